"""The engine: one step at a time on a model service's model and caches.

gRPC handler threads submit steps and wait on futures. The engine thread takes every step
queued at that moment as one batch and hands the list to `execute`, which returns one
result (or exception) per step. Today `execute` runs the steps one after another; batching
the forwards of many sessions into one can replace that loop without changing any caller.

With `inline`, a step that finds the engine idle (nothing queued, nothing running) runs
on its caller's thread instead: the hand-off to the engine thread and back costs about
0.3 ms here, which a stream pays on every draft proposal. Only for single-threaded torch:
OpenMP keeps a team of worker threads per calling thread, and a multi-threaded model
called from gRPC's rotating handler threads measured 20% slower per verification.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any, Generic, TypeVar

import torch

Step = TypeVar("Step")

_STOP = object()
_this_thread = threading.local()


def pin_torch_threads() -> None:
    """torch.set_num_threads reaches OpenMP and MKL only on the thread that calls it: a
    model run on another thread (the engine's, a gRPC handler's) multiplies its matrices
    on every core. Measured here: a 1-thread setting, 256x1024x4096 matmul, 29 ms on the
    main thread and 16 ms (two threads) on a new one."""
    if not getattr(_this_thread, "pinned", False):
        torch.set_num_threads(torch.get_num_threads())
        _this_thread.pinned = True


class EngineStopped(RuntimeError):
    """The engine no longer accepts work (the service is shutting down)."""


class Engine(Generic[Step]):
    def __init__(self, execute: Callable[[list[Step]], list[object]], name: str, inline: bool = False) -> None:
        self._execute = execute
        self._inline = inline
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._stopped = False
        self._lock = threading.Lock()
        self._busy = threading.Lock()  # held while steps run, on whichever thread
        self._pending = 0  # steps submitted and not yet run
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, step: Step) -> Future:
        future: Future = Future()
        with self._lock:
            if self._stopped:
                raise EngineStopped("the engine is stopped")
            self._pending += 1
            self._queue.put((step, future))
        return future

    @property
    def pending(self) -> int:
        """Steps queued for the engine thread and not run yet."""
        with self._lock:
            return self._pending

    def run(self, step: Step) -> object:
        """Runs one step and returns its result (re-raising its exception): after the steps
        queued before it, on this thread if `inline` and the engine is idle."""
        with self._lock:
            if self._stopped:
                raise EngineStopped("the engine is stopped")
            inline = self._inline and self._pending == 0 and self._busy.acquire(blocking=False)
        if not inline:
            return self.submit(step).result()
        try:
            (result,) = self._results([step])
        finally:
            self._busy.release()
        if isinstance(result, BaseException):
            raise result
        return result

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
        with self._busy:
            results = self._results([step for step, _ in work])
        with self._lock:
            self._pending -= len(work)
        for (_, future), result in zip(work, results):
            if isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)

    def _results(self, steps: list[Step]) -> list[object]:
        pin_torch_threads()
        try:
            return self._execute(steps)
        except BaseException as exc:  # a bug in execute must not strand the waiters
            return [exc] * len(steps)


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
