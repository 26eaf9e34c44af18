"""DeepSpeed's side of ``bench_moe_peer.py``: run in DeepSpeed's own environment
(``DS_ACCELERATOR=cpu``), it trains ``_moe_gpt.MoEGPT`` with ``deepspeed.moe.layer.MoE``
on ``--world`` gloo ranks and writes the step times and bytes to ``--out`` (JSON).

    DS_ACCELERATOR=cpu /path/to/ds/python bench/moe/_ds_moe_side.py --world 2 --ep 2 --steps 6 --out f.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _shared import spawn_ranks  # noqa: E402


def _rank(rank: int, a, port: int, q) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(a.world), "LOCAL_RANK": str(rank), "LOCAL_SIZE": str(a.world),
                       "LOCAL_WORLD_SIZE": str(a.world), "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"})
    import torch

    torch.set_num_threads(1)
    import deepspeed
    from _moe_gpt import MoEGPT, timed_steps
    from deepspeed.moe.layer import MoE
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = MoEGPT(MoE, a.ep, a.capacity_factor)
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": [p for p in model.parameters()], "name": "parameters"})
    cfg = {"train_micro_batch_size_per_gpu": a.micro, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
           "zero_optimization": {"stage": a.stage}, "steps_per_print": 10 ** 9}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=groups, config=cfg)
    q.put(timed_steps(engine, rank, a.micro, a.steps))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--ep", type=int, required=True)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--stage", type=int, default=1)
    ap.add_argument("--capacity-factor", type=float, default=1.0)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    procs, q = spawn_ranks(_rank, a.world, lambda r, port, q: (r, a, port, q))
    res = sorted((q.get(timeout=900) for _ in procs), key=lambda r: r["rank"])
    for p in procs:
        p.join(timeout=60)
    with open(a.out, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main()
