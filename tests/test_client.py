"""trio_infer.client against real servers: the example models behind a server with real worker
processes, and the bare transport with handlers written for a test."""

from __future__ import annotations

import json
import math
import socket
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio

from tests.support import eventually, start_server
from trio_infer.client import InferenceClient, InferResult
from trio_infer.core.service import SERVER_NAME, SERVER_VERSION
from trio_infer.datatypes import DATATYPES
from trio_infer.errors import (
    InferError,
    InvalidInput,
    ModelNotFound,
    Overloaded,
    StatusCode,
    Unavailable,
    Unimplemented,
)
from trio_infer.protobuf._proto import grpc_predict_v2_pb2 as pb
from trio_infer.protobuf.codec import encode_parameters
from trio_infer.server import RunningServer
from trio_infer.transport.grpc_server import Call, GrpcServer, ProtocolLimits

MiB = 1024 * 1024
A = np.arange(32, dtype=np.float32).reshape(2, 16) / 4
B = np.linspace(-3, 3, 32, dtype=np.float32).reshape(2, 16)


@pytest.fixture
async def client(server: RunningServer) -> AsyncIterator[InferenceClient]:
    async with InferenceClient.connect("127.0.0.1", server.port) as connected:
        yield connected


def every_datatype() -> dict[str, np.ndarray]:
    """One 2x3 tensor per datatype, holding its extreme values."""
    tensors: dict[str, np.ndarray] = {}
    for datatype, dtype in DATATYPES.items():
        kind: Any = dtype  # iinfo/finfo's stubs reject the generic dtype type
        if datatype == "BYTES":
            array = np.empty(6, dtype=object)
            array[:] = [b"", b"\x00", b"a\x00\x00", b"\xff\xfe", "h\u00e9".encode(), b"z" * 1000]
        elif datatype == "BOOL":
            array = np.array([True, False, True, False, False, True])
        elif kind.kind in "iu":
            info = np.iinfo(kind)
            array = np.array([info.min, info.max, 0, 1, info.max - 1, info.min + 1], dtype=kind)
        else:
            info_f = np.finfo(kind)
            array = np.array(
                [info_f.min, info_f.max, -0.0, np.inf, np.nan, info_f.tiny], dtype=kind
            )
        tensors[datatype] = array.reshape(2, 3)
    return tensors


def assert_identical(got: np.ndarray, expected: np.ndarray, datatype: str) -> None:
    assert got.dtype == DATATYPES[datatype], datatype
    assert got.shape == expected.shape, datatype
    if datatype == "BYTES":
        assert got.tolist() == expected.tolist()
        assert all(type(element) is bytes for element in got.ravel())
    else:
        # Bit for bit: tells -0.0 from 0.0 and compares NaNs.
        assert got.tobytes() == expected.astype(got.dtype).tobytes(), datatype


# -- health and metadata ------------------------------------------------------------------------


async def test_health_rpcs(client: InferenceClient) -> None:
    assert await client.server_live() is True
    assert await client.server_ready() is True
    for name in ("add_sub", "dense", "echo", "sleep"):
        assert await client.model_ready(name) is True
    assert await client.model_ready("add_sub", version="", timeout=5.0) is True


async def test_metadata_rpcs(client: InferenceClient) -> None:
    server = await client.server_metadata(metadata=[("x-user", "me")])
    assert isinstance(server, pb.ServerMetadataResponse)
    assert (server.name, server.version) == (SERVER_NAME, SERVER_VERSION)
    model = await client.model_metadata("add_sub")
    assert isinstance(model, pb.ModelMetadataResponse)
    assert model.name == "add_sub"
    assert [(t.name, t.datatype, list(t.shape)) for t in model.inputs] == [
        ("INPUT0", "FP32", [-1, 16]),
        ("INPUT1", "FP32", [-1, 16]),
    ]
    assert [(t.name, t.datatype, list(t.shape)) for t in model.outputs] == [
        ("OUTPUT0", "FP32", [-1, 16]),
        ("OUTPUT1", "FP32", [-1, 16]),
    ]


async def test_an_unknown_model_is_model_not_found_for_every_rpc(client: InferenceClient) -> None:
    calls: list[Callable[[], Any]] = [
        lambda: client.model_ready("nope"),
        lambda: client.model_metadata("nope"),
        lambda: client.infer("nope", {"x": A}),
    ]
    for call in calls:
        with pytest.raises(ModelNotFound) as caught:
            await call()
        assert caught.value.code == StatusCode.NOT_FOUND
        assert caught.value.message == "Request for unknown model: 'nope' is not found"
    # Errors end calls, not the connection.
    assert await client.server_live()


# -- inference ----------------------------------------------------------------------------------


@pytest.mark.parametrize("raw", [True, False])
async def test_add_sub_exact_values(client: InferenceClient, raw: bool) -> None:
    result = await client.infer(
        "add_sub", {"INPUT0": A, "INPUT1": B}, raw=raw, request_id="req-7", timeout=10.0
    )
    assert isinstance(result, InferResult)
    assert list(result.outputs) == ["OUTPUT0", "OUTPUT1"]
    assert_identical(result.outputs["OUTPUT0"], A + B, "FP32")
    assert_identical(result["OUTPUT1"], A - B, "FP32")
    assert (result.model_name, result.model_version, result.id) == ("add_sub", "", "req-7")
    assert result.parameters == {}
    # The server's request id, and nothing else: the model set no metadata.
    assert [name for name, _ in result.initial_metadata] == ["x-request-id"]
    assert result.trailing_metadata == ()


@pytest.mark.parametrize("raw", [True, False])
async def test_echo_round_trips_every_datatype(client: InferenceClient, raw: bool) -> None:
    tensors = every_datatype()
    result = await client.infer("echo", tensors, raw=raw)
    assert list(result.outputs) == list(tensors)
    for datatype, array in tensors.items():
        assert_identical(result.outputs[datatype], array, datatype)


@pytest.mark.parametrize("raw", [True, False])
async def test_echo_round_trips_bytes_exactly(client: InferenceClient, raw: bool) -> None:
    elements = [b"", b"\x00", b"\x00\x00", b"trailing\x00", b"\xff" * 3, bytes(range(256)) * 400]
    array = np.empty(len(elements), dtype=object)
    array[:] = elements
    text = np.array(["", "h\u00e9llo", "\u2603"])
    result = await client.infer("echo", {"b": array, "s": text}, raw=raw)
    assert result.outputs["b"].dtype == np.object_
    assert result.outputs["b"].tolist() == elements
    assert result.outputs["s"].tolist() == [value.encode() for value in text.tolist()]


async def test_requested_outputs_are_returned_in_request_order(client: InferenceClient) -> None:
    inputs: dict[str, np.ndarray] = {name: np.full(2, i, np.int32) for i, name in enumerate("abc")}
    result = await client.infer("echo", inputs, outputs=["c", "a"])
    assert list(result.outputs) == ["c", "a"]
    assert result.outputs["c"].tolist() == [2, 2]
    only = await client.infer("add_sub", {"INPUT0": A, "INPUT1": B}, outputs=["OUTPUT1"])
    assert list(only.outputs) == ["OUTPUT1"]
    assert_identical(only["OUTPUT1"], A - B, "FP32")


async def test_a_bad_shape_is_invalid_input(client: InferenceClient) -> None:
    with pytest.raises(InvalidInput) as caught:
        await client.infer("add_sub", {"INPUT0": A[:, :15], "INPUT1": B[:, :15]})
    assert caught.value.code == StatusCode.INVALID_ARGUMENT
    assert caught.value.message == (
        "model 'add_sub' input 'INPUT0': expected shape [-1, 16], got [2, 15] "
        "(dimension 1 must be 16)"
    )


async def test_an_unknown_requested_output_is_invalid_input(client: InferenceClient) -> None:
    with pytest.raises(InvalidInput) as caught:
        await client.infer("echo", {"x": A}, outputs=["y"])
    assert caught.value.message == "model 'echo' has no output 'y'; its outputs are 'x'"


async def test_parameters_reach_the_model(client: InferenceClient) -> None:
    result = await client.infer("sleep", {"x": A}, parameters={"delay_ms": 5})
    assert_identical(result["x"], A, "FP32")
    with pytest.raises(InvalidInput) as caught:
        await client.infer("sleep", {"x": A}, parameters={"delay_ms": -1})
    assert caught.value.message == "parameter 'delay_ms' must be a non-negative integer, got -1"


async def test_a_timeout_on_sleep_is_deadline_exceeded_from_the_server(
    client: InferenceClient,
) -> None:
    with pytest.raises(InferError) as caught:
        await client.infer("sleep", {"x": A}, parameters={"delay_ms": 2000}, timeout=0.3)
    assert caught.value.code == StatusCode.DEADLINE_EXCEEDED
    # The server's own message: it enforced the deadline the client sent as grpc-timeout.
    assert caught.value.message == "deadline exceeded"
    # The connection and the server serve the next call at once.
    result = await client.infer("sleep", {"x": A}, parameters={"delay_ms": 0}, timeout=5.0)
    assert_identical(result["x"], A, "FP32")


async def test_an_enclosing_cancel_scope_cancels_the_call(
    client: InferenceClient, server: RunningServer
) -> None:
    with trio.move_on_after(0.3) as scope:
        await client.infer("sleep", {"x": A}, parameters={"delay_ms": 2000})
    assert scope.cancelled_caught
    # The reset reached the server: its call, and the worker running it, are gone.
    await eventually(lambda: server.statistics().pool.busy == 0)
    assert await client.server_live(timeout=5.0)


async def test_more_concurrent_calls_than_the_server_allows_streams(
    client: InferenceClient,
) -> None:
    results: dict[int, InferResult] = {}

    async def one(index: int) -> None:
        inputs: dict[str, np.ndarray] = {"INPUT0": A + index, "INPUT1": B}
        results[index] = await client.infer("add_sub", inputs, request_id=str(index))

    # The server allows 100 concurrent streams per connection; the rest must wait their turn.
    async with trio.open_nursery() as nursery:
        for index in range(250):
            nursery.start_soon(one, index)
    for index, result in results.items():
        assert result.id == str(index)
        assert_identical(result["OUTPUT0"], (A + index) + B, "FP32")
    assert len(results) == 250


async def test_a_graceful_shutdown_finishes_the_calls_in_flight(server: RunningServer) -> None:
    async with InferenceClient.connect("127.0.0.1", server.port) as client:
        finished: list[InferResult] = []

        async def slow_call() -> None:
            params = {"delay_ms": 500}
            finished.append(await client.infer("sleep", {"x": A}, parameters=params))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(slow_call)
            await eventually(lambda: server.statistics().pool.busy == 1)
            server.shutdown()
        assert_identical(finished[0]["x"], A, "FP32")
        with pytest.raises(Unavailable) as caught:
            await client.server_live(timeout=5.0)
        assert caught.value.code == StatusCode.UNAVAILABLE


# -- errors ---------------------------------------------------------------------------------------

TEST_MODELS = '''
import json
import numpy as np
from trio_infer import InferError, Model, StatusCode


class Headers(Model):
    """Returns the request headers that reached the model, as JSON."""

    def predict(self, inputs, parameters):
        headers = {k: v for k, v in parameters.headers.items() if k.startswith("x-")}
        return {"headers": np.array([json.dumps(headers, sort_keys=True)], dtype=object)}


class Fail(Model):
    """Fails with the status and message the request asks for."""

    def predict(self, inputs, parameters):
        raise InferError(parameters["message"], StatusCode(parameters["code"]))
'''


@pytest.fixture
async def custom_client(nursery: trio.Nursery, tmp_path: Path) -> AsyncIterator[InferenceClient]:
    for name, cls in (("headers", "Headers"), ("fail", "Fail")):
        folder = tmp_path / name
        folder.mkdir()
        settings = {"name": name, "implementation": f"client_test_models.{cls}"}
        (folder / "model-settings.json").write_text(json.dumps(settings))
        (folder / "client_test_models.py").write_text(TEST_MODELS)
    server = await start_server(nursery, tmp_path)
    async with InferenceClient.connect("127.0.0.1", server.port) as connected:
        yield connected


async def test_request_metadata_reaches_the_model(custom_client: InferenceClient) -> None:
    metadata = [("x-user", "me"), ("X-Trace-Id", "abc-123")]
    result = await custom_client.infer("headers", {"x": A}, metadata=metadata)
    assert json.loads(result["headers"][0]) == {"x-trace-id": "abc-123", "x-user": "me"}
    mapped = await custom_client.infer("headers", {"x": A}, metadata={"x-user": "you"})
    assert json.loads(mapped["headers"][0]) == {"x-user": "you"}


@pytest.mark.parametrize(
    ("code", "error_type"),
    [
        (StatusCode.NOT_FOUND, ModelNotFound),
        (StatusCode.INVALID_ARGUMENT, InvalidInput),
        (StatusCode.UNAVAILABLE, Unavailable),
        (StatusCode.RESOURCE_EXHAUSTED, Overloaded),
        (StatusCode.UNIMPLEMENTED, Unimplemented),
        (StatusCode.FAILED_PRECONDITION, InferError),
        (StatusCode.PERMISSION_DENIED, InferError),
        (StatusCode.INTERNAL, InferError),
    ],
)
async def test_each_status_raises_its_exception_with_the_servers_message(
    custom_client: InferenceClient, code: StatusCode, error_type: type[InferError]
) -> None:
    # Percent signs, non-ASCII and newlines must survive grpc-message's percent-encoding.
    message = f"status {code.name}: 100% na\u00efve\nsecond line"
    with pytest.raises(InferError) as caught:
        await custom_client.infer(
            "fail", {"x": A}, parameters={"code": int(code), "message": message}
        )
    assert type(caught.value) is error_type
    assert caught.value.code == code
    assert caught.value.message == message


async def test_mistakes_are_caught_before_anything_is_sent(client: InferenceClient) -> None:
    with pytest.raises(InvalidInput, match="input 'z': numpy dtype complex128 has no"):
        await client.infer("echo", {"z": np.zeros(2, np.complex128)})
    with pytest.raises(InvalidInput, match="parameter 'p' is list"):
        await client.infer("echo", {"x": A}, parameters={"p": [1]})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="sequence of output names"):
        await client.infer("echo", {"x": A}, outputs="x")
    with pytest.raises(ValueError, match="timeout must be a positive number"):
        await client.server_live(timeout=0)
    with pytest.raises(ValueError, match="must not start with 'grpc-'"):
        await client.server_live(metadata=[("grpc-timeout", "1S")])
    with pytest.raises(TypeError, match="ends in '-bin'"):
        await client.server_live(metadata=[("x-key-bin", "text")])
    with pytest.raises(TypeError, match="printable ASCII"):
        await client.server_live(metadata=[("x-key", "line\nbreak")])
    assert await client.server_live()


async def test_a_request_over_the_client_limit_is_overloaded(server: RunningServer) -> None:
    async with InferenceClient.connect("127.0.0.1", server.port, max_message_size=MiB) as client:
        with pytest.raises(Overloaded, match="over this client's max_message_size"):
            await client.infer("echo", {"x": np.zeros(MiB, np.uint8)})
        assert await client.server_live()


async def test_a_request_over_the_server_limit_is_overloaded(nursery: trio.Nursery) -> None:
    server = await start_server(nursery, max_message_size=MiB)
    async with InferenceClient.connect("127.0.0.1", server.port) as client:
        with pytest.raises(Overloaded) as caught:
            await client.infer("echo", {"x": np.zeros(4 * MiB, np.uint8)}, timeout=10.0)
        assert caught.value.code == StatusCode.RESOURCE_EXHAUSTED
        small = await client.infer("echo", {"x": np.arange(3, dtype=np.uint8)})
        assert small["x"].tolist() == [0, 1, 2]


async def test_no_server_is_unavailable() -> None:
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    with pytest.raises(Unavailable, match=f"cannot connect to 127.0.0.1:{port}"):
        async with InferenceClient.connect("127.0.0.1", port):
            pass  # pragma: no cover


async def test_a_server_that_does_not_speak_http2_is_unavailable(nursery: trio.Nursery) -> None:
    async def hang_up(stream: trio.SocketStream) -> None:
        await stream.aclose()

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    await nursery.start(trio.serve_listeners, hang_up, listeners)
    with pytest.raises(Unavailable) as caught:
        async with InferenceClient.connect("127.0.0.1", port):
            pass  # pragma: no cover
    assert caught.value.message == (
        f"cannot connect to 127.0.0.1:{port}: the server closed the connection"
    )


async def test_an_error_in_the_block_comes_out_unwrapped(server: RunningServer) -> None:
    async def fail_inside() -> None:
        async with InferenceClient.connect("127.0.0.1", server.port) as client:
            await client.server_live()
            raise KeyError("mine")

    with pytest.raises(KeyError):
        await fail_inside()


# -- the bare transport: what the example server never does --------------------------------------


class Recorder:
    """A transport whose handler answers V2 calls as each test needs, and records what it saw."""

    def __init__(self) -> None:
        self.remaining: list[float] = []
        self.hanging = trio.Event()
        self.cancelled = trio.Event()
        self.port = 0
        self.server: GrpcServer | None = None

    async def handle(self, call: Call) -> None:
        data = await call.receive_message()
        assert data is not None
        method = call.method.rsplit("/", 1)[1]
        self.remaining.append(call.deadline - trio.current_time())
        if method == "ServerLive":
            await call.send_message(pb.ServerLiveResponse(live=True).SerializeToString())
            return
        request = pb.ModelInferRequest.FromString(data)
        response = pb.ModelInferResponse(model_name=request.model_name, id=request.id)
        if request.model_name == "metadata":
            call.initial_metadata = (("x-served-by", "recorder"), ("x-blob-bin", b"\x00\xff"))
            call.trailing_metadata = (("x-cost", "3"),)
            encode_parameters(response.parameters, {"took_ms": 3, "cached": True, "note": "hi"})
        elif request.model_name == "hang":
            self.hanging.set()
            try:
                await trio.sleep_forever()
            finally:
                self.cancelled.set()
        await call.send_message(response.SerializeToString())


async def start_recorder(nursery: trio.Nursery) -> Recorder:
    recorder = Recorder()
    recorder.server = GrpcServer(recorder.handle, ProtocolLimits())
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    await nursery.start(recorder.server.serve, listeners)
    recorder.port = listeners[0].socket.getsockname()[1]
    return recorder


@pytest.fixture
async def recorder(nursery: trio.Nursery) -> Recorder:
    return await start_recorder(nursery)


async def test_response_metadata_and_parameters(recorder: Recorder) -> None:
    async with InferenceClient.connect("127.0.0.1", recorder.port) as client:
        result = await client.infer("metadata", {}, request_id="r1")
    assert result.initial_metadata[:2] == (("x-served-by", "recorder"), ("x-blob-bin", b"\x00\xff"))
    assert [name for name, _ in result.initial_metadata[2:]] == ["x-request-id"]
    assert result.trailing_metadata == (("x-cost", "3"),)
    assert result.parameters == {"took_ms": 3, "cached": True, "note": "hi"}
    assert (result.model_name, result.id, result.outputs) == ("metadata", "r1", {})


async def test_deadlines_are_sent_as_grpc_timeout(recorder: Recorder) -> None:
    async with InferenceClient.connect("127.0.0.1", recorder.port) as client:
        await client.server_live()
        await client.server_live(timeout=5.0)
        with trio.fail_after(3.0):
            await client.infer("plain", {})
        with trio.fail_after(8.0):
            await client.infer("plain", {}, timeout=2.0)  # the sooner deadline wins
        await client.server_live(timeout=300.5)  # over 8 digits of microseconds
    no_deadline, five, three, two, long = recorder.remaining
    assert no_deadline == math.inf
    assert 4.5 < five <= 5.0
    assert 2.5 < three <= 3.0
    assert 1.5 < two <= 2.0
    assert 300.0 < long <= 301.0


async def test_cancelling_a_call_cancels_it_on_the_server(recorder: Recorder) -> None:
    async with InferenceClient.connect("127.0.0.1", recorder.port) as client:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client.infer, "hang", {})
            await recorder.hanging.wait()
            nursery.cancel_scope.cancel()
        with trio.fail_after(5):
            await recorder.cancelled.wait()
        assert await client.server_live()


async def test_a_shutdown_past_its_grace_period_is_unavailable(recorder: Recorder) -> None:
    assert recorder.server is not None
    async with InferenceClient.connect("127.0.0.1", recorder.port) as client:
        errors: list[InferError] = []

        async def hang() -> None:
            with pytest.raises(Unavailable) as caught:
                await client.infer("hang", {})
            errors.append(caught.value)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(hang)
            await recorder.hanging.wait()
            await recorder.server.shutdown(grace_period=0.1)
        assert errors[0].message == "server shut down before the call finished"
        # GOAWAY, then the connection closes: either way no new call starts.
        with trio.fail_after(5), pytest.raises(Unavailable):
            await client.server_live()


async def test_a_lost_connection_fails_the_calls_in_flight_and_later() -> None:
    async with trio.open_nursery() as server_nursery:
        recorder = await start_recorder(server_nursery)
        async with InferenceClient.connect("127.0.0.1", recorder.port) as client:
            errors: list[InferError] = []

            async def hang() -> None:
                with pytest.raises(Unavailable) as caught:
                    await client.infer("hang", {})
                errors.append(caught.value)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(hang)
                await recorder.hanging.wait()
                server_nursery.cancel_scope.cancel()  # the server vanishes, no status sent
            expected = f"connection to 127.0.0.1:{recorder.port} lost: "
            assert errors[0].message == expected + "the server closed the connection"
            with trio.fail_after(5), pytest.raises(Unavailable, match="lost"):
                await client.server_live()
