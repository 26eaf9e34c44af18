"""The model runner owns the device: the model's weights, the paged KV cache,
and the translation of a :class:`SchedulerOutput` into one forward pass."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from zeal.inference.attention import (
    AttentionMetadata,
    PagedAttention,
    PrefillChunk,
    decode_tables,
    plan_decodes,
)
from zeal.inference.exact_logits import HiddenCapture, refine_top_logits
from zeal.inference.kernels import cpu_kernels
from zeal.inference.sequence import SchedulerOutput

# what a model must have to be served: zeal's GPT and Llama have them all
SERVING_ATTRS = ("num_layers", "num_kv_heads", "head_dim", "max_positions", "config")


def as_serving_model(model: nn.Module) -> nn.Module:
    """The model itself (the module that trains is the module that serves); raises
    ``TypeError`` for one without zeal's serving interface (a flat-batch ``forward``
    taking ``positions``, ``attention`` and ``logits_index``, and the cache shape)."""
    missing = [a for a in SERVING_ATTRS if not hasattr(model, a)]
    if missing:
        raise TypeError(f"{type(model).__name__} cannot be served: it lacks {', '.join(missing)} "
                        "(serve zeal.models.GPT or zeal.models.llama.Llama, or load a Hugging Face folder)")
    return model


def kv_bytes_per_block(model: nn.Module, block_size: int, dtype: torch.dtype) -> int:
    elt = torch.empty((), dtype=dtype).element_size()
    return 2 * model.num_layers * block_size * model.num_kv_heads * model.head_dim * elt


class ModelRunner:
    """Runs ragged passes of a zeal model (``GPT`` or ``Llama``) over a paged KV cache.

    The model's layer modules are called as they are (through ``__call__``, so hooks such
    as ZeRO-3's gather/release fire), each given a :class:`PagedAttention` for the pass.

    Weights are the model's own tensors: :meth:`load_weights` copies new values
    into them in place, so a trainer can push weights without rebuilding
    anything (the KV cache should then be considered stale; the engine resets
    its prefix cache).
    """

    def __init__(self, model: nn.Module, num_blocks: int, block_size: int, kv_dtype: torch.dtype | None = None) -> None:
        self.model = as_serving_model(model)
        p = next(self.model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.kv_dtype = kv_dtype or self.dtype
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.num_block_copies = 0
        shape = (num_blocks, self.model.num_kv_heads, block_size, self.model.head_dim)
        # fused CPU kernels (attention over the block tables, norms, RoPE, activations, argmax)
        self.kernels = cpu_kernels() if self.device.type == "cpu" and self.kv_dtype == self.dtype else None
        self.k_cache = [torch.zeros(shape, dtype=self.kv_dtype, device=self.device) for _ in range(self.model.num_layers)]
        self.v_cache = [torch.zeros(shape, dtype=self.kv_dtype, device=self.device) for _ in range(self.model.num_layers)]
        # On CPU, torch's 16-bit F.linear takes a matrix-vector path for one input row and a
        # matrix-matrix path for more, which sum the products in different orders (SmolLM2's
        # down_proj: a row's output differs in its last bits between a one-row pass and a
        # 2-16-row one, while those agree with each other). A one-row pass is run as the row
        # twice, so that plain decoding of one request computes the logits a speculative
        # verify pass (the last token and its drafts together) computes for the same row.
        self.pad_single_rows = self.device.type == "cpu" and self.dtype in (torch.bfloat16, torch.float16)

    @property
    def vocab_size(self) -> int:
        m = self.model
        return m.config.vocab_size

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy tensors into the model's parameters by name (names of the wrapped
        model, e.g. ``transformer.h.0.attn.c_attn.weight`` for zeal's GPT). HF GPT-2
        Conv1D weights given as ``(in, out)`` are transposed. Returns how many were copied."""
        params = dict(self.model.named_parameters())
        n = 0
        with torch.no_grad():
            for name, t in named_tensors:
                if name not in params:
                    if name.endswith(("attn.bias", "masked_bias")) or name == "lm_head.weight":
                        continue
                    raise KeyError(f"load_weights: unknown parameter {name!r}")
                dst = params[name]
                if dst.shape != t.shape and t.dim() == 2 and dst.shape == t.shape[::-1]:
                    t = t.t()
                if dst.shape != t.shape:
                    raise ValueError(f"load_weights: {name} has shape {tuple(t.shape)}, expected {tuple(dst.shape)}")
                dst.copy_(t)
                n += 1
        return n

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Row-wise argmax of CPU ``logits (S, V)`` (the fused kernel: ~10x torch's in bf16)."""
        if self.kernels is not None:
            return self.kernels.argmax_rows(logits.contiguous())
        return logits.argmax(-1)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        self.num_block_copies += len(copies)
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for kc, vc in zip(self.k_cache, self.v_cache):
            kc[dst] = kc[src]
            vc[dst] = vc[src]

    def prepare(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """Flatten the chunks: token ids, positions, attention metadata, rows to sample."""
        bs, dev = self.block_size, self.device
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        dec_rows, dec_tables, dec_lens = [], [], []
        prefills = []
        for c in out.chunks:
            seq, start, n = c.seq, c.start, c.num_tokens
            row0 = len(ids)
            ids.extend(seq.fed_tokens(start, n) if c.num_draft else seq.tokens[start : start + n])
            pos.extend(range(start, start + n))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            if c.num_draft:  # speculative: a row per fed token, to verify each draft
                sample_rows.extend(range(row0, row0 + n))
            elif c.sample:
                sample_rows.append(row0 + n - 1)
            if c.num_draft:  # each fed token attends as a decode would (the same kernel, the same sums)
                dec_rows.extend(range(row0, row0 + n))
                dec_tables.extend([table] * n)
                dec_lens.extend(range(start + 1, start + n + 1))
            elif n == 1 and start > 0:
                dec_rows.append(row0)
                dec_tables.append(table)
                dec_lens.append(start + 1)
            else:
                prefills.append(PrefillChunk(row0, n, start + n, torch.tensor(table, dtype=torch.int32, device=dev)))
        if self.pad_single_rows and len(ids) == 1:  # the row twice (same slot, same context); row 0 is sampled
            ids, pos, slots = ids * 2, pos * 2, slots * 2
            if dec_rows:
                dec_rows, dec_tables, dec_lens = [0, 1], dec_tables * 2, dec_lens * 2
            else:
                prefills.append(PrefillChunk(1, 1, prefills[0].ctx_len, prefills[0].block_table))
        meta = AttentionMetadata(slot_mapping=torch.tensor(slots, device=dev), prefills=prefills, kernels=self.kernels)
        if dec_rows and self.kernels is not None:
            meta.decodes = decode_tables(dec_rows, dec_tables, dec_lens, bs, dev)
        elif dec_rows:
            meta.decodes = plan_decodes(dec_rows, dec_tables, dec_lens, bs, dev)
        return (torch.tensor(ids, device=dev), torch.tensor(pos, device=dev), meta,
                torch.tensor(sample_rows, device=dev, dtype=torch.long))

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> torch.Tensor:
        """Run one pass; returns logits ``(num_sampled_rows, vocab)`` in chunk order, in the
        model's dtype (greedy rows need only their argmax; the sampler upcasts the rest), or
        fp32 on the fused 16-bit path, whose leading logits are recomputed unrounded."""
        self.copy_blocks(out.copies)
        if out.empty:
            return torch.empty(0, self.vocab_size)
        input_ids, positions, meta, sample_rows = self.prepare(out)
        attention = PagedAttention(self.k_cache, self.v_cache, meta)  # its ops: self.kernels
        head = getattr(self.model, "lm_head", None)
        if self.kernels is None or self.dtype == torch.float32 or not isinstance(head, nn.Linear):
            return self.model(input_ids, positions=positions, attention=attention, logits_index=sample_rows)
        # fused 16-bit path: the leading logits without their 16-bit rounding (see exact_logits)
        with HiddenCapture(head) as cap:
            logits = self.model(input_ids, positions=positions, attention=attention, logits_index=sample_rows)
        if cap.hidden is None or cap.hidden.shape[0] != logits.shape[0]:
            return logits
        return refine_top_logits(logits, cap.hidden, head.weight, head.bias)
