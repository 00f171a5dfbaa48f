"""No request can hurt another: a request's parameters or failure affect that request
alone, and a seeded request repeats exactly in every mode, at every k, under any load.

One stack serves the module: the toy target, the close draft run by tests/faulty_draft.py
(a proposal for a session whose prompt starts with FAULT_PROMPT raises inside the draft),
and patient draft deadlines, since these tests assert when speculation runs.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from specdec.v1 import common_pb2, pairing_pb2
from specdec.client import connect, generate
from specdec.launcher import free_port
from tests import faulty_gateway
from tests.faulty_draft import FAULT_PROMPT, FAULT_TEXT
from tests.helpers import request, run, verify_info, wait_for

PROMPT = "def speculative_decode(prompt, draft, target, k=4):"
OTHER_PROMPTS = [f"{PROMPT}\n    # step {i}: the draft guesses" for i in range(8)]
N = 96  # above AUTO's short-output threshold (32), so AUTO speculates
# Words of a Python exception that must never reach a client.
PYTHON_WORDS = ("Traceback", "Error", "Exception", "exception", "nan", FAULT_TEXT)
SEEDED = {"temperature": 0.8, "top_k": 40, "top_p": 0.9, "seed": 7}


@pytest.fixture(scope="module")
def stack(toy, stack_factory):
    return stack_factory(
        toy.target,
        toy.close,
        args={"verify": ["--draft-deadline-min-ms", "10000"]},
        programs={"draft": [sys.executable, "tests/faulty_draft.py"]},
    )


def paired(stack) -> bool:
    return verify_info(stack).pairing.state == pairing_pb2.PAIRING_STATE_PAIRED


def details(completion) -> list[str]:
    return [m.speculation.detail for m in completion.messages]


def speculated_throughout(completion) -> bool:
    """Every message speculated, and every round but the last proposed draft tokens (the
    last may have room for one token only)."""
    messages = completion.messages
    return all(m.speculation.speculating for m in messages) and all(m.round.draft_tokens > 0 for m in messages[:-1])


def test_tiny_temperatures_decode_greedily_and_hurt_no_one(stack):
    greedy = run(stack, request(PROMPT, N, speculation=False)).token_ids
    for temperature in (1e-40, 1e-38, 1e-6):
        completion = run(stack, request(PROMPT, N, temperature=temperature))
        assert completion.token_ids == greedy, temperature
        assert speculated_throughout(completion), details(completion)
    after = run(stack, request(PROMPT, N))
    assert after.token_ids == greedy
    assert speculated_throughout(after), details(after)
    assert paired(stack)


def test_a_failing_draft_session_fails_only_its_own_proposal(stack):
    """A fault inside one draft session: that request goes on target-only (exact, saying
    why without the exception's text); 8 others running at the time speculate throughout,
    the pairing stays PAIRED, and the draft's log names the failed session."""
    references = [run(stack, request(p, N, speculation=False)).token_ids for p in OTHER_PROMPTS]
    fault_reference = run(stack, request(FAULT_PROMPT, N, speculation=False)).token_ids
    streaming = [threading.Event() for _ in OTHER_PROMPTS]

    def other(i: int):
        return run(stack, request(OTHER_PROMPTS[i], N), on_message=lambda _: streaming[i].set())

    with ThreadPoolExecutor(len(OTHER_PROMPTS)) as pool:
        others = [pool.submit(other, i) for i in range(len(OTHER_PROMPTS))]
        assert all(event.wait(60) for event in streaming)  # all 8 are mid-stream
        faulted = run(stack, request(FAULT_PROMPT, N))
        completions = [f.result() for f in others]

    assert faulted.token_ids == fault_reference
    assert all(m.speculation.reason == common_pb2.TARGET_ONLY_REASON_DRAFT_UNAVAILABLE for m in faulted.messages)
    assert "internal error" in faulted.messages[0].speculation.detail
    assert not any(word in detail for detail in details(faulted) for word in PYTHON_WORDS), details(faulted)
    for completion, reference in zip(completions, references):
        assert completion.token_ids == reference
        assert speculated_throughout(completion), details(completion)
    assert paired(stack)
    assert FAULT_TEXT in stack.log_tail("draft", lines=200)
    # The next request with a healthy session speculates at once.
    assert speculated_throughout(run(stack, request(PROMPT, N)))


def test_a_bug_in_the_gateway_answers_internal_without_its_text(stack, toy, tmp_path):
    """A second gateway, with a bug injected in its tokenizing, in front of the same verify
    service: the request gets INTERNAL with a short reason naming its trace; the log has
    the exception; the next request is served."""
    address = f"127.0.0.1:{free_port()}"
    command = [sys.executable, "tests/faulty_gateway.py", "--listen", address]
    command += ["--tokenizer", str(toy.target), "--verify", stack.config.verify_address]
    log = tmp_path / "gateway.log"
    with log.open("wb") as out:
        gateway = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:
        channel, stub = connect(address)
        with channel:
            grpc.channel_ready_future(channel).result(timeout=60)
            with pytest.raises(grpc.RpcError) as failed:
                generate(stub, request(faulty_gateway.FAULT_TEXT, 8), timeout=60)
            assert failed.value.code() == grpc.StatusCode.INTERNAL
            assert "internal error" in failed.value.details()
            assert not any(word in failed.value.details() for word in (*PYTHON_WORDS, faulty_gateway.FAULT_TEXT))
            assert len(generate(stub, request(PROMPT, 8), timeout=60).token_ids) == 8
        wait_for(lambda: faulty_gateway.FAULT_TEXT in log.read_text(), "the gateway to log the exception")
    finally:
        gateway.terminate()
        gateway.wait(30)


def seeded_requests() -> dict[str, object]:
    """The same seeded request in every mode: AUTO, ON at k = 1, 4 and 8, and OFF."""
    auto = request(PROMPT, N, **SEEDED)
    auto.speculation.mode = common_pb2.SPECULATION_MODE_AUTO
    requests = {"auto": auto, "off": request(PROMPT, N, speculation=False, **SEEDED)}
    requests |= {f"on k={k}": request(PROMPT, N, k=k, **SEEDED) for k in (1, 4, 8)}
    return requests


def test_a_seeded_request_repeats_in_every_mode_at_every_k_under_load(stack):
    requests = seeded_requests()
    alone = {name: [run(stack, req) for _ in range(2)] for name, req in requests.items()}
    expected = alone["off"][0].token_ids
    for name, completions in alone.items():
        assert [c.token_ids for c in completions] == [expected] * 2, name

    # The sampling is real and the speculation too: the draft's proposals were accepted
    # and rejected, AUTO speculated, and another seed or greedy decoding differ.
    usage = alone["on k=4"][0].usage
    assert usage.draft_tokens_accepted > 0 and usage.rejections > 0
    assert alone["auto"][0].usage.draft_tokens_proposed > 0
    assert expected != run(stack, request(PROMPT, N, speculation=False)).token_ids
    assert expected != run(stack, request(PROMPT, N, **{**SEEDED, "seed": 8})).token_ids

    # Again, with 8 other requests (unseeded sampling, ON and AUTO) streaming meanwhile.
    stop = threading.Event()

    def load(i: int) -> int:
        sent = 0
        while not stop.is_set() and sent < 50:
            req = request(OTHER_PROMPTS[i], 2 * N, temperature=1.0)
            if i % 2:
                req.speculation.mode = common_pb2.SPECULATION_MODE_AUTO
            run(stack, req)
            sent += 1
        return sent

    with ThreadPoolExecutor(len(OTHER_PROMPTS)) as pool:
        loaders = [pool.submit(load, i) for i in range(len(OTHER_PROMPTS))]
        try:
            loaded = {name: [run(stack, req) for _ in range(2)] for name, req in requests.items()}
        finally:
            stop.set()
        assert all(f.result() > 0 for f in loaders)
    for name, completions in loaded.items():
        assert [c.token_ids for c in completions] == [expected] * 2, name
