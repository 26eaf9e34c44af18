"""``deepspeed.runtime.sequence_parallel.ulysses_sp`` on zeal: ALST's Hugging Face path.

What Accelerate (``accelerator.prepare`` with ``ParallelismConfig(sp_backend="deepspeed",
sp_size=S)``), TRL and Transformers' Trainer call, reaching zeal's Ulysses sequence
parallelism (:mod:`zeal.parallel.sequence`):

* :meth:`UlyssesSPAttentionHF.register_with_transformers` checks the attention
  implementation (not ``eager``), builds the sp groups
  (:mod:`~zeal.deepspeed.runtime.sequence_parallel.parallel_state_sp`) and marks the
  model; it returns that module as the ``mpu``. zeal swaps the attention itself when
  ``deepspeed.initialize(model, config, mpu=mpu)`` builds the engine: the config's
  ``sequence_parallel_size`` is the mpu's when the config leaves it out (DeepSpeed reads
  it from the mpu);
* :class:`UlyssesSPDataLoaderAdapter` turns each rank's batches into chunks as
  DeepSpeed's does: one batch from every sp rank in turn, ``labels`` replaced by
  ``shift_labels`` (shifted before sharding, -100 at the end), every tensor cut to this
  rank's ``[r·T/S, (r+1)·T/S)`` columns; ``position_ids`` are required.

The loss, as DeepSpeed's: ``engine(**chunk)`` returns Hugging Face's output whose ``loss``
is the mean over this chunk's counted tokens (the caller combines the chunks, weighted by
their token counts, as Transformers' ``deepspeed_sp_compute_loss`` does), and the
gradients are those of DeepSpeed 0.19.8: summed over the sp group under ZeRO 0–2,
averaged under ZeRO 3 (which Transformers compensates for below DeepSpeed 0.20.2). So
an unchanged Trainer/Accelerate script trains as one process on the full sequences.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch

from zeal.deepspeed.refusals import Refused, RefusedName
from zeal.deepspeed.runtime.sequence_parallel import parallel_state_sp

MARK = "_zeal_deepspeed_ulysses"  # set on the model: its sp size
_TILING = ("zeal tiles from the config: tiling.tiled_mlp / tiling.tiled_logits_loss (and "
           "activation_checkpointing.cpu_checkpointing for the offload)")


class UlyssesSPAttentionHF(torch.nn.Module):
    """DeepSpeed's attention wrapper class; zeal needs only its registration classmethod
    (the attention itself is :func:`zeal.parallel.ulysses.register_hf_attention`'s)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise Refused("deepspeed.runtime.sequence_parallel.ulysses_sp.UlyssesSPAttentionHF(...)",
                      "zeal builds the attention when deepspeed.initialize runs with sequence_parallel_size > 1: "
                      "call UlyssesSPAttentionHF.register_with_transformers(model, ...) and pass its mpu")

    @classmethod
    def register_with_transformers(cls, model_name_or_path: Any, core_attn_implementation: str,
                                   sequence_parallel_size: int, micro_batch_size: int, seq_length: int | None = None,
                                   seq_length_is_variable: bool = True, disable_in_eval: bool = False,
                                   max_length: int | None = None) -> Any:
        """DeepSpeed's signature: None at ``sequence_parallel_size`` 1, else the sp ``mpu``.
        ``model_name_or_path`` must be the loaded model (zeal marks it; a hub name is
        refused in one line); ``seq_length`` (or the deprecated ``max_length``), when
        fixed, must divide by S."""
        if sequence_parallel_size == 1:
            return None
        seq_length = seq_length if seq_length is not None else max_length
        if not seq_length_is_variable and seq_length is None:
            raise ValueError("register_with_transformers: give seq_length when seq_length_is_variable is False")
        if seq_length is not None and not seq_length_is_variable and seq_length % sequence_parallel_size:
            raise ValueError(f"register_with_transformers: seq_length {seq_length} is not divisible by "
                             f"sequence_parallel_size {sequence_parallel_size}")
        if not hasattr(model_name_or_path, "config"):
            raise ValueError("register_with_transformers: zeal needs the loaded model (not a hub name or path): "
                             "load it first and pass the model object")
        if core_attn_implementation in ("eager", "paged|eager"):
            raise ValueError(f"{core_attn_implementation} attn_implementation isn't supported by Ulysses sequence "
                             "parallelism (it needs a 4D attention mask); use 'sdpa' or a flash attention")
        have = getattr(model_name_or_path.config, "_attn_implementation", None)
        if have is not None and have != core_attn_implementation:
            raise ValueError(f"core_attn_implementation='{core_attn_implementation}' does not match the model "
                             f"config's attn_implementation='{have}'; set both to the same value")
        parallel_state_sp.initialize_sequence_parallel(sequence_parallel_size)
        setattr(model_name_or_path, MARK, int(sequence_parallel_size))
        return parallel_state_sp


class UlyssesSPDataLoaderAdapter:
    """Wrap a DataLoader: every ``S`` iterations read one batch per sp rank and yield, on
    rank r, batch i's chunk r for i = 0..S-1 (see the module docstring). ``len`` is
    ``len(dl) · S``."""

    def __init__(self, dl: Any, sp_rank: int, sp_group: Any, sp_world_size: int, device: Any) -> None:
        self.dl, self.sp_rank, self.sp_group, self.sp_world_size = dl, sp_rank, sp_group, sp_world_size
        self.device = device
        self.iter = iter(dl)
        self.micro_batches: deque[dict] = deque()

    def __len__(self) -> int:
        return len(self.dl) * self.sp_world_size

    def __iter__(self) -> UlyssesSPDataLoaderAdapter:
        return self

    def __next__(self) -> dict:
        if not self.micro_batches:
            self.refill()
        return self.micro_batches.popleft()

    def refill(self) -> None:
        """Read one batch, gather the sp group's, queue this rank's chunk of each."""
        import torch.distributed as dist

        try:
            batch = next(self.iter)
        except StopIteration:
            self.iter = iter(self.dl)  # the next epoch starts over
            raise
        if "position_ids" not in batch:
            raise ValueError("Ulysses SP needs position_ids in every batch (torch.arange(seq_len) per sample for "
                             "unpacked sequences) so that each token keeps its global position")
        gathered: list[Any] = [None] * self.sp_world_size
        dist.all_gather_object(gathered, {k: v.cpu() if torch.is_tensor(v) else v for k, v in batch.items()},
                               group=self.sp_group)
        for whole in gathered:
            self.micro_batches.append(self._chunk(whole))

    def _chunk(self, batch: dict) -> dict:
        ids = batch["input_ids"]
        s = self.sp_world_size
        if ids.shape[1] % s:
            raise ValueError(f"batch's seqlen={ids.shape[1]} isn't divisible by sp-size={s}")
        for k, v in batch.items():
            if torch.is_tensor(v) and v.dim() > 1 and v.shape[1] != ids.shape[1]:
                raise ValueError(f"{k}'s shape {tuple(v.shape)} must match input_ids's shape {tuple(ids.shape)}")
        out = dict(batch)
        if "labels" in out:
            labels = out.pop("labels")
            out["shift_labels"] = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()
        n = ids.shape[1] // s
        lo = n * self.sp_rank
        return {k: v[:, lo:lo + n].to(self.device) if torch.is_tensor(v) and v.dim() > 1 else v
                for k, v in out.items()}


def config_with_mpu(config: Any, mpu: Any) -> Any:
    """``deepspeed.initialize``'s config with ``sequence_parallel_size`` from an sp ``mpu``
    (DeepSpeed reads the size from it); a size the config states must agree."""
    if mpu is not parallel_state_sp or not isinstance(config, dict):
        return config
    sp = parallel_state_sp.get_sequence_parallel_world_size()
    given = config.get("sequence_parallel_size")
    if given not in (None, sp):
        raise ValueError(f"deepspeed.initialize: the mpu's sequence-parallel size is {sp}, the config's "
                         f"sequence_parallel_size {given}")
    return {**config, "sequence_parallel_size": sp}


def adopt(engine: Any, model: Any) -> None:
    """After ``deepspeed.initialize``: a model registered by
    :meth:`UlyssesSPAttentionHF.register_with_transformers` returns DeepSpeed's chunk loss
    (see the module docstring) from ``engine(**chunk)``."""
    runner = getattr(getattr(engine, "_p", None), "sequence_parallel", None)
    if runner is None or not getattr(model, MARK, None):
        return
    stage = int(engine.config.zero_optimization.stage)
    # zeal averages gradients over data × sp: DeepSpeed 0.19.8 sums over sp below ZeRO 3
    runner.deepspeed_chunk_loss = float(runner.comm.size) if stage < 3 else 1.0


_REASONS = {"TiledMLP": _TILING, "TiledFusedLogitsLoss": _TILING, "SequenceTiledCompute": _TILING,
            "sequence_tiled_compute": _TILING, "AutogradComputeMLP": _TILING}


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    return RefusedName(f"deepspeed.runtime.sequence_parallel.ulysses_sp.{name}", _REASONS.get(name))
