"""Data efficiency in a ``zeal train`` job: which blocks a step reads (the curriculum
sampler), how a batch is cut (sequence-length curriculum), what a step consumed (tokens
and layer-tokens, for the token-based LR schedules and ``job.train_tokens``), and the
figures the metrics record (``curriculum_difficulty``, ``random_ltd_kept_tokens``).

Sample ids of the curriculum sampler are positions in the job's training blocks
(``blocks.train_index``), as ``zeal data analyze`` numbers them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from zeal.config.data_efficiency import SEQLEN_RESHAPE, SEQLEN_TRUNCATE, VOC
from zeal.data.curriculum import Pacing, apply_seqlen
from zeal.data.curriculum_sampler import CurriculumSampler, IndexedMetric
from zeal.train.token_schedules import TokenCounter, TokenLRScheduler, layer_token_lr, token_lr


@dataclass
class JobDataEfficiency:
    """The job's data-efficiency parts (each None when off) and its token counter."""

    seqlen: Pacing | None = None
    seqlen_kind: str = "truncate"
    sampler: CurriculumSampler | None = None
    drop: Any = None  # zeal.data.random_ltd.TokenDrop
    counter: TokenCounter = field(default_factory=TokenCounter)

    @property
    def on(self) -> bool:
        return self.seqlen is not None or self.sampler is not None or self.drop is not None

    def begin_step(self, step: int) -> np.ndarray | None:
        """Advance the curricula to ``step``; this rank's sampled ids of the step (None: the
        default order)."""
        if self.seqlen is not None:
            self.seqlen.update(step)
        return self.sampler.next_rank_batch() if self.sampler is not None else None

    def cut(self, x: torch.Tensor) -> torch.Tensor:
        """The batch at the current sequence-length difficulty."""
        return x if self.seqlen is None else apply_seqlen(x, self.seqlen.current, self.seqlen_kind)

    def consume(self, x: torch.Tensor, dp_size: int) -> None:
        """Count one micro-batch ``x`` of every data-parallel rank."""
        b, t = x.shape
        layer = self.drop.layer_tokens(b, t) if self.drop is not None and self.drop.layer_ids else None
        self.counter.add(b * t * dp_size, None if layer is None else layer * dp_size)

    def metrics(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.seqlen is not None:
            out["curriculum_difficulty"] = self.seqlen.current
        elif self.sampler is not None:
            out["curriculum_difficulty"] = next(iter(self.sampler.difficulties().values()))
        if self.drop is not None:
            out["random_ltd_kept_tokens"] = self.drop.kept
            out["layer_tokens"] = self.counter.layer_tokens  # summed over layers: the compute random-LTD saves
        return out

    def state_dict(self) -> dict[str, Any]:
        sd: dict[str, Any] = {"tokens": self.counter.tokens, "layer_tokens": self.counter.layer_tokens}
        if self.sampler is not None:
            sd["sampler"] = self.sampler.state_dict()
        return sd

    def load_state_dict(self, sd: dict[str, Any], step: int) -> None:
        self.counter.tokens, self.counter.layer_tokens = int(sd.get("tokens", 0)), int(sd.get("layer_tokens", 0))
        if self.sampler is not None and "sampler" in sd:
            self.sampler.load_state_dict(sd["sampler"])
        if self.seqlen is not None:
            self.seqlen.update(step)
        if self.drop is not None:
            self.drop.update(step)


def build(cfg: Any, blocks: Any, micro: int, accum: int, dp_size: int, dp_rank: int,
          drop: Any = None) -> JobDataEfficiency:
    """The job's parts from the engine config ``cfg`` (a :class:`zeal.config.Config`)."""
    out = JobDataEfficiency(drop=drop)
    legacy = cfg.curriculum_learning
    if legacy is not None and legacy.enabled:
        out.seqlen = Pacing.from_config(legacy)
    cl = cfg.data_efficiency.curriculum()
    metrics: dict[str, IndexedMetric] = {}
    for name, m in (cl.curriculum_metrics.items() if cl is not None else []):
        if name in SEQLEN_TRUNCATE + SEQLEN_RESHAPE:
            if out.seqlen is not None:
                raise ValueError(f"curriculum metric {name!r}: a sequence-length curriculum is already configured")
            out.seqlen = Pacing.from_config(m)
            out.seqlen_kind = "truncate" if name in SEQLEN_TRUNCATE else "reshape"
            continue
        metrics[name] = IndexedMetric(_metric_values(name, m, blocks), Pacing.from_config(m), m.difficulty_type)
    if metrics:
        out.sampler = CurriculumSampler(metrics, micro, dp_size, dp_rank, accum, cfg.data_efficiency.seed,
                                        num_samples=len(blocks.train_index))
    return out


def _metric_values(name: str, m: Any, blocks: Any) -> np.ndarray:
    from zeal.data.analyzer import analyze, load_sample_metric

    if m.index_to_sample_path and m.index_to_metric_path:
        return load_sample_metric(m.index_to_sample_path, m.index_to_metric_path)
    if name in VOC:  # no index given: analyze the training blocks here (one process)
        rows = blocks.ids[blocks.train_index.astype(np.int64)[:, None] * blocks.block_size
                          + np.arange(blocks.block_size)]
        return analyze(rows, "voc", 1).sample_to_metric
    raise ValueError(f"curriculum metric {name!r} needs index_to_sample_path and index_to_metric_path "
                     "(written by 'zeal data analyze')")


def token_scheduler(job: Any, cfg: Any, optimizer: torch.optim.Optimizer,
                    counter: TokenCounter) -> TokenLRScheduler | None:
    """A token-based LR schedule when the job asks for one (``job.lr_decay_tokens`` /
    ``job.lr_warmup_tokens``, or ``layer_token_lr_schedule.enabled``); else None."""
    opt_lr = (cfg.optimizer.params.get("lr") if cfg.optimizer is not None else None) or job.lr
    max_lr = float(opt_lr)
    for g in optimizer.param_groups:
        g["lr"] = max_lr  # the peak, not where a step schedule has put it
    rl = cfg.data_efficiency.random_ltd()
    lt = rl.layer_token_lr_schedule if rl is not None else None
    if lt is not None and lt.enabled:
        if lt.total_layer_tokens is None:
            raise ValueError("layer_token_lr_schedule.total_layer_tokens is required when it is enabled")
        return TokenLRScheduler(optimizer, lambda n: layer_token_lr(
            n, max_lr, lt.total_layer_tokens, lt.warmup_layer_tokens, lt.warmup_type, job.min_lr),
            lambda: counter.layer_tokens)
    if job.lr_decay_tokens is None and job.lr_warmup_tokens is None:
        return None
    return TokenLRScheduler(optimizer, lambda n: token_lr(
        n, max_lr, job.min_lr, job.lr_warmup_tokens or 0, job.lr_decay_tokens, job.lr_decay_style),
        lambda: counter.tokens)
