"""Hang forensics: what every rank last asked of every group, and where the ranks diverged.

Every collective issued through a :class:`~zeal.dist.comm.Comm` is numbered per group
(a sequence number that all members advance identically, since collectives are issued
in the same order on every rank) and recorded in a small per-process ring buffer: the
group's dimension name and ranks, the op, the tensor's shape and dtype, and the call
site (the first frame outside ``zeal/dist``, as ``file:line``). Recording costs a dict
and a short frame walk per call.

When a collective fails (gloo and NCCL raise when the process group's timeout expires,
``comm_timeout_s`` / ``ZEAL_COMM_TIMEOUT_S``), the rank writes its ring buffer as
``collectives-rank<N>.json`` into ``ZEAL_FORENSICS_DIR`` (the launcher, :mod:`zeal.dist.launch`, sets it to
``RUN/logs``; default: ``<tmp>/zeal-forensics``). :func:`report` reads every rank's file
and names the first sequence position, per group, where the ranks disagree: the op, the
group, and the rank(s) that skipped it (or issued something else there).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path

ENV_DIR = "ZEAL_FORENSICS_DIR"
ENV_TIMEOUT = "ZEAL_COMM_TIMEOUT_S"
KEEP = 64  # records per rank
_DIST_DIR = os.path.dirname(os.path.abspath(__file__))


class CollectiveLog:
    """The per-process ring buffer of the last :data:`KEEP` collectives, with a sequence
    counter per group."""

    def __init__(self, keep: int = KEEP) -> None:
        self.records: deque[dict] = deque(maxlen=keep)
        self._seq: dict[tuple, int] = {}
        self._lock = threading.Lock()
        self.rank = 0
        self.dumped: Path | None = None

    def record(self, name: str, ranks: tuple[int, ...], op: str, tensor: object = None) -> None:
        key = (name, ranks)
        with self._lock:
            seq = self._seq.get(key, 0)
            self._seq[key] = seq + 1
            self.records.append({
                "seq": seq, "group": name, "ranks": ranks, "op": op,
                "shape": tuple(getattr(tensor, "shape", ())), "dtype": getattr(tensor, "dtype", ""),
                "site": call_site(), "time": time.time(),
            })

    def dump(self, error: str = "", folder: str | os.PathLike | None = None) -> Path:
        """Write this rank's records (and the error that triggered the dump) as JSON."""
        out = Path(folder or forensics_dir())
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"collectives-rank{self.rank}.json"
        tmp = out / f".collectives-rank{self.rank}.json.tmp"
        with self._lock:
            records = [{**r, "dtype": str(r["dtype"])} for r in self.records]  # shapes are tuples: JSON lists
            body = {"rank": self.rank, "pid": os.getpid(), "time": time.time(), "error": error[:2000],
                    "records": records}
        tmp.write_text(json.dumps(body, indent=1))
        os.replace(tmp, path)
        self.dumped = path
        return path


LOG = CollectiveLog()


def forensics_dir() -> str:
    """Where ranks write their records: ``ZEAL_FORENSICS_DIR``, else ``<tmp>/zeal-forensics``."""
    return os.environ.get(ENV_DIR) or os.path.join(tempfile.gettempdir(), "zeal-forensics")


def comm_timeout_s(configured: float | None = None) -> float:
    """The process-group timeout: ``ZEAL_COMM_TIMEOUT_S`` when set, else ``configured``, else 600 s."""
    env = os.environ.get(ENV_TIMEOUT)
    if env:
        try:
            value = float(env)
        except ValueError:
            raise ValueError(f"{ENV_TIMEOUT}={env!r} is not a number of seconds") from None
        if value <= 0:
            raise ValueError(f"{ENV_TIMEOUT}={env!r} must be > 0")
        return value
    return float(configured) if configured else 600.0


def call_site(max_depth: int = 12) -> str:
    """``file:line`` of the nearest caller outside ``zeal/dist`` (a few frames walked)."""
    f = sys._getframe(2)
    for _ in range(max_depth):
        if f is None:
            break
        name = f.f_code.co_filename
        if not name.startswith(_DIST_DIR):
            return f"{name}:{f.f_lineno}"
        f = f.f_back
    return "?"


def on_failure(exc: BaseException) -> None:
    """Dump the ring buffer after a failed collective (once per process; never raises)."""
    if LOG.dumped is not None:
        return
    try:
        LOG.dump(f"{type(exc).__name__}: {exc}")
    except OSError:
        pass


# -- reading the records back ----------------------------------------------------------------
def read_records(folder: str | os.PathLike) -> dict[int, dict]:
    """Every rank's dump in ``folder``, by rank (unreadable files are skipped)."""
    out = {}
    for p in sorted(Path(folder).glob("collectives-rank*.json")):
        try:
            body = json.loads(p.read_text())
            out[int(body["rank"])] = body
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out


def _signature(r: dict) -> tuple:
    """What must agree across a group's members at one position; the call site too for
    collectives (the two ends of a point-to-point transfer are different code)."""
    return (r["op"], tuple(r["shape"]), r["dtype"], r["site"] if r["op"] != "send" else "")


def divergences(dumps: dict[int, dict]) -> list[dict]:
    """Per group, the first sequence position where the member ranks' records differ
    (only positions every member still has in its ring buffer, or past a member's last
    record, are compared). Each finding: group, ranks, seq, the expected record, the
    ranks that skipped it (issued nothing there, or the next record instead) and those
    that issued something else; sorted by the time the expected record was issued."""
    by_group: dict[tuple, dict[int, dict[int, dict]]] = {}
    for rank, body in dumps.items():
        for r in body.get("records", []):
            key = (r["group"], tuple(r["ranks"]))
            by_group.setdefault(key, {}).setdefault(rank, {})[r["seq"]] = r
    found = []
    for (name, ranks), per_rank in by_group.items():
        members = [r for r in ranks if r in dumps]
        if len(members) < 2:
            continue
        f = _first_divergence(name, ranks, members, {r: per_rank.get(r, {}) for r in members})
        if f is not None:
            found.append(f)
    return sorted(found, key=lambda f: f["expected"]["time"])


def _first_divergence(name: str, ranks: tuple, members: list[int], seqs: dict[int, dict[int, dict]]) -> dict | None:
    lo = max(min(s) if s else 0 for s in seqs.values())
    hi = max(max(s) if s else -1 for s in seqs.values())
    for seq in range(lo, hi + 1):
        here = {r: seqs[r].get(seq) for r in members}
        sigs = {r: _signature(v) for r, v in here.items() if v is not None}
        if len(set(sigs.values())) <= 1 and len(sigs) == len(members):
            continue
        # the expected record: the most common one; ties go to the record another rank issues next
        counts: dict[tuple, int] = {}
        for s in sigs.values():
            counts[s] = counts.get(s, 0) + 1
        nxt = {_signature(seqs[r][seq + 1]) for r in members if seqs[r].get(seq + 1)}
        best = max(counts, key=lambda s: (counts[s], s not in nxt))
        expected = next(here[r] for r in members if here[r] is not None and sigs[r] == best)
        ahead = {_signature(seqs[r][seq + 1]) for r in members if sigs.get(r) == best and seqs[r].get(seq + 1)}
        skipped = [r for r in members if here[r] is None or (sigs[r] != best and sigs[r] in ahead)]
        other = [r for r in members if r not in skipped and sigs.get(r) != best]
        return {"group": name, "ranks": list(ranks), "seq": seq, "expected": expected, "skipped": skipped,
                "other": {r: here[r] for r in other}}
    return None


def report(folder: str | os.PathLike | None = None) -> str:
    """One human-readable report of the ranks' records in ``folder`` (default
    :func:`forensics_dir`): the first divergence and the others found, or that none was."""
    folder = folder or forensics_dir()
    dumps = read_records(folder)
    if not dumps:
        return f"hang forensics: no collective records in {folder}"
    found = divergences(dumps)
    lines = [f"hang forensics: records of ranks {sorted(dumps)} in {folder}"]
    if not found:
        lines.append("  the ranks' collective sequences agree on every group (no skipped collective seen)")
    for i, f in enumerate(found):
        e = f["expected"]
        head = "first divergence" if i == 0 else "also"
        what = f"{e['op']} {tuple(e['shape'])} {e['dtype']} at {e['site']}"
        lines.append(f"  {head}: group {f['group']} {f['ranks']} position {f['seq']}: {what}")
        if f["skipped"]:
            lines.append(f"    skipped by rank(s) {f['skipped']}")
        for r, rec in f["other"].items():
            lines.append(f"    rank {r} issued instead: {rec['op']} {tuple(rec['shape'])} at {rec['site']}")
    for rank, body in sorted(dumps.items()):
        if body.get("error"):
            lines.append(f"  rank {rank}: {' '.join(body['error'].split())[:300]}")
    return "\n".join(lines)
