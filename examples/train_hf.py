"""Train a Hugging Face model with zeal: any ``transformers`` model built from a config
goes to ``zeal.initialize`` as it is (``engine.backward`` takes its output's ``.loss``).

    python examples/train_hf.py                   # a 4-layer Llama from scratch, 100 steps
    zeal launch --nproc 2 examples/train_hf.py    # on 2 ranks, ZeRO stage 2
    python examples/train_hf.py --toy             # 2 steps (what CI runs)

Needs ``pip install 'zeal[hf]'`` (transformers). The text is Python's ``json`` package as bytes.
"""
import argparse
import json
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import zeal

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=100)
parser.add_argument("--toy", action="store_true", help="2 steps")
args = parser.parse_args()
steps = 2 if args.toy else args.steps

text = b"".join(p.read_bytes() for p in sorted(Path(json.__file__).parent.glob("*.py")))
data = torch.tensor(list(text), dtype=torch.long)
config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
model = LlamaForCausalLM(config)
engine = zeal.initialize(model, {
    "train_micro_batch_size_per_gpu": 8,
    "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "weight_decay": 0.01}},
    "zero_optimization": {"stage": 2},
})
gen = torch.Generator().manual_seed(engine.mesh.dp_rank)
for step in range(1, steps + 1):
    starts = torch.randint(len(data) - 128, (8,), generator=gen)
    x = torch.stack([data[s:s + 128] for s in starts])
    out = engine(input_ids=x, labels=x)   # a CausalLMOutputWithPast; transformers shifts the labels
    engine.backward(out)
    engine.step()
    if step % 20 == 0 or step == steps:
        print(f"step {step}: loss {out.loss.item():.3f}")
if engine.mesh.rank == 0:
    engine.module.save_pretrained("runs/example-hf")  # stage 2 keeps whole weights: a plain HF folder
    print("saved runs/example-hf (LlamaForCausalLM.from_pretrained loads it)")
