"""Ulysses sequence parallelism: step time at equal total tokens, SP 2 vs DP 2, and the
all-to-all share of the SP step.

    flock /tmp/zeal-cpu.lock python bench/long_context/bench_sp.py [--seq 1024] [--steps 4]

Two gloo ranks on CPU, zeal's Llama (GQA: 8 query heads, 4 key/value heads), fp32, AdamW.
Both runs train on the same 2 sequences of ``--seq`` tokens per step: SP 2 shards both
sequences over the 2 ranks (each holds 2 x seq/2 tokens, attention runs on all seq tokens
with 4 of the 8 heads after the all-to-alls); DP 2 gives each rank one whole sequence.
Printed: median step time of each, their ratio, the time the SP step spends inside the
Ulysses all-to-alls (measured around ``mesh.sp.all_to_all``) as a share of its step, and
the sp bytes per step beside the Ulysses formula.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _shared import spawn_ranks  # noqa: E402

HIDDEN, INTER, LAYERS, HEADS, KV, VOCAB = 256, 688, 4, 8, 4, 1024


def _rank(rank: int, port: int, q, mode: str, seq: int, steps: int) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"})
    import torch

    torch.set_num_threads(1)
    import zeal
    from zeal.models.llama import Llama, LlamaConfig

    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
                              num_attention_heads=HEADS, num_key_value_heads=KV, max_position_embeddings=seq))
    sp = 2 if mode == "sp" else 1
    engine = zeal.initialize(model, {"train_micro_batch_size_per_gpu": 2 // (2 // sp), "gradient_accumulation_steps": 1,
                                     "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
                                     "sequence_parallel_size": sp, "zero_optimization": {"stage": 1}})
    a2a = [0.0]
    if sp > 1:  # time spent inside the Ulysses all-to-alls
        comm = engine.mesh.sp
        inner = comm.all_to_all

        def timed(out, inp, kind):
            t0 = time.perf_counter()
            inner(out, inp, kind)
            a2a[0] += time.perf_counter() - t0

        comm.all_to_all = timed
    ids = torch.randint(0, VOCAB, (2, seq), generator=torch.Generator().manual_seed(1))
    batch = ids if sp > 1 else ids[rank:rank + 1]
    times, shares = [], []
    for i in range(steps + 1):
        a2a[0] = 0.0
        t0 = time.perf_counter()
        loss = engine(input_ids=batch, labels=batch)
        engine.backward(loss)
        engine.step()
        dt = time.perf_counter() - t0
        if i:  # the first step warms up
            times.append(dt)
            shares.append(a2a[0] / dt)
    stats = engine.mesh.stats.last_step
    sp_bytes = sum(c.bytes for (op, kind, dim), c in stats.items() if dim == "sp" and op == "all_to_all")
    q.put((rank, statistics.median(times), statistics.median(shares), sp_bytes))
    engine.close()


def run(mode: str, seq: int, steps: int) -> tuple[float, float, int]:
    procs, q = spawn_ranks(_rank, 2, lambda r, port, q: (r, port, q, mode, seq, steps))
    got = sorted(q.get(timeout=1200) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    return max(g[1] for g in got), got[0][2], got[0][3]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=4)
    a = ap.parse_args()
    sp_t, share, sp_bytes = run("sp", a.seq, a.steps)
    dp_t, _, _ = run("dp", a.seq, a.steps)
    # per layer 4 all-to-alls forward + 4 backward; q/out of b·(s/2)·h fp32 elements, k/v of
    # b·(s/2)·nkv·hd; each rank sends the half addressed to the other rank
    hd = HIDDEN // HEADS
    formula = LAYERS * 2 * (2 * 2 * (a.seq // 2) * HIDDEN + 2 * 2 * (a.seq // 2) * KV * hd) * 4 // 2
    print(f"zeal Llama {LAYERS}x{HIDDEN} (8 q / 4 kv heads), 2 ranks gloo, 2 sequences x {a.seq} tokens per step")
    print(f"  SP 2 step {sp_t * 1e3:8.1f} ms   DP 2 step {dp_t * 1e3:8.1f} ms   SP/DP {sp_t / dp_t:.2f}x")
    print(f"  SP 2 all-to-all share of the step: {share:.1%}")
    print(f"  sp bytes per step per rank: {sp_bytes} (Ulysses formula {formula})")


if __name__ == "__main__":
    main()
