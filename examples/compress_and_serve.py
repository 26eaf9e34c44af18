"""Compress the embedded SmolLM2-135M-Instruct to 4-bit weights with ``zeal compress``,
then load the compressed folder in the serving engine and ask it what the dense model is
asked (the same folder serves over HTTP with ``zeal serve runs/example-smol-w4``).

    python examples/compress_and_serve.py                 # int4, a scale per 32 weights, ~1 min on 2 CPU cores
    python examples/compress_and_serve.py --sparsity 2:4  # also 2:4 sparsity (Wanda, + 16 fine-tuning steps)
    python examples/compress_and_serve.py --model PATH    # another HF folder (default: the embedded SmolLM2)
    python examples/compress_and_serve.py --toy           # int8, 2 calibration blocks (what CI runs)

``zeal compress`` prints the held-out perplexity before and after and writes a
compressed-tensors folder (packed integer weights and their scales), dequantized on load.
"""
import argparse
import subprocess
import sys

import zeal

parser = argparse.ArgumentParser()
parser.add_argument("--model", help="HF folder to compress (default: the embedded SmolLM2-135M-Instruct)")
parser.add_argument("--sparsity", help="N:M pattern, e.g. 2:4 (default: quantization only)")
parser.add_argument("--out", default="runs/example-smol-w4")
parser.add_argument("--toy", action="store_true", help="int8, 2 calibration and 2 evaluation blocks of 64 tokens")
args = parser.parse_args()

cmd = [sys.executable, "-m", "zeal.cli.main", "compress", "--out", args.out]  # i.e. `zeal compress ...`
if args.model:
    cmd += ["--model", args.model]
if args.toy:
    cmd += ["--bits", "8", "--calib-blocks", "2", "--eval-blocks", "2", "--seq-len", "64"]
else:
    cmd += ["--bits", "4", "--group-size", "32"]
if args.sparsity:
    cmd += ["--sparsity", args.sparsity, "--method", "wanda", "--steps", "16"]
print("$ zeal " + " ".join(cmd[3:]), flush=True)
subprocess.run(cmd, check=True)

question = [{"role": "user", "content": "What is the capital of France?"}]
ask = zeal.SamplingParams(max_tokens=8 if args.toy else 24, temperature=0)
models = [("compressed", args.out)] if args.toy else [("dense", args.model), ("compressed", args.out)]  # None: embedded
for name, path in models:
    llm = zeal.LLM(path, dtype="float32")
    print(f"{name}: {llm.chat(question, ask).outputs[0].text!r}")
    llm.shutdown()
print(f"serve it with: zeal serve {args.out}")
