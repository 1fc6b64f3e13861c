"""One trace per request across the three processes, received by a real OTLP gRPC trace service (what Jaeger
accepts on 4317): the parent/child links hold across every hop, the KV transfer's send -> receive included."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2

from pdserve.client import generate
from pdserve.cluster import Cluster
from protos import gateway_pb2, gateway_pb2_grpc
from tests.helpers import assert_nothing_held, start_cluster

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


class _Collector(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans: list[tuple[str, trace_pb2.Span]] = []  # (service, span)
        self._lock = threading.Lock()

    def Export(self, request: trace_service_pb2.ExportTraceServiceRequest, context: object) -> object:
        with self._lock:
            for resource_spans in request.resource_spans:
                service = next(a.value.string_value for a in resource_spans.resource.attributes
                               if a.key == "service.name")
                self.spans += [(service, span) for scope in resource_spans.scope_spans for span in scope.spans]
        return trace_service_pb2.ExportTraceServiceResponse()

    def trace(self, trace_id: bytes, names: set[str], timeout_s: float = 20) -> dict[str, tuple[str, trace_pb2.Span]]:
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                found = {span.name: (service, span) for service, span in self.spans if span.trace_id == trace_id}
            if names <= set(found) or time.monotonic() > deadline:
                return found
            time.sleep(0.05)


@dataclass
class Traced:
    cluster: Cluster
    collector: _Collector
    capture: Path  # PDSERVE_TRACE_DIR: what `pdserve trace` reads
    logs: Path  # every process's stderr: JSON lines


@pytest.fixture(scope="module")
def traced(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Traced]:
    with socket.socket() as probe:  # a free port for the trace service
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    collector = _Collector()
    server = grpc.server(ThreadPoolExecutor(4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    assert server.add_insecure_port(f"127.0.0.1:{port}") == port
    server.start()  # before the services start: they are spawned from a process that runs gRPC, as a user's may be
    capture, logs = tmp_path_factory.mktemp("capture"), tmp_path_factory.mktemp("logs") / "stderr.jsonl"
    saved_stderr = os.dup(2)
    with pytest.MonkeyPatch.context() as env, logs.open("w") as log_file:
        env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")  # the standard OTEL_* variables
        env.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
        env.setenv("PDSERVE_TRACE_DIR", str(capture))
        env.setenv("PDSERVE_LOG_FORMAT", "json")
        os.dup2(log_file.fileno(), 2)  # the workers inherit this stderr
        try:
            # Rare polls: the killed worker below is found by the request sent to it (a retry), not by a poll.
            cluster = start_cluster(tiny_model_dir, prefill=2, decode=1, gateway_args=("--poll-interval=60",))
        finally:
            os.dup2(saved_stderr, 2)
            os.close(saved_stderr)
    yield Traced(cluster, collector, capture, logs)
    cluster.stop()
    server.stop(0)


def _stream(cluster: Cluster, request_id: str, max_tokens: int,
            trace_id: str = TRACE_ID) -> Iterator[gateway_pb2.GenerateResponse]:
    """A request that arrives inside the client's trace `trace_id` (its span CLIENT_SPAN)."""
    channel = grpc.insecure_channel(cluster.gateway.address)
    call = gateway_pb2_grpc.GatewayStub(channel).Generate(
        gateway_pb2.GenerateRequest(prompt="The capital of France is", max_tokens=max_tokens, request_id=request_id,
                                    ignore_eos=True),
        timeout=60, metadata=[("traceparent", f"00-{trace_id}-{CLIENT_SPAN}-01")])
    try:
        yield from call
    finally:
        call.cancel()
        channel.close()


NAMES = {"gateway", "gateway.queue", "prefill", "prefill.queue", "prefill.forward", "kv.send", "kv.receive", "decode",
         "decode.join", "decode.step"}


def test_one_trace_links_gateway_prefill_transfer_and_decode(traced: Traced) -> None:
    cluster, collector = traced.cluster, traced.collector
    responses = list(_stream(cluster, "traced-1", 4))
    assert responses[-1].finish_reason == "length"
    spans = collector.trace(bytes.fromhex(TRACE_ID), NAMES)
    assert NAMES <= set(spans)
    (gateway_service, gateway), (prefill_service, prefill) = spans["gateway"], spans["prefill"]
    (_, send), (receive_service, receive), (decode_service, decode) = (spans["kv.send"], spans["kv.receive"],
                                                                        spans["decode"])
    assert (gateway_service, prefill_service, decode_service, receive_service) == (
        "pdserve-gateway", "pdserve-prefill", "pdserve-decode", "pdserve-decode")  # three processes
    assert gateway.parent_span_id == bytes.fromhex(CLIENT_SPAN)  # the client's traceparent was honoured
    assert prefill.parent_span_id == gateway.span_id and decode.parent_span_id == gateway.span_id
    assert send.parent_span_id == prefill.span_id
    assert receive.parent_span_id == send.span_id  # across the KV stream, prefill -> decode
    attributes = {a.key: a.value for a in receive.attributes}
    assert attributes["pdserve.kv_bytes"].int_value > 0 and attributes["pdserve.request_id"].string_value == "traced-1"
    assert {e.name for e in gateway.events} >= {"first token", "finish"}
    assert spans["gateway.queue"][1].parent_span_id == gateway.span_id
    for name in ("prefill.queue", "prefill.forward"):
        assert spans[name][1].parent_span_id == prefill.span_id
    assert spans["decode.join"][1].parent_span_id == decode.span_id
    # Every decode step the sequence rode in: 4 tokens, the first from prefill, so 3 steps, in order, inside decode.
    steps = sorted((span for _, span in collector.spans
                    if span.trace_id == bytes.fromhex(TRACE_ID) and span.name == "decode.step"),
                   key=lambda span: span.start_time_unix_nano)
    assert len(steps) == 3 and all(step.parent_span_id == decode.span_id for step in steps)
    assert [{a.key: a.value.int_value for a in step.attributes}["pdserve.step"] for step in steps] == [1, 2, 3]
    assert decode.start_time_unix_nano <= steps[0].start_time_unix_nano
    assert steps[-1].end_time_unix_nano <= decode.end_time_unix_nano
    assert_nothing_held(cluster)


def test_log_lines_about_a_request_carry_its_trace_and_request_ids(traced: Traced) -> None:
    assert list(_stream(traced.cluster, "logged-1", 2, "6bf92f3577b34da6a3ce929d0e0e4736"))[-1].finish_reason
    deadline = time.monotonic() + 10
    while True:
        lines = [json.loads(line) for line in traced.logs.read_text().splitlines() if line.startswith("{")]
        mine = [line for line in lines if line.get("request_id") == "logged-1"]
        if {"gateway.core", "prefill_service.server", "decode_service.worker"} <= {m["logger"] for m in mine}:
            break
        assert time.monotonic() < deadline, mine
        time.sleep(0.1)
    assert all(line["trace_id"] == "6bf92f3577b34da6a3ce929d0e0e4736" for line in mine)
    assert not [line for line in lines if line["level"] == "ERROR"]
    assert all({"time", "level", "message", "pid"} <= set(line) for line in lines)


def test_pdserve_trace_prints_the_request_waterfall_from_the_local_capture(traced: Traced) -> None:
    assert list(_stream(traced.cluster, "waterfall-1", 12, "9bf92f3577b34da6a3ce929d0e0e4736"))[-1].finish_reason
    command = [sys.executable, "-m", "pdserve.cli", "trace", "waterfall-1", "--dir", str(traced.capture)]
    deadline = time.monotonic() + 20
    # Each process writes its spans in batches, and the gateway's root span ends after the client has its last
    # token: wait for every span the checks below read (waiting for the workers' alone failed once in CI).
    wanted = {"gateway", "gateway.queue", "prefill", "prefill.forward", "kv.send", "decode", "kv.receive",
              "decode.step"}
    while True:
        shown = subprocess.run(command, capture_output=True, text=True, timeout=60)
        names = [line.split()[0] for line in shown.stdout.splitlines()[1:] if not line.lstrip().startswith("·")]
        if shown.returncode == 0 and wanted <= set(names):
            break
        assert time.monotonic() < deadline, shown.stdout + shown.stderr
        time.sleep(0.2)
    lines = shown.stdout.splitlines()
    assert lines[0].startswith("trace 9bf92f3577b34da6a3ce929d0e0e4736  request waterfall-1")
    indent = {line.split()[0]: len(line) - len(line.lstrip()) for line in lines[1:] if line.lstrip()[0] not in "·…"}
    assert indent["gateway"] == 0  # the client's span is not in the capture: the gateway is the root
    assert indent["prefill"] == indent["decode"] == indent["gateway.queue"] == 2
    assert indent["kv.send"] == indent["prefill.forward"] == 4 and indent["kv.receive"] == 6
    assert indent["decode.step"] == 4
    assert any("more decode.step" in line for line in lines)  # 11 steps: the middle ones summarised
    full = subprocess.run([*command, "--all"], capture_output=True, text=True, timeout=60).stdout
    assert sum(line.split()[0] == "decode.step" for line in full.splitlines()[1:]) == 11
    missing = subprocess.run([*command[:4], "no-such-request", "--dir", str(traced.capture)], capture_output=True,
                             text=True, timeout=60)
    assert missing.returncode == 1 and "no span of request 'no-such-request'" in missing.stdout


def test_a_cancelled_and_a_retried_request_show_where_in_their_traces(traced: Traced) -> None:
    cluster, collector = traced.cluster, traced.collector
    cancelled_trace = "5bf92f3577b34da6a3ce929d0e0e4736"
    responses = _stream(cluster, "traced-cancel", 400, cancelled_trace)
    next(responses)
    responses.close()  # type: ignore[attr-defined]  # cancellation still propagates with tracing on
    spans = collector.trace(bytes.fromhex(cancelled_trace), {"gateway", "decode"})
    cancelled = [e for e in spans["gateway"][1].events if e.name == "cancelled"]
    assert cancelled and cancelled[0].attributes[0].value.string_value == "decoding"
    assert_nothing_held(cluster)

    victim = cluster.prefill[0]
    victim.process.send_signal(signal.SIGKILL)
    victim.process.wait(timeout=10)
    cluster.prefill.remove(victim)
    retried = []
    for attempt in range(2):  # round robin sends one of these to the dead worker
        trace_id = f"{7 + attempt}bf92f3577b34da6a3ce929d0e0e4736"
        assert list(_stream(cluster, f"traced-retry-{attempt}", 2, trace_id))[-1].finish_reason
        spans = collector.trace(bytes.fromhex(trace_id), {"gateway"})
        retried += [e for e in spans["gateway"][1].events if e.name == "retry"]
    assert len(retried) == 1
    assert generate(cluster.gateway.address, timeout=30, prompt="Hi", max_tokens=2).finish_reason


def test_each_service_s_trace_flags_work_without_the_environment(tiny_model_dir: Path, tmp_path: Path) -> None:
    from pdserve import waterfall
    from pdserve.client import generate as complete

    flag = f"--trace-dir={tmp_path}"
    cluster = start_cluster(tiny_model_dir, prefill_args=(flag,), decode_args=(flag,), gateway_args=(flag,))
    try:
        assert complete(cluster.gateway.address, 60, prompt="Hi", max_tokens=3, request_id="flagged").finish_reason
        deadline = time.monotonic() + 20
        while True:  # the default batch delay is 5 s
            services = {s.service for s in waterfall.find_trace(waterfall.load(tmp_path), "flagged")}
            if services == {"pdserve-gateway", "pdserve-prefill", "pdserve-decode"}:
                break
            assert time.monotonic() < deadline, services
            time.sleep(0.5)
    finally:
        cluster.stop()
