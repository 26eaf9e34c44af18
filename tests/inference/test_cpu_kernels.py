"""The fused CPU kernels against the pure-torch code they replace (and dense attention)."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from tests.kernels import LazyOps, can_build
from zeal.inference.attention import AttentionMetadata, decode_tables, paged_attention, write_kv
from zeal.inference.kernels import cpu_kernels
from zeal.models.attention import DenseCausalAttention
from zeal.models.llama import Llama, LlamaConfig, apply_rope

ops = LazyOps()  # loaded by the first test that reads it (tests/kernels.py)
needs_ops = pytest.mark.skipif(not can_build(), reason="fused CPU kernels unavailable (no compiler or ninja)")
TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 3e-3}


@pytest.mark.timeout(300)
def test_kernels_build_where_a_compiler_is():
    if not can_build():
        pytest.skip("no C++ compiler or ninja here, or disabled by ZEAL_CPU_KERNELS=0")
    assert cpu_kernels() is not None


@needs_ops
@pytest.mark.timeout(120)
def test_a_built_library_is_loaded_in_another_environment_without_a_rebuild(tmp_path):
    """The library built under the hashed name is loaded as it is by any environment with the
    same source, torch, Python and CPU: a build file naming another virtual environment's torch
    folder (a fresh clone's venv) does not send it through ninja again. (A fresh interpreter:
    a second copy of the library in this process would register its ops twice.)"""
    from zeal.inference import kernels

    name = kernels._build_name()
    src = kernels.cache_dir() / "kernels" / name / f"{name}.so"
    there = tmp_path / "kernels" / name
    there.mkdir(parents=True)
    shutil.copy2(src, there / src.name)
    (there / "build.ninja").write_text("cflags = -isystem /another/venv/lib/python3.11/site-packages/torch/include\n")
    before = (there / src.name).stat().st_mtime_ns
    code = ("import torch, torch.utils.cpp_extension as ce\n"
            "def no_build(*a, **k):\n    raise SystemExit('cpp_extension.load was called: the kernels were built again')\n"
            "ce.load = no_build\n"
            "from zeal.inference import kernels\n"
            "ops = kernels._load()\n"
            "print(sorted(n for n in dir(ops) if not n.startswith('_'))[:3])\n")
    r = subprocess.run([sys.executable, "-c", code], env=os.environ | {"ZEAL_CACHE": str(tmp_path)},
                       capture_output=True, text=True, timeout=100)
    assert r.returncode == 0, (r.stdout + r.stderr)[-2000:]
    assert r.stdout.strip() not in ("", "[]"), r.stdout  # the library's ops are registered
    assert (there / src.name).stat().st_mtime_ns == before


def _decode_case(nh, nkv, hd, bs, lens, dtype, shared_prefix=0, seed=0):
    """Random caches and block tables (scattered over the cache; the first
    ``shared_prefix`` blocks of every sequence are the same blocks)."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    counts = [-(-n // bs) for n in lens]
    nblocks = shared_prefix + sum(c - shared_prefix for c in counts) + 5
    perm = rng.sample(range(nblocks), nblocks)
    common, rest = perm[:shared_prefix], perm[shared_prefix:]
    tables = []
    for c in counts:
        tables.append(common + rest[: c - shared_prefix])
        rest = rest[c - shared_prefix :]
    kc = torch.randn(nblocks, nkv, bs, hd, generator=g).to(dtype)
    vc = torch.randn(nblocks, nkv, bs, hd, generator=g).to(dtype)
    q = torch.randn(len(lens), nh, hd, generator=g).to(dtype)
    return q, kc, vc, tables


def _dense_decode(q, kc, vc, tables, lens):
    outs = []
    for i, n in enumerate(lens):
        k = kc[tables[i]].transpose(0, 1).reshape(kc.shape[1], -1, kc.shape[3])[:, :n].float()
        v = vc[tables[i]].transpose(0, 1).reshape(vc.shape[1], -1, vc.shape[3])[:, :n].float()
        qi = q[i].float().view(kc.shape[1], -1, q.shape[-1])
        p = torch.softmax(qi @ k.transpose(-1, -2) * q.shape[-1] ** -0.5, -1)
        outs.append((p @ v).reshape(q.shape[1], q.shape[2]))
    return torch.stack(outs)


@needs_ops
@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("nh,nkv,hd", [(4, 2, 8), (9, 3, 64), (12, 12, 64), (4, 1, 80), (8, 2, 128), (2, 2, 256)])
@pytest.mark.parametrize("bs", [4, 16, 64])
def test_decode_attention_equals_dense(dtype, nh, nkv, hd, bs):
    lens = [1, 2, bs - 1, bs, bs + 1, 3 * bs + 5, 130, 7]
    q, kc, vc, tables = _decode_case(nh, nkv, hd, bs, lens, dtype, seed=hd + bs)
    dt = decode_tables(list(range(len(lens))), tables, lens, bs)
    out = torch.empty_like(q)
    ops.decode_attention(q, kc, vc, dt.block_tables, dt.ctx_lens, hd**-0.5, out)
    torch.testing.assert_close(out.float(), _dense_decode(q, kc, vc, tables, lens), atol=TOL[dtype], rtol=TOL[dtype])


@needs_ops
@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("nh,nkv,hd", [(4, 2, 8), (9, 3, 64), (12, 12, 64), (4, 1, 80), (8, 2, 128), (2, 2, 256)])
@pytest.mark.parametrize("length,ctx,bs", [(1, 9, 4), (7, 19, 4), (70, 70, 64), (33, 100, 16), (20, 300, 64),
                                           (150, 150, 16)])
def test_chunk_attention_equals_dense(dtype, nh, nkv, hd, length, ctx, bs):
    """A prompt chunk (the last ``length`` of ``ctx`` positions) over scattered blocks:
    causal edges inside key tiles, query tiles shorter than a full one, GQA groups."""
    q, kc, vc, tables = _decode_case(nh, nkv, hd, bs, [ctx], dtype, seed=length + hd)
    q = torch.randn(length, nh, hd, generator=torch.Generator().manual_seed(1)).to(dtype)
    table = tables[0]
    k = kc[table].transpose(0, 1).reshape(nkv, -1, hd)[:, :ctx].float()
    v = vc[table].transpose(0, 1).reshape(nkv, -1, hd)[:, :ctx].float()
    qg = q.float().transpose(0, 1).reshape(nkv, nh // nkv, length, hd)
    visible = torch.arange(ctx)[None, :] <= torch.arange(ctx - length, ctx)[:, None]
    p = torch.softmax((qg @ k[:, None].transpose(-1, -2)) * hd**-0.5 + torch.where(visible, 0.0, float("-inf")), -1)
    ref = (p @ v[:, None]).reshape(nh, length, hd).transpose(0, 1)
    out = torch.empty_like(q)
    ops.chunk_attention(q, kc, vc, torch.tensor(table, dtype=torch.int32), ctx, hd**-0.5, out)
    torch.testing.assert_close(out.float(), ref, atol=TOL[dtype], rtol=TOL[dtype])


@needs_ops
@pytest.mark.timeout(60)
def test_paged_attention_with_kernels_equals_dense_shared_blocks_and_rows():
    """Decodes that share prefix blocks (prefix caching, n > 1), in rows that are not
    consecutive (a one-token prompt chunk between them), through paged_attention."""
    nh, nkv, hd, bs = 6, 2, 16, 4
    lens = [14, 11, 9]
    q, kc, vc, tables = _decode_case(nh, nkv, hd, bs, lens, torch.float32, shared_prefix=2, seed=3)
    k_new, v_new = torch.randn(3, nkv, hd), torch.randn(3, nkv, hd)
    slots = torch.tensor([tables[i][(n - 1) // bs] * bs + (n - 1) % bs for i, n in enumerate(lens)])
    ref_kc, ref_vc = kc.clone(), vc.clone()
    write_kv(ref_kc, ref_vc, k_new, v_new, slots)
    ref = _dense_decode(q, ref_kc, ref_vc, tables, lens)
    rows = [0, 2, 3]  # row 1 is someone else's; its output is left alone
    qq = torch.zeros(4, nh, hd)
    qq[rows] = q
    kk, vv = torch.zeros(4, nkv, hd), torch.zeros(4, nkv, hd)
    kk[rows], vv[rows] = k_new, v_new
    spare = tables[0][-1] * bs + bs - 1  # a slot nobody reads
    meta = AttentionMetadata(torch.tensor([slots[0], spare, slots[1], slots[2]]), kernels=ops,
                             decodes=decode_tables(rows, tables, lens, bs))
    assert not isinstance(meta.decodes.rows, slice)
    out = paged_attention(qq, kk, vv, kc, vc, meta)
    torch.testing.assert_close(out[rows], ref, atol=2e-5, rtol=2e-5)
    ref_kc[spare // bs, :, spare % bs] = kk[1]
    assert torch.equal(kc, ref_kc)


@needs_ops
@pytest.mark.timeout(30)
def test_write_kv_matches_torch_with_strided_rows():
    torch.manual_seed(0)
    nkv, hd, bs = 3, 8, 4
    kc, vc = torch.zeros(6, nkv, bs, hd), torch.zeros(6, nkv, bs, hd)
    qkv = torch.randn(5, 3 * nkv * hd)  # GPT-2's fused projection: k and v are strided views
    _, k, v = (x.view(5, nkv, hd) for x in qkv.split(nkv * hd, dim=-1))
    slots = torch.tensor([0, 5, 6, 23, 13])
    rk, rv = kc.clone(), vc.clone()
    write_kv(rk, rv, k, v, slots)
    ops.write_kv(kc, vc, k, v, slots)
    assert torch.equal(kc, rk) and torch.equal(vc, rv)
    with pytest.raises(RuntimeError, match="slot out of range"):
        ops.write_kv(kc, vc, k, v, torch.tensor([0, 1, 2, 3, 6 * bs]))


@needs_ops
@pytest.mark.timeout(30)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("width", [576, 70])
def test_norms_and_activations(dtype, width):
    torch.manual_seed(1)
    tol = dict(atol=TOL[dtype] * 4, rtol=TOL[dtype])
    x, d = torch.randn(33, width).to(dtype), torch.randn(33, width).to(dtype)
    w, b = torch.randn(width).to(dtype), torch.randn(width).to(dtype)
    for delta in (None, d):
        xs, out = x.clone(), torch.empty_like(x)
        ref_x = x if delta is None else x + delta
        ops.rms_norm(xs, delta, w, 1e-5, out)
        assert torch.equal(xs, ref_x)
        xf = ref_x.float()
        torch.testing.assert_close(out.float(), xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + 1e-5) * w.float(),
                                   **tol)
        xs = x.clone()
        ops.layer_norm(xs, delta, w, b, 1e-5, out)
        assert torch.equal(xs, ref_x)
        torch.testing.assert_close(out.float(), F.layer_norm(xf, (width,), w.float(), b.float(), 1e-5), **tol)
    gate, up = (torch.randn(33, width) * 6).to(dtype), torch.randn(33, width).to(dtype)
    ref = F.silu(gate.float()) * up.float()
    ops.silu_mul(gate, up)
    torch.testing.assert_close(gate.float(), ref, **tol)
    u = (torch.randn(33, width) * 6).to(dtype)
    ref = F.gelu(u.float(), approximate="tanh")
    ops.gelu_tanh(u)
    torch.testing.assert_close(u.float(), ref, **tol)


@needs_ops
@pytest.mark.timeout(30)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_norms_over_an_fp32_residual_stream(dtype):
    """x in fp32 beside 16-bit delta, weights and out: the add is the fp32 sum (not rounded to
    16 bits) and out is the fp32 norm of it rounded once."""
    torch.manual_seed(6)
    x, d = torch.randn(9, 70) * 300, torch.randn(9, 70).to(dtype)
    w, b = torch.randn(70).to(dtype), torch.randn(70).to(dtype)
    xs, out = x.clone(), torch.empty(9, 70, dtype=dtype)
    ops.rms_norm(xs, d, w, 1e-5, out)
    ref_x = x + d.float()
    assert torch.equal(xs, ref_x)
    ref = ref_x * torch.rsqrt(ref_x.square().mean(-1, keepdim=True) + 1e-5) * w.float()
    torch.testing.assert_close(out, ref.to(dtype), atol=TOL[dtype], rtol=TOL[dtype])
    xs = x.clone()
    ops.layer_norm(xs, d, w, b, 1e-5, out)
    assert torch.equal(xs, ref_x)
    torch.testing.assert_close(out, F.layer_norm(ref_x, (70,), w.float(), b.float(), 1e-5).to(dtype),
                               atol=TOL[dtype] * 4, rtol=TOL[dtype])
    with pytest.raises(RuntimeError, match="delta of x's shape"):
        ops.rms_norm(x.clone(), d.float(), w, 1e-5, out)


@needs_ops
@pytest.mark.timeout(30)
def test_rope_matches_apply_rope():
    torch.manual_seed(2)
    t, nh, nkv, hd = 7, 6, 2, 16
    q, k = torch.randn(t, nh, hd), torch.randn(t, nkv, hd)
    ang = torch.randn(t, hd // 2) * 50
    cos, sin = ang.cos(), ang.sin()
    full_cos, full_sin = torch.cat([cos, cos], -1)[:, None], torch.cat([sin, sin], -1)[:, None]
    rq, rk = apply_rope(q, full_cos, full_sin), apply_rope(k, full_cos, full_sin)
    ops.rope(q, k, cos, sin)
    torch.testing.assert_close(q, rq)
    torch.testing.assert_close(k, rk)


@needs_ops
@pytest.mark.timeout(30)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_rows_first_maximum(dtype):
    torch.manual_seed(3)
    x = torch.randn(9, 5000).to(dtype)
    x[2, 17] = x[2, 4000] = 100  # a tie: the first index wins
    x[5] = float("-inf")
    x[6, 4999] = 100  # the very last entry
    assert torch.equal(ops.argmax_rows(x), x.argmax(-1))
    assert ops.argmax_rows(x)[[2, 5, 6]].tolist() == [17, 0, 4999]


@needs_ops
@pytest.mark.timeout(30)
def test_kernels_reject_bad_input():
    q = torch.randn(2, 4, 8)
    kc = torch.randn(3, 2, 4, 8, dtype=torch.bfloat16)
    bt, lens = torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="share a dtype"):
        ops.decode_attention(q, kc, kc, bt, lens, 1.0, torch.empty_like(q))
    with pytest.raises(RuntimeError, match="int32"):
        ops.decode_attention(q, kc.float(), kc.float(), bt.long(), lens, 1.0, torch.empty_like(q))
    with pytest.raises(RuntimeError, match="context length"):
        ops.decode_attention(q, kc.float(), kc.float(), bt, lens * 5, 1.0, torch.empty_like(q))
    with pytest.raises(RuntimeError, match="block id out of range"):
        ops.decode_attention(q, kc.float(), kc.float(), bt + 3, lens, 1.0, torch.empty_like(q))
    with pytest.raises(RuntimeError, match="contiguous"):
        ops.silu_mul(torch.randn(4, 6).t(), torch.randn(6, 4))
    with pytest.raises(RuntimeError, match="block id out of range"):
        ops.chunk_attention(q, kc.float(), kc.float(), torch.tensor([7], dtype=torch.int32), 2, 1.0, torch.empty_like(q))
    with pytest.raises(RuntimeError, match="covering ctx_len"):
        ops.chunk_attention(q, kc.float(), kc.float(), torch.tensor([0], dtype=torch.int32), 9, 1.0, torch.empty_like(q))


@needs_ops
@pytest.mark.timeout(60)
def test_fused_llama_forward_equals_plain():
    torch.manual_seed(4)
    cfg = LlamaConfig(vocab_size=50, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=64)
    model = Llama(cfg).eval()
    ids = torch.randint(0, 50, (20,))
    pos = torch.arange(20)
    with torch.inference_mode():
        ref = model(ids, positions=pos)
        fused = model(ids, positions=pos, attention=DenseCausalAttention(ops))
    torch.testing.assert_close(fused, ref, atol=1e-5, rtol=1e-4)


@needs_ops
@pytest.mark.timeout(60)
def test_fused_gpt_forward_equals_plain():
    from zeal.models.gpt import GPT, GPTConfig

    torch.manual_seed(5)
    model = GPT(GPTConfig(vocab_size=50, n_positions=64, n_embd=48, n_layer=2, n_head=4)).eval()
    ids, pos = torch.randint(0, 50, (20,)), torch.arange(20)
    with torch.inference_mode():
        ref = model(ids, positions=pos)
        fused = model(ids, positions=pos, attention=DenseCausalAttention(ops))
    torch.testing.assert_close(fused, ref, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(model(ids[None])[0], ref, atol=1e-5, rtol=1e-4)  # batched = flat
