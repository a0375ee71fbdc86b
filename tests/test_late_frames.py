"""Frames a client sends on a stream after the stream closed, against a real server: what the
server answers must not hang on how far h2 has forgotten the stream (a stream its trailers
closed is forgotten at once; one closed by a reset only when h2 next counts the open
streams)."""

from __future__ import annotations

import functools
import socket

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import pytest
import trio

from tests.support import start_server
from tests.test_hostile import (
    REQUEST_HEADERS,
    Bystander,
    echo_request,
    frame,
    frames_in,
    goaway_codes,
    grpc_message,
    read_until_a_stream_ends,
)
from trio_infer.server import RunningServer


@pytest.fixture
async def server(nursery: trio.Nursery) -> RunningServer:
    return await start_server(nursery)


def after_a_call(
    port: int,
    late: bytes,
    timeout: float = 10.0,
    *,
    headers: list[tuple[str, str]] = REQUEST_HEADERS,
    body: bytes | None = None,
) -> tuple[list[object], bytes]:
    """A call on stream 1 (``headers``, then ``body``, an echo request by default) read until
    it ends or is reset, then ``late`` and a PING; the h2 events the server's bytes made
    after the call, until it closes the connection or acknowledges the PING (then the last
    event is the PING's acknowledgement), and those bytes."""
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    client.send_headers(1, headers)
    client.send_data(1, grpc_message(echo_request()) if body is None else body, end_stream=True)
    events: list[object] = []
    received = b""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(timeout)
        sock.sendall(client.data_to_send())
        read_until_a_stream_ends(sock, client)
        sock.sendall(late + frame(0x6, 0x0, 0, b"late?!!!"))
        try:
            while chunk := sock.recv(65536):
                received += chunk
                try:
                    new = client.receive_data(chunk)
                except h2.exceptions.ProtocolError:
                    break  # h2 refuses what follows the server's GOAWAY; the GOAWAY came first
                events += new
                if any(isinstance(event, h2.events.PingAckReceived) for event in new):
                    break
        except ConnectionResetError:
            pass
    return events, received


async def test_a_continuation_after_a_call_its_trailers_closed_is_a_protocol_error(
    server: RunningServer,
) -> None:
    # RFC 9113 §6.10: a CONTINUATION no open header block precedes is a connection error of
    # type PROTOCOL_ERROR, whichever stream it names. (h2 handed it to the stream: on one it
    # still held, PROTOCOL_ERROR; on one forgotten after END_STREAM, as the trailers' stream
    # now is at once, STREAM_CLOSED.)
    events, _ = await trio.to_thread.run_sync(after_a_call, server.port, frame(0x9, 0x4, 1, b""))
    assert goaway_codes(events) == [h2.errors.ErrorCodes.PROTOCOL_ERROR]
    await Bystander(server.port).call()


async def test_a_window_update_of_zero_after_a_call_its_trailers_closed_is_ignored(
    server: RunningServer,
) -> None:
    # RFC 9113 §5.1: a WINDOW_UPDATE on a closed stream is ignored, even one of 0 (which on an
    # open stream fails that stream only). The connection goes on.
    late = frame(0x8, 0x0, 1, (0).to_bytes(4, "big"))
    events, _ = await trio.to_thread.run_sync(after_a_call, server.port, late)
    assert goaway_codes(events) == []
    assert isinstance(events[-1], h2.events.PingAckReceived), events
    await Bystander(server.port).call()


@pytest.mark.parametrize(
    "late",
    [
        frame(0x8, 0x0, 1, (1000).to_bytes(4, "big")),  # WINDOW_UPDATE
        frame(0x3, 0x0, 1, h2.errors.ErrorCodes.CANCEL.to_bytes(4, "big")),  # RST_STREAM
        frame(0x0, 0x0, 1, b"\x00" * 100) + frame(0x0, 0x1, 1, b"\x00" * 100),  # DATA
    ],
    ids=["window", "reset", "data"],
)
async def test_late_frames_on_a_stream_the_server_reset_are_ignored(
    server: RunningServer, late: bytes
) -> None:
    # A request whose body outgrows its content-length is malformed, and its stream reset
    # (RFC 9113 §8.1.1). The client may have sent more before it saw the reset: RFC 9113 §5.1
    # says such frames are ignored, not answered (h2 answered each DATA with a RST_STREAM of
    # its own). Their DATA's bytes still count against the connection's window, and are given
    # back (tests/test_content_length.py).
    headers = [*REQUEST_HEADERS, ("content-length", "1")]
    events, received = await trio.to_thread.run_sync(
        functools.partial(after_a_call, headers=headers), server.port, late
    )
    assert goaway_codes(events) == []
    assert isinstance(events[-1], h2.events.PingAckReceived), events
    assert [kind for kind, _, _ in frames_in(received)] == [0x6]  # the PING's ACK, and only it
    await Bystander(server.port).call()


#: Request trailers the client's encoder adds to the HPACK dynamic table of both ends.
TRAILERS = [("x-late-one", "first value"), ("x-late-two", "second value")]


def trailers_after_a_reset(port: int, reset_by: str) -> tuple[bytes, list[object]]:
    """A call on stream 1 whose request has not ended, reset by the server (its body outgrows
    its content-length) or by the client (before its message); then the request's trailers on
    stream 1, encoded by the client's encoder (their fields added to its dynamic table, as to
    the server's when it decodes them), and a PING. The server's bytes after the trailers, up
    to the PING's acknowledgement; and the h2 events of a call on stream 3 whose header block
    refers to those fields by their place in the dynamic table, up to its end or reset."""
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    if reset_by == "server":
        client.send_headers(1, [*REQUEST_HEADERS, ("content-length", "1")])
        client.send_data(1, grpc_message(echo_request()))
    else:
        client.send_headers(1, REQUEST_HEADERS)  # no message: the call waits for it, unanswered
    ping = b"trailer?"
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(10.0)
        sock.sendall(client.data_to_send())
        if reset_by == "server":
            read_until_a_stream_ends(sock, client)
        else:
            client.reset_stream(1, h2.errors.ErrorCodes.CANCEL)
        # Sent as a client that had not seen the reset yet would send them (h2 would refuse
        # to send on a stream it knows is closed).
        block = client.encoder.encode(TRAILERS)
        sock.sendall(client.data_to_send() + frame(0x1, 0x5, 1, block) + frame(0x6, 0x0, 0, ping))
        received = b""
        while (0x6, 0, ping) not in frames_in(received):
            chunk = sock.recv(65536)
            assert chunk, "the server closed the connection"
            received += chunk
        client.receive_data(received)
        client.send_headers(3, [*REQUEST_HEADERS, *TRAILERS])
        client.send_data(3, grpc_message(echo_request()), end_stream=True)
        sock.sendall(client.data_to_send())
        return received, read_until_a_stream_ends(sock, client)


@pytest.mark.parametrize("reset_by", ["server", "client"])
async def test_trailers_on_a_stream_the_server_reset_are_ignored_and_decoded(
    server: RunningServer, reset_by: str
) -> None:
    # RFC 9113 §5.1: frames on a stream after the server sent its RST_STREAM are ignored (the
    # client may have sent them before it saw the reset); h2 answered request trailers with a
    # RST_STREAM of STREAM_CLOSED. After the client's own reset, they are a stream error of
    # type STREAM_CLOSED, answered so. Either way their header block is decoded: the HPACK
    # state is the connection's, and the next call's block refers to what they added to it.
    received, events = await trio.to_thread.run_sync(trailers_after_a_reset, server.port, reset_by)
    stream_closed = h2.errors.ErrorCodes.STREAM_CLOSED.to_bytes(4, "big")
    answered = [(kind, payload) for kind, stream, payload in frames_in(received) if stream == 1]
    assert answered == ([] if reset_by == "server" else [(0x3, stream_closed)])
    ended = [e for e in events if isinstance(e, h2.events.StreamEnded)]
    assert [e.stream_id for e in ended] == [3], events
    trailers = [e for e in events if isinstance(e, h2.events.TrailersReceived)]
    assert (b"grpc-status", b"0") in trailers[0].headers
    await Bystander(server.port).call()
