"""Hostile and careless clients: raw HTTP/2 written by hand or with h2, against a real server,
with a well-behaved grpcio client beside each whose calls must keep succeeding."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import socket
import time
import urllib.parse

import grpc
import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
import hpack
import numpy as np
import pytest
import trio

from tests.support import GrpcioClient, Peaks, eventually, start_server
from trio_infer.datatypes import DATATYPES
from trio_infer.protobuf._proto import grpc_predict_v2_pb2 as pb
from trio_infer.protobuf.codec import decode_outputs, encode_inputs, encode_parameters
from trio_infer.server import RunningServer
from trio_infer.transport.grpc_protocol import _FRAMES_PER_PASS, ProtocolLimits

#: What the server advertises as SETTINGS_MAX_HEADER_LIST_SIZE.
HEADER_LIST_LIMIT = 16 * 1024

REQUEST_HEADERS = [
    (":method", "POST"),
    (":scheme", "http"),
    (":path", "/inference.GRPCInferenceService/ModelInfer"),
    (":authority", "x"),
    ("te", "trailers"),
    ("content-type", "application/grpc"),
]


@pytest.fixture
async def server(nursery: trio.Nursery) -> RunningServer:
    return await start_server(nursery)


class Bystander:
    """A well-behaved client: an echo call that must succeed whatever the others do."""

    def __init__(self, port: int) -> None:
        self.client = GrpcioClient(port)
        self.x = np.arange(12, dtype=np.float32).reshape(3, 4)

    async def call(self) -> None:
        request = pb.ModelInferRequest(model_name="echo")
        encode_inputs(request, [("x", self.x)], raw=True)
        response = await self.client.call("ModelInfer", request, timeout=10)
        np.testing.assert_array_equal(decode_outputs(response)["x"], self.x)


def frame(
    kind: int, flags: int, stream_id: int, payload: bytes, *, length: int | None = None
) -> bytes:
    """An HTTP/2 frame; ``length`` announces another length than the payload's."""
    size = len(payload) if length is None else length
    return size.to_bytes(3, "big") + bytes([kind, flags]) + stream_id.to_bytes(4, "big") + payload


def exchange_until_closed(port: int, data: bytes, timeout: float = 10.0) -> list[object]:
    """Send a client preface and ``data`` on a new connection; return the h2 events the
    server's bytes make until it closes the connection (or ``timeout`` passes: then the last
    event is the string ``"timeout"``)."""
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    events: list[object] = []
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(timeout)
        sock.sendall(client.data_to_send() + data)
        try:
            while received := sock.recv(65536):
                try:
                    events += client.receive_data(received)
                except h2.exceptions.ProtocolError:
                    break  # h2 refuses what follows the server's GOAWAY; the GOAWAY came first
        except TimeoutError:
            events.append("timeout")
        except ConnectionResetError:
            pass
    return events


def frames_in(received: bytes) -> list[tuple[int, int, bytes]]:
    """The frames among a server's bytes (its frames, whole), read by hand: each frame's type,
    stream and payload. An h2 client would hide some (a second RST_STREAM of a stream it saw
    reset), or refuse a whole read (one holding a GOAWAY and frames after it)."""
    frames = []
    at = 0
    while at + 9 <= len(received):
        length = int.from_bytes(received[at : at + 3], "big")
        stream = int.from_bytes(received[at + 5 : at + 9], "big") & 0x7FFFFFFF
        frames.append((received[at + 3], stream, received[at + 9 : at + 9 + length]))
        at += 9 + length
    return frames


def goaway_codes_in(received: bytes) -> list[int]:
    """The error codes of the GOAWAY frames among a server's bytes (its frames, whole)."""
    return [
        int.from_bytes(payload[4:8], "big")
        for kind, _, payload in frames_in(received)
        if kind == 0x7
    ]


def goaway_codes(events: list[object]) -> list[object]:
    return [e.error_code for e in events if isinstance(e, h2.events.ConnectionTerminated)]


async def test_a_frame_announced_over_the_frame_size_is_refused_from_its_header(
    server: RunningServer,
) -> None:
    # A DATA frame header announcing 16 MiB, over SETTINGS_MAX_FRAME_SIZE (128 KiB), and no
    # body: refused when its 9 bytes arrive, not after the server has buffered the 16 MiB.
    encoder = hpack.Encoder()
    headers = frame(0x1, 0x4, 1, encoder.encode(REQUEST_HEADERS))
    announced = frame(0x0, 0x0, 1, b"", length=2**24 - 1)
    events = await trio.to_thread.run_sync(exchange_until_closed, server.port, headers + announced)
    assert goaway_codes(events) == [h2.errors.ErrorCodes.FRAME_SIZE_ERROR]
    await Bystander(server.port).call()


def huffman_literal(name: bytes, count: int) -> bytes:
    """A literal header field whose value is ``count`` (a multiple of 8) Huffman-coded "a"s,
    encoded by hand: hpack's encoder, in pure Python, takes minutes over a megabyte."""
    # "a" is the 5-bit code 00011: eight of them fill five bytes.
    eight = int("00011" * 8, 2).to_bytes(5, "big")
    value = eight * (count // 8)
    length = hpack.hpack.encode_integer(len(value), 7)
    length[0] |= 0x80  # the H bit: Huffman-coded
    return bytes([0x00, len(name)]) + name + bytes(length) + value


def unfinished_header_block(size: int, chunk: int = 8 * 1024) -> bytes:
    """A HEADERS frame and CONTINUATION frames carrying ``size`` encoded bytes of one header
    block (a Huffman-coded literal that decodes to 8/5 as many), with no END_HEADERS yet."""
    block = hpack.Encoder().encode(REQUEST_HEADERS) + huffman_literal(b"x-flood", size // 5 * 8)
    block = block[:size]
    parts = [block[i : i + chunk] for i in range(0, len(block), chunk)]
    return frame(0x1, 0x0, 1, parts[0]) + b"".join(frame(0x9, 0x0, 1, p) for p in parts[1:])


async def test_a_continuation_flood_is_refused_by_its_encoded_size(server: RunningServer) -> None:
    # Three 8 KiB frames of one header block, past the advertised 16 KiB: the connection ends
    # with ENHANCE_YOUR_CALM at once, without waiting for (or decoding) the rest of the block.
    flood = unfinished_header_block(3 * 8 * 1024)
    events = await trio.to_thread.run_sync(exchange_until_closed, server.port, flood, 5.0)
    assert goaway_codes(events) == [h2.errors.ErrorCodes.ENHANCE_YOUR_CALM]
    assert "timeout" not in events
    await Bystander(server.port).call()


async def test_a_header_block_within_the_limit_in_continuations_is_served(
    server: RunningServer,
) -> None:
    # 15 KiB of headers in two frames: under the limit, so the call is made (and fails only
    # for naming no model).
    client = GrpcioClient(server.port)
    error = await client.error(
        "ModelInfer", pb.ModelInferRequest(model_name="nope"), metadata=[("x-big", "v" * 15_000)]
    )
    assert "nope" in error.details()


async def test_the_advertised_header_list_size_is_the_one_enforced(server: RunningServer) -> None:
    # A small block that decodes past the advertised limit: a 4 KiB value put in the HPACK
    # table once, then indexed five times (20 KiB decoded, a few bytes encoded).
    encoder = hpack.Encoder()
    value = "v" * 4000
    block = encoder.encode([*REQUEST_HEADERS, *[("x-big", value)] * 5])
    assert len(block) < HEADER_LIST_LIMIT
    events = await trio.to_thread.run_sync(
        exchange_until_closed, server.port, frame(0x1, 0x4, 1, block)
    )
    assert goaway_codes(events) == [h2.errors.ErrorCodes.ENHANCE_YOUR_CALM]
    # Within the limit, the same headers make a call (it fails for its empty body, cleanly).
    client = GrpcioClient(server.port)
    error = await client.error(
        "ModelInfer", pb.ModelInferRequest(model_name="nope"), metadata=[("x-big", value)]
    )
    assert "nope" in error.details()
    await Bystander(server.port).call()


def grpc_message(payload: bytes) -> bytes:
    return b"\x00" + len(payload).to_bytes(4, "big") + payload


def echo_request() -> bytes:
    request = pb.ModelInferRequest(model_name="echo")
    encode_inputs(request, [("x", np.arange(4, dtype=np.int32))], raw=True)
    return request.SerializeToString()


def answers(
    port: int, send: list[tuple[int, str, object]], timeout: float = 10.0
) -> dict[int, dict[str, str]]:
    """Run an h2 client that does ``send`` (``(stream, "headers" | "data" | "trailers" |
    "window", argument)`` in order, then reads until every stream it used has ended or been
    reset; return each stream's response headers and trailers (``"reset"`` for a reset)."""
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    streams = sorted({stream for stream, _, _ in send})
    for stream, what, argument in send:
        if what == "headers":
            client.send_headers(stream, argument)  # type: ignore[arg-type]
        elif what == "data":
            client.send_data(stream, argument)  # type: ignore[arg-type]
        elif what == "end":
            client.end_stream(stream)
        elif what == "trailers":
            client.send_headers(stream, argument, end_stream=True)  # type: ignore[arg-type]
    out: dict[int, dict[str, str]] = {stream: {} for stream in streams}
    done: set[int] = set()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(timeout)
        sock.sendall(client.data_to_send())
        for stream, what, argument in send:
            if what == "window":  # a raw WINDOW_UPDATE, which h2 would refuse to send
                sock.sendall(frame(0x8, 0x0, stream, int(argument).to_bytes(4, "big")))  # type: ignore[call-overload]
        while done != set(streams):
            received = sock.recv(65536)
            if not received:
                break
            for event in client.receive_data(received):
                if isinstance(event, h2.events.ResponseReceived | h2.events.TrailersReceived):
                    out[event.stream_id].update(
                        (name.decode(), value.decode()) for name, value in event.headers
                    )
                elif isinstance(event, h2.events.StreamEnded):
                    done.add(event.stream_id)
                elif isinstance(event, h2.events.StreamReset):
                    out[event.stream_id]["reset"] = str(event.error_code)
                    done.add(event.stream_id)
            sock.sendall(client.data_to_send())
    return out


async def test_request_trailers_affect_their_stream_at_most(server: RunningServer) -> None:
    # HEADERS, DATA, then trailers (HEADERS with END_STREAM): legal in HTTP/2. The call is
    # served; a good call on the same connection is too.
    body = grpc_message(echo_request())
    result = await trio.to_thread.run_sync(
        answers,
        server.port,
        [
            (1, "headers", REQUEST_HEADERS),
            (1, "data", body),
            (3, "headers", REQUEST_HEADERS),
            (3, "data", body),
            (3, "end", None),
            (1, "trailers", [("x-trailer", "1")]),
        ],
    )
    assert result[1].get("grpc-status") == "0", result[1]
    assert result[3].get("grpc-status") == "0", result[3]
    await Bystander(server.port).call()


async def test_a_unary_call_with_two_request_messages_fails(server: RunningServer) -> None:
    body = grpc_message(echo_request())
    result = await trio.to_thread.run_sync(
        answers,
        server.port,
        [(1, "headers", REQUEST_HEADERS), (1, "data", body + body), (1, "end", None)],
    )
    assert result[1].get("grpc-status") == "3", result[1]  # INVALID_ARGUMENT
    assert "one request message" in result[1].get("grpc-message", ""), result[1]
    await Bystander(server.port).call()


async def test_a_stream_window_update_of_zero_resets_only_that_stream(
    server: RunningServer,
) -> None:
    body = grpc_message(echo_request())
    result = await trio.to_thread.run_sync(
        answers,
        server.port,
        [
            (1, "headers", REQUEST_HEADERS),
            (1, "window", 0),
            (3, "headers", REQUEST_HEADERS),
            (3, "data", body),
            (3, "end", None),
        ],
    )
    assert result[1].get("reset") == str(h2.errors.ErrorCodes.PROTOCOL_ERROR), result[1]
    assert result[3].get("grpc-status") == "0", result[3]
    await Bystander(server.port).call()


def padded_call(port: int, body: bytes, pad: int, timeout: float = 10.0) -> dict[str, str]:
    """Send ``body`` on one call, a byte a DATA frame, each frame padded with ``pad`` bytes, as
    the stream's window lets h2 send them; return the call's response headers and trailers
    (with ``"timeout"`` if the window stayed shut and no answer came)."""
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    client.send_headers(1, REQUEST_HEADERS)
    out: dict[str, str] = {}
    sent = 0
    ended = False
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(timeout)
        while True:
            while sent < len(body) and client.local_flow_control_window(1) >= 1 + pad + 1:
                client.send_data(1, body[sent : sent + 1], pad_length=pad)
                sent += 1
            if sent == len(body) and not ended:
                client.end_stream(1)
                ended = True
            sock.sendall(client.data_to_send())
            try:
                received = sock.recv(65536)
            except TimeoutError:
                out["timeout"] = f"{sent} of {len(body)} bytes sent"
                return out
            if not received:
                return out
            for event in client.receive_data(received):
                if isinstance(event, h2.events.ResponseReceived | h2.events.TrailersReceived):
                    out.update((name.decode(), value.decode()) for name, value in event.headers)
                elif isinstance(event, h2.events.StreamEnded | h2.events.StreamReset):
                    return out


async def test_padded_data_frames_leave_the_stream_window_to_the_message(
    server: RunningServer,
) -> None:
    # RFC 9113 §6.9.1: a DATA frame's padding counts against the windows. It holds nothing the
    # call admits, so the server returns it as it comes: else a client that pads (here 255
    # bytes a frame, some 160 KiB in all, more than a stream's 128 KiB) finds its window spent
    # by padding alone and the call stalls, its message never whole.
    request = pb.ModelInferRequest(model_name="echo")
    encode_inputs(request, [("x", np.arange(600, dtype=np.uint8))], raw=True)
    result = await trio.to_thread.run_sync(
        padded_call, server.port, grpc_message(request.SerializeToString()), 255
    )
    assert result.get("grpc-status") == "0", result
    await Bystander(server.port).call()


@pytest.mark.parametrize("deadline", [[], [("grpc-timeout", "10S")]], ids=["none", "10s"])
async def test_a_unary_call_is_answered_before_the_client_half_closes(
    server: RunningServer, deadline: list[tuple[str, str]]
) -> None:
    # The whole message arrived; the request's end never does. The answer must not wait for it.
    body = grpc_message(echo_request())
    result = await trio.to_thread.run_sync(
        answers, server.port, [(1, "headers", [*REQUEST_HEADERS, *deadline]), (1, "data", body)]
    )
    assert result[1].get("grpc-status") == "0", result[1]


@pytest.mark.parametrize(
    ("headers", "status", "message"),
    [
        (
            [*REQUEST_HEADERS, ("content-type", "application/grpc")],
            "3",  # INVALID_ARGUMENT
            "content-type appears 2 times; a gRPC call sends it once",
        ),
        (
            [(":method", "GET"), *REQUEST_HEADERS[1:]],
            "3",
            "the request's :method is 'GET'; gRPC calls are POST",
        ),
        (
            [*REQUEST_HEADERS, ("grpc-timeout", "1" * 40 + "S")],
            "3",
            "grpc-timeout '11111111111111111111...' is not a gRPC timeout (1 to 8 digits and a "
            "unit: H, M, S, m, u or n)",
        ),
        (
            [field for field in REQUEST_HEADERS if field[0] != "te"],
            "3",
            "the request has no te field; gRPC calls send te: trailers",
        ),
        (
            [(":scheme", "ftp") if name == ":scheme" else (name, v) for name, v in REQUEST_HEADERS],
            "3",
            "the request's :scheme is 'ftp'; gRPC calls are http or https",
        ),
        (
            [(":path", "/a/b/c") if name == ":path" else (name, v) for name, v in REQUEST_HEADERS],
            "12",  # UNIMPLEMENTED, as a path naming no method served
            "method /a/b/c is not served here; a gRPC method's path is /service/method",
        ),
        (
            [(":path", "x") if name == ":path" else (name, v) for name, v in REQUEST_HEADERS],
            "12",
            "method x is not served here; a gRPC method's path is /service/method",
        ),
    ],
    ids=[
        "duplicate-content-type",
        "get",
        "40-digit-timeout",
        "no-te",
        "ftp",
        "three-segment-path",
        "relative-path",
    ],
)
async def test_malformed_request_headers_get_a_clean_status_for_their_stream(
    server: RunningServer, headers: list[tuple[str, str]], status: str, message: str
) -> None:
    body = grpc_message(echo_request())
    result = await trio.to_thread.run_sync(
        answers,
        server.port,
        [
            (1, "headers", headers),
            (1, "data", body),
            (1, "end", None),
            (3, "headers", REQUEST_HEADERS),
            (3, "data", body),
            (3, "end", None),
        ],
    )
    first = result[1]
    assert first.get("grpc-status") == status, first
    assert urllib.parse.unquote(first["grpc-message"]) == message
    assert result[3].get("grpc-status") == "0", result[3]
    await Bystander(server.port).call()


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "snappy"])
@pytest.mark.parametrize("flag", [0, 1], ids=["sent-plain", "sent-compressed"])
async def test_a_message_encoding_not_accepted_is_unimplemented_naming_the_one_accepted(
    server: RunningServer, encoding: str, flag: int
) -> None:
    # gRPC's compression spec: a server refuses an encoding it does not take with UNIMPLEMENTED
    # and a grpc-accept-encoding field listing those it does, so that the client can call again
    # without compressing.
    body = bytes([flag]) + grpc_message(echo_request())[1:]
    result = await trio.to_thread.run_sync(
        answers,
        server.port,
        [
            (1, "headers", [*REQUEST_HEADERS, ("grpc-encoding", encoding)]),
            (1, "data", body),
            (1, "end", None),
        ],
    )
    assert result[1].get("grpc-status") == "12", result[1]
    assert urllib.parse.unquote(result[1]["grpc-message"]) == (
        f"message encoding '{encoding}' is not supported"
    )
    assert result[1].get("grpc-accept-encoding") == "identity", result[1]
    await Bystander(server.port).call()


async def test_refusals_for_an_encoding_keep_the_connections_header_table_in_step(
    server: RunningServer,
) -> None:
    # grpc-accept-encoding is coded with the connection's HPACK table, as every other field:
    # the second refusal's refers to the entry the first one added, and the calls between and
    # after them decode theirs as the server coded them.
    body = grpc_message(echo_request())
    send: list[tuple[int, str, object]] = []
    for stream, encoding in [(1, "gzip"), (3, "identity"), (5, "deflate"), (7, "identity")]:
        send += [
            (stream, "headers", [*REQUEST_HEADERS, ("grpc-encoding", encoding)]),
            (stream, "data", body),
            (stream, "end", None),
        ]
    result = await trio.to_thread.run_sync(answers, server.port, send)
    for stream in (1, 5):
        assert result[stream].get("grpc-status") == "12", result
        assert result[stream].get("grpc-accept-encoding") == "identity", result
    for stream in (3, 7):
        assert result[stream].get("grpc-status") == "0", result
        assert result[stream].get("content-type") == "application/grpc", result


def stalled_calls(streams: int, announced: int) -> tuple[h2.connection.H2Connection, list[int]]:
    """An h2 client with ``streams`` ModelInfer calls queued, each sending only a 5-byte prefix
    announcing ``announced`` bytes; the client and the streams."""
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    ids = [1 + 2 * i for i in range(streams)]
    for stream in ids:
        client.send_headers(stream, REQUEST_HEADERS)
        client.send_data(stream, b"\x00" + announced.to_bytes(4, "big"))
    return client, ids


def announce_and_stall(port: int, streams: int, announced: int) -> dict[int, dict[str, str]]:
    """Open ``streams`` ModelInfer calls without a deadline, each sending only a 5-byte prefix
    announcing ``announced`` bytes, then nothing; return what the server answers each."""
    client, ids = stalled_calls(streams, announced)
    out: dict[int, dict[str, str]] = {stream: {} for stream in ids}
    ended: set[int] = set()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(30)
        sock.sendall(client.data_to_send())
        while ended != set(ids):
            for event in client.receive_data(sock.recv(65536)):
                if isinstance(event, h2.events.ResponseReceived | h2.events.TrailersReceived):
                    out[event.stream_id].update(
                        (name.decode(), value.decode()) for name, value in event.headers
                    )
                elif isinstance(event, h2.events.StreamEnded | h2.events.StreamReset):
                    ended.add(event.stream_id)
            sock.sendall(client.data_to_send())
    return out


async def test_announced_bodies_that_never_come_hold_the_budget_only_for_the_receive_timeout(
    nursery: trio.Nursery,
) -> None:
    # Four calls without deadlines announce 8 MiB each and send nothing more: together they
    # reserve (three times) all of a 96 MiB budget. They end after the receive timeout, and
    # their reservations with them; a bystander then gets room.
    server = await start_server(
        nursery,
        memory_budget=96 * 1024 * 1024,
        max_waiting_bytes=0,
        max_connection_bytes=96 * 1024 * 1024,  # the one connection may take it all here
        receive_timeout=1.0,
    )
    bystander = Bystander(server.port)
    result: dict[int, dict[str, str]] = {}

    async def attack() -> None:
        result.update(
            await trio.to_thread.run_sync(announce_and_stall, server.port, 4, 8 * 1024 * 1024)
        )

    async with trio.open_nursery() as attackers:
        attackers.start_soon(attack)
        await eventually(lambda: server.statistics().admission.reserved_bytes >= 96 * 1024 * 1024)
        refused = await bystander.client.error(
            "ModelInfer", pb.ModelInferRequest(model_name="echo"), timeout=10
        )
        assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert [answer.get("grpc-status") for answer in result.values()] == ["4"] * 4
    assert all(
        "did not arrive within 1 s of its admission" in urllib.parse.unquote(answer["grpc-message"])
        for answer in result.values()
    )
    assert server.statistics().admission.reserved_bytes == 0
    await bystander.call()


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a timeout fails the test)."""
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    return received


@pytest.mark.parametrize("sent", [b"", b"PRI * HTTP/2.0\r\n"], ids=["nothing", "half-a-preface"])
async def test_a_connection_without_a_preface_is_closed_after_the_handshake_timeout(
    nursery: trio.Nursery, sent: bytes
) -> None:
    server = await start_server(nursery, handshake_timeout=0.5)

    def connect_and_stall() -> bytes:
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.settimeout(20)
            sock.sendall(sent)
            return read_until_closed(sock)

    # Closed: recv returns the end of the stream (the server's own SETTINGS may come first).
    received = await trio.to_thread.run_sync(connect_and_stall)
    assert b"GOAWAY" not in received  # no call was made: nothing to drain
    await Bystander(server.port).call()


async def test_an_idle_connection_gets_goaway_and_is_closed_and_a_busy_one_is_not(
    nursery: trio.Nursery,
) -> None:
    server = await start_server(nursery, idle_timeout=0.5)

    def call_then_idle() -> list[object]:
        client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        client.initiate_connection()
        client.send_headers(1, REQUEST_HEADERS)
        client.send_data(1, grpc_message(echo_request()), end_stream=True)
        events: list[object] = []
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.settimeout(20)
            sock.sendall(client.data_to_send())
            while chunk := sock.recv(65536):
                events += client.receive_data(chunk)
                sock.sendall(client.data_to_send())
        return events

    events = await trio.to_thread.run_sync(call_then_idle)
    ended = [e for e in events if isinstance(e, h2.events.StreamEnded)]
    assert [e.stream_id for e in ended] == [1]  # its call was answered first
    assert goaway_codes(events) == [h2.errors.ErrorCodes.NO_ERROR]

    # A call that runs longer than the idle timeout keeps its connection.
    client = GrpcioClient(server.port)
    request = pb.ModelInferRequest(model_name="sleep")
    encode_inputs(request, [("x", np.zeros(1, np.float32))], raw=True)
    encode_parameters(request.parameters, {"delay_ms": 1500})
    response = await client.call("ModelInfer", request, timeout=20)
    assert decode_outputs(response)["x"].tolist() == [0.0]
    await Bystander(server.port).call()


async def test_a_rapid_reset_flood_is_read_no_faster_than_the_bound_on_resets(
    server: RunningServer,
) -> None:
    # CVE-2023-44487: HEADERS then RST_STREAM, thousands of times in one write. Past the bound
    # (500 at once, then 1,000 a second) the rest is read only as fast as the bound allows. The
    # connection is not closed: a grpc client in a deadline storm resets as fast, and its other
    # calls share the connection. No call of the flood starts; the call after it is answered.
    transport = server.statistics().transport
    assert transport is not None
    before = transport.calls_started
    resets = 2500
    started = time.monotonic()
    result = await trio.to_thread.run_sync(reset_flood_then_call, server.port, resets)
    assert result.get("grpc-status") == "0", result
    # A lower bound, which no slowness of the machine can break: the resets past the burst
    # were read at 1,000 a second at most.
    assert time.monotonic() - started >= 0.9 * (resets - 500) / 1000
    transport = server.statistics().transport
    assert transport is not None
    # Frames are handled in passes of _FRAMES_PER_PASS: one may end between a call's HEADERS
    # and its RST_STREAM, and that call starts (to be cancelled in the next pass).
    passes = 2 * resets // _FRAMES_PER_PASS + 1
    assert before + 1 <= transport.calls_started <= before + 1 + passes
    await Bystander(server.port).call()


def storm_beside_calls(port: int, seconds: float) -> dict[str, int]:
    """One grpc.aio channel: 90 calls at a time of a 50 ms model with a 10 ms deadline (each
    cancelled by the client when it passes: a reset), and three well-behaved calls in a loop
    beside them; how each kind ended."""

    async def run() -> dict[str, int]:
        outcomes: dict[str, int] = {}
        x = np.zeros((1, 4), np.float32)
        slow = pb.ModelInferRequest(model_name="sleep")
        encode_inputs(slow, [("x", x)], raw=True)
        encode_parameters(slow.parameters, {"delay_ms": 50})
        echo = pb.ModelInferRequest(model_name="echo")
        encode_inputs(echo, [("x", x)], raw=True)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            infer = channel.unary_unary(
                "/inference.GRPCInferenceService/ModelInfer",
                request_serializer=pb.ModelInferRequest.SerializeToString,
                response_deserializer=pb.ModelInferResponse.FromString,
            )
            end = time.monotonic() + seconds

            async def loop(kind: str, request: pb.ModelInferRequest, deadline: float) -> None:
                while time.monotonic() < end:
                    try:
                        await infer(request, timeout=deadline)
                        outcome = "OK"
                    except grpc.RpcError as exc:
                        outcome = exc.code().name
                    key = f"{kind} {outcome}"
                    outcomes[key] = outcomes.get(key, 0) + 1

            await asyncio.gather(
                *[loop("storm", slow, 0.01) for _ in range(90)],
                *[loop("bystander", echo, 20) for _ in range(3)],
            )
        return outcomes

    return asyncio.run(run())


async def test_a_deadline_storm_on_a_channel_fails_none_of_its_other_calls(
    server: RunningServer,
) -> None:
    # Thousands of calls a second past their deadline, each reset by the client: more resets
    # than the bound, from a client that is not attacking anyone. Its calls end OK or
    # DEADLINE_EXCEEDED, and the calls beside them on the same connection all succeed.
    with trio.fail_after(60):
        outcomes = await trio.to_thread.run_sync(
            storm_beside_calls, server.port, 3.0, abandon_on_cancel=True
        )
    assert {kind for kind in outcomes if kind.startswith("storm")} <= {
        "storm OK",
        "storm DEADLINE_EXCEEDED",
    }, outcomes
    assert sum(outcomes.get(f"storm {end}", 0) for end in ("OK", "DEADLINE_EXCEEDED")) > 1500
    assert [kind for kind in outcomes if kind.startswith("bystander")] == ["bystander OK"]


async def test_a_settings_flood_ends_the_connection_before_it_is_all_answered(
    server: RunningServer,
) -> None:
    flood = frame(0x4, 0x0, 0, b"") * 50_000
    events = await trio.to_thread.run_sync(exchange_until_closed, server.port, flood)
    assert goaway_codes(events) == [h2.errors.ErrorCodes.ENHANCE_YOUR_CALM]
    acknowledged = [e for e in events if isinstance(e, h2.events.SettingsAcknowledged)]
    assert len(acknowledged) <= 101  # our own SETTINGS, then the burst the bound allows
    await Bystander(server.port).call()


def announce_until_refused(
    port: int, streams: int, announced: int
) -> tuple[socket.socket, dict[int, dict[str, str]]]:
    """Open ``streams`` ModelInfer calls on one connection, each sending only a 5-byte prefix
    announcing ``announced`` bytes, and read until one of them ends; return the connection,
    still open, and what the server answered each stream so far."""
    client, ids = stalled_calls(streams, announced)
    out: dict[int, dict[str, str]] = {stream: {} for stream in ids}
    sock = socket.create_connection(("127.0.0.1", port))
    sock.settimeout(30)
    sock.sendall(client.data_to_send())
    ended = False
    while not ended:
        for event in client.receive_data(sock.recv(65536)):
            if isinstance(event, h2.events.ResponseReceived | h2.events.TrailersReceived):
                out[event.stream_id].update(
                    (name.decode(), value.decode()) for name, value in event.headers
                )
            ended = ended or isinstance(event, h2.events.StreamEnded | h2.events.StreamReset)
        sock.sendall(client.data_to_send())
    return sock, out


async def test_one_connection_cannot_take_more_than_its_share_of_the_budget(
    nursery: trio.Nursery,
) -> None:
    # Three calls on one connection announce 8 MiB each (24 MiB reserved each) and never send
    # their bodies. Two fit in the connection's share, half of a 96 MiB budget; the third is
    # refused at once, and the other half stays for everyone else.
    server = await start_server(nursery, memory_budget=96 * 1024 * 1024, max_waiting_bytes=0)
    sock, result = await trio.to_thread.run_sync(
        announce_until_refused, server.port, 3, 8 * 1024 * 1024
    )
    with sock:
        refused = [answer for answer in result.values() if answer]
        assert [answer.get("grpc-status") for answer in refused] == ["8"]  # RESOURCE_EXHAUSTED
        assert urllib.parse.unquote(refused[0]["grpc-message"]) == (
            "connection's share of the memory budget full: the request needs 25165824 more "
            "bytes, the connection holds 50331648 of its 50331648 (--max-connection-bytes)"
        )
        statistics = server.statistics().admission
        assert statistics.reserved_bytes == 48 * 1024 * 1024
        assert statistics.rejected == {"max_connection_bytes": 1}
        await Bystander(server.port).call()
    # The connection gone, its reservations are given back.
    await eventually(lambda: server.statistics().admission.reserved_bytes == 0)
    await Bystander(server.port).call()


def ping(payload: bytes = b"12345678") -> bytes:
    return frame(0x6, 0x0, 0, payload)


async def test_pings_too_often_end_the_connection_with_too_many_pings(
    server: RunningServer,
) -> None:
    # gRPC's keepalive enforcement: two PINGs too soon are forgiven, the third is not.
    events = await trio.to_thread.run_sync(exchange_until_closed, server.port, ping() * 4)
    goaways = [e for e in events if isinstance(e, h2.events.ConnectionTerminated)]
    assert [(e.error_code, e.additional_data) for e in goaways] == [
        (h2.errors.ErrorCodes.ENHANCE_YOUR_CALM, b"too_many_pings")
    ]
    acknowledged = [e for e in events if isinstance(e, h2.events.PingAckReceived)]
    assert len(acknowledged) == 3
    await Bystander(server.port).call()


def ping_then_call(port: int, calls: int) -> list[object]:
    """A PING, then an echo call read to its end, ``calls`` times on one connection; the h2
    events the server's bytes made."""
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    events: list[object] = []
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(10)
        for stream in range(1, 2 * calls, 2):
            client.ping(b"12345678")
            client.send_headers(stream, REQUEST_HEADERS)
            client.send_data(stream, grpc_message(echo_request()), end_stream=True)
            sock.sendall(client.data_to_send())
            events += read_until_a_stream_ends(sock, client)
    return events


def read_until_a_stream_ends(
    sock: socket.socket, client: h2.connection.H2Connection
) -> list[object]:
    """The h2 events the server's bytes make until a stream ends (a call's answer read to
    its end) or is reset, what the client owes for each read (acknowledgements, windows) sent
    back."""
    events: list[object] = []
    ended = False
    while not ended:
        chunk = sock.recv(65536)
        assert chunk, "the server closed the connection"
        for event in client.receive_data(chunk):
            events.append(event)
            ended = ended or isinstance(event, h2.events.StreamEnded | h2.events.StreamReset)
        sock.sendall(client.data_to_send())
    return events


async def test_pings_between_answered_calls_are_forgiven(server: RunningServer) -> None:
    # A client's flow-control probes come with its calls: the answers sent between two PINGs
    # forgive them, as gRPC servers do.
    events = await trio.to_thread.run_sync(ping_then_call, server.port, 10)
    assert goaway_codes(events) == []
    assert len([e for e in events if isinstance(e, h2.events.StreamEnded)]) == 10


async def test_pings_keep_no_connection_open_past_the_idle_timeout(
    nursery: trio.Nursery,
) -> None:
    # Only calls count as use: a client pinging within the keepalive rules is still idle.
    # PINGs every 100 ms, a hundred times the interval allowed: a busy server that reads two
    # in one go still sees them apart.
    server = await start_server(nursery, idle_timeout=0.5, keepalive_min_interval=0.001)

    def ping_until_closed() -> bytes:
        client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        client.initiate_connection()
        received = bytearray()
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.settimeout(0.1)
            sock.sendall(client.data_to_send())
            for _ in range(200):  # 20 s at most
                try:
                    sock.sendall(ping())
                    time.sleep(0.1)
                    chunk = sock.recv(65536)
                except TimeoutError:
                    continue
                except ConnectionError:
                    break  # closed: the GOAWAY came before
                if not chunk:
                    break
                received += chunk
        return bytes(received)

    # The frames are read by hand, not by an h2 client: on a slow machine the first read may
    # already hold the GOAWAY followed by a PING's ACK, which h2 refuses with the whole read.
    received = await trio.to_thread.run_sync(ping_until_closed)
    assert goaway_codes_in(received) == [h2.errors.ErrorCodes.NO_ERROR]
    await Bystander(server.port).call()


def unknown_method_flood(port: int, path_length: int, seconds: float) -> int:
    """Call an unknown method with a long path again and again on one connection for
    ``seconds``, never reading: each call is a few bytes (the path is in the client's HPACK
    table) and each answer is a status naming the method (its first 200 characters).
    Returns the calls sent."""
    path = "/unknown.Service/" + "x" * path_length
    headers = [(n, path if n == ":path" else v) for n, v in REQUEST_HEADERS]
    client = h2.connection.H2Connection(
        h2.config.H2Configuration(client_side=True, header_encoding=None)
    )
    client.local_settings.max_concurrent_streams = 2**31 - 1
    client.initiate_connection()
    body = grpc_message(b"")
    sent = 0
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", port))
        sock.settimeout(2.0)
        sock.sendall(client.data_to_send())
        end = time.monotonic() + seconds
        stream = 1
        while time.monotonic() < end:
            batch = bytearray()
            for _ in range(50):
                # Streams end as the server answers; h2 never hears, so it is told nothing.
                batch += frame(0x1, 0x4, stream, client.encoder.encode(headers))
                batch += frame(0x0, 0x1, stream, body)
                stream += 2
            try:
                sock.sendall(batch)
            except TimeoutError:
                break  # the server stopped reading: what it holds for us is bounded
            sent += 50
    return sent


async def test_a_client_that_reads_nothing_makes_the_server_hold_a_bounded_backlog(
    server: RunningServer,
) -> None:
    # Tiny requests (a 3 KB path the client's HPACK table holds) each answered with a status,
    # and the client never reads: the server stops reading its requests once its unsent
    # answers pass max_unsent_bytes, so what it holds for the client stays bounded.
    peaks = Peaks(server)
    async with trio.open_nursery() as watching:
        watching.start_soon(peaks.watch)
        # The flood ends when the server stops reading (about 200,000 calls, 7 s on an idle
        # machine); the time given it guards against a server that never does.
        sent = await trio.to_thread.run_sync(unknown_method_flood, server.port, 3000, 120.0)
        await Bystander(server.port).call()
        watching.cancel_scope.cancel()
    peak = peaks.unsent
    bound = ProtocolLimits().max_unsent_bytes
    assert peak > bound / 2, (peak, sent)  # the attack did fill what it could
    # The bound, plus what the requests of the last read before it was passed answer.
    assert peak < bound + 2 * 1024 * 1024, (peak, sent)


def wide_open_call(
    port: int,
    body: bytes,
    headers: list[tuple[str, str]] = REQUEST_HEADERS,
    *,
    end_stream: bool = True,
    receive_buffer: int = 0,
) -> tuple[h2.connection.H2Connection, socket.socket]:
    """Open a connection whose client lets in any answer (flow-control windows wide open,
    frames of up to 16 MiB) and send one ModelInfer call with ``body`` as flow control allows;
    the client and the socket, still open, before any of the answer is read."""
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    client.update_settings(
        {
            h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 2**31 - 1,
            h2.settings.SettingCodes.MAX_FRAME_SIZE: 2**24 - 1,
        }
    )
    client.increment_flow_control_window(2**31 - 1 - 65535)
    client.send_headers(1, headers)
    sock = socket.socket()
    if receive_buffer:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.connect(("127.0.0.1", port))
    sock.settimeout(10)
    sock.sendall(client.data_to_send())
    while body:
        room = min(client.local_flow_control_window(1), client.max_outbound_frame_size)
        if room:
            client.send_data(1, body[:room], end_stream=end_stream and len(body) <= room)
            body = body[room:]
        else:
            client.receive_data(sock.recv(65536))  # window updates: the answer comes after
        sock.sendall(client.data_to_send())
    return client, sock


def half_closed_call(
    port: int,
    body: bytes,
    *,
    end_stream: bool = True,
    receive_buffer: int = 0,
    after_answer_starts: bool = False,
) -> tuple[dict[str, str], int]:
    """A ModelInfer call sending ``body``, then the client's TCP half-close (once the first
    bytes of the answer are in, with ``after_answer_starts``), then everything read until the
    server closes the connection; the call's status (its trailers, or its trailers-only
    response) and how many bytes of DATA came."""
    trailers: dict[str, str] = {}
    received = 0
    client, sock = wide_open_call(port, body, end_stream=end_stream, receive_buffer=receive_buffer)
    with sock:
        first: list[object] = []
        while after_answer_starts and not first:
            first = client.receive_data(sock.recv(16))
            received += sum(
                e.flow_controlled_length for e in first if isinstance(e, h2.events.DataReceived)
            )
        sock.shutdown(socket.SHUT_WR)
        while chunk := sock.recv(65536):
            for event in client.receive_data(chunk):
                if isinstance(event, h2.events.ResponseReceived | h2.events.TrailersReceived):
                    trailers.update((n.decode(), v.decode()) for n, v in event.headers)
                elif isinstance(event, h2.events.DataReceived):
                    received += event.flow_controlled_length
    return trailers, received


def echo_of(x: np.ndarray, model: str = "echo", **parameters: int) -> bytes:
    request = pb.ModelInferRequest(model_name=model)
    encode_inputs(request, [("x", x)], raw=True)
    encode_parameters(request.parameters, parameters)
    return request.SerializeToString()


async def test_calls_in_flight_are_answered_after_the_client_half_closes(
    server: RunningServer,
) -> None:
    body = grpc_message(echo_of(np.zeros(1, np.float32), "sleep", delay_ms=300))
    trailers, _ = await trio.to_thread.run_sync(half_closed_call, server.port, body)
    assert trailers.get("grpc-status") == "0", trailers
    await Bystander(server.port).call()


async def test_an_answer_still_queued_at_the_half_close_is_written_whole(
    server: RunningServer,
) -> None:
    # The call has ended, its answer started, when the client half-closes; the rest of its
    # 1 MiB answer cannot have been written yet (the client's receive buffer is small): it is
    # written whole, then the status.
    x = np.ones(256 * 1024, np.float32)
    call = functools.partial(half_closed_call, receive_buffer=4096, after_answer_starts=True)
    trailers, received = await trio.to_thread.run_sync(call, server.port, grpc_message(echo_of(x)))
    assert trailers.get("grpc-status") == "0", trailers
    assert received > x.nbytes


async def test_a_call_still_waiting_for_its_request_ends_at_the_half_close(
    server: RunningServer,
) -> None:
    # Half a message prefix, then the half-close: no more can come, so the call ends at once
    # (rather than holding its connection and task) and the connection closes.
    call = functools.partial(half_closed_call, end_stream=False)
    trailers, _ = await trio.to_thread.run_sync(call, server.port, b"\x00\x00")
    assert trailers.get("grpc-status") == "3", trailers  # INVALID_ARGUMENT
    await eventually(lambda: server.statistics().transport.connections == 0)  # type: ignore[union-attr]


def call_with_a_shut_window(port: int, request: bytes, window: int = 0) -> list[object]:
    """One ModelInfer call from a client whose SETTINGS give every stream a receive window of
    ``window`` bytes and that never opens more: the h2 events the server's bytes make until
    the call ends."""
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    client.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: window})
    client.send_headers(1, REQUEST_HEADERS)
    client.send_data(1, grpc_message(request), end_stream=True)
    events: list[object] = []
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(10)
        sock.sendall(client.data_to_send())
        while not any(isinstance(e, h2.events.StreamEnded | h2.events.StreamReset) for e in events):
            received = sock.recv(65536)
            assert received, "the server closed the connection"
            events += client.receive_data(received)
            sock.sendall(client.data_to_send())
    return events


async def test_an_answer_none_of_which_could_be_sent_ends_with_a_status_not_a_reset(
    nursery: trio.Nursery,
) -> None:
    # Its stream's window shut from the start, the client gets none of its answer's bytes: the
    # send timeout ends the call with nothing of the message sent, so its status can follow
    # the response headers (trailers take no window), and the client learns why.
    server = await start_server(nursery, workers=1, send_timeout=0.5)
    events = await trio.to_thread.run_sync(
        call_with_a_shut_window, server.port, echo_of(np.ones(16, np.float32))
    )
    assert not any(isinstance(e, h2.events.StreamReset | h2.events.DataReceived) for e in events)
    trailers = [e for e in events if isinstance(e, h2.events.TrailersReceived)]
    assert len(trailers) == 1, events
    fields = dict(trailers[0].headers)
    assert fields[b"grpc-status"] == b"1", fields  # CANCELLED
    assert urllib.parse.unquote(fields[b"grpc-message"].decode()) == (
        "the client read none of its response for 0.5 s"
    )
    assert server.statistics().admission.reserved_bytes == 0
    await Bystander(server.port).call()


@pytest.mark.parametrize("window", [1, 5], ids=["its-flag", "its-prefix"])
async def test_an_answer_cut_off_after_its_first_bytes_has_its_stream_reset(
    nursery: trio.Nursery, window: int
) -> None:
    # Once any byte of the message is sent, even its flag alone, trailers after it would be
    # read as the rest of the message: the stream is reset instead, and nothing follows.
    server = await start_server(nursery, workers=1, send_timeout=0.5)
    events = await trio.to_thread.run_sync(
        call_with_a_shut_window, server.port, echo_of(np.ones(16, np.float32)), window
    )
    data = b"".join(e.data for e in events if isinstance(e, h2.events.DataReceived))
    assert len(data) == window, events
    assert data[:1] == b"\x00", data  # the flag: not compressed
    assert not any(isinstance(e, h2.events.TrailersReceived) for e in events), events
    resets = [e for e in events if isinstance(e, h2.events.StreamReset)]
    assert [reset.error_code for reset in resets] == [h2.errors.ErrorCodes.CANCEL], events
    await eventually(lambda: server.statistics().admission.reserved_bytes == 0)
    await Bystander(server.port).call()


def send_request_then_stop_reading(
    port: int, request: bytes, headers: list[tuple[str, str]] = REQUEST_HEADERS
) -> socket.socket:
    """Send one ModelInfer call whose answer the client lets in but does not read (its receive
    buffer small); return the socket, still open."""
    _, sock = wide_open_call(port, grpc_message(request), headers, receive_buffer=4096)
    return sock


async def test_an_answer_holds_its_reservation_until_its_bytes_are_written(
    server: RunningServer,
) -> None:
    # A 3.5 MiB echo to a client that reads none of it: the kernel's buffers take some, the
    # rest stays queued (under max_unsent_bytes) after the call has ended. What the call
    # reserved is held until those bytes have been written, not given back when its handler
    # returned.
    x = np.ones(7 * 1024 * 1024 // 8, np.float32)
    request = pb.ModelInferRequest(model_name="echo")
    encode_inputs(request, [("x", x)], raw=True)
    sock = await trio.to_thread.run_sync(
        send_request_then_stop_reading, server.port, request.SerializeToString()
    )
    with sock:

        def ended_with_bytes_unsent() -> bool:
            transport = server.statistics().transport
            assert transport is not None
            return transport.calls == 0 and transport.unsent_bytes > 1024 * 1024

        await eventually(ended_with_bytes_unsent)
        assert server.statistics().admission.reserved_bytes >= 3 * x.nbytes
        received = await trio.to_thread.run_sync(read_until_reserved_is_free, sock, server)
    assert received  # the reservation was freed as the client read, not before
    assert server.statistics().admission.reserved_bytes == 0


def read_until_reserved_is_free(sock: socket.socket, server: RunningServer) -> bytes:
    """Read what the server sends until nothing is reserved any more (10 s at most)."""
    received = bytearray()
    end = time.monotonic() + 10
    sock.settimeout(0.05)  # the last bytes may be in before the server has seen them written
    while server.statistics().admission.reserved_bytes and time.monotonic() < end:
        with contextlib.suppress(TimeoutError):
            received += sock.recv(1 << 20)
    return bytes(received)


async def test_a_request_of_millions_of_empty_submessages_is_refused_before_it_is_parsed(
    server: RunningServer,
) -> None:
    # 8 MiB of empty requested outputs: four million objects and seconds of the event loop
    # for protobuf's parser. Their fields are counted from the wire format first.
    flood = b"\x0a\x04echo" + b"\x32\x00" * 4_000_000
    result = await trio.to_thread.run_sync(call_with_body, server.port, grpc_message(flood))
    assert result.get("grpc-status") == "3", result  # INVALID_ARGUMENT
    assert urllib.parse.unquote(result["grpc-message"]) == (
        "the request has more than 16384 fields outside its tensors' contents"
    )
    assert server.statistics().admission.reserved_bytes == 0
    await Bystander(server.port).call()


async def test_a_large_message_to_a_method_without_tensors_is_refused_from_its_prefix(
    server: RunningServer,
) -> None:
    headers = [
        (n, "/inference.GRPCInferenceService/ModelMetadata" if n == ":path" else v)
        for n, v in REQUEST_HEADERS
    ]
    result = await trio.to_thread.run_sync(announce_one, server.port, headers, 1024 * 1024)
    assert result.get("grpc-status") == "8", result  # RESOURCE_EXHAUSTED
    assert urllib.parse.unquote(result["grpc-message"]) == (
        "request message of 1048576 bytes is larger than the maximum of 65536 bytes for "
        "/inference.GRPCInferenceService/ModelMetadata"
    )
    await Bystander(server.port).call()


def announce_one(port: int, headers: list[tuple[str, str]], announced: int) -> dict[str, str]:
    """A call whose 5-byte prefix announces ``announced`` bytes, and no more; its answer."""
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    client.send_headers(1, headers)
    client.send_data(1, b"\x00" + announced.to_bytes(4, "big"))
    return status_of(port, client, 1)


def status_of(
    port: int, client: h2.connection.H2Connection, stream: int, body: bytes = b""
) -> dict[str, str]:
    """Send what ``client`` has queued on a new connection, then ``body`` on ``stream`` as flow
    control allows (ending it); read until ``stream``'s status comes. Its response headers and
    trailers."""
    out: dict[str, str] = {}
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(10)
        sock.sendall(client.data_to_send())
        while "grpc-status" not in out:
            room = min(client.local_flow_control_window(stream), client.max_outbound_frame_size)
            if body and room:
                client.send_data(stream, body[:room], end_stream=len(body) <= room)
                body = body[room:]
            else:
                chunk = sock.recv(65536)
                assert chunk, "the server closed the connection"
                for event in client.receive_data(chunk):
                    if (
                        isinstance(event, h2.events.ResponseReceived | h2.events.TrailersReceived)
                        and event.stream_id == stream
                    ):
                        out.update((n.decode(), v.decode()) for n, v in event.headers)
            sock.sendall(client.data_to_send())
    return out


def call_with_body(port: int, body: bytes) -> dict[str, str]:
    """A ModelInfer call with ``body`` as its request stream, sent as flow control allows;
    its response headers and trailers."""
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    client.send_headers(1, REQUEST_HEADERS)
    return status_of(port, client, 1, body)


async def test_bytes_that_are_not_a_request_get_invalid_argument_naming_the_message(
    server: RunningServer,
) -> None:
    result = await trio.to_thread.run_sync(call_with_body, server.port, grpc_message(b"\xff\xff"))
    assert result.get("grpc-status") == "3", result  # INVALID_ARGUMENT
    assert urllib.parse.unquote(result["grpc-message"]) == (
        "the request is not a valid inference.ModelInferRequest"
    )
    await Bystander(server.port).call()


def begin_and_stall(port: int, method: str, sent: bytes) -> dict[str, str]:
    """A call of ``method`` without a deadline that sends ``sent`` of its request (nothing, or
    part of a message's prefix) and no more; its answer."""
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    client.send_headers(
        1,
        [
            (":path", method) if name == ":path" else (name, value)
            for name, value in REQUEST_HEADERS
        ],
    )
    if sent:
        client.send_data(1, sent)
    return status_of(port, client, 1)


@pytest.mark.parametrize("sent", [b"", b"\x00\x00\x00"], ids=["no-data", "part-of-a-prefix"])
@pytest.mark.parametrize(
    "method",
    [
        "/inference.GRPCInferenceService/ModelInfer",
        "/inference.GRPCInferenceService/ServerLive",
        "/grpc.health.v1.Health/Watch",
    ],
)
async def test_a_call_of_one_request_message_that_never_begins_it_ends_after_the_receive_timeout(
    nursery: trio.Nursery, method: str, sent: bytes
) -> None:
    # A unary call (or a health Watch) has nothing to wait for before it sends its message: one
    # that sends none, or only part of its prefix, holds its stream no longer than the receive
    # timeout, as an announced message that never comes holds its reservation no longer.
    server = await start_server(nursery, workers=1, receive_timeout=1.0)
    answer = await trio.to_thread.run_sync(begin_and_stall, server.port, method, sent)
    assert answer.get("grpc-status") == "4", answer  # DEADLINE_EXCEEDED
    assert urllib.parse.unquote(answer["grpc-message"]) == (
        "the call's request message did not begin within 1 s of the call"
    )
    await Bystander(server.port).call()


@pytest.mark.parametrize(
    ("grpc_timeout", "receive_timeout", "said"),
    [
        ("300m", 30.0, "deadline exceeded"),
        ("60S", 0.5, "the call's request message did not begin within 0.5 s of the call"),
    ],
    ids=["deadline-first", "receive-timeout-first"],
)
async def test_a_call_that_never_begins_its_message_ends_at_its_deadline_or_the_receive_timeout(
    nursery: trio.Nursery, grpc_timeout: str, receive_timeout: float, said: str
) -> None:
    # Whichever comes first ends it, each with its own reason.
    server = await start_server(nursery, workers=1, receive_timeout=receive_timeout)
    result = await trio.to_thread.run_sync(
        answers, server.port, [(1, "headers", [*REQUEST_HEADERS, ("grpc-timeout", grpc_timeout)])]
    )
    assert result[1].get("grpc-status") == "4", result  # DEADLINE_EXCEEDED
    assert urllib.parse.unquote(result[1]["grpc-message"]) == said
    await eventually(lambda: server.statistics().transport.calls == 0)  # type: ignore[union-attr]


def reset_flood_then_call(port: int, resets: int) -> dict[str, str]:
    """``resets`` calls opened and reset at once, then an echo call, in one write on one
    connection; the echo call's response headers and trailers."""
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    for stream in range(1, 2 * resets, 2):
        client.send_headers(stream, REQUEST_HEADERS)
        client.reset_stream(stream, h2.errors.ErrorCodes.CANCEL)
    last = 2 * resets + 1
    client.send_headers(last, REQUEST_HEADERS)
    client.send_data(last, grpc_message(echo_request()), end_stream=True)
    return status_of(port, client, last)


async def test_calls_opened_and_reset_in_one_read_start_no_work(server: RunningServer) -> None:
    # A rapid-reset flood under the reset bound, in one write: no call task is started for
    # any of its calls, and the connection goes on serving.
    transport = server.statistics().transport
    assert transport is not None
    before = transport.calls_started
    result = await trio.to_thread.run_sync(reset_flood_then_call, server.port, 200)
    assert result.get("grpc-status") == "0", result
    transport = server.statistics().transport
    assert transport is not None
    assert transport.calls_started == before + 1


async def test_an_error_names_a_long_method_by_its_start_only(server: RunningServer) -> None:
    # One byte of HPACK can stand for a 3 KB path: its answer must not be kilobytes.
    client = GrpcioClient(server.port)
    method = "/unknown.Service/" + "x" * 3000
    call = client.channel.unary_unary(method)
    with pytest.raises(grpc.RpcError) as caught:
        await trio.to_thread.run_sync(lambda: call(b"", timeout=10))
    assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert caught.value.details() == f"method {method[:200]}... is not served here"


async def test_an_answer_cut_off_by_its_deadline_holds_its_reservation_until_written(
    server: RunningServer,
) -> None:
    # A 16 MiB echo with a deadline, to a client that takes frames of any size and reads
    # nothing: the answer is queued no further than max_unsent_bytes, the deadline ends the
    # call with part of it queued, and what the call reserved is held until that part has
    # been written (the queued frames are views of the answer's memory).
    x = np.ones(4 * 1024 * 1024, np.float32)
    headers = [*REQUEST_HEADERS, ("grpc-timeout", "1500m")]
    sock = await trio.to_thread.run_sync(
        send_request_then_stop_reading, server.port, echo_of(x), headers
    )
    peak = 0

    def cut_off_with_bytes_unsent() -> bool:
        nonlocal peak
        transport = server.statistics().transport
        assert transport is not None
        peak = max(peak, transport.largest_unsent_bytes)
        return transport.calls == 0 and transport.unsent_bytes > 1024 * 1024

    with sock:
        await eventually(cut_off_with_bytes_unsent)
        assert server.statistics().admission.reserved_bytes >= 3 * x.nbytes
        assert peak <= ProtocolLimits().max_unsent_bytes + 64 * 1024
        await trio.to_thread.run_sync(read_until_reserved_is_free, sock, server)
    assert server.statistics().admission.reserved_bytes == 0


def calls_across_table_sizes(port: int, sizes: list[int], timeout: float = 10.0) -> list[dict]:
    """On one connection, for each of ``sizes``: set the client's SETTINGS_HEADER_TABLE_SIZE to
    it, wait for the server's ACK, then make three echo calls one after another; return each
    call's response headers and trailers, as the client's HPACK decoder reads them."""
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    body = grpc_message(echo_request())
    results: list[dict] = []
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(timeout)

        def until(done: type) -> dict[str, str]:
            fields: dict[str, str] = {}
            while True:
                sock.sendall(client.data_to_send())
                for event in client.receive_data(sock.recv(65536)):
                    if isinstance(event, h2.events.ResponseReceived | h2.events.TrailersReceived):
                        fields.update((n.decode(), v.decode()) for n, v in event.headers)
                    if isinstance(event, done):
                        return fields

        for size in sizes:
            client.update_settings({h2.settings.SettingCodes.HEADER_TABLE_SIZE: size})
            until(h2.events.SettingsAcknowledged)
            for _ in range(3):
                stream = client.get_next_available_stream_id()
                client.send_headers(stream, REQUEST_HEADERS)
                client.send_data(stream, body, end_stream=True)
                results.append(until(h2.events.StreamEnded))
    return results


async def test_response_header_blocks_follow_the_clients_table_size_changes(
    server: RunningServer,
) -> None:
    # The server remembers the coding of the headers and trailers it sends every call; each
    # change of the client's table size (emptying the table, then allowing it again) must be
    # announced at the start of the next block, and the blocks after it coded for the new
    # table, or the client's decoder reads the wrong fields or fails.
    results = await trio.to_thread.run_sync(
        calls_across_table_sizes, server.port, [4096, 0, 4096, 64, 4096]
    )
    assert len(results) == 15
    for fields in results:
        assert fields[":status"] == "200", fields
        assert fields["content-type"] == "application/grpc", fields
        assert fields["grpc-status"] == "0", fields
        assert fields["x-request-id"], fields


async def test_a_request_shaped_like_a_served_one_but_short_of_bytes_is_refused(
    server: RunningServer,
) -> None:
    # The decoder remembers a (datatype, shape) it found valid; a request of that layout with
    # fewer bytes, or a name twice, is refused as before, and the good calls go on.
    client = GrpcioClient(server.port)

    def add_sub(first: bytes, second: bytes, name: str = "INPUT1") -> pb.ModelInferRequest:
        request = pb.ModelInferRequest(model_name="add_sub")
        for each in ("INPUT0", name):
            request.inputs.add(name=each, datatype="FP32", shape=[1, 16])
        request.raw_input_contents.extend([first, second])
        return request

    ones = np.ones(16, np.float32).tobytes()
    try:
        for _ in range(2):
            answer = await client.call("ModelInfer", add_sub(ones, ones))
            assert decode_outputs(answer)["OUTPUT0"].tolist() == [[2.0] * 16]
            short = await client.error("ModelInfer", add_sub(ones, ones[:-4]))
            assert short.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert short.details() == (
                "input 'INPUT1': shape [1, 16] has 16 elements but raw_input_contents[1] holds "
                "15 FP32 elements (60 bytes)"
            )
            twice = await client.error("ModelInfer", add_sub(ones, ones, name="INPUT0"))
            assert twice.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert twice.details() == "input 'INPUT0' appears more than once in the request"
    finally:
        client.channel.close()


async def test_a_remembered_layout_with_a_wrong_datatype_typed_data_or_an_entry_missing_is_refused(
    server: RunningServer,
) -> None:
    # Inputs of layouts the decoder remembers are decoded in one pass only when each is exactly
    # one, with its bytes, under a name of its own, with no contents beside and one raw entry
    # each: anything else takes the full checks and is refused in their words, unary and on a
    # stream, and the good calls around it are answered.
    client = GrpcioClient(server.port)
    ones = np.ones(16, np.float32).tobytes()

    def add_sub(
        *,
        datatype: str = "FP32",
        second: bytes = ones,
        name: str = "INPUT1",
        typed: bool = False,
        entries: int = 2,
    ) -> pb.ModelInferRequest:
        request = pb.ModelInferRequest(model_name="add_sub")
        request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 16])
        tensor = request.inputs.add(name=name, datatype=datatype, shape=[1, 16])
        if typed:
            tensor.contents.fp32_contents.extend([1.0] * 16)
        request.raw_input_contents.extend([ones, second][:entries])
        return request

    refused = [
        (
            add_sub(second=ones[:-4]),
            "input 'INPUT1': shape [1, 16] has 16 elements but raw_input_contents[1] holds "
            "15 FP32 elements (60 bytes)",
        ),
        (add_sub(name="INPUT0"), "input 'INPUT0' appears more than once in the request"),
        (
            add_sub(datatype="FLOAT32"),
            "input 'INPUT1': unknown datatype 'FLOAT32'; valid datatypes are "
            + ", ".join(DATATYPES),
        ),
        (
            add_sub(datatype="INT32"),
            "model 'add_sub' input 'INPUT1': expected datatype FP32, got INT32",
        ),
        (
            add_sub(typed=True),
            "contents field must not be specified when using raw_input_contents for 'INPUT1' "
            "for model 'add_sub': send every input raw or every input typed, not both",
        ),
        (
            add_sub(entries=1),
            "request has 2 inputs but 1 raw_input_contents entries; raw_input_contents needs "
            "exactly one entry per input, in input order",
        ),
    ]
    try:
        for _ in range(2):
            answer = await client.call("ModelInfer", add_sub())
            assert decode_outputs(answer)["OUTPUT0"].tolist() == [[2.0] * 16]
            for request, message in refused:
                error = await client.error("ModelInfer", request)
                assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert error.details() == message
        # A stream answers its messages as they end: matched by id.
        sent = [add_sub(), *(request for request, _ in refused), add_sub()]
        for index, request in enumerate(sent):
            request.id = str(index)
        answers = await trio.to_thread.run_sync(
            lambda: list(client.stub.ModelStreamInfer(iter(sent)))
        )
        by_id = {answer.infer_response.id: answer for answer in answers}
        assert {key: answer.error_message for key, answer in by_id.items()} == {
            "0": "",
            **{str(index + 1): message for index, (_, message) in enumerate(refused)},
            str(len(sent) - 1): "",
        }
        for key in ("0", str(len(sent) - 1)):
            outputs = decode_outputs(by_id[key].infer_response)
            assert outputs["OUTPUT1"].tolist() == [[0.0] * 16]
    finally:
        client.channel.close()


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("sent", [1, 4])
async def test_a_request_ended_inside_a_message_prefix_is_refused_saying_what_arrived(
    server: RunningServer, sent: int, split: bool
) -> None:
    # A stream that ends after part of a message's 5-byte prefix sent a message's start, not
    # no message: the status says so, whether the bytes came in one DATA frame or several.
    prefix = grpc_message(echo_request())[:sent]
    parts = [prefix[:1], prefix[1:]] if split else [prefix]
    send: list[tuple[int, str, object]] = [(1, "headers", REQUEST_HEADERS)]
    send += [(1, "data", part) for part in parts if part]
    send.append((1, "end", None))
    result = await trio.to_thread.run_sync(answers, server.port, send)
    assert result[1].get("grpc-status") == "3", result[1]  # INVALID_ARGUMENT
    assert urllib.parse.unquote(result[1]["grpc-message"]) == (
        f"the request ended after {sent} of a message's 5 prefix bytes"
    )
    await Bystander(server.port).call()


async def test_a_request_ended_inside_a_message_prefix_by_trailers_is_refused_saying_so(
    server: RunningServer,
) -> None:
    result = await trio.to_thread.run_sync(
        answers,
        server.port,
        [
            (1, "headers", REQUEST_HEADERS),
            (1, "data", b"\x00\x00"),
            (1, "trailers", [("x-trailer", "1")]),
        ],
    )
    assert result[1].get("grpc-status") == "3", result[1]
    assert urllib.parse.unquote(result[1]["grpc-message"]) == (
        "the request ended after 2 of a message's 5 prefix bytes"
    )


async def test_a_request_ended_inside_a_message_is_refused_saying_how_much_arrived(
    server: RunningServer,
) -> None:
    message = echo_request()
    result = await trio.to_thread.run_sync(
        call_with_body, server.port, grpc_message(message)[: 5 + 3]
    )
    assert result.get("grpc-status") == "3", result
    assert urllib.parse.unquote(result["grpc-message"]) == (
        f"the request ended after 3 of its message's {len(message)} bytes"
    )


async def test_a_request_of_no_bytes_is_refused_as_one_without_a_message(
    server: RunningServer,
) -> None:
    result = (
        await trio.to_thread.run_sync(
            answers, server.port, [(1, "headers", REQUEST_HEADERS), (1, "end", None)]
        )
    )[1]
    assert result.get("grpc-status") == "3", result
    assert urllib.parse.unquote(result["grpc-message"]) == (
        "/inference.GRPCInferenceService/ModelInfer expects one request message and got none"
    )


def trailers_then_call(port: int, answered: bool) -> tuple[list[object], dict[str, str]]:
    """A call on stream 1 whose trailers come without END_STREAM (once its answer is read, if
    ``answered``; otherwise with the last byte of its message still to come, so that it cannot
    have been answered), then a whole call on stream 3, on one connection: the h2 events of
    stream 1 and the connection after the trailers, and stream 3's response headers and
    trailers."""
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    client.send_headers(1, REQUEST_HEADERS)
    message = grpc_message(echo_request())
    client.send_data(1, message if answered else message[:-1])
    events: list[object] = []
    third: dict[str, str] = {}
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(10)
        sock.sendall(client.data_to_send())
        if answered:
            read_until_a_stream_ends(sock, client)
        trailers = frame(0x1, 0x4, 1, client.encoder.encode([("x-trailer", "1")]))
        client.send_headers(3, REQUEST_HEADERS)
        client.send_data(3, grpc_message(echo_request()), end_stream=True)
        sock.sendall(trailers + client.data_to_send())
        while "grpc-status" not in third:  # stream 1's reset, if any, was queued before
            chunk = sock.recv(65536)
            assert chunk, "the server closed the connection"
            for event in client.receive_data(chunk):
                stream = getattr(event, "stream_id", 0)
                if stream == 3 and hasattr(event, "headers"):
                    third.update((n.decode(), v.decode()) for n, v in event.headers)
                elif stream != 3 and not isinstance(event, h2.events.RemoteSettingsChanged):
                    events.append(event)
            sock.sendall(client.data_to_send())
    return events, third


@pytest.mark.parametrize("answered", [False, True])
async def test_request_trailers_without_end_stream_reset_their_stream_alone(
    server: RunningServer, answered: bool
) -> None:
    # RFC 9113 §8.1: a second header block without END_STREAM makes the request malformed,
    # a stream error (§8.1.1): its stream is reset, and the connection's other calls go on. A
    # stream answered (and reset with NO_ERROR, its request not ended) ignores it (§5.1).
    events, third = await trio.to_thread.run_sync(trailers_then_call, server.port, answered)
    resets = [e for e in events if isinstance(e, h2.events.StreamReset)]
    assert [(e.stream_id, e.error_code) for e in resets] == (
        [] if answered else [(1, h2.errors.ErrorCodes.PROTOCOL_ERROR)]
    )
    assert not goaway_codes(events)
    assert third.get("grpc-status") == "0", third
    await Bystander(server.port).call()


def stream_call(port: int, body: bytes) -> tuple[int, dict[str, str]]:
    """A ModelStreamInfer call whose request stream is ``body``, sent whole and ended: how
    many response messages came before its status, and its response headers and trailers."""
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    stream = [
        (name, "/inference.GRPCInferenceService/ModelStreamInfer" if name == ":path" else value)
        for name, value in REQUEST_HEADERS
    ]
    client.send_headers(1, stream)
    client.send_data(1, body, end_stream=True)
    received = bytearray()
    out: dict[str, str] = {}
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(10)
        sock.sendall(client.data_to_send())
        while "grpc-status" not in out:
            chunk = sock.recv(65536)
            assert chunk, "the server closed the connection"
            for event in client.receive_data(chunk):
                if isinstance(event, h2.events.DataReceived):
                    received += event.data
                    client.acknowledge_received_data(event.flow_controlled_length, 1)
                elif isinstance(event, h2.events.ResponseReceived | h2.events.TrailersReceived):
                    out.update((n.decode(), v.decode()) for n, v in event.headers)
            sock.sendall(client.data_to_send())
    messages = 0
    while received:
        received = received[5 + int.from_bytes(received[1:5], "big") :]
        messages += 1
    return messages, out


@pytest.mark.parametrize(
    ("after", "status", "message"),
    [
        (b"\x00\x00", "3", "the request ended after 2 of a message's 5 prefix bytes"),
        (
            b"\x00\xff\xff\xff\xff",
            "8",  # RESOURCE_EXHAUSTED
            "request message of 4294967295 bytes is larger than the maximum of 67108864 bytes",
        ),
        (b"\x01\x00\x00\x00\x01x", "13", "compressed message without a grpc-encoding"),
    ],
    ids=["ended-in-a-prefix", "over-the-size-limit", "compressed"],
)
async def test_a_stream_s_message_refused_from_its_prefix_ends_the_stream_with_its_status(
    server: RunningServer, after: bytes, status: str, message: str
) -> None:
    # The messages before it are answered, then the stream ends with the refusal's own status
    # and words, as one refused once its prefix was taken (its receive timeout, the budget).
    sent = grpc_message(echo_request()) * 2 + after
    answered, result = await trio.to_thread.run_sync(stream_call, server.port, sent)
    assert (result.get("grpc-status"), urllib.parse.unquote(result.get("grpc-message", ""))) == (
        status,
        message,
    )
    assert answered == 2
    await Bystander(server.port).call()
