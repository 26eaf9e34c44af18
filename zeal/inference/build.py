"""An :class:`~zeal.config.inference.InferenceConfig` → the :class:`LLMEngine` of one process.

``zeal serve`` (in its own process or in the engine process it starts) builds its engine
here, so the serving stack never reaches up into the command line."""

from __future__ import annotations

import torch
from torch import nn

from zeal.config.inference import InferenceConfig, resolve_dtype
from zeal.inference.engine import LLMEngine
from zeal.inference.llm import WeightsOffload, load_model_and_tokenizer, resolve_model_path
from zeal.inference.tokenizer import Tokenizer


def build_engine(cfg: InferenceConfig, model: nn.Module | None = None,
                 tokenizer: Tokenizer | None = None) -> LLMEngine:
    """The engine of one process (no tensor parallelism) as ``cfg`` describes it: the model
    of ``cfg.model`` (a folder, a ``.gguf`` file, None for the default model) at ``cfg.dtype``
    on ``cfg.device``, streamed or with int8 matmuls as ``cfg`` says. ``model``: an instance
    served in place instead (``cfg``'s weight-loading fields must be left at their defaults);
    ``tokenizer`` replaces the folder's own."""
    if model is not None:
        if cfg.weights_offload != "none" or cfg.quantized_matmul != "off":
            raise ValueError("weights_offload and quantized_matmul need a model folder, not a model instance")
        module, tok, eos = model.eval(), None, []
    else:
        dtype = getattr(torch, resolve_dtype(cfg.dtype, cfg.device))
        offload = WeightsOffload(cfg.weights_offload, cfg.max_resident_weights_gb, cfg.offload_dir,
                                 cfg.weights_offload_quant)
        module, tok, eos = load_model_and_tokenizer(resolve_model_path(cfg.model), dtype, cfg.device, offload,
                                                    cfg.quantized_matmul)
    if tokenizer is not None:
        tok = tokenizer
    return LLMEngine(module, tok, cfg.engine, eos)
