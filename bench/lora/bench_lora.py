"""Full fine-tuning vs LoRA vs QLoRA: memory per rank, step time, trainable parameters.

SmolLM2-135M (``zeal.models.hf.default_model_path()``, the offline copy) under ZeRO 3 on
2 gloo ranks (CPU), fp32, the same random token batches for every variant. Each variant
runs in fresh rank processes (``tests/dist_harness.run_ranks``, with a deadline):

* ``full``     every parameter trained (fp32 masters = the parameters, Adam moments);
* ``lora``     r=16, alpha=32, all linears but the head; the base frozen (partitioned);
* ``qlora8`` / ``qlora4``  the same adapters over an int8 / int4 base (block 64, fp32 scales).

Per rank: ``memory_breakdown()`` (bytes held for trainable parameters, gradients,
optimizer state; the frozen base's shard), the quantized base's bytes (replicated
buffers), peak RSS (it includes loading the fp32 checkpoint, identical for all variants),
and the median step time after one warm-up step.

    flock -w 1500 /tmp/zeal-cpu.lock python bench/lora/bench_lora.py --steps 4
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.dist_harness import run_ranks  # noqa: E402

LORA = {"enabled": True, "r": 16, "alpha": 32, "target_modules": "all-linear"}
VARIANTS = {
    "full": None,
    "lora": LORA,
    "qlora8": {**LORA, "quantize_base": "int8"},
    "qlora4": {**LORA, "quantize_base": "int4"},
}


# Llama-3.2-1B's config.json shapes (hidden, MLP, heads, GQA, vocabulary, tied head)
LLAMA_1B = {"vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
            "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 131072,
            "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "head_dim": 64}


def _model(shape: str, layers: int | None):
    """SmolLM2-135M from its checkpoint, or a random-init Llama of Llama-3.2-1B's shapes."""
    import torch

    from zeal.models.hf import default_model_path
    from zeal.models.llama import Llama, LlamaConfig

    if shape == "smollm2":
        return Llama.from_hf_folder(default_model_path())
    torch.manual_seed(0)
    return Llama(LlamaConfig.from_hf({**LLAMA_1B, "num_hidden_layers": layers or LLAMA_1B["num_hidden_layers"]}))


def _rank(rank: int, world: int, variant: str, steps: int, micro: int, seq: int, shape: str = "smollm2",
          layers: int | None = None) -> dict:
    import resource

    import torch

    import zeal
    from zeal.lora.layer import LoraLinear

    model = _model(shape, layers)
    vocab = model.config.vocab_size
    n_all = sum(p.numel() for p in model.parameters())
    cfg = {"train_micro_batch_size_per_gpu": micro, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
           "zero_optimization": {"stage": 3}}
    if VARIANTS[variant]:
        cfg["lora"] = VARIANTS[variant]
    engine = zeal.initialize(model, cfg)
    trainable = sum(p.numel() for p in engine.optimizer.param_groups[0]["params"])  # this rank's masters
    quant = sum(b.numel() * b.element_size() for m in engine.module.modules() if isinstance(m, LoraLinear)
                for b in (getattr(m, "qweight", None), getattr(m, "qscale", None)) if b is not None)
    g = torch.Generator().manual_seed(rank)
    times = []
    engine.train()
    for _ in range(steps):
        ids = torch.randint(0, vocab, (micro, seq), generator=g)
        t0 = time.perf_counter()
        loss = engine(ids, labels=ids)
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - t0)
    mem = engine.memory_breakdown()
    engine.close()
    return {"trainable_master_elems": trainable, "params_total": n_all, "memory": mem, "quant_bytes": quant,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "step_s": statistics.median(times[1:] or times), "loss": loss.item()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--micro", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--shape", choices=["smollm2", "llama1b"], default="smollm2",
                    help="SmolLM2-135M (checkpoint) or Llama-3.2-1B's shapes, random init")
    ap.add_argument("--layers", type=int, default=None, help="llama1b: fewer blocks than its 16 (memory)")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results.json"))
    a = ap.parse_args()
    rows = {}
    mib = 2**20
    name = "SmolLM2-135M" if a.shape == "smollm2" else f"Llama-3.2-1B shapes, {a.layers or 16} of 16 layers, random init"
    print(f"{name}, ZeRO 3, 2 gloo ranks, fp32, micro {a.micro} x seq {a.seq}, {a.steps} steps")
    print(f"{'variant':8} {'trainable':>11} {'params+grads+optim MiB':>23} {'frozen shard MiB':>17} "
          f"{'quant base MiB':>15} {'peak RSS MiB':>13} {'step s':>7}")
    for v in a.variants.split(","):
        res = run_ranks(_rank, 2, v, a.steps, a.micro, a.seq, a.shape, a.layers, timeout=580)
        r0 = res[0]
        trainable = sum(r["trainable_master_elems"] for r in res)  # masters are partitioned over the 2 ranks
        m = r0["memory"]
        row = {"trainable_params": trainable, "params_total": r0["params_total"],
               "held_mib_per_rank": m["total"] / mib, "frozen_mib_per_rank": m["frozen"] / mib,
               "quant_base_mib_per_rank": r0["quant_bytes"] / mib,
               "peak_rss_mib_per_rank": max(r["peak_rss_mib"] for r in res),
               "step_s": max(r["step_s"] for r in res), "memory_rank0": m}
        rows[v] = row
        print(f"{v:8} {trainable:>11,} {row['held_mib_per_rank']:>23.1f} {row['frozen_mib_per_rank']:>17.1f} "
              f"{row['quant_base_mib_per_rank']:>15.1f} {row['peak_rss_mib_per_rank']:>13.0f} {row['step_s']:>7.2f}",
              flush=True)
    Path(a.out).write_text(json.dumps({"args": vars(a), "results": rows}, indent=2) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
