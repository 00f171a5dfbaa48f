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


def check_num_draft_tokens(value: int) -> int:
    if not 1 <= value <= MAX_DRAFT_TOKENS:
        raise InvalidArgument(f"num_draft_tokens: must be in 1..{MAX_DRAFT_TOKENS}, got {value}")
    return value


def check_prompt_text(text: str, max_bytes: int, context: int) -> None:
    """Refuses a text prompt over max_bytes of UTF-8 before it is tokenized. A character
    takes at least one UTF-8 byte, so a count of characters over the bound is refused
    without encoding the text."""
    size, unit = len(text), "characters"
    if size <= max_bytes:
        size, unit = len(text.encode()), "bytes"
    if size > max_bytes:
        raise InvalidArgument(
            f"prompt: {size} {unit} of text, over the {max_bytes} bytes the gateway accepts "
            f"(the context holds {context} tokens)"
        )


def check_prompt_length(tokens: int, context: int) -> None:
    if tokens >= context:  # at least one position is left for the output
        raise InvalidArgument(f"prompt: {tokens} tokens, the context holds {context} (prompt and output together)")


def check_prompt_ids(ids: Sequence[int], vocab_size: int, context: int) -> list[int]:
    if not ids:
        raise InvalidArgument("prompt: must not be empty")
    check_prompt_length(len(ids), context)
    bad = next((i for i in ids if not 0 <= i < vocab_size), None)
    if bad is not None:
        raise InvalidArgument(f"prompt: token id {bad} is outside the vocabulary (0..{vocab_size - 1})")
    return list(ids)


def check_max_new_tokens(value: int, limit: int, prompt_tokens: int, context: int, defaulted: bool = False) -> int:
    """max_new_tokens against whichever binds first: the prompt plus the output must fit
    the context, and the output must be within the verify service's limit. `defaulted`:
    the client did not set it and the gateway's default was used, which the message says
    (the client may not know it sent a value at all)."""
    name = f"max_new_tokens (the gateway's default, {value})" if defaulted else "max_new_tokens"
    if value < 1:
        raise InvalidArgument(f"{name}: must be at least 1, got {value}")
    room = context - prompt_tokens
    if value > room and room <= limit:
        raise InvalidArgument(
            f"{name}: the prompt ({prompt_tokens} tokens) plus {value} new tokens exceed the context of {context} "
            f"tokens; at most {room} new tokens fit"
        )
    if value > limit:
        raise InvalidArgument(f"{name}: at most {limit} (the verify service's --max-new-tokens-limit), got {value}")
    return value
