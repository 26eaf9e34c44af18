"""The longest sequence that trains at a fixed memory budget per rank (peak host RSS).

One trial = one fresh process (``torchrun`` with ``--sp S`` ranks) that builds zeal's
Llama (default ≈106M parameters: 8 layers, hidden 768, SwiGLU 2048, 12 heads / 4 kv
heads, vocabulary 32000, untied head) in bf16 with fp32 Adam masters, and runs one
training step (forward, backward, optimizer step) on one random sequence of N tokens.
A watchdog thread ends the trial as soon as its RSS passes the budget; a trial
succeeds when the step finished and the process's peak RSS (``ru_maxrss``) is within
the budget. glibc returns freed blocks of 1 MiB and more at once (in both modes), so
RSS measures live tensors rather than heap fragmentation. The length is searched by doubling from ``--start`` and then bisecting to
``--resolution`` tokens, per mode:

* ``untiled``: the model as it is (no checkpointing, whole logits);
* ``tiled``: ALST's TiledMLP + tiled logits loss (``tiling``, num_shards "auto") +
  activation checkpointing with ``cpu_checkpointing`` (on a CPU run the checkpointed
  layer inputs already are in host memory, so it is plain checkpointing there).

``--sp S`` sets ``sequence_parallel_size`` (Ulysses; every rank gets the same full
sequence and zeal shards it); a zeal without sequence parallelism refuses it and the
bench says so. Run it under the shared CPU lock::

    flock -w 1500 /tmp/zeal-cpu.lock python bench/long_context/max_len.py --budget 2.5GB
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODES = ("untiled", "tiled")


def _config(mode: str, sp: int, zero: int | None = None) -> dict:
    cfg: dict = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
                 "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "steps_per_print": 1000}
    if sp > 1:
        cfg["sequence_parallel_size"] = sp
    if sp > 1 or zero is not None:
        cfg["zero_optimization"] = {"stage": 3 if zero is None else zero}
    if mode == "tiled":
        cfg["tiling"] = {"tiled_mlp": {"enabled": True, "num_shards": "auto"},
                         "tiled_logits_loss": {"enabled": True, "num_shards": "auto"}}
        cfg["activation_checkpointing"] = {"cpu_checkpointing": True}
    return cfg


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


_BASE = [0]  # --measure step: the RSS at the start of the measured step (0: whole-process peak)


def _watchdog(budget: int) -> None:
    while True:
        if _rss() - _BASE[0] > budget:
            print(json.dumps({"over": True, "rss": _rss() - _BASE[0]}), flush=True)
            os._exit(3)
        time.sleep(0.01)


def _hwm() -> int:
    """VmHWM: the peak RSS since the last reset (:func:`_reset_hwm`)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def _reset_hwm() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # "5": reset the peak RSS (Linux >= 4.0)
        f.write("5")


def trial(args: argparse.Namespace) -> int:
    """One step at ``args.seq`` tokens in this process (a rank of the trial)."""
    if args.measure == "peak":
        threading.Thread(target=_watchdog, args=(args.budget_bytes,), daemon=True).start()
    import torch

    import zeal
    from zeal.utils.process import set_malloc_thresholds

    # Freed blocks of 1 MiB and more go back to the OS at once (what zeal does for stage 3):
    # otherwise glibc keeps freed activations as heap holes and RSS measures fragmentation
    # (tiled at 4096 tokens: 2.62 GiB peak with glibc's defaults, 2.19 GiB with this), for both modes.
    set_malloc_thresholds(args.mmap_threshold)
    from zeal.models.llama import Llama, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.kv_heads, max_position_embeddings=1 << 22, tie_word_embeddings=False)
    engine = zeal.initialize(lambda: Llama(cfg), _config(args.mode, args.sp, args.zero))
    n_params = sum(p.numel() for p in engine.module.parameters())  # full shapes, at any ZeRO stage
    built = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    step_mode = args.measure == "step"
    if step_mode:  # a short warm-up step makes the optimizer states and buffers; then measure one step
        warm = torch.randint(0, args.vocab, (1, args.warmup), generator=torch.Generator().manual_seed(2))
        engine.backward(engine(warm, labels=warm))
        engine.step()
        import gc

        gc.collect()
        built = _rss()
        _BASE[0] = built
        _reset_hwm()
        threading.Thread(target=_watchdog, args=(args.budget_bytes,), daemon=True).start()
    ids = torch.randint(0, args.vocab, (1, args.seq), generator=torch.Generator().manual_seed(1))
    t0 = time.perf_counter()
    loss = engine(ids, labels=ids)
    engine.backward(loss)
    peak_fb = (_hwm() - built) if step_mode else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    _BASE[0] += 1 << 50 if step_mode else 0  # step: the budget bounds forward + backward (the optimizer step's
    engine.step()  # temporaries are the model states', equal at every length)
    step_s = time.perf_counter() - t0
    peak = peak_fb if step_mode else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"ok": True, "loss": float(loss), "peak": peak, "peak_fb": peak_fb, "built": built,
                      "step_s": step_s,
                      "params": n_params, "rank": int(os.environ.get("RANK", 0))}), flush=True)
    engine.close()
    return 0


def _run_trial(args: argparse.Namespace, mode: str, seq: int) -> dict:
    """A fresh process (or ``--sp`` ranks) for one length; the worst rank's result."""
    argv = [__file__, "--trial", "--mode", mode, "--seq", str(seq), "--budget", str(args.budget_bytes),
            "--sp", str(args.sp), "--layers", str(args.layers), "--hidden", str(args.hidden),
            "--intermediate", str(args.intermediate), "--heads", str(args.heads), "--kv-heads", str(args.kv_heads),
            "--vocab", str(args.vocab), "--measure", args.measure, "--warmup", str(args.warmup),
            "--mmap-threshold", str(getattr(args, "mmap_threshold", 1 << 20))]
    if args.zero is not None:
        argv += ["--zero", str(args.zero)]
    if args.sp > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.sp), "--master-port",
               str(29500 + seq % 1000), *argv]
    else:
        cmd = [sys.executable, *argv]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
    env.setdefault("OMP_NUM_THREADS", str(args.threads))
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.trial_timeout)
    except subprocess.TimeoutExpired:
        return {"ok": False, "why": f"timeout {args.trial_timeout}s"}
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    if any(r.get("over") for r in rows):
        return {"ok": False, "why": "over budget", "peak": max(r["rss"] for r in rows if r.get("over"))}
    done = [r for r in rows if r.get("ok")]
    if out.returncode != 0 or len(done) < max(args.sp, 1):
        tail = (out.stderr.strip().splitlines() or ["?"])[-1]
        return {"ok": False, "why": f"rc {out.returncode}: {tail[:200]}"}
    worst = max(done, key=lambda r: r["peak"])
    return {**worst, "ok": worst["peak"] <= args.budget_bytes, "why": "" if worst["peak"] <= args.budget_bytes
            else "peak over budget"}


def search(args: argparse.Namespace, mode: str) -> dict:
    """Doubling from ``--start``, then bisection to ``--resolution`` tokens."""
    good, bad, seq, best = 0, None, args.start, None
    while bad is None or bad - good > args.resolution:
        r = _run_trial(args, mode, seq)
        peak = f"peak {r['peak'] / 2**30:.2f} GiB" if "peak" in r else ""
        if "peak_fb" in r:
            peak += f" (fwd+bwd {r['peak_fb'] / 2**30:.2f})"
        step = f"step {r['step_s']:.1f} s" if r.get("step_s") else ""
        print(f"  {mode:<8} seq {seq:>7}: {'ok ' if r['ok'] else 'NO '} {peak} {step} {r.get('why', '')}", flush=True)
        if r["ok"]:
            good, best = seq, r
        else:
            bad = seq
        if bad is None:
            if seq >= args.max:
                break  # trained at the cap: the longest is at least this
            seq = min(seq * 2, args.max)
        else:
            if good == 0 and seq <= args.resolution:
                break
            seq = (good + bad) // 2 // args.resolution * args.resolution or args.resolution
            if seq <= good:
                break
    return {"mode": mode, "max_len": good, "capped": bad is None and good >= args.max, **({} if best is None else
                                                {"peak": best["peak"], "step_s": best["step_s"],
                                                 "built": best["built"], "params": best["params"]})}


def _bytes(text: str) -> int:
    from zeal.zero.estimate import parse_bytes

    return parse_bytes(text) if not text.isdigit() else int(text)


def add_shape_args(p: argparse.ArgumentParser) -> None:
    """The trial model's shape (zeal's Llama, ≈100M at the defaults)."""
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget", default="2.5GB", help="peak RSS per rank (default 2.5GB)")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated: untiled, tiled")
    p.add_argument("--sp", type=int, default=1, help="sequence_parallel_size (ranks per trial)")
    p.add_argument("--start", type=int, default=1024, help="first length tried (default 1024)")
    p.add_argument("--resolution", type=int, default=512, help="bisect to this many tokens (default 512)")
    p.add_argument("--max", type=int, default=1 << 20, help="longest length tried (a trial there that trains ends the search)")
    add_shape_args(p)
    p.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of a trial (default 2)")
    p.add_argument("--trial-timeout", type=float, default=900.0, help="seconds per trial")
    p.add_argument("--zero", type=int, default=None, help="ZeRO stage of every trial (default: 3 at --sp > 1, "
                   "none at sp 1)")
    p.add_argument("--measure", choices=("peak", "step"), default="peak",
                   help="peak: the budget bounds the process's peak RSS; step: the peak RSS of one measured forward + "
                   "backward above the RSS before it (after a --warmup step made the optimizer states)")
    p.add_argument("--warmup", type=int, default=128, help="tokens of the warm-up step of --measure step")
    p.add_argument("--mmap-threshold", type=int, default=1 << 20, help="glibc's mmap and trim thresholds in the "
                   "trials (bytes; default 1 MiB): blocks from this size on are mapped and returned at free")
    p.add_argument("--lengths", help="comma-separated: run one trial at each (no search) and report it")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--trial", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", default="untiled", help=argparse.SUPPRESS)
    p.add_argument("--seq", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    args.budget_bytes = _bytes(args.budget)
    if args.trial:
        return trial(args)
    modes = [m for m in args.modes.split(",") if m]
    if bad := [m for m in modes if m not in MODES]:
        p.error(f"--modes: unknown {bad}; choose from {', '.join(MODES)}")
    if args.sp > 1:
        from zeal.config import ConfigError, load_config

        try:
            load_config(_config("tiled", args.sp))
        except ConfigError as e:
            print(f"--sp {args.sp}: this zeal has no sequence parallelism yet ({e})", file=sys.stderr)
            return 2
    print(f"zeal Llama {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, bf16; sp {args.sp}; "
          f"budget {args.budget_bytes / 2**30:.2f} GiB peak RSS per rank", flush=True)
    if args.lengths:
        rows = [{"mode": m, "seq": n, **_run_trial(args, m, n)} for m in modes for n in map(int, args.lengths.split(","))]
        for r in rows:
            print(json.dumps({k: r.get(k) for k in ("mode", "seq", "ok", "why", "peak", "peak_fb", "step_s")}))
        if args.json:
            Path(args.json).write_text(json.dumps({"budget": args.budget_bytes, "sp": args.sp, "trials": rows},
                                                  indent=2))
        return 0
    results = [search(args, m) for m in modes]
    for r in results:
        extra = (f"peak {r['peak'] / 2**30:.2f} GiB (after build {r['built'] / 2**30:.2f}), step {r['step_s']:.1f} s, "
                 f"{r['params'] / 1e6:.1f}M params") if "peak" in r else "nothing trained"
        at_least = ">= " if r["capped"] else ""
        print(f"{r['mode']:<8} sp {args.sp}: longest {at_least}{r['max_len']} tokens"
              f"{' (the --max cap)' if r['capped'] else ''}; {extra}")
    if len(results) == 2 and results[0]["max_len"]:
        at_least = ">= " if results[1]["capped"] else ""
        print(f"tiled / untiled: {at_least}{results[1]['max_len'] / results[0]['max_len']:.1f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"budget": args.budget_bytes, "sp": args.sp, "results": results},
                                              indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
