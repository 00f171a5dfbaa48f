"""Admission control and idle expiry, through real processes: a bounded queue in front of
the session slots, RESOURCE_EXHAUSTED at once beyond it, a per-session KV budget, and
sessions freed when their caller or their verify service goes quiet."""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from transformers import AutoTokenizer

from specdec.v1 import common_pb2
from tests.helpers import HeldDecode, draft_info, request, rpc_error, run, verify_info, wait_for

PROMPT = "def speculative_decode(prompt, draft, target, k=4):"
N = 200
# The toy target's KV cache takes 1 KiB per position: 0.25 MiB is 256 positions.
KV_MIB = "0.25"
LIMITED = {
    "verify": ["--max-sessions", "2", "--max-queued", "1", "--session-kv-mib", KV_MIB, "--session-idle-s", "0"],
}
VERIFY_IDLE_S = 3.0
DRAFT_IDLE_S = 1.0
IDLE = {
    "verify": ["--session-idle-s", str(VERIFY_IDLE_S), "--draft-deadline-min-ms", "10000"],
    "draft": ["--session-idle-s", str(DRAFT_IDLE_S)],
}


@pytest.fixture(scope="module")
def limited(toy, stack_factory):
    return stack_factory(toy.target, toy.close, args=LIMITED)


@pytest.fixture(scope="module")
def idle(toy, stack_factory):
    return stack_factory(toy.target, toy.close, args=IDLE)


@pytest.fixture(scope="module")
def prompt_ids(toy) -> list[int]:
    return AutoTokenizer.from_pretrained(toy.target).encode(PROMPT)


def test_past_the_admission_limit_requests_are_refused_at_once(limited, prompt_ids):
    reference = run(limited, request(PROMPT, max_new_tokens=N, speculation=False))
    assert reference.finish_reason == "length"  # so a held stream has N tokens to hold on to

    held = [HeldDecode(limited, prompt_ids, N) for _ in range(2)]  # both slots taken
    assert verify_info(limited).active_sessions == 2
    with ThreadPoolExecutor(1) as pool:
        queued = pool.submit(run, limited, request(PROMPT, max_new_tokens=N, speculation=False))
        wait_for(lambda: verify_info(limited).queued_requests == 1, "the third request to wait in the queue")
        started = time.monotonic()
        refused = rpc_error(limited, request(PROMPT, max_new_tokens=N))
        assert time.monotonic() - started < 2.0
        assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-sessions 2 and --max-queued 1" in refused.details()
        assert not queued.done()
        for stream in held:  # the admitted streams lost nothing to the refusal
            assert stream.drain() == reference.token_ids
        assert queued.result().token_ids == reference.token_ids
    info = verify_info(limited)
    assert (info.active_sessions, info.queued_requests, info.max_sessions, info.max_queued) == (0, 0, 2, 1)


def test_a_queued_request_ends_at_its_deadline(limited, prompt_ids):
    held = [HeldDecode(limited, prompt_ids, N) for _ in range(2)]
    try:
        started = time.monotonic()
        err = rpc_error(limited, request(PROMPT, max_new_tokens=N), timeout=1.0)
        assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.monotonic() - started < 2.0
        wait_for(lambda: verify_info(limited).queued_requests == 0, "the queue to empty", timeout_s=1.0)
    finally:
        for stream in held:
            stream.cancel()
    wait_for(lambda: verify_info(limited).active_sessions == 0, "the held sessions to be freed", timeout_s=1.0)


def test_a_session_over_its_kv_budget_is_refused(limited):
    info = verify_info(limited)
    assert info.session_kv_budget_bytes == 2**18
    ok = run(limited, request(PROMPT, max_new_tokens=100))
    assert ok.finish_reason == "length"
    err = rpc_error(limited, request(PROMPT, max_new_tokens=300))  # the prompt plus 300 > 256 positions
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "--session-kv-mib" in err.details() and "0.25 MiB" in err.details()


def test_a_verify_session_whose_caller_stops_reading_expires(idle, prompt_ids):
    before = verify_info(idle).expired_sessions
    started = time.monotonic()
    held = HeldDecode(idle, prompt_ids, 400)
    wait_for(lambda: verify_info(idle).active_sessions == 0, "the idle session to expire", timeout_s=VERIFY_IDLE_S + 5)
    assert time.monotonic() - started >= VERIFY_IDLE_S  # not before its time
    assert verify_info(idle).expired_sessions == before + 1
    with pytest.raises(grpc.RpcError) as ended:
        held.drain()
    assert ended.value.code() == grpc.StatusCode.CANCELLED
    assert "expired: its caller took no message" in idle.log_path("verify").read_text()


def test_a_draft_session_left_idle_expires_and_the_request_continues_target_only(idle):
    """The verify service hangs (SIGSTOP) mid-request: the draft closes the idle session.
    Once the verify service resumes, the request finishes target-only, exact, and says why;
    the pairing stands, so the next request speculates."""
    reference = run(idle, request(PROMPT, max_new_tokens=N, speculation=False))
    before = draft_info(idle).expired_sessions

    def hang_verify() -> None:
        idle.signal("verify", signal.SIGSTOP)
        try:
            wait_for(lambda: draft_info(idle).active_sessions == 0, "the draft to expire the session", timeout_s=10)
        finally:
            idle.signal("verify", signal.SIGCONT)

    arrivals = 0

    def on_message(_message) -> None:
        nonlocal arrivals
        arrivals += 1
        if arrivals == 3:
            hang_verify()

    completion = run(idle, request(PROMPT, max_new_tokens=N, k=1), on_message=on_message)
    assert completion.token_ids == reference.token_ids
    assert draft_info(idle).expired_sessions == before + 1
    states = [m.speculation for m in completion.messages]
    lost_at = next(i for i, s in enumerate(states) if not s.speculating)
    assert lost_at >= 3
    assert all(s.reason == common_pb2.TARGET_ONLY_REASON_DRAFT_UNAVAILABLE for s in states[lost_at:])
    assert "expired" in states[lost_at].detail and "NOT_FOUND" in states[lost_at].detail
    after = run(idle, request(PROMPT, max_new_tokens=32))
    assert all(m.speculation.speculating for m in after.messages)
    assert idle.log_path("verify").read_text().count("paired with the draft") == 1  # no re-pairing needed


POOL_TOKENS = 300  # one request of N new tokens fits, two do not


@pytest.fixture(scope="module")
def pooled(toy, stack_factory):
    return stack_factory(toy.target, toy.close, with_draft=False, args={"verify": ["--kv-pool-tokens", str(POOL_TOKENS)]})


def test_admission_reserves_kv_pool_tokens_and_info_reports_them(pooled, prompt_ids):
    """A request reserves prompt + max_new_tokens + a proposal's look-ahead in the target's
    pool: one that does not fit now waits in the queue, one that could never fit is refused
    at once naming the flag, and Info shows the pool."""
    idle = verify_info(pooled).kv_pool
    assert (idle.capacity_tokens, idle.reserved_tokens, idle.used_tokens) == (POOL_TOKENS, 0, 0)
    assert idle.bytes == POOL_TOKENS * 2 * 2 * 64 * 4  # the toy target: 2 layers, keys and values, 64 wide, float32
    reference = run(pooled, request(PROMPT, max_new_tokens=N, speculation=False))
    lookahead = 16 + 1  # the longest proposal (AUTO's k_max) and its closing token
    held = HeldDecode(pooled, prompt_ids, N)
    pool = verify_info(pooled).kv_pool
    assert pool.reserved_tokens == POOL_TOKENS  # its slot: a context, or the whole pool when that is less
    assert len(prompt_ids) <= pool.used_tokens <= len(prompt_ids) + N
    with ThreadPoolExecutor(1) as executor:
        waiting = executor.submit(run, pooled, request(PROMPT, max_new_tokens=N, speculation=False))
        wait_for(lambda: verify_info(pooled).queued_requests == 1, "the second request to wait for the pool")
        too_big = POOL_TOKENS - len(prompt_ids) - lookahead + 1
        refused = rpc_error(pooled, request(PROMPT, max_new_tokens=too_big, speculation=False))
        assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--kv-pool-tokens" in refused.details()
        assert not waiting.done()
        assert held.drain() == reference.token_ids
        assert waiting.result().token_ids == reference.token_ids
    wait_for(lambda: verify_info(pooled).kv_pool.reserved_tokens == 0, "the reservations to be freed")
