"""The prompt limits the gateway checks before it tokenizes or calls Decode.

The gateway knows only its tokenizer; the target's context and the largest max_new_tokens
belong to the verify service, which reports them in GetInfo. They are asked for once, on
the first Generate, and kept: the gateway serves one tokenizer and so one target, whose
context does not change. Asking at startup instead would tie the gateway's start to the
verify service's; a request that finds it unreachable gets UNAVAILABLE, and the next one
asks again.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import grpc
from transformers import PreTrainedTokenizerBase

from specdec.errors import Unavailable
from specdec.v1 import verify_pb2, verify_pb2_grpc

INFO_TIMEOUT_S = 5.0  # GetInfo answers from counters: a verify service this slow is as good as down


@dataclass(frozen=True)
class PromptLimits:
    context: int  # the target's positions: prompt plus output
    max_new_tokens: int  # the verify service's --max-new-tokens-limit
    max_text_bytes: int  # longest text prompt worth tokenizing, in UTF-8 bytes


def longest_token_bytes(tokenizer: PreTrainedTokenizerBase) -> int:
    """UTF-8 bytes of the longest token string in the vocabulary, added tokens included.

    A token string is never shorter than the text it stands for in the tokenizers the
    targets use: byte-level BPE spells each byte of the text as one character of one or
    two UTF-8 bytes, and SentencePiece vocabularies spell a space as the 3-byte '▁' and an
    unknown byte as '<0xNN>'. A tokenizer that drops text (whitespace splitting, one
    unknown token for a whole word) could pack more into a token: give it
    --max-prompt-bytes."""
    return max(len(token.encode()) for token in tokenizer.get_vocab())


class VerifyLimits:
    """The PromptLimits of the verify service behind the gateway, learned once (see the
    module's docstring); safe to call from every handler thread."""

    def __init__(
        self,
        verify: verify_pb2_grpc.VerifyStub,
        address: str,
        longest_token: int,
        max_text_bytes: int,
        log: logging.Logger,
    ) -> None:
        self._verify = verify
        self._address = address
        self._longest_token = longest_token
        self._max_text_bytes = max_text_bytes  # 0: derived from the context
        self._log = log
        self._lock = threading.Lock()  # concurrent first requests ask once
        self._limits: PromptLimits | None = None

    def get(self, timeout: float | None) -> PromptLimits:
        """The limits; raises Unavailable naming the verify service if it cannot be asked.
        timeout: the caller's remaining deadline, if any."""
        with self._lock:
            if self._limits is None:
                self._limits = self._ask(INFO_TIMEOUT_S if timeout is None else min(timeout, INFO_TIMEOUT_S))
            return self._limits

    def _ask(self, timeout: float) -> PromptLimits:
        try:
            info = self._verify.GetInfo(verify_pb2.VerifyInfoRequest(), timeout=timeout)
        except grpc.RpcError as err:
            raise Unavailable(
                f"verify service at {self._address}: could not learn its context: {err.code().name}: {err.details()}"
            ) from err
        # A prompt of N tokens covers at most N * longest_token bytes of text (see
        # longest_token_bytes), so text over context * longest_token bytes cannot fit and
        # nothing that could fit is refused.
        limits = PromptLimits(
            context=info.max_positions,
            max_new_tokens=info.max_new_tokens_limit,
            max_text_bytes=self._max_text_bytes or info.max_positions * self._longest_token,
        )
        self._log.info(
            "the verify service's context holds %d tokens (max_new_tokens up to %d): text prompts over %d bytes "
            "are refused before tokenizing",
            limits.context,
            limits.max_new_tokens,
            limits.max_text_bytes,
        )
        return limits
