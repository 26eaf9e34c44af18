"""zeal's optimizer offload (cpu and nvme) beside DeepSpeed's, on the same model, data and steps.

Each configuration is a separate ``torchrun`` job of 2 gloo ranks on CPU
(``OMP_NUM_THREADS=1`` per rank), so each peak RSS is that job's own. Every job
trains the same GPT (zeal's ``zeal/models/gpt.py``, loaded from its file so that
the DeepSpeed environment, which has no zeal, runs the same model code), fp32,
seeded identically (``torch.manual_seed(0)`` before the build, data: tokens
uniform over the first ``--data-vocab`` ids from a generator seeded ``1000 + rank``), AdamW with the same hyper-parameters, for
``warmup + steps`` steps (default 3 + 8 = 11). It reports, per configuration:
the median over the timed steps of the slowest rank's step time (and its
forward / backward / optimizer-step parts), peak RSS per rank, the bytes left
in the nvme folder after the steps (to see whether optimizer state really went
to disk) and the loss of every step.

Configurations (``--configs``, comma list of ``stage:offload``):

* ``--engines ddp,...`` adds one PyTorch DDP + ``torch.optim.AdamW`` job (the
  reference loss trajectory, no ZeRO, no offload), shown as ZeRO "0";
* ``2:none`` — reference without offload (DeepSpeed with ``torch_adam``);
* ``2:cpu``, ``3:cpu`` — ``offload_optimizer: {device: cpu}`` (DeepSpeed uses
  its C++ ``DeepSpeedCPUAdam``, built on first use, ~2-3 minutes);
* ``2:nvme``, ``3:nvme`` — ``offload_optimizer: {device: nvme, nvme_path,
  buffer_count}`` with the same ``sub_group_size`` and ``aio`` section for both
  (DeepSpeed needs ``libaio-dev`` and builds its ``async_io`` op on first use).
  DeepSpeed 0.19.8 swaps optimizer state to disk only under ZeRO-3; under
  ZeRO-2 ``device: nvme`` is accepted and treated as ``cpu`` (the table's
  "on disk" column shows it).

DeepSpeed is never a zeal dependency: it runs from ``--ds-python`` (default
``/work/ds-venv/bin/python``) with ``DS_ACCELERATOR=cpu`` and gloo.

Example::

    python bench/offload/bench_vs_deepspeed.py --path /var/tmp/zeal-vs-ds
    python bench/offload/bench_vs_deepspeed.py --configs 3:nvme --first-timeout 1800
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
from _shared import clear_stale_extension_locks, load_gpt, peak_rss_mib, timed_step  # noqa: E402

SIZES = {
    # ~10.1M parameters (tied head counted once): the model of bench/train/bench_zero.py
    "10m": dict(vocab_size=8192, n_positions=256, n_embd=256, n_layer=10, n_head=8),
    # ~29M parameters
    "30m": dict(vocab_size=8192, n_positions=256, n_embd=512, n_layer=8, n_head=8),
}
ADAMW = dict(lr=1e-3, betas=[0.9, 0.999], eps=1e-8, weight_decay=0.01)
AIO = dict(block_size=1048576, queue_depth=8, thread_count=1, single_submit=False, overlap_events=True)


def _du(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(root, f))
            except OSError:
                pass
    return total


def _zero_section(spec: dict) -> dict:
    zo: dict = {"stage": spec["stage"], "sub_group_size": spec["sub_group"]}
    if spec["stage"] == 3:
        zo["stage3_param_persistence_threshold"] = 0
    if spec["offload"] == "cpu":
        zo["offload_optimizer"] = {"device": "cpu"}
    elif spec["offload"] == "nvme":
        zo["offload_optimizer"] = {"device": "nvme", "nvme_path": spec["swap"], "buffer_count": spec["buffers"]}
    return zo


# --------------------------------------------------------------------------- worker


def worker(spec: dict) -> None:
    import torch
    import torch.distributed as dist

    GPT, GPTConfig = load_gpt()
    cfg = GPTConfig(**SIZES[spec["size"]], dropout=0.0)
    cfg.n_positions = spec["seq"]
    micro, seq, stage = spec["micro"], spec["seq"], spec["stage"]
    torch.manual_seed(0)
    t_build = time.perf_counter()
    config = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": dict(ADAMW)},
        "zero_optimization": _zero_section(spec),
        "aio": dict(AIO),
    }
    if spec["kind"] == "ddp":  # reference trajectory: PyTorch DDP + torch.optim.AdamW, no ZeRO, no offload
        dist.init_process_group("gloo")
        model = torch.nn.parallel.DistributedDataParallel(GPT(cfg))
        opt = torch.optim.AdamW(model.parameters(), **{**ADAMW, "betas": tuple(ADAMW["betas"])})

        class _DDPEngine:
            def __call__(self, x, labels):
                return model(x, labels=labels)

            def backward(self, loss):
                loss.backward()

            def step(self):
                opt.step()
                opt.zero_grad(set_to_none=True)

        engine = _DDPEngine()
    elif spec["kind"] == "zeal":
        import zeal

        zeal.apply_process_settings()  # huge pages, as `zeal train` does

        engine = zeal.initialize((lambda: GPT(cfg)) if stage == 3 else GPT(cfg), config)
    else:
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        config.update(train_batch_size=micro * dist.get_world_size(), steps_per_print=10**9,
                      wall_clock_breakdown=False)
        if spec["offload"] == "none":  # no C++ Adam without offload: torch's
            config["optimizer"]["params"]["torch_adam"] = True
        if stage == 3:
            with deepspeed.zero.Init(config_dict_or_path=config):
                model = GPT(cfg)
        else:
            model = GPT(cfg)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    build_s = time.perf_counter() - t_build
    rank, world = dist.get_rank(), dist.get_world_size()
    rss_build = peak_rss_mib()
    gen = torch.Generator().manual_seed(1000 + rank)
    rows = []
    for _ in range(spec["warmup"] + spec["steps"]):
        x = torch.randint(0, min(spec["data_vocab"], cfg.vocab_size), (micro, seq), generator=gen)
        loss, fwd, bwd, opt = timed_step(engine, x)
        rows.append((fwd + bwd + opt, fwd, bwd, opt, float(loss.detach().float())))
    on_disk = _du(spec["swap"]) if spec["offload"] == "nvme" else 0
    mine = dict(rank=rank, rows=rows, rss_mib=peak_rss_mib(), rss_build_mib=rss_build, build_s=build_s, disk=on_disk)
    gathered = [None] * world
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        w = spec["warmup"]
        timed = range(w, len(rows))

        def med(col):  # slowest rank per step, median over the timed steps
            return statistics.median(max(g["rows"][i][col] for g in gathered) for i in timed)

        out = dict(spec=spec, step_s=med(0), fwd_s=med(1), bwd_s=med(2), opt_s=med(3),
                   step_times=[max(g["rows"][i][0] for g in gathered) for i in timed],
                   rss_mib=[g["rss_mib"] for g in gathered], rss_build_mib=[g["rss_build_mib"] for g in gathered],
                   build_s=max(g["build_s"] for g in gathered), disk_bytes=max(g["disk"] for g in gathered),
                   losses=[[r[4] for r in g["rows"]] for g in gathered], n_params=cfg.num_parameters())
        print("RESULT " + json.dumps(out), flush=True)
    dist.barrier()
    dist.destroy_process_group()


# --------------------------------------------------------------------------- launcher


def _label(kind: str, stage: int, offload: str) -> str:
    if kind == "ddp":
        return "PyTorch DDP (reference)"
    return f"{'zeal' if kind == 'zeal' else 'DeepSpeed'} ZeRO-{stage} offload {offload}"


def _deepspeed_version(python: str) -> str | None:
    if not python or not os.path.exists(python):
        return None
    try:
        r = subprocess.run([python, "-c", "import deepspeed; print(deepspeed.__version__)"], capture_output=True,
                           text=True, timeout=180, env=dict(os.environ, DS_ACCELERATOR="cpu"))
    except subprocess.TimeoutExpired:
        return None
    return r.stdout.strip().splitlines()[-1] if r.returncode == 0 and r.stdout.strip() else None


def run_job(spec: dict, args, timeout: int) -> dict:
    """Run one configuration; the result, or a dict with ``error`` saying why it did not run."""
    ds = spec["kind"] == "deepspeed"
    python = args.ds_python if ds else sys.executable
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if ds:
        env["DS_ACCELERATOR"] = "cpu"
        clear_stale_extension_locks()
    shutil.rmtree(spec["swap"], ignore_errors=True)
    os.makedirs(spec["swap"], exist_ok=True)
    cmd = [python, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
           str(Path(__file__).resolve()), "--worker", json.dumps(spec)]
    label = _label(spec["kind"], spec["stage"], spec["offload"])
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun, its ranks and any op build they started
        stdout, stderr = proc.communicate(timeout=60)
        print(f"# {label}: timed out after {timeout}s\n{stderr[-2000:]}", flush=True)
        if ds:
            clear_stale_extension_locks(min_age_s=0)
        return dict(spec=spec, error=f"timed out after {timeout}s")
    finally:
        shutil.rmtree(spec["swap"], ignore_errors=True)
    r = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
    wall = time.perf_counter() - t0
    result = None
    for line in r.stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT "):])
    if result is None or r.returncode:
        tail = (r.stdout + r.stderr).splitlines()
        errs = [ln for ln in tail if any(k in ln for k in ("Error", "error:", "what()", "terminate", "Abort"))]
        print(f"# {label}: failed (rc {r.returncode})\n" + "\n".join(errs[-20:] + tail[-40:]), flush=True)
        return dict(spec=spec, error=(errs[-1] if errs else f"rc {r.returncode}").strip()[:300])
    result["job_wall_s"] = wall
    print(f"# {label:34s}: {result['step_s']:.3f} s/step (opt {result['opt_s']:.3f}), peak RSS "
          f"{' / '.join(f'{x:.0f}' for x in result['rss_mib'])} MiB, on disk {result['disk_bytes'] / 2**20:.0f} MiB, "
          f"loss {result['losses'][0][0]:.4f} -> {result['losses'][0][-1]:.4f} ({wall:.0f} s job)", flush=True)
    return result


def table(results: list[dict]) -> str:
    groups: dict = {}
    for r in results:
        s = r["spec"]
        groups.setdefault((s["stage"], s["offload"], s["kind"]), []).append(r)
    lines = ["| ZeRO | offload | engine | step s (median) | fwd / bwd / opt s | peak RSS per rank MiB "
             "| on disk MiB | loss first → last step (rank 0 / rank 1) | step vs DS | RSS vs DS |",
             "|---|---|---|---:|---|---|---:|---|---|---|"]
    keys = sorted({(k[0], k[1]) for k in groups}, key=lambda k: (k[0], ["none", "cpu", "nvme"].index(k[1])))
    for stage, off in keys:
        agg = {}
        for kind in ("ddp", "zeal", "deepspeed"):
            rs = groups.get((stage, off, kind), [])
            ok = [r for r in rs if "error" not in r]
            if not ok:
                if rs:
                    agg[kind] = dict(error=rs[-1]["error"])
                continue
            agg[kind] = dict(
                step=statistics.median(r["step_s"] for r in ok),
                parts=[statistics.median(r[k] for r in ok) for k in ("fwd_s", "bwd_s", "opt_s")],
                rss=[max(r["rss_mib"][i] for r in ok) for i in range(len(ok[0]["rss_mib"]))],
                disk=max(r["disk_bytes"] for r in ok), losses=ok[0]["losses"], n=len(ok))
        for kind in ("ddp", "zeal", "deepspeed"):
            v = agg.get(kind)
            name = {"ddp": "PyTorch DDP", "zeal": "zeal", "deepspeed": "DeepSpeed"}[kind]
            if v is None:
                continue
            if "error" in v:
                lines.append(f"| {stage} | {off} | {name} | did not run: {v['error']} | | | | | | |")
                continue
            p = agg.get("deepspeed") if kind == "zeal" else None
            t_ratio = f"{v['step'] / p['step']:.2f}×" if p and "error" not in p else ""
            m_ratio = f"{max(v['rss']) / max(p['rss']):.2f}×" if p and "error" not in p else ""
            loss = " / ".join(f"{ls[0]:.3f} → {ls[-1]:.3f}" for ls in v["losses"])
            disk = f"{v['disk'] / 2**20:.0f}" if off == "nvme" else "—"
            lines.append(f"| {stage} | {off} | {name} | {v['step']:.3f} | "
                         f"{' / '.join(f'{x:.3f}' for x in v['parts'])} | "
                         f"{' / '.join(f'{x:.0f}' for x in v['rss'])} | {disk} | {loss} | {t_ratio} | {m_ratio} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--configs", default="2:none,2:cpu,2:nvme,3:cpu,3:nvme",
                    help="comma list of stage:offload, offload in none|cpu|nvme")
    ap.add_argument("--engines", default="zeal,deepspeed")
    ap.add_argument("--size", default="10m", choices=sorted(SIZES))
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8, help="timed steps after warm-up (default 8: 11 in all)")
    ap.add_argument("--data-vocab", type=int, default=256,
                    help="tokens drawn uniformly from the first N ids, so the loss has somewhere to go "
                         "(ln 8192 = 9.01 at the start, ln N = 5.55 for 256); default 256")
    ap.add_argument("--sub-group", type=int, default=2_000_000, help="sub_group_size for both engines")
    ap.add_argument("--buffers", type=int, default=4, help="offload_optimizer.buffer_count for both engines")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1, help="rounds; odd rounds run DeepSpeed first")
    ap.add_argument("--path", default="/var/tmp/zeal-vs-ds", help="nvme_path root (one folder per job)")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per job")
    ap.add_argument("--first-timeout", type=int, default=1500,
                    help="seconds for the first DeepSpeed job of each offload kind (it may build a C++ op)")
    ap.add_argument("--ds-python", default=os.environ.get("ZEAL_BENCH_DS_PYTHON", "/work/ds-venv/bin/python"))
    ap.add_argument("--json", help="also write all results to this file")
    ap.add_argument("--render", help="print the table of a results file written by --json, and exit")
    args = ap.parse_args(argv)
    if args.worker:
        worker(json.loads(args.worker))
        return
    if args.render:
        print(table(json.loads(Path(args.render).read_text())))
        return
    engines = [e for e in args.engines.split(",") if e]
    results: list = []
    if "deepspeed" in engines:
        ver = _deepspeed_version(args.ds_python)
        if ver is None:
            print(f"# DeepSpeed skipped: it does not import from {args.ds_python!r}", flush=True)
            engines.remove("deepspeed")
        else:
            print(f"# DeepSpeed {ver} from {args.ds_python}", flush=True)
    configs = [(int(c.split(":")[0]), c.split(":")[1]) for c in args.configs.split(",") if c]
    if "ddp" in engines:  # one reference job, first, not per configuration
        engines.remove("ddp")
        results.append(run_job(dict(kind="ddp", stage=0, offload="none", size=args.size, micro=args.micro,
                                    seq=args.seq, warmup=args.warmup, steps=args.steps, data_vocab=args.data_vocab,
                                    sub_group=args.sub_group, buffers=args.buffers,
                                    swap=os.path.join(args.path, "ddp")), args, args.timeout))
    print(f"# {time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}, "
          f"{args.nproc} gloo ranks x OMP_NUM_THREADS=1, GPT {args.size} fp32, micro {args.micro} x seq {args.seq}, "
          f"{args.warmup} warm-up + {args.steps} timed steps, sub_group_size {args.sub_group}, "
          f"buffer_count {args.buffers}, nvme_path under {args.path}", flush=True)
    first_ds: set = set()
    for rep in range(args.repeats):
        for stage, off in configs:
            order = engines if rep % 2 == 0 else engines[::-1]
            for kind in order:
                spec = dict(kind=kind, stage=stage, offload=off, size=args.size, micro=args.micro, seq=args.seq,
                            warmup=args.warmup, steps=args.steps, data_vocab=args.data_vocab, sub_group=args.sub_group, buffers=args.buffers,
                            swap=os.path.join(args.path, f"{kind}-z{stage}-{off}"))
                timeout = args.timeout
                if kind == "deepspeed" and off not in first_ds:
                    first_ds.add(off)
                    timeout = max(timeout, args.first_timeout)
                results.append(run_job(spec, args, timeout))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    print("\n" + table(results))


if __name__ == "__main__":
    main()
