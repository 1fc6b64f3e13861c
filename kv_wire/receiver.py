"""Decode side: validate a KVTransfer stream message by message and assemble the KV it carries.

Nothing is handed on until the trailer proved the stream whole: every tensor covered exactly once, in order,
every checksum right, the totals equal. Any violation raises KVTransferError with the status that names it.

The received bytes are the KV, verified where they landed and never copied on this side: the engine copies
them straight into the sequence's slot when it joins.
- gRPC: each chunk is a view of its message (see codec.py), kept. That is only fast because the messages land
  in warm heap pages (serving/memory.py); left at glibc's defaults, every message got fresh pages and holding
  them was slower than copying them into a warm staging buffer (docs/architecture.md, "A warm heap").
- Shared memory: each chunk is verified in the lent segment, which stays lent until the join. Verified bytes
  can only change if a writer writes after its trailer, which pdserve's sender never does; a segment whose
  transfer did not end in an admitted KV may still have a writer, so decode retires it instead of lending it
  again (decode_service/lending.py).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import numpy as np
import torch

from kv_wire.codec import Chunk, Malformed, Received
from kv_wire.layout import LOSSY_WIRE_DTYPES, WIRE_DTYPES, KVLayout, KVTransferError, TransferState, checksum
from kv_wire.segments import Segment, data_region
from model_runner.paged_cache import KVPieces
from protos import kv_transfer_pb2 as pb
from protos.types import ModelSpec

_KIND_INDEX: dict[int, int] = {pb.KV_KIND_KEYS: 0, pb.KV_KIND_VALUES: 1}


@dataclass
class ReceivedKV:
    pieces: KVPieces  # every tensor's verified elements, in the wire dtype
    layout: KVLayout
    first_token: int
    in_segment: bool  # the pieces are views of the lent shared-memory segment (else of the received messages)

    @property
    def nbytes(self) -> int:
        return self.layout.total_bytes

    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (keys, values) of shape (num_kv_heads, num_tokens, head_dim), assembled (copies)."""
        shape = self.layout.tensor_shape
        tensors = [torch.cat([flat for _, flat in pieces]).view(shape) for pieces in self.pieces]
        return list(zip(tensors[0::2], tensors[1::2]))


class KVReceiver:
    def __init__(self, spec: ModelSpec, max_chunk_bytes: int) -> None:
        self.spec = spec
        self.max_chunk_bytes = max_chunk_bytes
        self.state = TransferState.WAITING
        self.layout: KVLayout | None = None
        self._segment: np.ndarray | None = None  # shm streams: the lent segment's data region
        self._pieces: list[list[tuple[int, bytes | memoryview]]] = []  # gRPC streams: verified chunks per tensor
        # Where the next chunk must start: tensor index (layer * 2 + keys 0 / values 1) and byte offset in it.
        self._tensor, self._offset = 0, 0
        self.bytes_received = 0
        self.chunks_received = 0
        self.failure: grpc.StatusCode | None = None  # why it failed

    def header_of(self, first: Received | None) -> pb.KVHeader:
        """A stream's first message (None: the stream ended at once), which must be its header."""
        if isinstance(first, Malformed):
            raise self.fail(grpc.StatusCode.INVALID_ARGUMENT, first.reason)
        if not isinstance(first, pb.KVTransfer) or first.WhichOneof("part") != "header":
            raise self.fail(grpc.StatusCode.INVALID_ARGUMENT, "a KV stream must start with a header")
        return first.header

    def accept(self, message: Received) -> ReceivedKV | None:
        """Any message after the header, as the codec decoded it: chunks are checked (accept_chunk), and the
        trailer ends the stream (finish), which gives the KV."""
        if isinstance(message, Malformed):
            raise self.fail(grpc.StatusCode.INVALID_ARGUMENT, message.reason)
        if isinstance(message, Chunk):
            self.accept_chunk(message)
            return None
        if isinstance(message, list):  # a KVTransfer.chunks
            self.accept_chunks(message)
            return None
        part = message.WhichOneof("part")
        if part == "chunk":
            self.accept_chunk(message.chunk)
        elif part == "chunks":
            self.accept_chunks(message.chunks.chunk)
        elif part == "trailer":
            return self.finish(message.trailer)
        else:
            raise self.fail(grpc.StatusCode.INVALID_ARGUMENT, f"unexpected {part or 'empty'} message mid-stream")
        return None

    def accept_header(self, header: pb.KVHeader, reserved_tokens: int, segment: Segment | None) -> KVLayout:
        """Check the header against this worker's model and the reservation.

        `segment` is the shared-memory segment lent to the reservation, if any.
        """
        spec = self.spec
        if header.model_fingerprint != spec.fingerprint:
            raise self.fail(grpc.StatusCode.FAILED_PRECONDITION,
                             f"model mismatch: sender fingerprint {header.model_fingerprint!r}, "
                             f"this decode worker serves {spec.name} {spec.dtype} ({spec.fingerprint!r})")
        lossy = spec.dtype == "float32" and header.dtype in LOSSY_WIRE_DTYPES
        if header.dtype != spec.dtype and not lossy:
            raise self.fail(grpc.StatusCode.FAILED_PRECONDITION,
                            f"KV dtype {header.dtype!r} does not fit this worker's {spec.dtype!r}")
        expected = (spec.num_layers, spec.num_kv_heads, spec.head_dim)
        got = (header.num_layers, header.num_kv_heads, header.head_dim)
        if got != expected:
            raise self.fail(grpc.StatusCode.INVALID_ARGUMENT,
                             f"KV shape (layers, kv_heads, head_dim) {got} differs from the model's {expected}")
        if header.num_tokens != reserved_tokens:
            raise self.fail(grpc.StatusCode.INVALID_ARGUMENT,
                             f"header.num_tokens {header.num_tokens} differs from the reserved prompt length "
                             f"{reserved_tokens}")
        if not 0 < header.chunk_bytes <= self.max_chunk_bytes:
            raise self.fail(grpc.StatusCode.INVALID_ARGUMENT,
                             f"header.chunk_bytes {header.chunk_bytes} outside (0, {self.max_chunk_bytes}]")
        if header.shm and segment is None:
            raise self.fail(grpc.StatusCode.INVALID_ARGUMENT,
                            "header says the KV is in shared memory, but this reservation was lent no segment")
        self.layout = layout = KVLayout(header.num_layers, header.num_kv_heads, header.head_dim, header.num_tokens,
                                        header.dtype)
        if header.shm:
            assert segment is not None
            self._segment = data_region(segment, layout.total_bytes)
        else:
            self._pieces = [[] for _ in range(2 * layout.num_layers)]
        self.state = TransferState.TRANSFERRING
        return self.layout

    def accept_chunk(self, chunk: pb.KVChunk | Chunk) -> None:
        """Check one chunk and copy its bytes into place (from the message, or from the lent segment)."""
        layout = self.layout
        assert layout is not None and self.state is TransferState.TRANSFERRING, "accept_header first"
        if not chunk.layer < layout.num_layers or chunk.kind not in _KIND_INDEX:
            raise self.fail(grpc.StatusCode.INVALID_ARGUMENT,
                             f"chunk names layer {chunk.layer} kind {chunk.kind}: no such tensor")
        tensor = chunk.layer * 2 + _KIND_INDEX[chunk.kind]
        if self._offset == layout.tensor_bytes:  # the previous tensor is complete: the next one starts
            self._tensor, self._offset = self._tensor + 1, 0
        in_segment = self._segment is not None
        data = chunk.data  # read once: a protobuf bytes field is copied on every access
        if in_segment and len(data) or not in_segment and chunk.length:
            raise self.fail(grpc.StatusCode.INVALID_ARGUMENT,
                            f"layer {chunk.layer} chunk: {'data in a shared-memory' if in_segment else 'length in a'}"
                            " stream (shm chunks carry a length, gRPC chunks their data)")
        size = chunk.length if in_segment else len(data)
        if (tensor, chunk.offset) != (self._tensor, self._offset):
            expected = f"layer {self._tensor // 2} {('keys', 'values')[self._tensor % 2]} at offset {self._offset}"
            raise self.fail(grpc.StatusCode.INVALID_ARGUMENT,
                            f"chunk for layer {chunk.layer} {('keys', 'values')[tensor % 2]} at offset {chunk.offset}, "
                            f"expected {expected} (chunks out of order, duplicated or missing)")
        too_big = size > self.max_chunk_bytes and not in_segment  # shm chunks are not messages: any size fits
        if size == 0 or too_big or chunk.offset + size > layout.tensor_bytes:
            raise self.fail(grpc.StatusCode.DATA_LOSS,
                             f"layer {chunk.layer} chunk of {size} bytes at offset {chunk.offset} does not fit a "
                             f"{layout.tensor_bytes}-byte tensor")
        itemsize = WIRE_DTYPES[layout.dtype].itemsize
        if size % itemsize or chunk.offset % itemsize:
            raise self.fail(grpc.StatusCode.INVALID_ARGUMENT,
                            f"layer {chunk.layer} chunk of {size} bytes at offset {chunk.offset} splits a "
                            f"{itemsize}-byte element (chunks hold whole elements)")
        verified: np.ndarray | bytes | memoryview
        if self._segment is not None:
            start = tensor * layout.tensor_bytes + chunk.offset
            verified = self._segment[start : start + size]
        else:
            verified = data  # the message itself: immutable, kept as it is
            self._pieces[tensor].append((chunk.offset, data))
        if checksum(verified) != chunk.checksum:
            raise self.fail(grpc.StatusCode.DATA_LOSS,
                            f"layer {chunk.layer} chunk at offset {chunk.offset}: checksum mismatch")
        self._offset = chunk.offset + size
        self.bytes_received += size
        self.chunks_received += 1

    def accept_chunks(self, chunks: Sequence[pb.KVChunk | Chunk]) -> None:
        """A KVChunks message: each chunk checked in turn, as if it came alone."""
        if not chunks:
            raise self.fail(grpc.StatusCode.INVALID_ARGUMENT, "a chunks message with no chunk")
        for chunk in chunks:
            self.accept_chunk(chunk)

    @property
    def complete_layers(self) -> int:
        """Layers whose keys and values have both arrived whole and verified (they come in order)."""
        layout = self.layout
        if layout is None or self.state is not TransferState.TRANSFERRING:
            return 0
        return (self._tensor + (self._offset == layout.tensor_bytes)) // 2

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A complete layer's keys and values, (num_kv_heads, num_tokens, head_dim) each, copied out of the messages
        or the segment into memory of their own (split prefill hands them on before the stream ends)."""
        layout = self.layout
        assert layout is not None and layer < self.complete_layers, "a complete layer"
        dtype = WIRE_DTYPES[layout.dtype]
        tensors = []
        for tensor in (2 * layer, 2 * layer + 1):
            if self._segment is not None:
                start = tensor * layout.tensor_bytes
                flat = torch.from_numpy(self._segment[start : start + layout.tensor_bytes]).view(dtype).clone()
            else:
                flat = torch.cat([_elements(data, dtype) for _, data in self._pieces[tensor]])
            tensors.append(flat.view(layout.tensor_shape))
        return tensors[0], tensors[1]

    def finish(self, trailer: pb.KVTrailer) -> ReceivedKV:
        layout = self.layout
        assert layout is not None and self.state is TransferState.TRANSFERRING, "accept_header first"
        complete = self._tensor + (self._offset == layout.tensor_bytes)
        if complete != 2 * layout.num_layers:
            raise self.fail(grpc.StatusCode.DATA_LOSS,
                            f"stream ended with {complete} of {2 * layout.num_layers} tensors complete "
                            f"(missing from layer {complete // 2})")
        if (trailer.total_bytes, trailer.num_chunks) != (self.bytes_received, self.chunks_received):
            raise self.fail(grpc.StatusCode.DATA_LOSS,
                             f"trailer counts {trailer.total_bytes} bytes in {trailer.num_chunks} chunks, received "
                             f"{self.bytes_received} in {self.chunks_received}")
        if trailer.first_token >= self.spec.vocab_size:
            raise self.fail(grpc.StatusCode.INVALID_ARGUMENT,
                             f"trailer.first_token {trailer.first_token} is outside the vocabulary")
        self.state = TransferState.COMPLETE
        dtype = WIRE_DTYPES[layout.dtype]
        in_segment = self._segment is not None
        if self._segment is not None:
            flat = torch.from_numpy(self._segment).view(dtype)
            elements = layout.tensor_bytes // dtype.itemsize
            pieces = [[(0, flat[i * elements : (i + 1) * elements])] for i in range(2 * layout.num_layers)]
        else:
            pieces = [[(offset // dtype.itemsize, _elements(data, dtype)) for offset, data in chunks]
                      for chunks in self._pieces]
        self._segment, self._pieces = None, []
        return ReceivedKV(pieces=pieces, layout=layout, first_token=trailer.first_token, in_segment=in_segment)

    def fail(self, code: grpc.StatusCode, message: str) -> KVTransferError:
        """Mark the transfer failed and free the partial KV at once; returns the error to raise."""
        self.state, self.failure = TransferState.FAILED, code
        self._segment, self._pieces = None, []
        return KVTransferError(code, message)


def _elements(data: bytes | memoryview, dtype: torch.dtype) -> torch.Tensor:
    """A received message's bytes as a 1-D tensor, without copying. Nothing ever writes to it, but torch warns
    about any read-only buffer."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(data, dtype=dtype)
