"""Hostile and careless clients of the REST port: raw HTTP/1.1 written by hand against a real
server, with a well-behaved httpx client beside each whose calls must keep succeeding.

Each test checks the status the README promises (or HTTP's own), that the server goes on
serving, and that what the hostile client made it hold (connections, requests, reserved bytes,
buffered bytes) is bounded and given back."""

from __future__ import annotations

import contextlib
import gzip
import json
import socket
import struct
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, ClassVar

import httpx
import numpy as np
import pytest
import trio
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.support import eventually, start_server
from trio_infer.rest import codec
from trio_infer.server import RunningServer

MiB = 1024 * 1024

#: Short timeouts, so that what the transport cuts off is cut off within a test.
TIMEOUTS: dict[str, Any] = {
    "handshake_timeout": 1.0,
    "receive_timeout": 1.0,
    "idle_timeout": 1.0,
    "send_timeout": 1.0,
}

ADD_SUB_BODY = {
    "inputs": [
        {"name": "INPUT0", "datatype": "FP32", "shape": [1, 16], "data": list(range(16))},
        {"name": "INPUT1", "datatype": "FP32", "shape": [1, 16], "data": [1] * 16},
    ]
}
ADD_SUB_JSON = json.dumps(ADD_SUB_BODY).encode()


@pytest.fixture
async def server(nursery: trio.Nursery) -> RunningServer:
    return await start_server(nursery, workers=1, **TIMEOUTS)


@pytest.fixture(autouse=True)
async def close_raw_connections() -> AsyncIterator[None]:
    yield
    while Raw.opened:
        await Raw.opened.pop().aclose()


# -- a raw client -----------------------------------------------------------------------------


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: bytes

    def error(self) -> str:
        document = json.loads(self.body)
        assert set(document) == {"error"}, document
        return str(document["error"])

    @property
    def closes(self) -> bool:
        return self.headers.get("connection") == "close"


class Raw:
    """A connection to the REST port that sends bytes as given and parses what comes back by
    hand (the server always sends ``content-length``), so that it can send what no HTTP
    library would."""

    #: Every connection opened, closed at the end of its test whatever the test did.
    opened: ClassVar[list[Raw]] = []

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.buffer = bytearray()
        self.at_end = False
        Raw.opened.append(self)

    @classmethod
    async def open(cls, port: int | None, *, receive_buffer: int | None = None) -> Raw:
        assert port is not None
        sock = trio.socket.socket()
        if receive_buffer is not None:
            # Before connecting, so that the window the client advertises is small too.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
        await sock.connect(("127.0.0.1", port))
        return cls(trio.SocketStream(sock))

    async def send(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def trickle(self, data: bytes, pause: float = 0.05) -> None:
        """Send ``data`` a byte at a time, until it is sent or the server closes."""
        try:
            for byte in data:
                await self.stream.send_all(bytes([byte]))
                await trio.sleep(pause)
        except trio.BrokenResourceError:
            pass

    async def _fill(self) -> None:
        try:
            data = await self.stream.receive_some(65536)
        except trio.BrokenResourceError:
            data = b""  # a reset
        if not data:
            self.at_end = True
        self.buffer += data

    async def response(self, *, to_head: bool = False) -> Response | None:
        """The next response (1xx included); None if the connection ends before one.
        ``to_head``: it answers a HEAD, so has no body whatever its content-length."""
        while b"\r\n\r\n" not in self.buffer:
            if self.at_end:
                return None
            await self._fill()
        head, _, _ = bytes(self.buffer).partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ")[1])
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        length = 0 if to_head else int(headers.get("content-length", "0"))
        end = len(head) + 4 + length
        while len(self.buffer) < end:
            if self.at_end:
                return None
            await self._fill()
        body = bytes(self.buffer[len(head) + 4 : end])
        del self.buffer[:end]
        return Response(status, headers, body)

    async def final(self, *, to_head: bool = False) -> Response:
        """The next final (not 1xx) response."""
        while True:
            response = await self.response(to_head=to_head)
            assert response is not None, "the connection ended without a response"
            if response.status >= 200:
                return response

    async def ends(self) -> None:
        """Wait until the server closes the connection, with nothing more sent."""
        while not self.at_end:
            await self._fill()
        assert not self.buffer, bytes(self.buffer[:200])

    async def aclose(self) -> None:
        await self.stream.aclose()

    async def __aenter__(self) -> Raw:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


def head(method: str, path: str, *headers: str) -> bytes:
    return "\r\n".join([f"{method} {path} HTTP/1.1", "Host: x", *headers, "", ""]).encode()


def post(path: str, body: bytes, *headers: str) -> bytes:
    return head("POST", path, f"Content-Length: {len(body)}", *headers) + body


def infer(body: bytes, *headers: str, model: str = "echo") -> bytes:
    return post(f"/v2/models/{model}/infer", body, *headers)


async def exchange(server: RunningServer, data: bytes) -> Response:
    """Send ``data`` on a new connection; its one answer, after which the server closes it."""
    async with await Raw.open(server.http_port) as raw:
        await raw.send(data)
        with trio.fail_after(10):
            answer = await raw.final()
            assert answer.closes, answer
            await raw.ends()
    return answer


class Bystander:
    """A well-behaved client: a health check and an add_sub inference, which must succeed
    whatever the others do."""

    def __init__(self, server: RunningServer) -> None:
        self.server = server
        self.calls = 0
        self.stopping = False

    async def call(self) -> None:
        # Guards against a hang, not a measure: behind 200 other clients on a loaded machine
        # the call took more than 10 s once.
        with trio.fail_after(60):
            async with httpx.AsyncClient(
                base_url=f"http://127.0.0.1:{self.server.http_port}", timeout=60
            ) as client:
                ready = await client.get("/v2/health/ready")
                assert ready.status_code == 200, ready.text
                answer = await client.post("/v2/models/add_sub/infer", json=ADD_SUB_BODY)
                assert answer.status_code == 200, answer.text
                assert answer.json()["outputs"][0]["data"][:3] == [1.0, 2.0, 3.0]
        self.calls += 1

    async def keep_calling(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Call again and again until ``stopping`` is set (the first call made before it
        starts); a call under way when it is set finishes, so its reservation is released, not
        left to a cancelled client."""
        await self.call()
        task_status.started()
        while not self.stopping:
            await trio.sleep(0.05)
            await self.call()


def started(server: RunningServer) -> int:
    statistics = server.statistics().http
    assert statistics is not None
    return statistics.requests_started


def connections(server: RunningServer) -> int:
    statistics = server.statistics().http
    assert statistics is not None
    return statistics.connections


def reserved(server: RunningServer) -> int:
    return server.statistics().admission.reserved_bytes


# -- slowloris --------------------------------------------------------------------------------


async def test_a_head_sent_a_byte_at_a_time_is_cut_off_at_the_handshake_timeout(
    server: RunningServer,
) -> None:
    bystander = Bystander(server)
    raw = await Raw.open(server.http_port)
    silent = await Raw.open(server.http_port)
    request = head("GET", "/v2/health/live", *[f"X-Pad-{i}: {'a' * 20}" for i in range(20)])
    async with trio.open_nursery() as nursery:
        nursery.start_soon(raw.trickle, request)
        await bystander.call()  # served beside it
        with trio.fail_after(5):
            answer = await raw.final()
            assert answer.status == 408
            assert answer.error() == "the request's head did not arrive within 1 s"
            await raw.ends()
        nursery.cancel_scope.cancel()
    # A connection that sends nothing at all is closed at the same timeout, unanswered.
    with trio.fail_after(5):
        await silent.ends()
    assert started(server) == 2  # the bystander's two calls; neither reached a handler
    await raw.aclose()
    await silent.aclose()
    await bystander.call()
    await eventually(lambda: connections(server) == 0)


async def test_a_body_sent_a_byte_at_a_time_holds_the_budget_only_for_the_receive_timeout(
    server: RunningServer,
) -> None:
    bystander = Bystander(server)
    body = json.dumps(ADD_SUB_BODY).encode()
    announced = await Raw.open(server.http_port)
    chunked = await Raw.open(server.http_port)
    # The heads whole (the handshake timeout bounds them), the bodies a byte at a time.
    await announced.send(infer(body, model="add_sub")[: -len(body)])
    await chunked.send(head("POST", "/v2/models/add_sub/infer", "Transfer-Encoding: chunked"))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(announced.trickle, body)
        nursery.start_soon(
            chunked.trickle, b"".join(b"1\r\n" + bytes([byte]) + b"\r\n" for byte in body)
        )
        await eventually(lambda: reserved(server) >= 3 * len(body))
        await bystander.call()
        with trio.fail_after(5):
            answers = [await announced.final(), await chunked.final()]
        nursery.cancel_scope.cancel()
    for answer in answers:
        assert answer.status == 408
        assert answer.error() == "the request body did not arrive within 1 s"
        assert answer.closes
    assert reserved(server) == 0
    await announced.aclose()
    await chunked.aclose()
    await bystander.call()


# -- heads ------------------------------------------------------------------------------------

HEAD_FLOODS = [
    # (what, the bytes, the status, the start of the error)
    (
        "many headers",
        head("GET", "/v2/health/live", *[f"X-A-{i}: b" for i in range(3000)]),
        431,
        "the request has more than the maximum of 256 headers",
    ),
    (
        # 3,000 bytes on the wire, but each field kept costs objects fifty times its size.
        "many empty headers within the size",
        head("GET", "/v2/health/live", *["a:"] * 600),
        431,
        "the request has more than the maximum of 256 headers",
    ),
    (
        "one header of 1 MiB",
        head("GET", "/v2/health/live", "X-Big: " + "a" * MiB),
        431,
        "the request's headers are larger",
    ),
    (
        "a request line of 100 KB",
        head("GET", "/v2/models/" + "a" * 100_000),
        414,
        "the request target is longer than the maximum of 16384 bytes",
    ),
    (
        # The bound is the head's: a target within it, then fields past it.
        "a target of 16 KB and a header",
        head("GET", "/v2/models/" + "a" * 16_000, "X-A: " + "b" * 1000),
        431,
        "the request's headers are larger",
    ),
    ("a NUL in a header value", head("GET", "/v2", "X-A: a\0b"), 400, "malformed request"),
    ("a control byte in a name", head("GET", "/v2", "X\x01A: b"), 400, "malformed request"),
    ("a space before the colon", head("GET", "/v2", "X-A : b"), 400, "malformed request"),
    ("a space in the target", b"GET /v2 x HTTP/1.1\r\nHost: x\r\n\r\n", 400, "malformed request"),
    ("a bare CR", b"GET /v2 HTTP/1.1\rHost: x\r\n\r\n", 400, "malformed request"),
    ("no Host", b"GET /v2 HTTP/1.1\r\n\r\n", 400, "malformed request"),
    ("not HTTP", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(64), 400, "malformed"),
]


async def test_header_floods_and_malformed_heads_are_refused_and_closed(
    server: RunningServer,
) -> None:
    bystander = Bystander(server)
    for what, data, status, message in HEAD_FLOODS:
        answer = await exchange(server, data)
        assert answer.status == status, what
        assert answer.error().startswith(message), (what, answer.error())
        assert len(answer.body) < 1000, what  # the error does not echo what was sent
    # No handler saw any of them.
    assert started(server) == 0
    await bystander.call()
    await eventually(lambda: connections(server) == 0)


async def test_an_obsolete_line_fold_is_refused_as_rfc_9112_allows(
    server: RunningServer,
) -> None:
    # RFC 9112 5.2: a server either replaces an obs-fold with spaces or refuses the request
    # with 400; a proxy in front may have done the other, so refusing is the safer of the two.
    answer = await exchange(server, head("GET", "/v2/health/live", "X-Request-Id: a", " b"))
    assert answer.status == 400
    assert answer.error().startswith("malformed request")
    assert started(server) == 0
    await Bystander(server).call()


@pytest.mark.parametrize(
    ("sent", "answered"),
    [
        # Bytes no head begins with after a request whose Content-Length did not count them (a
        # careless client's body); heads ended with a bare LF. Too short to hold a head's blank
        # line, they are parsed as they come, not held back for the rest of the head until the
        # handshake timeout ends the wait with a 408.
        (post("/v2/repository/index", b"") + b"{}", [200]),
        (b"GET /v2/health/live HTTP/1.1\r\nHost: x\n\r\n", []),
        (b"GET /v2/health/live HTTP/1.1\r\nHost: x\n\n", []),
        (b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\n", []),
    ],
)
async def test_bytes_too_few_for_a_head_s_end_that_cannot_begin_or_end_one_are_400_at_once(
    server: RunningServer, sent: bytes, answered: list[int]
) -> None:
    async with await Raw.open(server.http_port) as raw:
        await raw.send(sent)
        with trio.fail_after(10):
            for status in answered:
                assert (await raw.final()).status == status
            answer = await raw.final()
            assert answer.status == 400, answer
            assert answer.error().startswith("malformed request: "), answer.error()
            assert answer.closes
            await raw.ends()
    await Bystander(server).call()


# -- framing: request smuggling ---------------------------------------------------------------

SMUGGLED = head("GET", "/v2/health/live", "X-Request-Id: smuggled")


@pytest.mark.parametrize(
    ("headers", "body", "status"),
    [
        # Both framings: a proxy that believes one and this server the other would see another
        # request in the body. RFC 9112 6.3: to be handled as an error, the connection closed.
        (["Content-Length: 5", "Transfer-Encoding: chunked"], b"0\r\n\r\n" + SMUGGLED, 400),
        (["Transfer-Encoding: chunked", "Content-Length: 40"], b"0\r\n\r\n" + SMUGGLED, 400),
        (["Content-Length: 5", "Content-Length: 6"], b"abcdef", 400),
        (["Content-Length: 5, 6"], b"abcdef", 400),
        (["Content-Length: -1"], b"", 400),
        (["Content-Length: +5"], b"abcde", 400),
        (["Content-Length: 0x10"], b"", 400),
        (["Content-Length: five"], b"", 400),
        (["Content-Length: " + "9" * 5000], b"", 400),
        # RFC 9112 6.1: a coding the server does not implement is 501; chunked applied twice
        # is malformed (a sender must not apply it more than once).
        (["Transfer-Encoding: gzip"], b"", 501),
        (["Transfer-Encoding: gzip, chunked"], b"0\r\n\r\n", 501),
        (["Transfer-Encoding: chunked, chunked"], b"0\r\n\r\n", 400),
        (["Transfer-Encoding: chunked", "Transfer-Encoding: chunked"], b"0\r\n\r\n", 400),
    ],
)
async def test_ambiguous_or_malformed_framing_is_refused_and_the_connection_closed(
    server: RunningServer, headers: list[str], body: bytes, status: int
) -> None:
    raw = await Raw.open(server.http_port)
    await raw.send(head("POST", "/v2/models/echo/infer", *headers) + body)
    with trio.fail_after(10):
        answer = await raw.final()
        assert answer.status == status, answer
        assert answer.closes
        if any(h.startswith("Content-Length") for h in headers) and any(
            h.startswith("Transfer-Encoding") for h in headers
        ):
            assert answer.error() == "the request has both Content-Length and Transfer-Encoding"
        # Nothing after the refusal is served: no smuggled request's answer.
        await raw.ends()
    await raw.aclose()
    assert started(server) == 0
    assert reserved(server) == 0
    await Bystander(server).call()


async def test_an_oversized_body_announced_with_expect_100_continue_is_refused_unread(
    server: RunningServer,
) -> None:
    raw = await Raw.open(server.http_port)
    await raw.send(
        head(
            "POST", "/v2/models/echo/infer", "Content-Length: 1099511627776", "Expect: 100-continue"
        )
    )
    with trio.fail_after(5):
        answer = await raw.response()  # not a 100 first: the final answer at once
        assert answer is not None
        assert answer.status == 413
        assert answer.closes
        await raw.ends()
    await raw.aclose()
    # A body within the limit gets its 100 Continue, then its answer, on a kept connection.
    await continued_and_kept(server, "100-continue")
    assert reserved(server) == 0


async def continued_and_kept(server: RunningServer, expect: str) -> None:
    """An ``add_sub`` request whose head says ``Expect: {expect}`` gets a 100 Continue, and
    once its body is sent, its answer, 200, on a connection kept open."""
    raw = await Raw.open(server.http_port)
    body = json.dumps(ADD_SUB_BODY).encode()
    await raw.send(infer(body, f"Expect: {expect}", model="add_sub")[: -len(body)])
    with trio.fail_after(5):
        interim = await raw.response()
        assert interim is not None
        assert interim.status == 100
        await raw.send(body)
        answer = await raw.final()
    assert answer.status == 200
    assert not answer.closes
    await raw.aclose()


async def test_an_expectation_other_than_100_continue_is_417_unread_and_the_connection_closed(
    server: RunningServer,
) -> None:
    body = json.dumps(ADD_SUB_BODY).encode()
    for expect, unmet in [
        ("something", "something"),
        ("100-continue, foo", "foo"),
        # RFC 9110 5.6: a comma in a quoted string is the value's, not the list's.
        ('foo="a,b", 100-continue', 'foo="a,b"'),
        ('100-continue, foo="x, 100-continue"', 'foo="x, 100-continue"'),
        # 100-continue has no parameters: one with some is another expectation.
        ("100-continue;a=b", "100-continue;a=b"),
        ("foo=" + "a" * 4000, "foo=" + "a" * 60 + "..."),
    ]:
        # The body follows its head at once: it is not read, and nothing after it is served.
        answer = await exchange(
            server, infer(body, f"Expect: {expect}", model="add_sub") + SMUGGLED
        )
        assert answer.status == 417, answer
        assert answer.error() == (
            f"the expectation {unmet!r} cannot be met; "
            "the one expectation this server meets is 100-continue"
        )
    # Any body counts, whatever the method, and a chunked one however short.
    for request in (
        head("GET", "/v2/health/live", "Content-Length: 2", "Expect: something") + b"{}",
        chunked("/v2/repository/index", b"0\r\n\r\n", "Expect: something"),
    ):
        answer = await exchange(server, request + SMUGGLED)
        assert answer.status == 417, answer
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.http_port}") as client:
        for expect in ("something", "100-continue, foo"):
            refused = await client.post(
                "/v2/models/add_sub/infer", json=ADD_SUB_BODY, headers={"Expect": expect}
            )
            assert refused.status_code == 417, refused.text
            assert refused.headers["connection"] == "close"
        # 100-continue is met in any case, alone or in a list.
        for expect in ("100-Continue", "100-CONTINUE, 100-continue"):
            answer = await client.post(
                "/v2/models/add_sub/infer", json=ADD_SUB_BODY, headers={"Expect": expect}
            )
            assert answer.status_code == 200, answer.text
    assert started(server) == 2
    await continued_and_kept(server, "100-Continue")
    # Expect is HTTP/1.1's: an HTTP/1.0 request's is ignored.
    answer = await exchange(
        server,
        infer(body, "Expect: something", model="add_sub").replace(b"HTTP/1.1", b"HTTP/1.0", 1),
    )
    assert answer.status == 200
    await Bystander(server).call()


async def test_an_expectation_other_than_100_continue_on_a_request_without_a_body_is_ignored(
    server: RunningServer,
) -> None:
    # As Triton's libevent, which reads Expect only before a body: each is served, and the
    # connection kept for the next.
    index = "/v2/repository/index"
    async with await Raw.open(server.http_port) as raw:
        for request, to_head in [
            (head("GET", "/v2/health/live", "Expect: something"), False),
            (head("HEAD", "/v2/health/live", "Expect: something"), True),
            (
                head("GET", "/v2/health/ready", "Content-Length: 0", "Expect: 100-continue, foo"),
                False,
            ),
            (head("POST", index, "Content-Length: 0", "Expect: something"), False),
            (head("POST", index, "Expect: foo=bar"), False),
        ]:
            await raw.send(request)
            answer = await raw.final(to_head=to_head)
            assert (answer.status, answer.closes) == (200, False), (request, answer)
        await raw.send(infer(json.dumps(ADD_SUB_BODY).encode(), model="add_sub"))
        answer = await raw.final()
        assert (answer.status, answer.closes) == (200, False), answer
    assert started(server) == 6


async def test_expect_100_continue_on_a_request_without_a_body_gets_no_interim_100(
    server: RunningServer,
) -> None:
    # RFC 9110 10.1.1: a 100 asks for a body; none is owed when the framing says there is none.
    index = "/v2/repository/index"
    async with await Raw.open(server.http_port) as raw:
        for request in [
            head("POST", index, "Content-Length: 0", "Expect: 100-continue"),
            head("POST", index, "Expect: 100-continue"),
            head("GET", "/v2/health/live", "Expect: 100-continue"),
            chunked(index, b"0\r\n\r\n", "Expect: 100-continue"),
        ]:
            await raw.send(request)
            with trio.fail_after(5):
                answer = await raw.response()
            assert answer is not None
            assert (answer.status, answer.closes) == (200, False), (request, answer)
    # A body yet to come still gets its 100.
    await continued_and_kept(server, "100-continue")


async def test_a_head_refused_before_any_handler_runs_is_answered_with_a_head_alone(
    server: RunningServer,
) -> None:
    # RFC 9110 9.3.2: no content follows the head of an answer to HEAD, refused or not.
    for request, status in [
        (head("HEAD", "/v2/health/live", "Content-Length: 5", "Expect: something"), 417),
        (head("HEAD", "/v2/health/live", "Host: y"), 400),
        (head("HEAD", "/v2/health/live", "Transfer-Encoding: gzip"), 501),
    ]:
        async with await Raw.open(server.http_port) as raw:
            await raw.send(request)
            with trio.fail_after(5):
                answer = await raw.final(to_head=True)
                assert (answer.status, answer.closes) == (status, True), answer
                # The length of the body a GET would get; the body itself is not sent.
                assert int(answer.headers["content-length"]) > 0
                await raw.ends()
    # The same refusal of a GET has its body.
    answer = await exchange(
        server, head("GET", "/v2/health/live", "Content-Length: 5", "Expect: something")
    )
    assert answer.status == 417
    assert answer.error().startswith("the expectation 'something' cannot be met")
    assert started(server) == 0


# -- chunked bodies ---------------------------------------------------------------------------


def chunked(path: str, chunks: bytes, *headers: str) -> bytes:
    return head("POST", path, "Transfer-Encoding: chunked", *headers) + chunks


async def test_chunk_extensions_and_trailers_are_served(server: RunningServer) -> None:
    body = json.dumps(ADD_SUB_BODY).encode()
    half = len(body) // 2
    raw = await Raw.open(server.http_port)
    await raw.send(
        chunked(
            "/v2/models/add_sub/infer",
            f"{half:x};name=value;flag\r\n".encode()
            + body[:half]
            + f'\r\n{len(body) - half:X};x="quoted"\r\n'.encode()
            + body[half:]
            + b"\r\n0\r\nX-Trailer: 1\r\nX-Other: 2\r\n\r\n",
        )
    )
    with trio.fail_after(10):
        answer = await raw.final()
    assert answer.status == 200, answer
    assert not answer.closes
    await raw.aclose()


@pytest.mark.parametrize(
    ("chunks", "status", "message"),
    [
        # A chunk size line of 40,000 hex digits: framing far over the head's bound, for one
        # byte of data.
        (b"0" * 40_000 + b"1\r\na\r\n0\r\n\r\n", 400, "malformed request body"),
        # A chunk size over 64 bits.
        (b"1" + b"0" * 16 + b"\r\na\r\n0\r\n\r\n", 400, "malformed request body"),
        (b"zz\r\nab\r\n0\r\n\r\n", 400, "malformed request body"),
        # A size line that never ends (its extension): framing over the head's bound.
        (b"1;" + b"x" * 70_000, 400, "malformed request body"),
        # Chunks announcing more than the limit.
        (b"ffffffffffffffff\r\n" + b"[" * 100, 408, "the request body did not arrive"),
        # A chunk that never ends, and a body without its last chunk.
        (b"100\r\nabc", 408, "the request body did not arrive"),
        (b"3\r\nabc\r\n", 408, "the request body did not arrive"),
        # A trailer line that never ends, after a megabyte of data: framing without data is
        # bounded like a head, whatever the data before it.
        (
            b"100000\r\n" + b" " * 0x100000 + b"\r\n0\r\nX: " + b"a" * 200_000,
            400,
            "malformed request body",
        ),
        # Trailers over the head's bound (they are counted, never kept).
        (b"0\r\n" + b"X-T: aaaaaaaaaa\r\n" * 60_000 + b"\r\n", 400, "malformed request body"),
    ],
)
async def test_malformed_or_unfinished_chunked_bodies_are_refused_and_free_the_budget(
    server: RunningServer, chunks: bytes, status: int, message: str
) -> None:
    bystander = Bystander(server)
    answer = await exchange(server, chunked("/v2/models/echo/infer", chunks))
    assert answer.status == status
    assert answer.error().startswith(message), answer.error()
    assert reserved(server) == 0
    await bystander.call()


# -- JSON and binary bombs --------------------------------------------------------------------


def tensor(shape: list[int], data: Any, datatype: str = "FP32") -> bytes:
    return json.dumps(
        {"inputs": [{"name": "x", "datatype": datatype, "shape": shape, "data": data}]}
    ).encode()


def nested(depth: int, count: int) -> bytes:
    """``data`` nested ``depth`` deep holding ``count`` numbers (simdjson's fast path looks at
    a body with more than 2,047 commas)."""
    return b"[" * depth + b"1," * (count - 1) + b"1" + b"]" * depth


JSON_BOMBS = [
    # (what, the body, the start of the error)
    ("100,000 [", b"[" * 100_000, "the request's JSON is malformed"),
    (
        "100,000 [ in a large tensor",
        b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [4096], "data": '
        + nested(100_000, 4096)
        + b"}]}",
        "the request's JSON is malformed",
    ),
    ("a shape of 2**62", tensor([2**62], [1]), "input 'x': shape [4611686018427387904] is too"),
    ("a shape over int64", tensor([2**40, 2**40], [1]), "input 'x': shape [1099511627776, 10"),
    ("a zero beside 2**62", tensor([0, 2**62], []), "input 'x': shape [0, 4611686018427387904]"),
    (
        "a dimension over 64 bits",
        tensor([2**64], [1]),
        "input 'x': 'shape' is [1.8446744073709552e+19]; it is a list of integers",
    ),
    ("33 dimensions", tensor([1] * 33, [1]), "input 'x': shape has 33 dimensions"),
    ("a negative dimension", tensor([-1], [1]), "input 'x': shape [-1] has a negative"),
    (
        "2**20 + 1 empty strings",
        tensor([2**20 + 1], [""] * (2**20 + 1), "BYTES"),
        "input 'x': shape [1048577] has 1048577 BYTES elements; at most 1048576",
    ),
    (
        "2**20 strings claimed, none sent",
        tensor([2**20], [], "BYTES"),
        "input 'x': data holds 0 values but shape [1048576] has 1048576 elements",
    ),
]


async def test_json_bombs_are_400_and_harm_nothing_else(server: RunningServer) -> None:
    bystander = Bystander(server)
    async with await Raw.open(server.http_port) as raw:
        for what, body, message in JSON_BOMBS:
            await raw.send(infer(body))
            with trio.fail_after(10):
                answer = await raw.final()
            assert answer.status == 400, (what, answer)
            assert answer.error().startswith(message), (what, answer.error()[:300])
            # One connection for them all: each 400 kept it.
            assert not answer.closes, what
        await bystander.call()
    assert reserved(server) == 0
    assert server.statistics().task_crashes == {"lane": 0, "batcher": 0, "models": 0}


async def test_a_shape_of_thousands_of_huge_dimensions_does_not_hold_the_event_loop(
    server: RunningServer,
) -> None:
    # 40,000 dimensions of 2**63 - 1 in 800 KB: their product, computed before the rank is
    # checked, is a 2.5-million-bit integer built one multiplication at a time (quadratic),
    # seconds of the event loop's thread for a request that is refused anyway.
    body = tensor([2**63 - 1] * 40_000, [1])
    hostile = await Raw.open(server.http_port)
    await hostile.send(infer(body))
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.http_port}") as client:
        assert (await client.get("/v2/health/live")).status_code == 200
    with trio.fail_after(5):
        answer = await hostile.final()
    assert answer.status == 400
    assert answer.error() == "input 'x': shape has 40000 dimensions; at most 32 are supported"
    # What kept the loop free: the fast path's gate reads the rank before it takes the product.
    assert not codec._is_large_numeric({"datatype": "FP32", "shape": [2] * 40})
    assert codec._is_large_numeric({"datatype": "FP32", "shape": [2] * 32})


def binary(json_part: dict[str, Any], data: bytes, length: str | None = None) -> bytes:
    text = json.dumps(json_part).encode()
    return infer(
        text + data,
        f"Inference-Header-Content-Length: {len(text) if length is None else length}",
    )


BINARY_INPUT = {
    "inputs": [
        {"name": "x", "datatype": "FP32", "shape": [4], "parameters": {"binary_data_size": 16}}
    ]
}


@pytest.mark.parametrize(
    ("request_bytes", "message"),
    [
        (
            binary(BINARY_INPUT, bytes(8)),
            "input 'x': 'binary_data_size' is 16 but only 8 bytes of the body are left for it",
        ),
        (
            binary(
                {
                    "inputs": [
                        {**BINARY_INPUT["inputs"][0], "parameters": {"binary_data_size": 2**70}}
                    ]
                },
                bytes(16),
            ),
            # orjson reads an integer over 64 bits as a float.
            "input 'x': parameter 'binary_data_size' is 1.1805916207174113e+21; it is a byte",
        ),
        (
            binary(
                {
                    "inputs": [
                        {**BINARY_INPUT["inputs"][0], "parameters": {"binary_data_size": -16}}
                    ]
                },
                b"",
            ),
            "input 'x': parameter 'binary_data_size' is -16",
        ),
        (
            binary(BINARY_INPUT, bytes(16), length="100000"),
            "Inference-Header-Content-Length is 100000 but the body has only",
        ),
        (binary(BINARY_INPUT, bytes(16), length="-1"), "inference-header-content-length must"),
        (binary(BINARY_INPUT, bytes(16), length="0x10"), "inference-header-content-length must"),
        # Digits to str.isdigit, not to int().
        (binary(BINARY_INPUT, bytes(16), length="\u00b2"), "inference-header-content-length must"),
        # More digits than int() converts (4,300).
        (binary(BINARY_INPUT, bytes(16), length="9" * 5000), "inference-header-content-length"),
        # Repeated, whether the values agree or not: which one a proxy in front would take is
        # unknown, as for Content-Length.
        *[
            (
                infer(
                    json.dumps(BINARY_INPUT).encode() + bytes(16),
                    f"Inference-Header-Content-Length: {len(json.dumps(BINARY_INPUT))}",
                    f"Inference-Header-Content-Length: {second}",
                ),
                "inference-header-content-length is sent 2 times; it is one number of bytes",
            )
            for second in (len(json.dumps(BINARY_INPUT)), 3)
        ],
        (
            binary(
                {
                    "inputs": [
                        {
                            "name": "x",
                            "datatype": "BYTES",
                            "shape": [3],
                            "parameters": {"binary_data_size": 8},
                        }
                    ]
                },
                (2**32 - 1).to_bytes(4, "little") + b"abcd",
            ),
            "the binary data of input 'x' holds 8 bytes, too few for the 3 length-prefixed BYTES "
            "elements",
        ),
    ],
)
async def test_binary_data_and_its_header_overrunning_the_body_are_400(
    server: RunningServer, request_bytes: bytes, message: str
) -> None:
    async with await Raw.open(server.http_port) as raw:
        await raw.send(request_bytes.replace("\u00b2".encode(), b"\xb2"))
        with trio.fail_after(10):
            answer = await raw.final()
        assert answer.status == 400, answer
        assert answer.error().startswith(message), answer.error()
    assert reserved(server) == 0
    await Bystander(server).call()


@pytest.mark.parametrize(
    "lengths",
    [["-1"], ["9" * 5000], ["16", "16"], ["16"], ["100000"]],
    ids=["negative", "too-many-digits", "repeated", "good", "past-the-body"],
)
async def test_a_body_that_does_not_arrive_is_408_whatever_its_header_length_says(
    server: RunningServer, lengths: list[str]
) -> None:
    # The header length is looked at before the body is read (where its binary part lands in
    # memory) and judged after it: the body's own fault is the answer.
    fields = [f"Inference-Header-Content-Length: {length}" for length in lengths]
    async with await Raw.open(server.http_port) as raw:
        await raw.send(head("POST", "/v2/models/echo/infer", "Content-Length: 1000", *fields))
        await raw.send(json.dumps(BINARY_INPUT).encode())
        with trio.fail_after(10):
            answer = await raw.final()
        assert answer.status == 408, answer
        assert answer.error().startswith("the request body did not arrive"), answer.error()
    assert reserved(server) == 0
    await Bystander(server).call()


async def test_a_body_sent_a_byte_at_a_time_is_read_whole_and_in_order(
    server: RunningServer,
) -> None:
    # Each byte is a piece of its own: held a few at a time, then moved to the body.
    x = np.arange(16, dtype=np.float32)
    document = {
        "inputs": [
            {"name": "x", "datatype": "FP32", "shape": [16], "parameters": {"binary_data_size": 64}}
        ],
        "parameters": {"binary_data_output": True},
    }
    text = json.dumps(document).encode()
    request = infer(text + x.tobytes(), f"Inference-Header-Content-Length: {len(text)}")
    async with await Raw.open(server.http_port) as raw:
        await raw.trickle(request, pause=0.001)
        with trio.fail_after(10):
            answer = await raw.final()
    assert answer.status == 200, answer
    json_length = int(answer.headers["inference-header-content-length"])
    np.testing.assert_array_equal(np.frombuffer(answer.body[json_length:], np.float32), x)
    assert reserved(server) == 0


# -- large announced bodies, received straight into their buffer ------------------------------


def binary_echo(x: np.ndarray) -> bytes:
    """An echo request with ``x`` (FP32) in binary after its JSON, answered in binary."""
    document = {
        "inputs": [
            {
                "name": "x",
                "datatype": "FP32",
                "shape": list(x.shape),
                "parameters": {"binary_data_size": x.nbytes},
            }
        ],
        "parameters": {"binary_data_output": True},
    }
    text = json.dumps(document).encode()
    return infer(text + x.tobytes(), f"Inference-Header-Content-Length: {len(text)}")


def echoed(answer: Response) -> np.ndarray:
    """The tensor a binary echo answer holds."""
    assert answer.status == 200, answer
    json_length = int(answer.headers["inference-header-content-length"])
    return np.frombuffer(answer.body[json_length:], np.float32)


#: 20,000 FP32 values: a body of about 80 KB, past the read size and past the straight bound.
LARGE = np.random.default_rng(7).standard_normal(20_000).astype(np.float32)


async def test_a_large_body_sent_a_byte_at_a_time_is_read_whole_and_in_order(
    nursery: trio.Nursery,
) -> None:
    # The receive timeout long enough for some 80,000 writes on a loaded machine.
    server = await start_server(nursery, workers=1, receive_timeout=60.0)
    x = LARGE[:5000]
    request = binary_echo(x)
    split = request.index(b"\r\n\r\n") + 4
    async with await Raw.open(server.http_port) as raw:
        await raw.send(request[:split])
        await raw.trickle(request[split:], pause=0)
        with trio.fail_after(60):
            answer = await raw.final()
        np.testing.assert_array_equal(echoed(answer), x)
        # The connection carries the next request: the parser is in step after the body.
        await raw.send(binary_echo(LARGE))
        with trio.fail_after(10):
            np.testing.assert_array_equal(echoed(await raw.final()), LARGE)
    assert reserved(server) == 0


async def test_requests_after_a_large_body_in_the_same_read_as_its_end_are_answered_in_order(
    server: RunningServer,
) -> None:
    large = binary_echo(LARGE)
    small = infer(json.dumps(ADD_SUB_BODY).encode(), model="add_sub")
    async with await Raw.open(server.http_port) as raw:
        # All of it at once: the large body's end, and what follows, buffered with its head.
        await raw.send(large + small + large)
        with trio.fail_after(10):
            np.testing.assert_array_equal(echoed(await raw.final()), LARGE)
            assert (await raw.final()).status == 200
            np.testing.assert_array_equal(echoed(await raw.final()), LARGE)
        # The large body's start first, then its last bytes with the next request in one write:
        # what the server reads of the body after its head is never more than the body.
        await raw.send(large[:-100])
        await eventually(lambda: reserved(server) >= len(LARGE.tobytes()))
        await raw.send(large[-100:] + small + head("GET", "/v2/health/live"))
        with trio.fail_after(10):
            np.testing.assert_array_equal(echoed(await raw.final()), LARGE)
            second = await raw.final()
            assert second.status == 200
            assert json.loads(second.body)["outputs"][0]["data"][:3] == [1.0, 2.0, 3.0]
            assert (await raw.final()).status == 200
    assert reserved(server) == 0


async def test_a_head_longer_than_one_read_then_a_large_body_are_served(
    server: RunningServer,
) -> None:
    # A head of nearly the maximum takes two of the reads that wait for a head; the body after
    # it, partly read with the head's end, is read whole.
    request = binary_echo(LARGE)
    split = request.index(b"\r\n")
    padding = f"\r\nX-Pad: {'a' * 16_000}".encode()
    async with await Raw.open(server.http_port) as raw:
        await raw.send(request[:split] + padding + request[split:])
        with trio.fail_after(10):
            np.testing.assert_array_equal(echoed(await raw.final()), LARGE)
    assert reserved(server) == 0


async def test_a_large_body_sent_after_100_continue_is_read_whole(server: RunningServer) -> None:
    request = binary_echo(LARGE)
    split = request.index(b"\r\n\r\n") + 2
    async with await Raw.open(server.http_port) as raw:
        # The head alone, asking to continue; the body only once told to.
        await raw.send(request[:split] + b"Expect: 100-continue\r\n\r\n")
        with trio.fail_after(10):
            interim = await raw.response()
            assert interim is not None
            assert interim.status == 100
            await raw.send(request[split + 2 :])
            np.testing.assert_array_equal(echoed(await raw.final()), LARGE)
    assert reserved(server) == 0


def echo_requests(server: RunningServer) -> int:
    """The requests the echo model's core has ended, whatever their status."""
    (statistics,) = server.core.model_statistics("echo")
    return sum(statistics.requests.values())


@pytest.mark.parametrize("ending", ["end", "reset of a second request"])
@pytest.mark.parametrize("size", [4_096, len(LARGE), 262_000])
async def test_a_client_that_ends_in_the_middle_of_a_large_body_is_gone_and_holds_nothing(
    server: RunningServer, ending: str, size: int
) -> None:
    # Bodies just past the smaller straight bound, past the read size, and just under the
    # larger bound: what is left unread of a body never reaches the model.
    bystander = Bystander(server)
    x = np.random.default_rng(size).standard_normal(size).astype(np.float32)
    request = binary_echo(x)
    async with await Raw.open(server.http_port) as raw:
        if ending != "end":
            # A first request read whole: its socket is watched for its end from then on.
            await raw.send(request)
            with trio.fail_after(10):
                np.testing.assert_array_equal(echoed(await raw.final()), x)
        before = echo_requests(server)
        await raw.send(request[: len(request) // 2])
        await eventually(lambda: reserved(server) >= x.nbytes)
        if ending == "end":
            await raw.stream.send_eof()
            # Gone: nothing is answered, and the connection ends.
            with trio.fail_after(10):
                await raw.ends()
        else:
            # Closed with a reset (no linger) as it leaves this block.
            linger = struct.pack("ii", 1, 0)
            raw.stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)
    await eventually(lambda: reserved(server) == 0)
    await eventually(lambda: connections(server) == 0)
    await bystander.call()
    assert echo_requests(server) == before


@pytest.mark.parametrize("length", [16_383, 16_384, 16_385, MiB - 1, MiB, MiB + 1])
async def test_a_body_either_side_of_the_straight_bounds_is_read_whole_then_the_next_request(
    server: RunningServer, length: int
) -> None:
    # The head and the start of the body in one write, the rest of it with a health check
    # after it in the next: the body is read to its last byte and no further.
    # Room for the JSON before the tensor, which is padded to make up the length.
    x = np.random.default_rng(length).standard_normal((length - 512) // 4).astype(np.float32)
    document = {
        "inputs": [
            {
                "name": "x",
                "datatype": "FP32",
                "shape": [len(x)],
                "parameters": {"binary_data_size": x.nbytes},
            }
        ],
        "parameters": {"binary_data_output": True},
    }
    text = json.dumps(document).encode()
    text += b" " * (length - len(text) - x.nbytes)  # JSON's trailing whitespace
    request = infer(text + x.tobytes(), f"Inference-Header-Content-Length: {len(text)}")
    assert int(request.split(b"Content-Length: ")[1].split(b"\r\n")[0]) == length
    split = request.index(b"\r\n\r\n") + 4 + 1000
    async with await Raw.open(server.http_port) as raw:
        await raw.send(request[:split])
        await eventually(lambda: reserved(server) >= length)
        await raw.send(request[split:] + head("GET", "/v2/health/live"))
        with trio.fail_after(10):
            np.testing.assert_array_equal(echoed(await raw.final()), x)
            assert (await raw.final()).status == 200
    assert reserved(server) == 0


async def test_a_large_body_that_stops_arriving_is_408_and_holds_nothing(
    server: RunningServer,
) -> None:
    request = binary_echo(LARGE)
    async with await Raw.open(server.http_port) as raw:
        # More than its head read, less than all of it: the rest is waited for, and never comes.
        await raw.send(request[:70_000])
        with trio.fail_after(10):
            answer = await raw.final()
            assert answer.status == 408, answer
            assert answer.error() == "the request body did not arrive within 1 s"
            assert answer.closes
            await raw.ends()
    assert reserved(server) == 0
    await Bystander(server).call()


async def test_a_large_content_length_over_the_limit_is_refused_before_the_body_is_read(
    nursery: trio.Nursery,
) -> None:
    server = await start_server(nursery, workers=1, max_message_size=64 * 1024, **TIMEOUTS)
    request = binary_echo(LARGE)
    async with await Raw.open(server.http_port) as raw:
        # The head alone: the answer does not wait for the body.
        await raw.send(request[: request.index(b"\r\n\r\n") + 4])
        with trio.fail_after(10):
            answer = await raw.final()
            assert answer.status == 413, answer
            assert answer.error().endswith("larger than the maximum of 65536 bytes")
            assert answer.closes
    assert reserved(server) == 0
    await Bystander(server).call()


def send_whole_then_read(port: int, request: bytes) -> bytes:
    """Send all of ``request`` before reading anything, as a client that writes its whole
    request first does; then what the server sent until it closed. A reset fails the call."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(10)
        sock.sendall(request)
        sock.shutdown(socket.SHUT_WR)
        received = b""
        while data := sock.recv(65536):
            received += data
    return received


@pytest.mark.parametrize(("header", "status"), [("X-Filler: 1", 413), ("Expect: something", 417)])
async def test_a_body_refused_unread_and_sent_anyway_does_not_reset_its_answer_away(
    nursery: trio.Nursery, header: str, status: int
) -> None:
    # Refused from its head (a 413 for its length over the limit, a 417 for its expectation),
    # the body is still sent, whole, before the client reads: the server drops it as it
    # closes, so that the close is no reset and the answer is there to read.
    server = await start_server(nursery, workers=1, max_message_size=64 * 1024, **TIMEOUTS)
    body = bytes(512 * 1024) if status == 413 else bytes(32 * 1024)
    received = await trio.to_thread.run_sync(
        send_whole_then_read, server.http_port, infer(body, header)
    )
    fields, _, answer = received.partition(b"\r\n\r\n")
    assert fields.startswith(f"HTTP/1.1 {status} ".encode()), received[:200]
    assert b"\r\nconnection: close" in fields
    assert f"\r\ncontent-length: {len(answer)}".encode() in fields
    assert reserved(server) == 0
    await Bystander(server).call()


def _tritonclient_large_binary(port: int, x: np.ndarray) -> list[np.ndarray]:
    """``x`` sent to echo with tritonclient.http's binary extension, under JSON parts of 17
    lengths (the binary part at every offset modulo 16), and the tensors answered."""
    client = httpclient.InferenceServerClient(f"127.0.0.1:{port}")
    try:
        answers = []
        for length in range(17):
            given = httpclient.InferInput("x", list(x.shape), "FP32")
            given.set_data_from_numpy(x, binary_data=True)
            wanted = [httpclient.InferRequestedOutput("x", binary_data=True)]
            answer = client.infer("echo", [given], outputs=wanted, request_id="i" * length)
            answers.append(answer.as_numpy("x"))
        return answers
    finally:
        client.close()


async def test_a_large_binary_input_from_tritonclient_is_read_alike_at_every_offset(
    server: RunningServer,
) -> None:
    assert server.http_port is not None
    x = LARGE.reshape(80, 250)
    answers = await trio.to_thread.run_sync(_tritonclient_large_binary, server.http_port, x)
    for answer in answers:
        np.testing.assert_array_equal(answer, x)


@pytest.mark.parametrize("padding", [" ", "   ", "\t", " \t "])
async def test_whitespace_after_a_header_s_value_is_not_part_of_it(
    server: RunningServer, padding: str
) -> None:
    # RFC 9110 5.5: a field value does not include the whitespace around it (the parser drops
    # what comes before the value, not what comes after it).
    x = np.arange(4, dtype=np.float32)
    text = json.dumps(BINARY_INPUT).encode()
    request = infer(
        text + x.tobytes(),
        f"Inference-Header-Content-Length: {len(text)}{padding}",
        f"X-Request-Id: r1{padding}",
    )
    async with await Raw.open(server.http_port) as raw:
        await raw.send(request)
        with trio.fail_after(10):
            answer = await raw.final()
    assert answer.status == 200, answer
    assert answer.headers["x-request-id"] == "r1"
    [output] = json.loads(answer.body)["outputs"]
    assert output["data"] == x.tolist()


async def test_a_60_mb_json_body_over_the_budget_parsed_is_413_before_it_is_parsed(
    nursery: trio.Nursery,
) -> None:
    # 60 MB of JSON numbers: 180 MB reserved while it is read fits a 1 GiB budget; the parse,
    # reserved at 24 bytes a byte (1.4 GB) before it starts, does not.
    budget = 1024 * MiB
    # 60 MB takes seconds to arrive on a busy 2-core machine: the receive timeout is not what
    # this test is about.
    timeouts = {**TIMEOUTS, "receive_timeout": 30.0}
    server = await start_server(
        nursery, workers=1, memory_budget=budget, max_connection_bytes=budget, **timeouts
    )
    count = 30_000_000
    body = b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [%d], "data": [' % count
    body += b"0," * (count - 1) + b"0]}]}"
    assert len(body) > 60_000_000
    bystander = Bystander(server)
    async with trio.open_nursery() as calls:
        await calls.start(bystander.keep_calling)
        async with await Raw.open(server.http_port) as raw:
            await raw.send(infer(body))
            # A guard against a hang, not a measure: the 60 MB are read and counted first,
            # which took over 20 s once on a machine shared with three other test runs.
            with trio.fail_after(120):
                answer = await raw.final()
            # No budget this size holds it parsed, now or later: 413, not 429's "retry".
            assert answer.status == 413, answer
            assert "more than the whole memory budget" in answer.error(), answer.error()
            # The body was read whole: the connection goes on.
            assert not answer.closes
            await raw.send(infer(json.dumps(ADD_SUB_BODY).encode(), model="add_sub"))
            assert (await raw.final()).status == 200
        bystander.stopping = True
    assert bystander.calls >= 1
    assert reserved(server) == 0


async def test_a_body_larger_than_a_bound_is_413_and_one_a_full_budget_cannot_take_now_429(
    nursery: trio.Nursery,
) -> None:
    # Requests reserve three times their body; a 2 MiB budget lets 512 KiB wait for room.
    server = await start_server(nursery, workers=1, memory_budget=2 * MiB, max_connection_bytes=MiB)
    path = "/v2/models/echo/infer"
    # Larger than the whole budget, or than a connection's share: refused from its head, the
    # body unread (the connection closes), each naming its bound.
    answer = await exchange(server, head("POST", path, f"Content-Length: {MiB}"))
    assert answer.status == 413, answer
    assert "more than the whole memory budget" in answer.error(), answer.error()
    assert "--memory-budget" in answer.error()
    answer = await exchange(server, head("POST", path, f"Content-Length: {MiB // 3 + 1}"))
    assert answer.status == 413, answer
    assert "--max-connection-bytes" in answer.error(), answer.error()
    # A chunked body is counted as it arrives: 413 once it alone outgrows the share.
    async with await Raw.open(server.http_port) as raw:
        await raw.send(head("POST", path, "Transfer-Encoding: chunked"))
        piece = b"%x\r\n%s\r\n" % (100_000, b" " * 100_000)
        with trio.fail_after(10):
            for _ in range(4):
                await raw.send(piece)
            answer = await raw.final()
        assert answer.status == 413, answer
        assert "--max-connection-bytes" in answer.error(), answer.error()
    # Room other requests hold is room later: 429 for one too large to wait for it (two
    # connections hold all but 56 KiB while their bodies are due; the third needs 600 KB).
    holders = [await Raw.open(server.http_port) for _ in range(2)]
    try:
        for holder in holders:
            await holder.send(head("POST", path, "Content-Length: 340000"))
        await eventually(lambda: reserved(server) == 2 * 3 * 340_000)
        answer = await exchange(server, head("POST", path, "Content-Length: 200000"))
        assert answer.status == 429, answer
        assert "memory budget full" in answer.error(), answer.error()
    finally:
        for holder in holders:
            await holder.aclose()
    await eventually(lambda: reserved(server) == 0)
    # tritonclient.http with a JSON tensor whose body fits but whose parse never can (24 bytes
    # a byte of JSON): the client is told 413 and why, on a connection that goes on.
    assert server.http_port is not None
    status, message, served = await trio.to_thread.run_sync(
        _tritonclient_json_over_budget, server.http_port
    )
    assert status == "413", (status, message)
    assert "more than the whole memory budget" in message, message
    np.testing.assert_array_equal(served, np.arange(4, dtype=np.float32))
    assert reserved(server) == 0
    # Nothing else was harmed: a call that fits is served.
    await Bystander(server).call()


def _tritonclient_json_over_budget(port: int) -> tuple[str | None, str, np.ndarray]:
    """echo sent 30,000 FP32 elements as JSON (about 150 KB, parsed about 3.6 MB) by
    tritonclient.http, then 4 on the same client: the first's status and message, the second's
    answer."""
    client = httpclient.InferenceServerClient(f"127.0.0.1:{port}")
    try:
        large = httpclient.InferInput("x", [30_000], "FP32")
        large.set_data_from_numpy(np.full(30_000, 0.5, np.float32), binary_data=False)
        with pytest.raises(InferenceServerException) as refused:
            client.infer("echo", [large])
        small = httpclient.InferInput("x", [4], "FP32")
        small.set_data_from_numpy(np.arange(4, dtype=np.float32), binary_data=False)
        served = client.infer("echo", [small]).as_numpy("x")
        assert served is not None
        return refused.value.status(), refused.value.message(), served
    finally:
        client.close()


# -- pipelining -------------------------------------------------------------------------------


async def test_pipelined_requests_are_answered_each_in_order(server: RunningServer) -> None:
    paths = ["/v2/health/live", "/v2/models/nope", "/v2", "/v2/models/add_sub/ready"]
    statuses = {"/v2/health/live": 200, "/v2/models/nope": 404, "/v2": 200}
    count = 2000
    body = json.dumps(ADD_SUB_BODY).encode()
    data = b"".join(
        head("GET", paths[i % 4], f"X-Request-Id: r{i}")
        if i % 100
        else infer(body, f"X-Request-Id: r{i}", model="add_sub")
        for i in range(count)
    )
    async with await Raw.open(server.http_port) as raw:
        await raw.send(data)  # one write
        with trio.fail_after(30):
            for i in range(count):
                answer = await raw.final()
                assert answer.headers["x-request-id"] == f"r{i}"
                expected = 200 if i % 100 == 0 else statuses.get(paths[i % 4], 200)
                assert answer.status == expected, (i, answer)
                assert not answer.closes
    assert started(server) == count


async def test_requests_pipelined_behind_a_chunked_body_are_answered_in_order(
    server: RunningServer,
) -> None:
    # A chunked body's end is found only by parsing it: what follows it in the same write (here
    # requests of every kind, another chunked one among them) is parsed ahead and answered
    # in turn, none lost and none answered twice.
    body = json.dumps(ADD_SUB_BODY).encode()
    chunks = f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"
    requests = []
    for i in range(60):
        kind = i % 3
        if kind == 0:
            requests.append(chunked("/v2/models/add_sub/infer", chunks, f"X-Request-Id: r{i}"))
        elif kind == 1:
            requests.append(head("GET", "/v2/health/live", f"X-Request-Id: r{i}"))
        else:
            requests.append(infer(body, f"X-Request-Id: r{i}", model="add_sub"))
    async with await Raw.open(server.http_port) as raw:
        await raw.send(b"".join(requests))
        with trio.fail_after(30):
            for i in range(60):
                answer = await raw.final()
                assert (answer.status, answer.headers["x-request-id"]) == (200, f"r{i}"), answer
                assert not answer.closes
    assert started(server) == 60


async def test_a_head_and_a_body_split_anywhere_across_reads_are_served(
    server: RunningServer,
) -> None:
    body = json.dumps(ADD_SUB_BODY).encode()
    request = infer(body, "X-Request-Id: split", model="add_sub")
    end_of_head = request.index(b"\r\n\r\n")
    async with await Raw.open(server.http_port) as raw:
        # Cut through the blank line that ends the head, at each of its bytes, and mid-body.
        for cut in range(end_of_head, end_of_head + 5):
            for piece in (request[:cut], request[cut : cut + 7], request[cut + 7 :]):
                await raw.send(piece)
                await trio.sleep(0.01)
            with trio.fail_after(5):
                answer = await raw.final()
            assert (answer.status, answer.headers["x-request-id"]) == (200, "split"), cut
        # A chunked body of one-byte chunks (five bytes of framing a byte) is within bounds.
        one_byte_chunks = b"".join(b"1\r\n" + body[i : i + 1] + b"\r\n" for i in range(len(body)))
        await raw.send(chunked("/v2/models/add_sub/infer", one_byte_chunks + b"0\r\n\r\n"))
        with trio.fail_after(5):
            answer = await raw.final()
        assert answer.status == 200, answer
        assert not answer.closes


VERSIONS_AND_UPGRADES = [
    # (what, the bytes, the status, whether the connection is kept)
    ("HTTP/1.0", b"GET /v2/health/live HTTP/1.0\r\n\r\n", 200, False),
    (
        "HTTP/1.0 keep-alive",
        b"GET /v2/health/live HTTP/1.0\r\nConnection: keep-alive\r\n\r\n",
        200,
        True,
    ),
    (
        "HTTP/1.0 keep-alive, an inference",
        b"POST /v2/models/add_sub/infer HTTP/1.0\r\nConnection: keep-alive\r\n"
        + f"Content-Length: {len(ADD_SUB_JSON)}\r\n\r\n".encode()
        + ADD_SUB_JSON,
        200,
        True,
    ),
    (
        "HTTP/1.0 keep-alive, an error",
        b"GET /v2/models/nope HTTP/1.0\r\nConnection: keep-alive\r\n\r\n",
        404,
        True,
    ),
    ("HTTP/1.1 Connection: close", head("GET", "/v2/health/live", "Connection: close"), 200, False),
    ("HTTP/2.0 as a request line", b"GET /v2/health/live HTTP/2.0\r\nHost: x\r\n\r\n", 505, False),
    ("HTTP/0.9 as a request line", b"GET /v2/health/live HTTP/0.9\r\nHost: x\r\n\r\n", 505, False),
    # llhttp knows no other versions: the request line is malformed.
    ("HTTP/1.2 as a request line", b"GET /v2/health/live HTTP/1.2\r\nHost: x\r\n\r\n", 400, False),
    ("HTTP/3.0 as a request line", b"GET /v2/health/live HTTP/3.0\r\nHost: x\r\n\r\n", 400, False),
    ("HTTP/2 prior knowledge", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 400, False),
    ("two Host headers", head("GET", "/v2/health/live", "Host: y"), 400, False),
    (
        "an upgrade to websocket",
        head("GET", "/v2/health/live", "Connection: Upgrade", "Upgrade: websocket"),
        200,
        False,
    ),
    ("CONNECT", b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n", 404, False),
    # RFC 9112 6.1: an HTTP/1.0 message with Transfer-Encoding has faulty framing (an HTTP/1.0
    # proxy would not have read it so): served, then the connection closes.
    (
        "HTTP/1.0 chunked, keep-alive",
        b"POST /v2/models/add_sub/infer HTTP/1.0\r\nConnection: keep-alive\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n"
        + f"{len(ADD_SUB_JSON):x}\r\n".encode()
        + ADD_SUB_JSON
        + b"\r\n0\r\n\r\n",
        200,
        False,
    ),
    # llhttp does not parse the body of a request to switch protocols: refused, not served
    # as if it had none.
    (
        "an upgrade with a body",
        infer(ADD_SUB_JSON, "Connection: Upgrade", "Upgrade: foo", model="add_sub"),
        400,
        False,
    ),
]


@pytest.mark.parametrize(
    ("what", "data", "status", "kept"),
    VERSIONS_AND_UPGRADES,
    ids=[v[0] for v in VERSIONS_AND_UPGRADES],
)
async def test_versions_and_upgrades_are_answered_and_closed_unless_kept_alive(
    server: RunningServer, what: str, data: bytes, status: int, kept: bool
) -> None:
    async with await Raw.open(server.http_port) as raw:
        # What follows is never taken for a request when the connection is not kept.
        await raw.send(data + head("GET", "/v2/health/live", "X-Request-Id: after"))
        with trio.fail_after(5):
            answer = await raw.final()
            assert answer.status == status, answer
            # RFC 9112 9.3: an HTTP/1.0 client keeps the connection only when told it is kept;
            # untold, it would wait for the server to close it.
            told = "keep-alive" if kept and data.split(b"\r\n")[0].endswith(b"HTTP/1.0") else None
            assert answer.headers.get("connection") == (told if kept else "close"), answer
            if kept:
                after = await raw.final()
                assert (after.status, after.headers["x-request-id"]) == (200, "after")
            else:
                await raw.ends()
    await Bystander(server).call()


COMPRESSED_BODIES = [
    # (what, the coding, the body as sent, the status, the start of the error)
    ("gzip", "gzip", gzip.compress(ADD_SUB_JSON), 200, ""),
    ("deflate (zlib)", "deflate", zlib.compress(ADD_SUB_JSON), 200, ""),
    ("identity", "identity", ADD_SUB_JSON, 200, ""),
    ("x-gzip", "x-gzip", gzip.compress(ADD_SUB_JSON), 200, ""),
    ("brotli", "br", ADD_SUB_JSON, 415, "the request body's Content-Encoding 'br'"),
    ("two codings", "gzip, gzip", ADD_SUB_JSON, 415, "the request body's Content-Encoding"),
    ("not gzip", "gzip", ADD_SUB_JSON, 400, "malformed request body: its gzip data is corrupt"),
    (
        "cut short",
        "gzip",
        gzip.compress(ADD_SUB_JSON)[:-12],
        400,
        "malformed request body: its gzip data ends before",
    ),
    (
        "bytes after the stream",
        "deflate",
        zlib.compress(ADD_SUB_JSON) + b"GET / HTTP/1.1\r\n\r\n",
        400,
        "malformed request body: bytes after the end",
    ),
    # Raw deflate without zlib's header: not what HTTP's deflate is.
    ("raw deflate", "deflate", zlib.compress(ADD_SUB_JSON)[2:-4], 400, "malformed request body"),
]


@pytest.mark.parametrize(
    ("what", "coding", "body", "status", "message"),
    COMPRESSED_BODIES,
    ids=[c[0] for c in COMPRESSED_BODIES],
)
async def test_compressed_bodies_are_decoded_or_refused_precisely(
    server: RunningServer, what: str, coding: str, body: bytes, status: int, message: str
) -> None:
    async with await Raw.open(server.http_port) as raw:
        await raw.send(infer(body, f"Content-Encoding: {coding}", model="add_sub"))
        with trio.fail_after(5):
            answer = await raw.final()
        assert answer.status == status, answer
        if status == 200:
            assert json.loads(answer.body)["outputs"][0]["data"] == [i + 1 for i in range(16)]
        else:
            assert answer.error().startswith(message), answer.error()
    assert reserved(server) == 0
    await Bystander(server).call()


async def test_unfinished_compressed_bodies_hold_only_what_was_sent(server: RunningServer) -> None:
    # Nothing is decoded before a body has arrived whole: a few KB of gzip that would decode to
    # megabytes, never finished, holds (and reserves) its few KB, not the megabytes.
    compressor = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    partial = compressor.compress(bytes(8 * MiB)) + compressor.flush(zlib.Z_SYNC_FLUSH)
    assert len(partial) < 16 * 1024
    bystander = Bystander(server)
    opened = []
    try:
        for _ in range(20):
            raw = await Raw.open(server.http_port)
            opened.append(raw)
            await raw.send(
                infer(partial, "Content-Encoding: gzip")[: -len(partial)].replace(
                    f"Content-Length: {len(partial)}".encode(),
                    f"Content-Length: {len(partial) + 100}".encode(),
                )
                + partial
            )
        await eventually(lambda: started(server) == 20)
        # At most a few bytes reserved per byte sent (RESERVED_PER_BYTE), not per byte decoded.
        assert 0 < reserved(server) <= 20 * (len(partial) + 100) * 4
        await bystander.call()
    finally:
        for raw in opened:
            await raw.aclose()
    await eventually(lambda: reserved(server) == 0)


async def test_repeated_content_encoding_headers_are_one_list(server: RunningServer) -> None:
    # RFC 9110 5.3: "gzip" then "br" is the list "gzip, br": refused, not decoded as gzip alone.
    body = gzip.compress(ADD_SUB_JSON)
    for second in ("br", "gzip", "identity"):
        async with await Raw.open(server.http_port) as raw:
            codings = ("Content-Encoding: gzip", f"Content-Encoding: {second}")
            await raw.send(infer(body, *codings, model="add_sub"))
            with trio.fail_after(5):
                answer = await raw.final()
        assert answer.status == 415, (second, answer)
        assert answer.error().startswith(f"the request body's Content-Encoding 'gzip, {second}'")


async def test_a_compression_bomb_is_413_as_it_decodes_and_holds_nothing(
    nursery: trio.Nursery,
) -> None:
    # 1 GiB of zeros is about 1 MB of gzip; the decoded bound (here 8 MiB) is kept as it is
    # decoded, chunked or not, so the server never holds more than the bound.
    server = await start_server(nursery, workers=1, max_message_size=8 * MiB, **TIMEOUTS)
    compressor = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    zeros = bytes(MiB)
    bomb = b"".join(compressor.compress(zeros) for _ in range(1024)) + compressor.flush()
    assert len(bomb) < 2 * MiB
    bystander = Bystander(server)
    for framing in ("length", "chunked"):
        if framing == "length":
            data = infer(bomb, "Content-Encoding: gzip")
        else:
            data = chunked(
                "/v2/models/echo/infer",
                f"{len(bomb):x}\r\n".encode() + bomb + b"\r\n0\r\n\r\n",
                "Content-Encoding: gzip",
            )
        async with await Raw.open(server.http_port) as raw:
            await raw.send(data)
            with trio.fail_after(10):
                answer = await raw.final()
        assert answer.status == 413, (framing, answer)
        assert answer.error() == (
            f"the request body is larger than the maximum of {8 * MiB} bytes decoded"
        )
        assert reserved(server) == 0
    await bystander.call()


async def test_a_client_that_pipelines_10000_requests_and_reads_nothing_is_bounded(
    server: RunningServer,
) -> None:
    # /metrics answers are some 35 KB each: the answers to the first hundred or so fill the
    # sockets' buffers, and the server then reads no more requests; after the send timeout
    # the connection is closed.
    request = head("GET", "/metrics")
    bystander = Bystander(server)
    http = server._http
    assert http is not None
    raw = await Raw.open(server.http_port)
    buffered = 0
    async with trio.open_nursery() as nursery:

        async def pipeline() -> None:
            with contextlib.suppress(trio.BrokenResourceError):
                await raw.send(request * 10_000)  # one write (it blocks once buffers are full)

        nursery.start_soon(pipeline)

        async def watch() -> None:
            nonlocal buffered
            while True:
                for connection in http._connections:
                    buffered = max(buffered, connection.buffered)
                await trio.sleep(0.01)

        nursery.start_soon(watch)
        await eventually(lambda: started(server) > 0)
        await bystander.call()
        # The connection ends once the server has waited the send timeout for the client.
        await eventually(lambda: connections(server) == 0, within=10)
        nursery.cancel_scope.cancel()
    # What was held of the requests not yet served: at most a read and an incomplete head.
    assert buffered <= 64 * 1024 + 16 * 1024
    # Most of the 10,000 were never read, let alone served.
    assert started(server) < 2000
    await bystander.call()


async def test_a_client_that_never_reads_a_large_answer_loses_it_after_the_send_timeout(
    server: RunningServer,
) -> None:
    # 32 MiB back from echo, binary: far more than the sockets' buffers hold.
    x = np.zeros(8 * MiB, dtype=np.float32)
    json_part = json.dumps(
        {
            "inputs": [
                {
                    "name": "x",
                    "datatype": "FP32",
                    "shape": [x.size],
                    "parameters": {"binary_data_size": x.nbytes},
                }
            ],
            "parameters": {"binary_data_output": True},
        }
    ).encode()
    bystander = Bystander(server)
    raw = await Raw.open(server.http_port, receive_buffer=4096)
    await raw.send(
        infer(json_part + x.tobytes(), f"Inference-Header-Content-Length: {len(json_part)}")
    )
    # The answer holds its reservation while it waits for the client...
    await eventually(lambda: started(server) == 1 and server.statistics().pool.busy == 0)
    assert reserved(server) > 0
    await bystander.call()
    # ...until the send timeout: the client is taken as gone, the connection closed.
    await eventually(lambda: connections(server) == 0, within=10)
    assert reserved(server) == 0
    await bystander.call()


# -- many connections -------------------------------------------------------------------------


async def test_hundreds_of_idle_connections_are_held_only_for_the_timeouts(
    server: RunningServer,
) -> None:
    bystander = Bystander(server)
    silent = [await Raw.open(server.http_port) for _ in range(200)]
    kept = [await Raw.open(server.http_port) for _ in range(200)]
    for raw in kept:
        await raw.send(head("GET", "/v2/health/live"))
    for raw in kept:
        assert (await raw.final()).status == 200
    await eventually(lambda: connections(server) == 400)
    await bystander.call()
    # The silent ones go at the handshake timeout, the kept-alive ones at the idle timeout
    # (both short here: without them, they would stay open past the wait).
    await eventually(lambda: connections(server) == 0, within=10)
    with trio.fail_after(5):
        for raw in silent + kept:
            await raw.ends()
    await bystander.call()


async def test_absolute_form_targets_are_served_as_their_path(server: RunningServer) -> None:
    # RFC 9112 3.2.2: a server must accept a target in absolute form, as a client that speaks
    # to a proxy sends it, and take the host from it: the host is not looked at here (every
    # host is served), the path and query are served as an origin-form target's.
    port = server.http_port
    async with await Raw.open(port) as raw:
        for target, status, error in [
            (f"http://127.0.0.1:{port}/v2/health/live", 200, None),
            ("HTTP://elsewhere.example/v2/models/add_sub/ready?x=1", 200, None),
            ("https://x/v2/models/a%2Fb", 404, "Request for unknown model: 'a/b' is not found"),
            ("http://x", 404, "no such endpoint: GET /"),
            ("http://x?v2", 404, "no such endpoint: GET /"),
            # Not absolute-form: served as written.
            ("ftp://x/v2/health/live", 404, "no such endpoint: GET ftp://x/v2/health/live"),
        ]:
            await raw.send(head("GET", target))
            with trio.fail_after(5):
                answer = await raw.final()
            assert answer.status == status, (target, answer)
            assert not answer.closes, target
            if error is not None:
                assert answer.error() == error, target
        await raw.send(post("http://x/v2/models/add_sub/infer", ADD_SUB_JSON))
        with trio.fail_after(10):
            answer = await raw.final()
        assert answer.status == 200, answer
        assert json.loads(answer.body)["outputs"][0]["data"] == [float(i + 1) for i in range(16)]
    assert started(server) == 7


# -- methods ----------------------------------------------------------------------------------


async def test_head_options_and_methods_not_served_are_answered_and_the_connection_kept(
    server: RunningServer,
) -> None:
    async with await Raw.open(server.http_port) as raw:
        for method, path, status, allow in [
            ("HEAD", "/v2/health/live", 200, None),
            ("HEAD", "/v2/health/ready", 200, None),
            ("HEAD", "/v2", 200, None),
            ("HEAD", "/v2/models/add_sub", 200, None),
            ("HEAD", "/v2/models/add_sub/ready", 200, None),
            ("HEAD", "/v2/models/nope", 404, None),
            ("HEAD", "/nope", 404, None),
            ("HEAD", "/metrics", 200, None),
            ("HEAD", "/v2/models/add_sub/infer", 405, "POST"),
            ("HEAD", "/v2/repository/index", 405, "POST"),
            ("OPTIONS", "/v2", 405, "GET, HEAD"),
            ("OPTIONS", "*", 404, None),
            ("POST", "/v2/health/live", 405, "GET, HEAD"),
            ("DELETE", "/v2/models/add_sub", 405, "GET, HEAD"),
            ("PATCH", "/v2/models/add_sub/infer", 405, "POST"),
            ("PUT", "/v2/repository/index", 405, "POST"),
            ("PUT", "/metrics", 405, "GET, HEAD"),
            ("GET", "/v2/health/live", 200, None),
        ]:
            await raw.send(head(method, path))
            with trio.fail_after(5):
                # No body follows the head of an answer to HEAD: were one sent, the next
                # answer would not parse.
                answer = await raw.final(to_head=method == "HEAD")
            assert answer.status == status, (method, path, answer)
            assert not answer.closes, (method, path)
            # RFC 9110 15.5.6: a 405 names the methods the endpoint takes.
            assert answer.headers.get("allow") == allow, (method, path, answer)
            if method == "HEAD":
                # The head a GET would get: the same status and length, no body.
                await raw.send(head("GET", path))
                with trio.fail_after(5):
                    got = await raw.final()
                assert answer.body == b""
                assert got.status == (status if allow is None else 405)
                # (An error's message names the method; the metrics change between scrapes.)
                if status == 200 and path != "/metrics":
                    assert answer.headers["content-length"] == str(len(got.body)), path
                    assert answer.headers.get("content-type") == got.headers.get("content-type")
            else:
                assert answer.error() if status != 200 else answer.body == b""
        # A HEAD refused before any handler runs is answered the same way.
        await raw.send(head("HEAD", "/v2/models/echo/infer", "Content-Length: 1099511627776"))
        with trio.fail_after(5):
            answer = await raw.final(to_head=True)
            assert (answer.status, answer.closes) == (413, True)
            assert int(answer.headers["content-length"]) > 0
            await raw.ends()
    assert started(server) == 28
    # A method no HTTP specification defines is not a request llhttp parses: 400, and closed.
    answer = await exchange(server, head("BREW", "/v2/models/add_sub/infer"))
    assert answer.status == 400
    assert answer.error().startswith("malformed request")
    assert started(server) == 28


# -- names ------------------------------------------------------------------------------------


async def test_percent_encoded_model_names_are_names_never_paths(server: RunningServer) -> None:
    async with await Raw.open(server.http_port) as raw:
        for method, path, status, message in [
            ("GET", "/v2/models/echo%2F..%2Fadd_sub", 404, "'echo/../add_sub'"),
            ("GET", "/v2/models/%2E%2E", 404, "'..'"),
            ("GET", "/v2/models/..%2F..%2Fetc%2Fpasswd", 404, "'../../etc/passwd'"),
            ("POST", "/v2/models/%2E%2E%2Fadd_sub/infer", 404, "'../add_sub'"),
            ("GET", "/v2/models/%00", 404, "'\x00'"),
            ("GET", "/v2/models/%ff%fe", 400, "'/v2/models/%ff%fe' is not UTF-8 once"),
            ("GET", "/v2/models/a%0D%0AX-Injected:%201", 404, "'a\r\nX-Injected: 1'"),
            ("GET", "/v2/models/add_sub%20", 404, "'add_sub '"),
            ("GET", "/v2/models/" + "%41" * 4000, 404, "'AAAA"),
            ("GET", "/v2/models/%", 404, "'%'"),
            # A version of more digits than int() converts is a bad version, not a bug.
            ("GET", "/v2/models/add_sub/versions/" + "9" * 5000 + "/ready", 400, "version"),
        ]:
            body = json.dumps(ADD_SUB_BODY).encode() if method == "POST" else b""
            await raw.send(post(path, body) if method == "POST" else head(method, path))
            with trio.fail_after(5):
                answer = await raw.final()
            assert answer.status == status, (path, answer)
            assert message in answer.error(), (path, answer.error()[:200])
            assert "x-injected" not in answer.headers
            assert not answer.closes
        await raw.send(head("GET", "/v2/models/a%0D%0AX-Injected:%201%00/ready"))
        answer = await raw.final()
        assert answer.status == 404
        assert "x-injected" not in answer.headers
        assert all(value.isprintable() for value in answer.headers.values()), answer.headers
    await Bystander(server).call()


async def test_a_path_whose_percent_encoding_is_not_utf_8_is_400_and_the_connection_kept(
    server: RunningServer,
) -> None:
    body = json.dumps(ADD_SUB_BODY).encode()
    async with await Raw.open(server.http_port) as raw:
        for request in [
            head("GET", "/v2/models/%ff"),
            head("HEAD", "/v2/models/add_sub%ff/ready"),
            infer(body, model="add_sub%C3"),  # a sequence cut short
            infer(body, model="%C0%AF"),  # an overlong '/'
            infer(body, model="%ED%A0%80"),  # a surrogate
            post("/v2/repository/models/%ff/load", b""),
            head("GET", "/v2/models/" + "%ff" * 1000),
        ]:
            await raw.send(request)
            with trio.fail_after(5):
                answer = await raw.final(to_head=request.startswith(b"HEAD"))
            assert answer.status == 400, (request[:80], answer)
            assert not answer.closes
            if not request.startswith(b"HEAD"):
                message = answer.error()
                assert message.startswith("the request path '/v2/"), message
                assert message.endswith("...' is not UTF-8 once percent-decoded") == (
                    len(request.split(b" ")[1]) > 64
                ), message
        # UTF-8 percent-encoded is a name as before: one no model has.
        await raw.send(head("GET", "/v2/models/%C3%A9"))
        answer = await raw.final()
        assert answer.status == 404
        assert "'\u00e9'" in answer.error()
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.http_port}") as client:
        refused = await client.post("/v2/models/add_sub%FF/infer", json=ADD_SUB_BODY)
        assert refused.status_code == 400
        assert refused.json() == {
            "error": "the request path '/v2/models/add_sub%FF/infer' is not UTF-8 once "
            "percent-decoded"
        }
        answer = await client.post("/v2/models/add_sub/infer", json=ADD_SUB_BODY)
        assert answer.status_code == 200
    assert started(server) == 10


# -- the repository extension and /metrics ----------------------------------------------------


async def test_repository_requests_with_oversized_bodies_are_413_before_they_are_read(
    server: RunningServer,
) -> None:
    for path in ("/v2/repository/index", "/v2/repository/models/add_sub/load"):
        # Only the head: the refusal comes at once, the body never needed.
        answer = await exchange(server, head("POST", path, "Content-Length: 100000"))
        assert answer.status == 413
        assert answer.error() == "this request's body may be at most 65536 bytes"
        # A body of unannounced size (chunked, compressed) is read, and refused as it passes
        # the limit, sent or decoded.
        for data in (
            chunked(path, b"10001\r\n" + b" " * 0x10001 + b"\r\n0\r\n\r\n"),
            # In many pieces, held before they are moved to the body: counted as they come.
            chunked(path, (b"400\r\n" + b" " * 0x400 + b"\r\n") * 65 + b"0\r\n\r\n"),
            post(path, gzip.compress(b" " * 0x10001), "Content-Encoding: gzip"),
        ):
            async with await Raw.open(server.http_port) as raw:
                await raw.send(data)
                with trio.fail_after(5):
                    answer = await raw.final()
            assert answer.status == 413, answer
            assert answer.error().startswith(
                "the request body is larger than the maximum of 65536 bytes"
            ), answer.error()
        # Within the limit, compressed or chunked, it is served.
        for data in (
            chunked(path, b"2\r\n{}\r\n0\r\n\r\n"),
            post(path, gzip.compress(b"{}"), "Content-Encoding: gzip"),
        ):
            async with await Raw.open(server.http_port) as raw:
                await raw.send(data)
                with trio.fail_after(5):
                    answer = await raw.final()
            # The index answers; a load is refused for what it asks (no --model-control-mode
            # explicit here), its body read and decoded.
            if path.endswith("index"):
                assert answer.status == 200, answer
            else:
                assert "model-control-mode" in answer.error(), answer
    async with await Raw.open(server.http_port) as raw:
        # Within the limit, not JSON, a deep JSON bomb, and the wrong JSON: 400 each.
        load = "/v2/repository/models/add_sub/load"
        for path, body, message in [
            ("/v2/repository/index", b"\xff" * 60_000, "the request body"),
            # The json module's recursion: a RecursionError, which was a 500.
            (
                "/v2/repository/index",
                b"[" * 60_000,
                "the request body is not valid JSON: it is nested too deeply",
            ),
            (
                load,
                b'{"parameters": {"config": "' + b"[" * 60_000 + b'"}}',
                "load parameter 'config' is not valid JSON: it is nested too deeply",
            ),
            ("/v2/repository/index", b'{"parameters": [1]}', "'parameters' must be a JSON"),
            ("/v2/repository/index", b'{"ready": "yes"}', "'ready' must be a boolean"),
        ]:
            await raw.send(post(path, body))
            answer = await raw.final()
            assert answer.status == 400, (body[:20], answer)
            assert message in answer.error(), answer.error()
            assert not answer.closes
        await raw.send(post("/v2/repository/index", b'{"ready": true}'))
        answer = await raw.final()
        assert answer.status == 200
        assert {entry["name"] for entry in json.loads(answer.body)} >= {"add_sub", "echo"}
    await Bystander(server).call()


async def test_many_concurrent_scrapes_of_metrics_on_both_ports(nursery: trio.Nursery) -> None:
    server = await start_server(nursery, workers=1, metrics_port=0, **TIMEOUTS)
    bystander = Bystander(server)
    answers: list[int] = []

    async def scrape(port: int | None) -> None:
        async with await Raw.open(port) as raw:
            for _ in range(3):
                await raw.send(head("GET", "/metrics"))
                answer = await raw.final()
                assert b"trio_infer" in answer.body or answer.body.startswith(b"#")
                answers.append(answer.status)

    with trio.fail_after(60):
        async with trio.open_nursery() as scrapers:
            scrapers.start_soon(bystander.call)
            for i in range(200):
                scrapers.start_soon(scrape, server.metrics_port if i % 2 else server.http_port)
    assert answers == [200] * 600
    # The metrics port serves /metrics only, GET only, and no body.
    for data, status in [
        (head("GET", "/v2/health/live"), 404),
        (head("GET", "/metrics/../v2"), 404),
        (head("POST", "/metrics", "Content-Length: 0"), 405),
        (head("GET", "/metrics", "Content-Length: 10") + bytes(10), 413),
        (head("GET", "/metrics", "Content-Length: 1073741824"), 413),
        (head("GET", "/metrics", "X-A: " + "a" * 20_000), 431),
    ]:
        async with await Raw.open(server.metrics_port) as raw:
            await raw.send(data)
            with trio.fail_after(5):
                answer = await raw.final()
            assert answer.status == status, (data[:40], answer)
    await bystander.call()


@pytest.mark.parametrize(
    ("datatype", "element", "message"),
    [
        # A float within UINT64's range is refused as a float, not as out of range: orjson
        # reads every integer literal up to 2**64 - 1 as an int.
        ("UINT64", "1e19", "1e+19, not an integer; UINT64 elements are integers"),
        (
            "UINT64",
            "10000000000000000000.0",
            "1e+19, not an integer; UINT64 elements are integers",
        ),
        # Integer literals beyond 64 bits, read as floats: out of range.
        ("UINT64", str(2**64), "1.8446744073709552e+19, outside UINT64's range"),
        ("INT64", str(-(2**63) - 1), "-9.223372036854776e+18, outside INT64's range"),
        ("INT64", "1e19", "1e+19, outside INT64's range"),
    ],
)
async def test_a_64_bit_integer_element_out_of_range_or_a_float_is_400_saying_which(
    server: RunningServer, datatype: str, element: str, message: str
) -> None:
    body = (
        f'{{"inputs": [{{"name": "x", "datatype": "{datatype}", "shape": [1], '
        f'"data": [{element}]}}]}}'
    ).encode()
    async with await Raw.open(server.http_port) as raw:
        await raw.send(infer(body))
        with trio.fail_after(10):
            answer = await raw.final()
    assert answer.status == 400, answer
    assert answer.error().startswith(f"input 'x': element 0 is {message}"), answer.error()
