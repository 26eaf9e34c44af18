"""Regional ``torch.compile``: the apply-step of the config's ``compile`` section.

Each transformer block's ``forward`` is compiled (not the whole model): every layer of a
stack shares one block class, so one graph is traced and reused, compile time stays that
of one block, and what runs between blocks — ZeRO-3's gathers and releases (module hooks,
called around ``forward``), the checkpointing wrapper, pipeline sends, the loss — stays
eager. The blocks are a zeal model's ``layer_stack()`` or, for any other model, the
longest ``nn.ModuleList`` of one module class (a Hugging Face model's decoder layers).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from zeal.config import ConfigError
from zeal.config.schema import CompileConfig

log = logging.getLogger("zeal.train")


def blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks: ``layer_stack()`` where the model has one, else the
    longest ``nn.ModuleList`` whose members are all of one class (empty when none)."""
    stack = getattr(model, "layer_stack", None)
    if callable(stack):
        return list(stack())
    best: list[nn.Module] = []
    for m in model.modules():
        if isinstance(m, nn.ModuleList) and len(m) > len(best) and len({type(x) for x in m}) == 1:
            best = list(m)
    return best


def apply_compile(model: nn.Module, section: CompileConfig) -> int:
    """Compile each block's ``forward`` as ``section`` says; returns the number compiled (0: off)."""
    if section.disable or not section.enabled:
        return 0
    targets = blocks(model)
    if not targets:
        raise ConfigError(f"config key 'compile': found no repeated blocks in {type(model).__name__} to compile "
                          "(no layer_stack() and no nn.ModuleList of one module class); call torch.compile on "
                          "the model yourself and drop the section")
    kwargs = dict(section.kwargs)
    if "backend" in kwargs:
        raise ConfigError("config key 'compile.kwargs.backend': give the backend as 'compile.backend'")
    for block in targets:
        ckpt = getattr(block, "_gradient_checkpointing_func", None)
        if getattr(block, "gradient_checkpointing", False) and ckpt is not None:
            # a Hugging Face layer checkpointing itself: its forward calls the checkpoint function
            # on the layer's own forward, which is what gets compiled (checkpointing stays eager)
            block._gradient_checkpointing_func = _compiled_inside(ckpt, section.backend, kwargs)
        else:
            block.forward = torch.compile(block.forward, backend=section.backend, **kwargs)
    log.info("compile: %d %s blocks, backend %s", len(targets), type(targets[0]).__name__, section.backend)
    return len(targets)


def _compiled_inside(ckpt, backend: str, kwargs: dict):
    """A checkpoint function that checkpoints the compiled form of what it is given (one
    compiled function per code object: dynamo caches by code, so layers share the graph)."""
    def run(fn, *args, **kw):
        return ckpt(torch.compile(fn, backend=backend, **kwargs), *args, **kw)

    return run
