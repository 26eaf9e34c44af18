"""How close a reduced-precision serving path stays to fp32, in greedy tokens.

For a fixed set of chat prompts, each path's greedy continuation is compared with
zeal's fp32 continuation of the same prompt: the *first divergence* of a prompt is the
index of the first generated token that differs (``horizon`` when none does within
it). A path is at least as close to fp32 as another when its median first divergence
is no earlier and no more of its prompts diverge within the first ``early`` tokens.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import torch
from torch import nn

from zeal.inference.llm import LLM
from zeal.inference.sampling_params import SamplingParams
from zeal.inference.tokenizer import Tokenizer


def greedy_chat(model: nn.Module, tokenizer: Tokenizer, prompts: Sequence[str], max_tokens: int,
                fused: bool = True, **engine_kwargs) -> list[list[int]]:
    """Greedy token ids of ``model`` answering each prompt as a user turn (chat template),
    ``max_tokens`` each (end-of-sequence ignored). ``fused=False``: the pure-torch path."""
    llm = LLM(model, tokenizer, **engine_kwargs)
    if not fused:
        llm.engine.runner.kernels = None  # read per pass by the runner (attention metadata, argmax)
    ids = [tokenizer.encode_chat([{"role": "user", "content": p}]) for p in prompts]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(ids, params)]


def first_divergence(ref: Sequence[int], other: Sequence[int], horizon: int) -> int:
    """Index of the first token where ``other`` differs from ``ref`` (``horizon`` if none within it)."""
    for i in range(min(horizon, len(ref), len(other))):
        if ref[i] != other[i]:
            return i
    return horizon


def agreement(ref: list[list[int]], other: list[list[int]], horizon: int, early: int = 8) -> dict:
    """Per-prompt first divergences of ``other`` from ``ref`` and their summary: the median,
    how many prompts diverge before token ``early``, how many never diverge."""
    div = [first_divergence(r, o, horizon) for r, o in zip(ref, other)]
    return {"divergence": div, "median": statistics.median(div), "early": sum(d < early for d in div),
            "identical": sum(d >= horizon for d in div), "prompts": len(div)}


def at_least_as_close(candidate: dict, baseline: dict) -> bool:
    """The acceptance rule: same or later median first divergence, no more early divergences."""
    return candidate["median"] >= baseline["median"] and candidate["early"] <= baseline["early"]


def bf16_agreement(model32: nn.Module, tokenizer: Tokenizer, prompts: Sequence[str], max_tokens: int,
                   early: int = 8, **engine_kwargs) -> dict[str, dict]:
    """fp32 reference, then the bf16 copies through the fused kernels and the torch path:
    ``{"fused": summary, "torch": summary}`` (see :func:`agreement`; ``tokens``: the answers)."""
    ref = greedy_chat(model32, tokenizer, prompts, max_tokens, **engine_kwargs)
    model16 = _bf16_copy(model32)
    out = {}
    for name, fused in (("fused", True), ("torch", False)):
        toks = greedy_chat(model16, tokenizer, prompts, max_tokens, fused=fused, **engine_kwargs)
        out[name] = agreement(ref, toks, max_tokens, early) | {"tokens": toks}
    return out


def _bf16_copy(model: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(model).to(torch.bfloat16)
