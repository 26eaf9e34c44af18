"""The compression config section and DeepSpeed's compression_training keys."""

import pytest
import torch
from torch import nn

from zeal.compression.apply import QuantScheduleHook, apply_compression
from zeal.compression.modules import QATLinear
from zeal.config import ConfigError, load_config

DS = {
    "weight_quantization": {
        "shared_parameters": {"enabled": True, "schedule_offset": 2, "quantize_groups": 1,
                              "quantization_type": "symmetric", "rounding": "nearest"},
        "different_groups": {"wq1": {"params": {"start_bits": 8, "target_bits": 4, "quantization_period": 3},
                                     "modules": ["mlp"]}}},
    "activation_quantization": {
        "shared_parameters": {"enabled": True, "quantization_type": "symmetric", "range_calibration": "dynamic"},
        "different_groups": {"aq1": {"params": {"bits": 8}, "modules": ["mlp"]}}},
    "sparse_pruning": {
        "shared_parameters": {"enabled": True, "schedule_offset": 5, "method": "l1", "block_pattern": "2:4"},
        "different_groups": {"sp1": {"params": {"dense_ratio": 0.5}, "modules": ["attn"]}}},
    "head_pruning": {"shared_parameters": {"enabled": False}},
}


def test_deepspeed_compression_training_maps_onto_the_section():
    c = load_config({"compression_training": DS}).compression
    q, s = c.quantization, c.sparsity
    assert (q.enabled, q.bits, q.start_bits, q.quantization_period, q.start_step, q.activation_bits) == \
        (True, 4, 8, 3, 2, 8)
    assert q.modules == ["*mlp*"] and s.modules == ["*attn*"]
    assert (s.enabled, s.pattern, s.method, s.prune_step) == (True, "2:4", "magnitude", 5)


@pytest.mark.parametrize("key,patch,msg", [
    ("row_pruning", {"shared_parameters": {"enabled": True}}, "row pruning"),
    ("layer_reduction", {"shared_parameters": {"enabled": True}}, "layer reduction"),
    ("sparse_pruning", {"shared_parameters": {"enabled": True, "block_pattern": "4x1"}, "different_groups": {}},
     "block_pattern"),
    ("weight_quantization", {"shared_parameters": {"enabled": True, "quantization_type": "asymmetric"},
                             "different_groups": {"g": {"params": {"target_bits": 8}}}}, "asymmetric"),
])
def test_unmapped_compression_keys_are_refused_by_name(key, patch, msg):
    with pytest.raises(ConfigError, match=msg):
        load_config({"compression_training": {key: patch}})


class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 6)
        self.lm_head = nn.Linear(6, 3)


def test_apply_compression_swaps_qat_linears_and_checks_groups():
    m = _Mlp()
    w = m.up.weight
    cfg = load_config({"compression": {"quantization": {"enabled": True, "bits": 4, "start_bits": 6,
                                                        "quantization_period": 2, "start_step": 1}}}).compression
    parts = apply_compression(m, cfg)
    assert isinstance(m.up, QATLinear) and m.up.weight is w and not isinstance(m.lm_head, QATLinear)
    hook = QuantScheduleHook(list(parts.qat.values()), cfg.quantization)
    seen = []
    for _ in range(6):
        seen.append((m.up.active, m.up.spec.bits))
        hook.after_step(True)
    assert seen == [(False, 6), (True, 6), (True, 6), (True, 5), (True, 5), (True, 4)]
    bad = load_config({"compression": {"sparsity": {"enabled": True, "pattern": "3:6"}}}).compression
    with pytest.raises(ConfigError, match="up.weight.*not a multiple of M=6"):
        apply_compression(_Mlp(), bad)
    x = torch.randn(2, 8)
    assert not torch.equal(m.up(x), nn.functional.linear(x, m.up.weight, m.up.bias))  # 4-bit QAT is on
