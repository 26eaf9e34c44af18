"""Which LoRA adapters an engine serves, by name: load, unload, resolve (vLLM's semantics).

:class:`LoRARegistry` maps the names requests give as ``model`` to loaded adapters. Each
load gets a fresh ``lora_id`` (never reused: the prefix cache salts its block hashes with
it, so a name unloaded and loaded again from another folder can never hit the old KV) and
a device slot of :class:`~zeal.inference.multi_lora.MultiLoRA`.

Unloading an adapter that requests are still using *drains* it: the name is gone at once
(new requests for it get 404, and it may be loaded again right away), while the requests
already admitted finish with it; its slot is freed when the last of them ends
(:meth:`LoRARegistry.collect`). So no request is lost or switched to other weights.

Errors are :class:`LoRAError` (a ``ValueError``) carrying the HTTP status the server
answers with: 404 for an unknown name or a folder that does not exist, 400 for a bad
folder, a rank above ``max_lora_rank``, a name already loaded or no free slot.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from zeal.config.inference import LoRAServingConfig
from zeal.inference.multi_lora import MultiLoRA
from zeal.lora.peft_folder import read_adapter

__all__ = ["LoRAError", "LoRANotFoundError", "LoRARegistry", "LoadedAdapter", "runtime_updating_allowed"]

log = logging.getLogger("zeal.inference")


def runtime_updating_allowed(cfg: LoRAServingConfig) -> bool:
    """Whether ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` are served: the
    config's ``allow_runtime_lora_updating``, or vLLM's ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``
    set to ``true``/``1``."""
    env = os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").strip().lower()
    return cfg.allow_runtime_lora_updating or env in ("1", "true")


class LoRAError(ValueError):
    """A refused LoRA operation; ``status`` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.param = status, code, param


class LoRANotFoundError(LoRAError):
    """A request or an unload names an adapter that is not served (HTTP 404)."""

    def __init__(self, message: str) -> None:
        super().__init__(404, message, "model_not_found", "model")


@dataclass(frozen=True)
class LoadedAdapter:
    """A served adapter: its ``name``, folder, unique ``lora_id``, device ``slot`` and rank."""

    name: str
    path: str
    lora_id: int
    slot: int
    rank: int


class LoRARegistry:
    """The adapters of one engine. ``in_use()`` gives the ``lora_id`` of each request the
    engine has not finished, one entry per request (what keeps a draining adapter's slot)."""

    def __init__(self, device: MultiLoRA, in_use: Callable[[], list[int]]) -> None:
        self.device = device
        self._in_use = in_use
        self.by_name: dict[str, LoadedAdapter] = {}  # replaced, never mutated: readable from other threads
        self.draining: dict[int, LoadedAdapter] = {}  # lora_id -> unloaded adapter still serving requests
        self._ids = itertools.count(1)

    def resolve(self, name: str) -> LoadedAdapter:
        """The adapter served as ``name`` (404 when none is)."""
        a = self.by_name.get(name)
        if a is None:
            raise LoRANotFoundError(f"the LoRA adapter {name!r} is not loaded")
        return a

    def load(self, name: str, path: str) -> LoadedAdapter:
        """Read the PEFT folder ``path`` and serve it as ``name``."""
        if not name:
            raise LoRAError(400, "lora_name must be a non-empty string", param="lora_name")
        if name in self.by_name:
            raise LoRAError(400, f"the LoRA adapter {name!r} is already loaded (from {self.by_name[name].path}); "
                            "unload it first", param="lora_name")
        self.collect()
        if self.device.num_free_slots == 0:
            raise LoRAError(400, f"max_loras {self.device.max_loras} adapters are loaded (or still finishing "
                            f"requests): unload one first", param="lora_name")
        if not Path(path).is_dir():
            raise LoRAError(404, f"no LoRA adapter folder at {path!r}", param="lora_path")
        try:
            weights = self.device.weights_of(read_adapter(path), f"LoRA adapter {name!r} ({path})")
        except (ValueError, FileNotFoundError, OSError) as e:
            raise LoRAError(400, str(e), param="lora_path") from None
        slot = self.device.add(weights)
        a = LoadedAdapter(name, str(path), next(self._ids), slot, weights.rank)
        self.by_name = {**self.by_name, name: a}
        log.info("LoRA adapter %r loaded from %s (rank %d, %d modules, slot %d)", name, path, weights.rank,
                 len(weights.factors), slot)
        return a

    def unload(self, name: str) -> int:
        """Stop serving ``name``; returns how many of its requests are still running (they
        finish with it, then its slot is freed)."""
        a = self.resolve(name)
        self.by_name = {k: v for k, v in self.by_name.items() if k != name}
        self.draining[a.lora_id] = a
        running = self.collect().get(a.lora_id, 0)
        log.info("LoRA adapter %r unloaded%s", name, f" ({running} request(s) finishing with it)" if running else "")
        return running

    def collect(self) -> dict[int, int]:
        """Free the slots of unloaded adapters no request uses any more; returns the
        requests still running per draining ``lora_id``."""
        if not self.draining:
            return {}
        busy: dict[int, int] = {}
        for lid in self._in_use():
            busy[lid] = busy.get(lid, 0) + 1
        for lid in [lid for lid in self.draining if lid not in busy]:
            self.device.remove(self.draining.pop(lid).slot)
        return {lid: n for lid, n in busy.items() if lid in self.draining}

    def cards(self) -> list[dict]:
        """``[{"name", "path", "rank"}]`` of the adapters served, in load order."""
        return [{"name": a.name, "path": a.path, "rank": a.rank} for a in self.by_name.values()]
