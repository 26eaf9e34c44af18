"""A Hugging Face model loaded with ``from_pretrained`` under a ZeRO-3 DeepSpeed config (what
the Trainer and DeepSpeed-Chat do), then trained a step: never names zeal. Writes OUT-result-RANK.json."""
import argparse
import json

import deepspeed
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from transformers.integrations import HfDeepSpeedConfig

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
args = ap.parse_args()
deepspeed.init_distributed()
torch.manual_seed(0)
ref = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
if dist.get_rank() == 0:
    ref.save_pretrained(args.out)
dist.barrier()
config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}}}
keep = HfDeepSpeedConfig(config)  # noqa: F841 - transformers reads it while it lives
model = AutoModelForCausalLM.from_pretrained(args.out, dtype=torch.float32)
with deepspeed.zero.GatheredParameters(list(model.parameters())):
    loaded = {k: v.detach().clone() for k, v in model.state_dict().items()}
same = all(torch.equal(loaded[k], v) for k, v in ref.state_dict().items() if k in loaded)
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(dist.get_rank()))
loss = engine(input_ids=x, labels=x).loss
with torch.no_grad():
    ref_loss = ref(input_ids=x, labels=x).loss
engine.backward(loss)
engine.step()
result = {"same_weights": same, "keys": len(loaded), "loss": loss.item(), "ref_loss": float(ref_loss)}
with open(f"{args.out}-result-{dist.get_rank()}.json", "w") as f:  # one file a rank: stdout lines interleave
    json.dump(result, f)
