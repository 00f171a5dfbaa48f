"""Command-line flags from configuration dataclasses, each with an environment default.

A field `model_path` of a config parsed with prefix SPECDEC_DRAFT becomes the flag
`--model-path`, whose default is $SPECDEC_DRAFT_MODEL_PATH when set, else the field's
default. Help text comes from the field's metadata.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from collections.abc import Sequence
from typing import Any, TypeVar

T = TypeVar("T")


def option(default: Any, help: str) -> Any:
    """A config field with its help text."""
    return dataclasses.field(default=default, metadata={"help": help})


def _convert(kind: type, text: str) -> Any:
    if kind is bool:
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off", ""):
            return False
        raise ValueError(f"not a boolean: {text!r}")
    return kind(text)


def add_config_arguments(parser: argparse.ArgumentParser, cls: type, env_prefix: str) -> None:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        env = f"{env_prefix}_{f.name.upper()}"
        default = f.default
        if env in os.environ:
            try:
                default = _convert(kind, os.environ[env])
            except ValueError as exc:
                parser.error(f"${env}: {exc}")
        written = f.metadata.get("help", "").replace("%", "%%")  # argparse formats help with %
        help_text = f"{written} (env {env}; default: %(default)s)"
        flag = "--" + f.name.replace("_", "-")
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_text)
        else:
            parser.add_argument(flag, type=kind, default=default, help=help_text)


def config_from_args(cls: type[T], namespace: argparse.Namespace) -> T:
    return cls(**{f.name: getattr(namespace, f.name) for f in dataclasses.fields(cls)})


def parse_config(cls: type[T], argv: Sequence[str] | None, prog: str, description: str, env_prefix: str) -> T:
    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_config_arguments(parser, cls, env_prefix)
    return config_from_args(cls, parser.parse_args(argv))


def config_to_args(config: Any) -> list[str]:
    """The flags that reproduce a config (for starting a service as a subprocess)."""
    args: list[str] = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            args.append(flag if value else "--no-" + f.name.replace("_", "-"))
        else:
            args += [flag, str(value)]
    return args
