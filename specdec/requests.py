"""Validation of request fields, in one place for the gateway, verify and draft services.

Each check raises InvalidArgument with a message that names the public field.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from specdec.defaults import MAX_DRAFT_TOKENS
from specdec.errors import InvalidArgument
from specdec.v1 import common_pb2

if TYPE_CHECKING:  # specdec.sampling imports torch (seconds): the CLI client never needs it
    from specdec.sampling import SamplingParams

# The speculation modes by the names that flags, span attributes and metric labels use.
SPECULATION_MODES = {
    "auto": common_pb2.SPECULATION_MODE_AUTO,
    "on": common_pb2.SPECULATION_MODE_ON,
    "off": common_pb2.SPECULATION_MODE_OFF,
}
MODE_NAMES = {mode: name for name, mode in SPECULATION_MODES.items()}


def sampling_params(msg: common_pb2.SamplingParams) -> SamplingParams:
    if not (math.isfinite(msg.temperature) and msg.temperature >= 0):
        raise InvalidArgument(f"temperature: must be a finite number >= 0, got {msg.temperature}")
    if msg.top_k < 0:
        raise InvalidArgument(f"top_k: must be >= 0, got {msg.top_k}")
    if not 0 < msg.top_p <= 1:
        raise InvalidArgument(f"top_p: must be in (0, 1], got {msg.top_p}")
    from specdec.sampling import SamplingParams

    return SamplingParams(msg.temperature, msg.top_k, msg.top_p)


def check_max_new_tokens(value: int, limit: int) -> int:
    if not 1 <= value <= limit:
        raise InvalidArgument(f"max_new_tokens: must be in 1..{limit}, got {value}")
    return value


def check_num_draft_tokens(value: int) -> int:
    if not 1 <= value <= MAX_DRAFT_TOKENS:
        raise InvalidArgument(f"num_draft_tokens: must be in 1..{MAX_DRAFT_TOKENS}, got {value}")
    return value


def check_prompt_ids(ids: Sequence[int], vocab_size: int, max_positions: int, max_new_tokens: int) -> list[int]:
    if not ids:
        raise InvalidArgument("prompt: must not be empty")
    bad = next((i for i in ids if not 0 <= i < vocab_size), None)
    if bad is not None:
        raise InvalidArgument(f"prompt: token id {bad} is outside the vocabulary (0..{vocab_size - 1})")
    if len(ids) >= max_positions:
        raise InvalidArgument(
            f"prompt: {len(ids)} tokens do not fit the target's context of {max_positions} positions"
        )
    if len(ids) + max_new_tokens > max_positions:
        raise InvalidArgument(
            f"max_new_tokens: prompt ({len(ids)} tokens) plus max_new_tokens ({max_new_tokens}) "
            f"exceeds the target's context of {max_positions} positions"
        )
    return list(ids)
