"""Python API: ``LLM(path_or_model).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import copy
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from zeal.inference.engine import EngineConfig, LLMEngine
from zeal.inference.outputs import RequestOutput
from zeal.inference.sampling_params import SamplingParams
from zeal.inference.tokenizer import Tokenizer
from zeal.utils.paths import cache_dir


def resolve_model_path(path: str | os.PathLike | None) -> Path:
    """A HF folder as is; a ``.gguf`` file converted once to a folder under the cache;
    None: the embedded default model (SmolLM2-135M-Instruct)."""
    from zeal.models.hf import convert_gguf, default_model_path

    if path is None:
        return default_model_path()
    p = Path(path).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        out = cache_dir() / f"{p.stem}-{p.stat().st_size}"
        if not (out / "model.safetensors").exists():
            convert_gguf(p, out)
        return out
    if not (p / "config.json").exists():
        raise FileNotFoundError(f"{p} is neither a model folder (config.json + safetensors) nor a .gguf file")
    return p


@dataclass(frozen=True)
class WeightsOffload:
    """ZeRO-Inference: where the decoder layers live (``none``: resident; ``disk``: layer
    files read on every pass; ``cpu``: pinned host memory copied to an accelerator), the
    resident-weights budget in GiB, the folder of the layer files (None: the cache), and
    the storage of the streamed 2-d weights (``quant``: ``none``, ``int8`` or ``int4``,
    group-wise with bf16 scales; :mod:`zeal.inference.weight_quant`)."""

    kind: str = "none"
    max_resident_gb: float | None = None
    offload_dir: str | None = None
    quant: str = "none"

    def __post_init__(self) -> None:
        from zeal.inference.weight_quant import check_quant

        check_quant(self.quant)
        if self.quant != "none" and self.kind == "none":
            raise ValueError(f"weights_offload_quant {self.quant!r} needs weights_offload 'disk' or 'cpu' "
                             "(it sets how the streamed layers are stored)")


def torch_dtype(dtype: torch.dtype | str, device: str = "cpu") -> torch.dtype:
    """A torch dtype, or its name as vLLM users write it (``"bfloat16"``, ``"bf16"``, ``"float32"``,
    ``"auto"``: bf16 where the hardware computes it natively); ``ValueError`` for any other."""
    if isinstance(dtype, torch.dtype):
        return dtype
    from zeal.config.inference import DTYPE_NAMES, resolve_dtype

    if not isinstance(dtype, str) or dtype.lower() not in DTYPE_NAMES:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(DTYPE_NAMES)} or a torch.dtype")
    return getattr(torch, resolve_dtype(dtype.lower(), device))


def load_model_and_tokenizer(path: str | os.PathLike | None, dtype: torch.dtype = torch.float32,
                             device: str | torch.device = "cpu", offload: WeightsOffload | None = None,
                             quantized_matmul: str = "off") -> tuple[nn.Module, Tokenizer | None, list[int]]:
    """The model (its decoder layers streamed when ``offload`` says so: the streamer is
    ``model.weight_streamer``), its tokenizer and end-of-sequence ids. ``quantized_matmul``
    ``"auto"`` (bf16) or ``"int8"`` (bf16 and fp32): a compressed-tensors folder's int8 per-channel
    linears compute with int8 weight-only matmuls (:mod:`zeal.inference.quant_linear`) instead of being dequantized."""
    from zeal.models.hf import load_hf_model

    p = resolve_model_path(path)
    if offload is not None and offload.kind != "none":
        from zeal.inference.weight_stream import load_streamed_model

        if offload.max_resident_gb is None:
            raise ValueError(f"weights_offload {offload.kind!r} needs max_resident_weights_gb")
        model, cfg, streamer = load_streamed_model(p, dtype, device, offload.kind,
                                                   int(offload.max_resident_gb * (1 << 30)), offload.offload_dir,
                                                   offload.quant)
        model.weight_streamer = streamer
    else:
        model, cfg = load_hf_model(p, dtype)
        model = model.to(device)
        if _check_quantized_matmul(quantized_matmul) != "off":
            from zeal.inference.quant_linear import apply_quantized_matmuls

            apply_quantized_matmuls(model, p, cfg, quantized_matmul)
    eos = cfg.get("eos_token_id")
    eos_ids = [e for e in (eos if isinstance(eos, list) else [eos]) if e is not None]
    return model, Tokenizer.from_folder(p), eos_ids


def _check_quantized_matmul(mode: str) -> str:
    from zeal.inference.quant_linear import QUANTIZED_MATMUL_MODES

    if mode not in QUANTIZED_MATMUL_MODES:
        raise ValueError(f"quantized_matmul must be one of {', '.join(QUANTIZED_MATMUL_MODES)}, got {mode!r}")
    return mode


def _draft_instance(engine_kwargs: dict) -> nn.Module | None:
    """``speculative_config={"method": "draft_model", "model": <nn.Module>}``: take the
    instance out (the config names it instead) and return it; None otherwise."""
    spec = engine_kwargs.get("speculative_config")
    if not isinstance(spec, dict) or not isinstance(spec.get("model"), nn.Module):
        return None
    draft = spec["model"]
    engine_kwargs["speculative_config"] = {**spec, "model": f"<{type(draft).__name__} instance>"}
    return draft


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """A tokenizer from a folder (``tokenizer.json`` and, if present, ``tokenizer_config.json``)
    or a ``tokenizer.json`` file; raises FileNotFoundError when there is none."""
    p = Path(path).expanduser()
    tok = Tokenizer.from_file(p) if p.is_file() else Tokenizer.from_folder(p) if p.is_dir() else None
    if tok is None:
        raise FileNotFoundError(f"tokenizer {p}: neither a tokenizer.json file nor a folder holding one")
    return tok


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
        dtype = torch_dtype(dtype, str(device))
        qmm = _check_quantized_matmul(quantized_matmul)
        if qmm != "off" and (tensor_parallel_size != 1 or weights_offload != "none"):
            raise ValueError(f"quantized_matmul {quantized_matmul!r} serves a resident, unsplit model: not with "
                             "tensor_parallel_size > 1 or weights_offload")
        offload = WeightsOffload(weights_offload, max_resident_weights_gb, offload_dir, weights_offload_quant)
        self.tp = None
        self.is_driver = True
        if tensor_parallel_size != 1:
            self._init_tensor_parallel(model, tokenizer, dtype, device, eos_token_ids, weights_offload,
                                       tensor_parallel_size, engine_kwargs)
            return
        draft = _draft_instance(engine_kwargs)
        if isinstance(model, nn.Module):
            if weights_offload != "none":
                raise ValueError("weights_offload needs a model folder (its layers are streamed from files)")
            module, tok, eos = model.eval(), None, list(eos_token_ids or [])
        else:
            module, tok, eos = load_model_and_tokenizer(model, dtype, device, offload, quantized_matmul)
            eos += list(eos_token_ids or [])
        if tokenizer is not None:  # the caller's tokenizer replaces the model folder's
            tok = tokenizer if isinstance(tokenizer, Tokenizer) else load_tokenizer(tokenizer)
        self.engine = LLMEngine(module, tok, EngineConfig(**engine_kwargs), eos, draft_model=draft)
        self.tokenizer = tok

    def _init_tensor_parallel(self, model, tokenizer, dtype, device, eos_token_ids, weights_offload: str,
                              size: int, engine_kwargs: dict) -> None:
        from zeal.inference import tensor_parallel as tpmod

        if weights_offload != "none":
            raise ValueError(f"weights_offload {weights_offload!r} is not supported with tensor_parallel_size {size}")
        if isinstance(model, nn.Module):
            if not tpmod.in_launched_job():
                raise ValueError(f"LLM(model instance, tensor_parallel_size={size}) needs its {size} ranks launched "
                                 "already (torchrun, one LLM per rank); pass a model folder to let zeal start them")
            tpmod.check_tp_size(model, size)
            module, tok, eos = copy.deepcopy(model).eval(), None, list(eos_token_ids or [])
            self.tp = tpmod.join_tensor_parallel(size)
            self.tp.shard(module)
        else:
            module, tok, eos, self.tp = tpmod.load_split(model, size, dtype, str(device))
            eos += list(eos_token_ids or [])
        if tokenizer is not None:
            tok = tokenizer if isinstance(tokenizer, Tokenizer) else load_tokenizer(tokenizer)
        self.tokenizer = tok
        if not self.tp.is_driver:  # ranks 1..T-1: follow rank 0's passes until it shuts the group down
            self.is_driver, self.engine = False, None
            self.tp.serve(module)
            return
        try:
            self.engine = LLMEngine(module, tok, EngineConfig(**engine_kwargs), eos, tp=self.tp)
        except BaseException:
            self.tp.shutdown()
            raise

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
