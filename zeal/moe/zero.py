"""ZeRO for expert parameters: the expert-data group handed to ZeRO as a CommGroup.

An expert lives on one ep rank and is replicated over that rank's expert-data
(``edp``) group. ZeRO knows nothing of experts: this module translates DeepSpeed's
marker on expert parameters (``allreduce = False``, :func:`~zeal.moe.layer.is_expert_param`)
and the buffers inside expert containers into one
:class:`~zeal.zero.groups.CommGroup` over ``mesh.edp``, which ``zeal.initialize`` gives
to ``apply_zero``. ZeRO then lays those parameters into units of their own, sharded
over ``edp``, while every other parameter stays over ``mesh.dp``:

* Gradients: the ep all-to-all's backward already summed, on the expert's rank, the
  gradient of every token routed to it from the whole ep group; reducing over ``edp``
  completes the sum over the data-parallel group, so the mean divides by the dp size
  (``mean_over``), not the edp size. Stage 3 reduce-scatters them over ``edp``.
* Stage 3 parameters: an expert unit is all-gathered over ``edp`` for its module's
  forward and backward (ZeRO++'s hpZ and qgZ apply to the non-expert units, qwZ to both).
* Gradient norm: stages 1–3 sum squared shard norms over ``dp`` (each expert shard is
  held by exactly one dp rank: dp = ep × edp); stage 0 holds whole local experts, whose
  squared norms are summed over ``ep`` (``spread``).
"""

from __future__ import annotations

from torch import nn

from zeal.dist.mesh import Mesh
from zeal.moe.layer import Experts, is_expert_param
from zeal.zero.groups import CommGroup


def expert_buffer_ids(model: nn.Module) -> set[int]:
    """Ids of the buffers inside expert containers: replicated over edp only."""
    return {id(b) for m in model.modules() if isinstance(m, Experts) for b in m.buffers()}


def expert_comm_group(model: nn.Module, mesh: Mesh) -> CommGroup | None:
    """The expert parameters (DeepSpeed's marker) and buffers of ``model`` as one
    CommGroup over ``mesh.edp``; None when the model has none."""
    params = frozenset(id(p) for p in model.parameters() if is_expert_param(p))
    if not params:
        return None
    return CommGroup(params, mesh.edp, mean_over=mesh.dp_size, spread=mesh.ep,
                     buffers=frozenset(expert_buffer_ids(model)), name="experts")
