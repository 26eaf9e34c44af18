"""Checkpoints of expert-parallel runs: saved at EP 2 (2 gloo ranks, ZeRO 1), resumed at
EP 2 bit-exactly, and loaded at EP 1 × DP 2 (stage 2), EP 2 at stage 3 (experts
partitioned over the expert-data group), EP 4 (stage 2), EP 2 × DP 2 (stages 1 and 3)
and in one process (EP 1, stage 0).

Oracles: the uninterrupted EP 2 run's losses (exact at the same layout; to fp32
rounding at another one, whose global batch is the same: drop_tokens=False makes the
model independent of the expert split); and the state itself: every resharded load
saves again, and both checkpoints, assembled into full tensors (masters, Adam moments,
step), are ``torch.equal`` (a box written twice or missing fails the assembly). The
HF-folder export of the EP 2 checkpoint and ``engine.module_state_dict()`` at EP 2 hold
every expert, equal to the single-process model's state after the load.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tests.checkpoint.test_resume_reshard import _same, assemble
from tests.dist_harness import run_ranks
from tests.moe.models import EXPERTS, TinyMoENet, batches

STEPS, SAVED_AT, LR, CLIP, BATCH = 5, 2, 1e-2, 0.5, 4


def _config(stage: int, world: int) -> dict:
    return {"train_micro_batch_size_per_gpu": BATCH // world, "gradient_clipping": CLIP,
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 200},
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01, "fused": False}}}


def _train(engine, rank: int, world: int, steps: range) -> list[float]:
    data = batches(STEPS, world, micro=BATCH // world)
    losses = []
    for s in steps:
        loss = engine(*data[s][rank])
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses


def _engine(ep: int, stage: int, world: int, seed: int):
    import zeal

    torch.manual_seed(seed)  # a different init each time: everything must come from the checkpoint
    model = TinyMoENet(ep_size=ep)
    for n, p in model.named_parameters():
        if n.endswith(".2.bias"):  # a frozen expert tensor: outside ZeRO's units, held by its ep rank only
            p.requires_grad_(False)
    return zeal.initialize(model, _config(stage, world))


def _two_ranks(rank: int, world: int, root: str) -> dict:
    engine = _engine(2, 1, world, 0)
    _train(engine, rank, world, range(SAVED_AT))
    engine.save_checkpoint(root, tag="ep2")
    experts = sorted({n.split(".")[4] for n, _ in engine.module.named_parameters() if ".experts." in n})
    out = {"straight": _train(engine, rank, world, range(SAVED_AT, STEPS)), "experts": experts}
    engine = _engine(2, 1, world, 1)
    engine.load_checkpoint(root, tag="ep2")
    out["full_state"] = engine.module_state_dict()  # every expert, gathered over ep
    out["resume"] = _train(engine, rank, world, range(SAVED_AT, STEPS))
    engine = _engine(1, 2, world, 2)  # every expert on both ranks, stage 2
    engine.load_checkpoint(root, tag="ep2")
    engine.save_checkpoint(root, tag="ep2_to_ep1dp2")
    out["ep1dp2"] = _train(engine, rank, world, range(SAVED_AT, STEPS))
    engine = _engine(2, 3, world, 5)  # stage 3 (small units kept gathered: refreshed over edp at load)
    engine.load_checkpoint(root, tag="ep2")
    engine.save_checkpoint(root, tag="ep2_to_s3")
    out["ep2s3"] = _train(engine, rank, world, range(SAVED_AT, STEPS))
    out["mixtral"] = _mixtral_ep2(root, rank)
    return out


def _mixtral_cfg(ep: int):
    from zeal.models import LlamaConfig

    return LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, num_experts=4,
                       moe_every=1, top_k=2, ep_size=ep)


def _mixtral_ep2(root: str, rank: int) -> dict:
    """A zeal Llama with an MoE MLP in every layer (Mixtral's layout), one step at EP 2, saved."""
    import zeal
    from zeal.models import Llama

    torch.manual_seed(5)
    engine = zeal.initialize(Llama(_mixtral_cfg(2)), _config(1, 2))
    x = torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(6))[2 * rank:2 * rank + 2]
    engine.backward(engine({"input_ids": x, "labels": x}))
    engine.step()
    engine.save_checkpoint(f"{root}/mixtral", tag="ep2")
    return engine.module_state_dict()


def _four_ranks(rank: int, world: int, root: str) -> dict:
    out = {}
    for ep, stage in ((4, 2), (2, 1), (2, 3)):  # EP 4; EP 2 x expert-data 2 (stage 3: experts over edp)
        engine = _engine(ep, stage, world, 3)
        engine.load_checkpoint(root, tag="ep2")
        engine.save_checkpoint(root, tag=f"ep2_to_ep{ep}s{stage}")
        out[(ep, stage)] = _train(engine, rank, world, range(SAVED_AT, STEPS))
    return out


def _mean(per_rank: list[list[float]]) -> list[float]:
    return [sum(x) / len(per_rank) for x in zip(*per_rank)]


@pytest.mark.timeout(150)
def test_expert_parallel_checkpoint_resume_and_reshard(tmp_path):
    from zeal.checkpoint.export import export_hf

    root = str(tmp_path)
    two = run_ranks(_two_ranks, 2, root, timeout=100)
    assert [r["experts"] for r in two] == [["0", "1"], ["2", "3"]]  # saved by each rank: its own experts
    straight = _mean([r["straight"] for r in two])
    for r in two:
        assert r["resume"] == r["straight"]  # same layout: exact
        assert r["ep1dp2"] == pytest.approx(r["straight"], rel=1e-5, abs=1e-6)
        assert r["ep2s3"] == pytest.approx(r["straight"], rel=1e-5, abs=1e-6)
    full = assemble(tmp_path / "ep2")
    assert {k for k in full if k.startswith("param/") and ".experts." in k} == {
        f"param/moe.deepspeed_moe.experts.deepspeed_experts.{g}.{i}.{w}"
        for g in range(EXPERTS) for i in (0, 2) for w in ("weight", "bias")}
    _same(full, assemble(tmp_path / "ep2_to_ep1dp2"), "EP 2 -> EP 1 x DP 2, stage 1 -> 2")
    _same(full, assemble(tmp_path / "ep2_to_s3"), "EP 2, stage 1 -> 3")

    four = run_ranks(_four_ranks, 4, root, timeout=100)
    for ep, stage in ((4, 2), (2, 1), (2, 3)):
        _same(full, assemble(tmp_path / f"ep2_to_ep{ep}s{stage}"), f"EP 2 -> EP {ep} on 4 ranks, stage {stage}")
        assert _mean([r[(ep, stage)] for r in four]) == pytest.approx(straight, rel=1e-5, abs=1e-6), ep

    # one process, every expert local: saved by 4 ranks (EP 2 x expert-data 2, stages 1 and 3),
    # by 2 at stage 3 and by 2 (EP 2)
    for tag in ("ep2_to_ep2s1", "ep2_to_ep2s3", "ep2_to_s3", "ep2"):
        engine = _engine(1, 0, 1, 4)
        engine.load_checkpoint(root, tag=tag)
        state = engine.module_state_dict()
        engine.save_checkpoint(root, tag=f"{tag}_to_ep1")
        _same(full, assemble(tmp_path / f"{tag}_to_ep1"), f"{tag} -> one process")
        assert _train(engine, 0, 1, range(SAVED_AT, STEPS)) == pytest.approx(straight, rel=1e-5, abs=1e-6), tag

    export_hf(tmp_path / "ep2", tmp_path / "hf")  # every expert, from both ranks' files
    exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert exported.keys() == state.keys()
    for r in two:
        _same(r["full_state"], state, "module_state_dict at EP 2 vs one process")
    for k, v in exported.items():
        assert torch.equal(v, state[k]), k
        assert torch.equal(v, full[f"param/{k}"]), k
    assert np.isfinite(straight).all()
    _check_mixtral_export(tmp_path, two[0]["mixtral"])


def _check_mixtral_export(tmp_path, state: dict) -> None:
    """The EP 2 checkpoint of the Mixtral-shaped Llama exports as a Mixtral folder that
    transformers loads, with the logits of the zeal model holding every expert."""
    from transformers import AutoModelForCausalLM

    from zeal.checkpoint.export import export_hf
    from zeal.models import Llama

    export_hf(tmp_path / "mixtral", tmp_path / "hf_mixtral")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf_mixtral", dtype=torch.float32).eval()
    assert type(hf).__name__ == "MixtralForCausalLM"
    ref = Llama(_mixtral_cfg(1)).eval()
    ref.load_state_dict({k: torch.as_tensor(v) for k, v in state.items()}, strict=True)
    x = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, ref(x), rtol=1e-5, atol=1e-5)


def test_moe_exports_that_have_no_hf_layout_are_refused_by_name():
    from zeal.checkpoint.export import ZEAL_GPT, ZEAL_LLAMA, _plan
    from zeal.checkpoint.files import CheckpointError
    from zeal.models.hf_moe import mixtral_name_to_hf

    cfg = _mixtral_cfg(1)
    with pytest.raises(CheckpointError, match="GPT-2 has no MoE layout"):
        _plan({"model": {"class": ZEAL_GPT, "config": {"num_experts": 4}}, "state_dict_keys": {}})
    for bad, what in (({"moe_every": 2}, "moe_every 2"), ({"top_k": 1}, "top_k 1")):
        meta = {"model": {"class": ZEAL_LLAMA, "config": {**vars(cfg), **bad}}, "state_dict_keys": {}}
        with pytest.raises(CheckpointError, match=f"Mixtral only with .*{what}"):
            _plan(meta)
    e = "model.layers.1.mlp.moe.deepspeed_moe.experts.deepspeed_experts.3"
    assert mixtral_name_to_hf(f"{e}.up_proj.weight") == "model.layers.1.block_sparse_moe.experts.3.w3.weight"
    assert mixtral_name_to_hf("model.layers.0.mlp.moe.deepspeed_moe.gate.wg.weight") == \
        "model.layers.0.block_sparse_moe.gate.weight"
