"""A PEFT-wrapped model (``peft.get_peft_model``, what TRL hands DeepSpeed) through
``deepspeed.initialize``, in the style of a DeepSpeed training script: only the adapters are
given to the optimizer, ZeRO ``--stage`` 0-3, a checkpoint at step ``--save-at``, then a
fresh engine loads it and replays the remaining steps. ``--reference``: the same loop in
plain PyTorch on one process (full batch, torch AdamW, clipping). Rank 0 prints ``RESULT
{json}``: per-step losses (mean over ranks), the resumed losses, the trainable names and
whether the frozen base weight moved.

    python -m zeal.deepspeed peft_ds.py --out DIR [--stage 3]
    zeal deepspeed --num_gpus 2 peft_ds.py --out DIR --stage 3     (or DeepSpeed's launcher)"""

from __future__ import annotations

import argparse
import json
import os

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--stage", type=int, default=2)
p.add_argument("--steps", type=int, default=6)
p.add_argument("--save-at", type=int, default=3)
p.add_argument("--reference", action="store_true")
p.add_argument("--local_rank", type=int, default=-1)
a = p.parse_args()
MICRO, LR = 2, 1e-2
ROWS = torch.randint(0, 64, (64, 12), generator=torch.Generator().manual_seed(1))


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, init_lora_weights=False)
    return get_peft_model(model, cfg)  # init_lora_weights=False: B is not zero, so step 1 already moves the loss


def batch(step: int, rank: int, world: int) -> torch.Tensor:
    start = (step * world + rank) * MICRO
    return ROWS[start:start + MICRO]


def reference() -> dict:
    model = build()
    world = int(os.environ.get("REF_WORLD", "1"))
    opt = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=LR, weight_decay=0.0)
    losses = []
    for step in range(a.steps):
        x = torch.cat([batch(step, r, world) for r in range(world)])
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_([q for q in model.parameters() if q.requires_grad], 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses}


def main() -> dict:
    import deepspeed

    deepspeed.init_distributed()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0, "torch_adam": True}},
              "zero_optimization": {"stage": a.stage}, "steps_per_print": 1000}

    def engine_of(model: torch.nn.Module):
        params = [q for q in model.parameters() if q.requires_grad]
        return deepspeed.initialize(model=model, model_parameters=params, config=config)[0]

    def run(engine, steps) -> list[float]:
        out = []
        for step in steps:
            x = batch(step, rank, world)
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
            mean = loss.detach().clone()
            torch.distributed.all_reduce(mean)
            out.append(mean.item() / world)
            if step + 1 == a.save_at:
                engine.save_checkpoint(a.out, tag=f"step{a.save_at}")
        return out

    model = build()
    base = model.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight
    with deepspeed.zero.GatheredParameters([base]):
        base_before = base.detach().clone()
    engine = engine_of(model)
    losses = run(engine, range(a.steps))
    with deepspeed.zero.GatheredParameters([base]):
        base_moved = not torch.equal(base.detach(), base_before)
    trainable = sorted(n for n, q in engine.module.named_parameters() if q.requires_grad)
    fresh = engine_of(build())
    path, _ = fresh.load_checkpoint(a.out, tag=f"step{a.save_at}")
    resumed = run(fresh, range(a.save_at, a.steps))
    return {"losses": losses, "resumed": resumed, "trainable": trainable, "base_moved": base_moved,
            "loaded": path is not None, "stage": engine.zero_optimization_stage(), "world": world}


result = reference() if a.reference else main()
if int(os.environ.get("RANK", "0")) == 0:
    print("RESULT " + json.dumps(result), flush=True)
