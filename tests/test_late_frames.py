"""Frames a client sends on a stream after the stream closed, against a real server: what the
server answers must not hang on how far h2 has forgotten the stream (a stream its trailers
closed is forgotten at once; one closed by a reset only when h2 next counts the open
streams)."""

from __future__ import annotations

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
    goaway_codes,
    grpc_message,
    read_until_a_stream_ends,
)
from trio_infer.server import RunningServer


@pytest.fixture
async def server(nursery: trio.Nursery) -> RunningServer:
    return await start_server(nursery)


def after_a_call(port: int, late: bytes, timeout: float = 10.0) -> list[object]:
    """An echo call on stream 1 read to its end, then ``late`` and a PING; the h2 events the
    server's bytes made after the call, until it closes the connection or acknowledges the
    PING (then the last event is the PING's acknowledgement)."""
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    client.send_headers(1, REQUEST_HEADERS)
    client.send_data(1, grpc_message(echo_request()), end_stream=True)
    events: list[object] = []
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(timeout)
        sock.sendall(client.data_to_send())
        read_until_a_stream_ends(sock, client)
        sock.sendall(late + frame(0x6, 0x0, 0, b"late?!!!"))
        try:
            while received := sock.recv(65536):
                try:
                    new = client.receive_data(received)
                except h2.exceptions.ProtocolError:
                    break  # h2 refuses what follows the server's GOAWAY; the GOAWAY came first
                events += new
                if any(isinstance(event, h2.events.PingAckReceived) for event in new):
                    break
        except ConnectionResetError:
            pass
    return events


async def test_a_continuation_after_a_call_its_trailers_closed_is_a_protocol_error(
    server: RunningServer,
) -> None:
    # RFC 9113 §6.10: a CONTINUATION no open header block precedes is a connection error of
    # type PROTOCOL_ERROR, whichever stream it names. (h2 handed it to the stream: on one it
    # still held, PROTOCOL_ERROR; on one forgotten after END_STREAM, as the trailers' stream
    # now is at once, STREAM_CLOSED.)
    events = await trio.to_thread.run_sync(after_a_call, server.port, frame(0x9, 0x4, 1, b""))
    assert goaway_codes(events) == [h2.errors.ErrorCodes.PROTOCOL_ERROR]
    await Bystander(server.port).call()


async def test_a_window_update_of_zero_after_a_call_its_trailers_closed_is_ignored(
    server: RunningServer,
) -> None:
    # RFC 9113 §5.1: a WINDOW_UPDATE on a closed stream is ignored, even one of 0 (which on an
    # open stream fails that stream only). The connection goes on.
    late = frame(0x8, 0x0, 1, (0).to_bytes(4, "big"))
    events = await trio.to_thread.run_sync(after_a_call, server.port, late)
    assert goaway_codes(events) == []
    assert isinstance(events[-1], h2.events.PingAckReceived), events
    await Bystander(server.port).call()
