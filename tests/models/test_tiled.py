"""ALST tiling against the untiled computation (plain PyTorch autograd), fp32.

Tolerance 1e-6: the tiled forward is the same arithmetic row by row; only the
parameter gradients are summed tile by tile instead of inside one matmul, a few
ulps apart on these sizes (measured < 1e-7), while a tile missed, counted twice or
misaligned moves a value by more than 1e-3.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from zeal.config import ConfigError, load_config
from zeal.config.tiling import TilingConfig
from zeal.models.gpt import GPT, GPTConfig
from zeal.models.llama import Llama, LlamaConfig, LlamaMLP
from zeal.models.tiled import TiledMLP, loss_shards, mlp_shards, tiled_logits_loss, tiled_rows
from zeal.train.tiling import apply_tiling

TOL = 1e-6
SHARDS = [1, 2, 3, 4, 7, 20]  # 3 and 7 do not divide 20 rows; 20 = one row a tile


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert torch.allclose(a, b, rtol=TOL, atol=TOL), (a - b).abs().max().item()


def _llama_cfg(**kw) -> LlamaConfig:
    return LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, **kw)


@pytest.mark.parametrize("shards", SHARDS)
def test_tiled_mlp_equals_untiled_forward_and_backward(shards):
    torch.manual_seed(0)
    mlp = LlamaMLP(_llama_cfg())
    x = torch.randn(2, 10, 32, requires_grad=True)
    up = torch.randn(2, 10, 32)
    ref = mlp(x)
    (ref * up).sum().backward()
    ref_grads = [p.grad.clone() for p in mlp.parameters()] + [x.grad.clone()]
    mlp.zero_grad()
    x.grad = None
    got = tiled_rows(mlp, x, shards, list(mlp.parameters()))
    (got * up).sum().backward()
    _close(got, ref)
    for g, r in zip([p.grad for p in mlp.parameters()] + [x.grad], ref_grads):
        _close(g, r)


def test_tiled_mlp_wrapper_keeps_names_and_serving_path():
    torch.manual_seed(0)
    m = Llama(_llama_cfg())
    names = [n for n, _ in m.named_parameters()]
    keys = list(m.state_dict())
    wrapped = apply_tiling(m, TilingConfig.model_validate({"tiled_mlp": {"enabled": True, "num_shards": 3}}))
    assert len(wrapped) == 2 and all(isinstance(layer.mlp, TiledMLP) for layer in m.model.layers)
    assert [n for n, _ in m.named_parameters()] == names and list(m.state_dict()) == keys
    assert apply_tiling(m, TilingConfig.model_validate({"tiled_mlp": {"enabled": True}})) == []  # idempotent
    m.eval()
    x = torch.randn(5, 32)
    _close(m.model.layers[0].mlp(x), wrapped[0].inner(x))


def test_tiled_mlp_replays_dropout_masks():
    """A dropout inside the MLP (Hugging Face GPT-2's) draws the same masks when backward
    recomputes a tile: the reference is the same tiles run under autograd."""
    mlp = nn.Sequential()
    mlp.c_fc, mlp.act, mlp.c_proj, mlp.drop = nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8), nn.Dropout(0.5)
    x = torch.randn(9, 8, requires_grad=True)
    torch.manual_seed(5)
    ref = torch.cat([mlp(t) for t in x.tensor_split(3)])
    ref.sum().backward()
    ref_grads = [p.grad.clone() for p in mlp.parameters()] + [x.grad.clone()]
    mlp.zero_grad()
    x.grad = None
    torch.manual_seed(5)
    got = tiled_rows(mlp, x, 3, list(mlp.parameters()))
    got.sum().backward()
    _close(got, ref)
    for g, r in zip([p.grad for p in mlp.parameters()] + [x.grad], ref_grads):
        _close(g, r)


@pytest.mark.parametrize("shards", SHARDS)
def test_tiled_logits_loss_equals_cross_entropy(shards):
    torch.manual_seed(1)
    head = nn.Linear(16, 50)
    h = torch.randn(20, 16, requires_grad=True)
    y = torch.randint(0, 50, (20,))
    y[[0, 7, 8, 19]] = -100
    ref = F.cross_entropy(head(h), y, ignore_index=-100, reduction="sum")
    ref.backward()
    ref_grads = [head.weight.grad.clone(), head.bias.grad.clone(), h.grad.clone()]
    head.zero_grad()
    h.grad = None
    total, count = tiled_logits_loss(head, h, y, shards, params=list(head.parameters()))
    assert int(count) == 16 and not count.requires_grad
    (total / count).backward()
    _close(total, ref)
    for g, r in zip([head.weight.grad, head.bias.grad, h.grad], ref_grads):
        _close(g, r / 16)


def test_tiled_logits_loss_counts_and_shapes():
    head = nn.Linear(4, 6)
    with pytest.raises(ValueError, match="rows of h"):
        tiled_logits_loss(head, torch.randn(3, 4), torch.zeros(2, dtype=torch.long))
    total, count = tiled_logits_loss(head, torch.randn(3, 4), torch.full((3,), -100))  # nothing counted
    assert float(total) == 0.0 and int(count) == 0
    assert mlp_shards("auto", 100, 32) == 4 and mlp_shards(500, 3, 32) == 3 and mlp_shards("auto", 0, 8) == 1
    assert loss_shards("auto", 1 << 12, 1 << 12) == 2 and loss_shards(7, 5, 10) == 5


def _models(kind: str):
    torch.manual_seed(2)
    if kind == "llama":
        return Llama(_llama_cfg(tie_word_embeddings=True))
    return GPT(GPTConfig(vocab_size=97, n_positions=32, n_embd=32, n_layer=2, n_head=4))


@pytest.mark.parametrize("kind,mlp,loss,ckpt", [
    ("llama", 3, 5, False), ("llama", 7, 3, True), ("llama", "auto", "auto", True), ("gpt", 4, 6, False),
    ("gpt", 3, 7, True),
])
def test_tiled_model_equals_untiled(kind, mlp, loss, ckpt):
    """A whole zeal model (tied head) with TiledMLP and the tiled loss, with and without
    activation checkpointing, against the same model untiled; ignore-index included."""
    ref = _models(kind).train()
    m = copy.deepcopy(ref)
    apply_tiling(m, TilingConfig.model_validate({"tiled_mlp": {"enabled": True, "num_shards": mlp},
                                                 "tiled_logits_loss": {"enabled": True, "num_shards": loss}}))
    m.checkpoint_activations = ckpt
    ids = torch.randint(0, 97, (2, 19))
    labels = ids.clone()
    labels[0, 4:9] = -100
    want = ref(ids, labels=labels)
    want.backward()
    got = m(ids, labels=labels)
    got.backward()
    _close(got, want)
    for (n, a), (_, b) in zip(m.named_parameters(), ref.named_parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=TOL, atol=TOL), n
    with torch.no_grad():  # evaluation takes the tiled loss too
        _close(m(ids, labels=labels), want.detach())


def test_tiling_config_keys():
    cfg = load_config({"tiling": {"tiled_mlp": {"enabled": True}, "tiled_logits_loss": {"enabled": True,
                                                                                         "num_shards": 8}}})
    assert cfg.tiling.tiled_mlp.num_shards == "auto" and cfg.tiling.tiled_logits_loss.num_shards == 8
    written = load_config({"tiling": {"tiled_mlp": {"enabled": True, "num_shards": "auto"},  # not HF's "auto"
                                      "tiled_logits_loss": {"enabled": True, "num_shards": "auto"}}})
    assert written.tiling.tiled_mlp.num_shards == written.tiling.tiled_logits_loss.num_shards == "auto"
    with pytest.raises(ConfigError, match="tiling.tiled_mlp.num_shards"):
        load_config({"tiling": {"tiled_mlp": {"num_shards": 0}}})
    with pytest.raises(ConfigError, match="tiling.tiled_mlp"):
        load_config({"tiling": {"tiled_mlp": {"shards": 2}}})


def test_hf_llama_mlps_tiled_in_place():
    """A Hugging Face Llama: every LlamaMLP wrapped (model code untouched), parameter names
    unchanged, loss and gradients as untiled; its loss stays Hugging Face's own."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(3)
    ref = transformers.LlamaForCausalLM(cfg).train()
    m = copy.deepcopy(ref)
    wrapped = apply_tiling(m, TilingConfig.model_validate({"tiled_mlp": {"enabled": True, "num_shards": 3}}))
    assert len(wrapped) == 2 and type(wrapped[0].inner).__name__ == "LlamaMLP"
    assert list(m.state_dict()) == list(ref.state_dict())
    ids = torch.randint(0, 64, (2, 13))
    want = ref(input_ids=ids, labels=ids).loss
    want.backward()
    got = m(input_ids=ids, labels=ids).loss
    got.backward()
    _close(got, want)
    for (n, a), (_, b) in zip(m.named_parameters(), ref.named_parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=TOL, atol=TOL), n


def _engine_losses(cfg: dict) -> tuple[list[float], dict[str, torch.Tensor]]:
    import zeal

    torch.manual_seed(4)
    engine = zeal.initialize(Llama(_llama_cfg()), {"train_micro_batch_size_per_gpu": 2,
                                                   "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, **cfg})
    g = torch.Generator().manual_seed(9)
    losses = []
    for _ in range(2):
        ids = torch.randint(0, 97, (2, 17), generator=g)
        loss = engine(ids, labels=ids)
        engine.backward(loss)
        grads = {n: p.grad.clone() for n, p in engine.module.named_parameters() if p.grad is not None}
        engine.step()
        losses.append(loss.item())
    engine.close()
    return losses, grads


def test_cpu_checkpointing_equals_plain_checkpointing():
    """DeepSpeed's activation_checkpointing.cpu_checkpointing, with the tiling on as well:
    the same losses and gradients as plain checkpointing (on a CPU device the inputs are
    already in host memory; on CUDA they go to pinned host memory and back)."""
    tiling = {"tiling": {"tiled_mlp": {"enabled": True, "num_shards": 3},
                         "tiled_logits_loss": {"enabled": True, "num_shards": 4}}}
    want = _engine_losses({"activation_checkpointing": {}, **tiling})
    got = _engine_losses({"activation_checkpointing": {"cpu_checkpointing": True}, **tiling})
    assert got[0] == want[0]
    assert got[1].keys() == want[1].keys() and all(torch.equal(got[1][k], want[1][k]) for k in want[1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (host offload of device activations)")
def test_cpu_checkpointing_moves_checkpoints_off_the_device():
    from zeal.models.checkpointing import CheckpointPolicy, run_blocks

    blocks = nn.ModuleList(nn.Sequential(nn.Linear(256, 256), nn.GELU()) for _ in range(8)).cuda()
    x = torch.randn(4096, 256, device="cuda", requires_grad=True)
    peaks, grads = [], []
    for offload in (False, True):
        policy = CheckpointPolicy(enabled=True, cpu_checkpointing=offload)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        out = run_blocks(blocks, x, policy)
        peaks.append(torch.cuda.memory_allocated() - before)
        out.sum().backward()
        grads.append(x.grad.clone())
        x.grad = None
    assert torch.equal(grads[0], grads[1])
    assert peaks[1] < peaks[0] - 6 * x.numel() * 4  # 7 of the 8 group inputs live on the host
