"""Small helpers for tests that talk to real services."""

from __future__ import annotations

import queue
import subprocess
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import grpc

from specdec.client import Completion, connect, generate
from specdec.launcher import Stack
from specdec.v1 import (
    common_pb2, draft_pb2, draft_pb2_grpc, generation_pb2, generation_pb2_grpc, verify_pb2, verify_pb2_grpc,
)  # fmt: skip

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


def rpc_error(stack: Stack, req: generation_pb2.GenerateRequest, **kwargs) -> grpc.RpcError:
    try:
        run(stack, req, **kwargs)
    except grpc.RpcError as err:
        return err
    raise AssertionError("the request succeeded")


def verify_info(stack: Stack, recent: int = 0) -> verify_pb2.VerifyInfo:
    """The verify service's Info; `recent`: its RecentRequests over that many (0: the default)."""
    with grpc.insecure_channel(stack.config.verify_address) as channel:
        info = verify_pb2.VerifyInfoRequest(recent_requests=recent)
        return verify_pb2_grpc.VerifyStub(channel).GetInfo(info, timeout=10)


def gateway_info(stack: Stack) -> generation_pb2.GatewayInfo:
    with grpc.insecure_channel(stack.config.gateway_address) as channel:
        return generation_pb2_grpc.GenerationStub(channel).GetInfo(generation_pb2.GatewayInfoRequest(), timeout=10)


def draft_info(stack: Stack) -> draft_pb2.DraftInfo:
    with grpc.insecure_channel(stack.config.draft_address) as channel:
        return draft_pb2_grpc.DraftStub(channel).GetInfo(draft_pb2.DraftInfoRequest(), timeout=10)


def open_sessions(stack: Stack) -> dict[str, int]:
    """Sessions each service holds now: gateway streams, verify sessions and queued
    requests, draft sessions."""
    gateway = gateway_info(stack)
    return {
        "gateway": gateway.active_streams,
        "verify": gateway.verify.active_sessions + gateway.verify.queued_requests,
        "draft": draft_info(stack).active_sessions,
    }


# A client window of about 1 KiB with no automatic growth: a stream whose client stops
# reading blocks its server within a few messages, as a stalled client does.
SMALL_WINDOW = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]


class HeldDecode:
    """A Decode stream straight to the verify service whose client reads one message and
    then stops reading: it holds a session slot until `drain` reads the rest, and the
    service cannot run more than the small window ahead of its reader.
    num_draft_tokens = 0: speculation off."""

    def __init__(
        self, stack: Stack, prompt_ids: list[int], max_new_tokens: int, timeout: float = 60.0, num_draft_tokens: int = 0
    ) -> None:
        self._channel = grpc.insecure_channel(stack.config.verify_address, options=SMALL_WINDOW)
        req = verify_pb2.DecodeRequest(
            prompt_ids=prompt_ids,
            max_new_tokens=max_new_tokens,
            sampling=common_pb2.SamplingParams(top_p=1.0),
            speculation=common_pb2.SPECULATION_MODE_ON if num_draft_tokens else common_pb2.SPECULATION_MODE_OFF,
            num_draft_tokens=num_draft_tokens,
        )
        self.call = verify_pb2_grpc.VerifyStub(self._channel).Decode(req, timeout=timeout)
        self.first = next(self.call)
        self.token_ids = list(self.first.token_ids)

    def drain(self) -> list[int]:
        """Reads the stream to its end (raising its error, if it ended in one)."""
        try:
            for chunk in self.call:
                self.token_ids.extend(chunk.token_ids)
        finally:
            self._channel.close()
        return self.token_ids

    def cancel(self) -> None:
        self.call.cancel()
        self._channel.close()


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
