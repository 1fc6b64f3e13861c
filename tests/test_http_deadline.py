"""HTTP requests carry a deadline, as gRPC ones may: `--http-deadline` (10 minutes by default)."""

from __future__ import annotations

import http.client
import json
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pdserve.client import generate
from pdserve.cluster import Cluster
from tests.helpers import assert_nothing_held, start_cluster


def _connect(cluster: Cluster, body: dict) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    host, port = cluster.gateway.http.rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    return connection, connection.getresponse()


@contextmanager
def _frozen(cluster: Cluster) -> Iterator[None]:
    """The decode worker stopped (SIGSTOP) for the block: nothing it owes can come, however fast the machine."""
    process = cluster.decode[0].process
    process.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        process.send_signal(signal.SIGCONT)


def test_an_http_request_past_its_deadline_ends_504_and_frees_every_worker(tiny_model_dir: Path) -> None:
    # Polls are rare, so the gateway takes the frozen decode worker for slow, not gone; a timed race (0.1 s for
    # 500 tokens) would fail on a machine that decodes them faster. The deadline, 3 s, is under the stream's idle
    # timeout (5 s), and far over a warm first token (milliseconds; a busy machine's tenths of a second).
    cluster = start_cluster(tiny_model_dir, gateway_args=("--http-deadline=3", "--poll-interval=60"))
    try:
        # 0. Warm up over gRPC (no HTTP deadline): a fresh worker's first request loads what it needs.
        assert generate(cluster.gateway.address, timeout=60, prompt="Hello", max_tokens=2).finish_reason
        # 1. A generation that cannot end before the deadline is cut at it.
        with _frozen(cluster):
            started = time.monotonic()
            connection, response = _connect(cluster, {"prompt": "Hello", "max_tokens": 500, "ignore_eos": True})
            status, payload, took = response.status, response.read(), time.monotonic() - started
            connection.close()
        assert status == 504 and json.loads(payload)["error"]["code"] == "deadline_exceeded", payload
        assert took < 30  # cut at the deadline, not left to the client's 60 s timeout
        # 2. Streaming: the stream is already 200 with a first event, so the deadline ends it with an error event.
        connection, response = _connect(cluster, {"prompt": "Hello", "max_tokens": 500, "ignore_eos": True,
                                                  "stream": True})
        try:
            assert response.status == 200
            first = response.readline()
            while not first.startswith(b"data: {"):
                first = response.readline()
            with _frozen(cluster):
                payload = first + response.read()
        finally:
            connection.close()
        events = [json.loads(line[6:]) for line in payload.decode().splitlines() if line.startswith("data: {")]
        assert "error" not in events[0] and events[-1]["error"]["code"] == "deadline_exceeded", payload
        # 3. A short request fits, and nothing is held afterwards.
        connection, response = _connect(cluster, {"prompt": "Hello", "max_tokens": 1})
        assert response.status == 200, response.read()
        connection.close()
        assert_nothing_held(cluster, within_s=10)
    finally:
        cluster.stop()
