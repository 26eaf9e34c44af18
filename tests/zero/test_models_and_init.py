"""Stage-3 construction from the meta device, Hugging Face models under every stage,
and client optimizers/schedulers passed in by the user."""

from __future__ import annotations

import pytest
import torch

from tests.dist_harness import run_ranks
from zeal.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)


def _meta_build(rank, world):
    import zeal

    engine = zeal.initialize(lambda: GPT(CFG), {"zero_optimization": {"stage": 3,
                                                                      "stage3_param_persistence_threshold": 0}})
    mem = engine.memory_breakdown()
    assert mem["gathered_now"] == 0
    # no unit keeps its full buffer after materialisation (persistent ones aside)
    assert all(u.full.untyped_storage().nbytes() == 0 for u in engine._p.units if not u.persistent)
    state = engine.module_state_dict()
    x = torch.randint(0, 64, (2, 16))
    for _ in range(2):  # a model built from meta trains
        engine.backward(engine(x, labels=x))
        engine.step()
    return state, mem


@pytest.mark.timeout(120)
def test_meta_construction_is_sharded_and_independent_of_world_size():
    one = _meta_build(0, 1)  # in-process, world size 1
    two = run_ranks(_meta_build, 2, timeout=100)
    psi = CFG.num_parameters()
    for state, mem in two:
        assert mem["params"] <= 4 * psi // 2 + 4 * 64, mem  # fp32 shard: Ψ/N plus per-unit padding
        for k, v in one[0].items():
            assert torch.equal(torch.from_numpy(state[k]), v), k
    st = one[0]
    assert torch.equal(st["transformer.h.0.ln_1.weight"], torch.ones(32))
    assert torch.equal(st["transformer.h.0.attn.c_attn.bias"], torch.zeros(96))
    assert 0.015 < st["transformer.h.0.mlp.c_fc.weight"].std().item() < 0.025
    assert st["lm_head.weight"] is not None and torch.equal(st["lm_head.weight"], st["transformer.wte.weight"])


def _hf_model():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=50, n_positions=16, n_embd=24, n_layer=2, n_head=2, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


def _hf_batches(world):
    g = torch.Generator().manual_seed(3)
    return [[torch.randint(0, 50, (2, 12), generator=g) for _ in range(world)] for _ in range(4)]


def _hf_train(rank, world):
    import zeal

    out = {}
    for stage in (0, 1, 2, 3):
        engine = zeal.initialize(_hf_model(), {"train_micro_batch_size_per_gpu": 2,
                                               "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
                                               "zero_optimization": {"stage": stage}})
        losses = []
        for batch in _hf_batches(world):
            out_obj = engine({"input_ids": batch[rank], "labels": batch[rank]})
            engine.backward(out_obj)  # a ModelOutput with .loss
            engine.step()
            losses.append(out_obj.loss.item())
        out[stage] = losses
    return out


@pytest.mark.timeout(200)
def test_hugging_face_model_trains_under_every_stage():
    pytest.importorskip("transformers")
    ref = _hf_model()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ref_losses = []
    for batch in _hf_batches(2):
        per_rank = [ref(input_ids=b, labels=b).loss for b in batch]
        ref_losses.append([x.item() for x in per_rank])
        (sum(per_rank) / 2).backward()
        opt.step()
        opt.zero_grad()
    results = run_ranks(_hf_train, 2, timeout=180)
    for rank, res in enumerate(results):
        for stage, losses in res.items():
            for step, loss in enumerate(losses):
                assert abs(loss - ref_losses[step][rank]) < 1e-5, (stage, rank, step, loss, ref_losses[step][rank])


def test_client_optimizer_groups_and_scheduler_are_kept():
    import zeal

    torch.manual_seed(0)
    model = GPT(CFG)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    engine = zeal.initialize(model, {"zero_optimization": {"stage": 2}}, optimizer=opt, lr_scheduler=sched)
    assert engine.optimizer is opt and len(opt.param_groups) == 2
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    x = torch.randint(0, 64, (2, 16))
    for _ in range(2):
        engine.backward(engine(x, labels=x))
        engine.step()
    assert engine.lr_scheduler is sched and opt.param_groups[0]["lr"] == pytest.approx(0.01 / 3)
