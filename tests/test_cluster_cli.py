"""`pdserve cluster` and `pdserve generate` as a user runs them, and the pairing check between pools."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdserve.client import generate
from pdserve.cluster import Cluster, ClusterConfig, _await_ready, _spawn, stop_all
from tests.conftest import start_cluster

PDSERVE = [sys.executable, "-m", "pdserve.cli"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie has exited; only its parent's wait() remains
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split(")")[-1].split()[0] != "Z"


def test_cluster_serves_and_sigterm_leaves_no_process(tiny_model_dir: Path) -> None:
    cluster = subprocess.Popen([*PDSERVE, "cluster", "--model", str(tiny_model_dir), "--prefill", "1", "--decode", "2"],
                               stdout=subprocess.PIPE, text=True)
    try:
        summary = json.loads(cluster.stdout.readline())  # one JSON line once every service is healthy
        pids = [summary["gateway"]["pid"]] + [w["pid"] for w in summary["prefill"] + summary["decode"]]
        assert len(summary["prefill"]) == 1 and len(summary["decode"]) == 2
        assert all(_alive(pid) for pid in pids)
        generated = subprocess.run([*PDSERVE, "generate", "Hello", "--address", summary["gateway"]["address"],
                                    "--max-tokens", "6", "--temperature", "0"],
                                   capture_output=True, text=True, timeout=120)
        assert generated.returncode == 0, generated.stderr
        assert "6 generated tokens" in generated.stderr or "[stop]" in generated.stderr
        as_json = subprocess.run([*PDSERVE, "generate", "Hello", "--address", summary["gateway"]["address"],
                                  "--max-tokens", "6", "--temperature", "0", "--json"],
                                 capture_output=True, text=True, timeout=120)
        assert json.loads(as_json.stdout)["text"] in generated.stdout
        cluster.send_signal(signal.SIGTERM)
        assert cluster.wait(timeout=30) == 0
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(pid) for pid in pids)
    finally:
        if cluster.poll() is None:
            cluster.kill()


def test_generate_reports_an_unreachable_gateway() -> None:
    result = subprocess.run([*PDSERVE, "generate", "Hello", "--address", "127.0.0.1:1", "--timeout", "5"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert "UNAVAILABLE" in result.stderr


def test_health_probe_answers_for_every_service_and_fails_for_a_dead_one(tiny_cluster: Cluster) -> None:
    for service in tiny_cluster.services:  # what the container image's HEALTHCHECK runs
        result = subprocess.run([*PDSERVE, "health", service.address], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0 and result.stdout.strip() == f"{service.address}: SERVING"
    result = subprocess.run([*PDSERVE, "health", "127.0.0.1:1", "--timeout", "2"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 1 and "UNAVAILABLE" in result.stderr


@pytest.mark.parametrize("module", ["gateway", "prefill_service", "decode_service"])
def test_each_service_has_help(module: str) -> None:
    result = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "--port" in result.stdout


def test_gateway_refuses_to_pair_workers_with_different_dtypes(tiny_model_dir: Path) -> None:
    common = ["--model", str(tiny_model_dir), "--threads", "1", "--port", "0"]
    workers = [_spawn("prefill", "prefill_service", [*common, "--dtype", "float32"]),
               _spawn("decode", "decode_service", [*common, "--dtype", "bfloat16"])]
    try:
        _await_ready(workers, time.monotonic() + 120)
        gateway = subprocess.run([sys.executable, "-m", "gateway", "--model", str(tiny_model_dir),
                                  f"--prefill={workers[0].address}", f"--decode={workers[1].address}"],
                                 capture_output=True, text=True, timeout=120)
        assert gateway.returncode != 0
        assert "refusing to pair" in gateway.stderr
    finally:
        stop_all(workers, grace_s=10)


@pytest.mark.parametrize("flags", [["--prefill", "-1"], ["--decode", "0"], ["--prefill-ports", "1,2"]])
def test_cluster_rejects_bad_flags(flags: list[str]) -> None:
    result = subprocess.run([*PDSERVE, "cluster", *flags], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and flags[0] in result.stderr


def test_worker_cores_are_disjoint_when_there_are_enough(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert ClusterConfig(prefill=1, decode=1).worker_cpus() == [{0, 1}, {2, 3}]
    assert ClusterConfig(prefill=1, decode=2, threads=1).worker_cpus() == [{0}, {1}, {2}]
    assert ClusterConfig(prefill=2, decode=2, threads=2).worker_cpus() == [None] * 4  # 8 cores wanted, 4 here
    assert ClusterConfig(prefill=1, decode=1, pin=False).worker_cpus() == [None, None]


def test_prefill_and_decode_processes_run_on_their_own_cores(tiny_model_dir: Path) -> None:
    cores = sorted(os.sched_getaffinity(0))
    cluster = start_cluster(tiny_model_dir, prefill=1, decode=1)  # one thread each
    try:
        pinned = [os.sched_getaffinity(w.process.pid) for w in (*cluster.prefill, *cluster.decode)]
        if len(cores) >= 2:
            assert pinned == [{cores[0]}, {cores[1]}]
        else:  # one core: nothing to separate, the scheduler shares it
            assert pinned == [set(cores), set(cores)]
        assert generate(cluster.gateway.address, timeout=30, prompt="Hi", max_tokens=3).finish_reason
    finally:
        cluster.stop()
