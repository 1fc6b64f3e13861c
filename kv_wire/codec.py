"""Wire encoding of KVTransfer messages, with a copy-free path for the chunks that carry the KV bytes.

Chunks are nearly all of a transfer's bytes, and the generic protobuf path copies them four times per side
(into the message, into the outer message, into the serialised string, out of the parsed field). Here a
chunk is encoded as standard protobuf bytes with a single copy (the join of a small prefix with the tensor's
memory) and decoded into a view of the received buffer. Headers and trailers go through protobuf as usual.
Any KVTransfer serialised by protobuf decodes here too, and the other way round.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError

from protos import decode_pb2
from protos import kv_transfer_pb2 as pb

# Decode.TransferKV, called with these functions instead of the generated (de)serializers.
_method = decode_pb2.DESCRIPTOR.services_by_name["Decode"].methods_by_name["TransferKV"]
TRANSFER_KV_METHOD = f"/{_method.containing_service.full_name}/{_method.name}"

_CHUNK_TAG = b"\x12"  # KVTransfer.chunk: field 2, length-delimited
_CHUNKS_TAG = b"\x22"  # KVTransfer.chunks: field 4, length-delimited
_REPEATED_CHUNK_TAG = b"\x0a"  # KVChunks.chunk: field 1, length-delimited
_DATA_TAG = b"\x22"  # KVChunk.data: field 4, length-delimited
_VARINT_FIELDS = {1: "layer", 2: "kind", 3: "offset", 5: "checksum", 6: "length"}


@dataclass
class Chunk:
    """A decoded KVChunk whose data is a view of the received message, not a copy (same fields as pb.KVChunk)."""

    layer: int = 0
    kind: int = 0
    offset: int = 0
    data: memoryview = memoryview(b"")
    checksum: int = 0
    length: int = 0


@dataclass(frozen=True)
class Malformed:
    """A message that is not a KVTransfer; the receiver refuses the stream with INVALID_ARGUMENT."""

    reason: str


Received = pb.KVTransfer | Chunk | Malformed  # what the TransferKV handler's request iterator yields


def transfer_kv(channel: grpc.aio.Channel) -> grpc.aio.StreamUnaryMultiCallable:
    """Decode.TransferKV on `channel`, sending pre-encoded chunks as they are."""
    return channel.stream_unary(TRANSFER_KV_METHOD, request_serializer=encode,
                                response_deserializer=pb.KVTransferAck.FromString)


def encode_chunk(layer: int, kind: int, offset: int, checksum: int, data: memoryview | None, length: int = 0) -> bytes:
    """A serialised KVTransfer{chunk}: `data` (the bytes path) or `length` (shared memory), never both."""
    fields = pb.KVChunk(layer=layer, kind=pb.KVKind.ValueType(kind), offset=offset, checksum=checksum,
                        length=length).SerializeToString()
    if data is None:
        return _CHUNK_TAG + _varint(len(fields)) + fields
    data_prefix = _DATA_TAG + _varint(len(data))
    return b"".join((_CHUNK_TAG, _varint(len(fields) + len(data_prefix) + len(data)), fields, data_prefix, data))


def encode_chunks(chunks: list[bytes]) -> bytes:
    """Serialised KVTransfer{chunk} messages (from encode_chunk) as one serialised KVTransfer{chunks}.

    Each chunk keeps its encoding: only its field tag changes, from KVTransfer.chunk to KVChunks.chunk.
    """
    assert chunks and all(chunk[:1] == _CHUNK_TAG for chunk in chunks), "encode_chunk's messages only"
    body = b"".join(_REPEATED_CHUNK_TAG + memoryview(chunk)[1:] for chunk in chunks)
    return _CHUNKS_TAG + _varint(len(body)) + body


def encode(message: pb.KVTransfer | bytes) -> bytes:
    """The stream's serializer: chunks arrive already encoded; headers and trailers are protobuf messages."""
    return message if isinstance(message, bytes) else message.SerializeToString()


def decode(raw: bytes) -> pb.KVTransfer | Chunk | Malformed:
    """The stream's deserializer. Never raises: a malformed message becomes Malformed."""
    view = memoryview(raw)
    try:
        if view[:1] == _CHUNK_TAG:
            size, start = _read_varint(view, 1)
            if start + size == len(view):
                return _decode_chunk(view[start:])
        return pb.KVTransfer.FromString(raw)  # header, trailer, or an unusual but valid encoding
    except (DecodeError, ValueError, IndexError) as exc:
        return Malformed(f"undecodable KVTransfer message ({len(raw)} bytes): {exc}")


def _decode_chunk(view: memoryview) -> Chunk:
    chunk, position = Chunk(), 0
    while position < len(view):
        key, position = _read_varint(view, position)
        field, wire_type = key >> 3, key & 7
        if wire_type == 0:
            value, position = _read_varint(view, position)
            if field in _VARINT_FIELDS:
                setattr(chunk, _VARINT_FIELDS[field], value)
        elif wire_type == 2:
            size, position = _read_varint(view, position)
            if position + size > len(view):
                raise ValueError("length-delimited field runs past the message")
            if field == 4:
                chunk.data = view[position : position + size]
            position += size
        elif wire_type in (1, 5):  # fixed64 / fixed32 fields unknown to this version: skip
            position += 8 if wire_type == 1 else 4
        else:
            raise ValueError(f"wire type {wire_type} in KVChunk")
    if position != len(view):
        raise ValueError("KVChunk ends mid-field")
    return chunk


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _read_varint(view: memoryview, position: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if shift > 63:
            raise ValueError("varint longer than 10 bytes")
        byte = view[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, position
        shift += 7
