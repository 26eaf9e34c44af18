"""Activation checkpointing: zeal's GPT and Llama, the config section, and its apply step.

Tolerance: a checkpointed backward re-runs the very same fp32 ops on the very same
inputs (dropout included: checkpoint restores the RNG state); GPT's loss under
checkpointing is summed over chunks of the logits (never whole), so it equals the
plain mean to fp32 rounding (1e-6 relative); the parameter gradients may differ in the last ulp only because
autograd may sum a tensor's incoming gradients in another order when the graph
is split into recomputed pieces. 1e-6 (absolute, on gradients of order 1e-2..1)
leaves room for that and nothing else: a missed or doubled block moves them by
far more.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

import zeal
from zeal.config import ConfigError, load_config
from zeal.models import GPT, GPTConfig
from zeal.models import checkpointing as ckpt
from zeal.models.checkpointing import CheckpointPolicy, blocks_per_checkpoint
from zeal.models.llama import Llama, LlamaConfig
from zeal.train.activation_checkpointing import apply_activation_checkpointing

GPT_CFG = GPTConfig(vocab_size=64, n_positions=16, n_embd=32, n_layer=4, n_head=4, dropout=0.1)
LLAMA_CFG = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
TOL = 1e-6


def _gpt_loss(model: GPT, x: torch.Tensor) -> torch.Tensor:
    return model(x, labels=x)


def _llama_loss(model: Llama, x: torch.Tensor) -> torch.Tensor:
    logits = model(x, positions=torch.arange(x.shape[0]))  # a flat batch: one sequence
    return F.cross_entropy(logits[:-1], x[1:])


def _loss_and_grads(model: torch.nn.Module, loss_fn, x: torch.Tensor, seed: int = 7):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # the same dropout masks in both runs
    loss = loss_fn(model, x)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _assert_same(ref, got) -> None:
    assert abs(ref[0].item() - got[0].item()) <= 1e-6 * abs(ref[0].item()), (ref[0], got[0])
    for n, g in ref[1].items():
        assert (g - got[1][n]).abs().max().item() <= TOL, n


@pytest.mark.timeout(60)
@pytest.mark.parametrize("every", [1, 2])
@pytest.mark.parametrize("which", ["gpt", "llama"])
def test_checkpointing_gives_the_same_loss_and_gradients(which: str, every: int):
    torch.manual_seed(0)
    if which == "gpt":
        model, loss_fn, x = GPT(GPT_CFG), _gpt_loss, torch.randint(0, 64, (2, 16))
    else:
        model, loss_fn, x = Llama(LLAMA_CFG), _llama_loss, torch.randint(0, 64, (12,))
    ref = _loss_and_grads(model, loss_fn, x)
    model.checkpoint_policy = CheckpointPolicy(enabled=True, every=every, profile=True)
    got = _loss_and_grads(model, loss_fn, x)
    _assert_same(ref, got)
    # each group of `every` blocks ran again in backward, once
    assert model.checkpoint_policy.counter.num_recomputes == 4 // every
    assert model.checkpoint_policy.counter.recompute_s > 0


@pytest.mark.timeout(60)
def test_checkpointing_drops_the_saved_activations():
    torch.manual_seed(0)
    model, x = GPT(GPT_CFG), torch.randint(0, 64, (2, 16))

    def saved_tensors(on: bool) -> int:
        model.checkpoint_activations = on
        n = 0

        def pack(t):
            nonlocal n
            n += 1
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(x, labels=x)
        return n

    # plain: every block's internals; checkpointed: one input per block (checkpoint's own
    # hooks take the internals) plus what the embedding, final norm, head and loss save
    assert saved_tensors(True) < saved_tensors(False) // 3


@pytest.mark.timeout(60)
def test_eval_and_no_grad_forwards_do_not_checkpoint(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("checkpoint called outside a training forward with grad")

    monkeypatch.setattr(ckpt, "checkpoint", refuse)
    torch.manual_seed(0)
    model, x = GPT(GPT_CFG), torch.randint(0, 64, (2, 16))
    model.checkpoint_activations = True
    model.eval()(x).sum().backward()  # grad on, but evaluating
    with torch.no_grad():  # training mode, but no grad (serving, held-out loss)
        model.train()(x)
    llama = Llama(LLAMA_CFG).eval()
    llama.checkpoint_activations = True
    llama(torch.randint(0, 64, (12,)), positions=torch.arange(12)).sum().backward()
    llama.train()
    with torch.no_grad():
        llama(torch.randint(0, 64, (2, 12)))


@pytest.mark.timeout(60)
def test_cpu_checkpointing_on_cpu_is_a_noop_logged_once(monkeypatch, caplog):
    monkeypatch.setattr(ckpt, "_said", set())
    torch.manual_seed(0)
    model, x = GPT(GPT_CFG), torch.randint(0, 64, (2, 16))
    ref = _loss_and_grads(model, _gpt_loss, x)
    model.checkpoint_policy = CheckpointPolicy(enabled=True, cpu_checkpointing=True)
    with caplog.at_level(logging.INFO, logger="zeal"):
        got = _loss_and_grads(model, _gpt_loss, x)
        _loss_and_grads(model, _gpt_loss, x)
    _assert_same(ref, got)
    said = [r for r in caplog.records if "cpu_checkpointing" in r.getMessage()]
    assert len(said) == 1 and "no effect on a CPU device" in said[0].getMessage()


def test_hugging_face_style_switches():
    model = GPT(GPT_CFG)
    assert not model.checkpoint_activations and not model.is_gradient_checkpointing
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    assert model.checkpoint_activations and model.checkpoint_policy.use_reentrant
    model.gradient_checkpointing_disable()
    assert not model.checkpoint_activations
    model.checkpoint_activations = True
    assert model.checkpoint_policy.enabled
    with pytest.raises(ValueError, match="use_reentrant"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"preserve_rng_state": False})


def test_number_checkpoints_becomes_blocks_per_group():
    assert blocks_per_checkpoint(4, None) == 1
    assert blocks_per_checkpoint(4, 2) == 2
    assert blocks_per_checkpoint(5, 2) == 3  # ceil: 2 checkpoints of 3 and 2 blocks
    assert blocks_per_checkpoint(4, 8) == 1


def test_config_section_loads_from_deepspeed_json():
    cfg = load_config({"activation_checkpointing": {
        "partition_activations": False, "cpu_checkpointing": True, "contiguous_memory_optimization": False,
        "number_checkpoints": 2, "synchronize_checkpoint_boundary": False, "profile": True}})
    s = cfg.activation_checkpointing
    assert (s.cpu_checkpointing, s.number_checkpoints, s.profile) == (True, 2, True)
    assert load_config({}).activation_checkpointing is None
    with pytest.raises(ConfigError, match="partition_activations") as e:
        load_config({"activation_checkpointing": {"partition_activations": True}})
    assert "tensor parallelism" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="activation_checkpointing.number_checkpoints"):
        load_config({"activation_checkpointing": {"number_checkpoints": 0}})


_ENGINE = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}


def _train(model, cfg: dict, steps: int = 2) -> tuple[object, list[float]]:
    engine = zeal.initialize(model, cfg)
    g = torch.Generator().manual_seed(3)
    losses = []
    for _ in range(steps):
        x = torch.randint(0, 64, (2, 16), generator=g)
        loss = engine(x, labels=x)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return engine, losses


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [0, 3])
def test_initialize_applies_the_section_to_a_zeal_model(stage: int):
    cfg = GPTConfig(vocab_size=64, n_positions=16, n_embd=32, n_layer=4, n_head=4)
    zo = {"zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    torch.manual_seed(0)
    plain, ref = _train(lambda: GPT(cfg), {**_ENGINE, **zo})
    torch.manual_seed(0)
    engine, losses = _train(lambda: GPT(cfg), {**_ENGINE, **zo,
                                               "activation_checkpointing": {"number_checkpoints": 2}})
    policy = engine.module.checkpoint_policy
    assert engine.module.checkpoint_activations and policy.every == 2
    assert not plain.module.checkpoint_activations
    # same fp32 arithmetic (see the module docstring); stage 3 re-gathers for the recompute
    assert losses == pytest.approx(ref, abs=1e-6)
    plain.close()
    engine.close()


@pytest.mark.timeout(120)
def test_initialize_enables_hugging_face_gradient_checkpointing(caplog):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32))
    with caplog.at_level(logging.INFO, logger="zeal"):
        engine = zeal.initialize(model, {**_ENGINE, "activation_checkpointing": {
            "number_checkpoints": 1, "cpu_checkpointing": not torch.cuda.is_available()}})
    # transformers 5.x renamed the flag (the old name warns)
    new_name = hasattr(type(engine.module), "is_activation_checkpointing")
    assert engine.module.is_activation_checkpointing if new_name else engine.module.is_gradient_checkpointing
    assert any("number_checkpoints" in r.getMessage() and "zeal's own models only" in r.getMessage()
               for r in caplog.records)
    x = torch.randint(0, 64, (2, 16))
    out = engine({"input_ids": x, "labels": x})
    engine.backward(out)
    engine.step()
    assert torch.isfinite(out.loss)
    engine.close()


def test_a_plain_module_is_refused():
    section = load_config({"activation_checkpointing": {}}).activation_checkpointing
    with pytest.raises(ConfigError, match="activation_checkpointing") as e:
        apply_activation_checkpointing(torch.nn.Sequential(torch.nn.Linear(4, 4)), section)
    assert "torch.utils.checkpoint" in str(e.value) and "gradient_checkpointing_enable()" in str(e.value)
    assert apply_activation_checkpointing(torch.nn.Linear(4, 4), None) is None


def test_a_wrapped_zeal_model_is_found():
    wrapper = torch.nn.ModuleDict({"lm": GPT(GPT_CFG)})
    section = load_config({"activation_checkpointing": {"number_checkpoints": 1}}).activation_checkpointing
    policy = apply_activation_checkpointing(wrapper, section)
    assert wrapper["lm"].checkpoint_policy is policy and policy.every == 4


def test_train_flag_adds_the_section():
    from zeal.cli.main import build_parser
    from zeal.cli.train import build_spec

    parser, _ = build_parser("train")
    args, extra = parser.parse_known_args(["train", "--checkpoint-activations", "--nproc", "1"])
    assert build_spec(args, extra).engine["activation_checkpointing"] == {}
    args, extra = parser.parse_known_args(["train", "--nproc", "1", "--activation_checkpointing.profile", "true"])
    assert build_spec(args, extra).engine["activation_checkpointing"] == {"profile": True}


@pytest.mark.timeout(60)
def test_gpt_loss_under_checkpointing_is_chunked_and_keeps_no_logits(monkeypatch):
    """The LM-head loss is scored chunk by chunk (checkpointed): nothing of size b·s·V is
    saved for backward, and the value and gradients equal the plain loss's."""
    from zeal.models import checkpointing as ck
    from zeal.models.gpt import GPT, GPTConfig

    monkeypatch.setattr(ck, "LOSS_CHUNK_ELEMS", 7 * 64)  # 7 rows of a 64-entry vocabulary: several chunks
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, n_positions=32, n_embd=16, n_layer=2, n_head=2))
    x = torch.randint(0, 64, (3, 20))
    x[0, 5] = -100
    labels = x.clamp(min=0)
    labels[1, 7:9] = -100
    ref = _loss_and_grads(model, lambda m, _: m(x.clamp(min=0), labels=labels), x)
    model.checkpoint_activations = True
    sizes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel()) or t, lambda t: t):
        got = _loss_and_grads(model, lambda m, _: m(x.clamp(min=0), labels=labels), x)
    _assert_same(ref, got)
    assert max(sizes) < 3 * 19 * 64, max(sizes)
