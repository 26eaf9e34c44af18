"""Tensor parallelism (``"tensor_parallel": {"autotp_size": 2}``) on real gloo ranks
matches single-process plain PyTorch, composed with ZeRO over the dp dimension.

Reference: one process, the same initial model, every micro-batch of every rank at the
same parameters, AdamW and ``clip_grad_norm_`` (the clip is below the gradient norm, so
clipping acts on every step), accumulation 2, 5 steps, fp32. The tp run sums partial
products (row-parallel linears) and input gradients in another order than one matmul,
so losses agree to fp32 rounding (1e-5 absolute; a layer split wrongly is off by ~1e-1).
The bytes over tp equal Megatron's formula: per layer and micro-batch two all-reduces of
b·s·h forward and two backward (zeal counts an all-reduce as 2n logical elements).
"""

from __future__ import annotations

import pytest
import torch

from tests.dist_harness import run_ranks

pytestmark = pytest.mark.timeout(120)

STEPS, ACCUM, MICRO, SEQ, VOCAB, LR, CLIP = 5, 2, 2, 8, 64, 1e-2, 0.5
HIDDEN, LAYERS = 32, 2


def build(kind: str) -> torch.nn.Module:
    """A tiny model, the same on every rank (seeded)."""
    torch.manual_seed(0)
    if kind == "llama":  # Hugging Face Llama with GQA (4 query heads, 2 key/value heads)
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=LAYERS,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                          attn_implementation="eager")
        return LlamaForCausalLM(cfg)
    if kind == "gpt2":  # Hugging Face GPT-2 (Conv1D, fused c_attn)
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=HIDDEN, n_layer=LAYERS, n_head=4,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager")
        return GPT2LMHeadModel(cfg)
    from zeal.models.gpt import GPT, GPTConfig  # zeal's GPT, head tied to the embedding

    return GPT(GPTConfig(vocab_size=VOCAB, n_positions=SEQ, n_embd=HIDDEN, n_layer=LAYERS, n_head=4))


def loss_of(model: torch.nn.Module, kind: str, ids: torch.Tensor) -> torch.Tensor:
    out = model(input_ids=ids, labels=ids)
    return out if kind == "gpt" else out.loss


def batches(dp: int) -> torch.Tensor:
    """ids[step, accum, dp rank] of shape (MICRO, SEQ)."""
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, VOCAB, (STEPS, ACCUM, dp, MICRO, SEQ), generator=g)


def reference(kind: str, dp: int) -> list[list[list[float]]]:
    """losses[step][accum][dp rank] of plain single-process training on the global batch."""
    model = build(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    ids = batches(dp)
    out = []
    for s in range(STEPS):
        per_step = []
        for a in range(ACCUM):
            row = []
            for d in range(dp):
                loss = loss_of(model, kind, ids[s, a, d])
                (loss / (ACCUM * dp)).backward()
                row.append(loss.item())
            per_step.append(row)
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP))
        assert norm > CLIP
        opt.step()
        opt.zero_grad()
        out.append(per_step)
    return out


def config(stage: int, tp: int = 2) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": ACCUM,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.1}},
            "gradient_clipping": CLIP, "tensor_parallel": {"autotp_size": tp},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 2000,
                                  "stage3_param_persistence_threshold": 50}}


def train(rank: int, kind: str, stage: int, tp: int = 2) -> tuple[list, dict, object]:
    import zeal

    engine = zeal.initialize(build(kind), config(stage, tp))
    d = engine.mesh.dp_rank
    ids = batches(engine.mesh.dp_size)
    losses = []
    for s in range(STEPS):
        for a in range(ACCUM):
            loss = loss_of(engine, kind, ids[s, a, d])
            engine.backward(loss)
            engine.step()
            losses.append((s, a, d, loss.item()))
    return losses, engine.comm_stats()["last_step"], engine


def _ranks_main(rank: int, world: int, combos: list[tuple[str, int]]) -> dict:
    out = {}
    for kind, stage in combos:
        losses, stats, engine = train(rank, kind, stage)
        out[f"{kind}/{stage}"] = {"losses": losses, "stats": stats, "dp": engine.mesh.dp_size}
        engine.close()
    return out


def _check(results: list[dict], combos: list[tuple[str, int]]) -> None:
    refs: dict = {}
    for kind, stage in combos:
        for res in results:
            got = res[f"{kind}/{stage}"]
            dp = got["dp"]
            ref = refs.setdefault((kind, dp), reference(kind, dp))
            for s, a, d, loss in got["losses"]:
                assert loss == pytest.approx(ref[s][a][d], abs=1e-5), (kind, stage, s, a, d)
            act = got["stats"]["by_op"]["all_reduce/activation"]
            bsh = MICRO * SEQ * HIDDEN
            # per layer and micro-batch: 2 all-reduces forward + 2 backward, 2n logical each
            assert act["logical_elems"] == ACCUM * LAYERS * 4 * 2 * bsh
            assert act["bytes"] == ACCUM * LAYERS * 4 * 2 * bsh * 4 // 2  # fp32, (T-1)/T of it sent
            assert act["calls"] == ACCUM * LAYERS * 4


TP2_COMBOS = [("llama", 1), ("gpt", 3), ("gpt2", 0)]
TP2_DP2_COMBOS = [("llama", 3), ("gpt", 1)]


def test_tp2_matches_single_process():
    combos = TP2_COMBOS
    _check(run_ranks(_ranks_main, 2, combos, timeout=110), combos)


def test_tp2_dp2_matches_single_process():
    combos = TP2_DP2_COMBOS
    _check(run_ranks(_ranks_main, 4, combos, timeout=110), combos)
