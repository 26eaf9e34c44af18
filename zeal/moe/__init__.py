"""Mixture of experts: DeepSpeed's MoE layer, gating, dispatch and expert parallelism.

Two sides, two places in the layer order (tests/test_layers.py):

* the layer, a model component: :mod:`~zeal.moe.layer` (:class:`MoE`, the experts),
  :mod:`~zeal.moe.gating`, :mod:`~zeal.moe.dispatch`, :mod:`~zeal.moe.mappings` and
  :mod:`~zeal.moe.recompute`. They import only ``zeal.dist`` and sit below ``zeal.models``,
  whose MoE blocks hold them;
* the apply side, run by ``zeal.initialize``: :mod:`~zeal.moe.apply` (bind each layer to
  the mesh's ep group), :mod:`~zeal.moe.zero` (the experts' ZeRO group),
  :mod:`~zeal.moe.tensor` (the experts' tensor-parallel split) and :mod:`~zeal.moe.layout`
  (checkpoint names). It sits above ``zeal.parallel`` and ``zeal.zero``.

Importing a layer module runs this file, so this file imports only the layer side; the
apply side's names load on first use (``from zeal.moe import apply_moe`` still works).
"""

from typing import Any

from zeal.moe.gating import Routing, TopKGate, capacity, top1gating, top2gating
from zeal.moe.layer import MoE, is_expert_param

__all__ = ["MoE", "Routing", "TopKGate", "apply_moe", "capacity", "is_expert_param", "model_ep_size",
           "moe_layers", "moe_tensor_parallel", "top1gating", "top2gating"]


def __getattr__(name: str) -> Any:
    # the apply side, loaded when first asked for (a model holding MoE layers never loads it)
    if name in ("apply_moe", "model_ep_size", "moe_layers"):
        from zeal.moe import apply

        return getattr(apply, name)
    if name == "moe_tensor_parallel":
        from zeal.moe.tensor import moe_tensor_parallel

        return moe_tensor_parallel
    raise AttributeError(f"module 'zeal.moe' has no attribute {name!r}")
