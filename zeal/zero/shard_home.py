"""Where a ZeRO-3 unit's shard lives between uses: in device memory (``unit.shard``), in
host memory (``offload_param.device: cpu`` on an accelerator, as DeepSpeed's ZeRO-3
parameter offload), or in a swap file on disk (``offload_param.device: nvme``,
ZeRO-Infinity).

``get(u)`` returns the shard as a 1-D device tensor valid until ``done(u)``; ``put(u, x)``
replaces its values from device values, ``put_host(u, x, staging)`` from host values (a
CPU optimizer's fp32 masters). Homes that keep the shard off the device (``lends``) leave
``unit.shard`` empty and cross the boundary through a
:class:`~zeal.zero.offload.staging.Staging` (device and pinning are its parameters). The
in-memory home is a thin veneer over ``unit.shard``, so the stage-3 code has one path for all.
"""

from __future__ import annotations

import torch

from zeal.zero.offload.param_swap import ParamSwapper
from zeal.zero.offload.staging import Staging
from zeal.zero.units import FlatUnit


class MemoryShards:
    on_disk = False
    lends = False  # get() is unit.shard itself

    def get(self, u: FlatUnit) -> torch.Tensor:
        return u.shard

    def done(self, u: FlatUnit) -> None:
        pass

    def adopt(self, u: FlatUnit) -> None:
        pass

    def put(self, u: FlatUnit, values: torch.Tensor) -> None:
        if values.data_ptr() != u.shard.data_ptr():
            u.shard.copy_(values)

    def put_host(self, u: FlatUnit, values: torch.Tensor, staging: Staging) -> None:
        staging.upload(u.shard, values, key=("up", u.index))

    def cpu_bytes(self, units: list[FlatUnit]) -> int:
        return sum(u.nbytes_shard() for u in units)

    def disk_bytes(self) -> int:
        return 0

    def close(self) -> None:
        pass


class HostShards:
    """Shards in host memory (pinned when asked and on CUDA), uploaded just before each
    gather; updated values are downloaded into them."""

    on_disk = False
    lends = True

    def __init__(self, staging: Staging) -> None:
        self.staging = staging
        self.host: dict[int, torch.Tensor] = {}

    def adopt(self, u: FlatUnit) -> None:
        """Move the unit's (freshly initialised) shard to host memory."""
        self.host[u.index] = self.staging.to_host(u.shard)
        self.staging.wait_host()
        u.shard = torch.empty(0, dtype=u.dtype, device=u.device)

    def get(self, u: FlatUnit) -> torch.Tensor:
        return self.staging.to_device(self.host[u.index])

    def done(self, u: FlatUnit) -> None:
        pass  # the device copy lives as long as its last user (the gather holds it)

    def put(self, u: FlatUnit, values: torch.Tensor) -> None:
        self.staging.download(self.host[u.index], values.to(u.dtype))

    def put_host(self, u: FlatUnit, values: torch.Tensor, staging: Staging) -> None:
        self.host[u.index].copy_(values.reshape(-1))

    def cpu_bytes(self, units: list[FlatUnit]) -> int:
        return sum(t.numel() * t.element_size() for t in self.host.values())

    def disk_bytes(self) -> int:
        return 0

    def close(self) -> None:
        self.host.clear()


class DiskShards:
    """Shards in swap files, read into a bounded pool of host buffers just before a gather
    and uploaded to the device through ``staging`` (no boundary on a CPU device)."""

    on_disk = True
    lends = True

    def __init__(self, units: list[FlatUnit], nvme_path: str, buffer_count: int, buffer_size: int,
                 staging: Staging | None = None) -> None:
        sizes = {str(u.index): u.shard_numel for u in units}
        dtype = units[0].dtype if units else torch.float32
        self.staging = staging or Staging(units[0].device if units else "cpu")
        self.swapper = ParamSwapper(sizes, nvme_path, buffer_count=buffer_count, buffer_size=buffer_size,
                                    dtype=dtype)

    def adopt(self, u: FlatUnit) -> None:
        """Move the unit's (freshly initialised) shard out of memory."""
        host = self.staging.to_host(u.shard)
        self.staging.wait_host()
        self.swapper.write(str(u.index), host)
        u.shard = torch.empty(0, dtype=u.dtype, device=u.device)

    def get(self, u: FlatUnit) -> torch.Tensor:
        return self.staging.to_device(self.swapper.fetch(str(u.index)))

    def done(self, u: FlatUnit) -> None:
        self.swapper.release(str(u.index))

    def put(self, u: FlatUnit, values: torch.Tensor) -> None:
        host = self.staging.to_host(values, dtype=u.dtype)
        self.staging.wait_host()  # the swap store's threads read host memory
        self.swapper.write(str(u.index), host)

    def put_host(self, u: FlatUnit, values: torch.Tensor, staging: Staging) -> None:
        self.swapper.write(str(u.index), values.to(u.dtype))

    def cpu_bytes(self, units: list[FlatUnit]) -> int:
        return self.swapper.cpu_bytes

    def disk_bytes(self) -> int:
        return self.swapper.disk_bytes

    def close(self) -> None:
        self.swapper.close()
