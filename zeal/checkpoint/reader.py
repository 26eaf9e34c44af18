"""Reading the per-rank tensor files of a checkpoint: any box of any saved parameter.

Format 2 (this code writes it): rank r's file holds, for every box of every parameter
it owned, ``<kind>/<name>/<k>`` (kind ``param`` for the master, ``optim.<key>`` for an
optimizer moment) stored with the box's shape; its JSON metadata lists the boxes
(``boxes[name][k] = [[start, stop], ...]``) and the scalar optimizer state.

Format 1 (read only): rank r's file holds ``<kind>/<name>`` as the 1-D flat range
``pieces[name] = [lo, hi)`` of the flattened parameter. Such a range is read as its
boxes (:func:`~zeal.zero.slices.flat_range_boxes`), each a contiguous part of the
stored 1-D tensor, so the rest of the code sees one layout.

A read of box B intersects B with every saved box of that parameter and copies each
intersection; for format 2 only the intersection is read from disk (safetensors
slicing), so a rank loading at another world size reads only what it needs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from zeal.checkpoint.files import DTYPE_BY_NAME, CheckpointCorruptError
from zeal.zero.slices import Box, box_numel, box_shape, flat_range_boxes, full_box, index, intersect


@dataclass(frozen=True)
class SavedBox:
    """One saved box of a parameter: in which file, under which key suffix, and, for
    format 1, where it starts inside the stored 1-D tensor (None for format 2)."""

    file: int
    key_suffix: str  # "<name>/<k>" (format 2) or "<name>" (format 1)
    box: Box
    flat_offset: int | None


class SavedShards:
    """Index of the saved boxes of every parameter, over all rank files of a checkpoint.
    ``transient``: open a file only while one tensor is read from it (export keeps its
    resident memory near one tensor instead of the whole mapped checkpoint)."""

    def __init__(self, folder: Path, files: list[str], shapes: dict[str, list[int]], version: int,
                 transient: bool = False, dtypes: dict[str, torch.dtype] | None = None) -> None:
        self.folder, self.files, self.transient = folder, files, transient
        self.dtypes = dtypes or {}  # parameter name -> the dtype the index (meta.json) gives its master
        self.readers: list[Any] = []
        self.meta: list[dict] = []
        self.boxes: dict[str, list[SavedBox]] = {}  # parameter name -> its saved boxes
        self.kinds: dict[str, set[str]] = {}  # parameter name -> {"param", "optim.exp_avg", ...}
        self.whole_keys: dict[str, int] = {}  # buffer/..., client/... -> file
        self.scalars: dict[str, dict] = {}
        for i, f in enumerate(files):
            r, md, keys = self._open_checked(i, f)
            self.readers.append(None if transient else r)
            self.meta.append(md)
            self.scalars.update(md.get("scalars", {}))
            self._index(i, md, keys, shapes, version)

    def _open_checked(self, i: int, f: str) -> tuple[Any, dict, list[str]]:
        path = self.folder / f
        try:
            r = safe_open(str(path), framework="pt")
            md = json.loads((r.metadata() or {})["zeal"])
            keys = list(r.keys())
        except Exception as e:  # noqa: BLE001 - any parse failure is a corrupt file
            raise CheckpointCorruptError(f"{path}: not a readable safetensors shard ({e})") from None
        if not isinstance(md, dict) or not _scalars_ok(md.get("scalars", {})):
            raise CheckpointCorruptError(f"{path}: index of saved pieces malformed (scalars)")
        if md.get("rank") != i or md.get("world_size") != len(self.files):
            raise CheckpointCorruptError(f"{path}: holds the shard of rank {md.get('rank')} of "
                                         f"{md.get('world_size')}, expected rank {i} of {len(self.files)}")
        return r, md, keys

    def _index(self, i: int, md: dict, keys: list[str], shapes: dict[str, list[int]], version: int) -> None:
        path = self.folder / self.files[i]
        try:
            for key in keys:
                kind, _, rest = key.partition("/")
                if kind != "param" and not kind.startswith("optim."):
                    self.whole_keys[key] = i
                    continue
                name = rest if version == 1 else rest.rpartition("/")[0]
                self.kinds.setdefault(name, set()).add(kind)
                if kind != "param":
                    continue  # moments share the boxes of the master
                if version == 1:
                    lo, hi = md["pieces"][name]
                    start = lo
                    for box in flat_range_boxes(shapes[name], lo, hi):
                        self.boxes.setdefault(name, []).append(SavedBox(i, name, box, start - lo))
                        start += box_numel(box)
                else:
                    k = int(rest.rpartition("/")[2])
                    box = tuple((int(a), int(b)) for a, b in md["boxes"][name][k])
                    self.boxes.setdefault(name, []).append(SavedBox(i, rest, box, None))
        except (KeyError, ValueError, TypeError, IndexError, OverflowError) as e:
            raise CheckpointCorruptError(f"{path}: index of saved pieces inconsistent ({type(e).__name__}: {e})") \
                from None

    def has(self, kind: str, name: str) -> bool:
        return kind in self.kinds.get(name, ())

    def read(self, kind: str, name: str, box: Box, out: torch.Tensor) -> None:
        """Fill ``out`` (the shape of ``box``) with ``box`` of ``kind`` of parameter ``name``."""
        filled = 0
        for sb in self.boxes.get(name, []):
            inter = intersect(sb.box, box)
            if inter is None:
                continue
            part = self._part(kind, sb, inter)
            want = self.dtypes.get(name)
            if want is not None and part.dtype != want:  # moments are stored like their master
                raise CheckpointCorruptError(f"{self.path(sb.file)}: {kind}/{sb.key_suffix} is stored as "
                                             f"{_dtype_name(part.dtype)}, the index says {_dtype_name(want)}")
            out[index(inter, origin=box)].copy_(part)
            filled += box_numel(inter)
        if filled != box_numel(box):
            raise CheckpointCorruptError(f"{self.folder}: {kind}/{name}: the saved pieces cover {filled} of the "
                                         f"{box_numel(box)} elements of box {box}")

    def full(self, kind: str, name: str, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
        """The whole saved tensor (export, tests)."""
        out = torch.empty(shape, dtype=dtype)
        self.read(kind, name, full_box(shape), out)
        return out

    def _part(self, kind: str, sb: SavedBox, inter: Box) -> torch.Tensor:
        key = f"{kind}/{sb.key_suffix}"
        path = self.folder / self.files[sb.file]
        try:
            sl = self._reader(sb.file).get_slice(key)
            if sb.flat_offset is not None:  # format 1: a contiguous run of the stored 1-D tensor
                n = box_numel(sb.box)
                part = sl[sb.flat_offset:sb.flat_offset + n].view(box_shape(sb.box))[index(inter, origin=sb.box)]
            elif not sb.box:
                part = self._reader(sb.file).get_tensor(key)  # a 0-d tensor has nothing to slice
            else:
                part = sl[index(inter, origin=sb.box)]  # reads only the intersection
        except Exception as e:  # noqa: BLE001 - missing key, short data: a corrupt file
            raise CheckpointCorruptError(f"{path}: cannot read {key} ({type(e).__name__}: {e})") from None
        if tuple(part.shape) != box_shape(inter):
            raise CheckpointCorruptError(f"{path}: {key} is smaller than its index says")
        return part

    def whole(self, key: str, shape: tuple[int, ...] | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A tensor stored whole (buffers, client state); with ``shape`` / ``dtype``, checked to have them."""
        i = self.whole_keys.get(key) if isinstance(key, str) else None
        if i is None:
            raise CheckpointCorruptError(f"{self.folder}: {key!r:.80} not found in any shard")
        try:
            t = self._reader(i).get_tensor(key)
        except Exception as e:  # noqa: BLE001 - short data: a corrupt file
            raise CheckpointCorruptError(f"{self.path(i)}: cannot read {key} ({type(e).__name__}: {e})") from None
        if shape is not None and tuple(t.shape) != shape:
            raise CheckpointCorruptError(f"{self.path(i)}: {key} has shape {tuple(t.shape)}, expected {shape}")
        if dtype is not None and t.dtype != dtype:
            raise CheckpointCorruptError(f"{self.path(i)}: {key} is stored as {_dtype_name(t.dtype)}, "
                                         f"the index says {_dtype_name(dtype)}")
        return t

    def path(self, i: int) -> Path:
        """The file of rank ``i``."""
        return self.folder / self.files[i]

    def rng(self, rank: int) -> dict | None:
        """The RNG state saved by ``rank`` (None when the saving job had fewer ranks)."""
        return next((md.get("rng") for md in self.meta if md.get("rank") == rank), None)

    def scalar_values(self, name: str) -> dict[str, Any]:
        """The scalar optimizer state of parameter ``name`` (a 0-d tensor keeps its dtype)."""
        return {k: torch.tensor(v, dtype=DTYPE_BY_NAME[dt]) if dt else v
                for k, (v, dt) in self.scalars.get(name, {}).items()}

    def _reader(self, i: int) -> Any:
        return self.readers[i] or safe_open(str(self.folder / self.files[i]), framework="pt")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _scalars_ok(sc: Any) -> bool:
    """``{name: {key: [number, dtype name or None]}}``"""
    def ok(v: Any) -> bool:
        return (isinstance(v, list) and len(v) == 2 and isinstance(v[0], (int, float))
                and -2**63 < v[0] < 2**63 and (v[1] is None or v[1] in DTYPE_BY_NAME))  # NaN fails too

    return isinstance(sc, dict) and all(isinstance(d, dict) and all(map(ok, d.values())) for d in sc.values())
