"""The verify service's gRPC server: `python -m verify_service`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import torch

from specdec import defaults
from specdec.engine import Engine
from specdec.errors import ServiceError
from specdec.flags import option, parse_config
from specdec.runtime import CausalLM, ModelSpec
from specdec.serving import Service, setup_logging
from specdec.v1 import verify_pb2, verify_pb2_grpc
from verify_service.decoder import Decoder
from verify_service.draft_client import DraftClient, DraftDeadlines
from verify_service.verifier import Verifier


@dataclass(frozen=True)
class VerifyConfig:
    listen: str = option(defaults.VERIFY_ADDRESS, "address to serve on: host:port or unix:///path")
    model: str = option(defaults.DEFAULT_TARGET, "target model: local directory or hub id")
    draft: str = option(defaults.DRAFT_ADDRESS, "draft service address (unix:///path or host:port); empty for none")
    device: str = option("cpu", "torch device of the model, e.g. cpu or cuda:0")
    dtype: str = option("float32", "model dtype: float32, float16 or bfloat16")
    backend: str = option("auto", "forward implementation: auto, static-gpt2 or transformers")
    max_new_tokens_limit: int = option(2048, "largest max_new_tokens a request may ask for")
    draft_deadline_factor: float = option(5.0, "a round's draft deadline, in multiples of the expected proposal time")
    draft_deadline_min_ms: float = option(50.0, "the shortest draft deadline of a round, in milliseconds")
    draft_open_timeout_ms: float = option(5000.0, "deadline of the draft's prefill and first proposal, in ms")
    threads: int = option(0, "torch CPU threads; 0 keeps torch's default")
    workers: int = option(64, "gRPC handler threads (one per streaming request)")
    grace_s: float = option(5.0, "seconds in-flight streams get to finish after SIGTERM")


class VerifyServicer(verify_pb2_grpc.VerifyServicer):
    def __init__(self, decoder: Decoder, verifier: Verifier, config: VerifyConfig) -> None:
        self._decoder = decoder
        self._verifier = verifier
        self._config = config

    def Decode(self, request: verify_pb2.DecodeRequest, context: grpc.ServicerContext):
        try:
            plan = self._decoder.plan(request)
        except ServiceError as err:
            context.abort(err.code, str(err))
        yield from self._decoder.decode(plan)

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
            max_new_tokens_limit=self._decoder.max_new_tokens_limit,
            active_sessions=totals.active,
            requests=totals.requests,
            rounds=self._verifier.rounds,
            target_forwards=model.forwards,
            prefills=self._verifier.prefills,
            draft_tokens_proposed=totals.proposed,
            draft_tokens_accepted=totals.accepted,
            runtime=model.backend,
        )


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_config(
        VerifyConfig, argv, "python -m verify_service", "specdec verify service: target model and round loop", "SPECDEC_VERIFY"
    )
    log = setup_logging("verify")
    if config.threads:
        torch.set_num_threads(config.threads)
    model = CausalLM.load(ModelSpec(config.model, config.device, config.dtype, config.backend))
    verifier = Verifier(model)
    engine = Engine(verifier.execute, "verify-engine")
    draft = None
    if config.draft:
        deadlines = DraftDeadlines(
            factor=config.draft_deadline_factor,
            floor_s=config.draft_deadline_min_ms / 1e3,
            open_s=config.draft_open_timeout_ms / 1e3,
        )
        draft = DraftClient(config.draft, deadlines, model.vocab_size)
    decoder = Decoder(engine, model, draft, config.max_new_tokens_limit)
    service = Service("verify", config.listen, config.workers, config.grace_s)
    servicer = VerifyServicer(decoder, verifier, config)
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
    engine.stop()
    if draft is not None:
        draft.close()
    return 0
