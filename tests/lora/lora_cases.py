"""Shared pieces of the LoRA tests: a tiny HF Llama (random init), a PEFT-initialised
adapter folder for it, the data, and PEFT's own training losses (the reference)."""

from __future__ import annotations

import torch

STEPS, MICRO, SEQ, LR, WORLD, VOCAB = 3, 2, 12, 1e-2, 2, 67
WD = 0.1  # stated on both sides: torch's AdamW and zeal's config default differ


def hf_model(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False, attn_implementation="eager")
    return LlamaForCausalLM(cfg)


def zeal_model(seed: int = 0):
    """zeal's Llama holding the HF model's weights (same names)."""
    from zeal.models.llama import Llama, LlamaConfig

    hf = hf_model(seed)
    model = Llama(LlamaConfig.from_hf(hf.config.to_dict()))
    model.load_state_dict(hf.state_dict(), strict=True)
    return model


def peft_model(**lora_kw):
    """The HF model wrapped by PEFT with a random, non-zero initial adapter (B too)."""
    import peft

    torch.manual_seed(1)
    kw = {"r": 4, "lora_alpha": 8, "target_modules": "all-linear", "init_lora_weights": False, **lora_kw}
    return peft.get_peft_model(hf_model(), peft.LoraConfig(**kw))


def write_initial_adapter(folder, **lora_kw) -> None:
    """PEFT's initial adapter (see :func:`peft_model`) saved as a folder."""
    peft_model(**lora_kw).save_pretrained(str(folder))


def data():
    g = torch.Generator().manual_seed(5)
    return [[torch.randint(0, VOCAB, (MICRO, SEQ), generator=g) for _ in range(WORLD)] for _ in range(STEPS)]


def peft_losses(**lora_kw) -> list[float]:
    """PEFT training in one plain process on the whole batch of every step."""
    model = peft_model(**lora_kw)
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=WD)
    losses = []
    for per_rank in data():
        ids = torch.cat(per_rank)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def engine_config(folder, stage: int = 0, **extra) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
            "lora": {"enabled": True, "adapter": str(folder)}, **extra}


def zeal_losses(engine, rank: int | None) -> list[float]:
    """Train ``engine`` on this rank's share (``rank``) or the whole batch (None)."""
    engine.train()
    losses = []
    for per_rank in data():
        ids = torch.cat(per_rank) if rank is None else per_rank[rank]
        loss = engine(ids, labels=ids)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses
