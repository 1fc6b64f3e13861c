"""A small Python client for the gateway's Generate stream (used by `pdserve generate` and the tests)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from protos import gateway_pb2, gateway_pb2_grpc
from serving.tls import TLS, channel


@dataclass
class Completion:
    request_id: str = ""
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    usage: gateway_pb2.Usage | None = None
    timing: gateway_pb2.Timing | None = None


def stream(address: str, timeout: float | None = None, api_key: str = "", tls: TLS | None = None,
           **fields: Any) -> Iterator[gateway_pb2.GenerateResponse]:
    """Yield the gateway's responses for one request; `fields` are GenerateRequest fields (`messages` may be
    a list of {"role", "content"} dicts). `api_key` is sent as `authorization: Bearer ...` when given; `tls` is
    the client's certificate when the gateway runs mutual TLS."""
    if fields.get("messages"):
        fields["messages"] = [gateway_pb2.ChatMessage(**m) if isinstance(m, dict) else m for m in fields["messages"]]
    metadata = [("authorization", f"Bearer {api_key}")] if api_key else None
    with channel(address, tls) as chan:
        call = gateway_pb2_grpc.GatewayStub(chan).Generate(gateway_pb2.GenerateRequest(**fields), timeout=timeout,
                                                              metadata=metadata)
        try:
            yield from call
        finally:
            call.cancel()  # leaving the loop early cancels the request on every service


def generate(address: str, timeout: float | None = None, api_key: str = "", tls: TLS | None = None,
             **fields: Any) -> Completion:
    completion = Completion()
    for response in stream(address, timeout, api_key, tls, **fields):
        completion.request_id = response.request_id
        completion.token_ids.extend(response.token_ids)
        completion.text += response.text
        if response.finish_reason:
            completion.finish_reason = response.finish_reason
            completion.usage, completion.timing = response.usage, response.timing
    return completion
