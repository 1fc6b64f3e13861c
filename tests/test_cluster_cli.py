"""`pdserve cluster` and `pdserve generate` as a user runs them, and the pairing check between pools."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdserve.client import generate
from pdserve.cluster import Cluster, ClusterConfig, spawn_service, stop_all, wait_ready
from tests.helpers import start_cluster

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
    workers = [spawn_service("prefill", "prefill_service", [*common, "--dtype", "float32"]),
               spawn_service("decode", "decode_service", [*common, "--dtype", "bfloat16"])]
    try:
        wait_ready(workers, 120)
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


_fork_reports: list[int] = []  # the pipe a forked child writes to, while a test listens


def _report_fork() -> None:
    if _fork_reports:
        os.write(_fork_reports[0], b"f")


os.register_at_fork(after_in_child=_report_fork)


def test_services_start_without_a_fork_while_this_process_runs_grpc() -> None:
    """A gateway once died as it started, now and then, with "epoll_wait error: Bad file descriptor": a preexec_fn
    made CPython fork() the child, gRPC's fork handlers restarted its poller there, and the child closed the poller's
    epoll before exec. A service is started by vfork and exec now, which runs no fork handler at all."""
    # 1. gRPC runs here, as in a test: a server, and a channel with calls coming and going.
    server = grpc.server(ThreadPoolExecutor(2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    stop = threading.Event()

    def call() -> None:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            while not stop.wait(0.005):
                health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)

    caller = threading.Thread(target=call)
    caller.start()
    read, write = os.pipe()
    os.set_blocking(read, False)
    _fork_reports.append(write)
    try:
        # 2. Start short-lived services, pinned as `pdserve cluster` pins workers: every one runs and exits cleanly.
        cpus = {min(os.sched_getaffinity(0))}
        for _ in range(25):
            service = spawn_service("probe", "platform", [], cpus)
            out, _ = service.process.communicate(timeout=60)
            assert service.process.returncode == 0 and out.startswith("Linux")
        # 3. No child ran a fork handler (gRPC's among them) before its exec.
        try:
            forked = len(os.read(read, 100))
        except BlockingIOError:  # nothing written
            forked = 0
        assert forked == 0, f"{forked} of 25 children were forked: their fork handlers ran before exec"
    finally:
        _fork_reports.clear()
        os.close(read)
        os.close(write)
        stop.set()
        caller.join()
        server.stop(0)


def test_a_service_is_pinned_and_ends_when_the_process_that_started_it_is_killed() -> None:
    core = min(os.sched_getaffinity(0))
    starts_one = ("import time\nfrom pdserve.cluster import spawn_service\n"
                  f"service = spawn_service('probe', 'http.server', ['--bind', '127.0.0.1', '0'], {{{core}}})\n"
                  "print(service.process.pid, flush=True)\ntime.sleep(120)")
    starter = subprocess.Popen([sys.executable, "-c", starts_one], stdout=subprocess.PIPE, text=True)
    try:
        service = int(starter.stdout.readline())
        deadline = time.monotonic() + 30
        # past pdserve.launch's exec into the service (mid-exec, cmdline reads empty)
        while Path(f"/proc/{service}/cmdline").read_text().split("\0")[1:3] != ["-m", "http.server"]:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert os.sched_getaffinity(service) == {core}
        starter.kill()
        deadline = time.monotonic() + 10
        while _alive(service):
            assert time.monotonic() < deadline, "the service outlived the process that started it"
            time.sleep(0.05)
    finally:
        starter.kill()
        starter.wait()
