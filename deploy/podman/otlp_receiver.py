"""A stand-in for Jaeger in `make test-deploy`: an OTLP gRPC trace receiver that prints every span it gets.

No Jaeger image can be pulled on the machine the check runs on, so the compose file's `jaeger` service runs this
instead (deploy/podman/compose.test.yml), on the same name and port the services send to (jaeger:4317). Each span
becomes one JSON line on stdout, which deploy/podman/test_compose_cluster.py reads with `podman logs`; `peer` is
the address of the container that exported it:
  {"service": "pdserve-gateway", "peer": "10.89.0.5", "name": "...", "trace_id": "<hex>", "span_id": "<hex>",
   "parent_id": "<hex>", "attributes": {...}}
"""

from __future__ import annotations

import json
import signal
import sys
import threading
from concurrent import futures
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind in ("string_value", "bool_value", "int_value", "double_value") else str(value)


_OUT = threading.Lock()  # Export runs on several threads: print() writes a line and its newline apart, so two
# threads' spans could share one line. Each line is written whole, under the lock.


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    def Export(self, request: trace_service_pb2.ExportTraceServiceRequest,  # noqa: N802 (the proto's name)
               context: grpc.ServicerContext) -> trace_service_pb2.ExportTraceServiceResponse:
        peer = context.peer().removeprefix("ipv4:").rsplit(":", 1)[0]  # "ipv4:10.89.0.5:41234"
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    line = json.dumps({"service": resource.get("service.name", ""), "peer": peer, "name": span.name,
                                       "trace_id": span.trace_id.hex(), "span_id": span.span_id.hex(),
                                       "parent_id": span.parent_span_id.hex(),
                                       "attributes": {a.key: _value(a.value) for a in span.attributes}})
                    with _OUT:
                        sys.stdout.write(line + "\n")
                        sys.stdout.flush()
        return trace_service_pb2.ExportTraceServiceResponse()


def main() -> None:
    port = int(sys.argv[1]) if len(sys.argv) > 1 else 4317
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Receiver(), server)
    server.add_insecure_port(f"0.0.0.0:{port}")
    server.start()
    print(f"OTLP trace receiver on 0.0.0.0:{port}", file=sys.stderr, flush=True)
    signal.signal(signal.SIGTERM, lambda *_: server.stop(1))  # PID 1 in its container: SIGTERM needs a handler
    server.wait_for_termination()


if __name__ == "__main__":
    main()
