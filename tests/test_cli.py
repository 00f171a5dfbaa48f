"""The `specdec` command and each service's own entry point, run as users run them."""

from __future__ import annotations

import json
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest

from specdec.launcher import free_port

SPECDEC = [sys.executable, "-m", "specdec.cli"]


class Lines:
    """Reads a process's stdout on a thread so that tests can wait for a line with a timeout."""

    def __init__(self, process: subprocess.Popen) -> None:
        self._queue: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._pump, args=(process,), daemon=True).start()

    def _pump(self, process: subprocess.Popen) -> None:
        for line in process.stdout:
            self._queue.put(line)

    def wait_for(self, prefix: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no line starting with {prefix!r} in {timeout}s; saw {self.seen}") from None
            self.seen.append(line)
            if line.startswith(prefix):
                return line


@pytest.mark.parametrize("module", ["draft_service", "verify_service", "gateway"])
def test_each_service_has_help(module):
    result = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    assert "--listen" in result.stdout and "(env SPECDEC_" in result.stdout


def test_serve_generate_and_sigterm(toy, tmp_path):
    port = free_port()
    serve = subprocess.Popen(
        [*SPECDEC, "serve", "--target", str(toy.target), "--draft", str(toy.close), "--port", str(port), "--workdir", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines = Lines(serve)
    try:
        ready = lines.wait_for("specdec ready", timeout=180)
        assert f"127.0.0.1:{port}" in ready and "draft.sock" in ready

        result = subprocess.run(
            [*SPECDEC, "generate", "-", "--gateway", f"127.0.0.1:{port}", "--json", "--max-new-tokens", "24", "--num-draft-tokens", "3"],
            input="The quick brown fox",
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stderr
        *messages, summary = [json.loads(line) for line in result.stdout.splitlines()]
        assert summary["finish_reason"] == "length" and len(summary["token_ids"]) == 24
        assert summary["usage"]["rounds"] == len(messages)
        assert 0 <= summary["acceptance_rate"] <= 1
        assert [t for m in messages for t in m.get("token_ids", [])] == summary["token_ids"]
        assert messages[0]["speculation"]["speculating"] is True

        bad = subprocess.run(
            [*SPECDEC, "generate", "hi", "--gateway", f"127.0.0.1:{port}", "--top-p", "2"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert bad.returncode == 1 and "INVALID_ARGUMENT: top_p" in bad.stderr

        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=60) == 0
        stopped = lines.wait_for("specdec stopped", timeout=10)
        assert stopped.count("exit 0") == 3
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()


def test_demo_streams_both_ways_and_prints_the_figures(toy):
    result = subprocess.run(
        [*SPECDEC, "demo", "--target", str(toy.target), "--draft", str(toy.close), "--port", str(free_port()), "--max-new-tokens", "64"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    for mode in ("on", "auto", "off"):
        assert f"--- speculation {mode} ---" in out
        row = next(line for line in out.splitlines() if line.startswith(f"speculation {mode} "))
        tokens, seconds, tokens_per_s, acceptance, rounds, speedup = row.split()[2:]
        assert int(tokens) == 64 and float(tokens_per_s) > 0 and speedup.endswith("x")
        if mode == "on":
            assert 0 < float(acceptance) <= 1
    assert "on: k=4 every round; auto: k in" in out
    assert "outputs identical: yes" in out
