"""REST: the V2 HTTP endpoints against a real server with real worker processes, with httpx,
tritonclient.http and raw sockets, compared with the same calls over gRPC."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import struct
import textwrap
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import h11
import httpx
import numpy as np
import pytest
import trio
import trio.lowlevel
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support import GrpcioClient, eventually, start_server
from trio_infer.errors import InferError, Overloaded, StatusCode, TooLarge
from trio_infer.frontends.http_service import (
    _header_length,
    _model_route,
    http_status,
    infer_route,
)
from trio_infer.protobuf._proto import grpc_predict_v2_pb2 as pb
from trio_infer.protobuf.codec import decode_outputs, encode_inputs
from trio_infer.server import RunningServer
from trio_infer.transport import http_server
from trio_infer.transport.http_server import (
    HttpConnection,
    HttpError,
    HttpLimits,
    HttpRequest,
    error_body,
    list_members,
    response_head,
)
from trio_infer.transport.listening import CallCounter

MiB = 1024 * 1024


# -- helpers ----------------------------------------------------------------------------------


def _client(server: RunningServer) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.http_port}", timeout=30)


def _json_input(name: str, array: np.ndarray, datatype: str) -> dict[str, Any]:
    data = array.flatten().tolist()
    if datatype == "BYTES":
        data = [element.decode() for element in data]
    return {"name": name, "datatype": datatype, "shape": list(array.shape), "data": data}


async def _grpc_infer(
    client: GrpcioClient, model: str, inputs: list[tuple[str, np.ndarray]], **kwargs: Any
) -> dict[str, np.ndarray]:
    request = pb.ModelInferRequest(model_name=model)
    encode_inputs(request, inputs, raw=True)
    return decode_outputs(await client.call("ModelInfer", request, **kwargs))


async def _open(server: RunningServer) -> tuple[trio.SocketStream, h11.Connection]:
    """A raw connection to the REST port, and h11's client side to read its responses."""
    assert server.http_port is not None
    stream = await trio.open_tcp_stream("127.0.0.1", server.http_port)
    return stream, h11.Connection(h11.CLIENT)


async def _read_response(
    stream: trio.SocketStream, client: h11.Connection
) -> tuple[h11.Response, bytes]:
    """The next whole response on a raw connection (informational ones skipped)."""
    response: h11.Response | None = None
    body = b""
    while True:
        event = client.next_event()
        if event is h11.NEED_DATA:
            client.receive_data(await stream.receive_some(65536))
        elif isinstance(event, h11.Response):
            response = event
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            assert response is not None
            return response, body


async def _send_request(
    stream: trio.SocketStream, client: h11.Connection, method: str, path: str, body: bytes = b""
) -> None:
    """Send a whole request through h11's client side (for a connection that reads several
    responses)."""
    headers = [("host", "x"), ("content-length", str(len(body)))]
    data = client.send(h11.Request(method=method, target=path, headers=headers)) or b""
    if body:
        data += client.send(h11.Data(data=body)) or b""
    data += client.send(h11.EndOfMessage()) or b""
    await stream.send_all(data)


def _post(path: str, body: bytes, extra: str = "") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n{extra}\r\n"
    ).encode() + body


def _sleep_body(delay_ms: int) -> bytes:
    return json.dumps(
        {
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1.0]}],
            "parameters": {"delay_ms": delay_ms},
        }
    ).encode()


def _binary_add_sub_json(rows: int) -> bytes:
    """The JSON part of an add_sub request of ``rows`` rows whose inputs and outputs are
    binary."""
    document = {
        "inputs": [
            {
                "name": name,
                "datatype": "FP32",
                "shape": [rows, 16],
                "parameters": {"binary_data_size": rows * 64},
            }
            for name in ("INPUT0", "INPUT1")
        ],
        "parameters": {"binary_data_output": True},
    }
    return json.dumps(document).encode()


ADD_SUB_BODY = {
    "inputs": [
        {"name": "INPUT0", "datatype": "FP32", "shape": [1, 16], "data": list(range(16))},
        {"name": "INPUT1", "datatype": "FP32", "shape": [1, 16], "data": [1] * 16},
    ]
}


# -- the endpoints ----------------------------------------------------------------------------


async def test_health_and_metadata_answer_as_triton_and_as_grpc(
    server: RunningServer, grpcio_client: GrpcioClient
) -> None:
    async with _client(server) as client:
        for path in ("/v2/health/live", "/v2/health/ready", "/v2/models/add_sub/ready"):
            response = await client.get(path)
            assert (response.status_code, response.content) == (200, b""), path
        metadata = (await client.get("/v2")).json()
        model = (await client.get("/v2/models/dense")).json()
        versioned = await client.get("/v2/models/dense/versions/1")
    grpc_server = await grpcio_client.call("ServerMetadata", pb.ServerMetadataRequest())
    assert metadata == {
        "name": grpc_server.name,
        "version": grpc_server.version,
        "extensions": list(grpc_server.extensions),
    }
    grpc_model = await grpcio_client.call("ModelMetadata", pb.ModelMetadataRequest(name="dense"))
    assert model == {
        "name": "dense",
        "versions": list(grpc_model.versions),
        "platform": grpc_model.platform,
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 256]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 256]}],
    }
    # dense serves no versions: asking for one is as unknown as over gRPC.
    grpc_error = await grpcio_client.error(
        "ModelMetadata", pb.ModelMetadataRequest(name="dense", version="1")
    )
    assert versioned.status_code == 404
    assert versioned.json() == {"error": grpc_error.details()}


async def test_unknown_models_paths_and_methods_are_404_and_405(
    server: RunningServer, grpcio_client: GrpcioClient
) -> None:
    unknown = await grpcio_client.error("ModelMetadata", pb.ModelMetadataRequest(name="nope"))
    async with _client(server) as client:
        for method, path in [
            ("GET", "/v2/models/nope"),
            ("GET", "/v2/models/nope/ready"),
            ("POST", "/v2/models/nope/infer"),
        ]:
            response = await client.request(method, path, json=ADD_SUB_BODY)
            assert response.status_code == 404, path
            assert response.json() == {"error": unknown.details()}
        for path in ("/v3", "/v2/models", "/v2/models/add_sub/explain", "/v2/health"):
            response = await client.get(path)
            assert response.status_code == 404, path
            assert response.json() == {"error": f"no such endpoint: GET {path}"}
        response = await client.get("/v2/models/add_sub/infer")
        assert response.status_code == 405
        assert response.json() == {"error": "Method Not Allowed (this endpoint takes POST)"}
        assert response.headers["allow"] == "POST"
        response = await client.post("/v2/health/ready")
        assert response.status_code == 405
        assert response.headers["allow"] == "GET, HEAD"
        # A load balancer's HEAD probe is answered as its GET would be, without the body.
        response = await client.head("/v2/models/add_sub/ready")
        assert (response.status_code, response.content) == (200, b"")
        # The server goes on serving the same client.
        assert (await client.get("/v2/health/live")).status_code == 200


async def test_an_inference_path_in_any_spelling_is_answered_as_its_plain_form(
    server: RunningServer,
) -> None:
    # The plain forms are read by infer_route; a percent-encoded one by the route's split, a
    # request of another method or for another model the same way: the same answers.
    spellings = [
        ("/v2/models/add_sub/infer", "/v2/models/add%5Fsub/infer"),
        ("/v2/models/add_sub/versions/1/infer", "/v2/models/add_sub/versions/%31/infer"),
        ("/v2/models/nope/infer", "/v2/models/n%6Fpe/infer"),
        ("/v2/models/nope/versions/3/infer", "/v2/models/nope/versions/%33/infer"),
    ]
    async with _client(server) as client:
        for plain, encoded in spellings:
            for method in ("POST", "GET", "PUT"):
                answers = [
                    await client.request(method, path, json=ADD_SUB_BODY)
                    for path in (plain, encoded)
                ]
                first, second = answers
                assert first.status_code == second.status_code, (method, plain)
                assert first.content == second.content, (method, plain)
                assert first.headers.get("allow") == second.headers.get("allow")
        # The plain form is the one served, not refused.
        plain_answer = await client.post("/v2/models/add_sub/infer", json=ADD_SUB_BODY)
        assert plain_answer.status_code == 200


@given(
    st.lists(
        st.sampled_from(["", "v2", "models", "versions", "infer", "ready", "m", "1", "%41", "a/b"]),
        max_size=7,
    )
)
@settings(max_examples=2000, deadline=None)
def test_infer_route_reads_a_path_as_the_route_does(segments: list[str]) -> None:
    path = "/".join(segments)
    found = infer_route(path)
    # As HttpService._route reads a path: split at "/", "/v2" first, "models" and a name, then
    # what _model_route finds after it.
    parts = path.split("/")
    routed = None
    if len(parts) >= 4 and not parts[0] and parts[1:3] == ["v2", "models"] and parts[3]:
        name, version, action = _model_route(parts[3:])
        if action == "infer":
            routed = (name, version)
    if "%" in path:
        assert found is None  # percent-encoded paths are the route's to decode
    else:
        assert found == routed


@given(
    st.binary(max_size=24)
    | st.sampled_from([b"\xb2", b"\xb9", b"1_0", b" 1", b"+1", b"-1", b"0" * 19, b"9" * 20])
    | st.text(alphabet="0123456789\u00b2\u00b3\u00b9\u0663", max_size=21).map(
        lambda text: text.encode("latin-1", "replace")
    )
)
@settings(max_examples=2000, deadline=None)
def test_a_header_length_is_read_from_its_bytes_as_from_its_text(value: bytes) -> None:
    # As the header's text (Latin-1) is read: ASCII digits, at most 19 of them, a number.
    text = value.decode("latin-1")
    if text.isascii() and text.isdigit() and len(text) <= 19:
        assert _header_length([value]) == int(text)
    else:
        with pytest.raises(HttpError) as caught:
            _header_length([value])
        assert caught.value.status == 400
        assert caught.value.message == (
            f"inference-header-content-length must be a number of bytes, got {text[:40]!r}"
        )


@pytest.mark.parametrize(
    ("value", "members"),
    [
        (b"100-continue", [b"100-continue"]),
        (b" 100-continue ,\t, foo ,", [b"100-continue", b"foo"]),
        (b'foo="a,b", 100-continue', [b'foo="a,b"', b"100-continue"]),
        (b'foo="a\\",b", bar', [b'foo="a\\",b"', b"bar"]),
        (b'foo="a\\\\", bar', [b'foo="a\\\\"', b"bar"]),
        (b'foo="unclosed, 100-continue', [b'foo="unclosed, 100-continue']),
        (b"", []),
        (b" , ,", []),
    ],
)
def test_a_list_field_splits_at_the_commas_outside_quoted_strings(
    value: bytes, members: list[bytes]
) -> None:
    assert list_members(value) == members


@pytest.mark.parametrize(
    ("framing", "status", "error"),
    [
        ("Content-Length: 65537", 413, "a GET request's body may be at most 65536 bytes"),
        (
            "Transfer-Encoding: chunked",
            411,
            "a GET request's body must be sent with a Content-Length",
        ),
    ],
)
@pytest.mark.parametrize("path", ["/v2/health/live", "/v2", "/v2/models/add_sub/ready"])
async def test_a_get_with_a_body_that_may_be_large_is_refused_before_it_is_read(
    server: RunningServer, path: str, framing: str, status: int, error: str
) -> None:
    stream, client = await _open(server)
    # Only the head: the body is not sent, and the answer comes at once.
    await stream.send_all(f"GET {path} HTTP/1.1\r\nHost: x\r\n{framing}\r\n\r\n".encode())
    with trio.fail_after(5):
        response, body = await _read_response(stream, client)
    assert response.status_code == status
    assert json.loads(body) == {"error": error}
    await stream.aclose()
    async with _client(server) as other:
        assert (await other.get(path)).status_code == 200


@pytest.mark.parametrize(
    ("model", "inputs"),
    [
        (
            "add_sub",
            [
                ("INPUT0", np.arange(32, dtype=np.float32).reshape(2, 16), "FP32"),
                ("INPUT1", np.full((2, 16), 0.5, dtype=np.float32), "FP32"),
            ],
        ),
        (
            "dense",
            [("x", np.linspace(-1, 1, 3 * 256, dtype=np.float32).reshape(3, 256), "FP32")],
        ),
        (
            "echo",
            [
                ("i8", np.array([[-128, 0, 127]], dtype=np.int8), "INT8"),
                ("u64", np.array([2**64 - 1, 0], dtype=np.uint64), "UINT64"),
                ("b", np.array([True, False]), "BOOL"),
                ("f64", np.array([[1.5, -2.25]], dtype=np.float64), "FP64"),
                ("s", np.array([b"abc", "é".encode()], dtype=object), "BYTES"),
            ],
        ),
    ],
)
async def test_json_inference_gives_the_same_answers_as_grpc(
    server: RunningServer,
    grpcio_client: GrpcioClient,
    model: str,
    inputs: list[tuple[str, np.ndarray, str]],
) -> None:
    body = {"id": "r1", "inputs": [_json_input(n, a, d) for n, a, d in inputs]}
    async with _client(server) as client:
        response = await client.post(f"/v2/models/{model}/infer", json=body)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/json"
    answer = response.json()
    expected = await _grpc_infer(grpcio_client, model, [(n, a) for n, a, _ in inputs])
    assert answer["model_name"] == model
    assert answer["id"] == "r1"
    assert [output["name"] for output in answer["outputs"]] == list(expected)
    for output in answer["outputs"]:
        want = expected[output["name"]]
        assert output["shape"] == list(want.shape)
        if output["datatype"] == "BYTES":
            assert output["data"] == [element.decode() for element in want.flatten()]
        else:
            got = np.array(output["data"], dtype=want.dtype).reshape(want.shape)
            np.testing.assert_array_equal(got, want)


def _tritonclient_calls(port: int) -> dict[str, Any]:
    """Every tritonclient.http call the server serves, from a thread (it is blocking)."""
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(f"127.0.0.1:{port}")
    try:
        results: dict[str, Any] = {
            "live": client.is_server_live(),
            "ready": client.is_server_ready(),
            "model_ready": client.is_model_ready("add_sub"),
            "unknown_ready": client.is_model_ready("nope"),
            "server": client.get_server_metadata(),
            "model": client.get_model_metadata("add_sub"),
        }
        a = np.arange(32, dtype=np.float32).reshape(2, 16)
        b = np.full((2, 16), 3, dtype=np.float32)
        for binary in (False, True):
            first = httpclient.InferInput("INPUT0", [2, 16], "FP32")
            first.set_data_from_numpy(a, binary_data=binary)
            second = httpclient.InferInput("INPUT1", [2, 16], "FP32")
            second.set_data_from_numpy(b, binary_data=binary)
            outputs = [httpclient.InferRequestedOutput("OUTPUT1", binary_data=binary)]
            answer = client.infer("add_sub", [first, second], outputs=outputs, request_id="t")
            results[f"add_sub {binary}"] = (answer.get_response(), answer.as_numpy("OUTPUT1"))
            for coding in ("gzip", "deflate"):  # the body compressed (Content-Encoding)
                answer = client.infer(
                    "add_sub",
                    [first, second],
                    outputs=outputs,
                    request_compression_algorithm=coding,
                )
                results[f"add_sub {binary} {coding}"] = answer.as_numpy("OUTPUT1")
        x = np.linspace(-1, 1, 256, dtype=np.float32).reshape(1, 256)
        dense_input = httpclient.InferInput("x", [1, 256], "FP32")
        dense_input.set_data_from_numpy(x, binary_data=True)
        results["dense"] = client.infer("dense", [dense_input]).as_numpy("y")
        strings = np.array([[b"x", b"", "é".encode()]], dtype=object)
        for binary in (False, True):
            echo_input = httpclient.InferInput("s", [1, 3], "BYTES")
            echo_input.set_data_from_numpy(strings, binary_data=binary)
            output = httpclient.InferRequestedOutput("s", binary_data=binary)
            results[f"echo {binary}"] = client.infer(
                "echo", [echo_input], outputs=[output]
            ).as_numpy("s")
        try:
            client.get_model_metadata("nope")
        except Exception as error:  # tritonclient's InferenceServerException
            results["unknown"] = (error.status(), error.message())  # type: ignore[attr-defined]
        return results
    finally:
        client.close()


async def test_tritonclient_http_works_unchanged_and_agrees_with_grpc(
    server: RunningServer, grpcio_client: GrpcioClient
) -> None:
    assert server.http_port is not None
    results = await trio.to_thread.run_sync(_tritonclient_calls, server.http_port)
    assert results["live"]
    assert results["ready"]
    assert results["model_ready"]
    assert results["unknown_ready"] is False
    assert results["server"]["name"] == "trio-infer"
    assert [i["name"] for i in results["model"]["inputs"]] == ["INPUT0", "INPUT1"]
    a = np.arange(32, dtype=np.float32).reshape(2, 16)
    b = np.full((2, 16), 3, dtype=np.float32)
    expected = await _grpc_infer(grpcio_client, "add_sub", [("INPUT0", a), ("INPUT1", b)])
    for binary in (False, True):
        response, output = results[f"add_sub {binary}"]
        np.testing.assert_array_equal(output, expected["OUTPUT1"])
        np.testing.assert_array_equal(results[f"add_sub {binary} gzip"], expected["OUTPUT1"])
        np.testing.assert_array_equal(results[f"add_sub {binary} deflate"], expected["OUTPUT1"])
        # Only the output asked for, binary when asked.
        assert [o["name"] for o in response["outputs"]] == ["OUTPUT1"]
        assert ("data" not in response["outputs"][0]) is binary
        assert response["id"] == "t"
    x = np.linspace(-1, 1, 256, dtype=np.float32).reshape(1, 256)
    dense = await _grpc_infer(grpcio_client, "dense", [("x", x)])
    np.testing.assert_array_equal(results["dense"], dense["y"])
    # tritonclient gives JSON BYTES back as str, binary ones as bytes.
    assert results["echo False"].tolist() == [["x", "", "é"]]
    assert results["echo True"].tolist() == [[b"x", b"", "é".encode()]]
    unknown = await grpcio_client.error("ModelMetadata", pb.ModelMetadataRequest(name="nope"))
    assert results["unknown"] == ("404", unknown.details())


def _tritonclient_binary_at_every_offset(port: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """``add_sub`` with both inputs and outputs binary, from tritonclient.http, once for each
    request id of 0 to 16 characters: the JSON part's length moves the inputs' bytes to every
    offset modulo 16 in the body (aligned for FP32 or not, and the padding that lays the body
    out aligned of every size)."""
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(f"127.0.0.1:{port}")
    try:
        a = np.arange(32, dtype=np.float32).reshape(2, 16)
        b = np.full((2, 16), 3, dtype=np.float32)
        answers = []
        for length in range(17):
            first = httpclient.InferInput("INPUT0", [2, 16], "FP32")
            first.set_data_from_numpy(a, binary_data=True)
            second = httpclient.InferInput("INPUT1", [2, 16], "FP32")
            second.set_data_from_numpy(b, binary_data=True)
            outputs = [
                httpclient.InferRequestedOutput(name, binary_data=True)
                for name in ("OUTPUT0", "OUTPUT1")
            ]
            answer = client.infer(
                "add_sub", [first, second], outputs=outputs, request_id="i" * length
            )
            answers.append((answer.as_numpy("OUTPUT0"), answer.as_numpy("OUTPUT1")))
            # The same request again, the same JSON part with other data: answered for its
            # own data.
            first.set_data_from_numpy(b, binary_data=True)
            second.set_data_from_numpy(a, binary_data=True)
            answer = client.infer(
                "add_sub", [first, second], outputs=outputs, request_id="i" * length
            )
            answers.append((answer.as_numpy("OUTPUT0"), -answer.as_numpy("OUTPUT1")))
        return answers
    finally:
        client.close()


async def test_an_inferences_answer_head_has_its_fields_in_order(nursery: trio.Nursery) -> None:
    # The content type and header length (rendered once by the service), then the transport's.
    server = await start_server(nursery)
    text = json.dumps(ADD_SUB_BODY).encode()
    x = np.arange(16, dtype=np.float32).reshape(1, 16)
    binary = _binary_add_sub_json(1)
    stream, _ = await _open(server)
    async with stream:
        for request, lines in (
            (_post("/v2/models/add_sub/infer", text), ["content-type: application/json"]),
            (
                _post(
                    "/v2/models/add_sub/infer",
                    binary + x.tobytes() * 2,
                    f"Inference-Header-Content-Length: {len(binary)}\r\nX-Request-Id: r-1\r\n",
                ),
                ["content-type: application/octet-stream", "inference-header-content-length: "],
            ),
        ):
            await stream.send_all(request)
            received = b""
            while b"\r\n\r\n" not in received:
                received += await stream.receive_some(65536)
            head, _, body = received.partition(b"\r\n\r\n")
            status, *fields = head.decode("latin-1").split("\r\n")
            assert status == "HTTP/1.1 200 OK"
            assert [field.partition(": ")[0] for field in fields] == [
                *(line.partition(": ")[0] for line in lines),
                "content-length",
                "x-request-id",
            ]
            assert all(field.startswith(line) for field, line in zip(fields, lines, strict=False))
            length = int(fields[-2].partition(": ")[2])
            while len(body) < length:
                body += await stream.receive_some(65536)
            if len(lines) == 2:
                json_length = int(fields[1].partition(": ")[2])
                outputs = json.loads(body[:json_length])["outputs"]
                assert [output["parameters"]["binary_data_size"] for output in outputs] == [64, 64]
                assert len(body) == json_length + 128
                assert fields[3] == "x-request-id: r-1"
            else:
                assert json.loads(body)["outputs"][0]["name"] == "OUTPUT0"


async def test_binary_inputs_are_read_alike_at_every_offset_in_the_body(
    server: RunningServer,
) -> None:
    assert server.http_port is not None
    answers = await trio.to_thread.run_sync(_tritonclient_binary_at_every_offset, server.http_port)
    a = np.arange(32, dtype=np.float32).reshape(2, 16)
    b = np.full((2, 16), 3, dtype=np.float32)
    for added, subtracted in answers:
        np.testing.assert_array_equal(added, a + b)
        np.testing.assert_array_equal(subtracted, a - b)


async def test_a_bad_header_length_with_a_large_body_is_400_after_the_body_is_read(
    server: RunningServer,
) -> None:
    # The header length is looked at before the body (where the binary part lands in memory),
    # judged once the body has been read: the connection goes on to the next request.
    x = np.arange(64 * 256, dtype=np.float32).reshape(64, 256)
    document = {
        "inputs": [
            {
                "name": "x",
                "datatype": "FP32",
                "shape": [64, 256],
                "parameters": {"binary_data_size": x.nbytes},
            }
        ],
        "parameters": {"binary_data_output": True},
    }
    text = json.dumps(document).encode()
    async with _client(server) as client:
        for length, error in [
            ("0x8d", "inference-header-content-length must be a number of bytes, got '0x8d'"),
            (str(len(text) + x.nbytes + 1), "Inference-Header-Content-Length is"),
            (str(len(text)), None),
        ]:
            answer = await client.post(
                "/v2/models/dense/infer",
                content=text + x.tobytes(),
                headers={"Inference-Header-Content-Length": length},
            )
            if error is None:
                assert answer.status_code == 200, answer.text
                json_length = int(answer.headers["inference-header-content-length"])
                y = np.frombuffer(answer.content[json_length:], dtype=np.float32)
                assert y.shape == (64 * 256,)
            else:
                assert answer.status_code == 400
                assert answer.json()["error"].startswith(error), answer.json()
        assert answer.http_version == "HTTP/1.1"


async def test_a_binary_input_of_the_wrong_size_is_refused_at_any_offset(
    server: RunningServer,
) -> None:
    # The size is checked before the input's array is made (where its alignment is read).
    async with _client(server) as client:
        for length in range(5):
            document = {
                "id": "i" * length,
                "inputs": [
                    {
                        "name": "INPUT0",
                        "datatype": "FP32",
                        "shape": [2, 16],
                        "parameters": {"binary_data_size": 126},
                    },
                    {
                        "name": "INPUT1",
                        "datatype": "FP32",
                        "shape": [2, 16],
                        "parameters": {"binary_data_size": 128},
                    },
                ],
            }
            text = json.dumps(document).encode()
            answer = await client.post(
                "/v2/models/add_sub/infer",
                content=text + bytes(126 + 128),
                headers={"Inference-Header-Content-Length": str(len(text))},
            )
            assert answer.status_code == 400
            assert answer.json() == {
                "error": "input 'INPUT0': shape [2, 16] has 32 elements but 'binary_data_size' "
                "is 126 bytes, not a whole number of 4-byte FP32 elements"
            }


@pytest.mark.parametrize("traced", [False, True], ids=["plain", "request-ids"])
async def test_rest_and_grpc_requests_batch_together(
    nursery: trio.Nursery, tmp_path: Path, traced: bool
) -> None:
    folder = tmp_path / "repository" / "batched"
    folder.mkdir(parents=True)
    spec = [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}]
    (folder / "model-settings.json").write_text(
        json.dumps(
            {
                "implementation": "trio_infer.examples.models.Echo",
                "inputs": spec,
                "outputs": spec,
                # A batch leaves when full (two rows), or after 60 s: the two requests, one per
                # entrance, can only be answered together.
                "max_batch_size": 2,
                "max_batch_time": 60,
            }
        )
    )
    server = await start_server(nursery, tmp_path / "repository")
    grpc_client = GrpcioClient(server.port)
    rest_row = np.array([[1, 2, 3, 4]], dtype=np.float32)
    grpc_row = np.array([[5, 6, 7, 8]], dtype=np.float32)
    answers: dict[str, Any] = {}

    async def over_rest() -> None:
        async with _client(server) as client:
            body = {"inputs": [_json_input("x", rest_row, "FP32")]}
            # A proxy (Envoy, an ingress) gives every request an x-request-id of its own: it
            # must not keep requests apart.
            headers = {"x-request-id": "rest-1"} if traced else {}
            answer = await client.post("/v2/models/batched/infer", json=body, headers=headers)
            answers["rest"] = answer.json()

    async def over_grpc() -> None:
        metadata = [("x-request-id", "grpc-1")] if traced else []
        answers["grpc"] = await _grpc_infer(
            grpc_client, "batched", [("x", grpc_row)], metadata=metadata
        )

    try:
        with trio.fail_after(30):
            async with trio.open_nursery() as both:
                both.start_soon(over_rest)
                both.start_soon(over_grpc)
    finally:
        grpc_client.channel.close()
    assert answers["rest"]["outputs"][0]["data"] == [1.0, 2.0, 3.0, 4.0]
    np.testing.assert_array_equal(answers["grpc"]["x"], grpc_row)
    batches = server.statistics().batching["batched"]
    assert (batches.batches, batches.requests, batches.max_batch_requests) == (1, 2, 2)


# -- bad input --------------------------------------------------------------------------------


async def test_malformed_requests_are_400_with_the_reason_and_the_connection_goes_on(
    server: RunningServer,
) -> None:
    async with _client(server) as client:
        response = await client.post("/v2/models/add_sub/infer", content=b'{"inputs": [')
        assert response.status_code == 400
        assert response.json()["error"].startswith("the request's JSON is malformed")
        wrong_shape = {
            "inputs": [
                {"name": "INPUT0", "datatype": "FP32", "shape": [1, 8], "data": [0] * 8},
                {"name": "INPUT1", "datatype": "FP32", "shape": [1, 8], "data": [0] * 8},
            ]
        }
        response = await client.post("/v2/models/add_sub/infer", json=wrong_shape)
        assert response.status_code == 400
        assert "INPUT0" in response.json()["error"]
        too_few = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [2], "data": [1]}]}
        response = await client.post("/v2/models/echo/infer", json=too_few)
        assert response.status_code == 400
        # Each answer kept the connection: the same one serves a good request now.
        response = await client.post("/v2/models/add_sub/infer", json=ADD_SUB_BODY)
        assert response.status_code == 200
    statistics = server.statistics().http
    assert statistics is not None
    assert statistics.requests_started == 4


@pytest.mark.parametrize(
    ("datatype", "data", "message"),
    [
        ("FP32", [1.0, True], "element 1 is a bool (true); FP32 elements are numbers"),
        ("INT32", [True, 2], "element 0 is a bool (true); INT32 elements are numbers"),
        ("FP64", [[0.5], [False]], "element 1 is a bool (false); FP64 elements are numbers"),
        ("UINT8", [False, True], "element 0 is a bool (false); UINT8 elements are numbers"),
        # Large enough for the simdjson path (FAST_JSON_MIN_ELEMENTS).
        (
            "FP32",
            [*[0.5] * 4000, True, *[0.5] * 95],
            "element 4000 is a bool (true); FP32 elements are numbers",
        ),
        (
            "INT64",
            [*[7] * 4095, False],
            "element 4095 is a bool (false); INT64 elements are numbers",
        ),
    ],
)
async def test_a_bool_among_a_numeric_tensor_s_json_data_is_400_naming_it(
    server: RunningServer, datatype: str, data: list[Any], message: str
) -> None:
    count = len(data)
    shape = [count, 1] if isinstance(data[0], list) else [count]
    tensor = {"name": "x", "datatype": datatype, "shape": shape, "data": data}
    async with _client(server) as client:
        response = await client.post("/v2/models/echo/infer", json={"inputs": [tensor]})
        assert response.status_code == 400
        assert response.json() == {"error": f"input 'x': {message}"}
        # A BOOL tensor takes them, on the same connection.
        flags = {"name": "x", "datatype": "BOOL", "shape": [2], "data": [True, False]}
        response = await client.post("/v2/models/echo/infer", json={"inputs": [flags]})
        assert response.status_code == 200
        assert response.json()["outputs"][0]["data"] == [True, False]


async def test_a_bytes_output_asked_for_as_json_that_is_not_utf_8_is_400_saying_how_to_get_it(
    server: RunningServer, caplog: pytest.LogCaptureFixture
) -> None:
    blob = b"".join(struct.pack("<I", len(e)) + e for e in (b"ok", b"\xff\xfe"))
    size = {"binary_data_size": len(blob)}
    header = {"inputs": [{"name": "s", "datatype": "BYTES", "shape": [2], "parameters": size}]}

    async def echo(client: httpx.AsyncClient, **fields: Any) -> httpx.Response:
        text = json.dumps(header | fields).encode()
        return await client.post(
            "/v2/models/echo/infer",
            content=text + blob,
            headers={"Inference-Header-Content-Length": str(len(text))},
        )

    async with _client(server) as client:
        refused = await echo(client)
        assert refused.status_code == 400
        assert refused.json() == {
            "error": "output 's': BYTES element 1 is not UTF-8, so it cannot be written as a "
            'JSON string; ask for the output as binary data: "binary_data": true in its '
            'parameters in the request\'s "outputs" (or "binary_data_output": true in the '
            "request's parameters)"
        }
        assert "connection" not in refused.headers
        # Asked for as binary data, on the same connection, the same bytes come back.
        for fields in (
            {"outputs": [{"name": "s", "parameters": {"binary_data": True}}]},
            {"parameters": {"binary_data_output": True}},
        ):
            answer = await echo(client, **fields)
            assert answer.status_code == 200, answer.text
            json_length = int(answer.headers["inference-header-content-length"])
            assert answer.content[json_length:] == blob
    assert not [record for record in caplog.records if record.levelno >= logging.ERROR]
    statistics = server.statistics().http
    assert statistics is not None
    assert statistics.requests_started == 3


async def test_a_content_length_over_the_limit_is_refused_before_the_body_is_sent(
    nursery: trio.Nursery,
) -> None:
    server = await start_server(nursery, max_message_size=MiB)
    stream, client = await _open(server)
    # Only the head: the body is never sent, and the answer comes at once.
    await stream.send_all(
        b"POST /v2/models/echo/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 1073741824\r\n\r\n"
    )
    with trio.fail_after(5):
        response, body = await _read_response(stream, client)
    assert response.status_code == 413
    assert json.loads(body) == {
        "error": f"the request body of 1073741824 bytes is larger than the maximum of {MiB} bytes"
    }
    assert (b"connection", b"close") in response.headers
    assert server.statistics().admission.reserved_bytes == 0
    await stream.aclose()
    async with _client(server) as other:
        assert (await other.post("/v2/models/add_sub/infer", json=ADD_SUB_BODY)).status_code == 200


async def test_a_chunked_body_is_counted_as_it_arrives(nursery: trio.Nursery) -> None:
    server = await start_server(nursery, max_message_size=64 * 1024)

    async def chunks(count: int) -> Any:
        text = json.dumps(ADD_SUB_BODY).encode()
        yield text
        for _ in range(count):
            yield b" " * 1024  # JSON allows trailing whitespace

    async with _client(server) as client:
        small = await client.post("/v2/models/add_sub/infer", content=chunks(4))
        assert small.status_code == 200, small.text
        large = await client.post("/v2/models/add_sub/infer", content=chunks(100))
    assert large.status_code == 413
    assert large.json() == {"error": "the request body is larger than the maximum of 65536 bytes"}
    assert server.statistics().admission.reserved_bytes == 0


async def test_request_headers_over_16_kib_are_431(server: RunningServer) -> None:
    stream, client = await _open(server)
    await stream.send_all(
        b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (20 * 1024) + b"\r\n\r\n"
    )
    with trio.fail_after(5):
        response, body = await _read_response(stream, client)
    assert response.status_code == 431
    assert json.loads(body) == {
        "error": "the request's headers are larger than the maximum of 16384 bytes"
    }
    await stream.aclose()
    async with _client(server) as other:
        assert (await other.get("/v2/health/live")).status_code == 200


async def test_a_body_that_does_not_arrive_in_time_is_408_and_frees_its_reservation(
    nursery: trio.Nursery,
) -> None:
    server = await start_server(nursery, receive_timeout=0.5)
    stream, client = await _open(server)
    body = json.dumps(ADD_SUB_BODY).encode()
    await stream.send_all(_post("/v2/models/add_sub/infer", body)[: -len(body) // 2])
    await eventually(lambda: server.statistics().admission.reserved_bytes > 0)
    # Others are served meanwhile.
    async with _client(server) as other:
        assert (await other.post("/v2/models/add_sub/infer", json=ADD_SUB_BODY)).status_code == 200
    with trio.fail_after(5):
        response, answer = await _read_response(stream, client)
    assert response.status_code == 408
    assert json.loads(answer) == {"error": "the request body did not arrive within 0.5 s"}
    assert server.statistics().admission.reserved_bytes == 0
    await stream.aclose()


async def test_a_client_that_disconnects_cancels_its_worker_call(server: RunningServer) -> None:
    stream, _ = await _open(server)
    await stream.send_all(_post("/v2/models/sleep/infer", _sleep_body(20_000)))
    await eventually(lambda: server.statistics().pool.busy == 1)
    await stream.aclose()
    # The call is stopped (its worker killed) long before its 20 s would end.
    await eventually(lambda: server.statistics().pool.busy == 0, within=5)
    statistics = server.statistics()
    assert statistics.http is not None
    assert statistics.http.requests == 0
    assert statistics.admission.reserved_bytes == 0
    async with _client(server) as other:
        response = await other.post("/v2/models/sleep/infer", content=_sleep_body(0))
        assert response.status_code == 200


async def test_keep_alive_serves_every_request_on_one_connection(server: RunningServer) -> None:
    stream, client = await _open(server)
    body = json.dumps(ADD_SUB_BODY).encode()
    for _ in range(3):
        await _send_request(stream, client, "POST", "/v2/models/add_sub/infer", body)
        response, answer = await _read_response(stream, client)
        assert response.status_code == 200
        assert json.loads(answer)["outputs"][0]["data"][:3] == [1.0, 2.0, 3.0]
        client.start_next_cycle()
        await _send_request(stream, client, "GET", "/v2/health/ready")
        response, answer = await _read_response(stream, client)
        assert (response.status_code, answer) == (200, b"")
        client.start_next_cycle()
    statistics = server.statistics().http
    assert statistics is not None
    assert (statistics.connections, statistics.requests_started) == (1, 6)
    await stream.aclose()


async def test_the_timeout_parameter_ends_the_request_with_504(server: RunningServer) -> None:
    body = json.loads(_sleep_body(5_000))
    body["parameters"]["timeout"] = 200_000  # microseconds
    async with _client(server) as client:
        response = await client.post("/v2/models/sleep/infer", json=body)
        assert response.status_code == 504
        assert response.json() == {"error": "deadline exceeded (the request's timeout parameter)"}
        body["parameters"]["timeout"] = "soon"
        response = await client.post("/v2/models/sleep/infer", json=body)
        assert response.status_code == 400
    await eventually(lambda: server.statistics().pool.busy == 0, within=5)


DECOUPLED = textwrap.dedent(
    """
    import numpy as np

    from trio_infer.model import Model


    class Twice(Model):
        def predict(self, inputs, parameters):
            yield {"index": np.array([0], np.int32)}
            yield {"index": np.array([1], np.int32)}
    """
)


HEADERS_MODEL = textwrap.dedent(
    """
    import json

    import numpy as np

    from trio_infer.model import Model

    class Headers(Model):
        def predict(self, inputs, parameters):
            seen = json.dumps(parameters.headers, sort_keys=True).encode()
            return {"headers": np.array([seen], dtype=object)}
    """
)


async def test_a_request_s_headers_reach_its_model_but_http_s_own(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    folder = tmp_path / "repository" / "headers"
    folder.mkdir(parents=True)
    (folder / "model-settings.json").write_text(
        json.dumps({"implementation": "headers_model.Headers"})
    )
    (folder / "headers_model.py").write_text(HEADERS_MODEL)
    server = await start_server(nursery, tmp_path / "repository")
    body = json.dumps({"inputs": [_json_input("x", np.zeros(1, np.float32), "FP32")]})
    async with _client(server) as client:
        response = await client.post(
            "/v2/models/headers/infer",
            content=body,
            # Names as the client spells them, values as latin-1 bytes; HTTP's own headers
            # (and the binary extension's, and the request id) are left out.
            headers={
                "X-User": "bob",
                "x-city": "Z\xfcrich".encode("latin-1"),
                "User-Agent": "test",
                "Content-Type": "application/json",
                "X-Request-Id": "r1",
                "Inference-Header-Content-Length": str(len(body)),
            },
        )
    assert response.status_code == 200, response.text
    [output] = response.json()["outputs"]
    assert json.loads(output["data"][0]) == {"x-city": "Z\xfcrich", "x-user": "bob"}


async def test_a_decoupled_model_is_501_as_in_triton(nursery: trio.Nursery, tmp_path: Path) -> None:
    folder = tmp_path / "repository" / "twice"
    folder.mkdir(parents=True)
    (folder / "model-settings.json").write_text(
        json.dumps({"implementation": "decoupled_http.Twice", "decoupled": True})
    )
    (folder / "decoupled_http.py").write_text(DECOUPLED)
    server = await start_server(nursery, tmp_path / "repository")
    async with _client(server) as client:
        response = await client.post("/v2/models/twice/infer", json={"inputs": []})
    assert response.status_code == 501
    assert "doesn't support models with decoupled transaction policy" in response.json()["error"]


# -- shutdown ---------------------------------------------------------------------------------


async def test_shutdown_closes_idle_connections_and_answers_503_past_the_grace_period() -> None:
    answers: dict[str, httpx.Response] = {}
    async with trio.open_nursery() as nursery:
        server = await start_server(nursery, grace_period=1.0)
        async with _client(server) as client:

            async def call(name: str, delay_ms: int) -> None:
                answers[name] = await client.post(
                    "/v2/models/sleep/infer", content=_sleep_body(delay_ms)
                )

            idle, idle_client = await _open(server)
            await _send_request(idle, idle_client, "GET", "/v2/health/live")
            assert (await _read_response(idle, idle_client))[0].status_code == 200
            async with trio.open_nursery() as calls:
                calls.start_soon(call, "within", 400)
                calls.start_soon(call, "past", 20_000)
                await eventually(lambda: server.statistics().pool.busy == 2)
                server.shutdown()
                # The idle keep-alive connection is closed at once, while the requests in
                # flight go on.
                assert await idle.receive_some(100) == b""
                statistics = server.statistics().http
                assert statistics is not None
                assert statistics.requests == 2
            await idle.aclose()
    assert answers["within"].status_code == 200
    assert answers["past"].status_code == 503
    assert answers["past"].json() == {"error": "server shut down before the request finished"}


def status_of(code: StatusCode) -> int:
    return http_status(InferError("", code))


def test_every_status_code_has_an_http_status() -> None:
    # Every code a model may choose maps to an error status (a KeyError otherwise).
    assert all(400 <= status_of(code) < 600 for code in StatusCode if code != StatusCode.OK)
    assert status_of(StatusCode.NOT_FOUND) == 404
    assert status_of(StatusCode.INVALID_ARGUMENT) == 400
    assert status_of(StatusCode.UNAVAILABLE) == 503
    assert status_of(StatusCode.RESOURCE_EXHAUSTED) == 429
    assert status_of(StatusCode.INTERNAL) == 500
    assert status_of(StatusCode.UNIMPLEMENTED) == 501
    assert status_of(StatusCode.DEADLINE_EXCEEDED) == 504
    assert status_of(StatusCode.CANCELLED) == 400
    # A full bound may have room later; a request larger than the bound never will.
    assert http_status(Overloaded("full")) == 429
    assert http_status(TooLarge("never fits")) == 413


def test_a_response_head_is_a_status_line_and_fields_and_refuses_line_breaks() -> None:
    assert response_head(200, [("content-length", "2")]) == (
        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n"
    )
    assert response_head(599, []) == b"HTTP/1.1 599 \r\n\r\n"  # no reason phrase known
    for fields in (
        [("x-a", "b\r\nset-cookie: c")],
        [("x-a", "b\nc")],
        [("x-a", "b\rc")],
        [("x\r\na", "b")],
    ):
        with pytest.raises(ValueError, match="line break"):
            response_head(200, fields)


@pytest.mark.parametrize("race", ["deadline", "drain"])
def test_a_head_whose_wait_is_cancelled_as_it_arrives_is_served(race: str) -> None:
    # The connection's scope is cancelled while it waits for a head (a drain, the deadline). If
    # that lands in the same pass of the run loop as the head's bytes, the head has arrived
    # and is served: answered whole, its handler not cancelled.
    async def main() -> tuple[list[str], bytes]:
        clock = trio.lowlevel.current_clock()
        assert isinstance(clock, trio.testing.MockClock)
        ours, theirs = socket.socketpair()
        log: list[str] = []

        async def handler(request: HttpRequest) -> None:
            body = await request.receive_body()
            await trio.lowlevel.checkpoint()
            log.append("past a checkpoint")
            await request.respond(200, body=[body])

        connection = HttpConnection(
            trio.SocketStream(trio.socket.from_stdlib_socket(ours)),
            handler,
            HttpLimits(handshake_timeout=10),
            CallCounter(),
        )
        if race == "drain":
            fill = connection.fill

            async def fill_then_drain(size: int) -> bool:
                filled = await fill(size)
                connection.drain()  # as if the drain ran between the wake-up and the read
                return filled

            connection.fill = fill_then_drain  # type: ignore[method-assign]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(connection.run)
            await trio.testing.wait_all_tasks_blocked()
            theirs.sendall(b"POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\nhi")
            if race == "deadline":
                clock.jump(10.5)  # the bytes and the passed deadline seen in one pass
            await trio.testing.wait_all_tasks_blocked()
            theirs.settimeout(5)
            answer = theirs.recv(1000)
            theirs.close()
        return log, answer

    log, answer = trio.run(main, clock=trio.testing.MockClock())
    assert log == ["past a checkpoint"]
    assert answer.startswith(b"HTTP/1.1 200 OK\r\n")
    assert answer.endswith(b"\r\n\r\nhi")


_GET = b"GET /x HTTP/1.1\r\nHost: a\r\n\r\n"


@pytest.mark.parametrize(
    ("script", "ends_at", "statuses"),
    [
        # A new connection has the handshake timeout for its first head...
        ([], 10.0, []),
        ([(5.0, b"GET /x HT")], 10.0, [408]),
        # ...a kept-alive one the idle timeout for its next, from its last answer on...
        ([(0.0, _GET)], 300.0, [200]),
        ([(0.0, _GET.replace(b"/x", b"/slow"))], 301.0, [200]),
        ([(0.0, _GET), (250.0, _GET)], 550.0, [200, 200]),
        # ...and the handshake timeout to finish a head once begun: 408.
        ([(0.0, _GET), (200.0, b"GET /x HT")], 210.0, [200, 408]),
    ],
)
def test_the_idle_and_handshake_timeouts_end_their_waits_at_their_deadlines(
    script: list[tuple[float, bytes]], ends_at: float, statuses: list[int]
) -> None:
    async def main() -> tuple[float, bytes]:
        ours, theirs = socket.socketpair()

        async def handler(request: HttpRequest) -> None:
            if request.path == "/slow":
                await trio.sleep(1)
            await request.respond(200)

        connection = HttpConnection(
            trio.SocketStream(trio.socket.from_stdlib_socket(ours)),
            handler,
            HttpLimits(handshake_timeout=10, idle_timeout=300),
            CallCounter(),
        )
        client = trio.socket.from_stdlib_socket(theirs)
        received = b""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(connection.run)
            for at, data in script:
                await trio.sleep_until(at)
                await client.send(data)
            while data := await client.recv(1000):
                received += data
            ended = trio.current_time()  # the server ended its side
            client.close()
        return ended, received

    ended, received = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert ended == pytest.approx(ends_at)
    lines = received.split(b"\r\n")
    assert [int(line.split()[1]) for line in lines if line.startswith(b"HTTP/1.1")] == statuses


def _post_head(path: str, body: bytes) -> bytes:
    return b"POST %s HTTP/1.1\r\nHost: a\r\nContent-Length: %d\r\n\r\n%s" % (
        path.encode(),
        len(body),
        body,
    )


async def _read_answers(client: trio.socket.SocketType, count: int) -> list[bytes]:
    """``count`` answers without bodies (``content-length: 0``), read whole."""
    received = b""
    while received.count(b"\r\n\r\n") < count:
        data = await client.recv(1000)
        assert data, received
        received += data
    return received.split(b"\r\n\r\n")[:count]


async def _serve_one_connection(
    handler: Callable[[HttpRequest], Awaitable[None]],
    client_side: Callable[[trio.socket.SocketType], Awaitable[None]],
    tcp: bool = False,
) -> None:
    if tcp:
        # A loopback TCP connection (a reset needs TCP), rather than a pair of Unix sockets.
        with socket.create_server(("127.0.0.1", 0)) as listener:
            theirs = socket.create_connection(listener.getsockname())
            ours, _ = listener.accept()
    else:
        ours, theirs = socket.socketpair()
    connection = HttpConnection(
        trio.SocketStream(trio.socket.from_stdlib_socket(ours)),
        handler,
        HttpLimits(),
        CallCounter(),
    )
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(connection.run)
            await client_side(trio.socket.from_stdlib_socket(theirs))


#: The ways a connection can watch its client's end here: the end watch where epoll has
#: EPOLLRDHUP (Linux), and everywhere the watcher task of the platforms without it.
_WATCHES = (["end watch"] if http_server._END_EVENTS is not None else []) + ["watcher task"]


def _serve_one_remembered_connection(
    handler: Callable[[HttpRequest], Awaitable[None]],
    client_side: Callable[[trio.socket.SocketType], Awaitable[None]],
    connections: list[HttpConnection],
) -> None:
    """:func:`_serve_one_connection` in a run of its own, its HttpConnection appended to
    ``connections`` once made (for the client side to reach)."""
    original = HttpConnection.__init__

    def remember(self: HttpConnection, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        connections.append(self)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(HttpConnection, "__init__", remember)
        trio.run(_serve_one_connection, handler, client_side)


@pytest.fixture(params=_WATCHES)
def watch(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs a test with each way a connection watches its client's end on this platform."""
    if request.param == "watcher task":
        monkeypatch.setattr(http_server, "_END_EVENTS", None)
    return str(request.param)


@pytest.mark.parametrize("before", [[], ["POST"], ["POST", "GET"], ["GET", "POST", "POST"]])
def test_a_client_that_closes_during_any_keep_alive_post_cancels_it(
    before: list[str], watch: str
) -> None:
    # One disconnect watcher serves the connection's requests in turn: it is parked between
    # them (and through GETs, which read no body) and watches each request whose body is read.
    log: list[str] = []

    async def handler(request: HttpRequest) -> None:
        if request.method == "POST":
            await request.receive_body()
        if request.path == "/wait":
            try:
                await trio.sleep_forever()
            finally:
                log.append("cancelled")
        await request.respond(200)

    async def client_side(client: trio.socket.SocketType) -> None:
        for method in before:
            await client.send(
                _post_head("/x", b"hi")
                if method == "POST"
                else b"GET /x HTTP/1.1\r\nHost: a\r\n\r\n"
            )
            [answer] = await _read_answers(client, 1)
            assert answer.startswith(b"HTTP/1.1 200 OK\r\n")
        await client.send(_post_head("/wait", b"hi"))
        await trio.testing.wait_all_tasks_blocked()
        assert log == []
        client.close()  # the connection's run ends (fail_after: it must)

    trio.run(_serve_one_connection, handler, client_side)
    assert log == ["cancelled"]


def test_a_request_pipelined_while_a_post_runs_neither_cancels_it_nor_is_lost(watch: str) -> None:
    # The watcher sees the socket readable with the next request: not an end, so the running
    # request goes on, and the next is read once it is answered.
    log: list[str] = []

    async def handler(request: HttpRequest) -> None:
        if request.method == "POST":
            await request.receive_body()
        if request.path == "/slow":
            await trio.sleep(0.2)
        log.append(request.path)
        await request.respond(200)

    async def client_side(client: trio.socket.SocketType) -> None:
        await client.send(_post_head("/slow", b"hi"))
        await trio.testing.wait_all_tasks_blocked()
        await client.send(_post_head("/next", b"hi"))
        await trio.testing.wait_all_tasks_blocked()
        answers = await _read_answers(client, 2)
        assert all(answer.startswith(b"HTTP/1.1 200 OK\r\n") for answer in answers)
        client.close()

    trio.run(_serve_one_connection, handler, client_side)
    assert log == ["/slow", "/next"]


@pytest.mark.parametrize(
    "pieces",
    # The head's last bytes held back, as one write or several: every way to split them.
    [(1,), (2,), (1, 1), (3,), (1, 2), (2, 1), (1, 1, 1)],
)
def test_a_head_begun_in_the_read_that_ends_a_chunked_body_is_served_when_its_end_comes(
    pieces: tuple[int, ...],
) -> None:
    # A chunked body's end is known only once parsed, so the parser reads on past it into what
    # came in the same read: here the next request's head, all but its last bytes. The blank
    # line that ends that head then straddles what the parser has read and what it has not;
    # the head's last bytes, when they come (in as many reads as they come in), end it, and
    # the request is served.
    log: list[tuple[str, bytes]] = []

    async def handler(request: HttpRequest) -> None:
        body = await request.receive_body() if request.method == "POST" else bytearray()
        log.append((request.path, bytes(body)))
        await request.respond(200)

    async def client_side(client: trio.socket.SocketType) -> None:
        after = b"GET /next HTTP/1.1\r\nHost: a\r\n\r\n"
        await client.send(
            b"POST /chunked HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        await trio.testing.wait_all_tasks_blocked()
        held_back = sum(pieces)
        await client.send(b"2\r\nhi\r\n0\r\n\r\n" + after[:-held_back])
        sent = len(after) - held_back
        for size in pieces:
            await trio.testing.wait_all_tasks_blocked()
            await client.send(after[sent : sent + size])
            sent += size
        answers = await _read_answers(client, 2)
        assert all(answer.startswith(b"HTTP/1.1 200 OK\r\n") for answer in answers)
        client.close()

    trio.run(_serve_one_connection, handler, client_side)
    assert log == [("/chunked", b"hi"), ("/next", b"")]


@pytest.mark.parametrize("method", ["GET", "POST"])
def test_a_request_cancelled_by_the_server_is_answered_503_outside_its_scope(method: str) -> None:
    # A request runs in the connection's scope, not one of its own: cancelled, it is answered
    # once that scope has exited, and the connection ends after it.
    connections: list[HttpConnection] = []

    async def handler(request: HttpRequest) -> None:
        if request.method == "POST":
            await request.receive_body()
        await trio.sleep_forever()

    async def client_side(client: trio.socket.SocketType) -> None:
        await client.send(
            _post_head("/x", b"hi") if method == "POST" else b"GET /x HTTP/1.1\r\nHost: a\r\n\r\n"
        )
        await trio.testing.wait_all_tasks_blocked()
        connections[0].drain()
        connections[0].cancel_request("shut down")
        received = b""
        while data := await client.recv(1000):
            received += data
        assert received.startswith(b"HTTP/1.1 503 Service Unavailable\r\n"), received
        assert b"connection: close\r\n" in received
        assert received.endswith(b'\r\n\r\n{"error": "shut down"}')
        client.close()

    _serve_one_remembered_connection(handler, client_side, connections)


def test_connections_sharing_a_server_timer_each_end_their_waits_at_their_deadlines() -> None:
    # A server's connections share one timer; a kept-alive connection adds a deadline to it
    # only when it is earlier than the one it has there.
    from trio_infer.transport.http_server import _WaitTimer

    scripts: list[list[tuple[float, bytes]]] = [
        [(0.0, _GET)],  # idle from 0: ends at 300
        [(0.0, _GET), (250.0, _GET)],  # idle from 250: ends at 550
        [(0.0, _GET), (200.0, b"GET /x HT")],  # a head begun at 200: 408 at 210
        [],  # no head: ends at the handshake timeout
    ]

    async def main() -> list[tuple[float, bytes]]:
        ended: list[tuple[float, bytes]] = [(0.0, b"")] * len(scripts)
        timer = _WaitTimer(10)

        async def handler(request: HttpRequest) -> None:
            await request.respond(200)

        async def client(index: int, client: trio.socket.SocketType) -> None:
            received = b""
            for at, data in scripts[index]:
                await trio.sleep_until(at)
                await client.send(data)
            while data := await client.recv(1000):
                received += data
            ended[index] = (trio.current_time(), received)
            client.close()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(timer.run)
            async with trio.open_nursery() as connections:
                for index in range(len(scripts)):
                    ours, theirs = socket.socketpair()
                    connection = HttpConnection(
                        trio.SocketStream(trio.socket.from_stdlib_socket(ours)),
                        handler,
                        HttpLimits(handshake_timeout=10, idle_timeout=300),
                        CallCounter(),
                        timer=timer,
                    )
                    connections.start_soon(connection.run)
                    connections.start_soon(client, index, trio.socket.from_stdlib_socket(theirs))
            nursery.cancel_scope.cancel()
        return ended

    ended = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert [at for at, _ in ended] == pytest.approx([300.0, 550.0, 210.0, 10.0])
    assert [received.count(b"HTTP/1.1 200 OK\r\n") for _, received in ended] == [1, 2, 1, 0]
    assert b"HTTP/1.1 408 " in ended[2][1]


def test_a_client_that_pipelines_then_closes_while_a_post_runs_cancels_it(watch: str) -> None:
    # The watcher saw the socket readable with the next request: its client closing its
    # socket afterwards (a TLS client's close_notify is such bytes too) must still cancel the
    # running request, not leave its worker call running for nobody.
    log: list[str] = []

    async def handler(request: HttpRequest) -> None:
        await request.receive_body()
        try:
            await trio.sleep_forever()
        finally:
            log.append("cancelled")

    async def client_side(client: trio.socket.SocketType) -> None:
        await client.send(_post_head("/wait", b"hi"))
        await trio.testing.wait_all_tasks_blocked()
        await client.send(b"GET /next HTTP/1.1\r\nHost: a\r\n\r\n")
        await trio.testing.wait_all_tasks_blocked()
        assert log == []
        client.close()  # the connection's run ends (fail_after: it must)

    trio.run(_serve_one_connection, handler, client_side)
    assert log == ["cancelled"]


@pytest.mark.parametrize("end", ["close", "half close", "reset"])
def test_a_client_that_ended_before_its_body_was_read_cancels_the_request(
    end: str, watch: str
) -> None:
    # The end came before the handler read the body (which had arrived with the head): the
    # watch starts on a socket that has ended already, and must still see it.
    log: list[str] = []
    started = trio.Event()
    ended = trio.Event()

    async def handler(request: HttpRequest) -> None:
        started.set()
        await ended.wait()
        await request.receive_body()
        try:
            await trio.sleep_forever()
        finally:
            log.append("cancelled")

    async def client_side(client: trio.socket.SocketType) -> None:
        await client.send(_post_head("/wait", b"hi"))
        await started.wait()
        if end == "half close":
            client.shutdown(socket.SHUT_WR)
            ended.set()
            assert await client.recv(1000) == b""  # nothing answered: the request was cancelled
            assert log == ["cancelled"]
        elif end == "reset":
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        client.close()
        ended.set()

    trio.run(_serve_one_connection, handler, client_side, end == "reset")
    assert log == ["cancelled"]


def test_a_response_to_a_client_that_reset_its_connection_cancels_the_request() -> None:
    # The response's first write fails on the reset socket: send() finds out why, the
    # request is cancelled as its client's, and the connection ends.
    log: list[str] = []
    started = trio.Event()
    reset = trio.Event()

    async def handler(request: HttpRequest) -> None:
        started.set()
        await reset.wait()
        try:
            await request.respond(200, [], [b"x" * 100])
        except trio.Cancelled:
            log.append("cancelled")
            raise
        log.append("answered")

    async def client_side(client: trio.socket.SocketType) -> None:
        await client.send(b"GET /x HTTP/1.1\r\nHost: a\r\n\r\n")
        await started.wait()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        client.close()
        reset.set()

    trio.run(_serve_one_connection, handler, client_side, True)
    assert log == ["cancelled"]


def test_requests_that_end_unwatched_leave_nothing_in_the_end_watch(watch: str) -> None:
    # A request is watched from its body's end to its handler's return, then no longer: a
    # thousand POSTs on one connection leave one registration of its socket in the end watch
    # (kept between requests), nor cancel anything; the client's end takes it off.
    connections: list[HttpConnection] = []
    log: list[str] = []

    async def handler(request: HttpRequest) -> None:
        await request.receive_body()
        log.append(request.path)
        await request.respond(200)

    async def client_side(client: trio.socket.SocketType) -> None:
        for _ in range(1000):
            await client.send(_post_head("/x", b"hi"))
            [answer] = await _read_answers(client, 1)
            assert answer.startswith(b"HTTP/1.1 200 OK\r\n")
        [connection] = connections
        ends = connection._ends
        assert (ends is None) == (watch == "watcher task")
        if ends is not None:
            assert ends._registered == {connection._socket_fd: connection}
        assert connection._watched is None
        client.close()
        if ends is not None:
            await trio.testing.wait_all_tasks_blocked()
            assert ends._registered == {}

    _serve_one_remembered_connection(handler, client_side, connections)
    assert log == ["/x"] * 1000


async def test_a_binary_layout_seen_before_still_refuses_a_body_of_another_size_or_bad_data(
    server: RunningServer,
) -> None:
    # The codec remembers the fields of a JSON part it has checked, for requests with the same
    # JSON part and body size: one of another size is checked afresh, and the data of one of
    # the same size are checked as they are decoded, every time.
    def add_sub(size: int) -> tuple[bytes, bytes]:
        return _binary_add_sub_json(2), bytes(size)

    async with _client(server) as client:

        async def infer(model: str, text: bytes, data: bytes) -> httpx.Response:
            return await client.post(
                f"/v2/models/{model}/infer",
                content=text + data,
                headers={"Inference-Header-Content-Length": str(len(text))},
            )

        text, _ = add_sub(256)
        for _ in range(2):
            for start in (0.0, 7.0):
                a = np.arange(start, start + 32, dtype=np.float32)
                answer = await infer("add_sub", text, a.tobytes() + bytes(128))
                assert answer.status_code == 200
                json_length = int(answer.headers["inference-header-content-length"])
                added = np.frombuffer(answer.content[json_length : json_length + 128], "<f4")
                np.testing.assert_array_equal(added, a)  # a + 0
        short = await infer("add_sub", text, bytes(255))
        assert short.status_code == 400
        assert short.json() == {
            "error": "input 'INPUT1': 'binary_data_size' is 128 but only 127 bytes of the body "
            "are left for it"
        }
        long = await infer("add_sub", text, bytes(257))
        assert long.status_code == 400
        assert long.json() == {
            "error": "the body has 1 bytes after the JSON part and the binary data of the "
            "inputs; each input sent binary declares its size in 'binary_data_size'"
        }
        echo = json.dumps(
            {
                "inputs": [
                    {
                        "name": "s",
                        "datatype": "BYTES",
                        "shape": [1, 1],
                        "parameters": {"binary_data_size": 6},
                    }
                ],
                "outputs": [{"name": "s", "parameters": {"binary_data": True}}],
            }
        ).encode()
        for _ in range(2):
            good = await infer("echo", echo, struct.pack("<I", 2) + b"hi")
            assert good.status_code == 200
            assert good.content.endswith(struct.pack("<I", 2) + b"hi")
            bad = await infer("echo", echo, struct.pack("<I", 3) + b"hi")
            assert bad.status_code == 400
            assert bad.json() == {
                "error": "the binary data of input 's': BYTES element 0 declares 3 bytes but "
                "only 2 remain"
            }


def test_a_response_of_a_buffer_not_contiguous_is_a_500_before_anything_is_sent() -> None:
    # A handler's fault: its buffers are written as they are, so one that is not one piece of
    # memory is refused before the response starts, and the request is answered 500.
    async def handler(request: HttpRequest) -> None:
        await request.respond(200, [], [b"ab", memoryview(bytes(8))[::2]])

    async def client_side(client: trio.socket.SocketType) -> None:
        await client.send(b"GET /x HTTP/1.1\r\nHost: a\r\n\r\n")
        received = b""
        while not received.endswith(error_body("internal server error")):
            data = await client.recv(1000)
            assert data, received
            received += data
        assert received.startswith(b"HTTP/1.1 500 Internal Server Error\r\n")
        assert received.count(b"HTTP/1.1") == 1
        client.close()

    trio.run(_serve_one_connection, handler, client_side)


def test_a_connection_the_server_closes_leaves_its_socket_out_of_the_end_watch() -> None:
    # The server ends the connection (the client asked it to close) while the client keeps
    # its socket open, so no end is reported: the connection takes its socket off the
    # server's end watch itself before closing it, or the descriptor's next socket would be
    # taken for this one's (its end never watched).
    log: list[str] = []

    async def handler(request: HttpRequest) -> None:
        await request.receive_body()
        log.append(request.path)
        await request.respond(200)

    async def main() -> None:
        ends = http_server._EndWatch()
        timer = http_server._WaitTimer(10.0)
        ours, theirs = socket.socketpair()
        with theirs, trio.fail_after(30):
            async with trio.open_nursery() as helpers:
                helpers.start_soon(ends.run)
                helpers.start_soon(timer.run)
                connection = HttpConnection(
                    trio.SocketStream(trio.socket.from_stdlib_socket(ours)),
                    handler,
                    HttpLimits(),
                    CallCounter(),
                    False,
                    timer,
                    helpers,
                    ends,
                )
                async with trio.open_nursery() as serving:
                    serving.start_soon(connection.run)
                    client = trio.socket.from_stdlib_socket(theirs.dup())
                    with client:
                        head = _post_head("/x", b"hi").replace(
                            b"Host: a\r\n", b"Host: a\r\nConnection: close\r\n"
                        )
                        await client.send(head)
                        [answer] = await _read_answers(client, 1)
                        assert answer.startswith(b"HTTP/1.1 200 OK\r\n")
                        assert ends._registered == {connection._socket_fd: connection}
                # The connection has ended, its client's socket still open (``theirs``).
                assert ends._registered == {}
                helpers.cancel_scope.cancel()

    trio.run(main)
    assert log == ["/x"]


_FIELD_TEXT = st.text(
    alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=8
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    method=st.sampled_from(["GET", "HEAD"]),
    status=st.sampled_from([200, 400, 404, 599]),
    headers=st.lists(st.tuples(_FIELD_TEXT, _FIELD_TEXT), max_size=3),
    parts=st.lists(
        st.tuples(st.binary(max_size=70_000), st.sampled_from(["B", "i", "d"])), max_size=4
    ),
)
def test_a_response_is_written_as_its_general_form_says_whole_or_in_pieces(
    method: str, status: int, headers: list[tuple[str, str]], parts: list[tuple[bytes, str]]
) -> None:
    # respond() skips the header lines when there are none, and send() the count of what is
    # left when one write took everything: the bytes are those response_head() frames, with
    # bodies of any item size, whether the socket takes them at once or in pieces (its buffer
    # is small, the larger bodies wait for the client to read).
    body = [
        memoryview(data[: len(data) - len(data) % np.dtype(code).itemsize]).cast(code)
        for data, code in parts
    ]
    payload = b"".join(view.tobytes() for view in body)

    async def handler(request: HttpRequest) -> None:
        await request.respond(status, headers, body)

    async def client_side(client: trio.socket.SocketType) -> None:
        await client.send(
            b"%s /x HTTP/1.1\r\nHost: a\r\nX-Request-Id: r1\r\n\r\n" % method.encode()
        )
        fields = [*headers, ("content-length", str(len(payload))), ("x-request-id", "r1")]
        expected = response_head(status, fields) + (payload if method == "GET" else b"")
        received = b""
        while len(received) < len(expected):
            data = await client.recv(65536)
            assert data, received
            received += data
        assert received == expected
        client.close()

    async def main() -> None:
        ours, theirs = socket.socketpair()
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        connection = HttpConnection(
            trio.SocketStream(trio.socket.from_stdlib_socket(ours)),
            handler,
            HttpLimits(),
            CallCounter(),
        )
        async with trio.open_nursery() as nursery:
            nursery.start_soon(connection.run)
            await client_side(trio.socket.from_stdlib_socket(theirs))

    trio.run(main)


def test_response_fields_are_sent_latin_1_and_one_it_cannot_encode_is_a_500() -> None:
    # One byte per character of a field (as HTTP's fields are octets); a character Latin-1
    # has not fails the response before any of it is sent, and the request is answered 500.
    async def handler(request: HttpRequest) -> None:
        value = "Z\xfcrich" if request.path == "/latin" else "\u20ac"
        await request.respond(200, [("x-city", value)])

    async def client_side(client: trio.socket.SocketType) -> None:
        await client.send(
            b"GET /latin HTTP/1.1\r\nHost: a\r\nX-Request-Id: r1\r\n\r\n"
            b"GET /euro HTTP/1.1\r\nHost: a\r\nX-Request-Id: r2\r\n\r\n"
        )
        body = error_body("internal server error")
        expected = response_head(
            200, [("x-city", "Z\xfcrich"), ("content-length", "0"), ("x-request-id", "r1")]
        ) + response_head(
            500,
            [
                ("content-type", "application/json"),
                ("content-length", str(len(body))),
                ("x-request-id", "r2"),
            ],
        )
        assert b"x-city: Z\xfcrich\r\n" in expected
        received = b""
        while len(received) < len(expected) + len(body):
            data = await client.recv(65536)
            assert data, received
            received += data
        assert received == expected + body
        client.close()

    trio.run(_serve_one_connection, handler, client_side)


@pytest.mark.parametrize("ready", [True, False])
def test_routes_looked_up_whole_answer_as_the_split_path_does(ready: bool) -> None:
    # The health checks' paths (/v2/health/live, /v2/health/ready) are looked up before the
    # path is split, and answered without a coroutine of their own: every method on them and
    # on /v2, with a body or none, and their near misses, are answered as the split path's
    # routing answers them.
    from types import SimpleNamespace

    from trio_infer.core.service import SERVER_NAME, SERVER_VERSION, ServerMetadata
    from trio_infer.frontends.http_service import HttpService

    core = SimpleNamespace(
        server_live=lambda: True,
        server_ready=lambda: ready,
        server_metadata=lambda: ServerMetadata(SERVER_NAME, SERVER_VERSION, ("a", "b")),
    )
    paths = ["/v2", "/v2/", "/v2/health/live", "/v2/health/ready", "/v2/health/live/"]
    paths += ["/v2//health/live", "/v2/health/%6Cive", "/v2/health/ready?x=1", "/V2"]
    requests = [
        b"%s %s HTTP/1.1\r\nHost: a\r\nX-Request-Id: r\r\n%s\r\n%s"
        % (method, path.encode(), *extra)
        for path in paths
        for method in (b"GET", b"POST", b"HEAD", b"PUT")
        for extra in ((b"", b""), (b"Content-Length: 2\r\n", b"{}"))
    ]

    def answers(service: HttpService) -> list[bytes]:
        received: list[bytes] = []

        def client_side(data: bytes) -> Callable[[trio.socket.SocketType], Awaitable[None]]:
            async def run(client: trio.socket.SocketType) -> None:
                # The whole answer: the server closes after it (the client ends its side).
                await client.send(data)
                client.shutdown(socket.SHUT_WR)
                answer = b""
                while chunk := await client.recv(65536):
                    answer += chunk
                received.append(answer)
                client.close()

            return run

        async def main() -> None:
            for data in requests:
                await _serve_one_connection(service.handle, client_side(data))

        trio.run(main)
        return received

    fast = HttpService(core)  # type: ignore[arg-type]
    general = HttpService(core)  # type: ignore[arg-type]
    general._health = {}
    fast_answers = answers(fast)
    assert fast_answers == answers(general)
    statuses = {answer.split(b" ")[1] for answer in fast_answers}
    assert statuses == ({b"200", b"404", b"405"} if ready else {b"200", b"400", b"404", b"405"})


# -- announced bodies, split and pipelined anyhow ---------------------------------------------

#: Body sizes either side of the smaller bound of the straight receive, of a head's read and
#: of the connection's read size, and small ones beside them.
_BODY_SIZES = [0, 1, 100, 16_383, 16_384, 16_385, 40_000, 65_535, 65_536, 65_537, 150_000]
#: The framings and versions a request's body may come in: an announced length (HTTP/1.1,
#: HTTP/1.0 kept alive, waiting to be told to continue, named identity-coded), chunked, or none
#: (a GET, whose answer is its path).
_FRAMINGS = ["length", "length", "1.0", "continue", "identity", "chunked", "get"]


def _framed(framing: str, body: bytes, index: int) -> bytes:
    """Request ``index``'s bytes: a POST of ``body`` framed as ``framing`` says (a GET and no
    body for ``get``), which asks in ``x-aligned-at`` for an offset in its body to be read
    aligned."""
    fields = f"Host: a\r\nX-Aligned-At: {(7 * index + len(body)) % 16}\r\n"
    if framing == "get":
        return f"GET /{index} HTTP/1.1\r\n{fields}\r\n".encode()
    version = "1.0" if framing == "1.0" else "1.1"
    if framing == "chunked":
        fields += "Transfer-Encoding: chunked\r\n"
        pieces = [body[start : start + 20_000] for start in range(0, len(body), 20_000)]
        body = b"".join(b"%x\r\n%s\r\n" % (len(piece), piece) for piece in pieces) + b"0\r\n\r\n"
    else:
        fields += f"Content-Length: {len(body)}\r\n"
        fields += {
            "1.0": "Connection: keep-alive\r\n",
            "continue": "Expect: 100-continue\r\n",
            "identity": "Content-Encoding: identity\r\n",
        }.get(framing, "")
    return f"POST /{index} HTTP/{version}\r\n{fields}\r\n".encode() + body


def _final_answers(received: bytes) -> list[tuple[int, bytes]]:
    """The final answers (1xx skipped) in ``received``, whole ones only: (status, body)."""
    answers = []
    while b"\r\n\r\n" in received:
        head, _, rest = received.partition(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.lower() == b"content-length":
                length = int(value)
        if len(rest) < length:
            break
        if status >= 200:
            answers.append((status, rest[:length]))
        received = rest[length:]
    return answers


@settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    requests=st.lists(
        st.tuples(st.sampled_from(_FRAMINGS), st.sampled_from(_BODY_SIZES)),
        min_size=1,
        max_size=4,
    ),
    cuts=st.lists(st.integers(0, 500_000), max_size=6),
    offsets=st.lists(st.integers(-3, 3), max_size=6),
)
def test_bodies_split_and_pipelined_anyhow_are_each_received_whole_in_order_and_aligned(
    watch: str, requests: list[tuple[str, int]], cuts: list[int], offsets: list[int]
) -> None:
    # Whatever reads the bytes come in (a head and part of its body in one, a body's end with
    # the next requests, a head cut just before or after its blank line), each request's body
    # is its own, whole, and starts 16-aligned where it was asked to: read straight into its
    # buffer, or parsed, as its framing and size say.
    bodies = [np.random.default_rng(size).bytes(size) for _, size in requests]
    framed = [
        _framed(framing, body, index)
        for index, ((framing, _), body) in enumerate(zip(requests, bodies, strict=True))
    ]
    data = b"".join(framed)
    # Cuts anywhere, and near the ends of heads and of requests.
    ends = np.cumsum([len(request) for request in framed]).tolist()
    heads = [
        end - len(request) + request.index(b"\r\n\r\n") + 4
        for end, request in zip(ends, framed, strict=True)
    ]
    near = [mark + offset for mark, offset in zip(heads + ends, offsets, strict=False)]
    pieces = sorted({cut for cut in cuts + near if 0 < cut < len(data)} | {len(data)})

    async def handler(request: HttpRequest) -> None:
        if request.method == "GET":
            await request.respond(200, body=[request.path.encode()])
            return
        aligned_at = int(request.header("x-aligned-at") or "")
        body = await request.receive_body(aligned_at=aligned_at)
        misaligned = 0
        if len(body) > aligned_at:
            misaligned = np.frombuffer(body, np.uint8)[aligned_at:].ctypes.data % 16
        digest = hashlib.sha256(body).hexdigest().encode()
        await request.respond(200, body=[b"%d %d %s" % (misaligned, len(body), digest)])

    async def client_side(client: trio.socket.SocketType) -> None:
        start = 0
        for end in pieces:
            while start < end:
                start += await client.send(data[start:end])
            # The server reads what has come before the next piece does.
            await trio.testing.wait_all_tasks_blocked()
        received = b""
        while len(_final_answers(received)) < len(requests):
            more = await client.recv(1 << 20)
            assert more, received[-300:]
            received += more
        answers = _final_answers(received)
        for (framing, _), body, index, (status, answer) in zip(
            requests, bodies, range(len(requests)), answers, strict=True
        ):
            assert status == 200, answer
            if framing == "get":
                assert answer == b"/%d" % index
            else:
                assert answer == b"0 %d %s" % (len(body), hashlib.sha256(body).hexdigest().encode())
        client.close()

    trio.run(_serve_one_connection, handler, client_side)


def test_a_keep_alive_request_after_a_body_received_straight_is_waited_for_not_read_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A large body's head comes in a read that its body fills: once the body is taken, the
    # client sends its next request only when answered, so a read of the socket before waiting
    # for it would find nothing (a system call and a scheduler pass a request).
    empty_reads = 0
    real_read = os.read

    def read(fd: int, size: int) -> bytes:
        nonlocal empty_reads
        try:
            return real_read(fd, size)
        except BlockingIOError:
            empty_reads += 1
            raise

    monkeypatch.setattr(os, "read", read)
    body = bytes(range(256)) * 256  # 64 KiB: past a head's read, received straight

    async def handler(request: HttpRequest) -> None:
        received = await request.receive_body()
        await request.respond(200, body=[hashlib.sha256(received).hexdigest().encode()])

    async def client_side(client: trio.socket.SocketType) -> None:
        for _ in range(3):
            request = _framed("length", body, 0)
            sent = 0
            while sent < len(request):
                sent += await client.send(request[sent:])
            received = b""
            while not _final_answers(received):
                more = await client.recv(1 << 20)
                assert more, received[-300:]
                received += more
            assert _final_answers(received) == [(200, hashlib.sha256(body).hexdigest().encode())]
            # The server has answered and waits for the next request before it is sent.
            await trio.testing.wait_all_tasks_blocked()
        client.close()

    trio.run(_serve_one_connection, handler, client_side)
    assert empty_reads == 0
