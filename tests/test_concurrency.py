"""Many clients at once, clients that leave, clients with deadlines: through the three
real processes, every session is freed in every service, and nothing is lost."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from specdec.client import connect
from tests.helpers import gateway_info, open_sessions, request, rpc_error, run, verify_info, wait_for

# Patient draft deadlines (10 s): a slow draft call is cut by the request's deadline only.
PATIENT = {"verify": ["--draft-deadline-min-ms", "10000", "--draft-open-timeout-ms", "10000"]}
PROMPTS = [f"def handler_{i}(request, *args):  # {'xyz'[i % 3] * (i + 1)}" for i in range(16)]
ZERO = {"gateway": 0, "verify": 0, "draft": 0}
LONG_PROMPT = "The quick brown fox"  # the toy target's greedy output for it has no EOS for 480 tokens


@pytest.fixture(scope="module")
def stack(toy, stack_factory):
    return stack_factory(toy.target, toy.close, args=PATIENT)


def test_sixteen_concurrent_streams_equal_their_single_stream_output(stack):
    singles = [run(stack, request(p, max_new_tokens=64)).token_ids for p in PROMPTS]
    assert len(set(map(tuple, singles))) == len(PROMPTS)  # sixteen different outputs
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(lambda p: run(stack, request(p, max_new_tokens=64)), PROMPTS))
    assert [c.token_ids for c in together] == singles  # run() raises on any error
    assert all(m.speculation.speculating for c in together for m in c.messages)
    assert open_sessions(stack) == ZERO


def test_fifty_clients_that_cancel_leave_no_session_anywhere(stack):
    rng = random.Random(7)
    reads = [rng.randint(-1, 12) for _ in range(50)]  # messages read before cancelling; -1: none
    cancelled_at: list[float] = []

    def client(i: int) -> None:
        channel, stub = connect(stack.config.gateway_address)
        with channel:
            call = stub.Generate(request(PROMPTS[i % 16], max_new_tokens=400), timeout=60)
            if reads[i] >= 0:
                for n, _ in enumerate(call):
                    if n >= reads[i]:
                        break
            call.cancel()
            cancelled_at.append(time.monotonic())

    with ThreadPoolExecutor(25) as pool:
        list(pool.map(client, range(50)))
    last_cancel = max(cancelled_at)
    wait_for(lambda: open_sessions(stack) == ZERO, "every service to free its sessions", timeout_s=3)
    freed_s = time.monotonic() - last_cancel
    assert freed_s < 1.0, f"sessions were freed {freed_s:.2f} s after the last cancel"
    # The services are still whole: a request after the storm is served in full.
    assert len(run(stack, request(PROMPTS[0], max_new_tokens=32)).token_ids) == 32


# A client that takes one message, says so, and hangs until it is killed.
HANGING_CLIENT = """
import sys, time, grpc
from specdec.v1 import generation_pb2, generation_pb2_grpc
from tests.helpers import SMALL_WINDOW
channel = grpc.insecure_channel(sys.argv[1], options=SMALL_WINDOW)
request = generation_pb2.GenerateRequest(text=sys.argv[2], max_new_tokens=480)
request.speculation.num_draft_tokens = 1  # many short rounds: the stream is long
call = generation_pb2_grpc.GenerationStub(channel).Generate(request)
next(call)
print("reading no more", flush=True)
time.sleep(120)
"""


def test_a_client_process_killed_mid_stream_leaves_no_session_anywhere(stack):
    """The client dies while the verify service waits on a stalled draft (round deadline
    10 s): its sessions are freed within a second anyway, the wait on the draft included."""
    client = subprocess.Popen(
        [sys.executable, "-c", HANGING_CLIENT, stack.config.gateway_address, LONG_PROMPT], stdout=subprocess.PIPE, text=True
    )
    try:
        assert client.stdout.readline().strip() == "reading no more"
        stack.signal("draft", signal.SIGSTOP)  # no round can finish now: the stream stays in flight
        assert gateway_info(stack).active_streams == 1 and verify_info(stack).active_sessions == 1
        client.kill()
        client.wait()
        killed = time.monotonic()
        wait_for(
            lambda: gateway_info(stack).active_streams == 0 and verify_info(stack).active_sessions == 0,
            "the gateway and the verify service to free the session",
            timeout_s=3,
        )
        assert time.monotonic() - killed < 1.0
    finally:
        client.kill()
        stack.signal("draft", signal.SIGCONT)
    wait_for(lambda: open_sessions(stack) == ZERO, "the draft to close its session too", timeout_s=3)
    assert "paired with the draft" in stack.log_path("verify").read_text()
    assert all(m.speculation.speculating for m in run(stack, request(PROMPTS[3], max_new_tokens=16)).messages)


def test_a_client_deadline_reaches_the_verify_service_and_its_draft_calls(stack):
    """With the draft stalled, a request's only way out is its deadline (the draft calls'
    own deadlines are 10 s): the client gets DEADLINE_EXCEEDED on time, and the verify
    service stops waiting for the draft at that same deadline and frees the session."""
    stack.signal("draft", signal.SIGSTOP)
    try:
        started = time.monotonic()
        err = rpc_error(stack, request(PROMPTS[1], max_new_tokens=200), timeout=1.0)
        assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.monotonic() - started < 2.0
        # GetInfo asks the stalled draft to pair (1 s per call), hence the slack.
        wait_for(lambda: verify_info(stack).active_sessions == 0, "the verify service to free the session", timeout_s=4)
        assert time.monotonic() - started < 6.0  # well before the 10 s draft deadline
    finally:
        stack.signal("draft", signal.SIGCONT)
    wait_for(lambda: open_sessions(stack) == ZERO, "every service to free its sessions", timeout_s=10)


def test_the_load_script_reports_what_its_clients_measured(stack, tmp_path):
    out = tmp_path / "load.json"
    command = [
        sys.executable, "-m", "bench.load", "--gateway", stack.config.gateway_address,
        "--clients", "1", "3", "--seconds", "1.5", "--max-new-tokens", "16", "--speculation", "on", "off",
        "--json", str(out),
    ]  # fmt: skip
    finished = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert finished.returncode == 0, finished.stderr
    reports = json.loads(out.read_text())
    assert [(r["clients"], r["speculation"]) for r in reports] == [(1, "on"), (1, "off"), (3, "on"), (3, "off")]
    for r in reports:
        if r["speculation"] == "on":
            assert 0 <= r["draft_tokens_accepted"] <= r["draft_tokens_proposed"] <= 4 * r["rounds"]
            assert r["draft_tokens_proposed"] > 0
            assert r["acceptance_rate"] == pytest.approx(r["draft_tokens_accepted"] / r["draft_tokens_proposed"], abs=1e-3)
        else:
            assert r["draft_tokens_proposed"] == 0 and r["acceptance_rate"] == 0.0 and r["rounds"] == r["tokens"]
        assert r["requests"] >= r["clients"] and r["errors"] == {}
        assert r["requests"] <= r["tokens"] <= 16 * r["requests"]
        assert r["tokens_per_s"] == pytest.approx(r["tokens"] / r["wall_s"], rel=0.01)
        assert 0 < r["ttft_ms"]["p50"] <= r["ttft_ms"]["p99"] and 0 < r["itl_ms"]["p50"] <= r["itl_ms"]["p99"]
        assert f"clients {r['clients']:3d}  speculation {r['speculation']:4s}  requests/s" in finished.stdout
