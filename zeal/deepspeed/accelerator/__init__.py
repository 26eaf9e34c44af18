"""``deepspeed.accelerator``: :func:`get_accelerator` — the device a script runs on.

One :class:`Accelerator` answers for CUDA when torch sees a GPU and for the CPU
otherwise, with DeepSpeed's method names (``device_name``, ``current_device_name``,
``set_device``, ``communication_backend_name``, ``manual_seed``, memory queries,
``pin_memory``, ``on_accelerator`` ...). ``DS_ACCELERATOR=cpu`` forces the CPU, as in
DeepSpeed. Names DeepSpeed has and zeal does not (op builders, CUDA graphs) fail at the
call with one line saying so.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from zeal.deepspeed.refusals import Refused

__all__ = ["Accelerator", "get_accelerator", "is_current_accelerator_supported", "set_accelerator"]

_REFUSED = {
    "op_builder_dir": "zeal builds no DeepSpeed ops; its optimizers are torch's (deepspeed.ops.adam maps to them)",
    "create_op_builder": "zeal builds no DeepSpeed ops; use deepspeed.ops.adam.FusedAdam / DeepSpeedCPUAdam",
    "get_op_builder": "zeal builds no DeepSpeed ops; use deepspeed.ops.adam.FusedAdam / DeepSpeedCPUAdam",
    "build_extension": "zeal builds no DeepSpeed ops",
    "create_graph": "CUDA graphs: use torch.cuda.CUDAGraph directly",
    "capture_to_graph": "CUDA graphs: use torch.cuda.graph directly",
    "replay_graph": "CUDA graphs: use CUDAGraph.replay() directly",
    "get_compile_backend": "zeal does not route torch.compile through the accelerator; call torch.compile",
    "set_compile_backend": "zeal does not route torch.compile through the accelerator; call torch.compile",
}


class Accelerator:
    """DeepSpeed's accelerator interface over ``torch.cuda`` (GPU) or the CPU."""

    def __init__(self, name: str | None = None) -> None:
        forced = name or os.environ.get("DS_ACCELERATOR")
        if forced not in (None, "cpu", "cuda"):
            raise ValueError(f"DS_ACCELERATOR={forced!r}: zeal runs on 'cuda' or 'cpu'")
        self._name = forced or ("cuda" if torch.cuda.is_available() else "cpu")
        self._cuda = self._name == "cuda"

    def __getattr__(self, name: str) -> Any:
        if name in _REFUSED:
            raise Refused(f"get_accelerator().{name}", _REFUSED[name])
        raise AttributeError(f"get_accelerator() has no attribute {name!r}")

    def __repr__(self) -> str:
        return f"Accelerator({self._name!r})"

    # -- devices --------------------------------------------------------------------------
    def device_name(self, device_index: int | None = None) -> str:
        """``'cuda'`` / ``'cuda:N'`` on a GPU, ``'cpu'`` on the CPU."""
        if self._cuda and device_index is not None:
            return f"cuda:{device_index}"
        return self._name

    def device(self, device_index: int | None = None) -> Any:
        """``torch.cuda.device(index)`` on a GPU; None on the CPU (as DeepSpeed's)."""
        return torch.cuda.device(device_index) if self._cuda else None

    def set_device(self, device_index: int) -> None:
        """Make ``device_index`` current (nothing to do on the CPU)."""
        if self._cuda:
            torch.cuda.set_device(device_index)

    def current_device(self) -> int:
        """The current device index (the local rank on the CPU)."""
        return torch.cuda.current_device() if self._cuda else int(os.environ.get("LOCAL_RANK", 0))

    def current_device_name(self) -> str:
        """``'cuda:N'`` for the current GPU; ``'cpu'``."""
        return f"cuda:{torch.cuda.current_device()}" if self._cuda else "cpu"

    def device_count(self) -> int:
        """GPUs visible; on the CPU the launcher's processes per node (LOCAL_SIZE), else 1."""
        if self._cuda:
            return torch.cuda.device_count()
        return int(os.environ.get("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", 1)))

    def is_available(self) -> bool:
        return torch.cuda.is_available() if self._cuda else True

    def synchronize(self, device_index: int | None = None) -> None:
        """Wait for the device's queued work (nothing to wait for on the CPU)."""
        if self._cuda:
            torch.cuda.synchronize(device_index)

    def is_synchronized_device(self) -> bool:
        """True on the CPU: work is done when the call returns."""
        return not self._cuda

    def use_host_timers(self) -> bool:
        return not self._cuda

    def resolves_data_dependency(self) -> bool:
        return not self._cuda

    def handles_memory_backpressure(self) -> bool:
        return not self._cuda

    def communication_backend_name(self) -> str:
        """``'nccl'`` on GPUs, ``'gloo'`` on the CPU."""
        return "nccl" if self._cuda else "gloo"

    def visible_devices_envs(self) -> list[str]:
        return ["CUDA_VISIBLE_DEVICES"] if self._cuda else []

    def set_visible_devices_envs(self, current_env: dict, local_accelerator_ids: list[int]) -> None:
        for env in self.visible_devices_envs():
            current_env[env] = ",".join(map(str, local_accelerator_ids))

    def export_envs(self) -> list[str]:
        return ["NCCL"] if self._cuda else []

    # -- random numbers -------------------------------------------------------------------
    def random(self) -> Any:
        return torch.random

    def manual_seed(self, seed: int) -> None:
        """Seed this device's generator (the CPU's on the CPU)."""
        if self._cuda:
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        """Seed every device's generator."""
        if self._cuda:
            torch.cuda.manual_seed_all(seed)
        else:
            torch.manual_seed(seed)

    def initial_seed(self) -> int:
        return torch.cuda.initial_seed() if self._cuda else torch.initial_seed()

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        if self._cuda:
            return torch.cuda.get_rng_state(device_index if device_index is not None else "cuda")
        return torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.set_rng_state(new_state, device_index if device_index is not None else "cuda")
        else:
            torch.set_rng_state(new_state)

    def default_generator(self, device_index: int) -> torch.Generator:
        return torch.cuda.default_generators[device_index] if self._cuda else torch.default_generator

    # -- streams and events ---------------------------------------------------------------
    @property
    def Stream(self) -> Any:  # noqa: N802 - DeepSpeed's name
        return torch.cuda.Stream if self._cuda else None

    def stream(self, stream: Any) -> Any:
        import contextlib

        return torch.cuda.stream(stream) if self._cuda else contextlib.nullcontext()

    def current_stream(self, device_index: int | None = None) -> Any:
        return torch.cuda.current_stream(device_index) if self._cuda else None

    def default_stream(self, device_index: int | None = None) -> Any:
        return torch.cuda.default_stream(device_index) if self._cuda else None

    @property
    def Event(self) -> Any:  # noqa: N802 - DeepSpeed's name
        return torch.cuda.Event if self._cuda else None

    def is_current_stream_capturing(self) -> bool:
        return bool(self._cuda and torch.cuda.is_current_stream_capturing())

    # -- memory ---------------------------------------------------------------------------
    def empty_cache(self) -> None:
        if self._cuda:
            torch.cuda.empty_cache()

    def memory_allocated(self, device_index: int | None = None) -> int:
        """Bytes held by tensors (GPU); on the CPU this process's resident memory."""
        return torch.cuda.memory_allocated(device_index) if self._cuda else _rss()

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        """Peak of :meth:`memory_allocated` (CPU: this process's peak resident memory)."""
        return torch.cuda.max_memory_allocated(device_index) if self._cuda else _peak_rss()

    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(device_index)

    def memory_cached(self, device_index: int | None = None) -> int:
        return self.memory_reserved(device_index)

    def max_memory_cached(self, device_index: int | None = None) -> int:
        return self.max_memory_reserved(device_index)

    def reset_max_memory_cached(self, device_index: int | None = None) -> None:
        self.reset_max_memory_allocated(device_index)

    def memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_reserved(device_index) if self._cuda else _rss()

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_reserved(device_index) if self._cuda else _peak_rss()

    def memory_stats(self, device_index: int | None = None) -> dict:
        if self._cuda:
            return torch.cuda.memory_stats(device_index)
        return {"allocated_bytes.all.current": _rss(), "allocated_bytes.all.peak": _peak_rss()}

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        self.reset_max_memory_allocated(device_index)

    def total_memory(self, device_index: int | None = None) -> int:
        """The device's memory (CPU: the machine's physical memory), bytes."""
        if self._cuda:
            return torch.cuda.get_device_properties(device_index or torch.cuda.current_device()).total_memory
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def available_memory(self, device_index: int | None = None) -> int:
        """Free bytes on the device (CPU: the machine's available memory)."""
        if self._cuda:
            return torch.cuda.mem_get_info(device_index)[0]
        return _available_ram()

    # -- data types -----------------------------------------------------------------------
    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported() if self._cuda else True

    def is_fp16_supported(self) -> bool:
        """fp16 on GPUs; on the CPU zeal emulates it (True, as zeal accepts fp16 configs)."""
        return True

    def is_fp64_supported(self) -> bool:
        return True

    def supported_dtypes(self) -> list[torch.dtype]:
        out = [torch.float32, torch.float16]
        return out + [torch.bfloat16] if self.is_bf16_supported() else out

    def is_triton_supported(self) -> bool:
        return False

    # -- tensors --------------------------------------------------------------------------
    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1, **_: Any) -> torch.Tensor:
        """Page-locked copy of ``tensor`` on a GPU machine; on the CPU the tensor itself."""
        return tensor.pin_memory() if self._cuda else tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return bool(self._cuda and tensor.is_pinned())

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lives on this accelerator's device type."""
        return tensor.device.type == self._name

    def lazy_call(self, callback: Any) -> Any:
        return torch.cuda._lazy_call(callback) if self._cuda else callback()

    def range_push(self, msg: str, *args: Any, **kwargs: Any) -> None:
        if self._cuda:
            torch.cuda.nvtx.range_push(msg)

    def range_pop(self, *args: Any, **kwargs: Any) -> None:
        if self._cuda:
            torch.cuda.nvtx.range_pop()

    # tensor types, as DeepSpeed exposes them
    @property
    def FloatTensor(self) -> Any:  # noqa: N802
        return torch.cuda.FloatTensor if self._cuda else torch.FloatTensor

    @property
    def HalfTensor(self) -> Any:  # noqa: N802
        return torch.cuda.HalfTensor if self._cuda else torch.HalfTensor

    @property
    def BFloat16Tensor(self) -> Any:  # noqa: N802
        return torch.cuda.BFloat16Tensor if self._cuda else torch.BFloat16Tensor

    @property
    def LongTensor(self) -> Any:  # noqa: N802
        return torch.cuda.LongTensor if self._cuda else torch.LongTensor

    @property
    def IntTensor(self) -> Any:  # noqa: N802
        return torch.cuda.IntTensor if self._cuda else torch.IntTensor

    @property
    def ByteTensor(self) -> Any:  # noqa: N802
        return torch.cuda.ByteTensor if self._cuda else torch.ByteTensor

    @property
    def DoubleTensor(self) -> Any:  # noqa: N802
        return torch.cuda.DoubleTensor if self._cuda else torch.DoubleTensor


def _rss() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def _peak_rss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _available_ram() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


_current: Accelerator | None = None


def get_accelerator() -> Accelerator:
    """The process's accelerator (built once)."""
    global _current
    if _current is None:
        _current = Accelerator()
    return _current


def set_accelerator(accel_obj: Accelerator) -> None:
    """Replace the process's accelerator (DeepSpeed's hook for tests)."""
    global _current
    _current = accel_obj


def is_current_accelerator_supported() -> bool:
    return get_accelerator()._name in ("cuda", "cpu")
