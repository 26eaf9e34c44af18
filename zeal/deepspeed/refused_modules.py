"""DeepSpeed modules zeal does not have, importable under the switch.

``from deepspeed.ops.sparse_attention import FixedSparsityConfig`` at the top of a script
that uses it only behind a flag must not stop the script: for a module that DeepSpeed
0.19.8 has (``modules`` in ``ds_0_19_8_names.json``) and ``zeal.deepspeed`` does not,
the switch (:mod:`zeal.deepspeed.switch`) loads a stand-in whose every public name is a
:class:`~zeal.deepspeed.refusals.RefusedName`: the import works, the first use raises one
line naming the DeepSpeed API and what to use in zeal instead."""

from __future__ import annotations

import types
from typing import Any

from zeal.deepspeed.refusals import RefusedName, deepspeed_names, reason_by_prefix

_NO_KERNELS = "zeal compiles no DeepSpeed kernels"
REASONS = {
    "ops.sparse_attention*": "DeepSpeed's sparse attention kernels are not part of zeal; use the model's own "
                             "attention (torch SDPA)",
    "ops.transformer*": "DeepSpeed's fused transformer kernels are not part of zeal; use zeal.models or the "
                        "Hugging Face model as it is",
    "ops.lion*": "zeal has no Lion optimizer; use the config's AdamW or pass a torch optimizer",
    "ops.*": _NO_KERNELS,
    "module_inject*": "zeal applies tensor parallelism from the config (tensor_parallel.autotp_size)",
    "runtime.domino*": "zeal has no Domino tensor-parallel overlap; use tensor_parallel.autotp_size",
    "runtime.sequence_parallel*": "zeal's Ulysses sequence parallelism is the config's sequence_parallel_size "
                                  "(zeal shards the sequence itself)",
    "runtime.data_pipeline.data_sampling*": "DeepSpeed's data sampling (curriculum, dynamic batching) is not in "
                                            "zeal; build the DataLoader in the script",
    "runtime.data_pipeline.curriculum_scheduler*": "DeepSpeed's curriculum learning is not in zeal",
    "runtime.zero.offload_states*": "zeal's offload is configured (zero_optimization.offload_*), not toggled",
    "compression*": "zeal's compression is `zeal compress` / the config's compression section",
    "inference*": "serve with zeal.LLM(...) / `zeal serve`",
    "model_implementations*": "use zeal.models",
    "autotuning*": "`zeal estimate` picks a ZeRO stage for a memory budget",
    "elasticity*": "zeal has no elastic training; restart with a checkpoint at the new world size",
    "nvme*": "zeal's NVMe offload is zero_optimization.offload_*.device 'nvme'",
    "profiling*": "use torch.profiler; the config's flops_profiler section counts FLOPs",
}


def is_deepspeed_module(fullname: str) -> bool:
    """Whether DeepSpeed 0.19.8 has a module of this dotted name."""
    return fullname in deepspeed_names()["modules"]


def reason(fullname: str) -> str | None:
    """Why ``fullname`` (``deepspeed.x.y``) is not in zeal, and what to use instead."""
    rest = fullname.partition(".")[2]
    found = reason_by_prefix(rest, REASONS)
    if found is None:
        from zeal.deepspeed import _REASONS as TOP

        found = reason_by_prefix(rest.split(".")[0], TOP)
    return found


def stand_in(fullname: str) -> types.ModuleType:
    """The module ``fullname`` as zeal gives it: every public name refused on use."""
    module = types.ModuleType(fullname, f"{fullname} (DeepSpeed 0.19) is not supported by zeal")
    why = reason(fullname)

    def __getattr__(name: str) -> Any:  # noqa: N807 - a module's attribute hook
        if name.startswith("__"):
            raise AttributeError(name)
        return RefusedName(f"{fullname}.{name}", why)

    module.__getattr__ = __getattr__  # type: ignore[method-assign]
    module.__path__ = []  # a package: its DeepSpeed submodules load the same way
    return module
