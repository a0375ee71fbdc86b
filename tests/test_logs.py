"""Request ids and the access log: ids echoed over real gRPC calls (grpcio and the bundled
client), and the ``trio-infer serve`` command's JSON log lines and access log, parsed."""

from __future__ import annotations

import json
import logging
import re
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import h2.config
import h2.connection
import h2.errors
import h2.events
import httpx
import numpy as np
import pytest
import trio

from tests.support import GrpcioClient, eventually, start_server
from tests.test_cli import free_port
from tests.test_hostile import REQUEST_HEADERS, echo_request, grpc_message
from tests.test_shutdown import (
    EXIT_SLACK,
    TIMEOUT,
    Server,
    v2_stub,
    wait_server_ready,
    wait_until,
)
from trio_infer.client import InferenceClient
from trio_infer.logs import JsonFormatter
from trio_infer.protobuf._proto import grpc_predict_v2_pb2 as pb
from trio_infer.protobuf.codec import encode_inputs, encode_parameters
from trio_infer.server import RunningServer
from trio_infer.transport.access_log import log_text, new_request_id, request_id

GRACE = 2.0


def _add_sub() -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="add_sub", id="r-1")
    for name in ("INPUT0", "INPUT1"):
        tensor = request.inputs.add(name=name, datatype="FP32", shape=[1, 16])
        tensor.contents.fp32_contents.extend([1.0] * 16)
    return request


def test_a_usable_client_id_is_kept_and_any_other_replaced() -> None:
    assert request_id("abc-123") == "abc-123"
    made = {request_id(None) for _ in range(1000)}
    assert len(made) == 1000
    for unusable in ("", "x" * 129, "line\nbreak", "tab\there", "caf\u00e9", b"bytes"):
        replaced = request_id(unusable)
        assert replaced != unusable
        assert replaced.isascii()
        assert replaced.isprintable()
    assert request_id("x" * 128) == "x" * 128


def test_made_ids_are_the_process_prefix_and_a_count_in_hex() -> None:
    made = [new_request_id() for _ in range(300)] + [request_id(None)]
    prefixes = {made_id.partition("-")[0] for made_id in made}
    assert len(prefixes) == 1
    assert re.fullmatch("[0-9a-f]{12}", prefixes.pop())
    counts = [made_id.partition("-")[2] for made_id in made]
    assert all(re.fullmatch("[1-9a-f][0-9a-f]*", count) for count in counts)
    numbers = [int(count, 16) for count in counts]
    assert numbers == list(range(numbers[0], numbers[0] + len(made)))


async def test_grpc_calls_echo_the_clients_request_id(grpcio_client: GrpcioClient) -> None:
    _, call = await grpcio_client.call_with_metadata(
        "ModelInfer", _add_sub(), metadata=[("x-request-id", "trace-42")]
    )
    assert dict(call.initial_metadata())["x-request-id"] == "trace-42"


async def test_grpc_calls_without_one_get_a_new_id_each(grpcio_client: GrpcioClient) -> None:
    ids = set()
    for _ in range(3):
        _, call = await grpcio_client.call_with_metadata("ServerLive", pb.ServerLiveRequest())
        ids.add(dict(call.initial_metadata())["x-request-id"])
    assert len(ids) == 3


async def test_a_failed_call_has_its_id_in_its_trailers(grpcio_client: GrpcioClient) -> None:
    # A trailers-only response: no headers are sent, so the id goes with the status.
    request = pb.ModelInferRequest(model_name="no-such-model")
    error = await grpcio_client.error(
        "ModelInfer", request, metadata=[("x-request-id", "failed-1")]
    )
    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert dict(error.trailing_metadata())["x-request-id"] == "failed-1"


async def test_a_stream_echoes_its_id(server: RunningServer) -> None:
    async with (
        InferenceClient.connect("127.0.0.1", server.port) as client,
        client.stream(metadata=[("x-request-id", "stream-9")]) as stream,
    ):
        await stream.send("echo", {"x": np.zeros(1, np.float32)})
        await stream.done_sending()
        async for _ in stream:
            pass
    assert ("x-request-id", "stream-9") in stream.initial_metadata


async def test_a_reset_call_is_logged_with_the_status_its_client_sees(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    server = await start_server(nursery, access_log=True)
    caplog.set_level(logging.INFO, logger="trio_infer.access")
    transport = server.statistics
    # A call in flight that its client cancels (grpcio resets the stream with CANCEL).
    client = GrpcioClient(server.port)
    slow = pb.ModelInferRequest(model_name="sleep")
    encode_inputs(slow, [("x", np.zeros(1, np.float32))], raw=True)
    encode_parameters(slow.parameters, {"delay_ms": 30_000})
    future = client.stub.ModelInfer.future(slow, metadata=[("x-request-id", "cancelled-1")])
    await eventually(lambda: getattr(transport().transport, "calls", 0) == 1)
    future.cancel()
    await eventually(lambda: getattr(transport().transport, "calls", 0) == 0)
    # A call whose body turns out longer than its content-length once it has started: the
    # server resets its stream with PROTOCOL_ERROR, which gRPC clients report as INTERNAL.
    h2_client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    h2_client.initiate_connection()
    headers = [*REQUEST_HEADERS, ("x-request-id", "malformed-1"), ("content-length", "3")]
    h2_client.send_headers(1, headers)
    async with await trio.open_tcp_stream("127.0.0.1", server.port) as stream:
        await stream.send_all(h2_client.data_to_send())
        await eventually(lambda: getattr(transport().transport, "calls", 0) == 1)
        h2_client.send_data(1, grpc_message(echo_request()), end_stream=True)
        await stream.send_all(h2_client.data_to_send())
        reset: list[int] = []
        with trio.fail_after(TIMEOUT):
            while not reset and (received := await stream.receive_some()):
                reset = [
                    e.error_code
                    for e in h2_client.receive_data(received)
                    if isinstance(e, h2.events.StreamReset)
                ]
        assert reset == [h2.errors.ErrorCodes.PROTOCOL_ERROR]

    def statuses() -> dict[str, str]:
        return {
            r.request_id: r.status  # type: ignore[attr-defined]
            for r in caplog.records
            if r.name == "trio_infer.access"
        }

    await eventually(lambda: len(statuses()) == 2)
    assert statuses() == {"cancelled-1": "CANCELLED", "malformed-1": "INTERNAL"}
    client.channel.close()


def test_json_lines_carry_the_records_fields() -> None:
    record = logging.LogRecord("trio_infer.x", logging.ERROR, __file__, 1, "a %s", ("b",), None)
    record.request_id = "r-7"
    try:
        raise ValueError("boom")
    except ValueError:
        record.exc_info = sys.exc_info()
    line = JsonFormatter().format(record)
    assert "\n" not in line
    parsed = json.loads(line)
    assert parsed["level"] == "ERROR"
    assert parsed["logger"] == "trio_infer.x"
    assert parsed["message"] == "a b"
    assert parsed["request_id"] == "r-7"
    assert "ValueError: boom" in parsed["exception"]
    assert parsed["time"].endswith("+00:00")


@pytest.fixture
def json_server(tmp_path: Path) -> Iterator[Callable[..., tuple[Server, int]]]:
    servers: list[Server] = []

    def start(*options: str) -> tuple[Server, int]:
        port = free_port()
        argv = ["--host", "127.0.0.1", "--grpc-port", str(port), "--http-port", "0"]
        argv += ["--workers", "1", "--grace-period", str(GRACE), "--log-format", "json"]
        server = Server([*argv, *options], tmp_path)
        servers.append(server)
        return server, port

    yield start
    for server in servers:
        server.close()


def test_the_command_writes_json_lines_and_one_access_record_per_call(
    json_server: Callable[..., tuple[Server, int]],
) -> None:
    server, port = json_server("--access-log", "--log-level", "warning")
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = v2_stub(channel)
        wait_server_ready(stub)
        stub.ModelInfer(_add_sub(), timeout=TIMEOUT, metadata=[("x-request-id", "acc-1")])
        with pytest.raises(grpc.RpcError):
            stub.ModelInfer(pb.ModelInferRequest(model_name="nope"), timeout=TIMEOUT)
    server.wait_for_line(r'"request_id": "acc-1"')
    server.wait_for_line(r'"status": "NOT_FOUND"')
    server.wait_exit(server.send(signal.SIGTERM) + GRACE + 1 + EXIT_SLACK)
    server.assert_clean_exit(0)
    lines = [json.loads(line) for line in server.stderr().splitlines()]
    access = [line for line in lines if line["logger"] == "trio_infer.access"]
    infer = [a for a in access if a["method"].endswith("/ModelInfer")]
    assert len(infer) == 2
    ok, missing = infer
    assert ok["protocol"] == "grpc"
    assert ok["model"] == "add_sub"
    assert ok["status"] == "OK"
    assert ok["request_id"] == "acc-1"
    assert ok["bytes_in"] == _add_sub().ByteSize()
    assert ok["bytes_out"] > 2 * 16 * 4
    assert ok["duration_ms"] > 0
    assert missing["status"] == "NOT_FOUND"
    assert missing["model"] == "nope"
    assert missing["request_id"] not in ("", "acc-1")
    # --log-level warning hides the server's INFO lines, not the access log; every line is JSON.
    assert not [line for line in lines if line["level"] == "INFO" and line not in access]


def test_without_access_log_no_call_is_logged(
    json_server: Callable[..., tuple[Server, int]],
) -> None:
    server, port = json_server()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = v2_stub(channel)
        wait_server_ready(stub)
        stub.ServerLive(pb.ServerLiveRequest(), timeout=TIMEOUT)
    server.wait_exit(server.send(signal.SIGTERM) + GRACE + 1 + EXIT_SLACK)
    server.assert_clean_exit(0)
    loggers = {json.loads(line)["logger"] for line in server.stderr().splitlines()}
    assert "trio_infer.access" not in loggers
    assert "trio_infer.server" in loggers


def test_rest_calls_echo_their_id_and_are_in_the_access_log(
    json_server: Callable[..., tuple[Server, int]],
) -> None:
    server, _ = json_server("--access-log")
    port = int(server.wait_for_line(r"REST on http://127\.0\.0\.1:(\d+)")[1])
    body = {
        "inputs": [
            {"name": name, "datatype": "FP32", "shape": [1, 16], "data": [1.0] * 16}
            for name in ("INPUT0", "INPUT1")
        ]
    }
    sent = json.dumps(body).encode()
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=TIMEOUT) as client:
        wait_until(lambda: client.get("/v2/health/ready").status_code == 200, "ready")
        answer = client.post(
            "/v2/models/add_sub/infer", content=sent, headers={"x-request-id": "rest-1"}
        )
        assert answer.status_code == 200
        assert answer.headers["x-request-id"] == "rest-1"
        missing = client.post("/v2/models/nope/infer", json=body)
        assert missing.status_code == 404
        made = missing.headers["x-request-id"]
        scraped = client.get("/metrics", headers={"x-request-id": "rest-2"})
        assert scraped.status_code == 200
    # A client that gives up on its request closes its connection before any answer.
    slow = {"inputs": body["inputs"][:1], "parameters": {"delay_ms": 60_000}}
    impatient = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=0.5)
    with impatient, pytest.raises(httpx.ReadTimeout):
        impatient.post("/v2/models/sleep/infer", json=slow, headers={"x-request-id": "rest-3"})
    server.wait_for_line(r'"request_id": "rest-3"')
    server.wait_for_line(r'"request_id": "rest-1"')
    server.wait_for_line(r'"request_id": "rest-2"')
    server.wait_for_line(rf'"request_id": "{made}"')
    server.wait_exit(server.send(signal.SIGTERM) + GRACE + 1 + EXIT_SLACK)
    server.assert_clean_exit(0)
    access = [
        line
        for line in map(json.loads, server.stderr().splitlines())
        if line["logger"] == "trio_infer.access" and line["protocol"] == "http"
    ]
    by_id = {line["request_id"]: line for line in access}
    ok = by_id["rest-1"]
    assert ok["method"] == "POST /v2/models/add_sub/infer"
    assert (ok["model"], ok["status"]) == ("add_sub", "200")
    assert ok["bytes_in"] == len(sent)
    assert ok["bytes_out"] > 0
    assert (by_id[made]["model"], by_id[made]["status"]) == ("nope", "404")
    # A scrape is for no model: a model may be called "metrics".
    scrape = by_id["rest-2"]
    assert (scrape["method"], scrape["model"], scrape["status"]) == ("GET /metrics", "", "200")
    # Sent no answer: nginx's "client closed request", a number as the other HTTP statuses.
    gone = by_id["rest-3"]
    assert (gone["model"], gone["status"], gone["bytes_out"]) == ("sleep", "499", 0)


def test_client_text_is_escaped_in_the_message_and_bounded() -> None:
    assert log_text("add_sub") == "add_sub"
    assert log_text("caf\u00e9 model") == "caf\u00e9 model"
    assert log_text("a\nb\r\0c") == "a\\x0ab\\x0d\\x00c"
    assert log_text("sep\u2028x\\n") == "sep\\u2028x\\x5cn"
    assert log_text("\U000e0001") == "\\U000e0001"
    assert log_text("y" * 100_000) == "y" * 512 + "..."


FORGED = "x\n2026-12-04 11:52:06,000 INFO trio_infer.access: grpc /admin OK id=forged"


def test_a_model_name_with_a_line_break_writes_one_access_line(tmp_path: Path) -> None:
    port = free_port()
    argv = ["--host", "127.0.0.1", "--grpc-port", str(port), "--http-port", "0"]
    server = Server(
        [*argv, "--workers", "1", "--grace-period", str(GRACE), "--access-log"], tmp_path
    )
    try:
        http_port = int(server.wait_for_line(r"REST on http://127\.0\.0\.1:(\d+)")[1])
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = v2_stub(channel)
            wait_server_ready(stub)
            for name in (FORGED, "z" * 100_000):
                with pytest.raises(grpc.RpcError) as missing:
                    stub.ModelInfer(pb.ModelInferRequest(model_name=name), timeout=TIMEOUT)
                assert missing.value.code() == grpc.StatusCode.NOT_FOUND
        with httpx.Client(base_url=f"http://127.0.0.1:{http_port}", timeout=TIMEOUT) as client:
            answer = client.get("/v2/models/y%0D%0Aforged%20line/ready")
            assert answer.status_code == 404
            assert answer.json()["error"] == (
                "Request for unknown model: 'y\r\nforged line' is not found"
            )
        server.wait_for_line(r"http GET /v2/models/y%0D%0Aforged%20line/ready ")
        server.wait_exit(server.send(signal.SIGTERM) + GRACE + 1 + EXIT_SLACK)
        server.assert_clean_exit(0)
    finally:
        server.close()
    lines = server.stderr().splitlines()
    # Each line is a record of its own, the forged one inside the first call's record.
    assert not [line for line in lines if line.startswith(("2026-12-04 11:52:06", "forged"))]
    access = [line for line in lines if " INFO trio_infer.access: " in line]
    infer = [line for line in access if "/ModelInfer " in line]
    assert len(infer) == 2
    assert f" {log_text(FORGED)} NOT_FOUND " in infer[0]
    assert " " + "z" * 512 + "... NOT_FOUND " in infer[1]
    assert len(infer[1]) < 1000
    (ready,) = [line for line in access if "/ready " in line]
    assert " y\\x0d\\x0aforged line 404 " in ready
