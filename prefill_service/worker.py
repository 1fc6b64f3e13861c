"""A prefill worker's state and a request's KV handoff (server.py's steps 3 and 5), free of the gRPC edge: the
engine and its event-loop client, the prefix cache, the channels to decode workers and the segments they lent."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind

from engine.client import EngineClient
from engine.core import EngineCore
from kv_wire.layout import KVLayout
from kv_wire.segments import SegmentMaps
from kv_wire.sender import KVSender
from model_runner.loading import LoadedModel
from model_runner.prefix_cache import PrefixCache
from prefill_service.config import PrefillConfig
from prefill_service.kv_push import DecodeChannels, KVPush
from prefill_service.metrics import prefill_metrics
from protos import prefill_pb2
from serving import tracing
from serving.server import CHANNEL_KEEPALIVE, MESSAGE_LIMITS
from serving.tls import aio_channel


@dataclass
class Handoff:
    """One request's way to its decode worker: the KV sender, the push that streams it, the flag that stops the
    forward pass, the KV's home in decode's segment when the pass can write it there, and the send span."""

    address: str
    sender: KVSender
    push: KVPush
    abandon: threading.Event
    home: list[tuple[torch.Tensor, torch.Tensor]] | None
    span: Span


class PrefillWorker:
    def __init__(self, config: PrefillConfig, runner: LoadedModel) -> None:
        self.config = config
        self.runner = runner
        self.spec = runner.spec
        self.prefix_cache = None
        if config.prefix_cache_mb:
            self.prefix_cache = PrefixCache(config.prefix_block_tokens, int(config.prefix_cache_mb * (1 << 20)))
        self.engine = EngineCore(runner, batch_tokens=config.batch_tokens, chunk_tokens=config.prefill_chunk,
                                 max_queued_tokens=config.max_queued_tokens, layer_streaming=config.layer_streaming,
                                 prefix_cache=self.prefix_cache)
        self.engine.start()
        self.client = EngineClient(self.engine)  # the engine thread's hops to this event loop
        self.channels = DecodeChannels(lambda address: aio_channel(
            address, config.server.tls, [*MESSAGE_LIMITS, *CHANNEL_KEEPALIVE], expect="decode"))
        self.segments = SegmentMaps()
        self.metrics = prefill_metrics(self.engine, self.segments, self.prefix_cache)

    def handoff(self, request: prefill_pb2.PrefillRequest, prompt_tokens: int) -> Handoff:
        """The request's KV handoff, ready before its pass: into decode's segment when it lent one this worker can
        open (same host), else over the wire. End it with `end`."""
        spec = self.spec
        layout = KVLayout(spec.num_layers, spec.num_kv_heads, spec.head_dim, prompt_tokens,
                          self.config.wire_dtype or spec.dtype)
        segment = home = None
        if self.config.kv_shm and request.shm_segment:
            segment = self.segments.open(request.shm_segment, request.reservation_token, layout.total_bytes)
        if segment is not None and layout.dtype == spec.dtype and self.runner.device.type == "cpu":
            home = segment.tensors(layout)  # the forward pass writes the KV straight into decode's segment
        span = tracing.tracer.start_span("kv.send", kind=SpanKind.CLIENT)
        with trace.use_span(span):  # the KV header carries this span's context to decode's receive span
            sender = KVSender(request.request_id, request.reservation_token, spec.fingerprint, layout,
                              self.config.chunk_bytes, trace_context=tracing.carrier(), segment=segment)
        abandon = threading.Event()
        push = KVPush(self.channels.acquire(request.decode_address), sender, abandon)  # released in end()
        return Handoff(request.decode_address, sender, push, abandon, home, span)

    def end(self, handoff: Handoff) -> None:
        """Finished, refused, cancelled or failed: stop computing, stop sending, end the span."""
        sender = handoff.sender
        handoff.abandon.set()
        self.engine.wake()
        handoff.push.cancel()
        self.channels.release(handoff.address)
        self.segments.prune()  # a segment decode retired (a cancel, a retry) is let go now, not at eviction
        handoff.span.set_attributes({"pdserve.kv_bytes": sender.bytes_sent, "pdserve.chunks": sender.chunks_sent,
                                     "pdserve.transport": sender.transport, "pdserve.state": sender.state.name})
        handoff.span.end()
        self.metrics.count("pdserve_kv_transfer_bytes", sender.bytes_sent, path=sender.transport)

    async def close(self) -> None:
        await self.channels.close()
        self.segments.close()
        await self.client.close()
