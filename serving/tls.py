"""Mutual TLS between every pdserve process, from certificate files (`deploy/make-certs.sh` makes a development CA).

With `--tls-cert`, `--tls-key` and `--tls-ca`, a service accepts only callers whose certificate the CA signed, and
uses the same certificate as its own identity when it calls another service. Each certificate's common name is
its role (gateway, prefill, decode, or anything else for a client), and the roles authorise the calls between
services: only a `gateway` may reserve on decode or start a prefill, and only a `prefill` may push KV. Workers
are dialled by address (a pod IP, say), so a caller checks the worker's certificate against the role it expects
(`grpc.ssl_target_name_override`), which each role's certificate carries as a DNS name.

Without TLS, a shared worker token authenticates the calls between services instead: with PDSERVE_WORKER_TOKEN
(or PDSERVE_WORKER_TOKEN_FILE) set, every channel sends it as `x-pdserve-worker-token` metadata and every worker
refuses a call without it (UNAUTHENTICATED), health checks and reflection excepted. A worker with neither TLS
nor a token listens on loopback only (serving.py refuses anything else): whoever reaches a worker's port could
otherwise reserve decode capacity, make prefill dial any address, or hold KV streams open.
"""

from __future__ import annotations

import argparse
import hmac
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

TOKEN_HEADER = "x-pdserve-worker-token"
# Calls a worker answers without the token: probes (the gateway's health checks, `pdserve health`) and discovery.
UNAUTHENTICATED_METHODS = ("/grpc.health.v1.Health/", "/grpc.reflection.")


@dataclass(frozen=True)
class TLS:
    cert: str
    key: str
    ca: str

    @classmethod
    def of(cls, directory: str, role: str) -> TLS:
        """`role`'s certificate in a directory `deploy/make-certs.sh` wrote: ROLE.pem, ROLE-key.pem, ca.pem."""
        return cls(*(os.path.join(directory, name) for name in (f"{role}.pem", f"{role}-key.pem", "ca.pem")))

    def flags(self) -> list[str]:
        """The same certificate as a service's flags."""
        return [f"--tls-cert={self.cert}", f"--tls-key={self.key}", f"--tls-ca={self.ca}"]

    def __post_init__(self) -> None:
        for flag, path in (("--tls-cert", self.cert), ("--tls-key", self.key), ("--tls-ca", self.ca)):
            if not Path(path).is_file():
                raise ValueError(f"{flag} {path}: no such file")

    def _read(self) -> tuple[bytes, bytes, bytes]:
        return Path(self.cert).read_bytes(), Path(self.key).read_bytes(), Path(self.ca).read_bytes()

    def server_credentials(self) -> grpc.ServerCredentials:
        cert, key, ca = self._read()
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        cert, key, ca = self._read()
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def add_args(group: Any, whose: str = "this service's") -> None:
    """The three flags; each defaults to an environment variable (PDSERVE_TLS_CERT, _KEY, _CA), which suits
    containers and health probes."""
    group.add_argument("--tls-cert", default=os.environ.get("PDSERVE_TLS_CERT", ""),
                       help=f"{whose} certificate (PEM): turns on mutual TLS (default: $PDSERVE_TLS_CERT)")
    group.add_argument("--tls-key", default=os.environ.get("PDSERVE_TLS_KEY", ""),
                       help="its private key (PEM) (default: $PDSERVE_TLS_KEY)")
    group.add_argument("--tls-ca", default=os.environ.get("PDSERVE_TLS_CA", ""),
                       help="the CA that signs every service's and client's certificate (default: $PDSERVE_TLS_CA)")


def from_args(args: argparse.Namespace) -> TLS | None:
    given = [args.tls_cert, args.tls_key, args.tls_ca]
    if not any(given):
        return None
    if not all(given):
        raise ValueError("--tls-cert, --tls-key and --tls-ca go together")
    return TLS(args.tls_cert, args.tls_key, args.tls_ca)


def _options(options: list[tuple[str, Any]] | None, expect: str) -> list[tuple[str, Any]]:
    return [*(options or []), *([("grpc.ssl_target_name_override", expect)] if expect else [])]


def worker_token() -> str:
    """The shared worker token from PDSERVE_WORKER_TOKEN, or the file PDSERVE_WORKER_TOKEN_FILE names; "" when
    neither is set. A file that holds no token is an error, never a silent "no authentication"."""
    token = os.environ.get("PDSERVE_WORKER_TOKEN", "")
    path = os.environ.get("PDSERVE_WORKER_TOKEN_FILE", "")
    if path and not token:
        try:
            token = Path(path).read_text().strip()
        except OSError as exc:
            raise ValueError(f"PDSERVE_WORKER_TOKEN_FILE {path}: {exc.strerror}") from exc
        if not token:
            raise ValueError(f"PDSERVE_WORKER_TOKEN_FILE {path} holds no token")
    return token


def _with_token(metadata: Any, token: str) -> list[tuple[str, str]]:
    return [*(metadata or ()), (TOKEN_HEADER, token)]


class _AioToken:
    """Adds the worker token to every call of an asyncio channel: one interceptor per call kind, since the
    channel files each interceptor under the first kind it matches (grpc/aio/_channel.py)."""

    def __init__(self, token: str) -> None:
        self._token = token

    def details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        return grpc.aio.ClientCallDetails(details.method, details.timeout,
                                          _with_token(details.metadata, self._token),  # type: ignore[arg-type]
                                          details.credentials, details.wait_for_ready)

    def interceptors(self) -> list[grpc.aio.ClientInterceptor]:
        token = self

        class UnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
            async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
                return await continuation(token.details(details), request)

        class UnaryStream(grpc.aio.UnaryStreamClientInterceptor):
            async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
                return await continuation(token.details(details), request)

        class StreamUnary(grpc.aio.StreamUnaryClientInterceptor):
            async def intercept_stream_unary(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
                return await continuation(token.details(details), request_iterator)

        class StreamStream(grpc.aio.StreamStreamClientInterceptor):
            async def intercept_stream_stream(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
                return await continuation(token.details(details), request_iterator)

        return [UnaryUnary(), UnaryStream(), StreamUnary(), StreamStream()]


class _Details(grpc.ClientCallDetails):
    def __init__(self, details: grpc.ClientCallDetails, token: str) -> None:
        self.method, self.timeout, self.credentials = details.method, details.timeout, details.credentials
        self.metadata = _with_token(details.metadata, token)
        self.wait_for_ready = getattr(details, "wait_for_ready", None)
        self.compression = getattr(details, "compression", None)


class _SyncToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                 grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """The blocking twin of _AioToken."""

    def __init__(self, token: str) -> None:
        self._token = token

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(_Details(details, self._token), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(_Details(details, self._token), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
        return continuation(_Details(details, self._token), request_iterator)

    def intercept_stream_stream(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
        return continuation(_Details(details, self._token), request_iterator)


class RequireWorkerToken(grpc.aio.ServerInterceptor):
    """A worker's check of the token on every call but probes: a wrong or missing one ends it UNAUTHENTICATED."""

    def __init__(self, token: str) -> None:
        self._token = token.encode()

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or details.method.startswith(UNAUTHENTICATED_METHODS):
            return handler
        sent = dict(details.invocation_metadata or ()).get(TOKEN_HEADER, "")
        if hmac.compare_digest(sent.encode() if isinstance(sent, str) else sent, self._token):
            return handler
        return _refusal(handler, "missing or wrong worker token (x-pdserve-worker-token): this worker serves "
                                 "only pdserve services that share its PDSERVE_WORKER_TOKEN")


def _refusal(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that ends the call UNAUTHENTICATED before reading anything."""
    async def refuse(_: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    kinds = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
             (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}
    make = kinds[(handler.request_streaming, handler.response_streaming)]
    return make(refuse, request_deserializer=handler.request_deserializer,  # type: ignore[operator]
                response_serializer=handler.response_serializer)


def aio_channel(address: str, tls: TLS | None, options: list[tuple[str, Any]] | None = None,
                expect: str = "") -> grpc.aio.Channel:
    """A channel to `address`: plain, or mutual TLS checking that the peer's certificate names `expect`; with the
    worker token on every call when one is set."""
    token = worker_token()
    interceptors = _AioToken(token).interceptors() if token else None
    if tls is None:
        return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
    return grpc.aio.secure_channel(address, tls.channel_credentials(), options=_options(options, expect),
                                   interceptors=interceptors)


def channel(address: str, tls: TLS | None, options: list[tuple[str, Any]] | None = None,
            expect: str = "") -> grpc.Channel:
    """The blocking twin of `aio_channel`."""
    if tls is None:
        plain = grpc.insecure_channel(address, options=options)
    else:
        plain = grpc.secure_channel(address, tls.channel_credentials(), options=_options(options, expect))
    token = worker_token()
    return grpc.intercept_channel(plain, _SyncToken(token)) if token else plain


def peer_role(context: grpc.aio.ServicerContext) -> str | None:
    """The common name on the caller's certificate; None on a plain-text server."""
    auth = context.auth_context()
    if auth.get("transport_security_type") != [b"ssl"]:  # plain text reports b"insecure"
        return None
    names = auth.get("x509_common_name") or [b""]
    return names[0].decode()


async def require_peer(context: grpc.aio.ServicerContext, role: str, what: str) -> None:
    """Abort with PERMISSION_DENIED unless the caller's certificate is `role`'s (no-op without TLS)."""
    peer = peer_role(context)
    if peer is not None and peer != role:
        await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                            f"{what} is for {role} certificates; the caller presented {peer!r}")
