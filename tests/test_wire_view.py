"""The wire view decodes typed contents exactly as the real ModelInferRequest and codec do.

Every test builds request bytes by hand (records, packed payloads split into several records,
elements sent unpacked, adversarial varints) and checks that parsing them with
``WireInferRequest`` and decoding with :func:`prepare_inputs` gives the arrays that parsing them
with ``ModelInferRequest`` and decoding gives, or that both refuse (the view with InvalidInput).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np
import pytest
from google.protobuf.internal import encoder
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from trio_infer.datatypes import DATATYPES
from trio_infer.errors import InvalidInput
from trio_infer.protobuf import wire
from trio_infer.protobuf._proto.grpc_predict_v2_pb2 import InferTensorContents, ModelInferRequest
from trio_infer.protobuf.codec import (
    _CONTENTS_FIELD,
    UNPACKED_LIMIT,
    decode_inputs,
    decoding_cost,
    prepare_inputs,
)

_NUMBER = {f.name: f.number for f in InferTensorContents.DESCRIPTOR.fields}
_TYPED = [d for d in DATATYPES if _CONTENTS_FIELD[d] is not None]
_FIXED = {"fp32_contents": 5, "fp64_contents": 1}  # their unpacked wire types


def varint(value: int) -> bytes:
    """protobuf's own encoding of a varint: the oracle, not a copy of the code under test."""
    return encoder._VarintBytes(value)


def record(number: int, payload: bytes) -> bytes:
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def overlong(value: int, size: int) -> bytes:
    """``value`` as a varint of ``size`` bytes (at least its shortest), padded with groups of
    zero bits: protobuf reads a value's varint of up to ten bytes, a key's of up to five."""
    shortest = varint(value)
    if size <= len(shortest):
        return shortest
    return bytes((*shortest[:-1], shortest[-1] | 0x80, *b"\x80" * (size - len(shortest) - 1), 0))


def request_bytes(datatype: str, shape: list[int], contents: list[bytes]) -> bytes:
    tensor = ModelInferRequest.InferInputTensor(name="x", datatype=datatype, shape=shape)
    body = tensor.SerializeToString() + b"".join(record(5, part) for part in contents)
    return ModelInferRequest(model_name="m").SerializeToString() + record(5, body)


def outcome(
    data: bytes,
) -> tuple[str, dict[str, np.ndarray] | None, tuple[str, dict[str, np.ndarray] | None]]:
    """The real parse and decode's outcome and the wire view's, each ("ok", arrays) or
    ("refused", None)."""
    try:
        real: tuple[str, dict[str, np.ndarray] | None] = (
            "ok",
            decode_inputs(ModelInferRequest.FromString(data)),
        )
    except (DecodeError, InvalidInput):
        real = ("refused", None)
    try:
        prepared = prepare_inputs(wire.WireInferRequest.FromString(data))
        decoding_cost(prepared, len(data))
        view: tuple[str, dict[str, np.ndarray] | None] = ("ok", decode_inputs(prepared))
    except InvalidInput:
        view = ("refused", None)
    return real[0], real[1], view


def assert_same(data: bytes) -> str:
    real_status, real, (view_status, mine) = outcome(data)
    assert view_status == real_status
    if real is not None:
        assert mine is not None
        assert list(mine) == list(real)
        for name, array in real.items():
            assert mine[name].dtype == array.dtype
            assert mine[name].shape == array.shape
            np.testing.assert_array_equal(mine[name], array)
    return real_status


def packed_payload(field: str, values: list[object]) -> bytes:
    """The payload protobuf writes for ``values`` in ``field``, and its element boundaries."""
    contents = InferTensorContents()
    getattr(contents, field).extend(values)
    serialized = contents.SerializeToString()
    if not serialized:
        return b""
    ((number, payload),) = wire.split_records(memoryview(serialized), 1)
    assert number == _NUMBER[field]
    return bytes(payload)


def boundaries(field: str, payload: bytes) -> list[int]:
    if field in _FIXED:
        size = 4 if field == "fp32_contents" else 8
        return list(range(size, len(payload), size))
    return [i + 1 for i, octet in enumerate(payload[:-1]) if octet < 0x80]


def unpacked(field: str, payload: bytes) -> bytes:
    number = _NUMBER[field]
    cuts = [0, *boundaries(field, payload), len(payload)] if payload else [0]
    kind = _FIXED.get(field, 0)
    return b"".join(
        varint(number << 3 | kind) + payload[start:end] for start, end in itertools.pairwise(cuts)
    )


@st.composite
def arrays(draw: st.DrawFn) -> tuple[str, np.ndarray]:
    datatype = draw(st.sampled_from(_TYPED))
    count = draw(st.integers(0, 40))
    dtype = DATATYPES[datatype]
    if datatype == "BYTES":
        elements = draw(st.lists(st.binary(max_size=6), min_size=count, max_size=count))
        array = np.empty(count, np.object_)
        array[:] = elements
        return datatype, array
    if dtype.kind == "b":
        return datatype, np.array(draw(st.lists(st.booleans(), min_size=count, max_size=count)))
    if dtype.kind == "f":
        floats = st.floats(width=32 if dtype.itemsize == 4 else 64, allow_nan=False)
        return datatype, np.array(draw(st.lists(floats, min_size=count, max_size=count)), dtype)
    info = np.iinfo(dtype)  # type: ignore[type-var]
    ints = st.integers(int(info.min), int(info.max))
    return datatype, np.array(draw(st.lists(ints, min_size=count, max_size=count)), dtype)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    arrays(),
    st.data(),
    st.sampled_from(["packed", "unpacked", "mixed"]),
    st.integers(1, 3),
)
def test_typed_contents_decode_as_the_real_message_does(
    sent: tuple[str, np.ndarray], data: st.DataObject, encoding: str, occurrences: int
) -> None:
    datatype, array = sent
    field = _CONTENTS_FIELD[datatype]
    assert field is not None
    if field == "bytes_contents":
        contents = InferTensorContents(bytes_contents=array.tolist()).SerializeToString()
        records = [contents]
    else:
        payload = packed_payload(field, array.tolist())
        # Split the packed field at random element boundaries into several records.
        cuts = sorted(data.draw(st.sets(st.sampled_from(boundaries(field, payload) or [0]))))
        cuts = [c for c in cuts if 0 < c < len(payload)]
        pieces = [payload[a:b] for a, b in zip([0, *cuts], [*cuts, len(payload)], strict=True)]
        records = []
        for index, piece in enumerate(pieces):
            as_unpacked = encoding == "unpacked" or (encoding == "mixed" and index % 2)
            records.append(unpacked(field, piece) if as_unpacked else record(_NUMBER[field], piece))
    # Spread the records over several occurrences of the tensor's contents (protobuf merges).
    split_at = sorted(
        data.draw(st.sets(st.integers(1, max(1, len(records) - 1)), max_size=occurrences))
    )
    parts = [
        b"".join(records[a:b])
        for a, b in zip([0, *split_at], [*split_at, len(records)], strict=True)
    ]
    assert assert_same(request_bytes(datatype, list(array.shape), parts)) == "ok"


_VARINT_FIELDS = [
    "bool_contents",
    "int_contents",
    "int64_contents",
    "uint_contents",
    "uint64_contents",
]


@settings(max_examples=500, deadline=None)
@given(
    st.sampled_from(_TYPED),
    st.lists(st.integers(0, 5), max_size=2),
    st.lists(
        st.tuples(st.sampled_from([*range(1, 10), 15, 16]), st.binary(max_size=24)), max_size=3
    ),
    st.binary(max_size=3),
    st.integers(0, 64),
)
@example("INT64", [1], [(3, b"\x80" * 10 + b"\x01")], b"", 0)  # an 11-byte varint
@example("INT64", [0], [(3, b"\x80")], b"", 0)  # truncated
@example("INT64", [1], [(3, b"\x01\x80")], b"", 0)  # truncated after a whole one
@example("INT32", [1], [(2, b"\xff" * 9 + b"\x7f")], b"", 0)  # bits past the 64th
@example("INT64", [2], [(3, b"\x81"), (3, b"\x01")], b"", 0)  # a varint split across records
@example("FP32", [1], [(6, b"\0\0\0")], b"", 0)  # not a whole float
@example("UINT8", [1], [(4, b"\x80\x02")], b"", 0)  # out of range once narrowed
@example("BOOL", [2], [(1, b"\x02\x80\x01")], b"", 0)  # nonzero is true
@example("INT64", [1], [(3, b"\x01")], b"", 2)  # contents cut inside a record
@example("INT64", [1], [], overlong(3 << 3 | 2, 5) + overlong(1, 10) + b"\x05", 0)  # key of 5
@example("INT64", [1], [], overlong(3 << 3 | 2, 6) + b"\x01\x05", 0)  # a key of six bytes
def test_adversarial_contents_decode_or_fail_as_the_real_message_does(
    datatype: str, shape: list[int], records: list[tuple[int, bytes]], tail: bytes, cut: int
) -> None:
    # Records of any typed field holding any bytes, possibly garbage after them, the whole
    # possibly cut into two occurrences of the tensor's contents at any byte.
    contents = b"".join(record(number, payload) for number, payload in records) + tail
    parts = [contents[:cut], contents[cut:]] if 0 < cut < len(contents) else [contents]
    assert_same(request_bytes(datatype, shape, parts))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 2**64 - 1), max_size=50), st.sampled_from(_VARINT_FIELDS))
def test_varint_codec_is_protobufs(values: list[int], field: str) -> None:
    kinds: dict[str, tuple[type[np.generic], Callable[[int], object]]] = {
        "bool_contents": (np.bool_, lambda v: v % 2 == 1),
        "int_contents": (np.int32, lambda v: (v & 0xFFFFFFFF) - ((v & 0x80000000) << 1)),
        "int64_contents": (np.int64, lambda v: v - ((v & 2**63) << 1)),
        "uint_contents": (np.uint32, lambda v: v & 0xFFFFFFFF),
        "uint64_contents": (np.uint64, lambda v: v),
    }
    dtype, convert = kinds[field]
    typed = [convert(v) for v in values]
    expected = packed_payload(field, typed)
    as_uint64 = np.array(typed, dtype).astype(np.int64 if dtype != np.uint64 else np.uint64)
    assert wire.encode_varints(as_uint64.view(np.uint64)).tobytes() == expected
    out: np.ndarray = np.empty(wire.count_varints(expected), dtype)
    wire.decode_varints(expected, out)
    np.testing.assert_array_equal(out, np.array(typed, dtype))


def test_a_large_contents_sent_unpacked_is_refused_saying_to_send_it_packed() -> None:
    count = UNPACKED_LIMIT
    payload = packed_payload("int64_contents", list(range(count)))
    data = request_bytes("INT64", [count], [unpacked("int64_contents", payload)])
    assert decode_inputs(ModelInferRequest.FromString(data))["x"].size == count
    with pytest.raises(InvalidInput, match="send them packed or in raw_input_contents"):
        prepare_inputs(wire.WireInferRequest.FromString(data))


def test_a_small_contents_sent_unpacked_decodes_as_the_real_message() -> None:
    payload = packed_payload("int64_contents", [-1, 0, 1, 2**40])
    data = request_bytes("INT64", [4], [unpacked("int64_contents", payload)])
    assert assert_same(data) == "ok"


def test_the_view_keeps_every_field_number_of_the_real_request() -> None:
    real = ModelInferRequest.DESCRIPTOR
    view = wire.WireInferRequest.DESCRIPTOR
    assert [(f.name, f.number, f.type) for f in view.fields] == [
        (f.name, f.number, f.type) for f in real.fields
    ]
    tensor, real_tensor = (
        view.nested_types_by_name["InferInputTensor"],
        real.nested_types_by_name["InferInputTensor"],
    )
    assert [(f.name, f.number) for f in tensor.fields] == [
        (f.name, f.number) for f in real_tensor.fields
    ]
    changed = [f.name for f in tensor.fields if f.type != real_tensor.fields_by_name[f.name].type]
    assert changed == ["contents"]


_NARROW_KINDS = {
    np.int8: "int_contents",
    np.int16: "int_contents",
    np.int32: "int_contents",
    np.int64: "int64_contents",
    np.uint8: "uint_contents",
    np.uint16: "uint_contents",
    np.uint32: "uint_contents",
    np.uint64: "uint64_contents",
    np.bool_: "bool_contents",
}


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(list(_NARROW_KINDS)), st.data())
def test_varint_parts_widen_each_dtype_as_protobuf_does(
    dtype: type[np.generic], data: st.DataObject
) -> None:
    # Any integer or bool array, unconverted: a negative INT8 is ten bytes, as in int_contents.
    values = data.draw(hnp.arrays(dtype, st.integers(0, 40)))
    elements: list[object] = values.tolist()
    expected = packed_payload(_NARROW_KINDS[dtype], elements)
    parts = wire.encode_varint_parts(values)
    assert b"".join(part.tobytes() for part in parts) == expected
    assert wire.encode_varints(values).tobytes() == expected


def test_varint_parts_of_many_steps_stay_apart_and_are_protobufs() -> None:
    values = np.arange(-50_000, 50_000, dtype=np.int64) * 977
    parts = wire.encode_varint_parts(values)
    assert len(parts) > 1
    elements: list[object] = list(values.tolist())
    assert b"".join(part.tobytes() for part in parts) == packed_payload("int64_contents", elements)
    assert wire.encode_varint_parts(np.zeros(0, np.int32)) == []


def any_record(number: int, kind: int, payload: bytes) -> bytes:
    """A record of any wire type: a varint's, fixed-size bytes, a delimited payload, or a bare
    group tag (wire types 3 and 4, which no proto3 message holds)."""
    key = varint(number << 3 | kind)
    if kind == 0:
        return key + varint(int.from_bytes(payload[:8] or b"\0", "little"))
    if kind in (1, 5):
        return key + payload.ljust(8 if kind == 1 else 4, b"\0")[: 8 if kind == 1 else 4]
    if kind == 2:
        return key + varint(len(payload)) + payload
    return key


def parsed_whole(data: bytes) -> bytes | None:
    """The message ``data`` is (serialised deterministically), or None: it does not parse."""
    try:
        message = wire.WireInferRequest.FromString(data)
    except DecodeError:
        return None
    return message.SerializeToString(deterministic=True)


def parsed_split(data: bytes, start: int, entries: list[memoryview]) -> bytes | None:
    """The message the records before ``start`` are, with ``entries`` appended to its raw
    inputs (serialised deterministically), or None: those records do not parse."""
    try:
        message = wire.WireInferRequest.FromString(data[:start])
    except DecodeError:
        return None
    assert not message.raw_input_contents
    message.raw_input_contents.extend(bytes(entry) for entry in entries)
    return message.SerializeToString(deterministic=True)


@st.composite
def request_records(draw: st.DrawFn) -> bytes:
    """A ModelInferRequest's bytes, written by protobuf, then changed as a client or an attacker
    might: records of any field and wire type (raw inputs among them) added anywhere, cut
    short, or bytes flipped."""
    request = ModelInferRequest(model_name=draw(st.text(max_size=5)), id=draw(st.text(max_size=5)))
    for index in range(draw(st.integers(0, 3))):
        request.inputs.add(name=f"x{index}", datatype="UINT8", shape=[draw(st.integers(0, 9))])
    request.raw_input_contents.extend(draw(st.lists(st.binary(max_size=40), max_size=4)))
    records = [request.SerializeToString()]
    for _ in range(draw(st.integers(0, 4))):
        number = draw(st.sampled_from([0, 1, 3, 5, 7, 7, 7, 99]))
        kind = draw(st.sampled_from([0, 1, 2, 2, 2, 3, 4, 5, 6]))
        extra = any_record(number, kind, draw(st.binary(max_size=20)))
        records.insert(draw(st.integers(0, len(records))), extra)
    data = b"".join(records)
    change = draw(st.sampled_from(["none", "none", "cut", "flip"]))
    if change == "cut" and data:
        data = data[: draw(st.integers(0, len(data) - 1))]
    elif change == "flip" and data:
        at = draw(st.integers(0, len(data) - 1))
        data = data[:at] + bytes([data[at] ^ draw(st.integers(1, 255))]) + data[at + 1 :]
    return data


@settings(max_examples=1500, deadline=None)
@given(request_records())
@example(ModelInferRequest(raw_input_contents=[b"ab", b""]).SerializeToString())
@example(ModelInferRequest(model_name="m", raw_input_contents=[b"a"]).SerializeToString() + b"\x0a")
@example(record(7, b"a") + record(1, b"m"))
@example(record(7, b"a") + b"\x38\x01")
@example(b"\x38\x01" + record(7, b"a"))
@example(b"\x3a\x05ab")
@example(overlong(7 << 3 | 2, 5) + overlong(1, 10) + b"a")  # the longest key and length
@example(overlong(7 << 3 | 2, 6) + b"\x01a")  # a key longer than protobuf reads
@example(record(1, b"m") + overlong(1 << 3 | 2, 6) + b"\x01n" + record(7, b"a"))
def test_raw_inputs_split_off_a_request_parse_as_the_whole_request(data: bytes) -> None:
    # Split or not, the message is the same: the records before the split parse (or fail) as
    # the whole message does, and the raw inputs are slices of the bytes, in order.
    split = wire.raw_input_suffix(memoryview(data))
    if split is None:
        return
    start, entries = split
    assert entries
    assert parsed_split(data, start, entries) == parsed_whole(data)


def test_a_request_as_clients_write_it_has_its_raw_inputs_split_off() -> None:
    request = ModelInferRequest(model_name="m", id="i")
    request.inputs.add(name="x", datatype="FP32", shape=[2])
    request.outputs.add(name="y")
    request.raw_input_contents.extend([bytes(range(8)), b""])
    data = request.SerializeToString()
    split = wire.raw_input_suffix(memoryview(data))
    assert split is not None
    start, entries = split
    assert [bytes(entry) for entry in entries] == [bytes(range(8)), b""]
    assert data[start:] == record(7, bytes(range(8))) + record(7, b"")
    # No raw inputs, or another field after one: parsed whole.
    assert wire.raw_input_suffix(memoryview(data[:start])) is None
    assert wire.raw_input_suffix(memoryview(data + record(1, b"n"))) is None
