"""DeepSpeed-TED through ``zeal.initialize``: ``tensor_parallel.autotp_size`` composed with
MoE (attention and experts split over tp, the router whole, duplicate-token dropping
around the all-to-alls, communication-aware checkpointing).

Reference: the single-process model with every expert local (plain torch AdamW and
``clip_grad_norm_`` below the gradient norm, the global batch at once), fp32, no token
dropped (zeal's GPT: top-1 with capacity factor = experts; the DeepSpeed-signature layer
in a user model: ``drop_tokens=False``), aux-loss coefficient 0, 5 steps, ZeRO stages 0-2. TP sums partial
products in another order than one matmul, so losses agree to fp32 rounding.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from tests.dist_harness import run_ranks
from zeal.moe import MoE
from zeal.moe.recompute import comm_aware

STEPS, LR, CLIP, MICRO, SEQ, VOCAB, DIM, EXPERTS = 5, 1e-2, 0.5, 2, 8, 64, 16, 4


class UserMoE(nn.Module):
    """A user's model with DeepSpeed's layer: embedding → residual PR-MoE (top-2,
    ``nn.Sequential`` experts, sort dispatch) → LayerNorm → ``lm_head``."""

    def __init__(self, ep_size: int = 1) -> None:
        super().__init__()
        self.checkpointed = False  # the MoE under torch's checkpoint, communication-aware
        self.wte = nn.Embedding(VOCAB, DIM)
        expert = nn.Sequential(nn.Linear(DIM, 32), nn.GELU(), nn.Linear(32, DIM))
        self.moe = MoE(DIM, expert, EXPERTS, ep_size=ep_size, k=2, drop_tokens=False, use_rts=False,
                       top2_2nd_expert_sampling=False, use_residual=True, dispatch="sort")
        for g, e in self.moe.deepspeed_moe.experts.deepspeed_experts.items():  # experts start different
            gen = torch.Generator().manual_seed(100 + int(g))
            with torch.no_grad():
                for p in e.parameters():
                    p.add_(0.1 * torch.randn(p.shape, generator=gen))
        self.norm = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.wte(input_ids)
        if self.checkpointed:
            out = checkpoint(comm_aware(lambda t: self.moe(t)[0]), h, use_reentrant=False)
        else:
            out, _, _ = self.moe(h)
        logits = self.lm_head(self.norm(h + out))
        return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def build(kind: str, ep: int) -> nn.Module:
    torch.manual_seed(0)
    if kind == "user":
        return UserMoE(ep)
    from zeal.models.gpt import GPT, GPTConfig

    return GPT(GPTConfig(vocab_size=VOCAB, n_positions=SEQ, n_embd=DIM, n_layer=2, n_head=2, num_experts=EXPERTS,
                         moe_every=2, top_k=1, capacity_factor=float(EXPERTS), aux_loss_coef=0.0, ep_size=ep))


def batches(dp: int) -> torch.Tensor:
    """ids[step, dp rank] of shape (MICRO, SEQ)."""
    return torch.randint(0, VOCAB, (STEPS, dp, MICRO, SEQ), generator=torch.Generator().manual_seed(7))


def reference(kind: str, dp: int, after: dict | None = None) -> list[float]:
    """Per-step losses of the single-process model; ``after["model"]``: the model after them."""
    model = build(kind, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    losses = []
    for ids in batches(dp):
        ids = ids.reshape(-1, SEQ)
        loss = model(ids, labels=ids)
        loss.backward()
        assert float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)) > CLIP
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    if after is not None:
        after["model"] = model
    return losses


def config(stage: int, **extra) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": CLIP,
            "tensor_parallel": {"autotp_size": 2}, "zero_optimization": {"stage": stage},
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}}, **extra}


def train(model: nn.Module, stage: int, drop_duplicates: bool = True, save: str | None = None, **extra) -> dict:
    import zeal
    from zeal.moe import moe_layers

    engine = zeal.initialize(model, config(stage, **extra))
    layers = moe_layers(engine.module)
    for m in layers:
        m.deepspeed_moe.drop_duplicates = drop_duplicates
    ids = batches(engine.mesh.dp_size)
    losses, a2a, control = [], [], []
    for step in ids:
        x = step[engine.mesh.dp_rank]
        loss = engine(x, labels=x)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
        ops = engine.comm_stats()["last_step"]["by_op"]
        c = ops.get("all_to_all/moe", {"bytes": 0, "calls": 0})
        a2a.append((c["calls"], c["bytes"], layers[0].deepspeed_moe.gate_capacity))
        control.append(ops.get("all_reduce/control", {"calls": 0})["calls"])
    state = {k: v.clone() for k, v in engine.module.state_dict().items()}
    if save is not None:
        engine.save_checkpoint(save, tag="tp2ep2")
    engine.close()
    return {"losses": losses, "a2a": a2a, "control": control, "dp": engine.mesh.dp_rank, "state": state}


def _tp_ep(rank: int, world: int, root: str) -> dict:
    # every model is built before the first initialize joins the job (a layer built after
    # init_process_group keeps rank % ep_size's experts, which under tp is not its ep rank)
    m = {key: build("user" if key.startswith("user") else "gpt", 2)
         for key in ("gpt", "gpt_full", "user", "user0", "user_cac", "gpt_ckpt", "gpt_cac")}
    m["user_cac"].checkpointed = True
    ckpt = {"activation_checkpointing": {}}
    cac = {"activation_checkpointing": {"communication_aware": True}}
    return {"gpt": train(m["gpt"], 1, save=root), "gpt_full": train(m["gpt_full"], 1, drop_duplicates=False),
            "user": train(m["user"], 2), "user0": train(m["user0"], 0), "user_cac": train(m["user_cac"], 2), "gpt_ckpt": train(m["gpt_ckpt"], 1, **ckpt),
            "gpt_cac": train(m["gpt_cac"], 1, **cac)}


def _tp_only(rank: int, world: int) -> dict:
    return {"gpt": train(build("gpt", 1), 2), "user": train(build("user", 1), 1)}


def mean_losses(runs: list[dict], dp: int) -> list[float]:
    """The global loss of each step: the mean over dp ranks (tp ranks agree)."""
    for r in runs:
        same = [q for q in runs if q["dp"] == r["dp"]]
        assert all(q["losses"] == r["losses"] for q in same)  # the tp ranks of a group agree exactly
    firsts = {r["dp"]: r["losses"] for r in runs}
    return [sum(firsts[d][i] for d in range(dp)) / dp for i in range(STEPS)]


def load_in_one_process(root: str) -> nn.Module:
    """The TP 2 x EP 2 checkpoint loaded by a single process with every expert local."""
    import zeal

    engine = zeal.initialize(build("gpt", 1), config(0, tensor_parallel={"autotp_size": 1}))
    engine.load_checkpoint(root, tag="tp2ep2")
    return engine.module


@pytest.mark.timeout(200)
def test_tp2_ep2_matches_single_process_and_dedups_all_to_all(tmp_path):
    from zeal.moe.mappings import a2a_bytes_per_call

    results = run_ranks(_tp_ep, 4, str(tmp_path), timeout=190)
    after: dict = {}
    for kind, key in (("gpt", "gpt"), ("gpt", "gpt_full"), ("user", "user"), ("user", "user0")):
        got = mean_losses([r[key] for r in results], 2)
        assert got == pytest.approx(reference(kind, 2, after if key == "gpt" else None), rel=1e-5, abs=1e-5), key
    # the checkpoint holds the whole model: in one process it gives the reference's logits
    loaded, ref = load_in_one_process(str(tmp_path)).eval(), after["model"].eval()
    ids = torch.randint(0, VOCAB, (3, SEQ), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids), ref(ids), rtol=1e-4, atol=1e-5)
    for r in results:
        for (calls, nbytes, cap), (calls_full, full, cap_full) in zip(r["gpt"]["a2a"], r["gpt_full"]["a2a"]):
            assert cap == cap_full == MICRO * SEQ  # top-1, capacity factor = experts: C = tokens per rank
            assert calls == calls_full == 4  # one MoE layer: 2 all-to-alls forward, 2 backward
            assert nbytes == 4 * a2a_bytes_per_call(EXPERTS, cap, DIM, 4, ep=2, tp=2) == full // 2
            assert full == 4 * a2a_bytes_per_call(EXPERTS, cap, DIM, 4, ep=2, tp=2, drop_duplicates=False)
        # communication-aware checkpointing: the recompute issues no all-to-all, and the
        # training is the non-checkpointed one (losses and every parameter)
        assert [c for c, _, _ in r["gpt_ckpt"]["a2a"]] == [6] * STEPS  # plain checkpointing exchanges again
        assert [c for c, _, _ in r["gpt_cac"]["a2a"]] == [4] * STEPS
        assert r["gpt_cac"]["a2a"] == r["gpt"]["a2a"]
        # a user's own torch checkpoint wrapped in comm_aware, drop_tokens=False: neither the
        # all-to-alls nor the capacity's max over ep are issued again
        assert r["user_cac"]["a2a"] == r["user"]["a2a"] and r["user_cac"]["control"] == r["user"]["control"]
        assert r["user_cac"]["losses"] == pytest.approx(r["user"]["losses"], rel=1e-6, abs=1e-7)
        for key in ("gpt_ckpt", "gpt_cac"):
            assert r[key]["losses"] == pytest.approx(r["gpt"]["losses"], rel=1e-6, abs=1e-7)
            for name, t in r["gpt"]["state"].items():
                torch.testing.assert_close(torch.as_tensor(r[key]["state"][name]), torch.as_tensor(t),
                                           rtol=1e-6, atol=1e-7, msg=lambda m, n=name, k=key: f"{k} {n}: {m}")


@pytest.mark.timeout(120)
def test_tp2_with_local_experts_matches_single_process():
    results = run_ranks(_tp_only, 2, timeout=110)
    for kind in ("gpt", "user"):
        got = mean_losses([r[kind] for r in results], 1)
        assert got == pytest.approx(reference(kind, 1), rel=1e-5, abs=1e-5), kind
