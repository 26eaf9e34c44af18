"""The hybrid engine: the actor trains under ``zeal.initialize`` (any ZeRO stage, offload)
and generates with zeal's serving engine (continuous batching, paged KV cache, the fused
kernels) over a second copy of the same architecture, whose weights are refreshed in
place from the training weights before each rollout.

One rollout: ``sync_weights()`` (at ZeRO-3 one flat unit gathered at a time, copied into
the serving model and released), ``wake_up()`` (the KV cache comes back), generation,
``sleep()`` (the KV cache is released while the actor trains). The serving engine
returns the sampled tokens' log-probabilities (``SamplingParams.logprobs = 0``), which
:func:`zeal.rlhf.formulas.token_logprobs` reproduces from the training module.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import nn

from zeal.inference.llm import LLM
from zeal.inference.sampling_params import SamplingParams
from zeal.inference.tokenizer import Tokenizer
from zeal.lora.apply import find_lora
from zeal.rlhf.adapter_sync import ServingAdapters, adapter_names, adapter_stream, base_stream
from zeal.rlhf.adapters import sync_stream


@dataclass
class Rollout:
    """One sampled answer: the prompt's and the answer's token ids, the serving engine's
    log-probability of each answer token (0 where ``loss_mask`` is 0), and why it stopped."""

    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    text: str = ""
    finish_reason: str | None = None
    group: int = 0  # the index of its prompt in the batch
    #: per answer token, 1 where the policy chose it (trained), 0 where it came from elsewhere (a tool's
    #: output in a multi-turn episode: not trained); None: all ones
    loss_mask: list[int] | None = None
    version: int = 0  # the actor's weight version (optimizer steps taken) that generated it


@dataclass
class PhaseTimes:
    """Seconds spent in each phase since the last :meth:`HybridEngine.take_times`."""

    sync: float = 0.0
    generate: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)


def serving_copy(module: nn.Module, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """A fresh model of the same class and config as ``module`` (zeal's ``GPT`` or
    ``Llama``), to be filled by :meth:`HybridEngine.sync_weights`; eval mode."""
    cfg = getattr(module, "config", None)
    if cfg is None or not hasattr(module, "num_kv_heads"):
        raise TypeError(f"the hybrid engine serves zeal's GPT or Llama models, not {type(module).__name__}")
    with torch.device(device):
        model = type(module)(cfg)
    return model.to(dtype).eval()


GENERATION_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def generation_dtype(name: str, actor_dtype: torch.dtype, device: torch.device | str) -> torch.dtype:
    """The serving copy's dtype for the ``rlhf.generation_dtype`` setting: ``"fp32"`` /
    ``"bf16"`` as named; ``"auto"``: bf16 for an fp32 actor where ``device`` multiplies
    bf16 natively (:func:`zeal.utils.hardware.native_bf16`; about 2.8x fp32's matmul speed
    on an AVX512-BF16 CPU), else the actor's own dtype."""
    if name in GENERATION_DTYPES:
        return GENERATION_DTYPES[name]
    if name != "auto":
        raise ValueError(f"generation_dtype must be 'auto', 'fp32' or 'bf16', not {name!r}")
    from zeal.utils.hardware import native_bf16

    if actor_dtype == torch.float32 and native_bf16(torch.device(device).type):
        return torch.bfloat16
    return actor_dtype


class HybridEngine:
    """The actor's :class:`~zeal.train.engine.TrainEngine` and a serving :class:`LLM`
    over a copy of its architecture (``inference_model``: None builds one from the
    actor's class and config, in ``dtype``: None is the actor's; a 16-bit copy of an
    fp32 actor generates faster, its log-probs then differ from the training side's by
    the rounding, see :attr:`exact_logprobs`). Engine knobs (``kv_cache_bytes``,
    ``max_num_seqs``, ``max_model_len``...) are keyword arguments of :class:`LLM`. The
    engine sleeps (KV cache released) except inside :meth:`generate`."""

    def __init__(self, engine, tokenizer: Tokenizer | None = None, *, inference_model: nn.Module | None = None,
                 eos_token_ids: list[int] | None = None, dtype: torch.dtype | None = None, **llm_kwargs) -> None:
        self.engine = engine
        module = engine.module
        actor_dtype = next(module.parameters()).dtype
        model = (inference_model if inference_model is not None
                 else serving_copy(module, dtype or actor_dtype, engine.device))
        #: whether the serving copy computes in the actor's dtype, so that its sampled tokens'
        #: log-probs are the training side's (to rounding: fp32 ~1e-5); a 16-bit copy of an
        #: fp32 actor gives only approximate ones, and the trainers then take the behaviour
        #: log-probs of ratios and KL from the training side
        self.exact_logprobs = next(model.parameters()).dtype == actor_dtype
        dtypes = {p.dtype for p in model.parameters()}
        self.serving_dtype = dtypes.pop() if len(dtypes) == 1 else None  # None: a mixed-dtype serving model
        self.llm = LLM(model, tokenizer, eos_token_ids=eos_token_ids, **llm_kwargs)
        self._lora = find_lora(module)  # LoRA: the serving copy holds the base once, syncs move the adapters
        self.adapters = ServingAdapters(model, self._lora) if self._lora else None
        self._base_synced = False
        self.times = PhaseTimes()
        self.num_syncs = 0
        self.sync_weights()
        self.llm.sleep()

    @torch.no_grad()
    def sync_weights(self) -> int:
        """Copy the actor's current weights into the serving model in place (every rank
        calls it; at ZeRO-3 unit by unit). Returns the number of tensors copied."""
        t0 = time.perf_counter()
        was_training = self.engine.module.training
        if self.adapters is None:
            n = self.llm.load_weights((name, p.detach()) for name, p in self.engine.iter_gathered_parameters())
        elif self._base_synced and not getattr(self.llm.engine, "_weights_discarded", False):
            rest = self.adapters.load(adapter_stream(self.engine, self._lora))  # the base stays as loaded
            n = 2 * len(self._lora) + self.llm.load_weights(iter(rest))  # (also drops the cached prefixes)
        else:  # the base once (a QLoRA base dequantized), the adapters beside it
            n = self.llm.load_weights(base_stream(self.engine, self._lora, self.adapters)) + 2 * len(self._lora)
            self._base_synced = True
        self.engine.module.train(was_training)
        self.num_syncs += 1
        self.times.sync += time.perf_counter() - t0
        return n

    @torch.no_grad()
    def snapshot_weights(self) -> list[tuple[str, torch.Tensor]]:
        """A copy of the actor's current weights as the serving copy takes them (every rank
        calls it; at ZeRO-3 unit by unit; with LoRA only the adapters, as :meth:`sync_weights`),
        already in the serving copy's dtype (what loading would cast to: a bf16 copy of an
        fp32 actor moves half the bytes), for :meth:`load_snapshot` on another thread while
        the actor trains on."""
        was_training = self.engine.module.training
        if self.adapters is not None:  # LoRA: the adapters only (the serving copy keeps its base)
            only = adapter_names(self.engine.module, self._lora)
            snap = [(name, p.detach().clone()) for name, p in self.engine.iter_gathered_parameters(only)]
        else:
            dt = self.serving_dtype
            snap = [(name, p.detach().to(dt, copy=True) if dt is not None else p.detach().clone())
                    for name, p in sync_stream(self.engine)]
        self.engine.module.train(was_training)
        return snap

    @torch.no_grad()
    def load_snapshot(self, weights: list[tuple[str, torch.Tensor]]) -> int:
        """Copy a :meth:`snapshot_weights` into the serving model (no collective: any thread
        that is not generating at the time)."""
        rest = self.adapters.load(weights) if self.adapters is not None else weights
        n = self.llm.load_weights(iter(rest)) + len(weights) - len(rest)
        self.num_syncs += 1
        return n

    def generate(self, prompts: list[list[int]], params: SamplingParams, sync: bool = True,
                 reload_next: bool = False) -> list[Rollout]:
        """Sample ``params.n`` answers per prompt (token ids) with the current actor
        weights; log-probabilities are always returned. Rollouts come prompt by prompt,
        ``n`` consecutive ones per prompt. ``reload_next``: the caller loads new weights
        (a sync or a snapshot) before generating again, so the sleep after this generation
        discards the serving weights instead of keeping them (see :meth:`sleep_level`)."""
        if sync:
            self.sync_weights()
        if params.logprobs is None:
            params = SamplingParams(**{**params.__dict__, "logprobs": 0})
        plist: SamplingParams | list[SamplingParams] = params
        if params.seed is not None:  # one seed per prompt (choice i of prompt k: seed + k·n + i)
            base = params.seed % (1 << 62)
            plist = [SamplingParams(**{**params.__dict__, "seed": base + k * params.n}) for k in range(len(prompts))]
        t0 = time.perf_counter()
        self.llm.wake_up()
        try:
            outs = self.llm.generate(prompts, plist)
        finally:
            self.llm.sleep(self.sleep_level(reload_next))
        self.times.generate += time.perf_counter() - t0
        rollouts = []
        for g, out in enumerate(outs):
            if out.error:
                raise RuntimeError(f"generation failed: {out.error}")
            for c in out.outputs:
                lps = [d["logprob"] for d in (c.logprobs or [])]
                rollouts.append(Rollout(list(out.prompt_token_ids), list(c.token_ids), lps, c.text,
                                        c.finish_reason, g))
        return rollouts

    def sleep_level(self, reload_next: bool) -> int:
        """The serving engine's sleep level between rollouts. Level 1 keeps the weights: on an
        accelerator it copies them to host memory and back at the next wake-up, which is two
        whole-model transfers wasted when new weights overwrite them first (``reload_next``);
        level 2 then discards them instead. On a CPU level 1 copies nothing and keeps the
        packed kernels' layouts, so it stays."""
        return 2 if reload_next and self.offloads_on_sleep() else 1

    def offloads_on_sleep(self) -> bool:
        """Whether sleeping at level 1 copies the serving weights out (an accelerator)."""
        return self.llm.engine.runner.device.type != "cpu"

    def take_times(self) -> PhaseTimes:
        """The phase times accumulated so far, then reset."""
        t, self.times = self.times, PhaseTimes()
        return t
