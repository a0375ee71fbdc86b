"""The Open Inference Protocol over gRPC, end to end: grpcio stubs generated from protos/, a real
server on a loopback port, real worker processes."""

from __future__ import annotations

import concurrent.futures
import json
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import trio

from tests.support import GrpcioClient, MiB, start_server
from trio_infer.datatypes import DATATYPES
from trio_infer.protobuf._proto import grpc_predict_v2_pb2 as pb
from trio_infer.protobuf._proto import health_pb2
from trio_infer.protobuf.codec import decode_parameters, encode_inputs, encode_parameters
from trio_infer.server import RunningServer

W = np.random.default_rng(0).standard_normal((256, 256)).astype(np.float32)


def infer_request(
    model: str, inputs: dict[str, np.ndarray], *, raw: bool = True, **fields: Any
) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=model, **fields)
    encode_inputs(request, list(inputs.items()), raw=raw)
    return request


def outputs_of(response: pb.ModelInferResponse) -> dict[str, np.ndarray]:
    from trio_infer.protobuf.codec import decode_outputs

    return decode_outputs(response)


async def test_server_live_ready_and_metadata(grpcio_client: GrpcioClient) -> None:
    assert (await grpcio_client.call("ServerLive", pb.ServerLiveRequest())).live
    assert (await grpcio_client.call("ServerReady", pb.ServerReadyRequest())).ready
    metadata = await grpcio_client.call("ServerMetadata", pb.ServerMetadataRequest())
    assert metadata.name == "trio-infer"
    assert metadata.version


async def test_model_ready_and_metadata(grpcio_client: GrpcioClient) -> None:
    for name in ("add_sub", "dense", "echo", "sleep"):
        response = await grpcio_client.call("ModelReady", pb.ModelReadyRequest(name=name))
        assert response.ready, name
    metadata = await grpcio_client.call("ModelMetadata", pb.ModelMetadataRequest(name="add_sub"))
    assert metadata.name == "add_sub"
    assert [(t.name, t.datatype, list(t.shape)) for t in metadata.inputs] == [
        ("INPUT0", "FP32", [-1, 16]),
        ("INPUT1", "FP32", [-1, 16]),
    ]
    assert [(t.name, t.datatype, list(t.shape)) for t in metadata.outputs] == [
        ("OUTPUT0", "FP32", [-1, 16]),
        ("OUTPUT1", "FP32", [-1, 16]),
    ]


async def test_health_check_reports_the_server_and_each_model(
    grpcio_client: GrpcioClient,
) -> None:
    serving = health_pb2.HealthCheckResponse.SERVING
    for service in ("", "inference.GRPCInferenceService", "dense"):
        request = health_pb2.HealthCheckRequest(service=service)
        response = await trio.to_thread.run_sync(grpcio_client.health.Check, request)
        assert response.status == serving
    with pytest.raises(grpc.RpcError) as caught:
        await trio.to_thread.run_sync(
            grpcio_client.health.Check, health_pb2.HealthCheckRequest(service="nope")
        )
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize("raw", [True, False], ids=["raw", "typed"])
async def test_add_sub_computes_sum_and_difference(grpcio_client: GrpcioClient, raw: bool) -> None:
    a = np.arange(48, dtype=np.float32).reshape(3, 16)
    b = np.linspace(-1, 1, 48, dtype=np.float32).reshape(3, 16)
    response = await grpcio_client.call(
        "ModelInfer", infer_request("add_sub", {"INPUT0": a, "INPUT1": b}, raw=raw, id="req-7")
    )
    assert response.model_name == "add_sub"
    assert response.id == "req-7"
    # Raw whatever the request used, as Triton answers.
    assert len(response.raw_output_contents) == 2
    outputs = outputs_of(response)
    np.testing.assert_array_equal(outputs["OUTPUT0"], a + b)
    np.testing.assert_array_equal(outputs["OUTPUT1"], a - b)


async def test_dense_is_tanh_of_x_times_w(grpcio_client: GrpcioClient) -> None:
    x = np.random.default_rng(1).standard_normal((4, 256)).astype(np.float32)
    response = await grpcio_client.call("ModelInfer", infer_request("dense", {"x": x}))
    np.testing.assert_allclose(outputs_of(response)["y"], np.tanh(x @ W), rtol=1e-5, atol=1e-6)


def every_datatype() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(2)
    arrays: dict[str, np.ndarray] = {}
    for datatype, dtype in DATATYPES.items():
        if datatype == "BYTES":
            arrays[datatype] = np.array(
                [[b"", b"\x00\xff"], [b"hello", "h\u00e9".encode()]], dtype=object
            )
        elif datatype == "BOOL":
            arrays[datatype] = np.array([[True, False], [False, True]])
        elif dtype.kind == "f":
            arrays[datatype] = rng.standard_normal((2, 2)).astype(dtype)
        else:
            info = np.iinfo(dtype)
            arrays[datatype] = np.array([[info.min, info.max], [0, 1]], dtype=dtype)
    return arrays


@pytest.mark.parametrize("raw", [True, False], ids=["raw", "typed"])
async def test_echo_round_trips_every_datatype(grpcio_client: GrpcioClient, raw: bool) -> None:
    arrays = every_datatype()
    if not raw:
        del arrays["FP16"]  # FP16 exists only in raw form
    response = await grpcio_client.call("ModelInfer", infer_request("echo", arrays, raw=raw))
    outputs = outputs_of(response)
    assert list(outputs) == list(arrays)
    for name, array in arrays.items():
        assert outputs[name].dtype == array.dtype, name
        assert outputs[name].shape == array.shape, name
        np.testing.assert_array_equal(outputs[name], array)


async def test_requested_outputs_are_the_only_ones_and_in_request_order(
    grpcio_client: GrpcioClient,
) -> None:
    a = np.ones((1, 16), np.float32)
    request = infer_request("add_sub", {"INPUT0": a, "INPUT1": a})
    request.outputs.add(name="OUTPUT1")
    request.outputs.add(name="OUTPUT0")
    response = await grpcio_client.call("ModelInfer", request)
    assert [output.name for output in response.outputs] == ["OUTPUT1", "OUTPUT0"]
    outputs = outputs_of(response)
    np.testing.assert_array_equal(outputs["OUTPUT1"], np.zeros((1, 16), np.float32))
    np.testing.assert_array_equal(outputs["OUTPUT0"], np.full((1, 16), 2, np.float32))


@pytest.mark.parametrize("size", [16 * MiB, 40 * MiB], ids=["16MiB", "40MiB"])
async def test_large_tensors_cross_both_ways(grpcio_client: GrpcioClient, size: int) -> None:
    data = np.frombuffer(np.random.default_rng(3).bytes(size), dtype=np.uint8)
    response = await grpcio_client.call("ModelInfer", infer_request("echo", {"blob": data}))
    np.testing.assert_array_equal(outputs_of(response)["blob"], data)


async def test_25_concurrent_256k_requests_all_succeed(grpcio_client: GrpcioClient) -> None:
    rows = (256 * 1024) // (16 * 4)
    a = np.random.default_rng(4).standard_normal((rows, 16)).astype(np.float32)
    request = infer_request("add_sub", {"INPUT0": a, "INPUT1": a})

    def load() -> list[pb.ModelInferResponse]:
        with concurrent.futures.ThreadPoolExecutor(25) as pool:
            return list(pool.map(lambda _: grpcio_client.stub.ModelInfer(request), range(100)))

    for response in await trio.to_thread.run_sync(load):
        np.testing.assert_array_equal(outputs_of(response)["OUTPUT0"], a + a)


# -- every row of the status table ------------------------------------------------------------


async def test_unknown_model_or_version_is_not_found(grpcio_client: GrpcioClient) -> None:
    a = np.ones((1, 16), np.float32)
    error = await grpcio_client.error("ModelInfer", infer_request("nope", {"INPUT0": a}))
    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert error.details() == "Request for unknown model: 'nope' is not found"
    error = await grpcio_client.error(
        "ModelMetadata", pb.ModelMetadataRequest(name="add_sub", version="9")
    )
    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert error.details().startswith("Request for unknown model: 'add_sub' version 9 is not found")


@pytest.mark.parametrize(
    ("inputs", "fragment"),
    [
        ({"INPUT0": np.ones((1, 16), np.float32)}, "INPUT1"),
        (
            {"INPUT0": np.ones((1, 8), np.float32), "INPUT1": np.ones((1, 8), np.float32)},
            "INPUT0",
        ),
        ({"INPUT0": np.ones((1, 16)), "INPUT1": np.ones((1, 16))}, "FP32"),
    ],
    ids=["missing-input", "wrong-shape", "wrong-datatype"],
)
async def test_malformed_input_is_invalid_argument_naming_the_tensor(
    grpcio_client: GrpcioClient, inputs: dict[str, np.ndarray], fragment: str
) -> None:
    error = await grpcio_client.error("ModelInfer", infer_request("add_sub", inputs))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert fragment in error.details()
    assert "add_sub" in error.details()


async def test_raw_contents_that_do_not_match_the_shape_are_invalid(
    grpcio_client: GrpcioClient,
) -> None:
    request = infer_request("echo", {"x": np.ones((2, 2), np.float32)})
    request.raw_input_contents[0] = b"\x00" * 12
    error = await grpcio_client.error("ModelInfer", request)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "'x'" in error.details()


async def test_garbage_bytes_for_a_request_are_invalid_argument(
    grpcio_client: GrpcioClient,
) -> None:
    method = grpcio_client.channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
    with pytest.raises(grpc.RpcError) as caught:
        await trio.to_thread.run_sync(method, b"\xff\xff\xff")
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "inference.ModelInferRequest" in caught.value.details()


async def test_unknown_method_is_unimplemented(grpcio_client: GrpcioClient) -> None:
    method = grpcio_client.channel.unary_unary("/inference.GRPCInferenceService/Teleport")
    with pytest.raises(grpc.RpcError) as caught:
        await trio.to_thread.run_sync(method, b"")
    assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED


async def test_a_message_over_the_limit_is_resource_exhausted_and_the_server_lives_on(
    nursery: trio.Nursery,
) -> None:
    server = await start_server(nursery, max_message_size=1 * MiB)
    client = GrpcioClient(server.port)
    big = np.zeros(2 * MiB, np.uint8)
    error = await client.error("ModelInfer", infer_request("echo", {"x": big}))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    small = np.arange(4, dtype=np.uint8)
    response = await client.call("ModelInfer", infer_request("echo", {"x": small}))
    np.testing.assert_array_equal(outputs_of(response)["x"], small)
    client.channel.close()


# -- models written for these tests -----------------------------------------------------------

TEST_MODELS = '''
import os
import numpy as np
from trio_infer import InferError, Model, StatusCode


class Inspect(Model):
    """Returns what reached the model: parameters and headers, as JSON."""

    def predict(self, inputs, parameters):
        import json
        seen = {
            "parameters": dict(parameters),
            "tensor_parameters": {k: dict(v) for k, v in parameters.inputs.items()},
            "headers": {k: v for k, v in parameters.headers.items() if k.startswith("x-")},
        }
        return {"seen": np.array([json.dumps(seen, sort_keys=True).encode()], dtype=object)}


class Fail(Model):
    def predict(self, inputs, parameters):
        if parameters.get("status"):
            raise InferError("quota used up", StatusCode.RESOURCE_EXHAUSTED)
        raise ValueError("the model is broken")
'''


def write_repository(root: Path) -> Path:
    for name, cls in (("inspect", "Inspect"), ("fail", "Fail")):
        folder = root / name
        folder.mkdir()
        settings = {"name": name, "implementation": f"test_models.{cls}"}
        (folder / "model-settings.json").write_text(json.dumps(settings))
        (folder / "test_models.py").write_text(TEST_MODELS)
    return root


@pytest.fixture
async def custom_server(nursery: trio.Nursery, tmp_path: Path) -> RunningServer:
    return await start_server(nursery, write_repository(tmp_path))


async def test_parameters_and_headers_reach_the_model(custom_server: RunningServer) -> None:
    client = GrpcioClient(custom_server.port)
    request = infer_request("inspect", {"x": np.zeros(1, np.int32)})
    parameters = {"flag": True, "n": 7, "name": "z", "ratio": 0.5}
    # The server's own parameter: it orders the request, and the model does not see it.
    encode_parameters(request.parameters, parameters | {"priority": 1})
    encode_parameters(request.inputs[0].parameters, {"scale": 2})
    response = await client.call("ModelInfer", request, metadata=(("x-user", "alice"),))
    seen = json.loads(outputs_of(response)["seen"][0])
    assert seen == {
        "parameters": parameters,
        "tensor_parameters": {"x": {"scale": 2}},
        "headers": {"x-user": "alice"},
    }
    assert decode_parameters(request.parameters)["n"] == 7
    client.channel.close()


async def test_each_request_s_input_parameters_reach_the_model_with_their_own_types(
    custom_server: RunningServer,
) -> None:
    # True, 1 and 1.0 are equal in Python, and so are 0.0 and -0.0; each request's must reach
    # the model as sent: a Parameters object shared between requests of equal parameters must
    # not be one of another type's, or sign's.
    client = GrpcioClient(custom_server.port)
    for value in (True, 1, 1.0, 1, True, 0.0, -0.0, 0.0):
        request = infer_request("inspect", {"x": np.zeros(1, np.int32)})
        encode_parameters(request.inputs[0].parameters, {"scale": value})
        response = await client.call("ModelInfer", request)
        seen = json.loads(outputs_of(response)["seen"][0])
        scale = seen["tensor_parameters"]["x"]["scale"]
        assert (type(scale), repr(scale)) == (type(value), repr(value))
    client.channel.close()


async def test_a_model_exception_is_internal_with_the_models_message(
    custom_server: RunningServer,
) -> None:
    client = GrpcioClient(custom_server.port)
    error = await client.error("ModelInfer", infer_request("fail", {"x": np.zeros(1)}))
    assert error.code() == grpc.StatusCode.INTERNAL
    assert error.details() == "ValueError: the model is broken"
    assert "Traceback" not in error.details()
    request = infer_request("fail", {"x": np.zeros(1)})
    encode_parameters(request.parameters, {"status": True})
    error = await client.error("ModelInfer", request)
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error.details() == "quota used up"
    client.channel.close()
