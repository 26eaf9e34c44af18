"""The MoE apply-step: bind every MoE layer of a model to the mesh's expert-parallel group.

Run by ``zeal.initialize`` after tensor parallelism and before ZeRO: each
:class:`~zeal.moe.layer.MoE` keeps only this rank's experts (named by global index) and
takes ``mesh.ep`` for its all-to-alls. ZeRO then finds the expert parameters by their
marker and lays them out over ``mesh.edp``.
"""

from __future__ import annotations

from torch import nn

from zeal.config import ConfigError
from zeal.dist.mesh import Mesh
from zeal.moe.layer import MoE


def moe_layers(model: nn.Module) -> list[MoE]:
    """Every MoE layer of ``model``, in module order."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def model_ep_size(model: nn.Module) -> int:
    """The expert-parallel size the model's MoE layers ask for (1 without MoE); one size
    for the whole model."""
    sizes = {m.ep_size for m in moe_layers(model)}
    if len(sizes) > 1:
        raise ConfigError(f"MoE layers ask for different ep_size values {sorted(sizes)}; zeal builds one "
                          "expert-parallel group size per model")
    return sizes.pop() if sizes else 1


def apply_moe(model: nn.Module, mesh: Mesh) -> set[int]:
    """Bind each MoE layer to ``mesh.ep`` (its gate to ``mesh.sp`` under sequence
    parallelism: the sp group's chunks route as more data, the aux loss is taken over
    the whole sequences); returns the ids of the parameters dropped
    (other ranks' experts), which callers remove from their optimizer groups."""
    dropped: set[int] = set()
    for m in moe_layers(model):
        try:
            dropped |= {id(p) for p in m.bind(mesh.ep, mesh.ep_rank)}
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if mesh.sp_size > 1:  # routing stays per rank (its chunk); the aux loss is the whole sequences'
            m.deepspeed_moe.gate.sp = mesh.sp
    return dropped
