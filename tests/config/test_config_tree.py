"""The one configuration tree: every field described, unknown keys refused, and
``zeal serve``'s flags derived from the ``inference`` section (one default each)."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, ValidationError

from zeal.config import Config, InferenceConfig, JobSpec, ProcessConfig, RLHFConfig
from zeal.config.inference import EngineConfig, ServerLimits

pytestmark = pytest.mark.timeout(60)
ROOTS = (Config, JobSpec, InferenceConfig, RLHFConfig)


def _sections(model: type[BaseModel], seen: set | None = None):
    seen = set() if seen is None else seen
    if model in seen:
        return
    seen.add(model)
    yield model
    for info in model.model_fields.values():
        for t in (info.annotation, *getattr(info.annotation, "__args__", ())):
            if isinstance(t, type) and issubclass(t, BaseModel):
                yield from _sections(t, seen)


@pytest.mark.parametrize("root", ROOTS, ids=lambda r: r.__name__)
def test_every_field_is_described_and_unknown_keys_are_refused(root):
    for section in _sections(root):
        assert section.model_config.get("extra") == "forbid", section.__name__
        missing = [n for n, f in section.model_fields.items() if not f.description]
        assert not missing, f"{section.__name__}: no description on {missing}"


def test_job_and_inference_share_the_process_section():
    assert JobSpec.model_fields["process"].annotation is ProcessConfig
    assert InferenceConfig.model_fields["process"].annotation is ProcessConfig
    assert ProcessConfig().transparent_hugepages  # `zeal train` and `zeal serve` keep huge pages on
    with pytest.raises(ValidationError, match="num_thread"):
        JobSpec.model_validate({"process": {"num_thread": 2}})
    with pytest.raises(ValidationError):
        InferenceConfig.model_validate({"engine": {"max_num_seqs": 0}})


def _serve_args(argv: list[str]):
    from zeal.cli.main import build_parser
    from zeal.cli.serve import config_from_args

    parser, _ = build_parser("serve")
    return config_from_args(parser.parse_args(["serve", *argv]))


def test_serve_flags_come_from_the_inference_section(capsys):
    from zeal.cli.main import main
    from zeal.cli.serve import _leaves

    assert _serve_args([]) == InferenceConfig()  # no flag: the section's defaults, stated once
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = capsys.readouterr().out
    flags = ["--host", "--port", "--api-key", "--served-model-name", "--dtype", "--device", "--block-size",
             "--num-blocks", "--kv-cache-mb", "--max-num-batched-tokens", "--max-num-seqs", "--max-model-len",
             "--max-waiting", "--no-prefix-caching", "--threads", "--log-level", "--no-transparent-hugepages",
             "--speculative-config", "--weights-offload", "--max-resident-weights-gb", "--offload-dir",
             "--weights-offload-quant", "--quantized-matmul",
             "--tensor-parallel-size", "--no-engine-process", "--no-disable-additional-properties"]
    flags += ["--enable-lora", "--lora-modules", "--max-loras", "--max-lora-rank", "--allow-runtime-lora-updating"]
    flags += ["--gpu-memory-utilization", "--enforce-eager"]  # CUDA serving (gpu_defaults, cuda_graphs)
    flags += ["--async-scheduling", "--compilation-config"]  # step overlap, compiled decode (issue 37)
    for flag in flags:
        assert flag in out, flag
    limit_flags = ["--max-body-bytes", "--max-n", "--max-prompts", "--body-read-timeout-s", "--header-read-timeout-s",
                   "--keep-alive-timeout-s", "--max-connections", "--max-idle-connections", "--max-request-seqs",
                   "--max-request-tokens"]
    for flag in limit_flags:
        assert flag in out, flag
    assert len([p for p, _ in _leaves(InferenceConfig)]) == len(flags) + len(limit_flags) + 1 + 1  # + model, malloc
    assert "(default: 512)" in out and "(default: 8000)" in out
    cfg = _serve_args(["m", "--kv-cache-mb", "64", "--no-prefix-caching", "--threads", "3", "--port", "9",
                       "--dtype", "bf16", "--max-waiting", "5", "--max-n", "2", "--body-read-timeout-s", "2.5"])
    assert cfg.model == "m" and cfg.dtype == "bf16" and cfg.server.port == 9 and cfg.server.max_waiting == 5
    assert cfg.engine == EngineConfig(kv_cache_bytes=64 << 20, enable_prefix_caching=False)
    assert cfg.process.num_threads == 3 and cfg.server.limits == ServerLimits(max_n=2, body_read_timeout_s=2.5)


def test_bad_serve_values_name_the_key():
    with pytest.raises(ValueError, match="engine.max_num_seqs"):
        _serve_args(["--max-num-seqs", "0"])


def test_the_rlhf_section_is_in_the_tree():
    from zeal.rlhf.config import RLHFConfig as where_it_lived

    assert where_it_lived is RLHFConfig and RLHFConfig.__module__ == "zeal.config.rlhf"


def test_rlhf_flags_come_from_the_rlhf_section(capsys):
    """One `zeal rlhf` flag per RLHFConfig field (name, type, choices, default and help from
    the field); the four older flags keep their spelling; given flags reach the ranks."""
    from zeal.cli.config_flags import argv_of, flag_of, leaves
    from zeal.cli.main import build_parser, main
    from zeal.cli.rlhf import rlhf_flags

    parser, _ = build_parser("rlhf")
    argv = ["rlhf", "grpo", "--beta", "0", "--no-scale-rewards", "--top-p", "0.9", "--loss-type", "dapo",
            "--generation-dtype", "fp32", "--async-rollouts", "1", "--steps", "3"]
    args = parser.parse_args(argv)
    assert rlhf_flags(args) == RLHFConfig(beta=0.0, scale_rewards=False, top_p=0.9)
    assert (args.loss_type, args.generation_dtype, args.async_rollouts, args.steps) == ("dapo", "fp32", 1, 3)
    assert rlhf_flags(parser.parse_args(["rlhf", "sft"])) == RLHFConfig()  # no flag: the section's defaults
    assert argv_of(args, RLHFConfig, dest_prefix="rlhf.") == ["--top-p", "0.9", "--beta", "0.0",
                                                             "--no-scale-rewards"]
    with pytest.raises(ValueError, match="config key 'rlhf.beta': Input should be greater than or equal to 0"):
        rlhf_flags(parser.parse_args(["rlhf", "grpo", "--beta", "-1"]))
    with pytest.raises(SystemExit):
        main(["rlhf", "--help"])
    out = capsys.readouterr().out
    missing = [flag_of(p, info)[0] for p, info in leaves(RLHFConfig) if flag_of(p, info)[0] not in out]
    assert not missing, missing
    assert "--kl-coef" in out and "(default: 0.1)" in out and "--no-share-prompt" in out


def test_train_section_flags_come_from_the_job_tree(capsys, tmp_path):
    """`zeal train` has one --section.leaf flag per leaf of the job's model/data/job/process
    sections (typed as dotted overrides are, help and default from the field); the named
    flags keep working and win below them, as before."""
    from zeal.cli.config_flags import leaves
    from zeal.cli.main import build_parser, main
    from zeal.cli.train import JOB_SECTIONS, build_spec

    parser, _ = build_parser("train")
    args, extra = parser.parse_known_args(["train", "--model", "gpt", "--steps", "7", "--model.n_layer", "3",
                                           "--job.checkpoint", "false", "--job.eval-interval", "5",
                                           "--process.num_threads", "2",
                                           "--job.steps", "9", "--run-dir", str(tmp_path / "r")])
    assert extra == ["--job.eval-interval", "5"]  # a dashed spelling still reaches the dotted overrides
    spec = build_spec(args, extra)
    assert (spec.model.n_layer, spec.job.checkpoint, spec.job.eval_interval, spec.process.num_threads) == (3, False, 5, 2)
    assert spec.job.steps == 9  # the dotted flag after the named --steps, as before
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    missing = [f"--{s}.{p}" for s in JOB_SECTIONS for p, _ in leaves(JobSpec.model_fields[s].annotation)
               if f"--{s}.{p}" not in out]
    assert not missing, missing


def test_train_engine_flags_come_from_the_engine_config(capsys, tmp_path):
    """`zeal train` has one flag per leaf of the engine's Config under DeepSpeed's key names
    (--zero_optimization.stage), parsed by argparse (not left over as extras); the old
    spellings (--engine.<key>, dashes, keys below a mapping leaf) stay dotted overrides, and
    the named flags keep their meaning."""
    from zeal.cli.config_flags import leaves
    from zeal.cli.main import build_parser, main
    from zeal.cli.train import build_spec

    parser, _ = build_parser("train")
    args, extra = parser.parse_known_args([
        "train", "--zero-stage", "1", "--zero_optimization.stage", "2", "--gradient_clipping", "0.5",
        "--zero_optimization.offload_optimizer.device", "cpu", "--bf16.enabled", "false",
        "--optimizer.params.weight_decay", "0.1", "--engine.steps_per_print", "7", "--wall-clock-breakdown",
        "--flops-profiler.enabled", "true", "--run-dir", str(tmp_path / "r")])
    assert extra == ["--optimizer.params.weight_decay", "0.1", "--engine.steps_per_print", "7",
                     "--flops-profiler.enabled", "true"]
    eng = build_spec(args, extra).engine
    assert eng["zero_optimization"]["stage"] == 2  # the derived flag after the named --zero-stage, as before
    assert eng["zero_optimization"]["offload_optimizer"]["device"] == "cpu" and eng["gradient_clipping"] == 0.5
    assert eng["optimizer"]["params"]["weight_decay"] == 0.1 and eng["steps_per_print"] == 7
    assert eng["wall_clock_breakdown"] is True and eng["flops_profiler"]["enabled"] is True
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    named = {"seed"}  # the named --seed sets the engine's seed and the data's
    paths = [p for p, _ in leaves(Config) if p not in named]
    assert len(paths) >= 140 and not [p for p in paths if f"--{p} " not in out and f"--{p}\n" not in out]
    with pytest.raises(ValueError, match="config key .gradient_clipping.: Input should be greater than or equal to 0"):
        build_spec(*parser.parse_known_args(["train", "--gradient_clipping", "-1", "--run-dir", str(tmp_path / "s")]))
