"""Tensor parallelism (Megatron-style, DeepSpeed's AutoTP key): the apply-step that splits
a plain model's attention and MLP linears over the ``tp`` dimension of the mesh.

Each transformer block holds two *split pairs*: attention (q/k/v by columns, the output
projection by rows) and the MLP (gate/up or fc by columns, down or proj by rows). A pair
costs one all-reduce in forward (the row-parallel output, :func:`~zeal.dist.regions.reduce_from_tp`) and one
in backward (the gradient of the column-parallel input,
:func:`~zeal.dist.regions.copy_to_tp`), both through
the accounted ``mesh.tp`` Comm (kind ``"activation"``, dimension ``"tp"``). The split is
in place: every Parameter keeps its identity and name and gets this rank's slice as its
data (so an optimizer or a ZeRO group built over the model still sees it); only the
attention's head-count attributes and the row linears' ``forward`` change.

What stays whole on every tp rank: norms, position embeddings and the row linears'
biases; the token embedding and the LM head too when the tp size does not divide the
vocabulary (or for a PipelineModule's layers, or when serving) — otherwise training splits
them by vocabulary rows (under pipeline parallelism: the first stage's embedding, the last
stage's head) with a vocabulary-parallel cross-entropy
(:mod:`zeal.parallel.vocab`, applied after this step). These *replicated* parameters get
identical gradients on every tp rank because every column pair all-reduces its input
gradient. GQA key/value
heads are split whole (the tp size must divide both head counts). Known families:
zeal's GPT and Llama, Hugging Face's Llama, Qwen2, Mistral (``q_proj ... down_proj``)
and GPT-2 (``Conv1D``, fused ``c_attn``). Any other linear layer (outside the head) is
refused naming its module. MoE layers (:class:`zeal.moe.MoE`): each expert split like an
MLP, the router whole, tokens deduplicated around the all-to-alls (:mod:`zeal.moe.tensor`).

RNG: the tp ranks of a group start from tp rank 0's generator state and run the same
random ops on same-shaped tensors, so dropout masks of replicated activations agree;
random ops inside a split pair draw from the per-tp-rank stream of
:mod:`zeal.parallel.rng` (applied by training after this step).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from zeal.config import ConfigError
from zeal.dist.comm import Comm
from zeal.dist.regions import copy_to_tp, gather_from_tp, reduce_from_tp, slice_for_tp

__all__ = ["Split", "TensorParallel", "apply_tensor_parallel", "copy_to_tp", "gather_from_tp", "reduce_from_tp",
           "slice_for_tp"]

# -- what a split parameter is --------------------------------------------------------------
@dataclass(frozen=True)
class Split:
    """How one parameter is split: along ``dim`` of its ``global_shape``, this rank holds
    ``segments``, each ``(local_start, global_start, length)`` along ``dim`` (one segment,
    or one per part of a fused q/k/v weight)."""

    dim: int
    global_shape: tuple[int, ...]
    segments: tuple[tuple[int, int, int], ...]


@dataclass
class TensorParallel:
    """What :func:`apply_tensor_parallel` did: the tp Comm, this rank's coordinates and
    the split of every split parameter, by name (first name in ``named_parameters``)."""

    comm: Comm
    size: int
    rank: int
    splits: dict[str, Split] = field(default_factory=dict)
    modules: list[str] = field(default_factory=list)  # the split pairs' module names


def _slice_param(p: nn.Parameter, dim: int, parts: int, size: int, rank: int) -> Split:
    """Keep this rank's slice of ``p`` along ``dim`` (``parts`` fused blocks, each split
    in ``size``); the Parameter object stays, its data becomes the slice."""
    full = tuple(p.shape)
    block = full[dim] // parts
    step = block // size
    segs = tuple((j * step, j * block + rank * step, step) for j in range(parts))
    with torch.no_grad():
        pieces = [p.data.narrow(dim, g, n) for _, g, n in segs]
        local = pieces[0] if parts == 1 else torch.cat(pieces, dim)
        p.data = local.clone()
    return Split(dim, full, segs)


# -- families -------------------------------------------------------------------------------
def _is_conv1d(m: nn.Module) -> bool:
    """Hugging Face's ``Conv1D`` (GPT-2): weight (in, out), ``nf`` outputs."""
    return type(m).__name__ == "Conv1D" and hasattr(m, "nf")


def _is_linear(m: nn.Module) -> bool:
    return isinstance(m, nn.Linear) or _is_conv1d(m)


def _child(mod: nn.Module, name: str) -> nn.Module | None:
    c = getattr(mod, name, None)
    return c if isinstance(c, nn.Module) and _is_linear(c) else None


@dataclass
class _Pair:
    """One split pair: column linears (with fused part counts), the row linear, the head
    unit (size that must be divisible) and the attributes to rescale."""

    name: str
    module: nn.Module
    columns: list[tuple[nn.Module, int]]
    row: nn.Module
    divisible: dict[str, int]
    attrs: tuple[str, ...]


def _attention_pair(name: str, mod: nn.Module) -> _Pair | None:
    q, k, v, o = (_child(mod, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
    if q is not None and k is not None and v is not None and o is not None:
        hd = getattr(mod, "head_dim", None) or getattr(mod, "hd", None)
        if not isinstance(hd, int) or any(_is_conv1d(x) for x in (q, k, v, o)):
            raise ConfigError(f"tensor_parallel: cannot split attention module '{name}' ({type(mod).__name__}): "
                              "no integer head_dim")
        nh, nkv = q.out_features // hd, k.out_features // hd
        return _Pair(name, mod, [(q, 1), (k, 1), (v, 1)], o, {"attention heads": nh, "key/value heads": nkv},
                     ("num_heads", "nh", "num_key_value_heads", "nkv"))
    c_attn, c_proj = _child(mod, "c_attn"), _child(mod, "c_proj")
    if c_attn is not None and c_proj is not None:
        if getattr(mod, "is_cross_attention", False) or _child(mod, "q_attn") is not None:
            raise ConfigError(f"tensor_parallel: cannot split cross-attention module '{name}'")
        nh = getattr(mod, "num_heads", None) or getattr(mod, "n_head", None)
        if not isinstance(nh, int):
            raise ConfigError(f"tensor_parallel: cannot split attention module '{name}' ({type(mod).__name__}): "
                              "no head count")
        return _Pair(name, mod, [(c_attn, 3)], c_proj, {"attention heads": nh},
                     ("num_heads", "n_head", "embed_dim", "split_size"))
    return None


def _mlp_pair(name: str, mod: nn.Module) -> _Pair | None:
    g, u, d = (_child(mod, n) for n in ("gate_proj", "up_proj", "down_proj"))
    if g is not None and u is not None and d is not None:
        return _Pair(name, mod, [(g, 1), (u, 1)], d, {"intermediate size": g.out_features},
                     ("intermediate_size",))
    fc, proj = _child(mod, "c_fc"), _child(mod, "c_proj")
    if fc is not None and proj is not None and _child(mod, "c_attn") is None:
        width = fc.nf if _is_conv1d(fc) else fc.out_features
        return _Pair(name, mod, [(fc, 1)], proj, {"intermediate size": width}, ())
    return None


def _find_pairs(model: nn.Module) -> list[_Pair]:
    pairs = []
    for name, mod in model.named_modules():
        pair = _attention_pair(name, mod) or _mlp_pair(name, mod)
        if pair is not None:
            pairs.append(pair)
    return pairs


def _head_modules(model: nn.Module) -> set[nn.Module]:
    """Linears that stay whole: the output head."""
    out = set()
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    for m in (head, getattr(model, "lm_head", None)):
        if isinstance(m, nn.Module):
            out.add(m)
    return out


def _check_coverage(model: nn.Module, pairs: list[_Pair], replicated: set[int] = frozenset()) -> None:
    covered = {id(m) for p in pairs for m in (p.row, *(c for c, _ in p.columns))}
    covered |= {id(m) for m in _head_modules(model)} | replicated
    for name, m in model.named_modules():
        if _is_linear(m) and id(m) not in covered:
            raise ConfigError(f"tensor_parallel: zeal cannot split module '{name}' ({type(m).__name__}): "
                              "it is not an attention or MLP projection of a known model family")
    if not pairs:
        raise ConfigError(f"tensor_parallel: no attention or MLP module of a known family in "
                          f"{type(model).__name__} (zeal splits GPT-2, Llama, Qwen2, Mistral and zeal's models)")


# -- applying a pair ------------------------------------------------------------------------
def _row_forward(mod: nn.Module, comm: Comm, x: torch.Tensor) -> torch.Tensor:
    """A row-parallel linear: local partial product, summed over tp, then the bias once."""
    if _is_conv1d(mod):
        y = torch.matmul(x, mod.weight)
    else:
        y = F.linear(x, mod.weight)
    y = reduce_from_tp(y, comm)
    return y if mod.bias is None else y + mod.bias


def _input_hook(comm: Comm, mod: nn.Module, args: tuple, kwargs: dict):
    """Forward pre-hook of a pair's module: its hidden-states input enters the tp region."""
    if args:
        return (copy_to_tp(args[0], comm), *args[1:]), kwargs
    for key in ("hidden_states", "x", "h"):
        if isinstance(kwargs.get(key), torch.Tensor):
            return args, {**kwargs, key: copy_to_tp(kwargs[key], comm)}
    raise RuntimeError(f"tensor_parallel: {type(mod).__name__} was called without a hidden-states input")


def _split_pair(pair: _Pair, tp: TensorParallel, split_of: dict[int, Split]) -> None:
    size, rank = tp.size, tp.rank
    for what, n in pair.divisible.items():
        if n % size:
            raise ConfigError(f"tensor_parallel.autotp_size {size} does not divide the {n} {what} of "
                              f"module '{pair.name}'")
    for lin, parts in pair.columns:
        conv = _is_conv1d(lin)
        split_of[id(lin.weight)] = _slice_param(lin.weight, 1 if conv else 0, parts, size, rank)
        if lin.bias is not None:
            split_of[id(lin.bias)] = _slice_param(lin.bias, 0, parts, size, rank)
        if conv:
            lin.nf = lin.weight.shape[1]
        else:
            lin.out_features = lin.weight.shape[0]
    row = pair.row
    conv = _is_conv1d(row)
    split_of[id(row.weight)] = _slice_param(row.weight, 0 if conv else 1, 1, size, rank)
    if not conv:
        row.in_features = row.weight.shape[1]
    row.forward = functools.partial(_row_forward, row, tp.comm)
    for attr in pair.attrs:
        v = getattr(pair.module, attr, None)
        if isinstance(v, int) and not isinstance(v, bool):
            setattr(pair.module, attr, v // size)
    pair.module.register_forward_pre_hook(functools.partial(_input_hook, tp.comm), with_kwargs=True)
    tp.modules.append(pair.name)


def _sync_rng(comm: Comm, device: torch.device) -> None:
    """Every tp rank continues from tp rank 0's generator state."""
    state = torch.get_rng_state()
    comm.broadcast(state, 0, "control")
    torch.set_rng_state(state)
    if device.type == "cuda":
        cuda_state = torch.cuda.get_rng_state(device).to(device)
        comm.broadcast(cuda_state, 0, "control")
        torch.cuda.set_rng_state(cuda_state.cpu(), device)


# A split rule for layers the family rules here do not know, handed in by the package that
# owns them (MoE: :func:`zeal.moe.tensor.moe_tensor_parallel`): (model, tp comm, tp rank,
# ids of the modules already in a pair) -> (more pairs, ids of linears kept whole).
SplitRule = Callable[..., tuple[list, set[int]]]


def apply_tensor_parallel(model: nn.Module, size: int, mesh,
                          extra_rules: tuple[SplitRule, ...] = ()) -> TensorParallel | None:
    """Split ``model``'s attention and MLP linears over ``mesh.tp`` (size ``size``, which
    must equal the mesh's tp size), and the pairs ``extra_rules`` find (see ``SplitRule``).
    Returns what was split (None at size 1). Raises
    :class:`ConfigError` naming the module for a head count ``size`` does not divide or a
    linear layer of an unknown family."""
    if size <= 1:
        return None
    if mesh.tp_size != size:
        raise ConfigError(f"tensor_parallel.autotp_size {size} != the mesh's tp size {mesh.tp_size}")
    tp = TensorParallel(mesh.tp, size, mesh.tp_rank)
    pairs = _find_pairs(model)
    replicated: set[int] = set()
    for rule in extra_rules:  # e.g. MoE: experts split, routers whole (DeepSpeed-TED)
        more, whole = rule(model, tp.comm, tp.rank, {id(p.module) for p in pairs})
        pairs += more
        replicated |= whole
    _check_coverage(model, pairs, replicated)
    split_of: dict[int, Split] = {}
    for pair in pairs:
        _split_pair(pair, tp, split_of)
    for name, p in model.named_parameters():
        if id(p) in split_of:
            tp.splits.setdefault(name, split_of[id(p)])
    _sync_rng(mesh.tp, mesh.device)
    return tp


def init_full_then_slice(init, model: nn.Module, tp: TensorParallel):
    """Wrap a per-module initialiser (for models built on the meta device): a module
    owning split parameters is initialised at its full size on a temporary copy, and this
    rank keeps its slices, so every tp rank's shard comes from the same full tensor (not
    the same local values on every rank)."""
    owned: dict[int, list[tuple[str, Split]]] = {}
    for mod in model.modules():
        for pname, p in mod.named_parameters(recurse=False):
            name = next((n for n, q in model.named_parameters() if q is p), None)
            if name in tp.splits:
                owned.setdefault(id(mod), []).append((pname, tp.splits[name]))

    def wrapped(m: nn.Module) -> None:
        parts = owned.get(id(m))
        if not parts:
            return init(m)
        tmp = copy.copy(m)  # shallow: its own parameter dict, the same code
        tmp._parameters = dict(m._parameters)
        for pname, split in parts:
            p = m._parameters[pname]
            tmp._parameters[pname] = nn.Parameter(torch.empty(split.global_shape, dtype=p.dtype, device=p.device))
        init(tmp)
        with torch.no_grad():
            for pname, split in parts:
                full = tmp._parameters[pname]
                for lo, g, n in split.segments:
                    m._parameters[pname].narrow(split.dim, lo, n).copy_(full.narrow(split.dim, g, n))
        return None

    return wrapped


def gather_full(tp: TensorParallel, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (a state dict of this rank's slices) with every split parameter replaced by
    its whole tensor, assembled from all tp ranks (collective over tp: every tp rank calls
    it with the same keys)."""
    out = dict(state)
    for name, split in tp.splits.items():
        local = state.get(name)
        if local is None:
            continue
        device = tp.comm.ctx.device  # the collective runs where the backend wants it
        every = torch.empty(tp.size * local.numel(), dtype=local.dtype, device=device)
        tp.comm.all_gather(every, local.contiguous().view(-1).to(device), "param")
        every = every.to(local.device)
        full = torch.empty(split.global_shape, dtype=local.dtype, device=local.device)
        parts = len(split.segments)
        for r, piece in enumerate(every.view(tp.size, *local.shape)):
            block = split.global_shape[split.dim] // parts
            for j, (lo, _, n) in enumerate(split.segments):
                full.narrow(split.dim, j * block + r * n, n).copy_(piece.narrow(split.dim, lo, n))
        out[name] = full
    return out
