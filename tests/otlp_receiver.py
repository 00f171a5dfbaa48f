"""An OTLP/gRPC receiver (the protocol Jaeger takes on port 4317), for tests.

In a test: `with OtlpReceiver() as receiver:` listens on a free loopback port and keeps
every span it is sent; `receiver.spans()` returns them flattened. As a program (the
stand-in for Jaeger in the compose test): `python -m tests.otlp_receiver --listen
0.0.0.0:4317 --out spans.jsonl` appends one JSON line per received span.
"""

from __future__ import annotations

import argparse
import json
import signal
import threading
from collections.abc import Callable
from concurrent import futures
from dataclasses import asdict, dataclass, field
from typing import Any

import grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2


@dataclass(frozen=True)
class ReceivedSpan:
    service: str  # the resource's service.name
    name: str
    trace_id: str  # 32 hex digits
    span_id: str  # 16 hex digits
    parent_span_id: str  # 16 hex digits; empty for a root span
    kind: int  # opentelemetry.proto.trace.v1.Span.SpanKind
    start_ns: int
    end_ns: int
    status_code: int  # 0 unset, 1 ok, 2 error
    status_message: str
    attributes: dict[str, Any] = field(default_factory=dict)


def _value(v: common_pb2.AnyValue) -> Any:
    which = v.WhichOneof("value")
    if which == "array_value":
        return [_value(x) for x in v.array_value.values]
    if which == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, which) if which else None


def flatten(request: trace_service_pb2.ExportTraceServiceRequest) -> list[ReceivedSpan]:
    spans = []
    for resource_spans in request.resource_spans:
        resource = {kv.key: _value(kv.value) for kv in resource_spans.resource.attributes}
        for scope_spans in resource_spans.scope_spans:
            for s in scope_spans.spans:
                spans.append(
                    ReceivedSpan(
                        service=str(resource.get("service.name", "")),
                        name=s.name,
                        trace_id=s.trace_id.hex(),
                        span_id=s.span_id.hex(),
                        parent_span_id=s.parent_span_id.hex(),
                        kind=s.kind,
                        start_ns=s.start_time_unix_nano,
                        end_ns=s.end_time_unix_nano,
                        status_code=s.status.code,
                        status_message=s.status.message,
                        attributes={kv.key: _value(kv.value) for kv in s.attributes},
                    )
                )
    return spans


class _Traces(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, sink: Callable[[list[ReceivedSpan]], None]) -> None:
        self._sink = sink

    def Export(self, request, context):
        self._sink(flatten(request))
        return trace_service_pb2.ExportTraceServiceResponse()


class _Metrics(metrics_service_pb2_grpc.MetricsServiceServicer):
    def __init__(self, sink: Callable[[metrics_service_pb2.ExportMetricsServiceRequest], None]) -> None:
        self._sink = sink

    def Export(self, request, context):
        self._sink(request)
        return metrics_service_pb2.ExportMetricsServiceResponse()


class OtlpReceiver:
    """Receives OTLP traces and metrics over gRPC on `listen` (port 0: a free port)."""

    def __init__(self, listen: str = "127.0.0.1:0", on_spans: Callable[[list[ReceivedSpan]], None] | None = None):
        self._lock = threading.Lock()
        self._spans: list[ReceivedSpan] = []
        self.metric_names: set[str] = set()
        self._on_spans = on_spans
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_Traces(self._add_spans), self._server)
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(_Metrics(self._add_metrics), self._server)
        self.port = self._server.add_insecure_port(listen)
        self.host = listen.rsplit(":", 1)[0]

    @property
    def endpoint(self) -> str:
        """The value for OTEL_EXPORTER_OTLP_ENDPOINT."""
        return f"http://{self.host}:{self.port}"

    def _add_spans(self, spans: list[ReceivedSpan]) -> None:
        with self._lock:
            self._spans += spans
        if self._on_spans is not None:
            self._on_spans(spans)

    def _add_metrics(self, request: metrics_service_pb2.ExportMetricsServiceRequest) -> None:
        names = {m.name for rm in request.resource_metrics for sm in rm.scope_metrics for m in sm.metrics}
        with self._lock:
            self.metric_names |= names

    def spans(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self._spans)

    def start(self) -> OtlpReceiver:
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop(0).wait()

    def __enter__(self) -> OtlpReceiver:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def span_tree(spans: list[ReceivedSpan]) -> str:
    """One line per span, children indented under parents, with durations and the round
    attributes: what Jaeger's trace view shows, as text."""
    children: dict[str, list[ReceivedSpan]] = {}
    ids = {s.span_id for s in spans}
    for span in sorted(spans, key=lambda s: s.start_ns):
        children.setdefault(span.parent_span_id if span.parent_span_id in ids else "", []).append(span)
    lines: list[str] = []

    def walk(parent: str, depth: int) -> None:
        for span in children.get(parent, []):
            a = span.attributes
            detail = ""
            if span.name == "round":
                detail = (
                    f"  k={a['specdec.round.draft_tokens']} accepted={a['specdec.round.accepted_tokens']}"
                    f" {'bonus' if a['specdec.round.bonus'] else 'correction' if a['specdec.round.correction'] else ''}"
                )
            label = f"{'  ' * depth}{span.name} [{span.service}]"
            lines.append(f"{label:<44}{(span.end_ns - span.start_ns) / 1e6:>9.2f} ms{detail}")
            walk(span.span_id, depth + 1)

    walk("", 0)
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.otlp_receiver", description=__doc__.split("\n\n")[0])
    parser.add_argument("--listen", default="0.0.0.0:4317", help="host:port to receive OTLP/gRPC on")
    parser.add_argument("--out", required=True, help="file to append received spans to, one JSON object per line")
    args = parser.parse_args()
    out = open(args.out, "a", encoding="utf-8")
    write_lock = threading.Lock()

    def write(spans: list[ReceivedSpan]) -> None:
        with write_lock:
            for span in spans:
                out.write(json.dumps(asdict(span)) + "\n")
            out.flush()

    receiver = OtlpReceiver(args.listen, on_spans=write).start()
    print(f"OTLP receiver on {args.listen}, spans to {args.out}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    receiver.stop()
    out.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
