"""DeepSpeed's hybrid engine (``"hybrid_engine": {"enabled": true}``) on zeal: what
``deepspeed.initialize`` returns for an RLHF actor such as DeepSpeed-Chat's step 3.

The engine trains as :class:`~zeal.deepspeed.engine.DeepSpeedEngine` does and generates
with :meth:`DeepSpeedHybridEngine.generate`, which it also installs as the model's own
``generate`` (DeepSpeed-Chat calls ``engine.module.generate``). A generation runs in
eval mode without gradients; at ZeRO-3 the whole model is gathered once for it (zeal's
``gathered_parameters``: one all-gather per flat unit, released at the end), as
DeepSpeed's hybrid engine does with ``gather_all_layers``. Tokens come from the model's
own ``generate`` (Hugging Face's decoding loop and KV cache), the path DeepSpeed 0.19.8
takes for a model it has no inference policy for; where it has one (OPT, Llama) it swaps
in its CUDA inference kernels, which have no CPU implementation ("This op had not been
implemented on CPU backend": DeepSpeed-Chat's step 3 with the hybrid engine does not run
on DeepSpeed's CPU accelerator, and runs on zeal's).

The section's settings are validated as DeepSpeed's ``HybridEngineConfig``;
``inference_tp_size > 1`` (tensor-parallel generation) is refused."""

from __future__ import annotations

import time
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field

from zeal.deepspeed.engine import DeepSpeedEngine
from zeal.deepspeed.refusals import Refused


class HybridEngineSettings(BaseModel):
    """DeepSpeed's ``hybrid_engine`` section (``HybridEngineConfig``)."""

    model_config = ConfigDict(extra="forbid")
    enabled: bool = Field(False, description="return the hybrid engine from initialize")
    max_out_tokens: int = Field(512, gt=0, description="DeepSpeed's inference workspace size (no effect here)")
    inference_tp_size: int = Field(1, ge=1, description="tensor-parallel ranks for generation (only 1)")
    release_inference_cache: bool = Field(False, description="free the KV cache after each generate "
                                          "(Hugging Face's cache is freed anyway)")
    pin_parameters: bool = Field(True, description="DeepSpeed's pinned gather buffers (no effect here)")
    tp_gather_partition_size: int = Field(8, gt=0, description="layers gathered at a time for TP generation")
    enable_cuda_graph: bool = Field(False, description="CUDA graphs for decoding (no effect here)")


def split_hybrid(config: Any) -> tuple[Any, HybridEngineSettings | None]:
    """``(config without its hybrid_engine section, the section)`` for a dict config whose
    section is enabled; ``(config, None)`` otherwise (a disabled section is left for the
    config translator, which drops it)."""
    if not isinstance(config, dict) or not isinstance(config.get("hybrid_engine"), dict):
        return config, None
    settings = HybridEngineSettings(**config["hybrid_engine"])
    if not settings.enabled:
        return config, None
    if settings.inference_tp_size > 1:
        raise Refused("hybrid_engine.inference_tp_size > 1", "zeal's hybrid engine generates on each "
                      "data-parallel rank with the whole model (inference_tp_size 1)")
    return {k: v for k, v in config.items() if k != "hybrid_engine"}, settings


class DeepSpeedHybridEngine(DeepSpeedEngine):
    """The training engine plus :meth:`generate`; ``module.generate`` is routed to it."""

    def __init__(self, engine: Any, settings: HybridEngineSettings) -> None:
        super().__init__(engine)
        object.__setattr__(self, "hybrid_settings", settings)
        self._generate = self.module.generate  # the model's own decoding loop
        self.module.generate = self.generate   # as DeepSpeed's hybrid engine: scripts call module.generate
        self._generate_latency = 0.0
        self._gather_latency = 0.0
        self._total_batch_size: int | None = None

    def generate(self, *inputs: Any, **kwargs: Any) -> Any:
        """The model's ``generate(*inputs, **kwargs)`` in eval mode under ``torch.no_grad``
        (the caller's mode is restored), every parameter whole (gathered once at ZeRO-3;
        every rank calls it then)."""
        if self._total_batch_size is None:
            first = inputs[0] if inputs else kwargs.get("input_ids")
            if isinstance(first, torch.Tensor):
                self._total_batch_size = first.shape[0] * self.engine.mesh.dp_size
        start = time.perf_counter()
        was_training = self.module.training
        self.module.eval()
        try:
            with torch.no_grad(), self.engine.gathered_parameters():
                self._gather_latency = time.perf_counter() - start
                out = self._generate(*inputs, **kwargs)
        finally:
            self.module.train(was_training)
        self._generate_latency = time.perf_counter() - start - self._gather_latency
        return out
