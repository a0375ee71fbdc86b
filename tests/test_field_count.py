"""Counting a request's fields from its wire format, before protobuf parses it."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from trio_infer.protobuf._proto import grpc_predict_v2_pb2 as pb
from trio_infer.protobuf.codec import encode_inputs
from trio_infer.protobuf.field_count import MODEL_INFER_REQUEST, count_fields

names = st.text(max_size=3)


@st.composite
def requests(draw: st.DrawFn) -> tuple[pb.ModelInferRequest, int]:
    """A ModelInferRequest, and its fields outside tensor contents counted from the message."""
    request = pb.ModelInferRequest(model_name=draw(names), id=draw(names))
    count = bool(request.model_name) + bool(request.id)
    for key in draw(st.lists(names, unique=True, max_size=5)):
        request.parameters[key].int64_param = 1
        count += 1
    for index in range(draw(st.integers(0, 4))):
        tensor = request.inputs.add(name=draw(names), datatype="INT32")
        count += 1 + bool(tensor.name) + 1
        shape = draw(st.lists(st.integers(0, 3), max_size=3))
        tensor.shape.extend(shape)
        count += bool(shape)  # packed: one field
        for key in draw(st.lists(names, unique=True, max_size=3)):
            tensor.parameters[key].bool_param = True
            count += 1
        if draw(st.booleans()):
            tensor.contents.SetInParent()
            tensor.contents.int_contents.extend(range(index * 100))  # not descended into
            count += 1
    for _ in range(draw(st.integers(0, 3))):
        output = request.outputs.add(name=draw(names))
        count += 1 + bool(output.name)
        for key in draw(st.lists(names, unique=True, max_size=3)):
            output.parameters[key].string_param = "v"
            count += 1
    return request, count


@settings(max_examples=200, deadline=None, derandomize=True)
@given(requests())
def test_the_count_is_the_fields_outside_tensor_contents(
    case: tuple[pb.ModelInferRequest, int],
) -> None:
    request, expected = case
    data = request.SerializeToString()
    assert count_fields(data, MODEL_INFER_REQUEST, 10_000) == expected


def test_raw_tensors_and_large_contents_are_stepped_over_whole() -> None:
    request = pb.ModelInferRequest(model_name="m")
    encode_inputs(request, [("x", np.zeros(1_000_000, np.float32))], raw=True)
    data = request.SerializeToString()
    # model_name, the input and its name, datatype and shape, one raw buffer.
    assert count_fields(data, MODEL_INFER_REQUEST, 100) == 6


def test_the_count_stops_past_the_limit() -> None:
    flood = b"\x32\x00" * 4_000_000  # four million empty requested outputs
    assert count_fields(flood, MODEL_INFER_REQUEST, 1000) == 1001


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.binary(max_size=200))
def test_bytes_that_are_not_wire_format_end_the_count_quietly(data: bytes) -> None:
    assert 0 <= count_fields(data, MODEL_INFER_REQUEST, 1000) <= 1001
