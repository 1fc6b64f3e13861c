"""Prefill side: turn per-layer KV tensors into a stream of KVTransfer messages as the layers are produced."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field

import grpc
import numpy as np
import torch

from kv_wire import codec
from kv_wire.layout import WIRE_DTYPES, KVLayout, KVTransferError, TransferState, checksum, copy_with_checksum
from kv_wire.segments import SegmentView
from protos import kv_transfer_pb2 as pb

_KINDS = (pb.KV_KIND_KEYS, pb.KV_KIND_VALUES)


@dataclass
class KVSender:
    """Encodes one request's KV. Feed it layers in order; it gives the wire messages and counts what it sent.

    With a `segment` (the same-host fast path) each chunk's bytes are written into decode's shared-memory
    segment and the message carries only where they are and their checksum.
    """

    request_id: str
    reservation_token: str
    model_fingerprint: str
    layout: KVLayout
    chunk_bytes: int
    trace_context: dict[str, str] = field(default_factory=dict)
    segment: SegmentView | None = None
    state: TransferState = TransferState.WAITING
    bytes_sent: int = 0
    chunks_sent: int = 0

    def header(self) -> pb.KVTransfer:
        self.state = TransferState.TRANSFERRING
        return pb.KVTransfer(header=pb.KVHeader(
            request_id=self.request_id,
            reservation_token=self.reservation_token,
            model_fingerprint=self.model_fingerprint,
            dtype=self.layout.dtype,
            num_layers=self.layout.num_layers,
            num_kv_heads=self.layout.num_kv_heads,
            head_dim=self.layout.head_dim,
            num_tokens=self.layout.num_tokens,
            chunk_bytes=self.chunk_bytes,
            trace_context=self.trace_context,
            shm=self.segment is not None,
        ))

    @property
    def transport(self) -> str:
        return "grpc" if self.segment is None else "shm"

    def encode(self, layers: Sequence[Layer]) -> Iterator[bytes]:
        """The messages carrying `layers` (the next ones, in order), each built when the one before is taken.

        gRPC: every message carries chunk_bytes of KV, cut across tensor boundaries, except the last, which
        carries what is left. Built lazily, a message reuses the memory its predecessor freed, still in cache.
        Shared memory: each tensor is written into the segment; messages carry up to SHM_BATCH_BYTES of KV's
        descriptors (and at least one).
        """
        if self.segment is None:
            for pieces in self._pack(layers):
                self.chunks_sent += len(pieces)
                yield codec.encode_pieces(pieces)
        else:
            for batch in self._write_to_segment(layers):
                self.chunks_sent += len(batch)
                yield pb.KVTransfer(chunks=pb.KVChunks(chunk=batch)).SerializeToString()

    def _pack(self, layers: Sequence[Layer]) -> Iterator[list[codec.Piece]]:
        """The tensors' bytes in messages of chunk_bytes (the last one shorter); chunks hold whole elements."""
        itemsize = WIRE_DTYPES[self.layout.dtype].itemsize
        full = max(self.chunk_bytes - self.chunk_bytes % itemsize, itemsize)
        pieces: list[codec.Piece] = []
        room = full
        for index, kind, raw in self._tensors(layers):
            offset = 0
            while offset < len(raw):
                size = min(room, len(raw) - offset)  # both whole elements, so size is too
                pieces.append(codec.Piece(index, kind, offset, raw[offset : offset + size]))
                self.bytes_sent += size
                offset, room = offset + size, room - size
                if not room:
                    yield pieces
                    pieces, room = [], full
        if pieces:
            yield pieces

    def _write_to_segment(self, layers: Sequence[Layer]) -> Iterator[list[pb.KVChunk]]:
        """Each tensor copied into its place in decode's segment, described by one chunk (the unit of checksum).

        A tensor already in its place (the forward pass wrote it there: SegmentView.tensors) is only hashed."""
        assert self.segment is not None
        batch: list[pb.KVChunk] = []
        for index, kind, raw in self._tensors(layers):
            if not self.segment.still_lent():
                raise KVTransferError(grpc.StatusCode.CANCELLED,
                                      "decode took its shared-memory segment back (reservation released)")
            start = (index * 2 + kind - 1) * self.layout.tensor_bytes  # kind is 1 (keys) or 2 (values)
            target = self.segment.data[start : start + len(raw)]
            digest = checksum(target) if raw.ctypes.data == target.ctypes.data else copy_with_checksum(target, raw)
            batch.append(pb.KVChunk(layer=index, kind=pb.KVKind.ValueType(kind), offset=0, length=len(raw),
                                    checksum=digest))
            self.bytes_sent += len(raw)
            if len(batch) * self.layout.tensor_bytes >= SHM_BATCH_BYTES:
                yield batch
                batch = []
        if batch:
            yield batch

    def _tensors(self, layers: Sequence[Layer]) -> Iterator[tuple[int, int, np.ndarray]]:
        """(layer, kind, the tensor's bytes in the wire dtype) in wire order; keys and values are
        (num_kv_heads, num_tokens, head_dim)."""
        dtype = WIRE_DTYPES[self.layout.dtype]
        for index, keys, values in layers:
            for kind, tensor in zip(_KINDS, (keys, values)):
                yield index, kind, host_bytes(tensor, dtype)

    def trailer(self, first_token: int) -> pb.KVTransfer:
        return pb.KVTransfer(trailer=pb.KVTrailer(
            total_bytes=self.bytes_sent, num_chunks=self.chunks_sent, first_token=first_token
        ))


def host_bytes(tensor: torch.Tensor, dtype: torch.dtype) -> np.ndarray:
    """`tensor` in `dtype`, C-contiguous in host memory, as uint8: a view where it can be (a CPU tensor already in
    `dtype` and contiguous), else one copy.

    A CUDA tensor is cast where it lives (a downcast moves fewer bytes), then copied out once, by DMA into page-locked
    memory from torch's pinned-memory cache (reused from one tensor to the next). The copy returns when it is done.
    Copying into pageable memory instead goes through the driver's own pinned staging buffer: two copies.
    """
    wire = tensor.detach().to(dtype).contiguous()
    if wire.device.type != "cpu":
        host = torch.empty(wire.shape, dtype=dtype, pin_memory=True)
        host.copy_(wire)
        wire = host
    return wire.view(-1).view(torch.uint8).numpy()


# Shared-memory streams send the descriptors of the tensors already written in one message, covering up to
# this much KV: fewer messages, while decode verifies one batch as the next is written; one batch for everything
# would verify only after the last write (docs/architecture.md, "Why these numbers").
SHM_BATCH_BYTES = 4 << 20

# What prefill hands the stream: a finished layer (layer, keys, values), then the first token, which closes the
# stream; None instead ends it early (the request was cancelled).
Layer = tuple[int, torch.Tensor, torch.Tensor]
Item = Layer | int | None


async def encode_stream(sender: KVSender, items: asyncio.Queue[Item]) -> AsyncIterator[pb.KVTransfer | bytes]:
    """The whole request stream: header, the KV of each layer as it arrives in `items`, then the trailer.

    Each round sends every layer already waiting, packed (KVSender.encode); a layer that arrives alone goes alone,
    so nothing waits for a layer the forward pass has not produced yet.
    Send it with `codec.transfer_kv(channel)`, whose serializer passes the pre-encoded chunks through.
    """
    yield sender.header()
    while True:
        layers: list[Layer] = []
        item = await items.get()
        while isinstance(item, tuple) and not items.empty():
            layers.append(item)
            item = items.get_nowait()
        if isinstance(item, tuple):
            layers.append(item)
        if item is None:  # cancelled: the request stream ends, so gRPC's task reading it ends too
            return
        for message in sender.encode(layers):
            yield message
        if isinstance(item, int):  # the first token: the last layer was sent
            yield sender.trailer(item)
            return
