"""DeepSpeed's ZeRO-3 "leaf module" marks (``set_z3_leaf_modules`` and friends), which
accelerate and MoE training scripts set on a model's expert blocks.

DeepSpeed stops placing its per-module fetch hooks below a leaf module, so a block whose
submodules run in a data-dependent order (MoE experts) is gathered whole. zeal's ZeRO-3
gathers by flat unit whatever order the submodules run in, so it needs no mark: these
functions set and read the same ``_z3_leaf`` flag DeepSpeed does, for scripts that query
it, and change nothing in how zeal trains."""

from __future__ import annotations

from torch import nn


def z3_leaf_module(model: nn.Module) -> bool:
    """Whether ``model`` is marked as a leaf module."""
    return bool(getattr(model, "_z3_leaf", False))


def z3_leaf_parameter(model: nn.Parameter) -> bool:
    """Whether the parameter belongs to a leaf module (DeepSpeed tags it ``ds_z3_leaf_module``)."""
    return hasattr(model, "ds_z3_leaf_module")


def get_z3_leaf_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` marked as leaves."""
    return [m for m in model.modules() if z3_leaf_module(m)]


def set_z3_leaf_module(model: nn.Module, flag: bool) -> None:
    """Mark (or unmark) one module."""
    model._z3_leaf = flag


def _matching(model: nn.Module, classes: list, flag: bool, raise_if_not_found: bool, verb: str) -> list[nn.Module]:
    names = {c if isinstance(c, str) else c.__name__ for c in classes}
    types = tuple(c for c in classes if isinstance(c, type))
    hits = [m for m in model.modules() if type(m).__name__ in names or (types and isinstance(m, types))]
    if not hits and raise_if_not_found:
        raise ValueError(f"{verb}_z3_leaf_modules: no module of class {sorted(names)} in the model")
    for m in hits:
        set_z3_leaf_module(m, flag)
    return hits


def set_z3_leaf_modules(model: nn.Module, leaf_module_classes: list, raise_if_not_found: bool = True) -> list[nn.Module]:
    """Mark every module whose class is in ``leaf_module_classes`` (types or class names)."""
    return _matching(model, leaf_module_classes, True, raise_if_not_found, "set")


def unset_z3_leaf_modules(model: nn.Module, leaf_module_classes: list,
                          raise_if_not_found: bool = True) -> list[nn.Module]:
    """Unmark every module whose class is in ``leaf_module_classes``."""
    return _matching(model, leaf_module_classes, False, raise_if_not_found, "unset")


def _by(model: nn.Module, keys: list[str], match: object, flag: bool,
        raise_if_not_found: bool) -> tuple[list[nn.Module], list[str]]:
    hits, missing = [], []
    named = list(model.named_modules())
    for key in keys:
        found = [m for n, m in named if match(n, key)]  # type: ignore[operator]
        if not found:
            missing.append(key)
        for m in found:
            set_z3_leaf_module(m, flag)
        hits += found
    if missing and raise_if_not_found:
        raise ValueError(f"no module named {missing[0]!r} in the model")
    return hits, missing


def set_z3_leaf_modules_by_name(model: nn.Module, module_names: list[str], flag: bool = True,
                                raise_if_not_found: bool = True) -> tuple[list[nn.Module], list[str]]:
    """Mark the modules of these qualified names; returns (marked, names not found)."""
    return _by(model, module_names, lambda n, k: n == k, flag, raise_if_not_found)


def set_z3_leaf_modules_by_suffix(model: nn.Module, module_name_suffixes: list[str], flag: bool = True,
                                  raise_if_not_found: bool = True) -> tuple[list[nn.Module], list[str]]:
    """Mark the modules whose qualified name ends with a suffix; returns (marked, suffixes not found)."""
    return _by(model, module_name_suffixes, lambda n, k: n.endswith(k), flag, raise_if_not_found)
