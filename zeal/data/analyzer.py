"""The data analyzer: a difficulty metric for every sample, by map-reduce over worker processes.

Samples are rows of a 2-D integer array (token blocks). The map splits the sample ids
into ``workers`` contiguous shards; each worker writes its shard's values to a ``.npy``
file (for ``voc``, a first map-reduce counts the tokens of the whole data). The reduce
concatenates the shards in order and sorts, so the merged output does not depend on the
number of workers. Files written to ``out_dir`` (numpy ``.npy``, read back with
``allow_pickle=False``):

* ``<metric>_sample_to_metric.npy``: the metric of sample ``i`` at row ``i`` (int64);
* ``<metric>_index_to_sample.npy``: sample ids sorted by metric (ties by id): the
  percentile-merged index the sampler reads;
* ``<metric>_index_to_metric.npy``: the metric of each of those (non-decreasing).
"""

from __future__ import annotations

import multiprocessing as mp
import shutil
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from zeal.data.curriculum import seqlen_metric, token_counts, voc_metric

METRICS = ("voc", "seqlen")


@dataclass(frozen=True)
class MetricIndex:
    """An analyzer's output for one metric (see the module docstring)."""

    sample_to_metric: np.ndarray
    index_to_sample: np.ndarray
    index_to_metric: np.ndarray

    @staticmethod
    def from_values(values: np.ndarray) -> MetricIndex:
        values = np.asarray(values, dtype=np.int64)
        order = np.argsort(values, kind="stable").astype(np.int64)
        return MetricIndex(values, order, values[order])

    def save(self, out_dir: str | Path, metric: str) -> list[Path]:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        paths = []
        for name in ("sample_to_metric", "index_to_sample", "index_to_metric"):
            p = out / f"{metric}_{name}.npy"
            np.save(p, getattr(self, name), allow_pickle=False)
            paths.append(p)
        return paths

    @staticmethod
    def load(out_dir: str | Path, metric: str) -> MetricIndex:
        out = Path(out_dir)
        arrays = [np.load(out / f"{metric}_{n}.npy", allow_pickle=False)
                  for n in ("sample_to_metric", "index_to_sample", "index_to_metric")]
        return MetricIndex(*arrays)


def load_sample_metric(index_to_sample_path: str | Path, index_to_metric_path: str | Path) -> np.ndarray:
    """Each sample's metric from the two sorted index files a config names
    (``index_to_sample_path``, ``index_to_metric_path``)."""
    ids = np.load(index_to_sample_path, allow_pickle=False).astype(np.int64)
    vals = np.load(index_to_metric_path, allow_pickle=False).astype(np.int64)
    if ids.shape != vals.shape or ids.ndim != 1:
        raise ValueError(f"index files {index_to_sample_path} and {index_to_metric_path} differ in shape")
    if ids.size and (np.sort(ids) != np.arange(ids.size)).any():
        raise ValueError(f"{index_to_sample_path}: not a permutation of the sample ids 0..{ids.size - 1}")
    out = np.empty_like(vals)
    out[ids] = vals
    return out


# ----------------------------------------------------------------------------------- map


def _shard_bounds(n: int, workers: int) -> list[tuple[int, int]]:
    return [(n * k // workers, n * (k + 1) // workers) for k in range(workers)]


def _map_counts(samples_path: str, lo: int, hi: int, vocab_size: int, out_path: str) -> str:
    rows = np.load(samples_path, mmap_mode="r", allow_pickle=False)[lo:hi]
    np.save(out_path, token_counts(rows, vocab_size), allow_pickle=False)
    return out_path


def _map_metric(samples_path: str, lo: int, hi: int, metric: str, counts_path: str | None,
                pad_id: int | None, out_path: str) -> str:
    rows = np.load(samples_path, mmap_mode="r", allow_pickle=False)[lo:hi]
    if metric == "voc":
        values = voc_metric(rows, np.load(counts_path, allow_pickle=False), pad_id)
    else:
        values = seqlen_metric(rows, pad_id)
    np.save(out_path, values, allow_pickle=False)
    return out_path


def _run(pool: ProcessPoolExecutor | None, fn, jobs: list[tuple]) -> list[str]:
    if pool is None:
        return [fn(*j) for j in jobs]
    return [f.result() for f in [pool.submit(fn, *j) for j in jobs]]


# ----------------------------------------------------------------------------------- reduce


def analyze(samples: np.ndarray, metric: str, workers: int = 1, vocab_size: int | None = None,
            pad_id: int | None = None, work_dir: str | Path | None = None) -> MetricIndex:
    """``metric`` (``voc`` or ``seqlen``) of every row of ``samples`` (2-D ints), computed by
    ``workers`` processes (1: in this process); equal for any ``workers``."""
    if metric not in METRICS:
        raise ValueError(f"--metric {metric!r}: unknown metric (choose from {', '.join(METRICS)})")
    if workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers}")
    samples = np.asarray(samples)
    if samples.ndim != 2 or samples.shape[0] == 0:
        raise ValueError(f"samples must be a non-empty 2-D array, got shape {samples.shape}")
    vocab = int(vocab_size if vocab_size is not None else int(samples.max()) + 1)
    tmp = Path(tempfile.mkdtemp(prefix="zeal-analyze-", dir=work_dir))
    try:
        src = str(tmp / "samples.npy")
        np.save(src, samples, allow_pickle=False)
        bounds = _shard_bounds(samples.shape[0], workers)
        ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
        pool = ProcessPoolExecutor(workers, mp_context=ctx) if workers > 1 else None
        try:
            counts_path = None
            if metric == "voc":
                parts = _run(pool, _map_counts, [(src, lo, hi, vocab, str(tmp / f"counts{k}.npy"))
                                                 for k, (lo, hi) in enumerate(bounds)])
                counts = sum(np.load(p, allow_pickle=False) for p in parts)
                counts_path = str(tmp / "counts.npy")
                np.save(counts_path, counts, allow_pickle=False)
            parts = _run(pool, _map_metric, [(src, lo, hi, metric, counts_path, pad_id, str(tmp / f"metric{k}.npy"))
                                             for k, (lo, hi) in enumerate(bounds)])
        finally:
            if pool is not None:
                pool.shutdown()
        values = np.concatenate([np.load(p, allow_pickle=False) for p in parts])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return MetricIndex.from_values(values)


# ----------------------------------------------------------------------------------- report


def histogram(values: np.ndarray, bins: int = 20) -> tuple[np.ndarray, np.ndarray]:
    """(counts, edges) of ``values`` over ``bins`` equal-width bins."""
    v = np.asarray(values, dtype=np.float64)
    lo, hi = float(v.min()), float(v.max())
    if hi == lo:
        hi = lo + 1.0
    return np.histogram(v, bins=bins, range=(lo, hi))


def format_histogram(values: np.ndarray, bins: int = 20, width: int = 40) -> str:
    """A text histogram: one line per bin, ``[lo, hi) count ####``."""
    counts, edges = histogram(values, bins)
    top = max(1, int(counts.max()))
    lines = []
    for c, a, b in zip(counts, edges[:-1], edges[1:]):
        lines.append(f"[{a:>12.1f}, {b:>12.1f}) {int(c):>8d} " + "#" * int(round(width * c / top)))
    return "\n".join(lines)


def write_histogram_png(values: np.ndarray, path: str | Path, metric: str, bins: int = 40) -> Path | None:
    """The histogram as a PNG through matplotlib; None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    counts, edges = histogram(values, bins)
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.bar(edges[:-1], counts, width=np.diff(edges), align="edge", edgecolor="black", linewidth=0.3)
    ax.set_xlabel(metric)
    ax.set_ylabel("samples")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)
