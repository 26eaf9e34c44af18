"""ZeRO++ (qwZ, hpZ, qgZ) against plain ZeRO-3 on simulated nodes (gloo, CPU).

Three measurements, each on real gloo ranks started by ``tests/dist_harness.run_ranks``
(every run has a deadline):

* ``traffic``   — bytes per optimizer step (total and inter-node, per collective) for
                  ``zeal train --model gpt``'s GPT on 4 ranks = 2 nodes x 2, ZeRO-3 vs
                  each ZeRO++ technique alone vs all three, fp32 and bf16.
* ``converge``  — the default GPT trained on the stdlib corpus, all three on vs
                  ZeRO-3 (same seed, same data order); held-out loss curves + PNG.
* ``slowlink``  — step time of ZeRO-3 vs ZeRO++ while every collective whose group
                  spans nodes is delayed by (bytes this rank sends to other nodes) /
                  (simulated inter-node bandwidth). The delay is a ``time.sleep`` in a
                  wrapper around ``torch.distributed``'s collectives, installed in the
                  benchmark's rank processes only (zeal itself is untouched).

    python bench/zeropp/bench_zeropp.py traffic
    python bench/zeropp/bench_zeropp.py converge --steps 300
    python bench/zeropp/bench_zeropp.py slowlink
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.dist_harness import run_ranks  # noqa: E402

ALL3 = {"zero_quantized_weights": True, "zero_hpz_partition_size": 2, "zero_quantized_gradients": True}
VARIANTS = {
    "zero3": {},
    "qwz": {"zero_quantized_weights": True},
    "hpz": {"zero_hpz_partition_size": 2},
    "qgz": {"zero_quantized_gradients": True},
    "zeropp": ALL3,
}


# ------------------------------------------------------------------------------ rank side


def _setup(steps: int, micro: int, lws: int, precision: str, zeropp: dict, persistence: int | None):
    """(spec, engine config) of `zeal train --model gpt` (the from-scratch GPT job) with these overrides."""
    from zeal.config.job import JobSection, JobSpec, merge_engine_config, resolve_precision
    from zeal.utils.process import apply_process_settings

    apply_process_settings()  # as `zeal train` does (huge pages), before any tensor

    job = JobSection(hf_model="gpt", steps=steps, nproc=1, checkpoint=False, precision=precision)
    zo: dict = {"stage": 3, **zeropp}
    if persistence is not None:
        zo["stage3_param_persistence_threshold"] = persistence
    user = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1,
            "local_world_size": lws, "zero_optimization": zo}
    spec = resolve_precision(JobSpec(job=job, engine=merge_engine_config(job, user)))
    return spec


def _engine(spec, vocab: int):
    import torch

    import zeal
    from zeal.train.job import build_model

    torch.manual_seed(spec.data.seed)
    return zeal.initialize(build_model(spec, vocab), spec.engine)


def _step(engine, blocks, sampler, step: int, rank: int) -> float:
    x = blocks.batch(blocks.train_index[sampler.indices(step, 0, rank)])
    out = engine({"input_ids": x, "labels": x})
    loss = out.loss if hasattr(out, "loss") else out
    engine.backward(loss)
    engine.step()
    return float(loss.detach())


def _rank_traffic(rank: int, world: int, lws: int, micro: int, steps: int, persistence: int | None) -> dict:
    from zeal.data.text_dataset import BlockSampler
    from zeal.train.job import prepare_data

    out: dict = {}
    for precision in ("fp32", "bf16"):
        for name, zeropp in VARIANTS.items():
            spec = _setup(1000, micro, lws, precision, zeropp, persistence)  # schedule length only
            tok, blocks = prepare_data(spec)
            engine = _engine(spec, tok.get_vocab_size())
            sampler = BlockSampler(len(blocks.train_index), micro, 1, world, spec.data.seed)
            for s in range(steps):
                _step(engine, blocks, sampler, s, rank)
            out[f"{precision}/{name}"] = engine.comm_stats()["last_step"]
            if rank == 0 and name == "zero3":
                out[f"{precision}/params"] = int(engine.module.config.num_parameters())
            del engine
    return out


def _rank_converge(rank: int, world: int, lws: int, micro: int, steps: int, eval_interval: int,
                   eval_batches: int, variants: dict) -> dict:
    from zeal.data.text_dataset import BlockSampler
    from zeal.train.job import _mean_over_ranks, evaluate, prepare_data

    out: dict = {}
    for name, zeropp in variants.items():
        spec = _setup(steps, micro, lws, "auto", zeropp, 0)
        tok, blocks = prepare_data(spec)
        engine = _engine(spec, tok.get_vocab_size())
        sampler = BlockSampler(len(blocks.train_index), micro, 1, world, spec.data.seed)
        train, evals = [], [(0, evaluate(engine, blocks, micro, eval_batches))]
        t0 = time.perf_counter()
        for s in range(steps):
            loss = _step(engine, blocks, sampler, s, rank)
            train.append(_mean_over_ranks([loss], world)[0])
            if (s + 1) % eval_interval == 0 or s + 1 == steps:
                evals.append((s + 1, evaluate(engine, blocks, micro, eval_batches)))
            if rank == 0 and (s + 1) % 50 == 0:
                print(f"  [{name}] step {s + 1}/{steps} train {train[-1]:.4f} "
                      f"({time.perf_counter() - t0:.0f} s)", flush=True)
        out[name] = {"train": train, "eval": evals, "time_s": time.perf_counter() - t0,
                     "bf16": bool(spec.engine["bf16"]["enabled"]),
                     "params": int(engine.module.config.num_parameters())}
        del engine
    return out


class SlowLink:
    """Wraps torch.distributed's collectives in this process: before a collective whose
    group spans nodes, sleep (bytes this rank sends to ranks on other nodes) / bandwidth.

    Bytes follow zeal's accounting convention (each rank sends each peer its 1/n
    chunk): all_gather_into_tensor sends the input to every peer; reduce_scatter_tensor
    and all_to_all_single send 1/n of the input to every peer; all_reduce sends twice
    1/n of the tensor to every peer (reduce-scatter + all-gather); broadcast sends the
    tensor to every peer from the source. Only the peers on other nodes count. Each
    rank has its own link (intra-node traffic is free), and the sleep runs on the
    calling thread before the op, so link time is not overlapped with compute.
    """

    def __init__(self, lws: int) -> None:
        import torch.distributed as dist

        self.dist, self.lws = dist, lws
        self.bandwidth: float | None = None  # bytes/s; None = no delay
        self.slept = 0.0
        self.remote_bytes = 0
        self._remote: dict = {}
        self._orig = {}
        self._depth = 0  # a deprecated alias may call the new name: count the outermost call only
        # torch 2.13 renamed the flat collectives (all_gather_single, reduce_scatter_single): wrap both
        # spellings; install this before zeal is imported, in case zeal binds the functions at import
        for name in ("all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor",
                     "reduce_scatter_single", "all_to_all_single", "all_reduce", "broadcast"):
            if hasattr(dist, name):
                self._orig[name] = getattr(dist, name)
                setattr(dist, name, self._wrap(name))

    def _remote_peers(self, group) -> tuple[int, int]:
        key = id(group)
        if key not in self._remote:
            dist = self.dist
            ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
            me = dist.get_rank() // self.lws
            self._remote[key] = (len(ranks), sum(1 for r in ranks if r // self.lws != me))
        return self._remote[key]

    def _wrap(self, name: str):
        orig = self._orig[name]

        def call(*args, **kwargs):
            group = kwargs.get("group")
            n, remote = self._remote_peers(group)
            if remote and self._depth == 0:
                kind = name.replace("_single", "").replace("_into_tensor", "").replace("_tensor", "")
                t = args[1] if kind in ("all_gather", "reduce_scatter", "all_to_all") else args[0]
                nbytes = t.numel() * t.element_size()
                per_peer = {"all_gather": nbytes, "reduce_scatter": nbytes // n, "all_to_all": nbytes // n,
                            "all_reduce": 2 * (nbytes // n), "broadcast": nbytes}[kind]
                sent = per_peer * remote
                self.remote_bytes += sent
                if self.bandwidth:
                    delay = sent / self.bandwidth
                    self.slept += delay
                    time.sleep(delay)
            self._depth += 1
            try:
                return orig(*args, **kwargs)
            finally:
                self._depth -= 1

        return call


def _rank_slowlink(rank: int, world: int, lws: int, micro: int, bandwidths: list, warmup: int,
                   timed: int, precision: str, names: tuple = ("zero3", "zeropp")) -> dict:
    import torch.distributed as dist

    link = SlowLink(lws)  # before zeal is imported (see SlowLink)
    from zeal.data.text_dataset import BlockSampler
    from zeal.train.job import prepare_data

    out: dict = {}
    engines, samplers = {}, {}
    for name in names:
        spec = _setup(1000, micro, lws, precision, VARIANTS[name], 0)
        tok, blocks = prepare_data(spec)
        engines[name] = _engine(spec, tok.get_vocab_size())
        samplers[name] = BlockSampler(len(blocks.train_index), micro, 1, world, spec.data.seed)
    step = 0
    for label, bits_per_s in bandwidths:
        link.bandwidth = bits_per_s / 8 if bits_per_s else None
        rec = {n: {"t": [], "slept": [], "remote": []} for n in names}
        for i in range(warmup + timed):
            for name in names:  # interleaved, so that drifting machine load hits both alike
                dist.barrier()
                s0, b0 = link.slept, link.remote_bytes
                t0 = time.perf_counter()
                _step(engines[name], blocks, samplers[name], step, rank)
                if i >= warmup:
                    rec[name]["t"].append(time.perf_counter() - t0)
                    rec[name]["slept"].append(link.slept - s0)
                    rec[name]["remote"].append(link.remote_bytes - b0)
            step += 1
        for name in names:
            r = rec[name]
            out[f"{name}@{label}"] = {"step_s": statistics.median(r["t"]), "slept_s": statistics.median(r["slept"]),
                                      "remote_bytes": statistics.median(r["remote"]), "step_s_all": r["t"],
                                      "inter_node_bytes_comm_stats": sum(
                                          c["inter_node_bytes"] for k, c in
                                          engines[name].comm_stats()["last_step"]["by_kind"].items()
                                          if k in ("param", "grad"))}
    link.bandwidth = None
    return out


# ---------------------------------------------------------------------------- parent side


def _fmt_bytes(n: float) -> str:
    return f"{n / 1e6:8.3f} MB"


def cmd_traffic(args) -> dict:
    res = run_ranks(_rank_traffic, 4, 2, args.micro, args.steps, args.persistence,
                    timeout=args.timeout, local_world=2)
    lines = []
    summary: dict = {"persistence_threshold": args.persistence, "ranks": 4, "local_world_size": 2,
                     "micro_batch": args.micro, "per_rank": {}}
    for precision in ("fp32", "bf16"):
        base_inter = None
        lines.append(f"\n== {precision}: {res[0][f'{precision}/params'] / 1e6:.3f}M params, 4 ranks = 2 nodes x 2, "
                     f"bytes sent per rank per step (rank 0; param+grad kinds) ==")
        lines.append(f"{'variant':8s} {'total':>12s} {'inter-node':>12s} {'inter vs ZeRO-3':>16s}  per collective "
                     "(inter-node / total MB)")
        for name in VARIANTS:
            per_rank_inter = []
            for r in range(4):
                st = res[r][f"{precision}/{name}"]
                per_rank_inter.append(sum(v["inter_node_bytes"] for k, v in st["by_kind"].items()
                                          if k in ("param", "grad")))
            st = res[0][f"{precision}/{name}"]
            kinds = {k: v for k, v in st["by_kind"].items() if k in ("param", "grad")}
            total = sum(v["bytes"] for v in kinds.values())
            inter = sum(v["inter_node_bytes"] for v in kinds.values())
            if base_inter is None:
                base_inter = inter
            ops = ", ".join(f"{op} {v['inter_node_bytes'] / 1e6:.3f}/{v['bytes'] / 1e6:.3f}"
                            for op, v in st["by_op"].items() if not op.endswith("/control"))
            lines.append(f"{name:8s} {_fmt_bytes(total)} {_fmt_bytes(inter)} {inter / base_inter:15.3f}x  {ops}")
            summary["per_rank"][f"{precision}/{name}"] = {"total_bytes": total, "inter_node_bytes": inter,
                                                          "ratio_inter_vs_zero3": inter / base_inter,
                                                          "inter_node_bytes_by_rank": per_rank_inter,
                                                          "by_op": st["by_op"]}
    text = "\n".join(lines)
    print(text)
    for precision in ("fp32", "bf16"):
        r = summary["per_rank"][f"{precision}/zeropp"]["ratio_inter_vs_zero3"]
        print(f"{precision}: ZeRO++ inter-node bytes / ZeRO-3 = {r:.3f}x (target <= 0.3x, paper 0.25x)")
    return summary


def cmd_converge(args) -> dict:
    world, lws = (4, 2) if args.ranks == 4 else (2, 1)
    variants = {"zero3": {}, "zeropp": ALL3 if lws == 2 else {"zero_quantized_weights": True,
                                                               "zero_quantized_gradients": True}}
    micro = args.global_batch // world
    t0 = time.perf_counter()
    res = run_ranks(_rank_converge, world, lws, micro, args.steps, args.eval_interval, args.eval_batches,
                    variants, timeout=args.timeout, local_world=lws)[0]
    print(f"converge: {world} ranks, local_world_size {lws}, micro {micro} (global batch {args.global_batch}), "
          f"{args.steps} steps, wall {time.perf_counter() - t0:.0f} s")
    a, b = res["zero3"]["eval"][-1][1], res["zeropp"]["eval"][-1][1]
    rel = (b - a) / a
    for name in res:
        print(f"  {name:7s} held-out {' '.join(f'{s}:{v:.4f}' for s, v in res[name]['eval'])}  "
              f"train time {res[name]['time_s']:.0f} s")
    print(f"final held-out loss: ZeRO-3 {a:.4f}, ZeRO++ {b:.4f}, relative difference {100 * rel:+.2f}% "
          f"(target within 2%)")
    _plot(res, HERE / "loss_curves.png", world, lws, args.steps)
    return {"world": world, "local_world_size": lws, "micro": micro, "steps": args.steps, "variants": variants,
            "final_heldout": {"zero3": a, "zeropp": b}, "relative_diff": rel, "curves": res}


def _plot(res: dict, path: Path, world: int, lws: int, steps: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=80)
    colors = {"zero3": "tab:blue", "zeropp": "tab:red"}
    labels = {"zero3": "ZeRO-3", "zeropp": "ZeRO++ (qwZ+hpZ+qgZ)" if lws > 1 else "ZeRO++ (qwZ+qgZ)"}
    for name, r in res.items():
        tr = r["train"]
        k = 10
        smooth = [sum(tr[max(0, i - k + 1):i + 1]) / len(tr[max(0, i - k + 1):i + 1]) for i in range(len(tr))]
        ax.plot(range(1, len(tr) + 1), smooth, color=colors[name], lw=1, alpha=0.6,
                label=f"{labels[name]} train (10-step mean)")
        s, v = zip(*r["eval"])
        ax.plot(s, v, "o-", color=colors[name], ms=3, lw=1.5, label=f"{labels[name]} held-out")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.set_ylim(top=min(9.0, ax.get_ylim()[1]))
    ax.set_title(f"default GPT, stdlib corpus, {world} ranks ({world // lws} nodes x {lws}), {steps} steps",
                 fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    print(f"wrote {path}")


def cmd_slowlink(args) -> dict:
    bandwidths = [("inf", None), ("10Gbit", 10e9), ("1Gbit", 1e9), ("100Mbit", 100e6), ("10Mbit", 10e6)]
    res = run_ranks(_rank_slowlink, 4, 2, args.micro, bandwidths, args.warmup, args.timed, args.precision,
                    timeout=args.timeout, local_world=2)
    print(f"\n== slow inter-node link: 4 ranks = 2 nodes x 2, {args.precision}, micro {args.micro}, "
          f"median of {args.timed} steps, step time = slowest rank ==")
    print("measured: wall time of a step with the delays; model: no-delay step + link seconds of the step")
    print(f"{'link':8s} {'ZeRO-3 s/step':>14s} {'(link s)':>9s} {'ZeRO++ s/step':>14s} {'(link s)':>9s} "
          f"{'speed-up':>9s} {'model speed-up':>15s}")
    table = []
    c3 = max(r["zero3@inf"]["step_s"] for r in res)
    cp = max(r["zeropp@inf"]["step_s"] for r in res)
    for label, _ in bandwidths:
        z3 = max(r[f"zero3@{label}"]["step_s"] for r in res)
        zp = max(r[f"zeropp@{label}"]["step_s"] for r in res)
        l3 = max(r[f"zero3@{label}"]["slept_s"] for r in res)
        lp = max(r[f"zeropp@{label}"]["slept_s"] for r in res)
        model = (c3 + l3) / (cp + lp)
        table.append({"link": label, "zero3_step_s": z3, "zeropp_step_s": zp, "zero3_link_s": l3,
                      "zeropp_link_s": lp, "speedup": z3 / zp, "model_speedup": model})
        print(f"{label:8s} {z3:14.3f} {l3:9.3f} {zp:14.3f} {lp:9.3f} {z3 / zp:8.2f}x {model:14.2f}x")
    rb3 = res[0]["zero3@inf"]["remote_bytes"]
    rbp = res[0]["zeropp@inf"]["remote_bytes"]
    print(f"bytes rank 0 sends to the other node per step (as seen by the wrapper): ZeRO-3 {rb3 / 1e6:.3f} MB, "
          f"ZeRO++ {rbp / 1e6:.3f} MB; comm_stats inter-node param+grad: "
          f"{res[0]['zero3@inf']['inter_node_bytes_comm_stats'] / 1e6:.3f} MB, "
          f"{res[0]['zeropp@inf']['inter_node_bytes_comm_stats'] / 1e6:.3f} MB")
    for name in ("zero3", "zeropp"):
        r0 = res[0][f"{name}@inf"]
        # the wrapper also sees the few bytes of control all-reduces (grad norm): allow 0.1 %
        if abs(r0["remote_bytes"] - r0["inter_node_bytes_comm_stats"]) > 1e-3 * r0["inter_node_bytes_comm_stats"]:
            print(f"WARNING {name}: the delay wrapper saw {r0['remote_bytes']} B but comm_stats counts "
                  f"{r0['inter_node_bytes_comm_stats']} B inter-node: the modelled delay is off")
    saved = max(rb3 - rbp, 1)
    if cp > c3:
        print(f"no-delay step: ZeRO-3 {c3:.3f} s, ZeRO++ {cp:.3f} s; ZeRO++ breaks even below "
              f"{saved * 8 / (cp - c3) / 1e6:.0f} Mbit/s per rank (= {saved / 1e6:.3f} MB saved / "
              f"{cp - c3:.3f} s extra compute)")
    else:
        print(f"no-delay step: ZeRO-3 {c3:.3f} s, ZeRO++ {cp:.3f} s; ZeRO++ is not slower even without delay")
    return {"precision": args.precision, "micro": args.micro, "warmup": args.warmup, "timed": args.timed,
            "table": table, "per_rank": res, "no_delay_step_s": {"zero3": c3, "zeropp": cp}}


def cmd_overhead(args) -> dict:
    """Step time of each technique alone with no link delay (the CPU cost of ZeRO++ here)."""
    names = tuple(VARIANTS)
    res = run_ranks(_rank_slowlink, 4, 2, args.micro, [("inf", None)], args.warmup, args.timed, args.precision,
                    names, timeout=args.timeout, local_world=2)
    print(f"\n== step time with no link delay, 4 ranks = 2 nodes x 2, {args.precision}, micro {args.micro}, "
          f"median of {args.timed} interleaved steps, slowest rank ==")
    out = {}
    for name in names:
        t = max(r[f"{name}@inf"]["step_s"] for r in res)
        out[name] = t
        print(f"{name:8s} {t:7.3f} s/step  ({t / out['zero3']:.2f}x ZeRO-3)")
    return {"precision": args.precision, "micro": args.micro, "timed": args.timed, "step_s": out, "per_rank": res}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("traffic")
    t.add_argument("--micro", type=int, default=4)
    t.add_argument("--steps", type=int, default=3)
    t.add_argument("--persistence", type=int, default=0,
                   help="stage3_param_persistence_threshold (zeal default 100000; 0 = every unit partitioned)")
    t.add_argument("--timeout", type=float, default=900)
    c = sub.add_parser("converge")
    c.add_argument("--steps", type=int, default=300)
    c.add_argument("--ranks", type=int, choices=[2, 4], default=4)
    c.add_argument("--global-batch", type=int, default=16, help="zeal train's default: 2 ranks x 8")
    c.add_argument("--eval-interval", type=int, default=50)
    c.add_argument("--eval-batches", type=int, default=8)
    c.add_argument("--timeout", type=float, default=3000)
    s = sub.add_parser("slowlink")
    s.add_argument("--micro", type=int, default=4)
    s.add_argument("--warmup", type=int, default=2)
    s.add_argument("--timed", type=int, default=8)
    s.add_argument("--precision", choices=["fp32", "bf16"], default="bf16")
    s.add_argument("--timeout", type=float, default=1200)
    o = sub.add_parser("overhead")
    o.add_argument("--micro", type=int, default=4)
    o.add_argument("--warmup", type=int, default=2)
    o.add_argument("--timed", type=int, default=8)
    o.add_argument("--precision", choices=["fp32", "bf16"], default="bf16")
    o.add_argument("--timeout", type=float, default=900)
    for sp in (t, c, s, o):
        sp.add_argument("--out", help="JSON results file (default bench/zeropp/results_<cmd>.json)")
    args = p.parse_args(argv)
    fn = {"traffic": cmd_traffic, "converge": cmd_converge, "slowlink": cmd_slowlink, "overhead": cmd_overhead}[args.cmd]
    result = fn(args)
    result["date"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    out = Path(args.out) if args.out else HERE / f"results_{args.cmd}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
