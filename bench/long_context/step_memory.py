"""What one training step's forward + backward holds at its peak, by allocation site (issue 38).

The same trial as ``max_len.py --measure step`` (zeal's Llama, bf16, ZeRO 3, a warm-up step
of 128 tokens, then one measured step; ``--sp S``: S ranks under ``torchrun``), with the
measured forward + backward under ``torch.profiler`` (``profile_memory``, Python stacks).
Every CPU allocation and free of that window is replayed: the peak of the bytes allocated
above the window's start, and the allocations live at that moment, grouped by the
innermost zeal frame and the aten op that made them. Frees of tensors made before the
window (the warm-up's buffers) count as negative. Beside it, the RSS peak above the pre-step
RSS (VmHWM after a reset, what ``max_len_sp.py`` budgets).

    flock -w 1500 /tmp/zeal-cpu.lock python bench/long_context/step_memory.py --seq 1024
    flock -w 1500 /tmp/zeal-cpu.lock python -m torch.distributed.run --nproc-per-node 2 \\
        bench/long_context/step_memory.py --seq 2048 --sp 2
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import max_len as ml  # noqa: E402 - the trial's config and RSS probes beside this file

MIB = 1 << 20


def _site(stack: list) -> str:
    """The innermost zeal (or bench) frame above an allocation, and the op that allocated."""
    op = next((n.name for n in reversed(stack) if n.name.startswith("aten::")), "?")
    for n in reversed(stack):
        name = n.name
        if "zeal/zero/external.py" in name:  # ZeRO-3's watch on every torch call in forward: not the site
            continue
        if ("zeal/" in name or "bench/" in name) and ".py(" in name:
            return f"{name.split('zeal/')[-1] if 'zeal/' in name else name} {op}"
    return f"{stack[-1].name if stack else '?'} {op}"


def _allocations(prof) -> list[tuple[int, int, int, str]]:
    """``(time, ptr, bytes, site)`` of every CPU allocation (bytes > 0) and free (< 0), in time order."""
    from torch._C._profiler import _EventType

    out: list[tuple[int, int, int, str]] = []
    todo = [(r, []) for r in prof.profiler.kineto_results.experimental_event_tree()]
    while todo:
        node, stack = todo.pop()
        if node.typed[0] == _EventType.Allocation:
            e = node.typed[1]
            if e.device.type == "cpu":
                out.append((node.start_time_ns, e.ptr, e.alloc_size, _site(stack)))
        todo.extend((c, stack + [node]) for c in node.children)
    out.sort(key=lambda a: a[0])
    return out


def peak_report(events: list[tuple[int, int, int, str]], top: int = 25) -> dict:
    """The peak of the running byte count and what was live then, by site (MiB)."""
    level = peak = peak_i = 0
    for i, (_, _, size, _) in enumerate(events):
        level += size
        if level > peak:
            peak, peak_i = level, i
    live: dict[int, tuple[int, str]] = {}
    freed_old = 0
    for _, ptr, size, site in events[:peak_i + 1]:
        if size > 0:
            live[ptr] = (size, site)
        elif ptr in live:
            del live[ptr]
        else:
            freed_old += size
    by_site: dict[str, int] = defaultdict(int)
    for size, site in live.values():
        by_site[site] += size
    rows = sorted(by_site.items(), key=lambda kv: -kv[1])
    return {"peak_mib": peak / MIB, "freed_before_window_mib": freed_old / MIB,
            "live_at_peak": [(s, round(b / MIB, 1)) for s, b in rows[:top] if b >= MIB // 4],
            "at_site": events[peak_i][3]}


def rss_report(events: list[tuple[int, int, int, str]], samples: list[tuple[int, int]], base: int) -> dict:
    """The RSS peak's moment (from ``samples`` of (time, RSS)): the allocator level then and the sites of the
    allocations made in the 20 ms before it."""
    t_peak, rss = max(samples, key=lambda s: s[1])
    level, near = 0, defaultdict(int)
    for t, _, size, site in events:
        if t > t_peak:
            break
        level += size
        if t > t_peak - 20_000_000:
            near[site] += size
    return {"rss_peak_sampled_mib": (rss - base) / MIB, "alloc_level_then_mib": level / MIB,
            "allocated_just_before": [(s, round(b / MIB, 1)) for s, b in sorted(near.items(), key=lambda kv: -kv[1])
                                      if abs(b) >= MIB // 4][:8]}


def _sample_rss(out: list[tuple[int, int]], stop: threading.Event) -> None:
    while not stop.is_set():
        out.append((time.time_ns(), ml._rss()))
        time.sleep(0.002)


def label_phases(model, phase: list[str]) -> None:
    """``phase[0]``: the module whose forward began, or whose output's gradient arrived, last."""
    for name, mod in model.named_modules():
        def pre(m, args, name=name):
            phase[0] = f"fwd {name}"

        def post(m, args, out, name=name):
            import torch

            if isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(lambda g, name=name: phase.__setitem__(0, f"bwd {name}"))

        mod.register_forward_pre_hook(pre)
        mod.register_forward_hook(post)


def mallinfo() -> dict:
    """glibc's ``mallinfo2`` (MiB): ``arena`` bytes of the heaps (main and per-thread), ``in_use`` of
    them, ``free`` in them (held, not returned), ``mmapped`` blocks (torch's large tensors)."""
    import ctypes

    class _Info(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _Info
    i = libc.mallinfo2()
    with open("/proc/self/status") as f:  # resident anonymous and file-backed (code, mapped files) pages
        rss = {k: int(v.split()[0]) / 1024 for k, v in (line.split(":", 1) for line in f) if k in ("RssAnon", "RssFile")}
    return {"arena": i.arena / MIB, "in_use": i.uordblks / MIB, "free": i.fordblks / MIB, "mmapped": i.hblkhd / MIB,
            **rss}


def phase_peaks(samples: list[tuple[int, int, str]], base: int, top: int = 12) -> list[tuple[str, float]]:
    peaks: dict[str, int] = {}
    for _, rss, ph in samples:
        peaks[ph] = max(peaks.get(ph, 0), rss - base)
    return [(ph, round(b / MIB, 1)) for ph, b in sorted(peaks.items(), key=lambda kv: -kv[1])[:top]]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--mode", choices=ml.MODES, default="tiled")
    p.add_argument("--sp", type=int, default=1)
    p.add_argument("--zero", type=int, default=3)
    ml.add_shape_args(p)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--steady", action="store_true", help="one more unmeasured step at --seq before the measured "
                   "one (ZeRO-3's recorded trace then matches: prefetch and reuse are on, as in a run's later steps)")
    p.add_argument("--phases", action="store_true", help="no profiler: sample the RSS every millisecond and "
                   "report its peak per phase (the module whose forward or backward ran last)")
    p.add_argument("--json", help="append this rank's report as a JSON line")
    p.add_argument("--dump", help="write every allocation event (time, ptr, bytes, site) of this rank here (JSON)")
    args = p.parse_args()
    import torch
    from torch.profiler import ProfilerActivity, profile

    import zeal
    from zeal.models.llama import Llama, LlamaConfig
    from zeal.utils.process import set_malloc_thresholds

    set_malloc_thresholds(1 << 20)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.kv_heads, max_position_embeddings=1 << 22, tie_word_embeddings=False)
    engine = zeal.initialize(lambda: Llama(cfg), ml._config(args.mode, args.sp, args.zero))
    warm = torch.randint(0, args.vocab, (1, 128), generator=torch.Generator().manual_seed(2))
    engine.backward(engine(warm, labels=warm))
    engine.step()
    ids = torch.randint(0, args.vocab, (1, args.seq), generator=torch.Generator().manual_seed(1))
    if args.steady:
        engine.backward(engine(ids, labels=ids))
        engine.step()
    gc.collect()
    base = ml._rss()
    ml._reset_hwm()
    if args.phases:
        heap0 = mallinfo()
        phase = ["start"]
        label_phases(engine.module, phase)
        rows: list[tuple[int, int, str]] = []
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                rows.append((time.time_ns(), ml._rss(), phase[0]))
                time.sleep(0.001)

        th = threading.Thread(target=sample, daemon=True)
        th.start()
        loss = engine(ids, labels=ids)
        engine.backward(loss)
        stop.set()
        th.join()
        report = {"rank": int(os.environ.get("RANK", 0)), "sp": args.sp, "seq": args.seq, "phases": True,
                  "malloc_before": heap0, "malloc_after_backward": mallinfo(),
                  "rss_peak_mib": (ml._hwm() - base) / MIB, "by_phase": phase_peaks(rows, base, args.top),
                  "first_within_1mib_of_peak": next(ph for _, r, ph in rows if r >= max(q for _, q, _ in rows) - MIB)}
        print(json.dumps(report), flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(report) + "\n")
        engine.step()
        engine.close()
        return 0
    samples: list[tuple[int, int]] = []
    stop = threading.Event()
    sampler = threading.Thread(target=_sample_rss, args=(samples, stop), daemon=True)
    sampler.start()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, with_stack=True) as prof:
        loss = engine(ids, labels=ids)
        engine.backward(loss)
    stop.set()
    sampler.join()
    rss_peak = ml._hwm() - base
    engine.step()
    events = _allocations(prof)
    rank = int(os.environ.get("RANK", 0))
    report = {"rank": rank, "sp": args.sp, "seq": args.seq, "mode": args.mode, "steady": args.steady,
              "rss_peak_mib": rss_peak / MIB, "loss": float(loss.detach()), **peak_report(events, args.top),
              **rss_report(events, samples, base)}
    if args.dump:
        Path(f"{args.dump}.{rank}").write_text(json.dumps({"events": events, "rss": samples, "base": base}))
    print(json.dumps(report, indent=1), flush=True)
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(report) + "\n")
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
