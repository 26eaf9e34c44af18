"""Tensor parallelism: zeal's TP step beside PyTorch's own (``parallelize_module`` with the
same ColwiseParallel / RowwiseParallel plan), same model, same batch, same ranks.

    flock /tmp/zeal-heavy.lock python bench/tp/bench_tp.py [--world 4] [--steps 6] [--size small|124m] [--ds PYTHON] [--ds /work/peers/ds/bin/python]

With ``--ds PYTHON`` (DeepSpeed 0.19.8's own venv), DeepSpeed AutoTP trains the same model
in the same run (``ds_autotp_peer.py``, ``DS_ACCELERATOR=cpu``) and is printed beside.

A small Hugging Face Llama (GQA), fp32, gloo on CPU, TP = world (no data parallelism).
Printed per framework: median step time (forward, backward, AdamW step) and the bytes
each rank sends over tp per step. zeal's bytes come from ``engine.comm_stats()``; torch's
from ``CommDebugMode`` (all-reduce counts) times the activation size, both with the same
bandwidth-optimal convention (an all-reduce of n fp32 elements sends 2n·4·(T-1)/T
bytes). The Megatron formula is printed beside: per layer 2 all-reduces of b·s·h forward
and 2 backward. zeal splits the embedding and the head by vocabulary rows (T divides V):
its tp bytes are the layers' (Comm kind ``activation``, the Megatron formula) plus the
vocabulary-parallel ones (kind ``vocab``: the embedding's all-reduce of b·s·h forward, the
head input's backward, and 3 floats per token for the cross-entropy), printed apart;
torch's plan keeps the head whole (every rank computes all b·s·V logits).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _shared import spawn_ranks  # noqa: E402

# hidden, intermediate, layers, heads, kv heads, vocab, seq, batch; "124m": a 124M-parameter Llama (GQA)
SIZES = {"small": (256, 688, 4, 8, 4, 1024, 128, 4), "124m": (768, 2048, 12, 12, 4, 32000, 128, 4)}
SIZE_ENV = "ZEAL_BENCH_TP_SIZE"  # read at import, so spawned ranks and DeepSpeed's peer build the same model
HIDDEN, INTER, LAYERS, HEADS, KV, VOCAB, SEQ, BATCH = SIZES[os.environ.get(SIZE_ENV, "small")]


def build():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
                      num_attention_heads=HEADS, num_key_value_heads=KV, max_position_embeddings=SEQ,
                      attn_implementation="sdpa")
    return LlamaForCausalLM(cfg)


def _zeal(world: int, steps: int, ids) -> tuple[list[float], tuple[int, int, int]]:
    import zeal

    engine = zeal.initialize(build(), {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1,
                                       "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
                                       "tensor_parallel": {"autotp_size": world}})
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = engine(input_ids=ids, labels=ids)
        engine.backward(out.loss)
        engine.step()
        times.append(time.perf_counter() - t0)
    last = engine.comm_stats()["last_step"]
    tp_bytes = (last["by_dim"]["tp"]["bytes"], last["by_op"]["all_reduce/activation"]["bytes"],
                last["by_op"].get("all_reduce/vocab", {}).get("bytes", 0))
    engine.close()
    return times, tp_bytes


def _torch(world: int, steps: int, ids) -> tuple[list[float], int]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = build()
    mesh = init_device_mesh("cpu", (world,))
    plan = {}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        plan.update({p + "self_attn.q_proj": ColwiseParallel(), p + "self_attn.k_proj": ColwiseParallel(),
                     p + "self_attn.v_proj": ColwiseParallel(), p + "self_attn.o_proj": RowwiseParallel(),
                     p + "mlp.gate_proj": ColwiseParallel(), p + "mlp.up_proj": ColwiseParallel(),
                     p + "mlp.down_proj": RowwiseParallel()})
    parallelize_module(model, mesh, plan)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    times, counts = [], 0
    for i in range(steps):
        mode = CommDebugMode() if i == steps - 1 else None
        t0 = time.perf_counter()
        if mode is not None:
            mode.__enter__()
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        if mode is not None:
            mode.__exit__(None, None, None)
            counts = sum(n for op, n in mode.get_comm_counts().items() if "all_reduce" in str(op))
        times.append(time.perf_counter() - t0)
    n = BATCH * SEQ * HIDDEN
    return times, counts * 2 * n * 4 * (world - 1) // world


def _rank(rank: int, world: int, port: int, steps: int, q) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world),
                       "OMP_NUM_THREADS": "1"})
    import torch

    torch.set_num_threads(1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    zt, zb = _zeal(world, steps, ids)
    tt, tb = _torch(world, steps, ids)
    q.put((rank, zt, zb, tt, tb))
    import torch.distributed as dist

    dist.destroy_process_group()


def _deepspeed(python: str, world: int, steps: int, zeal_time: float, zeal_bytes: int) -> None:
    """DeepSpeed AutoTP's figures (its own venv, a subprocess) beside zeal's, or its failure."""
    import json
    import subprocess

    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ds_autotp_peer.py")
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    run = subprocess.run([python, script, "--world", str(world), "--steps", str(steps)], capture_output=True,
                         text=True, timeout=600, env=env)
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("{")]
    out = json.loads(lines[-1]) if lines else {"error": (run.stderr.strip().splitlines() or ["no output"])[-1]}
    if "error" in out:
        print(f"DeepSpeed AutoTP failed: {out['error']}")
        return
    d = statistics.median(out["times"][1:])
    print(f"step time   zeal {zeal_time * 1e3:8.1f} ms   DeepSpeed AutoTP {d * 1e3:8.1f} ms   zeal/DS {zeal_time / d:.2f}x")
    print(f"tp bytes    zeal {zeal_bytes:>10}   DeepSpeed AutoTP {out['bytes']:>10}   "
          f"zeal/DS {zeal_bytes / max(out['bytes'], 1):.2f}x   (DS collectives: {out['ops']})")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--ds", default=None, help="DeepSpeed's venv python: run AutoTP beside (ds_autotp_peer.py)")
    ap.add_argument("--size", choices=sorted(SIZES), default=os.environ.get(SIZE_ENV, "small"))
    a = ap.parse_args()
    os.environ[SIZE_ENV] = a.size
    global HIDDEN, INTER, LAYERS, HEADS, KV, VOCAB, SEQ, BATCH
    HIDDEN, INTER, LAYERS, HEADS, KV, VOCAB, SEQ, BATCH = SIZES[a.size]
    procs, q = spawn_ranks(_rank, a.world, lambda r, port, q: (r, a.world, port, a.steps, q))
    res = sorted(q.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    _, zt, zb, tt, tb = res[0]
    z, t = statistics.median(zt[1:]), statistics.median(tt[1:])
    share = 4 * (a.world - 1) // a.world  # fp32 bytes sent per logical element of an all-reduce, x2 below
    formula = LAYERS * 4 * 2 * BATCH * SEQ * HIDDEN * share
    vocab = (2 * 2 * BATCH * SEQ * HIDDEN + 2 * 3 * BATCH * SEQ) * share
    total, act, voc = zb
    print(f"Llama h={HIDDEN} layers={LAYERS} heads={HEADS}/{KV} V={VOCAB} b={BATCH} s={SEQ}, TP {a.world} gloo CPU, "
          "fp32")
    print(f"step time   zeal {z * 1e3:8.1f} ms   torch TP {t * 1e3:8.1f} ms   zeal/torch {z / t:.2f}x")
    print(f"tp bytes    zeal {total:>10}   torch TP {tb:>10}   zeal/torch {total / max(tb, 1):.2f}x")
    print(f"  zeal layers (activation) {act:>10}   Megatron formula {formula:>10}")
    print(f"  zeal vocab-parallel      {voc:>10}   formula (emb + head 2·b·s·h each, CE 3·b·s) {vocab:>10}")
    if a.ds:
        _deepspeed(a.ds, a.world, a.steps, z, total)


if __name__ == "__main__":
    main()
