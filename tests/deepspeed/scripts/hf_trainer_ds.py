"""An unchanged Hugging Face Trainer script with ``TrainingArguments(deepspeed=...)``: a
tiny Llama built from its config, fixed token rows, "auto" config values as Hugging Face
fills them. It trains ``--steps`` steps saving every ``--save-steps``; with ``--resume DIR``
it resumes from that checkpoint. Prints one ``RESULT {json}`` line on rank 0 (per-step
losses and what the checkpoint folder holds).

    python -m zeal.deepspeed hf_trainer_ds.py --out DIR [--stage 3] [--resume DIR/checkpoint-2]
    ZEAL_DEEPSPEED=1 torchrun --nproc_per_node 2 hf_trainer_ds.py --out DIR"""

from __future__ import annotations

import argparse
import json
import os

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments, set_seed

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--stage", type=int, default=2)
p.add_argument("--steps", type=int, default=4)
p.add_argument("--save-steps", type=int, default=2)
p.add_argument("--resume", default=None)
p.add_argument("--ds-optimizer", action="store_true", help="optimizer and scheduler from the DeepSpeed config")
p.add_argument("--no-deepspeed", action="store_true", help="the reference: the Trainer's own loop")
p.add_argument("--peft", action="store_true", help="LoRA adapters by peft.get_peft_model, as TRL passes the model")
p.add_argument("--local_rank", type=int, default=-1)
a = p.parse_args()

ds_config = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
             "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
             "fp16": {"enabled": "auto"}, "zero_optimization": {"stage": a.stage}}
if a.ds_optimizer:
    ds_config["optimizer"] = {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                          "weight_decay": "auto"}}
    ds_config["scheduler"] = {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                                  "warmup_num_steps": "auto",
                                                                  "total_num_steps": "auto"}}
args = TrainingArguments(output_dir=a.out, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                         max_steps=a.steps, learning_rate=3e-3, warmup_steps=1, logging_steps=1,
                         save_steps=a.save_steps, report_to=[], deepspeed=None if a.no_deepspeed else ds_config, seed=0, use_cpu=True,
                         disable_tqdm=True, save_only_model=False)
set_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))
base_q = model.model.layers[0].self_attn.q_proj.weight.detach().clone()
if a.peft:
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                             lora_dropout=0.0))
rows = torch.randint(0, 64, (64, 12), generator=torch.Generator().manual_seed(1))
trainer = Trainer(model=model, args=args, train_dataset=[{"input_ids": r, "labels": r} for r in rows])
trainer.train(resume_from_checkpoint=a.resume)


def _peft_facts() -> dict:
    """What trained: the trainable names, and whether the frozen base weight moved."""
    import contextlib

    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    q = model.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight
    gather = contextlib.nullcontext() if a.no_deepspeed else __import__("deepspeed").zero.GatheredParameters([q])
    with gather:
        base_moved = not torch.equal(q.detach().clone(), base_q)
    adapter = sorted(os.listdir(os.path.join(a.out, f"checkpoint-{a.save_steps}")))
    return {"trainable": trainable, "base_moved": base_moved, "adapter_files": adapter}


if int(os.environ.get("RANK", 0)) == 0:
    losses = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
    first = os.path.join(a.out, f"checkpoint-{a.save_steps}")
    print("RESULT " + json.dumps({"losses": losses, "checkpoint": sorted(os.listdir(first)),
                                  "engine": type(trainer.model_wrapped).__module__,
                                  "stage": getattr(trainer.model_wrapped, "zero_optimization_stage", int)(),
                                  **(_peft_facts() if a.peft else {})}),
          flush=True)
