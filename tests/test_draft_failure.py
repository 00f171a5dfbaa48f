"""A missing, killed or stalled draft: the request continues target-only from where the
draft was lost, says so and why in every later message, and loses or repeats nothing."""

from __future__ import annotations

import logging
import signal
import time

import pytest

from specdec.pairing import PairingPolicy
from specdec.v1 import common_pb2, pairing_pb2
from verify_service.draft_client import DraftClient, DraftDeadlines, DraftLost
from tests.helpers import request, run

PROMPT = "def speculative_decode(prompt, draft, target, k=4):"
N = 300
UNAVAILABLE = common_pb2.TARGET_ONLY_REASON_DRAFT_UNAVAILABLE
TIMED_OUT = common_pb2.TARGET_ONLY_REASON_DRAFT_TIMED_OUT


def stream_with_fault(stack, fault, after_messages: int = 3):
    """Streams a long speculative request and calls fault() after a few messages;
    returns the completion and the arrival time of each message."""
    arrivals: list[float] = []

    def on_message(_message) -> None:
        arrivals.append(time.monotonic())
        if len(arrivals) == after_messages:
            fault()

    return run(stack, request(PROMPT, max_new_tokens=N), on_message=on_message), arrivals


def test_killed_draft_mid_stream(toy, stack_factory):
    stack = stack_factory(toy.target, toy.close, args={"verify": ["--draft-deadline-min-ms", "10000"]})
    reference = run(stack, request(PROMPT, max_new_tokens=N, speculation=False))
    completion, _ = stream_with_fault(stack, lambda: stack.processes["draft"].kill())

    assert completion.token_ids == reference.token_ids
    assert completion.finish_reason == "length"
    states = [m.speculation for m in completion.messages]
    assert all(s.speculating for s in states[:3])
    lost_at = next(i for i, s in enumerate(states) if not s.speculating)
    assert all(s.reason == UNAVAILABLE and "draft" in s.detail for s in states[lost_at:])
    assert all(m.round.draft_tokens == 0 for m in completion.messages[lost_at:])

    # New requests go target-only at once, flagged, and stay exact.
    started = time.monotonic()
    after = run(stack, request(PROMPT, max_new_tokens=N))
    assert time.monotonic() - started < 10
    assert after.token_ids == reference.token_ids
    assert all(m.speculation.reason == UNAVAILABLE for m in after.messages)


def test_stalled_draft_mid_stream(toy, stack_factory):
    deadline_ms = 300
    stack = stack_factory(toy.target, toy.close, args={"verify": ["--draft-deadline-min-ms", str(deadline_ms)]})
    reference = run(stack, request(PROMPT, max_new_tokens=N, speculation=False))
    draft = stack.processes["draft"]
    try:
        completion, arrivals = stream_with_fault(stack, lambda: draft.send_signal(signal.SIGSTOP))
    finally:
        draft.send_signal(signal.SIGCONT)

    assert completion.token_ids == reference.token_ids
    states = [m.speculation for m in completion.messages]
    assert all(s.speculating for s in states[:3])
    lost_at = next(i for i, s in enumerate(states) if not s.speculating)
    assert all(s.reason == TIMED_OUT for s in states[lost_at:])
    # The stall costs one round deadline (plus scheduling slack), not a hang.
    longest_gap = max(b - a for a, b in zip(arrivals, arrivals[1:]))
    assert longest_gap < deadline_ms / 1e3 + 1.5


def test_no_draft_configured(toy, stack_factory):
    stack = stack_factory(toy.target, toy.close, with_draft=False)
    completion = run(stack, request(PROMPT, max_new_tokens=32))
    assert completion.finish_reason == "length" and len(completion.token_ids) == 32
    assert all(m.speculation.reason == UNAVAILABLE for m in completion.messages)
    assert "no draft" in completion.messages[0].speculation.detail


def test_draft_address_with_nobody_listening(toy, stack_factory, tmp_path):
    nowhere = f"unix://{tmp_path}/nobody.sock"
    args = {"verify": ["--draft", nowhere, "--draft-startup-wait-s", "1"]}
    stack = stack_factory(toy.target, toy.close, with_draft=False, args=args)
    started = time.monotonic()
    completion = run(stack, request(PROMPT, max_new_tokens=32))
    assert time.monotonic() - started < 10
    reference = run(stack, request(PROMPT, max_new_tokens=32, speculation=False))
    assert completion.token_ids == reference.token_ids
    states = [m.speculation for m in completion.messages]
    # Whether the request met the startup handshake's outcome (its wait ran out) or a
    # fresh handshake that found no socket, nothing answered: unavailable, not timed out.
    assert all(s.reason == UNAVAILABLE for s in states), {s.detail for s in states}


def test_a_startup_wait_that_runs_out_is_unavailable_and_answered_until_the_retry(tmp_path):
    """The waited-for handshake at startup runs out on DEADLINE_EXCEEDED; that means no
    draft answered, not that one missed a round's deadline, and requests that arrive
    within a second of it get the same answer without a new handshake."""
    deadlines = DraftDeadlines(factor=3.0, floor_s=0.1, open_s=1.0)
    client = DraftClient(f"unix://{tmp_path}/nobody.sock", deadlines, pairing_pb2.PeerFacts, PairingPolicy(), logging.getLogger("test"))
    with pytest.raises(DraftLost) as at_startup:
        client.attach(wait_s=0.3)
    assert at_startup.value.reason == UNAVAILABLE
    assert "nobody.sock" in str(at_startup.value) and "0.3 s" in str(at_startup.value)
    assert client.pairing.state == pairing_pb2.PAIRING_STATE_UNREACHABLE
    with pytest.raises(DraftLost) as next_request:
        client.attach()
    assert next_request.value is at_startup.value
