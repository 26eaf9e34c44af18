"""Padding-free passes (zeal.rlhf.packing): the packed row's per-token log-probs, losses and
gradients equal the padded batch's (1e-6) for Llama (RoPE, grouped K/V) and GPT (learned
positions); SFT, DPO and GRPO steps with ``padding_free`` give the padded runs' losses and
weights."""

import copy

import pytest
import torch

from zeal.rlhf.formulas import token_logprobs
from zeal.rlhf.packing import pack_rows, packed_logprobs

pytestmark = pytest.mark.timeout(120)

ROWS = [[1, 2, 3, 4, 5, 6], [7, 8], [9, 10, 11, 12], [13, 14, 15]]


def _padded(rows, pad=0):
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), width - 1)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r) - 1] = 1.0
    return ids, mask


def _gpt():
    from zeal.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4))


def test_pack_rows_positions_restart():
    p = pack_rows([[5, 6, 7], [8], [9, 10]])
    assert p.ids.tolist() == [[5, 6, 7, 8, 9, 10]] and p.positions.tolist() == [[0, 1, 2, 0, 0, 1]]
    assert p.bounds == [(0, 3), (3, 4), (4, 6)]
    with pytest.raises(ValueError):
        pack_rows([[1], []])


@pytest.mark.parametrize("family", ["llama", "gpt"])
@pytest.mark.parametrize("start", [0, 1])
def test_packed_equals_padded_logprobs_and_grads(family, start):
    from tests.rlhf.test_hybrid import tiny_llama

    model = tiny_llama() if family == "llama" else _gpt()
    ids, mask = _padded(ROWS)
    ref = token_logprobs(model(ids), ids)[:, start:] * mask[:, start:]
    w = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1))
    (ref * w).sum().backward()
    g_ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    lp = packed_logprobs(model, ROWS, start)
    assert lp.shape == ref.shape
    torch.testing.assert_close(lp * mask[:, start:], ref, rtol=0, atol=1e-6)
    (lp * mask[:, start:] * w).sum().backward()
    for a, b in zip(model.parameters(), g_ref):
        torch.testing.assert_close(a.grad, b, rtol=0, atol=1e-6)
    lp2, ent = packed_logprobs(model, ROWS, start, with_entropy=True)
    assert (ent[mask[:, start:].bool()] > 0).all() and (ent[~mask[:, start:].bool()] == 0).all()


def _sft_rows():
    return [{"prompt": [1, 2, 3], "completion": [4, 5, 6, 7]}, {"prompt": [8], "completion": [9, 10]},
            {"prompt": [11, 12], "completion": [13]}, {"prompt": [14, 15, 16, 17], "completion": [18, 19, 20]}]


@pytest.mark.parametrize("job", ["sft", "dpo"])
def test_offline_jobs_padding_free_equal_padded(job):
    from tests.rlhf.test_hybrid import tiny_llama
    from zeal import rlhf

    if job == "sft":
        data = _sft_rows()
    else:
        data = [{"prompt": [1, 2, 3], "chosen": [4, 5, 6], "rejected": [7]},
                {"prompt": [8], "chosen": [9], "rejected": [10, 11, 12, 13]},
                {"prompt": [14, 15], "chosen": [16, 17], "rejected": [18, 19]}]
    runs = []
    for free in (False, True):
        cfg = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
               "rlhf": {"steps": 3, "batch_size": 2, "padding_free": free, "chat": False}}
        res = getattr(rlhf, job)(tiny_llama(), data, cfg, eos_token_ids=[0])
        runs.append((res.metrics, res.engine.module_state_dict()))
    (m0, w0), (m1, w1) = runs
    for a, b in zip(m0, m1):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6)
    for k in w0:
        torch.testing.assert_close(w1[k], w0[k], rtol=0, atol=1e-6)


def test_grpo_train_pass_padding_free_equals_padded():
    import zeal
    from tests.rlhf.test_grpo_family import _rollouts
    from tests.rlhf.test_hybrid import CFG, tiny_llama
    from zeal.rlhf.config import RLHFConfig
    from zeal.rlhf.grpo_trainer import _train_on

    model = tiny_llama()
    rollouts, lps = _rollouts(model)
    for r, row in zip(rollouts, lps):
        r.logprobs = row
    rollouts[1].loss_mask = [1, 0] + [1] * (len(rollouts[1].output_ids) - 2)  # a tool token in the middle
    ref = copy.deepcopy(model).eval().requires_grad_(False)
    cfg = {**CFG, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2}
    out = []
    for kw in ({"share_prompt": False}, {"share_prompt": True}, {"padding_free": True}):
        rc = RLHFConfig(num_generations=2, beta=0.04, loss_type="dapo", ppo_epochs=2, **kw)
        engine = zeal.initialize(copy.deepcopy(model), cfg)
        stats = _train_on(engine, ref, rollouts, torch.tensor([1.0, 0.0, 0.0, 1.0]), 0, rc)
        out.append((stats, engine.module_state_dict()))
        engine.close()
    for stats, w in out[1:]:
        assert stats["loss"] == pytest.approx(out[0][0]["loss"], abs=1e-6)
        assert stats["entropy"] == pytest.approx(out[0][0]["entropy"], abs=1e-5)
        for k in w:  # two AdamW steps of lr 1e-2: g/√v turns a gradient's rounding (~1e-9) into ~1e-6
            torch.testing.assert_close(w[k], out[0][1][k], rtol=0, atol=1e-5)
