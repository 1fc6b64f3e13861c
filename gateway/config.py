"""The gateway's settings, written once (serving/settings.py): flags, environment and config file."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

from gateway.admission import AdmissionConfig
from gateway.auth import ApiKeys
from gateway.failover import RetryPolicy
from gateway.openai_api import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_HTTP_DEADLINE_S,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_SSE_MIN_WRITE_BYTES,
)
from gateway.request import (
    MAX_TPOT_TARGET_MS,
    MAX_TTFT_TARGET_MS,
)
from gateway.stalls import DEFAULT_CLIENT_STALL_TIMEOUT_S
from gateway.workers import Keepalive
from serving.models import DEFAULT_MODEL
from serving.server import ServerConfig, add_server_args, server_config
from serving.settings import add_settings, check_settings, read_settings, setting


def _split(values: list[str]) -> list[str]:
    return [part.strip() for value in values for part in value.split(",") if part.strip()]


@dataclass(frozen=True)
class GatewayConfig:
    server: ServerConfig
    prefill: list[str] = field(default_factory=list)
    decode: list[str] = field(default_factory=list)
    model: str = setting(DEFAULT_MODEL, "model directory whose tokenizer to use (the model the workers serve)")
    startup_timeout_s: float = setting(300.0, "seconds to wait for every worker to answer", flag="--startup-timeout",
                                       low=0)
    colocate_below: int = setting(
        512, "prompts shorter than this go to a decode worker that prefills them itself (conditional "
        "disaggregation), with --placement threshold or until the workers report costs; 0: never",
        metavar="TOKENS", low=0)
    colocate_queued: int = setting(
        256, "...but only while the least loaded prefill worker has at least this many prompt tokens queued or "
        "running: an idle prefill worker costs the decode batch nothing; 0: whenever they are short",
        metavar="TOKENS", low=0)
    placement: str = setting(
        "model", "model: each prompt runs where the workers' measured costs predict its first token soonest, on a "
        "prefill worker or colocated on a decode worker, whatever its length; the two flags above decide only "
        "until the workers report costs. threshold: they always decide", choices=("model", "threshold"))
    split_above: int = setting(
        0, "a prompt of at least this many tokens may be split: a prefill worker prefills its first part and sends "
        "that KV layer by layer to a decode worker, which prefills the rest meanwhile (split prefill: two cores on "
        "one prompt). With --placement model, when that is predicted soonest (a prefill worker free within half a "
        "second, the split that ends soonest); with threshold, always, half on each side; 0: never",
        metavar="TOKENS", low=0)
    target_tpot_ms: int = setting(
        0, "the time between tokens a request asks for unless it says (its slo.tpot_ms): placement avoids choices "
        "predicted slower, and a decode worker then gives colocated prompts the rest of its core instead of "
        "--prefill-pass-ms; 0: none", metavar="MS", low=0, high=MAX_TPOT_TARGET_MS)
    target_ttft_ms: int = setting(
        0, "the time to first token a request asks for unless it says (its slo.ttft_ms); a request with "
        "slo.refuse_late predicted past it is refused at once; 0: none", metavar="MS", low=0, high=MAX_TTFT_TARGET_MS)
    retry: RetryPolicy = RetryPolicy()
    admission: AdmissionConfig = AdmissionConfig()
    poll_interval_s: float = setting(
        0.5, "seconds between reads of each worker's health and load, which pick the least loaded worker and route "
        "around draining ones", flag="--poll-interval", above=0)
    http_port: int = setting(
        0, "port of the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models); 0 picks a "
        "free one, reported with the address; -1 turns it off", low=-1, high=65535)
    api_key_file: str = setting(
        "", "file of API keys, one per line, that clients must send as `authorization: Bearer KEY` (gRPC metadata "
        "or HTTP header); PDSERVE_API_KEYS (comma-separated) adds more", default_text="none: no key needed")
    served_model_name: str = setting("", "the model's name in the HTTP API", default_text="the model directory's name")
    prefix_balance_tokens: int = setting(
        2048, "send a prompt to the prefill worker most likely to hold its prefix while that worker's queue is "
        "within this many tokens of the least loaded one's; -1 routes by load alone", low=-1)
    keepalive: Keepalive = Keepalive()  # pings on every worker channel
    http_body_timeout_s: float = setting(
        DEFAULT_BODY_TIMEOUT_S, "seconds an HTTP request's body may take to arrive before 408",
        flag="--http-body-timeout", above=0)
    http_deadline_s: float = setting(
        DEFAULT_HTTP_DEADLINE_S, "seconds an HTTP request may run in all, as a gRPC client's deadline does; past it "
        "the request ends with 504 (or an error event, when streaming) and frees every worker",
        flag="--http-deadline", above=0)
    client_stall_timeout_s: float = setting(
        DEFAULT_CLIENT_STALL_TIMEOUT_S, "seconds a client may leave a write of its stream (gRPC or HTTP) undrained "
        "before the gateway cuts the request and frees everything it held", flag="--client-stall-timeout", above=0)
    max_http_connections: int = setting(
        DEFAULT_MAX_CONNECTIONS, "open HTTP connections at once; a new one past it is answered 503 and closed", low=1)
    sse_min_write_bytes: int = setting(
        DEFAULT_SSE_MIN_WRITE_BYTES, "each SSE event is padded with spaces after its JSON to at least this many "
        "bytes, so that a client that stops reading fills its kernel's buffer and is cut (--client-stall-timeout): "
        "Linux keeps taking small writes for a socket that never reads; 0: no padding", metavar="BYTES", low=0,
        high=1 << 16)

    def __post_init__(self) -> None:
        if not self.decode:
            raise ValueError("at least one --decode worker address is required")
        check_settings(self)
        if self.api_key_file and not os.path.isfile(self.api_key_file):
            raise ValueError(f"--api-key-file {self.api_key_file}: no such file")
        ApiKeys.load(self.api_key_file)  # a key file or PDSERVE_API_KEYS holding no key must not turn auth off
        for address in self.prefill + self.decode:
            host, _, port = address.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"worker address {address!r}: expected host:port")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> GatewayConfig:
        args = argparse.Namespace(**{**vars(args), "idle_timeout_s": args.idle_timeout_s or None})  # 0: off
        retry = read_settings(RetryPolicy, args, capacity_wait_s=args.queue_timeout_s)
        return read_settings(
            cls, args, server=server_config(args), prefill=_split(args.prefill), decode=_split(args.decode),
            retry=retry,
            admission=read_settings(AdmissionConfig, args), keepalive=read_settings(Keepalive, args))

    @staticmethod
    def add_args(parser: argparse.ArgumentParser) -> None:
        add_server_args(parser)
        group = parser.add_argument_group("gateway")
        group.add_argument("--prefill", action="append", default=[], metavar="HOST:PORT",
                           help="prefill worker address (repeat, or comma-separate); none: every request is "
                           "colocated (decode workers prefill it themselves)")
        group.add_argument("--decode", action="append", default=[], metavar="HOST:PORT",
                           help="decode worker address (repeat, or comma-separate)")
        for config in (GatewayConfig, AdmissionConfig, RetryPolicy, Keepalive):
            add_settings(group, config)
