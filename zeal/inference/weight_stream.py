"""ZeRO-Inference: serve a model whose weights exceed a memory budget by streaming its
decoder layers, one pass at a time, into a bounded set of resident slots.

The embeddings, the final norm and the head stay resident; every decoder layer lives in
a layer file (``disk``: read from the file system on every pass; ``cpu``: kept in pinned
host memory and copied to the accelerator) and is bound into one of ``slots`` fixed
buffers just before it runs, through a forward pre-hook on the layer module. While layer
``i`` computes, a background thread reads layer ``i + 1`` into the next slot (file reads
release the GIL), so with two slots or more the read overlaps the compute. The resident
weight bytes are fixed at start-up: the resident tensors plus ``slots`` times the largest
layer, at most the budget.

Layer files are written once per (model folder, dtype) under the cache (or
``offload_dir``), tensor by tensor from the folder's safetensors, so the whole model is
never in memory: ``layerNNNNN.bin`` (each tensor at a 64-byte aligned offset, as freshly
allocated tensors are, so the arithmetic is bitwise that of resident serving) and
``index.json`` (names, shapes, offsets). No pickle anywhere.

With ``quant`` ``int8`` or ``int4`` (:mod:`zeal.inference.weight_quant`) the layer
files hold the 2-d weights as packed codes and bf16 scales, so each pass reads about a
half or a quarter of the bytes. Such a layer is read one tensor at a time (its codes and
scales in one read) into a buffer the size of the largest tensor's packed bytes and
dequantized from there into the slot (in place for fp32 and bf16, through a bounded fp32
scratch for fp16); the slots hold the serving dtype, laid out as an unquantized layer file
would be. So the buffers beside the slots stay small.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import time
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from zeal.inference import weight_quant as wq
from zeal.utils.paths import cache_dir

ALIGN = 64
OFFLOAD_KINDS = ("none", "cpu", "disk")
_FORMAT = 1  # 2: quantized layer files (an older reader refuses them rather than misreading them)


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass
class LayerFiles:
    """The layer files of one model: per layer its file, size and tensors (name within
    the layer → ``[byte offset, shape]``, plus ``scale offset, group size`` for a tensor
    stored as ``quant`` codes); one dtype for all."""

    root: Path
    dtype: torch.dtype
    layers: list[dict]
    quant: str = "none"

    @property
    def bits(self) -> int:
        return wq.check_quant(self.quant)

    @property
    def max_layer_bytes(self) -> int:
        """The largest layer file (the bytes one read brings in)."""
        return max(layer["nbytes"] for layer in self.layers)

    def slot_layout(self, i: int) -> tuple[dict[str, int], int]:
        """Layer ``i`` in the serving dtype as laid out in a resident slot: name → byte
        offset (64-byte aligned, names sorted, as in an unquantized file) and the total."""
        esize = torch.empty((), dtype=self.dtype).element_size()
        offsets, off = {}, 0
        for key in sorted(self.layers[i]["tensors"]):
            off = _aligned(off)
            offsets[key] = off
            off += math.prod(self.layers[i]["tensors"][key][1]) * esize
        return offsets, off

    @property
    def max_slot_bytes(self) -> int:
        return max(self.slot_layout(i)[1] for i in range(len(self.layers)))

    def pieces(self, i: int) -> list[tuple[str, int, int]]:
        """Layer ``i`` as its reads: ``(name, first byte, bytes)``, a tensor stored as codes
        with its scales in one span."""
        esize = torch.empty((), dtype=self.dtype).element_size()
        out = []
        for key, e in self.layers[i]["tensors"].items():
            if len(e) == 2:
                out.append((key, e[0], math.prod(e[1]) * esize))
            else:
                rows, cols = e[1]
                out.append((key, e[0], e[2] + rows * (cols // e[3]) * 2 - e[0]))
        return out

    @property
    def max_piece_bytes(self) -> int:
        return max(n for i in range(len(self.layers)) for _, _, n in self.pieces(i))

    @property
    def scratch_numel(self) -> int:
        """fp32 elements of the dequantization scratch of a dtype other than fp32 and bf16
        (see :func:`weight_quant.decode_into`): 256 Ki, or the longest row when longer, or
        the largest stored tensor when smaller (0 in fp32 and bf16)."""
        shapes = [e[1] for layer in self.layers for e in layer["tensors"].values() if len(e) > 2]
        if not shapes or self.dtype in (torch.float32, torch.bfloat16):
            return 0
        return max(min(max(math.prod(s) for s in shapes), 1 << 18), max(s[1] for s in shapes))

    def read_range(self, i: int, offset: int, n: int, buf: torch.Tensor) -> None:
        """Bytes ``[offset, offset + n)`` of layer ``i``'s file into the front of the uint8 ``buf``."""
        view = memoryview(buf.numpy()).cast("B")[:n]
        with open(self.root / self.layers[i]["file"], "rb", buffering=0) as f:
            f.seek(offset)
            got = 0
            while got < n:
                k = f.readinto(view[got:])
                if not k:
                    raise OSError(f"{self.root / self.layers[i]['file']}: truncated at byte {offset + got}")
                got += k

    def read_into(self, i: int, buf: torch.Tensor) -> int:
        """Read layer ``i``'s bytes into the front of the uint8 CPU tensor ``buf``."""
        n = self.layers[i]["nbytes"]
        self.read_range(i, 0, n, buf)
        return n

    @staticmethod
    def open(root: Path) -> LayerFiles:
        index = json.loads((root / "index.json").read_text())
        if index.get("format") not in (_FORMAT, _FORMAT + 1):
            raise ValueError(f"{root}/index.json: unknown layer-file format {index.get('format')!r}")
        dtype = _DTYPES.get(index.get("dtype")) if isinstance(index.get("dtype"), str) else None
        if dtype is None:  # a name from a file is looked up in a fixed table, never as an attribute of torch
            raise ValueError(f"{root}/index.json: unknown dtype {index.get('dtype')!r:.40} "
                             f"(expected one of {', '.join(_DTYPES)})")
        return LayerFiles(root, dtype, index["layers"], index.get("quant", "none"))


_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}  # what layers hold


def _write_layer(root: Path, i: int, tensors: dict[str, torch.Tensor], dtype: torch.dtype,
                 quant: str = "none") -> dict:
    entries, offset = {}, 0
    name = f"layer{i:05d}.bin"
    bits = wq.check_quant(quant)
    with open(root / name, "wb") as f:

        def put(data: bytes) -> int:  # at the next 64-byte aligned offset
            nonlocal offset
            f.write(b"\0" * (_aligned(offset) - offset))
            at = offset = _aligned(offset)
            f.write(data)
            offset += len(data)
            return at

        for key in sorted(tensors):
            t = tensors[key].to(dtype).contiguous()
            if bits and wq.is_quantized(t):
                codes, scales, group = wq.encode(t, bits)
                at = put(codes)
                entries[key] = [at, list(t.shape), put(scales), group]
                continue
            entries[key] = [put(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""),
                            list(t.shape)]
    return {"file": name, "nbytes": offset, "tensors": entries}


def _write_index(root: Path, dtype: torch.dtype, layers: list[dict], quant: str = "none") -> None:
    text = json.dumps({"format": _FORMAT + (quant != "none"), "dtype": str(dtype).removeprefix("torch."), "quant": quant,
                       "layers": layers})
    (root / "index.json").write_text(text)


def folder_key(folder: Path, dtype: torch.dtype, quant: str = "none") -> str:
    """What names a model's layer files: its folder, file sizes and times, the dtype and
    the weight storage (``quant``)."""
    parts = [str(folder.resolve()), str(dtype)] + ([quant] if quant != "none" else [])
    for p in sorted(folder.glob("*.safetensors")):
        st = p.stat()
        parts.append(f"{p.name}:{st.st_size}:{st.st_mtime_ns}")
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:20]


def build_layer_files(folder: Path, layer_of: dict[str, tuple[int, str]], convert, dtype: torch.dtype,
                      root: Path, quant: str = "none") -> tuple[LayerFiles, dict[str, torch.Tensor]]:
    """Read the folder's safetensors one tensor at a time: decoder-layer tensors go to layer
    files under ``root`` (written once; a layer is flushed as soon as it is complete), the
    others are returned (the resident part). ``convert(name, tensor)`` maps a checkpoint
    tensor to ``[(model name, tensor), ...]``; ``layer_of`` maps a model name to
    ``(layer, name within the layer)``; ``quant``: the storage of the 2-d weights."""
    expected: dict[int, int] = defaultdict(int)
    for layer, _ in layer_of.values():
        expected[layer] += 1
    reuse = (root / "index.json").is_file()
    tmp = root.with_name(root.name + f".tmp{os.getpid()}")
    pending: dict[int, dict[str, torch.Tensor]] = defaultdict(dict)
    layers: dict[int, dict] = {}
    resident: dict[str, torch.Tensor] = {}
    if not reuse:
        tmp.mkdir(parents=True, exist_ok=True)
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open has keys(), not iteration
                in_layers = [(n, t) for n, t in convert(key, None) if n in layer_of]
                if reuse and in_layers:
                    continue
                for name, t in convert(key, f.get_tensor(key)):
                    if name not in layer_of:
                        resident[name] = t.to(dtype=dtype, copy=True)
                        continue
                    layer, local = layer_of[name]
                    pending[layer][local] = t
                    if len(pending[layer]) == expected[layer]:
                        layers[layer] = _write_layer(tmp, layer, pending.pop(layer), dtype, quant)
    if not reuse:
        if pending or len(layers) != len(expected):
            missing = sorted(set(expected) - set(layers))
            shutil.rmtree(tmp, ignore_errors=True)
            raise ValueError(f"{folder}: decoder layers {missing} are incomplete in the checkpoint")
        _write_index(tmp, dtype, [layers[i] for i in sorted(layers)], quant)
        root.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.replace(tmp, root)
        except OSError:  # another process built the same files first
            shutil.rmtree(tmp, ignore_errors=True)
    files = LayerFiles.open(root)
    if (files.dtype, files.quant) != (dtype, quant):
        raise ValueError(f"offload_dir {root} holds {files.quant} layer files in {files.dtype}, not {quant} in "
                         f"{dtype}: give another offload_dir")
    return files, resident


def default_offload_dir(folder: Path, dtype: torch.dtype, quant: str = "none") -> Path:
    return cache_dir() / "weights-offload" / folder_key(folder, dtype, quant)


@dataclass
class StreamStats:
    """What streaming did: bytes read, reads, time spent waiting for a layer."""

    bytes_read: int = 0
    reads: int = 0
    wait_s: float = 0.0
    resident_bytes: int = 0
    slots: int = 0
    layer_bytes: list[int] = field(default_factory=list)


class LayerStreamer:
    """Binds decoder layers into ``slots`` resident buffers around their forward: with
    ``slots`` ≥ 3 the first ``slots - 2`` layers stay bound, the others take turns in
    the last two slots (the next one read while the current one computes)."""

    def __init__(self, layers: nn.ModuleList, files: LayerFiles, slots: int, device: torch.device,
                 host_copies: bool = False) -> None:
        if slots < 1:
            raise ValueError("weight streaming needs at least one layer slot")
        self.layers, self.files, self.device = layers, files, torch.device(device)
        self.n = len(layers)
        self.slots = min(slots, self.n)
        cuda = self.device.type == "cuda"
        size = files.max_layer_bytes
        self.bits = files.bits
        self.bufs = [torch.empty(files.max_slot_bytes, dtype=torch.uint8, device=self.device)
                     for _ in range(self.slots)]
        # CPU: read straight into the slot; CUDA: read (or copy) into pinned staging first.
        # Quantized files: into one buffer of packed bytes (reads never overlap), then
        # dequantized into the slot.
        piece = files.max_piece_bytes if self.bits else 0
        self.packed = torch.empty(piece, dtype=torch.uint8, device=self.device) if self.bits else None
        # fp32 products before their 16-bit cast
        self.scratch = torch.empty(files.scratch_numel if self.bits else 0, device=self.device)
        targets = [self.packed] if self.bits else self.bufs
        self.staging = [torch.empty(piece if self.bits else size, dtype=torch.uint8, pin_memory=True)
                        for _ in targets] if cuda else targets
        self.host = None
        if host_copies:  # the 'cpu' tier: every layer in pinned host memory
            self.host = []
            for i in range(self.n):
                t = torch.empty(files.layers[i]["nbytes"], dtype=torch.uint8, pin_memory=cuda)
                files.read_into(i, t)
                self.host.append(t)
        self.layouts = [files.slot_layout(i)[0] for i in range(self.n)]
        self.params = [self._layer_params(i) for i in range(self.n)]
        self.empty = torch.empty(0, dtype=files.dtype, device=self.device)
        self.stats = StreamStats(slots=self.slots, layer_bytes=[layer["nbytes"] for layer in files.layers])
        self.bound: dict[int, int] = {}  # layer → slot its weights are in
        self.pending: tuple[int, int, Future] | None = None  # (layer, slot, read)
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zeal-weights")
        self.handles = []
        # Two slots stream (one computes while the next is read); the slots beyond them
        # keep the first layers resident for good, so a larger budget streams fewer bytes.
        self.pinned = self.n if self.slots >= self.n else max(0, self.slots - 2)
        for i in range(self.pinned):
            self._fill(i, i)
            self._bind(i, i)
        self.stream_slots = list(range(self.pinned, self.slots))
        self.cursor = 0
        self.streamed = list(range(self.pinned, self.n))
        for j, i in enumerate(self.streamed):
            nxt = self.streamed[(j + 1) % len(self.streamed)]
            self.handles.append(layers[i].register_forward_pre_hook(self._make_before(i, nxt)))
            self.handles.append(layers[i].register_forward_hook(self._make_after(i)))
            self._unbind(i)

    def _layer_params(self, i: int) -> list[tuple[nn.Parameter, int, list[int]]]:
        named = dict(self.layers[i].named_parameters())
        entries = self.files.layers[i]["tensors"]
        missing = sorted(set(named) - set(entries))
        if missing:
            raise ValueError(f"layer file {i} lacks {', '.join(missing)}")
        offsets = self.layouts[i]
        return [(named[k], offsets[k], entry[1]) for k, entry in entries.items() if k in named]

    def _next_slot(self) -> int:
        s = self.stream_slots[self.cursor]
        self.cursor = (self.cursor + 1) % len(self.stream_slots)
        return s

    def _fill(self, i: int, slot: int) -> int:
        """Layer ``i``'s bytes into ``slot`` (runs on the reader thread)."""
        if self.bits:
            return self._fill_quantized(i, slot)
        stage = self.staging[slot]
        if self.host is not None:
            n = self.host[i].numel()
            stage[:n].copy_(self.host[i])
        else:
            n = self.files.read_into(i, stage)
        if stage is not self.bufs[slot]:
            self.bufs[slot][:n].copy_(stage[:n], non_blocking=True)
            torch.cuda.current_stream(self.device).synchronize()
        self.stats.bytes_read += n
        self.stats.reads += 1
        return slot

    def _piece(self, i: int, offset: int, n: int) -> torch.Tensor:
        """Bytes ``[offset, offset + n)`` of layer ``i`` in the packed buffer (on the device)."""
        stage, packed = self.staging[0], self.packed
        if self.host is not None:
            packed[:n].copy_(self.host[i][offset: offset + n], non_blocking=True)
        else:
            self.files.read_range(i, offset, n, stage)
            if stage is not packed:
                packed[:n].copy_(stage[:n], non_blocking=True)
        self.stats.bytes_read += n
        return packed[:n]

    def _fill_quantized(self, i: int, slot: int) -> int:
        """Layer ``i`` tensor by tensor through the packed buffer, dequantized into ``slot``."""
        buf, dtype = self.bufs[slot], self.files.dtype
        esize = torch.empty((), dtype=dtype).element_size()
        entries = self.files.layers[i]["tensors"]
        for key, off, n in self.files.pieces(i):
            entry, dst = entries[key], self.layouts[i][key]
            data = self._piece(i, off, n)
            if len(entry) == 2:  # stored in the serving dtype
                buf[dst: dst + n].copy_(data)
                continue
            (rows, cols), scale_at = entry[1], entry[2] - off
            out = buf[dst: dst + rows * cols * esize].view(dtype).view(rows, cols)
            scales = data[scale_at: scale_at + rows * (cols // entry[3]) * 2]
            wq.decode_into(out, data[: wq.code_bytes(rows * cols, self.bits)], scales, self.bits, self.scratch)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self.stats.reads += 1
        return slot

    def _bind(self, i: int, slot: int) -> None:
        buf, dtype = self.bufs[slot], self.files.dtype
        esize = torch.empty((), dtype=dtype).element_size()
        for p, off, shape in self.params[i]:
            p.data = buf[off: off + math.prod(shape) * esize].view(dtype).view(shape)
        self.bound[i] = slot

    def _unbind(self, i: int) -> None:
        for p, _, _ in self.params[i]:
            p.data = self.empty
        self.bound.pop(i, None)

    def _make_before(self, i: int, nxt: int):
        def before(module: nn.Module, args: tuple) -> None:
            self._ensure(i)
            if len(self.stream_slots) > 1 and nxt not in self.bound and self.pending is None:
                slot = self._next_slot()
                self.pending = (nxt, slot, self.pool.submit(self._fill, nxt, slot))
        return before

    def _make_after(self, i: int):
        def after(module: nn.Module, args: tuple, out: object) -> None:
            self._unbind(i)
        return after

    def _ensure(self, i: int) -> None:
        """Layer ``i`` bound into a slot: the prefetched read if it was this layer, else
        a read now (after any read in flight, which may target the slot taken next)."""
        if i in self.bound:
            return
        t0 = time.perf_counter()
        if self.pending is not None:
            layer, slot, fut = self.pending
            self.pending = None
            fut.result()
            if layer == i:
                self._bind(i, slot)
                self.stats.wait_s += time.perf_counter() - t0
                return
        slot = self._next_slot()
        self._fill(i, slot)
        self._bind(i, slot)
        self.stats.wait_s += time.perf_counter() - t0

    def close(self) -> None:
        """Wait for a read in flight and remove the hooks."""
        if self.pending is not None:
            self.pending[2].result()
            self.pending = None
        for h in self.handles:
            h.remove()
        self.pool.shutdown(wait=True)


def load_streamed_model(path: Path, dtype: torch.dtype, device: str | torch.device, offload: str,
                        max_resident_bytes: int, offload_dir: str | os.PathLike | None = None,
                        quant: str = "none") -> tuple[nn.Module, dict, LayerStreamer]:
    """The model of the HF folder ``path`` with its decoder layers streamed (``offload``:
    ``disk`` or ``cpu``) under ``max_resident_bytes`` of resident weights, their 2-d
    weights stored as ``quant`` (``none``, ``int8``, ``int4``). Returns
    ``(model, config_dict, streamer)``."""
    from zeal.models.hf import hf_skeleton

    device = torch.device(device)
    if offload not in ("cpu", "disk"):
        raise ValueError(f"weights_offload must be one of {', '.join(OFFLOAD_KINDS)}, got {offload!r}")
    if offload == "cpu" and device.type == "cpu":
        raise ValueError("weights_offload 'cpu' streams host memory to an accelerator; with device 'cpu' "
                         "use weights_offload 'disk'")
    bits = wq.check_quant(quant)
    sk = hf_skeleton(path)
    if (sk.config.get("quantization_config") or {}).get("quant_method") == "compressed-tensors":
        raise ValueError("weights_offload: compressed-tensors folders are not streamed yet; serve them without it")
    if sk.whole is not None:
        raise ValueError(f"weights_offload: model_type {sk.config.get('model_type')!r} is not streamed yet "
                         "(its checkpoint needs a whole-state rewrite); serve it without weights_offload")
    layers = sk.model.layer_stack()
    prefix = next(n for n, m in sk.model.named_modules() if m is layers)
    layer_of = {f"{prefix}.{i}.{n}": (i, n) for i, layer in enumerate(layers) for n, _ in layer.named_parameters()}
    root = Path(offload_dir) if offload_dir else default_offload_dir(Path(path), dtype, quant)
    files, resident = build_layer_files(Path(path), layer_of, sk.convert, dtype, root, quant)
    model = sk.finish(resident, frozenset(layer_of))
    for name in layer_of:
        owner, attr = name.rsplit(".", 1)
        setattr(model.get_submodule(owner), attr, nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False))
    model.to(device)
    # resident: embeddings, norms, head + the slots (+ the packed read buffer and, for a 16-bit
    # dtype, the fp32 dequantization scratch when quantized)
    fixed = _resident_bytes(model, layer_of)
    if bits:
        fixed += files.max_piece_bytes + 4 * files.scratch_numel
    slot_bytes = files.max_slot_bytes
    slots = (max_resident_bytes - fixed) // slot_bytes
    if slots < 1:
        gb = 1 << 30
        raise ValueError(f"max_resident_weights_gb {max_resident_bytes / gb:.4g} is below one pass's minimum "
                         f"{(fixed + slot_bytes) / gb:.4g} GB ({fixed / gb:.4g} GB resident embeddings, "
                         f"norms and head{', packed read buffer and scratch' if bits else ''} + {slot_bytes / gb:.4g} GB "
                         "for one decoder layer)")
    streamer = LayerStreamer(layers, files, int(slots), device, host_copies=offload == "cpu")
    streamer.stats.resident_bytes = fixed + streamer.slots * slot_bytes
    return model, sk.config, streamer


def _resident_bytes(model: nn.Module, streamed: dict[str, tuple[int, str]]) -> int:
    """Bytes of the parameters and buffers that stay resident (tied tensors once)."""
    seen, total = set(), 0
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if name in streamed or t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total
