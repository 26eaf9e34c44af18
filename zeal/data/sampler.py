"""A distributed sampler whose position is a function of the samples consumed, so a
resumed run replays exactly the batches an uninterrupted run would have seen."""

from __future__ import annotations

from collections.abc import Iterator

import torch


class ResumableDistributedSampler(torch.utils.data.Sampler[int]):
    """Each epoch is a seeded permutation of the dataset truncated to a whole number of
    global micro-batches (``world × batch_size``, so a loader with ``drop_last`` never
    drops more and consumption counts stay aligned with epochs); the global stream is read ``world`` samples at a time and rank r
    takes the r-th of each group (as ``DistributedSampler`` with ``drop_last``).
    ``set_position(global_samples)`` resumes mid-epoch; each new iteration continues
    where the previous epoch ended."""

    def __init__(self, num_samples: int, world: int, rank: int, seed: int = 0, shuffle: bool = True,
                 batch_size: int = 1) -> None:
        step = world * batch_size
        if num_samples < step:
            raise ValueError(f"dataset of {num_samples} samples is smaller than one global micro-batch "
                             f"({batch_size} × world {world})")
        self.n, self.world, self.rank, self.seed, self.shuffle = num_samples, world, rank, seed, shuffle
        self.per_epoch = (num_samples // step) * step
        self.position = 0  # global samples consumed before the next iteration starts

    def set_position(self, global_samples: int) -> None:
        self.position = int(global_samples)

    def _order(self, epoch: int) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.n)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.n, generator=g)

    def __iter__(self) -> Iterator[int]:
        epoch, offset = divmod(self.position, self.per_epoch)
        order = self._order(epoch)
        self.position = (epoch + 1) * self.per_epoch  # the next iteration is the next epoch
        for i in range(offset + self.rank, self.per_epoch, self.world):
            yield int(order[i])

    def __len__(self) -> int:
        return (self.per_epoch - self.position % self.per_epoch) // self.world
