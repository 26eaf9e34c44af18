"""The engine loop: schedule a pass, run it, sample, detokenize, stop, report.

Synchronous and single-threaded; the server runs it in a background thread
(:mod:`zeal.inference.async_engine`) and the Python API calls :meth:`LLMEngine.step`
until its requests are done.

A failure inside a step fails only the requests it belongs to: a batched forward pass
that raises is re-run one request at a time, and sampling, forking and detokenizing
are guarded per sequence. The other requests of the batch go on untouched.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from zeal.config.inference import EngineConfig
from zeal.inference.block_manager import BlockManager
from zeal.inference.compiled_decode import compile_level
from zeal.inference.cuda_graphs import enable_for_engine
from zeal.inference.device_sampler import apply_masks, sample_batch, verify_targets
from zeal.inference.gpu_defaults import engine_sizes
from zeal.inference.lora_adapters import LoadedAdapter, LoRARegistry, runtime_updating_allowed
from zeal.inference.metrics import EngineMetrics
from zeal.inference.model_runner import ModelRunner, as_serving_model, kv_bytes_per_block
from zeal.inference.outputs import CompletionOutput, RequestOutput, StepStats
from zeal.inference.sampler import SampleResult, sample, score_tokens
from zeal.inference.sampling_params import SamplingParams
from zeal.inference.scheduler import Scheduler, SchedulerConfig
from zeal.inference.sequence import ScheduledChunk, SchedulerOutput, SeqStatus, Sequence
from zeal.inference.sleep import EngineAsleepError, Released, release, restore
from zeal.inference.speculative import accept, draft_for, num_drafts
from zeal.inference.step_overlap import StepOverlap, async_scheduling_on
from zeal.inference.structured import GrammarCompiler, GrammarError, check, grammar_masks
from zeal.inference.tensor_parallel import GroupFailedError
from zeal.inference.tokenizer import Tokenizer

log = logging.getLogger("zeal.inference")


@dataclass
class _Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence] = field(default_factory=list)
    arrival_time: float = field(default_factory=time.monotonic)
    error: str | None = None
    error_type: str = "invalid_request_error"
    group: str = ""
    prompt_logprobs_sent: bool = False
    lora: LoadedAdapter | None = None  # the LoRA adapter it runs with (None: the base model)


class LLMEngine:
    """Continuous-batching engine over one model (scheduler + block manager + runner + sampler)."""

    def __init__(self, model: nn.Module, tokenizer: Tokenizer | None = None, config: EngineConfig | None = None,
                 eos_token_ids: list[int] | None = None, tp=None, draft_model: nn.Module | None = None) -> None:
        """``tp``: rank 0's :class:`zeal.inference.tensor_parallel.TensorParallelGroup` when
        ``model`` is split over tensor-parallel ranks (None: one process). ``draft_model``:
        the draft of ``speculative_config`` method ``draft_model`` as an instance (None:
        loaded from the config's ``model``)."""
        self.config = cfg = config or EngineConfig()
        self.tp = tp
        self.tokenizer = tokenizer
        smodel = as_serving_model(model)
        p = next(smodel.parameters())
        # on CPU, decode attention runs one small matmul per block: larger blocks amortise them
        bs = cfg.block_size or (64 if p.device.type == "cpu" else 16)
        tp_size = tp.size if tp is not None else 1  # kv_cache_bytes is per rank: each caches its own heads
        # CPU: the config's sizes; CUDA: vLLM's defaults for those not given (gpu_defaults)
        sizes = engine_sizes(cfg, smodel, p.device, kv_bytes_per_block(smodel, bs, p.dtype, tp_size))
        num_blocks = sizes.num_blocks
        level = compile_level(cfg, p.device)  # torch.compile of the decode step (compiled_decode)
        self.runner = ModelRunner(smodel, num_blocks, bs, tp_size=tp_size, scratch=level > 0 and tp is None)
        if tp is not None:
            tp.attach(self.runner)  # the other ranks build their runners alike and follow rank 0's passes
        self.bm = BlockManager(num_blocks, bs, cfg.enable_prefix_caching)
        self.scheduler = Scheduler(SchedulerConfig(sizes.max_num_batched_tokens, sizes.max_num_seqs), self.bm)
        self.max_model_len = min(cfg.max_model_len or smodel.max_positions, smodel.max_positions)
        self.max_seq_tokens = min(self.max_model_len, num_blocks * bs)
        self.vocab_size = smodel.config.vocab_size
        enable_for_engine(self.runner, smodel, sizes.max_num_seqs, self.max_seq_tokens, cfg.enforce_eager,
                          tp is not None, level > 0)  # CUDA graphs for decode steps (cuda_graphs)
        # async scheduling: the next step launched before this one's ids are read (step_overlap)
        self.overlap = StepOverlap(self) if async_scheduling_on(cfg, p.device, tp is not None) else None
        self.drafter = None  # speculative_config method 'draft_model': zeal.inference.draft_model
        spec = cfg.speculative_config
        if spec is not None and spec.method == "draft_model":
            from zeal.inference.draft_model import DraftModelProposer

            self.drafter = DraftModelProposer.build(spec, draft_model, self.runner, num_blocks * bs,
                                                    cfg.max_num_seqs, self.vocab_size)
        eos = list(eos_token_ids or [])
        if tokenizer is not None:
            eos += [e for e in tokenizer.eos_token_ids if e not in eos]
        self.eos_token_ids = set(eos)
        self.grammars = GrammarCompiler(tokenizer, self.vocab_size, eos)
        self.requests: dict[str, _Request] = {}
        self.metrics = EngineMetrics()
        self._seq_ids = itertools.count()
        self.last_stats = StepStats()
        self._sleep_level = 0  # 0 = awake
        self._kv_released = Released()
        self._weights_released = Released()
        self._weights_discarded = False  # sleep(level=2) until load_weights
        self.loras: LoRARegistry | None = None  # multi-LoRA serving (cfg.lora)
        if cfg.lora.enabled or runtime_updating_allowed(cfg.lora):
            self._enable_lora(smodel)

    def _enable_lora(self, model: nn.Module) -> None:
        """Adapter slots over ``model`` and the start-up adapters of ``config.lora``."""
        from zeal.inference.multi_lora import MultiLoRA

        self._refuse_under_tp("LoRA serving")
        if getattr(model, "weight_streamer", None) is not None:
            raise ValueError("LoRA serving is not supported with weights_offload (the layers are streamed); "
                             "serve with weights_offload none")
        lcfg = self.config.lora
        self.runner.lora = MultiLoRA(model, lcfg.max_loras, lcfg.max_lora_rank)
        self.loras = LoRARegistry(self.runner.lora, lambda: [r.lora.lora_id for r in self.requests.values()
                                                             if r.lora is not None])
        for m in lcfg.lora_modules:
            self.loras.load(m.name, m.path)

    # ------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    group: str | None = None, lora_name: str | None = None) -> None:
        """Queue a request. Raises ``ValueError`` for one that could never run and
        :class:`EngineAsleepError` while the engine sleeps. ``group``: the client request it
        is part of (the prompts of one HTTP request share one; default: its own id); the
        scheduler shares each pass fairly between groups. ``lora_name``: the loaded LoRA
        adapter to run it with (None: the base model)."""
        self._check_awake()
        lora = None
        if lora_name is not None:
            if self.loras is None:
                raise ValueError(f"LoRA adapter {lora_name!r} asked, but this engine serves no adapters "
                                 "(enable_lora / lora_modules)")
            lora = self.loras.resolve(lora_name)
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer; pass token ids")
            prompt_ids = self.tokenizer.encode(prompt)
        else:
            prompt_ids = [int(t) for t in prompt]
        if not prompt_ids:
            raise ValueError("prompt is empty")
        if min(prompt_ids) < 0 or max(prompt_ids) >= self.vocab_size:
            raise ValueError(f"prompt has token ids outside [0, {self.vocab_size})")
        if len(prompt_ids) + params.max_tokens > self.max_seq_tokens:
            raise ValueError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                f"maximum sequence length {self.max_seq_tokens}"
            )
        matcher = self.grammars.matcher(params.structured_outputs) if params.structured_outputs else None
        req = _Request(request_id, prompt_ids, params, group=group or request_id, lora=lora)
        seq = self._new_seq(req, 0)
        seq.matcher = matcher
        seq.pending_fork = params.n > 1
        self.requests[request_id] = req
        self.scheduler.add(seq)

    def _new_seq(self, req: _Request, index: int) -> Sequence:
        p = req.params
        # on the logits' device: the sampler draws there (CPU: the stream it always had)
        dev = self.runner.device
        gen = torch.Generator(device=dev).manual_seed(p.seed + index) if p.seed is not None else None
        seq = Sequence(next(self._seq_ids), req.request_id, req.prompt_ids, p, index=index, generator=gen,
                       arrival_time=req.arrival_time, group=req.group)
        if req.lora is not None:
            seq.lora_id, seq.lora_slot = req.lora.lora_id, req.lora.slot
        req.seqs.append(seq)
        return seq

    def abort(self, request_id: str) -> None:
        """Stop a request now and free its KV blocks (unknown ids are ignored)."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        for seq in req.seqs:
            if not seq.finished:
                self.scheduler.finish(seq, "abort")
        self.metrics.on_finish("abort")
        if self.loras is not None:
            self.loras.collect()

    # ------------------------------------------------------------ LoRA adapters
    def load_lora_adapter(self, name: str, path: str) -> LoadedAdapter:
        """Serve the PEFT adapter folder ``path`` as ``name`` (:class:`LoRAError`, a
        ``ValueError`` with an HTTP status, when refused)."""
        return self._lora_registry().load(name, path)

    def unload_lora_adapter(self, name: str) -> int:
        """Stop serving ``name``; its running requests finish with it (returns how many)."""
        return self._lora_registry().unload(name)

    def _lora_registry(self) -> LoRARegistry:
        if self.loras is None:
            from zeal.inference.lora_adapters import LoRAError

            raise LoRAError(400, "this engine serves no LoRA adapters (start it with enable_lora or lora_modules)")
        return self.loras

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or (self.overlap is not None and self.overlap.pending is not None)

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    def load_weights(self, named_tensors) -> int:
        """New weights in place (RLHF); cached prefixes were computed with the old ones, so drop them.
        Allowed while asleep: weights released by :meth:`sleep` come back first (the KV cache
        stays released until :meth:`wake_up`)."""
        self._refuse_under_tp("load_weights")
        restore(self._weights_released)
        n = self.runner.load_weights(named_tensors)
        self._weights_discarded = False
        self.bm.reset_prefix_cache()
        return n

    # ------------------------------------------------------------ sleep / wake
    def sleep(self, level: int = 1) -> None:
        """Release device memory between phases (as vLLM's ``sleep``). Level 1 frees the
        KV cache and forgets every cached prefix; the weights stay, or go to host memory
        when they live on an accelerator. Level 2 frees the KV cache and discards the
        weights: :meth:`load_weights` must give new ones before generating again.
        Refused while requests are unfinished; :meth:`wake_up` takes the memory back."""
        self._refuse_under_tp("sleep")
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        if self._sleep_level:
            raise RuntimeError(f"the engine is already asleep (level {self._sleep_level})")
        if self.overlap is not None and not self.requests:
            self.overlap.flush()  # a step in flight for aborted requests only: its ids are dropped
        if self.requests or self.scheduler.has_unfinished():
            raise RuntimeError(f"cannot sleep with {len(self.requests)} unfinished request(s): let them finish "
                               "or abort them first")
        self.bm.reset_prefix_cache()  # the cached blocks' contents are about to be gone
        if self.runner.graphs is not None:  # captured over the storages about to be released
            self.runner.graphs.reset()
        self._kv_released = release([*self.runner.k_cache, *self.runner.v_cache])
        params = list(self.runner.model.parameters())
        if level == 2:
            self._weights_released = release(params)
            self._weights_discarded = True
            if self.runner.packed is not None:
                self.runner.packed.drop()
        elif self.runner.device.type != "cpu":
            self._weights_released = release(params, keep_on_host=True)
        self._sleep_level = level

    def wake_up(self) -> None:
        """Re-allocate what :meth:`sleep` released: the same KV cache (empty), and the
        weights offloaded by level 1. A no-op when awake."""
        restore(self._weights_released)
        restore(self._kv_released, zero=True)
        self._sleep_level = 0

    def is_sleeping(self) -> bool:
        """Whether :meth:`sleep` released the memory and :meth:`wake_up` has not taken it back."""
        return self._sleep_level > 0

    @property
    def sleep_level(self) -> int:
        """0 awake, else the level given to :meth:`sleep`."""
        return self._sleep_level

    def _refuse_under_tp(self, what: str) -> None:
        if self.tp is not None:
            raise ValueError(f"{what} is not supported with tensor_parallel_size {self.tp.size} (the weights "
                             "and KV cache are split over ranks); serve with tensor_parallel_size 1")

    def _check_awake(self) -> None:
        if self._sleep_level:
            raise EngineAsleepError(f"the engine is asleep (sleep level {self._sleep_level}): call wake_up() "
                                    "before generating")
        if self._weights_discarded:
            raise EngineAsleepError("the weights were discarded by sleep(level=2): call load_weights(...) "
                                    "before generating")

    # ------------------------------------------------------------ the loop
    def step(self) -> list[RequestOutput]:
        """One forward pass. Returns an output for every request that progressed or ended
        (with async scheduling: in the step before the one it launches)."""
        self._check_awake()
        return self._step() if self.overlap is None else self.overlap.step()

    def _step(self) -> list[RequestOutput]:
        t0 = time.monotonic()
        if self.config.speculative_config is not None:
            self._propose_drafts()
        sched = self.scheduler.schedule()
        touched: dict[str, _Request] = {}
        for seq in sched.failed:
            req = self.requests.get(seq.request_id)
            if req is not None:
                req.error = seq.error
                touched[req.request_id] = req
        logits = self._execute(sched, touched)
        to_sample: list[Sequence] = []
        rows: list[int] = []  # the logits row of each sequence in to_sample
        spec: list[tuple[Sequence, int, list[int]]] = []  # (sequence, its first row, its drafts)
        prompt_tokens = decode_tokens = num_sampled = 0
        for c in sched.chunks:
            if c.seq.is_decoding:  # (before the commit) only its last sampled token was left to feed
                decode_tokens += c.num_tokens
            else:
                prompt_tokens += c.num_tokens
            c.seq.num_computed += c.num_tokens - c.num_draft  # drafts count once verified
            req = self.requests[c.seq.request_id]
            try:
                if req.error is None:
                    self.bm.commit(c.seq)
                if c.num_prompt_rows and req.error is None:
                    self._score_prompt(c, logits[num_sampled : num_sampled + c.num_prompt_rows])
            except Exception as e:  # noqa: BLE001 - this request's failure, not the batch's
                self._fail(req, e, touched)
            if c.sample and req.error is None:
                if c.num_draft:
                    spec.append((c.seq, num_sampled, list(c.seq.draft_ids)))
                else:
                    to_sample.append(c.seq)
                    rows.append(num_sampled + c.num_prompt_rows)
            c.seq.draft_ids = []
            num_sampled += c.num_rows
        if any(s.matcher is not None for s in to_sample):
            to_sample, rows, masks = self._grammar_masks(to_sample, rows, touched)
        else:
            masks = None
        all_logits = logits
        if len(rows) < num_sampled:
            logits = logits[rows]
        if masks is not None:
            logits = apply_masks(logits, masks)
        results = self._sample(logits, to_sample, touched)
        now = time.monotonic()
        for row, (seq, res) in enumerate(zip(to_sample, results)):
            req = self.requests[seq.request_id]
            if res is None or req.error is not None:
                continue  # failed earlier in this step
            touched[req.request_id] = req
            try:
                if seq.pending_fork:
                    self._fork(req, seq, logits[row : row + 1], now)
                self._append(seq, res, now)
            except Exception as e:  # noqa: BLE001 - this request's failure, not the batch's
                self._fail(req, e, touched)
        num_generated = len(to_sample) + self._verify(all_logits, spec, touched, now)
        stats = StepStats(sched.num_tokens, decode_tokens, prompt_tokens, len(sched.chunks), len(sched.preempted),
                          time.monotonic() - t0)
        self.last_stats = stats
        self.metrics.on_step(prompt_tokens, num_generated, stats.num_preempted)  # tokens generated
        outs = [self._output(r) for r in touched.values()]
        if self.loras is not None and self.loras.draining:
            self.loras.collect()  # an unloaded adapter's last requests may have ended
        return outs

    # ------------------------------------------------------------ failure isolation
    def _grammar_masks(self, seqs: list[Sequence], rows: list[int], touched: dict[str, _Request]):
        """The allowed-token masks of ``seqs`` (None where unconstrained); the sequences whose
        constraint fails here fail their request (the client's error) and leave the lists."""
        masks = grammar_masks([s.matcher for s in seqs], self.vocab_size)
        for seq, m in zip(seqs, masks):
            if isinstance(m, GrammarError):
                self._fail(self.requests[seq.request_id], m, touched)
        keep = [i for i, s in enumerate(seqs) if self.requests[s.request_id].error is None]
        return [seqs[i] for i in keep], [rows[i] for i in keep], [masks[i] for i in keep]

    def _fail(self, req: _Request, e: BaseException, touched: dict[str, _Request]) -> None:
        """End ``req`` with an engine error and free its blocks; the batch goes on. A
        :class:`GrammarError` is the request's own mistake: a 400 with its one line."""
        if isinstance(e, GrammarError):
            log.info("request %s: %s", req.request_id, e)
            req.error, req.error_type = str(e), "invalid_request_error"
        else:
            log.error("request %s failed in an engine step: %s: %s", req.request_id, type(e).__name__, e,
                      exc_info=e)
            req.error = f"engine error: {type(e).__name__}: {e}"
            req.error_type = "server_error"
        for seq in req.seqs:
            if seq.finished:
                continue
            if seq in self.scheduler.running or seq in self.scheduler.waiting:
                self.scheduler.finish(seq, "error")
            else:  # caught half-way into the scheduler (a fork)
                self.bm.free_seq(seq)
                seq.status, seq.finish_reason = SeqStatus.FINISHED, "error"
        touched[req.request_id] = req

    def _execute(self, sched: SchedulerOutput, touched: dict[str, _Request]) -> torch.Tensor:
        """The pass's logits (CPU). When the batched pass raises, each request's chunks run
        alone; requests whose own pass raises are failed and their chunks dropped from
        ``sched`` (the rows returned follow the sampled chunks that remain)."""
        try:
            return self.runner.execute(sched)  # stays on the device: sampled there
        except GroupFailedError:
            raise  # the tensor-parallel group is gone: no request can run alone either
        except Exception as e:  # noqa: BLE001 - isolated below
            batch_error = e
        groups: dict[str, list[ScheduledChunk]] = {}
        for c in sched.chunks:
            groups.setdefault(c.seq.request_id, []).append(c)
        log.warning("a forward pass over %d request(s) failed (%s: %s): running them one by one",
                    len(groups), type(batch_error).__name__, batch_error)
        rows: dict[int, torch.Tensor] = {}
        kept: set[int] = set()
        copies = sched.copies  # copy-on-write once: a later copy would overwrite a slot written since
        for rid, chunks in groups.items():
            try:
                out = self.runner.execute(SchedulerOutput(chunks=chunks, copies=copies))
            except Exception as e:  # noqa: BLE001
                self._fail(self.requests[rid], e, touched)
                continue
            copies = []
            r = 0
            for c in chunks:  # a chunk's rows: one when it samples, one per fed token when it speculates
                rows[id(c)] = out[r : r + c.num_rows]
                r += c.num_rows
            kept.update(id(c) for c in chunks)
        sched.chunks = [c for c in sched.chunks if id(c) in kept]
        sampled_rows = [rows[id(c)] for c in sched.chunks if c.num_rows]
        return torch.cat(sampled_rows) if sampled_rows else torch.empty(0, self.vocab_size)

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence], touched: dict[str, _Request]) -> list:
        """One :class:`SampleResult` per sequence (batched); when the batch raises, row by row,
        with ``None`` for the rows whose request failed."""
        hist = [(s.prompt_ids, s.output_ids) for s in seqs]
        params, gens = [s.params for s in seqs], [s.generator for s in seqs]
        try:
            return sample_batch(logits, hist, params, gens, self.runner.argmax)
        except Exception:  # noqa: BLE001 - isolated below
            pass
        results = []
        for row, seq in enumerate(seqs):
            try:
                results.append(sample(logits[row : row + 1], hist[row : row + 1], params[row : row + 1],
                                      gens[row : row + 1])[0])
            except Exception as e:  # noqa: BLE001
                self._fail(self.requests[seq.request_id], e, touched)
                results.append(None)
        return results

    # ------------------------------------------------------------ speculative decoding
    def _propose_drafts(self) -> None:
        """Drafts for the running greedy sequences about to decode: n-gram (see
        :mod:`.speculative`) or the draft model's (:mod:`.draft_model`)."""
        cfg = self.config.speculative_config
        if self.drafter is not None:
            running = self.scheduler.running
            wants = [(s, num_drafts(s, cfg, self.max_seq_tokens)) for s in running if s.is_decoding]
            try:
                self.drafter.propose(wants, running)
            except Exception as e:  # noqa: BLE001 - drafts are optional: decode without them
                log.warning("the draft model failed (%s: %s): this step decodes without drafts", type(e).__name__, e)
                for s, _ in wants:
                    s.draft_ids = []
                    self.drafter.release(s.seq_id)
            return
        for seq in self.scheduler.running:
            if seq.is_decoding:
                seq.draft_ids = draft_for(seq, cfg, self.max_seq_tokens)

    def _verify(self, logits: torch.Tensor, spec: list[tuple[Sequence, int, list[int]]],
                touched: dict[str, _Request], now: float) -> int:
        """Accept the drafts that greedy decoding confirms, append the step's tokens, roll the
        rest back (their blocks freed, their slots left to be overwritten). Returns tokens added."""
        added = 0
        # every verified row's greedy token from one argmax and one transfer
        targets = verify_targets(logits, [(row, 1 + len(drafts)) for _, row, drafts in spec], self.runner.argmax)
        for (seq, _row, drafts), target in zip(spec, targets):
            req = self.requests[seq.request_id]
            if req.error is not None:
                continue
            touched[req.request_id] = req
            try:
                toks = accept(drafts, target)
                self.metrics.on_spec(len(drafts), len(toks) - 1)
                seq.num_computed += len(toks) - 1  # the accepted drafts' KV is the sequence's now
                for t in toks:
                    self._append(seq, SampleResult(t), now)
                    added += 1
                    if seq.finished:
                        break
                if not seq.finished:
                    self.bm.trim(seq)
                    self.bm.commit(seq)
            except Exception as e:  # noqa: BLE001 - this request's failure, not the batch's
                self._fail(req, e, touched)
        return added

    def _score_prompt(self, c: ScheduledChunk, rows: torch.Tensor) -> None:
        """Prompt log-probs from a prefill chunk's rows: row ``i`` (position ``prompt_row_start + i``)
        scores the prompt token after it."""
        seq, lo = c.seq, c.prompt_row_start
        if lo != len(seq.prompt_logprobs):
            raise RuntimeError(f"prompt log-probs out of order: rows from position {lo}, "
                               f"{len(seq.prompt_logprobs)} scored")
        targets = seq.prompt_ids[lo + 1 : lo + 1 + c.num_prompt_rows]
        seq.prompt_logprobs.extend(score_tokens(rows, targets, seq.params.prompt_logprobs or 0))

    def _fork(self, req: _Request, seq: Sequence, logits_row: torch.Tensor, now: float) -> None:
        """``n > 1``: the siblings of ``seq`` share its prompt blocks and draw their own first token."""
        seq.pending_fork = False
        for i in range(1, seq.params.n):
            child = self._new_seq(req, i)
            child.output_ids = list(seq.output_ids)
            child.prompt_logprobs = seq.prompt_logprobs  # scored once, for the request
            child.matcher = seq.matcher.deep_copy() if seq.matcher is not None else None
            self.bm.fork(seq, child)
            self.scheduler.add_running(child)
            cres = sample(logits_row, [(child.prompt_ids, child.output_ids)], [child.params], [child.generator])[0]
            self._append(child, cres, now)

    def _append(self, seq: Sequence, res, now: float) -> None:
        seq.output_ids.append(res.token)
        if res.logprob is not None:
            seq.logprobs.append({"token": res.token, "logprob": res.logprob, "top_logprobs": res.top_logprobs or {}})
        if seq.first_token_time is None:
            seq.first_token_time = now
            if seq.index == 0:
                self.metrics.on_first_token(now - seq.arrival_time)
        else:
            self.metrics.on_token(now - seq.last_token_time)
        seq.last_token_time = now
        p, tok = seq.params, res.token
        reason = None
        stopped_by_token = (not p.ignore_eos and tok in self.eos_token_ids) or tok in p.stop_token_ids
        if seq.matcher is not None:
            seq.matcher.consume_token(tok)
            check(seq.matcher)
        if stopped_by_token or (seq.matcher is not None and seq.matcher.is_stopped()):
            reason = "stop"
        elif len(seq.output_ids) >= p.max_tokens or seq.num_tokens >= self.max_seq_tokens:
            reason = "length"
        if self.tokenizer is not None:
            ids = seq.output_ids[:-1] if stopped_by_token else seq.output_ids
            seq.text = self.tokenizer.decode(ids)
            if p.stop:
                window = seq.emitted_chars - max(len(s) for s in p.stop)
                hits = [i for s in p.stop if (i := seq.text.find(s, max(0, window))) >= 0]
                if hits:
                    seq.text = seq.text[: min(hits)]
                    reason = "stop"
        if reason is not None:
            self.scheduler.finish(seq, reason)

    @staticmethod
    def _prompt_logprobs(req: _Request, finished: bool) -> list[dict | None] | None:
        """The prompt's log-probs (None first: the first token has none) in the first output
        after they are all scored and in the last one; None otherwise or when not asked."""
        seq = req.seqs[0]
        if req.params.prompt_logprobs is None or seq.needs_prompt_logits:
            return None
        if req.prompt_logprobs_sent and not finished:
            return None
        req.prompt_logprobs_sent = True
        return [None, *seq.prompt_logprobs]

    def _output(self, req: _Request) -> RequestOutput:
        outs = []
        hold = max((len(s) for s in req.params.stop), default=1) - 1
        for seq in req.seqs:
            new_ids = seq.output_ids[seq.emitted_tokens :]
            seq.emitted_tokens = len(seq.output_ids)
            end = len(seq.text)
            if not seq.finished:
                end -= hold
                while end > seq.emitted_chars and seq.text[end - 1] == "\ufffd":
                    end -= 1  # an incomplete UTF-8 character: wait for its other bytes
            delta = seq.text[seq.emitted_chars : end] if end > seq.emitted_chars else ""
            seq.emitted_chars += len(delta)
            outs.append(CompletionOutput(seq.index, list(seq.output_ids), seq.text, delta, new_ids,
                                         seq.finish_reason, list(seq.logprobs) if seq.params.logprobs is not None else None))
        finished = req.error is not None or (
            len(req.seqs) == req.params.n and all(s.finished for s in req.seqs))
        out = RequestOutput(req.request_id, req.prompt_ids, outs, finished, req.error, req.error_type,
                            req.arrival_time, req.seqs[0].first_token_time,
                            prompt_logprobs=self._prompt_logprobs(req, finished))
        if finished:
            out.finish_time = time.monotonic()
            self.requests.pop(req.request_id, None)
            self.metrics.on_finish("error" if req.error else (req.seqs[0].finish_reason or "stop"))
        return out
