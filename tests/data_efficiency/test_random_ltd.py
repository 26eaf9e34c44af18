"""random-LTD: gather/scatter gradients by gradcheck (float64), the full-length schedule and eval
mode bit-identical to the plain model, recomputation reusing the original indices, kept tokens
at their original positions (against full-sequence attention restricted to the kept keys), and
Hugging Face Llama / GPT-2 layers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from zeal.config import load_config
from zeal.data.random_ltd import apply_token_drop, gather_tokens, kept_tokens, scatter_tokens
from zeal.models import GPT, GPTConfig, Llama, LlamaConfig

pytestmark = pytest.mark.timeout(90)


def _cfg(lo, hi, ids=None, steps=10, per=2):
    rl = {"enabled": True, "random_ltd_schedule": {"min_value": lo, "max_value": hi,
                                                   "schedule_config": {"require_steps": steps, "seq_per_step": per}}}
    if ids is not None:
        rl["random_ltd_layer_id"] = ids
    return load_config({"data_efficiency": {"enabled": True, "data_routing": {"random_ltd": rl}}})


def _gpt(dtype=torch.float32, layers=4):
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, n_positions=16, n_embd=16, n_layer=layers, n_head=2)).to(dtype)


def _llama(layers=3):
    torch.manual_seed(0)
    return Llama(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=layers,
                             num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32))


def test_kept_token_schedule_formula():
    assert kept_tokens(0, 128, 2048, 200000, 16) == 128
    t = 50000
    f = int(t / 200000 * (2048 - 128) + 128)
    assert kept_tokens(t, 128, 2048, 200000, 16) == f - f % 16
    assert kept_tokens(10**7, 128, 2048, 200000, 16) == 2048


def test_gather_scatter_gradcheck_float64():
    torch.manual_seed(1)
    x = torch.randn(2, 6, 3, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 3, dtype=torch.float64, requires_grad=True)
    idx = torch.tensor([[0, 2, 5], [1, 3, 4]])

    def fn(x, w):
        return scatter_tokens(x, torch.tanh(gather_tokens(x, idx) @ w), idx)

    assert torch.autograd.gradcheck(fn, (x, w))
    # dropped tokens: identity Jacobian (gradient flows through the bypass unchanged)
    g = torch.randn(2, 6, 3, dtype=torch.float64)
    (gx,) = torch.autograd.grad(fn(x, w), x, g)
    dropped = torch.ones(2, 6, dtype=torch.bool)
    dropped[torch.arange(2)[:, None], idx] = False
    assert torch.equal(gx[dropped], g[dropped])


def test_wrapped_gpt_block_gradcheck_float64():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=8, n_positions=6, n_embd=4, n_layer=3, n_head=1)).double()
    drop = apply_token_drop(model, _cfg(3, 6, ids=[1], per=1))
    assert drop.kept == 3
    block = model.transformer.h[1]
    x = torch.randn(2, 6, 4, dtype=torch.float64, requires_grad=True)

    def fn(x):
        torch.manual_seed(5)  # the same indices on every call
        return block(x)

    assert torch.autograd.gradcheck(fn, (x,), atol=1e-6, fast_mode=True)


def test_full_length_and_eval_are_bit_identical():
    plain, ltd = _gpt(), _gpt()
    drop = apply_token_drop(ltd, _cfg(16, 16))  # kept = T from the start
    ids = torch.randint(0, 64, (3, 16))
    for m in (plain, ltd):
        m.train()
        m(ids, labels=ids).backward()
    assert torch.equal(plain(ids, labels=ids), ltd(ids, labels=ids))
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), ltd.parameters()))
    drop.kept = 4  # dropping, but eval mode is untouched
    plain.eval()
    ltd.eval()
    assert torch.equal(plain(ids), ltd(ids))
    ltd.train()
    assert not torch.equal(plain(ids), ltd(ids))
    assert [n for n, _ in plain.named_parameters()] == [n for n, _ in ltd.named_parameters()]


def test_recompute_reuses_the_original_indices():
    ids = torch.randint(0, 64, (2, 16))
    grads, records = [], []
    for ckpt in (False, True):
        model = _gpt()
        drop = apply_token_drop(model, _cfg(6, 16))
        drop.record = []
        model.checkpoint_activations = ckpt
        torch.manual_seed(7)
        model(ids, labels=ids).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        records.append(drop.record)
    assert len(records[0]) == 2 and len(records[1]) == 4  # layers 1, 2; then recomputed in backward
    first, again = records[1][:2], records[1][2:]
    assert all(torch.equal(a, b) for a, b in zip(first, again[::-1]))  # backward recomputes layer 2, then 1
    assert all(torch.equal(a, b) for a, b in zip(records[0], first))
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(*grads))


class _KeyMaskAttention:
    """Full-sequence causal attention in which only the ``keep`` positions may be attended to."""

    ops = None

    def __init__(self, keep):
        self.keep = keep

    def __call__(self, layer_idx, q, k, v, dropout_p=0.0):
        t = q.shape[1]
        allowed = torch.ones(t, t, dtype=torch.bool).tril()[None] & self.keep[:, None, :]
        rep = q.shape[-2] // k.shape[-2]
        k, v = k.repeat_interleave(rep, dim=-2), v.repeat_interleave(rep, dim=-2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=allowed[:, None])
        return y.transpose(1, 2)


def test_kept_tokens_keep_their_positions_llama():
    model = _llama()
    drop = apply_token_drop(model, _cfg(5, 12, ids=[1]))
    drop.record = []
    layer = model.model.layers[1]
    x = torch.randn(2, 12, 16)
    pos = torch.arange(12)
    rope = model.rope(pos, x.dtype)
    torch.manual_seed(3)
    out = layer(x, rope)
    idx = drop.record[0]
    keep = torch.zeros(2, 12, dtype=torch.bool)
    keep[torch.arange(2)[:, None], idx] = True
    ref = layer.__class__.forward(layer, x, rope, _KeyMaskAttention(keep))  # the unwrapped forward
    assert torch.allclose(out[keep], ref[keep], atol=1e-5)
    assert torch.equal(out[~keep], x[~keep])


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_hugging_face_layers(family):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if family == "llama":
        hf = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
        make = transformers.LlamaForCausalLM
        layers = lambda m: m.model.layers  # noqa: E731
    else:
        hf = transformers.GPT2Config(vocab_size=64, n_embd=16, n_layer=3, n_head=2, n_positions=32,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        make = transformers.GPT2LMHeadModel
        layers = lambda m: m.transformer.h  # noqa: E731
    plain = make(hf)
    ltd = make(hf)
    ltd.load_state_dict(plain.state_dict())
    drop = apply_token_drop(ltd, _cfg(12, 12))
    ids = torch.randint(0, 64, (2, 12))
    plain.train()
    ltd.train()
    assert torch.equal(plain(ids, labels=ids).loss, ltd(ids, labels=ids).loss)  # kept = T
    drop.kept, drop.record = 5, []
    seen = {}
    layers(ltd)[1].register_forward_hook(lambda m, a, kw, out: seen.update(x=a[0] if a else kw["hidden_states"],
                                                                         y=out[0] if isinstance(out, tuple)
                                                                         else out), with_kwargs=True)
    loss = ltd(ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss) and drop.record[0].shape == (2, 5)
    idx = drop.record[0]
    kept = torch.zeros(2, 12, dtype=torch.bool)
    kept[torch.arange(2)[:, None], idx] = True
    assert torch.equal(seen["y"][~kept], seen["x"][~kept]) and not torch.equal(seen["y"][kept], seen["x"][kept])
    plain.eval()
    ltd.eval()
    assert torch.equal(plain(ids).logits, ltd(ids).logits)


def test_engine_steps_the_schedule_and_layer_selection():
    import zeal

    model = _gpt(layers=4)
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "data_efficiency": {"enabled": True, "data_routing": {"random_ltd": {
               "enabled": True, "random_ltd_layer_num": 2,
               "random_ltd_schedule": {"min_value": 4, "max_value": 16,
                                       "schedule_config": {"require_steps": 3, "seq_per_step": 4}}}}}}
    engine = zeal.initialize(model, cfg)
    drop = engine.token_drop
    assert drop.layer_ids == [1, 2] and drop.kept == 4
    ids = torch.randint(0, 64, (2, 16))
    kept = []
    for _ in range(4):
        engine.backward(engine(ids, labels=ids))
        engine.step()
        kept.append(drop.kept)
    assert kept == [kept_tokens(t, 4, 16, 3, 4) for t in range(1, 5)]
    assert drop.layer_tokens(2, 16) == 2 * (16 * 2 + 16 * 2)
    engine.close()
