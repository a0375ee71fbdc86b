"""Behaving like Triton where clients depend on it: raw outputs whatever the request used,
Triton's error texts and codes, and the batch and output checks Triton makes.

Against a real server (grpcio stubs, ``tritonclient.grpc``), plus the pure functions behind the
checks.
"""

from __future__ import annotations

import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import trio
import tritonclient.grpc as triton
from tritonclient.utils import InferenceServerException

from tests.support import GrpcioClient, start_server, write_repository
from trio_infer.core.validation import validate_batch, validate_inputs, validate_outputs
from trio_infer.errors import InvalidInput, ModelFailed
from trio_infer.protobuf import wire
from trio_infer.protobuf._proto import grpc_predict_v2_pb2 as pb
from trio_infer.protobuf.codec import decode_inputs, decode_outputs, encode_inputs, prepare_inputs
from trio_infer.repository.settings import TensorSpec
from trio_infer.server import RunningServer

MODELS = textwrap.dedent(
    '''
    import numpy as np

    from trio_infer.model import Model


    class Shapeshifter(Model):
        """Its declared outputs (y: x doubled, n: the rows), or broken as parameter mode says."""

        def predict(self, inputs, parameters):
            x = inputs["x"]
            rows = len(x)
            outputs = {"y": x * 2, "n": np.full(rows, rows, np.int64)}
            mode = parameters.get("mode", "ok")
            if mode == "extra":
                outputs["z"] = x
            elif mode == "missing":
                del outputs["n"]
            elif mode == "datatype":
                outputs["n"] = outputs["n"].astype(np.int32)
            elif mode == "width":
                outputs["y"] = np.zeros((rows, 5), np.float32)
            elif mode == "rows":
                outputs["n"] = np.zeros(rows + 1, np.int64)
            return outputs


    class Counter(Model):
        def predict(self, inputs, parameters):
            for step in range(3):
                yield {"index": np.array([step], np.int32)}
    '''
)

ADD_SUB = {
    "implementation": "trio_infer.examples.models.AddSub",
    "inputs": [
        {"name": "INPUT0", "datatype": "FP32", "shape": [-1, 16]},
        {"name": "INPUT1", "datatype": "FP32", "shape": [-1, 16]},
    ],
    "outputs": [
        {"name": "OUTPUT0", "datatype": "FP32", "shape": [-1, 16]},
        {"name": "OUTPUT1", "datatype": "FP32", "shape": [-1, 16]},
    ],
    "max_batch_size": 64,
}
SETTINGS: dict[str, dict[str, Any]] = {
    "add_sub": ADD_SUB,
    "shapeshifter": {
        "implementation": "triton_models.Shapeshifter",
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}],
        "outputs": [
            {"name": "y", "datatype": "FP32", "shape": [-1, 4]},
            {"name": "n", "datatype": "INT64", "shape": [-1]},
        ],
        # A batch dimension, but no batching: a request's outputs come back as the model made
        # them, not cut by the batcher.
        "max_batch_size": 1,
    },
    "counter": {
        "implementation": "triton_models.Counter",
        "outputs": [{"name": "index", "datatype": "INT32", "shape": [1]}],
        "decoupled": True,
    },
    "versioned": {
        "implementation": "trio_infer.examples.models.Echo",
        "parameters": {"version": "1"},
        "versions": ["1", "v2-beta"],
    },
}


@pytest.fixture
async def server(nursery: trio.Nursery, tmp_path: Path) -> RunningServer:
    root = write_repository(tmp_path / "repository", SETTINGS, "triton_models", MODELS)
    return await start_server(nursery, root, workers=1)


@pytest.fixture
def client(server: RunningServer) -> Iterator[GrpcioClient]:
    grpcio = GrpcioClient(server.port)
    yield grpcio
    grpcio.channel.close()


A = np.arange(32, dtype=np.float32).reshape(2, 16)
B = np.full((2, 16), 0.5, np.float32)


def _add_sub(*, raw: bool, **fields: Any) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="add_sub", **fields)
    encode_inputs(request, [("INPUT0", A), ("INPUT1", B)], raw=raw)
    return request


def _shapeshifter(mode: str, rows: int = 2) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="shapeshifter")
    encode_inputs(request, [("x", np.ones((rows, 4), np.float32))], raw=True)
    request.parameters["mode"].string_param = mode
    return request


# -- outputs are raw, as Triton's -------------------------------------------------------------


async def test_a_typed_request_is_answered_raw_as_tritons_examples_read_it(
    client: GrpcioClient,
) -> None:
    # Triton's grpc_explicit_*_content_client.py examples: typed contents in, raw out.
    response = await client.call("ModelInfer", _add_sub(raw=False))
    assert [output.name for output in response.outputs] == ["OUTPUT0", "OUTPUT1"]
    assert not any(output.HasField("contents") for output in response.outputs)
    sums = np.frombuffer(response.raw_output_contents[0], np.float32).reshape(2, 16)
    differences = np.frombuffer(response.raw_output_contents[1], np.float32).reshape(2, 16)
    np.testing.assert_array_equal(sums, A + B)
    np.testing.assert_array_equal(differences, A - B)


async def test_binary_data_output_false_asks_for_typed_outputs(client: GrpcioClient) -> None:
    for raw in (True, False):
        request = _add_sub(raw=raw)
        request.parameters["binary_data_output"].bool_param = False
        response = await client.call("ModelInfer", request)
        assert not response.raw_output_contents
        assert list(response.outputs[1].contents.fp32_contents) == (A - B).ravel().tolist()
    request = _add_sub(raw=False)
    request.parameters["binary_data_output"].string_param = "false"
    error = await client.error("ModelInfer", request)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == "parameter 'binary_data_output' must be a bool"


async def test_stream_answers_are_raw_for_typed_requests_and_decoupled_models(
    client: GrpcioClient,
) -> None:
    counted = pb.ModelInferRequest(model_name="counter", id="c")
    requests = [_add_sub(raw=False, id="a"), counted]
    answers = await trio.to_thread.run_sync(
        lambda: list(client.stub.ModelStreamInfer(iter(requests), timeout=10))
    )
    assert all(not answer.error_message for answer in answers)
    by_id: dict[str, list[pb.ModelInferResponse]] = {}
    for answer in answers:
        by_id.setdefault(answer.infer_response.id, []).append(answer.infer_response)
    (add_sub,) = by_id["a"]
    assert len(add_sub.raw_output_contents) == 2
    np.testing.assert_array_equal(
        np.frombuffer(add_sub.raw_output_contents[0], np.float32).reshape(2, 16), A + B
    )
    assert [list(np.frombuffer(r.raw_output_contents[0], np.int32)) for r in by_id["c"]] == [
        [0],
        [1],
        [2],
    ]


# -- errors in Triton's words and codes --------------------------------------------------------


async def test_an_unknown_model_or_version_is_named_in_tritons_words(client: GrpcioClient) -> None:
    error = await client.error("ModelInfer", pb.ModelInferRequest(model_name="nope"))
    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert error.details() == "Request for unknown model: 'nope' is not found"
    error = await client.error(
        "ModelMetadata", pb.ModelMetadataRequest(name="versioned", version="7")
    )
    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert error.details() == (
        "Request for unknown model: 'versioned' version 7 is not found (served version: 1)"
    )


async def test_a_version_that_is_not_an_integer_is_invalid_unless_the_model_declares_it(
    client: GrpcioClient,
) -> None:
    for version in ("1", "v2-beta"):  # declared: a free-form string as MLServer writes them
        ready = await client.call(
            "ModelReady", pb.ModelReadyRequest(name="versioned", version=version)
        )
        assert ready.ready
    for model, version in [
        ("versioned", "abc"),
        ("versioned", "-1"),
        ("versioned", " 1"),
        ("versioned", str(2**63)),
        ("nope", "x"),
    ]:
        error = await client.error("ModelReady", pb.ModelReadyRequest(name=model, version=version))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, version
        assert error.details() == (
            f"failed to get model version from specified version string '{version}': a "
            "version is an integer from 0 to 2**63 - 1"
        )
    error = await client.error("ModelReady", pb.ModelReadyRequest(name="nope", version="3"))
    assert error.code() == grpc.StatusCode.NOT_FOUND
    # Thousands of digits (more than int() converts): invalid, not an internal error; leading
    # zeros do not count against an int64's 19 digits.
    for version in ("9" * 5000, "0" * 5000 + "1" * 20):
        error = await client.error(
            "ModelReady", pb.ModelReadyRequest(name="versioned", version=version)
        )
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    error = await client.error(
        "ModelReady", pb.ModelReadyRequest(name="versioned", version="0" * 5000 + "7")
    )
    assert error.code() == grpc.StatusCode.NOT_FOUND


async def test_tritonclient_sees_the_messages_tritons_examples_check(server: RunningServer) -> None:
    def call() -> list[str]:
        triton_client = triton.InferenceServerClient(f"127.0.0.1:{server.port}")
        messages = []
        try:
            for attempt in (
                lambda: triton_client.get_model_metadata("wrong_model_name"),
                lambda: triton_client.infer("wrong_model_name", []),
            ):
                with pytest.raises(InferenceServerException) as caught:
                    attempt()
                messages.append(caught.value.message())
        finally:
            triton_client.close()
        return messages

    messages = await trio.to_thread.run_sync(call)
    assert all(message.startswith("Request for unknown model") for message in messages)


async def test_an_input_with_typed_contents_beside_raw_ones_is_named_first(
    client: GrpcioClient,
) -> None:
    # Triton's grpc_explicit_int_content_client.py: two typed inputs, then one raw buffer and
    # INPUT0's contents set. The raw entries are then fewer than the inputs, but the mix is
    # what the message names.
    request = _add_sub(raw=False)
    request.raw_input_contents.append(A.tobytes())
    error = await client.error("ModelInfer", request)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == (
        "contents field must not be specified when using raw_input_contents for 'INPUT0' for "
        "model 'add_sub': send every input raw or every input typed, not both"
    )
    # An empty contents beside raw data is no mix: MLServer's client sends one.
    request = _add_sub(raw=True)
    for tensor in request.inputs:
        tensor.contents.SetInParent()
    response = await client.call("ModelInfer", request)
    assert len(response.raw_output_contents) == 2


def test_the_mix_is_refused_before_the_contents_are_split_or_counted() -> None:
    request = pb.ModelInferRequest(model_name="m")
    encode_inputs(request, [("a", np.ones(2, np.int64)), ("b", np.ones(2, np.int64))], raw=True)
    # b's contents would be refused on their own (three elements for a shape of two), and
    # there are three raw entries for two inputs.
    request.inputs[1].contents.int64_contents.extend([1, 2, 3])
    request.raw_input_contents.append(b"")
    message = (
        "contents field must not be specified when using raw_input_contents for 'b' for model "
        "'m': send every input raw or every input typed, not both"
    )
    with pytest.raises(InvalidInput) as caught:
        prepare_inputs(wire.WireInferRequest.FromString(request.SerializeToString()))
    assert caught.value.message == message
    with pytest.raises(InvalidInput) as caught:
        decode_inputs(request)
    assert caught.value.message == message


def test_a_client_reading_a_response_with_the_mix_names_the_output() -> None:
    response = pb.ModelInferResponse(model_name="m")
    response.outputs.add(name="y", datatype="FP32", shape=[1]).contents.fp32_contents.append(1)
    response.raw_output_contents.append(bytes(4))
    with pytest.raises(Exception, match="when using raw_output_contents for 'y' for model 'm'"):
        decode_outputs(response)


# -- the checks Triton makes -------------------------------------------------------------------


async def test_the_inputs_of_a_batching_model_must_agree_on_the_batch(
    client: GrpcioClient,
) -> None:
    request = pb.ModelInferRequest(model_name="add_sub")
    three = np.zeros((3, 16), np.float32)
    encode_inputs(request, [("INPUT0", A), ("INPUT1", three)], raw=True)
    error = await client.error("ModelInfer", request)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == (
        "input 'INPUT1' batch size does not match other inputs for 'add_sub': 'INPUT1' has 3 "
        "(shape [3, 16]), 'INPUT0' has 2 (shape [2, 16])"
    )


@pytest.mark.parametrize(
    ("mode", "message"),
    [
        (
            "extra",
            "model 'shapeshifter' returned output 'z', which it does not declare; its declared "
            "outputs are 'y', 'n'",
        ),
        ("missing", "model 'shapeshifter' did not return its declared output(s) 'n'"),
        ("datatype", "model 'shapeshifter' output 'n' is INT32, but the model declares INT64"),
        (
            "width",
            "model 'shapeshifter' output 'y' has shape [2, 5], but the model declares [-1, 4] "
            "(its first dimension is the request's batch size, 2)",
        ),
        (
            "rows",
            "model 'shapeshifter' output 'n' has shape [3], but the model declares [-1] (its "
            "first dimension is the request's batch size, 2)",
        ),
    ],
)
async def test_outputs_that_are_not_the_declared_ones_are_internal(
    client: GrpcioClient, mode: str, message: str
) -> None:
    error = await client.error("ModelInfer", _shapeshifter(mode))
    assert error.code() == grpc.StatusCode.INTERNAL
    assert error.details() == message


async def test_outputs_that_are_the_declared_ones_pass(client: GrpcioClient) -> None:
    outputs = decode_outputs(await client.call("ModelInfer", _shapeshifter("ok", rows=3)))
    assert outputs["n"].tolist() == [3, 3, 3]
    assert outputs["y"].shape == (3, 4)


def test_undeclared_outputs_take_anything_and_minus_one_any_size() -> None:
    anything = {"whatever": np.zeros((2, 3), np.complex64)}
    validate_outputs(anything, {}, "m", batch=5)
    declared = {"y": TensorSpec("y", "FP32", (-1, 4, -1))}
    validate_outputs({"y": np.zeros((7, 4, 9), np.float32)}, declared, "m")
    validate_outputs({"y": np.zeros((2, 4, 0), np.float32)}, declared, "m", batch=2)
    with pytest.raises(
        ModelFailed, match=r"has shape \[7, 4\], but the model declares \[-1, 4, -1\]"
    ):
        validate_outputs({"y": np.zeros((7, 4), np.float32)}, declared, "m")
    with pytest.raises(ModelFailed, match="output 'y': numpy dtype complex64 has no"):
        validate_outputs({"y": np.zeros((7, 4, 1), np.complex64)}, declared, "m")


def test_the_batch_is_the_first_dimension_every_input_shares() -> None:
    assert validate_batch({}, "m") is None
    assert validate_batch({"a": np.zeros((4, 2)), "b": np.zeros(4)}, "m") == 4
    with pytest.raises(InvalidInput) as caught:
        validate_batch({"a": np.zeros(3), "s": np.zeros(())}, "m")
    assert caught.value.message.startswith(
        "input 's' has no shape but model requires batch dimension for 'm'"
    )


def test_the_batch_is_read_with_the_inputs_checks_and_its_errors_come_after_theirs() -> None:
    specs = {name: TensorSpec(name, "FP32", (-1, 2)) for name in ("a", "b", "c")}
    three, four = np.zeros((3, 2), np.float32), np.zeros((4, 2), np.float32)
    differs = (
        "input 'b' batch size does not match other inputs for 'm': 'b' has 4 (shape [4, 2]), "
        "'a' has 3 (shape [3, 2])"
    )
    cases = [
        ({"a": three, "b": four}, "model 'm': request is missing input(s) 'c'"),
        (
            {"a": three, "b": four, "c": np.zeros((3, 2), np.int32)},
            "model 'm' input 'c': expected datatype FP32, got INT32",
        ),
        ({"a": three, "b": four, "c": three}, differs),
        ({"a": three, "b": four, "c": four}, differs),
    ]
    for inputs, message in cases:
        with pytest.raises(InvalidInput) as caught:
            validate_inputs(inputs, specs, "m", batched=True)
        assert caught.value.message == message
    agreeing = {"a": four, "b": four, "c": four}
    assert validate_inputs(agreeing, specs, "m", batched=True) == 4
    assert validate_inputs(agreeing, specs, "m") is None
    # Without declared inputs, the batch is validate_batch's.
    assert validate_inputs({"x": np.zeros(5)}, {}, "m", batched=True) == 5
    with pytest.raises(InvalidInput, match="input 'y' batch size does not match"):
        validate_inputs({"x": np.zeros(5), "y": np.zeros(2)}, {}, "m", batched=True)
