"""Admission control of the verify service: session slots and a bounded queue.

A request takes a free slot at once; when every slot is taken it waits in a FIFO queue
of at most max_queued places, until a slot frees, its caller cancels, or its deadline
passes. A request that finds the queue full is refused at once with RESOURCE_EXHAUSTED:
nothing waits without bound.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

from specdec.errors import Cancelled, DeadlineExceeded, ResourceExhausted


@dataclass(frozen=True)
class Limits:
    max_sessions: int  # requests decoded at once
    max_queued: int  # requests waiting for a slot


class Admission:
    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.active = 0
        self._waiting: deque[object] = deque()  # tickets, first come first served
        self._cond = threading.Condition()

    @property
    def queued(self) -> int:
        return len(self._waiting)

    def acquire(self, timeout_s: float | None, cancelled: threading.Event) -> float:
        """Takes a slot, waiting in the queue if needed; returns the seconds waited.
        Raises ResourceExhausted (queue full), Cancelled or DeadlineExceeded."""
        start = time.monotonic()
        with self._cond:
            if self.active < self.limits.max_sessions and not self._waiting:
                self.active += 1
                return 0.0
            if len(self._waiting) >= self.limits.max_queued:
                raise ResourceExhausted(
                    f"{self.active} requests are being decoded and {len(self._waiting)} are queued; "
                    f"the limits are --max-sessions {self.limits.max_sessions} and --max-queued {self.limits.max_queued}"
                )
            ticket = object()
            self._waiting.append(ticket)
            try:
                while not (self._waiting[0] is ticket and self.active < self.limits.max_sessions):
                    if cancelled.is_set():
                        raise Cancelled("the caller cancelled while the request was queued")
                    left = None if timeout_s is None else start + timeout_s - time.monotonic()
                    if left is not None and left <= 0:
                        raise DeadlineExceeded(f"the deadline passed after {timeout_s:.3f} s in the queue")
                    self._cond.wait(left)
                self.active += 1
            finally:
                self._waiting.remove(ticket)
                self._cond.notify_all()  # the next in line may now be first
        return time.monotonic() - start

    def release(self) -> None:
        with self._cond:
            self.active -= 1
            self._cond.notify_all()

    def wake(self) -> None:
        """Lets queued requests look at their cancel flags again."""
        with self._cond:
            self._cond.notify_all()
