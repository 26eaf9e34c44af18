"""Vocabulary-parallel embedding, head and cross-entropy (:mod:`zeal.parallel.vocab`) on
real gloo ranks.

* The cross-entropy from each rank's slice of the logits equals ``F.cross_entropy`` of the
  whole logits (value, and the gradient of each slice; rows with ``ignore_index`` -100;
  mean, sum and per-row reductions), and its Comm counts exactly one max all-reduce of N
  floats and one all-reduce of N (sum-exp, target-logit) pairs.
* Training at TP 2 and TP 2 × DP 2 with ZeRO stages 1 and 3 (the stage/model pairs that
  ``test_tensor_parallel.py`` does not run), a Hugging Face Llama with GQA and a zeal GPT
  with a tied head: every step's loss equals single-process plain PyTorch (the reference
  of ``test_tensor_parallel.py``: accumulation 2, clipping on, fp32, 5 steps), the whole
  state comes back from the slices, and the vocabulary traffic per step is the formula
  (per micro-batch: the embedding's all-reduce of b·s·h forward, the head input's of
  b·s·h backward, and the loss's 3 floats per scored row).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.dist_harness import run_ranks
from tests.parallel.test_tensor_parallel import (
    ACCUM,
    HIDDEN,
    MICRO,
    SEQ,
    VOCAB,
    _check,
    batches,
    build,
    config,
    train,
)

pytestmark = pytest.mark.timeout(120)

N, V = 12, 10  # rows and vocabulary of the cross-entropy check


def test_a_vocabulary_the_tp_size_does_not_divide_keeps_the_head_whole():
    from transformers import LlamaConfig, LlamaForCausalLM

    from zeal.parallel.tensor import TensorParallel
    from zeal.parallel.vocab import apply_vocab_parallel

    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB - 1, hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2))
    tp = TensorParallel(comm=None, size=2, rank=0)
    assert apply_vocab_parallel(model, tp) is None
    assert model.lm_head.weight.shape == (VOCAB - 1, 16) and not tp.splits
    assert not hasattr(model.lm_head, "vocab_parallel")


def _ce_case(rank: int) -> dict:
    """This rank's losses and slice gradients, next to the whole-logits reference."""
    from zeal.dist.context import init_distributed
    from zeal.dist.mesh import build_mesh
    from zeal.parallel.vocab import vocab_parallel_cross_entropy

    mesh = build_mesh(init_distributed("gloo"), tp=2)
    g = torch.Generator().manual_seed(3)
    whole = torch.randn(N, V, generator=g) * 3
    target = torch.randint(0, V, (N,), generator=g)
    target[[1, 6]] = -100
    target[2], target[3] = V // 2 - 1, V // 2  # either side of the split
    up = torch.randn(N, generator=g)
    per = V // 2
    out = {}
    for reduction in ("mean", "sum", "none"):
        mesh.stats.step.clear()
        ref_in = whole.clone().requires_grad_(True)
        ref = F.cross_entropy(ref_in, target, ignore_index=-100, reduction=reduction)
        (ref * up).sum().backward() if reduction == "none" else ref.backward()
        mine = whole[:, rank * per:(rank + 1) * per].clone().requires_grad_(True)
        got = vocab_parallel_cross_entropy(mine, target, rank * per, mesh.tp, reduction=reduction)
        (got * up).sum().backward() if reduction == "none" else got.backward()
        stats = mesh.stats.step[("all_reduce", "vocab", "tp")]
        out[reduction] = {"got": got.detach(), "ref": ref.detach(), "grad": mine.grad,
                          "ref_grad": ref_in.grad[:, rank * per:(rank + 1) * per],
                          "calls": stats.calls, "logical": stats.logical_elems, "bytes": stats.bytes}
    return out


def _whole_logits(kind: str) -> dict:
    """Without labels the vocabulary-parallel head gives whole logits (generation and
    evaluation need them); a Hugging Face forward with labels exposes this rank's slice."""
    import zeal

    ids = batches(1)[0, 0, 0]
    ref = build(kind)(input_ids=ids)
    engine = zeal.initialize(build(kind), config(1))
    with torch.no_grad():
        got = engine(input_ids=ids)
        labelled = engine(input_ids=ids, labels=ids)
    engine.close()
    if kind != "gpt":
        got, ref = got.logits, ref.logits
    out = {"got": got, "ref": ref.detach()}
    if kind != "gpt":
        out["local_cols"] = labelled.logits.size(-1)
    return out


def _ranks(rank: int, world: int, combos: list[tuple[str, int]]) -> dict:
    out = {"ce": _ce_case(rank), "logits": {k: _whole_logits(k) for k in ("gpt", "llama")}} if world == 2 else {}
    for kind, stage in combos:
        losses, stats, engine = train(rank, kind, stage)
        splits = engine.tensor_parallel.splits
        out[f"{kind}/{stage}"] = {"losses": losses, "stats": stats, "dp": engine.mesh.dp_size,
                                  "head": tuple(splits["lm_head.weight"].segments)}
        if kind == "gpt":
            out["gpt_state"] = engine.module_state_dict()
            out["tied"] = splits["transformer.wte.weight"] == splits["lm_head.weight"]
            out["tied_param"] = engine.module.lm_head.weight is engine.module.transformer.wte.weight
        engine.close()
    return out


def _check_vocab(results: list[dict], combos: list[tuple[str, int]]) -> None:
    _check(results, combos)  # losses of every step, the tp activation formula, the whole GPT state
    bsh = MICRO * SEQ * HIDDEN
    for r, res in enumerate(results):
        for kind, stage in combos:
            got = res[f"{kind}/{stage}"]
            tp_rank = r % 2
            assert got["head"] == ((0, tp_rank * VOCAB // 2, VOCAB // 2),)
            rows = MICRO * (SEQ - 1 if kind == "gpt" else SEQ)  # HF pads the shifted labels; zeal slices
            vocab = got["stats"]["by_op"]["all_reduce/vocab"]
            assert vocab["calls"] == ACCUM * 4, (kind, stage)
            assert vocab["logical_elems"] == ACCUM * (2 * bsh + 2 * bsh + 2 * rows + 2 * 2 * rows), (kind, stage)
            assert "all_gather/vocab" not in got["stats"]["by_op"]  # whole logits never gathered
        if "tied" in res:
            assert res["tied"] and res["tied_param"]


def test_vocab_parallel_cross_entropy_and_tp2_training():
    combos = [("llama", 3), ("gpt", 1)]
    results = run_ranks(_ranks, 2, combos, timeout=110)
    for res in results:
        for reduction, c in res["ce"].items():
            assert torch.allclose(torch.as_tensor(c["got"]), torch.as_tensor(c["ref"]), atol=1e-5), reduction
            assert torch.allclose(torch.as_tensor(c["grad"]), torch.as_tensor(c["ref_grad"]), atol=1e-6), reduction
            assert c["calls"] == 2 and c["logical"] == 2 * N + 2 * 2 * N  # max of N, then N pairs
            assert c["bytes"] == (N + 2 * N) * 4  # fp32, 2n logical, half of it sent at T = 2
        for kind, c in res["logits"].items():
            got, ref = torch.as_tensor(c["got"]), torch.as_tensor(c["ref"])
            assert got.shape == ref.shape and torch.allclose(got, ref, atol=1e-5), kind
        assert res["logits"]["llama"]["local_cols"] == VOCAB // 2
    _check_vocab(results, combos)


def test_vocab_parallel_tp2_dp2_training():
    combos = [("llama", 1), ("gpt", 3)]
    _check_vocab(run_ranks(_ranks, 4, combos, timeout=110), combos)
