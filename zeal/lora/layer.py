"""The LoRA linear: a frozen base ``W (out, in)`` (full precision or block-quantized)
plus a trainable low-rank update, ``y = W x + b + scaling * B (A dropout(x))``.

:class:`LoraLinear` is an ``nn.Linear`` that keeps the base module's Parameter objects
and names (``q_proj.weight``, ``q_proj.bias``), so checkpoints, tensor parallelism and
Hugging Face export see the base as before; the factors are child modules
``q_proj.lora_A`` / ``q_proj.lora_B`` holding ``weight (r, in)`` / ``weight (out, r)``:
PEFT's names without its adapter segment, and modules of their own so that ZeRO-3
gathers them through their own forward hooks. A quantized base (QLoRA) has no
``weight`` Parameter: codes and scales are buffers (:mod:`zeal.lora.quant`),
dequantized in forward and again in backward (only the codes are saved for backward,
never the dequantized matrix).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from zeal.dist.regions import copy_to_tp, reduce_from_tp
from zeal.lora.quant import dequantize, quantize

__all__ = ["LoraFactor", "LoraLinear", "lora_a_tp"]


class LoraFactor(nn.Module):
    """One low-rank factor, ``x @ weight.T`` (a bare module, not an ``nn.Linear``:
    tensor parallelism and "all-linear" matching look for linears and must not see it)."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(out_features, in_features, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class _QuantLinear(torch.autograd.Function):
    """``x @ dequant(codes).T`` saving only the codes and scales for backward; no gradient
    for the frozen weight."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, kind: str):  # noqa: D102
        ctx.save_for_backward(codes, scale)
        ctx.kind = kind
        return F.linear(x, dequantize(codes, scale, kind, x.dtype))

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # noqa: D102
        codes, scale = ctx.saved_tensors
        w = dequantize(codes, scale, ctx.kind, g.dtype)
        return g @ w, None, None, None


class LoraLinear(nn.Linear):
    """``nn.Linear`` with a frozen base and a LoRA update (see the module docstring).

    ``adapter_enabled = False`` computes the base alone (the RLHF reference policy).
    ``scaling`` is a Python float: it never enters the optimizer or a dtype cast.
    Under tensor parallelism (:func:`zeal.lora.tp.split_lora_for_tp`) ``tp_comm`` and
    ``tp_kind`` say how the update is combined across tp ranks."""

    def __init__(self, base: nn.Linear, r: int, scaling: float, dropout: float = 0.0,
                 quantize_base: str = "none", block: int = 64) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        w = base.weight
        self.quant = quantize_base
        if quantize_base == "none":
            self.weight = w  # the base's Parameter object: its identity and name survive
        else:
            if w.is_meta:
                raise ValueError("lora.quantize_base needs the base weights loaded (the model is on the meta device)")
            codes, scale = quantize(w, quantize_base, block)
            self.register_parameter("weight", None)
            self.register_buffer("qweight", codes)
            self.register_buffer("qscale", scale)
        self.register_parameter("bias", base.bias)
        device = torch.device("cpu") if w.is_meta else w.device
        dtype = w.dtype if w.is_floating_point() else torch.float32
        self.lora_A = LoraFactor(self.in_features, r, dtype, device)
        self.lora_B = LoraFactor(r, self.out_features, dtype, device)
        self.scaling = float(scaling)
        # the scale in the state dict (checkpoints, ``export --merge-lora``) as a fixed-point
        # integer: a float buffer would be cast to the compute dtype (bf16 rounds alpha/sqrt(r))
        self.register_buffer("lora_scaling_q32", torch.tensor(round(self.scaling * 2**32), dtype=torch.int64))
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.adapter_enabled = True
        self.tp_mode: str | None = None  # "column" / "row" under tensor parallelism
        self.tp_comm = None

    @property
    def r(self) -> int:
        return self.lora_A.weight.shape[0]

    def reset_parameters(self) -> None:
        """The base's init (ZeRO's meta-device materialisation calls it); the factors are
        initialised by :meth:`init_adapter` when the adapter is created."""
        if self.weight is not None:
            super().reset_parameters()

    @torch.no_grad()
    def init_adapter(self, how: str, generator: torch.Generator | None = None) -> None:
        """PEFT's initialisations: ``default`` A Kaiming-uniform (a = sqrt 5), B = 0;
        ``gaussian`` A ~ N(0, 1/r), B = 0; ``zeros_a`` A = 0, B Kaiming-uniform (tests:
        a non-zero B with a zero product)."""
        a, b = self.lora_A.weight, self.lora_B.weight

        def kaiming(t: torch.Tensor) -> None:  # kaiming_uniform_(a=sqrt(5)): U(-1/sqrt(fan_in), 1/sqrt(fan_in))
            bound = 1.0 / math.sqrt(t.shape[1])
            t.copy_(torch.rand(t.shape, generator=generator, dtype=torch.float32) * 2 * bound - bound)

        if how == "default":
            kaiming(a)
            b.zero_()
        elif how == "gaussian":
            a.copy_(torch.randn(a.shape, generator=generator) / self.r)
            b.zero_()
        elif how == "zeros_a":
            a.zero_()
            kaiming(b)
        else:
            raise ValueError(f"lora.init {how!r} is not supported (default, gaussian, zeros_a)")

    def base_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The base weight ``(out, in)`` (dequantized for a quantized base)."""
        if self.weight is not None:
            return self.weight if dtype is None else self.weight.to(dtype)
        return dequantize(self.qweight, self.qscale, self.quant, dtype or torch.float32)

    def _base(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is not None:
            return F.linear(x, self.weight)
        return _QuantLinear.apply(x, self.qweight, self.qscale, self.quant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._base(x)
        if self.adapter_enabled:
            if self.tp_mode is None:
                u = self.lora_A(self.lora_dropout(x))  # (..., r)
            else:  # the low-rank activation combined over tp (see zeal.lora.tp)
                u = lora_a_tp(self, x)
            y_lora = self.lora_B(u) * self.scaling
        if self.tp_mode == "row":
            y = reduce_from_tp(y, self.tp_comm)
        if self.adapter_enabled:
            y = y + y_lora
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, r={self.r}, "
                f"scaling={self.scaling:g}, quant={self.quant}")


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, factor: float) -> torch.Tensor:  # noqa: D102
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # noqa: D102
        return g * ctx.factor, None


def lora_a_tp(mod: LoraLinear, x: torch.Tensor) -> torch.Tensor:
    """``u = A x`` of a tp-split adapter, combined over tp (the math: :mod:`zeal.lora.tp`):
    a row-split ``A`` all-reduces its partial ``u``; a column-split base all-reduces ``u``'s
    gradient in backward, ``x``'s share of it scaled by ``1/T``."""
    if mod.tp_mode == "row":
        return reduce_from_tp(mod.lora_A(mod.lora_dropout(x)), mod.tp_comm)
    x = _ScaleGrad.apply(x, 1.0 / mod.tp_comm.size)
    return copy_to_tp(mod.lora_A(mod.lora_dropout(x)), mod.tp_comm)
