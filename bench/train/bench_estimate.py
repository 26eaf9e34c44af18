"""`zeal estimate` against the measured peak RSS per rank (2 gloo ranks on CPU).

For each model size × ZeRO stage × activation checkpointing × precision, one
``torchrun`` job of 2 ranks (``OMP_NUM_THREADS=1`` each) builds zeal's GPT under
``zeal.initialize``, trains a few steps on random tokens (AdamW, zeal's default
config otherwise) and reports each rank's peak RSS (``ru_maxrss``), also at the end
of every forward, backward and optimizer step (so the phase that sets the peak is
visible). The launcher prints the planner's per-rank estimate for the same
configuration (``zeal.zero.estimate.plan(...).device``) beside the larger rank's
peak, and the error. Jobs run one after the other.

``--saved-tensors`` prints what autograd saves for backward in one zeal GPT block
and in the LM head / loss (``torch.autograd.graph.saved_tensors_hooks``, storages
counted once, parameters excluded), per b·s·h and per b·s·V, fp32 and bf16: the
measurement behind the planner's per-block constants.

Examples::

    python bench/train/bench_estimate.py --sizes 27m --stages 0,1,2,3 --ckpt off,on --dtypes fp32,bf16
    python bench/train/bench_estimate.py --sizes 124m --stages 3 --ckpt on --dtypes bf16 --steps 3
    python bench/train/bench_estimate.py --render bench/train/results/estimate_vs_rss.json
    python bench/train/bench_estimate.py --saved-tensors
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

SIZES = {
    # 27.4M parameters (tied head counted once)
    "27m": dict(vocab_size=4096, n_positions=256, n_embd=512, n_layer=8, n_head=8),
    # GPT-2 small, 123.8M parameters (n_positions 256, as bench_zero.py)
    "124m": dict(vocab_size=50257, n_positions=256, n_embd=768, n_layer=12, n_head=12),
}
DEFAULT_MICRO = {"27m": 8, "124m": 4}
ADAMW = dict(lr=1e-4, betas=[0.9, 0.999], eps=1e-8, weight_decay=0.01)
RESULTS = Path(__file__).resolve().parent / "results"


# --------------------------------------------------------------------------- worker


def _rss_mib() -> tuple[float, ...]:
    """(current, peak) resident set size of this process, and glibc's heap bytes in use,
    heap bytes free (kept by the allocator) and mmapped bytes, MiB."""
    with open("/proc/self/statm") as f:
        resident = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    heap = _mallinfo()
    return (resident / 2**20, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, *heap)


def _mallinfo() -> tuple[float, ...]:
    import ctypes

    class Info(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = Info
        i = libc.mallinfo2()
    except (OSError, AttributeError):
        return ()
    return (i.uordblks / 2**20, i.fordblks / 2**20, i.hblkhd / 2**20)


def worker(spec: dict) -> None:
    phases = {"start": _rss_mib()}
    import torch
    import torch.distributed as dist

    import zeal

    zeal.apply_process_settings()  # huge pages, as `zeal train` does
    from zeal.models import GPT, GPTConfig

    dist.init_process_group("gloo")
    phases["imported"] = _rss_mib()
    micro, seq, stage = spec["micro"], spec["seq"], spec["stage"]
    cfg = GPTConfig(**{**SIZES[spec["size"]], "n_positions": seq})
    zcfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": ADAMW}, "zero_optimization": {"stage": stage},
            "bf16": {"enabled": spec["dtype"] == "bf16"}}
    if spec["ckpt"]:  # per-block non-reentrant checkpointing, as `zeal estimate --budget` writes it
        zcfg["activation_checkpointing"] = {"number_checkpoints": cfg.n_layer}
    torch.manual_seed(0)
    engine = zeal.initialize((lambda: GPT(cfg)) if stage == 3 else GPT(cfg), zcfg)
    phases["built"] = _rss_mib()
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(1000 + rank)
    losses, times = [], []
    for i in range(spec["steps"]):
        x = torch.randint(0, cfg.vocab_size, (micro, seq), generator=gen)
        t0 = time.perf_counter()
        loss = engine(x, labels=x)
        phases[f"step{i + 1}.forward"] = _rss_mib()
        engine.backward(loss)
        phases[f"step{i + 1}.backward"] = _rss_mib()
        engine.step()
        phases[f"step{i + 1}.step"] = _rss_mib()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach().float()))
        del loss
    mine = dict(rank=rank, peak_mib=_rss_mib()[1], phases=phases, losses=losses, times=times,
                breakdown=engine.memory_breakdown(), checkpointing=engine.module.checkpoint_activations)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        print("RESULT " + json.dumps(dict(spec=spec, ranks=gathered, n_params=cfg.num_parameters())), flush=True)
    dist.barrier()
    dist.destroy_process_group()


# --------------------------------------------------------------------------- saved tensors


def saved_tensors(b: int = 2, s: int = 64, h: int = 128, n_head: int = 4, vocab: int = 1000) -> None:
    """Print what autograd keeps for one block and for the head + loss, beside the planner."""
    import torch

    from zeal.models import GPT, GPTConfig
    from zeal.zero.estimate import block_saved_bytes, gpt_shape

    shape = gpt_shape(1, h, n_head, vocab, s)
    for dtype, c in ((torch.float32, 4), (torch.bfloat16, 2)):
        model = GPT(GPTConfig(vocab_size=vocab, n_positions=s, n_embd=h, n_layer=1, n_head=n_head)).to(dtype)
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        seen: dict[int, tuple[int, tuple, torch.dtype]] = {}

        def pack(t, seen=seen, params=params):
            if t.untyped_storage().data_ptr() not in params:
                seen[t.untyped_storage().data_ptr()] = (t.untyped_storage().nbytes(), tuple(t.shape), t.dtype)
            return t

        x = torch.randint(0, vocab, (b, s))
        h0 = (model.transformer.wte(x) + model.transformer.wpe(torch.arange(s))).detach().requires_grad_()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model.transformer.h[0](h0)
            block = dict(seen)
            seen.clear()
            model(x, labels=x)
            head = {k: v for k, v in seen.items() if k not in block and v[1][-1:] == (vocab,)}
        total = sum(v[0] for v in block.values())
        print(f"{dtype}, b={b} s={s} h={h} heads={n_head}: one block saves {total} bytes = "
              f"{total / (b * s * h * c):.2f} values per b·s·h; planner {block_saved_bytes(shape, b, s, c)}")
        for n, shp, dt in sorted(block.values(), key=lambda v: -v[0]):
            print(f"    {n:>8} bytes  {shp} {dt}")
        print(f"  loss saves {sum(v[0] for v in head.values()) / (b * (s - 1) * vocab):.2f} bytes per "
              f"b·(s-1)·V ({', '.join(f'{v[1]} {v[2]}' for v in head.values())})")


# --------------------------------------------------------------------------- launcher


def estimate_for(spec: dict) -> int:
    """The planner's per-rank peak for the job described by ``spec`` (bytes)."""
    from zeal.zero.estimate import gpt_shape, plan

    m = {**SIZES[spec["size"]], "n_positions": spec["seq"]}
    shape = gpt_shape(m["n_layer"], m["n_embd"], m["n_head"], m["vocab_size"], m["n_positions"])
    return plan(shape, spec["nproc"], spec["stage"], micro_batch=spec["micro"], seq_len=spec["seq"],
                mixed_precision=spec["dtype"] == "bf16", checkpointing=spec["ckpt"]).device


def run_job(spec: dict, timeout: int) -> dict | None:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={spec['nproc']}",
           str(Path(__file__).resolve()), "--worker", json.dumps(spec)]
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, start_new_session=True)
    except subprocess.TimeoutExpired:
        print(f"# {label(spec)}: timed out after {timeout} s", flush=True)
        return None
    result = next((json.loads(line[7:]) for line in r.stdout.splitlines() if line.startswith("RESULT ")), None)
    if result is None or r.returncode:
        print(f"# {label(spec)}: failed (rc {r.returncode})\n" + "\n".join((r.stdout + r.stderr).splitlines()[-30:]),
              flush=True)
        return None
    result["job_wall_s"] = time.perf_counter() - t0
    return result


def label(spec: dict) -> str:
    return f"{spec['size']} {spec['dtype']} stage {spec['stage']} ckpt {'on' if spec['ckpt'] else 'off'}"


def row(result: dict) -> dict:
    spec = result["spec"]
    measured = max(r["peak_mib"] for r in result["ranks"])
    est = estimate_for(spec) / 2**20
    return dict(model=spec["size"], dtype=spec["dtype"], stage=spec["stage"], ckpt="on" if spec["ckpt"] else "off",
                estimate_mib=est, measured_mib=measured, error=(est - measured) / measured)


def render(results: list[dict]) -> str:
    lines = ["| model | dtype | stage | ckpt | micro × seq | estimate (MiB) | measured peak RSS (MiB) | error |",
             "|---|---|---:|---|---|---:|---:|---:|"]
    for res in results:
        r, spec = row(res), res["spec"]
        lines.append(f"| {r['model']} | {r['dtype']} | {r['stage']} | {r['ckpt']} | {spec['micro']} × {spec['seq']} "
                     f"| {r['estimate_mib']:.0f} | {r['measured_mib']:.0f} | {r['error']:+.1%} |")
    return "\n".join(lines)


def phases_table(result: dict) -> str:
    """Peak and current RSS of rank 0 at each phase end (MiB)."""
    ph = result["ranks"][0]["phases"]
    return "\n#   ".join(f"{k:16s} " + " ".join(f"{v:7.0f}" for v in vals) for k, vals in ph.items())


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--sizes", default="27m,124m", help="comma list of 27m,124m (default both)")
    ap.add_argument("--stages", default="0,1,2,3", help="comma list of ZeRO stages (default 0,1,2,3)")
    ap.add_argument("--ckpt", default="off,on", help="activation checkpointing: comma list of off,on")
    ap.add_argument("--dtypes", default="fp32,bf16", help="comma list of fp32,bf16")
    ap.add_argument("--steps", type=int, default=3, help="training steps per job (default 3)")
    ap.add_argument("--micro", type=int, default=None, help="micro-batch per rank (default 8 for 27m, 4 for 124m)")
    ap.add_argument("--seq", type=int, default=256, help="sequence length (default 256)")
    ap.add_argument("--nproc", type=int, default=2, help="ranks (default 2)")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per job before it is killed")
    ap.add_argument("--json", default=None,
                    help="raw results file (default bench/train/results/estimate_<sizes>.json; appended to)")
    ap.add_argument("--render", help="print the table of a results file (estimates recomputed), and exit")
    ap.add_argument("--saved-tensors", action="store_true", help="print autograd's saved tensors per block, and exit")
    args = ap.parse_args(argv)
    if args.worker:
        worker(json.loads(args.worker))
        return
    if args.saved_tensors:
        saved_tensors()
        return
    if args.render:
        print(render(json.loads(Path(args.render).read_text())))
        return
    sizes = [s for s in args.sizes.split(",") if s]
    for s in sizes:
        if s not in SIZES:
            ap.error(f"--sizes: unknown size {s!r} (known: {', '.join(SIZES)})")
    ckpts = []
    for c in args.ckpt.split(","):
        if c not in ("off", "on"):
            ap.error(f"--ckpt: expected off and/or on, got {c!r}")
        ckpts.append(c == "on")
    dtypes = [d for d in args.dtypes.split(",") if d]
    if set(dtypes) - {"fp32", "bf16"}:
        ap.error(f"--dtypes: expected fp32 and/or bf16, got {args.dtypes!r}")
    stages = [int(s) for s in args.stages.split(",") if s]
    out = Path(args.json) if args.json else RESULTS / f"estimate_{'_'.join(sizes)}.json"
    saved = json.loads(out.read_text()) if out.exists() else []
    print(f"# {time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs, {args.nproc} gloo ranks x OMP_NUM_THREADS=1, "
          f"{args.steps} steps; results -> {out}", flush=True)
    done = []
    for size in sizes:
        for dtype in dtypes:
            for stage in stages:
                for ckpt in ckpts:
                    spec = dict(size=size, dtype=dtype, stage=stage, ckpt=ckpt, micro=args.micro or DEFAULT_MICRO[size],
                                seq=args.seq, steps=args.steps, nproc=args.nproc)
                    res = run_job(spec, args.timeout)
                    if res is None:
                        continue
                    r = row(res)
                    print(f"# {label(spec)}: estimate {r['estimate_mib']:.0f} MiB, measured {r['measured_mib']:.0f} "
                          f"MiB ({r['error']:+.1%}), {res['job_wall_s']:.0f} s\n#   {phases_table(res)}", flush=True)
                    done.append(res)
                    saved = [s for s in saved if s["spec"] != spec] + [res]
                    out.parent.mkdir(parents=True, exist_ok=True)
                    out.write_text(json.dumps(saved, indent=1))
    print(render(done))


if __name__ == "__main__":
    main()
