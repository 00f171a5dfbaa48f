"""The verify service's gRPC server: `python -m verify_service`."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc
import torch

from specdec import defaults
from specdec.costs import (
    CALIBRATION_CONTEXT,
    batch_forward_seconds,
    calibration_context,
    context_ratios,
    forward_seconds,
)
from specdec.errors import ServiceError
from specdec.facts import kv_pool_info, peer_facts
from specdec.fingerprint import load_fingerprint
from specdec.flags import option, parse_config
from specdec.host import HostProbe
from specdec.idle import IdleSweeper
from specdec.metrics import ForwardMetrics, ModeMetrics, SpeculationMetrics, observe_peak_memory, observe_sessions
from specdec.pairing import PairingPolicy, base_record
from specdec.requests import SPECULATION_MODES
from specdec.runtime import CausalLM, ModelSpec
from specdec.serving import Service, setup_logging
from specdec.telemetry import Telemetry, incoming
from specdec.v1 import pairing_pb2, verify_pb2, verify_pb2_grpc
from verify_service.admission import Limits
from verify_service.auto_mode import AutoPolicy, ServiceAuto, parse_table
from verify_service.decoder import DecodeLimits, Decoder, session_kv_budget
from verify_service.draft_client import DraftClient, DraftDeadlines, DraftLost
from verify_service.round_telemetry import Instruments
from verify_service.step_costs import ContextCost, ServedStepCosts
from verify_service.verifier import Verifier


@dataclass(frozen=True)
class VerifyConfig:
    listen: str = option(defaults.VERIFY_ADDRESS, "address to serve on: host:port or unix:///path")
    model: str = option(defaults.DEFAULT_TARGET, "target model: local directory or hub id")
    draft: str = option(defaults.DRAFT_ADDRESS, "draft service address (unix:///path or host:port); empty for none")
    device: str = option("cpu", "torch device of the model, e.g. cpu or cuda:0")
    dtype: str = option("float32", "model dtype: float32, float16 or bfloat16")
    backend: str = option("auto", "forward implementation: auto, batched or transformers")
    kv_pool_tokens: int = option(
        0,
        "tokens of the target's KV pool, preallocated (each request reserves prompt, max_new_tokens and a "
        "proposal's look-ahead); 0: the context times --max-sessions, at most 1 GiB",
    )
    prefill_chunk_tokens: int = option(
        256, "most prompt positions prefilled per forward, beside the decoding requests' rounds"
    )
    max_new_tokens_limit: int = option(2048, "largest max_new_tokens a request may ask for")
    speculation: str = option("auto", "speculation mode of a request that names none: auto, on or off")
    speculation_policy: str = option(
        "goodput",
        "how AUTO mode chooses k: goodput (each step, from the batch's measured costs and each request's "
        "acceptance), table (k by requests in flight, --speculation-table) or fixed (ON's k under any load)",
    )
    speculation_table: str = option(
        "10:4,20:3,30:2", "the table policy: below BOUND requests in flight, k = K; from the last bound on, target-only"
    )
    max_sessions: int = option(16, "most requests decoded at once (more wait in the queue); sizes the KV budget")
    max_queued: int = option(16, "most requests waiting for a session slot (more get RESOURCE_EXHAUSTED at once)")
    session_kv_mib: float = option(
        0.0, "KV cache one session may reserve, in MiB (larger requests get RESOURCE_EXHAUSTED); 0: the whole context"
    )
    session_idle_s: float = option(60.0, "free a session whose caller takes no message for this many seconds; 0: never")
    require_nvlink: bool = option(False, "refuse a draft on another GPU reached over PCIe only (default: warn)")
    allow_different_tokenizer: bool = option(
        False, "pair with a draft whose tokenizer differs from the target's (same-origin override; shown in Info)"
    )
    allow_memory_pressure: bool = option(
        False, "attach the draft even when the target holds over 70% of its device's memory (override; shown in Info)"
    )
    draft_deadline_factor: float = option(5.0, "a round's draft deadline, in multiples of the expected proposal time")
    draft_deadline_min_ms: float = option(50.0, "the shortest draft deadline of a round, in milliseconds")
    draft_open_timeout_ms: float = option(5000.0, "deadline of the draft's prefill and first proposal, in ms")
    draft_startup_wait_s: float = option(
        10.0,
        "at startup, seconds to wait for a draft service that is not listening yet (it is paired later if it comes up later)",
    )
    threads: int = option(0, "torch CPU threads; 0 keeps torch's default")
    workers: int = option(64, "gRPC handler threads (one per streaming request)")
    grace_s: float = option(5.0, "seconds in-flight streams get to finish after SIGTERM")
    metrics_listen: str = option(
        "", "host:port of the Prometheus /metrics endpoint (port 0: any free port); empty for none"
    )


class VerifyServicer(verify_pb2_grpc.VerifyServicer):
    def __init__(
        self, decoder: Decoder, verifier: Verifier, config: VerifyConfig, pairing: Callable[[], pairing_pb2.Pairing]
    ) -> None:
        self._decoder = decoder
        self._verifier = verifier
        self._config = config
        self._pairing = pairing

    def Decode(self, request: verify_pb2.DecodeRequest, context: grpc.ServicerContext):
        try:
            yield from self._decoder.decode(request, incoming(context), context)
        except ServiceError as err:
            context.abort(err.code, str(err))

    def GetInfo(self, request: verify_pb2.VerifyInfoRequest, context: grpc.ServicerContext):
        model = self._verifier.model
        totals = self._decoder.totals
        return verify_pb2.VerifyInfo(
            model=self._config.model,
            parameters=model.parameters,
            vocab_size=model.vocab_size,
            max_positions=model.max_positions,
            device=str(model.device),
            draft_address=self._config.draft,
            max_new_tokens_limit=self._decoder.limits.max_new_tokens,
            active_sessions=self._decoder.admission.active,
            requests=totals.requests,
            rounds=self._verifier.rounds,
            target_forwards=model.forwards,
            prefills=self._verifier.prefills,
            draft_tokens_proposed=totals.proposed,
            draft_tokens_accepted=totals.accepted,
            runtime=model.backend,
            runtime_detail=model.unbatched_reason or "",
            kv_pool=kv_pool_info(model),
            prefill_chunk_tokens=self._decoder.limits.prefill_chunk_tokens,
            pairing=self._pairing(),
            max_sessions=self._decoder.limits.admission.max_sessions,
            recent=self._decoder.recent(request.recent_requests),
            queued_requests=self._decoder.admission.queued,
            max_queued=self._decoder.limits.admission.max_queued,
            session_kv_budget_bytes=self._decoder.session_kv_budget_bytes,
            session_idle_s=self._decoder.limits.idle_s,
            expired_sessions=totals.expired,
        )


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_config(
        VerifyConfig,
        argv,
        "python -m verify_service",
        "specdec verify service: target model and round loop",
        "SPECDEC_VERIFY",
    )
    return serve(config, HostProbe())


def serve(config: VerifyConfig, probe: HostProbe) -> int:
    """Runs the service until SIGTERM; `probe` reads the host facts (tests play other hosts)."""
    if config.speculation not in SPECULATION_MODES:
        raise SystemExit(f"--speculation: must be one of {', '.join(SPECULATION_MODES)}, not {config.speculation!r}")
    try:
        policy = AutoPolicy(
            schedule=config.speculation_policy,
            table=parse_table(config.speculation_table),
        )
    except ValueError as exc:
        raise SystemExit(f"--speculation-policy/--speculation-table: {exc}") from None
    log = setup_logging("verify")
    telemetry = Telemetry("specdec-verify", config.metrics_listen, log)
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
    model = CausalLM.load_for_service(spec, "target", log)
    tokenizer = load_fingerprint(config.model)
    limits = DecodeLimits(
        max_new_tokens=config.max_new_tokens_limit,
        admission=Limits(config.max_sessions, config.max_queued),
        default_mode=SPECULATION_MODES[config.speculation],
        session_kv_bytes=int(config.session_kv_mib * 2**20),
        idle_s=config.session_idle_s,
        prefill_chunk_tokens=config.prefill_chunk_tokens,
    )
    service = Service("verify", config.listen, config.workers, config.grace_s)
    kv_budget = config.max_sessions * session_kv_budget(model, limits.session_kv_bytes)

    def own_facts() -> pairing_pb2.PeerFacts:
        return peer_facts(model, config.model, tokenizer, probe, kv_budget)

    verifier = Verifier(model)
    auto = ServiceAuto(policy)
    draft = None
    if config.draft:
        deadlines = DraftDeadlines(
            factor=config.draft_deadline_factor,
            floor_s=config.draft_deadline_min_ms / 1e3,
            open_s=config.draft_open_timeout_ms / 1e3,
        )
        pairing_policy = PairingPolicy(
            config.require_nvlink, config.allow_different_tokenizer, config.allow_memory_pressure
        )
        draft = DraftClient(config.draft, deadlines, own_facts, pairing_policy, log)
        try:
            # Pair before serving, so that the first request speculates (services started
            # together come up together); a draft that is not up yet is asked again later.
            draft.attach(wait_s=config.draft_startup_wait_s)
        except DraftLost:
            pass  # attach() logged why; requests run target-only and say so

    def pairing() -> pairing_pb2.Pairing:
        if draft is not None:
            try:
                draft.attach(now=True)  # Info tells the present: a draft that came up since pairs now
            except DraftLost:
                pass  # the record says why
            return draft.pairing
        record = base_record(pairing_pb2.TRANSPORT_UNSPECIFIED, own_facts())
        record.state = pairing_pb2.PAIRING_STATE_NOT_CONFIGURED
        record.detail = "no draft service is configured (--draft is empty)"
        return record

    instruments = Instruments(
        telemetry.tracer, SpeculationMetrics(telemetry.meter), ModeMetrics(telemetry.meter),
        ForwardMetrics(telemetry.meter), config.model,
    )  # fmt: skip
    decoder = Decoder(verifier, draft, limits, instruments, auto, service.drain, log)
    positions = range(1, policy.k_max + 2)
    started = time.perf_counter()
    forward_s = decoder.loop.call(lambda: forward_seconds(model, positions))
    # The batch chooser's grid: sessions up to the most decoded at once, each with a round's
    # positions up to k_max + 1 (the chooser interpolates between them).
    sessions = sorted({min(s, config.max_sessions) for s in (1, 4, 16)})
    each = [p for p in (1, 2, 3, 5, 9, 17) if p <= policy.k_max + 1]
    short = calibration_context(model, CALIBRATION_CONTEXT, each)
    batch_s = decoder.loop.call(lambda: batch_forward_seconds(model, sessions, each, short, repeats=3))
    # The context's cost from one session and the most the pool holds, at the fewest and most
    # positions, each timed behind a context four times longer right after the same forward
    # behind the calibration's: attention's share grows with sessions, rows and context.
    longer, shapes = calibration_context(model, 4 * CALIBRATION_CONTEXT, each), sorted({each[0], each[-1]})
    slower = decoder.loop.call(lambda: context_ratios(model, sessions[-1], shapes, short, longer, repeats=5))
    grid = ServedStepCosts(batch_s) if batch_s else None
    base = {} if grid is None else {(s, p): grid.forward(s, s * p) for s, p in slower}
    context = ContextCost.fitted(short, base, longer, slower)
    auto.calibrate(forward_s, batch_s, context)
    log.info(
        "measured the target's forward for AUTO mode in %.2f s: over 1..%d positions (ms: %s); "
        "sessions x positions each (ms: %s); per further context token, %.3g µs a session and %.3g µs a row",
        time.perf_counter() - started,
        positions[-1],
        " ".join(f"{n}:{s * 1e3:.2f}" for n, s in forward_s.items()),
        " ".join(f"{s}x{p}:{t * 1e3:.2f}" for (s, p), t in batch_s.items()),
        context.per_session * 1e6,
        context.per_row * 1e6,
    )
    sweeper = IdleSweeper(config.session_idle_s, decoder.expire_idle, "verify-idle")
    observe_sessions(telemetry.meter, lambda: decoder.admission.active, "requests being decoded")
    observe_peak_memory(telemetry.meter, model.device)
    servicer = VerifyServicer(decoder, verifier, config, pairing)
    service.add(
        verify_pb2.DESCRIPTOR.services_by_name["Verify"].full_name,
        lambda server: verify_pb2_grpc.add_VerifyServicer_to_server(servicer, server),
    )
    service.start()
    log.info(
        "serving %s (%d parameters, %s runtime) on %s, draft %s",
        config.model,
        model.parameters,
        model.backend,
        config.listen,
        config.draft or "none",
    )
    service.wait_for_signal()
    log.info("shutting down")
    service.stop()
    sweeper.stop()
    decoder.loop.stop()
    if draft is not None:
        draft.close()
    telemetry.shutdown(config.grace_s)
    return 0
