"""Data efficiency on the stdlib corpus: baseline vs curriculum (seqlen, voc), random-LTD, both.

Every variant trains the same small GPT with the same seed, hyper-parameters and token
budget (token-based LR: warm-up and cosine decay over the budget, stop at
``train_tokens``) through ``zeal.train.job.run_job`` (one process), evaluating held-out
loss on the same held-out blocks every ``--eval-interval`` steps. Printed per variant:
final held-out loss, the consumed tokens and wall time at which it first reached the
baseline's final held-out loss (linear interpolation between evaluations), and those as
ratios to the baseline's, and the layer-tokens (tokens × layers each token ran through: the
compute, free of the machine's noise) at that point; the curves (held-out loss against
consumed tokens) go to one PNG. ``--seed`` repeats the whole comparison on another split,
order and initialisation.

    flock /tmp/zeal-heavy.lock python bench/data_efficiency/bench_data_efficiency.py --steps 300
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from zeal.config.job import JobSpec, merge_engine_config
from zeal.train.metrics import read_metrics


def variants(steps: int, seq: int, layers: int) -> dict[str, dict]:
    """Engine-config additions per variant (curricula end at 40 % of the steps, LTD at 60 %)."""
    cl_steps, ltd_steps = max(1, int(0.4 * steps)), max(1, int(0.6 * steps))
    seqlen = {"curriculum_learning": {"enabled": True, "curriculum_type": "seqlen", "min_difficulty": 16,
                                      "max_difficulty": seq, "schedule_type": "fixed_linear",
                                      "schedule_config": {"total_curriculum_step": cl_steps, "difficulty_step": 8}}}
    voc = {"voc": {"difficulty_type": "percentile", "min_difficulty": 10, "max_difficulty": 100,
                   "schedule_type": "fixed_root", "schedule_config": {
                       "total_curriculum_step": cl_steps, "difficulty_step": 1, "root_degree": 2}}}
    ltd = {"enabled": True, "random_ltd_layer_id": list(range(1, layers - 1)), "random_ltd_schedule": {
        "min_value": seq // 4, "max_value": seq, "schedule_config": {"require_steps": ltd_steps, "seq_per_step": 8}}}
    de_voc = {"data_efficiency": {"enabled": True, "data_sampling": {"curriculum_learning": {
        "enabled": True, "curriculum_metrics": voc}}}}
    de_ltd = {"data_efficiency": {"enabled": True, "data_routing": {"random_ltd": ltd}}}
    return {"baseline": {}, "seqlen": seqlen, "voc": de_voc, "random_ltd": de_ltd, "seqlen+random_ltd": {**seqlen,
                                                                                                       **de_ltd}}


def run_variant(name: str, extra: dict, args: argparse.Namespace, root: Path) -> list[dict]:
    from zeal.train.job import run_job

    budget = args.steps * args.micro * args.seq
    job = {"hf_model": "gpt", "steps": 10 * args.steps, "nproc": 1, "run_dir": str(root / name), "eval_batches": args.eval_batches,
           "eval_interval": args.eval_interval, "save_interval": 0, "checkpoint": False, "sample_tokens": 0,
           "report_to": "none", "precision": "fp32", "lr": args.lr, "lr_warmup_tokens": budget // 20,
           "lr_decay_tokens": budget, "min_lr": args.lr / 10, "train_tokens": budget, "log_interval": 10**6}
    engine = {"train_micro_batch_size_per_gpu": args.micro, "zero_optimization": {"stage": 0}, "seed": args.seed,
              **extra}
    spec = JobSpec(model={"n_layer": args.layers, "n_embd": args.n_embd, "n_head": args.n_head},
                   data={"seq_len": args.seq, "max_bytes": args.max_bytes, "seed": args.seed}, job=job)
    spec = spec.model_copy(update={"engine": merge_engine_config(spec.job, engine)})
    run_job(spec)
    return read_metrics(root / name / "metrics.jsonl")


def first_reach(curve: list[tuple[float, float, float, float]], target: float) -> tuple[float, float, float] | None:
    """(tokens, seconds, layer-tokens) at which held-out loss first reaches ``target``,
    interpolated linearly between evaluations."""
    for (t0, s0, l0, k0), (t1, s1, l1, k1) in zip(curve, curve[1:]):
        if l1 <= target:
            f = 1.0 if l0 == l1 else min(1.0, max(0.0, (l0 - target) / (l0 - l1)))
            return t0 + f * (t1 - t0), s0 + f * (s1 - s0), k0 + f * (k1 - k0)
    return None


def held_out_curve(records: list[dict], layers: int) -> list[tuple[float, float, float, float]]:
    """(tokens, train seconds, held-out loss, layer-tokens) of every evaluation; without
    random-LTD every token runs through all ``layers``."""
    secs, layer_tokens, out = 0.0, None, []
    for r in records:
        if r.get("kind") == "train":
            secs = r.get("elapsed_s") or secs
            layer_tokens = r.get("layer_tokens", layer_tokens)
        elif r.get("kind") == "eval":
            tokens = float(r.get("tokens") or 0)
            out.append((tokens, secs, float(r["loss"]), tokens * layers if layer_tokens is None else layer_tokens))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=300, help="baseline steps (the token budget = steps·micro·seq)")
    p.add_argument("--micro", type=int, default=16)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--seed", type=int, default=1234, help="the job's seed (split, batch order, initialisation)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--max-bytes", type=int, default=4_000_000)
    p.add_argument("--eval-interval", type=int, default=25)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--only", default=None, help="comma-separated variants")
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    p.add_argument("--tag", default="", help="suffix of the result files (data_efficiency_<tag>.json/png)")
    p.add_argument("--runs", default=None, help="keep the run folders here (default: a temporary folder)")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    todo = variants(args.steps, args.seq, args.layers)
    if args.only:
        todo = {k: v for k, v in todo.items() if k in args.only.split(",") or k == "baseline"}
    curves = {}
    with tempfile.TemporaryDirectory() as tmp:
        runs = Path(args.runs) if args.runs else Path(tmp)
        for name, extra in todo.items():
            curves[name] = held_out_curve(run_variant(name, extra, args, runs), args.layers)
    base_final = curves["baseline"][-1][2]
    base_tokens, base_secs, base_lt = first_reach(curves["baseline"], base_final) or (
        curves["baseline"][-1][0], curves["baseline"][-1][1], curves["baseline"][-1][3])
    rows = []
    print(f"\nbudget {args.steps * args.micro * args.seq} tokens, seed {args.seed}; baseline final held-out loss "
          f"{base_final:.4f}")
    print(f"{'variant':<20} {'final loss':>10} {'tokens to base':>15} {'ratio':>6} {'layer-tok ratio':>15} "
          f"{'wall to base':>12} {'ratio':>6}")
    for name, c in curves.items():
        hit = first_reach(c, base_final)
        tok, sec, lt = hit if hit else (float("nan"),) * 3
        row = {"variant": name, "final_heldout_loss": c[-1][2], "tokens_to_baseline": tok, "seconds_to_baseline": sec,
               "token_ratio": tok / base_tokens, "layer_token_ratio": lt / base_lt, "time_ratio": sec / base_secs,
               "curve": c}
        rows.append(row)
        print(f"{name:<20} {c[-1][2]:>10.4f} {tok:>15.0f} {tok / base_tokens:>6.2f} {lt / base_lt:>15.2f} "
              f"{sec:>11.1f}s {sec / base_secs:>6.2f}")
    stem = f"data_efficiency_{args.tag}" if args.tag else "data_efficiency"
    (out / f"{stem}.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1) + "\n")
    _plot(curves, out / f"{stem}.png")


def _plot(curves: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no PNG: matplotlib is not installed")
        return
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    for name, c in curves.items():
        ax.plot([t for t, _, _, _ in c], [loss for _, _, loss, _ in c], "o-", ms=3, label=name)
    ax.set_xlabel("consumed tokens")
    ax.set_ylabel("held-out loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
