"""The pipeline_parallel config: what is refused, by name, before any rank communicates."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from torch import nn

from zeal.config import ConfigError, load_config
from zeal.models.gpt import GPT, GPTConfig
from zeal.pipe.apply import apply_pipeline


def _gpt():
    return GPT(GPTConfig(vocab_size=32, n_embd=16, n_layer=2, n_head=2, n_positions=8))


def test_stage3_with_stages_is_refused():
    with pytest.raises(ConfigError, match="pipeline_parallel.size > 1 with zero_optimization.stage 3"):
        load_config({"pipeline_parallel": {"size": 2}, "zero_optimization": {"stage": 3}})
    assert load_config({"pipeline_parallel": {"size": 2}}).pipeline_parallel.schedule == "1f1b"


@pytest.mark.parametrize("section,accum,model,message", [
    ({"size": 2, "schedule": "interleaved"}, 4, _gpt, "'interleaved' needs pipeline_parallel.virtual_stages >= 2"),
    ({"size": 2, "virtual_stages": 2}, 4, _gpt, "virtual_stages 2 needs schedule 'interleaved'"),
    ({"size": 2, "schedule": "interleaved", "virtual_stages": 2}, 3, _gpt,
     "micro_batches 3 is not a multiple of pipeline_parallel.size 2"),
    ({"size": 2, "schedule": "interleaved", "virtual_stages": 2}, 4, _gpt,
     "2 blocks do not divide into pipeline_parallel.size 2 x pipeline_parallel.virtual_stages 2"),
    ({"size": 2, "micro_batches": 8}, 4, _gpt, "micro_batches 8 != gradient_accumulation_steps 4"),
    ({"size": 2}, 4, lambda: nn.Linear(2, 2), "cannot split a Linear"),
    ({"size": 3}, 4, _gpt, "cannot split 2 layers into 3"),
])
def test_refused_by_name(section, accum, model, message):
    cfg = load_config({"pipeline_parallel": section})
    with pytest.raises(ConfigError, match=message):
        apply_pipeline(model(), cfg, SimpleNamespace(pp_rank=0), accum)


def test_off_by_default_and_gpt_cut_keeps_global_names():
    assert apply_pipeline(_gpt(), load_config({}), SimpleNamespace(pp_rank=0), 1) is None
    last = apply_pipeline(_gpt(), load_config({"pipeline_parallel": {"size": 2}}), SimpleNamespace(pp_rank=1), 1)
    names = [n for n, _ in last.module.named_parameters()]
    assert names[0].startswith("transformer.h.1.") and names[-1] == "transformer.ln_f.bias"
    assert last.tied is not None and last.tied.owner is last.module.lm_head  # the head's copy, not a parameter
