"""The tensor-parallel RNG tracker (:mod:`zeal.parallel.rng`).

* Unit: a fork runs on its own seeded stream, continues it on the next fork and leaves
  the default generator where it was (compared with plain ``torch.Generator`` draws).
* 2 gloo ranks, TP 2, Hugging Face GPT-2 with dropout: draws made where the model's own
  dropout modules run — the attention-probability dropout (this rank's heads: a split
  region) and the residual dropout after the row-parallel output and the embedding
  dropout (replicated) — differ over the tp ranks inside split regions and are equal
  outside them.
* 2 gloo ranks, TP 2, dropout on, a zeal GPT (attention dropout inside the split pair,
  embedding dropout outside) and GPT-2: with activation checkpointing, the losses and
  gradient norms of 2 steps equal the run without it (the recompute replays both streams;
  without the replay the split regions' masks change and the norms are off by ~1e-2).
"""

from __future__ import annotations

import pytest
import torch

from tests.dist_harness import run_ranks
from tests.parallel.test_tensor_parallel import HIDDEN, LAYERS, SEQ, VOCAB, batches, config

pytestmark = pytest.mark.timeout(120)


def test_fork_uses_its_own_stream_and_restores_the_default():
    from zeal.parallel.rng import RNGTracker

    tracker = RNGTracker()
    tracker.add("s", 11)
    torch.manual_seed(5)
    expect_default = torch.rand(4, generator=torch.Generator().manual_seed(5))
    stream = torch.Generator().manual_seed(11)
    with tracker.fork("s"):
        a = torch.rand(3)
    with tracker.fork("s"):
        b = torch.rand(3)
    assert torch.equal(a, torch.rand(3, generator=stream)) and torch.equal(b, torch.rand(3, generator=stream))
    assert torch.equal(torch.rand(4), expect_default)
    with pytest.raises(KeyError, match="no state 'other'"):
        tracker.enter("other")


def _gpt2(dropout: float) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=HIDDEN, n_layer=LAYERS, n_head=4,
                                      resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
                                      attn_implementation="eager"))


def _zgpt(dropout: float) -> torch.nn.Module:
    from zeal.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=VOCAB, n_positions=SEQ, n_embd=HIDDEN, n_layer=LAYERS, n_head=4, dropout=dropout))


def _draws() -> dict[str, list]:
    """A draw where each dropout module of GPT-2's first block (and the embedding's) runs."""
    import zeal

    engine = zeal.initialize(_gpt2(0.1), config(1))
    draws: dict[str, list] = {}
    blk = engine.module.transformer.h[0]
    # the attention-probability dropout is functional: it runs in the region right after c_attn
    where = {"attn_region": blk.attn.c_attn, "resid_dropout": blk.attn.resid_dropout,
             "mlp_dropout": blk.mlp.dropout, "embd_dropout": engine.module.transformer.drop}
    for name, mod in where.items():
        mod.register_forward_hook(lambda m, a, o, name=name: draws.setdefault(name, []).append(torch.rand(4)))
    ids = batches(1)[0, 0, 0]
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.close()
    return draws


def _train(kind: str, ckpt: bool) -> dict:
    import zeal

    cfg = config(1)
    if ckpt:
        cfg["activation_checkpointing"] = {}
    engine = zeal.initialize(_zgpt(0.2) if kind == "zgpt" else _gpt2(0.2), cfg)
    ids = batches(1)
    losses, norms = [], []
    for s in range(2):
        for a in range(2):
            out = engine(input_ids=ids[s, a, 0], labels=ids[s, a, 0])
            loss = out if kind == "zgpt" else out.loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        norms.append(engine.grad_norm)
    state = engine.module_state_dict()
    engine.close()
    return {"losses": losses, "norms": norms, "state": state}


def _ranks(rank: int, world: int) -> dict:
    out = {"draws": _draws()}
    for kind in ("zgpt", "gpt2"):
        out[kind] = {ckpt: _train(kind, ckpt) for ckpt in (False, True)}
    return out


def test_tp_rng_regions_and_checkpoint_replay():
    r0, r1 = run_ranks(_ranks, 2, timeout=110)
    for name in ("resid_dropout", "mlp_dropout", "embd_dropout"):  # replicated activations: same masks
        assert all(torch.equal(torch.as_tensor(x), torch.as_tensor(y))
                   for x, y in zip(r0["draws"][name], r1["draws"][name], strict=True)), name
    assert not torch.equal(torch.as_tensor(r0["draws"]["attn_region"][0]),  # this rank's heads: own masks
                           torch.as_tensor(r1["draws"]["attn_region"][0]))
    for res in (r0, r1):
        for kind in ("zgpt", "gpt2"):
            plain, ckpt = res[kind][False], res[kind][True]
            assert ckpt["losses"] == pytest.approx(plain["losses"], abs=1e-6), kind
            assert ckpt["norms"] == pytest.approx(plain["norms"], rel=1e-6), kind
            for name, v in plain["state"].items():
                # Adam's first steps are ±lr wherever a gradient is not ~0: a mask mismatch moves many
                assert torch.allclose(torch.as_tensor(ckpt["state"][name]), torch.as_tensor(v), atol=1e-4), name
