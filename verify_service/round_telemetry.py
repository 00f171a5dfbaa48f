"""Where the round loop reports: a span per round of every request (its draft proposal
and its share of the target's forward beneath it), the prefill's span, and the metrics of
rounds and forwards. Kept beside the round loop, not woven through it."""

from __future__ import annotations

import time
from dataclasses import dataclass

from opentelemetry import trace

from specdec import span_attributes as attrs
from specdec.metrics import ForwardMetrics, ModeMetrics, SpeculationMetrics
from specdec.telemetry import traceparent
from specdec.v1 import common_pb2, verify_pb2
from verify_service.auto_mode import Choice, ServiceAuto
from verify_service.request_state import Request

AUTO = common_pb2.SPECULATION_MODE_AUTO


@dataclass(frozen=True)
class Instruments:
    """Where the decoder reports: its spans and its metrics."""

    tracer: trace.Tracer
    metrics: SpeculationMetrics
    modes: ModeMetrics
    forwards: ForwardMetrics
    model_name: str  # gen_ai.request.model


class RoundTelemetry:
    def __init__(self, instruments: Instruments, auto: ServiceAuto) -> None:
        self._tracer = instruments.tracer
        self._metrics = instruments.metrics
        self._modes = instruments.modes
        self._forwards = instruments.forwards
        self._auto = auto

    def start_prefill(self, request: Request) -> None:
        attributes = {"gen_ai.usage.input_tokens": len(request.plan.prompt_ids)}
        request.prefill_span = self._tracer.start_span(attrs.TARGET_PREFILL, context=request.ctx, attributes=attributes)

    def end_prefill(self, request: Request) -> None:
        if request.prefill_span is not None:
            request.prefill_span.end()
            request.prefill_span = None

    def start_round(self, request: Request, speculating: bool) -> tuple[trace.Span, str]:
        """Opens a round's span; returns it and, for a round that asks the draft, its
        traceparent (the draft's span's parent; '' otherwise: formatting it costs a
        target-only round of one token a measurable share)."""
        span = self._tracer.start_span(attrs.ROUND, context=request.ctx)
        return span, traceparent(trace.set_span_in_context(span)) if speculating else ""

    def forward(self, sessions: int, positions: int) -> None:
        self._forwards.record(sessions, positions)

    def verified(self, request: Request, start_ns: int, end_ns: int, positions: int, compute_us: int) -> None:
        """The request's part of a shared target forward, under its round's span."""
        ctx = trace.set_span_in_context(request.round_span)
        span = self._tracer.start_span(attrs.TARGET_VERIFY, context=ctx, start_time=start_ns)
        span.set_attributes({"specdec.positions": positions, "specdec.compute_us": compute_us})
        span.end(end_time=end_ns)

    def end_round(self, request: Request, chunk: verify_pb2.DecodeChunk) -> None:
        """The round's attributes and metrics; its span ends."""
        stats, turn = chunk.round, request.turn
        span = request.round_span
        span.set_attributes(attrs.round_stats(stats, len(chunk.token_ids), request.usage.acceptance_rate))
        if not chunk.speculation.speculating:
            span.set_attributes(attrs.speculation(chunk.speculation))
        choice = {"k": stats.draft_tokens}
        if request.plan.mode == AUTO:
            span.set_attributes(attrs.auto_choice(stats, self.auto_reason(turn, request.previous)))
            choice["choice"] = attrs.auto_choice_name(stats.auto_choice)
        self._modes.rounds.add(1, choice)
        if stats.auto_choice == common_pb2.AUTO_CHOICE_LOW_GAIN and not request.fell_back and request.auto is not None:
            request.fell_back = True
            self._modes.auto_fallbacks.add(1)
        span.end()
        request.round_span = None
        now = time.perf_counter()
        self._metrics.round_duration.record(now - request.round_start)
        self._metrics.speculated(stats.draft_tokens, stats.accepted_tokens)
        self._metrics.generated.add(len(chunk.token_ids))
        if stats.draft_tokens:
            self._metrics.accepted_per_round.record(stats.accepted_tokens)
        if chunk.finish_reason and now > request.first_round_start:
            self._metrics.tokens_per_second.record(request.usage.completion_tokens / (now - request.first_round_start))

    def fail(self, request: Request, err: BaseException) -> None:
        """The request ends mid-round (the decode span says which status it got)."""
        for span in (request.round_span, request.prefill_span, request.upcoming and request.upcoming.span):
            if span is not None:
                span.record_exception(err)
                span.set_status(trace.Status(trace.StatusCode.ERROR, repr(err)))
        self.close(request)

    @staticmethod
    def close(request: Request) -> None:
        """Ends the spans a request that ends between rounds left open."""
        for span in (request.round_span, request.prefill_span, request.upcoming and request.upcoming.span):
            if span is not None:
                span.end()
        request.round_span = request.prefill_span = request.upcoming = None

    def auto_reason(self, turn: Choice, previous: Choice | None) -> str:
        """Why an AUTO round does what it does, when that changed since the round before."""
        if previous is not None and previous.how == turn.how:
            return ""
        policy = self._auto.policy
        if turn.how == common_pb2.AUTO_CHOICE_SHORT_OUTPUT:
            return "too short for speculation to pay its draft's opening: target-only, no draft"
        if turn.how == common_pb2.AUTO_CHOICE_NOT_OPENED:
            return "no k gained at the α̂ and load it arrived at (another request measures α̂): target-only, no draft"
        if turn.how == common_pb2.AUTO_CHOICE_BEST_K:
            return f"speculating: k={turn.k} has the best expected gain, {turn.gain:.2f}x at α̂ {turn.alpha:.2f}"
        if turn.how == common_pb2.AUTO_CHOICE_LOW_GAIN:
            return (
                f"target-only: the best expected gain is {turn.gain:.2f}x (below {policy.pause_below:g}) "
                f"at α̂ {turn.alpha:.2f}; a probe follows"
            )
        if turn.how == common_pb2.AUTO_CHOICE_LOAD:
            return (
                f"held at k=0 by the batch: its draft tokens would lower the step's committed tokens/s "
                f"(α̂ {turn.alpha:.2f} kept; it speculates again when the batch allows)"
            )
        if turn.how == common_pb2.AUTO_CHOICE_PROBE:
            return f"probing with k={turn.k}: measuring the acceptance and the draft's cost"
        return "no draft: target-only"
