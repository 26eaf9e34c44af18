"""A distributed sampler that draws DeepSpeed's batches (the order of torch's
``DistributedSampler``, which DeepSpeed's data loader uses) and whose position is a
function of the samples consumed, so a resumed run replays exactly the batches an
uninterrupted run would have seen."""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch


class ResumableDistributedSampler(torch.utils.data.Sampler[int]):
    """The indices ``torch.utils.data.DistributedSampler(num_replicas=world, rank=rank,
    seed=seed, shuffle=shuffle)`` yields: a permutation seeded ``seed + epoch``, padded by
    repeating its head to a multiple of ``world``, rank r taking every world-th from r.
    With ``drop_last`` this rank's last partial micro-batch is left out (the loader's
    ``drop_last``); otherwise it is drawn. As DeepSpeed's loader the epoch changes only
    by :meth:`set_epoch`: every pass repeats the order. :meth:`set_position` (global
    samples consumed, ``batch_size × world`` per micro-batch) resumes mid-pass."""

    def __init__(self, num_samples: int, world: int, rank: int, seed: int = 0, shuffle: bool = True,
                 batch_size: int = 1, drop_last: bool = False) -> None:
        per_rank = math.ceil(num_samples / world) if num_samples > 0 else 0
        batches = per_rank // batch_size if drop_last else math.ceil(per_rank / batch_size)
        if batches < 1:
            raise ValueError(f"dataset of {num_samples} samples is smaller than one micro-batch of "
                             f"{batch_size} on each of {world} ranks (dataloader_drop_last)")
        self.n, self.world, self.rank, self.seed, self.shuffle = num_samples, world, rank, seed, shuffle
        self.batch_size, self.drop_last = batch_size, drop_last
        self.per_rank, self.batches = per_rank, batches
        self.epoch = 0
        self.skip = 0  # this rank's samples to skip at the start of the next pass

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle for ``epoch`` (``DistributedSampler.set_epoch``)."""
        self.epoch = int(epoch)

    def set_position(self, global_samples: int) -> None:
        """Start the next pass after ``global_samples`` (a count of whole micro-batches)."""
        micro_batches = int(global_samples) // (self.batch_size * self.world)
        self.skip = (micro_batches % self.batches) * self.batch_size

    def rank_indices(self) -> list[int]:
        """This rank's indices for the current epoch, the last partial batch included."""
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.n, generator=g).tolist()
        else:
            order = list(range(self.n))
        pad = self.per_rank * self.world - self.n
        if pad:
            order += (order * math.ceil(pad / len(order)))[:pad]
        return order[self.rank::self.world]

    def _count(self) -> int:
        return self.batches * self.batch_size if self.drop_last else self.per_rank

    def __iter__(self) -> Iterator[int]:
        skip, self.skip = self.skip, 0  # the pass after this one starts at the beginning
        yield from self.rank_indices()[skip:self._count()]

    def __len__(self) -> int:
        return self._count() - self.skip
