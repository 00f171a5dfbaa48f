"""A small client of the public Generation API, used by the CLI, the demo and tests."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import grpc

from specdec.v1 import common_pb2, generation_pb2, generation_pb2_grpc

FINISH_NAMES = {
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_EOS: "eos",
}


@dataclass
class Completion:
    """Everything a stream delivered, with client-side timings."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    messages: list[generation_pb2.GenerateResponse] = field(default_factory=list)
    finish_reason: str = ""
    usage: common_pb2.Usage = field(default_factory=common_pb2.Usage)
    trace_id: str = ""  # the request's trace, from the first message
    first_token_s: float = 0.0  # from sending the request to the first token
    elapsed_s: float = 0.0  # from sending the request to the last message

    @property
    def tokens_per_s(self) -> float:
        return len(self.token_ids) / self.elapsed_s if self.elapsed_s else 0.0


def connect(address: str) -> tuple[grpc.Channel, generation_pb2_grpc.GenerationStub]:
    channel = grpc.insecure_channel(address)
    return channel, generation_pb2_grpc.GenerationStub(channel)


def generate(
    stub: generation_pb2_grpc.GenerationStub,
    request: generation_pb2.GenerateRequest,
    timeout: float | None = None,
    on_message: Callable[[generation_pb2.GenerateResponse], None] | None = None,
) -> Completion:
    """Streams one completion to its end; raises grpc.RpcError on a failed stream."""
    completion = Completion()
    start = time.perf_counter()
    stream: Iterator[generation_pb2.GenerateResponse] = stub.Generate(request, timeout=timeout)
    for message in stream:
        now = time.perf_counter() - start
        if message.token_ids and not completion.token_ids:
            completion.first_token_s = now
        if not completion.messages:
            completion.trace_id = message.trace_id
        completion.messages.append(message)
        completion.text += message.text
        completion.token_ids.extend(message.token_ids)
        if message.finish_reason:
            completion.finish_reason = FINISH_NAMES[message.finish_reason]
            completion.usage = message.usage
        completion.elapsed_s = now
        if on_message is not None:
            on_message(message)
    return completion
