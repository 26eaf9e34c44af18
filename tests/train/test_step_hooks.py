"""Step hooks: the engine walks registered hooks around backward and step, in order."""

from __future__ import annotations

import pytest
import torch

import zeal
from zeal.models import GPT, GPTConfig

pytestmark = pytest.mark.timeout(60)


class Recorder:
    def __init__(self, log: list, name: str) -> None:
        self.log, self.name = log, name

    def before_backward(self, boundary: bool) -> None:
        self.log.append((self.name, "before_backward", boundary))

    def after_backward(self) -> None:
        self.log.append((self.name, "after_backward"))

    def after_step(self, applied: bool) -> None:
        self.log.append((self.name, "after_step", applied))

    def close(self) -> None:
        self.log.append((self.name, "close"))


class OnlyAfterStep:
    def __init__(self) -> None:
        self.steps = 0

    def after_step(self, applied: bool) -> None:
        self.steps += applied


@pytest.mark.parametrize("stage", [0, 3])
def test_hooks_run_in_order_around_backward_and_step(stage):
    torch.manual_seed(0)
    engine = zeal.initialize(GPT(GPTConfig(vocab_size=32, n_positions=8, n_embd=16, n_layer=1, n_head=2)),
                             {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
                              "zero_optimization": {"stage": stage}})
    log: list = []
    engine.register_step_hook(Recorder(log, "a"))
    engine.register_step_hook(Recorder(log, "b"))
    partial = OnlyAfterStep()  # a hook may implement any subset of the methods
    engine.register_step_hook(partial)
    x = torch.randint(0, 32, (1, 8))
    for _ in range(2):
        engine.backward(engine({"input_ids": x, "labels": x}))
        engine.step()
    assert log == [
        ("a", "before_backward", False), ("b", "before_backward", False),
        ("a", "after_backward"), ("b", "after_backward"),
        ("a", "before_backward", True), ("b", "before_backward", True),
        ("a", "after_backward"), ("b", "after_backward"),
        ("a", "after_step", True), ("b", "after_step", True),
    ]
    assert partial.steps == 1 and engine.global_steps == 1
    engine.close()
    assert log[-2:] == [("a", "close"), ("b", "close")]


def test_a_hook_without_hook_methods_is_refused():
    engine = zeal.initialize(GPT(GPTConfig(vocab_size=32, n_positions=8, n_embd=16, n_layer=1, n_head=2)),
                             {"train_micro_batch_size_per_gpu": 1})
    with pytest.raises(TypeError, match="none of the step-hook methods"):
        engine.register_step_hook(object())
    engine.close()
