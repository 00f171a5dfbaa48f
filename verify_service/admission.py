"""Admission control of the verify service: session slots, KV-pool tokens and a bounded queue.

A request takes a slot and reserves its tokens in the target's KV pool at once when both
are free; otherwise it waits in a FIFO queue of at most max_queued places, until both are,
its caller cancels, or its deadline passes. A request that finds the queue full, or needs
more tokens than the whole pool holds, is refused at once with RESOURCE_EXHAUSTED: nothing
waits without bound.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from specdec.errors import Cancelled, DeadlineExceeded, ResourceExhausted

Reservation = TypeVar("Reservation")


@dataclass(frozen=True)
class Limits:
    max_sessions: int  # requests decoded at once
    max_queued: int  # requests waiting for a slot


class Admission(Generic[Reservation]):
    def __init__(
        self, limits: Limits, reserve: Callable[[int], Reservation | None], pool_tokens: Callable[[], int | None]
    ) -> None:
        """reserve(tokens): the reservation, or None while the pool cannot hold it;
        pool_tokens(): what the whole pool holds (None: no pool, only slots count)."""
        self.limits = limits
        self._reserve = reserve
        self._pool_tokens = pool_tokens
        self.active = 0
        self._waiting: deque[object] = deque()  # tickets, first come first served
        self._cond = threading.Condition()

    @property
    def queued(self) -> int:
        return len(self._waiting)

    def acquire(self, tokens: int, timeout_s: float | None, cancelled: threading.Event) -> tuple[Reservation, float]:
        """Takes a slot and reserves `tokens`, waiting in the queue if needed; returns the
        reservation and the seconds waited. Raises ResourceExhausted (queue full, or more
        tokens than the pool holds), Cancelled or DeadlineExceeded."""
        start = time.monotonic()
        pool = self._pool_tokens()
        if pool is not None and tokens > pool:
            raise ResourceExhausted(
                f"the request reserves {tokens} tokens of KV cache (prompt, max_new_tokens and the look-ahead of a "
                f"proposal), more than the whole pool of {pool} (--kv-pool-tokens)"
            )
        with self._cond:
            if not self._waiting and (reservation := self._take(tokens)) is not None:
                return reservation, 0.0
            if len(self._waiting) >= self.limits.max_queued:
                raise ResourceExhausted(
                    f"{self.active} requests are being decoded and {len(self._waiting)} are queued; the limits are "
                    f"--max-sessions {self.limits.max_sessions} and --max-queued {self.limits.max_queued} (and the KV "
                    f"pool's tokens, --kv-pool-tokens)"
                )
            ticket = object()
            self._waiting.append(ticket)
            try:
                while self._waiting[0] is not ticket or (reservation := self._take(tokens)) is None:
                    if cancelled.is_set():
                        raise Cancelled("the caller cancelled while the request was queued")
                    left = None if timeout_s is None else start + timeout_s - time.monotonic()
                    if left is not None and left <= 0:
                        raise DeadlineExceeded(f"the deadline passed after {timeout_s:.3f} s in the queue")
                    self._cond.wait(left)
            finally:
                self._waiting.remove(ticket)
                self._cond.notify_all()  # the next in line may now be first
        return reservation, time.monotonic() - start

    def _take(self, tokens: int) -> Reservation | None:
        if self.active >= self.limits.max_sessions:
            return None
        reservation = self._reserve(tokens)
        if reservation is not None:
            self.active += 1
        return reservation

    def release(self) -> None:
        """A request left (its reservation already freed)."""
        with self._cond:
            self.active -= 1
            self._cond.notify_all()

    def wake(self) -> None:
        """Lets queued requests look at their cancel flags again."""
        with self._cond:
            self._cond.notify_all()
