"""ALST's tiled logits loss on Hugging Face causal LMs (zeal.models.hf_tiled): equal to the
model's own loss and gradients (fp32, 1e-6), with the head never projecting more than one
tile of rows; TiledMLP on the HF MLPs in the same run."""

from __future__ import annotations

import pytest
import torch

from zeal.models.hf_tiled import hf_lm_parts, hf_tiled_loss

pytestmark = pytest.mark.timeout(120)

VOCAB, SEQ, BATCH = 64, 11, 2


def hf_model(kind: str) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model(kind, vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                               attn_implementation="sdpa")
    return AutoModelForCausalLM.from_config(cfg)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = ids.clone()
    labels[1, -4:] = -100
    labels[0, 2] = -100
    return ids, labels


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def head_rows(head: torch.nn.Module) -> list[int]:
    rows: list[int] = []
    head.register_forward_hook(lambda m, i, o: rows.append(o.reshape(-1, o.size(-1)).size(0)))
    return rows


def close(a: dict, b: dict, rounding: dict | None = None) -> None:
    assert a.keys() == b.keys()
    for n in a:
        err = float((a[n] - b[n]).norm())
        slack = 1e-9 if rounding is None else rounding[n]  # reading a gradient off fp32 parameters
        assert err <= 1e-6 * max(float(b[n].norm()), 1e-30) + slack, f"{n}: off by {err:.2e}"


@pytest.mark.parametrize(("kind", "shards"), [("llama", 1), ("llama", 3), ("qwen2", 5)])  # 3, 5 do not divide 22 rows
def test_tiled_loss_equals_hf_loss_and_grads(kind: str, shards: int) -> None:
    ids, labels = batch()
    ref = hf_model(kind)
    want = ref(input_ids=ids, labels=labels).loss
    want.backward()
    model = hf_model(kind)
    runner = hf_tiled_loss(model, shards)
    rows = head_rows(runner.head)
    out = runner(input_ids=ids, labels=labels)
    out.loss.backward()
    assert out.logits is None
    assert out.loss.item() == pytest.approx(float(want), rel=1e-6)
    close(grads(model), grads(ref))
    assert max(rows) <= -(-BATCH * SEQ // shards)  # one tile of rows per head call, never [tokens, vocab]


def test_num_items_in_batch_and_shift_labels_as_hf() -> None:
    """The Trainer's ``num_items_in_batch`` (sum / items) and already shifted ``shift_labels``."""
    ids, labels = batch()
    ref, model = hf_model("llama"), hf_model("llama")
    runner = hf_tiled_loss(model, 2)
    items = torch.tensor(37)
    want = ref(input_ids=ids, labels=labels, num_items_in_batch=items).loss
    got = runner(input_ids=ids, labels=labels, num_items_in_batch=items).loss
    assert float(got) == pytest.approx(float(want), rel=1e-6)
    shift = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
    count = int((shift != -100).sum())
    assert float(runner(input_ids=ids, shift_labels=shift).loss) == pytest.approx(float(want) * 37 / count, rel=1e-6)


def test_without_labels_the_model_runs_as_it_is() -> None:
    ids, _ = batch()
    model = hf_model("llama")
    assert torch.equal(hf_tiled_loss(model, 2)(input_ids=ids).logits, model(input_ids=ids).logits)


def test_scaled_logits_keep_their_own_loss() -> None:
    model = hf_model("llama")
    model.config.final_logit_softcapping = 30.0
    assert "scaled" in hf_lm_parts(model)


def test_initialize_tiles_the_hf_loss_and_mlps() -> None:
    """Through ``zeal.initialize`` with the ``tiling`` section: the engine's loss and the
    SGD update equal HF's own (one process, ZeRO 3), the head sees tiles only, the MLPs are tiled."""
    import zeal
    from zeal.models.tiled import TiledMLP

    ids, labels = batch()
    ref = hf_model("qwen2")
    loss = ref(input_ids=ids, labels=labels).loss
    loss.backward()
    want = grads(ref)
    cfg = {"train_micro_batch_size_per_gpu": BATCH, "optimizer": {"type": "SGD", "params": {"lr": 1.0}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
           "tiling": {"tiled_mlp": {"enabled": True, "num_shards": 3},
                      "tiled_logits_loss": {"enabled": True, "num_shards": 4}}}
    engine = zeal.initialize(hf_model("qwen2"), cfg)
    assert sum(isinstance(m, TiledMLP) for m in engine.module.modules()) == 2
    rows = head_rows(engine.module.lm_head)
    before = engine.module_state_dict()
    out = engine(input_ids=ids, labels=labels)
    engine.backward(out)
    engine.step()
    assert out.loss.item() == pytest.approx(float(loss), rel=1e-6)
    assert max(rows) <= -(-BATCH * SEQ // 4)
    after = engine.module_state_dict()
    eps = torch.finfo(torch.float32).eps
    rounding = {n: float(((before[n].abs() + after[n].abs()) * eps).norm()) for n in want}
    close({n: before[n] - after[n] for n in want}, want, rounding)
    engine.close()
