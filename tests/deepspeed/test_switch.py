"""The opt-in switch: under ``python -m zeal.deepspeed`` / ``ZEAL_DEEPSPEED=1`` /
``zeal deepspeed`` a script's ``import deepspeed`` is zeal's; without it, it is not; the
launcher picks DeepSpeed's resources and starts a DeepSpeedExamples-style script unchanged."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path

import pytest

from tests.dist_harness import free_port
from zeal.cli.deepspeed import parse_spec, select_resources

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "scripts"


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("ZEAL_DEEPSPEED", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = str(ROOT)
    env.update(extra)
    return env


def _probe(argv: list[str], env: dict) -> dict:
    out = subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True, timeout=120, cwd="/")
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_without_the_switch_deepspeed_is_not_zeals():
    code = "import importlib.util, sys; s = importlib.util.find_spec('deepspeed'); print(s and s.origin)"
    out = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=120)
    origin = out.stdout.strip()
    assert out.returncode == 0 and "zeal" not in origin  # None, or a real DeepSpeed left untouched


def test_python_m_zeal_deepspeed_runs_the_script_with_deepspeed_resolved_to_zeal():
    got = _probe(["-m", "zeal.deepspeed", str(SCRIPTS / "probe_imports.py"), "--flag", "x"], _env())
    assert got["name"] == "zeal.deepspeed" and got["comm"] == "zeal.deepspeed.comm" and got["same_pipe"]
    assert got["version"].startswith("0.19.8") and got["spec"] and got["main"] == "__main__"
    assert got["argv"] == ["--flag", "x"] and got["device"] in ("cpu", "cuda")


def test_zeal_deepspeed_env_with_the_site_dir_switches_a_plain_python_run():
    from zeal.deepspeed.switch import site_dir

    env = _env(ZEAL_DEEPSPEED="1")
    env["PYTHONPATH"] = site_dir() + os.pathsep + str(ROOT)
    got = _probe([str(SCRIPTS / "probe_imports.py")], env)
    assert got["name"] == "zeal.deepspeed" and got["version"].startswith("0.19.8")
    env["ZEAL_DEEPSPEED"] = "0"  # the site dir alone does nothing
    out = subprocess.run([sys.executable, "-c", "import deepspeed; print(deepspeed.__name__)"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert "zeal.deepspeed" not in out.stdout


def test_install_in_process_aliases_modules_and_uninstall_forgets_them():
    from zeal.deepspeed import switch

    switch.install()
    try:
        import deepspeed.utils.groups as g

        import zeal.deepspeed.utils.groups as zg

        assert g is zg and sys.modules["deepspeed"] is sys.modules["zeal.deepspeed"]
        from importlib.metadata import version

        assert version("deepspeed").startswith("0.19.8")
        with pytest.raises(ModuleNotFoundError, match="deepspeed.no_such_module"):
            import deepspeed.no_such_module  # noqa: F401
    finally:
        switch.uninstall()
    assert "deepspeed" not in sys.modules and not switch.installed()


def test_resources_follow_deepspeeds_include_exclude_num_nodes_num_gpus():
    pool = OrderedDict([("w0", [0, 1, 2, 3]), ("w1", [0, 1, 2, 3])])
    assert select_resources(pool) == pool
    assert select_resources(pool, include="w1:0,2") == OrderedDict(w1=[0, 2])
    assert select_resources(pool, include="w0@w1:3") == OrderedDict([("w0", [0, 1, 2, 3]), ("w1", [3])])
    assert select_resources(pool, exclude="w0:1@w1") == OrderedDict(w0=[0, 2, 3])
    assert select_resources(pool, num_nodes=1, num_gpus=2) == OrderedDict(w0=[0, 1])
    assert parse_spec("a:1,2@b", "include") == OrderedDict([("a", [1, 2]), ("b", [])])
    with pytest.raises(ValueError, match="mutually exclusive"):
        select_resources(pool, include="w0", exclude="w1")
    with pytest.raises(ValueError, match="host 'w9' is not in the resource pool"):
        select_resources(pool, include="w9")
    with pytest.raises(ValueError, match="no slot 7"):
        select_resources(pool, include="w0:7")


def test_launcher_dry_run_is_torchrun_with_deepspeeds_port_and_process_count(capsys):
    from zeal.cli.main import main

    assert main(["deepspeed", "--num_gpus", "3", "--master_port", "29123", "--dry_run", "train.py", "--lr", "1"]) == 0
    cmd = capsys.readouterr().out
    assert "--nproc-per-node=3" in cmd and "--master-port=29123" in cmd and "--master-addr=127.0.0.1" in cmd
    assert cmd.rstrip().endswith("zeal.cli.rank_main -m zeal.deepspeed train.py --lr 1")


def test_cifar_style_script_runs_unchanged_on_two_ranks(tmp_path):
    """DeepSpeedExamples' cifar shape (add_config_arguments, --local_rank, init_distributed,
    get_accelerator, training_data=, RepeatingLoader, log_dist) under ``zeal deepspeed``."""
    cfg = tmp_path / "ds_config.json"
    cfg.write_text(json.dumps({
        "train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "steps_per_print": 100,
        "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8,
                                                 "weight_decay": 3e-7}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001,
                                                     "warmup_num_steps": 10}},
        "gradient_clipping": 1.0, "zero_optimization": {"stage": 1}}))
    port = free_port()
    out = subprocess.run([sys.executable, "-m", "zeal.cli.main", "deepspeed", "--num_gpus", "2", "--master_port",
                          str(port), str(SCRIPTS / "cifar_style.py"), "--deepspeed", "--deepspeed_config", str(cfg),
                          "--steps", "3", "--out", str(tmp_path / "out")],
                         env=_env(), capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stderr[-3000:]
    recs = [json.loads((tmp_path / "out" / f"rank{r}.json").read_text()) for r in (0, 1)]
    for r, rec in enumerate(recs):
        assert rec["world"] == 2 and rec["local_rank"] == r and rec["dp_world_size"] == 2
        assert rec["env"] == {"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                              "MASTER_PORT": str(port), "LOCAL_SIZE": "2", "CROSS_RANK": "0", "CROSS_SIZE": "1"}
        assert rec["global_steps"] == 3 and len(rec["losses"]) == 6 and rec["was_step_applied"]
        assert rec["params"] == 62006  # engine.parameters() is the model's
    assert recs[0]["checksum"] == pytest.approx(recs[1]["checksum"], rel=1e-12)  # one model on both ranks
    assert recs[0]["losses"] != recs[1]["losses"]  # each rank drew its own shard of the data
    assert "step 0 loss" in out.stdout and "[Rank 0]" in out.stdout and "[Rank 1]" not in out.stdout
