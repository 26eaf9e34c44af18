"""The ``process`` section: settings that hold for the whole process (memory
allocator, CPU threads). Applied once, by :func:`zeal.utils.process.apply_process_settings`,
before the command builds a model; importing zeal changes none of them."""

from __future__ import annotations

from pydantic import Field

from zeal.config.schema import Section


class ProcessConfig(Section):
    """Process-wide settings of ``zeal train`` and ``zeal serve`` (the same defaults for both)."""

    transparent_hugepages: bool = Field(
        True, description="Put CPU tensors of 2 MB and more on transparent huge pages (torch's "
        "THP_MEM_ALLOC_ENABLE=1): ZeRO-3 gathers and fresh gradients then cost 512x fewer page faults "
        "(124M stage 3: 3.45 -> 2.9 s per step at the same peak RSS). THP_MEM_ALLOC_ENABLE set in the "
        "environment wins; torch reads it at its first CPU allocation.")
    num_threads: int | None = Field(
        None, ge=1, description="torch intra-op CPU threads; None = torch's choice (ranks started by "
        "zeal train / zeal launch get an equal share of the cores through OMP_NUM_THREADS).")
    malloc_release_threshold: int | None = Field(
        None, ge=0, description="glibc mmap and trim thresholds, in bytes: freed allocations this large "
        "go back to the OS at once. None = glibc's own (the training engine sets 1 MiB itself for ZeRO "
        "stage 3 and the disk tier). No effect with other C libraries.")
