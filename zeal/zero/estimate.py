"""Memory planner: bytes per rank for every ZeRO stage and offload choice.

Pure functions of the model's shape, the world size and the precision; no torch.

Accounting (ZeRO paper, algorithms.md §1.1), Ψ parameters, N data-parallel ranks:

* mixed precision (bf16/fp16 compute, Adam): 16-bit params 2Ψ, 16-bit grads 2Ψ and
  optimizer state K·Ψ with K = 12 (fp32 master copy 4 + momentum 4 + variance 4;
  the master copy is counted as optimizer state). Per rank: stage 0 16Ψ,
  stage 1 4Ψ + 12Ψ/N, stage 2 2Ψ + 14Ψ/N, stage 3 16Ψ/N.
* fp32 training: params 4Ψ, grads 4Ψ, Adam 8Ψ (no separate master). Per rank:
  stage 0 16Ψ, stage 1 8Ψ + 8Ψ/N, stage 2 4Ψ + 12Ψ/N, stage 3 16Ψ/N.

Partitioning rounds each flat buffer up to a multiple of N (``ceil(Ψ/N)`` per rank).
On top of model states the planner adds, per rank, the stage-3 gather working set
(the largest layer held whole, current + prefetched) and activations (see
``activation_bytes``). "Device" is the accelerator, or host RAM when training on CPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

OFFLOADS = ("none", "cpu_optimizer", "nvme_optimizer", "cpu_params", "nvme_params")
"""Offload choices. ``cpu_params``/``nvme_params`` (stage 3 only) move the optimizer
state to the same tier as the parameters; ``nvme_optimizer`` is stage 3 only, as
in ZeRO-Infinity; ``cpu_optimizer`` (ZeRO-Offload) needs stage ≥ 1."""


@dataclass(frozen=True)
class ModelShape:
    """What the planner needs to know about a decoder model."""

    num_params: int
    n_layer: int
    hidden: int
    n_head: int
    vocab_size: int
    intermediate: int
    largest_layer_params: int
    mlp_tensors: int = 2  # saved MLP activations of size `intermediate`: 2 for GELU, 4 for gated (SwiGLU)
    name: str = "model"


@dataclass(frozen=True)
class StateBytes:
    """Per-rank bytes of model states."""

    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


@dataclass(frozen=True)
class Plan:
    """One (stage, offload) configuration and where its bytes live, per rank."""

    stage: int
    offload: str
    states: StateBytes
    gathered: int
    activations: int
    device: int
    cpu: int
    nvme: int
    notes: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"stage {self.stage}" + ("" if self.offload == "none" else f" + {self.offload.replace('_', ' ')}")

    def ds_config(self) -> dict:
        """The DeepSpeed/zeal ``zero_optimization`` section for this plan."""
        zo: dict = {"stage": self.stage}
        if self.offload in ("cpu_optimizer", "cpu_params"):
            zo["offload_optimizer"] = {"device": "cpu"}
        if self.offload in ("nvme_optimizer", "nvme_params"):
            zo["offload_optimizer"] = {"device": "nvme", "nvme_path": "/local_nvme"}
        if self.offload == "cpu_params":
            zo["offload_param"] = {"device": "cpu"}
        if self.offload == "nvme_params":
            zo["offload_param"] = {"device": "nvme", "nvme_path": "/local_nvme"}
        return {"zero_optimization": zo}


def shard(n: int, world_size: int) -> int:
    """Elements a rank holds of an ``n``-element buffer padded to a multiple of N."""
    return math.ceil(n / world_size)


def model_state_bytes(num_params: int, world_size: int, stage: int, mixed_precision: bool = True) -> StateBytes:
    """Per-rank bytes for params, grads and optimizer state (Adam) under ZeRO ``stage``.

    >>> model_state_bytes(1000, 4, 2).total   # 2Ψ + 14Ψ/N
    5500
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_optimization.stage must be 0, 1, 2 or 3, got {stage}")
    if world_size < 1:
        raise ValueError(f"world size must be >= 1, got {world_size}")
    p_bytes, g_bytes, o_bytes = (2, 2, 12) if mixed_precision else (4, 4, 8)
    part = shard(num_params, world_size)
    return StateBytes(
        params=p_bytes * (part if stage >= 3 else num_params),
        grads=g_bytes * (part if stage >= 2 else num_params),
        optimizer=o_bytes * (part if stage >= 1 else num_params),
    )


def activation_bytes(shape: ModelShape, micro_batch: int, seq_len: int, bytes_per_value: int = 2,
                     flash_attention: bool = True, checkpointing: bool = False) -> int:
    """Bytes of activations saved for backward in one micro-batch, per rank.

    Per transformer layer, counting the tensors autograd keeps (values, for a
    pre-LayerNorm block without dropout): LN inputs and outputs 4·sbh, q/k/v 3·sbh,
    attention output sbh, MLP ``mlp_tensors``·s·b·intermediate — 16·sbh for GPT-2 —
    plus a·s²·b attention probabilities when the attention is not fused (flash).
    The LM head adds logits in the compute dtype plus an fp32 copy and an fp32
    log-softmax (b·s·V·(bytes + 8)). With activation checkpointing only each
    layer's input (sbh) is kept, plus one layer's working set during recompute.
    """
    s, b, h = seq_len, micro_batch, shape.hidden
    per_layer = (8 * h + shape.mlp_tensors * shape.intermediate) * s * b
    if not flash_attention:
        per_layer += shape.n_head * s * s * b
    per_layer *= bytes_per_value
    if checkpointing:
        layers = shape.n_layer * s * b * h * bytes_per_value + per_layer
    else:
        layers = shape.n_layer * per_layer
    head = s * b * shape.vocab_size * (bytes_per_value + 8) + 3 * s * b * h * bytes_per_value
    return layers + head


def plan(shape: ModelShape, world_size: int, stage: int, offload: str = "none", *, micro_batch: int = 1,
         seq_len: int = 1024, mixed_precision: bool = True, flash_attention: bool = True,
         checkpointing: bool = False) -> Plan:
    """Where each byte lives, per rank, for one (stage, offload) choice."""
    if offload not in OFFLOADS:
        raise ValueError(f"offload must be one of {', '.join(OFFLOADS)}, got {offload!r}")
    if offload != "none" and stage == 0:
        raise ValueError("offload needs zero_optimization.stage >= 1")
    if offload in ("nvme_optimizer", "cpu_params", "nvme_params") and stage != 3:
        raise ValueError(f"offload {offload} needs zero_optimization.stage 3")
    states = model_state_bytes(shape.num_params, world_size, stage, mixed_precision)
    compute_bytes = 2 if mixed_precision else 4
    # Stage 3 gathers whole layers just in time: the current one and the prefetched next.
    gathered = 2 * compute_bytes * shape.largest_layer_params if stage == 3 else 0
    acts = activation_bytes(shape, micro_batch, seq_len, compute_bytes, flash_attention, checkpointing)
    device, cpu, nvme = states.total + gathered + acts, 0, 0
    if offload in ("cpu_optimizer", "cpu_params"):
        device -= states.optimizer
        cpu += states.optimizer
    if offload in ("nvme_optimizer", "nvme_params"):
        device -= states.optimizer
        nvme += states.optimizer
    if offload == "cpu_params":
        device -= states.params
        cpu += states.params
    if offload == "nvme_params":
        device -= states.params
        nvme += states.params
    return Plan(stage, offload, states, gathered, acts, device, cpu, nvme)


def all_plans(shape: ModelShape, world_size: int, **kw) -> list[Plan]:
    """Every valid (stage, offload) plan, cheapest first.

    "Cheapest" orders by expected step time: less communication and less offload
    traffic first (stage 0 > 1 > 2 > 2 + CPU optimizer > 3 > 3 + offloads, CPU before
    NVMe)."""
    order = [(0, "none"), (1, "none"), (2, "none"), (1, "cpu_optimizer"), (2, "cpu_optimizer"),
             (3, "none"), (3, "cpu_optimizer"), (3, "nvme_optimizer"), (3, "cpu_params"), (3, "nvme_params")]
    return [plan(shape, world_size, s, o, **kw) for s, o in order]


def recommend(plans: list[Plan], device_budget: int, cpu_budget: int | None = None) -> Plan | None:
    """The first (cheapest) plan whose device bytes fit ``device_budget`` and, when
    given, whose CPU bytes fit ``cpu_budget``; None when nothing fits."""
    for p in plans:
        if p.device <= device_budget and (cpu_budget is None or p.cpu <= cpu_budget):
            return p
    return None


def gpt_shape(n_layer: int = 4, n_embd: int = 128, n_head: int = 4, vocab_size: int = 4096,
              n_positions: int = 128) -> ModelShape:
    """Shape of a zeal GPT (GPT-2 layout, tied head)."""
    d = n_embd
    block = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d)
    total = vocab_size * d + n_positions * d + n_layer * block + 2 * d
    return ModelShape(total, n_layer, d, n_head, vocab_size, 4 * d, max(block, vocab_size * d), 2,
                      f"GPT n_layer={n_layer} n_embd={n_embd} vocab={vocab_size}")


def hf_shape(cfg: dict) -> ModelShape:
    """Shape from a Hugging Face ``config.json`` (GPT-2, Llama/Mistral/Qwen-style keys)."""
    def get(*keys, default=None):
        for k in keys:
            if cfg.get(k) is not None:
                return cfg[k]
        if default is None:
            raise ValueError(f"config.json lacks {' / '.join(keys)}")
        return default

    h = int(get("hidden_size", "n_embd", "d_model"))
    n_layer = int(get("num_hidden_layers", "n_layer", "num_layers"))
    heads = int(get("num_attention_heads", "n_head"))
    kv_heads = int(get("num_key_value_heads", default=heads))
    vocab = int(get("vocab_size"))
    classic = cfg.get("model_type") in ("gpt2", "gpt_neox", "opt", "phi")  # LayerNorm + biases, GELU MLP
    gated = "intermediate_size" in cfg and not classic
    inter = int(get("intermediate_size", "n_inner", "ffn_dim", default=4 * h) or 4 * h)
    head_dim = int(cfg.get("head_dim") or h // heads)
    attn = h * heads * head_dim + 2 * h * kv_heads * head_dim + heads * head_dim * h
    mlp = (3 if gated else 2) * h * inter
    # LayerNorm (weight + bias) and linear biases for GPT-2-like models; RMSNorm weights otherwise
    block = attn + mlp + (4 * h + 3 * h + h + inter + h if classic else 2 * h)
    tied = bool(cfg.get("tie_word_embeddings", True))
    positions = int(cfg.get("n_positions") or 0) * h if cfg.get("model_type") == "gpt2" else 0
    total = vocab * h * (1 if tied else 2) + positions + n_layer * block + (2 * h if classic else h)
    return ModelShape(total, n_layer, h, heads, vocab, inter, max(block, vocab * h), 4 if gated else 2,
                      str(cfg.get("_name_or_path") or cfg.get("model_type") or "hf model"))


def parse_bytes(text: str) -> int:
    """``"16GB"``, ``"1.5GiB"``, ``"512M"``, ``"1e9"`` → bytes (decimal units for
    KB/MB/GB/TB, binary for KiB/MiB/GiB/TiB; a bare K/M/G/T is binary)."""
    t = text.strip().replace(" ", "")
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 10**3, "mb": 10**6, "gb": 10**9,
             "tb": 10**12, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40, "b": 1}
    low = t.lower()
    for suffix in sorted(units, key=len, reverse=True):
        if low.endswith(suffix):
            number, scale = low[: -len(suffix)], units[suffix]
            break
    else:
        number, scale = low, 1
    try:
        value = float(number)
    except ValueError:
        raise ValueError(f"--budget: cannot read {text!r} as a size (e.g. 16GB, 1.5GiB, 800M)") from None
    if value < 0:
        raise ValueError(f"--budget must be positive, got {text!r}")
    return int(value * scale)


def fmt_bytes(n: int) -> str:
    """Human-readable binary size."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"
