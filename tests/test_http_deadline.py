"""HTTP requests carry a deadline, as gRPC ones may: `--http-deadline` (10 minutes by default)."""

from __future__ import annotations

import http.client
import json
import time
from pathlib import Path

from pdserve.cluster import Cluster
from tests.helpers import assert_nothing_held, start_cluster


def _post(cluster: Cluster, body: dict) -> tuple[int, bytes, float]:
    host, port = cluster.gateway.http.rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    started = time.monotonic()
    try:
        connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, response.read(), time.monotonic() - started
    finally:
        connection.close()


def test_an_http_request_past_its_deadline_ends_504_and_frees_every_worker(tiny_model_dir: Path) -> None:
    cluster = start_cluster(tiny_model_dir, gateway_args=("--http-deadline=0.1",))
    try:
        # 1. A generation that takes longer than the deadline (500 tokens, one event each) is cut at it.
        status, payload, took = _post(cluster, {"prompt": "Hello", "max_tokens": 500, "ignore_eos": True})
        assert status == 504 and json.loads(payload)["error"]["code"] == "deadline_exceeded", payload
        assert took < 10
        # 2. Streaming: the stream is already 200, so the deadline ends it with an error event.
        status, payload, _ = _post(cluster, {"prompt": "Hello", "max_tokens": 500, "ignore_eos": True,
                                             "stream": True})
        events = [json.loads(line[6:]) for line in payload.decode().splitlines() if line.startswith("data: {")]
        assert status == 200 and events[-1]["error"]["code"] == "deadline_exceeded", payload
        # 3. A short request fits, and nothing is held afterwards.
        status, payload, _ = _post(cluster, {"prompt": "Hello", "max_tokens": 1})
        assert status == 200, payload
        assert_nothing_held(cluster)
    finally:
        cluster.stop()
