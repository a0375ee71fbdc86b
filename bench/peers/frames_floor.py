"""The floor of a Python HTTP/2 front-end without h2: ServerLive answered from frames parsed by
hand on Trio.

Usage: ``python -m bench.peers.frames_floor GRPC_PORT [tasks]``. Like :mod:`bench.peers.h2_floor`,
but without h2's connection and stream state machines: one Trio task per connection splits the bytes
into frames with ``struct``, decodes each request's header block with hpack (every client's block
must be decoded, as HPACK's table is shared by the connection), and answers a call once its
END_STREAM arrives with frames made in advance (their header blocks use only HPACK's static table
and literals, so they never change the client's table). It checks nothing a server must check
(stream states, frame sizes, SETTINGS values, padding, CONTINUATION, the client's flow-control
windows and stream limit), so it is not a server: its CPU
per call is how little any HTTP/2 front-end written in Python can spend.

With ``tasks``, each call is also given what trio-infer gives every call: a task of its own in
the connection's nursery, a cancel scope around its work, and a writer task that it wakes to
send its answer. The difference between the two rows is what structured concurrency costs a call.
"""

from __future__ import annotations

import contextlib
import struct
import sys

import hpack
import trio

from bench.attacks import (
    ACK,
    DATA,
    END_STREAM,
    HEADERS,
    PREFACE,
    SETTINGS,
    WINDOW_UPDATE,
    frame,
)
from bench.peers.h2_floor import FRAMED

#: Bytes read from the socket at a time.
READ_SIZE = 65536
PING, PADDED, PRIORITY = 0x6, 0x8, 0x20
FRAME_HEADER = struct.Struct(">HBBBL")
#: What the connection's receive window is raised by at once: given back (WINDOW_UPDATE) only
#: once half of it has been used, so a client never waits for it and no read pays for it.
WINDOW = 2**31 - 1 - 65535


def literal(name: bytes, value: bytes) -> bytes:
    """An HPACK literal field without indexing, new name (RFC 7541 6.2.2), short strings."""
    return b"\x00" + bytes([len(name)]) + name + bytes([len(value)]) + value


#: ``:status: 200`` is static entry 8; the rest are literals, so the client's table is unchanged.
RESPONSE_HEADERS = b"\x88" + literal(b"content-type", b"application/grpc")
TRAILERS = literal(b"grpc-status", b"0")
UNIMPLEMENTED = b"\x88" + literal(b"grpc-status", b"12")


def response(stream_id: int, path: bytes) -> bytes:
    """Every frame of the response to the call on ``stream_id``."""
    message = FRAMED.get(path)
    if message is None:
        return frame(HEADERS, 0x5, stream_id, UNIMPLEMENTED)
    return (
        frame(HEADERS, 0x4, stream_id, RESPONSE_HEADERS)
        + frame(DATA, 0, stream_id, message)
        + frame(HEADERS, 0x5, stream_id, TRAILERS)
    )


class Connection:
    """The frames of one connection: bytes in, bytes out."""

    def __init__(self) -> None:
        self.buffer = bytearray()
        self.decoder = hpack.Decoder()
        self.paths: dict[int, bytes] = {}
        self.preface = False
        self.received = 0

    def receive(self, data: bytes) -> tuple[bytes, list[tuple[int, bytes]]]:
        """The frames to send after ``data`` (acknowledgements), and the calls it ended, by
        stream id and path."""
        buffer = self.buffer
        buffer += data
        out = bytearray()
        ended: list[tuple[int, bytes]] = []
        position = 0
        if not self.preface:
            if len(buffer) < len(PREFACE):
                return b"", ended
            position = len(PREFACE)
            self.preface = True
        while len(buffer) - position >= 9:
            high, low, kind, flags, stream_id = FRAME_HEADER.unpack_from(buffer, position)
            size = (high << 8) | low
            end = position + 9 + size
            if end > len(buffer):
                break
            payload = bytes(buffer[position + 9 : end])
            position = end
            stream_id &= 0x7FFFFFFF
            if kind == HEADERS:
                block = payload
                if flags & PADDED:
                    block = block[1 : len(block) - block[0]]
                if flags & PRIORITY:
                    block = block[5:]
                headers = self.decoder.decode(block, raw=True)
                self.paths[stream_id] = dict(headers).get(b":path", b"")
                if flags & END_STREAM:
                    ended.append((stream_id, self.paths.pop(stream_id)))
            elif kind == DATA:
                self.received += size
                if flags & END_STREAM:
                    ended.append((stream_id, self.paths.pop(stream_id, b"")))
            elif kind == SETTINGS and not flags & ACK:
                out += frame(SETTINGS, ACK, 0, b"")
            elif kind == PING and not flags & ACK:
                out += frame(PING, ACK, 0, payload)
        del buffer[:position]
        if self.received >= WINDOW // 2:
            out += frame(WINDOW_UPDATE, 0, 0, self.received.to_bytes(4, "big"))
            self.received = 0
        return bytes(out), ended


def hello() -> bytes:
    """The server's SETTINGS and its connection window."""
    return frame(SETTINGS, 0, 0, b"") + frame(WINDOW_UPDATE, 0, 0, WINDOW.to_bytes(4, "big"))


async def serve_connection(stream: trio.SocketStream) -> None:
    """Answer the calls on one connection, each as its frames are parsed, until the client
    closes or breaks it."""
    connection = Connection()
    with contextlib.suppress(trio.BrokenResourceError, hpack.HPACKError):
        await stream.send_all(hello())
        while data := await stream.receive_some(READ_SIZE):
            out, ended = connection.receive(data)
            for stream_id, path in ended:
                out += response(stream_id, path)
            if out:
                await stream.send_all(out)


class Writer:
    """The one task that writes a connection's frames; calls queue theirs and wake it."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.pending = bytearray()
        self.queued = trio.Event()

    def put(self, data: bytes) -> None:
        """Queue ``data`` to be written."""
        self.pending += data
        self.queued.set()

    async def run(self) -> None:
        """Write what is queued, until cancelled."""
        while True:
            await self.queued.wait()
            self.queued = trio.Event()
            data = bytes(self.pending)
            self.pending.clear()
            await self.stream.send_all(data)


async def answer_call(writer: Writer, stream_id: int, path: bytes) -> None:
    """One call's task: its answer, made within its own cancel scope once it has checked for
    cancellation (as trio-infer's calls do, without yielding)."""
    with trio.CancelScope():
        await trio.lowlevel.checkpoint_if_cancelled()
        writer.put(response(stream_id, path))


async def serve_connection_with_tasks(stream: trio.SocketStream) -> None:
    """Answer the calls on one connection, each in a task of its own, until the client closes
    or breaks it."""
    connection = Connection()
    writer = Writer(stream)
    try:
        await stream.send_all(hello())
        async with trio.open_nursery() as nursery:
            nursery.start_soon(writer.run)
            while data := await stream.receive_some(READ_SIZE):
                out, ended = connection.receive(data)
                if out:
                    writer.put(out)
                for stream_id, path in ended:
                    nursery.start_soon(answer_call, writer, stream_id, path)
            nursery.cancel_scope.cancel()
    except* (trio.BrokenResourceError, hpack.HPACKError):
        pass  # the client went away, or sent what this floor cannot read: drop the connection


async def serve(port: int, tasks: bool) -> None:
    """Serve 127.0.0.1:PORT until the process is interrupted."""
    handler = serve_connection_with_tasks if tasks else serve_connection
    await trio.serve_tcp(handler, port, host="127.0.0.1")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        trio.run(serve, int(sys.argv[1]), sys.argv[2:] == ["tasks"])
