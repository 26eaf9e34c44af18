"""The tokenizer half of an exported Hugging Face folder.

``transformers`` needs three files beside the weights to load a fast tokenizer as the
model was trained with: ``tokenizer.json`` (vocabulary, merges, pre-tokenizer),
``tokenizer_config.json`` (the tokenizer class, the special tokens by name, the chat
template) and ``special_tokens_map.json``; and ``generate`` reads the special-token
ids from ``config.json`` / ``generation_config.json``, which must be ids of that
vocabulary. This module finds the tokenizer of a checkpoint (``--tokenizer PATH``,
else the ``tokenizer.json`` a ``zeal train`` run folder keeps next to
``checkpoints/``, plus the configuration of the Hugging Face folder the run
fine-tuned) and writes those files.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

EOT = "<|endoftext|>"  # zeal's from-scratch tokenizers (zeal.data.corpus.EOT): document separator, token 0
SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
_EXTRA_FILES = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "generation_config.json")


@dataclass
class TokenizerSource:
    """Where an export's tokenizer comes from: the ``tokenizer.json`` and, when known,
    the Hugging Face folder whose configuration goes with it."""

    tokenizer_json: Path
    config_dir: Path | None = None
    notes: list[str] = field(default_factory=list)


def _run_dirs(checkpoint: Path, tag_folder: Path) -> list[Path]:
    """Folders that may be the run folder of a checkpoint given as a run, checkpoints or tag folder."""
    out = []
    for p in (checkpoint, checkpoint.parent, tag_folder.parent.parent, tag_folder.parent):
        if p not in out:
            out.append(p)
    return out


def find_tokenizer(checkpoint: str | Path, tag_folder: Path, tokenizer: str | Path | None = None
                   ) -> TokenizerSource | None:
    """The tokenizer to export with a checkpoint: ``tokenizer`` (a ``tokenizer.json`` file
    or a folder holding one) when given, else the run folder's; None when there is none."""
    if tokenizer is not None:
        p = Path(tokenizer).expanduser()
        if p.is_file():
            return TokenizerSource(p, p.parent if (p.parent / "tokenizer_config.json").is_file() else None)
        if (p / "tokenizer.json").is_file():
            return TokenizerSource(p / "tokenizer.json", p)
        raise FileNotFoundError(f"--tokenizer {tokenizer}: neither a tokenizer.json file nor a folder holding one")
    for run in _run_dirs(Path(checkpoint), tag_folder):
        if (run / "tokenizer.json").is_file():
            return TokenizerSource(run / "tokenizer.json", _fine_tuned_folder(run))
    return None


def _fine_tuned_folder(run: Path) -> Path | None:
    """The Hugging Face folder a ``zeal train`` run fine-tuned (its tokenizer configuration
    and chat template belong to the export), or None for a from-scratch run."""
    try:
        spec = json.loads((run / "config.json").read_text())
    except (OSError, ValueError):
        return None
    hf = (spec.get("job") or {}).get("hf_model") if isinstance(spec, dict) else None
    if not hf:
        return None
    from zeal.models.hf import model_folder  # 'smollm2' names the embedded model's cached folder

    try:
        folder = model_folder(hf)
    except FileNotFoundError:  # the embedded model's package is gone
        return None
    return folder if (folder / "tokenizer_config.json").is_file() else None


def _read_json(path: Path) -> dict:
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return d if isinstance(d, dict) else {}


def _token_str(t: Any) -> str | None:
    return t.get("content") if isinstance(t, dict) else t


def _special_tokens(tok: Any, source_cfg: dict) -> dict[str, str]:
    """Special tokens by name: the source configuration's, else (a zeal-trained
    tokenizer) ``<|endoftext|>`` as bos, eos and unk, GPT-2's convention."""
    named = {k: _token_str(source_cfg.get(k)) for k in SPECIAL_KEYS}
    named = {k: v for k, v in named.items() if v is not None and tok.token_to_id(v) is not None}
    if not named and tok.token_to_id(EOT) is not None:
        named = {"bos_token": EOT, "eos_token": EOT, "unk_token": EOT}
    return named


def special_token_ids(tok: Any, named: dict[str, str]) -> dict[str, int]:
    """``bos_token_id`` / ``eos_token_id`` / ``pad_token_id`` of the named special tokens."""
    out = {}
    for key in ("bos_token", "eos_token", "pad_token"):
        if key in named:
            out[f"{key}_id"] = tok.token_to_id(named[key])
    return out


def write_tokenizer(dest: Path, source: TokenizerSource, model_config: dict, max_length: int | None) -> dict:
    """Write ``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json``
    and ``generation_config.json`` into ``dest``; set the special-token ids in
    ``model_config`` (the ``config.json`` about to be written). Returns a summary."""
    from tokenizers import Tokenizer

    text = source.tokenizer_json.read_text()
    tok = Tokenizer.from_str(text)
    vocab = model_config.get("vocab_size")
    if vocab is not None and tok.get_vocab_size() > vocab:
        raise ValueError(f"tokenizer {source.tokenizer_json} has {tok.get_vocab_size()} tokens, more than the "
                         f"model's vocabulary of {vocab}: not this model's tokenizer (pass --tokenizer PATH)")
    src = source.config_dir
    src_cfg = _read_json(src / "tokenizer_config.json") if src else {}
    named = _special_tokens(tok, src_cfg)
    cfg = {k: v for k, v in src_cfg.items() if k not in SPECIAL_KEYS and k != "added_tokens_decoder"}
    cfg.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    cfg.setdefault("clean_up_tokenization_spaces", False)
    if max_length:
        cfg["model_max_length"] = max_length
    cfg.update(named)
    template = src_cfg.get("chat_template")
    if not template and src and (src / "chat_template.jinja").is_file():
        template = (src / "chat_template.jinja").read_text()
    if template:
        cfg["chat_template"] = template
    ids = special_token_ids(tok, named)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        model_config[key] = ids.get(key)
    gen = _read_json(src / "generation_config.json") if src else {}
    gen.update({k: v for k, v in ids.items() if v is not None})
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "tokenizer.json").write_text(text)
    _write_json(dest / "tokenizer_config.json", cfg)
    _write_json(dest / "special_tokens_map.json", named)
    _write_json(dest / "generation_config.json", gen)
    return {"tokenizer": str(source.tokenizer_json), "vocab": tok.get_vocab_size(), "special_tokens": named,
            **ids, "chat_template": bool(template)}


def clear_invalid_token_ids(model_config: dict) -> list[str]:
    """Without a tokenizer: drop special-token ids outside the vocabulary (GPT-2's 50256
    in a smaller vocabulary makes ``generate`` fail); returns the keys dropped."""
    vocab = model_config.get("vocab_size")
    dropped = []
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        v = model_config.get(key)
        values = v if isinstance(v, list) else [v]
        if vocab is not None and any(isinstance(x, int) and not 0 <= x < vocab for x in values):
            model_config[key] = None
            dropped.append(key)
    return dropped


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
