"""``zeal serve [PATH]``: the OpenAI-compatible server (default model: SmolLM2-135M-Instruct).

Every flag is a field of the ``inference`` config section
(:class:`zeal.config.inference.InferenceConfig`): its name, type, default and help
come from there, so each default is stated once.
"""

from __future__ import annotations

import argparse
import logging
import sys

from pydantic import ValidationError

from zeal.cli.config_flags import add_flags, leaves, scalar_type, tree_from_args
from zeal.config.inference import DTYPE_NAMES, InferenceConfig, resolve_dtype  # noqa: F401 - re-exported

DTYPES = DTYPE_NAMES  # the accepted --dtype spellings

# Flags whose spelling is not the field name: path -> (flag, scale of the value given on the command line).
_FLAG_NAMES: dict[str, tuple[str, int]] = {
    "engine.kv_cache_bytes": ("--kv-cache-mb", 1 << 20),
    "engine.enable_prefix_caching": ("--no-prefix-caching", 1),
    "process.num_threads": ("--threads", 1),
    "process.transparent_hugepages": ("--no-transparent-hugepages", 1),
    "server.engine_process": ("--no-engine-process", 1),
    "server.disable_additional_properties": ("--no-disable-additional-properties", 1),
}
_leaves, _scalar_type = leaves, scalar_type  # the names these had here


def add_arguments(p: argparse.ArgumentParser) -> None:
    """One flag per leaf of :class:`InferenceConfig` (the model path is the positional argument).
    Flags default to None: a flag not given leaves the config's default in place."""
    p.add_argument("model", nargs="?", default=None,
                   help=(InferenceConfig.model_fields["model"].description or "").rstrip("."))
    add_flags(p, InferenceConfig, _FLAG_NAMES, skip=("model",))


def config_from_args(args: argparse.Namespace) -> InferenceConfig:
    """The validated ``inference`` section: the flags given over the section's defaults."""
    try:
        return InferenceConfig.model_validate(tree_from_args(args, InferenceConfig, _FLAG_NAMES))
    except ValidationError as e:
        from zeal.config import format_validation_error

        raise ValueError(format_validation_error(e)) from None


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``serve`` on an argparse subparsers object."""
    p = subparsers.add_parser("serve", help="serve a model over the OpenAI HTTP API",
                              description=__doc__)
    add_arguments(p)
    p.set_defaults(func=run)
    return p


class _RankDeath:
    """A tensor-parallel rank died: the server cannot go on (its passes need every rank).
    Says so in one line, ends every open stream with an error event (then ``[DONE]``), and
    stops the server gracefully (uvicorn lets the open responses finish), exit code 1; a
    stop that hangs is cut after ``grace`` seconds. Before serving: exit at once."""

    def __init__(self, grace: float = 10.0) -> None:
        self.aengine = None
        self.server = None  # the uvicorn.Server, once serving
        self.message: str | None = None
        self.grace = grace

    def __call__(self, message: str) -> None:
        import os
        import threading

        if self.message is not None:
            return
        self.message = message
        print(f"zeal serve: {message}; stopping", file=sys.stderr, flush=True)
        if self.aengine is None:
            os._exit(1)
        self.aengine.fail_all(message)
        timer = threading.Timer(self.grace, os._exit, (1,))
        timer.daemon = True
        timer.start()
        if self.server is not None:
            self.server.should_exit = True  # uvicorn's graceful shutdown (a signal would be re-raised at its end)


_exit_on_rank_death = _RankDeath()


def load_engine(cfg: InferenceConfig):
    """The :class:`LLMEngine` of one process (no tensor parallelism) as ``cfg`` describes it
    (:func:`zeal.inference.build.build_engine`)."""
    from zeal.inference.build import build_engine

    return build_engine(cfg)


def build(cfg: InferenceConfig | argparse.Namespace):
    """Load the model and return ``(app, model_name)``; under tensor parallelism, on ranks
    1..T-1 of a launched job, serve rank 0's passes until it stops and return ``(None, name)``.
    With ``server.engine_process`` (and no tensor parallelism) the model is loaded in the
    engine's own process."""
    from pathlib import Path

    from zeal.inference.async_engine import AsyncEngine
    from zeal.inference.llm import resolve_model_path
    from zeal.inference.server import build_app

    if isinstance(cfg, argparse.Namespace):
        cfg = config_from_args(cfg)
    path = resolve_model_path(cfg.model)
    srv = cfg.server
    name = srv.served_model_name or (Path(cfg.model).name if cfg.model else "SmolLM2-135M-Instruct")
    if cfg.tensor_parallel_size > 1:
        aengine = _tensor_parallel_engine(cfg, path, srv.max_waiting)
        if aengine is None:
            return None, name
    elif srv.engine_process:
        from zeal.inference.engine_process import EngineProcess
        from zeal.inference.tokenizer import Tokenizer

        aengine = EngineProcess(cfg, Tokenizer.from_folder(path), srv.max_waiting)
    else:
        aengine = AsyncEngine(load_engine(cfg), srv.max_waiting)
    return build_app(aengine, name, srv.api_key, srv.limits,
                     disable_additional_properties=srv.disable_additional_properties), name


def _tensor_parallel_engine(cfg: InferenceConfig, path, max_waiting: int):
    """Rank 0's engine thread over the split model; None on the other ranks (after serving)."""
    from zeal.inference.async_engine import AsyncEngine
    from zeal.inference.build import build_engine

    engine = build_engine(cfg, on_rank_death=_exit_on_rank_death)
    if engine is None:
        return None
    _exit_on_rank_death.aengine = AsyncEngine(engine, max_waiting)
    return _exit_on_rank_death.aengine


def run(args: argparse.Namespace) -> int:
    """Serve until interrupted (Ctrl-C cancels requests in flight and exits cleanly)."""
    from zeal.utils.process import apply_process_settings

    try:
        cfg = config_from_args(args)
    except ValueError as e:
        print(f"zeal serve: {e}", file=sys.stderr)
        return 2
    apply_process_settings(cfg.process)  # before the model is loaded: torch reads THP at its first allocation
    import uvicorn

    srv = cfg.server
    logging.basicConfig(level=srv.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        app, name = build(cfg)
    except (FileNotFoundError, ValueError) as e:
        print(f"zeal serve: {e}", file=sys.stderr)
        return 2
    if app is None:  # a tensor-parallel rank other than 0: rank 0 has stopped the group
        return 0
    from zeal.inference.server import uvicorn_limits

    print(f"zeal serve: {name} on http://{srv.host}:{srv.port}/v1", file=sys.stderr)
    server = uvicorn.Server(uvicorn.Config(app, host=srv.host, port=srv.port, log_level=srv.log_level,
                                           timeout_graceful_shutdown=5, **uvicorn_limits(srv.limits)))
    _exit_on_rank_death.server = server
    server.run()
    return 1 if _exit_on_rank_death.message else 0  # under tensor parallelism the other ranks are stopped at exit


def main(argv: list[str] | None = None) -> int:
    """``python -m zeal.cli.serve``: the same as ``zeal serve``."""
    p = argparse.ArgumentParser(prog="zeal serve", description=__doc__)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
