"""The round loop of one request, run on the gRPC handler thread that serves it.

Each round: ask the draft for k tokens (with a deadline), verify them in one target
forward on the engine thread, tell the draft what was kept, stream the round. Any draft
failure switches the request to target-only rounds from the next token on: the target
session already holds every committed token, so nothing is lost or repeated. In AUTO mode
each round's k comes from the session's AutoSession (verify_service/auto_mode.py), and a
round with k = 0 is target-only; the draft catches up on the tokens it missed with the
next proposal it is asked for.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
import uuid
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, replace

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace

from specdec import requests
from specdec import span_attributes as attrs
from specdec.defaults import NUM_DRAFT_TOKENS, RECENT_CAPACITY
from specdec.engine import Engine
from specdec.errors import Internal, InvalidArgument, ResourceExhausted, ServiceError
from specdec.metrics import ModeMetrics, SpeculationMetrics
from specdec.runtime import CausalLM
from specdec.sampling import SamplingParams
from specdec.serving import Drain, remaining_timeout
from specdec.telemetry import inject, set_error, traceparent
from specdec.usage import UsageTally
from specdec.v1 import common_pb2, verify_pb2
from verify_service.admission import Admission, Limits
from verify_service.auto_mode import AutoSession, Choice, ServiceAuto
from verify_service.draft_client import DraftClient, DraftLost, DraftSession
from verify_service.verifier import NO_DRAFT, Prefill, Release, Verified, Verify

SPECULATING = common_pb2.Speculation(speculating=True)
AUTO = common_pb2.SPECULATION_MODE_AUTO
DEFAULT_RECENT = 100


def target_only(reason: common_pb2.TargetOnlyReason, detail: str) -> common_pb2.Speculation:
    return common_pb2.Speculation(speculating=False, reason=reason, detail=detail)


@dataclass(frozen=True)
class Plan:
    """A validated request with every default resolved."""

    request_id: str
    prompt_ids: list[int]
    max_new_tokens: int
    params: SamplingParams
    seed: int  # the request's, or a fresh random one
    seeded: bool  # the request set its seed: sampled by coupling, repeatable in every mode
    mode: common_pb2.SpeculationMode  # ON, OFF or AUTO (the service's default resolved)
    num_draft_tokens: int  # k of every round in ON mode

    @property
    def capacity(self) -> int:
        """The longest the sequence can grow: prompt plus output."""
        return len(self.prompt_ids) + self.max_new_tokens

    def sampling_proto(self) -> common_pb2.SamplingParams:
        """The draft's sampling settings: the seed only for a seeded request (the draft
        then proposes with the same noise as the target; else it draws its own)."""
        p = self.params
        sampling = common_pb2.SamplingParams(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p)
        if self.seeded:
            sampling.seed = self.seed
        return sampling


@dataclass
class Totals:
    """Service-wide counters reported by GetInfo."""

    requests: int = 0
    proposed: int = 0
    accepted: int = 0
    expired: int = 0  # sessions freed because their caller stopped taking messages


@dataclass(frozen=True)
class Finished:
    """What RecentRequests keeps of a finished request."""

    completion_tokens: int
    proposed: int
    accepted: int
    rejections: int  # rounds that ended in a rejection


@dataclass(frozen=True)
class Instruments:
    """Where the decoder reports: its spans and its metrics."""

    tracer: trace.Tracer
    metrics: SpeculationMetrics
    modes: ModeMetrics
    model_name: str  # gen_ai.request.model


@dataclass(frozen=True)
class DecodeLimits:
    max_new_tokens: int  # largest max_new_tokens a request may ask for
    admission: Limits
    default_mode: common_pb2.SpeculationMode  # of a request that names none
    session_kv_bytes: int  # KV cache one session may reserve; 0: the whole context
    idle_s: float  # a stream whose caller takes no message for this long is cancelled; 0: never


def session_kv_budget(model: CausalLM, limit_bytes: int) -> int:
    """KV-cache bytes one session may reserve: the limit, or the whole context if less or unset."""
    whole_context = model.max_positions * model.kv_bytes_per_token
    return min(limit_bytes or whole_context, whole_context)


@dataclass
class Stream:
    """A request being decoded, as the idle sweep sees it."""

    context: grpc.ServicerContext
    sending_since: float | None = None  # monotonic time the message now being sent was handed to gRPC
    expired: bool = False
    draft: DraftSession | None = None  # its draft session, to interrupt when the call ends

    def ended(self) -> None:
        """The call ended (any way): stop waiting on the draft."""
        if self.draft is not None:
            self.draft.interrupt()


class Decoder:
    def __init__(
        self,
        engine: Engine,
        model: CausalLM,
        draft: DraftClient | None,
        limits: DecodeLimits,
        instruments: Instruments,
        auto: ServiceAuto,
        drain: Drain,
        log: logging.Logger,
    ) -> None:
        self._engine = engine
        self._auto = auto
        self._model = model
        self._draft = draft
        self._tracer = instruments.tracer
        self._metrics = instruments.metrics
        self._modes = instruments.modes
        self._model_name = instruments.model_name
        self._drain = drain
        self._log = log
        self._eos = model.eos_token_ids
        self.limits = limits
        self.admission = Admission(limits.admission)
        self.totals = Totals()
        self._finished: deque[Finished] = deque(maxlen=RECENT_CAPACITY)
        self._streams: dict[str, Stream] = {}
        self._lock = threading.Lock()
        drain.at_end(self._interrupt_all)

    @property
    def session_kv_budget_bytes(self) -> int:
        return session_kv_budget(self._model, self.limits.session_kv_bytes)

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
        )

    def expire_idle(self) -> None:
        """Cancels every stream whose caller has taken no message for the idle period; the
        stream's own thread then frees its sessions (see `decode`)."""
        now = time.monotonic()
        with self._lock:
            idle = [
                (sid, s) for sid, s in self._streams.items()
                if not s.expired and s.sending_since is not None and now - s.sending_since > self.limits.idle_s
            ]  # fmt: skip
            for _, stream in idle:
                stream.expired = True
                self.totals.expired += 1
        for sid, stream in idle:
            self._log.warning("session %s expired: its caller took no message for %.1f s", sid, self.limits.idle_s)
            stream.context.cancel()

    def _interrupt_all(self) -> None:
        """Shutdown: streams still waiting on the draft stop waiting, so that each reaches
        its next message and ends with the drain's UNAVAILABLE."""
        with self._lock:
            streams = list(self._streams.values())
        for stream in streams:
            stream.ended()

    def plan(self, request: verify_pb2.DecodeRequest) -> Plan:
        """Validates a request (InvalidArgument naming the field) and resolves defaults."""
        context = self._model.max_positions
        prompt = requests.check_prompt_ids(request.prompt_ids, self._model.vocab_size, context)
        limit = self.limits.max_new_tokens
        max_new = requests.check_max_new_tokens(request.max_new_tokens, limit, len(prompt), context)
        params = requests.sampling_params(request.sampling)
        k = requests.check_num_draft_tokens(request.num_draft_tokens or NUM_DRAFT_TOKENS)
        seeded = request.sampling.HasField("seed")
        mode = request.speculation
        if mode not in common_pb2.SpeculationMode.values():
            raise InvalidArgument(f"speculation: unknown mode {mode}")
        if mode == common_pb2.SPECULATION_MODE_UNSPECIFIED:
            mode = common_pb2.SPECULATION_MODE_ON if request.num_draft_tokens else self.limits.default_mode
        if mode == AUTO and request.num_draft_tokens:
            raise InvalidArgument("num_draft_tokens: AUTO mode chooses k every round; set speculation ON for a fixed k")
        return Plan(
            request_id=request.request_id or uuid.uuid4().hex,
            prompt_ids=prompt,
            max_new_tokens=max_new,
            params=params,
            seed=request.sampling.seed if seeded else secrets.randbits(63),
            seeded=seeded,
            mode=mode,
            num_draft_tokens=k,
        )

    def decode(
        self, request: verify_pb2.DecodeRequest, parent: otel_context.Context, context: grpc.ServicerContext
    ) -> Iterator[verify_pb2.DecodeChunk]:
        """Validates the request, takes a session slot (waiting in the queue if need be) and
        streams its rounds, under a `decode` span that is a child of `parent`. Raises
        InvalidArgument, ResourceExhausted (before the first round), Cancelled or
        DeadlineExceeded (while queued), Unavailable (shutdown)."""
        span = self._tracer.start_span(attrs.DECODE, context=parent, kind=trace.SpanKind.SERVER)
        ctx = trace.set_span_in_context(span)
        stream = Stream(context)
        done = threading.Event()  # set when the call ends for any reason: wakes a queued request
        context.add_callback(lambda: (done.set(), self.admission.wake(), stream.ended()))
        timeout = remaining_timeout(context)
        deadline = None if timeout is None else time.monotonic() + timeout
        draft: DraftSession | None = None
        final = None
        sid = ""
        admitted = False
        try:
            plan = self.plan(request)
            p = plan.params
            span.set_attributes(attrs.request(self._model_name, plan.max_new_tokens, p.temperature, p.top_k, p.top_p))
            self._check_kv_budget(plan)
            queued_s = self.admission.acquire(timeout, done)
            admitted = True
            mode = requests.MODE_NAMES[plan.mode]
            span.set_attributes({"specdec.queue_us": int(queued_s * 1e6), "specdec.speculation.mode": mode})
            self._modes.sessions.add(1, {"mode": mode})
            sid = f"{plan.request_id}-{uuid.uuid4().hex[:8]}"
            with self._lock:
                self.totals.requests += 1
                self._streams[sid] = stream
            draft, speculation = self._open_draft(sid, plan, ctx, deadline)
            stream.draft = draft
            if done.is_set() and draft is not None:  # ended while the session was being opened
                draft.interrupt()
            span.set_attributes(attrs.speculation(speculation))
            if self._draft is not None and self._wants_draft(plan):
                span.set_attributes(attrs.pairing(self._draft.pairing))
            with self._tracer.start_span(attrs.TARGET_PREFILL, context=ctx, attributes={"gen_ai.usage.input_tokens": len(plan.prompt_ids)}):
                self._engine.run(Prefill(sid, plan.prompt_ids, plan.params, plan.seed, plan.capacity, plan.seeded))
            for chunk in self._rounds(sid, plan, draft, speculation, ctx):
                if chunk.finish_reason:
                    final = chunk
                    break
                self._drain.check()
                stream.sending_since = time.monotonic()
                yield chunk
                stream.sending_since = None
        except ServiceError as err:
            set_error(span, err.code, str(err))
            raise
        except GeneratorExit:  # the stream ended under us: cancelled, past its deadline, or idle
            if stream.expired:
                set_error(span, grpc.StatusCode.CANCELLED, f"expired: the caller took no message for {self.limits.idle_s} s")
            elif deadline is not None and time.monotonic() >= deadline:
                set_error(span, grpc.StatusCode.DEADLINE_EXCEEDED, "the caller's deadline passed")
            else:
                set_error(span, grpc.StatusCode.CANCELLED, "the caller cancelled the stream")
            raise
        except Exception as err:  # a bug: the trace and the log get its text, the caller a short reason
            span.record_exception(err)
            set_error(span, grpc.StatusCode.INTERNAL, repr(err))
            self._log.exception("session %r failed", sid)
            raise Internal(f"decoding failed: an internal error, logged under session {sid!r}") from None
        finally:
            # Free the sessions before the last message leaves, so that a client that has
            # its completion never sees this request as active.
            if sid:
                self._engine.submit(Release(sid))
                with self._lock:
                    del self._streams[sid]
            if draft is not None:
                draft.close()
            if admitted:
                self.admission.release()
            if final is not None:
                span.set_attributes(attrs.usage(final.usage, final.finish_reason))
            span.end()
        if final is not None:
            usage = final.usage
            with self._lock:
                self._finished.append(
                    Finished(
                        usage.completion_tokens, usage.draft_tokens_proposed, usage.draft_tokens_accepted,
                        usage.rejections,
                    )  # fmt: skip
                )
            yield final

    def _short(self, plan: Plan) -> bool:
        """An AUTO request too short for speculation to pay: it never contacts the draft."""
        return plan.mode == AUTO and plan.max_new_tokens <= self._auto.policy.min_new_tokens

    def _wants_draft(self, plan: Plan) -> bool:
        return plan.mode == common_pb2.SPECULATION_MODE_ON or (plan.mode == AUTO and not self._short(plan))

    def _check_kv_budget(self, plan: Plan) -> None:
        need = plan.capacity * self._model.kv_bytes_per_token
        budget = self.session_kv_budget_bytes
        if need > budget:
            raise ResourceExhausted(
                f"the request needs {need / 2**20:.2f} MiB of KV cache for {plan.capacity} positions (prompt plus "
                f"max_new_tokens), over the per-session budget of {budget / 2**20:.2f} MiB (--session-kv-mib)"
            )

    def _rounds(
        self,
        sid: str,
        plan: Plan,
        draft: DraftSession | None,
        speculation: common_pb2.Speculation,
        ctx: otel_context.Context,
    ) -> Iterator[verify_pb2.DecodeChunk]:
        usage = UsageTally(prompt_tokens=len(plan.prompt_ids))
        greedy = plan.params.greedy
        costs = self._auto.costs(greedy)
        auto = self._auto.session(greedy) if plan.mode == AUTO and draft is not None else None
        fell_back = False  # an AUTO session counted once among those that went target-only
        started = time.perf_counter()
        span, round_start = self._tracer.start_span(attrs.ROUND, context=ctx), time.perf_counter()
        turn = self._choose(plan, usage, draft, auto)
        previous: Choice | None = None
        try:
            for index in range(plan.max_new_tokens):
                draft, speculation, chunk = self._round(
                    sid, plan, index, usage, draft, speculation, turn, trace.set_span_in_context(span)
                )
                stats = chunk.round
                span.set_attributes(attrs.round_stats(stats, len(chunk.token_ids), usage.acceptance_rate))
                if not chunk.speculation.speculating:
                    span.set_attributes(attrs.speculation(chunk.speculation))
                steady = self._steady(index, turn, previous)
                if plan.mode == AUTO:
                    span.set_attributes(attrs.auto_choice(stats, self._auto_reason(turn, previous)))
                previous = turn
                if auto is not None:
                    auto.observe(stats.draft_tokens, stats.accepted_tokens, len(chunk.token_ids))
                    if stats.auto_choice == common_pb2.AUTO_CHOICE_LOW_GAIN and not fell_back:
                        fell_back = True
                        self._modes.auto_fallbacks.add(1)
                if stats.draft_tokens:
                    self._auto.observe_alpha(stats.accepted_tokens, stats.accepted_tokens < stats.draft_tokens)
                if not chunk.finish_reason:
                    # The next round starts now: its proposal is asked for before this
                    # round's tokens are sent, so the draft computes while they travel.
                    following, following_start = self._tracer.start_span(attrs.ROUND, context=ctx), time.perf_counter()
                    if steady:
                        costs.observe(stats.draft_tokens, stats.draft_time_us / 1e6, stats.verify_time_us / 1e6, following_start - round_start)
                    turn = self._choose(plan, usage, draft, auto)
                    draft, speculation = self._request_proposal(turn.k, draft, speculation, following)
                span.end()
                span = None
                self._metrics.round_duration.record(time.perf_counter() - round_start)
                self._metrics.speculated(stats.draft_tokens, stats.accepted_tokens)
                self._metrics.generated.add(len(chunk.token_ids))
                if stats.draft_tokens:
                    self._metrics.accepted_per_round.record(stats.accepted_tokens)
                if chunk.finish_reason:
                    elapsed = time.perf_counter() - started
                    if elapsed > 0:
                        self._metrics.tokens_per_second.record(usage.completion_tokens / elapsed)
                    yield chunk
                    return
                yield chunk
                span, round_start = following, following_start
        except Exception as err:  # the decode span says which status the caller got
            if span is not None:
                span.record_exception(err)
                span.set_status(trace.Status(trace.StatusCode.ERROR, repr(err)))
            raise
        finally:  # a stream that ends between rounds leaves the next one's span open
            if span is not None:
                span.end()

    def _choose(self, plan: Plan, usage: UsageTally, draft: DraftSession | None, auto: AutoSession | None) -> Choice:
        """What the next round does: its k never proposes past the last position the
        request may emit (so the last round is target-only)."""
        if draft is None:
            how = common_pb2.AUTO_CHOICE_SHORT_OUTPUT if self._short(plan) else common_pb2.AUTO_CHOICE_UNSPECIFIED
            return Choice(0, how, 0.0, 0.0)
        choice = auto.next() if auto is not None else Choice(plan.num_draft_tokens, common_pb2.AUTO_CHOICE_UNSPECIFIED, 0.0, 0.0)
        remaining = plan.max_new_tokens - usage.completion_tokens
        return replace(choice, k=min(choice.k, remaining - 1))

    @staticmethod
    def _steady(index: int, turn: Choice, previous: Choice | None) -> bool:
        """Whether a round's costs are a steady sample: not the first round (it also waits
        for the draft's prefill), nor a probe after a target-only stretch (the draft first
        catches up on the tokens it missed)."""
        after_pause = previous is not None and previous.how == common_pb2.AUTO_CHOICE_LOW_GAIN
        return index > 0 and not (turn.how == common_pb2.AUTO_CHOICE_PROBE and after_pause)

    def _auto_reason(self, turn: Choice, previous: Choice | None) -> str:
        """Why an AUTO round does what it does, when that changed since the round before."""
        if previous is not None and previous.how == turn.how:
            return ""
        if turn.how == common_pb2.AUTO_CHOICE_SHORT_OUTPUT:
            return f"max_new_tokens is at most {self._auto.policy.min_new_tokens}: target-only, no draft"
        if turn.how == common_pb2.AUTO_CHOICE_BEST_K:
            return f"speculating: k={turn.k} has the best expected gain, {turn.gain:.2f}x at α̂ {turn.alpha:.2f}"
        if turn.how == common_pb2.AUTO_CHOICE_LOW_GAIN:
            return f"target-only: the best expected gain is {turn.gain:.2f}x (below {self._auto.policy.pause_below:g}) at α̂ {turn.alpha:.2f}; a probe follows"
        if turn.how == common_pb2.AUTO_CHOICE_PROBE:
            return f"probing with k={turn.k}: measuring the acceptance and the draft's cost"
        return "no draft: target-only"

    def _request_proposal(
        self, k: int, draft: DraftSession | None, speculation: common_pb2.Speculation, span: trace.Span
    ) -> tuple[DraftSession | None, common_pb2.Speculation]:
        """Asks the draft for the next round's proposal of k tokens (under that round's span)."""
        if k > 0 and draft is not None:
            try:
                draft.request(k, traceparent(trace.set_span_in_context(span)))
            except DraftLost as lost:
                speculation = self._lose_draft(draft, lost)
                draft = None
        return draft, speculation

    def _lose_draft(self, draft: DraftSession, lost: DraftLost) -> common_pb2.Speculation:
        """The request goes on target-only; the pairing goes too if the draft is in doubt."""
        if lost.unpairs:
            self._draft.forget(lost)
        draft.close()
        return target_only(lost.reason, str(lost))

    def _round(
        self,
        sid: str,
        plan: Plan,
        index: int,
        usage: UsageTally,
        draft: DraftSession | None,
        speculation: common_pb2.Speculation,
        turn: Choice,
        ctx: otel_context.Context,
    ) -> tuple[DraftSession | None, common_pb2.Speculation, verify_pb2.DecodeChunk]:
        """One round: proposal, verification, the chunk to stream (and the draft session
        and speculation state that the next round continues with)."""
        remaining = plan.max_new_tokens - usage.completion_tokens
        proposal, draft_seconds, draft_compute = NO_DRAFT, 0.0, 0.0
        if turn.k > 0 and draft is not None:
            try:
                start = time.perf_counter()
                if not draft.requested:  # the first round; later ones were asked for by the round before
                    draft.request(turn.k, traceparent(ctx))
                proposal, draft_compute = draft.receive()
                draft_seconds = time.perf_counter() - start
            except DraftLost as lost:
                speculation = self._lose_draft(draft, lost)
                draft = None
        with self._tracer.start_span(attrs.TARGET_VERIFY, context=ctx) as span:
            verified: Verified = self._engine.run(Verify(sid, proposal))
            span.set_attributes({"specdec.positions": len(proposal.ids) + 1, "specdec.compute_us": int(verified.seconds * 1e6)})
        if draft is not None and proposal.ids:
            draft.commit(verified.accepted, verified.tokens[-1])
        elif draft is not None:  # an AUTO target-only round: the draft learns its token with the next request
            draft.append(verified.tokens)

        tokens, finish = self._cut(verified.tokens, remaining)
        stats = common_pb2.RoundStats(
            index=index,
            draft_tokens=len(proposal.ids),
            accepted_tokens=verified.accepted,
            closing=(
                common_pb2.CLOSING_TOKEN_BONUS
                if verified.accepted == len(proposal.ids)
                else common_pb2.CLOSING_TOKEN_CORRECTION
            ),
            draft_time_us=int(draft_seconds * 1e6),
            verify_time_us=int(verified.seconds * 1e6),
            draft_compute_us=int(draft_compute * 1e6),
            mode=plan.mode,
            auto_choice=turn.how,
            expected_gain=turn.gain,
            alpha_estimate=turn.alpha,
        )
        usage.add(stats, len(tokens))
        with self._lock:
            self.totals.proposed += stats.draft_tokens
            self.totals.accepted += stats.accepted_tokens
        shown = speculation
        if turn.how == common_pb2.AUTO_CHOICE_LOW_GAIN and speculation.speculating:
            detail = f"AUTO: the best expected gain is {turn.gain:.2f}x at α̂ {turn.alpha:.2f}; target-only until the next probe"
            shown = target_only(common_pb2.TARGET_ONLY_REASON_AUTO_LOW_GAIN, detail)
        chunk = verify_pb2.DecodeChunk(token_ids=tokens, round=stats, speculation=shown)
        if finish:
            chunk.finish_reason = finish
            chunk.usage.CopyFrom(usage.to_proto())
        return draft, speculation, chunk

    def _cut(self, tokens: list[int], remaining: int) -> tuple[list[int], common_pb2.FinishReason]:
        """The round's tokens up to the first EOS or the length limit, and why it ended."""
        for i, token in enumerate(tokens[:remaining]):
            if token in self._eos:
                return tokens[: i + 1], common_pb2.FINISH_REASON_EOS
        if len(tokens) >= remaining:
            return tokens[:remaining], common_pb2.FINISH_REASON_LENGTH
        return tokens, common_pb2.FINISH_REASON_UNSPECIFIED

    def _open_draft(
        self, sid: str, plan: Plan, ctx: otel_context.Context, deadline: float | None
    ) -> tuple[DraftSession | None, common_pb2.Speculation]:
        if plan.mode == common_pb2.SPECULATION_MODE_OFF:
            return None, target_only(common_pb2.TARGET_ONLY_REASON_OFF_BY_REQUEST, "speculation is off for this request")
        if self._short(plan):
            detail = (
                f"AUTO: max_new_tokens {plan.max_new_tokens} is at most {self._auto.policy.min_new_tokens} "
                "(--auto-min-new-tokens), too short for speculation to pay"
            )
            return None, target_only(common_pb2.TARGET_ONLY_REASON_AUTO_SHORT_OUTPUT, detail)
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
        session = self._draft.open(sid, plan.prompt_ids, plan.sampling_proto(), plan.capacity, inject(ctx), deadline)
        return session, speculation
