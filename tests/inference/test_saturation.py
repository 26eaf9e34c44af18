"""A short load test: ``zeal serve`` (a child process on 127.0.0.1) at 2x its saturation rate.

The shortened form of ``bench/inference/bench_saturation.py``: a tiny random
Llama, one sequence per pass, 64 new tokens (so that the server, not the
client, is the bottleneck), a queue bound of 4, saturation measured for 3 s,
then 5 s of Poisson arrivals at twice that rate. No accepted request may be
lost, every rejection is a 429 with an OpenAI-style error body, and the waiting queue never exceeds
its bound (polled on /metrics and as the server's own high-water mark).
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path

import pytest

MAX_WAITING = 4


def _bench():
    path = Path(__file__).resolve().parents[2] / "bench" / "inference" / "bench_saturation.py"
    spec = importlib.util.spec_from_file_location("zeal_bench_saturation", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up here
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.timeout(150)  # the server's start (torch, the model) takes longer on a loaded machine
def test_twice_saturation_loses_nothing_and_bounds_the_queue(llama_dir, tmp_path):
    b = _bench()
    srv = b.start_server(str(llama_dir), max_waiting=MAX_WAITING, threads=1, log_dir=tmp_path, ready_timeout=90,
                         extra=["--max-num-seqs", "1", "--num-blocks", "256", "--block-size", "4"])
    try:
        kw = dict(vocab=96, prompt_tokens=8, new_tokens=64, timeout=20.0)
        sat = asyncio.run(b.saturation(srv.base, concurrency=1 + MAX_WAITING // 2, seconds=3.0, **kw))
        assert sat["errors"] == 0 and sat["req_per_s"] > 0, sat
        ov = asyncio.run(b.overload(srv.base, rate=2 * sat["req_per_s"], duration=5.0, max_requests=None, **kw))
    finally:
        srv.stop()
    assert srv.proc.returncode is not None
    assert ov["lost"] == 0, ov["lost_sample"]  # every request is either completed in full or a 429 with an error body
    assert ov["completed"] > 0 and ov["rejected_429"] > 0, ov
    assert ov["completed"] + ov["rejected_429"] == ov["sent"]
    assert ov["queue_limit"] == MAX_WAITING
    assert ov["queue_samples"] > 10 and ov["queue_max_polled"] <= MAX_WAITING, ov
    assert 0 < ov["queue_peak_server"] <= MAX_WAITING, ov
