"""ModelStreamInfer against a real server: tritonclient's stream API, grpcio's stream stubs and a
raw HTTP/2 client that never reads."""

from __future__ import annotations

import logging
import queue
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import h2.config
import h2.connection
import h2.settings
import numpy as np
import pytest
import trio
import tritonclient.grpc as triton

from tests.probe import Probe, probe_request, process_exists, start_probe
from tests.support import GrpcioClient, Peaks, eventually, start_server
from tests.test_hostile import REQUEST_HEADERS, Bystander, echo_of, grpc_message
from trio_infer.protobuf._proto import grpc_predict_v2_pb2 as pb
from trio_infer.protobuf.codec import decode_outputs, encode_inputs
from trio_infer.server import RunningServer
from trio_infer.transport.grpc_protocol import ProtocolLimits

STREAM_HEADERS = [
    (n, "/inference.GRPCInferenceService/ModelStreamInfer" if n == ":path" else v)
    for n, v in REQUEST_HEADERS
]


def _triton_inputs(name: str, array: np.ndarray, datatype: str) -> triton.InferInput:
    tensor = triton.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    return tensor


def _triton_stream(port: int, send: list[dict[str, Any]]) -> dict[str, Any]:
    """Send every request in ``send`` (``async_stream_infer`` keyword arguments) on one
    tritonclient stream, wait for the stream to end; each answer by request id (the result,
    or the error's message under ``"error"`` for answers tritonclient gives without an id)."""
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client = triton.InferenceServerClient(f"127.0.0.1:{port}")
    try:
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        for request in send:
            client.async_stream_infer(**request)
        client.stop_stream()  # waits for every answer
    finally:
        client.close()
    out: dict[str, Any] = {"error": []}
    while not answers.empty():
        result, error = answers.get()
        if error is not None:
            out["error"].append(error.message())
        else:
            out[result.get_response().id] = result
    return out


async def test_tritonclient_streams_many_requests_to_several_models(
    server: RunningServer,
) -> None:
    a = np.arange(16, dtype=np.float32).reshape(1, 16)
    b = np.full((1, 16), 0.5, dtype=np.float32)
    x = np.random.default_rng(1).standard_normal((3, 256)).astype(np.float32)
    send: list[dict[str, Any]] = []
    for index in range(30):
        send.append(
            {
                "model_name": "add_sub",
                "inputs": [
                    _triton_inputs("INPUT0", a + index, "FP32"),
                    _triton_inputs("INPUT1", b, "FP32"),
                ],
                "request_id": f"add_sub-{index}",
            }
        )
        text = np.array([f"text {index}".encode()], dtype=np.object_)
        send.append(
            {
                "model_name": "echo",
                "inputs": [_triton_inputs("text", text, "BYTES")],
                "request_id": f"echo-{index}",
            }
        )
    send.append(
        {"model_name": "dense", "inputs": [_triton_inputs("x", x, "FP32")], "request_id": "dense"}
    )
    answers = await trio.to_thread.run_sync(_triton_stream, server.port, send)
    assert answers.pop("error") == []
    assert len(answers) == 61
    for index in range(30):
        result = answers[f"add_sub-{index}"]
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + index + b)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a + index - b)
        assert answers[f"echo-{index}"].as_numpy("text").tolist() == [f"text {index}".encode()]
    weights = np.random.default_rng(0).standard_normal((256, 256)).astype(np.float32)
    np.testing.assert_allclose(answers["dense"].as_numpy("y"), np.tanh(x @ weights), atol=1e-4)


async def test_a_message_that_fails_or_times_out_is_answered_alone_and_the_stream_goes_on(
    server: RunningServer,
) -> None:
    zero = np.zeros((1,), np.float32)
    send: list[dict[str, Any]] = [
        # Its own timeout (tritonclient's timeout=, microseconds) passes while it sleeps.
        {
            "model_name": "sleep",
            "inputs": [_triton_inputs("x", zero, "FP32")],
            "parameters": {"delay_ms": 2000},
            "timeout": 200_000,
            "request_id": "slow",
        },
        {"model_name": "no_such_model", "inputs": [], "request_id": "unknown"},
        *(
            {
                "model_name": "echo",
                "inputs": [_triton_inputs("x", zero + i, "FP32")],
                "request_id": f"ok-{i}",
            }
            for i in range(10)
        ),
    ]
    answers = await trio.to_thread.run_sync(_triton_stream, server.port, send)
    errors = sorted(answers.pop("error"))
    assert errors == [
        "Request for unknown model: 'no_such_model' is not found",
        "deadline exceeded (the request's timeout parameter)",
    ]
    assert sorted(answers) == sorted(f"ok-{i}" for i in range(10))
    assert all(answers[f"ok-{i}"].as_numpy("x").tolist() == [float(i)] for i in range(10))


async def test_cancelling_a_stream_kills_the_worker_running_its_message(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    probe: Probe = await start_probe(nursery, tmp_path)
    stub = probe.client.stub
    holding = queue.Queue[pb.ModelInferRequest | None]()

    def requests() -> Iterator[pb.ModelInferRequest]:
        while (request := holding.get()) is not None:
            yield request

    responses = stub.ModelStreamInfer(requests())
    holding.put(probe_request(tag="streamed", action="sleep", delay_ms=10_000))
    pid = await probe.wait_started("streamed")
    responses.cancel()
    holding.put(None)
    await eventually(lambda: not process_exists(pid))
    await probe.wait_idle()
    assert await probe.call(deadline=5) != pid


def _flood_without_reading(port: int, messages: int, seconds: float) -> int:
    """Send up to ``messages`` echo requests on one stream without reading any answer, for at
    most ``seconds``; the messages sent before the server stopped taking them."""
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    client.send_headers(1, STREAM_HEADERS)
    body = grpc_message(echo_of(np.zeros(64, np.float32)))
    sent = 0
    end = time.monotonic() + seconds
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", port))
        sock.settimeout(0.5)
        sock.sendall(client.data_to_send())
        while sent < messages and time.monotonic() < end:
            if client.local_flow_control_window(1) < len(body):
                # Only the server's window updates are read, never its answers' bytes.
                try:
                    for event in client.receive_data(sock.recv(4096)):
                        del event
                except TimeoutError:
                    continue
                continue
            client.send_data(1, body)
            try:
                sock.sendall(client.data_to_send())
            except TimeoutError:
                break
            sent += 1
    return sent


async def test_a_stream_whose_client_never_reads_holds_a_bounded_amount(
    server: RunningServer,
) -> None:
    peaks = Peaks(server)
    async with trio.open_nursery() as watching:
        watching.start_soon(peaks.watch)
        sent = await trio.to_thread.run_sync(_flood_without_reading, server.port, 10_000, 8.0)
        await Bystander(server.port).call()
        watching.cancel_scope.cancel()
    assert sent < 10_000  # the server stopped taking them
    assert peaks.unsent <= ProtocolLimits().max_unsent_bytes + 64 * 1024
    # What is reserved: the 64 messages in flight at most, and the answers queued under the
    # unsent bound (each holds its reservation until written). Not the 10,000.
    assert peaks.reserved <= 2 * ProtocolLimits().max_unsent_bytes


async def test_a_grpcio_stream_answers_with_the_request_ids(server: RunningServer) -> None:
    client = GrpcioClient(server.port)
    requests = []
    for index in range(20):
        request = pb.ModelInferRequest(model_name="echo", id=f"id-{index}")
        encode_inputs(request, [("x", np.full(3, index, np.int32))], raw=True)
        requests.append(request)
    answers = await trio.to_thread.run_sync(
        lambda: list(client.stub.ModelStreamInfer(iter(requests), timeout=10))
    )
    assert [answer.error_message for answer in answers] == [""] * 20
    by_id = {answer.infer_response.id: answer.infer_response for answer in answers}
    assert sorted(by_id) == sorted(f"id-{i}" for i in range(20))
    for index in range(20):
        assert decode_outputs(by_id[f"id-{index}"])["x"].tolist() == [index] * 3


async def test_a_stream_past_its_deadline_ends_with_deadline_exceeded(
    server: RunningServer,
) -> None:
    client = GrpcioClient(server.port)
    request = pb.ModelInferRequest(model_name="sleep", id="slow")
    encode_inputs(request, [("x", np.zeros(1, np.float32))], raw=True)
    request.parameters["delay_ms"].int64_param = 5000
    with_error: list[grpc.RpcError] = []

    def call() -> None:
        try:
            list(client.stub.ModelStreamInfer(iter([request]), timeout=0.5))
        except grpc.RpcError as error:
            with_error.append(error)

    await trio.to_thread.run_sync(call)
    assert [error.code() for error in with_error] == [grpc.StatusCode.DEADLINE_EXCEEDED]
    await Bystander(server.port).call()


async def test_the_timeout_parameter_bounds_a_unary_call_too(server: RunningServer) -> None:
    client = GrpcioClient(server.port)
    request = pb.ModelInferRequest(model_name="sleep")
    encode_inputs(request, [("x", np.zeros(1, np.float32))], raw=True)
    request.parameters["delay_ms"].int64_param = 3000
    request.parameters["timeout"].int64_param = 200_000
    error = await client.error("ModelInfer", request, timeout=10)
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert error.details() == "deadline exceeded (the request's timeout parameter)"
    request.parameters["timeout"].string_param = "soon"
    error = await client.error("ModelInfer", request, timeout=10)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == "parameter 'timeout' must be an int64 of microseconds, at least 0"
    request.parameters["timeout"].int64_param = 0  # none
    request.parameters["delay_ms"].int64_param = 10
    assert decode_outputs(await client.call("ModelInfer", request, timeout=10))["x"].tolist() == [0]


def _stream_to_a_client_that_opens_no_window(port: int) -> list[str]:
    """One stream message whose answer cannot be sent (the client's window is 100 bytes and
    it never opens more); the h2 events the server's bytes make, for 3 s."""
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    client.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 100})
    client.send_headers(1, STREAM_HEADERS)
    client.send_data(1, grpc_message(echo_of(np.zeros(256, np.float32))))
    events: list[str] = []
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(0.2)
        sock.sendall(client.data_to_send())
        end = time.monotonic() + 3
        while time.monotonic() < end:
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                continue
            if not chunk:
                break
            events += [type(event).__name__ for event in client.receive_data(chunk)]
            sock.sendall(client.data_to_send())  # SETTINGS ACKs; never a WINDOW_UPDATE
    return events


async def test_a_stream_whose_answer_cannot_be_sent_ends_alone_without_a_traceback(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    server = await start_server(nursery, send_timeout=0.5)
    events = await trio.to_thread.run_sync(_stream_to_a_client_that_opens_no_window, server.port)
    assert "StreamReset" in events  # half an answer was sent: the stream is reset
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
    await Bystander(server.port).call()


async def test_a_stream_may_wait_past_the_receive_timeout_before_its_first_message(
    nursery: trio.Nursery,
) -> None:
    # The receive timeout bounds when a unary call's one message begins, not a stream's: its
    # client may open it and send its first request whenever it has one.
    server = await start_server(nursery, workers=1, receive_timeout=0.5)
    client = GrpcioClient(server.port)
    request = pb.ModelInferRequest(model_name="echo", id="late")
    encode_inputs(request, [("x", np.arange(3, dtype=np.int32))], raw=True)

    def later() -> Iterator[pb.ModelInferRequest]:
        time.sleep(1.5)
        yield request

    answers = await trio.to_thread.run_sync(
        lambda: list(client.stub.ModelStreamInfer(later(), timeout=30))
    )
    assert [answer.error_message for answer in answers] == [""]
    assert answers[0].infer_response.id == "late"
    assert decode_outputs(answers[0].infer_response)["x"].tolist() == [0, 1, 2]
