"""`pdserve cluster`: a gateway, N prefill and M decode workers as local processes on loopback."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from model_runner.loading import resolve_model
from pdserve.cluster_config import ClusterConfig
from serving import tracing
from serving.logs import LOG_FORMAT_ENV
from serving.tls import TLS
from serving.tls import channel as tls_channel

# With no prefill workers (--prefill 0) every prompt is colocated: decode workers prefill in chunks this long
# instead of their default 32 tokens, which keeps a running stream's wait short beside a prefill tier
ALL_COLOCATED_CHUNK = 256


@dataclass
class Service:
    role: str
    process: subprocess.Popen
    address: str = ""
    cpus: set[int] | None = None  # pinned to these cores, or None
    metrics: str = ""  # host:port of its Prometheus /metrics
    http: str = ""  # the gateway's OpenAI-compatible HTTP host:port
    kv: str = ""  # a decode worker's TransferKV host:port, when it has one of its own (--kv-port)

    def summary(self) -> dict[str, object]:
        summary = {"address": self.address, "pid": self.process.pid, "cpus": sorted(self.cpus) if self.cpus else None,
                   "metrics": self.metrics}
        return {**summary, "http": self.http} if self.http else summary


@dataclass
class Cluster:
    gateway: Service
    prefill: list[Service] = field(default_factory=list)
    decode: list[Service] = field(default_factory=list)
    tls: TLS | None = None  # the client identity (client.pem) when the cluster runs mutual TLS

    def channel(self, service: Service) -> grpc.Channel:
        """A blocking channel to one of the cluster's services, with the client certificate under mutual TLS."""
        return tls_channel(service.address, self.tls, expect=service.role)

    @property
    def services(self) -> list[Service]:
        return [self.gateway, *self.prefill, *self.decode]

    def summary(self) -> dict[str, object]:
        return {"gateway": self.gateway.summary(), "prefill": [s.summary() for s in self.prefill],
                "decode": [s.summary() for s in self.decode]}

    def stop(self, grace_s: float = 10.0) -> None:
        """Gateway first (stop taking requests), then the workers; anything still alive after `grace_s` is killed."""
        stop_all([self.gateway], grace_s)
        stop_all([*self.prefill, *self.decode], grace_s)


def stop_all(services: list[Service], grace_s: float) -> None:
    for service in services:
        if service.process.poll() is None:
            service.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for service in services:
        try:
            service.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            service.process.kill()
            service.process.wait()


def spawn_service(role: str, module: str, args: list[str], cpus: set[int] | None = None,
                  env: dict[str, str] | None = None) -> Service:
    """Start `python -m module args` as one of the cluster's processes (`role` names it in errors), and return it
    at once, before it serves: `wait_ready` then reads the address it announces.

    The process is ended by the kernel if this one dies (even by SIGKILL); with `cpus`, it and every thread it
    starts run only there. Both are set by `pdserve.launch` after an exec, never in a `preexec_fn`: one makes
    CPython fork() where it would vfork(), so gRPC's fork handlers run in the child and restart gRPC's poller there;
    the child then closes every descriptor it does not pass on, the poller's epoll among them, and gRPC aborts it
    ("epoll_wait error: Bad file descriptor") before the exec. With gRPC running here, that was a few starts in a
    hundred (grpc/grpc#43055).
    """
    pinned = ",".join(map(str, sorted(cpus))) if cpus else ""
    process = subprocess.Popen([sys.executable, "-m", "pdserve.launch", str(os.getpid()), pinned, module, *args],
                               stdout=subprocess.PIPE, text=True, env=env)
    return Service(role, process, cpus=cpus)


def wait_ready(services: list[Service], timeout_s: float) -> None:
    """Wait until each of `services` (from `spawn_service`) serves, and fill in what it announces: every pdserve
    process prints one JSON line once it serves, with its gRPC address and, where it has them, its /metrics, HTTP
    and KV addresses.

    Raises RuntimeError if one exits first, TimeoutError if one has not announced itself within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    waiting = {s.process.stdout.fileno(): s for s in services if s.process.stdout}
    while waiting:
        for service in waiting.values():
            if service.process.poll() is not None:
                raise RuntimeError(
                    f"{service.role} worker exited with code {service.process.returncode} while starting")
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"{len(waiting)} services not ready in time: {[s.role for s in waiting.values()]}")
        ready, _, _ = select.select(list(waiting), [], [], min(remaining, 1.0))
        for fd in ready:
            service = waiting.pop(fd)
            line = service.process.stdout.readline() if service.process.stdout else ""
            if not line:
                waiting[fd] = service  # EOF: the next poll() reports the exit
                continue
            announced = json.loads(line)
            service.address, service.metrics = announced["address"], announced.get("metrics", "")
            service.http, service.kv = announced.get("http", ""), announced.get("kv", "")


def wait_healthy(address: str, timeout_s: float, tls: TLS | None = None, expect: str = "") -> None:
    with tls_channel(address, tls, expect=expect) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=2, wait_for_ready=True)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{address} did not report SERVING")
            time.sleep(0.2)


def role_args(config: ClusterConfig, role: str) -> list[str]:
    """The flags a role's services get beyond where they listen and what they load: none but the user's own, so
    that `pdserve cluster` runs the services' defaults, the profile compose and Kubernetes run too
    (tests/test_config_defaults.py), except where its config says otherwise. The user's flags come last: the last
    of a flag given twice wins."""
    file = [f"--config={os.path.abspath(config.config_file)}"] if config.config_file else []
    if role == "gateway":
        colocate = [] if config.colocate_below is None else [f"--colocate-below={config.colocate_below}"]
        return [*file, *colocate, *config.gateway_args]
    if role == "decode":
        whole = [] if config.prefill else [f"--prefill-chunk={ALL_COLOCATED_CHUNK}"]
        return [*file, *whole, *config.decode_args]
    return [*file, *config.prefill_args]


def start(config: ClusterConfig) -> Cluster:
    model_dir = str(resolve_model(config.model))  # convert the default model once, before workers race for it
    deadline = time.monotonic() + config.startup_timeout_s
    # --metrics-port 0 (a free port each), whatever PDSERVE_METRICS_PORT says: the services share this host
    worker_flags = ["--host", config.host, "--model", model_dir, "--dtype", config.dtype, "--device", config.device,
                    "--threads", str(config.threads_per_worker), "--metrics-port", "0"]
    client_tls = TLS.of(config.tls_dir, "client") if config.tls_dir else None

    def tls_flags(role: str) -> list[str]:
        return TLS.of(config.tls_dir, role).flags() if config.tls_dir else []

    env = dict(os.environ)
    if config.trace_dir:
        env[tracing.TRACE_DIR_ENV] = os.path.abspath(config.trace_dir)
        env.setdefault("OTEL_BSP_SCHEDULE_DELAY", "500")  # spans on disk within half a second, for `pdserve trace`
    if config.log_format == "json":
        env[LOG_FORMAT_ENV] = config.log_format
    workers: list[Service] = []
    cpus = iter(config.worker_cpus())
    try:
        for role, count, ports in (("prefill", config.prefill, config.prefill_ports),
                                   ("decode", config.decode, config.decode_ports)):
            extra = role_args(config, role)
            for i in range(count):
                port = ports[i] if ports else 0
                workers.append(spawn_service(role, f"{role}_service", [*worker_flags, *tls_flags(role), *extra,
                                                                        "--port", str(port)], next(cpus), env))
        wait_ready(workers, deadline - time.monotonic())
        prefill = [w for w in workers if w.role == "prefill"]
        decode = [w for w in workers if w.role == "decode"]
        gateway_args = ["--host", config.host, "--port", str(config.gateway_port), "--model", model_dir,
                        "--http-port", str(config.http_port), "--metrics-port", "0"]
        gateway_args += [f"--prefill={w.address}" for w in prefill] + [f"--decode={w.address}" for w in decode]
        gateway_args += [*tls_flags("gateway"), *role_args(config, "gateway")]
        gateway = spawn_service("gateway", "gateway", gateway_args, env=env)
        workers.append(gateway)
        wait_ready([gateway], deadline - time.monotonic())
        cluster = Cluster(gateway, prefill, decode, client_tls)
        for service in cluster.services:
            wait_healthy(service.address, max(1.0, deadline - time.monotonic()), client_tls, service.role)
        return cluster
    except BaseException:
        stop_all(workers, grace_s=5)
        raise


def serve_until_signal(cluster: Cluster) -> None:
    """Block until SIGINT/SIGTERM or the gateway's exit, then stop everything. A dead worker is reported, and
    the rest keep serving."""
    stopping: list[int] = []
    reported: set[int] = set()

    def on_signal(signum: int, _frame: object) -> None:
        stopping.append(signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not stopping and cluster.gateway.process.poll() is None:
            for service in cluster.services:
                if service.process.poll() is not None and service.process.pid not in reported:
                    reported.add(service.process.pid)
                    print(f"pdserve cluster: {service.role} {service.address} (pid {service.process.pid}) exited "
                          f"with code {service.process.returncode}", file=sys.stderr, flush=True)
            time.sleep(0.2)
    finally:
        cluster.stop()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
