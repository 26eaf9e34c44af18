"""DeepSpeed-Chat-style steps 1 and 2 on a tiny OPT built from its config:
supervised fine-tuning (causal-LM loss) and a reward model (pairwise loss on the
last-token reward). As DeepSpeed-Chat: its own DistributedSampler loader, a client
FusedAdam over weight-decay / no-decay groups, a Hugging Face cosine schedule passed as
``lr_scheduler``, and its ds_config (hybrid_engine off, tensorboard off).

    torchrun --nproc_per_node N chat_ds.py --step sft|reward --stage S [--steps 20]"""

from __future__ import annotations

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
from _side import Recorder, import_deepspeed, tokens
from torch.utils.data import DataLoader, DistributedSampler
from transformers import OPTConfig, OPTForCausalLM, get_scheduler

deepspeed = import_deepspeed()
VOCAB, SEQ, MICRO = 128, 24, 4


def opt_config() -> OPTConfig:
    return OPTConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, ffn_dim=128, num_attention_heads=4,
                     max_position_embeddings=64, word_embed_proj_dim=64, dropout=0.0, attention_dropout=0.0,
                     activation_dropout=0.0, layerdrop=0.0)


class RewardModel(nn.Module):
    """DeepSpeed-Chat's reward model, simplified: the base transformer and a value head;
    chosen and rejected sequences come stacked in one batch (chosen first)."""

    def __init__(self, base: nn.Module) -> None:
        super().__init__()
        self.rwtransformer = base
        self.v_head = nn.Linear(base.config.hidden_size, 1, bias=False)

    def forward(self, input_ids, attention_mask):
        hidden = self.rwtransformer(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        rewards = self.v_head(hidden).squeeze(-1)[:, -1]
        half = input_ids.shape[0] // 2
        return -F.logsigmoid(rewards[:half] - rewards[half:]).mean()


class Rows(torch.utils.data.Dataset):
    def __init__(self, step: str, n: int = 256) -> None:
        self.step = step
        self.ids = tokens(n, SEQ, VOCAB, seed=11)
        self.rejected = tokens(n, SEQ, VOCAB, seed=12)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        ids = self.ids[i]
        if self.step == "sft":
            return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
        return {"chosen": ids, "rejected": self.rejected[i]}


def grouped_parameters(model: nn.Module, weight_decay: float) -> list[dict]:
    """DeepSpeed-Chat's groups: no decay for biases and LayerNorm weights."""
    no_decay = ("bias", "layer_norm.weight", "layernorm.weight", "norm.weight", "ln_f.weight")
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [{"params": [p for n, p in named if not any(nd in n.lower() for nd in no_decay)],
             "weight_decay": weight_decay},
            {"params": [p for n, p in named if any(nd in n.lower() for nd in no_decay)], "weight_decay": 0.0}]


def train_ds_config(stage: int, world: int) -> dict:
    return {
        "train_batch_size": MICRO * world,
        "train_micro_batch_size_per_gpu": MICRO,
        "steps_per_print": 10,
        "zero_optimization": {"stage": stage, "offload_param": {"device": "none"},
                              "offload_optimizer": {"device": "none"}, "stage3_param_persistence_threshold": 1e4,
                              "stage3_max_live_parameters": 3e7, "stage3_prefetch_bucket_size": 3e7,
                              "memory_efficient_linear": False},
        "fp16": {"enabled": False, "loss_scale_window": 100},
        "bf16": {"enabled": False},
        "gradient_clipping": 1.0,
        "prescale_gradients": False,
        "wall_clock_breakdown": False,
        "hybrid_engine": {"enabled": False, "max_out_tokens": 512, "inference_tp_size": 1,
                          "release_inference_cache": False, "pin_parameters": True, "tp_gather_partition_size": 8},
        "tensorboard": {"enabled": False, "output_path": "step1_tensorboard/ds_tensorboard_logs/",
                        "job_name": "step1_model_tensorboard"},
    }


def fused_adam():
    """DeepSpeed-Chat's optimizer class (FusedAdam); torch's AdamW — the same update —
    where this zeal does not give ``deepspeed.ops`` yet."""
    ops = getattr(deepspeed, "ops", None)
    return ops.adam.FusedAdam if ops is not None else torch.optim.AdamW


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--step", choices=("sft", "reward"), default="sft")
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--local_rank", type=int, default=-1)
    args = p.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    torch.manual_seed(1234)
    lm = OPTForCausalLM(opt_config())
    model = lm if args.step == "sft" else RewardModel(lm.model.decoder)
    data = Rows(args.step)
    sampler = DistributedSampler(data)
    loader = DataLoader(data, sampler=sampler, batch_size=MICRO)
    optimizer = fused_adam()(grouped_parameters(model, 0.1), lr=5e-3, betas=(0.9, 0.95))
    lr_scheduler = get_scheduler(name="cosine", optimizer=optimizer, num_warmup_steps=2,
                                 num_training_steps=args.steps)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, args=args, lr_scheduler=lr_scheduler,
                                      config=train_ds_config(args.stage, world), dist_init_required=True)
    rec = Recorder(engine.global_rank)
    epoch = 0
    while len(rec.losses) < args.steps:
        sampler.set_epoch(epoch)
        for batch in loader:
            if args.step == "sft":
                loss = engine(**batch, use_cache=False).loss
            else:
                ids = torch.cat([batch["chosen"], batch["rejected"]])
                loss = engine(ids, torch.ones_like(ids))
            engine.backward(loss)
            engine.step()
            rec.step(loss.item())
            if len(rec.losses) >= args.steps:
                break
        epoch += 1
    rec.finish()


if __name__ == "__main__":
    main()
