"""DeepSpeed AutoTP training as a peer of ``bench_tp.py`` (run with DeepSpeed's own venv).

    DS_ACCELERATOR=cpu /work/peers/ds/bin/python bench/tp/ds_autotp_peer.py --world 4 --steps 6

The same Hugging Face Llama, batch and ranks as ``bench_tp.py`` (its ``build``), configured
from the JSON alone (``"tensor_parallel": {"autotp_size": T}``, ZeRO stage 0, fp32, AdamW),
gloo on CPU. Prints one JSON line: the step times of rank 0 and the bytes it sent per step
in collectives (counted by wrapping ``torch.distributed``'s collectives during the last
step; an all-reduce of n bytes counts 2n·(T-1)/T, as bench_tp.py counts). A failure is
printed as ``{"error": ...}`` with the exception's last line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _shared import spawn_ranks  # noqa: E402


def _count(world: int, box: dict):
    import torch.distributed as dist

    def wrap(name: str, factor: float):
        real = getattr(dist, name)

        def counted(*args, **kwargs):
            if box["on"]:
                t = args[0] if args else kwargs.get("tensor", kwargs.get("output_tensor"))
                t = t[0] if isinstance(t, list) else t
                box["bytes"] += int(t.numel() * t.element_size() * factor)
                box["ops"][name] = box["ops"].get(name, 0) + 1
            return real(*args, **kwargs)

        setattr(dist, name, counted)

    share = (world - 1) / world
    wrap("all_reduce", 2 * share)
    wrap("all_gather_into_tensor", share)  # the output's bytes: each rank sends its part T-1 times / T
    wrap("reduce_scatter_tensor", share)
    wrap("broadcast", 1.0)


def _rank(rank: int, world: int, port: int, steps: int, q) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world),
                       "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"})
    try:
        import deepspeed
        import torch

        from bench.tp.bench_tp import BATCH, SEQ, VOCAB, build

        torch.set_num_threads(1)
        box = {"on": False, "bytes": 0, "ops": {}}
        _count(world, box)
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
        deepspeed.init_distributed(dist_backend="gloo")
        engine, *_ = deepspeed.initialize(model=build(), config={
            "train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": {"stage": 0},
            "tensor_parallel": {"autotp_size": world}})
        times = []
        for i in range(steps):
            box["on"] = i == steps - 1
            t0 = time.perf_counter()
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            times.append(time.perf_counter() - t0)
        box["on"] = False
        q.put((rank, {"times": times, "bytes": box["bytes"], "ops": box["ops"], "loss": float(loss)}))
    except Exception as e:  # noqa: BLE001 — the peer's failure is the figure
        q.put((rank, {"error": f"{type(e).__name__}: {e}".splitlines()[0][:400],
                      "where": traceback.format_exc().splitlines()[-3:]}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6)
    a = ap.parse_args()
    procs, q = spawn_ranks(_rank, a.world, lambda r, port, q: (r, a.world, port, a.steps, q))
    res = {}
    try:
        while len(res) < a.world:
            r, out = q.get(timeout=400)
            res[r] = out
            if "error" in out:
                break
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    out = next((v for v in res.values() if "error" in v), res.get(0))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
