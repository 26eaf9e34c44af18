"""Real public DeepSpeed configs (tests/config/data/ds_corpus, sources in SOURCES.md):
each loads, with "auto" resolved from the job's values, or is refused naming a missing
feature — never an unknown-key error."""

from __future__ import annotations

from pathlib import Path

import pytest

from zeal.config import AutoValues, ConfigError, load_config

pytestmark = pytest.mark.timeout(60)
CORPUS = sorted((Path(__file__).parent / "data" / "ds_corpus").glob("*.json"))

# file -> the feature its refusal names (every other file loads)
REFUSED = {
    "dse_bing_bert_onebit_adam_seq128.json": "1-bit Adam",
    "dse_cifar_ds_config_onebitlamb.json": "1-bit LAMB",
    "dse_cifar_ds_config.json": "fp16 master weights",
    "dse_megatron_ds_zero2_config.json": "tensor parallelism",  # partition_activations
    "openrlhf_ddpo_ds_config.json": "tensor parallelism",  # partition_activations
    "llamafactory_ds_z3_alst_config.json": "sequence parallelism",
    "llamafactory_ds_z3_fp8_config.json": "fp8 training",
    "megatron_ds_ds_zero2_config_bf16.json": "communication dtype",
}


def _job() -> AutoValues:
    return AutoValues(micro_batch=4, grad_accum=2, lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                      gradient_clipping=1.0, fp16=False, bf16=False, warmup_steps=10, total_steps=100, hidden_size=64)


def test_corpus_is_large_enough_and_documented():
    assert len(CORPUS) >= 25
    sources = (Path(__file__).parent / "data" / "ds_corpus" / "SOURCES.md").read_text()
    assert all(p.name in sources for p in CORPUS)


@pytest.mark.parametrize("path", CORPUS, ids=lambda p: p.stem)
def test_each_config_loads_or_names_the_missing_feature(path):
    if path.name in REFUSED:
        with pytest.raises(ConfigError) as e:
            load_config(path, _job())
        assert REFUSED[path.name] in str(e.value) and "unknown key" not in str(e.value)
        return
    cfg = load_config(path, _job())
    _, micro, _ = cfg.resolve_batch(1)
    assert micro >= 1
