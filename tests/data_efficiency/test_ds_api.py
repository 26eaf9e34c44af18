"""DeepSpeed's random-LTD names as DeepSpeed's example scripts call them: ``convert_to_random_ltd``
after ``deepspeed.initialize`` on a Hugging Face GPT-2, ``engine.random_ltd_scheduler`` (its
``state["consumed_layer_tokens"]`` against the formula, counted once under activation
checkpointing), ``save_without_random_ltd``; and ``convert_to_random_ltd`` before initialize on
a hand-made model whose layers zeal cannot find by itself."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zeal
from zeal.config import ConfigError
from zeal.data.random_ltd import kept_tokens
from zeal.deepspeed.runtime.data_pipeline.data_routing.helper import (
    convert_to_random_ltd,
    remove_random_ltd_state_dict,
    save_without_random_ltd,
)

pytestmark = pytest.mark.timeout(90)


def _ltd_config(ids, lo=4, hi=16, steps=3, per=4, **extra):
    return {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.05}},
            "data_efficiency": {"enabled": True, "data_routing": {"random_ltd": {
                "enabled": True, "random_ltd_layer_id": ids,
                "random_ltd_schedule": {"min_value": lo, "max_value": hi,
                                        "schedule_config": {"require_steps": steps, "seq_per_step": per}}}}},
            **extra}


def test_deepspeed_script_flow_on_hugging_face_gpt2():
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    import zeal.deepspeed as deepspeed

    torch.manual_seed(0)
    hf = transformers.GPT2Config(vocab_size=64, n_embd=16, n_layer=4, n_head=2, n_positions=32,
                                 resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(hf)
    plain_keys = set(model.state_dict())
    engine, _, _, _ = deepspeed.initialize(model=model, config=_ltd_config([1, 2]))
    engine = convert_to_random_ltd(engine, GPT2Block)
    assert engine.random_ltd_enabled()
    sched = engine.random_ltd_scheduler
    ids = torch.randint(0, 64, (2, 16))
    expected = 0
    for step in range(4):
        r = sched.get_current_seq()
        assert r == kept_tokens(step, 4, 16, 3, 4)
        expected += 2 * (r * 2 + 16 * 2)  # samples · (r · n_ltd + T · (L − n_ltd))
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        assert sched.state["consumed_layer_tokens"] == expected
    assert sched.state["current_value"] == sched.get_current_seq() == 16
    saved = save_without_random_ltd(engine)
    assert set(saved) == plain_keys
    assert all(torch.equal(saved[k], v) for k, v in engine.module_state_dict().items())
    with pytest.raises(ValueError, match="not GPT2Attention"):
        convert_to_random_ltd(engine, transformers.models.gpt2.modeling_gpt2.GPT2Attention)
    engine.close()


def test_consumed_layer_tokens_counted_once_under_activation_checkpointing():
    from zeal.models import GPT, GPTConfig

    counts, draws = [], []
    for ckpt in (False, True):
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=64, n_positions=16, n_embd=16, n_layer=4, n_head=2))
        extra = {"activation_checkpointing": {}} if ckpt else {}
        engine = zeal.initialize(model, _ltd_config([1, 2], lo=8, hi=16, steps=100, **extra))
        engine.token_drop.record = []
        ids = torch.randint(0, 64, (2, 16))
        for _ in range(2):
            engine.backward(engine(ids, labels=ids))
            engine.step()
        counts.append(engine.token_drop.state["consumed_layer_tokens"])
        draws.append(len(engine.token_drop.record))
        engine.close()
    assert draws == [4, 8]  # 2 layers × 2 steps; recomputed in backward under checkpointing
    assert counts[0] == counts[1] == 2 * 2 * (8 * 2 + 16 * 2)


class _Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        return x + torch.tanh(self.proj(x))


class _Awkward(nn.Module):
    """Layers in a ModuleDict under an unusual name: nothing zeal knows finds them."""

    def __init__(self, vocab=32, d=8, n=3):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.stack = nn.ModuleDict({f"b{i}": _Block(d) for i in range(n)})
        self.out = nn.Linear(d, vocab)

    def forward(self, ids, labels):
        x = self.emb(ids)
        for block in self.stack.values():
            x = block(x)
        return nn.functional.cross_entropy(self.out(x).flatten(0, 1), labels.flatten())


def test_convert_before_initialize_names_the_layers_of_an_awkward_model():
    torch.manual_seed(0)
    with pytest.raises(ConfigError, match="convert_to_random_ltd"):
        zeal.initialize(_Awkward(), _ltd_config([1], lo=3, hi=12))
    model = convert_to_random_ltd(_Awkward(), _Block)
    keys = set(model.state_dict())
    engine = zeal.initialize(model, _ltd_config([1], lo=3, hi=12, steps=100, per=1))
    engine.token_drop.record = []
    ids = torch.randint(0, 32, (2, 12))
    engine.backward(engine(ids, ids))
    engine.step()
    assert [r.shape for r in engine.token_drop.record] == [(2, 3)]  # only block 1, 3 of 12 tokens kept
    assert set(engine.module.state_dict()) == keys  # the layer list adds no state-dict keys
    engine.close()
    with pytest.raises(ValueError, match="has no Linear2"):
        convert_to_random_ltd(_Awkward(), type("Linear2", (nn.Module,), {}))


def test_convert_on_an_engine_without_random_ltd_and_the_state_dict_helper():
    torch.manual_seed(0)
    engine = zeal.initialize(_Awkward(), {"train_micro_batch_size_per_gpu": 2,
                                          "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    assert engine.token_drop is None
    with pytest.raises(ValueError, match="random_ltd.enabled"):
        convert_to_random_ltd(engine, _Block)
    engine.close()
    ds_keys = {"transformer.h.1.random_ltd_layer.attn.c_attn.weight": 1, "lm_head.weight": 2}
    assert remove_random_ltd_state_dict(ds_keys) == {"transformer.h.1.attn.c_attn.weight": 1, "lm_head.weight": 2}
