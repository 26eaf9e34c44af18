"""Long-context planner: sequence-parallel size × ALST tiling × checkpointing for one sequence.

Pure functions; no torch. One sample (micro-batch 1) of ``s`` tokens, ``S`` sequence-
parallel ranks (Ulysses), so each rank holds ``s_l = ceil(s / S)`` tokens of every
activation (attention holds all ``s`` tokens over ``heads / S`` heads: the same bytes).
c = bytes of the compute dtype, h hidden, I intermediate, V vocabulary, L layers, m =
the MLP's saved intermediate tensors (2 GELU, 4 SwiGLU), n_h heads.

Activations per rank (bytes)::

    block(s_l)  = (8h + m·I + 4)·s_l·c + 4·n_h·s_l        a block's saved tensors (untiled MLP)
    block_t     = (8h + 4)·s_l·c + 4·n_h·s_l              TiledMLP: the MLP keeps only its input
    mlp_tile    = (m + 2)·I·r·c + 4·P_mlp                 TiledMLP's transient: one tile of r = min(s_l, h)
                                                          rows recomputed + its gradients, and the fp32
                                                          sums of the MLP's parameter gradients (P_mlp)
    kept        = L·block            no checkpointing
                = L·s_l·h·c          per-layer checkpointing (the layer inputs)
                = 0                  + cpu_checkpointing (those inputs in host memory: ``host``)
    loss        = s_l·V·(2c + 4) + 4·s_l·V(kept)          untiled: logits, shifted copy, fp32 log-softmax
                = T·(c + 12) + 4·V·h                      tiled: one tile of T = min(2**23, s_l·V) logits,
                                                          fp32 copy, log-softmax and gradient + fp32 head grad
    backward    = [block or block_t if checkpointing] + (2·I·s_l·c untiled | mlp_tile tiled)
    activations = kept + head inputs (2·s_l·h·c) + max(loss, backward)

Model states: ZeRO stage 3 over ``max(world, S)`` ranks (ALST's setting: the sp ranks
shard the model states too), plus stage 3's gather/gradient buffers and step
temporaries (:mod:`zeal.zero.estimate`). ``device`` = baseline (CPU runs) + states +
max(activations + buffers + gathered, step temporaries + buffers).

Cheapest plan first, lexicographically: the smaller ``S`` (fewer ranks, less
all-to-all), no checkpointing before checkpointing before checkpointing with host
offload, untiled before tiled (TiledMLP recomputes one MLP forward; checkpointing a
whole layer's). Each plan's bytes grow with ``s`` and the order is fixed, so the
proposal never gets cheaper for a longer sequence nor dearer for a larger budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from zeal.zero.estimate import (
    HOST_BASELINE_BYTES,
    ModelShape,
    gathered_bytes,
    grad_buffer_bytes,
    model_state_bytes,
    step_temporary_bytes,
)

LOSS_TILE_ELEMS = 1 << 23  # zeal.models.tiled.LOSS_TILE_ELEMS
CHECKPOINTING = ("none", "layers", "layers+cpu")
LONG_CONTEXT_TOKENS = 16384  # `zeal estimate --budget` plans for long context from this length on


@dataclass(frozen=True)
class LongPlan:
    """One (sp, tiling, checkpointing) configuration and its bytes per rank."""

    sp: int
    tiling: bool
    checkpointing: str
    world: int
    states: int
    activations: int
    device: int
    host: int  # checkpointed layer inputs offloaded to host memory

    @property
    def cost(self) -> tuple[int, int, bool]:
        return self.sp, CHECKPOINTING.index(self.checkpointing), self.tiling

    @property
    def description(self) -> str:
        parts = [f"sp {self.sp}", "tiling" if self.tiling else "no tiling",
                 {"none": "no checkpointing", "layers": "checkpointing",
                  "layers+cpu": "checkpointing + cpu_checkpointing"}[self.checkpointing]]
        return ", ".join(parts)

    def ds_config(self) -> dict:
        """The config keys this plan sets."""
        cfg: dict = {"train_micro_batch_size_per_gpu": 1, "sequence_parallel_size": self.sp,
                     "zero_optimization": {"stage": 3}}
        if self.tiling:
            cfg["tiling"] = {"tiled_mlp": {"enabled": True, "num_shards": "auto"},
                             "tiled_logits_loss": {"enabled": True, "num_shards": "auto"}}
        if self.checkpointing != "none":
            cfg["activation_checkpointing"] = {"cpu_checkpointing": self.checkpointing == "layers+cpu"}
        return cfg


def long_activation_bytes(shape: ModelShape, seq_len: int, sp: int, tiling: bool, checkpointing: str,
                          bytes_per_value: int = 2) -> tuple[int, int]:
    """(device, host) activation bytes per rank of one sequence (the module's formula)."""
    c, h, i, v, n_layer = bytes_per_value, shape.hidden, shape.intermediate, shape.vocab_size, shape.n_layer
    s = math.ceil(seq_len / sp)
    lse = 4 * shape.n_head * s
    block_full = (8 * h + shape.mlp_tensors * i + 4) * s * c + lse
    block_tiled = (8 * h + 4) * s * c + lse
    block = block_tiled if tiling else block_full
    mlp_params = (3 if shape.mlp_tensors >= 4 else 2) * h * i
    mlp_work = (shape.mlp_tensors + 2) * i * min(s, h) * c + 4 * mlp_params if tiling else 2 * i * s * c
    layer_inputs = n_layer * s * h * c
    if checkpointing == "none":
        kept, host = n_layer * block, 0
    elif checkpointing == "layers":
        kept, host = layer_inputs, 0
    else:
        kept, host = 0, layer_inputs
    if tiling:
        loss = min(LOSS_TILE_ELEMS, s * v) * (c + 12) + 4 * v * h
    else:
        loss = s * v * (2 * c + 4)
        kept += 4 * s * v
    kept += 2 * s * h * c
    backward = (block if checkpointing != "none" else 0) + mlp_work
    return kept + max(loss, backward), host


def long_plan(shape: ModelShape, seq_len: int, sp: int, tiling: bool, checkpointing: str, world_size: int = 1,
              mixed_precision: bool = True, host: bool = True) -> LongPlan:
    """Bytes per rank of one configuration (``host``: training on CPU, baseline counted)."""
    if checkpointing not in CHECKPOINTING:
        raise ValueError(f"checkpointing must be one of {', '.join(CHECKPOINTING)}, got {checkpointing!r}")
    if sp < 1 or seq_len < 1:
        raise ValueError("sp and the sequence length must be >= 1")
    c = 2 if mixed_precision else 4
    world = max(world_size, sp)
    world += (-world) % sp  # sp divides the world
    states = model_state_bytes(shape.num_params, world, 3, mixed_precision).total
    acts, offloaded = long_activation_bytes(shape, seq_len, sp, tiling, checkpointing, c)
    buffers = grad_buffer_bytes(shape, world, 3, c)
    temps = step_temporary_bytes(shape.num_params, world, 3, mixed_precision)
    working = max(acts + buffers + gathered_bytes(shape, 3, c), temps + buffers)
    device = (HOST_BASELINE_BYTES if host else 0) + states + working
    return LongPlan(sp, tiling, checkpointing, world, states, acts, device, offloaded)


def sp_choices(shape: ModelShape, largest: int = 64) -> list[int]:
    """Powers of two up to ``largest`` that divide the attention heads (Ulysses splits heads)."""
    out, s = [], 1
    while s <= min(largest, shape.n_head):
        if shape.n_head % s == 0:
            out.append(s)
        s *= 2
    return out


def long_plans(shape: ModelShape, seq_len: int, world_size: int = 1, mixed_precision: bool = True,
               host: bool = True, max_sp: int = 64) -> list[LongPlan]:
    """Every sp × tiling × checkpointing plan, cheapest first (the module's order). On a
    CPU device (``host``) checkpoint offload is left out: the activations already are in
    host memory."""
    ckpts = CHECKPOINTING[:2] if host else CHECKPOINTING
    plans = [long_plan(shape, seq_len, sp, t, ck, world_size, mixed_precision, host)
             for sp in sp_choices(shape, max_sp) for ck in ckpts for t in (False, True)]
    return sorted(plans, key=lambda p: p.cost)


def recommend_long(plans: list[LongPlan], device_budget: int, host_budget: int | None = None) -> LongPlan | None:
    """The cheapest plan that fits ``device_budget`` (and ``host_budget`` for offloaded
    checkpoints); None when nothing does."""
    for p in plans:
        if p.device <= device_budget and (host_budget is None or p.host <= host_budget):
            return p
    return None
