"""DeepSpeed 0.19.8's own Ulysses SP (ALST's HF path) beside zeal's, on CPU gloo ranks.

One script, two sides, the same Hugging Face Llama built from a config (seeded), the same
sequences, SP 2, ZeRO 1, fp32 AdamW, one sequence per step:

* ``--side deepspeed`` (run with DeepSpeed's venv, ``DS_ACCELERATOR=cpu``):
  ``UlyssesSPAttentionHF.register_with_transformers`` (attention "sdpa") gives the mpu,
  ``deepspeed.initialize(..., mpu=mpu)`` with ``sequence_parallel_size``, the batches
  sharded by ``UlyssesSPDataLoaderAdapter`` (input_ids, position_ids, shift_labels), and
  the loss of the full sequence combined from the shards as ALST does (each shard's mean
  weighted by its counted tokens, over the sp group);
* ``--side zeal``: ``zeal.initialize`` with the same config, every rank passing the full
  sequence.

Rank 0 prints one JSON line: losses, median step time, peak RSS (ru_maxrss) per rank.

    DS_ACCELERATOR=cpu /work/peers/ds/bin/torchrun --nproc-per-node 2 bench/long_context/ds_ulysses_peer.py --side deepspeed
    python -m torch.distributed.run --nproc-per-node 2 bench/long_context/ds_ulysses_peer.py --side zeal
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import time

import torch

CONFIG = dict(vocab_size=32000, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
              num_key_value_heads=4)


def model(seq: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**CONFIG, max_position_embeddings=seq, attn_implementation="sdpa"))


def ds_config(sp: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "sequence_parallel_size": sp,
            "zero_optimization": {"stage": 1}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}


def data(seq: int, steps: int) -> torch.Tensor:
    return torch.randint(0, CONFIG["vocab_size"], (steps, 1, seq), generator=torch.Generator().manual_seed(5))


def run_deepspeed(seq: int, steps: int, sp: int) -> tuple[list[float], list[float]]:
    import deepspeed
    from deepspeed.runtime.sequence_parallel.ulysses_sp import (
        UlyssesSPAttentionHF,
        UlyssesSPDataLoaderAdapter,
    )
    from deepspeed.utils import groups

    deepspeed.init_distributed(dist_backend="gloo")
    m = model(seq)
    mpu = UlyssesSPAttentionHF.register_with_transformers(model_name_or_path=m, core_attn_implementation="sdpa",
                                                          sequence_parallel_size=sp, micro_batch_size=1,
                                                          seq_length=seq, seq_length_is_variable=True)
    engine, *_ = deepspeed.initialize(model=m, config=ds_config(sp), mpu=mpu)
    ids = data(seq, steps + sp)
    rank = groups._get_sequence_parallel_rank()
    # the adapter runs sp rank r's sample at iteration r of each round: rank r reads samples r, r + sp, ...
    rows = [{"input_ids": ids[s], "labels": ids[s], "position_ids": torch.arange(seq)[None]}
            for s in range(rank, steps + sp, sp)]
    group = groups._get_sequence_parallel_group()
    dl = UlyssesSPDataLoaderAdapter(rows, sp_rank=rank, sp_group=group,
                                    sp_world_size=sp, device=engine.device)
    losses, times = [], []
    for _, batch in zip(range(steps), dl):
        t0 = time.perf_counter()
        out = engine(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
        y = batch["shift_labels"]  # the adapter drops labels: HF's forward computes no loss, ALST's caller does
        good = (y != -100).sum()
        shard = torch.nn.functional.cross_entropy(out.logits.reshape(-1, out.logits.size(-1)).float(), y.reshape(-1),
                                                  ignore_index=-100)
        import torch.distributed.nn.functional as dfn

        per_rank = dfn.all_gather(shard, group=group)
        counts = dfn.all_gather(good, group=group)
        loss = sum(per_rank[r] * counts[r] for r in range(sp)) / sum(counts)
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    return losses, times


def run_zeal(seq: int, steps: int, sp: int) -> tuple[list[float], list[float]]:
    import zeal

    engine = zeal.initialize(model(seq), ds_config(sp))
    ids = data(seq, steps)
    losses, times = [], []
    for s in range(steps):
        t0 = time.perf_counter()
        out = engine(input_ids=ids[s], labels=ids[s])
        engine.backward(out.loss)
        engine.step()
        times.append(time.perf_counter() - t0)
        losses.append(out.loss.item())
    return losses, times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--side", choices=["deepspeed", "zeal"], required=True)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--sp", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(1)
    losses, times = (run_deepspeed if args.side == "deepspeed" else run_zeal)(args.seq, args.steps, args.sp)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # GiB (ru_maxrss is KiB on Linux)
    import torch.distributed as dist

    peaks = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, round(rss, 3))
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps({"side": args.side, "seq": args.seq, "sp": args.sp, "losses": losses,
                          "step_s_median": statistics.median(times[1:] or times), "peak_rss_gib": peaks}))


if __name__ == "__main__":
    main()
