"""``deepspeed.ops``: ``adam`` (``FusedAdam``, ``DeepSpeedCPUAdam``) as torch optimizers.
zeal compiles no DeepSpeed kernels; ``lamb``, ``transformer`` and the other op families
fail at import or use with one line saying so."""

from typing import Any

from zeal.deepspeed.ops import adam
from zeal.deepspeed.refusals import refuse

__all__ = ["adam"]

_REFUSED = {"transformer": "DeepSpeed's fused transformer kernels are not part of zeal; use zeal.models",
            "sparse_attention": "DeepSpeed's sparse attention kernels are not part of zeal",
            "op_builder": "zeal builds no DeepSpeed ops"}


def __getattr__(name: str) -> Any:
    if name in _REFUSED:
        return refuse(f"deepspeed.ops.{name}", _REFUSED[name])
    raise AttributeError(f"module 'deepspeed.ops' has no attribute {name!r}")
