"""The protobuf wire format's varint, which the TensorBoard and W&B readers both decode by hand:
each reads a few fields of a few messages, so neither takes protobuf and its generated classes."""

from __future__ import annotations


class WireError(ValueError):
    """Bytes that are not a protobuf varint."""


def varint(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    """The unsigned 64-bit value starting at buf[pos] (before `end`) and the position after it."""
    value = shift = 0
    while pos < end and shift < 70:
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value & 0xFFFFFFFFFFFFFFFF, pos
        shift += 7
    raise WireError("bad varint")
