"""Where a ZeRO-3 unit's shard lives between uses: in memory (``unit.shard``) or in
a swap file on disk (``offload_param.device: nvme``, ZeRO-Infinity).

``get(u)`` returns the shard as a 1-D tensor valid until ``done(u)``; ``put(u, x)``
replaces its values. The in-memory home is a thin veneer over ``unit.shard``, so the
stage-3 code has one path for both.
"""

from __future__ import annotations

import torch

from zeal.zero.offload.param_swap import ParamSwapper
from zeal.zero.units import FlatUnit


class MemoryShards:
    on_disk = False

    def get(self, u: FlatUnit) -> torch.Tensor:
        return u.shard

    def done(self, u: FlatUnit) -> None:
        pass

    def adopt(self, u: FlatUnit) -> None:
        pass

    def put(self, u: FlatUnit, values: torch.Tensor) -> None:
        if values.data_ptr() != u.shard.data_ptr():
            u.shard.copy_(values)

    def cpu_bytes(self, units: list[FlatUnit]) -> int:
        return sum(u.nbytes_shard() for u in units)

    def disk_bytes(self) -> int:
        return 0

    def close(self) -> None:
        pass


class DiskShards:
    """Shards in swap files, read into a bounded pool of buffers just before a gather."""

    on_disk = True

    def __init__(self, units: list[FlatUnit], nvme_path: str, buffer_count: int, buffer_size: int) -> None:
        sizes = {str(u.index): u.shard_numel for u in units}
        dtype = units[0].dtype if units else torch.float32
        self.swapper = ParamSwapper(sizes, nvme_path, buffer_count=buffer_count, buffer_size=buffer_size,
                                    dtype=dtype)

    def adopt(self, u: FlatUnit) -> None:
        """Move the unit's (freshly initialised) shard out of memory."""
        self.swapper.write(str(u.index), u.shard)
        u.shard = torch.empty(0, dtype=u.dtype, device=u.device)

    def get(self, u: FlatUnit) -> torch.Tensor:
        return self.swapper.fetch(str(u.index))

    def done(self, u: FlatUnit) -> None:
        self.swapper.release(str(u.index))

    def put(self, u: FlatUnit, values: torch.Tensor) -> None:
        self.swapper.write(str(u.index), values.to(u.dtype))

    def cpu_bytes(self, units: list[FlatUnit]) -> int:
        return self.swapper.cpu_bytes

    def disk_bytes(self) -> int:
        return self.swapper.disk_bytes

    def close(self) -> None:
        self.swapper.close()
