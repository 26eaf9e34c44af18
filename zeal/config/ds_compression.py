"""DeepSpeed's ``compression_training`` section → zeal's ``compression`` section.

What maps (one group per method; DeepSpeed's module names are substrings of qualified
names, so ``"attention.self"`` becomes the pattern ``*attention.self*``):

* ``weight_quantization``: ``target_bits`` → ``bits``, ``start_bits`` and
  ``quantization_period`` (one bit less every period), ``schedule_offset`` →
  ``start_step``; symmetric, nearest rounding only. ``quantize_groups`` is accepted:
  zeal's scales are per output channel, finer than any group count of a whole matrix.
* ``activation_quantization``: ``bits`` 8, symmetric, dynamic range → ``activation_bits``.
* ``sparse_pruning`` with an N:M ``block_pattern`` and method ``l1``/``topk`` →
  magnitude N:M sparsity pruned at ``schedule_offset`` (a ``dense_ratio`` must be N/M).

Refused by name: ``row_pruning``, ``head_pruning``, ``channel_pruning``,
``layer_reduction``, unstructured or block (``4x1``) sparse pruning, ``snip_momentum``,
asymmetric quantization, stochastic rounding, static activation ranges, several groups
with different settings.
"""

from __future__ import annotations

from typing import Any

REFUSED = {
    "row_pruning": "row pruning", "head_pruning": "head pruning", "channel_pruning": "channel pruning",
    "layer_reduction": "layer reduction",
}
KEY = "compression_training"


def _enabled(sec: Any) -> bool:
    return isinstance(sec, dict) and bool((sec.get("shared_parameters") or {}).get("enabled", False))


def _groups(path: str, sec: dict) -> tuple[dict, list[str]]:
    """The one group's params and its modules as fnmatch patterns."""
    groups = sec.get("different_groups") or {}
    if not isinstance(groups, dict) or not groups:
        raise ValueError(f"config key '{path}.different_groups': give one group (params and modules)")
    params = [g.get("params", {}) for g in groups.values()]
    if any(p != params[0] for p in params):
        raise ValueError(f"config key '{path}.different_groups': zeal supports one setting per method; "
                         "groups with different params are not supported yet")
    modules = sorted({m for g in groups.values() for m in (g.get("modules") or ["*"])})
    return params[0], ["*" if m == "*" else f"*{m}*" for m in modules]


def _refuse_value(path: str, value: Any, allowed: tuple, what: str) -> None:
    if value is not None and value not in allowed:
        raise ValueError(f"config key '{path}': zeal does not support {what} ({value!r}) yet")


def translate_compression(cfg: dict[str, Any], notes: list[str]) -> None:
    """Replace ``cfg['compression_training']`` by the ``compression`` section (in place)."""
    ct = cfg.pop(KEY, None)
    if ct is None:
        return
    if not isinstance(ct, dict):
        raise ValueError(f"config key '{KEY}': must be a section")
    for key, what in REFUSED.items():
        if _enabled(ct.get(key)):
            raise ValueError(f"config key '{KEY}.{key}': zeal does not support {what} yet")
    out: dict[str, Any] = {}
    wq = ct.get("weight_quantization")
    if _enabled(wq):
        out["quantization"] = _weight_quant(f"{KEY}.weight_quantization", wq, notes)
    aq = ct.get("activation_quantization")
    if _enabled(aq):
        path = f"{KEY}.activation_quantization"
        shared = aq["shared_parameters"]
        _refuse_value(f"{path}.shared_parameters.quantization_type", shared.get("quantization_type"),
                      ("symmetric",), "asymmetric activation quantization")
        _refuse_value(f"{path}.shared_parameters.range_calibration", shared.get("range_calibration"),
                      ("dynamic",), "static activation ranges")
        params, _ = _groups(path, aq)
        _refuse_value(f"{path}.different_groups.params.bits", params.get("bits", 8), (8,), "activation bits but 8")
        out.setdefault("quantization", {"enabled": True})["activation_bits"] = 8
    sp = ct.get("sparse_pruning")
    if _enabled(sp):
        out["sparsity"] = _sparse(f"{KEY}.sparse_pruning", sp)
    if out:
        cfg["compression"] = {**out, **(cfg.get("compression") or {})}
        notes.append(f"'{KEY}' is translated to zeal's 'compression' section")


def _weight_quant(path: str, wq: dict, notes: list[str]) -> dict:
    shared = wq["shared_parameters"]
    _refuse_value(f"{path}.shared_parameters.quantization_type", shared.get("quantization_type"),
                  ("symmetric",), "asymmetric weight quantization")
    _refuse_value(f"{path}.shared_parameters.rounding", shared.get("rounding"), ("nearest",), "stochastic rounding")
    if shared.get("quantize_groups", 1) != 1:
        notes.append(f"'{path}.shared_parameters.quantize_groups': zeal quantizes per output channel")
    params, modules = _groups(path, wq)
    target = params.get("target_bits", 8)
    start = params.get("start_bits", target)
    if not isinstance(target, int) or not isinstance(start, int) or start < target:
        raise ValueError(f"config key '{path}.different_groups.params': start_bits must be >= target_bits (ints)")
    return {"enabled": True, "bits": target, "start_bits": start if start != target else None,
            "quantization_period": params.get("quantization_period", 1) or 1,
            "start_step": shared.get("schedule_offset", 0), "modules": modules}


def _sparse(path: str, sp: dict) -> dict:
    shared = sp["shared_parameters"]
    _refuse_value(f"{path}.shared_parameters.method", shared.get("method", "l1"), ("l1", "topk"),
                  "the sparse-pruning method")
    pattern = shared.get("block_pattern")
    if not isinstance(pattern, str) or ":" not in pattern:
        raise ValueError(f"config key '{path}.shared_parameters.block_pattern': zeal supports N:M patterns "
                         f"(for example '2:4'), not {pattern!r} (unstructured or block sparsity) yet")
    n, m = (int(x) for x in pattern.split(":"))
    params, modules = _groups(path, sp)
    ratio = params.get("dense_ratio")
    if ratio is not None and abs(float(ratio) - n / m) > 1e-9:
        raise ValueError(f"config key '{path}.different_groups.params.dense_ratio': {ratio} differs from the "
                         f"block pattern's density {n}/{m}")
    return {"enabled": True, "pattern": pattern, "method": "magnitude",
            "prune_step": shared.get("schedule_offset", 0), "modules": modules}
