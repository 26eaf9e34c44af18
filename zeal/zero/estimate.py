"""Memory planner: peak bytes per rank for every ZeRO stage, offload, checkpointing and micro-batch.

Pure functions of the model's shape, the world size and the precision; no torch.

The peak of a rank is a sum of named parts (each a field of :class:`Plan`)::

    peak = baseline + slack + model states
           + max(activations + grad buffers + gathered,    # forward / backward
                 step temporaries + grad buffers)           # optimizer step

*Model states* (ZeRO paper, algorithms.md §1.1), Ψ parameters, N data-parallel ranks:

* mixed precision (bf16/fp16 compute, Adam): 16-bit params 2Ψ, 16-bit grads 2Ψ and
  optimizer state K·Ψ with K = 12 (fp32 master copy 4 + momentum 4 + variance 4;
  the master copy is counted as optimizer state). Per rank: stage 0 16Ψ,
  stage 1 4Ψ + 12Ψ/N, stage 2 2Ψ + 14Ψ/N, stage 3 16Ψ/N.
* fp32 training: params 4Ψ, grads 4Ψ, Adam 8Ψ (no separate master). Per rank:
  stage 0 16Ψ, stage 1 8Ψ + 8Ψ/N, stage 2 4Ψ + 12Ψ/N, stage 3 16Ψ/N.

Partitioning rounds each flat buffer up to a multiple of N (``ceil(Ψ/N)`` per rank).

*Working memory* of one step, for one micro-batch (c = bytes of the compute dtype):

* activations (:func:`activation_parts`): what autograd keeps for backward, plus
  the largest transient on top of it (the loss's logits, or one block's backward);
* grad buffers (:func:`grad_buffer_bytes`): stages 2–3 copy gradients into flat
  buffers that are reduce-scattered; what may be in flight is kept for reuse;
* gathered (:func:`gathered_bytes`): stage 3's whole units at the peak;
* step temporaries (:func:`step_temporary_bytes`): the fp32 gradient copy the
  masters are updated from (mixed precision), stage 1's reduce-scatter output.

*Process* parts, for training on CPU (host RAM is the "device"), measured with
``bench/train/bench_estimate.py`` (torch 2.13.0+cpu, Python 3.11, glibc):
``HOST_BASELINE_BYTES`` and, for stages 0–2, ``HOST_HEAP_SLACK_BYTES``. On a GPU
they are 0: the CUDA context lives outside PyTorch's allocator and was not measured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol

OFFLOADS = ("none", "cpu_optimizer", "nvme_optimizer", "cpu_params", "nvme_params")
"""Offload choices. ``cpu_params``/``nvme_params`` (stage 3 only) move the optimizer
state to the same tier as the parameters; ``nvme_optimizer`` is stage 3 only, as
in ZeRO-Infinity; ``cpu_optimizer`` (ZeRO-Offload) needs stage ≥ 1."""

MIB = 2**20
# RSS of a rank before its first step, less the model's own buffers: Python, torch, zeal,
# a 2-rank gloo group and the pages of code a step touches. Measured 304–311 MiB in every
# rank of every bench_estimate.py job ("built" RSS minus the mmapped flat buffers).
HOST_BASELINE_BYTES = 305 * MIB
# Stages 0–2 leave glibc's malloc at its defaults: blocks freed in one step (activations,
# autograd's per-parameter gradients) stay in the heap as holes the next step's tensors do
# not all fit. mallinfo2's free heap bytes at the end of the third forward: 122–398 MiB,
# median 195 MiB, over the ranks of the 24 stage 0–2 jobs of bench_estimate.py (27.4M and
# 124M GPT, fp32 and bf16, checkpointing on and off); the median is counted, capped at what
# a step frees into the heap at all (its activations and autograd's gradients, c·Ψ), so that
# a small model is not charged more than it could leave behind. Stage 3 and the
# NVMe tier return freed blocks at once (mmap threshold 1 MiB, zeal.utils.process.set_malloc_thresholds):
# 1–4 MiB measured, counted as 0.
HOST_HEAP_SLACK_BYTES = 195 * MIB
# zeal's defaults (zeal.config.schema.ZeroConfig) and zeal.zero.units.COALESCE_BLOCK_ELEMS
BUCKET_ELEMS = 5_000_000          # reduce_bucket_size: bucket size and bound on gradients in flight
PREFETCH_ELEMS = 1_000_000        # stage3_prefetch_bucket_size
COALESCE_BLOCK_ELEMS = 4_000_000  # a block this small is one stage-3 unit
LOSS_CHUNK_ELEMS = 1 << 23        # zeal GPT under checkpointing scores the logits in chunks of this many


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
    block_params: int = 0  # parameters of one transformer block (0: unknown, taken as largest_layer_params)
    tied_embeddings: bool = True


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
    """One (stage, offload, checkpointing, micro-batch) configuration and where its
    bytes live, per rank. ``device`` is the peak on the device (host RAM on CPU runs);
    ``cpu``/``nvme`` what offload moved there."""

    stage: int
    offload: str
    states: StateBytes
    gathered: int
    activations: int
    device: int
    cpu: int
    nvme: int
    micro_batch: int = 1
    checkpointing: bool = False
    activations_kept: int = 0
    grad_buffers: int = 0
    step_temporaries: int = 0
    baseline: int = 0
    slack: int = 0
    n_layer: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"stage {self.stage}" + ("" if self.offload == "none" else f" + {self.offload.replace('_', ' ')}")

    @property
    def description(self) -> str:
        """The label with checkpointing and micro-batch."""
        return f"{self.label}{', checkpointing' if self.checkpointing else ''}, micro-batch {self.micro_batch}"

    def ds_config(self) -> dict:
        """The DeepSpeed/zeal config sections this plan sets: ``train_micro_batch_size_per_gpu``,
        ``zero_optimization`` and, with checkpointing, ``activation_checkpointing``."""
        zo: dict = {"stage": self.stage}
        if self.offload in ("cpu_optimizer", "cpu_params"):
            zo["offload_optimizer"] = {"device": "cpu"}
        if self.offload in ("nvme_optimizer", "nvme_params"):
            zo["offload_optimizer"] = {"device": "nvme", "nvme_path": "/local_nvme"}
        if self.offload == "cpu_params":
            zo["offload_param"] = {"device": "cpu"}
        if self.offload == "nvme_params":
            zo["offload_param"] = {"device": "nvme", "nvme_path": "/local_nvme"}
        cfg: dict = {"train_micro_batch_size_per_gpu": self.micro_batch, "zero_optimization": zo}
        if self.checkpointing:  # one checkpoint per block, as the activation formula assumes
            cfg["activation_checkpointing"] = {"number_checkpoints": self.n_layer} if self.n_layer else {}
        return cfg


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


def block_saved_bytes(shape: ModelShape, micro_batch: int, seq_len: int, bytes_per_value: int = 2,
                      flash_attention: bool = True) -> int:
    """Bytes autograd saves in one pre-LayerNorm block's forward (storages counted once).

    Measured with ``saved_tensors_hooks`` on zeal's GPT (``bench_estimate.py
    --saved-tensors``), in fp32 and bf16 alike: 8·bsh values (LN inputs and outputs 4,
    q/k/v 3 in one storage, attention output 1, which is also the projection's input)
    plus ``mlp_tensors``·bs·intermediate (GELU input and output), all in the compute
    dtype; the two LayerNorms' mean and rstd (4·bs values) and the fused attention's
    log-sum-exp (heads·bs, fp32). Unfused attention adds heads·s²·b probabilities.
    """
    s, b, h, c = seq_len, micro_batch, shape.hidden, bytes_per_value
    values = (8 * h + shape.mlp_tensors * shape.intermediate + 4) * s * b
    if not flash_attention:
        values += shape.n_head * s * s * b
    return values * c + 4 * shape.n_head * s * b


def activation_parts(shape: ModelShape, micro_batch: int, seq_len: int, bytes_per_value: int = 2,
                     flash_attention: bool = True, checkpointing: bool = False) -> tuple[int, int]:
    """(kept, transient) activation bytes of one micro-batch, per rank.

    *kept*: what autograd holds once the forward is done: every block's saved tensors
    (:func:`block_saved_bytes`) or, with per-block checkpointing, each block's input
    (bsh); plus the head's: the final LN's and the LM head's inputs (2·bsh) and the fp32
    log-softmax of the loss (4·bsV bytes). With checkpointing zeal's GPT scores the
    logits in checkpointed chunks of ``LOSS_CHUNK_ELEMS``: the head keeps only its
    inputs, and the loss's transient is one chunk's logits, fp32 copy, log-softmax and
    gradient, plus the head's weight gradient summed over the chunks (the running sum
    and the next chunk's, V·h each).

    *transient*: the larger of two moments on top of that. At the loss: the logits
    (bsV in the compute dtype), their shifted copy (idem) and, for 16-bit compute, their
    fp32 copy: 8 bytes per b·s·V in fp32 and bf16 alike (log-softmax's backward needs as
    much: its output, its gradient and its input's gradient). In a block's backward,
    once the loss is done with: the block's recomputed saved tensors (checkpointing only),
    two intermediate-wide gradients, and a tied embedding's gradient (V·h, held from the
    head's backward until the embedding's adds to it).
    """
    s, b, h, c, v = seq_len, micro_batch, shape.hidden, bytes_per_value, shape.vocab_size
    block = block_saved_bytes(shape, b, s, c, flash_attention)
    if checkpointing:  # chunked, recomputed loss: nothing of b·s·V is kept; one chunk at a time
        head_kept = 2 * s * b * h * c
        chunk = min(LOSS_CHUNK_ELEMS, s * b * v)
        loss = chunk * (c + (4 if c < 4 else 0) + 8)  # logits, fp32 copy, log-softmax and its gradient
        # the head's weight gradient is summed over the chunks: the running sum and the next chunk's
        loss += (2 if s * b * v > chunk else 1) * v * h * c
    else:
        head_kept = 2 * s * b * h * c + 4 * s * b * v
        loss = s * b * v * (2 * c + (4 if c < 4 else 0))
    kept = (shape.n_layer * s * b * h * c if checkpointing else shape.n_layer * block) + head_kept
    backward = (block if checkpointing else 0) + 2 * s * b * shape.intermediate * c
    backward += v * h * c if shape.tied_embeddings else 0
    return kept, max(loss, backward - head_kept)


def activation_bytes(shape: ModelShape, micro_batch: int, seq_len: int, bytes_per_value: int = 2,
                     flash_attention: bool = True, checkpointing: bool = False) -> int:
    """Peak activation bytes of one micro-batch, per rank: kept + transient
    (:func:`activation_parts`)."""
    return sum(activation_parts(shape, micro_batch, seq_len, bytes_per_value, flash_attention, checkpointing))


def stage3_block_unit(shape: ModelShape) -> int:
    """Elements of the largest stage-3 unit inside a block: the whole block when it is
    coalesced (≤ ``COALESCE_BLOCK_ELEMS``), else its MLP up-projection."""
    block = shape.block_params or shape.largest_layer_params
    return block if block <= COALESCE_BLOCK_ELEMS else shape.hidden * shape.intermediate + shape.intermediate


def grad_buffer_bytes(shape: ModelShape, world_size: int, stage: int, bytes_per_value: int,
                      bucket_elems: int = BUCKET_ELEMS) -> int:
    """Flat gradient buffers of stages 2–3 (0 for stages 0–1, whose full gradient buffer
    is a model state).

    Each unit's gradients are copied into a flat buffer that is reduce-scattered into a
    shard-sized output; a reduction is waited for once more than ``bucket_elems`` are in
    flight, so at most ``bucket_elems`` plus one unit (a bucket, stage 2; a block's largest
    unit, stage 3) of flat buffers exist, and their outputs (/N). A single parameter larger
    than a bucket (the embedding) is reduced from autograd's own gradient: only its
    output counts. The buffers are kept for reuse, so they stay resident.
    """
    if stage < 2:
        return 0
    unit = min(bucket_elems, shape.largest_layer_params) if stage == 2 else stage3_block_unit(shape)
    flat = min(bucket_elems + unit, shape.num_params)
    lone = shape.largest_layer_params if shape.largest_layer_params > bucket_elems else 0
    return bytes_per_value * (flat + shard(flat + lone, world_size))


def gathered_bytes(shape: ModelShape, stage: int, bytes_per_value: int, prefetch_elems: int = PREFETCH_ELEMS) -> int:
    """Stage 3's gathered units at the peak (the loss): the largest layer (the tied
    embedding / head is held over the loss) and what is prefetched next, at least the
    next unit of a block."""
    if stage != 3:
        return 0
    return bytes_per_value * (shape.largest_layer_params + max(prefetch_elems, stage3_block_unit(shape)))


def step_temporary_bytes(num_params: int, world_size: int, stage: int, mixed_precision: bool) -> int:
    """Bytes the optimizer step allocates on top of the states: with mixed precision the
    fp32 copy of the gradient this rank updates (4 bytes per owned element: all of them at
    stage 0, Ψ/N at stages 1–3); stage 1's reduce-scatter output (c per owned element),
    alive from the end of backward to the end of the step. fp32 training updates from the
    reduced buffer itself; fused Adam/AdamW and the per-tensor gradient norm allocate
    nothing model-sized."""
    owned = num_params if stage == 0 else shard(num_params, world_size)
    c = 2 if mixed_precision else 4
    return (4 * owned if mixed_precision else 0) + (c * owned if stage == 1 else 0)


class Variant(Protocol):
    """A training variant with its own planner, which :func:`plan` hands the work to once
    the arguments are checked: :class:`zeal.zero.estimate_lora.LoraSpec` (adapters on a
    frozen base). The variant's planner builds on this module's parts; this module knows
    only this protocol, so the dependency runs one way."""

    def plan(self, shape: ModelShape, world_size: int, stage: int, offload: str, **kw: Any) -> Plan:
        """The variant's :class:`Plan`, with :func:`plan`'s keyword arguments."""
        ...


def plan(shape: ModelShape, world_size: int, stage: int, offload: str = "none", *, micro_batch: int = 1,
         seq_len: int = 1024, mixed_precision: bool = True, flash_attention: bool = True,
         checkpointing: bool = False, host: bool = True, lora: Variant | None = None) -> Plan:
    """Where each byte lives, per rank, at the peak of a step (see the module docstring).
    ``host``: training on CPU, so the process baseline and glibc's heap slack count.
    ``lora``: a :class:`zeal.zero.estimate_lora.LoraSpec` (adapters on a frozen base; its
    own planner makes the plan)."""
    if offload not in OFFLOADS:
        raise ValueError(f"offload must be one of {', '.join(OFFLOADS)}, got {offload!r}")
    if offload != "none" and stage == 0:
        raise ValueError("offload needs zero_optimization.stage >= 1")
    if offload in ("nvme_optimizer", "cpu_params", "nvme_params") and stage != 3:
        raise ValueError(f"offload {offload} needs zero_optimization.stage 3")
    if micro_batch < 1 or seq_len < 1:
        raise ValueError("micro-batch and sequence length must be >= 1")
    if lora is not None:
        return lora.plan(shape, world_size, stage, offload, micro_batch=micro_batch, seq_len=seq_len,
                         mixed_precision=mixed_precision, flash_attention=flash_attention,
                         checkpointing=checkpointing, host=host)
    states = model_state_bytes(shape.num_params, world_size, stage, mixed_precision)
    c = 2 if mixed_precision else 4
    kept, transient = activation_parts(shape, micro_batch, seq_len, c, flash_attention, checkpointing)
    buffers = grad_buffer_bytes(shape, world_size, stage, c)
    gathered = gathered_bytes(shape, stage, c)
    temps = step_temporary_bytes(shape.num_params, world_size, stage, mixed_precision)
    baseline = HOST_BASELINE_BYTES if host else 0
    slack = 0
    if host and stage < 3 and "nvme" not in offload:
        slack = min(HOST_HEAP_SLACK_BYTES, kept + transient + c * shape.num_params)
    on_device, cpu, nvme = place_states(states, temps, offload)
    working = max(kept + transient + buffers + gathered, (temps if offload == "none" else 0) + buffers)
    device = baseline + slack + on_device + working
    return Plan(stage, offload, states, gathered, kept + transient, device, cpu, nvme, micro_batch, checkpointing,
                kept, buffers, temps, baseline, slack, shape.n_layer)


def place_states(states: StateBytes, temps: int, offload: str, stay: int = 0) -> tuple[int, int, int]:
    """``(device, cpu, nvme)`` bytes of the model states under ``offload``: the optimizer
    state, and the step's temporaries, live where the optimizer steps; with ``cpu_params`` /
    ``nvme_params`` the parameters move too, all but ``stay`` bytes of them (a quantized
    LoRA base stays on the device)."""
    on_device, cpu, nvme = states.total, 0, 0
    if offload != "none":
        on_device -= states.optimizer
        cpu += temps
        if "nvme" in offload:
            nvme += states.optimizer
        else:
            cpu += states.optimizer
    if offload in ("cpu_params", "nvme_params"):
        moved = states.params - stay
        on_device -= moved
        if offload == "cpu_params":
            cpu += moved
        else:
            nvme += moved
    return on_device, cpu, nvme


STAGE_OFFLOAD_ORDER = [(0, "none"), (1, "none"), (2, "none"), (3, "none"), (1, "cpu_optimizer"),
                       (2, "cpu_optimizer"), (3, "cpu_optimizer"), (3, "nvme_optimizer"), (3, "cpu_params"),
                       (3, "nvme_params")]
"""(stage, offload) by expected step time and moving parts: no offload before offload
(an offloaded optimizer steps on the CPU and moves 2Ψ per step over PCIe, more than
stage 3's extra parameter all-gather over the fabric), then less communication and
less offload traffic first (stage 0 = 1 = 2 > 3 > 1/2 + CPU optimizer > 3 + offloads,
CPU before NVMe). So when plain stage 3 and stage 2 + CPU offload both fit, stage 3 is
picked, as DeepSpeed's documentation advises (offload only when stage 3 does not fit)."""


def _traffic_tier(stage: int, offload: str) -> int:
    """Stages 0, 1 and 2 move the same bytes per step (an all-reduce is a reduce-scatter
    plus an all-gather): one tier; every later entry of STAGE_OFFLOAD_ORDER its own."""
    return max(0, STAGE_OFFLOAD_ORDER.index((stage, offload)) - 2)


def all_plans(shape: ModelShape, world_size: int, **kw) -> list[Plan]:
    """Every valid (stage, offload) plan, in ``STAGE_OFFLOAD_ORDER``."""
    return [plan(shape, world_size, s, o, **kw) for s, o in STAGE_OFFLOAD_ORDER]


def implemented_on(p: Plan, device: str) -> bool:
    """Whether zeal runs ``p``'s offload tiers on ``device`` ("cpu", "gpu"/"cuda", ...): the
    check ``zeal.initialize`` makes (:func:`zeal.zero.apply.check_offload_device`), so
    ``--budget`` never proposes a plan the target refuses."""
    import torch

    from zeal.config import ConfigError, load_config
    from zeal.zero.apply import check_offload_device

    zc = load_config({"zero_optimization": p.ds_config()["zero_optimization"]}).zero_optimization
    try:
        check_offload_device(zc, torch.device("cuda" if device == "gpu" else device))
    except ConfigError:
        return False
    return True


def micro_batch_choices(largest: int) -> list[int]:
    """``largest`` and the powers of two below it, largest first."""
    out = [largest]
    m = 1 << (largest.bit_length() - 1)
    while m >= 1:
        if m != largest:
            out.append(m)
        m //= 2
    return out


def candidate_plans(shape: ModelShape, world_size: int, max_micro_batch: int, **kw) -> list[Plan]:
    """Every stage × offload × checkpointing × micro-batch (``max_micro_batch`` and the
    powers of two below) plan, cheapest first. Cheapest is lexicographic:

    1. least communication and offload traffic (the tiers of ``_traffic_tier``);
    2. no activation checkpointing before checkpointing (one more forward per block);
    3. the larger micro-batch (fewer accumulation steps for the same batch);
    4. the lower stage within a tier.
    """
    kw.pop("checkpointing", None)
    plans = [plan(shape, world_size, s, o, micro_batch=m, checkpointing=ck, **kw)
             for s, o in STAGE_OFFLOAD_ORDER for ck in (False, True) for m in micro_batch_choices(max_micro_batch)]
    return sorted(plans, key=lambda p: (_traffic_tier(p.stage, p.offload), p.checkpointing, -p.micro_batch,
                                        STAGE_OFFLOAD_ORDER.index((p.stage, p.offload))))


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
                      f"GPT n_layer={n_layer} n_embd={n_embd} vocab={vocab_size}", block, True)


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
                      str(cfg.get("_name_or_path") or cfg.get("model_type") or "hf model"), block, tied)


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
