"""zeal's decoder models: plain single-device ``nn.Module`` code, one code path per
family for training and serving (see :mod:`zeal.models.attention`)."""

from zeal.models.attention import DenseCausalAttention
from zeal.models.gpt import GPT, GPTConfig
from zeal.models.llama import Llama, LlamaConfig

__all__ = ["GPT", "GPTConfig", "Llama", "LlamaConfig", "DenseCausalAttention"]
