"""zeal LoRA vs PEFT + TRL's ``SFTTrainer`` at equal settings: step time and peak memory.

One process, CPU, fp32, SmolLM2-135M (the offline copy, ``zeal.models.hf.default_model_path()``),
LoRA r=16, alpha=32, dropout 0, on every linear but the head, AdamW lr 1e-4 (no weight
decay), micro-batch 2 x 128 tokens of the same random token rows (labels = inputs), no
gradient checkpointing, ``--threads`` intra-op threads, ``--steps`` optimizer steps; the
step time is the median after the first step. Each side runs in its own process:

    flock -w 1500 /tmp/zeal-cpu.lock sh -c '
      /work/peers/trl/bin/python bench/lora/bench_trl.py --side trl &&
      PYTHONPATH=$PWD .venv/bin/python bench/lora/bench_trl.py --side zeal'

``--side trl`` needs a venv with ``trl`` and ``peft`` (``/work/peers/trl``: torch 2.13.0 CPU,
trl 1.16, peft 0.21, transformers 5.25); it imports nothing of zeal. Each run appends
one JSON line to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path

R, ALPHA, LR = 16, 32, 1e-4


def data(rows: int, seq: int, vocab: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (rows, seq), generator=g).tolist()


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_trl(a: argparse.Namespace) -> dict:
    import datasets
    import peft
    import torch
    import trl
    from transformers import AutoModelForCausalLM, TrainerCallback

    model = AutoModelForCausalLM.from_pretrained(a.model, torch_dtype=torch.float32)
    rows = data(a.micro * a.steps, a.seq, model.config.vocab_size)
    ds = datasets.Dataset.from_dict({"input_ids": rows})
    times: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - self.t0)

    cfg = trl.SFTConfig(output_dir=a.tmp, per_device_train_batch_size=a.micro, max_steps=a.steps,
                        learning_rate=LR, weight_decay=0.0, lr_scheduler_type="constant", warmup_steps=0,
                        logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, bf16=False, fp16=False,
                        dataloader_num_workers=0, max_length=a.seq, packing=False, gradient_checkpointing=False,
                        completion_only_loss=False, optim="adamw_torch")
    lora = peft.LoraConfig(r=R, lora_alpha=ALPHA, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = trl.SFTTrainer(model=model, args=cfg, train_dataset=ds, peft_config=lora, callbacks=[Timer()])
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    trainer.train()
    return {"side": "peft+trl SFTTrainer", "versions": f"trl {trl.__version__}, peft {peft.__version__}, "
            f"torch {torch.__version__}", "trainable": trainable, "steps": len(times),
            "step_s": statistics.median(times[1:] or times), "peak_rss_mib": peak_rss_mib()}


def run_zeal(a: argparse.Namespace) -> dict:
    import torch

    import zeal
    from zeal.models.llama import Llama

    model = Llama.from_hf_folder(a.model)
    rows = torch.tensor(data(a.micro * a.steps, a.seq, model.config.vocab_size))
    cfg = {"train_micro_batch_size_per_gpu": a.micro, "zero_optimization": {"stage": 0},
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
           "lora": {"enabled": True, "r": R, "alpha": ALPHA, "target_modules": "all-linear"}}
    engine = zeal.initialize(model, cfg)
    trainable = sum(p.numel() for p in engine.module.parameters() if p.requires_grad)
    engine.train()
    times = []
    for s in range(a.steps):
        ids = rows[s * a.micro:(s + 1) * a.micro]
        t0 = time.perf_counter()
        engine.backward(engine(ids, labels=ids))
        engine.step()
        times.append(time.perf_counter() - t0)
    engine.close()
    return {"side": "zeal (ZeRO 0, lora section)", "versions": f"torch {torch.__version__}", "trainable": trainable,
            "steps": len(times), "step_s": statistics.median(times[1:] or times), "peak_rss_mib": peak_rss_mib()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--side", choices=["trl", "zeal"], required=True)
    ap.add_argument("--model", default=None, help="HF folder (default: zeal's SmolLM2-135M copy)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--micro", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tmp", default="/tmp/zeal_bench_trl")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results_trl.jsonl"))
    a = ap.parse_args()
    if a.model is None:
        found = sorted(Path.home().glob(".cache/zeal/SmolLM2-135M*/config.json"))  # what zeal downloads
        a.model = str(found[0].parent) if found else "HuggingFaceTB/SmolLM2-135M"
        if a.side == "zeal":
            from zeal.models.hf import default_model_path

            a.model = str(default_model_path())
    import torch

    torch.set_num_threads(a.threads)
    res = run_trl(a) if a.side == "trl" else run_zeal(a)
    res.update(micro=a.micro, seq=a.seq, threads=a.threads, model=a.model)
    print(json.dumps(res), flush=True)
    with open(a.out, "a") as f:
        f.write(json.dumps(res) + "\n")


if __name__ == "__main__":
    sys.exit(main())
