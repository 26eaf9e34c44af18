"""Load test: ``zeal serve`` at twice its saturation rate.

Starts ``zeal serve`` (as a child process, on 127.0.0.1 and a free port) on the
default model (SmolLM2-135M-Instruct) or a tiny random Llama, then:

1. **saturation**: a closed loop of ``--calib-concurrency`` clients, each
   sending its next request as soon as the last one returns, for
   ``--calib-seconds``; the completions per second over the last three quarters
   of that window are the saturation rate ``r``;
2. **overload**: Poisson arrivals at ``--load`` x ``r`` (default 2x) for
   ``--duration`` seconds or ``ceil(load * r * duration)`` requests, whichever
   ends first, every request with a timeout; ``/metrics`` is polled meanwhile.

It reports accepted vs rejected (HTTP 429) requests, lost requests (accepted
but not completed with all their tokens: timeouts, 5xx, short outputs — must be
0), the waiting queue's maximum as polled from ``/metrics`` and as the server's
own high-water mark (``zeal_num_requests_waiting_peak``, bounded by
``--max-waiting``), and p50/p99 latency of accepted and of rejected requests.

Every request is a non-streaming ``/v1/completions`` with token-id prompts,
greedy, ``ignore_eos`` so each asks for exactly ``--new-tokens`` tokens.

    python bench/inference/bench_saturation.py                    # SmolLM2, 60 s at 2x
    python bench/inference/bench_saturation.py --model tiny --duration 10
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

HOST = "127.0.0.1"  # loopback only, always


# ---------------------------------------------------------------- server process
def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def tiny_llama_folder(dest: Path, hidden: int = 64, layers: int = 2, vocab: int = 128) -> Path:
    """A random Llama saved as a Hugging Face folder (no tokenizer: prompts are token ids)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      eos_token_id=1, bos_token_id=None, pad_token_id=None)
    LlamaForCausalLM(cfg).save_pretrained(dest)
    return dest


@dataclass
class Server:
    proc: subprocess.Popen
    base: str
    log_path: Path

    def stop(self, timeout: float = 15.0) -> None:
        """SIGINT (a clean drain/cancel) by process id; SIGKILL if it does not exit."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def start_server(model: str | None, *, max_waiting: int, extra: list[str] | None = None, threads: int = 1,
                 log_dir: Path | None = None, ready_timeout: float = 300.0) -> Server:
    """``python -m zeal.cli.serve`` on 127.0.0.1:free-port; returns once ``/health`` answers."""
    port = free_port()
    cmd = [sys.executable, "-m", "zeal.cli.serve", *([model] if model else []), "--host", HOST, "--port", str(port),
           "--max-waiting", str(max_waiting), "--threads", str(threads), "--log-level", "warning", *(extra or [])]
    log_path = Path(log_dir or tempfile.gettempdir()) / f"zeal-serve-{port}.log"
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    srv = Server(proc, f"http://{HOST}:{port}", log_path)
    deadline = time.monotonic() + ready_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"zeal serve exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
        try:
            if httpx.get(srv.base + "/health", timeout=1.0).status_code == 200:
                return srv
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    srv.stop()
    raise TimeoutError(f"zeal serve did not answer /health within {ready_timeout:.0f} s")


# ---------------------------------------------------------------- client side
@dataclass
class Result:
    kind: str  # "ok" | "rejected" | "lost"
    latency: float
    detail: str = ""
    end: float = field(default_factory=time.perf_counter)  # when the answer (or the failure) came


@dataclass
class QueueWatch:
    samples: list[int] = field(default_factory=list)
    peak: int = 0  # the server's own high-water mark
    limit: int | None = None
    running_max: int = 0


def _gauge(text: str, name: str) -> float | None:
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


async def watch_queue(client: httpx.AsyncClient, base: str, w: QueueWatch, stop: asyncio.Event,
                      every: float = 0.1) -> None:
    while not stop.is_set():
        try:
            r = await client.get(base + "/metrics", timeout=5.0)
            text = r.text
            w.samples.append(int(_gauge(text, "zeal_num_requests_waiting") or 0))
            w.peak = max(w.peak, int(_gauge(text, "zeal_num_requests_waiting_peak") or 0))
            w.running_max = max(w.running_max, int(_gauge(text, "zeal_num_requests_running") or 0))
            lim = _gauge(text, "zeal_num_requests_waiting_limit")
            w.limit = int(lim) if lim is not None else w.limit
        except httpx.HTTPError:
            pass
        try:
            await asyncio.wait_for(stop.wait(), every)
        except TimeoutError:
            pass


def is_openai_error(body) -> bool:
    e = body.get("error") if isinstance(body, dict) else None
    return isinstance(e, dict) and isinstance(e.get("message"), str) and isinstance(e.get("type"), str) \
        and "code" in e and "param" in e


async def one_request(client: httpx.AsyncClient, base: str, prompt: list[int], new_tokens: int,
                      timeout: float) -> Result:
    body = {"prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    t0 = time.perf_counter()
    try:
        r = await client.post(base + "/v1/completions", json=body, timeout=timeout)
    except httpx.HTTPError as e:  # timeout or connection trouble: never answered
        return Result("lost", time.perf_counter() - t0, f"{type(e).__name__}: {e}")
    dt = time.perf_counter() - t0
    try:
        data = r.json()
    except ValueError:
        data = None
    if r.status_code == 429:
        if not is_openai_error(data):
            return Result("lost", dt, f"429 without an OpenAI error body: {r.text[:200]}")
        return Result("rejected", dt, data["error"]["message"])
    if r.status_code != 200:
        return Result("lost", dt, f"HTTP {r.status_code}: {r.text[:200]}")
    got = (data or {}).get("usage", {}).get("completion_tokens")
    if got != new_tokens:
        return Result("lost", dt, f"completed with {got} tokens, expected {new_tokens}")
    return Result("ok", dt)


def make_client() -> httpx.AsyncClient:
    # no pool limit: a client-side pool would queue requests and hide the server's own queue
    return httpx.AsyncClient(limits=httpx.Limits(max_connections=None, max_keepalive_connections=64), trust_env=False)


def prompts_for(n: int, vocab: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    hi = max(3, vocab - 1)
    return [[rng.randrange(2, hi) for _ in range(length)] for _ in range(n)]


async def saturation(base: str, *, vocab: int, prompt_tokens: int, new_tokens: int, concurrency: int,
                     seconds: float, timeout: float, min_completed: int = 0, max_seconds: float | None = None) -> dict:
    """Closed loop: ``concurrency`` clients back to back (started over the first eighth);
    returns completions/s after a warm-up quarter. ``errors`` counts 429s and failures.

    With ``min_completed``, the loop runs past ``seconds`` until that many completions fall in
    the measured window (at most ``max_seconds`` in all): on a loaded machine a fixed window
    may hold too few requests to give a rate."""
    done_at: list[float] = []
    errors: list[str] = []
    t0 = time.perf_counter()
    start = t0 + seconds / 4
    hard_end = t0 + max(seconds, max_seconds or seconds)
    end = t0 + seconds  # moved on while the window holds fewer than ``min_completed``
    prompts = iter(prompts_for(100_000, vocab, prompt_tokens, seed=1))

    def running() -> bool:
        nonlocal end
        now = time.perf_counter()
        if now < end:
            return True
        if now < hard_end and sum(t >= start for t in done_at) < min_completed:
            end = now + 0.05
            return True
        return False

    async def worker(client: httpx.AsyncClient, delay: float) -> None:
        await asyncio.sleep(delay)  # a ramp, not a burst: a burst overflows the queue before any step runs
        while running():
            res = await one_request(client, base, next(prompts), new_tokens, timeout)
            if res.kind == "ok":
                done_at.append(time.perf_counter())
            else:
                errors.append(res.detail)
                await asyncio.sleep(0.05)

    async with make_client() as client:
        ramp = seconds / 8
        await asyncio.gather(*(worker(client, ramp * i / concurrency) for i in range(concurrency)))
    window = [t for t in done_at if start <= t <= end]
    return {"req_per_s": len(window) / (end - start), "completed": len(done_at), "errors": len(errors),
            "concurrency": concurrency, "seconds": end - t0, "error_sample": errors[:3]}


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


async def overload(base: str, *, rate: float, duration: float, max_requests: int | None, vocab: int,
                   prompt_tokens: int, new_tokens: int, timeout: float, seed: int = 0) -> dict:
    """Open loop: Poisson arrivals at ``rate`` for ``duration`` s or ``max_requests``, whichever first."""
    if max_requests is None:
        max_requests = math.ceil(rate * duration)
    rng = random.Random(seed)
    prompts = prompts_for(max_requests, vocab, prompt_tokens, seed=seed + 2)
    w, stop = QueueWatch(), asyncio.Event()
    tasks: list[asyncio.Task] = []
    async with make_client() as client:
        watcher = asyncio.create_task(watch_queue(client, base, w, stop))
        t0 = time.perf_counter()
        due = 0.0
        for p in prompts:
            due += rng.expovariate(rate)
            if due >= duration or time.perf_counter() - t0 >= duration:
                break  # (the second: a client that fell behind its schedule still stops on time)
            await asyncio.sleep(max(0.0, t0 + due - time.perf_counter()))
            tasks.append(asyncio.create_task(one_request(client, base, p, new_tokens, timeout)))
        send_end = time.perf_counter()
        send_s = send_end - t0
        results: list[Result] = await asyncio.gather(*tasks)
        total_s = time.perf_counter() - t0
        await asyncio.sleep(0.3)  # one more /metrics sample with the queue drained
        stop.set()
        await watcher
    ok = [r for r in results if r.kind == "ok"]
    rej = [r for r in results if r.kind == "rejected"]
    lost = [r for r in results if r.kind == "lost"]
    return {
        "offered_rate": rate, "sent": len(results), "send_seconds": send_s, "total_seconds": total_s,
        "accepted": len(ok) + len(lost), "completed": len(ok), "rejected_429": len(rej), "lost": len(lost),
        "lost_sample": [r.detail for r in lost[:5]],
        "completed_per_s": len(ok) / total_s if total_s else 0.0,
        # goodput while requests keep arriving (the drain after the last arrival is excluded)
        "completed_per_s_while_sending": sum(r.end <= send_end for r in ok) / send_s if send_s else 0.0,
        "latency_p50_s": pct([r.latency for r in ok], 50), "latency_p99_s": pct([r.latency for r in ok], 99),
        "latency_max_s": max((r.latency for r in ok), default=float("nan")),
        "reject_latency_p50_ms": 1e3 * pct([r.latency for r in rej], 50),
        "reject_latency_p99_ms": 1e3 * pct([r.latency for r in rej], 99),
        "queue_max_polled": max(w.samples, default=0), "queue_samples": len(w.samples),
        # queue_peak_server: the server's high-water mark since it started (saturation phase included)
        "queue_peak_server": w.peak, "queue_limit": w.limit, "running_max": w.running_max,
    }


# ---------------------------------------------------------------- main
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default",
                    help="'default' (SmolLM2-135M-Instruct), 'tiny' (random 2-layer Llama) or an HF folder")
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--max-waiting", type=int, default=32, help="the server's bounded queue (beyond: 429)")
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--calib-concurrency", type=int, default=None,
                    help="closed-loop clients for the saturation phase (default: max-num-seqs + max-waiting/2)")
    ap.add_argument("--calib-seconds", type=float, default=30.0)
    ap.add_argument("--load", type=float, default=2.0, help="offered rate as a multiple of saturation")
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--request-timeout", type=float, default=300.0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the server")
    ap.add_argument("--no-engine-process", action="store_true",
                    help="the engine as a thread of the server's process (default: its own process)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    conc = args.calib_concurrency or args.max_num_seqs + args.max_waiting // 2

    with tempfile.TemporaryDirectory() as tmp:
        if args.model == "tiny":
            model, vocab = str(tiny_llama_folder(Path(tmp) / "tiny")), 128
        elif args.model == "default":
            model, vocab = None, 49152
        else:
            model = args.model
            vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
        t = time.perf_counter()
        srv = start_server(model, max_waiting=args.max_waiting, threads=args.threads, log_dir=Path(tmp),
                           extra=["--max-num-seqs", str(args.max_num_seqs),
                                  *(["--no-engine-process"] if args.no_engine_process else [])])
        print(f"server up at {srv.base} (pid {srv.proc.pid}) in {time.perf_counter() - t:.1f} s", flush=True)
        try:
            kw = dict(vocab=vocab, prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens)
            asyncio.run(saturation(srv.base, concurrency=2, seconds=3.0, timeout=args.request_timeout, **kw))  # warm
            sat = asyncio.run(saturation(srv.base, concurrency=conc, seconds=args.calib_seconds,
                                         timeout=args.request_timeout, **kw))
            sat["loadavg_1m"] = os.getloadavg()[0]
            print("saturation:", json.dumps(sat), flush=True)
            if sat["req_per_s"] <= 0:
                raise RuntimeError("no request completed in the saturation window: raise --calib-seconds")
            rate = args.load * sat["req_per_s"]
            ov = asyncio.run(overload(srv.base, rate=rate, duration=args.duration, max_requests=None,
                                      timeout=args.request_timeout, **kw))
            ov["loadavg_1m"] = os.getloadavg()[0]
            print("overload:", json.dumps(ov), flush=True)
        finally:
            srv.stop()
    ok = ov["lost"] == 0 and ov["queue_peak_server"] <= args.max_waiting and ov["queue_max_polled"] <= args.max_waiting
    print(f"\nsaturation {sat['req_per_s']:.2f} req/s ({conc} closed-loop clients, {args.calib_seconds:.0f} s); "
          f"offered {rate:.2f} req/s ({args.load:g}x) for {ov['send_seconds']:.0f} s: sent {ov['sent']}, "
          f"accepted {ov['accepted']}, completed {ov['completed']}, rejected (429) {ov['rejected_429']}, "
          f"lost {ov['lost']}; completed/s while sending {ov['completed_per_s_while_sending']:.2f} "
          f"({ov['completed_per_s_while_sending'] / sat['req_per_s']:.2f}x saturation); queue max {ov['queue_max_polled']} polled / {ov['queue_peak_server']} server peak "
          f"(limit {args.max_waiting}); latency p50 {ov['latency_p50_s']:.2f} s p99 {ov['latency_p99_s']:.2f} s; "
          f"429 in p50 {ov['reject_latency_p50_ms']:.0f} ms  -> {'PASS' if ok else 'FAIL'}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "saturation": sat, "overload": ov}, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
