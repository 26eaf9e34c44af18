"""A masked-language-model script in the style of DeepSpeedExamples'
``training/HelloDeepSpeed/train_bert_ds.py``: a tiny Hugging Face BERT built from its
config, bf16, ZeRO 1 or 2 (optionally with the optimizer offloaded to the CPU, where
DeepSpeed runs its CPU Adam), Adam with WarmupDecayLR; synthetic masked tokens.

    torchrun --nproc_per_node N bert_ds.py --stage S [--offload] [--steps 20]"""

from __future__ import annotations

import argparse

import torch
from _side import Recorder, Tensors, import_deepspeed, tokens
from transformers import BertConfig, BertForMaskedLM

deepspeed = import_deepspeed()
VOCAB, SEQ, MASK_ID = 128, 32, 1


def mlm_data(n: int) -> Tensors:
    """15% of positions masked (id 1) with their labels kept; -100 elsewhere."""
    ids = tokens(n, SEQ, VOCAB, seed=3)
    g = torch.Generator().manual_seed(4)
    masked = torch.rand(n, SEQ, generator=g) < 0.15
    labels = torch.where(masked, ids, torch.full_like(ids, -100))
    return Tensors(torch.where(masked, torch.full_like(ids, MASK_ID), ids), torch.ones_like(ids), labels)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--stage", type=int, default=1)
    p.add_argument("--offload", action="store_true")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--local_rank", type=int, default=-1)
    args = p.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(7)
    model = BertForMaskedLM(BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                       intermediate_size=128, max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
                                       attention_probs_dropout_prob=0.0))
    zero = {"stage": args.stage}
    if args.offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "optimizer": {"type": "Adam", "params": {"lr": 3e-3}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 40, "warmup_num_steps": 4,
                                                          "warmup_max_lr": 3e-3, "warmup_type": "linear"}},
        "bf16": {"enabled": True},
        "gradient_clipping": 1.0,
        "zero_optimization": zero,
    }
    engine, _, loader, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config,
                                                training_data=mlm_data(512))
    rec = Recorder(engine.global_rank)
    while len(rec.losses) < args.steps:
        for ids, mask, labels in loader:
            loss = engine(input_ids=ids, attention_mask=mask, labels=labels).loss
            engine.backward(loss)
            engine.step()
            rec.step(loss.item())
            if len(rec.losses) >= args.steps:
                break
    rec.finish()


if __name__ == "__main__":
    main()
