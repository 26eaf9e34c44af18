"""DeepSpeed-Chat's own step 1-3 scripts, unchanged, on DeepSpeed 0.19.8 and on zeal.

    python bench/compat/dschat_compare.py --dschat DIR [--only step1-r1 ...] [--stage 2]

``DIR`` holds DeepSpeed-Chat's ``training/`` and ``dschat/`` (not in this repository; from
DeepSpeedExamples ``applications/DeepSpeed-Chat``, e.g. ``git archive``). The harness
writes a tiny OPT (random init, ``save_pretrained``), a byte-level BPE tokenizer and
``DIR/data/{train,eval}.json`` for DS-Chat's ``local/jsonfile`` data set, then runs each
case with DeepSpeed's launcher (``deepspeed``, ``DS_ACCELERATOR=cpu``) and with
``zeal deepspeed``, same arguments, and compares what the scripts print: step 1's
per-step losses (``--print_loss``), step 2's per-step evaluated chosen scores
(``--eval_interval 1``), step 3's actor / critic losses (PPO with
``--enable_hybrid_engine``). DS-Chat accepts only ``--dtype fp16|bf16``; the runs are bf16.

DeepSpeed 0.19.8's hybrid engine has no CPU kernels, so its step 3 with
``--enable_hybrid_engine`` fails here. ``--ds-no-hybrid`` runs DeepSpeed's step 3 without the
flag (generation through the model's own ``generate``, as DS-Chat does then) while zeal's keeps
it, and ``--step3-from ds`` starts both sides' step 3 from DeepSpeed's step-1/2 models, so the
PPO losses of the two can be compared.

Two things outside DeepSpeed are needed on both sides: ``datasets`` and ``tensorboard``
(DS-Chat imports them; ``--zeal-site`` is a folder with them for zeal's side), and a
transformers-5 shim that the harness writes as ``DIR/dschat/__init__.py`` (DS-Chat imports
``no_init_weights`` from where transformers 4 had it). Run it under the CPU lock."""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
from _shared import clear_stale_extension_locks  # noqa: E402

SHIM = '''# written by zeal's bench/compat/dschat_compare.py: transformers 5 moved no_init_weights
import transformers.modeling_utils as _mu
if not hasattr(_mu, "no_init_weights"):
    from transformers.initialization import no_init_weights as _niw
    _mu.no_init_weights = _niw
'''
BF16_TOL = 2e-2  # see README.md: bf16 weights, the losses of both sides move by bf16 rounding


def make_assets(dschat: Path, work: Path, python: str) -> Path:
    """A tiny OPT + tokenizer in ``work/tiny-opt`` and DS-Chat's local/jsonfile data."""
    model = work / "tiny-opt"
    if (model / "config.json").exists():
        return model
    rng = random.Random(0)
    words = "the a cat dog runs sits on mat red blue big small sky sea tree house sun moon eats jumps".split()

    def sent(n: int) -> str:
        return " ".join(rng.choice(words) for _ in range(n))

    rows = [{"prompt": "Human: " + sent(5) + " Assistant:", "chosen": sent(6), "rejected": sent(4)} for _ in range(96)]
    (dschat / "data").mkdir(exist_ok=True)
    (dschat / "data" / "train.json").write_text(json.dumps(rows[:64]))
    (dschat / "data" / "eval.json").write_text(json.dumps(rows[64:]))
    code = f'''
import json, torch
from tokenizers import ByteLevelBPETokenizer
from transformers import GPT2TokenizerFast, OPTConfig, OPTForCausalLM
rows = json.load(open({str(dschat / "data" / "train.json")!r})) + json.load(open({str(dschat / "data" / "eval.json")!r}))
bpe = ByteLevelBPETokenizer()
bpe.train_from_iterator([r["prompt"] + " " + r["chosen"] + " " + r["rejected"] for r in rows], vocab_size=300,
                        min_frequency=1, special_tokens=["<pad>", "</s>", "<unk>"])
tok = GPT2TokenizerFast(tokenizer_object=bpe._tokenizer, bos_token="</s>", eos_token="</s>", unk_token="<unk>",
                        pad_token="<pad>")
tok.save_pretrained({str(model)!r}); bpe.save_model({str(model)!r})
torch.manual_seed(0)
cfg = OPTConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, ffn_dim=64, num_attention_heads=4,
                max_position_embeddings=128, word_embed_proj_dim=32, pad_token_id=0, bos_token_id=1, eos_token_id=1,
                dropout=0.0, attention_dropout=0.0)
OPTForCausalLM(cfg).save_pretrained({str(model)!r})
'''
    subprocess.run([python, "-c", code], check=True, timeout=300)
    return model


def _copy_tokenizer(src: Path, dst: Path) -> None:
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "vocab", "merges")):
            (dst / f.name).write_bytes(f.read_bytes())


def step_args(step: int, model: Path, work: Path, side: str, ranks: int, stage: int, hybrid: bool = True,
              step3_from: str = "own") -> tuple[str, list[str]]:
    common = ["--data_path", "local/jsonfile", "--data_split", "2,4,4", "--seed", "1234", "--dtype", "bf16",
              "--num_train_epochs", "1", "--lr_scheduler_type", "cosine", "--num_warmup_steps", "0",
              "--gradient_accumulation_steps", "1"]
    tag = f"{side}-r{ranks}-z{stage}"
    if step in (1, 2):
        folder = "step1_supervised_finetuning" if step == 1 else "step2_reward_model_finetuning"
        extra = ["--print_loss"] if step == 1 else ["--eval_interval", "1", "--eval_iters", "4"]
        return folder, [*common, "--model_name_or_path", str(model), "--per_device_train_batch_size", "4",
                        "--per_device_eval_batch_size", "4", "--max_seq_len", "32", "--learning_rate", "1e-3",
                        "--weight_decay", "0.1", "--zero_stage", str(stage), *extra,
                        "--output_dir", str(work / f"step{step}-{tag}"),
                        "--data_output_path", str(work / f"data{step}-{tag}")]
    src = tag if step3_from == "own" else f"{step3_from}-r{ranks}-z{stage}"
    return "step3_rlhf_finetuning", [
        *common, "--actor_model_name_or_path", str(work / f"step1-{src}"),
        "--critic_model_name_or_path", str(work / f"step2-{src}"), "--num_padding_at_beginning", "1",
        "--per_device_generation_batch_size", "4", "--per_device_training_batch_size", "4",
        "--generation_batches", "1", "--ppo_epochs", "1", "--max_answer_seq_len", "16", "--max_prompt_seq_len", "16",
        "--actor_learning_rate", "1e-4", "--critic_learning_rate", "1e-4", "--actor_zero_stage", str(stage),
        "--critic_zero_stage", str(stage), *(["--enable_hybrid_engine"] if hybrid else []),
        "--output_dir", str(work / f"step3-{tag}"),
        "--data_output_path", str(work / f"data3-{tag}")]


PATTERNS = {1: re.compile(r"Step: (\d+), Rank: (\d+), loss = ([-\d.e]+)"),
            2: re.compile(r"Iter (\d+): c_scores: ([-\d.e]+)"),
            3: re.compile(r"Actor Loss: ([-\d.e]+) \| Critic Loss: ([-\d.e]+)")}


def figures(step: int, text: str) -> list[float]:
    """What a step prints, in order: rank 0's losses / chosen scores / actor and critic losses."""
    if step == 1:
        return [float(m[2]) for m in PATTERNS[1].findall(text) if m[1] == "0"]
    if step == 2:
        return [float(m[1]) for m in PATTERNS[2].findall(text)]
    return [float(v) for m in PATTERNS[3].findall(text) for v in m]


def run_side(side: str, step: int, args: argparse.Namespace, model: Path, work: Path, ranks: int) -> tuple[list, float]:
    folder, script_args = step_args(step, model, work, side, ranks, args.stage,
                                    hybrid=not (side == "ds" and args.ds_no_hybrid), step3_from=args.step3_from)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    port = str(29500 + random.randint(0, 999))
    if side == "ds":
        env.update(DS_ACCELERATOR="cpu", PYTHONPATH=str(args.dschat))
        cmd = [args.ds_launcher, "--num_gpus", str(ranks), "--master_port", port, "main.py", *script_args]
    else:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), args.zeal_site, str(args.dschat)) if p)
        cmd = [sys.executable, "-m", "zeal.cli.main", "deepspeed", "--num_gpus", str(ranks), "--master_port", port,
               "main.py", *script_args]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, cwd=args.dschat / "training" / folder, env=env, capture_output=True, text=True,
                         timeout=args.timeout)
    took = time.perf_counter() - t0
    text = out.stdout + out.stderr
    if out.returncode != 0:
        print(f"  {side} step{step} r{ranks} failed (rc {out.returncode}):\n" + text[-1500:])
        return [], took
    if step in (1, 2):
        _copy_tokenizer(model, work / f"step{step}-{side}-r{ranks}-z{args.stage}")
    return figures(step, text), took


def rel(a: list[float], b: list[float]) -> float:
    return max((abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b)), default=float("nan"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dschat", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=Path("/tmp/zeal-dschat-compare"))
    ap.add_argument("--stage", type=int, default=2)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--steps", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--ds-launcher", default="/work/peers/ds/bin/deepspeed")
    ap.add_argument("--zeal-site", default="", help="a folder with datasets and tensorboard for zeal's side")
    ap.add_argument("--timeout", type=int, default=1500)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--ds-no-hybrid", action="store_true",
                    help="DeepSpeed's step 3 without --enable_hybrid_engine (its hybrid kernels have no CPU build)")
    ap.add_argument("--step3-from", choices=["own", "ds", "zeal"], default="own",
                    help="whose step-1/2 models both sides' step 3 starts from (own: each side its own)")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    shim = args.dschat / "dschat" / "__init__.py"
    if not shim.exists():
        shim.write_text(SHIM)
    clear_stale_extension_locks()
    model = make_assets(args.dschat, args.work, sys.executable)
    rows = []
    for ranks in args.ranks:
        for step in sorted(args.steps):  # step 3 loads what steps 1 and 2 saved, side by side
            ds, t_ds = run_side("ds", step, args, model, args.work, ranks)
            zl, t_zl = run_side("zeal", step, args, model, args.work, ranks)
            row = {"case": f"step{step}-r{ranks}-z{args.stage}", "ranks": ranks, "stage": args.stage, "ds": ds,
                   "zeal": zl, "max_rel": rel(zl, ds) if ds and zl else None,
                   "max_abs": max((abs(x - y) for x, y in zip(zl, ds)), default=None) if ds and zl else None,
                   "time_ratio": t_zl / t_ds, "wall_s": {"ds": t_ds, "zeal": t_zl}}
            if step == 3:
                row["ds_hybrid_engine"] = not args.ds_no_hybrid
                row["step3_from"] = args.step3_from
            rows.append(row)
            print(f"{row['case']}: ds {ds}\n{' ' * len(row['case'])}  zeal {zl}\n  max rel {row['max_rel']}, "
                  f"wall time zeal/DS {row['time_ratio']:.2f}", flush=True)
    print("\n| case | ranks | stage | what is compared | max rel diff | max abs diff | tol | wall zeal/DS |")
    print("|---|---|---|---|---|---|---|---|")
    what = {1: "SFT loss per step", 2: "eval chosen score per step", 3: "PPO actor, critic loss per step"}
    for r in rows:
        step = int(r["case"][4])
        ok = r["max_rel"] is not None and (step == 3 or r["max_rel"] <= BF16_TOL)
        if r["max_rel"] is not None:
            m = f"{r['max_rel']:.1e}"
        else:
            m = "DeepSpeed failed, zeal ran" if r["zeal"] and not r["ds"] else "failed"
        tol = f"{BF16_TOL:.0e}" if step < 3 else "behaviour"
        mabs = f"{r['max_abs']:.1e}" if r.get("max_abs") is not None else "-"
        print(f"| {r['case']} | {r['ranks']} | {r['stage']} | {what[step]} | {m} | {mabs} | {tol} | {r['time_ratio']:.2f} "
              f"{'ok' if ok else ''} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
