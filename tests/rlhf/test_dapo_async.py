"""DAPO's dynamic sampling, overlong filtering and soft overlong punishment on constructed
groups; async rollouts: k = 0 is the synchronous loop exactly, k = 1 trains on batches at
most one weight version old (version counters) and is deterministic given the seed."""

import pytest
import torch

from zeal.rlhf import dapo

pytestmark = pytest.mark.timeout(120)


def test_soft_overlong_penalty_formula():
    # L_max 10, L_cache 4: 0 up to 6, then (6 − L)/4, then −1 beyond 10
    got = dapo.soft_overlong_penalty([3, 6, 7, 8, 10, 11], 10, 4)
    torch.testing.assert_close(got, torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0]))
    torch.testing.assert_close(dapo.soft_overlong_penalty([9], 10, 4, penalty=2.0), torch.tensor([-1.5]))
    assert dapo.soft_overlong_penalty([10], 10, 0).item() == 0.0
    with pytest.raises(ValueError, match="overlong_buffer"):
        dapo.soft_overlong_penalty([1], 4, 5)


def test_informative_groups_and_fill():
    rewards = torch.tensor([1.0, 1.0, 1.0,  0.0, 1.0, 0.0,  0.5, 0.5, 0.5,  0.0, 0.0, 2.0])
    assert dapo.informative_groups(rewards, 3).tolist() == [1, 3]
    with pytest.raises(ValueError):
        dapo.informative_groups(rewards, 5)
    kept = [("a", [], None), ("b", [], None)]
    spare = [("u", [], None), ("v", [], None)]
    assert [g[0] for g in dapo.fill_groups(kept, 3, spare)] == ["a", "b", "u"]
    assert [g[0] for g in dapo.fill_groups(kept, 1, spare)] == ["a"]


def test_overlong_filtering_masks_truncated_answers():
    from zeal.rlhf.config import RLHFConfig
    from zeal.rlhf.grpo_trainer import _loss_mask
    from zeal.rlhf.hybrid import Rollout

    ros = [Rollout([1], [2, 3], [0, 0], finish_reason="stop"), Rollout([1], [2, 3], [0, 0], finish_reason="length")]
    mask = torch.ones(2, 2)
    torch.testing.assert_close(_loss_mask(ros, mask, RLHFConfig(mask_truncated_completions=True)),
                               torch.tensor([[1.0, 1.0], [0.0, 0.0]]))
    torch.testing.assert_close(_loss_mask(ros, mask, RLHFConfig()), mask)


class _FakeHybrid:
    """Answers whose reward is set by the prompt: prompt ids < 3 score all alike (uniform
    groups), others alternate 0/1 (informative)."""

    def __init__(self):
        self.calls = []

    def generate(self, prompts, params, sync=True):
        from zeal.rlhf.hybrid import Rollout

        self.calls.append((list(prompts), sync))
        return [Rollout(p, [p[0]] * (i + 1), [0.0] * (i + 1), group=g) for g, p in enumerate(prompts)
                for i in range(params.n)]


def _reward(prompts, completions, completion_ids):
    return [1.0 if ids[0] < 3 else float(len(ids) % 2) for ids in completion_ids]


def test_dynamic_sampling_drops_uniform_groups_and_refills():
    from zeal.rlhf.config import RLHFConfig
    from zeal.rlhf.grpo_trainer import make_batch

    prompt_ids = [[i] for i in range(6)]  # 0, 1, 2 uniform; 3, 4, 5 informative
    rc = RLHFConfig(num_generations=2, dynamic_sampling=True, max_num_gen_batches=20, seed=1)
    h = _FakeHybrid()
    b = make_batch(h, 1, [0, 3, 1], 0, prompt_ids, list(range(6)), _reward, rc, 0, True)
    assert [r.prompt_ids[0] >= 3 for r in b.rollouts] == [True] * 6  # 3 informative groups, in draw order
    assert b.prompts[0] == 3 and [r.group for r in b.rollouts] == [0, 0, 1, 1, 2, 2]
    assert len(h.calls) == b.stats["num_gen_batches"] >= 2
    assert h.calls[0][1] is True and all(not s for _, s in h.calls[1:])  # refills reuse the synced weights
    for g in range(3):
        assert b.rewards[2 * g] != b.rewards[2 * g + 1]
    # a budget of one generation: the uniform groups fill the batch
    rc1 = RLHFConfig(num_generations=2, dynamic_sampling=True, max_num_gen_batches=1)
    b1 = make_batch(_FakeHybrid(), 1, [0, 3, 1], 0, prompt_ids, list(range(6)), _reward, rc1, 0, True)
    assert b1.prompts == [3, 0, 1] and b1.stats["informative_groups"] == pytest.approx(1 / 3)
    # off: the batch as drawn
    b0 = make_batch(_FakeHybrid(), 1, [0, 3, 1], 0, prompt_ids, list(range(6)), _reward, RLHFConfig(num_generations=2),
                    0, True)
    assert b0.prompts == [0, 3, 1] and b0.stats == {}
    # the soft overlong punishment is added to the rewards: answers of 1 and 2 tokens, limit 2, buffer 1
    rc2 = RLHFConfig(num_generations=2, max_new_tokens=2, overlong_buffer=1, overlong_penalty=0.5)
    b2 = make_batch(_FakeHybrid(), 1, [0], 0, prompt_ids, list(range(6)), _reward, rc2, 0, True)
    torch.testing.assert_close(b2.rewards, torch.tensor([1.0, 1.0 - 0.5]))


def _run(tmp_path, name, lr=3e-3, **rlhf):
    from tests.rlhf.test_e2e import PROMPTS, fraction_of_target, tiny
    from zeal.rlhf import grpo

    cfg = {"optimizer": {"type": "AdamW", "params": {"lr": lr}},
           "rlhf": {"steps": 4, "batch_size": 2, "num_generations": 4, "max_new_tokens": 6, "beta": 0.04,
                    "generation_dtype": "fp32", **rlhf}}
    res = grpo(tiny(), fraction_of_target, PROMPTS, cfg, out=str(tmp_path / name))
    return res, {k: v.clone() for k, v in res.engine.module_state_dict().items()}


def test_async_k0_is_sync_and_k1_is_one_step_stale_and_deterministic(tmp_path):
    sync, w_sync = _run(tmp_path, "sync")
    k0, w_k0 = _run(tmp_path, "k0", async_rollouts=0)
    for k in w_sync:
        assert torch.equal(w_sync[k], w_k0[k]), k
    assert [r["reward"] for r in sync.metrics] == [r["reward"] for r in k0.metrics]
    assert "async" not in k0.extra and all(r["staleness"] == 0 for r in k0.metrics)

    a, w_a = _run(tmp_path, "a", async_rollouts=1)
    b, w_b = _run(tmp_path, "b", async_rollouts=1)
    # version counters: batch 1 and 2 from version 0, batch t from version t − 2 afterwards
    assert [r["staleness"] for r in a.metrics] == [0, 1, 1, 1]
    for k in w_a:
        assert torch.equal(w_a[k], w_b[k]), k
    assert [r["reward"] for r in a.metrics] == [r["reward"] for r in b.metrics]
    # step 1 sees the same batch and weights as the synchronous run
    assert a.metrics[0]["reward"] == sync.metrics[0]["reward"]
    assert a.metrics[0]["loss"] == pytest.approx(sync.metrics[0]["loss"], abs=1e-6)
    # stale batches: behaviour log-probs from the generator, corrected by the importance weights
    assert all("is_ratio_mean" in r for r in a.metrics[1:])
    s = a.extra["async"]
    assert 0.0 <= s["overlap_share"] <= 1.0 and s["generate_s"] > 0 and s["train_s"] > 0
    assert 0.0 <= s["hidden_generation_share"] <= 1.0 and s["overlap_s"] <= s["generate_s"]


def test_async_k2_staleness_bound(tmp_path):
    res, _ = _run(tmp_path, "k2", async_rollouts=2)
    assert [r["staleness"] for r in res.metrics] == [0, 1, 2, 2]


def test_pipeline_refuses_a_batch_older_than_k():
    from types import SimpleNamespace

    from zeal.rlhf.async_rollouts import RolloutPipeline

    pipe = RolloutPipeline(1, 1, 3, lambda step, pick, version: SimpleNamespace(version=version - 5),
                           lambda step: None, lambda: None, lambda w: None)
    try:
        with pytest.raises(RuntimeError, match="steps old"):  # a stale batch is refused
            pipe.get(1)  # 0 − (−5) ≤ 1? no: 5 steps old
    finally:
        pipe.close()


def test_pipeline_checks_the_serving_copys_version_counter():
    """A batch labelled with weights newer than the serving copy held (the load skipped) is
    refused; the generator thread gets its own intra-op thread count, the trainer's stays."""
    from types import SimpleNamespace

    import torch

    from zeal.rlhf.async_rollouts import RolloutPipeline

    threads = []

    def produce(step, pick, version):
        threads.append(torch.get_num_threads())
        return SimpleNamespace(version=version + (step == 3))  # batch 3 claims a version never loaded

    before = torch.get_num_threads()
    pipe = RolloutPipeline(1, 1, 3, produce, lambda step: None, lambda: "w", lambda w: None, threads=1)
    try:
        assert pipe.get(1).version == 0 and pipe.get(2).version == 0
        pipe.trained(1, 0.0)  # weights version 1 go to the generator with batch 3
        with pytest.raises(RuntimeError, match="serving copy held version 1"):  # weights it never held
            pipe.get(3)
    finally:
        pipe.close()
    assert threads == [1, 1, 1] and torch.get_num_threads() == before


def test_async_rollouts_with_lora_adapters(tmp_path):
    """Async rollouts with adapters run: the snapshot handed to the generator thread holds the
    adapters only (the serving copy keeps its base, as the synchronous sync) and loads into
    the serving copy (a snapshot of lora_A/lora_B used to be refused with a KeyError)."""
    from zeal.cli.lora_flag import parse_lora_flag
    from zeal.models.llama import Llama, LlamaConfig
    from zeal.rlhf import grpo

    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    cfg = {"lora": parse_lora_flag(""), "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "rlhf": {"steps": 3, "batch_size": 2, "num_generations": 2, "max_new_tokens": 3, "beta": 0.0,
                    "generation_dtype": "fp32", "async_rollouts": 1}}
    res = grpo(model, lambda p, c, **k: [float(len(x)) for x in c], [[5, 6, 7], [8, 9, 10]], cfg,
               eos_token_ids=[0], out=str(tmp_path))
    assert [r["staleness"] for r in res.metrics] == [0, 1, 1]
    hybrid = res.extra["hybrid"]
    snap = dict(hybrid.snapshot_weights())
    assert snap and all("lora_" in n for n in snap)
    assert hybrid.load_snapshot(list(snap.items())) == len(snap)


def test_cli_flags_reach_the_config(tmp_path, monkeypatch):
    from tests.rlhf.conftest import build_tiny_folder
    from zeal.cli.main import main

    tiny = build_tiny_folder(tmp_path / "tiny")
    seen = {}

    def fake_grpo(model, reward_fn, prompts, config, out=None):
        seen.update(config)
        raise ValueError("stop here")

    monkeypatch.setattr("zeal.rlhf.grpo_trainer.grpo", fake_grpo)
    argv = ["rlhf", "grpo", "--model", str(tiny), "--out", str(tmp_path / "run")]
    assert main([*argv, "--loss-type", "dapo", "--async-rollouts", "1"]) == 2
    assert seen["rlhf"]["loss_type"] == "dapo" and seen["rlhf"]["async_rollouts"] == 1
    seen.clear()
    assert main(argv) == 2
    assert seen["rlhf"]["loss_type"] == "grpo" and seen["rlhf"]["async_rollouts"] == 0
    with pytest.raises(SystemExit):
        main([*argv, "--loss-type", "ppo"])


def test_nearby_seeds_draw_unrelated_streams():
    """Answer i of prompt k samples with sampling_seed(seed, step) + k·G + i: runs with seeds
    s and s + 1 share no answer's stream (with seed + c·step, seed s + 1's answer k was seed
    s's answer k + 1), nor do consecutive steps or dynamic-sampling attempts."""
    from zeal.rlhf.common import sampling_seed

    def streams(seed, step, attempt=0):
        return {sampling_seed(seed, step, attempt) + j for j in range(64)}

    for s in range(4):
        assert not streams(s, 3) & streams(s + 1, 3)
        assert not streams(s, 3) & streams(s, 4) and not streams(s, 3) & streams(s, 3, 1)
    assert sampling_seed(5, 2) == sampling_seed(5, 2)  # deterministic


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_async_k1_batches_equal_sync_ones_when_the_weights_stay(tmp_path, monkeypatch, dtype):
    """With lr 0 every weights version is the initial one, so async k = 1 must sample exactly
    the synchronous run's batches, step by step (same prompts, seeds and weights): what
    separates the two otherwise is only the version that sampled a batch, not the prompt
    order, the seeds or the generator thread."""
    import zeal.rlhf.grpo_trainer as gt

    seen: dict[str, dict[int, list]] = {}
    make_batch = gt.make_batch

    def spy(hybrid, step, *args, **kwargs):
        batch = make_batch(hybrid, step, *args, **kwargs)
        seen.setdefault(run, {})[step] = [(r.prompt_ids, r.output_ids) for r in batch.rollouts]
        return batch

    monkeypatch.setattr(gt, "make_batch", spy)
    for run, k in (("sync", 0), ("async", 1)):
        _run(tmp_path, run, async_rollouts=k, generation_dtype=dtype, lr=0.0)
    assert sorted(seen["async"]) == [1, 2, 3, 4]
    for step in range(1, 5):
        assert seen["async"][step] == seen["sync"][step], step
