"""Flat units: parameters laid out back to back in one padded buffer.

A :class:`FlatUnit` owns the storage of its parameters. Each parameter's ``.data``
is a view into ``unit.full`` (set once, no attributes added to the Parameter).
For a *partitioned* unit (ZeRO-3) the storage of ``full`` is released when the
unit is not in use (resized to 0 bytes, as FSDP does), while ``unit.shard`` keeps
this rank's slice; gathering resizes the storage back and all-gathers into it, so
the views, and any autograd references to the parameters, see the data again.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from zeal.zero.partition import bucketize, layout, padded_size, shard_range


class FlatUnit:
    """Parameters of one unit in a flat buffer of ``padded`` elements; rank r owns
    ``[start, end)``. ``trainable`` units carry gradients and optimizer state;
    ``group`` is the optimizer param-group index."""

    def __init__(
        self, index: int, named_params: list[tuple[str, nn.Parameter]], rank: int, world: int,
        dtype: torch.dtype, device: torch.device, partitioned: bool, group: int = 0,
    ) -> None:
        self.index = index
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        self.slots, self.numel = layout([(n, tuple(p.shape)) for n, p in named_params])
        self.padded = padded_size(self.numel, world)
        self.shard_numel = self.padded // world
        self.start, self.end = shard_range(self.padded, rank, world)
        self.dtype, self.device = dtype, device
        self.partitioned = partitioned
        self.trainable = self.params[0].requires_grad
        self.group = group
        self.persistent = False  # ZeRO-3: kept gathered (small units)
        self.comm_group = 0  # 1 + index of its CommGroup (zeal.zero.groups), 0: ZeRO's dp Comm
        self.comm = None  # the Comm this unit is sharded over when not ZeRO's dp Comm (its CommGroup's)
        self.needs_init = any(p.is_meta for p in self.params)
        # A partitioned unit built from meta parameters gets no storage until it is
        # materialised, so building a model never holds more than one unit whole.
        lazy = partitioned and self.needs_init
        # (untouched pages of an empty tensor cost no memory; lazy units free it below)
        self.full = (torch.empty if lazy else torch.zeros)(self.padded, dtype=dtype, device=device)
        self.replaced: dict[int, nn.Parameter] = {}  # id(meta parameter) -> its materialised successor
        for i, (slot, p) in enumerate(zip(self.slots, self.params)):
            view = self.full[slot.offset:slot.end].view(slot.shape)
            if p.is_meta:  # a meta tensor cannot take real data: a new Parameter replaces it
                # Built empty and then pointed at the view (as for real parameters below), so
                # that the parameter keeps a version counter of its own: gathers write into
                # ``full`` while autograd holds the parameter for backward.
                fresh = nn.Parameter(torch.empty(0, dtype=dtype, device=device), requires_grad=p.requires_grad)
                fresh.data = view
                self.params[i] = self.replaced[id(p)] = fresh
            else:
                view.copy_(p.detach())
                p.data = view
        self.shard = self.full[self.start:self.end]
        if partitioned:
            self.shard = torch.empty(0, dtype=dtype, device=device) if lazy else self.shard.clone()
        self.gathered = True
        if lazy:  # views are in place; storage comes back with alloc_full()
            self.full.untyped_storage().resize_(0)
            self.gathered = False

    # -- storage of the full buffer (partitioned units only) ---------------------------
    def free_full(self) -> None:
        """Drop the gathered copy; the shard stays."""
        if self.partitioned and self.gathered and not self.persistent:
            self.full.untyped_storage().resize_(0)
            self.gathered = False

    def alloc_full(self) -> None:
        """Give ``full`` its storage back (contents undefined until gathered)."""
        if not self.gathered:
            self.full.untyped_storage().resize_(self.padded * self.full.element_size())
            self.gathered = True

    def refresh_shard_from_full(self) -> None:
        """After ``full`` was written whole (init, broadcast), take this rank's slice."""
        if self.partitioned:
            if self.shard.numel() != self.shard_numel:
                self.shard = torch.empty(self.shard_numel, dtype=self.dtype, device=self.device)
            self.shard.copy_(self.full[self.start:self.end])

    def nbytes_shard(self) -> int:
        return self.shard_numel * self.full.element_size()

    def __repr__(self) -> str:
        return f"FlatUnit({self.index}, params={len(self.params)}, numel={self.numel}, padded={self.padded})"


def replace_meta_parameters(model: nn.Module, units: list[FlatUnit]) -> None:
    """Put each unit's materialised parameters into every module that registered the
    meta original (tied parameters are registered by several modules)."""
    new = {k: v for u in units for k, v in u.replaced.items()}
    if not new:
        return
    for mod in model.modules():
        for name, p in list(mod._parameters.items()):
            if p is not None and id(p) in new:
                mod._parameters[name] = new[id(p)]


def _param_names(model: nn.Module) -> dict[int, str]:
    names: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=True):
        names.setdefault(id(p), name)
    return names


def build_bucket_units(
    model: nn.Module, groups: list[list[nn.Parameter]], bucket_elems: int, rank: int, world: int,
    dtype: torch.dtype, device: torch.device,
) -> list[FlatUnit]:
    """Stages 0–2: trainable parameters in buckets of ``bucket_elems``, in reverse
    registration order (roughly the order backward produces gradients), never
    mixing optimizer groups. Frozen parameters stay where they are."""
    names = _param_names(model)
    units: list[FlatUnit] = []
    for g, params in enumerate(groups):
        params = [p for p in reversed(params) if p.requires_grad]
        for idx in bucketize([p.numel() for p in params], bucket_elems):
            named = [(names[id(params[i])], params[i]) for i in idx]
            units.append(FlatUnit(len(units), named, rank, world, dtype, device, partitioned=False, group=g))
    return units


# A repeated block (a child of an nn.ModuleList: a transformer layer) with at most this many
# parameter elements becomes one unit: below it, per-module units are so small that the fixed
# cost of each collective and hook outweighs moving the bytes (measured on a 10M GPT).
COALESCE_BLOCK_ELEMS = 4_000_000


def _coalesced_blocks(model: nn.Module, max_elems: int) -> dict[nn.Module, nn.Module]:
    """Module -> the small repeated block it belongs to (outermost wins)."""
    root_of: dict[nn.Module, nn.Module] = {}
    for mod in model.modules():
        if not isinstance(mod, nn.ModuleList) or mod in root_of:
            continue
        for block in mod:
            if block in root_of or not 0 < sum(p.numel() for p in block.parameters()) <= max_elems:
                continue
            for sub in block.modules():
                root_of.setdefault(sub, block)
    return root_of


def build_module_units(
    model: nn.Module, group_of: dict[int, int], rank: int, world: int, dtype: torch.dtype,
    device: torch.device, coalesce_block_elems: int = COALESCE_BLOCK_ELEMS,
    placement: Callable[[nn.Parameter], tuple[int, int, int]] | None = None,
) -> tuple[list[FlatUnit], dict[nn.Module, list[FlatUnit]]]:
    """Stage 3: one unit per module and (trainable, group) for the parameters it
    registers directly, in module order; a small repeated block (see
    ``COALESCE_BLOCK_ELEMS``) is one module here, with all the parameters of its
    subtree. A parameter shared by several modules (tied weights) belongs to the
    first; every module that registers it needs that unit, which the returned
    ``module → units`` map records (hooks go on exactly these modules). ``placement(p)``
    = ``(comm_group, rank, world)``: parameters of a CommGroup (comm_group > 0,
    :mod:`zeal.zero.groups`) get units of their own (``unit.comm_group``), sharded over
    that group (whose Comm the caller sets as ``unit.comm``)."""
    names = _param_names(model)
    root_of = _coalesced_blocks(model, coalesce_block_elems)
    owner: dict[int, FlatUnit] = {}
    units: list[FlatUnit] = []
    needs: dict[nn.Module, list[FlatUnit]] = {}
    for mod in model.modules():
        root = root_of.get(mod)
        if root is not None and root is not mod:
            continue  # inside a coalesced block: the block stands for it
        direct = [p for _, p in mod.named_parameters(recurse=root is mod)]
        if not direct:
            continue
        fresh: dict[tuple[bool, int, tuple[int, int, int]], list[tuple[str, nn.Parameter]]] = {}
        for p in direct:
            if id(p) not in owner:
                where = placement(p) if placement is not None else (0, rank, world)
                key = (p.requires_grad, group_of.get(id(p), 0), where)
                fresh.setdefault(key, []).append((names[id(p)], p))
        for (_, g, (cg, r, w)), named in fresh.items():
            u = FlatUnit(len(units), named, r, w, dtype, device, partitioned=True, group=g)
            u.comm_group = cg
            units.append(u)
            for _, p in named:
                owner[id(p)] = u
        mod_units: list[FlatUnit] = []
        for p in direct:
            u = owner[id(p)]
            if u not in mod_units:
                mod_units.append(u)
        needs[mod] = mod_units
    return units, needs


def materialize_unit(unit: FlatUnit, modules: list[nn.Module], init_fn: Callable[[nn.Module], None],
                     seed: int) -> None:
    """Initialise a unit built from meta parameters: run ``init_fn`` on the modules
    that own it with an RNG seeded by (seed, unit index), so that every rank computes
    the same values without any rank holding more than this unit."""
    unit.alloc_full()
    devices = [unit.device] if unit.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed * 1_000_003 + unit.index)
        for m in modules:
            init_fn(m)
    unit.refresh_shard_from_full()
    unit.needs_init = False


def default_init_fn(model: nn.Module) -> Callable[[nn.Module], None]:
    """The model's own per-module initialiser (``_init_weights``, as in GPT and
    Hugging Face models), else each module's ``reset_parameters``."""
    own = getattr(model, "_init_weights", None)

    def init(m: nn.Module) -> None:
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()
        if callable(own):
            own(m)

    return init
