"""The verify service's side of a Decode call, on the gRPC handler thread that serves it:
validation, admission (a slot and the KV pool's tokens), the draft session's opening, then
streaming what the round loop (verify_service/rounds.py) hands the request, round by round.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace

from specdec import requests
from specdec import span_attributes as attrs
from specdec.defaults import MAX_DRAFT_TOKENS, RECENT_CAPACITY
from specdec.errors import Internal, ResourceExhausted, ServiceError
from specdec.runtime import CausalLM, KVCache
from specdec.serving import Drain, remaining_timeout
from specdec.telemetry import inject, set_error
from specdec.v1 import common_pb2, verify_pb2
from verify_service.admission import Admission, Limits
from verify_service.auto_mode import ServiceAuto
from verify_service.draft_client import DraftClient, DraftLost, DraftSession
from verify_service.load_bands import LoadTally, band_protos
from verify_service.plan import AUTO, Plan, PlanLimits, make_plan
from verify_service.request_state import ENDED, MAX_AHEAD, SPECULATING, Request, target_only
from verify_service.round_telemetry import Instruments, RoundTelemetry
from verify_service.rounds import RoundLoop, Totals
from verify_service.verifier import Verifier

DEFAULT_RECENT = 100
# Reasons a request never asked for its draft (the others tried: the pairing shows why it failed).
NO_DRAFT_WANTED = (
    common_pb2.TARGET_ONLY_REASON_OFF_BY_REQUEST,
    common_pb2.TARGET_ONLY_REASON_AUTO_SHORT_OUTPUT,
    common_pb2.TARGET_ONLY_REASON_AUTO_NOT_OPENED,
)


@dataclass(frozen=True)
class Finished:
    """What RecentRequests keeps of a finished request."""

    completion_tokens: int
    proposed: int
    accepted: int
    rejections: int  # rounds that ended in a rejection
    load: LoadTally  # its rounds by load


@dataclass(frozen=True)
class DecodeLimits:
    max_new_tokens: int  # largest max_new_tokens a request may ask for
    admission: Limits
    default_mode: common_pb2.SpeculationMode  # of a request that names none
    session_kv_bytes: int  # KV cache one session may reserve; 0: the whole context
    idle_s: float  # a stream whose caller takes no message for this long is cancelled; 0: never
    prefill_chunk_tokens: int  # prompt positions prefilled per forward, shared by the prompts being prefilled


def session_kv_budget(model: CausalLM, limit_bytes: int) -> int:
    """KV-cache bytes one session may reserve: the limit, or the whole context if less or unset."""
    whole_context = model.max_positions * model.kv_bytes_per_token
    return min(limit_bytes or whole_context, whole_context)


class Decoder:
    def __init__(
        self,
        verifier: Verifier,
        draft: DraftClient | None,
        limits: DecodeLimits,
        instruments: Instruments,
        auto: ServiceAuto,
        drain: Drain,
        log: logging.Logger,
    ) -> None:
        self._model = model = verifier.model
        self._auto = auto
        self._draft = draft
        self._tracer = instruments.tracer
        self._modes = instruments.modes
        self._model_name = instruments.model_name
        self._drain = drain
        self._log = log
        self.limits = limits
        self._plan_limits = PlanLimits(
            model.vocab_size, model.max_positions, limits.max_new_tokens, limits.default_mode
        )
        self.lookahead = max(MAX_DRAFT_TOKENS, auto.policy.k_max) + 1  # a proposal's positions past the output
        self.admission: Admission[KVCache] = Admission(limits.admission, self._reserve, self._pool_tokens)
        telemetry = RoundTelemetry(instruments, auto)
        self.loop = RoundLoop(
            verifier, draft, auto, telemetry, limits.prefill_chunk_tokens, self._retired, log,
            admitted=lambda: self.admission.active,
        )  # fmt: skip
        self._finished: deque[Finished] = deque(maxlen=RECENT_CAPACITY)
        self._requests: dict[str, Request] = {}
        self._lock = threading.Lock()
        drain.at_end(self.loop.interrupt)

    @property
    def totals(self) -> Totals:
        return self.loop.totals

    @property
    def session_kv_budget_bytes(self) -> int:
        return session_kv_budget(self._model, self.limits.session_kv_bytes)

    def _reserve(self, tokens: int) -> KVCache | None:
        if not self._model.fits(tokens):
            return None
        return self._model.new_cache(tokens)

    def _pool_tokens(self) -> int | None:
        stats = self._model.pool_stats()
        return None if stats is None else stats.capacity_tokens

    def recent(self, window: int) -> verify_pb2.RecentRequests:
        """Totals over the last `window` finished requests (0: DEFAULT_RECENT)."""
        window = window or DEFAULT_RECENT
        with self._lock:
            last = list(self._finished)[-window:]
        proposed = sum(f.proposed for f in last)
        accepted = sum(f.accepted for f in last)
        rejections = sum(f.rejections for f in last)
        return verify_pb2.RecentRequests(
            window=window,
            requests=len(last),
            mean_completion_tokens=sum(f.completion_tokens for f in last) / len(last) if last else 0.0,
            speculated_requests=sum(f.proposed > 0 for f in last),
            draft_tokens_proposed=proposed,
            draft_tokens_accepted=accepted,
            acceptance_rate=accepted / proposed if proposed else 0.0,
            rejections=rejections,
            alpha_hat=accepted / (accepted + rejections) if accepted + rejections else 0.0,
            load_bands=band_protos([f.load for f in last]),
        )

    def expire_idle(self) -> None:
        """Cancels every stream whose caller has taken no message for the idle period; the
        round loop then frees its sessions."""
        now = time.monotonic()
        with self._lock:
            idle = [
                r for r in self._requests.values()
                if not r.expired and r.sending_since is not None and now - r.sending_since > self.limits.idle_s
            ]  # fmt: skip
            for request in idle:
                request.expired = True
                self.totals.expired += 1
        for request in idle:
            self._log.warning(
                "session %s expired: its caller took no message for %.1f s", request.sid, self.limits.idle_s
            )
            request.context.cancel()

    def plan(self, request: verify_pb2.DecodeRequest) -> Plan:
        """Validates a request (InvalidArgument naming the field) and resolves defaults."""
        return make_plan(request, self._plan_limits)

    def decode(
        self, request: verify_pb2.DecodeRequest, parent: otel_context.Context, context: grpc.ServicerContext
    ) -> Iterator[verify_pb2.DecodeChunk]:
        """Validates the request, takes a slot and its KV tokens (waiting in the queue if need
        be) and streams its rounds, under a `decode` span that is a child of `parent`.
        Raises InvalidArgument, ResourceExhausted (before the first round), Cancelled or
        DeadlineExceeded (while queued), Unavailable (shutdown)."""
        span = self._tracer.start_span(attrs.DECODE, context=parent, kind=trace.SpanKind.SERVER)
        ctx = trace.set_span_in_context(span)
        done = threading.Event()  # set when the call ends for any reason: wakes a queued request
        state: Request | None = None

        def ended() -> None:
            done.set()
            self.admission.wake()
            if state is not None:
                state.end()
                self.loop.ended(state)

        context.add_callback(ended)
        timeout = remaining_timeout(context)
        deadline = None if timeout is None else time.monotonic() + timeout
        final = None
        cache: KVCache | None = None  # reserved at admission; the round loop frees it once handed over
        draft: DraftSession | None = None
        handed = False  # to the round loop
        try:
            plan = self.plan(request)
            p = plan.params
            span.set_attributes(attrs.request(self._model_name, plan.max_new_tokens, p.temperature, p.top_k, p.top_p))
            self._check_kv_budget(plan)
            tokens = min(plan.capacity + self.lookahead, self._model.max_positions)
            cache, queued_s = self.admission.acquire(tokens, timeout, done)
            mode = requests.MODE_NAMES[plan.mode]
            span.set_attributes({"specdec.queue_us": int(queued_s * 1e6), "specdec.speculation.mode": mode})
            self._modes.sessions.add(1, {"mode": mode})
            sid = f"{plan.request_id}-{uuid.uuid4().hex[:8]}"
            draft, speculation = self._open_draft(sid, plan, ctx)
            span.set_attributes(attrs.speculation(speculation))
            if self._draft is not None and speculation.reason not in NO_DRAFT_WANTED:
                span.set_attributes(attrs.pairing(self._draft.pairing))
            state = Request(sid, plan, context, ctx, cache, speculation, draft)
            if plan.mode == AUTO and draft is not None:
                state.auto = self._auto.session(plan.params.greedy)
            with self._lock:
                self._requests[sid] = state
            self.loop.add(state)
            handed = True
            if done.is_set():  # ended while it was being admitted
                state.end()
                self.loop.ended(state)
            while (item := state.outbox.get()) is not ENDED:
                if state.outbox.qsize() == MAX_AHEAD - 1:  # the rounds had stopped for this caller
                    self.loop.wake()
                if isinstance(item, Exception):
                    raise item
                if item.finish_reason:
                    final = item
                    break
                self._drain.check()
                state.sending_since = time.monotonic()
                yield item
                state.sending_since = None
                self.loop.sent()
            else:  # the call ended while the request waited for its next round
                self._call_ended(span, state, deadline)
        except ServiceError as err:
            set_error(span, err.code, str(err))
            raise
        except GeneratorExit:  # the stream ended under us while a chunk was being sent
            self._call_ended(span, state, deadline)
            raise
        except Exception as err:  # a bug: the trace and the log get its text, the caller a short reason
            sid = state.sid if state is not None else ""
            span.record_exception(err)
            set_error(span, grpc.StatusCode.INTERNAL, repr(err))
            self._log.exception("session %r failed", sid)
            raise Internal(f"decoding failed: an internal error, logged under session {sid!r}") from None
        finally:
            if handed:
                state.end()  # the loop drops it at the next step if it has not retired it
                self.loop.ended(state)
            elif cache is not None:  # admitted, never handed to the round loop
                if state is not None:
                    with self._lock:
                        self._requests.pop(state.sid, None)
                if draft is not None:
                    draft.close()
                cache.release()
                self.admission.release()
            if final is not None:
                span.set_attributes(attrs.usage(final.usage, final.finish_reason))
            span.end()
        if final is not None:
            usage = final.usage
            with self._lock:
                self._finished.append(
                    Finished(
                        usage.completion_tokens,
                        usage.draft_tokens_proposed,
                        usage.draft_tokens_accepted,
                        usage.rejections,
                        state.load,
                    )
                )
            yield final

    def _call_ended(self, span: trace.Span, state: Request | None, deadline: float | None) -> None:
        """The span says how the call ended under the request: idle, past its deadline or cancelled."""
        if state is not None and state.expired:
            set_error(
                span, grpc.StatusCode.CANCELLED, f"expired: the caller took no message for {self.limits.idle_s} s"
            )
        elif deadline is not None and time.monotonic() >= deadline:
            set_error(span, grpc.StatusCode.DEADLINE_EXCEEDED, "the caller's deadline passed")
        else:
            set_error(span, grpc.StatusCode.CANCELLED, "the caller cancelled the stream")

    def _retired(self, state: Request) -> None:
        """The round loop freed the request's sessions and reservation (its thread)."""
        with self._lock:
            self._requests.pop(state.sid, None)
        self.admission.release()

    def _check_kv_budget(self, plan: Plan) -> None:
        need = plan.capacity * self._model.kv_bytes_per_token
        budget = self.session_kv_budget_bytes
        if need > budget:
            raise ResourceExhausted(
                f"the request needs {need / 2**20:.2f} MiB of KV cache for {plan.capacity} positions (prompt plus "
                f"max_new_tokens), over the per-session budget of {budget / 2**20:.2f} MiB (--session-kv-mib)"
            )

    def _open_draft(
        self, sid: str, plan: Plan, ctx: otel_context.Context
    ) -> tuple[DraftSession | None, common_pb2.Speculation]:
        if plan.mode == common_pb2.SPECULATION_MODE_OFF:
            return None, target_only(
                common_pb2.TARGET_ONLY_REASON_OFF_BY_REQUEST, "speculation is off for this request"
            )
        if plan.mode == AUTO:
            opening = self._auto.opening(plan.max_new_tokens, plan.params.greedy, self.admission.active)
            if not opening.pays:
                short = opening.reason == common_pb2.TARGET_ONLY_REASON_AUTO_SHORT_OUTPUT
                why = "too short for speculation to pay" if short else "no draft opened"
                return None, target_only(opening.reason, f"AUTO: {why}: {opening.detail}")
        if self._draft is None:
            return None, target_only(common_pb2.TARGET_ONLY_REASON_DRAFT_UNAVAILABLE, "no draft service is configured")
        try:
            pairing = self._draft.attach()
        except DraftLost as lost:
            return None, target_only(lost.reason, str(lost))
        max_positions = pairing.draft.model.max_positions
        if plan.capacity > max_positions:
            detail = f"the output would not fit the draft's context of {max_positions} positions"
            return None, target_only(common_pb2.TARGET_ONLY_REASON_DRAFT_UNAVAILABLE, detail)
        speculation = SPECULATING
        if pairing.overrides:
            detail = f"paired under operator override: {', '.join(pairing.overrides)}"
            speculation = common_pb2.Speculation(speculating=True, detail=detail)
        session = self._draft.open(
            sid, plan.prompt_ids, plan.sampling_proto(), plan.capacity, inject(ctx), self.loop.wake
        )
        return session, speculation
