"""A request's ``content-length`` against a real server. RFC 9113 §8.1.1: a request whose
content-length is not a length, or is not the sum of its DATA payloads, is malformed, and a
malformed request is a stream error of type PROTOCOL_ERROR (§5.4.2): its stream is reset, and
the connection and its other calls go on. The DATA the server drops still counts against the
connection's flow-control window, and must be given back."""

from __future__ import annotations

import contextlib
import functools
import socket
import threading

import h2.config
import h2.connection
import h2.errors
import h2.events
import hpack
import pytest
import trio

from tests.support import start_server
from tests.test_hostile import (
    REQUEST_HEADERS,
    Bystander,
    answers,
    echo_request,
    frame,
    frames_in,
    goaway_codes,
    grpc_message,
    read_until_a_stream_ends,
)
from trio_infer.server import RunningServer

BODY = grpc_message(echo_request())
SIZE = str(len(BODY))
RESET = {"reset": str(h2.errors.ErrorCodes.PROTOCOL_ERROR)}


@pytest.fixture
async def server(nursery: trio.Nursery) -> RunningServer:
    return await start_server(nursery)


def sent(lengths: list[str], *, end: str = "end") -> list[tuple[int, str, object]]:
    """Stream 1 of :func:`answers`: a request with a content-length field for each of
    ``lengths``, an echo request in one DATA frame, then its end (``"end"``: an empty DATA
    frame with END_STREAM; ``"trailers"``: trailers); with ``end="headers"``, the request ends
    with its headers and sends no body."""
    headers = [*REQUEST_HEADERS, *(("content-length", length) for length in lengths)]
    if end == "headers":
        return [(1, "trailers", headers)]
    finish = (1, "trailers", [("x-trailer", "1")]) if end == "trailers" else (1, "end", None)
    return [(1, "headers", headers), (1, "data", BODY), finish]


@pytest.mark.parametrize(
    ("request_", "expected"),
    [
        # The body against its content-length: malformed when they differ, wherever the
        # difference shows (a DATA frame past it, or END_STREAM short of it, on DATA or on
        # trailers, or on the headers themselves).
        (sent(["3"]), RESET),
        (sent([str(len(BODY) + 10)]), RESET),
        (sent([str(len(BODY) + 10)], end="trailers"), RESET),
        (sent(["5"], end="headers"), RESET),
        # The field itself (RFC 9110 §8.6: 1*DIGIT): h2 read it with Python's int(), which
        # refused some (and ended the connection) and took others.
        (sent(["five"]), RESET),
        (sent(["-5"]), RESET),
        (sent([""]), RESET),
        (sent([f"+{SIZE}"]), RESET),
        (sent([f"{SIZE}, {SIZE}"]), RESET),
        (sent([SIZE, str(len(BODY) + 1)]), RESET),
        # Right: served. A field repeated with the same value is the one value (RFC 9110 §8.6).
        (sent([SIZE]), {"grpc-status": "0"}),
        (sent([SIZE, SIZE]), {"grpc-status": "0"}),
        (sent(["0" + SIZE]), {"grpc-status": "0"}),
        (sent([SIZE], end="trailers"), {"grpc-status": "0"}),
        # No body, and a content-length that says so: well-formed HTTP/2, not a gRPC call.
        (sent(["0"], end="headers"), {"grpc-status": "3"}),
    ],
    ids=[
        "over",
        "short",
        "short-at-trailers",
        "short-at-headers",
        "not-a-number",
        "negative",
        "empty",
        "plus-sign",
        "list",
        "two-values",
        "right",
        "repeated",
        "leading-zero",
        "right-with-trailers",
        "none-at-headers",
    ],
)
async def test_a_content_length_that_is_wrong_resets_only_its_stream(
    server: RunningServer, request_: list[tuple[int, str, object]], expected: dict[str, str]
) -> None:
    # The malformed request and a good one beside it, on one connection in one write: the
    # first's stream is reset (h2 closed the whole connection); the second is served.
    good: list[tuple[int, str, object]] = [
        (3, "headers", REQUEST_HEADERS),
        (3, "data", BODY),
        (3, "end", None),
    ]
    result = await trio.to_thread.run_sync(answers, server.port, request_ + good)
    assert {key: result[1].get(key) for key in expected} == expected, result[1]
    assert result[3].get("grpc-status") == "0", result[3]
    await Bystander(server.port).call()


def reset_beside_a_call_in_flight(port: int) -> tuple[list[object], list[object]]:
    """On one connection: an echo call on stream 1 that has sent half its message (its call
    started, waiting for the rest), then a request on stream 3 whose body outgrows its
    content-length; once stream 3 is reset, the rest of stream 1's message. The h2 events the
    server's bytes made until stream 3 was reset, and after."""
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    half = len(BODY) // 2
    client.send_headers(1, REQUEST_HEADERS)
    client.send_data(1, BODY[:half])
    client.send_headers(3, [*REQUEST_HEADERS, ("content-length", "1")])
    client.send_data(3, BODY, end_stream=True)
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(10)
        sock.sendall(client.data_to_send())
        before = read_until_a_stream_ends(sock, client)
        client.send_data(1, BODY[half:], end_stream=True)
        sock.sendall(client.data_to_send())
        after = read_until_a_stream_ends(sock, client)
    return before, after


async def test_a_call_in_flight_beside_a_reset_one_is_served(server: RunningServer) -> None:
    before, after = await trio.to_thread.run_sync(reset_beside_a_call_in_flight, server.port)
    # Stream 1's call was in flight (its message half sent) when stream 3 was reset.
    resets = [e for e in before if isinstance(e, h2.events.StreamReset)]
    assert [(e.stream_id, e.error_code) for e in resets] == [
        (3, h2.errors.ErrorCodes.PROTOCOL_ERROR)
    ]
    assert not [e for e in before if isinstance(e, h2.events.StreamEnded)]
    assert goaway_codes(after) == []
    trailers = [e for e in after if isinstance(e, h2.events.TrailersReceived)]
    assert [e.stream_id for e in trailers] == [1]
    assert (b"grpc-status", b"0") in trailers[0].headers
    await Bystander(server.port).call()


class Relay:
    """A TCP relay between one grpcio connection and the server that slips a request of its own
    into the connection: once the grpcio call has sent its headers (its call started on the
    server), a request whose body outgrows its content-length, on a stream id above the
    call's; the call's DATA is held back until the server has reset that stream. So the
    grpcio call is in flight, on the same connection, when its neighbour is reset.

    The request's header block is never indexed, and refers to the static table only: the
    connection's HPACK table stays as grpcio's encoder knows it."""

    def __init__(self, port: int) -> None:
        self.server_port = port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.listener.getsockname()[1]
        #: The stream id of the request slipped in, once it is.
        self.slipped: int | None = None
        #: What the server sent, as it came.
        self.from_server = bytearray()
        self._reset = threading.Event()

    def serve(self) -> None:
        """Relay the first connection made to :attr:`port` until its client closes it."""
        with (
            self.listener,
            self.listener.accept()[0] as client,
            socket.create_connection(("127.0.0.1", self.server_port)) as upstream,
        ):
            back = threading.Thread(target=self._back, args=(upstream, client))
            back.start()
            try:
                self._forth(client, upstream)
            finally:
                upstream.shutdown(socket.SHUT_WR)
                back.join()

    def _forth(self, client: socket.socket, upstream: socket.socket) -> None:
        pending = b""
        preface = 24  # the client's connection preface precedes its frames
        while data := client.recv(65536):
            pending += data
            while len(pending) >= preface + 9:
                length = int.from_bytes(pending[preface : preface + 3], "big")
                end = preface + 9 + length
                if len(pending) < end:
                    break
                stream = int.from_bytes(pending[preface + 5 : preface + 9], "big") & 0x7FFFFFFF
                if pending[preface + 3] == 0x0 and stream and self.slipped is None:  # DATA
                    self._slip_in(upstream, stream + 1000)
                upstream.sendall(pending[:end])
                pending, preface = pending[end:], 0

    def _slip_in(self, upstream: socket.socket, stream: int) -> None:
        self.slipped = stream
        fields = [*REQUEST_HEADERS, ("content-length", "1")]
        block = hpack.Encoder().encode([hpack.NeverIndexedHeaderTuple(*f) for f in fields])
        upstream.sendall(frame(0x1, 0x4, stream, block) + frame(0x0, 0x1, stream, BODY))
        assert self._reset.wait(10), "the server did not reset the stream slipped in"

    def _back(self, upstream: socket.socket, client: socket.socket) -> None:
        while data := upstream.recv(65536):
            self.from_server += data
            reset = (0x3, self.slipped)
            if any((kind, stream) == reset for kind, stream, _ in frames_in(self.from_server)):
                self._reset.set()
            with contextlib.suppress(OSError):  # grpcio closed its end
                client.sendall(data)


async def test_a_grpcio_call_in_flight_beside_a_reset_stream_on_its_connection_is_served(
    server: RunningServer,
) -> None:
    # A well-behaved client's call in flight on the very connection whose other stream is
    # reset: the call is answered OK, and the server resets that stream and nothing else.
    relay = Relay(server.port)
    bystander = Bystander(relay.port)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(functools.partial(trio.to_thread.run_sync, relay.serve))
        await bystander.call()
        bystander.client.channel.close()
    frames = frames_in(bytes(relay.from_server))
    protocol_error = h2.errors.ErrorCodes.PROTOCOL_ERROR.to_bytes(4, "big")
    assert [(stream, payload) for kind, stream, payload in frames if kind == 0x3] == [
        (relay.slipped, protocol_error)
    ]
    assert not [kind for kind, _, _ in frames if kind == 0x7]  # no GOAWAY


#: Bytes of DATA each malformed request sends: its first frame outgrows its content-length
#: (and resets the stream), the rest arrive on the stream the server has reset.
PER_REQUEST = 8 * 16 * 1024
#: More than the connection window the server opens (16 MiB), and far more than HTTP/2's
#: initial 64 KiB: unless the server gives back the window of every byte it drops, the
#: client runs out of window before the last request.
DROPPED = 17 * 1024 * 1024


def malformed_requests_then_a_call(port: int) -> tuple[dict[int, str], bytes]:
    """On one connection, one request after another, each sending :data:`PER_REQUEST` bytes
    of DATA (16 KiB frames, in one write) against a content-length of 1, as the connection's
    window allows, until :data:`DROPPED` bytes are sent; then an echo call. Its grpc-status,
    and the server's bytes up to its end."""
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    chunk = bytes(16 * 1024)
    received = b""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(10)
        sock.sendall(client.data_to_send())

        def read() -> list[object]:
            nonlocal received
            data = sock.recv(65536)
            assert data, "the server closed the connection"
            received += data
            events: list[object] = client.receive_data(data)
            sock.sendall(client.data_to_send())
            return events

        requests = -(-DROPPED // PER_REQUEST)
        for stream in range(1, 2 * requests, 2):
            client.send_headers(stream, [*REQUEST_HEADERS, ("content-length", "1")])
            # The server's SETTINGS (128 KiB streams and frames) may not have come yet.
            while client.local_flow_control_window(stream) < PER_REQUEST:
                read()
            for _ in range(PER_REQUEST // len(chunk)):
                client.send_data(stream, chunk)
            sock.sendall(client.data_to_send())
            reset = False
            while not reset:
                reset = any(isinstance(e, h2.events.StreamReset) for e in read())
        stream = 2 * requests + 1
        client.send_headers(stream, REQUEST_HEADERS)
        client.send_data(stream, BODY, end_stream=True)
        sock.sendall(client.data_to_send())
        status: dict[int, str] = {}
        while stream not in status:
            for event in read():
                if isinstance(event, h2.events.TrailersReceived):
                    status[event.stream_id] = dict(event.headers)[b"grpc-status"].decode()
    return status, received


async def test_the_window_of_data_dropped_with_a_reset_stream_is_given_back(
    server: RunningServer,
) -> None:
    # RFC 9113 §6.9 and §5.1: DATA counts against the connection's window whatever becomes of
    # it. Were the dropped bytes not given back, the 17 MiB of malformed requests would leave
    # the connection no window, and its last call could not send its request.
    status, received = await trio.to_thread.run_sync(malformed_requests_then_a_call, server.port)
    assert list(status.values()) == ["0"]
    frames = frames_in(received)
    resets = [(stream, payload) for kind, stream, payload in frames if kind == 0x3]
    # One RST_STREAM PROTOCOL_ERROR per malformed request: the DATA that followed on its
    # stream was ignored, not answered (RFC 9113 §5.1).
    protocol_error = h2.errors.ErrorCodes.PROTOCOL_ERROR.to_bytes(4, "big")
    assert resets == [(stream, protocol_error) for stream in range(1, 2 * len(resets), 2)]
    assert len(resets) * PER_REQUEST >= DROPPED
    assert not [kind for kind, _, _ in frames if kind == 0x7]  # no GOAWAY
    await Bystander(server.port).call()
