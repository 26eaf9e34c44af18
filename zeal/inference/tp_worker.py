"""``python -m zeal.inference.tp_worker SPEC``: one tensor-parallel serving rank (1..T-1)
started by rank 0 (:func:`zeal.inference.tensor_parallel.spawn_tensor_parallel`) with
torchrun's variables. ``SPEC`` is JSON: the ``model`` folder, the ``dtype`` name and the
``device``. The rank joins the group, loads and splits the model, runs rank 0's passes
until rank 0 stops it, and exits 0; on an error it prints one line naming its rank and
exits 1 (rank 0 reports it). It also ends when rank 0's process ends (Linux)."""

from __future__ import annotations

import json
import os
import signal
import sys


def _end_with_parent() -> None:
    """Ask Linux to send SIGTERM when the parent (rank 0) dies, so no rank outlives it."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    rank = os.environ.get("RANK", "?")
    _end_with_parent()
    try:
        spec = json.loads(argv[0])
        from zeal.config.inference import InferenceConfig
        from zeal.inference.build import build_engine

        # a launched job's rank > 0: joins the group, loads and splits the model, serves rank 0's passes
        build_engine(InferenceConfig(model=spec["model"], dtype=spec["dtype"], device=spec["device"],
                                     tensor_parallel_size=int(os.environ["WORLD_SIZE"])))
        return 0
    except Exception as e:  # noqa: BLE001 - one line for rank 0's log
        print(f"zeal tensor-parallel rank {rank}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
