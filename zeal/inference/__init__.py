"""FastGen-style serving: request -> scheduler -> block manager -> model runner -> sampler.

``LLM`` is the offline API; ``zeal serve`` (:mod:`zeal.inference.server`) the
OpenAI-compatible HTTP server.
"""

from zeal.inference.engine import EngineConfig, LLMEngine
from zeal.inference.llm import LLM, generate_text
from zeal.inference.outputs import CompletionOutput, RequestOutput
from zeal.inference.sampling_params import SamplingParams
from zeal.inference.sleep import EngineAsleepError

__all__ = ["LLM", "EngineConfig", "LLMEngine", "SamplingParams", "RequestOutput", "CompletionOutput", "EngineAsleepError",
           "generate_text"]
