"""Export a zeal checkpoint to a Hugging Face folder, and inspect a checkpoint.

Export streams tensor by tensor: each parameter is assembled from the per-rank
boxes (:class:`~zeal.checkpoint.reader.SavedShards`), converted and written before the next one is
read, so peak memory is a few times the largest single tensor, never the model.
zeal's GPT (``zeal.models.gpt.GPT``) becomes a ``GPT2LMHeadModel`` folder (HF GPT-2
stores the attention/MLP projections as ``Conv1D``, the transpose of ``nn.Linear``;
the tied LM head is left to ``tie_word_embeddings``); zeal's Llama already uses
Hugging Face's names and becomes a ``LlamaForCausalLM`` folder (with an MoE MLP in every
layer, top-2, a ``MixtralForCausalLM`` folder: router and per-expert w1/w2/w3, every
expert of an expert-parallel run); a Hugging Face model
trained under zeal keeps its own names and ``config.json``. The tokenizer goes with
the weights (:mod:`zeal.checkpoint.export_tokenizer`): ``tokenizer=PATH``, else the
run folder's ``tokenizer.json``; the special-token ids of ``config.json`` are those
of that vocabulary.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from zeal.checkpoint import files as cf
from zeal.checkpoint.export_tokenizer import clear_invalid_token_ids, find_tokenizer, write_tokenizer
from zeal.checkpoint.files import CheckpointCorruptError, CheckpointError, TensorSpec
from zeal.checkpoint.load import open_shards, read_meta
from zeal.checkpoint.reader import SavedShards
from zeal.checkpoint.save import META

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
ZEAL_GPT = "zeal.models.gpt.GPT"
ZEAL_LLAMA = "zeal.models.llama.Llama"
_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def find_checkpoint(path: str | Path, tag: str | None = None) -> Path:
    """A tag folder from a tag folder, a checkpoints folder or a run folder (``checkpoints/``)."""
    p = Path(path)
    if (p / cf.MANIFEST).is_file() and tag is None:
        return p
    if not (p / cf.LATEST).exists() and (p / "checkpoints").is_dir():
        p = p / "checkpoints"
    return p / cf.resolve_tags(p, tag)[0]


def open_verified(folder: Path, transient: bool = True) -> tuple[dict, dict, SavedShards]:
    """Manifest, meta and box index of a tag folder, after checking every file's SHA-256."""
    manifest = cf.read_manifest(folder)
    for name in sorted(manifest["files"]):
        cf.verify_file(folder, name, manifest)
    meta = read_meta(folder)
    return manifest, meta, open_shards(folder, manifest, meta, transient=transient)


def _hf_gpt2_config(cfg: dict) -> dict:
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": cfg["vocab_size"],
        "n_positions": cfg["n_positions"], "n_ctx": cfg["n_positions"], "n_embd": cfg["n_embd"],
        "n_layer": cfg["n_layer"], "n_head": cfg["n_head"], "n_inner": None,
        "activation_function": "gelu_new", "layer_norm_epsilon": cfg.get("layer_norm_epsilon", 1e-5),
        "resid_pdrop": cfg.get("dropout", 0.0), "embd_pdrop": cfg.get("dropout", 0.0),
        "attn_pdrop": cfg.get("dropout", 0.0), "initializer_range": 0.02, "scale_attn_weights": True,
        "tie_word_embeddings": True, "use_cache": True,
        "bos_token_id": None, "eos_token_id": None,  # set from the tokenizer (GPT-2's 50256 is not in ours)
    }


def _plan(meta: dict) -> tuple[list[tuple[str, str, str, bool]], dict]:
    """[(output name, kind, saved name, transpose)] and the config.json to write."""
    model = meta.get("model") or {}
    cls, cfg = model.get("class"), model.get("config")
    gpt = cls == ZEAL_GPT
    out = []
    for key, (kind, src) in meta["state_dict_keys"].items():
        if kind == "param" and key != src:
            continue  # tied alias of a parameter written under its first name
        out.append((key, kind, src, gpt and key.endswith(_CONV1D)))
    if gpt and (cfg or {}).get("num_experts"):
        raise CheckpointError(f"cannot export an MoE {ZEAL_GPT} as a Hugging Face folder: GPT-2 has no MoE layout")
    if gpt:
        config = _hf_gpt2_config(cfg or {})
    elif cls == ZEAL_LLAMA and cfg is not None and cfg.get("num_experts"):  # MoE Llama: a Mixtral folder
        out, config = _mixtral(cfg, out)
    elif cls == ZEAL_LLAMA and cfg is not None:
        from zeal.models.llama import LlamaConfig

        config = LlamaConfig(**cfg).to_hf()
    elif cfg is not None:
        config = dict(cfg)
        if not config.get("architectures"):
            config["architectures"] = [cls.rsplit(".", 1)[-1]]
    else:
        config = {"zeal_model_class": cls}
    return out, config


def _mixtral(cfg: dict, plan: list) -> tuple[list, dict]:
    """The plan renamed to Mixtral's tensors, and Mixtral's config.json."""
    from zeal.models.hf_moe import mixtral_config_to_hf, mixtral_name_to_hf
    from zeal.models.llama import LlamaConfig

    try:
        config = mixtral_config_to_hf(LlamaConfig(**cfg))
        return [(mixtral_name_to_hf(name), *rest) for name, *rest in plan], config
    except ValueError as e:
        raise CheckpointError(f"cannot export {ZEAL_LLAMA} as a Hugging Face folder: {e}") from None


def _producer(shards: SavedShards, meta: dict, kind: str, src: str, transpose: bool, dtype: torch.dtype):
    def produce() -> torch.Tensor:
        if kind == "buffer":
            t = shards.whole(f"buffer/{src}", dtype=cf.DTYPE_BY_NAME[meta["buffers"][src]["dtype"]])
        else:
            entry = meta["params"][src]
            t = shards.full("param", src, entry["shape"], cf.DTYPE_BY_NAME[entry["dtype"]])
        if transpose:
            t = t.t()
        return t.to(dtype).contiguous() if t.is_floating_point() else t.contiguous()

    return produce


def _specs(plan: list, meta: dict, shards: SavedShards, tdt: torch.dtype) -> list[TensorSpec]:
    specs = []
    for name, kind, src, transpose in plan:
        entry = meta["buffers"][src] if kind == "buffer" else meta["params"][src]
        shape = tuple(entry["shape"])
        stored = cf.DTYPE_BY_NAME[entry["dtype"]] if kind == "buffer" else torch.float32
        st = tdt if stored.is_floating_point else stored
        specs.append(TensorSpec(name, st, shape[::-1] if transpose else shape,
                                _producer(shards, meta, kind, src, transpose, tdt)))
    return specs


def _lora_specs(specs: list[TensorSpec], plan: list, meta: dict, shards: SavedShards, tdt: torch.dtype,
                merge: bool, folder: Path) -> list[TensorSpec]:
    """LoRA checkpoints: the adapters merged (``merge``), else a one-line refusal."""
    has_lora = any(k.endswith(".lora_A.weight") for k in meta["params"])
    if not merge:
        if has_lora:
            raise CheckpointError(f"{folder} holds LoRA adapters: export it with --merge-lora (base + adapter "
                                  "merged), or write the adapter alone with engine.save_adapter")
        return specs
    if not has_lora:
        raise CheckpointError(f"--merge-lora: {folder} holds no LoRA adapters")
    from zeal.lora.merge import merge_checkpoint_specs

    return merge_checkpoint_specs(
        specs, meta, lambda n: shards.full("param", n, meta["params"][n]["shape"], torch.float32),
        lambda n: shards.whole(f"buffer/{n}", dtype=cf.DTYPE_BY_NAME[meta["buffers"][n]["dtype"]]), tdt,
        {name for name, _, _, transpose in plan if transpose})


def export_hf(checkpoint: str | Path, out: str | Path, tag: str | None = None, dtype: str = "fp32",
              max_shard_bytes: int = 5 * 1024**3, tokenizer: str | Path | None = None,
              merge_lora: bool = False) -> dict[str, Any]:
    """Write ``out/config.json`` and ``out/model.safetensors`` (or shards plus
    ``model.safetensors.index.json`` above ``max_shard_bytes``) in ``dtype``
    (fp32/bf16/fp16), and the tokenizer files when a tokenizer is found (``tokenizer``:
    a ``tokenizer.json`` or a folder holding one; default: the run folder's); returns
    a summary. The checkpoint is verified first. A checkpoint of LoRA training exports
    only with ``merge_lora`` (the adapters merged into their base weights, see
    :func:`zeal.lora.merge.merge_checkpoint_specs`)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    folder = find_checkpoint(checkpoint, tag)
    source = find_tokenizer(checkpoint, folder, tokenizer)
    _, meta, shards = open_verified(folder)
    tdt = DTYPES[dtype]
    try:
        plan, config = _plan(meta)
        specs = _specs(plan, meta, shards, tdt)
        specs = _lora_specs(specs, plan, meta, shards, tdt, merge_lora, folder)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
        raise CheckpointCorruptError(f"{folder / META}: malformed ({type(e).__name__}: {e})") from None
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for s in specs:
        if shards[-1] and size + s.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(s)
        size += s.nbytes
    dest = Path(out)
    dest.mkdir(parents=True, exist_ok=True)
    config["torch_dtype"] = str(tdt).removeprefix("torch.")
    if source is not None:
        max_len = config.get("n_positions") or config.get("max_position_embeddings")
        tok_summary = write_tokenizer(dest, source, config, max_len)
    else:
        tok_summary = {"tokenizer": None, "dropped_token_ids": clear_invalid_token_ids(config)}
    cf.write_json(dest / "config.json", config)
    files = ["model.safetensors"] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for fname, group in zip(files, shards):
        cf.write_safetensors(dest / fname, group, {"format": "pt"})
    if len(shards) > 1:
        cf.write_json(dest / "model.safetensors.index.json", {
            "metadata": {"total_size": sum(s.nbytes for s in specs)},
            "weight_map": {s.name: f for f, g in zip(files, shards) for s in g}})
    return {"checkpoint": str(folder), "out": str(dest), "files": files, "tensors": len(specs),
            "bytes": sum(s.nbytes for s in specs), "dtype": dtype, **tok_summary}


def inspect_checkpoint(checkpoint: str | Path, tag: str | None = None) -> dict[str, Any]:
    """What a checkpoint holds, with every file's checksum verified (``ok`` per file)."""
    folder = find_checkpoint(checkpoint, tag)
    manifest = cf.read_manifest(folder)
    files = {}
    for name, entry in sorted(manifest["files"].items()):
        try:
            cf.verify_file(folder, name, manifest)
            files[name] = {"bytes": entry["bytes"], "ok": True}
        except CheckpointError as e:
            files[name] = {"bytes": entry["bytes"], "ok": False, "error": str(e)}
    info: dict[str, Any] = {"path": str(folder), "tag": manifest["tag"], "seq": manifest["seq"],
                            "world_size": manifest["world_size"], "zero_stage": manifest["zero_stage"],
                            "global_steps": manifest["global_steps"], "files": files,
                            "verified": all(f["ok"] for f in files.values())}
    if files.get(META, {}).get("ok"):
        try:
            info.update(_meta_info(read_meta(folder)))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise CheckpointCorruptError(f"{folder / META}: malformed ({type(e).__name__}: {e})") from None
    return info


def _meta_info(meta: dict) -> dict[str, Any]:
    params = meta["params"]
    return {
        "model_class": (meta.get("model") or {}).get("class"), "compute_dtype": meta["compute_dtype"],
        "micro_steps": meta["micro_steps"], "global_samples": meta["global_samples"],
        "skipped_steps": meta["skipped_steps"], "optimizer": meta["optimizer"]["class"],
        "optimizer_state": meta["optimizer"]["state_keys"],
        "parameters": sum(_numel(v["shape"]) for v in params.values()),
        "tensors": {n: {"shape": v["shape"], "trainable": v.get("trainable")} for n, v in params.items()},
        "buffers": {n: v["shape"] for n, v in meta["buffers"].items()},
    }


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
