"""Who talks to whom: process groups built once and passed explicitly."""

from zeal.dist.comm import Comm, CommStats
from zeal.dist.context import DistContext, init_distributed

__all__ = ["Comm", "CommStats", "DistContext", "init_distributed"]
