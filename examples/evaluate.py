"""Evaluate a model with zeal's serving engine: held-out perplexity, and a multiple-choice
task scored the way lm-evaluation-harness scores one (the log-likelihood of each choice
given the question; ``acc`` picks the likeliest, ``acc_norm`` the likeliest per byte).

    python examples/evaluate.py                                  # the embedded SmolLM2-135M-Instruct, ~10 s
    python examples/evaluate.py --model runs/example-smollm2     # a fine-tuned folder (examples/finetune_smollm2.py)
    python examples/evaluate.py --toy                            # 3 questions, one short text (what CI runs)

The same scores come from lm-evaluation-harness itself against ``zeal serve`` (lm-eval in
its own environment; ``echo`` + ``logprobs`` give it the prompt's log-probs):

    zeal serve PATH --dtype float32 --served-model-name zeal &
    lm_eval --model local-completions --tasks TASK --model_args \\
      model=zeal,base_url=http://127.0.0.1:8000/v1/completions,tokenizer=PATH,tokenized_requests=True
"""
import argparse
import math

import zeal

parser = argparse.ArgumentParser()
parser.add_argument("--model", help="a Hugging Face folder or GGUF (default: the embedded SmolLM2-135M-Instruct)")
parser.add_argument("--toy", action="store_true", help="3 questions, one short text (what CI runs)")
args = parser.parse_args()

# (question, choices, index of the right one): facts a 135M model mostly knows
TASK = [
    ("The capital of France is", [" Paris", " Berlin", " Madrid", " Rome"], 0),
    ("Two plus two equals", [" four", " seven", " ten", " one"], 0),
    ("Water freezes at a temperature of zero degrees", [" Celsius", " Kelvin", " Newton", " Pascal"], 0),
    ("The opposite of hot is", [" cold", " loud", " tall", " fast"], 0),
    ("A week has seven", [" days", " hours", " months", " years"], 0),
    ("The largest planet in the solar system is", [" Jupiter", " Mercury", " Mars", " Venus"], 0),
    ("In Python, a function is defined with the keyword", [" def", " func", " lambda", " fn"], 0),
    ("Bees make", [" honey", " milk", " silk", " wool"], 0),
]
TEXT = ("The Python standard library is very extensive, offering a wide range of facilities. "
        "It contains built-in modules, written in C, that provide access to system functionality "
        "such as file input and output that would otherwise be inaccessible to Python programmers, "
        "as well as modules written in Python that provide standardized solutions for many "
        "problems that occur in everyday programming.")
task = TASK[:3] if args.toy else TASK

llm = zeal.LLM(args.model, dtype="float32")      # None: the embedded model
tok = llm.tokenizer
score = zeal.SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)


def loglikelihoods(pairs):
    """Sum of log p(continuation | context) for each (context, continuation), in one batch."""
    prompts, spans = [], []
    for context, continuation in pairs:
        ctx = tok.encode(context)
        cont = tok.encode(continuation, add_special_tokens=False)
        prompts.append(ctx + cont)
        spans.append((len(ctx), len(ctx) + len(cont)))
    outs = llm.generate(prompts, score)
    return [sum(o.prompt_logprobs[i]["logprob"] for i in range(a, b)) for o, (a, b) in zip(outs, spans)]


acc = acc_norm = 0
for question, choices, right in task:
    ll = loglikelihoods([(question, c) for c in choices])
    acc += max(range(len(choices)), key=lambda i: ll[i]) == right
    acc_norm += max(range(len(choices)), key=lambda i: ll[i] / len(choices[i].encode())) == right
print(f"multiple choice: acc {acc / len(task):.3f}  acc_norm {acc_norm / len(task):.3f}  ({len(task)} questions)")

ids = tok.encode(TEXT)[: 32 if args.toy else None]
entries = llm.generate([ids], score)[0].prompt_logprobs[1:]   # the first token has no context
nll = -sum(e["logprob"] for e in entries) / len(entries)
print(f"held-out text: {len(entries)} tokens, {nll:.3f} nats/token, perplexity {math.exp(nll):.2f}")
llm.shutdown()
