"""How every pdserve process serves gRPC: one asyncio server with health, reflection, limits and ordered shutdown."""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from serving import logs, memory, tls, tracing
from serving.metrics import Metrics
from serving.settings import add_settings, check_settings, read_settings, resolve, role_of, setting
from serving.tls import TLS

MAX_MESSAGE_BYTES = 8 << 20  # KV chunks are 768 KiB by default, 4 MiB at most; anything near this limit is malformed
# The message limits every pdserve server and channel runs with.
MESSAGE_LIMITS = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                  ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
# Keepalive on the server side: ping an idle connection every 20 s and drop it when no answer comes in 10 s (a
# frozen or vanished peer; grpcio waits `ping_timeout_ms` for the ack, whatever keepalive_timeout_ms says), and
# accept the clients' own keepalive pings down to every 5 s: gRPC's default answers a client that pings more often
# than every 5 minutes with GOAWAY ("too_many_pings").
SERVER_KEEPALIVE = [("grpc.keepalive_time_ms", 20_000), ("grpc.keepalive_timeout_ms", 10_000),
                    ("grpc.http2.ping_timeout_ms", 10_000), ("grpc.keepalive_permit_without_calls", 1),
                    ("grpc.http2.min_ping_interval_without_data_ms", 5_000), ("grpc.http2.max_ping_strikes", 0)]
# The same pings on the channels one worker opens to another (prefill's KV pushes to decode).
CHANNEL_KEEPALIVE = [("grpc.keepalive_time_ms", 20_000), ("grpc.keepalive_timeout_ms", 10_000),
                     ("grpc.http2.ping_timeout_ms", 10_000), ("grpc.keepalive_permit_without_calls", 1),
                     ("grpc.http2.max_pings_without_data", 0)]
WATCHDOG_PERIOD_S = 1.0
WORKER_ROLES = ("prefill", "decode")


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


@dataclass(frozen=True)
class ServerConfig:
    host: str = setting("127.0.0.1", "address to listen on", default_text="loopback")
    port: int = setting(0, "port; 0 picks a free one, reported on stdout once serving", low=0, high=65535)
    grace_s: float = setting(5.0, "seconds in-flight calls get to finish on SIGTERM", flag="--grace", low=0)
    metrics_port: int = setting(0, "HTTP port of Prometheus /metrics; 0 picks a free one, reported with the "
                                "address; -1 turns it off", low=-1, high=65535)
    tls: TLS | None = None  # mutual TLS for this server and the calls it makes (serving/tls.py's flags)
    max_concurrent_rpcs: int = setting(1024, "calls served at once; more are refused with RESOURCE_EXHAUSTED", low=1)
    stall_s: float = setting(30.0, "a worker whose engine has run one pass or step for longer than this reports "
                             "NOT_SERVING until it moves again", above=0)
    otlp_endpoint: str = setting(
        "", "send spans to this OTLP gRPC endpoint, e.g. http://jaeger:4317",
        default_text="$OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or $OTEL_EXPORTER_OTLP_ENDPOINT; none: no tracing")
    trace_dir: str = setting("", "append spans to DIR/<service>-<pid>.jsonl for `pdserve trace`",
                             default_text=f"${tracing.TRACE_DIR_ENV}", metavar="DIR")

    def __post_init__(self) -> None:
        check_settings(self)


def add_server_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server")
    add_settings(group, ServerConfig)
    tls.add_args(group)


def server_config(args: argparse.Namespace) -> ServerConfig:
    return read_settings(ServerConfig, args, tls=tls.from_args(args))


async def serve(
    role: str,
    config: ServerConfig,
    register: Callable[[grpc.aio.Server], list[str]],
    on_shutdown: Callable[[], Awaitable[None]] | None = None,
    metrics: Metrics | None = None,
    announce: dict[str, str] | None = None,
    also: tuple[grpc.aio.Server, HealthServicer] | None = None,
    stalled: Callable[[], float] | None = None,
) -> None:
    """Run a gRPC server (and its /metrics) until SIGINT/SIGTERM.

    `register` adds the servicers and returns their full service names. Once serving, one JSON line
    {"role", "address", "pid", "metrics", **announce} goes to stdout: `pdserve cluster` and the tests read it to
    learn the free ports.
    Shutdown is ordered: health turns NOT_SERVING, new calls are refused, in-flight calls get `grace_s`, then
    `on_shutdown` releases what the service holds. `also`: a second server (from `listen`) stopped with this one.
    `stalled()`: how long the engine has been stuck in one pass (0 when idle or moving); past `config.stall_s`
    health turns NOT_SERVING, so the gateway routes around a wedged worker that still answers RPCs.
    """
    tracing.setup(role, config.otlp_endpoint, config.trace_dir)
    server, port, health = await listen(role, config, config.port, register)
    address = f"{config.host}:{port}"
    metrics_address = ""
    if metrics is not None and config.metrics_port >= 0:
        metrics_address = metrics.start(config.host, config.metrics_port)
    memory.freeze_startup_objects()  # after the model, the servicers and the server: all of startup
    print(json.dumps({"role": role, "address": address, "pid": os.getpid(), "metrics": metrics_address,
                      **(announce or {})}), flush=True)
    logging.getLogger(role).info("serving on %s", address)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    serving = asyncio.ensure_future(server.wait_for_termination())
    watchdog = None if stalled is None else asyncio.ensure_future(watchdog_loop(role, health, stalled, config.stall_s))
    await asyncio.wait([serving, asyncio.ensure_future(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
    if watchdog is not None:
        watchdog.cancel()
    await health.enter_graceful_shutdown()
    if also is not None:
        await also[1].enter_graceful_shutdown()
        await asyncio.gather(server.stop(config.grace_s), also[0].stop(config.grace_s))
    else:
        await server.stop(config.grace_s)
    if on_shutdown is not None:
        await on_shutdown()
    if metrics is not None:
        metrics.stop()
    tracing.shutdown()
    logging.getLogger(role).info("stopped")


async def watchdog_loop(role: str, health: HealthServicer, stalled: Callable[[], float], stall_s: float) -> None:
    """Every WATCHDOG_PERIOD_S: health NOT_SERVING while `stalled()` exceeds `stall_s`, SERVING again after."""
    log = logging.getLogger(role)
    serving = True
    while True:
        await asyncio.sleep(WATCHDOG_PERIOD_S)
        stuck = stalled()
        if (stuck <= stall_s) == serving:
            continue
        serving = not serving
        if serving:
            log.warning("the engine moves again: SERVING")
        else:
            log.error("the engine has been stuck in one pass for %.1f s (--stall-s %.1f): NOT_SERVING", stuck, stall_s)
        await health.set("", health_pb2.HealthCheckResponse.SERVING if serving
                         else health_pb2.HealthCheckResponse.NOT_SERVING)


async def listen(
    role: str, config: ServerConfig, port: int, register: Callable[[grpc.aio.Server], list[str]]
) -> tuple[grpc.aio.Server, int, HealthServicer]:
    """A started gRPC server on `port` with `register`'s services, health, reflection and the limits. A worker
    (any role but the gateway, whose callers are users with API keys) checks the worker token when one is set,
    and without TLS or a token listens on loopback only."""
    interceptors = []
    try:
        token = tls.worker_token()  # every role reads it: a gateway sends it to the workers
    except ValueError as exc:
        raise RuntimeError(str(exc)) from exc
    if role in WORKER_ROLES:
        if token:
            interceptors.append(tls.RequireWorkerToken(token))
        elif config.tls is None and not _loopback(config.host):
            raise RuntimeError(f"refusing to serve {role} on {config.host} unauthenticated: anyone who reaches the "
                               "port could use this worker. Set PDSERVE_WORKER_TOKEN (or PDSERVE_WORKER_TOKEN_FILE) "
                               "on every pdserve process, or turn on mutual TLS (--tls-cert, --tls-key, --tls-ca)")
    server = grpc.aio.server(options=[*MESSAGE_LIMITS, *SERVER_KEEPALIVE, ("grpc.so_reuseport", 0)],
                             maximum_concurrent_rpcs=config.max_concurrent_rpcs, interceptors=interceptors)
    services = register(server)
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection([*services, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                                         reflection.SERVICE_NAME], server)
    where = f"{config.host}:{port}"
    if config.tls is None:
        bound = server.add_insecure_port(where)
    else:
        bound = server.add_secure_port(where, config.tls.server_credentials())
    if bound == 0:
        raise SystemExit(f"{role}: cannot listen on {where}")
    await server.start()
    for name in ["", *services]:
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, bound, health


def run(main: Awaitable[None]) -> None:
    import uvloop

    uvloop.run(main)  # type: ignore[arg-type]


def parse_config(prog: str, description: str | None, config_class: Any, argv: list[str] | None,
                 sources: dict[str, str] | None = None, values: dict[str, Any] | None = None) -> Any:
    """A service's validated config from a config file, the environment and its flags (serving/settings.py's
    `resolve`); anything bad exits with status 2 and a message naming it. `sources` and `values`, if given, are
    filled with where each setting's value came from and the value, by its flag's dest."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    config_class.add_args(parser)
    try:
        args, found = resolve(parser, role_of(config_class), argv)
        config = config_class.from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    if sources is not None:
        sources.update(found)
    if values is not None:
        values.update({dest: getattr(args, dest) for dest in found})
    return config


def main(prog: str, description: str | None, config_class: Any, serve_config: Callable[[Any], Awaitable[None]],
         argv: list[str] | None = None) -> None:
    """The `python -m <service>` entry point: flags -> validated config (errors name the flag) -> serve."""
    config = parse_config(prog, description, config_class, argv)
    logs.configure()
    memory.keep_heap_warm()
    try:
        run(serve_config(config))
    except RuntimeError as exc:  # start-up refusals (e.g. workers that must not pair): one line, exit 1
        sys.exit(f"{prog}: {exc}")
