"""Stage 3 parameter lifecycle: when a gathered unit may go, and what is gathered again."""

from __future__ import annotations

import pytest
import torch

from tests.dist_harness import run_ranks
from tests.train.models import TinyNet, make_batches


def _run(rank, world, reuse):
    import zeal

    torch.manual_seed(0)
    model = TinyNet(tied=True, frozen=False)
    seen = []

    def check(grad):  # the gradient reaching the embedding's output: only its backward is left
        seen.append(model.emb.weight.untyped_storage().nbytes())

    def watch(module, args, out):
        if out.requires_grad:
            out.register_hook(check)

    model.emb.register_forward_hook(watch)
    engine = zeal.initialize(model, {
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                              "stage3_max_reuse_distance": reuse}})
    for step in make_batches(3, 1, world, 2):
        x, y = step[0][rank]
        engine.backward(engine((x, y)))
        engine.step()
    gathered = engine.comm_stats()["last_step"]["by_kind"]["param"]["logical_elems"]
    return seen, gathered


@pytest.mark.timeout(120)
def test_tied_embedding_is_released_after_the_head_backward_and_never_regathered():
    """The head shares the embedding's weight: its backward is the weight's last reader
    (the embedding's backward reads indices only), so the unit is freed before the
    embedding's backward runs, although its gradient is not complete until then."""
    (seen, gathered), _ = run_ranks(_run, 2, 0, timeout=100)
    assert seen and all(n == 0 for n in seen), seen
    # with a large reuse distance the unit is kept from its forward use to its backward use:
    # fewer elements gathered, but never more than with distance 0
    (seen_far, gathered_far), _ = run_ranks(_run, 2, 10**9, timeout=100)
    assert gathered_far <= gathered
