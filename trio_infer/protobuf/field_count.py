"""Counting a message's fields from its wire format, before protobuf parses it.

protobuf's parser makes an object for every submessage and map entry, and holds the GIL (and so
the event loop) while it does: a 64 MiB ModelInferRequest of empty ``outputs`` entries is 32
million of them, gigabytes and seconds. A legitimate request has few fields outside its tensors'
contents (its parameters are at most ``MAX_PARAMETERS`` map entries), so they are counted first,
by walking the wire format without building anything, and a request with too many is refused
before it is parsed. The walk stops at the limit, so it costs no more than a small request's
parse, whatever the message holds.

Only the fields a :data:`FieldTree` names are descended into; any other length-delimited field
(a tensor's contents, a raw tensor, a string) is stepped over whole.
"""

from __future__ import annotations

from collections.abc import Mapping

from trio_infer.buffers import Buffer

__all__ = ["MODEL_INFER_REQUEST", "FieldTree", "count_fields"]

FieldTree = Mapping[int, "FieldTree"]
"""Field numbers to descend into, each with the tree of its own message."""

#: A ModelInferRequest: its own fields, each input's (name, datatype, shape, parameter map
#: entries, contents) and each requested output's (name, parameter map entries). A tensor's
#: contents are not descended into: they are its elements, bounded by their own rules.
MODEL_INFER_REQUEST: FieldTree = {5: {}, 6: {}}

_VARINT, _FIXED64, _LENGTH_DELIMITED, _FIXED32 = 0, 1, 2, 5


class _NotWireFormat(Exception):
    """The bytes are not protobuf's wire format: the parser will say how."""


def count_fields(data: Buffer, tree: FieldTree, limit: int) -> int:
    """The fields of the message in ``data`` and of the submessages ``tree`` names, counted
    until more than ``limit``.

    Returns:
        The count, or ``limit + 1`` once it passes the limit (the rest is not walked). Bytes
        that are not wire format end the count where they start: the parser that reads them
        next refuses them.
    """
    with memoryview(data) as view, view.cast("B") as raw:
        count = 0
        # Invariant: each entry is a message still to walk: its next byte, its end, its tree.
        pending: list[tuple[int, int, FieldTree]] = [(0, len(raw), tree)]
        try:
            while pending:
                position, end, fields = pending.pop()
                while position < end:
                    count += 1
                    if count > limit:
                        return count
                    key, position = _varint(raw, position, end)
                    kind = key & 7
                    if kind == _VARINT:
                        _, position = _varint(raw, position, end)
                    elif kind == _FIXED64:
                        position += 8
                    elif kind == _FIXED32:
                        position += 4
                    elif kind == _LENGTH_DELIMITED:
                        length, position = _varint(raw, position, end)
                        inner = fields.get(key >> 3)
                        if inner is not None and position + length <= end:
                            pending.append((position, position + length, inner))
                        position += length
                    else:
                        raise _NotWireFormat  # groups are not proto3; nothing else exists
        except _NotWireFormat:
            pass
        return count


def _varint(raw: memoryview, position: int, end: int) -> tuple[int, int]:
    """The varint at ``position`` and the position after it."""
    value = 0
    shift = 0
    while position < end and shift < 70:
        byte = raw[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, position
        shift += 7
    raise _NotWireFormat
