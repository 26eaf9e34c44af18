"""Config values zeal hands to torch are checked by zeal (issue 15, finding 9): every
bad value fails at start-up with one line naming the key path and the rule. A property
test pushes values of every field of the schema (and the optimizer / schedule
parameters) out of range: each config either fails in ``zeal.initialize`` that way, or
trains one step."""

from __future__ import annotations

import collections
import math
from typing import Any, get_args

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

import zeal
from tests.tiers import budget
from tests.train.models import TinyNet, make_batches
from zeal.cli.main import main
from zeal.config import Config, ConfigError

pytestmark = pytest.mark.timeout(120)
BASE = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}

REGRESSIONS = [
    ({"optimizer": {"type": "AdamW", "params": {"lr": -0.1}}}, "optimizer.params.lr"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": math.nan}}}, "optimizer.params.lr"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": math.inf}}}, "optimizer.params.lr"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": "fast"}}}, "optimizer.params.lr"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "eps": -1e-8}}}, "optimizer.params.eps"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 1.0]}}}, "optimizer.params.betas"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": "fast"}}}, "optimizer.params.betas"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": -0.1}}}, "optimizer.params.weight_decay"),
    ({"optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": -1}}}, "optimizer.params.momentum"),
    ({"optimizer": {"type": "SGD", "params": {"lr": 0.1, "nesterov": True}}}, "optimizer.params"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "amsgrad": "yes please"}}}, "optimizer.params.amsgrad"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": -5}}}, "scheduler.params.warmup_num_steps"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 2.5}}}, "scheduler.params.warmup_num_steps"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": math.nan}}}, "scheduler.params.warmup_max_lr"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": -1}}}, "scheduler.params.warmup_min_lr"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cubic"}}}, "scheduler.params.warmup_type"),
    ({"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 0}}}, "scheduler.params.total_num_steps"),
    ({"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 10, "cos_min_ratio": 2}}},
     "scheduler.params.cos_min_ratio"),
    ({"gradient_clipping": math.inf}, "gradient_clipping"),
    ({"fp16": {"enabled": True, "loss_scale": math.inf}}, "fp16.loss_scale"),
    ({"fp16": {"enabled": True, "min_loss_scale": math.inf}}, "fp16.min_loss_scale"),
    ({"local_world_size": 3}, "local_world_size"),
    ({"seed": 10**30}, "seed"),
    ({"seed": -1}, "seed"),
]


def _one_line_naming(e: ConfigError, key: str) -> None:
    msg = str(e)
    assert "\n" not in msg and f"'{key}" in msg, msg


@pytest.mark.parametrize("cfg,key", REGRESSIONS, ids=[k for _, k in REGRESSIONS])
def test_bad_values_fail_at_start_up_naming_the_key(cfg, key):
    with pytest.raises(ConfigError) as e:
        zeal.initialize(TinyNet(), {**BASE, **cfg})
    _one_line_naming(e.value, key)


def test_config_error_is_one_line():
    assert str(ConfigError("config key 'x': bad\n  because\n\tof this")) == "config key 'x': bad because of this"


def test_values_changed_after_validation_are_checked_where_torch_gets_them():
    cfg = zeal.load_config({**BASE, "scheduler": {"type": "WarmupLR", "params": {}}})
    cfg.optimizer.params["lr"] = -0.1  # a dict edited in place bypasses pydantic
    with pytest.raises(ConfigError) as e:
        zeal.initialize(TinyNet(), cfg)
    _one_line_naming(e.value, "optimizer.params.lr")
    cfg.optimizer.params["lr"] = 1e-3
    cfg.scheduler.params["warmup_num_steps"] = -5
    with pytest.raises(ConfigError) as e:
        zeal.initialize(TinyNet(), cfg)
    _one_line_naming(e.value, "scheduler.params.warmup_num_steps")


@pytest.mark.parametrize("argv", [["--seed", str(10**30)], ["--engine.seed", str(10**30)], ["--seed", "-3"]])
def test_cli_seed_out_of_range_names_seed(tmp_path, capsys, argv):
    rc = main(["train", "--run-dir", str(tmp_path / "run"), "--nproc", "1", *argv])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "seed" in err and "Overflow" not in err, err


# -- the property test ------------------------------------------------------------------------------
GENERIC = [-1, -0.5, math.nan, math.inf, 10**30, "fast", None, True, [], {}, "auto"]
OPTIMIZER_KEYS = ["lr", "eps", "weight_decay", "betas", "amsgrad"]
SCHEDULER_KEYS = ["warmup_num_steps", "warmup_min_lr", "warmup_max_lr", "total_num_steps", "warmup_type",
                  "warmup_min_ratio", "cos_min_ratio"]


def _outside_bounds(field: Any) -> list:
    out = []
    for m in field.metadata:
        for attr, delta in (("ge", -1), ("gt", 0), ("le", 1), ("lt", 0)):
            bound = getattr(m, attr, None)
            if bound is not None:
                out.append(bound + delta)
    return out


def _leaves(model: type[BaseModel], prefix: tuple = ()):
    for name, field in model.model_fields.items():
        path = (*prefix, name)
        if path in (("optimizer",), ("scheduler",)):
            yield (*path, "type"), GENERIC
            for key in OPTIMIZER_KEYS if name == "optimizer" else SCHEDULER_KEYS:
                yield (*path, "params", key), GENERIC + [0, 1.5, 2]
            continue
        sub = [t for t in (field.annotation, *get_args(field.annotation)) if isinstance(t, type)
               and issubclass(t, BaseModel)]
        if sub:
            yield from _leaves(sub[0], path)
        else:
            yield path, GENERIC + _outside_bounds(field)


LEAVES = list(_leaves(Config))
PUSH = st.integers(0, len(LEAVES) - 1).flatmap(
    lambda i: st.tuples(st.just(LEAVES[i][0]), st.sampled_from(LEAVES[i][1])))


def _with(cfg: dict, path: tuple, value: Any) -> None:
    node = cfg
    for i, k in enumerate(path[:-1]):
        if not isinstance(node.get(k), dict):
            node[k] = {"type": "WarmupLR"} if path[:i + 1] == ("scheduler",) else {}
        node = node[k]
    node[path[-1]] = value


def _named(msg: str, path: tuple) -> bool:
    """The message names the pushed key, or the section it belongs to."""
    return any(".".join(path[:n]) in msg for n in range(len(path), 0, -1))


@pytest.mark.timeout(600)
@budget(ci=40, long=400)
def test_configs_pushed_out_of_range_fail_naming_the_key_or_train(max_examples):
    stats = collections.Counter()
    x_y = make_batches(1, 1, 1, 2)[0][0][0]

    @settings(max_examples=max_examples, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.lists(PUSH, min_size=1, max_size=2, unique_by=lambda p: p[0]), st.sampled_from([0, 1, 2, 3]),
           st.sampled_from([None, "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]))
    def run(pushes, stage, schedule):
        cfg = {**BASE, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": stage}}
        if schedule:
            params = {"warmup_num_steps": 2, "total_num_steps": 10, "warmup_max_lr": 1e-3}
            if schedule == "WarmupLR":
                del params["total_num_steps"]
            elif schedule == "WarmupCosineLR":
                del params["warmup_max_lr"]
            cfg["scheduler"] = {"type": schedule, "params": params}
        for path, value in pushes:
            _with(cfg, path, value)
        stats["tried"] += 1
        torch.manual_seed(0)
        try:
            engine = zeal.initialize(TinyNet(), cfg)
        except ConfigError as e:
            msg = str(e)
            assert "\n" not in msg and any(_named(msg, p) for p, _ in pushes), (pushes, msg)
            stats["refused"] += 1
            stats["handled"] += 1
            return
        loss = engine(x_y)
        engine.backward(loss)
        engine.step()
        engine.close()
        stats["trained"] += 1
        stats["handled"] += 1

    run()
    print(f"\nconfigs pushed out of range ({len(LEAVES)} keys): {dict(stats)}")
    assert stats["handled"] == stats["tried"] >= 3 * max_examples // 4 and stats["refused"] and stats["trained"]
