"""The engine runs one step at a time; with `inline`, an idle engine runs a step on its
caller's thread, and a busy one queues it behind the steps before it."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from specdec.engine import Engine
from tests.helpers import wait_for


class Recorder:
    """Steps are names; running one records it and the thread it ran on. A step named
    "hold" blocks until `release` is set, to keep the engine busy."""

    def __init__(self) -> None:
        self.ran: list[tuple[str, str]] = []
        self.holding = threading.Event()
        self.release = threading.Event()

    def execute(self, steps: list[str]) -> list[object]:
        results: list[object] = []
        for step in steps:
            if step == "hold":
                self.holding.set()
                self.release.wait(10)
            self.ran.append((step, threading.current_thread().name))
            results.append(ValueError(step) if step == "bad" else step.upper())
        return results


@pytest.mark.parametrize("inline", [True, False])
def test_an_idle_engine_runs_on_the_callers_thread_only_when_inline(inline):
    recorder = Recorder()
    engine = Engine(recorder.execute, "test-engine", inline=inline)
    try:
        assert engine.run("a") == "A"
        with pytest.raises(ValueError, match="bad"):
            engine.run("bad")
    finally:
        engine.stop()
    expected = threading.current_thread().name if inline else "test-engine"
    assert recorder.ran == [("a", expected), ("bad", expected)]


def test_a_busy_inline_engine_queues_steps_in_order_on_its_thread():
    recorder = Recorder()
    engine = Engine(recorder.execute, "test-engine", inline=True)
    try:
        with ThreadPoolExecutor(3) as pool:
            held = pool.submit(engine.run, "hold")  # runs inline on a pool thread and blocks there
            assert recorder.holding.wait(10)
            first = engine.submit("first")
            second = pool.submit(engine.run, "second")  # the engine is busy: queued, not run inline
            wait_for(lambda: engine.pending == 2, "the second step to be queued", timeout_s=10)
            recorder.release.set()
            assert (held.result(10), first.result(10), second.result(10)) == ("HOLD", "FIRST", "SECOND")
    finally:
        engine.stop()
    assert [step for step, _ in recorder.ran] == ["hold", "first", "second"]
    assert [thread for step, thread in recorder.ran if step != "hold"] == ["test-engine", "test-engine"]
