"""Fake quantization: values against the formula, straight-through gradient, zeros stay zero."""

import torch

from zeal.compression.nm import nm_project
from zeal.compression.quant import dequantize, fake_quant, fake_quant_activation, quantize


def test_per_channel_int8_matches_the_formula():
    w = torch.tensor([[0.5, -1.27, 0.01, 0.0], [2.0, 1.0, -0.5, 0.25]])
    q, s = quantize(w, 8)
    assert torch.allclose(s.view(-1), torch.tensor([1.27 / 127, 2.0 / 127]))
    assert q.tolist() == [[50, -127, 1, 0], [127, 64, -32, 16]]  # round(v / s), ties to even
    assert torch.allclose(dequantize(q, s), q.float() * s)


def test_int4_groups_and_ste_forward_backward():
    torch.manual_seed(0)
    w = torch.randn(4, 16, requires_grad=True)
    y = fake_quant(w, 4, group_size=8)
    q, s = quantize(w, 4, 8)
    assert s.shape == (4, 2) and int(q.max()) <= 7 and int(q.min()) >= -8
    assert torch.equal(y.detach(), dequantize(q, s))
    assert len(torch.unique(y.detach()[0, :8])) <= 15
    g = torch.randn(4, 16)
    y.backward(g)
    assert torch.equal(w.grad, g)  # straight-through: the gradient passes unchanged
    x = torch.randn(3, 5, requires_grad=True)
    xa = fake_quant_activation(x, 8)
    assert float((xa - x).detach().abs().max()) <= float(x.detach().abs().max()) / 127 / 2 + 1e-6
    xa.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))


def test_sparse_zeros_stay_zero_after_quantization():
    torch.manual_seed(0)
    w = nm_project(torch.randn(8, 32), 2, 4)
    for bits, group in ((8, None), (4, None), (4, 16)):
        y = fake_quant(w, bits, group)
        assert bool((y[w == 0] == 0).all())
