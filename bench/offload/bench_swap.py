"""Swapped (nvme) optimizer step against the disk's physical limit, measured in the same run.

1. Disk: sequential O_DIRECT write then read of a scratch file (``--disk-gb``) with the
   same page-aligned buffers and syscalls the swap tier uses, with 1 and 4 concurrent
   streams; the best of each is taken as the disk's bandwidth. ``dd`` (oflag/iflag=direct)
   on the same size is printed as a second opinion when available.
   Also: one file read while another is written (4 streams each way).
2. Optimizer: :class:`SwappedAdam` over ``--numel`` fp32 elements (master + exp_avg +
   exp_avg_sq on disk, gradients in memory). A steady-state step reads and writes 12
   bytes per element, so bound A is ``12·numel/read_bw + 12·numel/write_bw`` seconds;
   since the step reads and writes at once, bound B = ``24·numel/concurrent_bw`` is the
   tighter physical limit.
3. Peer: the same Adam step with every tensor in memory (``torch.optim.AdamW``).

Usage: PYTHONPATH=. python bench/offload/bench_swap.py --path /folder/on/disk [--numel 200e6] [--fused]
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import shutil
import subprocess
import tempfile
import threading
import time

import torch

from zeal.utils.process import apply_process_settings
from zeal.zero.offload import CPUAdam, SwappedAdam, aligned_empty

apply_process_settings()  # huge pages, as `import zeal` used to set them

GB = 1e9


def disk_bandwidth(folder: str, nbytes: int, streams: int, chunk: int = 64 << 20) -> tuple[float, float]:
    """(write, read) bytes/s of sequential O_DIRECT I/O on a scratch file (fsynced), with
    ``streams`` threads each moving every ``streams``-th chunk (queue depth)."""
    bufs = [aligned_empty(chunk // 4) for _ in range(streams)]
    for b in bufs:
        b.copy_(torch.randn(b.numel()))
    mvs = [memoryview(b.view(torch.uint8).numpy()) for b in bufs]
    path = os.path.join(folder, "zeal-bench-disk.bin")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0), 0o600)
    n = nbytes // chunk

    def timed(io) -> float:
        def work(k: int) -> None:
            for i in range(k, n, streams):
                io(fd, [mvs[k]], i * chunk)

        t0 = time.perf_counter()
        threads = [threading.Thread(target=work, args=(k,)) for k in range(streams)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        os.fsync(fd)
        return n * chunk / (time.perf_counter() - t0)

    try:
        return timed(os.pwritev), timed(os.preadv)
    finally:
        os.close(fd)
        os.unlink(path)


def disk_concurrent_bandwidth(folder: str, nbytes: int, streams: int = 4, chunk: int = 64 << 20) -> float:
    """Bytes/s moved when one file is read and another written at the same time (``streams``
    threads each way, O_DIRECT), as the swapped step's read-ahead and write-behind do."""
    bufs = [aligned_empty(chunk // 4) for _ in range(2 * streams)]
    mvs = [memoryview(b.view(torch.uint8).numpy()) for b in bufs]
    flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0)
    paths = [os.path.join(folder, f"zeal-bench-{k}.bin") for k in ("src", "dst")]
    src, dst = (os.open(p, flags, 0o600) for p in paths)
    n = nbytes // 2 // chunk
    try:
        for i in range(n):
            os.pwritev(src, [mvs[0]], i * chunk)
        os.fsync(src)

        def work(k: int) -> None:
            fd, io = (src, os.preadv) if k < streams else (dst, os.pwritev)
            for i in range(k % streams, n, streams):
                io(fd, [mvs[k]], i * chunk)

        t0 = time.perf_counter()
        threads = [threading.Thread(target=work, args=(k,)) for k in range(2 * streams)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        os.fsync(dst)
        return 2 * n * chunk / (time.perf_counter() - t0)
    finally:
        for fd, p in zip((src, dst), paths):
            os.close(fd)
            os.unlink(p)


def dd_bandwidth(folder: str, nbytes: int) -> tuple[float, float] | None:
    """(write, read) bytes/s reported by dd with direct I/O, or None without dd."""
    if shutil.which("dd") is None:
        return None
    path = os.path.join(folder, "zeal-bench-dd.bin")
    count = nbytes // (64 << 20)

    def run(args: list[str]) -> float:
        out = subprocess.run(["dd", *args, "bs=64M", f"count={count}"], capture_output=True, text=True,
                             check=True).stderr
        return count * (64 << 20) / float(re.search(r"copied, ([\d.]+) s", out).group(1))

    try:
        return run(["if=/dev/zero", f"of={path}", "oflag=direct", "conv=fsync"]), \
            run([f"if={path}", "of=/dev/null", "iflag=direct"])
    except (subprocess.CalledProcessError, AttributeError):
        return None
    finally:
        if os.path.exists(path):
            os.unlink(path)


def in_memory_step(numel: int, grads: torch.Tensor, steps: int) -> float:
    p = torch.nn.Parameter(torch.randn(numel))
    opt = torch.optim.AdamW([p], lr=1e-4, weight_decay=0.01)
    p.grad = grads
    opt.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        opt.step()
    return (time.perf_counter() - t0) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--path", default=tempfile.gettempdir(), help="folder on the disk to test (nvme_path)")
    ap.add_argument("--numel", type=float, default=200e6, help="fp32 master elements")
    ap.add_argument("--sub-group-size", type=float, default=25e6)
    ap.add_argument("--buffer-count", type=int, default=9)
    ap.add_argument("--io-parallelism", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3, help="timed steady-state steps")
    ap.add_argument("--disk-gb", type=float, default=4.0)
    ap.add_argument("--fused", action="store_true", help="torch's fused CPU Adam kernel (not bitwise)")
    ap.add_argument("--skip-peer", action="store_true")
    args = ap.parse_args()
    numel, sgs = int(args.numel), int(args.sub_group_size)

    w_bw = r_bw = 0.0
    for streams in (1, 4):
        w, r = disk_bandwidth(args.path, int(args.disk_gb * GB), streams)
        w_bw, r_bw = max(w_bw, w), max(r_bw, r)
        print(f"disk O_DIRECT {args.disk_gb:.1f} GB, {streams} stream(s): write {w / GB:.2f} GB/s, "
              f"read {r / GB:.2f} GB/s")
    rw_bw = disk_concurrent_bandwidth(args.path, int(args.disk_gb * GB))
    print(f"disk O_DIRECT, read one file while writing another: {rw_bw / GB:.2f} GB/s moved")
    dd = dd_bandwidth(args.path, int(args.disk_gb * GB))
    if dd:
        print(f"disk dd direct:                  write {dd[0] / GB:.2f} GB/s, read {dd[1] / GB:.2f} GB/s")

    grads = torch.randn(numel).mul_(1e-3)
    opt = SwappedAdam(numel, CPUAdam(lr=1e-4, weight_decay=0.01, fused=args.fused), args.path,
                      sub_group_size=sgs, buffer_count=args.buffer_count, io_parallelism=args.io_parallelism)
    chunk = aligned_empty(sgs)
    t0 = time.perf_counter()
    for lo in range(0, numel, sgs):
        n = min(sgs, numel - lo)
        chunk[:n].normal_()
        opt.write_master(chunk[:n], lo)
    print(f"state: {numel / 1e6:.0f}M elements, {12 * numel / GB:.2f} GB of master+m+v on disk, "
          f"sub_group_size {sgs / 1e6:.0f}M, buffer_count {args.buffer_count} "
          f"({opt.slots} sub-groups in flight, {args.buffer_count * sgs * 4 / GB:.2f} GB of buffers), "
          f"direct I/O {opt.store.direct_io}, {'fused' if args.fused else 'bitwise'} Adam; "
          f"init write {time.perf_counter() - t0:.1f} s")
    first = opt.step(grads)  # moments are zero-filled, not read
    print(f"first step (no moment reads): {first.seconds:.2f} s")
    bound = 12 * numel / r_bw + 12 * numel / w_bw
    bound_rw = 24 * numel / rw_bw
    rows = []
    for _ in range(args.steps):
        s = opt.step(grads)
        assert s.bytes_read == s.bytes_written == 12 * numel
        rows.append(s)
        print(f"step {s.seconds:.2f} s (ratio {s.seconds / bound:.2f}x / {s.seconds / bound_rw:.2f}x); main thread "
              f"waiting on disk {s.io_wait_seconds:.2f} s, updating {s.compute_seconds:.2f} s; "
              f"{(s.bytes_read + s.bytes_written) / s.seconds / GB:.2f} GB/s moved")
    best = min(r.seconds for r in rows)
    mean = sum(r.seconds for r in rows) / len(rows)
    opt.close()
    rss_swapped = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    peer = None if args.skip_peer else in_memory_step(numel, grads, 2)
    print("\nsummary")
    print(f"  bytes across the disk per step : {24 * numel / GB:.2f} GB (read 12 B + write 12 B per element)")
    print(f"  disk bandwidth (best measured) : read {r_bw / GB:.2f} GB/s, write {w_bw / GB:.2f} GB/s")
    print(f"  bound A: 12B/read + 12B/write  : {bound:.2f} s (reads and writes one after the other)")
    print(f"  bound B: 24B/concurrent r+w bw : {bound_rw:.2f} s (reads and writes at once, as the step does)")
    print(f"  swapped step, best / mean      : {best:.2f} s / {mean:.2f} s")
    print(f"  ratio to bound A, best / mean  : {best / bound:.2f}x / {mean / bound:.2f}x (target <= 1.5x)")
    print(f"  ratio to bound B, best / mean  : {best / bound_rw:.2f}x / {mean / bound_rw:.2f}x")
    if peer is not None:
        print(f"  in-memory torch AdamW step     : {peer:.2f} s (state in RAM: {16 * numel / GB:.2f} GB)")
    print(f"  peak RSS before the peer       : {rss_swapped:.2f} GB (gradients {4 * numel / GB:.2f} GB "
          "in memory)")


if __name__ == "__main__":
    main()
