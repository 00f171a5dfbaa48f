"""The draft service's gRPC server: `python -m draft_service`."""

from __future__ import annotations

import logging
import secrets
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import grpc
import torch
from opentelemetry import context as otel_context
from opentelemetry import trace

from draft_service.drafter import Close, Drafter, Expire, Open, Proposals, Propose, ProposeBatch
from specdec import defaults
from specdec import span_attributes as attrs
from specdec.engine import Engine, EngineStopped
from specdec.errors import Internal, ServiceError, Unavailable
from specdec.facts import kv_pool_info, peer_facts
from specdec.fingerprint import load_fingerprint
from specdec.flags import option, parse_config
from specdec.host import HostProbe
from specdec.idle import IdleSweeper
from specdec.metrics import ForwardMetrics, SpeculationMetrics, observe_peak_memory, observe_sessions, proposal_duration
from specdec.pairing import REFUSAL_FACTS_KEY, check_verifier, describe_host, transport_of_peer
from specdec.runtime import CausalLM, ModelSpec
from specdec.sampling import SamplingParams
from specdec.serving import Service, setup_logging
from specdec.telemetry import Telemetry, from_traceparent, incoming, set_error
from specdec.v1 import draft_pb2, draft_pb2_grpc, pairing_pb2

SERVER = trace.SpanKind.SERVER
MAX_PAIRINGS = 64  # pairing ids remembered (one per verify-service connection)
_CODES = {code.value[0]: code for code in grpc.StatusCode}


@dataclass(frozen=True)
class DraftConfig:
    listen: str = option(defaults.DRAFT_ADDRESS, "address to serve on: unix:///path or host:port")
    model: str = option(defaults.DEFAULT_DRAFT, "draft model: local directory or hub id")
    device: str = option("cpu", "torch device of the model, e.g. cpu or cuda:0")
    dtype: str = option("float32", "model dtype: float32, float16 or bfloat16")
    backend: str = option("auto", "forward implementation: auto, batched or transformers")
    kv_pool_tokens: int = option(
        0,
        "tokens of the KV pool every session reserves from (batched runtime); 0: --max-sessions contexts, at most 1 GiB",
    )
    support_size: int = option(32, "K: tokens in each truncated draft distribution sent when sampling")
    max_sessions: int = option(
        64, "most sessions open at once (more get RESOURCE_EXHAUSTED: that request runs target-only)"
    )
    session_idle_s: float = option(60.0, "close a session that gets no proposal call for this many seconds; 0: never")
    threads: int = option(
        1,
        "torch CPU threads (0: torch's default); one, because a draft step is too small to split and a second "
        "thread takes a core from the target's forward",
    )
    workers: int = option(
        80,
        "gRPC handler threads: each open session's proposal stream holds one (see --max-sessions), short calls use the rest",
    )
    grace_s: float = option(5.0, "seconds in-flight calls get to finish after SIGTERM")
    metrics_listen: str = option(
        "", "host:port of the Prometheus /metrics endpoint (port 0: any free port); empty for none"
    )


class DraftServicer(draft_pb2_grpc.DraftServicer):
    def __init__(
        self,
        drafter: Drafter,
        engine: Engine,
        model_name: str,
        step_time_s: float,
        tokenizer: pairing_pb2.TokenizerFingerprint,
        probe: HostProbe,
        log: logging.Logger,
        telemetry: Telemetry,
        idle_s: float,
    ) -> None:
        self._drafter = drafter
        self._idle_s = idle_s
        self._tracer = telemetry.tracer
        self._metrics = SpeculationMetrics(telemetry.meter)
        self._proposal_duration = proposal_duration(telemetry.meter)
        self._forwards = ForwardMetrics(telemetry.meter)
        self._engine = engine
        self._model_name = model_name
        self._step_time_s = step_time_s
        self._tokenizer = tokenizer
        self._probe = probe
        self._log = log
        self._lock = threading.Lock()
        self._pairings: OrderedDict[str, str] = OrderedDict()  # pairing id -> verifier host

    def Pair(self, request: pairing_pb2.PairRequest, context: grpc.ServicerContext):
        facts = peer_facts(self._drafter.model, self._model_name, self._tokenizer, self._probe, kv_budget_bytes=0)
        transport = transport_of_peer(context.peer())
        refusal = check_verifier(transport, request.verifier, facts, request.allow_different_tokenizer)
        verifier = describe_host(request.verifier.host)
        if refusal:
            self._log.warning("refused the verify service at %s: %s", verifier, refusal)
            context.set_trailing_metadata(((REFUSAL_FACTS_KEY, facts.SerializeToString()),))
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, refusal)
        pairing_id = uuid.uuid4().hex
        with self._lock:
            self._pairings[pairing_id] = verifier
            while len(self._pairings) > MAX_PAIRINGS:
                self._pairings.popitem(last=False)
        self._log.info("paired with the verify service at %s (%s)", verifier, context.peer())
        return pairing_pb2.PairResponse(draft=facts, pairing_id=pairing_id, step_time_us=int(self._step_time_s * 1e6))

    def OpenSession(self, request: draft_pb2.OpenSessionRequest, context: grpc.ServicerContext):
        with self._lock:
            paired = request.pairing_id in self._pairings
        if not paired:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "this verify service is not paired with the draft (unknown pairing_id): call Pair first",
            )
        sampling = request.sampling
        coupled = sampling.HasField("seed")  # a seeded request: the target's noise, not draws of the draft's own
        seed = sampling.seed if coupled else secrets.randbits(63)
        params = SamplingParams(sampling.temperature, sampling.top_k, sampling.top_p or 1.0)
        step = Open(request.session_id, list(request.prompt_ids), params, seed, request.max_tokens, coupled)
        attributes = {"gen_ai.usage.input_tokens": len(request.prompt_ids)}
        prefill_seconds, _ = self._traced(attrs.DRAFT_PREFILL, step, incoming(context), context, attributes)
        return draft_pb2.OpenSessionResponse(prefill_time_us=int(prefill_seconds * 1e6))

    def ProposeBatch(self, requests: Iterator[draft_pb2.ProposeBatchRequest], context: grpc.ServicerContext):
        for request in requests:
            items = [Propose(r.session_id, r.accepted, list(r.appended_ids), r.num_tokens) for r in request.sessions]
            start = time.perf_counter()
            try:
                proposals: Proposals = self._engine.run(ProposeBatch(items))
            except EngineStopped:
                context.abort(grpc.StatusCode.UNAVAILABLE, "the draft service is shutting down")
            seconds = time.perf_counter() - start
            answers = [self._answer(r, tokens) for r, tokens in zip(request.sessions, proposals.tokens)]
            self._trace(request, answers, seconds, len(proposals.shapes))
            self._proposal_duration.record(seconds)
            for sessions, positions in proposals.shapes:
                self._forwards.record(sessions, positions)
            yield draft_pb2.ProposeBatchResponse(
                sessions=answers, compute_time_us=int(seconds * 1e6), forwards=len(proposals.shapes)
            )

    def _answer(self, request: draft_pb2.ProposeRequest, tokens: list | Exception) -> draft_pb2.SessionProposal:
        """A session's part of a batch's answer. An unexpected exception fails that session
        alone: logged here with its session id, INTERNAL with a short reason to the caller
        (the verify service keeps the pairing and other sessions keep speculating)."""
        answer = draft_pb2.SessionProposal(session_id=request.session_id)
        if isinstance(tokens, ServiceError):
            answer.status, answer.detail = tokens.code.value[0], str(tokens)
        elif isinstance(tokens, Exception):
            self._log.error("the proposal of session %r failed", request.session_id, exc_info=tokens)
            answer.status = grpc.StatusCode.INTERNAL.value[0]
            answer.detail = (
                f"the draft's proposal failed: an internal error, logged under session {request.session_id!r}"
            )
        else:
            answer.tokens.extend(tokens)
            # The verifier reports acceptance one proposal late: `accepted` is the previous one's.
            self._metrics.speculated(request.num_tokens, request.accepted)
        return answer

    def _trace(
        self,
        request: draft_pb2.ProposeBatchRequest,
        answers: list[draft_pb2.SessionProposal],
        seconds: float,
        forwards: int,
    ) -> None:
        """A draft.propose span per session, the child of that session's round span."""
        end = time.time_ns()
        start = end - int(seconds * 1e9)
        for r, answer in zip(request.sessions, answers):
            attributes = {
                "specdec.draft.num_tokens": r.num_tokens,
                "specdec.draft.previous_accepted": r.accepted,
                "specdec.batch.sessions": len(request.sessions),
                "specdec.batch.forwards": forwards,
                "specdec.compute_us": int(seconds * 1e6),
            }
            span = self._tracer.start_span(
                attrs.DRAFT_PROPOSE, context=from_traceparent(r.traceparent), kind=SERVER, attributes=attributes,
                start_time=start,
            )  # fmt: skip
            if answer.status:
                set_error(span, _CODES[answer.status], answer.detail)
            span.end(end_time=end)

    def CloseSession(self, request: draft_pb2.CloseSessionRequest, context: grpc.ServicerContext):
        return draft_pb2.CloseSessionResponse(existed=self._run(Close(request.session_id), context))

    def GetInfo(self, request: draft_pb2.DraftInfoRequest, context: grpc.ServicerContext):
        model = self._drafter.model
        return draft_pb2.DraftInfo(
            model=self._model_name,
            parameters=model.parameters,
            vocab_size=model.vocab_size,
            max_positions=model.max_positions,
            device=str(model.device),
            support_size=self._drafter.support_size,
            step_time_us=int(self._step_time_s * 1e6),
            active_sessions=len(self._drafter.sessions),
            forwards=model.forwards,
            proposals=self._drafter.proposals,
            runtime=model.backend,
            max_sessions=self._drafter.max_sessions,
            session_idle_s=self._idle_s,
            expired_sessions=self._drafter.expirations,
            kv_pool=kv_pool_info(model),
            runtime_detail=model.unbatched_reason or "",
        )

    def _run(self, step: object, context: grpc.ServicerContext):
        try:
            return self._step(step)
        except ServiceError as err:
            context.abort(err.code, str(err))

    def _step(self, step: object) -> object:
        """Runs a step on the engine. An unexpected exception fails that step's session
        alone: logged here with its session id, INTERNAL with a short reason to the caller
        (the verify service keeps the pairing and other sessions keep speculating)."""
        try:
            return self._engine.run(step)
        except ServiceError:
            raise
        except EngineStopped:
            raise Unavailable("the draft service is shutting down") from None
        except Exception:
            session = getattr(step, "session_id", "")
            self._log.exception("%s of session %r failed", type(step).__name__, session)
            what = type(step).__name__.lower()
            raise Internal(
                f"the draft's {what} step failed: an internal error, logged under session {session!r}"
            ) from None

    def _traced(
        self,
        name: str,
        step: object,
        parent: otel_context.Context,
        context: grpc.ServicerContext,
        attributes: dict[str, int],
    ) -> tuple[object, float]:
        """Runs a step under a span that is a child of `parent` (the caller's); returns its
        result and wall time (queueing on the engine included: it is part of the caller's wait)."""
        start = time.perf_counter()
        error: ServiceError | None = None
        with self._tracer.start_span(name, context=parent, kind=SERVER, attributes=attributes) as span:
            try:
                result = self._step(step)
            except ServiceError as err:
                set_error(span, err.code, str(err))
                error = err
            seconds = time.perf_counter() - start
            span.set_attribute("specdec.compute_us", int(seconds * 1e6))
        if error is not None:
            context.abort(error.code, str(error))
        return result, seconds


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_config(
        DraftConfig, argv, "python -m draft_service", "specdec draft service: proposes draft tokens", "SPECDEC_DRAFT"
    )
    return serve(config, HostProbe())


def serve(config: DraftConfig, probe: HostProbe) -> int:
    """Runs the service until SIGTERM; `probe` reads the host facts (tests play other hosts)."""
    log = setup_logging("draft")
    telemetry = Telemetry("specdec-draft", config.metrics_listen, log)
    if config.threads:
        torch.set_num_threads(config.threads)
    spec = ModelSpec(
        config.model,
        config.device,
        config.dtype,
        config.backend,
        config.kv_pool_tokens,
        config.max_sessions,
    )
    model = CausalLM.load_for_service(spec, "draft", log)
    step_time_s = model.step_time_s()
    drafter = Drafter(model, config.support_size, config.max_sessions)
    engine = Engine(drafter.execute, "draft-engine", inline=torch.get_num_threads() == 1)

    def expire() -> None:
        for sid in engine.run(Expire(config.session_idle_s)):
            log.warning("session %s expired after %.1f s without a proposal", sid, config.session_idle_s)

    sweeper = IdleSweeper(config.session_idle_s, expire, "draft-idle")
    service = Service("draft", config.listen, config.workers, config.grace_s)
    observe_sessions(telemetry.meter, lambda: len(drafter.sessions), "draft sessions open")
    observe_peak_memory(telemetry.meter, model.device)
    fingerprint = load_fingerprint(config.model)
    servicer = DraftServicer(
        drafter, engine, config.model, step_time_s, fingerprint, probe, log, telemetry, config.session_idle_s
    )
    service.add(
        draft_pb2.DESCRIPTOR.services_by_name["Draft"].full_name,
        lambda server: draft_pb2_grpc.add_DraftServicer_to_server(servicer, server),
    )
    service.start()
    log.info(
        "serving %s (%d parameters, %s runtime, step %.2f ms) on %s",
        config.model,
        model.parameters,
        model.backend,
        step_time_s * 1e3,
        config.listen,
    )
    service.wait_for_signal()
    log.info("shutting down")
    service.stop()
    sweeper.stop()
    engine.stop()
    telemetry.shutdown(config.grace_s)
    return 0
