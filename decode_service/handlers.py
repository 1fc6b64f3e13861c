"""The decode service's gRPC registration: the generated one, except that TransferKV decodes its chunks as views
(kv_wire.codec), and that TransferKV with RenewLease may listen on a port of their own (--kv-port)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

from kv_wire import codec
from protos import decode_pb2, kv_transfer_pb2, worker_pb2

SERVICE = decode_pb2.DESCRIPTOR.services_by_name["Decode"].full_name


def control_handlers(servicer: Any) -> dict[str, grpc.RpcMethodHandler]:
    """Generate and GetInfo: the gateway's calls."""
    return {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate, request_deserializer=decode_pb2.DecodeRequest.FromString,
            response_serializer=decode_pb2.DecodeEvent.SerializeToString),
        "GetInfo": grpc.unary_unary_rpc_method_handler(
            servicer.GetInfo, request_deserializer=worker_pb2.WorkerInfoRequest.FromString,
            response_serializer=worker_pb2.WorkerInfo.SerializeToString),
    }


def kv_handlers(servicer: Any) -> dict[str, grpc.RpcMethodHandler]:
    """TransferKV and, beside it, RenewLease: the prefill worker that will send the KV renews the lease."""
    return {
        "TransferKV": grpc.stream_unary_rpc_method_handler(
            servicer.inbox.TransferKV, request_deserializer=codec.decode,
            response_serializer=kv_transfer_pb2.KVTransferAck.SerializeToString),
        "RenewLease": grpc.unary_unary_rpc_method_handler(
            servicer.RenewLease, request_deserializer=decode_pb2.LeaseRenewal.FromString,
            response_serializer=decode_pb2.LeaseRenewed.SerializeToString),
    }


def registering(handlers: dict[str, grpc.RpcMethodHandler]) -> Callable[[grpc.aio.Server], list[str]]:
    def register(server: grpc.aio.Server) -> list[str]:
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, handlers)])
        return [SERVICE]

    return register
