"""The image's HEALTHCHECK: `pdserve health ADDRESS`, without the CLI's imports.

`pdserve health` loads the whole CLI, torch included: ~2 s of CPU per probe, every interval, in every container.
This asks the same grpc.health.v1 question with only grpc and serving.tls loaded (~0.2 s), over mutual TLS when
PDSERVE_TLS_CERT, _KEY and _CA are set, and exits as `pdserve health` does: 0 when SERVING, 1 otherwise.
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from serving import tls


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("address", metavar="ADDRESS", help="host:port of any pdserve service")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds (default: %(default)s)")
    tls.add_args(parser, "the probe's")
    args = parser.parse_args()
    try:
        identity = tls.from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    with tls.channel(args.address, identity) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=args.timeout)
        except grpc.RpcError as exc:
            print(f"{args.address}: {exc.code().name}", file=sys.stderr)  # type: ignore[attr-defined]
            return 1
    print(f"{args.address}: {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main())
