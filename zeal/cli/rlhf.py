"""`zeal rlhf sft|rm|ppo|dpo|grpo`: DeepSpeed-Chat's three steps (SFT → reward model → PPO),
DPO and GRPO, on one process or on ``--nproc`` data-parallel ranks (started as ``zeal train`` starts them).

With no arguments each job runs on the embedded SmolLM2-135M-Instruct and the built-in
offline task (short arithmetic: a programmatic reward for PPO/GRPO, right-before-wrong
preference pairs for RM/DPO, right answers for SFT), with no download. ``--data`` is a
JSONL file: ``messages`` rows (SFT), ``prompt``/``chosen``/``rejected`` (RM, DPO),
``prompt`` rows (PPO, GRPO; an ``answer`` key is checked by the arithmetic reward, or
``--reward module:function`` names your own). ``--config`` is a DeepSpeed JSON for the
engine with an ``rlhf`` section (see ``zeal.rlhf.RLHFConfig``). The run folder gets
``metrics.csv``/``metrics.jsonl``, ``reward_kl.png`` (with matplotlib), ``checkpoints/``
(resumed when present) and the trained model as a Hugging Face folder in ``model/``
(``value_model.safetensors`` for RM), so that steps chain: ``zeal rlhf sft``, ``zeal rlhf rm``,
then ``zeal rlhf ppo --model runs/rlhf-sft/model --reward-model runs/rlhf-rm``.
"""

from __future__ import annotations

import argparse
import importlib
import shutil
from pathlib import Path

JOBS = ("sft", "rm", "ppo", "dpo", "grpo")
DEFAULT_STEPS = {"sft": 20, "rm": 20, "dpo": 20, "ppo": 10, "grpo": 10}
KEYS = {"sft": ("messages",), "rm": ("prompt", "chosen", "rejected"), "dpo": ("prompt", "chosen", "rejected"),
        "ppo": ("prompt",), "grpo": ("prompt",)}


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``zeal rlhf``."""
    p = subparsers.add_parser("rlhf", help="SFT, reward model, PPO, DPO and GRPO with the hybrid engine",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                              allow_abbrev=False)
    p.add_argument("job", choices=JOBS, help="which step to run")
    p.add_argument("--model", default=None, help="Hugging Face folder or .gguf (default: SmolLM2-135M-Instruct)")
    p.add_argument("--data", default=None, help="JSONL data (default: the built-in arithmetic task)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps / rollouts (default: a short run)")
    p.add_argument("--out", default=None, help="run folder (default: runs/rlhf-<job>)")
    p.add_argument("--config", default=None, help="DeepSpeed JSON with an 'rlhf' section")
    p.add_argument("--reward", default=None, metavar="MODULE:FUNCTION",
                   help="PPO/GRPO reward function fn(prompts, completions, **kw) (default: the arithmetic check)")
    p.add_argument("--reward-model", default=None, metavar="DIR",
                   help="PPO: a 'zeal rlhf rm' run folder whose reward model scores the answers")
    p.add_argument("--generation-dtype", default=None, choices=["auto", "fp32", "bf16"],
                   help="PPO/GRPO: dtype of the hybrid engine's serving copy (rlhf.generation_dtype; default auto)")
    p.add_argument("--loss-type", default=None,
                   choices=["grpo", "bnpo", "dr_grpo", "dapo", "gspo", "cispo", "sequence", "token"],
                   help="GRPO: the loss family member (rlhf.loss_type; default grpo; see zeal.rlhf.grpo_losses)")
    p.add_argument("--async-rollouts", type=int, default=None, metavar="K",
                   help="GRPO: generate up to K batches ahead while the trainer updates (rlhf.async_rollouts; 0: sync)")
    p.add_argument("--tools", default=None, metavar="NAME,...",
                   help="GRPO: built-in tools (calculator, retrieval); each answer becomes a multi-turn episode "
                        "with tool calls, tool outputs masked out of the loss (rlhf.tools)")
    p.add_argument("--retrieval-file", default=None, metavar="FILE",
                   help="GRPO: the text file the retrieval tool searches (rlhf.retrieval_file)")
    p.add_argument("--verifiers", default=None, metavar="NAME,...",
                   help="GRPO: verifiable rewards added (math, code) (rlhf.verifiers); rows' answer/tests fields")
    p.add_argument("--zero-stage", type=int, default=None, choices=[0, 1, 2, 3],
                   help="ZeRO stage of the engine(s) (zero_optimization.stage; default: the config's, else 0)")
    p.add_argument("--lora", nargs="?", const="", metavar="K=V,...",
                   help="train LoRA adapters (as zeal train --lora); the reference is the base with adapters "
                        "off; the run folder gets adapter/ (PEFT) and model/ (merged)")
    p.add_argument("--nproc", type=int, default=1,
                   help="processes (data-parallel ranks, started as 'zeal train' starts them); "
                        "rlhf.batch_size is per rank, rank 0 writes the run folder")
    from zeal.cli.config_flags import add_flags
    from zeal.config.rlhf import RLHFConfig

    add_flags(p, RLHFConfig, dest_prefix="rlhf.", keep_existing=True)  # one per rlhf field (spellings above kept)
    return p


# the options a launched rank gets again, as given (--nproc is the launcher's own)
_FORWARDED = ("model", "data", "steps", "out", "config", "reward", "reward_model", "generation_dtype", "zero_stage",
              "lora", "loss_type", "async_rollouts", "tools", "retrieval_file", "verifiers")


def _rank_argv(args: argparse.Namespace, out: Path) -> list[str]:
    argv = ["zeal.cli.main", "rlhf", args.job]
    for name in _FORWARDED:
        value = str(out) if name == "out" else getattr(args, name)
        if value is not None:
            flag = f"--{name.replace('_', '-')}"
            argv += [f"{flag}={value}"] if name == "lora" else [flag, str(value)]  # --lora's value may be empty
    from zeal.cli.config_flags import argv_of
    from zeal.config.rlhf import RLHFConfig

    return argv + argv_of(args, RLHFConfig, dest_prefix="rlhf.")


def _launch(args: argparse.Namespace, out: Path) -> int:
    """Run the job on ``args.nproc`` ranks (:func:`zeal.dist.launch.launch_ranks`, as
    ``zeal train``); a failing rank records its error under ``<out>/logs``, the first is printed."""
    from zeal.dist.launch import launch_ranks

    rc = launch_ranks(_rank_argv(args, out), args.nproc, prog=f"zeal rlhf {args.job}", log_dir=out / "logs")
    if rc != 0:
        raise SystemExit(rc)
    return 0


def import_reward(spec: str):
    """The function ``--reward MODULE:FUNCTION`` names; a one-line ValueError when the
    module cannot be imported or has no such callable."""
    mod, _, fn = spec.partition(":")
    if not mod or not fn:
        raise ValueError(f"--reward {spec!r}: expected MODULE:FUNCTION")
    try:
        module = importlib.import_module(mod)
    except Exception as e:  # noqa: BLE001 - an import error of the user's module: one line
        raise ValueError(f"--reward {spec}: cannot import module {mod!r} ({type(e).__name__}: {e})") from None
    f = getattr(module, fn, None)
    if not callable(f):
        raise ValueError(f"--reward {spec}: module {mod!r} has no function {fn!r}")
    return f


def _reward_fn(spec: str | None, rows: list[dict]):
    from zeal.rlhf.tasks import arithmetic_reward

    if spec:
        return import_reward(spec)
    answers = {r["prompt"]: r["answer"] for r in rows if "answer" in r and isinstance(r["prompt"], str)}

    def reward(prompts, completions, **kw):
        return arithmetic_reward([{"prompt": p, "answer": answers[p]} if p in answers else p for p in prompts],
                                 completions, **kw)

    return reward


def _load_reward_model(run_dir: str, policy_path: str | None):
    """The ValueModel of a ``zeal rlhf rm`` run (its base architecture from ``model/``)."""
    import json

    from safetensors.torch import load_file

    from zeal.inference.llm import load_model_and_tokenizer
    from zeal.rlhf.value import ValueModel

    d = Path(run_dir)
    weights = d / "value_model.safetensors"
    if not weights.is_file():
        raise FileNotFoundError(f"--reward-model {d}: no value_model.safetensors (a 'zeal rlhf rm' run folder)")
    meta = d / "reward_model.json"
    base = json.loads(meta.read_text()).get("base") if meta.is_file() else policy_path
    lm, _, _ = load_model_and_tokenizer(base)
    vm = ValueModel(lm)
    missing, unexpected = vm.load_state_dict(load_file(str(weights)), strict=False)
    if unexpected or [k for k in missing if not k.endswith("lm_head.weight")]:
        raise ValueError(f"--reward-model {d}: weights do not fit the model (missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]})")
    return vm.eval()


def _export(result, out: Path, model_path: str | None, job: str) -> None:
    """The trained weights as a Hugging Face folder (``model/``), with the tokenizer files."""
    import json

    from zeal.inference.llm import resolve_model_path

    engine = result.engine
    if job == "rm":  # the scalar head and its trunk; the architecture is the base model's
        with engine.gathered_parameters():
            if engine.rank == 0:
                result.extra["value_model"].save(out / "value_model.safetensors")
                (out / "reward_model.json").write_text(json.dumps({"base": model_path}))
        return
    if getattr(engine, "lora", None) is not None:  # LoRA: adapter/ (PEFT) and the merged model/
        from zeal.rlhf.adapters import export_lora

        export_lora(engine, out)
    else:
        with engine.gathered_parameters():
            if engine.rank == 0 and hasattr(engine.module, "save_hf_folder"):
                engine.module.save_hf_folder(out / "model")
    if engine.rank == 0 and (out / "model").is_dir():
        src = resolve_model_path(model_path)
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
            if (src / name).exists():
                shutil.copy(src / name, out / "model" / name)


def run(args: argparse.Namespace) -> int:
    """Run one RLHF job (on ``--nproc`` ranks) and print where its results are."""
    import os

    def in_distributed_env() -> bool:  # inside a torchrun-started rank
        return "RANK" in os.environ and "WORLD_SIZE" in os.environ

    if args.nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {args.nproc}")
    rlhf_flags(args)  # a refused value: one line, before any rank starts
    out = Path(args.out or f"runs/rlhf-{args.job}")
    if args.nproc > 1 and not in_distributed_env():
        check_inputs(args)  # one line here rather than from every rank
        return _launch(args, out)
    if not in_distributed_env():
        return _run_job(args, out)
    from zeal.dist.launch import run_rank

    return run_rank(lambda: _run_job(args, out), out / "logs")  # a launched rank: the launcher prints its error


def check_inputs(args: argparse.Namespace) -> list[dict] | None:
    """What a job reads besides the model, checked before a model is loaded or ``--out``
    touched: ``--reward`` imports, ``--reward-model`` is a reward-model folder, and every
    row of ``--data`` has the keys and types of the job (its rows; None without ``--data``)."""
    from zeal.rlhf.data import read_jsonl

    job = args.job
    if args.reward and job in ("ppo", "grpo"):
        import_reward(args.reward)
    if args.reward_model and job == "ppo" and not (Path(args.reward_model) / "value_model.safetensors").is_file():
        raise FileNotFoundError(f"--reward-model {args.reward_model}: no value_model.safetensors "
                                "(a 'zeal rlhf rm' run folder)")
    if not args.data:
        return None
    default_reward = job in ("ppo", "grpo") and not args.reward and not args.reward_model
    return read_jsonl(args.data, KEYS[job], answer=default_reward)


def rlhf_flags(args: argparse.Namespace, rc=None):
    """``rc`` (default: the section's defaults) with the ``rlhf`` flags given over it (one flag
    per :class:`~zeal.config.rlhf.RLHFConfig` field, derived by :mod:`zeal.cli.config_flags`);
    a refused value is a one-line ValueError naming ``rlhf.<field>``."""
    from pydantic import ValidationError

    from zeal.cli.config_flags import tree_from_args
    from zeal.config import format_validation_error
    from zeal.config.rlhf import RLHFConfig

    rc = rc if rc is not None else RLHFConfig()
    given = tree_from_args(args, RLHFConfig, dest_prefix="rlhf.")
    try:
        return RLHFConfig.model_validate({**rc.model_dump(), **given}) if given else rc
    except ValidationError as e:
        raise ValueError(format_validation_error(e).replace("config key '", "config key 'rlhf.")) from None


def _task_flags(args: argparse.Namespace, rc) -> None:
    """``--tools``, ``--retrieval-file``, ``--verifiers`` into ``rc``, checked (tool names,
    the retrieval file, ``rlhf.reward_funcs`` imports) before any model is loaded."""
    from zeal.rlhf.tools import select_tools
    from zeal.rlhf.verifiers import config_rewards

    for name in ("tools", "verifiers"):
        value = getattr(args, name, None)
        if value is not None:
            setattr(rc, name, [v.strip() for v in value.split(",") if v.strip()])
    if getattr(args, "retrieval_file", None) is not None:
        rc.retrieval_file = args.retrieval_file
    if rc.tools or rc.verifiers or rc.reward_funcs:
        if args.job != "grpo":
            raise ValueError(f"zeal rlhf {args.job}: tools, verifiers and reward_funcs are GRPO's (zeal rlhf grpo)")
        select_tools(list(rc.tools), rc.retrieval_file)
        config_rewards(None, rc)


def _run_job(args: argparse.Namespace, out: Path) -> int:
    import zeal.rlhf as rl
    from zeal.rlhf.config import split_config
    from zeal.rlhf.tasks import arithmetic_reward, arithmetic_rows

    job = args.job
    if args.steps is not None and args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")
    engine_cfg, rc = split_config(args.config, {"steps": args.steps or DEFAULT_STEPS[job]})
    if args.steps is not None:
        rc.steps = args.steps
    if args.generation_dtype is not None:
        rc.generation_dtype = args.generation_dtype
    if args.loss_type is not None:
        rc.loss_type = args.loss_type
    if args.async_rollouts is not None:
        if args.async_rollouts < 0:
            raise ValueError(f"--async-rollouts must be >= 0, got {args.async_rollouts}")
        rc.async_rollouts = args.async_rollouts
    _task_flags(args, rc)
    rc = rlhf_flags(args, rc)
    if args.zero_stage is not None:
        engine_cfg["zero_optimization"] = {**engine_cfg.get("zero_optimization", {}), "stage": args.zero_stage}
    if getattr(args, "lora", None) is not None:
        from zeal.cli.lora_flag import parse_lora_flag

        if job == "rm":
            raise ValueError("zeal rlhf rm --lora is not supported: the reward model's value head must train whole")

        engine_cfg["lora"] = {**(engine_cfg.get("lora") or {}), **parse_lora_flag(args.lora)}
    rows = check_inputs(args) or arithmetic_rows(64, rc.seed)
    config = {**engine_cfg, "rlhf": rc.model_dump()}
    model = args.model
    if job == "sft":
        res = rl.sft(model, rows, config, out=str(out))
    elif job == "rm":
        res = rl.reward_model(model, rows, config, out=str(out))
    elif job == "dpo":
        res = rl.dpo(model, rows, config, out=str(out))
    elif job == "grpo" and (rc.tools or rc.verifiers):  # rows go whole: the tools' episodes and verifiers read them
        reward = import_reward(args.reward) if args.reward else None if rc.verifiers else arithmetic_reward
        res = rl.grpo(model, reward, rows, config, out=str(out))
    elif job == "grpo":
        res = rl.grpo(model, _reward_fn(args.reward, rows), [r["prompt"] for r in rows], config, out=str(out))
    else:
        reward = _load_reward_model(args.reward_model, model) if args.reward_model else _reward_fn(args.reward, rows)
        res = rl.ppo(model, reward, [r["prompt"] for r in rows], config, out=str(out))
    _export(res, out, model, job)
    if res.engine.rank != 0:
        return 0
    last = res.metrics[-1] if res.metrics else {}
    shown = ", ".join(f"{k} {last[k]:.4g}" for k in ("loss", "reward", "kl", "accuracy") if last.get(k) is not None)
    print(f"zeal rlhf {job}: {len(res.metrics)} step(s) in {out} ({shown}); metrics.csv, checkpoints/, "
          f"{'value_model.safetensors' if job == 'rm' else 'model/'}")
    return 0
