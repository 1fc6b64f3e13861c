"""Protobuf fields written by hand: what a client built from another .proto, or from none, may send. The hostile
requests of the tests (tests/test_hostile_input.py) and of `bench soak` are made of them."""

from __future__ import annotations


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        out.append((value & 0x7F) | (0x80 if value > 0x7F else 0))
        value >>= 7
        if not value:
            return bytes(out)


def field(number: int, wire_type: int, payload: bytes) -> bytes:
    """One field (wire type 0: `payload` is the varint; 2: length-delimited)."""
    return varint(number << 3 | wire_type) + (varint(len(payload)) + payload if wire_type == 2 else payload)


def varint_field(number: int, value: int) -> bytes:
    return field(number, 0, varint(value))
