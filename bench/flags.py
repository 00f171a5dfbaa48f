"""The benchmarks' command lines: a config dataclass from parsed flags."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def config_from_args(cls: type[T], args: argparse.Namespace, quick: dict[str, Any], tuples: tuple[str, ...]) -> T:
    """`cls` from the flags given (lists in `tuples` become tuples, --out a Path), over the
    --quick preset when --quick is set, over the config's defaults otherwise."""
    fields = {k: v for k, v in vars(args).items() if k != "quick" and v is not None}
    for name in tuples:
        if name in fields:
            fields[name] = tuple(fields[name])
    if "out" in fields:
        fields["out"] = Path(fields["out"])
    return cls(**{**(quick if args.quick else {}), **fields})
