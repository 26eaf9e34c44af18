"""The long-context planner (sp × tiling × checkpointing): proposals monotone in the
sequence length and the budget, each feature lowering what it should, and the CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from zeal.zero.estimate import hf_shape
from zeal.zero.estimate_long import CHECKPOINTING, long_activation_bytes, long_plans, recommend_long

LLAMA_8B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256}
SMALL = {"model_type": "llama", "hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 8,
         "num_attention_heads": 12, "num_key_value_heads": 4, "vocab_size": 32000}
GIB = 2**30


@pytest.mark.parametrize("cfg,host", [(LLAMA_8B, False), (SMALL, True), (SMALL, False)])
def test_proposal_is_monotone_in_length_and_budget(cfg, host):
    shape = hf_shape(cfg)
    lengths = [2**k for k in range(10, 21)]
    budgets = [b * GIB for b in (2, 4, 8, 16, 24, 40, 80, 141)]
    for budget in budgets:  # a longer sequence never gets a cheaper plan
        costs = [recommend_long(long_plans(shape, s, 8, host=host), budget) for s in lengths]
        keys = [(0,) if p is None else p.cost for p in costs]
        fitted = [k for k in keys if k != (0,)]
        assert fitted == sorted(fitted), (budget, keys)
        nones = [p is None for p in costs]
        assert nones == sorted(nones)  # once nothing fits, nothing longer fits
    for s in lengths:  # a larger budget never gets a dearer plan
        plans = [recommend_long(long_plans(shape, s, 8, host=host), b) for b in budgets]
        fitted = [p.cost for p in plans if p is not None]
        assert fitted == sorted(fitted, reverse=True), (s, fitted)


def test_each_feature_lowers_the_activations():
    shape = hf_shape(LLAMA_8B)
    for sp in (1, 2, 8):
        by = {(t, ck): long_activation_bytes(shape, 131072, sp, t, ck) for t in (False, True) for ck in CHECKPOINTING}
        for ck in CHECKPOINTING:
            assert by[(True, ck)][0] < by[(False, ck)][0]
        for t in (False, True):
            assert by[(t, "none")][0] > by[(t, "layers")][0] > by[(t, "layers+cpu")][0]
            assert by[(t, "layers+cpu")][1] == 32 * (131072 // sp) * 4096 * 2  # L·s_l·h·c on the host
    # sp divides the activations by about sp
    one, eight = (long_activation_bytes(shape, 131072, s, True, "layers")[0] for s in (1, 8))
    assert 6 < one / eight <= 8.5


def test_cli_proposes_sp_tiling_and_checkpointing(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(LLAMA_8B))
    out = subprocess.run([sys.executable, "-m", "zeal.cli.main", "estimate", "--hf-config", str(cfg), "--seq-len",
                          "131072", "--budget", "24GB", "--device", "gpu", "--world-size", "8", "--json"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    rec = json.loads(out.stdout)["recommended"]
    assert rec["sequence_parallel_size"] == 2 and rec["tiling"]["tiled_mlp"]["enabled"]
    assert rec["activation_checkpointing"] == {"cpu_checkpointing": True}
    tight = subprocess.run([sys.executable, "-m", "zeal.cli.main", "estimate", "--hf-config", str(cfg), "--seq-len",
                            "131072", "--budget", "1GB", "--device", "gpu"], capture_output=True, text=True, timeout=60)
    assert tight.returncode == 1 and "nothing fits" in tight.stdout
