"""The ``--lora`` flag of ``zeal train`` / ``zeal rlhf``: ``K=V,K=V,...`` into a ``lora``
config section.

``--lora r=16,alpha=32,dropout=0.05,target_modules=q_proj,v_proj,quantize_base=int4``:
a bare item after a key (``v_proj`` above) adds to that key's list. ``--lora`` alone turns
LoRA on with the section's defaults. PEFT's spellings (``lora_alpha``, ``lora_dropout``)
and ``rank`` are accepted. Name lists stay lists; ``all-linear`` or a value holding regex
characters stays one string (PEFT's full-match regex).
"""

from __future__ import annotations

from typing import Any

from zeal.cli.overrides import UsageError, parse_value

__all__ = ["parse_lora_flag"]

_ALIASES = {"lora_alpha": "alpha", "lora_dropout": "dropout", "rank": "r", "target": "target_modules",
            "lora_target": "target_modules", "quant": "quantize_base", "init_lora_weights": "init"}
_LISTS = ("target_modules", "modules_to_save", "exclude_modules", "layers_to_transform")
_REGEX = set("*()[]|\\^$?+")


def parse_lora_flag(text: str | None) -> dict[str, Any]:
    """The ``lora`` section a ``--lora`` value asks for (``enabled`` set); UsageError
    naming the item for one that is neither ``key=value`` nor a list item."""
    from zeal.config.lora import LoraConfig

    out: dict[str, Any] = {"enabled": True}
    key = None
    for item in (text or "").split(","):
        item = item.strip()
        if not item:
            continue
        k, eq, v = item.partition("=")
        if not eq:
            if key not in _LISTS:
                raise UsageError(f"--lora: {item!r} is not key=value (e.g. --lora r=8,alpha=16,target_modules=q_proj,v_proj)")
            out[key].append(parse_value(item))
            continue
        key = _ALIASES.get(k.strip().replace("-", "_"), k.strip().replace("-", "_"))
        if key not in LoraConfig.model_fields:
            raise UsageError(f"--lora: unknown key {k.strip()!r} (known: {', '.join(sorted(LoraConfig.model_fields))})")
        v = v.strip()
        if key in _LISTS:
            if key == "target_modules" and (v.lower() == "all-linear" or _REGEX & set(v)):
                out[key] = v
                key = None
            else:
                out[key] = [parse_value(v)] if v else []
        else:
            out[key] = v if key in ("adapter", "quantize_base", "init", "bias") else parse_value(v)
    return out
