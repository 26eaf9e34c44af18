"""DeepSpeed's engine surface over a zeal :class:`~zeal.train.engine.TrainEngine`.

A thin facade (composition): every attribute and method is the zeal engine's, except
the few whose DeepSpeed return shape differs (``load_checkpoint`` returns
``(path, client_state)``, ``save_checkpoint`` returns ``True``, the default tag is
``global_step{N}``)."""

from __future__ import annotations

import os
from typing import Any


class DeepSpeedEngine:
    """``engine(batch)``, ``engine.backward(loss)``, ``engine.step()`` and DeepSpeed's
    accessors, delegated to the zeal engine in ``.engine`` (no state of its own)."""

    def __init__(self, engine: Any) -> None:
        object.__setattr__(self, "engine", engine)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.engine, name, value)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.engine(*args, **kwargs)

    @property
    def global_rank(self) -> int:
        """This process's rank in the job."""
        return self.engine.mesh.rank

    @property
    def local_rank(self) -> int:
        """This process's rank on its node."""
        return int(os.environ.get("LOCAL_RANK", 0))

    def train(self, mode: bool = True) -> DeepSpeedEngine:
        """Training mode (as ``nn.Module.train``)."""
        self.engine.train(mode)
        return self

    def eval(self) -> DeepSpeedEngine:
        """Evaluation mode."""
        return self.train(False)

    def save_checkpoint(self, save_dir: str, tag: Any = None, client_state: dict | None = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False) -> bool:
        """Save under ``save_dir/tag`` (default ``global_step{N}``); every rank calls it.
        ``save_latest`` and ``exclude_frozen_parameters`` are accepted (zeal always
        records the latest tag and saves every parameter)."""
        del save_latest, exclude_frozen_parameters
        tag = str(tag) if tag is not None else f"global_step{self.engine.global_steps}"
        self.engine.save_checkpoint(save_dir, tag=tag, client_state=client_state or {})
        return True

    def load_checkpoint(self, load_dir: str, tag: Any = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn: Any = None) -> tuple[str, dict]:
        """Load ``tag`` (default: the latest) and return ``(path, client_state)``."""
        if custom_load_fn is not None:
            raise ValueError("load_checkpoint: custom_load_fn is not supported by zeal")
        if not load_module_strict:
            raise ValueError("load_checkpoint: load_module_strict=False is not supported by zeal")
        from pathlib import Path

        from zeal.checkpoint.files import resolve_tags

        tags = resolve_tags(Path(load_dir), None if tag is None else str(tag))
        client = self.engine.load_checkpoint(load_dir, tag=None if tag is None else str(tag),
                                             load_optimizer_states=load_optimizer_states,
                                             load_lr_scheduler_states=load_lr_scheduler_states,
                                             load_module_only=load_module_only)
        return os.path.join(load_dir, tags[0] if tags else str(tag)), client
