"""DeepSpeed-TED: MoE layers under tensor parallelism (tensor × expert × data).

``"tensor_parallel": {"autotp_size": T}`` splits a model with :class:`~zeal.moe.MoE`
layers as follows (the apply-step is :func:`zeal.parallel.tensor.apply_tensor_parallel`,
which runs :func:`moe_tensor_parallel` for the MoE parts: training and tensor-parallel
serving pass it in ``extra_rules``):

* attention and dense MLPs: split as in any model (column, then row);
* the router ``wg`` (and PR-MoE's ``coefficient``): replicated on every tp rank. Its
  input (the block's hidden states) and everything downstream of the MoE layer are
  replicated, so its gradient is the same on every tp rank;
* each expert's MLP: split column / row over tp like a dense MLP (one all-reduce of its
  output forward, one of its input gradient backward). Splitting (rather than keeping
  whole experts on every tp rank, each computing 1/T of the tokens) keeps 1/T of every
  expert's weights and optimizer state per rank and needs no expert-gradient reduction
  over tp: an expert's gradient stays reduced over the expert-data group only;
* **duplicate-token dropping**: the ``[E, C, d]`` buffer entering the layer's
  all-to-all is the same on every tp rank (its tokens are replicated), so each tp rank
  sends only its 1/T slice of the capacity dimension through the expert-parallel
  all-to-all and the slices are all-gathered over tp after it; the experts' output is
  sliced the same way before the return all-to-all and gathered after it. The all-to-all
  bytes per rank drop to 1/T; the results do not change. The capacity is padded up to a
  multiple of T for the exchange only (empty rows, trimmed after), so routing does not
  depend on T. The sort dispatch builds the same ``[E, C, d]`` buffer, so both dispatch
  modes drop along the capacity dimension.

The token mappings (``drop_tokens`` / ``gather_tokens``) are in :mod:`zeal.moe.mappings`.
"""

from __future__ import annotations

from torch import nn

from zeal.dist.comm import Comm
from zeal.moe.layer import MoE
from zeal.parallel.tensor import _Pair


# -- the apply-step's MoE part ---------------------------------------------------------------
def _sequential_expert(mod: nn.Module) -> tuple[nn.Linear, nn.Linear] | None:
    """An ``nn.Sequential`` expert: a Linear, parameter-free modules (activations,
    dropout), a Linear; its (column, row) linears."""
    if not isinstance(mod, nn.Sequential):
        return None
    layers = list(mod)
    if (len(layers) >= 2 and isinstance(layers[0], nn.Linear) and isinstance(layers[-1], nn.Linear)
            and all(not any(True for _ in m.parameters()) for m in layers[1:-1])):
        return layers[0], layers[-1]
    return None


def moe_tensor_parallel(model: nn.Module, comm: Comm, rank: int, found: set[int]) -> tuple[list, set[int]]:
    """The MoE part of the tensor-parallel apply-step. Binds every MoE layer to the tp
    group (duplicate-token dropping) and returns ``(pairs, replicated)``: split pairs for
    the experts that the dense family rules did not find (``found``: ids of the modules
    already in a pair; an ``nn.Sequential`` Linear → activation → Linear expert is split
    column / row), and the ids of the linears kept whole (routers, PR-MoE coefficients)."""
    pairs, replicated = [], set()
    for lname, layer in model.named_modules():
        if not isinstance(layer, MoE):
            continue
        inner = layer.deepspeed_moe
        inner.tp, inner.tp_rank = comm, rank
        replicated.add(id(inner.gate.wg))
        if layer.use_residual:
            replicated.add(id(layer.coefficient))
        for name, mod in layer.named_modules(prefix=lname):
            if id(mod) in found:
                continue
            seq = _sequential_expert(mod)
            if seq is not None:
                col, row = seq
                pairs.append(_Pair(name, mod, [(col, 1)], row, {"intermediate size": col.out_features}, ()))
    return pairs, replicated

