"""The model runner owns the device: the model's weights, the paged KV cache,
and the translation of a :class:`SchedulerOutput` into one forward pass."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

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
from zeal.inference.packed_linear import packed_linears_for
from zeal.inference.paged_flex import attention_backend
from zeal.inference.sequence import SchedulerOutput
from zeal.inference.step_inputs import StepInputPacker, fill_ids

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


def kv_bytes_per_block(model: nn.Module, block_size: int, dtype: torch.dtype, tp_size: int = 1) -> int:
    """Bytes of one KV-cache block on one rank (``tp_size`` ranks share the key/value heads)."""
    elt = torch.empty((), dtype=dtype).element_size()
    return 2 * model.num_layers * block_size * (model.num_kv_heads // tp_size) * model.head_dim * elt


@dataclass
class StepPlan:
    """One forward pass as plain integers (what tensor-parallel ranks receive, as JSON):
    block ``copies`` to do first, the flat batch's token ``ids``, ``pos`` and cache
    ``slots``, the ``sample_rows`` to project, the decodes (rows, block tables, context
    lengths) and the prompt chunks ``[first row, tokens, context length, block table]``."""

    copies: list[list[int]] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    pos: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)
    dec_rows: list[int] = field(default_factory=list)
    dec_tables: list[list[int]] = field(default_factory=list)
    dec_lens: list[int] = field(default_factory=list)
    prefills: list[list] = field(default_factory=list)
    lora_slots: list[int] = field(default_factory=list)  # LoRA slot per row (empty: no row has an adapter)
    # async scheduling: rows whose token id is the previous step's sampled token ``fill_src`` (on the device)
    fill_rows: list[int] = field(default_factory=list)
    fill_src: list[int] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.ids

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes) -> StepPlan:
        return cls(**json.loads(data))


class ModelRunner:
    """Runs ragged passes of a zeal model (``GPT`` or ``Llama``) over a paged KV cache.

    The model's layer modules are called as they are (through ``__call__``, so hooks such
    as ZeRO-3's gather/release fire), each given a :class:`PagedAttention` for the pass.

    Under tensor parallelism every rank runs one (its model split, its cache holding its
    own key/value heads); rank 0's :meth:`execute` sends each :class:`StepPlan` to the
    others, which :meth:`run` it (:mod:`zeal.inference.tensor_parallel`).

    Weights are the model's own tensors: :meth:`load_weights` copies new values
    into them in place, so a trainer can push weights without rebuilding
    anything (the KV cache should then be considered stale; the engine resets
    its prefix cache).
    """

    def __init__(self, model: nn.Module, num_blocks: int, block_size: int, kv_dtype: torch.dtype | None = None,
                 tp_size: int = 1, scratch: bool = False) -> None:
        """``scratch``: keep a scratch cache block (padding rows of a compiled or graphed decode
        write there) also without the batched attention backend."""
        self.model = as_serving_model(model)
        p = next(self.model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.kv_dtype = kv_dtype or self.dtype
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.num_block_copies = 0
        # under tensor parallelism (``tp_size`` ranks) this rank caches its own key/value heads only
        # accelerators (or ZEAL_ATTENTION_BACKEND=flex): the batched paged attention of paged_flex, fed
        # by one packed host-to-device transfer of the step's inputs (step_inputs); None: CPU paths
        self.attn_backend = attention_backend(self.device, self.kv_dtype, self.dtype)
        self.packer = StepInputPacker(self.device, block_size) if self.attn_backend is not None else None
        self.graphs = None  # zeal.inference.cuda_graphs.DecodeGraphs (enable_decode_graphs)
        # with the backend, one scratch block past the block manager's: padding rows of a graphed decode write there
        self.scratch_slot = num_blocks * block_size
        extra = 1 if self.attn_backend is not None or scratch else 0
        # async scheduling (step_overlap): the step in flight's sampled ids (device) and each sequence's row
        self.prev_tokens: torch.Tensor | None = None
        self.prev_rows: dict[int, int] = {}
        shape = (num_blocks + extra, self.model.num_kv_heads // tp_size, block_size, self.model.head_dim)
        # rank 0 under tensor parallelism: ``tp_driver.pass_of(plan)`` sends each plan to the other ranks
        self.tp_driver = None
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
        # fp32/bf16 on CPU: the linears compute on weights reordered once for oneDNN (packed_linear)
        self.packed = packed_linears_for(self.model, self.device, self.dtype)
        self.lora = None  # the engine's zeal.inference.multi_lora.MultiLoRA when it serves adapters

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

    def plan(self, out: SchedulerOutput) -> StepPlan:
        """Flatten the chunks of ``out`` into a :class:`StepPlan` (plain integers)."""
        bs = self.block_size
        p = StepPlan(copies=[list(c) for c in out.copies])
        any_lora = any(c.seq.lora_slot for c in out.chunks)
        for c in out.chunks:
            seq, start, n = c.seq, c.start, c.num_tokens
            row0 = len(p.ids)
            if any_lora:
                p.lora_slots.extend([seq.lora_slot] * n)
            p.ids.extend(seq.fed_tokens(start, n) if c.num_draft else seq.tokens[start : start + n])
            src = self.prev_rows.get(seq.seq_id) if self.prev_rows else None
            if src is not None and start + n == seq.num_tokens:  # its last token is still on the device
                p.ids[-1] = 0
                p.fill_rows.append(row0 + n - 1)
                p.fill_src.append(src)
            p.pos.extend(range(start, start + n))
            table = seq.block_table
            p.slots.extend(table[q // bs] * bs + q % bs for q in range(start, start + n))
            if c.num_prompt_rows:  # prompt log-probs: the rows scoring the prompt's next tokens
                first = row0 + c.prompt_row_start - start
                p.sample_rows.extend(range(first, first + c.num_prompt_rows))
            if c.num_draft:  # speculative: a row per fed token, to verify each draft
                p.sample_rows.extend(range(row0, row0 + n))
            elif c.sample:
                p.sample_rows.append(row0 + n - 1)
            if c.num_draft:  # each fed token attends as a decode would (the same kernel, the same sums)
                p.dec_rows.extend(range(row0, row0 + n))
                p.dec_tables.extend([table] * n)
                p.dec_lens.extend(range(start + 1, start + n + 1))
            elif n == 1 and start > 0:
                p.dec_rows.append(row0)
                p.dec_tables.append(table)
                p.dec_lens.append(start + 1)
            else:
                p.prefills.append([row0, n, start + n, table])
        if self.pad_single_rows and len(p.ids) == 1:  # the row twice (same slot, same context); row 0 is sampled
            p.ids, p.pos, p.slots, p.lora_slots = p.ids * 2, p.pos * 2, p.slots * 2, p.lora_slots * 2
            p.fill_rows, p.fill_src = p.fill_rows + [1] * len(p.fill_rows), p.fill_src * 2
            if p.dec_rows:
                p.dec_rows, p.dec_tables, p.dec_lens = [0, 1], p.dec_tables * 2, p.dec_lens * 2
            else:
                p.prefills.append([1, 1, p.prefills[0][2], p.prefills[0][3]])
        return p

    def prepare(self, out: SchedulerOutput | StepPlan) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata,
                                                                 torch.Tensor]:
        """The pass's tensors: token ids, positions, attention metadata, rows to sample."""
        p = out if isinstance(out, StepPlan) else self.plan(out)
        if self.packer is not None:
            return self.packer.prepare(p, self.kernels, self.attn_backend, self.prev_tokens)
        bs, dev = self.block_size, self.device
        prefills = [PrefillChunk(row0, n, ctx, torch.tensor(table, dtype=torch.int32, device=dev))
                    for row0, n, ctx, table in p.prefills]
        meta = AttentionMetadata(slot_mapping=torch.tensor(p.slots, device=dev), prefills=prefills,
                                 kernels=self.kernels)
        if p.dec_rows and self.kernels is not None:
            meta.decodes = decode_tables(p.dec_rows, p.dec_tables, p.dec_lens, bs, dev)
        elif p.dec_rows:
            meta.decodes = plan_decodes(p.dec_rows, p.dec_tables, p.dec_lens, bs, dev)
        ids = torch.tensor(p.ids, device=dev)
        if p.fill_rows:
            fill_ids(ids, torch.tensor(p.fill_rows, device=dev), torch.tensor(p.fill_src, device=dev),
                     self.prev_tokens)
        return ids, torch.tensor(p.pos, device=dev), meta, torch.tensor(p.sample_rows, device=dev, dtype=torch.long)

    def execute(self, out: SchedulerOutput) -> torch.Tensor:
        """Run one pass; returns logits ``(num_sampled_rows, vocab)`` in chunk order, in the
        model's dtype (greedy rows need only their argmax; the sampler upcasts the rest), or
        fp32 on the fused 16-bit path, whose leading logits are recomputed unrounded. Under
        tensor parallelism the pass's plan is first sent to the other ranks (``tp_driver``)."""
        plan = self.plan(out)
        if self.tp_driver is None:
            return self.run(plan)
        with self.tp_driver.pass_of(plan):  # the other ranks run the same pass alongside
            return self.run(plan)

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> torch.Tensor:
        """The pass of one :class:`StepPlan` (what :meth:`execute` and a tensor-parallel worker run)."""
        self.copy_blocks([(s, d) for s, d in plan.copies])
        if plan.empty:
            return torch.empty(0, self.vocab_size)
        if self.graphs is not None and _decode_only(plan):
            return self._graphed_decode(plan)
        input_ids, positions, meta, sample_rows = self.prepare(plan)
        attention = PagedAttention(self.k_cache, self.v_cache, meta)  # its ops: self.kernels
        with (self.packed.active() if self.packed is not None else contextlib.nullcontext(),
              self.lora.active(plan.lora_slots) if plan.lora_slots else contextlib.nullcontext()):
            return self._forward(input_ids, positions, attention, sample_rows)

    def enable_decode_graphs(self, max_num_seqs: int, max_seq_tokens: int, enforce_eager: bool = False,
                             graph_factory=None, compile: bool = False) -> None:
        """Run decode-only passes through graphs captured per batch-size bucket
        (:mod:`zeal.inference.cuda_graphs`; ``graph_factory``: CUDA graphs by default, None
        off CUDA), of a step compiled by ``torch.compile`` per bucket when ``compile``."""
        from zeal.inference.cuda_graphs import runner_decode_graphs

        if self.attn_backend is None and not compile:
            raise ValueError("decode graphs need the batched attention backend (ZEAL_ATTENTION_BACKEND=flex)")
        if self.k_cache[0].shape[0] <= self.num_blocks:
            raise ValueError("a compiled decode step needs the runner's scratch block (ModelRunner(scratch=True))")
        self.graph_packer = self.packer or StepInputPacker(self.device, self.block_size)
        self.graphs = runner_decode_graphs(self, max_num_seqs, max_seq_tokens, enforce_eager, graph_factory, compile)

    def _graphed_decode(self, plan: StepPlan) -> torch.Tensor:
        """A decode-only pass through :attr:`graphs` (inputs from one packed transfer)."""
        f, _ = self.graph_packer.transfer(plan)
        if plan.fill_rows:
            fill_ids(f["ids"], f["fill_rows"], f["fill_src"], self.prev_tokens)
        tables = f["dec_tables"]
        tables = torch.nn.functional.pad(tables, (0, self.graphs.static["tables"].shape[1] - tables.shape[1]))
        return self.graphs.run({"ids": f["ids"], "pos": f["pos"], "slots": f["slots"], "tables": tables,
                                "lens": f["dec_lens"]})

    def _forward(self, input_ids, positions, attention, sample_rows) -> torch.Tensor:
        """The model over one pass's flat batch (16-bit fused path: the top logits refined)."""
        head = getattr(self.model, "lm_head", None)
        if self.kernels is None or self.dtype == torch.float32 or not isinstance(head, nn.Linear):
            return self.model(input_ids, positions=positions, attention=attention, logits_index=sample_rows)
        # fused 16-bit path: the leading logits without their 16-bit rounding (see exact_logits)
        with HiddenCapture(head) as cap:
            logits = self.model(input_ids, positions=positions, attention=attention, logits_index=sample_rows)
        if cap.hidden is None or cap.hidden.shape[0] != logits.shape[0]:
            return logits
        return refine_top_logits(logits, cap.hidden, head.weight, head.bias)


def _decode_only(plan: StepPlan) -> bool:
    """A pass of decodes only (one row each, all sampled, no adapter): what a decode graph runs."""
    n = len(plan.ids)
    return (not plan.prefills and not plan.lora_slots and len(plan.dec_rows) == n
            and plan.dec_rows == list(range(n)) and plan.sample_rows == plan.dec_rows)
