"""Hostile and careless clients: raw HTTP/2 written by hand or with h2, against a real server,
with a well-behaved grpcio client beside each whose calls must keep succeeding."""

from __future__ import annotations

import socket
import urllib.parse

import grpc
import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import hpack
import numpy as np
import pytest
import trio

from tests.support import GrpcioClient, eventually, start_server
from trio_infer.protobuf._proto import grpc_predict_v2_pb2 as pb
from trio_infer.protobuf.codec import decode_outputs, encode_inputs, encode_parameters
from trio_infer.server import RunningServer

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
    assert "one%20request%20message" in result[1].get("grpc-message", ""), result[1]
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
    ("headers", "message"),
    [
        (
            [*REQUEST_HEADERS, ("content-type", "application/grpc")],
            "content-type appears 2 times; a gRPC call sends it once",
        ),
        (
            [(":method", "GET"), *REQUEST_HEADERS[1:]],
            "the request's :method is 'GET'; gRPC calls are POST",
        ),
        (
            [*REQUEST_HEADERS, ("grpc-timeout", "1" * 40 + "S")],
            "grpc-timeout '11111111111111111111...' is not a gRPC timeout (1 to 8 digits and a "
            "unit: H, M, S, m, u or n)",
        ),
    ],
    ids=["duplicate-content-type", "get", "40-digit-timeout"],
)
async def test_malformed_request_headers_get_a_clean_status_for_their_stream(
    server: RunningServer, headers: list[tuple[str, str]], message: str
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
    assert first.get("grpc-status") == "3", first  # INVALID_ARGUMENT
    assert urllib.parse.unquote(first["grpc-message"]) == message
    assert result[3].get("grpc-status") == "0", result[3]
    await Bystander(server.port).call()


def announce_and_stall(port: int, streams: int, announced: int) -> dict[int, dict[str, str]]:
    """Open ``streams`` ModelInfer calls without a deadline, each sending only a 5-byte prefix
    announcing ``announced`` bytes, then nothing; return what the server answers each."""
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    ids = [1 + 2 * i for i in range(streams)]
    for stream in ids:
        client.send_headers(stream, REQUEST_HEADERS)
        client.send_data(stream, b"\x00" + announced.to_bytes(4, "big"))
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
        nursery, memory_budget=96 * 1024 * 1024, max_waiting_bytes=0, receive_timeout=1.0
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


async def test_rapid_reset_ends_the_connection_with_enhance_your_calm(
    server: RunningServer,
) -> None:
    # CVE-2023-44487: HEADERS then RST_STREAM, thousands of times in one write.
    encoder = hpack.Encoder()
    block = encoder.encode(REQUEST_HEADERS)
    flood = b"".join(
        frame(0x1, 0x4, stream, block) + frame(0x3, 0x0, stream, (8).to_bytes(4, "big"))
        for stream in range(1, 2 * 5000, 2)
    )
    events = await trio.to_thread.run_sync(exchange_until_closed, server.port, flood)
    assert goaway_codes(events) == [h2.errors.ErrorCodes.ENHANCE_YOUR_CALM]
    await Bystander(server.port).call()


async def test_a_settings_flood_ends_the_connection_before_it_is_all_answered(
    server: RunningServer,
) -> None:
    flood = frame(0x4, 0x0, 0, b"") * 50_000
    events = await trio.to_thread.run_sync(exchange_until_closed, server.port, flood)
    assert goaway_codes(events) == [h2.errors.ErrorCodes.ENHANCE_YOUR_CALM]
    acknowledged = [e for e in events if isinstance(e, h2.events.SettingsAcknowledged)]
    assert len(acknowledged) <= 101  # our own SETTINGS, then the burst the bound allows
    await Bystander(server.port).call()
