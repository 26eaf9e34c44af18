"""The curriculum sampler: each global batch drawn uniformly among the samples whose
difficulty is within the current bound, split disjointly over the data-parallel ranks.

Every rank runs the same sampler (same seed, same metrics) and so draws the same global
batch without communication; data-parallel rank ``r`` of ``dp`` takes the slice
``[round(r·B/dp), round((r+1)·B/dp))`` of it. A global batch is ``B`` distinct eligible
samples (a uniform draw without replacement; with fewer than ``B`` eligible, every
eligible sample appears before any repeats). Difficulty advances once per global batch.

Eligibility per metric (several metrics: the intersection):

* ``value``: the sample's metric ``<= d``;
* ``percentile``: the sample is among the first ``(S // P) · d`` samples sorted by metric
  (all ``S`` when ``d >= P``), ``P`` = ``max_difficulty`` (100).

The sampler's whole state is its step and its own ``torch.Generator``: :meth:`state_dict`
returns both (the generator state as a uint8 tensor, which checkpoints' client state
stores in safetensors), so a resumed run draws exactly the batches the uninterrupted one
would have.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from zeal.data.curriculum import Pacing


@dataclass
class IndexedMetric:
    """One difficulty metric over the samples: each sample's value, its pacing, its type."""

    values: np.ndarray
    pacing: Pacing
    difficulty_type: str = "value"

    def __post_init__(self) -> None:
        self.values = np.asarray(self.values, dtype=np.int64)
        if self.difficulty_type not in ("value", "percentile"):
            raise ValueError(f"difficulty_type must be 'value' or 'percentile', got {self.difficulty_type!r}")
        self._order = np.argsort(self.values, kind="stable")

    def eligible(self, difficulty: int) -> np.ndarray:
        """Boolean mask of the samples within ``difficulty``."""
        if self.difficulty_type == "value":
            return self.values <= difficulty
        s, p = len(self.values), self.pacing.max_difficulty
        count = s if difficulty >= p else (s // p) * max(0, difficulty)
        mask = np.zeros(s, dtype=bool)
        mask[self._order[:count]] = True
        return mask


class CurriculumSampler(torch.utils.data.Sampler[int]):
    """Sample ids for this data-parallel rank, one global batch (``micro_batch × dp ×
    grad_accum`` samples) per step; see the module docstring. Iterating yields this rank's
    ``micro_batch × grad_accum`` ids of each step in turn (a DataLoader with
    ``batch_size=micro_batch`` reads them); :meth:`next_rank_batch` gives one step's."""

    def __init__(self, metrics: dict[str, IndexedMetric], micro_batch: int, dp_size: int = 1, dp_rank: int = 0,
                 grad_accum: int = 1, seed: int = 1234, num_samples: int | None = None) -> None:
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is not in [0, {dp_size})")
        sizes = {len(m.values) for m in metrics.values()}
        if num_samples is not None:
            sizes.add(int(num_samples))
        if len(sizes) != 1:
            raise ValueError(f"the curriculum metrics cover different sample counts: {sorted(sizes)}")
        self.num_samples = sizes.pop()
        self.metrics, self.micro_batch, self.grad_accum = metrics, int(micro_batch), int(grad_accum)
        self.dp_size, self.dp_rank, self.seed = int(dp_size), int(dp_rank), int(seed)
        self.global_batch = self.micro_batch * self.dp_size * self.grad_accum
        self.step = 0  # global batches drawn
        self.generator = torch.Generator().manual_seed(self.seed)

    def difficulties(self) -> dict[str, int]:
        """Each metric's current difficulty."""
        return {name: m.pacing.current for name, m in self.metrics.items()}

    def eligible(self) -> np.ndarray:
        """Ids of the samples within every metric's current difficulty."""
        mask = np.ones(self.num_samples, dtype=bool)
        for m in self.metrics.values():
            mask &= m.eligible(m.pacing.current)
        return np.flatnonzero(mask)

    def next_global_batch(self) -> np.ndarray:
        """Advance the difficulties to this step and draw the next global batch (every rank
        draws the same one)."""
        for m in self.metrics.values():
            m.pacing.update(self.step)
        pool = self.eligible()
        if pool.size == 0:
            raise ValueError(f"curriculum step {self.step}: no sample is within the difficulties "
                             f"{self.difficulties()}")
        picks = []
        need = self.global_batch
        while need > 0:
            perm = torch.randperm(pool.size, generator=self.generator)[:need].numpy()
            picks.append(pool[perm])
            need -= perm.size
        self.step += 1
        return np.concatenate(picks)

    def rank_slice(self, global_batch: np.ndarray) -> np.ndarray:
        """This rank's share of ``global_batch``: ``[round(r·B/dp), round((r+1)·B/dp))``."""
        b = len(global_batch)
        lo, hi = round(self.dp_rank * b / self.dp_size), round((self.dp_rank + 1) * b / self.dp_size)
        return global_batch[lo:hi]

    def next_rank_batch(self) -> np.ndarray:
        """This rank's ``micro_batch × grad_accum`` sample ids of the next step."""
        return self.rank_slice(self.next_global_batch())

    def __iter__(self) -> Iterator[int]:
        while True:
            yield from (int(i) for i in self.next_rank_batch())

    def __len__(self) -> int:
        return self.num_samples // self.dp_size

    def set_position(self, global_samples: int) -> None:
        """Resume after ``global_samples`` samples (what the engine does after loading a
        checkpoint): the generator and difficulties are replayed from the seed to the step
        that many samples reach, so the next batches are those of the uninterrupted run."""
        target = int(global_samples) // self.global_batch
        if target == self.step:
            return
        self.generator.manual_seed(self.seed)
        self.step = 0
        for m in self.metrics.values():
            m.pacing.current = m.pacing.min_difficulty
        for _ in range(target):
            self.next_global_batch()

    def state_dict(self) -> dict:
        """Step, difficulties and the generator's state (a uint8 tensor)."""
        return {"step": self.step, "generator": self.generator.get_state(),
                "difficulties": self.difficulties()}

    def load_state_dict(self, sd: dict) -> None:
        """Resume from :meth:`state_dict` (the generator state as a tensor, or a list of bytes)."""
        state = sd["generator"]
        if not isinstance(state, torch.Tensor):
            state = torch.tensor(list(state), dtype=torch.uint8)
        self.generator.set_state(state.to(torch.uint8).cpu())
        self.step = int(sd["step"])
        for name, d in sd.get("difficulties", {}).items():
            if name in self.metrics:
                self.metrics[name].pacing.current = int(d)


def sampler_from_config(cfg, num_samples: int, micro_batch: int, dp_size: int, dp_rank: int,
                        grad_accum: int) -> CurriculumSampler | None:
    """The curriculum sampler of ``initialize(training_data=...)``: the index-based metrics of
    ``data_efficiency.data_sampling.curriculum_learning`` (each with ``index_to_sample_path`` and
    ``index_to_metric_path``); None when there are none. Sequence-length metrics are applied to
    batches by the training loop (as ``zeal train`` does), not by the sampler."""
    from zeal.config.data_efficiency import SEQLEN_RESHAPE, SEQLEN_TRUNCATE
    from zeal.data.analyzer import load_sample_metric

    cl = cfg.data_efficiency.curriculum()
    metrics = {}
    for name, m in (cl.curriculum_metrics.items() if cl is not None else []):
        if name in SEQLEN_TRUNCATE + SEQLEN_RESHAPE:
            continue
        if not (m.index_to_sample_path and m.index_to_metric_path):
            raise ValueError(f"curriculum metric {name!r} needs index_to_sample_path and index_to_metric_path "
                             "(written by 'zeal data analyze')")
        metrics[name] = IndexedMetric(load_sample_metric(m.index_to_sample_path, m.index_to_metric_path),
                                      Pacing.from_config(m), m.difficulty_type)
    if not metrics:
        return None
    return CurriculumSampler(metrics, micro_batch, dp_size, dp_rank, grad_accum, cfg.data_efficiency.seed,
                             num_samples=num_samples)
