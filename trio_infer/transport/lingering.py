"""Closing a connection the server ends without losing the last bytes it sent.

A socket closed with received bytes unread, or that receives bytes after it is closed, is
reset (RFC 1122 §4.2.2.13), and the client's host may then drop what it had received and not
yet read: the last response, a GOAWAY, the statuses of the last calls. A client that was still
sending when the server decided to close (a pipelined request, gRPC calls started while the
GOAWAY travelled) would see a reset ("broken pipe") where it should have read an answer or a
GOAWAY that lets it retry elsewhere. So the server ends only its sending side, then reads and
drops what the client still sends until the client closes too, for a bounded time and number
of bytes, and only then closes the socket.

Over TLS, the server first sends close_notify (:func:`~trio_infer.transport.tls.send_close_notify`),
so that the client reads a closed session, not a truncated one: :func:`end_connection` does both.
"""

from __future__ import annotations

import contextlib
import socket

import trio

from trio_infer.transport.tls import send_close_notify

__all__ = ["LINGER_BYTES", "LINGER_SECONDS", "end_connection", "linger"]

#: The longest a closed connection keeps reading: a client that has read everything closes its
#: side at once; one that does not gets this long.
LINGER_SECONDS = 1.0
#: The most a closed connection reads and drops.
LINGER_BYTES = 1024 * 1024
_READ_SIZE = 64 * 1024


async def linger(sock: trio.socket.SocketType) -> None:
    """End ``sock``'s sending side (a TLS connection's too, below the TLS layer), then read and
    drop what arrives until the peer closes, :data:`LINGER_SECONDS` pass or
    :data:`LINGER_BYTES` have come. The caller closes the socket afterwards."""
    received = 0
    with (
        trio.move_on_after(LINGER_SECONDS),
        contextlib.suppress(OSError),
    ):
        sock.shutdown(socket.SHUT_WR)
        while received < LINGER_BYTES:
            data = await sock.recv(_READ_SIZE)
            if not data:
                return
            received += len(data)


async def end_connection(
    stream: trio.SocketStream | trio.SSLStream[trio.SocketStream], *, lingering: bool
) -> None:
    """End a connection the server closes, short of closing it: over TLS, send close_notify;
    then, with ``lingering``, :func:`linger`. The caller closes the stream afterwards, however
    this ends.

    The alert and the linger take :data:`LINGER_SECONDS` at most together: a client that reads
    nothing holds the connection no longer than a linger already allowed.
    """
    with trio.move_on_after(LINGER_SECONDS):
        if isinstance(stream, trio.SSLStream):
            await send_close_notify(stream)
            sock = stream.transport_stream.socket
        else:
            sock = stream.socket
        if lingering:
            await linger(sock)
