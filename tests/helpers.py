"""Small helpers for tests that talk to real services."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import grpc

from specdec.client import Completion, connect, generate
from specdec.launcher import Stack
from specdec.v1 import common_pb2, generation_pb2, verify_pb2, verify_pb2_grpc

T = TypeVar("T")


def request(
    prompt: str | list[int],
    max_new_tokens: int = 48,
    speculation: bool = True,
    k: int | None = None,
    **fields: object,
) -> generation_pb2.GenerateRequest:
    req = generation_pb2.GenerateRequest(max_new_tokens=max_new_tokens, **fields)
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.token_ids.ids.extend(prompt)
    req.speculation.mode = common_pb2.SPECULATION_MODE_ON if speculation else common_pb2.SPECULATION_MODE_OFF
    if k is not None:
        req.speculation.num_draft_tokens = k
    return req


def run(stack: Stack, req: generation_pb2.GenerateRequest, timeout: float = 60.0, **kwargs) -> Completion:
    channel, stub = connect(stack.config.gateway_address)
    with channel:
        return generate(stub, req, timeout=timeout, **kwargs)


def rpc_error(stack: Stack, req: generation_pb2.GenerateRequest) -> grpc.RpcError:
    try:
        run(stack, req)
    except grpc.RpcError as err:
        return err
    raise AssertionError("the request succeeded")


def verify_info(stack: Stack) -> verify_pb2.VerifyInfo:
    with grpc.insecure_channel(stack.config.verify_address) as channel:
        return verify_pb2_grpc.VerifyStub(channel).GetInfo(verify_pb2.VerifyInfoRequest(), timeout=10)


def wait_for(condition: Callable[[], T | None], what: str, timeout_s: float = 30.0) -> T:
    """Polls until condition() returns something truthy, for what arrives on another
    process's schedule (exports, container start-up); fails naming `what` at the deadline."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
