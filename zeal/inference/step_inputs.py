"""One host-to-device transfer per serving step.

:func:`pack_plan` lays every integer a :class:`~zeal.inference.model_runner.StepPlan`
needs on the device (token ids, positions, cache slots, the rows to sample, the decodes'
rows, block tables and context lengths, each prompt chunk's block table) into one
``uint8`` host buffer: an int64 section, then an int32 section. :class:`StepInputPacker`
copies it with a single ``non_blocking`` copy (from a reused pinned staging buffer on
CUDA) and unpacks it on the device with views, into the same tensors
:meth:`ModelRunner.prepare` builds one ``torch.tensor`` at a time (10-20 blocking copies
a step on CUDA).

It also packs what the batched paged attention of :mod:`zeal.inference.paged_flex` reads
for the prompt chunks: their block tables padded to one ``(P, W)`` table, their context
and query lengths, and the flat-batch row of every (chunk, query) slot of a padded
``(P, Lmax)`` query batch (the dummy row ``T`` where a chunk is shorter).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zeal.inference.attention import AttentionMetadata, DecodeTables, PrefillChunk


@dataclass
class PrefillBatch:
    """The prompt chunks of a pass as one padded batch (device tensors)."""

    tables: torch.Tensor  # (P, W) int32, padded with 0
    ctx_lens: torch.Tensor  # (P,) int32
    q_lens: torch.Tensor  # (P,) int32
    gather: torch.Tensor  # (P * Lmax,) int64: flat-batch row of each padded query, T = none
    max_q_len: int


@dataclass
class PackedLayout:
    """Where each field lies in the packed buffer: ``(section, offset, shape)``."""

    nbytes: int
    n64: int
    fields: dict[str, tuple[str, int, tuple[int, ...]]]


def _used(table: list[int], n: int, bs: int) -> list[int]:
    return table[: -(-n // bs)]


def pack_plan(plan, block_size: int) -> tuple[list[int], list[int], PackedLayout]:
    """The int64 and int32 values of ``plan`` and where each field lies."""
    i64: list[int] = []
    i32: list[int] = []
    fields: dict[str, tuple[str, int, tuple[int, ...]]] = {}

    def put(name: str, values: list[int], shape: tuple[int, ...], wide: bool) -> None:
        sec = i64 if wide else i32
        fields[name] = ("i64" if wide else "i32", len(sec), shape)
        sec.extend(values)

    t = len(plan.ids)
    put("ids", plan.ids, (t,), True)
    put("pos", plan.pos, (t,), True)
    put("slots", plan.slots, (t,), True)
    put("sample_rows", plan.sample_rows, (len(plan.sample_rows),), True)
    fill = getattr(plan, "fill_rows", None)
    if fill:  # async scheduling: rows whose id is the previous step's sampled token fill_src
        put("fill_rows", fill, (len(fill),), True)
        put("fill_src", plan.fill_src, (len(fill),), True)
    if plan.dec_rows:
        used = [_used(tb, n, block_size) for tb, n in zip(plan.dec_tables, plan.dec_lens)]
        w = max(map(len, used))
        put("dec_rows", plan.dec_rows, (len(plan.dec_rows),), True)
        put("dec_tables", [b for u in used for b in u + [0] * (w - len(u))], (len(used), w), False)
        put("dec_lens", plan.dec_lens, (len(plan.dec_lens),), False)
    if plan.prefills:
        w = max(len(tb) for _, _, _, tb in plan.prefills)
        lmax = max(n for _, n, _, _ in plan.prefills)
        tabs = [b for _, _, _, tb in plan.prefills for b in list(tb) + [0] * (w - len(tb))]
        put("pre_tables", tabs, (len(plan.prefills), w), False)
        put("pre_ctx", [c for _, _, c, _ in plan.prefills], (len(plan.prefills),), False)
        put("pre_qlen", [n for _, n, _, _ in plan.prefills], (len(plan.prefills),), False)
        gather = [r0 + i if i < n else t for r0, n, _, _ in plan.prefills for i in range(lmax)]
        put("pre_gather", gather, (len(gather),), True)
    return i64, i32, PackedLayout(8 * len(i64) + 4 * len(i32), len(i64), fields)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def unpack(buf: torch.Tensor, layout: PackedLayout) -> dict[str, torch.Tensor]:
    """Views of the device buffer ``buf (nbytes,) uint8``, one per field."""
    v64 = buf[: 8 * layout.n64].view(torch.int64)
    v32 = buf[8 * layout.n64 : layout.nbytes].view(torch.int32)
    out = {}
    for name, (sec, off, shape) in layout.fields.items():
        src = v64 if sec == "i64" else v32
        out[name] = src[off : off + _numel(shape)].view(shape)
    return out


def fill_ids(ids: torch.Tensor, rows: torch.Tensor, src: torch.Tensor, prev: torch.Tensor | None) -> None:
    """Async scheduling: ``ids[rows] = prev[src]`` on the device (the previous step's sampled ids)."""
    if prev is None:
        raise RuntimeError("a step reads the previous step's tokens, but none are in flight")
    ids.index_copy_(0, rows, prev.index_select(0, src).to(ids.dtype))


class StepInputPacker:
    """Packs a step's plan on the host and moves it to ``device`` in one copy.

    On CUDA the staging buffer is pinned and reused; an event recorded after each copy
    keeps the next step from overwriting it before the copy has read it."""

    def __init__(self, device: torch.device, block_size: int) -> None:
        self.device = torch.device(device)
        self.block_size = block_size
        self.pinned = self.device.type == "cuda" and torch.cuda.is_available()
        self._staging = torch.empty(0, dtype=torch.uint8)
        self._event = None
        self.transfers = 0  # host-to-device copies made (one per step)

    def _stage(self, i64: list[int], i32: list[int], layout: PackedLayout) -> torch.Tensor:
        host = torch.cat([torch.tensor(i64, dtype=torch.int64).view(torch.uint8),
                          torch.tensor(i32, dtype=torch.int32).view(torch.uint8)])
        if not self.pinned:
            return host
        if self._event is not None:
            self._event.synchronize()  # the previous step's copy has read the staging buffer
        if self._staging.numel() < layout.nbytes:
            self._staging = torch.empty(max(layout.nbytes, 2 * self._staging.numel()), dtype=torch.uint8,
                                        pin_memory=True)
        self._staging[: layout.nbytes].copy_(host)
        return self._staging[: layout.nbytes]

    def transfer(self, plan) -> tuple[dict[str, torch.Tensor], PackedLayout]:
        """The plan's fields as device tensors (views of one buffer) and their layout."""
        i64, i32, layout = pack_plan(plan, self.block_size)
        host = self._stage(i64, i32, layout)
        if self.device.type == "cpu":
            dev = host
        else:
            dev = host.to(self.device, non_blocking=True)
            if self.pinned:
                self._event = torch.cuda.Event()
                self._event.record()
        self.transfers += 1
        return unpack(dev, layout), layout

    def prepare(self, plan, kernels: object | None = None, backend: object | None = None,
                prev_tokens: torch.Tensor | None = None):
        """What :meth:`ModelRunner.prepare` returns (ids, positions, metadata, sample rows),
        from one transfer; ``meta.decodes`` is :class:`DecodeTables` (the block tables read
        by the fused CPU kernels or ``backend``) and ``meta.prefill_batch`` the padded
        prompt chunks. ``prev_tokens``: the step in flight's sampled ids (device), read by
        the plan's ``fill_rows`` (async scheduling)."""
        f, _ = self.transfer(plan)
        if "fill_rows" in f:
            fill_ids(f["ids"], f["fill_rows"], f["fill_src"], prev_tokens)
        prefills = []
        if plan.prefills:
            tabs = f["pre_tables"]
            prefills = [PrefillChunk(row0, n, ctx, tabs[i, : len(tb)])
                        for i, (row0, n, ctx, tb) in enumerate(plan.prefills)]
        meta = AttentionMetadata(slot_mapping=f["slots"], prefills=prefills, kernels=kernels)
        meta.backend = backend
        if plan.dec_rows:
            rows = plan.dec_rows
            r = slice(rows[0], rows[0] + len(rows)) if rows == list(range(rows[0], rows[0] + len(rows))) \
                else f["dec_rows"]
            meta.decodes = DecodeTables(r, f["dec_tables"], f["dec_lens"])
        if plan.prefills:
            meta.prefill_batch = PrefillBatch(f["pre_tables"], f["pre_ctx"], f["pre_qlen"], f["pre_gather"],
                                              max(n for _, n, _, _ in plan.prefills))
        return f["ids"], f["pos"], meta, f["sample_rows"]
