"""The clock of idle-session expiry: calls a sweep a few times per idle period.

Both model services use it: the draft service closes sessions that no proposal has
touched for the idle period (their verify service died, or its close was lost), the
verify service frees sessions whose caller has stopped taking messages.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class IdleSweeper:
    """Runs `sweep` on a daemon thread every idle_s / 4 (at most every second) until
    stopped; idle_s = 0 turns expiry off."""

    def __init__(self, idle_s: float, sweep: Callable[[], None], name: str) -> None:
        self.idle_s = idle_s
        self._sweep = sweep
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        if idle_s > 0:
            self._thread.start()

    def _loop(self) -> None:
        period = min(1.0, self.idle_s / 4)
        while not self._stop.wait(period):
            self._sweep()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
