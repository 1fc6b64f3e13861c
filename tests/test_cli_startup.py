"""`pdserve health` is the containers' health probe (Docker HEALTHCHECK, Kubernetes exec probe, 1 s default timeout)
and `pdserve --help` the first thing a user runs: neither may load torch, transformers or a benchmark. Checked by what
the process imported, not by a stopwatch."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

HEAVY = ("torch", "transformers", "matplotlib", "bench", "model_runner", "engine", "kv_wire")
# Runs the CLI in a fresh interpreter, then prints the heavy packages it imported as the last line of stderr.
PROBE = f"""
import json, sys
from pdserve import cli
try:
    cli.main(sys.argv[1:])
except SystemExit as exit:
    code = exit.code
print(json.dumps([code, sorted({{m.split(".")[0] for m in sys.modules}} & set({HEAVY!r}))]), file=sys.stderr)
"""


def _run(*argv: str) -> tuple[int, list[str], str]:
    """The CLI's exit code, the heavy packages it imported, and its stdout."""
    done = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, timeout=60)
    code, heavy = json.loads(done.stderr.strip().splitlines()[-1])
    return code, heavy, done.stdout


@pytest.fixture(scope="module")
def serving_address() -> Iterator[str]:
    """A grpc.health.v1 service that answers SERVING, as every pdserve service does."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(grace=None)


@pytest.mark.parametrize("argv", [["--help"], ["health", "--help"], ["bench", "--help"], ["generate", "--help"],
                                  ["cluster", "--help"]])
def test_help_loads_no_model_code(argv: list[str]) -> None:
    code, heavy, stdout = _run(*argv)
    assert code == 0 and heavy == [] and "usage: pdserve" in stdout


def test_health_probe_loads_no_model_code(serving_address: str) -> None:
    code, heavy, stdout = _run("health", serving_address)
    assert (code, heavy) == (0, []) and "SERVING" in stdout
    code, heavy, _ = _run("health", "127.0.0.1:1", "--timeout", "0.5")  # nothing listens there
    assert (code, heavy) == (1, [])


def test_a_benchmark_loads_its_own_module_for_its_flags() -> None:
    code, heavy, stdout = _run("bench", "gemm", "--help")
    assert code == 0 and "bench" in heavy and "--json" in stdout
