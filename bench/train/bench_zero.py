"""Training step time and peak memory: zeal ZeRO stages beside PyTorch DDP, FSDP2 and DeepSpeed.

Each configuration is a separate ``torchrun`` job of 2 gloo ranks on CPU
(``OMP_NUM_THREADS=1`` per rank), so the peak RSS printed is that
configuration's own. Every job trains the same GPT (zeal's single-device
GPT-2 model) with the same micro-batch, the same data (seeded per rank), AdamW
with the same hyper-parameters and the same number of warm-up and timed steps.
Jobs are run interleaved (peer, then the zeal stages compared with it) and, with
``--repeats``, in alternating order, so that machine noise hits everyone alike.

Comparisons (ratios < 1 mean zeal is faster / smaller):

* zeal stages 0, 1, 2 against PyTorch DDP;
* zeal stage 3 against PyTorch FSDP2 (``fully_shard`` per block and the root,
  built on the meta device then ``to_empty`` + init) and against DeepSpeed
  ZeRO-3 (built under ``deepspeed.zero.Init``);
* peak RSS per rank of zeal stage 3 against the lowest of all peers.

bf16 means bf16 compute with fp32 master weights: DDP under
``torch.autocast("cpu", torch.bfloat16)``, FSDP2 with
``MixedPrecisionPolicy(param_dtype=bf16)``, DeepSpeed with ``bf16.enabled``,
zeal with ``bf16.enabled``.

DeepSpeed is never a zeal dependency: it runs from a separate virtual
environment (``--ds-python``, default ``/work/ds-venv/bin/python``) with
``DS_ACCELERATOR=cpu``, gloo and ``torch_adam`` (no C++ Adam build). Without it
the DeepSpeed rows are skipped with a message.

Example::

    python bench/train/bench_zero.py --sizes 10m --dtypes fp32,bf16 --steps 8
    python bench/train/bench_zero.py --sizes 124m --dtypes fp32 --warmup 3 --steps 5 \\
        --peers ddp,fsdp2,deepspeed --stages 2,3 --ds-stages 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
from _shared import clear_stale_extension_locks, load_gpt, peak_rss_mib  # noqa: E402

SIZES = {
    # ~10.1M parameters (tied head counted once)
    "10m": dict(vocab_size=8192, n_positions=256, n_embd=256, n_layer=10, n_head=8),
    # GPT-2 small, ~124M parameters
    "124m": dict(vocab_size=50257, n_positions=256, n_embd=768, n_layer=12, n_head=12),
}
DEFAULT_MICRO = {"10m": 4, "124m": 1}
ADAMW = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


# --------------------------------------------------------------------------- worker


def worker(spec: dict) -> None:
    # Every system runs with the same allocator setting zeal's commands use (transparent huge
    # pages for large CPU tensors); it must be set before torch's first allocation.
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    import torch
    import torch.distributed as dist

    kind, stage, bf16 = spec["kind"], spec.get("stage"), spec["dtype"] == "bf16"
    micro, seq = spec["micro"], spec["seq"]
    GPT, GPTConfig = load_gpt()
    cfg = GPTConfig(**SIZES[spec["size"]], dropout=0.0)
    cfg.n_positions = seq
    torch.manual_seed(0)
    t_build = time.perf_counter()

    ckpt = bool(spec.get("ckpt"))  # activation checkpointing per block (non-reentrant)
    if kind == "ddp":
        dist.init_process_group("gloo")
        plain = GPT(cfg)
        plain.checkpoint_activations = ckpt
        model = torch.nn.parallel.DistributedDataParallel(plain)
        opt = torch.optim.AdamW(model.parameters(), **ADAMW)

        def train_step(x):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss = model(x, labels=x)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

    elif kind == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        dist.init_process_group("gloo")
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if bf16 else MixedPrecisionPolicy()
        with torch.device("meta"):
            model = GPT(cfg)
        model.checkpoint_activations = ckpt
        for block in model.transformer.h:
            fully_shard(block, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        model.to_empty(device="cpu")
        with torch.no_grad():
            model.apply(model._init_weights)
        opt = torch.optim.AdamW(model.parameters(), **ADAMW)

        def train_step(x):
            loss = model(x, labels=x)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

    elif kind == "zeal":
        import zeal

        zeal.apply_process_settings()  # as `zeal train` does (huge pages already set above)

        zcfg = {
            "train_micro_batch_size_per_gpu": micro,
            "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {**ADAMW, "betas": list(ADAMW["betas"])}},
            "zero_optimization": {"stage": stage},
            "bf16": {"enabled": bf16},
        }
        if ckpt:
            zcfg["activation_checkpointing"] = {}
        engine = zeal.initialize((lambda: GPT(cfg)) if stage == 3 else GPT(cfg), zcfg)

        def train_step(x):
            loss = engine(x, labels=x)
            engine.backward(loss)
            engine.step()
            return loss

    elif kind == "deepspeed":
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        dcfg = {
            "train_micro_batch_size_per_gpu": micro,
            "gradient_accumulation_steps": 1,
            "train_batch_size": micro * dist.get_world_size(),
            "optimizer": {"type": "AdamW", "params": {**ADAMW, "betas": list(ADAMW["betas"]), "torch_adam": True}},
            "zero_optimization": {"stage": stage},
            "bf16": {"enabled": bf16},
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
        }
        if stage == 3:  # the recommended flow: partitioned at construction
            with deepspeed.zero.Init(config_dict_or_path=dcfg):
                model = GPT(cfg)
        else:
            model = GPT(cfg)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=dcfg)

        def train_step(x):
            loss = engine(x, labels=x)
            engine.backward(loss)
            engine.step()
            return loss

    else:
        raise ValueError(f"unknown kind {kind!r}")

    build_s = time.perf_counter() - t_build
    rss_after_build = peak_rss_mib()
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(1000 + rank)
    times, losses = [], []
    n_steps = spec["warmup"] + spec["steps"]
    prof = None
    for i in range(n_steps):
        x = torch.randint(0, cfg.vocab_size, (micro, seq), generator=gen)
        if spec.get("profile") and i == n_steps - 1 and rank == 0:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=False)
            prof.__enter__()
        t0 = time.perf_counter()
        loss = train_step(x)
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach().float()))
        if prof is not None:
            prof.__exit__(None, None, None)
    timed = times[spec["warmup"]:]
    mine = dict(rank=rank, times=timed, rss_mib=peak_rss_mib(), rss_after_build_mib=rss_after_build,
                build_s=build_s, losses=losses)
    gathered = [None] * world
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        per_step = [max(r["times"][i] for r in gathered) for i in range(len(timed))]
        step_s = statistics.median(per_step)
        out = dict(spec=spec, step_s=step_s, tokens_per_s=micro * seq * world / step_s,
                   rss_mib=[r["rss_mib"] for r in gathered],
                   rss_after_build_mib=[r["rss_after_build_mib"] for r in gathered],
                   build_s=max(r["build_s"] for r in gathered), step_times=per_step,
                   loss_first=[r["losses"][0] for r in gathered], loss_last=[r["losses"][-1] for r in gathered],
                   n_params=cfg.num_parameters())
        print("RESULT " + json.dumps(out), flush=True)
        if prof is not None:
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30), flush=True)
    dist.barrier()
    dist.destroy_process_group()


# --------------------------------------------------------------------------- launcher


def _label(kind: str, stage) -> str:
    return {"ddp": "DDP", "fsdp2": "FSDP2"}.get(kind) or (
        f"zeal stage {stage}" if kind == "zeal" else f"DeepSpeed ZeRO-{stage}")


def _deepspeed_ok(python: str) -> str | None:
    """None if DeepSpeed imports in ``python``; otherwise the reason."""
    if not python or not os.path.exists(python):
        return f"no DeepSpeed environment at {python!r}"
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    try:
        r = subprocess.run([python, "-c", "import deepspeed; print(deepspeed.__version__)"],
                           capture_output=True, text=True, timeout=180, env=env)
    except subprocess.TimeoutExpired:
        return "importing deepspeed timed out"
    if r.returncode:
        return "deepspeed does not import: " + (r.stderr.strip().splitlines() or ["?"])[-1]
    print(f"# DeepSpeed {r.stdout.strip().splitlines()[-1]} from {python}", flush=True)
    return None


def run_job(spec: dict, args) -> dict | None:
    python = args.ds_python if spec["kind"] == "deepspeed" else sys.executable
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if spec["kind"] == "deepspeed":
        env["DS_ACCELERATOR"] = "cpu"
        clear_stale_extension_locks()
    cmd = [python, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
           str(Path(__file__).resolve()), "--worker", json.dumps(spec)]
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env,
                           start_new_session=True)
    except subprocess.TimeoutExpired as e:
        print(f"# {_label(spec['kind'], spec.get('stage'))} {spec['size']} {spec['dtype']}: "
              f"timed out after {args.timeout}s", flush=True)
        tail = (e.stderr or b"")[-2000:] if isinstance(e.stderr, bytes) else (e.stderr or "")[-2000:]
        print(tail, flush=True)
        return None
    wall = time.perf_counter() - t0
    result = None
    for line in r.stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT "):])
    if result is None or r.returncode:
        print(f"# {_label(spec['kind'], spec.get('stage'))} {spec['size']} {spec['dtype']}: failed "
              f"(rc {r.returncode})", flush=True)
        print("\n".join((r.stdout + r.stderr).splitlines()[-30:]), flush=True)
        return None
    if spec.get("profile"):
        print(r.stdout, flush=True)
    result["job_wall_s"] = wall
    print(f"# {_label(spec['kind'], spec.get('stage')):20s} {spec['size']:5s} {spec['dtype']}: "
          f"{result['step_s']:.3f} s/step, peak RSS {max(result['rss_mib']):.0f} MiB, "
          f"loss {result['loss_first'][0]:.4f} -> {result['loss_last'][0]:.4f} ({wall:.0f} s job)", flush=True)
    return result


def plan(args, size: str, dtype: str, ds_ok: bool) -> list[tuple[str, int | None]]:
    """One round, ordered so that each zeal stage runs right after the peer it is compared with."""
    peers, stages, ds_stages = args.peers, args.stages, args.ds_stages if ds_ok else []
    jobs: list[tuple[str, int | None]] = []
    low = [s for s in stages if s < 3]
    if "ddp" in peers:
        jobs.append(("ddp", None))
    for s in low:
        jobs.append(("zeal", s))
    if "deepspeed" in peers:
        jobs += [("deepspeed", s) for s in ds_stages if s < 3]
    if "fsdp2" in peers:
        jobs.append(("fsdp2", None))
    if 3 in stages:
        jobs.append(("zeal", 3))
    if "deepspeed" in peers and 3 in ds_stages:
        jobs.append(("deepspeed", 3))
    return jobs


def _fmt_ratio(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}×"


def table(results: list[dict], size: str, dtype: str) -> str:
    rows = {}
    for r in results:
        key = (r["spec"]["kind"], r["spec"].get("stage"))
        rows.setdefault(key, []).append(r)
    agg = {}
    for key, rs in rows.items():  # median over repeats
        agg[key] = dict(step_s=statistics.median(r["step_s"] for r in rs),
                        best_s=min(min(r["step_times"]) for r in rs),
                        rss=[max(r["rss_mib"][i] for r in rs) for i in range(len(rs[0]["rss_mib"]))],
                        tok=statistics.median(r["tokens_per_s"] for r in rs),
                        loss=(rs[0]["loss_first"][0], rs[0]["loss_last"][0]), n=rs[0]["n_params"])

    def get(kind, stage=None):
        return agg.get((kind, stage))

    peers_rss = [max(v["rss"]) for k, v in agg.items() if k[0] != "zeal"]
    lowest_peer_rss = min(peers_rss) if peers_rss else None
    n = next(iter(agg.values()))["n"] / 1e6
    lines = [f"**{size} ({n:.1f}M params), {dtype}**", "",
             "| configuration | step (s, median) | best step (s) | tokens/s | peak RSS per rank (MiB) "
             "| loss first → last | time vs peer | RSS vs peer |",
             "|---|---:|---:|---:|---:|---|---|---|"]
    order = sorted(agg, key=lambda k: ({"ddp": 0, "zeal": 1, "fsdp2": 2, "deepspeed": 3}[k[0]], k[1] or 0))
    for key in order:
        v = agg[key]
        kind, stage = key
        t_cmp, m_cmp = [], []
        if kind == "zeal" and stage is not None and stage < 3 and get("ddp"):
            p = get("ddp")
            t_cmp.append(f"{_fmt_ratio(v['step_s'] / p['step_s'])} DDP")
            m_cmp.append(f"{_fmt_ratio(max(v['rss']) / max(p['rss']))} DDP")
        if kind == "zeal" and stage in (1, 2) and get("deepspeed", stage):
            p = get("deepspeed", stage)
            t_cmp.append(f"{_fmt_ratio(v['step_s'] / p['step_s'])} DS-{stage}")
            m_cmp.append(f"{_fmt_ratio(max(v['rss']) / max(p['rss']))} DS-{stage}")
        if kind == "zeal" and stage == 3:
            for pk, name in (("fsdp2", "FSDP2"), ("deepspeed", "DS-3")):
                p = get(pk, 3 if pk == "deepspeed" else None)
                if p:
                    t_cmp.append(f"{_fmt_ratio(v['step_s'] / p['step_s'])} {name}")
                    m_cmp.append(f"{_fmt_ratio(max(v['rss']) / max(p['rss']))} {name}")
            if lowest_peer_rss:
                m_cmp.append(f"{_fmt_ratio(max(v['rss']) / lowest_peer_rss)} lowest peer")
        lines.append(
            f"| {_label(kind, stage)} | {v['step_s']:.3f} | {v['best_s']:.3f} | {v['tok']:.0f} | "
            f"{' / '.join(f'{x:.0f}' for x in v['rss'])} | {v['loss'][0]:.3f} → {v['loss'][1]:.3f} | "
            f"{', '.join(t_cmp)} | {', '.join(m_cmp)} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--sizes", default="10m", help="comma list of 10m,124m (default: 10m)")
    ap.add_argument("--dtypes", default="fp32,bf16", help="comma list of fp32,bf16")
    ap.add_argument("--steps", type=int, default=6, help="timed steps per job (default 6)")
    ap.add_argument("--warmup", type=int, default=3, help="warm-up steps per job (default 3)")
    ap.add_argument("--peers", default="ddp,fsdp2,deepspeed", help="comma list of ddp,fsdp2,deepspeed")
    ap.add_argument("--stages", default="0,1,2,3", help="zeal ZeRO stages")
    ap.add_argument("--ds-stages", default="2,3", help="DeepSpeed ZeRO stages (default 2,3)")
    ap.add_argument("--micro", type=int, default=None,
                    help="micro-batch per rank (default: 4 for 10m, 1 for 124m)")
    ap.add_argument("--seq", type=int, default=256, help="sequence length (default 256)")
    ap.add_argument("--nproc", type=int, default=2, help="ranks (default 2)")
    ap.add_argument("--repeats", type=int, default=1, help="rounds; odd rounds run in reverse order")
    ap.add_argument("--reverse", action="store_true", help="run the first round in reverse order")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per job before it is killed")
    ap.add_argument("--ds-python", default=os.environ.get("ZEAL_BENCH_DS_PYTHON", "/work/ds-venv/bin/python"),
                    help="python of the environment that has deepspeed")
    ap.add_argument("--profile", action="store_true",
                    help="print a torch.profiler table of the last step of each zeal stage-3 job (rank 0)")
    ap.add_argument("--json", help="also write all results to this file")
    ap.add_argument("--render", help="print the tables of a results file written by --json, and exit")
    args = ap.parse_args(argv)
    if args.worker:
        worker(json.loads(args.worker))
        return
    if args.render:
        saved = json.loads(Path(args.render).read_text())
        keys = list(dict.fromkeys((r["spec"]["size"], r["spec"]["dtype"]) for r in saved))
        print("\n\n".join(table([r for r in saved if (r["spec"]["size"], r["spec"]["dtype"]) == k], *k)
                            for k in keys))
        return
    args.peers = [p for p in args.peers.split(",") if p]
    args.stages = [int(s) for s in args.stages.split(",") if s != ""]
    args.ds_stages = [int(s) for s in args.ds_stages.split(",") if s != ""]
    for s in args.sizes.split(","):
        if s not in SIZES:
            ap.error(f"--sizes: unknown size {s!r} (known: {', '.join(SIZES)})")

    ds_ok = False
    if "deepspeed" in args.peers:
        why = _deepspeed_ok(args.ds_python)
        ds_ok = why is None
        if why:
            print(f"# DeepSpeed skipped: {why}", flush=True)
    print(f"# {time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs, torch from {sys.executable}, "
          f"{args.nproc} gloo ranks x OMP_NUM_THREADS=1, micro {args.micro or DEFAULT_MICRO} x seq {args.seq}, "
          f"{args.warmup} warm-up + {args.steps} timed steps", flush=True)
    all_results, tables = [], []
    for size in args.sizes.split(","):
        for dtype in args.dtypes.split(","):
            jobs = plan(args, size, dtype, ds_ok)
            results = []
            for rep in range(args.repeats):
                for kind, stage in (jobs if (rep + args.reverse) % 2 == 0 else jobs[::-1]):
                    micro = args.micro or DEFAULT_MICRO[size]
                    spec = dict(kind=kind, stage=stage, size=size, dtype=dtype, micro=micro, seq=args.seq,
                                warmup=args.warmup, steps=args.steps,
                                profile=bool(args.profile and kind == "zeal" and stage == 3))
                    r = run_job(spec, args)
                    if r:
                        results.append(r)
            all_results += results
            if results:
                tables.append(table(results, size, dtype))
                print("\n" + tables[-1] + "\n", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(all_results, indent=1))
    print("\n\n".join(tables))


if __name__ == "__main__":
    main()
