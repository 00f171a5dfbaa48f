"""Stop sequences over streamed text: cut at the first match, and hold back any tail
that could still become one so that no stop text is ever streamed."""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = [s for s in stops if s]
        self._held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to stream, whether a stop sequence ended the output)."""
        buffer = self._held + text
        found = [i for i in (buffer.find(s) for s in self._stops) if i >= 0]
        if found:
            self._held = ""
            return buffer[: min(found)], True
        hold = self._partial_tail(buffer)
        self._held = buffer[len(buffer) - hold :] if hold else ""
        return buffer[: len(buffer) - hold], False

    def flush(self) -> str:
        """The held tail, once the output has ended without a stop."""
        held, self._held = self._held, ""
        return held

    def _partial_tail(self, buffer: str) -> int:
        """Length of the longest suffix of buffer that is a proper prefix of a stop."""
        longest = 0
        for stop in self._stops:
            for size in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if stop.startswith(buffer[-size:]):
                    longest = size
                    break
        return longest
