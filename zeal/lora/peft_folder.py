"""PEFT LoRA adapter folders: ``adapter_config.json`` + ``adapter_model.safetensors``.

The format ``peft`` writes with ``PeftModel.save_pretrained`` and reads with
``PeftModel.from_pretrained`` (and what vLLM's ``--lora-modules`` serves):

* ``adapter_config.json``: ``peft_type`` ``"LORA"``, ``r``, ``lora_alpha``,
  ``target_modules`` (a list of module-name suffixes, or one string matched as a full
  regex against the whole module path; ``"all-linear"`` before it is resolved),
  ``modules_to_save``, ``use_rslora`` (scale ``alpha / sqrt(r)`` instead of
  ``alpha / r``), ``rank_pattern`` / ``alpha_pattern`` (per-module overrides keyed by
  a name suffix), ``fan_in_fan_out`` (GPT-2's ``Conv1D`` weights are ``(in, out)``),
  ``bias`` (``"none"``, ``"all"``, ``"lora_only"``), ``lora_dropout`` ...
* ``adapter_model.safetensors``: for each adapted linear ``W (out, in)`` at module path
  ``P``: ``base_model.model.P.lora_A.weight (r, in)`` and
  ``base_model.model.P.lora_B.weight (out, r)``; the layer computes
  ``W x + scaling * B (A x)``. A ``modules_to_save`` module ``M`` is stored whole under
  ``base_model.model.M.<its parameter names>``; trained biases (``bias != "none"``)
  under ``base_model.model.P.bias``.

zeal's Llama and GPT use Hugging Face's module names, so a PEFT module path is a
zeal module name. Only JSON and safetensors are read; a pickled
``adapter_model.bin`` is refused.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

__all__ = [
    "ALL_LINEAR",
    "CONFIG_NAME",
    "PREFIX",
    "WEIGHTS_NAME",
    "LoraPair",
    "PeftAdapter",
    "PeftLoraConfig",
    "match_modules_to_save",
    "match_target_modules",
    "peft_key",
    "read_adapter",
    "read_adapter_config",
    "read_adapter_tensors",
    "split_adapter_tensors",
    "write_adapter",
]

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
PREFIX = "base_model.model."
ALL_LINEAR = "all-linear"

_SUPPORTED_INITS = (True, False, "gaussian")
_REFUSED_FLAGS = ("use_dora", "lora_bias", "use_qalora", "use_bdlora")


def _pattern_key(keys: Iterable[str], name: str) -> str | None:
    """The first ``rank_pattern``/``alpha_pattern`` key that is a suffix of ``name``
    (PEFT's rule: ``(.*\\.)?key$`` as a regex)."""
    for key in keys:
        if re.match(rf"(.*\.)?({key})$", name):
            return key
    return None


@dataclass
class PeftLoraConfig:
    """The fields of a PEFT ``LoraConfig`` zeal uses (the others are kept in ``extra``
    and written back unchanged).

    ``target_modules``: a list of names (a module matches when its path equals one or
    ends with ``"." + name``), a string (a regex that must match the whole path), or
    ``"all-linear"`` (every linear but the output head). ``layers_to_transform`` limits
    list matches to those layer indices (``layers_pattern`` names the layer list)."""

    r: int = 8
    lora_alpha: float = 8
    target_modules: list[str] | str | None = None
    exclude_modules: list[str] | str | None = None
    modules_to_save: list[str] | None = None
    lora_dropout: float = 0.0
    use_rslora: bool = False
    fan_in_fan_out: bool = False
    bias: str = "none"
    init_lora_weights: bool | str = True
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    layers_to_transform: list[int] | int | None = None
    layers_pattern: list[str] | str | None = None
    base_model_name_or_path: str | None = None
    task_type: str | None = "CAUSAL_LM"
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.r, int) or self.r <= 0:
            raise ValueError(f"LoRA r must be a positive integer, got {self.r!r}")
        if self.bias not in ("none", "all", "lora_only"):
            raise ValueError(f"LoRA bias must be 'none', 'all' or 'lora_only', got {self.bias!r}")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {self.lora_dropout!r}")
        if self.init_lora_weights not in _SUPPORTED_INITS:
            raise ValueError(f"LoRA init_lora_weights {self.init_lora_weights!r} is not supported "
                             f"(supported: true (PEFT's default), false (B random too: tests), 'gaussian')")
        for k in _REFUSED_FLAGS:
            if self.extra.get(k):
                raise ValueError(f"PEFT LoRA option {k}=true is not supported by zeal")
        if self.target_modules is None and not self.modules_to_save:
            raise ValueError("LoRA target_modules is empty: name the modules to adapt (e.g. q_proj,v_proj or all-linear)")
        if isinstance(self.target_modules, list):
            self.target_modules = [str(t) for t in self.target_modules]
        if isinstance(self.target_modules, str):
            try:
                re.compile(self.target_modules)
            except re.error as e:
                raise ValueError(f"LoRA target_modules regex {self.target_modules!r} is invalid: {e}") from None

    # ---- per-module rank and scale -------------------------------------------------
    def rank_for(self, module: str) -> int:
        """The rank of the adapter on ``module`` (``rank_pattern`` overrides ``r``)."""
        key = _pattern_key(self.rank_pattern, module)
        return int(self.rank_pattern[key]) if key is not None else self.r

    def alpha_for(self, module: str) -> float:
        """``lora_alpha`` of ``module`` (``alpha_pattern`` overrides it)."""
        key = _pattern_key(self.alpha_pattern, module)
        return float(self.alpha_pattern[key]) if key is not None else float(self.lora_alpha)

    def scaling_for(self, module: str) -> float:
        """The factor on ``B A x``: ``alpha / r``, or ``alpha / sqrt(r)`` with ``use_rslora``."""
        r = self.rank_for(module)
        return self.alpha_for(module) / (math.sqrt(r) if self.use_rslora else r)

    # ---- JSON ----------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict, source: str = "adapter_config.json") -> PeftLoraConfig:
        """From an ``adapter_config.json`` dict; refuses other PEFT types in one line."""
        if not isinstance(d, dict):
            raise ValueError(f"{source}: expected a JSON object")
        ptype = d.get("peft_type", "LORA")
        if str(ptype).upper() != "LORA":
            raise ValueError(f"{source}: peft_type {ptype!r} is not LORA (zeal reads LoRA adapters only)")
        known = {f for f in cls.__dataclass_fields__ if f != "extra"}
        kwargs = {k: d[k] for k in known if k in d and d[k] is not None}
        for k in ("rank_pattern", "alpha_pattern"):
            kwargs[k] = dict(d.get(k) or {})
        if "r" in kwargs and not isinstance(kwargs["r"], int):
            raise ValueError(f"{source}: r must be an integer, got {kwargs['r']!r}")
        if isinstance(kwargs.get("target_modules"), (set, tuple)):
            kwargs["target_modules"] = list(kwargs["target_modules"])
        extra = {k: v for k, v in d.items() if k not in known}
        try:
            return cls(**kwargs, extra=extra)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{source}: {e}") from None

    def to_dict(self) -> dict:
        """The ``adapter_config.json`` dict PEFT reads (unknown keys carried through)."""
        d = dict(self.extra)
        d.update(
            peft_type="LORA", r=self.r, lora_alpha=self.lora_alpha,
            target_modules=(sorted(self.target_modules) if isinstance(self.target_modules, list)
                            else self.target_modules),
            exclude_modules=self.exclude_modules, modules_to_save=self.modules_to_save,
            lora_dropout=self.lora_dropout, use_rslora=self.use_rslora, fan_in_fan_out=self.fan_in_fan_out,
            bias=self.bias, init_lora_weights=self.init_lora_weights, rank_pattern=self.rank_pattern,
            alpha_pattern=self.alpha_pattern, layers_to_transform=self.layers_to_transform,
            layers_pattern=self.layers_pattern, base_model_name_or_path=self.base_model_name_or_path,
            task_type=self.task_type,
        )
        d.setdefault("inference_mode", True)
        for k in ("use_dora", "lora_bias"):
            d.setdefault(k, False)
        return d


@dataclass
class LoraPair:
    """One adapted linear's low-rank factors: ``A (r, in)``, ``B (out, r)`` and ``scaling``."""

    A: torch.Tensor
    B: torch.Tensor
    scaling: float

    @property
    def rank(self) -> int:
        return self.A.shape[0]

    def delta(self) -> torch.Tensor:
        """``scaling * B @ A`` ``(out, in)``, in fp32 (what merging adds to ``W``)."""
        return (self.B.float() @ self.A.float()) * self.scaling


@dataclass
class PeftAdapter:
    """A PEFT adapter read from (or to be written to) a folder: its config, the LoRA
    pairs by module path, and the other tensors (``modules_to_save`` parameters,
    trained biases) by parameter name, both without the ``base_model.model.`` prefix."""

    config: PeftLoraConfig
    lora: dict[str, LoraPair]
    saved: dict[str, torch.Tensor] = field(default_factory=dict)

    def module_names(self) -> list[str]:
        """The adapted modules' paths, sorted."""
        return sorted(self.lora)


def peft_key(module: str, kind: str) -> str:
    """The file key of ``module``'s tensor ``kind`` (``"lora_A"``, ``"lora_B"``, or a
    parameter name such as ``"weight"`` for a saved module)."""
    suffix = f"{kind}.weight" if kind in ("lora_A", "lora_B") else kind
    return f"{PREFIX}{module}.{suffix}"


# ---- reading -------------------------------------------------------------------------
def _folder(path: str | os.PathLike) -> Path:
    p = Path(path)
    if not p.is_dir():
        raise FileNotFoundError(f"PEFT adapter folder {p} does not exist (or is not a folder)")
    return p


def read_adapter_config(path: str | os.PathLike) -> PeftLoraConfig:
    """The ``adapter_config.json`` of folder ``path``; one-line errors for a missing or bad file."""
    f = _folder(path) / CONFIG_NAME
    if not f.is_file():
        raise FileNotFoundError(f"{f} is missing: not a PEFT adapter folder")
    try:
        d = json.loads(f.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{f} is not valid JSON: {e}") from None
    return PeftLoraConfig.from_dict(d, str(f))


def read_adapter_tensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """All tensors of ``adapter_model.safetensors`` in folder ``path``, keys as stored."""
    p = _folder(path)
    f = p / WEIGHTS_NAME
    if not f.is_file():
        if (p / "adapter_model.bin").is_file():
            raise ValueError(f"{p} holds adapter_model.bin (a pickle); zeal reads adapter_model.safetensors only "
                             "(convert it with peft: PeftModel.from_pretrained(...).save_pretrained(..., "
                             "safe_serialization=True))")
        raise FileNotFoundError(f"{f} is missing: not a PEFT adapter folder")
    try:
        with safe_open(str(f), framework="pt") as fh:
            return {k: fh.get_tensor(k) for k in fh.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    except Exception as e:  # safetensors raises its own error types for a corrupt header
        raise ValueError(f"{f} is not a readable safetensors file: {e}") from None


_LORA_KEY = re.compile(r"^(?P<module>.+)\.(?P<kind>lora_A|lora_B)(?:\.(?P<adapter>[^.]+))?\.weight$")


def split_adapter_tensors(tensors: dict[str, torch.Tensor], config: PeftLoraConfig,
                          source: str = "adapter") -> PeftAdapter:
    """Group a file's tensors into :class:`LoraPair` per module and the saved rest.
    Keys may carry PEFT's ``base_model.model.`` prefix or not (transformers' own PEFT
    integration writes them without); an adapter name segment (``lora_A.default.weight``)
    is accepted."""
    a: dict[str, torch.Tensor] = {}
    b: dict[str, torch.Tensor] = {}
    saved: dict[str, torch.Tensor] = {}
    for key, t in tensors.items():
        name = key.removeprefix(PREFIX)
        if "lora_embedding_" in name or "lora_magnitude_vector" in name:
            raise ValueError(f"{source}: tensor {key} (LoRA on embeddings or DoRA) is not supported by zeal")
        m = _LORA_KEY.match(name)
        if m is None:
            saved[name] = t
            continue
        if t.dim() != 2:
            raise ValueError(f"{source}: {key} has shape {tuple(t.shape)}; zeal adapts linear layers only")
        (a if m["kind"] == "lora_A" else b)[m["module"]] = t
    if set(a) != set(b):
        odd = sorted(set(a) ^ set(b))[0]
        raise ValueError(f"{source}: module {odd} has only one of lora_A / lora_B")
    lora: dict[str, LoraPair] = {}
    for mod in a:
        if a[mod].shape[0] != b[mod].shape[1]:
            raise ValueError(f"{source}: {mod} lora_A {tuple(a[mod].shape)} and lora_B {tuple(b[mod].shape)} "
                             "disagree on the rank")
        if a[mod].shape[0] != config.rank_for(mod):
            raise ValueError(f"{source}: {mod} has rank {a[mod].shape[0]} but the config says "
                             f"{config.rank_for(mod)} (r / rank_pattern)")
        lora[mod] = LoraPair(a[mod], b[mod], config.scaling_for(mod))
    return PeftAdapter(config, lora, saved)


def read_adapter(path: str | os.PathLike) -> PeftAdapter:
    """Config and tensors of the PEFT adapter folder ``path``."""
    config = read_adapter_config(path)
    return split_adapter_tensors(read_adapter_tensors(path), config, str(path))


# ---- writing -------------------------------------------------------------------------
def write_adapter(path: str | os.PathLike, adapter: PeftAdapter) -> Path:
    """Write ``adapter`` as a PEFT folder (``PeftModel.from_pretrained`` loads it). The
    tensors are written contiguous, on CPU, in their dtype; the folder is created."""
    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for mod, pair in adapter.lora.items():
        tensors[peft_key(mod, "lora_A")] = pair.A.detach().to("cpu").contiguous()
        tensors[peft_key(mod, "lora_B")] = pair.B.detach().to("cpu").contiguous()
    for name, t in adapter.saved.items():
        tensors[PREFIX + name] = t.detach().to("cpu").contiguous()
    save_file(tensors, str(p / WEIGHTS_NAME), metadata={"format": "pt"})
    (p / CONFIG_NAME).write_text(json.dumps(adapter.config.to_dict(), indent=2, sort_keys=True) + "\n")
    return p


# ---- matching module paths ----------------------------------------------------------
def _layer_index(config: PeftLoraConfig, name: str) -> int | None:
    patterns = config.layers_pattern
    if not patterns:
        m = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", name)
        return int(m["idx"]) if m else None
    for pat in [patterns] if isinstance(patterns, str) else patterns:
        m = re.match(rf"(?:^|.*?\.){pat}\.(?P<idx>\d+)\.", name)
        if m:
            return int(m["idx"])
    return None


def _in_list(name: str, names: Iterable[str]) -> bool:
    return any(name == n or name.endswith("." + n) for n in names)


def _saved_match(name: str, modules_to_save: Iterable[str]) -> bool:
    return any(re.match(rf"(^|.*\.){m}($|\..*)", name) for m in modules_to_save)


def _targets(config: PeftLoraConfig, name: str, linear: set[str], head: set[str]) -> bool:
    excl = config.exclude_modules
    if excl and (re.fullmatch(excl, name) if isinstance(excl, str) else _in_list(name, excl)):
        return False
    if config.modules_to_save and _saved_match(name, config.modules_to_save):
        return False
    tm = config.target_modules
    if tm is None:
        return False
    if isinstance(tm, str):
        if tm.lower() == ALL_LINEAR:
            return name in linear and name not in head
        return re.fullmatch(tm, name) is not None
    if not _in_list(name, tm):
        return False
    lt = config.layers_to_transform
    if lt is None or (isinstance(lt, list) and not lt):
        return True
    idx = _layer_index(config, name)
    return idx is not None and (idx == lt if isinstance(lt, int) else idx in lt)


def match_target_modules(config: PeftLoraConfig, module_names: Iterable[str],
                         linear_names: Iterable[str] | None = None,
                         head_names: Iterable[str] = ("lm_head",)) -> list[str]:
    """The module paths among ``module_names`` that ``config.target_modules`` adapts,
    in PEFT's rules (see :class:`PeftLoraConfig`; ``exclude_modules`` and
    ``modules_to_save`` never match). ``linear_names`` (the linear layers' paths)
    resolves ``"all-linear"``, which leaves out ``head_names`` (the output head)."""
    names = list(module_names)
    linear = set(names if linear_names is None else linear_names)
    return [n for n in names if n and _targets(config, n, linear, set(head_names))]


def match_modules_to_save(config: PeftLoraConfig, module_names: Iterable[str]) -> list[str]:
    """The outermost module paths that ``config.modules_to_save`` names (a module matches
    when its path equals a name or ends with ``"." + name``)."""
    out: list[str] = []
    for n in module_names:
        if n and config.modules_to_save and _in_list(n, config.modules_to_save):
            if not any(n.startswith(o + ".") for o in out):
                out.append(n)
    return out
