"""Wire views of ModelInfer messages, and a vectorised protocol buffer varint codec.

In proto3's wire format an embedded message, like a packed repeated scalar field, is one
length-delimited record, exactly as a ``bytes`` field of the same number is.
:data:`WireInferRequest` is ``ModelInferRequest`` with each input's ``contents`` declared
``repeated bytes``: parsing it copies each input's contents as one blob (one per occurrence on the
wire; concatenated they are the contents message, as protobuf merges repeated occurrences) instead
of parsing typed numeric contents element by element, which holds the GIL for every element.
Every other field keeps its real declaration, so names, shapes, parameters, raw contents and
requested outputs parse exactly as in the real message.

A contents blob is then split into its records by :func:`split_records`: a packed numeric field is
one record whose payload is decoded here with numpy, as a zero-copy slice of the blob. Splitting
by hand rather than with a second view type sees every record's field number and wire type, so
elements sent unpacked (a record per element) and fields the protocol does not define are found
exactly and at no cost; protobuf's Python API exposes unknown fields only by serialising the
message or by building an object per unknown field.

The view is built at import from the real message's descriptor (only the declaration named above
changes, so the field numbers cannot drift) and registered in the private pool
(:mod:`trio_infer.protobuf._pool`) as ``inference.wire.ModelInferRequest``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import numpy as np
from google.protobuf import descriptor_pb2, message_factory
from google.protobuf.message import Message

from trio_infer.protobuf._pool import POOL
from trio_infer.protobuf._proto import grpc_predict_v2_pb2 as _pb

__all__ = [
    "MAX_VARINT_BYTES",
    "Irregular",
    "VarintError",
    "WireInferRequest",
    "count_varints",
    "decode_varints",
    "encode_varint_parts",
    "encode_varints",
    "raw_input_suffix",
    "split_records",
    "varint_encode_scratch",
    "varint_scratch",
    "varint_sizes",
]

#: A 64-bit value takes at most ten 7-bit groups; protobuf refuses a longer varint.
MAX_VARINT_BYTES = 10
#: A record's key (a 32-bit value) takes at most five; protobuf refuses a longer key, even one
#: padded with groups of zero bits to a value that fits.
_MAX_KEY_BYTES = 5

#: The numeric fields of ``InferTensorContents``, which the contents view declares ``bytes``.
NUMERIC_FIELDS = (
    "bool_contents",
    "int_contents",
    "int64_contents",
    "uint_contents",
    "uint64_contents",
    "fp32_contents",
    "fp64_contents",
)

_PACKAGE = "inference"
_VIEW_PACKAGE = "inference.wire"
_FieldProto = descriptor_pb2.FieldDescriptorProto


def _as_repeated_bytes(field: descriptor_pb2.FieldDescriptorProto) -> None:
    field.type = _FieldProto.TYPE_BYTES
    field.label = _FieldProto.LABEL_REPEATED
    field.ClearField("type_name")
    field.ClearField("options")


def _retarget(message: descriptor_pb2.DescriptorProto, old: str, new: str) -> None:
    # Point references to the copied messages at the copies; others (InferParameter) stay real.
    for field in message.field:
        if field.type_name.startswith(old):
            field.type_name = new + field.type_name[len(old) :]
    for nested in message.nested_type:
        _retarget(nested, old, new)


def _view_file() -> descriptor_pb2.FileDescriptorProto:
    real = descriptor_pb2.FileDescriptorProto()
    _pb.DESCRIPTOR.CopyToProto(real)
    view = descriptor_pb2.FileDescriptorProto(
        name="trio_infer/protobuf/wire_view.proto",
        package=_VIEW_PACKAGE,
        syntax=real.syntax,
        dependency=[real.name],
    )
    by_name = {message.name: message for message in real.message_type}
    request = view.message_type.add()
    request.CopyFrom(by_name["ModelInferRequest"])
    old, new = f".{_PACKAGE}.ModelInferRequest.", f".{_VIEW_PACKAGE}.ModelInferRequest."
    _retarget(request, old, new)
    (tensor,) = (nested for nested in request.nested_type if nested.name == "InferInputTensor")
    (field,) = (field for field in tensor.field if field.name == "contents")
    _as_repeated_bytes(field)
    return view


def _build() -> type[Message]:
    POOL.Add(_view_file())
    return message_factory.GetMessageClass(
        POOL.FindMessageTypeByName(f"{_VIEW_PACKAGE}.ModelInferRequest")
    )


#: ``ModelInferRequest`` with each input's ``contents`` as ``repeated bytes`` (its occurrences).
#: Typed as ``Any``: the class is made at run time, so no stub describes its fields.
WireInferRequest: Any = _build()


class Irregular(Exception):
    """A message's records are not all length-delimited, well-formed and few enough."""


#: Wire types: a varint, 8 bytes, a length-delimited payload, 4 bytes.
_VARINT, _FIXED64, _DELIMITED, _FIXED32 = 0, 1, 2, 5
_LARGEST_FIELD = (1 << 29) - 1


def _read_varint(
    data: memoryview, position: int, longest: int = MAX_VARINT_BYTES
) -> tuple[int, int]:
    """The varint at ``position`` (of at most ``longest`` bytes), as protobuf reads it (bits
    past the 64th dropped), and the position after it.

    Raises:
        Irregular: It is truncated or longer.
    """
    value = 0
    for index in range(longest):
        if position + index >= len(data):
            raise Irregular("truncated")
        octet = data[position + index]
        value |= (octet & 0x7F) << (7 * index)
        if octet < 0x80:
            return value & 0xFFFFFFFFFFFFFFFF, position + index + 1
    raise Irregular(f"a varint longer than {longest} bytes")


def split_records(data: memoryview, limit: int) -> list[tuple[int, memoryview]]:
    """The length-delimited records of a serialised message: ``(field number, payload)`` pairs.

    The payloads are slices of ``data``, in wire order.

    Raises:
        Irregular: If there are more than ``limit`` records, a record is not length-delimited
            (wire type 0, 1 or 5: an element sent unpacked; 3 or 4: a group), a field number is
            0 or too large, a key is longer than protobuf reads, or a record is truncated. The
            caller parses such a message with the real type, which decides what it means, or
            refuses it.
    """
    records: list[tuple[int, memoryview]] = []
    position = 0
    size = len(data)
    while position < size:
        if len(records) == limit:
            raise Irregular(f"more than {limit} records")
        key, position = _read_varint(data, position, _MAX_KEY_BYTES)
        number, kind = key >> 3, key & 7
        if kind != _DELIMITED or not 0 < number <= _LARGEST_FIELD:
            raise Irregular(f"field {number} has wire type {kind}")
        length, position = _read_varint(data, position)
        if length > size - position:
            raise Irregular("truncated")
        records.append((number, data[position : position + length]))
        position += length
    return records


#: ``ModelInferRequest.raw_input_contents``.
_RAW_INPUT_CONTENTS = 7


def raw_input_suffix(data: memoryview) -> tuple[int, list[memoryview]] | None:
    """Where a serialised ModelInferRequest's ``raw_input_contents`` start, and their entries,
    when they are its last records: ``(start, entries)``, the entries slices of ``data``.

    Protobuf parses a message's records in order, appending each occurrence of a repeated
    field: such a message is the fields before ``start``, parsed alone, with these entries
    appended to ``raw_input_contents`` (the fields before ``start`` hold none of them: a record
    of the field with another wire type is an unknown field). None, and the message is parsed
    whole, which decides what it means or refuses it: when it has no such entry, a record of
    another field follows one, or a record's key or length is not well-formed or runs past the
    end. Only the records' keys and lengths are read; what the fields before ``start`` hold is
    the parser's to check.
    """
    position = 0
    size = len(data)
    start = -1
    entries: list[memoryview] = []
    try:
        while position < size:
            record = position
            key, position = _read_varint(data, position, _MAX_KEY_BYTES)
            kind = key & 7
            if key >> 3 == _RAW_INPUT_CONTENTS and kind == _DELIMITED:
                length, position = _read_varint(data, position)
                if length > size - position:
                    return None
                if start < 0:
                    start = record
                entries.append(data[position : position + length])
                position += length
                continue
            if start >= 0:
                return None
            if kind == _VARINT:
                _, position = _read_varint(data, position)
            elif kind == _DELIMITED:
                length, position = _read_varint(data, position)
                position += length
            elif kind == _FIXED64:
                position += 8
            elif kind == _FIXED32:
                position += 4
            else:
                return None
    except Irregular:
        return None
    if start < 0:
        return None
    return start, entries


class VarintError(ValueError):
    """A packed varint field is malformed: truncated, or a varint longer than ten bytes."""


#: Varints decoded per step: bounds the temporaries to a few MiB, and between steps another
#: thread (the event loop) may take the GIL.
_CHUNK = 1 << 16

_CONTINUE = 0x80
_PAYLOAD = 0x7F
#: Varints encoded per step: smaller than a decoding step, as an encode's temporaries are
#: reserved with the answer of every call with typed outputs, small ones included.
_ENCODE_CHUNK = 1 << 13
#: Bytes of temporaries per varint of one step of :func:`decode_varints` or
#: :func:`encode_varint_parts` (the step's masks, positions, lengths and values, at most eight
#: bytes each), with room to spare.
_SCRATCH_PER_VARINT = 64


def varint_scratch(count: int) -> int:
    """The most bytes :func:`decode_varints` holds in temporaries for ``count`` varints."""
    return _SCRATCH_PER_VARINT * min(count, _CHUNK + MAX_VARINT_BYTES)


def varint_encode_scratch(count: int) -> int:
    """The most bytes :func:`encode_varint_parts` holds in temporaries for ``count`` values."""
    return _SCRATCH_PER_VARINT * min(count, _ENCODE_CHUNK)


def count_varints(blob: bytes | memoryview) -> int:
    """The number of varints in one packed field's payload (its bytes without the high bit).

    Raises:
        VarintError: If the last varint is truncated (a packed record holds whole varints).
    """
    data = np.frombuffer(blob, np.uint8)
    if data.size and data[-1] & _CONTINUE:
        raise VarintError(f"the packed field's last varint is truncated ({data.size} bytes)")
    count = 0
    for start in range(0, data.size, _CHUNK * 16):
        count += int(np.count_nonzero(data[start : start + _CHUNK * 16] < _CONTINUE))
    return count


def decode_varints(blob: bytes | memoryview, out: np.ndarray) -> None:
    """Decode one packed field's varints into ``out``, converted as protobuf converts them.

    ``out`` has exactly :func:`count_varints` elements. Each varint is a 64-bit value (bits past
    the 64th, in a tenth byte, are dropped as protobuf drops them); it is stored by ``out``'s
    dtype as protobuf stores it in a field of that type: int64 and uint64 take all 64 bits, int32
    and uint32 the low 32 (a negative int32 travels as a ten-byte sign-extended varint), bool is
    whether the value is nonzero.

    Raises:
        VarintError: If a varint is longer than ten bytes or the last one is truncated.
    """
    data = np.frombuffer(blob, np.uint8)
    size = data.size
    if size and data[-1] & _CONTINUE:
        raise VarintError(f"the packed field's last varint is truncated ({size} bytes)")
    position = 0
    done = 0
    while position < size:
        # Past the first varint, a window ends at its last varint that ends inside it.
        window = data[position : position + _CHUNK + MAX_VARINT_BYTES]
        ends = np.flatnonzero(window < _CONTINUE)
        if ends.size == 0:
            raise VarintError(f"a varint at byte {position} is longer than {MAX_VARINT_BYTES}")
        stop = int(ends[-1]) + 1
        count = ends.size
        if count == stop:
            # Every varint of this step is one byte: the bytes are the values.
            values = window[:stop].astype(np.uint64)
        else:
            starts = np.empty(count, np.intp)
            starts[0] = 0
            starts[1:] = ends[:-1] + 1
            lengths = ends - starts + 1
            longest = int(lengths.max())
            if longest > MAX_VARINT_BYTES:
                where = position + int(starts[int(np.argmax(lengths > MAX_VARINT_BYTES))])
                raise VarintError(f"a varint at byte {where} is longer than {MAX_VARINT_BYTES}")
            values = (window[starts] & _PAYLOAD).astype(np.uint64)
            for group in range(1, longest):
                longer = np.flatnonzero(lengths > group)
                payload = (window[starts[longer] + group] & _PAYLOAD).astype(np.uint64)
                values[longer] |= payload << np.uint64(7 * group)
        _store(values, out[done : done + count])
        done += count
        position += stop
    if done != out.size:
        raise VarintError(f"the packed field holds {done} varints, not {out.size}")


def _store(values: np.ndarray, out: np.ndarray) -> None:
    if out.dtype == np.bool_:
        np.not_equal(values, 0, out=out)
    elif out.dtype.itemsize == 4:
        # Casting uint64 to a 32-bit type keeps the low 32 bits, as protobuf does.
        out[:] = values.astype(np.uint32).view(out.dtype)
    else:
        out[:] = values.view(out.dtype)


def varint_sizes(values: np.ndarray) -> np.ndarray:
    """The encoded size of each element of a uint64 array as a varint (1 to 10 bytes)."""
    sizes = np.ones(values.shape, np.uint8)
    for group in range(1, MAX_VARINT_BYTES):
        sizes += values >= np.uint64(1) << np.uint64(7 * group)
    return sizes


def _as_uint64(values: np.ndarray) -> np.ndarray:
    # As protobuf widens a field's value before writing it: signed integers sign-extended,
    # unsigned ones and bools zero-extended.
    if values.dtype.kind == "i":
        return values.astype(np.int64).view(np.uint64)
    return values.astype(np.uint64)


def encode_varint_parts(values: np.ndarray) -> list[np.ndarray]:
    """Encode an integer or bool array as consecutive varints, in parts (uint8 arrays).

    Concatenated, the parts are a packed field's payload; they are left apart so that a caller
    writing them out needs no copy of the whole. Each value is widened to 64 bits as protobuf
    widens it: a signed one (int8 to int64) sign-extended, so a negative one takes ten bytes;
    an unsigned one or a bool zero-extended. Works a step of elements at a time: the
    temporaries stay within :func:`varint_encode_scratch`, whatever the array's size.
    """
    values = values.reshape(-1)
    parts: list[np.ndarray] = []
    for start in range(0, values.size, _ENCODE_CHUNK):
        chunk = _as_uint64(values[start : start + _ENCODE_CHUNK])
        if int(chunk.max()) <= _PAYLOAD:
            parts.append(chunk.astype(np.uint8))
            continue
        sizes = varint_sizes(chunk)
        ends = np.cumsum(sizes, dtype=np.intp)
        starts = ends - sizes
        encoded = np.empty(int(ends[-1]), np.uint8)
        for group in range(int(sizes.max())):
            longer = np.flatnonzero(sizes > group)
            shifted = chunk[longer] >> np.uint64(7 * group)
            octets = (shifted & np.uint64(_PAYLOAD)).astype(np.uint8)
            octets[sizes[longer] > group + 1] |= _CONTINUE
            encoded[starts[longer] + group] = octets
        parts.append(encoded)
    return parts


def encode_varints(values: np.ndarray) -> np.ndarray:
    """:func:`encode_varint_parts` as one uint8 array (a packed field's payload)."""
    parts = encode_varint_parts(values)
    if len(parts) == 1:
        return parts[0]
    return np.concatenate(cast(Sequence[np.ndarray], parts)) if parts else np.empty(0, np.uint8)
