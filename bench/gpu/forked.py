"""``run.sh --dry-run``'s stage runner: each stage in its own process under its own time limit,
as on the GPU, but forked from one parent that has imported torch, transformers and zeal once
(five fresh interpreters spent most of the CPU dry run importing them).

    python bench/gpu/forked.py OUT_DIR env:45 train_correct:90 ...   # appends to OUT_DIR/results.jsonl

Each stage's stdout goes to ``OUT_DIR/NAME.out`` and its stderr to ``NAME.err``; its last JSON
line (its record, or its record so far when the limit stopped it) is appended to
``results.jsonl`` and printed, as ``run.sh``'s ``stage`` does. Only the CPU dry run forks: on a
GPU each stage starts a fresh interpreter (``run.sh``), so no CUDA state can cross a fork.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
GRACE_S = 10.0  # after the limit, SIGTERM; this much later, SIGKILL (``timeout -k 10``)


def _child(name: str, out: Path, err: Path) -> None:
    """In the forked process: the stage's output to its files, then exit with its status."""
    code = 1
    try:
        sys.stdout.flush()
        sys.stderr.flush()
        with out.open("wb") as fo, err.open("wb") as fe:
            os.dup2(fo.fileno(), 1)
            os.dup2(fe.fileno(), 2)
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - the process's own fds
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        import stages

        code = stages.main([name, "--dry-run"])
    except BaseException:  # noqa: BLE001 - a crash is the stage's "no result", shown in NAME.err
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _wait(pid: int, limit: float) -> int:
    """The child's exit status; past ``limit`` it is sent SIGTERM, then SIGKILL after the grace."""
    deadline, signalled = time.monotonic() + limit, False
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        now = time.monotonic()
        if now > deadline and not signalled:
            os.kill(pid, signal.SIGTERM)
            deadline, signalled = now + GRACE_S, True
        elif now > deadline:
            os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


def run_stage(name: str, limit: float, out_dir: Path) -> str:
    """Run one stage forked; its result line (a JSON object), or one saying why there is none."""
    out, err = out_dir / f"{name}.out", out_dir / f"{name}.err"
    pid = os.fork()
    if pid == 0:
        _child(name, out, err)
    rc = _wait(pid, limit)
    lines = out.read_text(errors="replace").splitlines() if out.exists() else []
    line = lines[-1] if lines else ""
    if not line.startswith("{"):
        line = json.dumps({"stage": name, "error": f"no result (exit {rc}, limit {limit:g} s): see {name}.err"})
    return line


def main(argv: list[str]) -> int:
    out_dir, specs = Path(argv[0]), argv[1:]
    sys.path.insert(0, str(HERE))
    import stages  # noqa: F401 - imported once, before the forks
    import torch  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401

    import zeal.inference  # noqa: F401
    import zeal.train.build  # noqa: F401

    with (out_dir / "results.jsonl").open("a") as res:
        for spec in specs:
            name, limit = spec.split(":")
            line = run_stage(name, float(limit), out_dir)
            res.write(line + "\n")
            res.flush()
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
