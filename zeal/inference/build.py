"""The composition root of serving: an :class:`~zeal.config.inference.InferenceConfig` → the
:class:`LLMEngine` of this process.

Every way in builds its engine here: ``zeal serve`` (in its own process or in the engine
process it starts), :class:`zeal.inference.LLM` (its keyword arguments become an
``InferenceConfig``), the RLHF hybrid engine (an ``LLM`` over its serving copy) and the
tensor-parallel ranks zeal starts (:mod:`zeal.inference.tp_worker`). What may be combined
is checked once, by the config's validators; what is loaded, and how, once, in
:mod:`zeal.inference.loader` (which the draft model of speculative decoding loads through
too). The serving stack never reaches up into the command line.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import torch
from torch import nn

from zeal.config.inference import InferenceConfig, resolve_dtype
from zeal.inference.engine import LLMEngine
from zeal.inference.loader import WeightsOffload, load_model_and_tokenizer, resolve_model_path
from zeal.inference.tokenizer import Tokenizer

__all__ = ["build_engine"]


def build_engine(cfg: InferenceConfig, model: nn.Module | None = None, tokenizer: Tokenizer | None = None, *,
                 eos_token_ids: Sequence[int] = (), draft_model: nn.Module | None = None,
                 on_rank_death: Callable[[str], None] | None = None) -> LLMEngine | None:
    """The engine ``cfg`` describes: the model of ``cfg.model`` (a folder, a ``.gguf`` file,
    None for the default model) at ``cfg.dtype`` on ``cfg.device``, streamed or with int8
    matmuls as ``cfg`` says. ``model``: an instance served in place instead (``cfg``'s
    weight-loading fields left at their defaults); ``tokenizer`` replaces the folder's own;
    ``eos_token_ids`` stop generation besides the model's; ``draft_model``: the instance of
    ``speculative_config`` method ``draft_model``.

    With ``cfg.tensor_parallel_size`` T > 1 the model is split over T ranks: started by this
    process (which becomes rank 0; ``on_rank_death`` is told if one of them dies) or, in a
    launched job, joined (an instance is copied before it is split). Rank 0 gets the engine
    (its group is ``engine.tp``); ranks 1..T-1 serve rank 0's passes until it shuts the group
    down and get None."""
    if model is not None and (cfg.weights_offload != "none" or cfg.quantized_matmul != "off"):
        raise ValueError("weights_offload and quantized_matmul need a model folder (its layers are streamed or "
                         "read as codes from files), not a model instance")
    dtype = getattr(torch, resolve_dtype(cfg.dtype, cfg.device))
    tp = None
    if cfg.tensor_parallel_size > 1:
        module, tok, eos, tp = _split(cfg, model, dtype, on_rank_death)
    elif model is not None:
        module, tok, eos = model.eval(), None, []
    else:
        offload = WeightsOffload(cfg.weights_offload, cfg.max_resident_weights_gb, cfg.offload_dir,
                                 cfg.weights_offload_quant)
        module, tok, eos = load_model_and_tokenizer(resolve_model_path(cfg.model), dtype, cfg.device, offload,
                                                    cfg.quantized_matmul)
    tok = tokenizer if tokenizer is not None else tok
    eos = eos + [e for e in eos_token_ids if e not in eos]
    if tp is None:
        return LLMEngine(module, tok, cfg.engine, eos, draft_model=draft_model)
    if not tp.is_driver:  # ranks 1..T-1: follow rank 0's passes until it shuts the group down
        tp.serve(module)
        return None
    try:
        return LLMEngine(module, tok, cfg.engine, eos, tp=tp, draft_model=draft_model)
    except BaseException:
        tp.shutdown()
        raise


def _split(cfg: InferenceConfig, model: nn.Module | None, dtype: torch.dtype,
           on_rank_death: Callable[[str], None] | None):
    """``(model, tokenizer, eos ids, group)``: this rank's part of the split model."""
    from zeal.inference import tensor_parallel as tpmod

    size = cfg.tensor_parallel_size
    if model is None:
        return tpmod.load_split(cfg.model, size, dtype, cfg.device, on_rank_death)
    if not tpmod.in_launched_job():
        raise ValueError(f"LLM(model instance, tensor_parallel_size={size}) needs its {size} ranks launched "
                         "already (torchrun, one LLM per rank); pass a model folder to let zeal start them")
    tpmod.check_tp_size(model, size)
    module = copy.deepcopy(model).eval()
    tp = tpmod.join_tensor_parallel(size)
    tp.shard(module)
    return module, None, [], tp
