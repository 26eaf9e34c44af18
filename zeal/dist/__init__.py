"""Who talks to whom: the mesh builds every process group once and hands out accounted Comms."""

from zeal.dist.comm import Comm, CommStats
from zeal.dist.context import DistContext, init_distributed
from zeal.dist.mesh import Mesh, build_mesh, layout

__all__ = ["Comm", "CommStats", "DistContext", "Mesh", "build_mesh", "init_distributed", "layout"]
