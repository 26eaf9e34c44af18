"""ZeRO-Infinity capacity: train a GPT whose training state is larger than this
machine's memory, with optimizer state and parameters on disk.

Runs a ~1.5B-parameter GPT (48 layers, d 1600, vocab 50257) under ZeRO-3 with
``offload_optimizer`` and ``offload_param`` on nvme, bf16, on N gloo ranks, for a
few steps, and prints per rank: step time, optimizer-step time and its disk
traffic, peak RSS. In the same run it measures the disk's sequential write and
read bandwidth (dd with direct I/O) and reports the optimizer step against the
bound: bytes that must cross the disk / bandwidth. It also prints what the same
model needs without offload (the ZeRO formulas) beside this machine's memory.

    python bench/offload/bench_capacity.py --path /var/tmp/zeal-swap --nproc 2 --steps 3
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _shared import timed_step  # noqa: E402


def disk_bandwidth(path: str, gib: int = 4) -> tuple[float, float]:
    """(write, read) bytes/s of a sequential direct-I/O pass over a ``gib`` GiB file."""
    f = os.path.join(path, "zeal-dd-probe")
    try:
        t0 = time.perf_counter()
        subprocess.run(["dd", "if=/dev/zero", f"of={f}", "bs=8M", f"count={gib * 128}", "oflag=direct",
                        "conv=fsync", "status=none"], check=True)
        w = gib * 2**30 / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        subprocess.run(["dd", f"if={f}", "of=/dev/null", "bs=8M", "iflag=direct", "status=none"], check=True)
        r = gib * 2**30 / (time.perf_counter() - t0)
    finally:
        if os.path.exists(f):
            os.remove(f)
    return w, r


def worker(args: argparse.Namespace) -> None:
    import torch

    import zeal

    zeal.apply_process_settings()  # huge pages, as `zeal train` does
    from zeal.models import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=50257, n_positions=args.seq, n_embd=args.n_embd, n_layer=args.n_layer,
                    n_head=args.n_head)
    swap = args.path
    config = {
        "train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {
            "stage": 3, "stage3_param_persistence_threshold": 0, "sub_group_size": args.sub_group,
            "offload_optimizer": {"device": "nvme", "nvme_path": swap, "buffer_count": 9},
            "offload_param": {"device": "nvme", "nvme_path": swap, "buffer_count": 4,
                              "buffer_size": 90_000_000},
        },
    }
    t0 = time.perf_counter()
    engine = zeal.initialize(lambda: GPT(cfg), config)
    build_s = time.perf_counter() - t0
    rss_after_build = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    g = torch.Generator().manual_seed(engine.rank)
    rows = []
    for step in range(args.steps):
        x = torch.randint(0, cfg.vocab_size, (1, args.seq), generator=g)
        loss, fwd, bwd, opt = timed_step(engine, x)
        st = engine._p.zero_optimizer.last_stats
        rows.append({"step": step, "loss": loss.item(), "forward_s": fwd, "backward_s": bwd,
                     "optimizer_s": opt, "opt_io_wait_s": st.io_wait_seconds,
                     "opt_bytes": st.bytes_read + st.bytes_written})
        if engine.rank == 0:
            print(json.dumps(rows[-1]), flush=True)
    mem = engine.memory_breakdown()
    out = {"rank": engine.rank, "params": cfg.num_parameters(), "build_s": build_s,
           "rss_after_build_gib": rss_after_build,
           "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, "memory": mem,
           "steps": rows}
    print("RESULT " + json.dumps(out), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--path", default="/var/tmp/zeal-swap", help="swap folder (on the disk to test)")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--n-layer", type=int, default=48)
    ap.add_argument("--n-embd", type=int, default=1600)
    ap.add_argument("--n-head", type=int, default=25)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--sub-group", type=int, default=20_000_000)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    os.makedirs(args.path, exist_ok=True)
    from zeal.models import GPTConfig
    from zeal.zero.estimate import model_state_bytes

    psi = GPTConfig(vocab_size=50257, n_positions=args.seq, n_embd=args.n_embd, n_layer=args.n_layer,
                    n_head=args.n_head).num_parameters()
    total_mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    print(f"model: {psi / 1e9:.3f}B parameters; machine memory {total_mem / 2**30:.1f} GiB")
    floor = args.nproc * 0.5 * 2**30 + 1 * 2**30  # torch + gloo per process, and the OS
    for stage in (0, 1, 2, 3):
        need = model_state_bytes(psi, args.nproc, stage).total * args.nproc
        verdict = "cannot start" if need + floor > total_mem else "fits"
        print(f"  without offload, ZeRO-{stage} on {args.nproc} ranks needs {need / 2**30:.1f} GiB of model "
              f"states in all, + {floor / 2**30:.1f} GiB runtime floor, before activations: {verdict}")
    w_bw, r_bw = disk_bandwidth(args.path)
    print(f"disk: sequential write {w_bw / 2**30:.2f} GiB/s, read {r_bw / 2**30:.2f} GiB/s (dd, direct I/O)")
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 2) // args.nproc)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
           __file__, "--worker", "--path", args.path, "--steps", str(args.steps), "--n-layer", str(args.n_layer),
           "--n-embd", str(args.n_embd), "--n-head", str(args.n_head), "--seq", str(args.seq),
           "--sub-group", str(args.sub_group)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=7200)
    results = [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or len(results) != args.nproc:
        print(proc.stdout[-3000:], proc.stderr[-5000:])
        raise SystemExit(f"worker failed (exit {proc.returncode})")
    for res in sorted(results, key=lambda r: r["rank"]):
        last = res["steps"][-1]
        print(f"rank {res['rank']}: build {res['build_s']:.0f}s, peak RSS {res['peak_rss_gib']:.2f} GiB "
              f"(after build {res['rss_after_build_gib']:.2f}), last step: fwd {last['forward_s']:.1f}s "
              f"bwd {last['backward_s']:.1f}s optimizer {last['optimizer_s']:.1f}s "
              f"(waiting on disk {last['opt_io_wait_s']:.1f}s), loss {last['loss']:.3f}; "
              f"disk: params {res['memory']['params_disk'] / 2**30:.1f} GiB, "
              f"optimizer {res['memory']['optimizer_disk'] / 2**30:.1f} GiB")
    # Both ranks share the disk: the optimizer step must move every rank's bytes.
    opt_bytes = sum(r["steps"][-1]["opt_bytes"] for r in results)
    read_b = write_b = opt_bytes / 2
    bound = read_b / r_bw + write_b / w_bw
    opt_s = max(r["steps"][-1]["optimizer_s"] for r in results)
    print(f"optimizer step: {opt_s:.1f}s vs disk bound {bound:.1f}s "
          f"({opt_bytes / 2**30:.1f} GiB moved) -> {opt_s / bound:.2f}x the bound")
    shutil.rmtree(args.path, ignore_errors=True)


if __name__ == "__main__":
    tempfile.tempdir = None
    main()
