"""Loading what a serving engine runs: the model folder (or ``.gguf`` file, or the
default model), its tokenizer and end-of-sequence ids, in the dtype and device asked for,
its decoder layers streamed (ZeRO-Inference) or its int8 linears kept as codes when the
config says so. :func:`zeal.inference.build.build_engine` loads through here, and so do the
tensor-parallel ranks, the draft model of speculative decoding and the RLHF jobs; it builds
no engine (so the engine's own collaborators can load a model without reaching up)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from zeal.inference.tokenizer import Tokenizer
from zeal.utils.paths import cache_dir

__all__ = ["WeightsOffload", "load_model_and_tokenizer", "load_tokenizer", "resolve_model_path", "torch_dtype"]


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
        from zeal.config.inference import check_weights_offload
        from zeal.inference.weight_quant import check_quant

        check_quant(self.quant)
        check_weights_offload(self.kind, self.max_resident_gb, self.quant)


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

        model, cfg, streamer = load_streamed_model(p, dtype, device, offload.kind,
                                                   int(offload.max_resident_gb * (1 << 30)), offload.offload_dir,
                                                   offload.quant)
        model.weight_streamer = streamer
    else:
        from zeal.compression.export import decompress_state  # compressed-tensors folders dequantized on load

        model, cfg = load_hf_model(p, dtype, state_transform=decompress_state)
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


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """A tokenizer from a folder (``tokenizer.json`` and, if present, ``tokenizer_config.json``)
    or a ``tokenizer.json`` file; raises FileNotFoundError when there is none."""
    p = Path(path).expanduser()
    tok = Tokenizer.from_file(p) if p.is_file() else Tokenizer.from_folder(p) if p.is_dir() else None
    if tok is None:
        raise FileNotFoundError(f"tokenizer {p}: neither a tokenizer.json file nor a folder holding one")
    return tok
