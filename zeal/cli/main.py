"""The ``zeal`` command: one entry point, one module per subcommand.

Each subcommand module exposes ``add_parser(subparsers)`` and ``run(args)``. Only
the module of the command being run is imported (``zeal --help`` imports none of
them), so a missing optional piece — the server, the checkpoint tools — affects
only its own command. Bad input (a wrong flag, a config value that fails
validation) ends with one line naming it and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import NoReturn

COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("zeal.cli.train", "train a model (default: small GPT from scratch, 2 processes, ZeRO-3)"),
    "generate": ("zeal.cli.generate", "sample text from a trained checkpoint"),
    "serve": ("zeal.cli.serve", "serve a model over an OpenAI-compatible HTTP API"),
    "estimate": ("zeal.cli.estimate", "per-rank memory for every ZeRO stage and offload; pick one for a budget"),
    "launch": ("zeal.cli.launch", "run a script on N processes (and N nodes), as torchrun does"),
    "deepspeed": ("zeal.cli.deepspeed", "run an unchanged DeepSpeed script on zeal (DeepSpeed's launcher flags)"),
    "checkpoint": ("zeal.cli.checkpoint", "inspect a checkpoint or export it to a Hugging Face folder"),
    "compress": ("zeal.cli.compress", "N:M sparsity (magnitude, Wanda, ADMM) and int8/int4 weights, exported"),
    "bench": ("zeal.cli.bench", "measure step time and peak memory per ZeRO stage beside the estimate"),
    "rlhf": ("zeal.cli.rlhf", "SFT, reward model, PPO, DPO and GRPO (hybrid engine) on a model"),
    "data": ("zeal.cli.data", "analyze a corpus for curriculum learning (per-sample metric, sorted index)"),
}

DESCRIPTION = "zeal: ZeRO-family training and serving on PyTorch."
EPILOG = "zeal commands:\n" + "\n".join(f"  {name:<11} {text}" for name, (_, text) in COMMANDS.items()) + (
    "\n\nRun 'zeal COMMAND --help' for a command's options.")


def _formatter(prog: str) -> argparse.HelpFormatter:
    # wide enough that every command and option fits on one line
    return argparse.RawDescriptionHelpFormatter(prog, max_help_position=30, width=120)


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error (sub-parsers inherit the class)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


class MissingCommand(Exception):
    """A command whose module is not part of this installation."""


def _load(name: str):
    module_name = COMMANDS[name][0]
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name == module_name:
            raise MissingCommand(f"'zeal {name}' is not available in this installation ({module_name} is missing)"
                                 ) from None
        extra = {"serve": "serve", "generate": "hf"}.get(name, "dev")
        raise MissingCommand(f"'zeal {name}' needs the package '{e.name}' (pip install 'zeal[{extra}]')") from None


def build_parser(command: str | None) -> tuple[argparse.ArgumentParser, object | None]:
    """The top-level parser, with the real sub-parser for ``command`` and a stub
    (name and one-line help) for every other command."""
    parser = _Parser(prog="zeal", description=DESCRIPTION, formatter_class=_formatter,
                                     epilog=EPILOG, allow_abbrev=False)
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    # The command list is the epilog (one line each); argparse's own listing would wrap long names.
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", help="one of the commands below")
    module = None
    for name in COMMANDS:
        if name == command:
            module = _load(name)
            sp = module.add_parser(sub)
            if isinstance(sp, argparse.ArgumentParser):
                sp.epilog = EPILOG if sp.epilog is None else sp.epilog.rstrip("\n") + "\n\n" + EPILOG
                sp.formatter_class = _formatter
        else:
            sub.add_parser(name, add_help=False)
    return parser, module


def _command_of(argv: list[str]) -> str | None:
    for tok in argv:
        if tok in COMMANDS:
            return tok
        if not tok.startswith("-"):
            return None
    return None


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``zeal`` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = _command_of(argv)
    try:
        parser, module = build_parser(command)
    except MissingCommand as e:
        print(f"zeal: error: {e}", file=sys.stderr)
        return 2
    if command is None:
        args = parser.parse_args(argv)
        if args.version:
            from importlib.metadata import PackageNotFoundError, version

            try:
                print(f"zeal {version('zeal')}")
            except PackageNotFoundError:
                print("zeal (not installed; running from a source checkout)")
            return 0
        parser.print_help()
        return 0 if not argv else 2
    args, extra = parser.parse_known_args(argv)
    try:
        if extra and not getattr(args, "_allow_extra", False):
            raise ValueError(f"unrecognized arguments: {' '.join(extra)}")
        rc = module.run(args, extra) if getattr(args, "_allow_extra", False) else module.run(args)
        return int(rc or 0)
    except KeyboardInterrupt:
        print("zeal: interrupted", file=sys.stderr)
        return 130
    except (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError, TimeoutError) as e:
        msg = " ".join(str(e).split()) or type(e).__name__
        print(f"zeal {command}: error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
