"""Wire encoding of KVTransfer messages, with a one-copy path for the chunks that carry the KV bytes.

Chunks are nearly all of a transfer's bytes, and the generic protobuf path copies them four times per side
(into the message, into the outer message, into the serialised string, out of the parsed field). Here:
- the sender lays a message out first (every size is known: the checksum is fixed64, written after the data),
  then copies each piece of KV into place once and hashes it while the copy has it in cache
  (layout.copy_with_checksum);
- the receiver decodes chunks into views of the received buffer.
A message carries one chunk, or several (KVTransfer.chunks) where it spans a tensor boundary. Headers and
trailers go through protobuf as usual. Any KVTransfer serialised by protobuf decodes here too, and the other way
round.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from kv_wire.layout import copy_with_checksum
from protos import decode_pb2
from protos import kv_transfer_pb2 as pb

# Decode.TransferKV, called with these functions instead of the generated (de)serializers.
_method = decode_pb2.DESCRIPTOR.services_by_name["Decode"].methods_by_name["TransferKV"]
TRANSFER_KV_METHOD = f"/{_method.containing_service.full_name}/{_method.name}"

_CHUNK_TAG = 0x12  # KVTransfer.chunk: field 2, length-delimited
_CHUNKS_TAG = 0x22  # KVTransfer.chunks: field 4, length-delimited
_REPEATED_CHUNK_TAG = 0x0A  # KVChunks.chunk: field 1, length-delimited
_LAYER_TAG, _KIND_TAG, _OFFSET_TAG = b"\x08", b"\x10", b"\x18"  # KVChunk fields 1-3, varints
_DATA_TAG = 0x22  # KVChunk.data: field 4, length-delimited
_CHECKSUM_PREFIX = b"\x29"  # KVChunk.checksum: field 5, fixed64
# KVChunk's fields by (number, wire type); any other field is skipped, as protobuf skips unknown fields.
_CHUNK_FIELDS = {(1, 0): "layer", (2, 0): "kind", (3, 0): "offset", (4, 2): "data", (5, 1): "checksum",
                 (6, 0): "length"}


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
class Piece:
    """KV bytes to send as one chunk: their tensor (layer, kind), byte offset in it, and the bytes (uint8)."""

    layer: int
    kind: int
    offset: int
    source: np.ndarray


@dataclass(frozen=True)
class Malformed:
    """A message that is not a KVTransfer; the receiver refuses the stream with INVALID_ARGUMENT."""

    reason: str


# What the TransferKV handler's request iterator yields; a list is the chunks of a KVTransfer.chunks.
Received = pb.KVTransfer | Chunk | list[Chunk] | Malformed


def transfer_kv(channel: grpc.aio.Channel) -> grpc.aio.StreamUnaryMultiCallable:
    """Decode.TransferKV on `channel`, sending pre-encoded chunks as they are."""
    return channel.stream_unary(TRANSFER_KV_METHOD, request_serializer=encode,
                                response_deserializer=pb.KVTransferAck.FromString)


def encode_pieces(pieces: Sequence[Piece]) -> bytes:
    """A serialised KVTransfer carrying `pieces` with their data: as its chunk, or as its chunks if several.

    Every byte is copied once, from its tensor into the message, and hashed while the copy has it in cache.
    Each chunk is laid out as: layer, kind, offset, data, checksum (the bytes protobuf would write).
    """
    assert pieces, "at least one piece"
    heads = [_chunk_head(p.layer, p.kind, p.offset, len(p.source)) for p in pieces]
    sizes = [len(head) + len(piece.source) + 9 for head, piece in zip(heads, pieces)]  # 9: checksum tag + 8 bytes
    if len(pieces) == 1:
        envelope, prefixes = b"", [bytes([_CHUNK_TAG]) + _varint(sizes[0])]
    else:
        prefixes = [bytes([_REPEATED_CHUNK_TAG]) + _varint(size) for size in sizes]
        envelope = bytes([_CHUNKS_TAG]) + _varint(sum(map(len, prefixes)) + sum(sizes))
    message, out = _blank_bytes(len(envelope) + sum(map(len, prefixes)) + sum(sizes))
    view = out.data  # a memoryview: writes small parts of the message faster than numpy
    position = len(envelope)
    view[:position] = envelope
    for prefix, head, piece in zip(prefixes, heads, pieces):
        start = position + len(prefix) + len(head)
        view[position:start] = prefix + head
        position = start + len(piece.source)
        digest = copy_with_checksum(out[start:position], piece.source)
        view[position : position + 9] = _CHECKSUM_PREFIX + digest.to_bytes(8, "little")
        position += 9
    assert position == len(out)
    return message


def encode(message: pb.KVTransfer | bytes) -> bytes:
    """The stream's serializer: chunks arrive already encoded; headers and trailers are protobuf messages."""
    return message if isinstance(message, bytes) else message.SerializeToString()


def decode(raw: bytes) -> Received:
    """The stream's deserializer. Never raises: a malformed message becomes Malformed."""
    view = memoryview(raw)
    try:
        if len(view) and view[0] in (_CHUNK_TAG, _CHUNKS_TAG):
            size, start = _read_varint(view, 1)
            if start + size == len(view):
                body = view[start:]
                return _decode_chunk(body) if view[0] == _CHUNK_TAG else _decode_chunks(body)
        return pb.KVTransfer.FromString(raw)  # header, trailer, or an unusual but valid encoding
    except (DecodeError, ValueError, IndexError) as exc:
        return Malformed(f"undecodable KVTransfer message ({len(raw)} bytes): {exc}")


def _decode_chunk(view: memoryview) -> Chunk:
    chunk = Chunk()
    for number, wire_type, value in _fields(view):
        if (number, wire_type) in _CHUNK_FIELDS:
            setattr(chunk, _CHUNK_FIELDS[number, wire_type], value)
    return chunk


def _decode_chunks(view: memoryview) -> list[Chunk]:
    return [_decode_chunk(value) for number, wire_type, value in _fields(view)
            if (number, wire_type) == (1, 2) and isinstance(value, memoryview)]


def _fields(view: memoryview) -> Iterator[tuple[int, int, int | memoryview]]:
    """(field number, wire type, value) of each field of a serialised message; bytes fields as views."""
    position = 0
    while position < len(view):
        key, position = _read_varint(view, position)
        number, wire_type = key >> 3, key & 7
        value: int | memoryview
        if wire_type == 0:
            value, position = _read_varint(view, position)
        elif wire_type in (1, 5):  # fixed64, fixed32
            width = 8 if wire_type == 1 else 4
            if position + width > len(view):
                raise ValueError("fixed-width field runs past the message")
            value, position = int.from_bytes(view[position : position + width], "little"), position + width
        elif wire_type == 2:
            size, position = _read_varint(view, position)
            if position + size > len(view):
                raise ValueError("length-delimited field runs past the message")
            value, position = view[position : position + size], position + size
        else:
            raise ValueError(f"wire type {wire_type} in field {number}")
        yield number, wire_type, value


# grpcio sends only `bytes`, which Python code cannot write into. A new bytes object may be filled by its creator
# before anyone else sees it (what PyBytes_FromStringAndSize(NULL, size) is for), so messages are built in place
# instead of joined from their parts, which would copy every KV byte a second time.
_new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
_new_bytes.argtypes, _new_bytes.restype = (ctypes.c_void_p, ctypes.c_ssize_t), ctypes.py_object
_bytes_address = ctypes.pythonapi.PyBytes_AsString
_bytes_address.argtypes, _bytes_address.restype = (ctypes.py_object,), ctypes.c_void_p


def _blank_bytes(size: int) -> tuple[bytes, np.ndarray]:
    """A new, unfilled bytes object of `size`, and a writable uint8 array over its contents: fill it all."""
    message = _new_bytes(None, size)
    contents = (ctypes.c_ubyte * size).from_address(_bytes_address(message))
    return message, np.frombuffer(memoryview(contents), dtype=np.uint8)


def _chunk_head(layer: int, kind: int, offset: int, size: int) -> bytes:
    """A KVChunk's fields before its data's bytes, as protobuf writes them (fields at zero left out)."""
    head = b""
    for tag, value in ((_LAYER_TAG, layer), (_KIND_TAG, kind), (_OFFSET_TAG, offset)):
        if value:
            head += tag + _varint(value)
    return head + bytes([_DATA_TAG]) + _varint(size)


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
