"""Ulysses sequence parallelism composed with the tiled loss, MoE / expert parallelism and
pipeline parallelism, on gloo ranks, against one process on the same full sequences
(fp32; losses 1e-5 relative, gradients 1e-5 relative norm-wise plus the rounding of
reading them off fp32 parameters; see tests/parallel/test_ulysses.py).

* SP 2 + ``tiling.tiled_logits_loss`` (HF Llama, ZeRO 3; zeal Llama, ZeRO 1): each rank's
  chunk loss over row tiles, the head never projecting more than one tile.
* SP 2 × MoE with ep 2 on 2 ranks (zeal Llama, top-1 over 4 experts, no token over
  capacity): each rank routes its chunk (the sp group is more data to the router) with
  the chunk's capacity (DeepSpeed's per-rank rule); the aux loss is the whole sequences'
  (fractions all-reduced over sp), so loss and gradients equal one process's, aux loss
  included. The model is built after ``init_process_group`` (it keeps only its experts).
* SP 2 × PP 2 on 4 ranks (zeal Llama with the tiled loss, zeal GPT at a length S does
  not divide): the stages pass this rank's chunk; losses and every stage's parameters
  after the steps equal one process's.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist_harness import run_ranks
from tests.parallel.test_ulysses import LR, MICRO, batches, build, check, config, loss_of, reference

pytestmark = pytest.mark.timeout(200)

TILED = {"tiling": {"tiled_logits_loss": {"enabled": True, "num_shards": 3}}}
MOE = dict(num_experts=4, moe_every=2, top_k=1, capacity_factor=4.0, aux_loss_coef=0.1)


def build_moe(seq: int, ep: int) -> torch.nn.Module:
    from zeal.models.llama import Llama, LlamaConfig

    torch.manual_seed(0)
    return Llama(LlamaConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq,
                             ep_size=ep, **MOE))


def _rows_seen(engine) -> list[int]:
    rows: list[int] = []
    head = engine.module.get_output_embeddings() if hasattr(engine.module, "get_output_embeddings") \
        else engine.module.lm_head
    head.register_forward_hook(lambda m, i, o: rows.append(o.reshape(-1, o.size(-1)).size(0)))
    return rows


def _steps(engine, seq: int, pad: bool) -> dict:
    """test_ulysses.train's steps on a built engine: losses and gradients read off the update."""
    ids, labels = batches(seq, pad)
    losses, grads = [], []
    before = engine.module_state_dict()
    eps = torch.finfo(torch.float32).eps
    for s in range(len(ids)):
        loss = loss_of(engine(input_ids=ids[s], labels=labels[s]))
        engine.backward(loss)
        engine.step()
        after = engine.module_state_dict()
        grads.append({n: ((before[n] - after[n]) / LR, float(((before[n].abs() + after[n].abs()) * eps / LR).norm()))
                      for n in after if n in before and after[n].is_floating_point()})
        before = after
        losses.append(loss.item())
    sizes = dict(engine.mesh.sizes)
    engine.close()
    return {"losses": losses, "grads": grads, "sizes": sizes}


def _tiled_and_moe(rank: int, world: int, seq: int) -> dict:
    import zeal

    out = {"tiled": []}
    for kind, stage in (("hf_llama", 3), ("llama", 1)):
        engine = zeal.initialize(build(kind, seq), {**config(2, stage), **TILED})
        rows = _rows_seen(engine)
        out["tiled"].append({**_steps(engine, seq, True), "probe": rows})
    from zeal.moe.layer import MoE

    model = build_moe(seq, 2)  # built after init_process_group: keeps its experts only (initialised as one process)
    out["moe"] = _steps(zeal.initialize(model, config(2, 1)), seq, False)
    out["moe"]["capacity"] = [m.deepspeed_moe.gate_capacity for m in model.modules() if isinstance(m, MoE)]
    return out


def _moe_reference(seq: int) -> tuple[list, list]:
    model = build_moe(seq, 1)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    ids, labels = batches(seq, False)
    losses, grads = [], []
    for s in range(len(ids)):
        loss = model(input_ids=ids[s], labels=labels[s])
        loss.backward()
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, grads


def test_sp2_tiled_loss_hf_and_zeal_and_moe_ep2():
    """SP 2 on 2 ranks: the tiled chunk loss (HF Llama ZeRO 3, zeal Llama ZeRO 1, padding
    and ignore-index) and zeal Llama MoE with ep 2 equal one process."""
    seq = 16
    out = run_ranks(_tiled_and_moe, 2, seq, timeout=180)
    for i, kind in enumerate(("hf_llama", "llama")):
        ref = reference(kind, seq, True)
        for r in range(2):
            got = out[r]["tiled"][i]
            check(got, ref, f"{kind} sp2 tiled rank {r}")
            assert got["probe"] and max(got["probe"]) <= -(-MICRO * seq // 2 // 3)  # one tile of the chunk's rows
    from zeal.moe.gating import capacity

    ref = _moe_reference(seq)
    for r in range(2):
        got = out[r]["moe"]
        assert got["sizes"]["sp"] == 2 and got["sizes"]["ep"] == 2
        check(got, ref, f"moe sp2 ep2 rank {r}")
        # the dropping rule: capacity is the chunk's (DeepSpeed's per-rank rule), here large enough for all
        chunk = MICRO * seq // 2
        assert got["capacity"] == [capacity(chunk, MOE["num_experts"], MOE["capacity_factor"], 1)] == [chunk]


# -- PP x SP -----------------------------------------------------------------------------------
PP_M = 2  # micro-batches per step


def _pp_config(kind: str) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": PP_M,
           "optimizer": {"type": "SGD", "params": {"lr": LR}}, "sequence_parallel_size": 2,
           "zero_optimization": {"stage": 1}, "pipeline_parallel": {"size": 2, "micro_batches": PP_M}}
    return {**cfg, **TILED} if kind == "llama" else cfg


def _pp_data(seq: int, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids, labels = batches(seq, True, steps * PP_M)
    return ids.reshape(steps, PP_M, MICRO, seq), labels.reshape(steps, PP_M, MICRO, seq)


def _pp_ranks(rank: int, world: int, cases: list) -> dict:
    import zeal

    out = {}
    for kind, seq in cases:
        engine = zeal.initialize(build(kind, seq), _pp_config(kind))
        ids, labels = _pp_data(seq, 2)
        losses = [float(engine.train_batch(iter([(ids[s, m], labels[s, m]) for m in range(PP_M)])))
                  for s in range(2)]
        out[kind] = {"losses": losses, "state": engine.module_state_dict(), "sizes": dict(engine.mesh.sizes),
                     "pp_bytes": engine.comm_stats()["total"]["by_dim"].get("pp", {}).get("bytes", 0)}
        engine.close()
    return out


def _pp_reference(kind: str, seq: int) -> tuple[list, dict]:
    model = build(kind, seq)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    ids, labels = _pp_data(seq, 2)
    losses = []
    for s in range(2):
        total = 0.0
        for m in range(PP_M):
            loss = loss_of(model(input_ids=ids[s, m], labels=labels[s, m]))
            (loss / PP_M).backward()
            total += loss.item() / PP_M
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, model.state_dict()


def _check_pp(out: list, cases: list) -> None:
    for kind, seq in cases:
        ref_losses, ref_state = _pp_reference(kind, seq)
        for r, res in enumerate(out):
            got = res[kind]
            assert got["sizes"]["pp"] == 2 and got["sizes"]["sp"] == 2
            assert got["losses"] == pytest.approx(ref_losses, rel=1e-5), (kind, r)
            assert got["pp_bytes"] > 0
            for name, t in got["state"].items():
                torch.testing.assert_close(torch.as_tensor(t), ref_state[name], rtol=1e-5, atol=2e-6,
                                           msg=lambda m, n=name, k=kind, i=r: f"{k} pp2 sp2 rank {i} {n}: {m}")


@pytest.mark.slow
def test_pp2_x_sp2_on_4_ranks():
    """SP 2 inside each of 2 pipeline stages: zeal Llama (GQA, tiled loss) and zeal GPT
    (13 tokens: padded to 14) equal one process; the stages exchange chunks."""
    cases = [("llama", 16), ("gpt", 13)]
    _check_pp(run_ranks(_pp_ranks, 4, cases, timeout=190), cases)
