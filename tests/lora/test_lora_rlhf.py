"""LoRA in RLHF: the reference policy is the base with adapters off (the same module, no
copy) and its log-probs equal the base model's after the adapters have trained; DPO with
``lora`` trains only adapters against the base's reference log-probs; the hybrid engine's
sync stream carries merged weights (equal to merge_and_unload), at ZeRO 0 and ZeRO 3.

Tolerance: the view runs the very same module with the update skipped, so its log-probs
equal the base's to fp32 rounding of the same ops (1e-5 absolute)."""

from __future__ import annotations

import pytest
import torch

from tests.lora.lora_cases import VOCAB, engine_config, write_initial_adapter, zeal_losses, zeal_model
from tests.needs import needs

pytestmark = needs("transformers", "peft")


def _lp(model, ids):
    from zeal.rlhf.batch import policy_logprobs

    with torch.no_grad():
        return policy_logprobs(model, ids)


def test_reference_is_the_base_with_adapters_off(tmp_path):
    import zeal
    from zeal.rlhf.adapters import AdapterlessView, reference_policy

    write_initial_adapter(tmp_path)
    cfg = engine_config(tmp_path)
    base = zeal_model()
    model = zeal_model()
    ref = reference_policy(model, cfg)
    assert isinstance(ref, AdapterlessView) and ref.module is model  # no second copy
    engine = zeal.initialize(model, cfg)
    zeal_losses(engine, None)
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(3))
    want = _lp(base, ids)
    torch.testing.assert_close(_lp(ref, ids), want, rtol=0, atol=1e-5)
    assert (_lp(engine.module, ids) - want).abs().max() > 1e-3  # the policy itself moved
    assert engine.module.model.layers[0].self_attn.q_proj.adapter_enabled  # switched back on
    engine.close()
    with pytest.raises(ValueError, match="modules_to_save"):
        reference_policy(model, {"lora": {"enabled": True, "modules_to_save": ["lm_head"]}})


def test_dpo_with_lora_reference_equals_base(tmp_path):
    from zeal.rlhf import dpo
    from zeal.rlhf.batch import sequence_logprob

    write_initial_adapter(tmp_path / "init")
    g = torch.Generator().manual_seed(0)
    rows = [{"prompt": torch.randint(1, VOCAB, (5,), generator=g).tolist(),
             "chosen": torch.randint(1, VOCAB, (4,), generator=g).tolist(),
             "rejected": torch.randint(1, VOCAB, (4,), generator=g).tolist()} for _ in range(8)]
    cfg = {**engine_config(tmp_path / "init"), "rlhf": {"steps": 2, "batch_size": 2, "max_prompt_len": 8}}
    cfg.pop("train_micro_batch_size_per_gpu")
    res = dpo(zeal_model(), rows, cfg, eos_token_ids=[0])
    trainable = [n for n, p in res.engine.module.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n in trainable)
    plain_cfg = {k: v for k, v in cfg.items() if k != "lora"}
    plain = dpo(zeal_model(), rows, plain_cfg, eos_token_ids=[0])  # without LoRA: the base's own log-probs
    for k in ("ref_chosen", "ref_rejected"):
        torch.testing.assert_close(res.extra[k], plain.extra[k], rtol=0, atol=1e-5)
    base = zeal_model().eval()
    with torch.no_grad():  # and they are the base's sequence log-probs, not the adapter's
        want = sequence_logprob(base, *_packed(rows))
    torch.testing.assert_close(plain.extra["ref_chosen"], want, rtol=0, atol=1e-5)
    plain.engine.close()
    res.engine.close()


def _packed(rows):
    from zeal.rlhf.batch import pack
    from zeal.rlhf.config import RLHFConfig
    from zeal.rlhf.data import encode_pair

    rc = RLHFConfig(max_prompt_len=8)
    pairs = [encode_pair(r, None, [0], rc) for r in rows]
    b = pack([p for p, _, _ in pairs], [c for _, c, _ in pairs], 0)
    return b.ids, b.mask


def _sync(rank, world, folder, stage):
    import zeal
    from zeal.lora.merge import merge_and_unload
    from zeal.rlhf.adapters import sync_stream

    engine = zeal.initialize(zeal_model(), engine_config(folder, stage))
    zeal_losses(engine, rank if world > 1 else None)
    got = {n: t.clone() for n, t in sync_stream(engine)}
    with engine.gathered_parameters():
        want = {n: p.detach().clone() for n, p in merge_and_unload(engine.module).named_parameters()}
    engine.close()
    assert set(got) == set(want), sorted(set(got) ^ set(want))[:4]
    return max(float((got[n] - want[n]).abs().max()) for n in want)


def test_sync_stream_merged_zero0(tmp_path):
    write_initial_adapter(tmp_path)
    assert _sync(0, 1, str(tmp_path), 0) <= 1e-6


@pytest.mark.timeout(120)
def test_hybrid_engine_serves_the_merged_policy_and_grpo_runs(tmp_path):
    """After LoRA steps the serving copy generates the merged policy's greedy tokens and
    log-probs; a short GRPO run with lora (reference = adapters off) keeps the serving and
    training log-probs together and trains adapters only."""
    import copy

    import zeal
    from tests.rlhf.test_e2e import PROMPTS, fraction_of_target
    from tests.rlhf.test_hybrid import _check, _train_step
    from zeal.lora.merge import merge_and_unload
    from zeal.rlhf import grpo

    write_initial_adapter(tmp_path)
    engine = zeal.initialize(zeal_model(), engine_config(tmp_path))
    _train_step(engine, 1)
    reference = merge_and_unload(copy.deepcopy(engine.module)).eval()
    assert _check(engine, reference) < 1e-4
    engine.close()
    cfg = {"lora": {"enabled": True, "adapter": str(tmp_path)},
           "rlhf": {"steps": 2, "batch_size": 2, "num_generations": 2, "max_new_tokens": 4,
                    "generation_dtype": "fp32", "beta": 0.1}}
    res = grpo(zeal_model(), fraction_of_target, PROMPTS, cfg)
    assert all(".lora_" in n for n, p in res.engine.module.named_parameters() if p.requires_grad)
    assert max(r["logprob_diff"] for r in res.metrics) < 1e-4
    assert all(r["kl"] > 0 for r in res.metrics)  # the adapters already differ from the base
    res.engine.close()
