"""Python API: ``LLM(path_or_model).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import torch
from pydantic import ValidationError
from torch import nn

from zeal.config import format_validation_error
from zeal.config.inference import DTYPE_NAMES, InferenceConfig
from zeal.inference.build import build_engine
from zeal.inference.engine import EngineConfig
from zeal.inference.loader import (  # noqa: F401 - re-exported: the loaders lived here
    WeightsOffload,
    _check_quantized_matmul,
    load_model_and_tokenizer,
    load_tokenizer,
    resolve_model_path,
    torch_dtype,
)
from zeal.inference.outputs import RequestOutput
from zeal.inference.sampling_params import SamplingParams
from zeal.inference.tokenizer import Tokenizer


def _draft_instance(engine_kwargs: dict) -> nn.Module | None:
    """``speculative_config={"method": "draft_model", "model": <nn.Module>}``: take the
    instance out (the config names it instead) and return it; None otherwise."""
    spec = engine_kwargs.get("speculative_config")
    if not isinstance(spec, dict) or not isinstance(spec.get("model"), nn.Module):
        return None
    draft = spec["model"]
    engine_kwargs["speculative_config"] = {**spec, "model": f"<{type(draft).__name__} instance>"}
    return draft


def inference_config(model: str | os.PathLike | None = None, dtype: torch.dtype | str = torch.float32,
                     device: str | torch.device = "cpu", **fields) -> InferenceConfig:
    """The :class:`InferenceConfig` of ``LLM(model, dtype=..., device=..., **fields)``: the
    one :func:`zeal.inference.build.build_engine` builds from (and ``zeal serve`` builds from
    its flags). A torch dtype becomes its name; a refused value or combination raises
    ``ValueError`` naming the field."""
    if isinstance(dtype, torch.dtype):
        name = str(dtype).removeprefix("torch.")
        if name not in DTYPE_NAMES:
            raise ValueError(f"dtype {dtype} is not one of {sorted(set(DTYPE_NAMES.values()) - {'auto'})}")
    else:
        torch_dtype(dtype)  # a name it does not know (or not a name): ValueError naming the accepted ones
        name = dtype.lower()
    try:
        return InferenceConfig(model=None if model is None else str(model), dtype=name, device=str(device),
                               **fields)
    except ValidationError as e:
        raise ValueError(format_validation_error(e)) from None


class LLM:
    """Offline generation with the serving engine.

    ``model`` is a folder, a ``.gguf`` file, None (the default model), or a model
    instance (``zeal.models.GPT`` or ``zeal.models.llama.Llama``) whose weights are
    used in place. ``tokenizer`` (a :class:`Tokenizer`, a folder or a ``tokenizer.json``
    file) replaces the model folder's own; its end-of-sequence ids stop generation too. Engine knobs (``block_size``, ``num_blocks``,
    ``max_num_batched_tokens``, ``max_num_seqs``, ``max_model_len``,
    ``enable_prefix_caching``, ``kv_cache_bytes``) are keyword arguments.
    ``weights_offload`` (``"disk"``, or ``"cpu"`` on an accelerator) with
    ``max_resident_weights_gb`` serves a model larger than that budget by streaming its
    decoder layers (ZeRO-Inference; :mod:`zeal.inference.weight_stream`);
    ``weights_offload_quant`` (``"int8"`` or ``"int4"``) stores the streamed layers' 2-d
    weights as group-wise codes with bf16 scales, reading about 2x / 4x fewer bytes a pass.
    ``quantized_matmul="auto"`` (bf16) or ``"int8"`` (bf16 and fp32) serves a compressed-tensors
    folder's int8 per-channel linears with int8 weight-only matmuls instead of dequantizing
    them (:mod:`zeal.inference.quant_linear`; serve-only: ``load_weights`` refuses such a model).

    ``speculative_config`` (vLLM's shape) turns on speculative decoding for greedy
    requests: ``{"method": "ngram", ...}`` (prompt lookup) or ``{"method": "draft_model",
    "model": PATH_OR_MODEL, "num_speculative_tokens": k}`` (a smaller model of the same
    tokenizer, a folder or an instance; :mod:`zeal.inference.draft_model`).

    ``tensor_parallel_size=T`` splits the model over ``T`` ranks
    (:mod:`zeal.inference.tensor_parallel`). In a plain process (a model folder or None)
    this process becomes rank 0 and starts the others; :meth:`shutdown` (or exit) stops
    them. In a launched job of ``T`` ranks (torchrun) every rank constructs its ``LLM``
    (a folder, or the same model instance, which is copied before it is split): rank 0's
    generates, the others' constructors serve rank 0's passes and return when rank 0
    calls :meth:`shutdown` (``is_driver`` is False there).
    """

    def __init__(self, model: str | os.PathLike | nn.Module | None = None, tokenizer: Tokenizer | str | None = None,
                 *, dtype: torch.dtype | str = torch.float32, device: str | torch.device = "cpu",
                 eos_token_ids: list[int] | None = None, weights_offload: str = "none",
                 max_resident_weights_gb: float | None = None, offload_dir: str | None = None,
                 weights_offload_quant: str = "none", tensor_parallel_size: int = 1, quantized_matmul: str = "off",
                 **engine_kwargs) -> None:
        draft = _draft_instance(engine_kwargs)
        cfg = inference_config(None if isinstance(model, nn.Module) else model, dtype, device,
                               weights_offload=weights_offload, max_resident_weights_gb=max_resident_weights_gb,
                               offload_dir=offload_dir, weights_offload_quant=weights_offload_quant,
                               tensor_parallel_size=tensor_parallel_size, quantized_matmul=quantized_matmul,
                               engine=EngineConfig(**engine_kwargs))
        if tokenizer is not None and not isinstance(tokenizer, Tokenizer):
            tokenizer = load_tokenizer(tokenizer)
        self.config = cfg  #: the InferenceConfig this LLM was built from (as zeal serve builds from its flags)
        self.engine = build_engine(cfg, model if isinstance(model, nn.Module) else None, tokenizer,
                                   eos_token_ids=eos_token_ids or (), draft_model=draft)
        self.is_driver = self.engine is not None  # False: a tensor-parallel rank 1..T-1 whose group has stopped
        self.tp = self.engine.tp if self.engine is not None else None
        self.tokenizer = self.engine.tokenizer if self.engine is not None else tokenizer

    def shutdown(self) -> None:
        """Tensor parallelism, rank 0: stop the other ranks (and the processes zeal started);
        also done at exit. A no-op in one process."""
        if self.tp is not None and self.is_driver:
            self.tp.shutdown()

    def _add(self, prompt, params: SamplingParams) -> str:
        if not self.is_driver:
            raise RuntimeError("this rank is a tensor-parallel worker: generate on rank 0")
        if self.tp is not None and self.tp.closed:
            raise RuntimeError("the tensor-parallel group was shut down")
        rid = uuid.uuid4().hex
        self.engine.add_request(rid, prompt, params)
        return rid

    def generate(self, prompts: str | list[str] | list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids) in one continuous batch; outputs in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        ids = []
        try:
            for p, sp in zip(prompts, plist):
                ids.append(self._add(p, sp))
            done: dict[str, RequestOutput] = {}
            while len(done) < len(ids):
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
        finally:
            for rid in ids:
                self.engine.abort(rid)
        return [done[r] for r in ids]

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield a :class:`RequestOutput` each time the request progresses (``delta_text`` holds the new text)."""
        rid = self._add(prompt, params or SamplingParams())
        try:
            while True:
                for out in self.engine.step():
                    if out.request_id == rid:
                        yield out
                        if out.finished:
                            return
        finally:
            self.engine.abort(rid)

    def chat(self, messages: list[dict], params: SamplingParams | None = None) -> RequestOutput:
        """One chat turn with the model's chat template."""
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer")
        return self.generate([self.tokenizer.encode_chat(messages)], params)[0]

    def load_weights(self, named_tensors) -> int:
        """Copy new weights into the model in place (see ``ModelRunner.load_weights``);
        allowed while asleep (the RLHF pattern: ``sleep()``, train, ``load_weights``, ``wake_up()``)."""
        if getattr(self.engine.runner.model, "weight_streamer", None) is not None:
            raise ValueError("load_weights: this model's layers are streamed from files (weights_offload); "
                             "load it without weights_offload to update weights in place")
        from zeal.inference.quant_linear import has_quantized_linears

        if has_quantized_linears(self.engine.runner.model):
            raise ValueError("load_weights: this model computes with int8 weight codes (quantized_matmul) "
                             "and is serve-only; load it with quantized_matmul='off' to update weights in place")
        return self.engine.load_weights(named_tensors)

    def sleep(self, level: int = 1) -> None:
        """Free the KV cache (level 1; weights on an accelerator go to host memory) or the KV
        cache and the weights (level 2) until :meth:`wake_up`; see :meth:`LLMEngine.sleep`."""
        self.engine.sleep(level)

    def wake_up(self) -> None:
        """Take back the memory :meth:`sleep` released."""
        self.engine.wake_up()

    def is_sleeping(self) -> bool:
        """Whether the engine's memory is released."""
        return self.engine.is_sleeping()


def generate_text(model_path: str | None, prompts: list[str], max_tokens: int = 64, temperature: float = 0.0,
                  top_p: float = 1.0, top_k: int = 0, seed: int | None = None, chat: bool = False,
                  **engine_kwargs) -> list[str]:
    """Helper for ``zeal generate``: load ``model_path`` (None: the default model) and
    return one completion text per prompt (``chat=True`` wraps each prompt as a user turn)."""
    llm = LLM(model_path, **engine_kwargs)
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    if chat:
        if llm.tokenizer is None:
            raise ValueError(f"{model_path} has no tokenizer")
        inputs = [llm.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in prompts]
    else:
        inputs = list(prompts)
    return [o.text for o in llm.generate(inputs, params)]
