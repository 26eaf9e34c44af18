"""The core of Hugging Face folder I/O for Llama-family models: read the tensors of a folder
(single or sharded safetensors), build the model on the meta device from ``config.json``
(:class:`HFSkeleton`), load the weights into it, and write a model back as a folder.

It imports the model's config (:mod:`zeal.models.llama_config`) and the MoE formats
(:mod:`zeal.models.hf_moe`), never the model classes: the class to build is handed in
(``llama_skeleton(cls, cfg)``). So :class:`zeal.models.llama.Llama` can load and save
itself through this module, and :mod:`zeal.models.hf` (GPT-2, the model-type dispatch,
GGUF) builds on both; no two of them import each other.

Only safetensors and JSON are read: nothing is ever unpickled."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from zeal.models.hf_moe import MOE_TYPES, moe_config, moe_state_from_hf
from zeal.models.llama_config import LlamaConfig, rope_inv_freq
from zeal.utils.meta import meta_device

LLAMA_LIKE = {"llama", "mistral", "qwen2", "smollm"}

# A reader of a stored weight format: (the folder's tensors, its config.json) -> plain tensors
# under the folder's names (e.g. zeal.compression.export.decompress_state for compressed-tensors).
StateTransform = Callable[[dict[str, torch.Tensor], dict], dict[str, torch.Tensor]]


def read_safetensors_folder(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """All tensors of a folder, single file or sharded (``model.safetensors.index.json``)."""
    p = Path(path)
    index = p / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        out: dict[str, torch.Tensor] = {}
        for shard in shards:
            out.update(load_file(str(p / shard)))
        return out
    single = p / "model.safetensors"
    if not single.exists():
        raise FileNotFoundError(f"{p} has neither model.safetensors nor model.safetensors.index.json")
    return load_file(str(single))


@dataclass
class HFSkeleton:
    """A HF folder's model built on the meta device, its config, how a checkpoint tensor
    becomes the model's (``convert(name, tensor)`` → ``[(model name, tensor)]``; with
    ``tensor=None`` only the names), the embedding a tied head takes, a rewrite of the
    whole state that must come first (Mixtral's experts), if any, and what rebuilds the
    model's buffers and ties once the weights are in (``retie(model)``)."""

    model: nn.Module
    config: dict
    convert: Callable[[str, torch.Tensor | None], list[tuple[str, torch.Tensor | None]]]
    embedding: str
    tied: bool
    whole: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None  # a whole-state rewrite first
    retie: Callable[[nn.Module], None] | None = None  # buffers and ties, after the load

    def finish(self, state: dict[str, torch.Tensor], streamed: frozenset[str] = frozenset()) -> nn.Module:
        """Load ``state`` (the model's names; a missing or tied head takes the embedding),
        rebuild the buffers, tie the head; the model in eval mode. ``streamed`` names
        parameters left out of ``state`` on purpose (a weight streamer binds them)."""
        if self.tied or "lm_head.weight" not in state:
            state["lm_head.weight"] = state[self.embedding]
        model = self.model
        missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
        if unexpected or set(missing) - streamed:
            raise ValueError(f"checkpoint does not match the model: missing {sorted(set(missing) - streamed)[:5]}, "
                             f"unexpected {sorted(unexpected)[:5]}")
        if self.retie is not None:
            self.retie(model)
        return model.eval()


def is_llama_like(cfg: dict) -> bool:
    """Whether a ``config.json`` dict describes a model zeal's Llama builds (the Llama
    family, the MoE types of :mod:`zeal.models.hf_moe`, or any Llama-shaped config)."""
    mt = cfg.get("model_type", "llama")
    return mt in MOE_TYPES or mt in LLAMA_LIKE or "num_key_value_heads" in cfg or "intermediate_size" in cfg


def _llama_tensor(name: str, t: torch.Tensor | None) -> list[tuple[str, torch.Tensor | None]]:
    return [] if name.endswith("rotary_emb.inv_freq") else [(name, t)]


def _llama_retie(model: Any) -> None:
    """Buffers are not in the checkpoint: rebuild the rotary frequencies on CPU; tie the head."""
    model.inv_freq = rope_inv_freq(model.config)
    if model.config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight


def llama_skeleton(cls: Callable[[LlamaConfig], nn.Module], cfg: dict) -> HFSkeleton:
    """``cls`` (zeal's :class:`~zeal.models.llama.Llama`) built on the meta device from a
    Llama-family ``config.json`` dict, with how its checkpoint loads."""
    mt = cfg.get("model_type", "llama")
    lcfg = moe_config(cfg) if mt in MOE_TYPES else LlamaConfig.from_hf(cfg)
    with meta_device():
        model = cls(lcfg)
    return HFSkeleton(model, cfg, _llama_tensor, "model.embed_tokens.weight", lcfg.tie_word_embeddings,
                      moe_state_from_hf if mt in MOE_TYPES else None, _llama_retie)


def load_skeleton(sk: HFSkeleton, path: str | os.PathLike, dtype: torch.dtype = torch.float32,
                  state_transform: StateTransform | None = None) -> tuple[nn.Module, dict]:
    """Read the folder's weights into ``sk``'s model: ``(model, config_dict)``, in eval mode.
    ``state_transform`` rewrites the folder's tensors first (see
    :func:`zeal.models.hf.load_hf_model`); a compressed-tensors folder without one is refused."""
    # fresh, aligned storage: safetensors hands out views at arbitrary byte offsets,
    # which BLAS kernels run markedly slower on
    raw = read_safetensors_folder(path)
    if state_transform is not None:
        raw = state_transform(raw, sk.config)
    elif (sk.config.get("quantization_config") or {}).get("quant_method") == "compressed-tensors":
        raise ValueError(f"{path} holds compressed-tensors weights: load it with zeal.LLM, zeal serve or "
                         "zeal.inference.llm.load_model_and_tokenizer, or pass "
                         "state_transform=zeal.compression.export.decompress_state")
    if sk.whole is not None:
        raw = sk.whole(raw)
    state = {name: t.to(dtype=dtype, copy=True) for key, v in raw.items() for name, t in sk.convert(key, v)}
    return sk.finish(state), sk.config


def load_llama_folder(cls: Callable[[LlamaConfig], nn.Module], path: str | os.PathLike,
                      dtype: torch.dtype = torch.float32) -> nn.Module:
    """``cls`` loaded from a Llama-family HF folder, in eval mode (another model type is
    refused naming it)."""
    cfg = json.loads((Path(path) / "config.json").read_text())
    if not is_llama_like(cfg):
        raise ValueError(f"{path} holds a {cfg.get('model_type')!r} model, not a Llama-family model")
    model, _ = load_skeleton(llama_skeleton(cls, cfg), path, dtype)
    return model


def save_llama_folder(model: Any, path: str | os.PathLike) -> Path:
    """Write a zeal Llama as a Hugging Face folder (``config.json`` + one
    ``model.safetensors``, the tied head stored once); to a temporary folder, fsynced, then
    renamed over ``path``, so a failed export leaves the previous folder intact."""
    out = Path(path)
    cfg = model.config.to_hf()
    sd = model.state_dict()
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    # own, contiguous storage per tensor: safetensors refuses shared or strided views
    sd = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in sd.items()}
    cfg["torch_dtype"] = str(next(iter(sd.values())).dtype).removeprefix("torch.")
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    save_file(sd, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out
