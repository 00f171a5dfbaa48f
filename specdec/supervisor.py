"""Keeps a started Stack's services running for `specdec serve`: a service that exits is
started again after a backoff, and the others stay up. A restarted draft is paired again
by the verify service's own handshake, and the gateway finds a restarted verify service
by itself; streams the verify service was serving end with UNAVAILABLE, and streams that
lose their draft finish target-only."""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from specdec.launcher import Stack


@dataclass(frozen=True)
class Backoff:
    first_s: float = 0.5  # wait before restarting a service that exits
    cap_s: float = 30.0  # each exit soon after a restart doubles the wait, up to this
    stable_s: float = 60.0  # a service up this long exits as if for the first time


@dataclass
class _Restarts:
    """One service's restart state."""

    started: float  # monotonic time its process was started
    delay_s: float  # the wait before its next restart
    due: float | None = None  # monotonic time of the pending restart; None: running


def exit_description(code: int) -> str:
    """An exit status as Popen reports it, with the signal's name when one killed it."""
    if code < 0:
        try:
            return f"{code} ({signal.Signals(-code).name})"
        except ValueError:
            pass
    return str(code)


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class Supervisor:
    """Restarts the stack's services as they exit, until told to stop. Runs on one thread."""

    def __init__(self, stack: Stack, backoff: Backoff = Backoff(), log: Callable[[str], None] = _stderr) -> None:
        self._stack = stack
        self._backoff = backoff
        self._log = log
        now = time.monotonic()
        self._restarts = {service: _Restarts(now, backoff.first_s) for service in stack.processes}

    def run(self, stop: threading.Event, poll_s: float = 0.2) -> None:
        """Tends the services until `stop` is set; stopping them is the caller's."""
        while not stop.wait(poll_s):
            self.tend(time.monotonic())

    def tend(self, now: float) -> None:
        """Notes the services that exited since the last call and restarts those whose wait is over."""
        for service, state in self._restarts.items():
            if state.due is None:
                code = self._stack.processes[service].poll()
                if code is None:
                    continue
                if now - state.started >= self._backoff.stable_s:
                    state.delay_s = self._backoff.first_s
                state.due = now + state.delay_s
                how = exit_description(code)
                self._log(f"specdec serve: {service} exited with {how}; restarting it in {state.delay_s:g} s")
                state.delay_s = min(2 * state.delay_s, self._backoff.cap_s)
            elif now >= state.due:
                process = self._stack.start_service(service)
                state.started, state.due = now, None
                self._log(f"specdec serve: {service} restarted (pid {process.pid})")
