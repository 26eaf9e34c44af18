"""Many LoRA adapters over one served model, batched in one forward pass (punica / S-LoRA's idea).

The model's linears are never changed. Each loaded adapter owns a *slot* (slot 0 is the
base model: no adapter); its factors live here, per adapted linear, as ``A (r, in)`` and
``B (out, r)`` with the adapter's scaling folded into ``B``. A pass whose rows belong to
several adapters runs every linear once over the whole flat batch (the base matmul, as
without adapters) and adds one gathered low-rank term:

    y = x W^T  +  ((x A_cat^T) * M) B_cat^T

where ``A_cat (C, in)`` / ``B_cat (out, C)`` stack the factors of the adapters present
in the pass (``C`` = the sum of their ranks; the stacks are built once per set of
adapters and reused while the set stays the same) and ``M (T, C)`` is the 0/1 mask
keeping, for each row, only the columns of its own adapter (rows of slot 0 keep none).
So the cost of the adapters is two thin matmuls per linear whatever their number, the
rows grouped by adapter through the mask; a row's term is exactly ``B_s (A_s x)`` (the
other columns add exact zeros). A pass whose rows are all on the base model adds nothing
and costs nothing.

The term is added by forward hooks registered on the adapted linears for the duration of
one pass (:meth:`MultiLoRA.active`), so it composes with whatever computes the base
product (plain ``F.linear``, oneDNN's packed weights, int8 weight-only matmuls).
Adapters on the output head or the embeddings are refused: the head sees only the rows
it samples, not the pass's rows.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from zeal.lora.peft_folder import PeftAdapter

__all__ = ["LoRAWeights", "MultiLoRA", "adaptable_linears"]


def adaptable_linears(model: nn.Module) -> dict[str, nn.Module]:
    """The model's linears an adapter may target, by module path: every module with
    ``in_features``/``out_features`` (``nn.Linear``, the int8 weight-only linears) that
    sees all the rows of a pass — the output head and mixture-of-experts experts do not."""
    out = {}
    for name, m in model.named_modules():
        if not (hasattr(m, "in_features") and hasattr(m, "out_features")) or name in ("lm_head", ""):
            continue
        if ".experts." in f".{name}.":  # an expert sees only the rows routed to it
            continue
        out[name] = m
    return out


@dataclass
class LoRAWeights:
    """One adapter as the device holds it: ``A (r, in)`` and ``B (out, r)`` (scaling folded
    into ``B``) per adapted module path, all of one ``rank`` (smaller ones zero-padded)."""

    factors: dict[str, tuple[torch.Tensor, torch.Tensor]]
    rank: int

    @classmethod
    def from_peft(cls, adapter: PeftAdapter, linears: dict[str, nn.Module], max_rank: int, device: torch.device,
                  dtype: torch.dtype, source: str = "adapter") -> LoRAWeights:
        """Check ``adapter`` against the served model and convert it. Raises ``ValueError``
        naming the first problem (an unknown or non-adaptable module, a shape that does not
        fit, a rank above ``max_rank``, tensors this engine cannot apply)."""
        if not adapter.lora:
            raise ValueError(f"{source}: holds no LoRA tensors")
        rank = max(p.rank for p in adapter.lora.values())
        if rank > max_rank:
            raise ValueError(f"{source}: rank {rank} exceeds max_lora_rank {max_rank}")
        factors = {}
        for mod, pair in sorted(adapter.lora.items()):
            lin = linears.get(mod)
            if lin is None:
                why = "the output head and embeddings cannot be adapted per request" \
                    if mod in ("lm_head",) or "embed" in mod else "the served model has no adaptable linear of that name"
                raise ValueError(f"{source}: targets module {mod!r}: {why}")
            if pair.A.shape[1] != lin.in_features or pair.B.shape[0] != lin.out_features:
                raise ValueError(f"{source}: {mod} lora_A {tuple(pair.A.shape)} / lora_B {tuple(pair.B.shape)} do not "
                                 f"fit the served linear ({lin.out_features} x {lin.in_features}): an adapter of "
                                 "another base model?")
            r = pair.rank
            a = torch.zeros(rank, lin.in_features, dtype=dtype, device=device)
            b = torch.zeros(lin.out_features, rank, dtype=dtype, device=device)
            a[:r] = pair.A.to(device=device, dtype=torch.float32).to(dtype)
            b[:, :r] = (pair.B.to(device=device, dtype=torch.float32) * pair.scaling).to(dtype)
            factors[mod] = (a, b)
        if adapter.saved:
            first = sorted(adapter.saved)[0]
            raise ValueError(f"{source}: holds {first} (modules_to_save or trained biases), which multi-LoRA serving "
                             "cannot apply per request; serve a merged model instead")
        return cls(factors, rank)

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.factors.values())


class _PassTerm:
    """The gathered low-rank term of one pass: the row mask and the stacks of the adapters present."""

    def __init__(self, mask: torch.Tensor, stacks: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.mask = mask  # (T, C) 0/1 in the compute dtype
        self.stacks = stacks  # module path -> (A_cat (C, in), B_cat^T (C, out))

    def hook(self, name: str):
        a_cat, bt_cat = self.stacks[name]
        mask = self.mask

        def add_term(_module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
            x = args[0]
            if x.dim() != 2 or x.shape[0] != mask.shape[0]:
                raise RuntimeError(f"LoRA: {name} saw {tuple(x.shape)} rows, the pass has {mask.shape[0]}")
            h = torch.mm(x.to(a_cat.dtype), a_cat.t()).mul_(mask)  # (T, C): each row keeps its adapter's columns
            return out.addmm_(h.to(out.dtype), bt_cat.to(out.dtype))
        return add_term


class MultiLoRA:
    """The adapters resident for one served model, by slot (``1..max_loras``; 0 = base),
    and the hooks that add their batched term to a pass (see the module docstring).

    Invariant: a slot holds at most one adapter; the stacks cached for a set of slots are
    dropped whenever a slot changes."""

    def __init__(self, model: nn.Module, max_loras: int, max_rank: int) -> None:
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        if self.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            self.dtype = torch.float32
        self.linears = adaptable_linears(model)
        self.max_loras, self.max_rank = max_loras, max_rank
        self.slots: list[LoRAWeights | None] = [None] * (max_loras + 1)
        self._stacks: dict[tuple[int, ...], dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}

    # ------------------------------------------------------------ slots
    @property
    def num_free_slots(self) -> int:
        return sum(w is None for w in self.slots[1:])

    def weights_of(self, adapter: PeftAdapter, source: str = "adapter") -> LoRAWeights:
        """``adapter`` converted for this model (``ValueError`` if it does not fit)."""
        return LoRAWeights.from_peft(adapter, self.linears, self.max_rank, self.device, self.dtype, source)

    def add(self, weights: LoRAWeights) -> int:
        """Put ``weights`` in a free slot; returns the slot (``RuntimeError`` when none is free)."""
        for s in range(1, len(self.slots)):
            if self.slots[s] is None:
                self.slots[s] = weights
                self._stacks.clear()
                return s
        raise RuntimeError(f"all {self.max_loras} LoRA slots are taken (max_loras)")

    def remove(self, slot: int) -> None:
        """Free ``slot`` (its requests must be done)."""
        if slot < 1 or self.slots[slot] is None:
            raise KeyError(f"LoRA slot {slot} is empty")
        self.slots[slot] = None
        self._stacks.clear()

    # ------------------------------------------------------------ a pass
    def _stacks_of(self, present: tuple[int, ...]) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Per module: ``(A_cat, B_cat^T, column slot ids)`` over the slots ``present``
        (modules an adapter does not target get zero columns for it)."""
        hit = self._stacks.get(present)
        if hit is not None:
            return hit
        ws = [self.slots[s] for s in present]
        names = sorted({n for w in ws for n in w.factors})
        cols = torch.cat([torch.full((w.rank,), s, dtype=torch.int32, device=self.device) for s, w in zip(present, ws)])
        out = {}
        for n in names:
            lin = self.linears[n]
            a = [w.factors[n][0] if n in w.factors else torch.zeros(w.rank, lin.in_features, dtype=self.dtype,
                                                                    device=self.device) for w in ws]
            b = [w.factors[n][1] if n in w.factors else torch.zeros(lin.out_features, w.rank, dtype=self.dtype,
                                                                    device=self.device) for w in ws]
            out[n] = (torch.cat(a).contiguous(), torch.cat(b, dim=1).t().contiguous(), cols)
        if len(self._stacks) >= 8:  # the sets of adapters recently batched together
            self._stacks.pop(next(iter(self._stacks)))
        self._stacks[present] = out
        return out

    @contextlib.contextmanager
    def active(self, row_slots: list[int]) -> Iterator[None]:
        """Within: the adapted linears add the term of each row's adapter (``row_slots[i]``:
        the slot of row ``i`` of the pass's flat batch, 0 for the base model)."""
        present = tuple(sorted({s for s in row_slots if s}))
        if not present:
            yield
            return
        missing = [s for s in present if s >= len(self.slots) or self.slots[s] is None]
        if missing:
            raise RuntimeError(f"LoRA slot {missing[0]} is empty but a request uses it")
        stacks = self._stacks_of(present)
        rows = torch.tensor(row_slots, dtype=torch.int32, device=self.device)
        cols = next(iter(stacks.values()))[2]
        mask = (rows[:, None] == cols[None, :]).to(self.dtype)  # (T, C)
        term = _PassTerm(mask, {n: (a, bt) for n, (a, bt, _) in stacks.items()})
        handles = [self.linears[n].register_forward_hook(term.hook(n)) for n in stacks]
        try:
            yield
        finally:
            for h in handles:
                h.remove()
