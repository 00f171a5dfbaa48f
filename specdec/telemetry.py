"""OpenTelemetry of one service process: traces, metrics and the trace context on the wire.

- Traces: an SDK tracer provider in every service, so trace ids exist (and reach clients)
  whether or not anything is exported. Spans are exported by OTLP/gRPC when the standard
  variables name an endpoint (OTEL_EXPORTER_OTLP_ENDPOINT or ..._TRACES_ENDPOINT) and
  OTEL_TRACES_EXPORTER is not "none"; sampling follows OTEL_TRACES_SAMPLER(_ARG) and the
  service name OTEL_SERVICE_NAME. Export runs on the batching processor's own thread with
  a bounded queue (OTEL_BSP_*), so a slow or dead collector drops spans, never requests.
- Metrics: an SDK meter provider read by a Prometheus endpoint (`--metrics-listen`) and,
  with an OTLP endpoint, by a periodic OTLP exporter (OTEL_METRICS_EXPORTER=none stops it).
- Context: W3C `traceparent` in gRPC metadata, injected and extracted explicitly; in the
  message itself on a stream whose messages have different parents (draft proposals).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
from opentelemetry import context as otel_context
from opentelemetry import metrics, trace
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from prometheus_client import CollectorRegistry, start_http_server

Metadata = Sequence[tuple[str, str]]
_PROPAGATOR = TraceContextTextMapPropagator()


@dataclass(frozen=True)
class ExportSettings:
    """Which OTLP exports the environment asks for."""

    traces: bool
    metrics: bool
    endpoint: str  # for the log line; the exporters read the variables themselves

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> ExportSettings:
        env = dict(os.environ) if env is None else env
        traces_endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "")
        metrics_endpoint = env.get("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "")
        return cls(
            traces=bool(traces_endpoint) and env.get("OTEL_TRACES_EXPORTER", "otlp") != "none",
            metrics=bool(metrics_endpoint) and env.get("OTEL_METRICS_EXPORTER", "otlp") != "none",
            endpoint=traces_endpoint or metrics_endpoint,
        )


def _resource(default_service_name: str) -> Resource:
    named = "OTEL_SERVICE_NAME" in os.environ or "service.name=" in os.environ.get("OTEL_RESOURCE_ATTRIBUTES", "")
    return Resource.create({} if named else {SERVICE_NAME: default_service_name})


class Telemetry:
    """The tracer and meter of one service process, and their exporters."""

    def __init__(self, default_service_name: str, metrics_listen: str, log: logging.Logger) -> None:
        self._log = log
        resource = _resource(default_service_name)
        self.service_name = str(resource.attributes[SERVICE_NAME])
        settings = ExportSettings.from_env()
        # shutdown_on_exit=False: shutdown() bounds the wait by the grace period instead.
        self._tracer_provider = TracerProvider(resource=resource, shutdown_on_exit=False)
        if settings.traces:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            self._tracer_provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        readers: list[MetricReader] = []
        self._http = None
        self.metrics_port = 0
        if metrics_listen:
            registry = CollectorRegistry()
            readers.append(PrometheusMetricReader(registry=registry))
            host, _, port = metrics_listen.rpartition(":")
            try:
                self._http, _ = start_http_server(int(port), host or "0.0.0.0", registry=registry)
            except (ValueError, OSError) as err:
                raise SystemExit(f"--metrics-listen {metrics_listen!r}: cannot serve metrics there: {err}") from None
            self.metrics_port = self._http.server_port
        if settings.metrics:
            from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter

            readers.append(PeriodicExportingMetricReader(OTLPMetricExporter()))
        self._meter_provider = MeterProvider(resource=resource, metric_readers=readers, shutdown_on_exit=False)
        self.tracer: trace.Tracer = self._tracer_provider.get_tracer("specdec")
        self.meter: metrics.Meter = self._meter_provider.get_meter("specdec")
        log.info(
            "telemetry: service %s; traces %s; metrics %s%s",
            self.service_name,
            f"exported by OTLP to {settings.endpoint}" if settings.traces else "not exported (no OTLP endpoint set)",
            f"on http://{host}:{self.metrics_port}/metrics" if metrics_listen else "without a Prometheus endpoint",
            f" and by OTLP to {settings.endpoint}" if settings.metrics else "",
        )

    def shutdown(self, timeout_s: float) -> None:
        """Flushes what is queued for at most timeout_s (the service's grace period)."""
        if self._http is not None:
            self._http.shutdown()
        done = threading.Event()

        def run() -> None:
            self._tracer_provider.shutdown()
            self._meter_provider.shutdown(timeout_millis=timeout_s * 1e3)
            done.set()

        threading.Thread(target=run, name="telemetry-shutdown", daemon=True).start()
        if not done.wait(timeout_s):
            self._log.warning("telemetry: the exporter did not finish within %.1f s; queued spans are dropped", timeout_s)


def inject(ctx: otel_context.Context) -> list[tuple[str, str]]:
    """gRPC metadata carrying ctx's span as the parent of the callee's spans."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=ctx)
    return list(carrier.items())


def extract(metadata: Metadata | None) -> otel_context.Context:
    """The caller's trace context from gRPC metadata (an empty context when there is none)."""
    return _PROPAGATOR.extract({key: value for key, value in metadata or ()})


def traceparent(ctx: otel_context.Context) -> str:
    """ctx's span as a W3C traceparent value, for a message that carries its own parent."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=ctx)
    return carrier.get("traceparent", "")


def from_traceparent(value: str) -> otel_context.Context:
    """The context a traceparent value names (an empty context for an empty value)."""
    return _PROPAGATOR.extract({"traceparent": value} if value else {})


def incoming(context: grpc.ServicerContext) -> otel_context.Context:
    return extract(context.invocation_metadata())


def trace_id_hex(span: trace.Span) -> str:
    """The span's W3C trace id, 32 hex digits."""
    return trace.format_trace_id(span.get_span_context().trace_id)


def set_error(span: trace.Span, code: grpc.StatusCode, message: str) -> None:
    """Marks a span failed with the gRPC status the caller receives."""
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    span.set_status(trace.Status(trace.StatusCode.ERROR, f"{code.name}: {message}"))
