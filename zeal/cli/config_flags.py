"""Command-line flags derived from a config section: one flag per leaf field of a pydantic
section, its type, choices, default and help taken from the field, so each default is
stated once, in ``zeal/config/``. ``zeal serve`` (:class:`~zeal.config.inference.InferenceConfig`),
``zeal rlhf`` (:class:`~zeal.config.rlhf.RLHFConfig`) and ``zeal train`` (the job's sections
and the engine's :class:`~zeal.config.schema.Config`) build their flags here.

A flag's name is ``--`` and the leaf's name with ``-`` for ``_``, unless ``names`` says
otherwise (``path -> (flag, scale of the value given on the command line)``); a switch
that is on by default is turned off by ``--no-<leaf>``. Every flag defaults to None: a
flag not given leaves the config's value (default or file) in place.
"""

from __future__ import annotations

import argparse
import types
import typing
from collections.abc import Iterator
from typing import Any

from pydantic import BaseModel

Names = dict[str, tuple[str, int]]
_UNITS = {1 << 20: "MB"}


def leaves(model: type[BaseModel], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``(dotted path, FieldInfo)`` of every leaf field, sections walked depth first."""
    for name, info in model.model_fields.items():
        ann = info.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            yield from leaves(ann, f"{prefix}{name}.")
        else:
            yield prefix + name, info


def scalar_type(ann: Any) -> Any:
    """``int | None`` -> int; a Literal stays as it is."""
    if typing.get_origin(ann) in (typing.Union, types.UnionType):
        ann = next(a for a in typing.get_args(ann) if a is not type(None))
    return ann


def flag_of(path: str, info: Any, names: Names | None = None) -> tuple[str, int]:
    """The flag of leaf ``path`` and the scale of its command-line value."""
    if names and path in names:
        return names[path]
    leaf = path.rsplit(".", 1)[-1].replace("_", "-")
    if scalar_type(info.annotation) is bool and info.default is True:
        return f"--no-{leaf}", 1
    return f"--{leaf}", 1


def add_flags(p: argparse.ArgumentParser, model: type[BaseModel], names: Names | None = None, *,
              dest_prefix: str = "", skip: typing.Container[str] = (), keep_existing: bool = False) -> None:
    """One flag per leaf of ``model`` (dest: ``dest_prefix`` + the dotted path), except the
    paths in ``skip``. ``keep_existing``: a flag the parser already has (a command's own,
    older spelling of the same setting) is left as it is."""
    for path, info in leaves(model):
        if path in skip:
            continue
        flag, scale = flag_of(path, info, names)
        if keep_existing and flag in p._option_string_actions:
            continue
        desc = (info.description or "").rstrip(".")
        ann = scalar_type(info.annotation)
        dest = dest_prefix + path
        if ann is bool:
            if info.default and not flag.startswith("--no-"):
                raise TypeError(f"{path}: a flag that turns off a default-on switch needs a --no- name")
            if desc[1:2].islower():  # "Reuse ..." reads "turn off: reuse ..."; "GRPO: ..." stays
                desc = desc[:1].lower() + desc[1:]
            p.add_argument(flag, dest=dest, action="store_const", const=not info.default, default=None,
                           help=f"turn {'off' if info.default else 'on'}: {desc}")
            continue
        leaf = path.rsplit(".", 1)[-1]
        kwargs: dict[str, Any] = {"dest": dest, "default": None, "help": desc,
                                  "metavar": _UNITS[scale] if scale != 1 else leaf.upper()}
        if info.default is not None and not info.is_required() and info.default_factory is None:
            kwargs["help"] += f" (default: {info.default if scale == 1 else info.default // scale})"
        if typing.get_origin(ann) is list:  # e.g. --lora-modules a=PATH b=PATH (items parsed by the config)
            kwargs["nargs"] = "+"
            kwargs["metavar"] = "ITEM"
        elif typing.get_origin(ann) is typing.Literal:
            kwargs["choices"] = sorted(typing.get_args(ann))
            del kwargs["metavar"]
        elif ann in (int, float):
            kwargs["type"] = ann
        p.add_argument(flag, **kwargs)


def tree_from_args(args: argparse.Namespace, model: type[BaseModel], names: Names | None = None, *,
                   dest_prefix: str = "") -> dict[str, Any]:
    """The nested dict of the flags given (scaled back), for ``model.model_validate`` over
    the section's defaults or merged over a config file's section."""
    tree: dict[str, Any] = {}
    for path, _ in leaves(model):
        value = getattr(args, dest_prefix + path, None)
        if value is None:
            continue
        scale = (names or {}).get(path, ("", 1))[1]
        node = tree
        *heads, leaf = path.split(".")
        for h in heads:
            node = node.setdefault(h, {})
        node[leaf] = value * scale if scale != 1 else value
    return tree


def argv_of(args: argparse.Namespace, model: type[BaseModel], names: Names | None = None, *,
            dest_prefix: str = "") -> list[str]:
    """The flags given, written out again (for the ranks a command launches)."""
    out: list[str] = []
    for path, info in leaves(model):
        value = getattr(args, dest_prefix + path, None)
        if value is None:
            continue
        flag, _ = flag_of(path, info, names)
        if scalar_type(info.annotation) is bool:
            out.append(flag)
        else:
            out += [flag, *map(str, value if isinstance(value, list) else [value])]
    return out


def add_dotted_flags(p: argparse.ArgumentParser | argparse._ArgumentGroup, model: type[BaseModel], section: str,
                     value_type: typing.Callable[[str], Any] = str, *, bare: bool = False) -> None:
    """``--<section>.<leaf>`` for every leaf of ``model`` (dest: the same dotted path), each
    taking one value parsed by ``value_type``, its help and default from the field. ``bare``:
    the flag is ``--<leaf>`` alone (a tree whose keys are known names of their own, as
    DeepSpeed's engine keys are), the dest still ``<section>.<leaf>``. A flag the parser
    already has is left as it is."""
    for path, info in leaves(model):
        flag = f"--{path}" if bare else f"--{section}.{path}"
        if flag in p._option_string_actions:
            continue
        desc = (info.description or "").rstrip(".")
        if info.default is not None and not info.is_required() and info.default_factory is None:
            desc += f" (default: {info.default})"
        p.add_argument(flag, dest=f"{section}.{path}", type=value_type, default=None, metavar="VALUE", help=desc)


def dotted_values(args: argparse.Namespace, model: type[BaseModel], section: str) -> list[tuple[list[str], Any]]:
    """``[(path, value)]`` of the ``--<section>.<leaf>`` flags given (see :func:`add_dotted_flags`)."""
    return [([section, *path.split(".")], value) for path, _ in leaves(model)
            if (value := getattr(args, f"{section}.{path}", None)) is not None]
