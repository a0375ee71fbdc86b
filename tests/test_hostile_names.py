"""A client's names of unbounded length (a model's name, its version) over real gRPC and REST
clients: each call gets its precise status, with an error message of bounded size, which a
grpcio client takes (it refuses trailers past its metadata limit), and the models serve on."""

from __future__ import annotations

import grpc
import httpx
import numpy as np

from tests.support import GrpcioClient
from trio_infer.client import InferenceClient
from trio_infer.protobuf._proto import grpc_predict_v2_pb2 as pb
from trio_infer.server import RunningServer

LONG = "n" * 1_000_000


def _add_sub(name: str = "add_sub", version: str = "") -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=name, model_version=version)
    for tensor_name in ("INPUT0", "INPUT1"):
        tensor = request.inputs.add(name=tensor_name, datatype="FP32", shape=[1, 16])
        tensor.contents.fp32_contents.extend([1.0] * 16)
    return request


async def test_an_unknown_model_of_a_megabyte_name_is_not_found_in_a_short_message(
    grpcio_client: GrpcioClient,
) -> None:
    error = await grpcio_client.error("ModelInfer", _add_sub(LONG), timeout=30)
    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert error.details() == f"Request for unknown model: '{'n' * 256}...' is not found"
    error = await grpcio_client.error("ModelInfer", _add_sub("\u00e9" * 300_000), timeout=30)
    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert error.details() == "Request for unknown model: '" + "\u00e9" * 256 + "...' is not found"
    answer = await grpcio_client.call("ModelInfer", _add_sub(), timeout=30)
    assert answer.model_name == "add_sub"


async def test_a_megabyte_version_is_invalid_in_a_short_message(
    grpcio_client: GrpcioClient,
) -> None:
    error = await grpcio_client.error("ModelInfer", _add_sub(version="v" * 1_000_000), timeout=30)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == (
        f"failed to get model version from specified version string '{'v' * 64}...': "
        "a version is an integer from 0 to 2**63 - 1"
    )


async def test_a_stream_answers_a_megabyte_name_with_a_short_error_and_goes_on(
    server: RunningServer,
) -> None:
    two = {"INPUT0": np.ones((1, 16), np.float32), "INPUT1": np.ones((1, 16), np.float32)}
    async with (
        InferenceClient.connect("127.0.0.1", server.port) as client,
        client.stream() as stream,
    ):
        await stream.send(LONG, two, request_id="long")
        await stream.send("add_sub", two, request_id="after")
        failed = await anext(stream)
        assert failed.id == "long"
        assert failed.error is not None
        assert failed.error.message == (f"Request for unknown model: '{'n' * 256}...' is not found")
        answered = await anext(stream)
        assert answered.id == "after"
        assert answered.error is None


async def test_rest_answers_a_long_name_with_a_short_404(server: RunningServer) -> None:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.http_port}") as client:
        answer = await client.get(f"/v2/models/{'m' * 6000}/ready")
        assert answer.status_code == 404
        assert answer.json() == {
            "error": f"Request for unknown model: '{'m' * 256}...' is not found"
        }
        assert (await client.get("/v2/models/add_sub/ready")).status_code == 200


async def test_a_megabyte_input_or_output_name_is_invalid_in_a_status_grpcio_takes(
    grpcio_client: GrpcioClient,
) -> None:
    named = _add_sub()
    named.inputs[0].name = LONG
    unknown_output = _add_sub()
    unknown_output.outputs.add(name=LONG)
    typed = _add_sub()
    typed.inputs[1].datatype = "\u2603" * 1_000_000
    for request, start in [
        (named, "model 'add_sub' has no input 'nnn"),
        (unknown_output, "model 'add_sub' has no output 'nnn"),
        (typed, "input 'INPUT1': unknown datatype '\u2603\u2603\u2603"),
    ]:
        error = await grpcio_client.error("ModelInfer", request, timeout=30)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error.details().startswith(start)
        assert error.details().endswith("...")
    answer = await grpcio_client.call("ModelInfer", _add_sub(), timeout=30)
    assert answer.model_name == "add_sub"
