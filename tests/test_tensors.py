"""Tests for trio_infer.protobuf.codec: decoding, encoding, validation, parameters."""

from __future__ import annotations

import tracemalloc
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from trio_infer.core.validation import select_outputs, validate_inputs
from trio_infer.datatypes import DATATYPES, datatype_of
from trio_infer.errors import InferError, InvalidInput, ModelFailed, StatusCode
from trio_infer.protobuf import codec
from trio_infer.protobuf._proto.grpc_predict_v2_pb2 import (
    InferParameter,
    ModelInferRequest,
    ModelInferResponse,
)
from trio_infer.protobuf.codec import (
    BYTES_ELEMENT_OVERHEAD,
    MAX_BYTES_ELEMENTS,
    MAX_PARAMETERS,
    DecodingCost,
    EncodingCost,
    decode_inputs,
    decode_known_raw,
    decode_outputs,
    decode_parameters,
    decoding_cost,
    encode_inputs,
    encode_outputs,
    encode_parameters,
    encode_raw_as_is,
    encode_response,
    encoding_cost,
    prepare_inputs,
    serialize_response,
)
from trio_infer.protobuf.wire import WireInferRequest
from trio_infer.repository.settings import TensorSpec

NUMERIC = [name for name in DATATYPES if name != "BYTES"]
TYPED = [name for name in DATATYPES if name != "FP16"]


def sample(datatype: str) -> np.ndarray:
    """A 2x3 array of the datatype that includes its extreme values."""
    if datatype == "BYTES":
        values: list[bytes] = [b"", b"\xff\xfe\x00", b"plain", "h\u00e9".encode(), b"\x00", b"z"]
        array = np.empty(6, dtype=object)
        array[:] = values
        return array.reshape(2, 3)
    dtype: Any = DATATYPES[datatype]  # iinfo/finfo's stubs reject the generic dtype type
    if datatype == "BOOL":
        return np.array([[True, False, True], [False, False, True]])
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return np.array([[info.min, info.max, 0], [1, info.max - 1, info.min + 1]], dtype=dtype)
    finfo = np.finfo(dtype)
    return np.array(
        [[finfo.min, finfo.max, -0.0], [np.inf, np.nan, finfo.tiny]],
        dtype=dtype,
    )


def as_request(response: ModelInferResponse) -> ModelInferRequest:
    """Turn a response's outputs into a request's inputs, through the wire format."""
    request = ModelInferRequest()
    for output in response.outputs:
        tensor = request.inputs.add()
        tensor.name = output.name
        tensor.datatype = output.datatype
        tensor.shape.extend(output.shape)
        if output.HasField("contents"):
            tensor.contents.CopyFrom(output.contents)
    request.raw_input_contents.extend(response.raw_output_contents)
    wire = ModelInferRequest()
    wire.ParseFromString(request.SerializeToString())
    return wire


def sent(outputs: Sequence[tuple[str, np.ndarray]], *, raw: bool) -> ModelInferResponse:
    """The response a client receives for ``outputs``, parsed from the bytes the server sends."""
    response = ModelInferResponse()
    parts = serialize_response(response, encode_outputs(response, outputs, raw=raw))
    return ModelInferResponse.FromString(b"".join(parts))


def round_trip(outputs: Sequence[tuple[str, np.ndarray]], *, raw: bool) -> dict[str, np.ndarray]:
    return decode_inputs(as_request(sent(outputs, raw=raw)))


def assert_same(got: np.ndarray, expected: np.ndarray, datatype: str) -> None:
    assert got.dtype == DATATYPES[datatype]
    assert got.shape == expected.shape
    if datatype == "BYTES":
        assert got.tolist() == expected.tolist()
        assert all(type(element) is bytes for element in got.ravel())
    else:
        np.testing.assert_array_equal(got, expected)
        # -0.0 == 0.0, so compare signs too.
        if got.dtype.kind == "f":
            np.testing.assert_array_equal(np.signbit(got), np.signbit(expected))


def raw_request(*tensors: tuple[str, str, Sequence[int], bytes]) -> ModelInferRequest:
    request = ModelInferRequest()
    for name, datatype, shape, data in tensors:
        tensor = request.inputs.add(name=name, datatype=datatype)
        tensor.shape.extend(shape)
        request.raw_input_contents.append(data)
    return request


def typed_request(
    name: str, datatype: str, shape: Sequence[int], **contents: Any
) -> ModelInferRequest:
    request = ModelInferRequest()
    tensor = request.inputs.add(name=name, datatype=datatype)
    tensor.shape.extend(shape)
    for field, values in contents.items():
        getattr(tensor.contents, field).extend(values)
    return request


def length_prefixed(*elements: bytes) -> bytes:
    return b"".join(len(e).to_bytes(4, "little") + e for e in elements)


# --------------------------------------------------------------------------------------------
# Round trips


@pytest.mark.parametrize("datatype", TYPED)
def test_typed_round_trip(datatype: str) -> None:
    array = sample(datatype)
    response = sent([("OUT", array)], raw=False)
    assert not response.raw_output_contents
    [tensor] = response.outputs
    assert (tensor.name, tensor.datatype, list(tensor.shape)) == ("OUT", datatype, [2, 3])
    assert_same(decode_inputs(as_request(response))["OUT"], array, datatype)


@pytest.mark.parametrize("datatype", list(DATATYPES))
def test_raw_round_trip(datatype: str) -> None:
    array = sample(datatype)
    response = sent([("OUT", array)], raw=True)
    assert len(response.raw_output_contents) == 1
    assert not response.outputs[0].HasField("contents")
    assert_same(decode_inputs(as_request(response))["OUT"], array, datatype)


@pytest.mark.parametrize("raw", [True, False])
def test_round_trip_keeps_order_and_many_outputs(raw: bool) -> None:
    outputs = [(f"OUT_{name}", sample(name)) for name in (TYPED if not raw else DATATYPES)]
    decoded = round_trip(outputs, raw=raw)
    assert list(decoded) == [name for name, _ in outputs]
    for (name, array), datatype in zip(outputs, (TYPED if not raw else DATATYPES), strict=True):
        assert_same(decoded[name], array, datatype)


@pytest.mark.parametrize("raw", [True, False])
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (1, 1, 1, 1)])
def test_round_trip_scalar_and_empty_shapes(raw: bool, shape: tuple[int, ...]) -> None:
    numbers = np.arange(int(np.prod(shape)), dtype=np.int32).reshape(shape)
    strings = np.empty(shape, dtype=object)
    strings.fill(b"x")
    decoded = round_trip([("N", numbers), ("S", strings)], raw=raw)
    assert_same(decoded["N"], numbers, "INT32")
    assert_same(decoded["S"], strings, "BYTES")


def test_fp16_output_makes_the_response_raw() -> None:
    # FP16 has no typed field and a response cannot mix raw and typed outputs.
    half = np.array([1.5, -2.0], dtype=np.float16)
    response = sent([("A", np.arange(3)), ("H", half)], raw=False)
    assert len(response.raw_output_contents) == 2
    assert not any(output.HasField("contents") for output in response.outputs)
    decoded = decode_inputs(as_request(response))
    assert_same(decoded["H"], half, "FP16")
    assert_same(decoded["A"], np.arange(3), "INT64")


@pytest.mark.parametrize("raw", [True, False])
def test_bytes_outputs_accept_str_and_numpy_string_arrays(raw: bool) -> None:
    mixed = np.array(["h\u00e9", b"\xff", ""], dtype=object)
    fixed_bytes = np.array([b"ab", b""], dtype="S2")
    unicode = np.array([["\u20ac", "a"]], dtype="U1")
    decoded = round_trip([("M", mixed), ("S", fixed_bytes), ("U", unicode)], raw=raw)
    assert decoded["M"].tolist() == ["h\u00e9".encode(), b"\xff", b""]
    assert decoded["S"].tolist() == [b"ab", b""]
    assert decoded["U"].tolist() == [["\u20ac".encode(), b"a"]]
    assert decoded["U"].shape == (1, 2)


def test_raw_bytes_layout_matches_tritonclient() -> None:
    import tritonclient.utils as utils  # a test dependency; safe to import in-process

    array = sample("BYTES")
    response = sent([("B", array)], raw=True)
    assert response.raw_output_contents[0] == utils.serialize_byte_tensor(array).item()
    request = raw_request(("B", "BYTES", [6], utils.serialize_byte_tensor(array).item()))
    assert decode_inputs(request)["B"].tolist() == array.ravel().tolist()


@pytest.mark.parametrize("raw", [True, False])
@pytest.mark.parametrize(
    "array",
    [
        np.arange(24, dtype=np.float32).reshape(4, 6)[:, ::2],
        np.arange(24, dtype=np.int64).reshape(4, 6).T,
        np.arange(12, dtype=">f4").reshape(3, 4),
        np.arange(12, dtype=">i8").reshape(3, 4)[::-1],
        np.arange(6, dtype=">u2"),
        np.arange(6, dtype=">f2").reshape(2, 3)[:, 1:],
        np.arange(6, dtype=">f8")[::3],
    ],
    ids=[
        "strided",
        "transposed",
        "big-fp32",
        "big-int64-reversed",
        "big-u16",
        "big-fp16",
        "big-fp64",
    ],
)
def test_encode_non_contiguous_and_big_endian(array: np.ndarray, raw: bool) -> None:
    datatype = datatype_of(array)
    decoded = round_trip([("X", array)], raw=raw)["X"]
    assert decoded.dtype.isnative
    assert_same(decoded, array, datatype)


def test_raw_numeric_decode_is_zero_copy() -> None:
    array = np.arange(32, dtype=np.float32)
    request = raw_request(("INPUT0", "FP32", [2, 16], array.tobytes()))
    decoded = decode_inputs(request)["INPUT0"]
    assert not decoded.flags.owndata
    assert not decoded.flags.writeable
    base: Any = decoded
    while isinstance(base, np.ndarray):
        base = base.base
    # The array is a view of the bytes protobuf handed out, not a copy of them.
    assert isinstance(base, bytes)
    assert len(base) == array.nbytes
    assert np.shares_memory(decoded, np.frombuffer(base, dtype=np.uint8))
    np.testing.assert_array_equal(decoded, array.reshape(2, 16))


# --------------------------------------------------------------------------------------------
# Property tests

_numeric_dtypes = st.sampled_from([DATATYPES[name] for name in NUMERIC])
_shapes = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4)


@settings(database=None, max_examples=150, deadline=None)
@given(data=st.data(), raw=st.booleans())
def test_numeric_round_trip_property(data: st.DataObject, raw: bool) -> None:
    dtype = data.draw(_numeric_dtypes)
    order = data.draw(st.sampled_from("<>"))
    array = data.draw(hnp.arrays(dtype.newbyteorder(order), _shapes))
    datatype = datatype_of(array)
    assert_same(round_trip([("X", array)], raw=raw)["X"], array, datatype)


@settings(database=None, max_examples=100, deadline=None)
@given(
    elements=st.lists(st.binary(max_size=12), max_size=12),
    raw=st.booleans(),
)
def test_bytes_round_trip_property(elements: list[bytes], raw: bool) -> None:
    array = np.empty(len(elements), dtype=object)
    array[:] = elements
    assert_same(round_trip([("B", array)], raw=raw)["B"], array, "BYTES")


# --------------------------------------------------------------------------------------------
# Decode errors


def decode_error(request: ModelInferRequest) -> str:
    with pytest.raises(InvalidInput) as caught:
        decode_inputs(request)
    return caught.value.message


def test_raw_size_mismatch_message() -> None:
    request = raw_request(("INPUT0", "FP32", [2, 16], bytes(124)))
    assert decode_error(request) == (
        "input 'INPUT0': shape [2, 16] has 32 elements but raw_input_contents[0] holds "
        "31 FP32 elements (124 bytes)"
    )


def test_raw_size_not_a_whole_number_of_elements() -> None:
    request = raw_request(("X", "INT64", [2], bytes(17)))
    assert "raw_input_contents[0] holds 17 bytes, not a whole number of 8-byte INT64" in (
        decode_error(request)
    )


def test_raw_count_mismatch() -> None:
    request = raw_request(("A", "INT32", [1], bytes(4)))
    request.inputs.add(name="B", datatype="INT32", shape=[1])
    assert "request has 2 inputs but 1 raw_input_contents entries" in decode_error(request)


def test_raw_and_typed_mixed() -> None:
    request = raw_request(("A", "FP32", [1], bytes(4)))
    request.inputs[0].contents.fp32_contents.append(1.0)
    assert decode_error(request) == (
        "contents field must not be specified when using raw_input_contents for 'A' for model "
        "'': send every input raw or every input typed, not both"
    )


def test_duplicate_input_names() -> None:
    request = raw_request(("A", "INT8", [1], b"\x01"), ("A", "INT8", [1], b"\x02"))
    assert decode_error(request) == "input 'A' appears more than once in the request"


def test_a_layout_decoded_before_still_refuses_a_wrong_size_and_a_repeated_name() -> None:
    # The first request's (datatype, shape) is remembered as valid; what differs from it in
    # bytes or names takes the full checks, with their messages.
    good = raw_request(("L", "FP32", [3, 7], bytes(84)))
    assert decode_inputs(good)["L"].shape == (3, 7)
    assert decode_error(raw_request(("L", "FP32", [3, 7], bytes(80)))) == (
        "input 'L': shape [3, 7] has 21 elements but raw_input_contents[0] holds "
        "20 FP32 elements (80 bytes)"
    )
    twice = raw_request(("L", "FP32", [3, 7], bytes(84)), ("L", "FP32", [3, 7], bytes(84)))
    assert decode_error(twice) == "input 'L' appears more than once in the request"
    # BOOL bytes are checked every time, whatever came before in that shape.
    assert decode_inputs(raw_request(("B", "BOOL", [2], b"\x00\x01")))["B"].tolist() == [
        False,
        True,
    ]
    assert "raw BOOL element 1 is byte 2" in decode_error(
        raw_request(("B", "BOOL", [2], b"\x00\x02"))
    )


def as_wire(request: ModelInferRequest) -> Any:
    """The request as the server parses it (a WireInferRequest)."""
    return WireInferRequest.FromString(request.SerializeToString())


def known_raw(request: ModelInferRequest) -> tuple[list[Any], dict[str, np.ndarray]] | None:
    """:func:`decode_known_raw` of ``request`` parsed whole, with its own raw entries."""
    wire = as_wire(request)
    return decode_known_raw(wire, wire.raw_input_contents)


def staged(request: ModelInferRequest) -> dict[str, np.ndarray]:
    """``request`` through the server's stages: prepared, costed, decoded."""
    prepared = prepare_inputs(as_wire(request))
    decoding_cost(prepared, request.ByteSize())
    return decode_inputs(prepared)


def staged_error(request: ModelInferRequest) -> str:
    """The refusal of ``request`` by the server's stages."""
    with pytest.raises(InvalidInput) as caught:
        staged(request)
    return caught.value.message


def test_remembered_raw_layouts_decode_in_one_pass_and_anything_else_takes_the_stages() -> None:
    # A shape no other test sends: not remembered until decoded once.
    values = np.arange(18, dtype="<f4").reshape(3, 1, 6)
    good = raw_request(("K", "FP32", [3, 1, 6], values.tobytes()), ("J", "INT64", [0], b""))
    assert known_raw(good) is None
    through_stages = staged(good)
    known = known_raw(good)
    assert known is not None
    tensors, arrays = known
    assert [tensor.name for tensor in tensors] == ["K", "J"]
    assert list(arrays) == list(through_stages) == ["K", "J"]
    for name, array in arrays.items():
        expected = through_stages[name]
        assert (array.dtype, array.shape) == (expected.dtype, expected.shape)
        np.testing.assert_array_equal(array, expected)
        assert not array.flags.writeable
    assert decoding_cost(prepare_inputs(as_wire(good)), good.ByteSize()).nbytes == 0

    # Each of these is of remembered layouts but for one thing: not decoded in one pass, and
    # refused by the stages in their words (or, for an empty contents, decoded by them).
    short = raw_request(("K", "FP32", [3, 1, 6], bytes(68)), ("J", "INT64", [0], b""))
    twice = raw_request(("K", "FP32", [3, 1, 6], bytes(72)), ("K", "FP32", [3, 1, 6], bytes(72)))
    unknown = raw_request(("K", "FP-32", [3, 1, 6], bytes(72)))
    typed_beside = raw_request(("K", "FP32", [3, 1, 6], bytes(72)))
    typed_beside.inputs[0].contents.fp32_contents.append(1.0)
    empty_beside = raw_request(("K", "FP32", [3, 1, 6], bytes(72)))
    empty_beside.inputs[0].contents.SetInParent()
    missing = raw_request(("K", "FP32", [3, 1, 6], bytes(72)), ("J", "INT64", [0], b""))
    del missing.raw_input_contents[1]
    extra = raw_request(("K", "FP32", [3, 1, 6], bytes(72)))
    extra.raw_input_contents.append(b"")
    typed = typed_request("K", "FP32", [3, 1, 6], fp32_contents=[0.0] * 18)
    for request in (short, twice, unknown, typed_beside, empty_beside, missing, extra, typed):
        assert known_raw(request) is None
    assert staged_error(short) == (
        "input 'K': shape [3, 1, 6] has 18 elements but raw_input_contents[0] holds "
        "17 FP32 elements (68 bytes)"
    )
    assert staged_error(twice) == "input 'K' appears more than once in the request"
    assert staged_error(unknown).startswith("input 'K': unknown datatype 'FP-32'; valid")
    assert staged_error(typed_beside) == (
        "contents field must not be specified when using raw_input_contents for 'K' for "
        "model '': send every input raw or every input typed, not both"
    )
    assert staged(empty_beside)["K"].shape == (3, 1, 6)
    assert staged_error(missing) == (
        "request has 2 inputs but 1 raw_input_contents entries; raw_input_contents needs "
        "exactly one entry per input, in input order"
    )
    assert staged_error(extra).startswith("request has 1 inputs but 2 raw_input_contents")
    assert staged(typed)["K"].shape == (3, 1, 6)
    # BOOL is never remembered: its bytes are checked every time.
    bools = raw_request(("B", "BOOL", [3, 1, 6], bytes(18)))
    staged(bools)
    assert known_raw(bools) is None


def test_unknown_datatype_lists_valid_ones() -> None:
    message = decode_error(raw_request(("A", "FLOAT32", [1], bytes(4))))
    assert "input 'A': unknown datatype 'FLOAT32'; valid datatypes are BOOL, UINT8," in message
    assert all(name in message for name in DATATYPES)


def test_negative_dimension() -> None:
    message = decode_error(raw_request(("A", "FP32", [2, -1], bytes(8))))
    assert "input 'A': shape [2, -1] has a negative dimension" in message


def test_too_many_dimensions() -> None:
    message = decode_error(raw_request(("A", "FP32", [1] * 33, bytes(4))))
    assert "input 'A': shape has 33 dimensions; at most 32" in message


def test_shape_too_large_for_numpy_even_when_empty() -> None:
    message = decode_error(raw_request(("A", "FP32", [0, 2**62, 2**62], b"")))
    assert "input 'A': shape [0, 4611686018427387904, 4611686018427387904] is too large" in message


def test_huge_declared_shape_is_compared_before_allocating() -> None:
    message = decode_error(raw_request(("A", "FP32", [2**40, 2**20], bytes(8))))
    assert f"has {2**60} elements but raw_input_contents[0] holds 2 FP32 elements" in message
    message = decode_error(raw_request(("B", "BYTES", [2**37, 2**20], length_prefixed(b"a"))))
    assert f"has {2**57} BYTES elements; at most {MAX_BYTES_ELEMENTS} are taken" in message
    message = decode_error(raw_request(("B", "BYTES", [2**10, 2**10], length_prefixed(b"a"))))
    assert f"too few for the {2**20} length-prefixed BYTES elements" in message
    typed = typed_request("C", "INT32", [2**40, 2**20], int_contents=[1])
    assert f"has {2**60} elements but contents.int_contents holds 1 values" in decode_error(typed)


def test_raw_bool_must_be_zero_or_one() -> None:
    message = decode_error(raw_request(("B", "BOOL", [3], b"\x01\x02\x00")))
    assert "input 'B': raw BOOL element 1 is byte 2; BOOL elements must be 0 or 1" in message


def test_raw_bytes_truncated_prefix() -> None:
    data = length_prefixed(b"ab") + b"\x01\x00"
    message = decode_error(raw_request(("S", "BYTES", [2], data)))
    assert "runs out at the 4-byte length prefix of BYTES element 1 (offset 6, 8 bytes" in message


def test_raw_bytes_truncated_element() -> None:
    data = length_prefixed(b"ab") + (10).to_bytes(4, "little") + b"xyz"
    message = decode_error(raw_request(("S", "BYTES", [2], data)))
    assert "input 'S': raw_input_contents[0]: BYTES element 1 declares 10 bytes but only 3" in (
        message
    )


def test_raw_bytes_trailing_data() -> None:
    data = length_prefixed(b"ab", b"c") + b"\x00"
    message = decode_error(raw_request(("S", "BYTES", [1], data)))
    assert (
        "raw_input_contents[0] has 6 bytes after the 1 BYTES elements that shape [1] declares"
        in message
    )


def test_raw_bytes_too_few_elements() -> None:
    message = decode_error(raw_request(("S", "BYTES", [3], length_prefixed(b"abcd", b""))))
    assert "runs out at the 4-byte length prefix of BYTES element 2 (offset 12, 12 bytes" in (
        message
    )


def test_typed_fp16_is_rejected() -> None:
    request = typed_request("H", "FP16", [1], fp32_contents=[1.0])
    assert "input 'H': FP16 has no typed contents field; send FP16 data in raw" in (
        decode_error(request)
    )


@pytest.mark.parametrize(
    ("datatype", "field", "values", "expected_field"),
    [
        ("INT32", "fp32_contents", [1.0], "int_contents"),
        ("INT64", "int_contents", [1], "int64_contents"),
        ("UINT64", "uint_contents", [1], "uint64_contents"),
        ("BOOL", "int_contents", [1], "bool_contents"),
        ("BYTES", "int_contents", [1], "bytes_contents"),
        ("FP64", "fp32_contents", [1.0], "fp64_contents"),
    ],
)
def test_typed_contents_in_the_wrong_field(
    datatype: str, field: str, values: list[Any], expected_field: str
) -> None:
    request = typed_request("X", datatype, [1], **{field: values})
    assert decode_error(request) == (
        f"input 'X': datatype {datatype} takes its data in contents.{expected_field}, "
        f"but contents.{field} is set"
    )


def test_typed_count_mismatch() -> None:
    request = typed_request("X", "FP32", [2, 2], fp32_contents=[1.0, 2.0, 3.0])
    assert decode_error(request) == (
        "input 'X': shape [2, 2] has 4 elements but contents.fp32_contents holds 3 values"
    )


def test_typed_without_any_contents() -> None:
    request = typed_request("X", "BYTES", [2])
    assert "has 2 elements but contents.bytes_contents holds 0 values" in decode_error(request)


@pytest.mark.parametrize(
    ("datatype", "field", "values", "fragment"),
    [
        ("INT8", "int_contents", [1, 300], "INT8 element 1 is 300, outside [-128, 127]"),
        ("INT16", "int_contents", [-40000], "INT16 element 0 is -40000, outside [-32768, 32767]"),
        ("UINT8", "uint_contents", [256], "UINT8 element 0 is 256, outside [0, 255]"),
        ("UINT16", "uint_contents", [0, 70000], "UINT16 element 1 is 70000, outside [0, 65535]"),
    ],
)
def test_typed_narrow_integers_out_of_range(
    datatype: str, field: str, values: list[int], fragment: str
) -> None:
    request = typed_request("X", datatype, [len(values)], **{field: values})
    assert f"input 'X': {fragment}" in decode_error(request)


# --------------------------------------------------------------------------------------------
# Encode errors and datatype_of


@pytest.mark.parametrize(
    ("dtype", "datatype"),
    [
        (np.bool_, "BOOL"),
        (np.uint8, "UINT8"),
        (np.uint16, "UINT16"),
        (">u4", "UINT32"),
        (np.uint64, "UINT64"),
        (np.ulonglong, "UINT64"),
        (np.int8, "INT8"),
        (np.int16, "INT16"),
        (np.int32, "INT32"),
        ("<i8", "INT64"),
        (np.longlong, "INT64"),
        (">i2", "INT16"),
        (np.float16, "FP16"),
        (np.float32, "FP32"),
        (">f4", "FP32"),
        (np.float64, "FP64"),
        (np.dtype(np.float64, metadata={"unit": "m"}), "FP64"),
        (object, "BYTES"),
        ("S3", "BYTES"),
        ("U2", "BYTES"),
    ],
)
def test_datatype_of(dtype: Any, datatype: str) -> None:
    assert datatype_of(np.zeros(2, dtype=dtype)) == datatype


@pytest.mark.parametrize(
    "dtype", [np.complex64, np.complex128, "datetime64[s]", "timedelta64[s]", "V4", "i4,f4"]
)
def test_datatype_of_rejects_unsupported_dtypes(dtype: Any) -> None:
    array = np.zeros(2, dtype=dtype)
    with pytest.raises(ModelFailed, match="has no Open Inference Protocol datatype"):
        datatype_of(array)


def test_encode_unsupported_dtype_names_the_output() -> None:
    response = ModelInferResponse()
    with pytest.raises(ModelFailed) as caught:
        encode_outputs(response, [("OK", np.zeros(1)), ("Z", np.zeros(2, np.complex128))], raw=True)
    assert caught.value.message.startswith(
        "output 'Z': numpy dtype complex128 has no Open Inference Protocol datatype"
    )
    # The dtypes are all checked before anything is written.
    assert not response.outputs


@pytest.mark.parametrize("raw", [True, False])
def test_encode_bytes_with_a_non_string_element(raw: bool) -> None:
    array = np.array([b"a", 7, None], dtype=object)
    with pytest.raises(ModelFailed) as caught:
        encode_outputs(ModelInferResponse(), [("B", array)], raw=raw)
    assert caught.value.message == (
        "output 'B': BYTES element 1 is int; BYTES outputs hold bytes or str"
    )


def test_encode_str_that_utf8_cannot_encode() -> None:
    array = np.array(["ok", "bad\udcff"], dtype=object)
    with pytest.raises(ModelFailed) as caught:
        encode_outputs(ModelInferResponse(), [("B", array)], raw=False)
    assert caught.value.message.startswith(
        "output 'B': BYTES element 1 is a str that UTF-8 cannot encode (surrogates not allowed"
    )


def test_encode_numpy_scalar_output() -> None:
    decoded = round_trip([("S", np.float32(2.5))], raw=True)  # type: ignore[list-item]
    assert_same(decoded["S"], np.array(2.5, dtype=np.float32), "FP32")


# --------------------------------------------------------------------------------------------
# Parameters


def test_decode_parameters_every_kind() -> None:
    request = ModelInferRequest()
    request.parameters["b"].bool_param = False
    request.parameters["i"].int64_param = -(2**63)
    request.parameters["s"].string_param = "text"
    request.parameters["d"].double_param = 0.25
    request.parameters["u"].uint64_param = 2**64 - 1
    decoded = decode_parameters(request.parameters)
    assert decoded == {"b": False, "i": -(2**63), "s": "text", "d": 0.25, "u": 2**64 - 1}
    assert type(decoded["b"]) is bool
    assert type(decoded["i"]) is int


def test_decode_parameter_without_value() -> None:
    with pytest.raises(InvalidInput, match="parameter 'empty' has no value set"):
        decode_parameters({"empty": InferParameter()})


def test_encode_parameters() -> None:
    response = ModelInferResponse()
    encode_parameters(
        response.parameters,
        {
            "flag": True,
            "small": -5,
            "big": 2**63,
            "ratio": 1.5,
            "name": "n",
            "np_int": np.int32(3),  # type: ignore[dict-item]
            "np_bool": np.bool_(False),  # type: ignore[dict-item]
            "np_float": np.float32(0.5),  # type: ignore[dict-item]
        },
    )
    kinds = {
        key: value.WhichOneof("parameter_choice") for key, value in response.parameters.items()
    }
    assert kinds == {
        "flag": "bool_param",
        "small": "int64_param",
        "big": "uint64_param",
        "ratio": "double_param",
        "name": "string_param",
        "np_int": "int64_param",
        "np_bool": "bool_param",
        "np_float": "double_param",
    }
    assert decode_parameters(response.parameters) == {
        "flag": True,
        "small": -5,
        "big": 2**63,
        "ratio": 1.5,
        "name": "n",
        "np_int": 3,
        "np_bool": False,
        "np_float": 0.5,
    }


def test_encode_parameters_replaces_an_existing_value() -> None:
    response = ModelInferResponse()
    response.parameters["k"].string_param = "old"
    encode_parameters(response.parameters, {"k": 7})
    assert decode_parameters(response.parameters) == {"k": 7}


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        (2**64, "parameter 'p': 18446744073709551616 does not fit in 64 bits"),
        (-(2**63) - 1, "does not fit in 64 bits"),
        ([1], "parameter 'p' is list; parameters are bool, int, float or str"),
        (b"x", "parameter 'p' is bytes"),
    ],
)
def test_encode_parameters_rejects(value: Any, fragment: str) -> None:
    with pytest.raises(ModelFailed) as caught:
        encode_parameters(ModelInferResponse().parameters, {"p": value})
    assert fragment in caught.value.message


# --------------------------------------------------------------------------------------------
# validate_inputs: a decoded request against the model's declared inputs


# The declared inputs by name, as DeclaredTensors holds them.
SPECS = {"A": TensorSpec("A", "FP32", (-1, 3)), "B": TensorSpec("B", "BYTES", (1,))}


def decoded(*tensors: tuple[str, str, Sequence[int]]) -> dict[str, np.ndarray]:
    return {name: np.zeros(shape, DATATYPES[datatype]) for name, datatype, shape in tensors}


def validation_error(inputs: dict[str, np.ndarray], specs: Mapping[str, TensorSpec] = SPECS) -> str:
    with pytest.raises(InvalidInput) as caught:
        validate_inputs(inputs, specs, "m")
    return caught.value.message


def test_validate_accepts_matching_request_in_any_order() -> None:
    validate_inputs(decoded(("B", "BYTES", [1]), ("A", "FP32", [7, 3])), SPECS, "m")


def test_validate_without_declared_inputs_accepts_anything() -> None:
    validate_inputs(decoded(("anything", "UINT16", [0, 4])), {}, "m")


def test_validate_missing_input() -> None:
    assert validation_error(decoded(("A", "FP32", [1, 3]))) == (
        "model 'm': request is missing input(s) 'B'"
    )


def test_validate_unexpected_input() -> None:
    inputs = decoded(("A", "FP32", [1, 3]), ("B", "BYTES", [1]), ("C", "FP32", [1]))
    assert validation_error(inputs) == "model 'm' has no input 'C'; its inputs are 'A', 'B'"


@pytest.mark.parametrize(("sent", "expected"), [("FP64", "FP32"), ("UINT8", "FP32")])
def test_validate_wrong_datatype(sent: str, expected: str) -> None:
    inputs = decoded(("A", sent, [1, 3]), ("B", "BYTES", [1]))
    assert validation_error(inputs) == (
        f"model 'm' input 'A': expected datatype {expected}, got {sent}"
    )


def test_validate_tells_bool_from_uint8() -> None:
    specs = {"A": TensorSpec("A", "BOOL", (2,))}
    assert validation_error(decoded(("A", "UINT8", [2])), specs) == (
        "model 'm' input 'A': expected datatype BOOL, got UINT8"
    )


def test_validate_wrong_rank() -> None:
    inputs = decoded(("A", "FP32", [3]), ("B", "BYTES", [1]))
    assert validation_error(inputs) == (
        "model 'm' input 'A': expected shape [-1, 3] (rank 2), got [3] (rank 1)"
    )


def test_validate_mismatched_fixed_dimension() -> None:
    inputs = decoded(("A", "FP32", [2, 4]), ("B", "BYTES", [1]))
    assert validation_error(inputs) == (
        "model 'm' input 'A': expected shape [-1, 3], got [2, 4] (dimension 1 must be 3)"
    )


# --------------------------------------------------------------------------------------------
# select_outputs


OUTPUTS = {"x": np.zeros(1), "y": np.ones(1), "z": np.full(1, 2.0)}


def test_select_all_outputs_in_model_order() -> None:
    assert [name for name, _ in select_outputs(OUTPUTS, [], "m")] == ["x", "y", "z"]


def test_select_requested_outputs_in_request_order() -> None:
    selected = select_outputs(OUTPUTS, ["z", "x"], "m")
    assert [name for name, _ in selected] == ["z", "x"]
    assert selected[0][1] is OUTPUTS["z"]


def test_select_unknown_output() -> None:
    with pytest.raises(InvalidInput) as caught:
        select_outputs(OUTPUTS, ["x", "w"], "m")
    assert caught.value.message == "model 'm' has no output 'w'; its outputs are 'x', 'y', 'z'"


def test_select_output_twice() -> None:
    with pytest.raises(InvalidInput, match="model 'm': output 'x' is requested twice"):
        select_outputs(OUTPUTS, ["x", "x"], "m")


# --------------------------------------------------------------------------------------------
# The client side: encode_inputs and decode_outputs


def through_the_wire(message: Any) -> Any:
    return type(message).FromString(message.SerializeToString())


def client_round_trip(
    inputs: Sequence[tuple[str, np.ndarray]], *, raw: bool
) -> dict[str, np.ndarray]:
    """A client's inputs through a server that echoes them, and back to the client."""
    request = ModelInferRequest()
    encode_inputs(request, inputs, raw=raw)
    received = decode_inputs(through_the_wire(request))
    return decode_outputs(sent(list(received.items()), raw=raw))


@pytest.mark.parametrize("raw", [True, False])
@pytest.mark.parametrize("datatype", list(DATATYPES))
def test_encode_inputs_every_datatype(datatype: str, raw: bool) -> None:
    array = sample(datatype)
    request = ModelInferRequest()
    encode_inputs(request, [("IN", array)], raw=raw)
    [tensor] = request.inputs
    assert (tensor.name, tensor.datatype, list(tensor.shape)) == ("IN", datatype, [2, 3])
    # FP16 has no typed field, so it travels raw whatever was asked.
    travels_raw = raw or datatype == "FP16"
    assert len(request.raw_input_contents) == (1 if travels_raw else 0)
    assert tensor.HasField("contents") == (not travels_raw)
    assert_same(decode_inputs(through_the_wire(request))["IN"], array, datatype)


@pytest.mark.parametrize("raw", [True, False])
@pytest.mark.parametrize("datatype", list(DATATYPES))
def test_decode_outputs_every_datatype(datatype: str, raw: bool) -> None:
    array = sample(datatype)
    assert_same(decode_outputs(sent([("OUT", array)], raw=raw))["OUT"], array, datatype)


@pytest.mark.parametrize("raw", [True, False])
def test_client_round_trip_keeps_order_and_every_datatype(raw: bool) -> None:
    inputs = [(f"T_{name}", sample(name)) for name in reversed(DATATYPES)]
    decoded = client_round_trip(inputs, raw=raw)
    assert list(decoded) == [name for name, _ in inputs]
    for name, array in inputs:
        assert_same(decoded[name], array, name.removeprefix("T_"))


@pytest.mark.parametrize("raw", [True, False])
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2)])
def test_client_round_trip_scalar_and_empty_shapes(raw: bool, shape: tuple[int, ...]) -> None:
    numbers = np.arange(int(np.prod(shape)), dtype=np.uint16).reshape(shape)
    strings = np.empty(shape, dtype=object)
    strings.fill(b"\x00y\x00")
    decoded = client_round_trip([("N", numbers), ("S", strings)], raw=raw)
    assert_same(decoded["N"], numbers, "UINT16")
    assert_same(decoded["S"], strings, "BYTES")


@pytest.mark.parametrize("raw", [True, False])
def test_encode_inputs_str_and_numpy_strings_become_utf8_bytes(raw: bool) -> None:
    decoded = client_round_trip(
        [("U", np.array(["h\u00e9", ""])), ("S", np.array([b"a\x00", b"b"], dtype="S2"))],
        raw=raw,
    )
    assert decoded["U"].tolist() == ["h\u00e9".encode(), b""]
    assert decoded["S"].tolist() == [b"a", b"b"]  # numpy's S dtype drops trailing NULs itself


def test_encode_inputs_big_endian_and_strided_arrays() -> None:
    big = np.arange(6, dtype=">i4").reshape(2, 3)
    strided = np.arange(12, dtype=np.float64).reshape(3, 4)[:, ::2]
    decoded = client_round_trip([("B", big), ("S", strided)], raw=True)
    assert_same(decoded["B"], big.astype("<i4"), "INT32")
    assert_same(decoded["S"], strided, "FP64")


@settings(database=None, max_examples=100, deadline=None)
@given(data=st.data(), raw=st.booleans())
def test_client_numeric_round_trip_property(data: st.DataObject, raw: bool) -> None:
    dtype = data.draw(_numeric_dtypes)
    array = data.draw(hnp.arrays(dtype, _shapes))
    assert_same(client_round_trip([("X", array)], raw=raw)["X"], array, datatype_of(array))


def test_encode_inputs_rejects_unsupported_dtype_as_invalid_input() -> None:
    request = ModelInferRequest()
    with pytest.raises(InvalidInput) as caught:
        encode_inputs(request, [("OK", np.zeros(1)), ("C", np.zeros(2, np.complex64))], raw=True)
    assert caught.value.code == StatusCode.INVALID_ARGUMENT
    assert caught.value.message.startswith(
        "input 'C': numpy dtype complex64 has no Open Inference Protocol datatype"
    )
    assert not request.inputs


@pytest.mark.parametrize("raw", [True, False])
def test_encode_inputs_rejects_non_string_bytes_elements(raw: bool) -> None:
    array = np.array([b"a", 3.5], dtype=object)
    with pytest.raises(InvalidInput) as caught:
        encode_inputs(ModelInferRequest(), [("B", array)], raw=raw)
    assert caught.value.message == (
        "input 'B': BYTES element 1 is float; BYTES inputs hold bytes or str"
    )


def test_encode_inputs_rejects_str_that_utf8_cannot_encode() -> None:
    with pytest.raises(InvalidInput, match=r"^input 'B': BYTES element 0 is a str that UTF-8"):
        encode_inputs(ModelInferRequest(), [("B", np.array(["\udcff"], dtype=object))], raw=True)


def malformed_response(response: ModelInferResponse) -> InferError:
    """decode_outputs must fail with INTERNAL: a malformed response is the server's fault."""
    with pytest.raises(InferError) as caught:
        decode_outputs(response)
    assert type(caught.value) is InferError
    assert caught.value.code == StatusCode.INTERNAL
    return caught.value


def test_decode_outputs_raw_size_mismatch() -> None:
    response = ModelInferResponse(raw_output_contents=[bytes(12)])
    response.outputs.add(name="OUT", datatype="FP32", shape=[2, 2])
    assert malformed_response(response).message == (
        "output 'OUT': shape [2, 2] has 4 elements but raw_output_contents[0] holds "
        "3 FP32 elements (12 bytes)"
    )


def test_decode_outputs_raw_count_mismatch() -> None:
    response = ModelInferResponse(raw_output_contents=[bytes(4)])
    response.outputs.add(name="A", datatype="INT32", shape=[1])
    response.outputs.add(name="B", datatype="INT32", shape=[1])
    assert malformed_response(response).message == (
        "response has 2 outputs but 1 raw_output_contents entries; raw_output_contents needs "
        "exactly one entry per output, in output order"
    )


def test_decode_outputs_typed_errors_name_the_output() -> None:
    response = ModelInferResponse()
    response.outputs.add(name="Y", datatype="INT8", shape=[2]).contents.int_contents.extend(
        [1, 300]
    )
    assert malformed_response(response).message == (
        "output 'Y': INT8 element 1 is 300, outside [-128, 127]"
    )
    unknown = ModelInferResponse()
    unknown.outputs.add(name="Z", datatype="FLOAT", shape=[0])
    assert malformed_response(unknown).message.startswith("output 'Z': unknown datatype 'FLOAT'")


def test_decode_outputs_raw_bytes_truncated() -> None:
    response = ModelInferResponse(raw_output_contents=[length_prefixed(b"ab")[:-1]])
    response.outputs.add(name="S", datatype="BYTES", shape=[1])
    assert malformed_response(response).message == (
        "output 'S': raw_output_contents[0]: BYTES element 0 declares 2 bytes but only 1 remain"
    )


def test_decode_outputs_of_an_empty_response() -> None:
    assert decode_outputs(ModelInferResponse()) == {}


def test_serialized_response_is_the_response_with_its_raw_outputs() -> None:
    outputs = [("A", np.arange(6, dtype=np.int32)), ("B", np.array([b"x", b"yz"], dtype=object))]
    response = ModelInferResponse(model_name="m", model_version="2", id="call-7")
    parts = serialize_response(response, encode_outputs(response, outputs, raw=True))
    whole = ModelInferResponse(model_name="m", model_version="2", id="call-7")
    encode_outputs(whole, outputs, raw=True)
    whole.raw_output_contents.extend(
        [np.arange(6, dtype="<i4").tobytes(), length_prefixed(b"x", b"yz")]
    )
    assert b"".join(parts) == whole.SerializeToString()


def test_raw_outputs_are_sent_from_the_arrays_own_memory() -> None:
    array = np.arange(100_000, dtype="<f4").reshape(1000, 100)
    [view] = encode_outputs(ModelInferResponse(), [("OUT", array)], raw=True)
    assert np.shares_memory(np.frombuffer(view, np.uint8), array)


def test_raw_outputs_of_any_byte_order_and_strides_are_little_endian_c_order() -> None:
    array = np.arange(24, dtype=">i8").reshape(4, 6)[::2, ::-3]
    [view] = encode_outputs(ModelInferResponse(), [("OUT", array)], raw=True)
    assert bytes(view) == np.ascontiguousarray(array, "<i8").tobytes()
    assert_same(round_trip([("OUT", array)], raw=True)["OUT"], array.astype("<i8"), "INT64")


def test_a_bytes_tensor_over_the_element_cap_is_refused_before_it_is_decoded() -> None:
    request = ModelInferRequest()
    request.inputs.add(name="s", datatype="BYTES", shape=[MAX_BYTES_ELEMENTS + 1])
    # Each element's 4-byte prefix and no more: the message itself is small enough to send.
    request.raw_input_contents.append(bytes(4 * (MAX_BYTES_ELEMENTS + 1)))
    with pytest.raises(InvalidInput) as caught:
        decode_inputs(request)
    assert caught.value.message == (
        f"input 's': shape [{MAX_BYTES_ELEMENTS + 1}] has {MAX_BYTES_ELEMENTS + 1} BYTES "
        f"elements; at most {MAX_BYTES_ELEMENTS} are taken"
    )


def test_a_bytes_tensor_at_the_element_cap_is_decoded() -> None:
    request = ModelInferRequest()
    request.inputs.add(name="s", datatype="BYTES", shape=[MAX_BYTES_ELEMENTS])
    request.raw_input_contents.append(bytes(4 * MAX_BYTES_ELEMENTS))
    decoded = decode_inputs(request)["s"]
    assert decoded.shape == (MAX_BYTES_ELEMENTS,)
    assert decoded[0] == b""


def test_more_parameters_than_the_cap_are_refused() -> None:
    request = ModelInferRequest()
    for i in range(MAX_PARAMETERS + 1):
        request.parameters[f"p{i}"].bool_param = True
    with pytest.raises(InvalidInput) as caught:
        decode_parameters(request.parameters)
    assert caught.value.message == (
        f"{MAX_PARAMETERS + 1} parameters in one map; at most {MAX_PARAMETERS} are taken"
    )
    del request.parameters["p0"]
    assert len(decode_parameters(request.parameters)) == MAX_PARAMETERS


# -- what decoding costs ------------------------------------------------------------------------


def test_typed_contents_cost_the_parsed_field_and_the_array_not_their_wire_size() -> None:
    request = ModelInferRequest()
    encode_inputs(
        request, [("x", np.zeros(1000, np.int64)), ("b", np.ones(10, np.bool_))], raw=False
    )
    message = request.ByteSize()
    cost = decoding_cost(request, message)
    # An INT64 of value 0 is one byte on the wire, up to 16 in the parsed field (which grows by
    # doubling) and 8 in the array.
    assert cost == DecodingCost(nbytes=1000 * (16 + 8) + 10 * (2 + 1), elements=1010)
    assert cost.nbytes > 10 * message


def test_narrow_typed_contents_also_cost_their_narrowed_copy() -> None:
    request = ModelInferRequest()
    encode_inputs(request, [("x", np.zeros(100, np.int8))], raw=False)
    assert decoding_cost(request, request.ByteSize()).nbytes == 100 * (8 + 4 + 1)


def test_a_shape_of_too_many_dimensions_costs_nothing_and_is_refused_by_its_rank() -> None:
    # Its product is never taken: for thousands of huge dimensions that is a number of millions
    # of bits, seconds of the event loop. Decoding then refuses the shape by its rank first.
    request = ModelInferRequest()
    tensor = request.inputs.add(name="s", datatype="BYTES", shape=[2**62] * 40)
    request.raw_input_contents.append(b"\0" * 4000)
    assert decoding_cost(request, request.ByteSize()).elements == 0
    with pytest.raises(InvalidInput, match=r"input 's': shape has 40 dimensions; at most 32"):
        decode_inputs(request)
    tensor.shape[0] = -1
    with pytest.raises(InvalidInput, match=r"shape has 40 dimensions"):
        decode_inputs(request)


@pytest.mark.parametrize("raw", [True, False], ids=["raw", "typed"])
def test_bytes_elements_cost_an_object_each_and_their_payloads(raw: bool) -> None:
    request = ModelInferRequest()
    encode_inputs(request, [("s", np.array([b"ab"] * 100, dtype=np.object_))], raw=raw)
    message = request.ByteSize()
    assert decoding_cost(request, message) == DecodingCost(
        nbytes=100 * BYTES_ELEMENT_OVERHEAD + message, elements=100
    )


def test_raw_numeric_inputs_cost_nothing_beyond_their_message() -> None:
    request = ModelInferRequest()
    encode_inputs(request, [("x", np.zeros((64, 256), np.float32))], raw=True)
    assert decoding_cost(request, request.ByteSize()).elements == 0


def test_a_raw_bytes_shape_larger_than_its_message_costs_what_the_message_can_hold() -> None:
    request = ModelInferRequest()
    tensor = request.inputs.add(name="s", datatype="BYTES", shape=[1 << 40])
    request.raw_input_contents.append(b"\x00" * 40)
    message = request.ByteSize()
    count = message // 4  # each element takes at least its 4-byte length prefix
    assert decoding_cost(request, message).elements == count
    assert tensor.shape == [1 << 40]


# --------------------------------------------------------------------------------------------
# encode_response: the server's answer written without an object per element


def old_way(outputs: Sequence[tuple[str, np.ndarray]], *, raw: bool) -> bytes:
    """The response's bytes as protobuf serialises the real message holding the outputs."""
    response = ModelInferResponse(model_name="m", model_version="3", id="call")
    response.parameters["p"].int64_param = 7
    return b"".join(serialize_response(response, encode_outputs(response, outputs, raw=raw)))


def new_way(
    outputs: Sequence[tuple[str, np.ndarray]], *, raw: bool, datatypes: list[str] | None = None
) -> list[Any]:
    response = ModelInferResponse(model_name="m", model_version="3", id="call")
    response.parameters["p"].int64_param = 7
    return encode_response(response, outputs, raw=raw, datatypes=datatypes)


def check_encoded(outputs: Sequence[tuple[str, np.ndarray]], *, raw: bool) -> None:
    sent = b"".join(new_way(outputs, raw=raw))
    assert sent == old_way(outputs, raw=raw)
    # As the server encodes: with the datatypes its costing found (FP16's raw forcing included).
    cost = encoding_cost(outputs, raw=raw)
    assert b"".join(new_way(outputs, raw=raw, datatypes=cost.datatypes)) == sent
    if raw:
        check_as_is(outputs, cost)
    decoded = decode_outputs(ModelInferResponse.FromString(sent))
    assert list(decoded) == [name for name, _ in outputs]
    for name, array in outputs:
        array = np.asarray(array)
        datatype = datatype_of(array)
        if datatype == "BYTES":
            expected = np.empty(array.size, dtype=object)
            expected[:] = [e.encode() if isinstance(e, str) else e for e in array.ravel().tolist()]
            array = expected.reshape(array.shape)
        assert_same(decoded[name], array, datatype)


def check_as_is(outputs: Sequence[tuple[str, np.ndarray]], cost: EncodingCost) -> None:
    """encode_raw_as_is takes exactly the outputs numeric, little-endian and C-order, and
    then reserves encoding_cost's cost and gives encode_response's buffers; others it leaves
    with nothing reserved."""
    as_is = all(
        array.dtype.kind not in "OSU"
        and array.flags.c_contiguous
        and array.dtype == codec._LITTLE[datatype_of(array)]
        for _, array in outputs
    )
    reserved: list[EncodingCost] = []
    response = ModelInferResponse(model_name="m", model_version="3", id="call")
    response.parameters["p"].int64_param = 7
    parts = encode_raw_as_is(response, outputs, reserved.append)
    if not as_is:
        assert (parts, reserved) == (None, [])
        return
    assert parts is not None
    assert reserved == [cost]
    assert [bytes(part) for part in parts] == [bytes(part) for part in new_way(outputs, raw=True)]


def test_outputs_sent_as_they_are_are_costed_reserved_and_joined_in_one_pass() -> None:
    small = np.arange(256, dtype="<f4").reshape(1, 256)
    large = np.arange(1 << 14, dtype="<f4").reshape(64, 256)  # 64 KiB: a buffer of its own
    cases: list[list[tuple[str, np.ndarray]]] = [
        [("y", small)],
        [("y", large)],
        [("a", small), ("b", large), ("c", np.zeros((2, 0), np.int8))],
        # Small outputs over a mebibyte together: joined in pieces, as encode_response does.
        [(f"o{index}", np.full(60_000, index, np.uint8)) for index in range(20)],
        [("b", np.array([True, False])), ("h", np.ones(3, np.float16)), ("u", np.ones(2, "u8"))],
        [],
    ]
    for outputs in cases:
        check_encoded(outputs, raw=True)
    parts = encode_raw_as_is(ModelInferResponse(), [("y", large)], lambda cost: None)
    assert parts is not None
    assert any(np.shares_memory(np.frombuffer(part, np.uint8), large) for part in parts)
    # A refusal of the cost (the budget's) is the encode's: nothing is joined after it.
    refused = InferError("over budget", StatusCode.RESOURCE_EXHAUSTED)

    def refuse(cost: EncodingCost) -> None:
        raise refused

    with pytest.raises(InferError) as caught:
        encode_raw_as_is(ModelInferResponse(), [("y", small)], refuse)
    assert caught.value is refused
    # Any other output: nothing reserved, left to encoding_cost and encode_response.
    for other in (
        np.array([b"a"], dtype=object),
        np.array(["a"]),
        np.ones(3, ">f4"),
        np.ones((4, 4), "<f4")[:, ::2],
        np.zeros(2, np.complex64),
    ):
        assert encode_raw_as_is(ModelInferResponse(), [("y", small), ("z", other)], refuse) is None


_bytes_elements = st.one_of(st.binary(max_size=200), st.text(max_size=20))


@st.composite
def _outputs(draw: st.DrawFn) -> list[tuple[str, np.ndarray]]:
    outputs: list[tuple[str, np.ndarray]] = []
    for index in range(draw(st.integers(0, 3))):
        datatype = draw(st.sampled_from(list(DATATYPES)))
        if datatype == "BYTES":
            shape = draw(_shapes)
            count = int(np.prod(shape))
            array = np.empty(count, dtype=object)
            array[:] = draw(st.lists(_bytes_elements, min_size=count, max_size=count))
            array = array.reshape(shape)
        else:
            big_endian = draw(st.booleans())
            dtype = DATATYPES[datatype].newbyteorder(">" if big_endian else "<")
            array = draw(hnp.arrays(dtype, _shapes))
            if array.ndim and draw(st.booleans()):
                array = array[::-1]  # not C-order: copied
        outputs.append((f"out{index}", array))
    return outputs


@settings(database=None, max_examples=300, deadline=None)
@given(outputs=_outputs(), raw=st.booleans())
def test_encoded_response_is_protobufs_serialisation_of_the_real_message(
    outputs: list[tuple[str, np.ndarray]], raw: bool
) -> None:
    check_encoded(outputs, raw=raw)


@settings(database=None, max_examples=300, deadline=None)
@given(data=st.data())
def test_a_raw_output_view_holds_the_bytes_of_the_arrays_little_endian_c_order_copy(
    data: st.DataObject,
) -> None:
    # A little-endian C-order array is viewed as it is, any other copied: both give these bytes.
    datatype = data.draw(st.sampled_from([name for name in DATATYPES if name != "BYTES"]))
    big_endian = data.draw(st.booleans())
    array = data.draw(
        hnp.arrays(DATATYPES[datatype].newbyteorder(">" if big_endian else "<"), _shapes)
    )
    if array.ndim and data.draw(st.booleans()):
        array = array[::-1]
    view = codec._raw_view(array, datatype)
    copied = np.ascontiguousarray(array, codec._LITTLE[datatype]).reshape(-1).view(np.uint8)
    assert (view.format, view.ndim) == ("B", 1)
    assert bytes(view) == copied.tobytes()


@pytest.mark.parametrize("raw", [True, False], ids=["raw", "typed"])
def test_encoded_response_of_outputs_larger_than_an_encoding_step(raw: bool) -> None:
    # Several varint and framing steps, values of every varint size and sign, BYTES elements
    # alone in a step (larger than one) and many to a step.
    rng = np.random.default_rng(16)
    wide = rng.integers(-(2**63), 2**63 - 1, 70_000, dtype=np.int64)
    wide[::7] = rng.integers(-200, 200, wide[::7].size)
    lengths = rng.integers(0, 300, 150_000)
    lengths[[5, 70_000]] = [3 << 20, 1 << 20]
    elements = np.empty(lengths.size, dtype=object)
    elements[:] = [bytes([n % 251]) * int(n) for n in lengths]
    outputs = [
        ("i64", wide),
        ("i8", rng.integers(-128, 127, 30_000, dtype=np.int8)),
        ("u32", rng.integers(0, 2**32 - 1, 40_000, dtype=np.uint32)),
        ("u64", rng.integers(0, 2**64 - 1, 40_000, dtype=np.uint64)),
        ("small", np.arange(100_000) % 128),
        ("b", np.arange(200_000) % 3 == 0),
        ("f32", rng.standard_normal((300, 400)).astype(np.float32)),
        ("f64", rng.standard_normal(50_000).astype(">f8")),
        ("s", elements),
    ]
    check_encoded(outputs, raw=raw)


def test_typed_fixed_width_outputs_are_sent_from_the_arrays_own_memory() -> None:
    array = np.arange(100_000, dtype="<f4").reshape(1000, 100)
    parts = new_way([("OUT", array)], raw=False)
    assert any(np.shares_memory(np.frombuffer(part, np.uint8), array) for part in parts)


def test_a_bool_view_of_other_bytes_is_encoded_as_protobuf_encodes_true() -> None:
    array = np.array([0, 1, 2, 255], np.uint8).view(np.bool_)
    check_encoded([("B", array)], raw=False)


def test_encode_response_remembers_few_output_metadata_and_encodes_every_one_right() -> None:
    """Outputs' serialised metadata is remembered by name, datatype and shape: many shapes
    (more than it keeps), a long name and a high rank are each encoded as protobuf does."""
    for rows in range(codec._METADATA_ENTRIES + 10):
        check_encoded([("y", np.zeros((rows % 2000, 3), np.float32))], raw=True)
        assert len(codec._METADATA) <= codec._METADATA_ENTRIES
    check_encoded([("n" * 1000, np.zeros((1, 2), np.int64))], raw=False)
    check_encoded([("deep", np.zeros((1,) * 12, np.float64))], raw=True)
    assert ("n" * 1000, "INT64", (1, 2)) not in codec._METADATA
    assert ("deep", "FP64", (1,) * 12) not in codec._METADATA
    # The same output twice, from what was remembered the second time.
    check_encoded([("y", np.ones((2, 3), np.float32))], raw=True)
    check_encoded([("y", np.ones((2, 3), np.float32))], raw=True)


@pytest.mark.parametrize("raw", [True, False], ids=["raw", "typed"])
def test_encode_response_refuses_what_encode_outputs_refuses(raw: bool) -> None:
    array = np.array([b"ok", 3], dtype=object)
    with pytest.raises(ModelFailed, match=r"output 'B': BYTES element 1 is int"):
        encode_response(ModelInferResponse(), [("B", array)], raw=raw)
    with pytest.raises(ModelFailed, match=r"output 'B': BYTES element 1 is int"):
        encoding_cost([("B", array)], raw=raw)
    with pytest.raises(ModelFailed, match="output 'C'"):
        encoding_cost([("C", np.zeros(2, np.complex64))], raw=raw)


_COST_CASES: dict[str, list[tuple[str, np.ndarray]]] = {
    "int64 small": [("x", np.arange(300_000) % 100)],
    "int64 wide": [("x", np.arange(-150_000, 150_000) * 2**40)],
    "int8 negative": [("x", np.full(300_000, -1, np.int8))],
    "uint32": [("x", np.arange(300_000, dtype=np.uint32) * 1000)],
    "fp32 big-endian": [("x", np.ones(300_000, ">f4"))],
    "small": [
        ("x", np.ones(10_000, np.float32)),
        ("y", np.ones(6_000, ">f8")),
        ("z", np.arange(30_000) % 3 == 0),
        ("w", np.ones((100, 100), np.int8)[:, ::2]),
    ],
    "fp64 strided": [("x", np.ones(600_000)[::2])],
    "bool": [("x", np.arange(300_000) % 2 == 0)],
    "bytes short": [("x", np.array([b"ab"] * 300_000, dtype=object))],
    "bytes long": [("x", np.array([b"a" * 5000] * 1000, dtype=object))],
    "str": [("x", np.array(["héllo"] * 100_000, dtype=object))],
    "many small": [(f"x{index}", np.ones(15_000, np.float32)) for index in range(30)],
}
#: The cases whose raw outputs are all sent as they are (numeric, little-endian, C order).
_AS_IS_CASES = ("int64 small", "int64 wide", "int8 negative", "uint32", "bool", "many small")


@pytest.mark.parametrize("raw", [True, False], ids=["raw", "typed"])
@pytest.mark.parametrize("case", list(_COST_CASES))
def test_encoding_allocates_no_more_than_its_cost(case: str, raw: bool) -> None:
    outputs = _COST_CASES[case]
    cost = encoding_cost(outputs, raw=raw)
    # Once first: the codec's cache of serialised output metadata (bounded, shared by every
    # answer) then holds these outputs', and its growth is not this answer's allocation.
    new_way(outputs, raw=raw)
    tracemalloc.start()
    try:
        parts = new_way(outputs, raw=raw)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak <= cost.nbytes
    # Not a loose bound either: within a few times the real peak.
    assert cost.nbytes <= 4 * peak + 8 * 2**20
    del parts
    if raw and case in _AS_IS_CASES:
        # In one pass: what it allocates before the cost is reserved is the answer's records,
        # within their allowance, and all of it within the cost.
        before: list[int] = []

        def reserve(reserved: EncodingCost) -> None:
            assert reserved == cost
            before.append(tracemalloc.get_traced_memory()[1])

        tracemalloc.start()
        try:
            as_is = encode_raw_as_is(ModelInferResponse(), outputs, reserve)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert as_is is not None
        assert before[0] <= len(outputs) * codec._METADATA_ALLOWANCE
        assert peak <= cost.nbytes


def test_the_cost_of_outputs_counts_the_arrays_and_the_work() -> None:
    numeric = np.zeros((100, 10), np.int64)
    elements = np.array([b"abc"] * 50, dtype=object)
    cost = encoding_cost([("n", numeric), ("s", elements)], raw=False)
    assert cost.outputs == numeric.nbytes + elements.nbytes + 50 * (BYTES_ELEMENT_OVERHEAD + 3)
    assert cost.elements == 1050
    # Raw, a little-endian C-order numeric output is sent as it is: no work, and no bytes
    # from 64 KiB on; a smaller one is joined with the answer's records, its bytes copied once.
    raw = encoding_cost([("n", numeric)], raw=True)
    assert raw == EncodingCost(raw.nbytes, numeric.nbytes, 0, ["INT64"])
    assert numeric.nbytes <= raw.nbytes <= numeric.nbytes + 8192  # the copy, its metadata
    large = np.zeros((100, 100), np.int64)
    assert encoding_cost([("n", large)], raw=True).nbytes <= 8192  # its metadata
    # One FP16 output makes every output raw, as in encode_response.
    assert encoding_cost([("n", numeric), ("h", np.zeros(1, np.float16))], raw=False).elements == 0
