"""The V2 REST codec: bodies as tritonclient writes and reads them, and every refusal."""

from __future__ import annotations

import json
import math
from typing import Any, Literal

import numpy as np
import orjson
import pytest
import simdjson
import tritonclient.http as triton_http
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from tritonclient.http._utils import _get_inference_request

from trio_infer.datatypes import DATATYPES
from trio_infer.errors import InvalidInput, ModelFailed
from trio_infer.rest import codec
from trio_infer.rest.codec import (
    BYTES_ELEMENT_OVERHEAD,
    BinaryOutputs,
    decode_infer_request,
    encode_infer_response,
    parse_infer_request,
    parsing_cost,
)

NUMERIC = [name for name in DATATYPES if name != "BYTES"]


def sample(datatype: str, shape: tuple[int, ...] = (2, 3)) -> np.ndarray:
    """An array of ``datatype`` holding each kind's edge values where it can."""
    count = int(np.prod(shape))
    if datatype == "BYTES":
        words = [b"", "gr\u00fc\u00dfe \u2603".encode(), b"plain", b"\xf0\x9f\x98\x80", b"x"]
        return np.array([words[i % len(words)] for i in range(count)], dtype=object).reshape(shape)
    dtype = DATATYPES[datatype]
    if datatype == "BOOL":
        return (np.arange(count) % 2 == 0).reshape(shape)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        edges = [info.min, info.max, 0, 1, info.max // 3, info.min // 3]
        return np.array([edges[i % len(edges)] for i in range(count)], dtype=dtype).reshape(shape)
    info_f = np.finfo(dtype)
    edges_f = [float(info_f.max), -float(info_f.max), 0.1, -2.5, float(info_f.tiny), 0.0]
    return np.array([edges_f[i % len(edges_f)] for i in range(count)], dtype=dtype).reshape(shape)


def triton_body(
    inputs: list[tuple[str, np.ndarray, bool]],
    outputs: list[tuple[str, bool]] | None = None,
    parameters: dict[str, Any] | None = None,
    request_id: str = "",
) -> tuple[bytes, int | None]:
    """The exact body and Inference-Header-Content-Length tritonclient.http sends."""
    infer_inputs = []
    for name, array, binary in inputs:
        datatype = "BYTES" if array.dtype == np.object_ else _triton_datatype(array)
        infer_input = triton_http.InferInput(name, list(array.shape), datatype)
        infer_input.set_data_from_numpy(array, binary_data=binary)
        infer_inputs.append(infer_input)
    requested = [triton_http.InferRequestedOutput(name, binary) for name, binary in outputs or []]
    body, header_length = _get_inference_request(
        infer_inputs, request_id, requested, 0, False, False, 0, None, parameters
    )
    return body, header_length


def _triton_datatype(array: np.ndarray) -> str:
    return next(name for name, dtype in DATATYPES.items() if dtype == array.dtype)


def body_of(document: Any, *blobs: bytes) -> tuple[bytes, int | None]:
    """A body of ``document`` as JSON followed by ``blobs`` (with a header length if any)."""
    header = json.dumps(document).encode()
    if not blobs:
        return header, None
    return header + b"".join(blobs), len(header)


def fp32_input(**fields: Any) -> dict[str, Any]:
    return {"name": "x", "datatype": "FP32", "shape": [2], "data": [1.0, 2.0], **fields}


def read_response(buffers: list[Any], header_length: int | None) -> Any:
    body = b"".join(bytes(buffer) for buffer in buffers)
    return triton_http.InferResult.from_response_body(body, header_length=header_length)


# --------------------------------------------------------------------------------------------
# Requests as tritonclient sends them


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
@pytest.mark.parametrize("datatype", list(DATATYPES))
def test_every_datatype_decodes_as_tritonclient_sent_it(datatype: str, binary: bool) -> None:
    array = sample(datatype)
    body, header_length = triton_body([("x", array, binary)], request_id="r-7")
    assert (header_length is not None) == binary

    request = decode_infer_request(body, header_length)

    decoded = request.inputs["x"]
    assert decoded.dtype == DATATYPES[datatype]
    assert decoded.shape == array.shape
    assert decoded.tolist() == array.tolist()
    assert request.id == "r-7"
    assert request.datatypes == {"x": datatype}
    assert request.input_parameters == {"x": {}}


def test_inputs_binary_and_json_mix_and_their_bytes_follow_in_input_order() -> None:
    first = np.arange(5, dtype=np.int16)
    second = np.array([[True, False]])
    third = np.array([b"\x00\xff", b""], dtype=object)
    body, header_length = triton_body(
        [("a", first, True), ("b", second, False), ("c", third, True)]
    )

    request = decode_infer_request(body, header_length)

    assert list(request.inputs) == ["a", "b", "c"]
    np.testing.assert_array_equal(request.inputs["a"], first)
    np.testing.assert_array_equal(request.inputs["b"], second)
    assert request.inputs["c"].tolist() == [b"\x00\xff", b""]


def test_request_parameters_of_every_type_are_kept_and_binary_data_output_taken_out() -> None:
    parameters = {"flag": True, "count": -3, "big": 2**64 - 1, "ratio": 0.25, "name": "h\u00e9"}
    body, header_length = triton_body([("x", sample("FP32"), False)], parameters=parameters)

    request = decode_infer_request(body, header_length)

    # tritonclient asks for every output binary when it names none.
    assert request.binary_outputs == BinaryOutputs(default=True)
    assert request.parameters == parameters
    assert all(type(request.parameters[key]) is type(value) for key, value in parameters.items())
    assert request.outputs == []


def test_input_and_output_parameters_are_kept_without_the_layout_ones() -> None:
    binary = {"name": "x", "datatype": "FP32", "shape": [2]}
    document = {
        "inputs": [{**binary, "parameters": {"binary_data_size": 8, "scale": 2}}],
        "outputs": [
            {"name": "y", "parameters": {"binary_data": True, "classification": 3}},
            {"name": "z"},
        ],
    }
    body, header_length = body_of(document, np.float32([1, 2]).tobytes())

    request = decode_infer_request(body, header_length)

    assert request.input_parameters == {"x": {"scale": 2}}
    assert request.outputs == ["y", "z"]
    assert request.output_parameters == {"y": {"classification": 3}, "z": {}}
    assert request.binary_outputs.is_binary("y")
    assert not request.binary_outputs.is_binary("z")


def test_nested_json_data_decodes_as_its_flat_form() -> None:
    values = np.arange(24, dtype=np.int32).reshape(2, 3, 4)
    nested = {"name": "x", "datatype": "INT32", "shape": [2, 3, 4], "data": values.tolist()}
    flat = {**nested, "data": values.ravel().tolist()}

    for document in ({"inputs": [nested]}, {"inputs": [flat]}):
        request = decode_infer_request(*body_of(document))
        np.testing.assert_array_equal(request.inputs["x"], values)


def test_empty_tensors_decode_in_every_form() -> None:
    document = {
        "inputs": [
            {"name": "a", "datatype": "INT8", "shape": [0, 3], "data": []},
            {"name": "b", "datatype": "FP32", "shape": [2, 0], "data": [[], []]},
            {"name": "c", "datatype": "BYTES", "shape": [0], "data": []},
            {
                "name": "d",
                "datatype": "UINT16",
                "shape": [0],
                "parameters": {"binary_data_size": 0},
            },
        ]
    }
    request = decode_infer_request(*body_of(document, b""))
    assert {name: (a.dtype, a.shape) for name, a in request.inputs.items()} == {
        "a": (np.dtype(np.int8), (0, 3)),
        "b": (np.dtype(np.float32), (2, 0)),
        "c": (np.dtype(object), (0,)),
        "d": (np.dtype(np.uint16), (0,)),
    }


def test_json_integers_are_accepted_for_float_datatypes() -> None:
    document = {"inputs": [{"name": "x", "datatype": "FP64", "shape": [3], "data": [1, 2.5, -3]}]}
    assert decode_infer_request(*body_of(document)).inputs["x"].tolist() == [1.0, 2.5, -3.0]


FLOAT_DATATYPES = ["FP16", "FP32", "FP64"]
#: A float tensor's JSON numbers: floats of every magnitude (beyond FP16's and FP32's largest
#: and beyond 2**53) and around FP16's range, integers up to 64 bits and small ones, bools.
JSON_NUMBERS = st.one_of(
    st.floats(allow_nan=False, allow_infinity=False),
    st.floats(-70000.0, 70000.0),
    st.integers(-(2**63), 2**64 - 1),
    st.integers(-3000, 3000),
    st.booleans(),
)


def decoded_or_refused(body: bytes) -> tuple[Any, ...]:
    """Input ``x`` of a request, bit for bit and whether it is writable, or the refusal."""
    try:
        array = decode_infer_request(body, None).inputs["x"]
    except InvalidInput as error:
        return ("refused", str(error))
    return (array.dtype, array.shape, array.tobytes(), array.flags.writeable)


@given(
    datatype=st.sampled_from(FLOAT_DATATYPES),
    data=st.lists(JSON_NUMBERS, min_size=1, max_size=40),
    odd=st.one_of(
        st.none(), st.tuples(st.integers(0, 39), st.sampled_from([None, "1.5", [1.0], {}]))
    ),
    form=st.sampled_from(["flat", "row", "nested", "miscounted"]),
)
@settings(max_examples=500, deadline=None)
def test_float_data_packed_as_doubles_decodes_as_numpys_inference_of_the_list(
    datatype: str, data: list[Any], odd: tuple[int, Any] | None, form: str
) -> None:
    # Small float tensors are packed by struct unless the general path must decide; whatever
    # the elements, the outcome is the general path's.
    if odd is not None:
        position, value = odd
        data[position % len(data)] = value
    shape = [len(data)]
    document_data: Any = data
    if form == "row":
        shape = [1, len(data)]
    elif form == "nested":
        shape, document_data = [1, len(data)], [data]
    elif form == "miscounted":
        shape = [len(data) + 1]
    body, _ = body_of(numbers(datatype, document_data, shape))

    packed = decoded_or_refused(body)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(codec, "_PACKED_MAX_ELEMENTS", 0)
        general = decoded_or_refused(body)
    assert packed == general


@pytest.mark.parametrize("datatype", FLOAT_DATATYPES)
def test_small_float_data_is_packed_as_doubles(
    datatype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    packed: list[bool] = []
    original = codec._packed_floats

    def spy(datatype: str, shape: tuple[int, ...], count: int, data: list[Any]) -> Any:
        result = original(datatype, shape, count, data)
        packed.append(result is not None)
        return result

    monkeypatch.setattr(codec, "_packed_floats", spy)
    data = [0.5, -2, 1e-3, 3, 1, -0.0]
    request = decode_infer_request(*body_of(numbers(datatype, data, [2, 3])))
    assert packed == [True]
    expected = np.array(data, dtype=np.float64).astype(DATATYPES[datatype]).reshape(2, 3)
    assert_identical(request.inputs["x"], expected)
    assert request.inputs["x"].flags.writeable


def test_a_binary_input_is_a_view_of_the_body_where_aligned_and_a_copy_where_not() -> None:
    values = np.arange(4, dtype=np.float64)
    for pad in range(8):
        document = {
            "id": "p" * pad,
            "inputs": [{"name": "x", "datatype": "FP64", "shape": [4]}],
        }
        document["inputs"][0]["parameters"] = {"binary_data_size": 32}
        body, header_length = body_of(document, values.tobytes())

        parsed = parse_infer_request(body, header_length)
        array = decode_infer_request(body, header_length).inputs["x"]

        np.testing.assert_array_equal(array, values)
        assert array.ctypes.data % 8 == 0
        aliases = np.shares_memory(array, np.frombuffer(body, dtype=np.uint8))
        assert aliases == (parsed.decoded_nbytes == 0)


def test_decoded_nbytes_bounds_the_arrays_before_they_are_built() -> None:
    document = {
        "inputs": [
            {"name": "a", "datatype": "FP32", "shape": [2, 8], "data": [0.5] * 16},
            {"name": "b", "datatype": "BYTES", "shape": [3], "data": ["a", "bb", ""]},
        ]
    }
    body, header_length = body_of(document)

    parsed = parse_infer_request(body, header_length)

    # The array numpy infers (8 bytes an element) and the FP32 one; each BYTES element's
    # object, and payloads of at most the JSON's text.
    assert parsed.decoded_nbytes == 16 * (8 + 4) + 3 * BYTES_ELEMENT_OVERHEAD + len(body)
    assert parsing_cost(len(body)) == 24 * len(body)


# --------------------------------------------------------------------------------------------
# Responses as tritonclient reads them


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
@pytest.mark.parametrize("datatype", list(DATATYPES))
def test_every_datatype_encodes_as_tritonclient_reads_it(datatype: str, binary: bool) -> None:
    array = sample(datatype, (3, 2))

    buffers, header_length = encode_infer_response(
        "m", "2", "id-1", [("y", array)], {}, BinaryOutputs(default=binary)
    )

    assert (header_length is not None) == binary
    result = read_response(buffers, header_length)
    decoded = result.as_numpy("y")
    assert decoded.shape == array.shape
    if datatype == "BYTES" and not binary:
        # JSON carries BYTES as strings: tritonclient gives them back as str.
        assert decoded.tolist() == [[e.decode() for e in row] for row in array.tolist()]
    else:
        assert decoded.tolist() == array.tolist()
    response = result.get_response()
    assert (response["model_name"], response["model_version"], response["id"]) == (
        "m",
        "2",
        "id-1",
    )
    assert response["outputs"][0]["datatype"] == datatype


def test_outputs_go_binary_as_requested_per_output_over_the_request_default() -> None:
    body, header_length = body_of(
        {
            "inputs": [fp32_input()],
            "parameters": {"binary_data_output": True},
            "outputs": [{"name": "a", "parameters": {"binary_data": False}}, {"name": "b"}],
        }
    )
    request = decode_infer_request(body, header_length)
    outputs = [
        ("a", np.float32([[1.5, 2.5]])),
        ("b", np.int64([7, -8])),
        ("c", np.array([b"z"], dtype=object)),
    ]

    buffers, response_header = encode_infer_response(
        "m", "1", "", outputs, {"done": True}, request.binary_outputs
    )

    result = read_response(buffers, response_header)
    response = result.get_response()
    assert "id" not in response
    assert response["parameters"] == {"done": True}
    assert [o.get("parameters") for o in response["outputs"]] == [
        None,
        {"binary_data_size": 16},
        {"binary_data_size": 5},
    ]
    assert response["outputs"][0]["data"] == [1.5, 2.5]
    for name, array in outputs:
        assert result.as_numpy(name).tolist() == array.tolist()
    assert response_header == len(buffers[0])


def test_a_response_without_binary_outputs_is_one_json_buffer() -> None:
    buffers, header_length = encode_infer_response(
        "m", "1", "", [("y", np.float16([0.5, np.inf]))], {}, BinaryOutputs()
    )
    assert header_length is None
    assert orjson.loads(buffers[0])["outputs"] == [
        {"name": "y", "datatype": "FP16", "shape": [2], "data": [0.5, None]}
    ]


def test_response_parameters_of_every_type_are_written() -> None:
    parameters = {"b": False, "i": -(2**63), "u": 2**64 - 1, "f": 1.25, "s": "\u2603"}
    buffers, _ = encode_infer_response("m", "1", "", [], parameters, BinaryOutputs())
    assert orjson.loads(buffers[0])["parameters"] == parameters


def test_outputs_of_any_layout_and_byte_order_are_written_in_row_major_order() -> None:
    base = np.arange(12, dtype=">i4").reshape(3, 4)
    for array in (base, base.T, base[::2, ::-1], np.asfortranarray(base)):
        for binary in (False, True):
            buffers, header_length = encode_infer_response(
                "m", "1", "", [("y", array)], {}, BinaryOutputs(default=binary)
            )
            assert read_response(buffers, header_length).as_numpy("y").tolist() == array.tolist()


def test_a_contiguous_binary_output_is_sent_from_its_own_memory() -> None:
    array = np.arange(1000, dtype=np.float32)
    buffers, _ = encode_infer_response(
        "m", "1", "", [("y", array)], {}, BinaryOutputs(default=True)
    )
    assert np.shares_memory(np.frombuffer(buffers[1], dtype=np.float32), array)


@pytest.mark.parametrize(
    ("array", "binary", "message"),
    [
        (
            np.array([b"ok", 3], dtype=object),
            True,
            "output 'y': BYTES element 1 is int; BYTES outputs hold bytes or str",
        ),
        (
            np.array(["\ud800"], dtype=object),
            True,
            "output 'y': BYTES element 0 is a str that UTF-8 cannot encode (surrogates not "
            "allowed at index 0)",
        ),
        (np.array([1j]), False, "output 'y': numpy dtype complex128 has no Open Inference"),
    ],
)
def test_unwritable_outputs_fail_the_model(array: np.ndarray, binary: bool, message: str) -> None:
    with pytest.raises(ModelFailed) as caught:
        encode_infer_response("m", "1", "", [("y", array)], {}, BinaryOutputs(default=binary))
    assert str(caught.value).startswith(message)


def test_a_bytes_output_asked_for_as_json_that_is_not_utf_8_is_the_requests_to_change() -> None:
    array = np.array([b"ok", b"\xff"], dtype=object)
    with pytest.raises(InvalidInput) as caught:
        encode_infer_response("m", "1", "", [("y", array)], {}, BinaryOutputs(default=False))
    assert str(caught.value).startswith(
        "output 'y': BYTES element 1 is not UTF-8, so it cannot be written as a JSON string; "
        'ask for the output as binary data: "binary_data": true'
    )


# --------------------------------------------------------------------------------------------
# Properties


@st.composite
def cases(draw: st.DrawFn) -> tuple[str, np.ndarray, bool]:
    """A datatype, an array of it, and whether it travels binary."""
    binary = draw(st.booleans())
    datatype = draw(st.sampled_from(list(DATATYPES)))
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4))
    if datatype == "BYTES":
        # Only UTF-8 travels as JSON strings; binary takes any bytes.
        elements = st.text(max_size=4).map(str.encode)
        if binary:
            elements |= st.binary(max_size=8)
        return datatype, draw(hnp.arrays(object, shape, elements=elements)), binary
    dtype = DATATYPES[datatype]
    elements = (
        hnp.from_dtype(dtype, allow_nan=False, allow_infinity=False)
        if dtype.kind == "f"
        else hnp.from_dtype(dtype)
    )
    return datatype, draw(hnp.arrays(dtype, shape, elements=elements)), binary


@given(cases())
@settings(max_examples=300, deadline=None)
def test_any_array_round_trips_through_a_response_and_a_request(
    case: tuple[str, np.ndarray, bool],
) -> None:
    datatype, array, binary = case
    buffers, header_length = encode_infer_response(
        "m", "1", "", [("y", array)], {}, BinaryOutputs(default=binary)
    )
    result = read_response(buffers, header_length)
    if not binary and datatype == "BYTES":
        # A client reading JSON BYTES gets str.
        texts = [element.decode() for element in array.ravel()]
        assert result.as_numpy("y").ravel().tolist() == texts
    else:
        assert result.as_numpy("y").tolist() == array.tolist()

    # The client's request of the same array decodes to it again.
    body, request_header = triton_body([("x", array, binary)])
    decoded = decode_infer_request(body, request_header).inputs["x"]
    assert decoded.dtype == DATATYPES[datatype]
    assert decoded.shape == array.shape
    assert decoded.tolist() == array.tolist()


# --------------------------------------------------------------------------------------------
# Refusals


def refused(document: Any, *blobs: bytes, header_length: int | None = None) -> str:
    body, computed = body_of(document, *blobs)
    with pytest.raises(InvalidInput) as caught:
        decode_infer_request(body, header_length if header_length is not None else computed)
    return str(caught.value)


def numbers(datatype: str, data: Any, shape: list[int] | None = None) -> Any:
    size = shape if shape is not None else [len(data)]
    return {"inputs": [{"name": "x", "datatype": datatype, "shape": size, "data": data}]}


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ([1], "the request's JSON is a list; an inference request is an object"),
        ({"inputs": [fp32_input()], "id": 5}, "the request's 'id' is a number (5); it is a string"),
        ({}, "the request's 'inputs' is missing; it is a list of inputs"),
        ({"inputs": {}}, "the request's 'inputs' is an object; it is a list of inputs"),
        ({"inputs": [3]}, "the request's inputs[0] is a number (3); it is an object"),
        ({"inputs": [{"shape": [1]}]}, "the request's inputs[0] 'name' is missing; it is a string"),
        (
            {"inputs": [fp32_input(), fp32_input()]},
            "input 'x' appears more than once in the request",
        ),
        (
            {"inputs": [fp32_input(datatype=None)]},
            "input 'x': 'datatype' is missing; it is a string",
        ),
        (
            {"inputs": [fp32_input(datatype="FLOAT")]},
            "input 'x': unknown datatype 'FLOAT'; valid datatypes are BOOL, UINT8, UINT16, "
            "UINT32, UINT64, INT8, INT16, INT32, INT64, FP16, FP32, FP64, BYTES",
        ),
        (
            {"inputs": [fp32_input(shape=None)]},
            "input 'x': 'shape' is missing; it is a list of integers",
        ),
        (
            {"inputs": [fp32_input(shape=[2, 1.5])]},
            "input 'x': 'shape' is [2, 1.5]; it is a list of integers",
        ),
        (
            {"inputs": [fp32_input(shape=[True])]},
            "input 'x': 'shape' is [True]; it is a list of integers",
        ),
        (
            {"inputs": [fp32_input(shape=[2, -1])]},
            "input 'x': shape [2, -1] has a negative dimension; request shapes must be concrete",
        ),
        (
            {"inputs": [fp32_input(shape=[1] * 33)]},
            "input 'x': shape has 33 dimensions; at most 32 are supported",
        ),
        (
            {"inputs": [fp32_input(shape=[2**40, 2**40, 0], data=[])]},
            "input 'x': shape [1099511627776, 1099511627776, 0] is too large",
        ),
        (
            {"inputs": [fp32_input(datatype="BYTES", shape=[2**21], data=[])]},
            "input 'x': shape [2097152] has 2097152 BYTES elements; at most 1048576 are taken",
        ),
        (
            {"inputs": [fp32_input(data=None)]},
            "input 'x': 'data' is missing; an input carries a list in 'data' or sends its data "
            "binary with a 'binary_data_size' parameter",
        ),
        (
            {"inputs": [fp32_input(data=1.0, shape=[])]},
            "input 'x': 'data' is a number (1.0); an input carries a list in 'data' or sends "
            "its data binary with a 'binary_data_size' parameter",
        ),
        (
            {"inputs": [fp32_input(parameters=[])]},
            "input 'x': 'parameters' is a list; it is an object",
        ),
        (
            {"inputs": [fp32_input(parameters={"k": None})]},
            "input 'x': parameter 'k' is null; parameters are bools, numbers or strings",
        ),
        (
            {"inputs": [fp32_input()], "parameters": {"k": [1]}},
            "the request: parameter 'k' is a list; parameters are bools, numbers or strings",
        ),
        (
            {"inputs": [fp32_input()], "parameters": {str(i): i for i in range(1025)}},
            "the request: 1025 parameters; at most 1024 are taken",
        ),
        (
            {"inputs": [fp32_input()], "parameters": {"binary_data_output": 1}},
            "the request's parameter 'binary_data_output' is a number (1); it is a bool",
        ),
        (
            {"inputs": [fp32_input()], "outputs": {"name": "y"}},
            "the request's 'outputs' is an object; it is a list",
        ),
        (
            {"inputs": [fp32_input()], "outputs": ["y"]},
            "the request's outputs[0] is a string ('y'); it is an object",
        ),
        (
            {"inputs": [fp32_input()], "outputs": [{"name": 1}]},
            "the request's outputs[0] 'name' is a number (1); it is a string",
        ),
        (
            {"inputs": [fp32_input()], "outputs": [{"name": "y"}, {"name": "y"}]},
            "output 'y' is requested more than once",
        ),
        (
            {
                "inputs": [fp32_input()],
                "outputs": [{"name": "y", "parameters": {"binary_data": "yes"}}],
            },
            "requested output 'y': parameter 'binary_data' is a string ('yes'); it is a bool",
        ),
    ],
)
def test_malformed_json_fields_are_refused(document: Any, message: str) -> None:
    assert refused(document) == message


def test_malformed_json_is_refused() -> None:
    with pytest.raises(InvalidInput) as caught:
        decode_infer_request(b'{"inputs": [', None)
    assert str(caught.value).startswith("the request's JSON is malformed: ")


@pytest.mark.parametrize(
    ("document", "message"),
    [
        (numbers("UINT8", [1, 300]), "input 'x': element 1 is 300, outside UINT8's range [0, 255]"),
        (numbers("INT8", [-129]), "input 'x': element 0 is -129, outside INT8's range [-128, 127]"),
        (numbers("UINT64", [1, -1]), "input 'x': element 1 is -1, outside UINT64's range"),
        (
            numbers("INT64", [2**63]),
            "input 'x': element 0 is 9223372036854775808, outside INT64's range",
        ),
        # Integers beyond 64 bits (orjson reads them as floats) are out of range, not "not
        # integers".
        (
            numbers("INT64", [-(2**63) - 1]),
            "input 'x': element 0 is -9.223372036854776e+18, outside INT64's range",
        ),
        (
            numbers("UINT64", [2**64]),
            "input 'x': element 0 is 1.8446744073709552e+19, outside UINT64's range",
        ),
        (numbers("INT8", [10**30]), "input 'x': element 0 is 1e+30, outside INT8's range"),
        (
            numbers("INT32", [1, 2.5]),
            "input 'x': element 1 is 2.5, not an integer; INT32 elements are integers",
        ),
        (
            numbers("INT32", [1.0]),
            "input 'x': element 0 is 1.0, not an integer; INT32 elements are integers",
        ),
        (
            numbers("FP32", [1.0, "2"]),
            "input 'x': element 1 is a string ('2'); FP32 elements are numbers",
        ),
        (
            numbers("FP32", [True]),
            "input 'x': element 0 is a bool (true); FP32 elements are numbers",
        ),
        # Among numbers, where struct packs it and numpy infers it as 0 or 1.
        (
            numbers("FP32", [1.0, True]),
            "input 'x': element 1 is a bool (true); FP32 elements are numbers",
        ),
        (
            numbers("FP16", [0, False, 2.5]),
            "input 'x': element 1 is a bool (false); FP16 elements are numbers",
        ),
        (
            numbers("INT32", [True, 2]),
            "input 'x': element 0 is a bool (true); INT32 elements are numbers",
        ),
        (
            numbers("UINT64", [2**64 - 1, True]),
            "input 'x': element 1 is a bool (true); UINT64 elements are numbers",
        ),
        (
            numbers("FP64", [[1.0], [True]], [2, 1]),
            "input 'x': element 1 is a bool (true); FP64 elements are numbers",
        ),
        (
            numbers("INT8", [[1, 2], [3, False]], [2, 2]),
            "input 'x': element 3 is a bool (false); INT8 elements are numbers",
        ),
        (numbers("INT16", [None]), "input 'x': element 0 is null; INT16 elements are numbers"),
        (numbers("INT16", [{}]), "input 'x': element 0 is an object; INT16 elements are numbers"),
        (
            numbers("BOOL", [True, 1]),
            "input 'x': element 1 is a number (1); BOOL elements are true or false",
        ),
        (
            numbers("FP16", [1.0, 70000.0]),
            "input 'x': element 1 is 70000.0, beyond FP16's largest value 65504.0",
        ),
        (
            numbers("FP32", [[1.0], [1e39]], [2, 1]),
            "input 'x': element 1 is 1e+39, beyond FP32's largest value",
        ),
        (
            numbers("BYTES", ["a", 1]),
            "input 'x': element 1 is a number (1); BYTES elements are strings",
        ),
        (
            numbers("FP32", [1.0, 2.0, 3.0], [2, 2]),
            "input 'x': data holds 3 values but shape [2, 2] has 4 elements",
        ),
        (
            numbers("INT32", [[1, 2], [3]], [2, 2]),
            "input 'x': data holds 3 values but shape [2, 2] has 4 elements",
        ),
        (
            numbers("INT32", [[1, [2, 3]], [4, 5, 6]], [2, 2]),
            "input 'x': data holds 6 values but shape [2, 2] has 4 elements",
        ),
        (
            numbers("BYTES", [["a"], "b", [[]]], [3, 1]),
            "input 'x': data holds 2 values but shape [3, 1] has 3 elements",
        ),
        (
            numbers("FP64", [[1.0, 2.0]], []),
            "input 'x': data holds 2 values but shape [] has 1 elements",
        ),
    ],
)
def test_json_data_that_does_not_fit_its_datatype_or_shape_is_refused(
    document: Any, message: str
) -> None:
    assert refused(document).startswith(message)


@pytest.mark.parametrize("spelled", [b"true", b"true ", b"true\t", b"true\r\n", b"false\n  "])
def test_a_bool_among_numbers_is_refused_however_the_json_around_it_is_spaced(
    spelled: bytes,
) -> None:
    text = b'{"inputs":[{"name":"x","datatype":"INT16","shape":[2],"data":[3,%s]}]}' % spelled
    with pytest.raises(InvalidInput) as caught:
        decode_infer_request(text, None)
    literal = spelled.strip().decode()
    assert str(caught.value) == (
        f"input 'x': element 1 is a bool ({literal}); INT16 elements are numbers"
    )


def test_numbers_decode_beside_bools_elsewhere_in_the_request() -> None:
    document = {
        "id": "true false",
        "inputs": [
            {"name": "b", "datatype": "BOOL", "shape": [2], "data": [True, False]},
            {"name": "x", "datatype": "FP32", "shape": [2], "data": [1, 0.5]},
            {"name": "i", "datatype": "INT8", "shape": [2], "data": [[1], [0]]},
        ],
        "parameters": {"flag": True, "binary_data_output": False},
    }
    request = decode_infer_request(*body_of(document))
    assert request.inputs["b"].tolist() == [True, False]
    assert request.inputs["x"].tolist() == [1.0, 0.5]
    assert request.inputs["i"].tolist() == [1, 0]


def binary_input(datatype: str, shape: list[int], size: Any) -> Any:
    return {
        "name": "x",
        "datatype": datatype,
        "shape": shape,
        "parameters": {"binary_data_size": size},
    }


@pytest.mark.parametrize(
    ("document", "blobs", "message"),
    [
        (
            {"inputs": [binary_input("FP32", [2], 8)]},
            [],
            "input 'x' has a 'binary_data_size' parameter but the request has no "
            "Inference-Header-Content-Length header to say where the binary data starts",
        ),
        (
            {"inputs": [{**binary_input("FP32", [2], 8), "data": [1.0, 2.0]}]},
            [b"\0" * 8],
            "input 'x' has both 'data' and a 'binary_data_size' parameter; send one",
        ),
        (
            {"inputs": [binary_input("FP32", [2], 16)]},
            [b"\0" * 8],
            "input 'x': 'binary_data_size' is 16 but only 8 bytes of the body are left for it",
        ),
        (
            {"inputs": [binary_input("FP32", [2], -8)]},
            [b"\0" * 8],
            "input 'x': parameter 'binary_data_size' is -8; it is a byte count, an integer of "
            "at least 0",
        ),
        (
            {"inputs": [binary_input("FP32", [2], True)]},
            [b"\0" * 8],
            "input 'x': parameter 'binary_data_size' is True; it is a byte count, an integer "
            "of at least 0",
        ),
        (
            {"inputs": [binary_input("FP32", [3], 8)]},
            [b"\0" * 8],
            "input 'x': shape [3] has 3 elements but 'binary_data_size' is 2 FP32 elements "
            "(8 bytes)",
        ),
        (
            {"inputs": [binary_input("FP32", [2], 7)]},
            [b"\0" * 7],
            "input 'x': shape [2] has 2 elements but 'binary_data_size' is 7 bytes, not a whole "
            "number of 4-byte FP32 elements",
        ),
        (
            {"inputs": [binary_input("FP32", [2], 8)]},
            [b"\0" * 12],
            "the body has 4 bytes after the JSON part and the binary data of the inputs; each "
            "input sent binary declares its size in 'binary_data_size'",
        ),
        (
            {"inputs": [binary_input("BOOL", [3], 3)]},
            [b"\x01\x00\x02"],
            "input 'x': binary BOOL element 2 is byte 2; BOOL elements are 0 or 1",
        ),
        (
            {"inputs": [binary_input("BYTES", [2], 4)]},
            [b"\0" * 4],
            "the binary data of input 'x' holds 4 bytes, too few for the 2 length-prefixed BYTES "
            "elements of shape [2]",
        ),
        (
            {"inputs": [binary_input("BYTES", [2], 9)]},
            [b"\x05\0\0\0abcde"],
            "the binary data of input 'x' runs out at the 4-byte length prefix of BYTES element 1 "
            "(offset 9, 9 bytes in all); shape [2] declares 2 elements",
        ),
        (
            {"inputs": [binary_input("BYTES", [2], 9)]},
            [b"\x09\0\0\0abcde"],
            "the binary data of input 'x': BYTES element 0 declares 9 bytes but only 5 remain",
        ),
        (
            {"inputs": [binary_input("BYTES", [1], 9)]},
            [b"\x01\0\0\0abcde"],
            "the binary data of input 'x' has 4 bytes after the 1 BYTES elements that shape [1] "
            "declares",
        ),
    ],
)
def test_binary_data_that_does_not_fit_is_refused(
    document: Any, blobs: list[bytes], message: str
) -> None:
    body, header_length = body_of(document, *blobs)
    if not blobs:
        header_length = None
    with pytest.raises(InvalidInput) as caught:
        decode_infer_request(body, header_length)
    assert str(caught.value) == message


@pytest.mark.parametrize(
    ("header_length", "message"),
    [
        (-1, "Inference-Header-Content-Length is negative (-1)"),
        (10**6, "Inference-Header-Content-Length is 1000000 but the body has only"),
    ],
)
def test_a_header_length_outside_the_body_is_refused(header_length: int, message: str) -> None:
    body, _ = body_of({"inputs": [fp32_input()]})
    with pytest.raises(InvalidInput) as caught:
        decode_infer_request(body, header_length)
    assert str(caught.value).startswith(message)


# --------------------------------------------------------------------------------------------
# The fast path: large numeric JSON tensors read by simdjson, no Python object per element

LARGE = codec.FAST_JSON_MIN_ELEMENTS
FAST_NUMERIC = [name for name in NUMERIC if name != "BOOL"]


class FastPathSpy:
    """Wraps codec._fast_json_array: records whether each call decided (returned an array)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.decided: list[bool] = []
        original = codec._fast_json_array

        def spy(datatype: str, shape: tuple[int, ...], data: simdjson.Array) -> Any:
            result = original(datatype, shape, data)
            self.decided.append(result is not None)
            return result

        monkeypatch.setattr(codec, "_fast_json_array", spy)


def decode_both(body: bytes) -> tuple[Any, Any]:
    """The request decoded as it is, and with every tensor on the orjson path."""
    fast = decode_infer_request(body, None)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(codec, "FAST_JSON_MIN_ELEMENTS", 2**62)
        slow = decode_infer_request(body, None)
    return fast, slow


def assert_identical(fast: np.ndarray, slow: np.ndarray) -> None:
    assert fast.dtype == slow.dtype
    assert fast.shape == slow.shape
    # Bit for bit: -0.0 and 0.0 differ here.
    assert fast.tobytes() == slow.tobytes()


def random_values(datatype: str, count: int, seed: int) -> np.ndarray:
    """``count`` values of ``datatype`` over the range the fast path decodes, its edge values
    among them: all of an integer datatype's; floats below 2**53 in magnitude (the fast path
    leaves larger FP16/FP32 values to orjson), down to the smallest normal."""
    rng = np.random.default_rng(seed)
    dtype = DATATYPES[datatype]
    edges: list[Any]
    if dtype.kind in "iu":
        info = np.iinfo(dtype.name)
        values = rng.integers(info.min, info.max, count, dtype=dtype, endpoint=True)
        edges = [info.min, info.max, 0]
    else:
        finfo = np.finfo(dtype.name)
        top = float(finfo.max) if datatype == "FP64" else min(float(finfo.max), 2.0**53 - 2**30)
        top = float(np.array(top).astype(dtype))
        # Magnitudes over the datatype's exponent range, and small integers (JSON ints).
        exponents = rng.uniform(np.log10(float(finfo.tiny)), np.log10(top), count)
        with np.errstate(over="ignore"):
            values = (rng.standard_normal(count) * 10.0**exponents).astype(dtype)
        values[::7] = rng.integers(-1000, 1000, len(values[::7]))
        values[~(np.abs(values.astype(np.float64)) <= top)] = 1.5
        edges = [top, -top, float(finfo.tiny), -0.0, 0.0]
    values[rng.choice(count, len(edges), replace=False)] = edges
    return values


@given(
    datatype=st.sampled_from(FAST_NUMERIC),
    rows=st.integers(1, 4),
    nested=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
@settings(max_examples=60, deadline=None)
def test_the_fast_path_decodes_exactly_as_the_orjson_path(
    datatype: str, rows: int, nested: bool, seed: int
) -> None:
    shape = (rows, LARGE // rows + 1)
    values = random_values(datatype, math.prod(shape), seed).reshape(shape)
    body, _ = triton_body([("x", values, False)])
    if nested:
        document = orjson.loads(body)
        document["inputs"][0]["data"] = values.tolist()
        body = orjson.dumps(document)

    with pytest.MonkeyPatch.context() as patch:
        spy = FastPathSpy(patch)
        fast, slow = decode_both(body)

    assert spy.decided == [True]
    assert_identical(fast.inputs["x"], slow.inputs["x"])
    np.testing.assert_array_equal(fast.inputs["x"], values)


@given(cases().filter(lambda case: case[0] in FAST_NUMERIC))
@settings(max_examples=200, deadline=None)
def test_with_the_threshold_at_one_any_array_decodes_as_on_the_orjson_path(
    case: tuple[str, np.ndarray, bool],
) -> None:
    _, array, _ = case
    body, _ = triton_body([("x", array, False)])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(codec, "FAST_JSON_MIN_ELEMENTS", 1)
        fast, slow = decode_both(body)
    assert_identical(fast.inputs["x"], slow.inputs["x"])


@pytest.mark.parametrize("datatype", FAST_NUMERIC)
@pytest.mark.parametrize("nested", [False, True], ids=["flat", "nested"])
def test_large_numeric_tensors_take_the_fast_path(
    datatype: str, nested: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    spy = FastPathSpy(monkeypatch)
    values = sample(datatype, (2, LARGE // 2))
    if DATATYPES[datatype].kind == "f" and datatype != "FP64":
        # The fast path leaves magnitudes of 2**53 and more (FP32's largest) to orjson.
        values[np.abs(values.astype(np.float64)) > 2**52] = 1.25
    document = {
        "inputs": [
            {
                "name": "x",
                "datatype": datatype,
                "shape": list(values.shape),
                "data": values.tolist() if nested else values.ravel().tolist(),
            },
            {"name": "small", "datatype": "INT8", "shape": [2], "data": [1, 2]},
            {"name": "text", "datatype": "BYTES", "shape": [1], "data": ["gr\u00fc\u00dfe"]},
        ],
        "id": "r",
        "parameters": {"p": 1.5},
        "outputs": [{"name": "y", "parameters": {"binary_data": True}}],
    }

    request = decode_infer_request(*body_of(document))

    assert spy.decided == [True]
    assert_identical(request.inputs["x"], values)
    assert request.inputs["small"].tolist() == [1, 2]
    assert request.inputs["text"].tolist() == ["gr\u00fc\u00dfe".encode()]
    assert (request.id, request.parameters, request.outputs) == ("r", {"p": 1.5}, ["y"])
    assert request.binary_outputs.is_binary("y")


def test_small_tensors_and_bool_and_bytes_stay_on_the_orjson_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spy = FastPathSpy(monkeypatch)
    document = {
        "inputs": [
            {"name": "b", "datatype": "BOOL", "shape": [LARGE], "data": [True] * LARGE},
            {"name": "s", "datatype": "BYTES", "shape": [LARGE], "data": ["a"] * LARGE},
            {"name": "f", "datatype": "FP32", "shape": [LARGE - 1], "data": [0.5] * (LARGE - 1)},
        ]
    }
    request = decode_infer_request(*body_of(document))
    assert spy.decided == []
    assert request.inputs["f"].shape == (LARGE - 1,)


BAD = LARGE - 3


def large(datatype: str, bad: Any, position: int = BAD) -> Any:
    data: list[Any] = [1] * LARGE
    data[position] = bad
    return numbers(datatype, data)


@pytest.mark.parametrize(
    ("document", "message"),
    [
        (large("FP32", "2"), f"element {BAD} is a string ('2'); FP32 elements are numbers"),
        (large("FP64", None), f"element {BAD} is null; FP64 elements are numbers"),
        (numbers("FP32", [True] * LARGE), "element 0 is a bool (true); FP32 elements are numbers"),
        (large("FP32", True), f"element {BAD} is a bool (true); FP32 elements are numbers"),
        (large("INT32", False), f"element {BAD} is a bool (false); INT32 elements are numbers"),
        (large("UINT64", True), f"element {BAD} is a bool (true); UINT64 elements are numbers"),
        (large("INT16", {}), f"element {BAD} is an object; INT16 elements are numbers"),
        (large("INT32", 2.5), f"element {BAD} is 2.5, not an integer; INT32 elements are integers"),
        (large("INT64", 1.0), f"element {BAD} is 1.0, not an integer; INT64 elements are integers"),
        (large("UINT8", 256), f"element {BAD} is 256, outside UINT8's range [0, 255]"),
        (large("UINT64", -1), f"element {BAD} is -1, outside UINT64's range"),
        (large("INT64", 2**63), f"element {BAD} is 9223372036854775808, outside INT64's range"),
        (large("INT8", -129), f"element {BAD} is -129, outside INT8's range [-128, 127]"),
        (large("FP16", 70000.0), f"element {BAD} is 70000.0, beyond FP16's largest value 65504.0"),
        (large("FP32", 1e39), f"element {BAD} is 1e+39, beyond FP32's largest value"),
        (
            numbers("FP32", [0.5] * (LARGE - 1), [LARGE]),
            f"data holds {LARGE - 1} values but shape [{LARGE}] has {LARGE} elements",
        ),
        (
            numbers("INT32", [[1] * (LARGE // 2), [1] * (LARGE // 2 - 1)], [2, LARGE // 2]),
            f"data holds {LARGE - 1} values but shape [2, {LARGE // 2}] has {LARGE} elements",
        ),
        (
            numbers("FP64", [[1.0] * LARGE, [1.0]], [2, LARGE]),
            f"data holds {LARGE + 1} values but shape [2, {LARGE}] has {2 * LARGE} elements",
        ),
    ],
)
def test_the_fast_path_refuses_what_the_orjson_path_refuses_with_its_message(
    document: Any, message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    spy = FastPathSpy(monkeypatch)
    got = refused(document)
    assert spy.decided == [False]
    assert got.startswith(f"input 'x': {message}")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(codec, "FAST_JSON_MIN_ELEMENTS", 2**62)
        assert refused(document) == got


def test_what_the_fast_path_cannot_decide_the_orjson_path_takes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spy = FastPathSpy(monkeypatch)
    # An integer beyond 2**53 for FP32 (rounded once by the orjson path, twice through a
    # double).
    document = numbers("FP32", [2**60 + 1] * LARGE)
    fast, slow = decode_both(body_of(document)[0])
    assert spy.decided == [False]
    assert_identical(fast.inputs["x"], slow.inputs["x"])


@pytest.mark.parametrize(
    ("datatype", "data", "shape", "expected"),
    [
        ("INT32", [[1, 2, 3], [4, 5, 6]], [3, 2], [[1, 2], [3, 4], [5, 6]]),
        ("INT32", [[1, [2]], [3, 4]], [2, 2], [[1, 2], [3, 4]]),
        ("INT32", [1, [2]], [2], [1, 2]),
        ("FP64", [[[[0.5]]]], [], 0.5),
        ("BYTES", [["a"], "b"], [2, 1], [[b"a"], [b"b"]]),
    ],
)
def test_small_data_nested_any_way_is_flattened_as_triton_does(
    datatype: str, data: Any, shape: list[int], expected: Any
) -> None:
    # Triton's JSON reader walks any nesting and counts the values: the same below the fast
    # path's threshold as above it.
    request = decode_infer_request(*body_of(numbers(datatype, data, shape)))
    assert request.inputs["x"].tolist() == expected


def test_deep_nesting_is_flattened_without_recursion() -> None:
    data: Any = [1.5]
    for _ in range(900):  # deeper than Python's recursion limit allows a recursive walk
        data = [data]
    request = decode_infer_request(*body_of(numbers("FP32", data, [1])))
    assert request.inputs["x"].tolist() == [1.5]


def test_data_nested_any_way_is_flattened_on_the_fast_path_as_triton_does() -> None:
    # Triton's JSON reader walks any nesting and counts the values; so does the fast path.
    half = LARGE // 2
    data = [[list(range(half - 1)), [half - 1]], list(range(half, LARGE))]
    document = numbers("INT32", data, [2, half])
    request = decode_infer_request(*body_of(document))
    np.testing.assert_array_equal(request.inputs["x"].ravel(), np.arange(LARGE))


def test_repeated_keys_keep_their_last_value_as_orjson_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spy = FastPathSpy(monkeypatch)
    values = ",".join(["0.5"] * LARGE)
    tensor = f'{{"name": "x", "datatype": "BYTES", "datatype": "FP32", "shape": [{LARGE}]'
    body = f'{{"id": "a", "inputs": [{tensor}, "data": [{values}]}}], "id": "b"}}'.encode()
    fast, slow = decode_both(body)
    # simdjson's lookup finds a repeated key's first value: such a document goes to orjson.
    assert spy.decided == []
    assert fast.id == slow.id == "b"
    assert_identical(fast.inputs["x"], slow.inputs["x"])


@pytest.mark.parametrize("of_type", ["d", "i", "u"])
@pytest.mark.parametrize(
    ("element", "error"),
    [
        (b'"1"', TypeError),
        (b"null", TypeError),
        (b"true", TypeError),
        (b"{}", TypeError),
        (b"1.0", TypeError),
        (b"-1", ValueError),
        (b"9223372036854775808", ValueError),
    ],
)
def test_simdjson_as_buffer_refuses_rather_than_converts(
    of_type: Literal["d", "i", "u"], element: bytes, error: type[Exception]
) -> None:
    """What the fast path relies on: as_buffer raises on any element its type cannot hold
    exactly (a number into doubles: any number, integers rounded beyond 2**53)."""
    array = simdjson.Parser().parse(b"[1, [2], " + element + b"]")
    assert isinstance(array, simdjson.Array)
    numeric = element not in (b'"1"', b"null", b"true", b"{}")
    fits = {
        "d": numeric,
        "i": element in (b"-1",),
        "u": element in (b"9223372036854775808",),
    }[of_type]
    if fits:
        buffer = array.as_buffer(of_type=of_type)
        assert len(np.frombuffer(buffer, dtype=np.uint64)) == 3
    else:
        with pytest.raises(error if of_type != "d" or not numeric else TypeError):
            array.as_buffer(of_type=of_type)


def test_a_request_of_a_layout_seen_before_is_its_own_and_leaves_the_next_whole() -> None:
    # The fields of a JSON part checked once are remembered for the same JSON part and body
    # size: each request gets its own maps (a caller takes the timeout out of its parameters)
    # and arrays of its own body.
    document = {
        "id": "same",
        "inputs": [
            {
                "name": "x",
                "datatype": "INT32",
                "shape": [2],
                "parameters": {"binary_data_size": 8, "p": 1},
            }
        ],
        "parameters": {"timeout": 5, "binary_data_output": True},
        "outputs": [{"name": "y", "parameters": {"binary_data": False, "q": "r"}}],
    }
    for first in (1, 3, 5):
        values = np.array([first, first + 1], dtype="<i4")
        body, header_length = body_of(document, values.tobytes())
        parsed = parse_infer_request(bytearray(body), header_length)
        assert parsed.id == "same"
        assert parsed.parameters == {"timeout": 5}
        assert parsed.input_parameters == {"x": {"p": 1}}
        assert parsed.outputs == ["y"]
        assert parsed.output_parameters == {"y": {"q": "r"}}
        assert parsed.binary_outputs.is_binary("x")
        assert not parsed.binary_outputs.is_binary("y")
        np.testing.assert_array_equal(codec.input_arrays(parsed)["x"], values)
        parsed.parameters.pop("timeout")
        parsed.input_parameters["x"].clear()
        parsed.output_parameters["y"]["q"] = "changed"
        parsed.outputs.append("z")


@st.composite
def binary_layouts(draw: st.DrawFn) -> np.ndarray:
    """A numeric array of any datatype and byte order, C-ordered, Fortran-ordered, strided,
    0-d or empty."""
    datatype = draw(st.sampled_from(NUMERIC))
    dtype = DATATYPES[datatype].newbyteorder(draw(st.sampled_from("<>=")))
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5))
    array = draw(hnp.arrays(dtype, shape))
    layout = draw(st.sampled_from(["c", "f", "strided", "transposed"]))
    if layout == "f":
        return np.asfortranarray(array)
    if layout == "strided" and array.ndim:
        return array[::2]
    if layout == "transposed":
        return array.T
    return array


@given(binary_layouts())
@settings(max_examples=500, deadline=None)
def test_a_binary_output_is_its_row_major_little_endian_bytes_in_any_layout(
    array: np.ndarray,
) -> None:
    # What the wire carries, made the general way: a C-contiguous little-endian copy as bytes.
    datatype = codec.datatype_of(array)
    dtype = DATATYPES[datatype].newbyteorder("<")
    expected = np.ascontiguousarray(array, dtype=dtype).reshape(-1).view(np.uint8).data
    blob = codec._binary_blob("output 'y'", datatype, array)
    assert isinstance(blob, memoryview)
    assert (blob.format, blob.ndim, blob.nbytes) == ("B", 1, expected.nbytes)
    assert blob.tobytes() == expected.tobytes()
    if array.dtype == dtype and array.flags.c_contiguous and array.size:
        # Sent from the array's own memory, not a copy of it.
        assert np.shares_memory(np.frombuffer(blob, np.uint8), array)


@pytest.mark.parametrize("datatype", NUMERIC)
@pytest.mark.parametrize("shape", [(), (0,), (3, 0), (1, 5), (2, 3, 2)])
@pytest.mark.parametrize("pad", range(8))
def test_a_binary_input_is_the_array_of_its_bytes_in_its_shape(
    datatype: str, shape: tuple[int, ...], pad: int
) -> None:
    # What frombuffer then reshape made of the bytes, at every alignment of their place.
    values = sample(datatype, shape)
    raw = values.astype(DATATYPES[datatype].newbyteorder("<")).tobytes()
    document = {
        "id": "p" * pad,
        "inputs": [
            {
                "name": "x",
                "datatype": datatype,
                "shape": list(shape),
                "parameters": {"binary_data_size": len(raw)},
            }
        ],
    }
    body, header_length = body_of(document, raw)
    for parsed_body in (bytearray(body), bytes(body)):  # writable, and read-only
        decoded = decode_infer_request(parsed_body, header_length).inputs["x"]
        assert header_length is not None
        expected = np.frombuffer(
            memoryview(parsed_body)[header_length:], DATATYPES[datatype].newbyteorder("<")
        ).reshape(shape)
        assert decoded.dtype == expected.dtype
        assert decoded.shape == expected.shape
        assert decoded.tobytes() == expected.tobytes()
        assert decoded.flags.c_contiguous
        assert decoded.flags.aligned
        if decoded.flags.owndata:  # copied, where its place was not aligned
            assert decoded.flags.writeable
        else:
            assert decoded.flags.writeable == expected.flags.writeable
