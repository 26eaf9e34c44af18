"""zeal's RLHF jobs beside TRL's trainers on the same model (the embedded SmolLM2-135M-Instruct,
fp32), data (the built-in arithmetic task), hyper-parameters and seed, in one run. TRL runs
in its own virtual environment (``--trl-python``) through ``_trl_side.py``, which writes
JSON; zeal runs here. Prints, per job, zeal's figure beside TRL's and the ratio:

- DPO (the correctness anchor): the loss of every step, zeal's against TRL's
  ``DPOTrainer`` (sigmoid loss), with the max difference (asserted ≤ ``--dpo-tol``);
- RM: the loss of every step and the held-out accuracy, zeal's reward model against
  TRL's ``RewardTrainer`` (their losses differ by definition: token-wise vs last token);
- GRPO: samples (completions) per second and the split of a step into generation,
  training and weight sync, zeal (hybrid engine) against TRL's ``GRPOTrainer``
  (generating with the training model), and both sides' mean reward per step (the
  task's graded reward by default: partial credit, non-zero from the first step) with
  the ratio of their last-k means;
- PPO: time per PPO iteration against TRL's last PPO (TRL 1.16 has none; 0.29.1's
  ``trl.experimental.ppo``, installed with ``--no-deps`` in a folder of its own and run
  by TRL's interpreter) and the reward curves, both scored by the same Python reward
  (TRL's PPO takes a reward model only: its reward-model calls are routed to the function).

    flock /tmp/zeal-heavy.lock timeout 900 env PYTHONPATH=. python bench/rlhf/bench_trl.py
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def trl_side(python: str, spec: dict, timeout: float, pythonpath: str | None = None) -> dict:
    """Run ``_trl_side.py`` in TRL's environment on ``spec``; its JSON result."""
    with tempfile.TemporaryDirectory() as d:
        spec_path, out_path = Path(d) / "spec.json", Path(d) / "out.json"
        spec_path.write_text(json.dumps(spec))
        env = {"PATH": "/usr/bin:/bin", "HOME": str(Path.home()), "TQDM_DISABLE": "1", "OMP_NUM_THREADS": "2",
               "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "HF_DATASETS_CACHE": str(Path(d) / "ds"),
               "TRL_EXPERIMENTAL_SILENCE": "1", **({"PYTHONPATH": pythonpath} if pythonpath else {})}
        proc = subprocess.run([python, str(HERE / "_trl_side.py"), str(spec_path), str(out_path)], env=env,
                              capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"TRL side failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        return json.loads(out_path.read_text())


def zeal_dpo_order(n: int, batch: int, steps: int, seed: int) -> list[int]:
    """The row indices zeal's DPO visits, step by step (its seeded shuffle)."""
    from zeal.rlhf.offline_trainers import _batches

    it = _batches(n, batch, torch.Generator().manual_seed(seed))
    return [i for _ in range(steps) for i in next(it)]


def engine_cfg(args) -> dict:
    return {"optimizer": {"type": args.optimizer, "params": {"lr": args.lr, "weight_decay": 0.0}},
            "gradient_clipping": args.grad_clip, "zero_optimization": {"stage": args.zero_stage}}


def bench_dpo(args, model_path: str) -> dict:
    from zeal.rlhf import dpo
    from zeal.rlhf.tasks import arithmetic_rows

    n = args.dpo_steps * args.dpo_batch
    rows = [{k: r[k] for k in ("prompt", "chosen", "rejected")} for r in arithmetic_rows(n, seed=args.seed)]
    cfg = {**engine_cfg(args), "rlhf": {"steps": args.dpo_steps, "batch_size": args.dpo_batch, "seed": args.seed,
                                        "dpo_beta": args.beta, "max_seq_len": 1024, "log_every": 10**6}}
    t0 = time.perf_counter()
    res = dpo(model_path, rows, cfg)
    zeal_s = time.perf_counter() - t0
    order = zeal_dpo_order(n, args.dpo_batch, args.dpo_steps, args.seed)
    spec = {"job": "dpo", "model": model_path, "rows": [rows[i] for i in order], "steps": args.dpo_steps,
            "batch_size": args.dpo_batch, "beta": args.beta, "lr": args.lr, "optimizer": args.optimizer,
            "grad_clip": args.grad_clip, "seed": args.seed, "max_length": 1024}
    trl = trl_side(args.trl_python, spec, args.timeout)
    return {"zeal": [r["loss"] for r in res.metrics], "trl": [s["loss"] for s in trl["steps"]],
            "zeal_margin": [r["reward"] for r in res.metrics], "trl_margin": [s["margin"] for s in trl["steps"]],
            "zeal_s": zeal_s, "trl_s": trl["train_s"], "trl_version": trl["trl_version"]}


def bench_rm(args, model_path: str) -> dict:
    """zeal's reward model (DeepSpeed-Chat's token-wise ranking loss over the answers'
    divergent span, zero-initialised head) beside TRL's ``RewardTrainer`` (last-token
    loss, N(0, 0.02) head): the same pairs in the same order, held-out pairs, steps, seed."""
    from zeal.rlhf import reward_model
    from zeal.rlhf.offline_trainers import _batches
    from zeal.rlhf.tasks import arithmetic_rows

    n = args.rm_pairs
    rows = [{k: r[k] for k in ("prompt", "chosen", "rejected")} for r in arithmetic_rows(n, seed=args.seed + 2)]
    cfg = {**engine_cfg(args), "rlhf": {"steps": args.rm_steps, "batch_size": args.rm_batch, "seed": args.seed,
                                        "eval_fraction": args.rm_eval, "max_seq_len": 1024,
                                        "log_every": args.rm_steps}}
    t0 = time.perf_counter()
    res = reward_model(model_path, rows, cfg)
    zeal_s = time.perf_counter() - t0
    gen = torch.Generator().manual_seed(args.seed)  # zeal's split and batch order (reward_model's own draws)
    order = torch.randperm(n, generator=gen).tolist()
    n_eval = int(n * args.rm_eval)
    held, train = [rows[i] for i in order[:n_eval]], [rows[i] for i in order[n_eval:]]
    it = _batches(len(train), args.rm_batch, gen)
    seq = [train[i] for _ in range(args.rm_steps) for i in next(it)]
    spec = {"job": "rm", "model": model_path, "rows": seq, "held": held, "steps": args.rm_steps,
            "batch_size": args.rm_batch, "lr": args.lr, "optimizer": args.optimizer, "grad_clip": args.grad_clip,
            "seed": args.seed}
    trl = trl_side(args.trl_python, spec, args.timeout)
    return {"zeal": [r["loss"] for r in res.metrics], "trl": trl["loss"],
            "zeal_acc": res.metrics[-1].get("accuracy"), "trl_acc": trl["accuracy"], "zeal_s": zeal_s,
            "trl_s": trl["train_s"], "held": n_eval}


REWARDS = {"exact": "arithmetic_reward", "graded": "graded_arithmetic_reward"}


def task_reward(args):
    """The task's reward function named by ``--reward`` (``zeal.rlhf.tasks``)."""
    from zeal.rlhf import tasks

    return getattr(tasks, REWARDS[args.reward])


def bench_grpo(args, model_path: str) -> dict:
    from zeal.rlhf import grpo
    from zeal.rlhf.tasks import arithmetic_rows

    rows = arithmetic_rows(args.grpo_prompts, seed=args.seed + 1)
    prompts = [r["prompt"] for r in rows]
    G, P = args.group, args.grpo_batch
    rc = {"steps": args.grpo_steps, "batch_size": P, "num_generations": G, "max_new_tokens": args.new_tokens,
          "seed": args.seed, "beta": args.grpo_beta, "clip": 0.2, "loss_type": "sequence", "log_every": 10**6,
          "temperature": 1.0}
    res = grpo(model_path, task_reward(args), prompts, {**engine_cfg(args), "rlhf": rc})
    # zeal draws its prompts with a seeded generator; TRL gets the same ones in the same order
    gen = torch.Generator().manual_seed(args.seed * 1000003)
    order = [i for _ in range(args.grpo_steps) for i in torch.randint(len(prompts), (P,), generator=gen).tolist()]
    spec = {"job": "grpo", "model": model_path, "prompts": [prompts[i] for i in order], "steps": args.grpo_steps,
            "batch_size": P, "num_generations": G, "max_new_tokens": args.new_tokens, "temperature": 1.0,
            "beta": args.grpo_beta, "clip": 0.2, "lr": args.lr, "optimizer": args.optimizer,
            "grad_clip": args.grad_clip, "seed": args.seed, "zeal_root": str(ROOT), "reward": REWARDS[args.reward]}
    trl = trl_side(args.trl_python, spec, args.timeout)
    m = res.metrics
    return {"zeal": {"step_s": [r["time_generate_s"] + r["time_train_s"] + r["time_sync_s"] for r in m],
                     "generate_s": [r["time_generate_s"] for r in m], "train_s": [r["time_train_s"] for r in m],
                     "sync_s": [r["time_sync_s"] for r in m], "reward": [r["reward"] for r in m],
                     "response_length": [r["response_length"] for r in m]},
            "trl": {"step_s": trl["step_s"], "generate_s": trl["generate_s"], "reward": trl["rewards"]},
            "samples_per_step": P * G}


def bench_ppo(args, model_path: str) -> dict:
    """PPO on both sides with the task's Python reward (``--ppo-reward task``; TRL 0.29's
    PPO takes only a reward model, so its reward-model calls are routed to the function),
    or with a reward model (``model``): SmolLM's trunk with a fresh scalar head
    (N(0, 0.02), as HF initialises one), frozen."""
    from zeal.rlhf import ppo
    from zeal.rlhf.common import load_policy
    from zeal.rlhf.tasks import arithmetic_rows
    from zeal.rlhf.value import ValueModel

    prompts = [r["prompt"] for r in arithmetic_rows(args.grpo_prompts, seed=args.seed + 1)]
    B = args.ppo_batch or args.grpo_batch * args.group
    torch.manual_seed(args.seed)
    if args.ppo_reward == "task":
        rm = task_reward(args)
    else:
        rm = ValueModel(load_policy(model_path).model)
        torch.nn.init.normal_(rm.v_head.weight, std=0.02)
    # TRL whitens the advantages of every batch
    rc = {"steps": args.ppo_steps, "batch_size": B, "max_new_tokens": args.new_tokens, "seed": args.seed,
          "log_every": 10**6, "kl_coef": 0.1, "critic_lr": args.lr, "whiten_advantages": True}
    res = ppo(model_path, rm, prompts, {**engine_cfg(args), "rlhf": rc})
    m = res.metrics
    gen = torch.Generator().manual_seed(args.seed * 1000003)
    order = [i for _ in range(args.ppo_steps) for i in torch.randint(len(prompts), (B,), generator=gen).tolist()]
    out = {"zeal": {"step_s": [r["time_generate_s"] + r["time_train_s"] + r["time_sync_s"] for r in m],
                    "generate_s": [r["time_generate_s"] for r in m], "reward": [r["reward"] for r in m]},
           "trl": None, "batch": B}
    if not Path(args.trl_ppo_path, "trl", "experimental", "ppo").is_dir():
        return out
    spec = {"job": "ppo", "model": model_path, "prompts": [prompts[i] for i in order], "steps": args.ppo_steps,
            "batch_size": B, "max_new_tokens": args.new_tokens, "lr": args.lr, "optimizer": args.optimizer,
            "grad_clip": args.grad_clip, "seed": args.seed, "zeal_root": str(ROOT),
            "reward": REWARDS[args.reward] if args.ppo_reward == "task" else None}
    out["trl"] = trl_side(args.trl_python, spec, args.timeout, pythonpath=args.trl_ppo_path)
    return out


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def reward_curves(zeal: list[float], trl: list[float], k: int, what: str) -> None:
    """Both sides' mean reward per step beside each other, then the mean of the last ``k``
    steps and zeal's over TRL's."""
    print(f"{'step':>6} {'zeal reward':>12} {'TRL reward':>12}")
    for i in range(max(len(zeal), len(trl))):
        z = f"{zeal[i]:.3f}" if i < len(zeal) else "-"
        t = f"{trl[i]:.3f}" if i < len(trl) else "-"
        print(f"{i + 1:>6} {z:>12} {t:>12}")
    zk, tk = _mean(zeal[-k:]), _mean(trl[-k:])
    ratio = f"{zk / tk:.2f}" if tk else "n/a (TRL 0)"
    print(f"{what}: first-step reward zeal {zeal[0]:.3f}, TRL {trl[0]:.3f}; mean of the last {k} steps zeal "
          f"{zk:.3f}, TRL {tk:.3f}, zeal/TRL {ratio}; all steps zeal {_mean(zeal):.3f}, TRL {_mean(trl):.3f}")


def report(dpo: dict | None, grpo: dict | None, ppo: dict | None, args, rm: dict | None = None) -> int:
    """Print the side-by-side; returns 1 when DPO's losses differ beyond the tolerance."""
    rc = 0
    if dpo is not None:
        print(f"DPO (SmolLM2-135M fp32, {args.dpo_steps} steps x {args.dpo_batch} pairs, beta {args.beta}, "
              f"{args.optimizer} lr {args.lr}; TRL {dpo['trl_version']} DPOTrainer)")
        print(f"{'step':>4} {'zeal loss':>12} {'TRL loss':>12} {'|diff|':>9} {'zeal margin':>12} {'TRL margin':>12}")
        worst = 0.0
        for i, (z, t) in enumerate(zip(dpo["zeal"], dpo["trl"]), 1):
            worst = max(worst, abs(z - t))
            print(f"{i:>4} {z:>12.6f} {t:>12.6f} {abs(z - t):>9.2e} {dpo['zeal_margin'][i - 1]:>12.6f} "
                  f"{dpo['trl_margin'][i - 1]:>12.6f}")
        ok = len(dpo["zeal"]) == len(dpo["trl"]) and worst <= args.dpo_tol
        print(f"max |diff| {worst:.2e} (tolerance {args.dpo_tol:g}): {'OK' if ok else 'FAIL'}; wall zeal "
              f"{dpo['zeal_s']:.1f} s, TRL {dpo['trl_s']:.1f} s (TRL/zeal {dpo['trl_s'] / dpo['zeal_s']:.2f}x)")
        rc |= 0 if ok else 1
    if rm is not None:
        print(f"\nReward model (SmolLM2-135M fp32, {args.rm_steps} steps x {args.rm_batch} pairs, {rm['held']} held-out "
              f"pairs; zeal: DeepSpeed-Chat token-wise loss, zero head; TRL RewardTrainer: last-token loss)")
        print(f"{'step':>4} {'zeal loss':>10} {'TRL loss':>10}")
        for i, (z, t) in enumerate(zip(rm["zeal"], rm["trl"]), 1):
            print(f"{i:>4} {z:>10.4f} {t:>10.4f}")
        print(f"held-out accuracy zeal {rm['zeal_acc']:.3f}, TRL {rm['trl_acc']:.3f}; wall zeal {rm['zeal_s']:.1f} s "
              f"(with loading), TRL {rm['trl_s']:.1f} s (training only) (TRL/zeal {rm['trl_s'] / rm['zeal_s']:.2f}x)")
    if grpo is not None:
        z, t, n = grpo["zeal"], grpo["trl"], grpo["samples_per_step"]
        # the first step of each side carries one-off start-up work: report the rest when there is a rest
        skip = 1 if len(z["step_s"]) > 1 and len(t["step_s"]) > 1 else 0
        zs, ts = _mean(z["step_s"][skip:]), _mean(t["step_s"][skip:])
        zg, tg = _mean(z["generate_s"][skip:]), _mean(t["generate_s"][skip:])
        zt, zy = _mean(z["train_s"][skip:]), _mean(z["sync_s"][skip:])
        print(f"\nGRPO ({args.grpo_steps} steps x {args.grpo_batch} prompts x G={args.group}, {args.new_tokens} "
              f"new tokens; mean over steps {skip + 1}..{args.grpo_steps})")
        print(f"{'':>22} {'zeal':>10} {'TRL':>10} {'zeal/TRL':>9}")
        print(f"{'samples/s':>22} {n / zs:>10.2f} {n / ts:>10.2f} {ts / zs:>8.2f}x")
        print(f"{'step s':>22} {zs:>10.2f} {ts:>10.2f}")
        print(f"{'  generation s':>22} {zg:>10.2f} {tg:>10.2f} {zg / tg:>9.2f}")
        print(f"{'  training s':>22} {zt:>10.2f} {ts - tg:>10.2f} {zt / (ts - tg):>9.2f}")
        print(f"{'  sync s':>22} {zy:>10.4f} {0.0:>10.4f}")
        print(f"{'generation share':>22} {zg / zs:>10.0%} {tg / ts:>10.0%}")
        print(f"\nGRPO reward ({args.reward} arithmetic reward, same prompts, seeds and hyper-parameters)")
        reward_curves(z["reward"], t["reward"], args.last_k, "GRPO")
    if ppo is not None:
        z, t = ppo["zeal"], ppo["trl"]
        skip = 1 if len(z["step_s"]) > 1 else 0
        scorer = (f"the {args.reward} arithmetic reward (Python) on both sides" if args.ppo_reward == "task"
                  else "reward model = SmolLM + random scalar head")
        print(f"\nPPO ({args.ppo_steps} iterations x {ppo['batch']} prompts, {args.new_tokens} new tokens, 1 PPO "
              f"epoch, {scorer}; mean over iterations {skip + 1}..)")
        if t is None:
            print(f"zeal {_mean(z['step_s'][skip:]):.2f} s per iteration (generation {_mean(z['generate_s'][skip:]):.2f}"
                  f" s); TRL: no PPO in TRL >= 1.0, and no TRL 0.29 under --trl-ppo-path: not measured")
        else:
            zs, ts = _mean(z["step_s"][skip:]), _mean(t["step_s"][skip:])
            zg, tg = _mean(z["generate_s"][skip:]), _mean(t["generate_s"][skip:])
            print(f"{'':>22} {'zeal':>10} {'TRL 0.29':>10} {'TRL/zeal':>9}")
            print(f"{'s per iteration':>22} {zs:>10.2f} {ts:>10.2f} {ts / zs:>8.2f}x")
            print(f"{'  generation s':>22} {zg:>10.2f} {tg:>10.2f} {tg / zg:>8.2f}x")
            reward_curves(z["reward"], t["reward"], args.last_k, "PPO")
    return rc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trl-python", default="/work/peers/trl/bin/python")
    ap.add_argument("--trl-ppo-path", default="/work/peers/trl_ppo",
                    help="a folder holding TRL 0.29 (pip install --no-deps --target it trl==0.29.1), the last "
                    "release with PPO, put first on the TRL side's PYTHONPATH")
    ap.add_argument("--jobs", default="dpo,rm,grpo,ppo", help="comma-separated: dpo, rm, grpo, ppo")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--optimizer", default="AdamW", choices=["AdamW", "SGD"])
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--zero-stage", type=int, default=0)
    ap.add_argument("--beta", type=float, default=0.1, help="DPO beta")
    ap.add_argument("--dpo-steps", type=int, default=5)
    ap.add_argument("--dpo-batch", type=int, default=4)
    ap.add_argument("--dpo-tol", type=float, default=1e-4)
    ap.add_argument("--rm-steps", type=int, default=8)
    ap.add_argument("--rm-batch", type=int, default=4, help="pairs per step")
    ap.add_argument("--rm-pairs", type=int, default=40)
    ap.add_argument("--rm-eval", type=float, default=0.2, help="share of the pairs held out")
    ap.add_argument("--grpo-steps", type=int, default=3)
    ap.add_argument("--grpo-batch", type=int, default=2, help="prompts per step")
    ap.add_argument("--group", type=int, default=4, help="G: answers per prompt")
    ap.add_argument("--grpo-prompts", type=int, default=32)
    ap.add_argument("--grpo-beta", type=float, default=0.04)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--ppo-steps", type=int, default=3)
    ap.add_argument("--ppo-batch", type=int, default=0, help="PPO prompts per iteration (0: grpo-batch x group)")
    ap.add_argument("--ppo-reward", default="task", choices=["task", "model"],
                    help="PPO's scorer: the task's Python reward (--reward) or SmolLM with a random scalar head")
    ap.add_argument("--reward", default="graded", choices=sorted(REWARDS),
                    help="GRPO/PPO task reward: graded (partial credit) or exact (the right first integer)")
    ap.add_argument("--last-k", type=int, default=5, help="reward compared over the last k steps")
    ap.add_argument("--json", help="also write the raw figures to this file")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds for each TRL run")
    args = ap.parse_args()
    from zeal.models.hf import default_model_path

    model_path = str(default_model_path())
    jobs = set(args.jobs.split(","))
    results = {}
    for name, fn in (("dpo", bench_dpo), ("rm", bench_rm), ("grpo", bench_grpo), ("ppo", bench_ppo)):
        if name in jobs:
            try:
                results[name] = fn(args, model_path)
            except (RuntimeError, subprocess.TimeoutExpired) as e:  # one side failing does not lose the others
                print(f"{name}: {e}", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(results))
    return report(results.get("dpo"), results.get("grpo"), results.get("ppo"), args, results.get("rm"))


if __name__ == "__main__":
    sys.exit(main())
