"""``bench/gpu/torch_api_check.py``: the torch names and keywords a source tree uses that
the running torch lacks (the GPU image's torch is older than the one zeal is developed on)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _checker():
    spec = importlib.util.spec_from_file_location("torch_api_check", REPO / "bench/gpu/torch_api_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_finds_missing_names_and_keywords_through_aliases(tmp_path):
    (tmp_path / "m.py").write_text(
        "import torch\nimport torch.distributed as dist\nfrom torch.nn import functional as F\n"
        "from torch.nn.attention.flex_attention import BlockMask\n"
        "def f(t, g, num, idx):\n"
        "    dist.isend(t, group=g, group_dst=1, tag=0)\n"  # exists: no finding
        "    dist.isend(t, group=g, peer_rank=1)\n"  # no such keyword
        "    BlockMask.from_kv_blocks(num, idx, compute_blocks=False)\n"  # no such keyword
        "    F.silu(t, inplace=False)\n"
        "    return torch.cuda.not_an_api(t), F.not_a_function\n")
    found = _checker().check([tmp_path])
    assert sorted(line.split(" ", 1)[1] for line in found) == [
        "torch.cuda.not_an_api: not in this torch",
        "torch.distributed.isend(peer_rank=...): no such parameter in this torch",
        "torch.nn.attention.flex_attention.BlockMask.from_kv_blocks(compute_blocks=...): no such parameter in this torch",
        "torch.nn.functional.not_a_function: not in this torch",
    ], found
    assert all(line.startswith(f"{tmp_path}/m.py:") for line in found)


def test_zeal_uses_only_what_this_torch_has():
    assert _checker().check([REPO / "zeal"]) == []
