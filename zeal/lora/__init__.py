"""LoRA / QLoRA: PEFT adapter folders, low-rank adapters applied to a plain model before
ZeRO, adapter save and merge (see docs/lora.md)."""
