"""A compressed model as a Hugging Face folder in the ``compressed-tensors`` format.

What vLLM and llm-compressor read: ``config.json`` gains a ``quantization_config`` with
``quant_method: compressed-tensors``, ``format: pack-quantized``, one config group per
(bits, group size) listing its layers as targets, and ``ignore`` for the linears left
in floating point. Each quantized linear ``L`` is stored as ``L.weight_packed`` (the
int codes densely packed into int32 by the ``compressed-tensors`` library),
``L.weight_scale`` (fp32, ``[out, 1]`` per channel or ``[out, in/group]`` per group) and
``L.weight_shape``; zeal's symmetric quantizer (:mod:`.quant`) gives the codes, so the
served weight ``q·scale`` is exactly the fake-quantized weight of training.

N:M sparsity is stored as values (the zeros written as zeros): the bitmask formats were
dropped by ``compressed-tensors`` 0.15 and by vLLM's loader, so no current reader would
take them. With quantization, ``quantization_config.sparsity_config`` records the pattern
(format ``dense``, ``sparsity_structure``, ``global_sparsity``) with no ``targets`` list
(every linear but its ``ignore``): vLLM 0.32 refuses any folder whose sparsity config
names targets ("Sparsity support has been removed from compressed-tensors"). Without
quantization the folder is a plain dense one with no ``quantization_config``, as
llm-compressor writes a sparse-only model: transformers 5.17 with compressed-tensors 0.19
fails on a compressed-tensors config that has no quantization group.

Needs the optional ``compressed-tensors`` package (``pip install zeal[compress]``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from zeal.compression.quant import dequantize, quantize

__all__ = ["decompress_state", "export_compressed", "is_compressed_config"]


def _ct():
    try:
        import compressed_tensors  # noqa: F401
        from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
    except ImportError:
        raise ImportError("the compressed-tensors format needs the package compressed-tensors: "
                          "pip install 'zeal[compress]'") from None
    return pack_to_int32, unpack_from_int32


def _scheme(layers: list[str], bits: int, group_size: int | None) -> dict:
    weights = {"num_bits": bits, "type": "int", "symmetric": True, "dynamic": False,
               "strategy": "group" if group_size else "channel", "group_size": group_size, "observer": "minmax"}
    return {"targets": layers, "weights": weights, "input_activations": None, "output_activations": None}


def export_compressed(folder: str | Path, quant: dict[str, tuple[int, int | None]],
                      sparse: dict[str, tuple[int, int]] | None = None, ignore: list[str] | None = None) -> Path:
    """Rewrite the dense HF folder ``folder`` (written by ``save_hf_folder``) in place:
    every linear named in ``quant`` (module name → (bits, group_size)) is packed, the
    config gets its ``quantization_config``. ``sparse`` (module → (n, m)) and ``ignore``
    (linears left in floating point) are recorded in it; with no ``quant`` the folder
    stays a plain dense one (see the module docstring)."""
    folder = Path(folder)
    if not quant:
        return folder
    pack_to_int32, _ = _ct()
    import compressed_tensors

    sd = load_file(str(folder / "model.safetensors"))
    groups: dict[tuple[int, int | None], list[str]] = {}
    for layer, (bits, group_size) in quant.items():
        w = sd.pop(f"{layer}.weight")
        q, scale = quantize(w, bits, group_size)
        sd[f"{layer}.weight_packed"] = pack_to_int32(q.contiguous(), bits)
        sd[f"{layer}.weight_scale"] = scale.contiguous()
        sd[f"{layer}.weight_shape"] = torch.tensor(list(w.shape), dtype=torch.int64)
        groups.setdefault((bits, group_size), []).append(layer)
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((folder / "config.json").read_text())
    qc = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
          "version": compressed_tensors.__version__, "ignore": sorted(ignore or []),
          "config_groups": {f"group_{i}": _scheme(["Linear"] if len(groups) == 1 else layers, b, g)
                            for i, ((b, g), layers) in enumerate(groups.items())}}
    if sparse:  # no "targets": every linear but "ignore" (vLLM refuses listed targets)
        structures = sorted({f"{n}:{m}" for n, m in sparse.values()})
        qc["sparsity_config"] = {"format": "dense", "sparsity_structure": ",".join(structures),
                                 "ignore": sorted(set(ignore or []) | (set(quant) - set(sparse))),
                                 "global_sparsity": _global_sparsity(sd, sparse)}
    cfg["quantization_config"] = qc
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    return folder


def _global_sparsity(sd: dict[str, torch.Tensor], sparse: dict[str, tuple[int, int]]) -> float:
    zeros = total = 0
    for layer, (n, m) in sparse.items():
        w = sd.get(f"{layer}.weight")
        numel = w.numel() if w is not None else int(torch.prod(sd[f"{layer}.weight_shape"]))
        zeros += numel * (m - n) // m
        total += numel
    return zeros / max(total, 1)


def is_compressed_config(cfg: dict) -> bool:
    return (cfg.get("quantization_config") or {}).get("quant_method") == "compressed-tensors"


def decompress_state(sd: dict[str, torch.Tensor], cfg: dict) -> dict[str, torch.Tensor]:
    """``sd`` with every ``L.weight_packed``/``weight_scale``/``weight_shape`` triple
    replaced by the dequantized ``L.weight`` (fp32). Symmetric int pack-quantized only.
    ``sd`` as it is when ``cfg`` is not a compressed-tensors config (so it serves as
    :func:`zeal.models.hf.load_hf_model`'s ``state_transform`` for any folder)."""
    if not is_compressed_config(cfg):
        return sd
    qc = cfg["quantization_config"]
    fmt = qc.get("format")
    if fmt not in ("pack-quantized", "dense"):
        raise ValueError(f"compressed-tensors format {fmt!r} is not supported (supported: pack-quantized, dense)")
    targets = []  # (target, bits): a layer name, "Linear" (every linear) or "re:<regex>"
    for name, group in (qc.get("config_groups") or {}).items():
        w = group.get("weights") or {}
        if w.get("type", "int") != "int" or not w.get("symmetric", True):
            raise ValueError(f"compressed-tensors group {name!r}: only symmetric int weights are supported")
        targets += [(t, int(w["num_bits"])) for t in group.get("targets", [])]
    _, unpack_from_int32 = _ct()
    out = dict(sd)
    for key in [k for k in sd if k.endswith(".weight_packed")]:
        layer = key.removesuffix(".weight_packed")
        bits = _bits_of(layer, targets)
        shape = torch.Size(out.pop(f"{layer}.weight_shape").tolist())
        q = unpack_from_int32(out.pop(key), bits, shape)
        scale = out.pop(f"{layer}.weight_scale").float()
        out[f"{layer}.weight"] = dequantize(q, scale, torch.float32)
    return out


def _bits_of(layer: str, targets: list[tuple[str, int]]) -> int:
    """The width of ``layer``'s group: an exact name first, then a regex, then "Linear"."""
    import re

    for match in (lambda t: t == layer, lambda t: t.startswith("re:") and re.match(t[3:], layer) is not None,
                  lambda t: t == "Linear"):
        for t, bits in targets:
            if match(t):
                return bits
    raise ValueError(f"{layer}: a packed weight that no compressed-tensors config group targets")
