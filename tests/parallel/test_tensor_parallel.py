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
SAVE_AT = 3  # the TP 2 x DP 2 run saves before this step; TP 1 resumes from it


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
    if kind == "zllama":  # zeal's Llama with GQA
        from zeal.models.llama import Llama, LlamaConfig

        return Llama(LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=LAYERS,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ))
    from zeal.models.gpt import GPT, GPTConfig  # zeal's GPT, head tied to the embedding

    return GPT(GPTConfig(vocab_size=VOCAB, n_positions=SEQ, n_embd=HIDDEN, n_layer=LAYERS, n_head=4))


def loss_of(model: torch.nn.Module, kind: str, ids: torch.Tensor) -> torch.Tensor:
    out = model(input_ids=ids, labels=ids)
    return out if kind in ("gpt", "zllama") else out.loss


def batches(dp: int) -> torch.Tensor:
    """ids[step, accum, dp rank] of shape (MICRO, SEQ)."""
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, VOCAB, (STEPS, ACCUM, dp, MICRO, SEQ), generator=g)


def reference(kind: str, dp: int, final: dict | None = None) -> list[list[list[float]]]:
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
    if final is not None:
        final.update({k: v.detach().clone() for k, v in model.state_dict().items()})
    return out


def config(stage: int, tp: int = 2) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": ACCUM,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.1}},
            "gradient_clipping": CLIP, "tensor_parallel": {"autotp_size": tp},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 2000,
                                  "stage3_param_persistence_threshold": 50}}


def train(rank: int, kind: str, stage: int, save_dir: str | None = None) -> tuple[list, dict, object]:
    """5 steps at TP 2; with ``save_dir``, a checkpoint after step SAVE_AT."""
    import zeal

    engine = zeal.initialize(build(kind), config(stage))
    d = engine.mesh.dp_rank
    ids = batches(engine.mesh.dp_size)
    losses = []
    for s in range(STEPS):
        if save_dir is not None and s == SAVE_AT:
            engine.save_checkpoint(save_dir, tag="mid")
        for a in range(ACCUM):
            loss = loss_of(engine, kind, ids[s, a, d])
            engine.backward(loss)
            engine.step()
            losses.append((s, a, d, loss.item()))
    return losses, engine.comm_stats()["last_step"], engine


def norm_check(engine) -> float:
    """Only tp rank 1's shard of a split parameter has the largest gradient (3), and a
    replicated parameter has gradient 2 on every tp rank: the global norm is sqrt(13)."""
    from zeal.zero.optimizer import unscale_check_clip

    zopt = engine._p.zero_optimizer
    grads = [torch.zeros_like(m) for m in zopt.masters]
    segs = [(i, lo, split) for i, unit_segs in enumerate(zopt.grad_norm.segments) for lo, _, split in unit_segs]
    i, lo, _ = next(x for x in segs if x[2])
    if engine.tensor_parallel.rank == 1:
        grads[i].view(-1)[lo] = 3.0
    j, lo2, _ = next(x for x in segs if not x[2])
    grads[j].view(-1)[lo2] = 2.0
    _, norm = unscale_check_clip(grads, engine.mesh.dp, zopt.stage, None, 1.0, zopt.grad_norm)
    assert float(grads[j].view(-1)[lo2]) == pytest.approx(2.0 / 13 ** 0.5, rel=1e-5)  # clipped by that norm
    return norm


def refusals() -> list[str]:
    """What a TP 2 run says for heads it cannot split and for a layer of an unknown family."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import zeal
    from zeal.config import ConfigError

    out = []
    odd = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=24, intermediate_size=32, num_hidden_layers=1,
                                       num_attention_heads=6, num_key_value_heads=3))
    unknown = torch.nn.Sequential(torch.nn.Embedding(VOCAB, 8), torch.nn.Linear(8, VOCAB))
    for model in (odd, unknown):
        with pytest.raises(ConfigError) as e:
            zeal.initialize(model, config(1))
        out.append(str(e.value))
    return out


def meta_init_losses() -> tuple[float, float]:
    """A model built on the meta device (a factory) is initialised at full size and
    sliced: at TP 2 its first loss equals the TP 1 one."""
    import zeal

    ids = batches(1)[0, 0, 0]
    out = []
    for tp in (2, 1):
        engine = zeal.initialize(lambda: build("gpt"), config(1, tp))
        with torch.no_grad():
            out.append(loss_of(engine, "gpt", ids).item())
        engine.close()
    return out[0], out[1]


def _ranks_main(rank: int, world: int, combos: list[tuple[str, int]], save_dir: str | None) -> dict:
    out = {}
    for kind, stage in combos:
        losses, stats, engine = train(rank, kind, stage, save_dir if kind == "llama" else None)
        out[f"{kind}/{stage}"] = {"losses": losses, "stats": stats, "dp": engine.mesh.dp_size}
        if world == 2 and kind == "llama":
            out["norm"] = norm_check(engine)
        if kind == "gpt":  # whole tensors assembled from the tp slices
            out["gpt_state"] = engine.module_state_dict()
        engine.close()
    if world == 2:
        out["refusals"] = refusals()
        out["meta"] = meta_init_losses()
    return out


def _resume_tp1(rank: int, world: int, save_dir: str, export_dir: str) -> dict:
    """Load the TP 2 x DP 2 checkpoint at TP 1 x DP 1 (a micro-batch holding both dp ranks'
    micro-batches), train the remaining steps; export the checkpoint to one HF folder."""
    import zeal
    from zeal.checkpoint.export import export_hf

    cfg = {**config(1, tp=1), "train_micro_batch_size_per_gpu": MICRO * 2}
    engine = zeal.initialize(build("llama"), cfg)
    engine.load_checkpoint(save_dir, tag="mid")
    loaded = engine.module_state_dict()
    ids = batches(2)
    losses = []
    for s in range(SAVE_AT, STEPS):
        for a in range(ACCUM):
            loss = loss_of(engine, "llama", torch.cat([ids[s, a, 0], ids[s, a, 1]]))
            engine.backward(loss)
            engine.step()
            losses.append((s, a, loss.item()))
    export_hf(f"{save_dir}/mid", export_dir)
    return {"losses": losses, "loaded": loaded}


def _check(results: list[dict], combos: list[tuple[str, int]]) -> dict:
    refs: dict = {}
    for kind, stage in combos:
        for res in results:
            got = res[f"{kind}/{stage}"]
            dp = got["dp"]
            if (kind, dp) not in refs:
                refs[(kind, dp)] = reference(kind, dp, refs.setdefault(("state", kind, dp), {}))
            ref = refs[(kind, dp)]
            for s, a, d, loss in got["losses"]:
                assert loss == pytest.approx(ref[s][a][d], abs=1e-5), (kind, stage, s, a, d)
            act = got["stats"]["by_op"]["all_reduce/activation"]
            bsh = MICRO * SEQ * HIDDEN
            # per layer and micro-batch: 2 all-reduces forward + 2 backward, 2n logical each
            assert act["logical_elems"] == ACCUM * LAYERS * 4 * 2 * bsh
            assert act["bytes"] == ACCUM * LAYERS * 4 * 2 * bsh * 4 // 2  # fp32, (T-1)/T of it sent
            assert act["calls"] == ACCUM * LAYERS * 4
            assert got["stats"]["by_dim"]["tp"]["bytes"] >= act["bytes"]
            # T divides the vocabulary: embedding and head are vocabulary-parallel (zeal.parallel.vocab)
            assert got["stats"]["by_op"]["all_reduce/vocab"]["calls"] == ACCUM * 4, (kind, stage)
            if kind == "gpt":
                final = refs[("state", kind, dp)]
                for name, v in res["gpt_state"].items():
                    assert torch.allclose(torch.as_tensor(v), final[name], atol=1e-4), name
    return refs


def test_tp2_matches_single_process():
    combos = [("llama", 1), ("gpt", 3), ("gpt2", 0), ("zllama", 2)]
    results = run_ranks(_ranks_main, 2, combos, None, timeout=110)
    _check(results, combos)
    for res in results:
        assert res["norm"] == pytest.approx(13 ** 0.5, rel=1e-6)
        heads, unknown = res["refusals"]
        assert "does not divide the 3 key/value heads of module 'model.layers.0.self_attn'" in heads
        assert "cannot split module '1' (Linear)" in unknown
        tp2, tp1 = res["meta"]
        assert tp2 == pytest.approx(tp1, abs=1e-5)


def test_tp2_dp2_matches_single_process_and_resumes_at_tp1(tmp_path):
    combos = [("llama", 3), ("gpt", 1)]
    save = str(tmp_path / "ckpt")
    refs = _check(run_ranks(_ranks_main, 4, combos, save, timeout=110), combos)
    ref = refs[("llama", 2)]
    (res,) = run_ranks(_resume_tp1, 1, save, str(tmp_path / "hf"), timeout=60)
    assert len(res["losses"]) == (STEPS - SAVE_AT) * ACCUM
    for s, a, loss in res["losses"]:  # the micro-batch of both dp ranks at once: their mean loss
        assert loss == pytest.approx((ref[s][a][0] + ref[s][a][1]) / 2, abs=1e-5), (s, a)
    from safetensors.torch import load_file

    exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
    loaded = res["loaded"]
    assert exported["model.layers.0.self_attn.k_proj.weight"].shape == (16, HIDDEN)
    for name, v in exported.items():  # one HF folder, the values the TP 1 engine loaded
        assert torch.equal(v, torch.as_tensor(loaded[name])), name
