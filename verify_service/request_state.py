"""The state of one request being decoded: everything its rounds read and write, in one
object that the round loop owns and the request's handler thread streams from."""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace

from specdec.runtime import KVCache
from specdec.usage import UsageTally
from specdec.v1 import common_pb2, verify_pb2
from verify_service.auto_mode import AutoSession, Choice
from verify_service.draft_client import DraftSession
from verify_service.load_bands import LoadTally
from verify_service.plan import Plan

SPECULATING = common_pb2.Speculation(speculating=True)


def target_only(reason: common_pb2.TargetOnlyReason, detail: str) -> common_pb2.Speculation:
    return common_pb2.Speculation(speculating=False, reason=reason, detail=detail)


# What the handler thread reads from a request's outbox: a chunk to stream, the exception
# that ends the stream, or ENDED (the call ended under it).
ENDED = object()
# Chunks a request's rounds may run ahead of its stream: enough that the next round runs
# while the last one's tokens travel, few enough that a caller that stops reading holds
# its session (and is expired as idle) instead of being decoded to the end unseen.
MAX_AHEAD = 2
Outgoing = verify_pb2.DecodeChunk | Exception | object


@dataclass(frozen=True)
class Upcoming:
    """A round chosen (and its proposal asked for) before the step that runs it."""

    turn: Choice
    span: trace.Span
    traceparent: str  # of the span: the draft's span's parent
    start: float  # perf_counter when it was chosen


@dataclass
class Request:
    sid: str  # the session id on both model services
    plan: Plan
    context: grpc.ServicerContext
    ctx: otel_context.Context  # the decode span's: every round span is its child
    cache: KVCache  # the target's reservation, taken at admission
    speculation: common_pb2.Speculation  # the request's speculation state as streamed
    draft: DraftSession | None = None  # None: target-only from here on
    auto: AutoSession | None = None  # AUTO mode with a draft
    usage: UsageTally = field(init=False)
    load: LoadTally = field(default_factory=LoadTally)  # its rounds by the load they ran under
    outbox: queue.SimpleQueue[Outgoing] = field(default_factory=queue.SimpleQueue)
    index: int = 0  # of the next round
    turn: Choice | None = None  # what the round now running does
    previous: Choice | None = None  # what the round before did
    fell_back: bool = False  # an AUTO session counted once among those that went target-only
    upcoming: Upcoming | None = None  # the next round, chosen before this one's chunk left
    prefill_span: trace.Span | None = None
    round_span: trace.Span | None = None
    round_start: float = 0.0  # perf_counter at the start of the round now running
    traceparent: str = ""  # of the round span now open: the draft's span's parent
    first_round_start: float = 0.0
    ended: threading.Event = field(default_factory=threading.Event)  # the call ended: drop at the next step
    sending_since: float | None = None  # monotonic time the chunk now being sent was handed to gRPC
    expired: bool = False  # cancelled by the idle sweep

    def __post_init__(self) -> None:
        self.usage = UsageTally(prompt_tokens=len(self.plan.prompt_ids))

    @property
    def remaining(self) -> int:
        """Tokens the request may still emit."""
        return self.plan.max_new_tokens - self.usage.completion_tokens

    def end(self) -> None:
        """The call ended (any thread): the handler stops waiting, the loop drops the request."""
        self.ended.set()
        self.outbox.put(ENDED)

    def plan_round(self, turn: Choice, span: trace.Span, traceparent: str) -> None:
        self.upcoming = Upcoming(turn, span, traceparent, time.perf_counter())

    def start_planned_round(self) -> None:
        """The upcoming round becomes the one running."""
        up, self.upcoming = self.upcoming, None
        self.turn, self.round_span, self.traceparent, self.round_start = up.turn, up.span, up.traceparent, up.start
        if not self.index:
            self.first_round_start = self.round_start
