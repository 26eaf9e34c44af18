"""zeal's MoE beside DeepSpeed 0.19.8's ``deepspeed.moe.layer.MoE``, same model, same batches.

    flock /tmp/zeal-heavy.lock python bench/moe/bench_moe_peer.py --ds-python /path/to/ds/bin/python \\
        [--worlds 2,4] [--steps 6] [--stage 1]

The model (``_moe_gpt.py``): a byte-level GPT, 4 blocks, d 512, an 8-expert top-2 MoE MLP
of GELU experts (width 1792) in every block — ~60M parameters, ~15M active per token —
written once in plain PyTorch with the MoE class passed in: ``zeal.moe.MoE`` on zeal's side,
``deepspeed.moe.layer.MoE`` on DeepSpeed's (its own virtual environment, ``DS_ACCELERATOR=cpu``,
gloo), expert parallelism over all ranks (EP = world, ``--ep`` to change), ZeRO ``--stage``,
AdamW, capacity factor 1, token dropping and random token selection on (DeepSpeed's
defaults), aux-loss coefficient 0.01, 1 thread per rank. Each rank trains on the same
micro-batches on both sides. Printed per world size: median step time (steps after the
first) and bytes each rank sends per step, counted the same way on both sides by a wrapper
around ``torch.distributed``'s collectives (``_moe_gpt.install_byte_counter``), and zeal's
own accounting (``engine.comm_stats()``) beside it.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def _rank(rank: int, a, world: int, port: int, dispatch: str, q) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world),
                       "OMP_NUM_THREADS": "1"})
    import functools

    import torch

    torch.set_num_threads(1)
    from _moe_gpt import MoEGPT, timed_steps

    import zeal
    from zeal.moe import MoE

    torch.manual_seed(0)
    ep = a.ep or world
    engine = zeal.initialize(MoEGPT(functools.partial(MoE, dispatch=dispatch), ep, a.capacity_factor),
                             {"train_micro_batch_size_per_gpu": a.micro, "gradient_accumulation_steps": 1,
                              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
                              "zero_optimization": {"stage": a.stage}})
    result = timed_steps(engine, rank, a.micro, a.steps)
    own = engine.comm_stats()["last_step"]
    q.put({**result,
           "zeal_bytes": own["bytes"] if "bytes" in own else sum(v["bytes"] for v in own["by_op"].values()),
           "zeal_by_op": {k: v["bytes"] for k, v in own["by_op"].items()}})
    engine.close()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_zeal(a, world: int, dispatch: str) -> list[dict]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _port()
    procs = [ctx.Process(target=_rank, args=(r, a, world, port, dispatch, q)) for r in range(world)]
    for p in procs:
        p.start()
    res = sorted((q.get(timeout=900) for _ in procs), key=lambda r: r["rank"])
    for p in procs:
        p.join(timeout=60)
    return res


def run_ds(a, world: int) -> list[dict] | str:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "ds.json")
        cmd = [a.ds_python, os.path.join(HERE, "_ds_moe_side.py"), "--world", str(world), "--ep",
               str(a.ep or world), "--steps", str(a.steps), "--micro", str(a.micro), "--stage", str(a.stage),
               "--capacity-factor", str(a.capacity_factor), "--out", out]
        env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": ""}
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
        if r.returncode != 0 or not os.path.exists(out):
            return "DeepSpeed failed: " + (r.stderr.strip().splitlines() or ["(no output)"])[-1]
        with open(out) as f:
            return json.load(f)


def _median(res: list[dict]) -> float:
    """Median over steps after the first of the slowest rank's step time."""
    return statistics.median(max(r["times"][i] for r in res) for i in range(1, len(res[0]["times"])))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ds-python", required=True, help="python of a virtual environment with deepspeed==0.19.8")
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--ep", type=int, default=0, help="expert-parallel size (default: the world size)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--stage", type=int, default=1)
    ap.add_argument("--capacity-factor", type=float, default=1.0)
    ap.add_argument("--dispatch", default="einsum,sort")
    a = ap.parse_args()
    from _moe_gpt import DIM, EXPERTS, FFN, LAYERS, SEQ, TOP_K

    print(f"MoE GPT: {LAYERS} blocks, d {DIM}, {EXPERTS} experts top-{TOP_K} (width {FFN}), seq {SEQ}, "
          f"micro {a.micro}/rank, ZeRO {a.stage}, fp32, gloo CPU, 1 thread/rank")
    for world in (int(w) for w in a.worlds.split(",")):
        ds = run_ds(a, world)
        rows = [(f"zeal ({d})", run_zeal(a, world, d)) for d in a.dispatch.split(",")]
        if isinstance(ds, str):
            print(f"world {world}: {ds}")
            ds_t = None
        else:
            ds_t = _median(ds)
            print(f"world {world}, EP {a.ep or world}: DeepSpeed {ds_t * 1e3:8.1f} ms/step, "
                  f"{ds[0]['bytes'][-1]:>11} B/step/rank {ds[0]['by_op']}")
        for name, res in rows:
            t = _median(res)
            ratio = f"zeal/DeepSpeed {t / ds_t:.2f}x" if ds_t else ""
            b = res[0]["bytes"][-1]
            bratio = f" ({b / ds[0]['bytes'][-1]:.2f}x)" if ds_t else ""
            print(f"  {name:<16} {t * 1e3:8.1f} ms/step {ratio}, {b:>11} B/step/rank{bratio}; "
                  f"zeal's own count {res[0]['zeal_bytes']} {res[0]['zeal_by_op']}")


if __name__ == "__main__":
    main()
