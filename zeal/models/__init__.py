"""Reference decoder models: plain single-device ``nn.Module`` code."""

from zeal.models.gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
