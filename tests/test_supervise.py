"""`specdec serve` supervises its services: one that dies is started again after a backoff
while the others stay up, and only a signal to serve stops them all. The tests after the
backoff's share one serve process, in order: a killed draft, a killed verify service,
then SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from specdec.client import Completion, connect, generate
from specdec.launcher import SERVICES, Stack, StackConfig, free_port
from specdec.supervisor import Backoff, Supervisor
from specdec.v1 import common_pb2, generation_pb2
from tests.conftest import NO_EXPORT
from tests.helpers import Lines, request, wait_for

PROMPT = "def speculative_decode(prompt, draft, target, k=4):"
N = 240
DRAFT_UNAVAILABLE = common_pb2.TARGET_ONLY_REASON_DRAFT_UNAVAILABLE


def test_backoff_doubles_to_its_cap_and_starts_over_after_a_stable_run(tmp_path):
    exits_at_once = {"draft": [sys.executable, "-c", "raise SystemExit(3)"]}
    stack = Stack(StackConfig(target="", draft="", workdir=tmp_path, programs=exits_at_once))
    stack.start_service("draft")
    log: list[str] = []
    supervisor = Supervisor(stack, Backoff(first_s=0.5, cap_s=2.0, stable_s=10.0), log.append)
    now, delays = time.monotonic(), []
    try:
        for _ in range(4):
            stack.processes["draft"].wait(30)
            supervisor.tend(now)
            prefix, _, delay = log[-1].removesuffix(" s").rpartition(" in ")
            assert prefix == "specdec serve: draft exited with 3; restarting it"
            delays.append(float(delay))
            logged = len(log)
            supervisor.tend(now + delays[-1] - 0.01)
            assert len(log) == logged  # not restarted before its wait is over
            now += delays[-1]
            supervisor.tend(now)
            pid = stack.processes["draft"].pid
            assert log[-1] == f"specdec serve: draft restarted (pid {pid})"
            assert int(stack.pid_path("draft").read_text()) == pid
        assert delays == [0.5, 1.0, 2.0, 2.0]
        # An exit after a run of stable_s waits first_s again.
        stack.processes["draft"].wait(30)
        supervisor.tend(now + 10.0)
        assert log[-1] == "specdec serve: draft exited with 3; restarting it in 0.5 s"
    finally:
        stack.stop()
    assert not stack.pid_path("draft").exists()


@dataclass
class Serve:
    process: subprocess.Popen
    lines: Lines  # serve's stdout and stderr
    workdir: Path
    gateway: str

    def pid(self, service: str) -> int:
        return int((self.workdir / f"{service}.pid").read_text())


@pytest.fixture(scope="module")
def serve(toy, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serve]:
    workdir = tmp_path_factory.mktemp("serve")
    port = free_port()
    # Patient draft deadlines: these tests assert when speculation runs.
    env = {**os.environ, **NO_EXPORT, "SPECDEC_VERIFY_DRAFT_DEADLINE_MIN_MS": "10000"}
    process = subprocess.Popen(
        [sys.executable, "-m", "specdec.cli", "serve", "--target", str(toy.target), "--draft", str(toy.close),
         "--port", str(port), "--workdir", str(workdir)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )  # fmt: skip
    lines = Lines(process)
    try:
        lines.wait_for("specdec ready", timeout=180)
        yield Serve(process, lines, workdir, f"127.0.0.1:{port}")
    finally:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def generate_at(serve: Serve, req: generation_pb2.GenerateRequest, **kwargs) -> Completion:
    channel, stub = connect(serve.gateway)
    with channel:
        return generate(stub, req, timeout=60, **kwargs)


@pytest.fixture(scope="module")
def reference(serve: Serve) -> list[int]:
    return generate_at(serve, request(PROMPT, max_new_tokens=N, speculation=False)).token_ids


def test_a_killed_draft_is_restarted_and_speculation_resumes(serve, reference):
    first = serve.pid("draft")
    arrivals, killed_at = 0, 0.0

    def kill_draft_mid_stream(_message) -> None:
        nonlocal arrivals, killed_at
        arrivals += 1
        if arrivals == 3:
            os.kill(first, signal.SIGKILL)
            killed_at = time.monotonic()

    completion = generate_at(serve, request(PROMPT, max_new_tokens=N), on_message=kill_draft_mid_stream)
    # The stream lost its draft midway and finished target-only, exactly.
    assert completion.token_ids == reference and completion.finish_reason == "length"
    assert completion.messages[0].speculation.speculating
    lost = [m for m in completion.messages[3:] if not m.speculation.speculating]
    assert lost and lost[0].speculation.reason == DRAFT_UNAVAILABLE

    exited = serve.lines.wait_for("specdec serve: draft exited", timeout=10)
    assert exited.strip() == "specdec serve: draft exited with -9 (SIGKILL); restarting it in 0.5 s"
    restarted = serve.lines.wait_for("specdec serve: draft restarted", timeout=10)
    assert restarted.strip() == f"specdec serve: draft restarted (pid {serve.pid('draft')})"
    assert serve.pid("draft") != first

    def speculating() -> Completion | None:
        done = generate_at(serve, request(PROMPT, max_new_tokens=32))
        assert done.token_ids == reference[:32]  # exact, speculating or not
        return done if any(m.round.draft_tokens > 0 for m in done.messages) else None

    # The verify service pairs with the new draft by itself, on a request's demand.
    wait_for(speculating, "a request to speculate again", timeout_s=30 - (time.monotonic() - killed_at))


def test_a_killed_verify_service_is_restarted_and_the_gateway_stays(serve, reference):
    before = {service: serve.pid(service) for service in SERVICES}
    arrivals = 0

    def kill_verify_mid_stream(_message) -> None:
        nonlocal arrivals
        arrivals += 1
        if arrivals == 3:  # stall the draft so the stream cannot finish first
            os.kill(before["draft"], signal.SIGSTOP)
            os.kill(before["verify"], signal.SIGKILL)

    try:
        with pytest.raises(grpc.RpcError) as ended:
            generate_at(serve, request(PROMPT, max_new_tokens=N), on_message=kill_verify_mid_stream)
    finally:
        os.kill(before["draft"], signal.SIGCONT)
    assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
    exited = serve.lines.wait_for("specdec serve: verify exited", timeout=10)
    assert exited.strip() == "specdec serve: verify exited with -9 (SIGKILL); restarting it in 0.5 s"

    def answered() -> Completion | None:
        try:
            return generate_at(serve, request(PROMPT, max_new_tokens=N))
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.UNAVAILABLE:  # the gateway's answer while its verify service is down
                raise
            return None

    assert wait_for(answered, "a request to succeed after the verify service's restart", 90).token_ids == reference
    assert serve.pid("verify") != before["verify"]
    # The others were not restarted.
    assert (serve.pid("gateway"), serve.pid("draft")) == (before["gateway"], before["draft"])
    assert serve.process.poll() is None


def test_sigterm_stops_serve_and_the_services_it_restarted(serve):
    pids = {service: serve.pid(service) for service in SERVICES}
    serve.process.send_signal(signal.SIGTERM)
    assert serve.process.wait(timeout=60) == 0
    stopped = serve.lines.wait_for("specdec stopped", timeout=10)
    assert stopped.count("exit 0") == 3
    assert not any(Path(f"/proc/{pid}").exists() for pid in pids.values())
    assert not any((serve.workdir / f"{service}.pid").exists() for service in SERVICES)
