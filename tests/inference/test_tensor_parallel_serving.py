"""Tensor-parallel serving (``LLM(..., tensor_parallel_size=2)``, ``zeal serve
--tensor-parallel-size 2``): greedy tokens of a batch of mixed prompts equal those of one
process (TP 1), and log-probabilities agree to fp32 rounding (the row-parallel sums are
added in another order: ~1e-6; a wrongly split layer is off by far more than 1e-4).

Models: a Hugging Face ``LlamaForCausalLM`` with GQA (4 query heads, 2 key/value heads:
one key/value head per rank) saved as a folder, and a zeal GPT instance (fused q/k/v).
The batch mixes prompt lengths 3-70 under a 24-token SplitFuse budget (chunked prompts
beside decodes), blocks of 16 tokens, two prompts sharing a prefix (prefix caching) and
``n=2`` (copy-on-write block copies), with the fused CPU kernels and with torch ops.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from tests.dist_harness import free_port, run_ranks
from tests.inference.conftest import VOCAB, mixed_prompts

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]
ENGINE = {"block_size": 16, "max_num_batched_tokens": 24, "max_num_seqs": 8}


def _prompts() -> list[list[int]]:
    ps = mixed_prompts(5, 5, 3, 70)
    return ps + [ps[4][:40] + [7, 8, 9]]  # shares a 40-token prefix with prompt 4


def _params():
    from zeal.inference import SamplingParams

    return SamplingParams(max_tokens=10, temperature=0, logprobs=2, ignore_eos=True)


def _generate(llm) -> tuple[list[list[int]], list[list[float]]]:
    """Tokens and chosen-token log-probabilities of every choice (the last prompt asks n=2)."""
    from zeal.inference import SamplingParams

    ps = _prompts()
    outs = llm.generate(ps[:-1], _params()) + llm.generate(
        ps[-1:], SamplingParams(n=2, max_tokens=10, temperature=0, logprobs=2, ignore_eos=True))
    toks = [c.token_ids for o in outs for c in o.outputs]
    lps = [[e["logprob"] for e in c.logprobs] for o in outs for c in o.outputs]
    return toks, lps


def _gpt():
    from zeal.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=VOCAB, n_positions=128, n_embd=64, n_layer=2, n_head=4))


def _ranks(rank: int, world: int, llama_dir: str, cases: tuple[tuple[str, str], ...]) -> list:
    """Every rank builds its LLM (a launched job); rank 0 generates and compares with TP 1."""
    import zeal.inference.model_runner as mr
    from zeal.inference import LLM

    fused = mr.cpu_kernels
    results = []
    for kind, kernels in cases:
        mr.cpu_kernels = fused if kernels == "fused" else (lambda: None)
        source = llama_dir if kind == "llama" else _gpt()
        llm = LLM(source, tensor_parallel_size=2, **ENGINE)
        if rank:  # the constructor served rank 0's passes until it shut the group down
            assert not llm.is_driver and llm.engine is None
            continue
        assert llm.engine.runner.k_cache[0].shape[1] == (1 if kind == "llama" else 2)  # this rank's kv heads
        tp_out = _generate(llm)
        llm.shutdown()
        one = _generate(LLM(source, **ENGINE))
        results.append((kind, kernels, tp_out, one))
    return results


# the default tier covers each model and each kernel path once; the long tier the other pairs
@pytest.mark.parametrize("cases", [
    pytest.param((("llama", "fused"), ("gpt", "torch")), id="llama-fused,gpt-torch"),
    pytest.param((("llama", "torch"), ("gpt", "fused")), id="llama-torch,gpt-fused", marks=pytest.mark.slow)])
def test_tp2_greedy_tokens_equal_tp1_launched_ranks(llama_dir, cases):
    results = run_ranks(_ranks, 2, str(llama_dir), cases, timeout=100)[0]
    assert [(kind, kernels) for kind, kernels, *_ in results] == list(cases)
    for kind, kernels, (tp_toks, tp_lps), (toks, lps) in results:
        assert tp_toks == toks, (kind, kernels)
        err = max(abs(a - b) for x, y in zip(tp_lps, lps) for a, b in zip(x, y))
        assert err < 1e-4, (kind, kernels, err)
        assert 0 < err or kind == "gpt", "the tp run should sum in another order than one process"


def test_tp2_started_by_zeal_equals_tp1(llama_dir):
    """A plain process becomes rank 0 and starts rank 1 itself (what ``zeal serve`` does)."""
    from zeal.inference import LLM

    llm = LLM(llama_dir, tensor_parallel_size=2, **ENGINE)
    try:
        (worker,) = llm.tp.procs
        tp_toks, tp_lps = _generate(llm)
    finally:
        llm.shutdown()
    assert worker.returncode == 0  # stopped cleanly
    toks, lps = _generate(LLM(llama_dir, **ENGINE))
    assert tp_toks == toks
    assert max(abs(a - b) for x, y in zip(tp_lps, lps) for a, b in zip(x, y)) < 1e-4
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate([[5, 6, 7]], _params())


def test_bad_sizes_are_refused_by_name(llama_dir):
    from zeal.cli.serve import add_arguments, config_from_args
    from zeal.inference import LLM

    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not divide the model's 4 attention heads"):
        LLM(llama_dir, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="tensor_parallel_size 8 is larger than the model's 4 attention heads"):
        LLM(llama_dir, tensor_parallel_size=8)
    with pytest.raises(ValueError, match="tensor_parallel_size 4 does not divide the model's 2 key/value heads"):
        LLM(llama_dir, tensor_parallel_size=4)
    with pytest.raises(ValueError, match="needs its 2 ranks launched"):
        LLM(_gpt(), tensor_parallel_size=2)
    import argparse

    p = argparse.ArgumentParser()
    add_arguments(p)
    assert config_from_args(p.parse_args([str(llama_dir), "--tensor-parallel-size", "2"])).tensor_parallel_size == 2
    with pytest.raises(ValueError, match="tensor_parallel_size") as e:
        config_from_args(p.parse_args([str(llama_dir), "--tensor-parallel-size", "0"]))
    assert "\n" not in str(e.value)


def _serve(llama_dir: Path, *flags: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return subprocess.Popen([sys.executable, "-m", "zeal.cli.main", "serve", str(llama_dir), "--dtype", "fp32",
                             "--log-level", "warning", *flags], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_cli_refuses_a_size_that_does_not_divide_the_heads(llama_dir, monkeypatch, capsys):
    from zeal.cli.serve import main

    monkeypatch.setattr("zeal.utils.process.apply_process_settings", lambda *_: {})  # no process-wide settings
    assert main([str(llama_dir), "--tensor-parallel-size", "3", "--dtype", "fp32"]) == 2
    err = capsys.readouterr().err
    assert err == "zeal serve: tensor_parallel_size 3 does not divide the model's 4 attention heads\n"
    assert main([str(llama_dir), "--tensor-parallel-size", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("zeal serve: ") and "tensor_parallel_size" in err and err.count("\n") == 1, err


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads a process's children from /proc")
def test_zeal_serve_tp2_over_http_then_a_dead_rank_stops_it(llama_dir):
    port = free_port()
    proc = _serve(llama_dir, "--tensor-parallel-size", "2", "--port", str(port), "--block-size", "16")
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.communicate()[1]
            try:
                urllib.request.urlopen(base + "/health", timeout=2)
                break
            except OSError:
                assert time.monotonic() < deadline, "zeal serve did not come up"
                time.sleep(0.3)
        prompts = _prompts()[:3]
        got = _post(base + "/v1/completions", {"model": llama_dir.name, "prompt": prompts, "max_tokens": 8,
                                               "temperature": 0})
        from zeal.inference import LLM, SamplingParams

        ref = LLM(llama_dir).generate(prompts, SamplingParams(max_tokens=8, temperature=0))
        by_index = sorted(got["choices"], key=lambda c: c["index"])
        assert [c["text"] for c in by_index] == [o.text for o in ref]
        # a worker dies mid-stream: the stream ends with an error event, then [DONE]
        body = {"prompt": "Hello", "max_tokens": 230, "temperature": 0, "ignore_eos": True, "stream": True}
        req = urllib.request.Request(base + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            events = [r.readline()]
            assert events[0].startswith(b"data: {")
            (worker,) = _children(proc.pid)
            os.kill(worker, signal.SIGKILL)
            events += [line for line in r if line.strip()]
        assert events[-1] == b"data: [DONE]\n", events[-3:]
        last = json.loads(events[-2][len(b"data: "):])
        assert last["error"]["type"] == "server_error" and "tensor-parallel rank 1" in last["error"]["message"]
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 1
        lines = err.splitlines()
        assert "zeal serve: tensor-parallel rank 1 exited with code -9; stopping" in lines, err
        first = next(i for i, x in enumerate(lines) if "tensor-parallel rank 1" in x)
        assert "Traceback" not in err and not [x for x in lines[:first] if "gloo" in x.lower()], err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
