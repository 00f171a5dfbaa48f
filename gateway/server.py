"""The gateway's gRPC server: `python -m gateway`.

Tokenizes and validates requests, calls the verify service's Decode, and turns each
round into a GenerateResponse: UTF-8-safe text deltas, stop sequences, usage.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import NoReturn

import grpc
from opentelemetry import trace
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from gateway.detokenizer import IncrementalDetokenizer
from gateway.limits import VerifyLimits, longest_token_bytes
from gateway.stops import StopMatcher
from gateway.tokenizing import PromptTokenizer
from specdec import defaults, requests
from specdec.errors import InvalidArgument, ServiceError, Unavailable
from specdec.flags import option, parse_config
from specdec import span_attributes as attrs
from specdec.metrics import SpeculationMetrics, observe_sessions
from specdec.serving import Drain, Service, channel_options, remaining_timeout, setup_logging
from specdec.telemetry import Telemetry, incoming, inject, set_error, trace_id_hex
from specdec.usage import UsageTally
from specdec.v1 import common_pb2, generation_pb2, generation_pb2_grpc, verify_pb2, verify_pb2_grpc

TRACE_ID_KEY = "specdec-trace-id"  # trailing metadata of a failed Generate


@dataclass(frozen=True)
class GatewayConfig:
    listen: str = option(defaults.GATEWAY_ADDRESS, "address to serve the public API on: host:port")
    verify: str = option(defaults.VERIFY_ADDRESS, "verify service address: host:port or unix:///path")
    tokenizer: str = option(defaults.DEFAULT_TARGET, "tokenizer of the target model: local directory or hub id")
    default_max_new_tokens: int = option(64, "max_new_tokens of requests that do not set it")
    max_prompt_bytes: int = option(
        0,
        "longest text prompt, in UTF-8 bytes: longer ones are refused (INVALID_ARGUMENT) before they are tokenized; "
        "0: derived, the target's context in tokens (asked of the verify service) times the tokenizer's longest "
        "token in bytes, so that no prompt that could fit is refused",
    )
    tokenize_workers: int = option(
        2, "threads that tokenize text prompts: at most this many are tokenized at once, the rest wait their turn"
    )
    max_stop_sequences: int = option(16, "most stop sequences a request may give")
    max_stop_length: int = option(256, "longest stop sequence, in characters")
    workers: int = option(64, "gRPC handler threads: most calls served at once (more get RESOURCE_EXHAUSTED)")
    grace_s: float = option(5.0, "seconds in-flight streams get to finish after SIGTERM")
    max_message_bytes: int = option(4 * 2**20, "largest request message accepted (larger get RESOURCE_EXHAUSTED)")
    metrics_listen: str = option("", "host:port of the Prometheus /metrics endpoint (port 0: any free port); empty for none")


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompts: PromptTokenizer,
        verify: verify_pb2_grpc.VerifyStub,
        limits: VerifyLimits,
        config: GatewayConfig,
        telemetry: Telemetry,
        drain: Drain,
        log: logging.Logger,
    ) -> None:
        self._tokenizer = tokenizer
        self._log = log
        self._prompts = prompts
        self._verify = verify
        self._limits = limits
        self._config = config
        self._drain = drain
        self._tracer = telemetry.tracer
        self._metrics = SpeculationMetrics(telemetry.meter)
        self._lock = threading.Lock()
        self.streams = 0  # Generate calls in progress
        observe_sessions(telemetry.meter, lambda: self.streams, "Generate streams in progress")

    def Generate(self, request: generation_pb2.GenerateRequest, context: grpc.ServicerContext):
        """Streams one completion under the request's root span (a child of the client's
        trace context, when it sent one); the first message names the trace."""
        span = self._tracer.start_span(attrs.GENERATE, context=incoming(context), kind=trace.SpanKind.SERVER)
        trace_id = trace_id_hex(span)
        with self._lock:
            self.streams += 1
        try:
            yield from self._generate(request, context, span, trace_id)
        except GeneratorExit:  # the client went away mid-stream
            set_error(span, grpc.StatusCode.CANCELLED, "the client cancelled the stream")
            raise
        except Exception as err:
            if context.code() is not None:  # _generate's own abort, with the status it chose
                raise
            # A bug: the trace and the log get its text, the client a short reason.
            span.record_exception(err)
            set_error(span, grpc.StatusCode.INTERNAL, repr(err))
            self._log.exception("Generate failed (trace %s)", trace_id)
            context.set_trailing_metadata(((TRACE_ID_KEY, trace_id),))
            reason = f"the gateway failed: an internal error, logged under trace {trace_id}"
            context.abort(grpc.StatusCode.INTERNAL, reason)
        finally:
            with self._lock:
                self.streams -= 1
            span.end()

    def _generate(
        self, request: generation_pb2.GenerateRequest, context: grpc.ServicerContext, span: trace.Span, trace_id: str
    ) -> Iterator[generation_pb2.GenerateResponse]:
        def abort(code: grpc.StatusCode, message: str) -> NoReturn:
            set_error(span, code, message)
            context.set_trailing_metadata(((TRACE_ID_KEY, trace_id),))
            context.abort(code, message)

        try:
            decode_request = self._decode_request(request, context)
        except ServiceError as err:
            abort(err.code, str(err))
        s = decode_request.sampling
        span.set_attributes(
            attrs.request(self._config.tokenizer, decode_request.max_new_tokens, s.temperature, s.top_k, s.top_p)
        )
        metadata = inject(trace.set_span_in_context(span))
        call = self._verify.Decode(decode_request, timeout=remaining_timeout(context), metadata=metadata)
        context.add_callback(call.cancel)  # a client that leaves frees the verify session
        started = time.perf_counter()
        try:
            for i, response in enumerate(self._stream(call, request.stop, len(decode_request.prompt_ids))):
                if i == 0:
                    response.trace_id = trace_id
                    span.set_attributes(attrs.speculation(response.speculation))
                self._metrics.speculated(response.round.draft_tokens, response.round.accepted_tokens)
                self._metrics.generated.add(len(response.token_ids))
                if response.finish_reason:
                    span.set_attributes(attrs.usage(response.usage, response.finish_reason))
                    elapsed = time.perf_counter() - started
                    self._metrics.tokens_per_second.record(response.usage.completion_tokens / elapsed)
                else:
                    self._drain.check()
                yield response
        except grpc.RpcError as err:
            details = err.details()
            if err.code() == grpc.StatusCode.UNAVAILABLE:  # name the service that is down
                details = f"verify service at {self._config.verify}: {details}"
            abort(err.code(), details)
        except ServiceError as err:
            abort(err.code, str(err))
        finally:
            call.cancel()  # after a stop sequence this frees the verify session; else a no-op

    def GetInfo(self, request: generation_pb2.GatewayInfoRequest, context: grpc.ServicerContext):
        try:
            verify = self._verify.GetInfo(
                verify_pb2.VerifyInfoRequest(recent_requests=request.recent_requests), timeout=remaining_timeout(context)
            )
        except grpc.RpcError as err:
            context.abort(err.code(), f"verify service at {self._config.verify}: {err.details()}")
        return generation_pb2.GatewayInfo(
            verify_address=self._config.verify, tokenizer=self._config.tokenizer, verify=verify, active_streams=self.streams
        )

    def _decode_request(
        self, request: generation_pb2.GenerateRequest, context: grpc.ServicerContext
    ) -> verify_pb2.DecodeRequest:
        """Validates the request, cheapest checks first: a text prompt is measured before
        it is tokenized, and the tokens against the context before a DecodeRequest is built."""
        which = request.WhichOneof("prompt")
        text = request.text if which == "text" else ""  # each read of a string field copies it
        if not (text or (which == "token_ids" and request.token_ids.ids)):
            raise InvalidArgument("prompt: must be a non-empty text or list of token ids")
        if len(request.stop) > self._config.max_stop_sequences:
            raise InvalidArgument(f"stop: at most {self._config.max_stop_sequences} sequences, got {len(request.stop)}")
        for stop in request.stop:
            if not 1 <= len(stop) <= self._config.max_stop_length:
                raise InvalidArgument(f"stop: each sequence must have 1..{self._config.max_stop_length} characters")
        num_draft_tokens = 0  # the verify service's default
        if request.speculation.HasField("num_draft_tokens"):
            num_draft_tokens = requests.check_num_draft_tokens(request.speculation.num_draft_tokens)
        limits = self._limits.get(remaining_timeout(context))
        if text:
            requests.check_prompt_text(text, limits.max_text_bytes, limits.context)
            prompt_ids = self._prompts.encode(text, context)
            requests.check_prompt_length(len(prompt_ids), limits.context)
        else:
            requests.check_prompt_length(len(request.token_ids.ids), limits.context)
            prompt_ids = list(request.token_ids.ids)
        defaulted = not request.HasField("max_new_tokens")
        max_new_tokens = requests.check_max_new_tokens(
            self._config.default_max_new_tokens if defaulted else request.max_new_tokens,
            limits.max_new_tokens,
            len(prompt_ids),
            limits.context,
            defaulted,
        )
        sampling = common_pb2.SamplingParams(
            temperature=request.temperature if request.HasField("temperature") else 0.0,
            top_k=request.top_k if request.HasField("top_k") else 0,
            top_p=request.top_p if request.HasField("top_p") else 1.0,
        )
        if request.HasField("seed"):
            sampling.seed = request.seed
        return verify_pb2.DecodeRequest(
            prompt_ids=prompt_ids,
            max_new_tokens=max_new_tokens,
            sampling=sampling,
            speculation=request.speculation.mode,
            num_draft_tokens=num_draft_tokens,
        )

    def _stream(
        self, chunks: Iterator[verify_pb2.DecodeChunk], stop: Sequence[str], prompt_tokens: int
    ) -> Iterator[generation_pb2.GenerateResponse]:
        detokenizer = IncrementalDetokenizer(self._tokenizer)
        stops = StopMatcher(stop)
        usage = UsageTally(prompt_tokens=prompt_tokens)
        for chunk in chunks:
            ids: list[int] = []
            text: list[str] = []
            stopped = False
            for token in chunk.token_ids:  # token by token, to cut right after a stop
                ids.append(token)
                delta, stopped = stops.feed(detokenizer.add([token]))
                text.append(delta)
                if stopped:
                    break
            usage.add(chunk.round, len(ids))
            finish = common_pb2.FINISH_REASON_STOP if stopped else chunk.finish_reason
            if finish and not stopped:
                tail, stopped = stops.feed(detokenizer.flush())
                text.append(tail if stopped else tail + stops.flush())
                finish = common_pb2.FINISH_REASON_STOP if stopped else finish
            response = generation_pb2.GenerateResponse(
                text="".join(text), token_ids=ids, round=chunk.round, speculation=chunk.speculation
            )
            if finish:
                response.finish_reason = finish
                response.usage.CopyFrom(usage.to_proto())
                yield response
                return
            yield response
        raise Unavailable("the verify service ended the stream before the completion finished")


def follow_verify_health(channel: grpc.Channel, service: Service, log: logging.Logger) -> None:
    """The gateway reports NOT_SERVING while its verify service cannot be reached (a load
    balancer then sends clients elsewhere) and SERVING again once the channel is back;
    gRPC reconnects by itself."""

    def changed(state: grpc.ChannelConnectivity) -> None:
        if state == grpc.ChannelConnectivity.READY:
            service.set_serving(True)
            log.info("verify service reachable")
        elif state == grpc.ChannelConnectivity.TRANSIENT_FAILURE:
            service.set_serving(False)
            log.warning("verify service unreachable: answering UNAVAILABLE until it is back")

    channel.subscribe(changed, try_to_connect=True)


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_config(GatewayConfig, argv, "python -m gateway", "specdec gateway: the public Generation API", "SPECDEC_GATEWAY")
    if config.max_prompt_bytes < 0:
        raise SystemExit(f"--max-prompt-bytes: must be >= 0 (0: derived), not {config.max_prompt_bytes}")
    if config.tokenize_workers < 1:
        raise SystemExit(f"--tokenize-workers: must be >= 1, not {config.tokenize_workers}")
    log = setup_logging("gateway")
    telemetry = Telemetry("specdec-gateway", config.metrics_listen, log)
    tokenizer = AutoTokenizer.from_pretrained(config.tokenizer)
    prompts = PromptTokenizer(tokenizer, config.tokenize_workers)
    channel = grpc.insecure_channel(config.verify, options=channel_options())
    verify = verify_pb2_grpc.VerifyStub(channel)
    limits = VerifyLimits(verify, config.verify, longest_token_bytes(tokenizer), config.max_prompt_bytes, log)
    service = Service("gateway", config.listen, config.workers, config.grace_s, config.max_message_bytes)
    servicer = GenerationServicer(tokenizer, prompts, verify, limits, config, telemetry, service.drain, log)
    service.add(
        generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name,
        lambda server: generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server),
    )
    service.start()
    follow_verify_health(channel, service, log)
    log.info("serving the Generation API on %s, verify service at %s", config.listen, config.verify)
    service.wait_for_signal()
    log.info("shutting down")
    service.stop()
    prompts.shutdown()
    channel.close()
    telemetry.shutdown(config.grace_s)
    return 0
