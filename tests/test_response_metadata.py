"""Response metadata a model sets (trio_infer.Response): on unary calls, on streams, from a batch
and from a decoupled model, read by grpcio, tritonclient and the bundled client; metadata that
breaks the rules fails its request alone."""

from __future__ import annotations

import json
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import trio

from tests.support import GrpcioClient, start_server, write_repository
from trio_infer.client import InferenceClient
from trio_infer.model import MAX_RESPONSE_METADATA
from trio_infer.protobuf._proto import grpc_predict_v2_pb2 as pb
from trio_infer.protobuf.codec import decode_outputs
from trio_infer.server import RunningServer

MODELS = textwrap.dedent(
    '''
    import numpy as np

    from trio_infer import Model, Response


    class Tagged(Model):
        """Echoes x; headers and trailers from the request's parameters (JSON objects)."""

        def predict(self, inputs, parameters):
            import json

            return Response(
                {"y": inputs["x"]},
                headers=json.loads(parameters.get("headers", "{}")),
                trailers=json.loads(parameters.get("trailers", "{}")),
            )


    class TaggedBatch(Model):
        def predict(self, inputs, parameters):
            rows = inputs["x"].shape[0]
            return Response({"y": inputs["x"] * 2}, headers={"x-batch-rows": str(rows)})


    class TaggedSteps(Model):
        def predict(self, inputs, parameters):
            for step in range(3):
                yield Response(
                    {"index": np.array([step], np.int32)},
                    headers={"x-step": str(step)},
                    trailers={f"x-trailer-{step}": "t"},
                )
    '''
)


def _repository(root: Path) -> Path:
    models: dict[str, dict[str, Any]] = {
        "tagged": {"implementation": "tagged_models.Tagged"},
        "tagged_batch": {
            "implementation": "tagged_models.TaggedBatch",
            "max_batch_size": 8,
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 2]}],
        },
        "tagged_steps": {"implementation": "tagged_models.TaggedSteps", "decoupled": True},
    }
    return write_repository(root, models, "tagged_models", MODELS)


@pytest.fixture
async def tagged_server(nursery: trio.Nursery, tmp_path: Path) -> RunningServer:
    return await start_server(nursery, _repository(tmp_path / "repository"))


@pytest.fixture
def grpcio(tagged_server: RunningServer) -> Iterator[GrpcioClient]:
    client = GrpcioClient(tagged_server.port)
    yield client
    client.channel.close()


def _request(
    model: str = "tagged",
    headers: dict[str, str] | None = None,
    trailers: dict[str, str] | None = None,
    request_id: str = "",
) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=model, id=request_id)
    x = request.inputs.add(name="x", datatype="FP32", shape=[1, 2])
    x.contents.fp32_contents.extend([1.0, 2.0])
    request.parameters["headers"].string_param = json.dumps(headers or {})
    request.parameters["trailers"].string_param = json.dumps(trailers or {})
    return request


async def test_unary_headers_and_trailers_reach_grpcio(grpcio: GrpcioClient) -> None:
    response, call = await grpcio.call_with_metadata(
        "ModelInfer",
        _request(headers={"X-Cache": "hit", "x-model-rev": "7"}, trailers={"x-cost": "3 ms"}),
    )
    assert decode_outputs(response)["y"].tolist() == [[1.0, 2.0]]
    initial = dict(call.initial_metadata())
    trailing = dict(call.trailing_metadata())
    # Names are lower-cased, as gRPC requires.
    assert initial["x-cache"] == "hit"
    assert initial["x-model-rev"] == "7"
    assert trailing["x-cost"] == "3 ms"
    assert "x-cost" not in initial
    assert "x-cache" not in trailing


async def test_unary_metadata_reaches_the_bundled_client(tagged_server: RunningServer) -> None:
    async with InferenceClient.connect("127.0.0.1", tagged_server.port) as client:
        result = await client.infer(
            "tagged",
            {"x": np.ones((1, 2), np.float32)},
            parameters={"headers": '{"x-a": "1"}', "trailers": '{"x-b": "2"}'},
        )
    assert ("x-a", "1") in result.initial_metadata
    assert ("x-b", "2") in result.trailing_metadata


async def test_a_batch_gives_its_metadata_to_every_member(
    tagged_server: RunningServer, grpcio: GrpcioClient
) -> None:
    async def one(index: int, seen: list[tuple[np.ndarray, dict[str, str]]]) -> None:
        request = pb.ModelInferRequest(model_name="tagged_batch", id=str(index))
        x = request.inputs.add(name="x", datatype="FP32", shape=[1, 2])
        x.contents.fp32_contents.extend([index, index])
        response, call = await grpcio.call_with_metadata("ModelInfer", request)
        seen.append((decode_outputs(response)["y"][0], dict(call.initial_metadata())))

    seen: list[tuple[np.ndarray, dict[str, str]]] = []
    async with trio.open_nursery() as nursery:
        for index in range(12):
            nursery.start_soon(one, index, seen)
    assert len(seen) == 12
    for values, initial in seen:
        assert values[0] == values[1]
        # Each member sees its batch's row count, whatever batch it was in.
        assert 1 <= int(initial["x-batch-rows"]) <= 8
    assert tagged_server.statistics().batching["tagged_batch"].requests == 12


@pytest.mark.parametrize(
    ("headers", "trailers", "complaint"),
    [
        ({"bad name": "v"}, {}, "may hold only letters"),
        ({"content-type": "text/plain"}, {}, "is the protocol's own"),
        ({}, {"grpc-status": "0"}, "is the protocol's own"),
        ({}, {"x-request-id": "forged"}, "is the protocol's own"),
        ({"x-line": "a\r\nb"}, {}, "not printable ASCII"),
        ({"x-data-bin": "AAAA"}, {}, "binary metadata"),
        ({"x-big": "v" * MAX_RESPONSE_METADATA}, {}, f"more than the {MAX_RESPONSE_METADATA}"),
        ({}, {"x-n": 3}, "must be str"),
    ],
)
async def test_metadata_that_breaks_the_rules_fails_its_call_alone(
    grpcio: GrpcioClient, headers: dict[str, Any], trailers: dict[str, Any], complaint: str
) -> None:
    error = await grpcio.error("ModelInfer", _request(headers=headers, trailers=trailers))
    assert error.code() == grpc.StatusCode.INTERNAL
    assert complaint in error.details()
    # The worker, the connection and the model are fine.
    _, call = await grpcio.call_with_metadata("ModelInfer", _request(headers={"x-ok": "1"}))
    assert dict(call.initial_metadata())["x-ok"] == "1"


def _stream_requests(headers: list[dict[str, str]], trailers: list[dict[str, str]]) -> Any:
    for index, (own_headers, own_trailers) in enumerate(zip(headers, trailers, strict=True)):
        yield _request(headers=own_headers, trailers=own_trailers, request_id=str(index))


async def test_a_stream_sends_the_first_answers_headers_first_and_gathers_the_rest(
    tagged_server: RunningServer,
) -> None:
    # One request at a time, so the order of the answers is known.
    async with InferenceClient.connect("127.0.0.1", tagged_server.port) as client:
        async with client.stream() as stream:
            ids = []
            for index, value in enumerate(["first", "second", "third"]):
                await stream.send(
                    "tagged",
                    {"x": np.ones((1, 2), np.float32)},
                    parameters={
                        "headers": json.dumps({"x-which": value}),
                        "trailers": json.dumps({f"x-t{index}": value, "x-last": value}),
                    },
                    request_id=str(index),
                )
                answer = await stream.__anext__()
                assert answer.error is None
                ids.append(answer.id)
            await stream.done_sending()
            async for _ in stream:
                raise AssertionError("no answer is left")
        initial, trailing = dict(stream.initial_metadata), dict(stream.trailing_metadata)
    assert ids == ["0", "1", "2"]
    assert initial["x-which"] == "first"
    # Later headers can only be trailers; the last value of a name wins.
    assert trailing["x-which"] == "third"
    assert trailing["x-last"] == "third"
    assert (trailing["x-t0"], trailing["x-t1"], trailing["x-t2"]) == ("first", "second", "third")


async def test_grpcio_reads_a_streams_initial_metadata_and_trailers(
    grpcio: GrpcioClient,
) -> None:
    def run() -> tuple[list[Any], dict[str, str], dict[str, str]]:
        # One request: the answer order is then known without reading between sends.
        call = grpcio.stub.ModelStreamInfer(
            _stream_requests([{"x-h": "1"}], [{"x-t": "2"}]), timeout=10
        )
        answers = list(call)
        return answers, dict(call.initial_metadata()), dict(call.trailing_metadata())

    answers, initial, trailing = await trio.to_thread.run_sync(run)
    assert [answer.error_message for answer in answers] == [""]
    assert initial["x-h"] == "1"
    assert trailing["x-t"] == "2"


async def test_a_stream_whose_trailers_would_grow_past_the_bound_fails_that_message_only(
    tagged_server: RunningServer,
) -> None:
    value = "v" * 1000
    async with InferenceClient.connect("127.0.0.1", tagged_server.port) as client:
        async with client.stream() as stream:
            answers = []
            for index in range(6):
                await stream.send(
                    "tagged",
                    {"x": np.ones((1, 2), np.float32)},
                    parameters={"trailers": json.dumps({f"x-t{index}": value})},
                    request_id=str(index),
                )
                answers.append(await stream.__anext__())
            await stream.done_sending()
            async for _ in stream:
                raise AssertionError("no answer is left")
        trailing = dict(stream.trailing_metadata)
    # Four fit in 4 KiB; the fifth and sixth would not: each gets its error, the stream goes on.
    assert [answer.error is None for answer in answers] == [True] * 4 + [False] * 2
    for failed in answers[4:]:
        assert failed.error is not None
        assert "past 4096 bytes" in failed.error.message
    assert sorted(trailing) == ["x-t0", "x-t1", "x-t2", "x-t3"]


async def test_a_decoupled_models_metadata_on_a_stream(tagged_server: RunningServer) -> None:
    async with InferenceClient.connect("127.0.0.1", tagged_server.port) as client:
        async with client.stream() as stream:
            await stream.send("tagged_steps", {"x": np.zeros(1, np.float32)}, request_id="r")
            await stream.done_sending()
            indexes = [int(answer["index"][0]) async for answer in stream]
        initial, trailing = dict(stream.initial_metadata), dict(stream.trailing_metadata)
    assert indexes == [0, 1, 2]
    assert initial["x-step"] == "0"
    assert trailing["x-step"] == "2"
    assert {name for name in trailing if name.startswith("x-trailer-")} == {
        "x-trailer-0",
        "x-trailer-1",
        "x-trailer-2",
    }


def test_a_stream_s_trailers_stay_bounded_when_a_name_is_set_again_with_a_longer_value() -> None:
    from types import SimpleNamespace

    from trio_infer.frontends.grpc_service import _Answer, _StreamSender

    sender = _StreamSender(SimpleNamespace(initial_metadata=()))  # type: ignore[arg-type]
    assert sender.claim(_Answer([], trailers={f"x-{i}": "v" for i in range(100)}))
    # Each answer alone is within the bound; gathered, the trailers would not be.
    long = "v" * (MAX_RESPONSE_METADATA - 10)
    assert not sender.claim(_Answer([], trailers={"x-0": long}))
    assert sender.trailers["x-0"] == "v"
    assert sum(len(n) + len(v) for n, v in sender.trailers.items()) <= MAX_RESPONSE_METADATA
