"""Mutual TLS between every pdserve process, from certificate files (`deploy/make-certs.sh` makes a development CA).

With `--tls-cert`, `--tls-key` and `--tls-ca`, a service accepts only callers whose certificate the CA signed, and
uses the same certificate as its own identity when it calls another service. Each certificate's common name is
its role (gateway, prefill, decode, or anything else for a client), and the roles authorise the calls between
services: only a `gateway` may reserve on decode or start a prefill, and only a `prefill` may push KV. Workers
are dialled by address (a pod IP, say), so a caller checks the worker's certificate against the role it expects
(`grpc.ssl_target_name_override`), which each role's certificate carries as a DNS name.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc


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


def aio_channel(address: str, tls: TLS | None, options: list[tuple[str, Any]] | None = None,
                expect: str = "") -> grpc.aio.Channel:
    """A channel to `address`: plain, or mutual TLS checking that the peer's certificate names `expect`."""
    if tls is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, tls.channel_credentials(), options=_options(options, expect))


def channel(address: str, tls: TLS | None, options: list[tuple[str, Any]] | None = None,
            expect: str = "") -> grpc.Channel:
    """The blocking twin of `aio_channel`."""
    if tls is None:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, tls.channel_credentials(), options=_options(options, expect))


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
