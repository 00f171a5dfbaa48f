"""Every field of the public request, fuzzed against the real gateway: each request gets a
status code that names what was wrong (or a completion), the services stay up, and their
memory stays bounded. Generated with hypothesis, derandomized so CI sees the same cases."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdec.client import connect, generate
from specdec.v1 import common_pb2, generation_pb2
from tests.helpers import request, rpc_error, run

EXAMPLES = settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
GENERATE = "/specdec.v1.Generation/Generate"
INT32 = st.integers(-(2**31), 2**31 - 1)
# Every code point the wire can carry in a string field (lone surrogates are not UTF-8;
# they are sent as raw bytes below), control characters included.
TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=300)
FLOATS = st.floats(allow_nan=True, allow_infinity=True, width=32)


@st.composite
def generate_requests(draw: st.DrawFn) -> generation_pb2.GenerateRequest:
    req = generation_pb2.GenerateRequest()
    prompt = draw(st.sampled_from(["text", "ids", "none"]))
    if prompt == "text":
        req.text = draw(TEXT)
    elif prompt == "ids":
        req.token_ids.ids.extend(draw(st.lists(st.one_of(st.integers(0, 399), INT32), max_size=600)))
    # Outputs that fit are short (the suite's time); the rest of int32 is fuzzed as bad input.
    for name, values in {
        "max_new_tokens": st.one_of(st.integers(-5, 16), INT32),
        "temperature": FLOATS,
        "top_k": INT32,
        "top_p": FLOATS,
        "seed": st.integers(0, 2**64 - 1),
    }.items():
        if draw(st.booleans()):
            setattr(req, name, draw(values))
    req.stop.extend(draw(st.lists(TEXT, max_size=40)))
    if draw(st.booleans()):
        req.speculation.mode = draw(st.one_of(st.sampled_from(list(common_pb2.SpeculationMode.values())), INT32))
    if draw(st.booleans()):
        req.speculation.num_draft_tokens = draw(INT32)
    return req


@pytest.fixture(scope="module")
def stack(shared_stack):
    return shared_stack


@pytest.fixture(scope="module")
def channel(stack):
    channel, _ = connect(stack.config.gateway_address)
    with channel:
        yield channel


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_fuzzed_requests_each_get_a_status_and_the_services_stay_up(stack, channel):
    _, stub = connect(stack.config.gateway_address)
    before = {s: rss_mib(p.pid) for s, p in stack.processes.items()}
    seen: dict[str, int] = {}

    @EXAMPLES
    @given(generate_requests())
    def fuzz(req: generation_pb2.GenerateRequest) -> None:
        try:
            completion = generate(stub, req, timeout=30)
            code = "OK"
            assert completion.finish_reason in ("length", "stop", "eos")
        except grpc.RpcError as err:
            code = err.code().name
            assert err.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED), err.details()
            assert err.details(), "a refusal must say why"
        seen[code] = seen.get(code, 0) + 1

    fuzz()
    assert seen.get("OK") and seen.get("INVALID_ARGUMENT"), seen  # both sides of the validation were reached
    _still_serving(stack)
    after = {s: rss_mib(p.pid) for s, p in stack.processes.items()}
    growth = {s: after[s] - before[s] for s in after}
    assert all(g < 64 for g in growth.values()), growth


@EXAMPLES
@given(st.binary(max_size=2000))
def test_raw_bytes_that_are_no_request_get_a_status(stack, channel, raw: bytes):
    call = channel.unary_stream(GENERATE, response_deserializer=generation_pb2.GenerateResponse.FromString)
    try:
        for _ in call(raw, timeout=30):
            pass
    except grpc.RpcError as err:
        # gRPC itself answers a message that does not parse; one that parses is validated.
        allowed = (grpc.StatusCode.INTERNAL, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED)
        assert err.code() in allowed, (err.code(), err.details())


def test_lone_surrogates_on_the_wire_are_refused_and_nothing_breaks(stack, channel):
    call = channel.unary_stream(GENERATE, response_deserializer=generation_pb2.GenerateResponse.FromString)
    surrogate = "a".encode() + b"\xed\xa0\x80" + "b".encode()  # U+D800 as WTF-8: not UTF-8
    raw = b"\x0a" + bytes([len(surrogate)]) + surrogate  # field 1 (text), length-delimited
    with pytest.raises(grpc.RpcError) as refused:
        list(call(raw, timeout=30))
    assert refused.value.code() == grpc.StatusCode.INTERNAL  # gRPC's answer to an unparsable message
    _still_serving(stack)


def test_a_message_over_the_size_limit_is_refused_by_grpc(stack):
    err = rpc_error(stack, request("x" * (5 * 2**20), max_new_tokens=4))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    huge_stop_list = request("def f():", max_new_tokens=4)
    huge_stop_list.stop.extend(["stop"] * 100_000)
    err = rpc_error(stack, huge_stop_list)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "stop: at most 16" in err.details()
    _still_serving(stack)


def _still_serving(stack) -> None:
    assert all(p.poll() is None for p in stack.processes.values())
    assert len(run(stack, request("def f():", max_new_tokens=8)).token_ids) == 8
