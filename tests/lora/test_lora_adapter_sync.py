"""Adapter-only weight sync (RLHF with LoRA): the hybrid engine's serving copy holds the
base once; after training steps a sync moves the adapters alone, the serving model's
parameters keep their storage and bytes (data_ptr and SHA-256 of every parameter before
and after), and greedy generations equal a merged reference (``W + s B A`` computed here
from the trained factors, a plain module decoding with full forwards).

Tolerance: fp32, log-probs within 1e-4 of the merged reference (the serving side computes
``W x + s B (A x)``, the reference ``(W + s B A) x``: a few ulps apart), and at least 1e-3
away from the untrained base (the adapters are followed, not ignored)."""

from __future__ import annotations

import hashlib

import pytest
import torch

from tests.lora.lora_cases import engine_config, write_initial_adapter, zeal_losses, zeal_model
from tests.needs import needs

pytestmark = needs("transformers", "peft")

PROMPTS = [[1, 2, 3], [5, 9, 11, 13, 2], [7]]


def fingerprint(model: torch.nn.Module) -> dict[str, tuple[int, str]]:
    """Per parameter: its storage address and the SHA-256 of its bytes."""
    return {n: (p.data_ptr(), hashlib.sha256(p.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest())
            for n, p in model.named_parameters()}


def merged_reference(engine) -> torch.nn.Module:
    """A fresh copy of the base with each adapter folded in (``W + s B A``, fp32)."""
    from zeal.lora.apply import find_lora

    state = engine.module_state_dict()
    ref = zeal_model()
    sd = ref.state_dict()
    for name, mod in find_lora(engine.module).items():
        w = sd[f"{name}.weight"] if mod.weight is not None else mod.base_weight(torch.float32)  # QLoRA: dequantized
        sd[f"{name}.weight"] = w + mod.scaling * (
            state[f"{name}.lora_B.weight"] @ state[f"{name}.lora_A.weight"])
    ref.load_state_dict(sd)
    return ref.eval()


def adapter_sync_case(rank: int, world: int, folder: str, stage: int, via_snapshot: bool = False, **extra) -> dict:
    """Train, sync (or snapshot + load_snapshot: the async rollouts' path), generate;
    returns what the test checks (every rank runs it)."""
    import zeal
    from tests.rlhf.test_hybrid import greedy_reference
    from zeal.inference.sampling_params import SamplingParams
    from zeal.lora.apply import find_lora
    from zeal.rlhf.hybrid import HybridEngine

    engine = zeal.initialize(zeal_model(), engine_config(folder, stage, **extra))
    hybrid = HybridEngine(engine, kv_cache_bytes=1 << 20, dtype=torch.float32)
    serving = hybrid.llm.engine.runner.model
    before = fingerprint(serving)
    zeal_losses(engine, rank if world > 1 else None)
    gathered = []
    coord = getattr(engine._p, "coordinator", None)
    if coord is not None:  # which units a sync gathers
        gather = coord._gather_now
        coord._gather_now = lambda u: (gathered.extend(u.names), gather(u))[1]
    n = hybrid.load_snapshot(hybrid.snapshot_weights()) if via_snapshot else hybrid.sync_weights()
    if coord is not None:
        coord._gather_now = gather
    outs = hybrid.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), sync=False)
    ref, base = merged_reference(engine), zeal_model().eval()
    worst, off_base = 0.0, 0.0
    for p, o in zip(PROMPTS, outs):
        toks, lps = greedy_reference(ref, p, 6)
        assert o.output_ids == toks, (o.output_ids, toks)
        worst = max(worst, max(abs(a - b) for a, b in zip(o.logprobs, lps)))
        with torch.no_grad():
            base_lp = torch.log_softmax(base(torch.tensor([p + o.output_ids]))[0, len(p) - 1:-1], -1)
        off_base = max(off_base, max(abs(float(base_lp[i, t]) - o.logprobs[i]) for i, t in enumerate(o.output_ids)))
    after = fingerprint(serving)
    n_lora = len(find_lora(engine.module))
    engine.close()
    return {"n": n, "n_lora": n_lora, "worst": worst, "off_base": off_base, "untouched": before == after,
            "gathered": gathered, "changed": sorted(k for k in before if before[k] != after[k])[:3]}


def check(res: dict, stage: int) -> None:
    assert res["untouched"], f"serving base parameters rewritten by the sync: {res['changed']}"
    assert res["n"] == 2 * res["n_lora"]  # the factors alone
    assert res["worst"] < 1e-4, res["worst"]
    assert res["off_base"] > 1e-3, res["off_base"]
    if stage == 3:
        assert res["gathered"] and all(".lora_" in n for n in res["gathered"]), res["gathered"][:4]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("quant", ["none", "int8"])
def test_adapter_only_sync_keeps_base_bytes_zero0(tmp_path, quant):
    """int8: through snapshot_weights / load_snapshot (the async rollouts' path)."""
    write_initial_adapter(tmp_path)
    lora = {"enabled": True, "adapter": str(tmp_path), "quantize_base": quant, "quant_block_size": 16}
    check(adapter_sync_case(0, 1, str(tmp_path), 0, quant != "none", lora=lora), 0)


def test_serving_adapters_refuse_a_mismatched_model():
    from zeal.config.lora import LoraConfig
    from zeal.lora.apply import apply_lora
    from zeal.rlhf.adapter_sync import ServingAdapters

    actor = zeal_model()
    state = apply_lora(actor, LoraConfig(enabled=True, r=2, target_modules=["q_proj"]))
    other = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match="no module"):
        ServingAdapters(other, state.modules)
