"""A request to the gateway and the pieces of its answer, as plain values: what the core (core.py) takes and gives,
whichever edge the request came by. Each edge translates its own wire format into these and back (gRPC:
from_pb/to_pb here, for server.py; HTTP: openai_api.py, which builds no protobuf)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from protos import gateway_pb2


@dataclass
class ChatTurn:
    role: str
    content: str


@dataclass
class Slo:
    """A request's service level (gateway.proto Slo); 0: the gateway's default."""

    ttft_ms: int = 0
    tpot_ms: int = 0
    refuse_late: bool = False


@dataclass
class GenerateInput:
    """What a client asked for, unchecked (request.parse_request checks it). Exactly one of prompt, token_ids and
    messages should be given; None: the field was not set, and takes its default."""

    prompt: str = ""
    token_ids: list[int] = field(default_factory=list)
    messages: list[ChatTurn] = field(default_factory=list)
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    request_id: str = ""
    ignore_eos: bool = False
    cache_salt: str = ""
    slo: Slo = field(default_factory=Slo)

    @classmethod
    def from_pb(cls, pb: gateway_pb2.GenerateRequest) -> GenerateInput:
        return cls(
            prompt=pb.prompt, token_ids=list(pb.token_ids),
            messages=[ChatTurn(turn.role, turn.content) for turn in pb.messages],
            max_tokens=pb.max_tokens if pb.HasField("max_tokens") else None,
            temperature=pb.temperature if pb.HasField("temperature") else None,
            top_p=pb.top_p if pb.HasField("top_p") else None, top_k=pb.top_k,
            seed=pb.seed if pb.HasField("seed") else None, stop=list(pb.stop), request_id=pb.request_id,
            ignore_eos=pb.ignore_eos, cache_salt=pb.cache_salt,
            slo=Slo(pb.slo.ttft_ms, pb.slo.tpot_ms, pb.slo.refuse_late))


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens whose KV a prefill worker reused from its prefix cache


@dataclass
class HopTimes:
    """What a request's journey through the workers took (journey.py fills them in as it reaches each point):
    milliseconds unless named, as both the journey's accumulator and the answer's Timing hold them."""

    reserve_ms: float = 0.0
    prefill_queue_ms: float = 0.0
    prefill_ms: float = 0.0
    kv_exposed_ms: float = 0.0
    kv_transfer_ms: float = 0.0
    kv_bytes: int = 0
    kv_transport: str = ""
    retries: int = 0
    migrations: int = 0
    placement: str = ""  # where the last attempt's prompt ran: "prefill" or "colocated"
    placement_reason: str = ""  # why: the options the model predicted, or the threshold that decided

    def hops(self) -> dict[str, Any]:
        """These fields alone (not a subclass's)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(HopTimes)}


@dataclass
class Timing(HopTimes):
    """Where a finished request's time went (gateway.proto Timing: the same fields): the journey's hops and the
    request's own figures."""

    ttft_ms: float = 0.0
    decode_tokens_per_s: float = 0.0
    total_ms: float = 0.0
    predicted_ttft_ms: float = 0.0  # the placement model's TTFT for the last attempt's choice (0: not by the model)
    placed_ttft_ms: float = 0.0  # the first token's time since that attempt began


@dataclass(frozen=True)
class Delta:
    """One piece of a streamed answer: the tokens since the last piece and their text. The last piece has its
    finish_reason ("stop" or "length"), usage and timing."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str = ""
    usage: Usage | None = None
    timing: Timing | None = None

    def to_pb(self) -> gateway_pb2.GenerateResponse:
        response = gateway_pb2.GenerateResponse(request_id=self.request_id, token_ids=self.token_ids, text=self.text,
                                                finish_reason=self.finish_reason)
        if self.usage is not None:
            response.usage.CopyFrom(gateway_pb2.Usage(**dataclasses.asdict(self.usage)))
        if self.timing is not None:
            response.timing.CopyFrom(gateway_pb2.Timing(**dataclasses.asdict(self.timing)))
        return response
