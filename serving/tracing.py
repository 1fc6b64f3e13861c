"""OpenTelemetry tracing for every service: one trace per request across gateway, prefill, KV transfer, decode.

Off unless one of two places to send spans is given (and `OTEL_SDK_DISABLED` is not "true"):
- `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`): an OTLP gRPC endpoint (Jaeger accepts
  it on 4317), batched as the standard `OTEL_BSP_*` variables say;
- `PDSERVE_TRACE_DIR`: a local capture, each process appending OTLP JSON lines (one ExportTraceServiceRequest per
  batch, the OpenTelemetry Collector file exporter's format) to `<dir>/<service>-<pid>.jsonl`, which
  `pdserve trace REQUEST_ID` reads.
Off, the API's no-op tracer costs a function call per span, and work recorded for spans only (decode steps) is
skipped: `recording()` says whether anyone listens.

The W3C trace context travels in gRPC metadata (`traceparent`) on every call, set here by hand rather than by the
aio client interceptor, which swallows cancellation (opentelemetry-python-contrib#3271). The KV stream carries
it in its header too, so decode's receive span is a child of prefill's send span.
"""

from __future__ import annotations

import base64
import json
import os
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from opentelemetry import context, trace
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

TRACE_DIR_ENV = "PDSERVE_TRACE_DIR"

_propagator = TraceContextTextMapPropagator()
_provider: object | None = None


def setup(service: str, endpoint: str = "", directory: str = "") -> None:
    """Install the exporters for `service`: the flags' endpoint and directory, else the environment's (see the
    module's doc)."""
    global _provider
    endpoint = (endpoint or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
                or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", ""))
    directory = directory or os.environ.get(TRACE_DIR_ENV, "")
    if not (endpoint or directory) or os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": f"pdserve-{service}"}))
    if endpoint:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=True)))
    if directory:
        Path(directory).mkdir(parents=True, exist_ok=True)
        path = Path(directory) / f"{service}-{os.getpid()}.jsonl"
        provider.add_span_processor(BatchSpanProcessor(_FileExporter(path)))
    trace.set_tracer_provider(provider)
    _provider = provider


def shutdown() -> None:
    """Flush the spans still buffered (at exit)."""
    if _provider is not None:
        _provider.shutdown()  # type: ignore[attr-defined]


tracer = trace.get_tracer("pdserve")


def recording() -> bool:
    """Whether spans go anywhere (tracing was set up in this process)."""
    return _provider is not None


def wall_ns(perf: float) -> int:
    """A `time.perf_counter()` reading as the wall-clock nanoseconds spans are stamped with."""
    return time.time_ns() - int((time.perf_counter() - perf) * 1e9)


def record(name: str, parent: context.Context | None, start: float, end: float,
           attributes: Mapping[str, Any] | None = None) -> None:
    """A span for work already done, between two `perf_counter()` readings (work timed on an engine thread)."""
    span = tracer.start_span(name, context=parent, start_time=wall_ns(start), attributes=attributes)
    span.end(end_time=wall_ns(end))


class _FileExporter(SpanExporter):
    """Appends each batch as one OTLP JSON line (ids in hex, as OTLP JSON has them): what `pdserve trace` reads."""

    def __init__(self, path: Path) -> None:
        self._path, self._lock = path, threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        from google.protobuf.json_format import MessageToDict
        from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

        batch = MessageToDict(encode_spans(spans))
        for resource in batch.get("resourceSpans", []):
            for scope in resource.get("scopeSpans", []):
                for span in scope.get("spans", []):
                    for key in ("traceId", "spanId", "parentSpanId"):
                        if key in span:
                            span[key] = base64.b64decode(span[key]).hex()
        with self._lock, self._path.open("a") as out:
            out.write(json.dumps(batch, separators=(",", ":")) + "\n")
        return SpanExportResult.SUCCESS


def outgoing() -> list[tuple[str, str]]:
    """gRPC metadata carrying the current span's context to the next hop."""
    return list(carrier().items())


def carrier() -> dict[str, str]:
    """The current span's context as a string map (the KV header's `trace_context`)."""
    found: dict[str, str] = {}
    _propagator.inject(found)
    return found


def incoming(metadata: Iterable[tuple[str, str | bytes]] | Mapping[str, str] | None) -> context.Context:
    """The context a caller sent (gRPC metadata pairs or a string map); empty when it sent none."""
    if metadata is None:
        return context.Context()
    pairs = metadata.items() if isinstance(metadata, Mapping) else metadata
    found = {key: value for key, value in pairs if isinstance(value, str)}
    return _propagator.extract(found)
