"""engine.dataloader resumes where a checkpoint left it: same batches as an uninterrupted run."""

from __future__ import annotations

import torch

import zeal
from tests.train.models import VOCAB, TinyNet
from zeal.data.sampler import ResumableDistributedSampler


class _Data(torch.utils.data.Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(5)
        self.x = torch.randint(0, VOCAB, (23, 6), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.x[i]


def _engine():
    torch.manual_seed(0)
    return zeal.initialize(TinyNet(), {"train_micro_batch_size_per_gpu": 2}, training_data=_Data())


def _batches(engine, n):
    out, it = [], iter(engine.dataloader)
    while len(out) < n:
        try:
            x, y = next(it)
        except StopIteration:  # next epoch
            it = iter(engine.dataloader)
            continue
        engine.backward(engine((x, y)))
        engine.step()
        out.append(x)
    return out


def test_resume_replays_the_same_batches(tmp_path):
    straight = _batches(_engine(), 30)  # 11 batches of 2 per epoch (23 samples): crosses two epochs
    for cut in (7, 13):  # mid-epoch, and after an epoch boundary
        first = _engine()
        _batches(first, cut)
        first.save_checkpoint(str(tmp_path), tag=f"t{cut}")
        resumed = _engine()
        resumed.load_checkpoint(str(tmp_path), tag=f"t{cut}")
        after = _batches(resumed, 30 - cut)
        assert all(torch.equal(a, b) for a, b in zip(after, straight[cut:])), cut


def test_ranks_draw_distributed_samplers_order():  # DeepSpeed's loader: DistributedSampler, padded
    for drop_last in (False, True):
        for r in range(3):
            ours = list(ResumableDistributedSampler(10, 3, r, seed=1, batch_size=3, drop_last=drop_last))
            torch_order = list(torch.utils.data.DistributedSampler(range(10), 3, r, seed=1))
            assert ours == (torch_order[:3] if drop_last else torch_order)  # 4 each: one batch of 3
