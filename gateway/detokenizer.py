"""Incremental detokenization that never streams half a character.

Byte-level tokenizers may split one UTF-8 character over several tokens; decoding such a
prefix yields U+FFFD. Text is released only when the decoded window does not end in
U+FFFD; the window restarts at the last released boundary, so each step decodes a few
tokens rather than the whole completion.
"""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # window start: tokens before it are released and out of context
        self._released = 0  # tokens whose text has been released

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def add(self, ids: Sequence[int]) -> str:
        """Text completed by these tokens (may be empty while a character is incomplete)."""
        self._ids.extend(ids)
        released_text = self._decode(self._ids[self._prefix : self._released])
        window_text = self._decode(self._ids[self._prefix :])
        if window_text.endswith(REPLACEMENT) or len(window_text) < len(released_text):
            return ""
        self._prefix, self._released = self._released, len(self._ids)
        return window_text[len(released_text) :]

    def flush(self) -> str:
        """Whatever text is still held, at the end of the stream (U+FFFD for bytes that
        never formed a character)."""
        released_text = self._decode(self._ids[self._prefix : self._released])
        window_text = self._decode(self._ids[self._prefix :])
        self._prefix = self._released = len(self._ids)
        return window_text[len(released_text) :]
