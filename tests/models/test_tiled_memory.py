"""The tiled loss's and TiledMLP's parameter gradients: same values, no full-size temporaries.

Reference: plain autograd on the untiled head (fp32, 1e-6 as in test_tiled.py) and the
generic tile path (the head hidden behind a lambda, so the bias-free ``nn.Linear`` path is
not taken). Memory: every CPU allocation of the backward, replayed from ``torch.profiler``.
Before the fix, a bf16 head's backward held the fp32 sum, a whole fp32 copy of each tile's
gradient (``fp32.add_(bf16)`` converts its operand first) and the tile's bf16 gradient:
at least 10 bytes per head element; now the sum and the final bf16 gradient, 6.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from zeal.models.tiled import ADD_SLICE_ELEMS, add_into, tiled_logits_loss, tiled_rows

TOL = 1e-6


def _close(a: torch.Tensor, b: torch.Tensor, tol: float = TOL) -> None:
    assert torch.allclose(a, b, rtol=tol, atol=tol), (a - b).abs().max().item()


@pytest.mark.parametrize("shards,vocab", [(1, 50), (3, 50), (7, 50), (3, 11)])  # 11 < 20 rows: tile by tile
def test_bias_free_head_equals_cross_entropy(shards, vocab):
    torch.manual_seed(1)
    head = nn.Linear(16, vocab, bias=False)
    h = torch.randn(20, 16, requires_grad=True)
    y = torch.randint(0, vocab, (20,))
    y[[0, 7, 8, 19]] = -100
    ref = F.cross_entropy(head(h), y, ignore_index=-100, reduction="sum")
    ref.backward()
    ref_grads = [head.weight.grad.clone(), h.grad.clone()]
    head.zero_grad()
    h.grad = None
    total, count = tiled_logits_loss(head, h, y, shards, params=[head.weight])
    (total / count).backward()
    _close(total, ref)
    for g, r in zip([head.weight.grad, h.grad], ref_grads):
        _close(g, r / 16)


def test_bias_free_bf16_head_as_close_as_generic_tiles():
    """bf16: the sliced path (softmax in place, weight gradient by slices) is as close to a float64
    reference as the generic tile path (autograd per tile); both are one bf16 rounding from it."""
    torch.manual_seed(2)
    head = nn.Linear(64, 3000, bias=False).to(torch.bfloat16)
    h0 = torch.randn(96, 64).to(torch.bfloat16)
    y = torch.randint(0, 3000, (96,))
    y[:9] = -100
    w64 = head.weight.detach().double().requires_grad_(True)
    h64 = h0.double().requires_grad_(True)
    F.cross_entropy(h64 @ w64.t(), y, reduction="sum").backward()
    errs = []
    for project in (head, lambda x: head(x)):  # the lambda takes the generic path
        h = h0.clone().requires_grad_(True)
        head.zero_grad()
        total, _ = tiled_logits_loss(project, h, y, 5, params=[head.weight], vocab=3000)
        total.backward()
        errs.append([((g.double() - r).abs().max() / r.abs().max()).item()
                     for g, r in ((head.weight.grad, w64.grad), (h.grad, h64.grad))])
    (fast_w, fast_x), (gen_w, gen_x) = errs
    assert fast_w <= 1.25 * gen_w + 1e-3 and fast_x <= 1.25 * gen_x + 1e-3, errs
    assert max(fast_w, fast_x) < 8e-3, errs  # within bf16 rounding (2^-8 relative)


def test_add_into_slices_equal_one_add():
    torch.manual_seed(3)
    acc = torch.randn(ADD_SLICE_ELEMS * 2 + 17)
    g = torch.randn(acc.numel()).to(torch.bfloat16)
    ref = acc + g.float()
    add_into(acc, g)
    assert torch.equal(acc, ref)


def _peak_bytes(fn) -> int:
    """The peak of bytes allocated above the start while ``fn`` runs (CPU, from the profiler)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events, todo = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while todo:
        node = todo.pop()
        if node.typed[0] == _EventType.Allocation and node.typed[1].device.type == "cpu":
            events.append((node.start_time_ns, node.typed[1].alloc_size))
        todo.extend(node.children)
    level = peak = 0
    for _, size in sorted(events):
        level += size
        peak = max(peak, level)
    return peak


def test_bf16_head_backward_holds_no_full_size_temporaries():
    """The head's backward holds its weight-sized gradient (2 bytes an element in bf16) and slices:
    no fp32 sum over the tiles (4 more), no tile's full gradient (2) nor its fp32 copy (4)."""
    torch.manual_seed(4)
    vocab, hidden = 32768, 256  # 8M head elements: 8 slices of SLICE_ELEMS
    head = nn.Linear(hidden, vocab, bias=False).to(torch.bfloat16)
    h = torch.randn(64, hidden).to(torch.bfloat16).requires_grad_(True)
    y = torch.randint(0, vocab, (64,))
    total, _ = tiled_logits_loss(head, h, y, 4, params=[head.weight], vocab=vocab)
    peak = _peak_bytes(total.backward)
    # the gradient (2) + a slice's fp32 sum, fp32 weight, product and its fp32 copy (about 14 MiB in all)
    assert peak < 4.5 * vocab * hidden, f"{peak / (vocab * hidden):.2f} bytes per head element"


def test_tiled_mlp_backward_adds_bf16_tiles_in_slices():
    torch.manual_seed(5)
    mlp = nn.Sequential(nn.Linear(256, 8192, bias=False), nn.ReLU(), nn.Linear(8192, 256, bias=False))
    mlp = mlp.to(torch.bfloat16)
    x = torch.randn(64, 256).to(torch.bfloat16).requires_grad_(True)
    out = tiled_rows(mlp, x, 4, list(mlp.parameters()))
    peak = _peak_bytes(lambda: out.float().sum().backward())
    elems = sum(p.numel() for p in mlp.parameters())
    # measured 7.0 bytes per element (fp32 sums, a tile's bf16 gradients, the tile's activations); the
    # old whole-size fp32 copy of one weight's tile gradient made it 8.0
    assert peak < 7.5 * elems, f"{peak / elems:.2f} bytes per parameter element"


def test_bf16_head_tile_backward_holds_one_fp32_tile_of_logits():
    """A long tile and a small head: the tile's logits dominate. Autograd's backward of the
    cross-entropy holds the log-softmax, its incoming and its outgoing gradient (three fp32
    tiles); the in-place softmax holds one (plus the bf16 logits and their gradient)."""
    torch.manual_seed(6)
    vocab, hidden, rows = 16384, 16, 256
    head = nn.Linear(hidden, vocab, bias=False).to(torch.bfloat16)
    h = torch.randn(rows, hidden).to(torch.bfloat16).requires_grad_(True)
    y = torch.randint(0, vocab, (rows,))
    peaks = []
    for project in (head, lambda x: head(x)):  # the lambda takes the generic path (autograd per tile)
        total, _ = tiled_logits_loss(project, h, y, 1, params=[head.weight], vocab=vocab)
        peaks.append(_peak_bytes(total.backward) / (rows * vocab * 4))
    fast, generic = peaks
    assert fast < 2.5 < generic, peaks


@pytest.mark.parametrize("hold", [True, False])
def test_zero3_gathers_the_head_once_per_tile_loop(hold):
    """ZeRO-3 (one process): with the coordinator's ``holding`` (what the engine hands the tiled
    loss) the head's unit is gathered once in forward and once in backward, whatever the tile
    count; without it (a caller that passes no ``hold``) around every tile's call, 3 per tile."""
    import zeal
    from zeal.models.llama import Llama, LlamaConfig

    cfg = LlamaConfig(vocab_size=4000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    engine = zeal.initialize(lambda: Llama(cfg), {
        "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "tiling": {"tiled_logits_loss": {"enabled": True, "num_shards": 5}}})
    policy = engine.module.checkpoint_policy
    assert policy.hold_params is not None
    if not hold:
        policy.hold_params = None
    coord = engine._p.coordinator
    head_unit = coord._unit_of[id(engine.module.lm_head.weight)]
    gathers = []
    real = coord.coll.gather
    coord.coll.gather = lambda u, backward: (gathers.append(u.index), real(u, backward))[1]
    ids = torch.randint(0, 4000, (1, 100), generator=torch.Generator().manual_seed(1))
    engine.backward(engine(ids, labels=ids))
    engine.step()
    assert gathers.count(head_unit.index) == (2 if hold else 3 * 5)
