"""OpenTelemetry tracing for every service: one trace per request across gateway, prefill, KV transfer, decode.

Off unless `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set, and
`OTEL_SDK_DISABLED` is not "true": then spans go to that OTLP gRPC endpoint (Jaeger accepts it on 4317), batched
as the standard `OTEL_BSP_*` variables say. Off, the API's no-op tracer costs a function call per span.

The W3C trace context travels in gRPC metadata (`traceparent`) on every call, set here by hand rather than by the
aio client interceptor, which swallows cancellation (opentelemetry-python-contrib#3271). The KV stream carries
it in its header too, so decode's receive span is a child of prefill's send span.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

from opentelemetry import context, trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_propagator = TraceContextTextMapPropagator()
_provider: object | None = None


def setup(service: str) -> None:
    """Install the OTLP exporter for `service` when the environment asks for one (see the module's doc)."""
    global _provider
    endpoint = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if not endpoint or os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": f"pdserve-{service}"}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=True)))
    trace.set_tracer_provider(provider)
    _provider = provider


def shutdown() -> None:
    """Flush the spans still buffered (at exit)."""
    if _provider is not None:
        _provider.shutdown()  # type: ignore[attr-defined]


tracer = trace.get_tracer("pdserve")


def outgoing() -> list[tuple[str, str]]:
    """gRPC metadata carrying the current span's context to the next hop."""
    carrier: dict[str, str] = {}
    _propagator.inject(carrier)
    return list(carrier.items())


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
