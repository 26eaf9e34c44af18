"""A Hugging Face ``Trainer`` script as users write it: ``TrainingArguments(deepspeed=ds_config)``
with "auto" values, a tiny Llama built from its config, fp32. Nothing in it names zeal or
imports ``deepspeed``: transformers and accelerate do. On zeal it runs under the switch
(``ZEAL_DEEPSPEED=1`` with zeal's site dir on ``PYTHONPATH``; run.py sets both).

    torchrun --nproc_per_node N hf_trainer_ds.py --stage S [--steps 20] [--ds-optimizer] [--resume-at K]

``--ds-optimizer``: AdamW and WarmupDecayLR from the DeepSpeed config (accelerate's
DummyOptim / DummyScheduler path) instead of the Trainer's own. ``--resume-at K``: after
the run, a second Trainer resumes from ``checkpoint-K`` (``engine.load_checkpoint``) and
its losses for steps K+1.. are appended to the reported ones."""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile

import torch
from _side import Recorder, tokens
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments, set_seed

VOCAB, SEQ = 128, 24


class Losses(TrainerCallback):
    """Each optimizer step's logged loss (logging_steps=1) into the shared recorder."""

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.recorder.step(logs["loss"])


def ds_config(stage: int, ds_optimizer: bool) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto", "gradient_accumulation_steps": "auto",
           "gradient_clipping": "auto", "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"},
           "zero_optimization": {"stage": stage, "stage3_gather_16bit_weights_on_model_save": True}}
    if ds_optimizer:
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                        "weight_decay": "auto", "torch_adam": True}}
        cfg["scheduler"] = {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                                "warmup_num_steps": "auto", "total_num_steps": "auto"}}
    return cfg


def train(out: str, a: argparse.Namespace, recorder: Recorder, resume: str | None = None) -> None:
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                             max_steps=a.steps, learning_rate=2e-3, warmup_steps=3, weight_decay=0.01,
                             logging_steps=1, save_steps=a.resume_at or a.steps, report_to=[], seed=0,
                             deepspeed=ds_config(a.stage, a.ds_optimizer), use_cpu=True, disable_tqdm=True)
    set_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    if a.peft:  # LoRA adapters, as TRL hands the model over; only they train
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                                 lora_dropout=0.0))
    rows = tokens(512, SEQ, VOCAB, seed=21)
    trainer = Trainer(model=model, args=args, train_dataset=[{"input_ids": r, "labels": r} for r in rows],
                      callbacks=[Losses(recorder)])
    trainer.train(resume_from_checkpoint=resume)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stage", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--ds-optimizer", action="store_true")
    ap.add_argument("--resume-at", type=int, default=0)
    ap.add_argument("--peft", action="store_true", help="wrap the model with peft.get_peft_model (LoRA)")
    ap.add_argument("--local_rank", type=int, default=-1)
    a = ap.parse_args()
    rank = int(os.environ.get("RANK", 0))
    recorder = Recorder(rank)
    # one folder for every rank of this run (the job's port tells runs apart)
    out = os.environ.get("COMPAT_OUT") or os.path.join(tempfile.gettempdir(), "hf_trainer_ds_{}_{}".format(
        os.environ.get("COMPAT_SIDE", "deepspeed"), os.environ.get("MASTER_PORT", "0")))
    train(out, a, recorder)
    if a.resume_at:
        torch.distributed.barrier()
        train(out + "-resumed", a, recorder, resume=os.path.join(out, f"checkpoint-{a.resume_at}"))
    recorder.finish()
    torch.distributed.barrier()
    if rank == 0 and not os.environ.get("COMPAT_OUT"):
        for d in (out, out + "-resumed"):
            shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
