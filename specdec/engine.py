"""The engine thread: the one thread of a model service that touches its model and caches.

gRPC handler threads submit steps and wait on futures. The thread takes every step queued
at that moment as one batch and hands the list to `execute`, which returns one result (or
exception) per step. Today `execute` runs the steps one after another; batching the
forwards of many sessions into one can replace that loop without changing any caller.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any, Generic, TypeVar

Step = TypeVar("Step")

_STOP = object()


class EngineStopped(RuntimeError):
    """The engine no longer accepts work (the service is shutting down)."""


class Engine(Generic[Step]):
    def __init__(self, execute: Callable[[list[Step]], list[object]], name: str) -> None:
        self._execute = execute
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._stopped = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, step: Step) -> Future:
        future: Future = Future()
        with self._lock:
            if self._stopped:
                raise EngineStopped("the engine is stopped")
            self._queue.put((step, future))
        return future

    def run(self, step: Step) -> object:
        """Submits one step and waits for its result (re-raising its exception)."""
        return self.submit(step).result()

    def stop(self) -> None:
        """Finishes the queued steps, then ends the thread."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            self._queue.put(_STOP)
        self._thread.join()

    def _loop(self) -> None:
        while True:
            batch = [self._queue.get()]
            while True:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            stop = any(item is _STOP for item in batch)
            work = [item for item in batch if item is not _STOP]
            if work:
                self._run_batch(work)
            if stop:
                return

    def _run_batch(self, work: list[tuple[Step, Future]]) -> None:
        try:
            results = self._execute([step for step, _ in work])
        except BaseException as exc:  # a bug in execute must not strand the waiters
            results = [exc] * len(work)
        for (_, future), result in zip(work, results):
            if isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)


def run_each(steps: list[Step], handlers: Mapping[type, Callable[[Any], object]]) -> list[object]:
    """Runs the steps one after another with the handler of each step's type; a step
    that raises gets its exception as its result, so one bad step fails only its caller."""
    results: list[object] = []
    for step in steps:
        try:
            results.append(handlers[type(step)](step))
        except Exception as exc:
            results.append(exc)
    return results
