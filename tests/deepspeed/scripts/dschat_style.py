"""A DeepSpeed-Chat-style script (its steps 1-3), written for zeal's tests in the shape of
DeepSpeed-Chat's ``training/step*/main.py`` and its ``dschat`` package, with the same
DeepSpeed calls: ``add_config_arguments`` / ``--local_rank``, ``get_accelerator``,
``init_distributed``, a ``DistributedSampler`` loader, a client ``FusedAdam`` (or
``DeepSpeedCPUAdam`` with ``--offload``) over weight-decay groups and a Hugging Face
schedule, ``initialize(model=, optimizer=, args=, config=, lr_scheduler=)``,
``backward`` / ``step`` / ``train`` / ``eval``, the model's own attributes through the
engine, ``tput_timer``, ``compression.helper``, ``ZeroParamStatus`` / ``ds_id`` /
``GatheredParameters`` for saving at ZeRO-3, and at step 3 four engines (actor with
``hybrid_engine``, ref, critic, reward) and ``actor.module.generate``.

A tiny OPT built from a config, random token data. Each rank writes ``rank{R}.json``
(losses, what it saw) into ``--out``; steps 1 and 2 save a Hugging Face-style folder that
the next step loads."""

from __future__ import annotations

import argparse
import json
import os

import deepspeed
import torch
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator
from deepspeed.compression.helper import recursive_getattr, recursive_setattr
from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from transformers import AutoModel, AutoModelForCausalLM, OPTConfig, get_scheduler

VOCAB, SEQ, PROMPT = 64, 12, 6


def ds_config(stage: int, offload: bool, dtype: str, micro: int, hybrid: bool = False) -> dict:
    """dschat.utils.ds_utils.get_train_ds_config's shape (no optimizer section)."""
    device = "cpu" if offload else "none"
    cfg = {"train_micro_batch_size_per_gpu": micro, "steps_per_print": 10,
           "zero_optimization": {"stage": stage, "overlap_comm": True, "offload_param": {"device": device},
                                 "offload_optimizer": {"device": device},
                                 "stage3_param_persistence_threshold": 10, "stage3_max_live_parameters": 3e7,
                                 "stage3_prefetch_bucket_size": 3e7, "memory_efficient_linear": False},
           "gradient_clipping": 1.0, "prescale_gradients": False, "wall_clock_breakdown": False,
           "hybrid_engine": {"enabled": hybrid, "max_out_tokens": 512, "inference_tp_size": 1,
                             "release_inference_cache": False, "pin_parameters": True,
                             "tp_gather_partition_size": 8},
           "tensorboard": {"enabled": False, "output_path": "/tmp/unused", "job_name": "x"}}
    if dtype == "bf16":
        cfg["bfloat16"] = {"enabled": True}
    return cfg


def grouped(model: nn.Module, weight_decay: float) -> list[dict]:
    """dschat.utils.utils.get_optimizer_grouped_parameters."""
    no_decay = ("bias", "layer_norm.weight", "layernorm.weight", "norm.weight")
    return [{"params": [p for n, p in model.named_parameters() if p.requires_grad and not any(k in n for k in no_decay)],
             "weight_decay": weight_decay},
            {"params": [p for n, p in model.named_parameters() if p.requires_grad and any(k in n for k in no_decay)],
             "weight_decay": 0.0}]


def tiny_opt_config() -> OPTConfig:
    return OPTConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, ffn_dim=64, num_attention_heads=4,
                     max_position_embeddings=64, word_embed_proj_dim=32, pad_token_id=1, bos_token_id=2,
                     eos_token_id=2, dropout=0.0, attention_dropout=0.0)


class RewardModel(nn.Module):
    """dschat.utils.model.reward_model.RewardModel's shape: a base model and a value head;
    the pairwise loss on the last token's score (chosen first half, rejected second)."""

    def __init__(self, base: nn.Module):
        super().__init__()
        self.config = base.config
        self.v_head = nn.Linear(base.config.hidden_size, 1, bias=False)
        self.rwtransformer = base

    def forward_value(self, input_ids, attention_mask=None):
        hidden = self.rwtransformer(input_ids, attention_mask=attention_mask).last_hidden_state
        return self.v_head(hidden).squeeze(-1)  # (B, T)

    def forward(self, input_ids, attention_mask=None):
        values = self.forward_value(input_ids, attention_mask)
        half = input_ids.shape[0] // 2
        chosen, rejected = values[:half, -1], values[half:, -1]
        return {"loss": -F.logsigmoid(chosen - rejected).mean(), "chosen_mean_scores": chosen,
                "rejected_mean_scores": rejected}


def data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (n, SEQ), generator=g)
    return TensorDataset(ids, torch.ones_like(ids))


def z3_params_to_fetch(params):
    return [p for p in params if hasattr(p, "ds_id") and p.ds_status == ZeroParamStatus.NOT_AVAILABLE]


def save_model(engine, rank: int, out_dir: str, stage: int) -> None:
    """save_hf_format below ZeRO-3, save_zero_three_model's per-parameter gather at it."""
    os.makedirs(out_dir, exist_ok=True)
    model = engine.module if hasattr(engine, "module") else engine
    if stage < 3:
        state = model.state_dict()
    else:
        state = {}
        for k, v in model.named_parameters():
            with deepspeed.zero.GatheredParameters(z3_params_to_fetch([v]), enabled=True):
                state[k] = v.data.detach().cpu().clone()
        state.update({k: b.detach().cpu().clone() for k, b in model.named_buffers()})
    if rank == 0:
        torch.save(state, os.path.join(out_dir, "pytorch_model.bin"))
        model.config.to_json_file(os.path.join(out_dir, "config.json"))


def load_into(model: nn.Module, folder: str) -> None:
    state = torch.load(os.path.join(folder, "pytorch_model.bin"), map_location="cpu", weights_only=True)
    model.load_state_dict(state, strict=False)


def make_optimizer(model, args, lr):
    adam = DeepSpeedCPUAdam if args.offload else FusedAdam
    return adam(grouped(model, args.weight_decay), lr=lr, betas=(0.9, 0.95))


def step1(args, world: int, rank: int, device) -> dict:
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(tiny_opt_config())
    # LoRA-style module swap through compression.helper (what dschat's convert_linear_layer_to_lora does)
    name = "model.decoder.layers.0.fc2"
    recursive_setattr(model, name, recursive_getattr(model, name))
    loader = DataLoader(data(args.samples, 1), sampler=DistributedSampler(data(args.samples, 1)),
                        batch_size=args.micro)
    opt = make_optimizer(model, args, 5e-3)
    sched = get_scheduler("cosine", optimizer=opt, num_warmup_steps=0, num_training_steps=len(loader))
    engine, opt, _, sched = deepspeed.initialize(model=model, optimizer=opt, args=args, lr_scheduler=sched,
                                                 config=ds_config(args.stage, args.offload, args.dtype, args.micro),
                                                 dist_init_required=True)
    losses = []
    engine.train()
    for ids, mask in loader:
        ids, mask = ids.to(device), mask.to(device)
        loss = engine(input_ids=ids, attention_mask=mask, labels=ids, use_cache=False).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.tput_timer.update_epoch_count()
    n_layers = len(engine.model.decoder.layers)  # the model's attribute, through the engine
    save_model(engine, rank, os.path.join(args.out, "actor"), args.stage)
    return {"losses": losses, "layers": n_layers, "lr": engine.get_lr()[0], "epochs": engine.tput_timer.epoch_count}


def step2(args, world: int, rank: int, device) -> dict:
    torch.manual_seed(args.seed)
    model = RewardModel(AutoModel.from_config(tiny_opt_config()))
    chosen, rejected = data(args.samples, 2), data(args.samples, 3)
    pairs = TensorDataset(chosen.tensors[0], rejected.tensors[0])
    loader = DataLoader(pairs, sampler=DistributedSampler(pairs), batch_size=args.micro)
    opt = make_optimizer(model, args, 5e-3)
    sched = get_scheduler("cosine", optimizer=opt, num_warmup_steps=0, num_training_steps=len(loader))
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, args=args, lr_scheduler=sched,
                                      config=ds_config(args.stage, args.offload, args.dtype, args.micro))
    losses, acc = [], []
    for c, r in loader:
        ids = torch.cat([c, r]).to(device)
        out = engine(ids, attention_mask=torch.ones_like(ids))
        engine.backward(out["loss"])
        engine.step()
        losses.append(out["loss"].item())
        acc.append((out["chosen_mean_scores"] > out["rejected_mean_scores"]).float().mean().item())
    save_model(engine, rank, os.path.join(args.out, "critic"), args.stage)
    return {"losses": losses, "acc": acc}


def step3(args, world: int, rank: int, device) -> dict:
    z3 = args.stage == 3

    def actor_model():
        m = AutoModelForCausalLM.from_config(tiny_opt_config())
        load_into(m, os.path.join(args.out, "actor"))
        return m

    def critic_model():
        m = RewardModel(AutoModel.from_config(tiny_opt_config()))
        load_into(m, os.path.join(args.out, "critic"))
        return m

    def engine_for(model, lr, hybrid=False):
        cfg = ds_config(args.stage, args.offload, args.dtype, args.micro, hybrid=hybrid)
        if lr is None:  # get_eval_ds_config: no optimizer
            return deepspeed.initialize(model=model, config=cfg)[0]
        opt = make_optimizer(model, args, lr)
        sched = get_scheduler("constant", optimizer=opt)
        return deepspeed.initialize(model=model, optimizer=opt, lr_scheduler=sched, config=cfg)[0]

    torch.manual_seed(args.seed)
    actor = engine_for(actor_model(), 1e-3, hybrid=True)
    ref = engine_for(actor_model(), None)
    critic = engine_for(critic_model(), 1e-3)
    reward = engine_for(critic_model(), None)
    prompts = data(args.samples, 4).tensors[0][:, :PROMPT]
    loader = DataLoader(TensorDataset(prompts), sampler=DistributedSampler(TensorDataset(prompts)),
                        batch_size=args.micro)
    out: dict = {"actor_type": type(actor).__name__, "actor_loss": [], "critic_loss": [], "reward": [],
                 "generated": [], "modes": []}
    for (batch,) in loader:
        batch = batch.to(device)
        for e in (actor, ref, critic, reward):
            e.eval()
        out["modes"].append([actor.module.training, critic.module.training])
        with torch.no_grad():
            seq = actor.module.generate(batch, attention_mask=torch.ones_like(batch), max_length=SEQ,
                                        pad_token_id=1, synced_gpus=z3, do_sample=False)
            mask = torch.ones_like(seq)
            logp_old = F.log_softmax(actor(seq, attention_mask=mask).logits[:, :-1].float(), -1)
            logp_old = logp_old.gather(-1, seq[:, 1:, None]).squeeze(-1)
            logp_ref = F.log_softmax(ref(seq, attention_mask=mask).logits[:, :-1].float(), -1)
            logp_ref = logp_ref.gather(-1, seq[:, 1:, None]).squeeze(-1)
            score = reward.module.forward_value(seq, mask)[:, -1]
            values_old = critic.module.forward_value(seq, mask)[:, :-1]
        out["generated"].append(seq.tolist())
        out["reward"].append(score.mean().item())
        actor.train()
        critic.train()
        out["modes"].append([actor.module.training, critic.module.training])
        start = PROMPT - 1
        rewards = -0.1 * (logp_old - logp_ref)
        rewards[:, -1] += score.clamp(-5, 5)
        returns = rewards[:, start:].flip(-1).cumsum(-1).flip(-1)
        adv = returns - values_old[:, start:]
        logp = F.log_softmax(actor(seq, attention_mask=mask).logits[:, :-1].float(), -1)
        logp = logp.gather(-1, seq[:, 1:, None]).squeeze(-1)[:, start:]
        ratio = torch.exp(logp - logp_old[:, start:])
        actor_loss = torch.max(-adv * ratio, -adv * ratio.clamp(0.8, 1.2)).mean()
        actor.backward(actor_loss)
        actor.step()
        values = critic.module.forward_value(seq, mask)[:, :-1][:, start:]
        critic_loss = 0.5 * ((values - returns) ** 2).mean()
        critic.backward(critic_loss)
        critic.step()
        out["actor_loss"].append(actor_loss.item())
        out["critic_loss"].append(critic_loss.item())
    with deepspeed.zero.GatheredParameters(z3_params_to_fetch(list(actor.module.parameters())), enabled=z3):
        out["actor_norm"] = float(sum(p.detach().float().norm() ** 2 for p in actor.module.parameters()) ** 0.5)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--step", choices=["1", "2", "3", "all"], default="all")
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--offload", action="store_true")
    parser.add_argument("--micro", type=int, default=2)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--weight_decay", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--out", required=True)
    parser.add_argument("--local_rank", type=int, default=-1)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    if args.local_rank == -1:
        device = torch.device(get_accelerator().device_name())
    else:
        get_accelerator().set_device(args.local_rank)
        device = torch.device(get_accelerator().device_name(), args.local_rank)
    deepspeed.init_distributed()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.distributed.barrier()
    record: dict = {"rank": rank, "world": world, "comm_rank": deepspeed.comm.get_rank()}
    for step, fn in (("1", step1), ("2", step2), ("3", step3)):
        if args.step in (step, "all"):
            record[f"step{step}"] = fn(args, world, rank, device)
            torch.distributed.barrier()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main()
