"""Peak memory of `zeal checkpoint export` on a model of >= 1 GB (fp32).

Step 1 (one process): build a zeal GPT (~300M parameters, 1.2 GB fp32) under zeal at
world size 1 and save a checkpoint. Step 2 (a fresh process): export it to a Hugging
Face folder and report the peak resident memory above the process baseline, next to
the model size and the largest tensor. A peer figure: loading the whole state dict
(what a gather-then-save consolidation does) needs at least the model size.

    python bench/checkpoint/bench_export.py [--dir /tmp/zeal_export_bench] [--layers 20]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path


def rss_peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def current_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def save(d: Path, layers: int, embd: int) -> None:
    import torch

    import zeal

    zeal.apply_process_settings()  # huge pages, as `zeal train` does
    from zeal.models.gpt import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=50257, n_positions=1024, n_embd=embd, n_layer=layers, n_head=16)
    engine = zeal.initialize(lambda: GPT(cfg), {"train_micro_batch_size_per_gpu": 1,
                                                "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}})
    n = sum(p.numel() for p in engine.module.parameters())
    t0 = time.perf_counter()
    engine.save_checkpoint(str(d / "ckpt"), tag="bench")
    print(json.dumps({"params": n, "save_s": round(time.perf_counter() - t0, 2)}))
    del torch


def anon_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


def export(d: Path) -> None:
    import threading

    import torch  # noqa: F401 - count the import in the baseline

    from zeal.checkpoint.export import export_hf, open_verified

    base, base_anon = current_rss(), anon_rss()
    peak_anon, done = [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak_anon[0] = max(peak_anon[0], anon_rss())
            time.sleep(0.005)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    t0 = time.perf_counter()
    s = export_hf(d / "ckpt", d / "hf")
    dt = time.perf_counter() - t0
    done.set()
    th.join()
    _, meta, _ = open_verified(d / "ckpt" / "bench")
    largest = max(4 * _numel(v["shape"]) for v in meta["params"].values())
    print(json.dumps({"export_s": round(dt, 2), "model_bytes": s["bytes"], "largest_tensor_bytes": largest,
                      "peak_rss_above_baseline": rss_peak() - base, "peak_anon_above_baseline": peak_anon[0] - base_anon,
                      "baseline_rss": base}))


def _numel(shape: list[int]) -> int:
    n = 1
    for x in shape:
        n *= x
    return n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/zeal_export_bench")
    ap.add_argument("--layers", type=int, default=20)
    ap.add_argument("--embd", type=int, default=1024)
    ap.add_argument("--step", choices=["all", "save", "export"], default="all")
    a = ap.parse_args()
    d = Path(a.dir)
    if a.step == "save":
        return save(d, a.layers, a.embd)
    if a.step == "export":
        return export(d)
    for step in ("save", "export"):
        subprocess.run([sys.executable, __file__, "--dir", str(d), "--layers", str(a.layers),
                        "--embd", str(a.embd), "--step", step], check=True)


if __name__ == "__main__":
    main()
