"""Range-checked argument types for the CLI: a value out of range is a usage error (exit 2
with argparse's usage line), not a traceback from deep inside a request."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

UINT32_MAX = 2**32 - 1
INT32_MAX = 2**31 - 1
UINT64_MAX = 2**64 - 1
FLOAT32_MAX = 3.4028234663852886e38  # a larger value sent as a proto float becomes inf


def int_in(lo: int, hi: int) -> Callable[[str], int]:
    """An integer in lo..hi (both included)."""

    def convert(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"{value} is outside {lo}..{hi}")
        return value

    return convert


def float_in(lo: float, hi: float = FLOAT32_MAX, above: bool = False) -> Callable[[str], float]:
    """A finite number in [lo, hi], or in (lo, hi] when `above`."""
    interval = f"{'(' if above else '['}{lo:g}, {hi:g}]"

    def convert(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"not a finite number: {text!r}")
        if not (value > lo if above else value >= lo) or value > hi:
            raise argparse.ArgumentTypeError(f"{text} is outside {interval}")
        return value

    return convert


PORT = int_in(1, 65535)
# A deadline or timeout. gRPC takes one of about 1e10 s or more as already passed.
SECONDS = float_in(0.0, 1e6, above=True)
