"""Processes that die, come back, or are told to stop, under a running workload: every
request either completes exactly or ends with a status that says what happened, and the
survivors recover without being restarted themselves."""

from __future__ import annotations

import signal
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from transformers import AutoTokenizer

from specdec.launcher import Stack
from specdec.v1 import common_pb2, pairing_pb2
from tests.helpers import HeldDecode, request, rpc_error, run, verify_info, wait_for

PROMPT = "def speculative_decode(prompt, draft, target, k=4):"
N = 240
ARGS = {
    # Patient draft deadlines: these tests assert when speculation runs. A short grace
    # period: the SIGTERM test needs a stream that cannot finish within it.
    "verify": ["--draft-deadline-min-ms", "10000", "--grace-s", "0.1"],
}
SERVING = health_pb2.HealthCheckResponse.SERVING


@pytest.fixture(scope="module")
def stack(toy, stack_factory):
    return stack_factory(toy.target, toy.close, args=ARGS)


@pytest.fixture(scope="module")
def reference(stack) -> list[int]:
    completion = run(stack, request(PROMPT, max_new_tokens=N, speculation=False))
    assert completion.finish_reason == "length"
    return completion.token_ids


def restart(stack: Stack, service: str) -> None:
    stack.start_service(service)
    stack.wait_healthy(service, time.monotonic() + 60)
    if service == "verify":  # later tests assert on speculating streams
        wait_for(lambda: verify_info(stack).pairing.state == pairing_pb2.PAIRING_STATE_PAIRED, "the verify service to pair again")


def gateway_health(stack: Stack) -> int:
    with grpc.insecure_channel(stack.config.gateway_address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status


def test_draft_killed_and_restarted_during_sequential_requests(stack, reference):
    """Requests keep coming while the draft dies and comes back: every one is exact; once
    the draft is back the verify service pairs again by itself and speculation resumes."""
    completions = [run(stack, request(PROMPT, max_new_tokens=N)) for _ in range(2)]
    stack.processes["draft"].kill()
    stack.processes["draft"].wait()
    completions += [run(stack, request(PROMPT, max_new_tokens=N)) for _ in range(3)]
    restart(stack, "draft")
    back = time.monotonic()
    after = []
    while not (after and all(m.speculation.speculating for m in after[-1].messages)):
        assert time.monotonic() - back < 15, "requests did not speculate again after the draft came back"
        after.append(run(stack, request(PROMPT, max_new_tokens=N)))
    after += [run(stack, request(PROMPT, max_new_tokens=N)) for _ in range(2)]

    assert all(c.token_ids == reference for c in completions + after)
    assert all(m.speculation.speculating for c in completions[:2] for m in c.messages)
    down = completions[2:]
    assert all(m.speculation.reason == common_pb2.TARGET_ONLY_REASON_DRAFT_UNAVAILABLE for c in down for m in c.messages)
    assert all(m.speculation.speculating for c in after[-3:] for m in c.messages)
    # The handshake (topology, tokenizer and memory guards) ran again with the new process.
    assert stack.log_path("verify").read_text().count("paired with the draft") == 2
    assert f"pid {stack.processes['draft'].pid})" in verify_info(stack).pairing.draft_host


def test_verify_killed_mid_stream_and_back_without_restarting_the_gateway(stack, reference):
    gateway_pid = stack.processes["gateway"].pid
    arrivals = 0

    def kill_verify_mid_stream(_message) -> None:
        nonlocal arrivals
        arrivals += 1
        if arrivals == 3:  # stall the draft so the stream cannot finish before the kill
            stack.signal("draft", signal.SIGSTOP)
            stack.processes["verify"].kill()

    try:
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as ended:
            run(stack, request(PROMPT, max_new_tokens=N), on_message=kill_verify_mid_stream)
        assert time.monotonic() - started < 5
    finally:
        stack.signal("draft", signal.SIGCONT)
    assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
    assert ended.value.details().startswith(f"verify service at {stack.config.verify_address}")
    stack.processes["verify"].wait()

    started = time.monotonic()
    refused = rpc_error(stack, request(PROMPT, max_new_tokens=8))
    assert refused.code() == grpc.StatusCode.UNAVAILABLE
    assert time.monotonic() - started < 2.0
    wait_for(lambda: gateway_health(stack) != SERVING, "the gateway to report NOT_SERVING")

    restart(stack, "verify")
    wait_for(lambda: gateway_health(stack) == SERVING, "the gateway to see the verify service again")
    assert run(stack, request(PROMPT, max_new_tokens=N)).token_ids == reference
    assert stack.processes["gateway"].pid == gateway_pid


def test_sigterm_to_the_gateway_lets_the_stream_finish_and_exits_zero(stack, reference):
    def stop_gateway(message) -> None:
        if not stop_gateway.sent:
            stack.signal("gateway", signal.SIGTERM)
            stop_gateway.sent = True

    stop_gateway.sent = False
    completion = run(stack, request(PROMPT, max_new_tokens=N), on_message=stop_gateway)
    assert completion.token_ids == reference and completion.finish_reason == "length"
    assert stack.processes["gateway"].wait(10) == 0
    assert rpc_error(stack, request(PROMPT, max_new_tokens=8)).code() == grpc.StatusCode.UNAVAILABLE
    restart(stack, "gateway")


def test_sigterm_to_the_verify_service_ends_a_stuck_stream_clearly_and_exits_zero(stack, reference, toy):
    """The stream cannot finish within the grace period (0.1 s): its draft is stalled with
    a 10 s round deadline, and its reader's small window keeps the service from running
    ahead before the stall. It ends with UNAVAILABLE that says why, after an exact prefix
    of the completion, and the service exits 0 well before the draft's deadline."""
    prompt_ids = AutoTokenizer.from_pretrained(toy.target).encode(PROMPT)
    held = HeldDecode(stack, prompt_ids, N, num_draft_tokens=1)
    assert held.first.speculation.speculating
    started = time.monotonic()
    stack.signal("draft", signal.SIGSTOP)
    stack.signal("verify", signal.SIGTERM)
    try:
        with pytest.raises(grpc.RpcError) as ended:
            held.drain()
        assert stack.processes["verify"].wait(10) == 0
    finally:
        stack.signal("draft", signal.SIGCONT)
    assert time.monotonic() - started < 5
    assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "shutting down" in ended.value.details()
    assert 0 < len(held.token_ids) < N and held.token_ids == reference[: len(held.token_ids)]
    restart(stack, "verify")
