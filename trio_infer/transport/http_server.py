"""HTTP/1.1 on Trio, parsed by httptools (llhttp, Node.js's parser, in C): one task per
connection, one request at a time on it.

The parser is the only C on the REST path: h11, in pure Python, took about 44 us to parse a
small request and frame its answer, a third of an empty call's CPU; httptools parses one in
about 3 (``docs/performance.md``, "REST: the HTTP parser"). llhttp checks the syntax; what it
leaves to its caller (the head's size, ``Host``, the version, the transfer coding, ``Expect``) is
checked by :class:`_Parse`, and responses are framed here (a status line and a header block).

Ownership, top to bottom::

    HttpServer.serve                   owns the listeners and every connection
    ├── wait timer                     cancels a connection's wait for a request's head at
    │                                  its deadline (idle and handshake timeouts)
    ├── end watch                      while a request whose body was read runs, the client
    │                                  closing its socket cancels the request: one epoll
    │                                  instance for the connections' sockets (Linux)
    ├── accept loops                   one per listener, in the server's accepting scope
    └── HttpConnection.run             one per client connection: reads a request, runs it
        │                              (the handler, in the connection's cancel scope, which
        │                              is the request's while it runs: reads the body, works,
        │                              responds), writes its response if the handler did
        │                              not, and again (keep-alive)
        └── disconnect watcher         without the end watch (no EPOLLRDHUP): the same for
                                       the connection's requests, from its first body read;
                                       parked between them

Invariants:

- Every request gets exactly one response, or none when its client is gone: the handler's, or
  the one :meth:`HttpConnection._serve_request` writes when the handler sent none (the error
  it raised, 500 for a bug, 503 when the shutdown cut it off). A response is never started
  twice, and a connection whose response was cut off half-way is closed, never reused.
- A request whose client goes away (its socket's end, a reset, a response it reads none of for
  the send timeout) is cancelled: its handler's scope, and with it whatever the handler waits
  on. Nothing is answered then.
- What a client may make the server hold is bounded before it is read: header blocks by
  ``max_header_size`` (414 for a target past it, else 431), bodies by ``max_body_size`` (413,
  from ``Content-Length`` before any of the body is read; a chunked body as it arrives), and
  the time each part may take by the handshake, receive, idle and send timeouts.
- Nothing here knows JSON, tensors or models: a handler sees a request line, headers and body
  bytes, and sends a status, headers and body buffers (written with vectored writes, large
  ones from the handler's own memory). The one format this module writes itself is the error
  body of the V2 protocol, ``{"error": "..."}``, for the errors it answers on its own.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import heapq
import http
import itertools
import json
import logging
import math
import os
import select
import socket
import ssl
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import NoReturn

import httptools
import numpy
import trio

from trio_infer.buffers import MAX_BUFFERS, Buffer, first_bytes, unsent
from trio_infer.transport.access_log import (
    ACCESS_LOGGER,
    REQUEST_ID_HEADER,
    CallRecord,
    log_call,
    new_request_id,
    request_id,
)
from trio_infer.transport.connection_age import retirement_time
from trio_infer.transport.content_coding import (
    BodyDecoder,
    ContentCodingError,
    body_decoder,
    is_coded,
)
from trio_infer.transport.lingering import end_connection
from trio_infer.transport.listening import CallCounter, ConnectionServer, Transport
from trio_infer.transport.quoting import shown

__all__ = [
    "HttpConnection",
    "HttpError",
    "HttpHandler",
    "HttpLimits",
    "HttpRequest",
    "HttpServer",
    "HttpStatistics",
]

logger = logging.getLogger(__name__)

HttpHandler = Callable[["HttpRequest"], Awaitable[None]]

_READ_SIZE = 64 * 1024
#: The most read at a time while a request's head is waited for: a head and a body under
#: :data:`_STRAIGHT_BODY` come in one read, and of a larger body little is read with its head
#: (the rest is read straight into the body's buffer, not into the connection's first).
_HEAD_READ_SIZE = 16 * 1024
#: The most one TLS write encrypts and sends, so the send timeout measures a client's progress.
_TLS_WRITE_SIZE = 256 * 1024
#: Numbers the process's HTTP connections, never reusing a number. Negative, so that they are
#: never equal to the gRPC transport's (both are owners in the same memory budget).
_connection_ids = itertools.count(-1, -1)
#: Status lines by status. A response's head is put together as text and encoded once, at its
#: end: formatting and encoding text costs less than formatting bytes, and than encoding each
#: field on its own.
_STATUS_LINES = {
    status.value: f"HTTP/1.1 {status.value} {status.phrase}\r\n" for status in http.HTTPStatus
}
#: The access log's status of a request whose client went away before its answer began:
#: nginx's "client closed request", a number as every HTTP status the log holds.
_CLIENT_CLOSED_REQUEST = "499"
_JSON = ("content-type", "application/json")
_CLOSE = ("connection", "close")
_CLOSE_LINE = "connection: close\r\n"
#: RFC 9112 9.3 and C.2.2: an HTTP/1.0 client keeps a connection it asked to keep alive only
#: when the response says the server does; without it the client waits for the server to close.
_KEEP_ALIVE = ("connection", "keep-alive")
_KEEP_ALIVE_LINE = "connection: keep-alive\r\n"
_REQUEST_ID = REQUEST_ID_HEADER.encode("ascii")
#: The first byte of a request target in origin form (``/path?query``).
_SLASH = ord("/")
#: What delimits a list's members and quoted strings in a field's value (RFC 9110 5.6).
_COMMA, _QUOTE, _BACKSLASH = b',"\\'
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
#: How much of a chunked body is parsed at a time: its end is known only once parsed, so what
#: follows it in the same piece (a pipelined request) is parsed ahead, at most this much.
_CHUNKED_SLICE = 16 * 1024
#: Body pieces a request holds before they are moved to its body: few, so a body sent a few
#: bytes a write holds little more than its bytes.
_HELD_PIECES = 16
_BOTH_FRAMINGS = "the request has both Content-Length and Transfer-Encoding"
#: Decoded bytes of a compressed body made between two checkpoints.
_DECODE_SLICE = 256 * 1024
#: The sizes of announced bodies received straight into their buffer (:meth:`HttpConnection.
#: receive_straight`). Below them, the parser a straight body costs (one made anew) is more
#: than the copies it saves; above them, the buffer made whole before the body has arrived
#: would hold the event loop for a while to write it, and take its memory before the client
#: has sent it (a larger body is gathered as it arrives).
_STRAIGHT_BODY = 16 * 1024
_STRAIGHT_MAX = 1024 * 1024


@dataclass(frozen=True)
class HttpLimits:
    """The bounds every HTTP connection keeps.

    Args:
        max_body_size: The largest request body accepted, in bytes (413 past it).
        max_header_size: The largest request line and header block accepted, in bytes (414
            when the request target alone passes it, else 431).
        max_header_fields: The most header fields a request may have (431 past it): each is
            kept as objects some fifty times its size on the wire, so a head of many tiny
            fields would cost far more than ``max_header_size``.
        handshake_timeout: Seconds a new connection may take to send its first request's
            headers, and any request its headers once they have started.
        receive_timeout: Seconds a request's body may take to arrive once its handler starts
            reading it (408 past it).
        idle_timeout: Seconds a keep-alive connection may wait for its next request.
        send_timeout: Seconds a response may wait for a client that reads none of it; the
            client is then taken as gone.
        max_connection_age: Seconds after which a keep-alive connection ends, spread by up to
            10 % either way (:mod:`~trio_infer.transport.connection_age`), so that its client
            reconnects and may reach another replica: its first response past the age says
            ``Connection: close`` (nginx's ``keepalive_time``). A connection waiting for its
            next request is not closed at the age: that would race with a request the client
            is sending (HTTP/1.1 cannot tell it not to), and an idle connection carries no
            load to rebalance. None: connections live on.
    """

    max_body_size: int = 64 * 1024 * 1024
    max_header_size: int = 16 * 1024
    max_header_fields: int = 256
    handshake_timeout: float = 10.0
    receive_timeout: float = 30.0
    idle_timeout: float = 300.0
    send_timeout: float = 30.0
    max_connection_age: float | None = None


class HttpError(Exception):
    """A request the transport, or a handler, answers with an HTTP error status.

    Raised by :meth:`HttpRequest.receive_body` (a body too large, too slow, or malformed); a
    handler may raise it too. The connection answers ``{"error": message}`` with ``status``,
    unless a response was already started.

    Args:
        status: The HTTP status, 4xx or 5xx.
        message: Why, for the client.
    """

    def __init__(self, status: int, message: str, fields: Sequence[tuple[str, str]] = ()) -> None:
        super().__init__(status, message)
        self.status = status
        self.message = message
        self.fields = fields
        """Header fields its answer carries besides the error's own (a 405's ``allow``)."""

    def __str__(self) -> str:
        return self.message


def error_body(message: str) -> bytes:
    """The V2 protocol's error body, ``{"error": message}``, as JSON bytes."""
    return json.dumps({"error": message}).encode()


class _Message:
    """What the parser has read of one request: its head, the body pieces not yet taken, and
    whether it has ended."""

    __slots__ = (
        "body",
        "body_size",
        "complete",
        "content_encoding",
        "content_length",
        "expects_continue",
        "framing",
        "head_done",
        "head_size",
        "headers",
        "http_1_0",
        "keep_alive",
        "method",
        "request_id",
        "target",
        "trailer_size",
        "upgrade",
    )

    def __init__(self) -> None:
        self.method = b""
        self.target = b""
        #: Header names lower-case, in the order sent.
        self.headers: list[tuple[bytes, bytes]] = []
        #: Bytes of the target and the header fields (each counted with ": " and CRLF).
        self.head_size = 0
        self.head_done = False
        #: From ``Content-Length``; None for a chunked body.
        self.content_length: int | None = 0
        #: The ``Content-Encoding`` values, joined: repeated, a header is one list (RFC 9110
        #: 5.3), so several codings are refused together. None without the header.
        self.content_encoding: str | None = None
        #: The first ``X-Request-Id`` value; None without one.
        self.request_id: bytes | None = None
        self.keep_alive = True
        #: An HTTP/1.0 request: kept alive (only when it asked), its responses say so.
        self.http_1_0 = False
        self.expects_continue = False
        #: The client asked to switch protocols (or CONNECT): the parser stops at the end of
        #: this message, and the connection closes after its response.
        self.upgrade = False
        #: Body pieces parsed and not yet taken by the handler.
        self.body: list[bytes] = []
        #: Bytes of body parsed so far.
        self.body_size = 0
        #: Bytes of a chunked body parsed since its last piece of data: framing (size lines,
        #: extensions, trailers), to the nearest slice. Its bound is on memory (httptools
        #: keeps a trailer field until its line ends); the time is the receive timeout's.
        self.framing = 0
        self.trailer_size = 0
        self.complete = False


class _Refused(Exception):
    """Raised in a parser callback to stop at a request this module refuses; the status and
    message wait in :attr:`_Parse.refusal`."""


class _Parse:
    """httptools' callbacks: they turn what llhttp finds into :class:`_Message` records.

    llhttp validates the syntax (request line, header names and values, ``Content-Length``,
    chunked framing); what it leaves to its caller is checked here, in the order a request's
    head completes: the head's size, ``Host``, the HTTP version, ``Transfer-Encoding`` and
    ``Expect``.
    """

    def __init__(self, max_header_size: int, max_header_fields: int) -> None:
        self.parser = httptools.HttpRequestParser(self)
        #: Messages begun and not yet served, oldest first. Holds more than one only when a
        #: client pipelines, and then at most what one chunked slice held past its body's end.
        self.messages: collections.deque[_Message] = collections.deque()
        #: Why the callbacks stopped the parser: (status, message).
        self.refusal: tuple[int, str] | None = None
        self._max_header_size = max_header_size
        self._max_header_fields = max_header_fields

    def _refuse(self, status: int, message: str) -> NoReturn:
        self.refusal = (status, message)
        raise _Refused

    def on_message_begin(self) -> None:
        self.messages.append(_Message())

    def on_url(self, url: bytes) -> None:
        message = self.messages[-1]
        message.target += url
        message.head_size += len(url)
        if message.head_size > self._max_header_size:
            # The target comes before any header field: only it can have passed the bound.
            # RFC 9112 3: a target longer than the server parses is 414, not a header's 431.
            self._refuse(
                414,
                f"the request target is longer than the maximum of {self._max_header_size} bytes",
            )

    def on_header(self, name: bytes, value: bytes) -> None:
        message = self.messages[-1]
        size = len(name) + len(value) + 4
        if message.head_done:
            # A chunked body's trailers: counted against the head's bound, not kept.
            message.trailer_size += size
            if message.trailer_size > self._max_header_size:
                self._refuse(
                    400,
                    f"malformed request body: its trailers are larger than the maximum of "
                    f"{self._max_header_size} bytes",
                )
            return
        message.head_size += size
        if message.head_size > self._max_header_size:
            self._refuse(431, headers_too_large(self._max_header_size))
        if len(message.headers) == self._max_header_fields:
            self._refuse(
                431, f"the request has more than the maximum of {self._max_header_fields} headers"
            )
        # RFC 9110 5.5: the whitespace around a field's value is not part of it; the parser
        # drops what comes before the value only.
        message.headers.append((name.lower(), value.rstrip(b" \t")))

    def on_headers_complete(self) -> None:
        message = self.messages[-1]
        parser = self.parser
        message.method = parser.get_method()
        message.keep_alive = parser.should_keep_alive()
        message.upgrade = parser.should_upgrade()
        version = parser.get_http_version()
        hosts = 0
        #: The first expectation sent other than 100-continue, the one expectation met here.
        unmet: bytes | None = None
        for name, value in message.headers:
            if name == b"content-length":
                message.content_length = int(value)  # llhttp checked it is one number
            elif name == b"transfer-encoding":
                if value.strip().lower() != b"chunked":
                    # RFC 9112 6.1: a coding the server does not understand is 501.
                    self._refuse(501, "only the chunked transfer coding is implemented")
                message.content_length = None
                # RFC 9112 6.1: in HTTP/1.0 its framing is to be taken as faulty (a proxy of
                # that version would not have read it so): served, then the connection closes.
                message.keep_alive &= version != "1.0"
            elif name == b"host":
                hosts += 1
            elif name == b"content-encoding":
                coding = value.decode("latin-1")
                previous = message.content_encoding
                message.content_encoding = coding if previous is None else f"{previous}, {coding}"
            elif name == b"expect":
                # RFC 9110 10.1.1: a list of expectations (repeated, one list).
                for expectation in list_members(value):
                    if expectation.lower() == b"100-continue":
                        message.expects_continue = True
                    elif unmet is None:
                        unmet = expectation
            elif name == _REQUEST_ID and message.request_id is None:
                message.request_id = value
        if version == "1.1":
            if hosts != 1:
                # RFC 9112 3.2: a server must answer 400 to an HTTP/1.1 request without exactly
                # one.
                self._refuse(400, f"malformed request: {hosts} Host headers; HTTP/1.1 needs one")
            if unmet is not None and message.content_length != 0:
                # RFC 9110 10.1.1: 417 for an expectation the server cannot meet. Refused
                # before its body is read, like a 413: the connection closes after the answer,
                # since a body the client sends anyway cannot be told from a next request. A
                # request without a body (no Content-Length, or 0, and not chunked) is served,
                # its expectation ignored, as Triton's libevent serves it (it reads Expect only
                # before a body; RFC 9110 allows either). Expect is HTTP/1.1's: an HTTP/1.0
                # request's is ignored, as its 100-continue must be.
                self._refuse(
                    417,
                    f"the expectation {shown(unmet.decode('latin-1'))!r} cannot be met; "
                    "the one expectation this server meets is 100-continue",
                )
        elif version == "1.0":
            message.http_1_0 = True
            message.expects_continue = False
        else:
            self._refuse(505, f"HTTP/{version} is not supported; this port serves HTTP/1.1")
        if message.upgrade and message.content_length != 0:
            # httptools has llhttp skip the body of a request that asks to switch protocols
            # (the bytes after its head would be the new protocol's); none is switched here,
            # and such a body could not be told from what follows it.
            self._refuse(400, "a request that asks to switch protocols may not have a body")
        message.head_done = True

    def on_body(self, body: bytes) -> None:
        message = self.messages[-1]
        message.body.append(body)
        message.body_size += len(body)

    def on_message_complete(self) -> None:
        self.messages[-1].complete = True

    def restart(self) -> None:
        """Continue with a new parser, as at the start of a request: the one before stopped in
        the middle of a body received without it (a parser whose callbacks are set sees every
        byte of a body, and httptools copies each piece into a ``bytes`` for ``on_body``)."""
        self.parser = httptools.HttpRequestParser(self)


def list_members(value: bytes) -> list[bytes]:
    """The members of a field's value that is a list (RFC 9110 5.6.1): split at the commas
    outside quoted strings (5.6.4, where a backslash quotes the next character), each without
    the whitespace around it, empty ones dropped. A quoted string left open runs to the end."""
    members: list[bytes] = []
    start = 0
    quoted = escaped = False
    for at, byte in enumerate(value):
        if escaped:
            escaped = False
        elif quoted:
            if byte == _BACKSLASH:
                escaped = True
            elif byte == _QUOTE:
                quoted = False
        elif byte == _QUOTE:
            quoted = True
        elif byte == _COMMA:
            members.append(value[start:at])
            start = at + 1
    members.append(value[start:])
    return [stripped for member in members if (stripped := member.strip(b" \t"))]


def _blank_line_begun(head: bytes | bytearray) -> int:
    """How many of the last bytes of ``head``, which holds no blank line, may begin the one
    that ends it: the longest of its ends that ``\\r\\n\\r\\n`` starts with."""
    if head.endswith(b"\r\n\r"):
        return 3
    if head.endswith(b"\r\n"):
        return 2
    return 1 if head.endswith(b"\r") else 0


def _origin_form(target: bytes) -> bytes:
    """The path and query of an absolute-form target (``http://host:port/v2?x`` -> ``/v2?x``;
    ``/`` for an empty path), any other target unchanged (``*``, a CONNECT's authority).

    RFC 9112 3.2.2: a server must accept the absolute form (a client speaking to a proxy sends
    it, and HTTP/1.1 allows it to any server), and take the host from it rather than from
    ``Host``: one server serves every host here, so only the path and query are kept.
    """
    scheme, separator, rest = target.partition(b"://")
    if not separator or scheme.lower() not in (b"http", b"https"):
        return target
    ends = [end for end in (rest.find(b"/"), rest.find(b"?")) if end >= 0]
    origin = rest[min(ends) :] if ends else b""
    return origin if origin.startswith(b"/") else b"/" + origin


def _readable_now(sock: trio.socket.SocketType) -> bool:
    """Whether ``sock`` has bytes (or its end) to read now, without waiting."""
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN)
    return bool(poller.poll(0))


def _shortest_timeout(limits: HttpLimits) -> float:
    return min(limits.handshake_timeout, limits.idle_timeout)


def headers_too_large(limit: int) -> str:
    """The 431 answer's message."""
    return f"the request's headers are larger than the maximum of {limit} bytes"


def response_head(status: int, fields: Sequence[tuple[str, str]]) -> bytes:
    """An HTTP/1.1 response's status line and header block, encoded Latin-1.

    The fields are the server's own, or a model's that its worker checked (printable ASCII);
    a line break in one would start a header of the client's choosing, so it is refused.

    Raises:
        ValueError: A name or value holds a CR or LF.
        UnicodeEncodeError: A name or value holds a character Latin-1 has not.
    """
    return (status_line(status) + header_lines(fields) + "\r\n").encode("latin-1")


def status_line(status: int) -> str:
    """A response's status line (with no reason phrase for a status that has none known)."""
    line = _STATUS_LINES.get(status)
    return f"HTTP/1.1 {status} \r\n" if line is None else line


def header_lines(fields: Sequence[tuple[str, str]]) -> str:
    """Header fields as lines, each ended by CRLF.

    Raises:
        ValueError: A name or value holds a CR or LF (it would start a line of its own).
    """
    # A loop, not a comprehension: the comprehension is a function made and called (Python
    # 3.11), which costs more than the few fields a response has.
    lines = ""
    for name, value in fields:
        lines += f"{name}: {value}\r\n"
    if lines.count("\n") != len(fields) or lines.count("\r") != len(fields):
        raise ValueError("a response header's name or value holds a line break")
    return lines


def _too_large(limit: int) -> HttpError:
    """The refusal of a body that grew past ``limit`` bytes."""
    return HttpError(413, f"the request body is larger than the maximum of {limit} bytes")


async def _decode(
    decoder: BodyDecoder, body: bytearray, on_data: Callable[[int], None] | None
) -> None:
    """Decode a compressed body that has arrived whole into ``body``, a slice at a time, with a
    checkpoint between slices: a body that decodes to megabytes does not hold the event loop."""
    try:
        while not decoder.done:
            piece = decoder.decode(_DECODE_SLICE)
            if on_data is not None:
                on_data(len(piece))
            body += piece
            await trio.lowlevel.checkpoint()
        decoder.finish()
    except ContentCodingError as exc:
        raise HttpError(exc.status, exc.message) from None


class _WaitTimer:
    """Cancels connections' waits for a request's head at their deadlines (the idle and
    handshake timeouts): one task (:meth:`run`) for a server's connections, and a heap of
    deadlines. A connection adds one only when its wait's deadline is earlier than any it
    has there (:meth:`HttpConnection._wait_until`), so a kept-alive connection adds about one
    a timeout, not one a request; when one comes due, the connection looks at its wait's
    deadline as it is then (:meth:`HttpConnection._time_out`).

    Args:
        shortest_timeout: The shortest of the timeouts: the timer sleeps at most this long at
            a time, so that it wakes before any deadline added while it sleeps.
    """

    def __init__(self, shortest_timeout: float) -> None:
        #: (deadline, tie-breaker, [connection, or None once it has ended]).
        self._heap: list[tuple[float, int, list[HttpConnection | None]]] = []
        self._ties = itertools.count()
        # (A floor, so that timeouts of 0 do not make it spin.)
        self._longest_sleep = max(shortest_timeout, 1e-3)

    def add(self, deadline: float, entry: list[HttpConnection | None]) -> None:
        heapq.heappush(self._heap, (deadline, next(self._ties), entry))

    async def run(self) -> NoReturn:
        heap = self._heap
        while True:
            now = trio.current_time()
            while heap and heap[0][0] <= now:
                connection = heapq.heappop(heap)[2][0]
                if connection is not None:
                    connection._time_out(now)
            await trio.sleep_until(min(heap[0][0] if heap else math.inf, now + self._longest_sleep))


#: What a socket reports to the end watch: the client ended its side (``EPOLLRDHUP``); epoll
#: adds a hang-up and an error (a reset) on its own. Bytes the client sends are not reported, so
#: a pipelined request (or a TLS client's close_notify) is neither read nor waited for.
_END_EVENTS: int | None = getattr(select, "EPOLLRDHUP", None) if hasattr(select, "epoll") else None


class _EndWatch:
    """Cancels a request whose client closes its socket (or resets it) while its handler
    runs: one epoll instance of the server's, in which a connection's socket is registered
    for its end only (:data:`_END_EVENTS`) from its first request whose body was read until
    the connection ends or the socket's end is reported, and one task (:meth:`run`) that waits
    for that instance to turn readable and tells the socket's connection, which cancels the
    request it watches, if any (:meth:`HttpConnection._client_ended`). Watching a request
    costs no system call, no task woken and no scheduler pass: a task per connection that
    waited for the socket itself took about a seventh of a small POST's instructions in
    wake-ups and cancels (docs/performance.md), and a registration for each request two
    ``epoll_ctl`` calls. Linux only (``EPOLLRDHUP``); elsewhere each connection watches its
    socket with a task of its own (:meth:`HttpConnection._watch`).
    """

    def __init__(self) -> None:
        assert _END_EVENTS is not None, "the end watch needs epoll's EPOLLRDHUP"
        self._poller = select.epoll()
        #: The connection of each socket registered, by descriptor.
        self._registered: dict[int, HttpConnection] = {}

    def add(self, fd: int, connection: HttpConnection) -> None:
        """Report the end of ``connection``'s socket ``fd`` to it from now on, unless it is
        reported already. A socket that has ended already reports so at once."""
        assert _END_EVENTS is not None
        if fd not in self._registered:
            self._poller.register(fd, _END_EVENTS)
            self._registered[fd] = connection

    def forget(self, fd: int) -> None:
        """Stop watching ``fd``, if it is: before its connection closes it, so that the
        descriptor's next socket is not taken for it (:meth:`run` takes off a socket that
        ended)."""
        if self._registered.pop(fd, None) is not None:
            self._poller.unregister(fd)

    async def run(self) -> NoReturn:
        """Wait for sockets to end and tell their connections, until cancelled; the epoll
        instance is closed then."""
        poller = self._poller
        try:
            while True:
                await trio.lowlevel.wait_readable(poller.fileno())
                for fd, _ in poller.poll(0):
                    connection = self._registered.pop(fd, None)
                    if connection is not None:
                        # Level-triggered: unregistered, or it would be reported again.
                        poller.unregister(fd)
                        connection._client_ended()
        finally:
            self._registered.clear()
            poller.close()


class HttpRequest:
    """One HTTP request as its handler sees it: the request line, headers, and the body to read.

    The handler reads the body (at most once) with :meth:`receive_body` and sends one response
    with :meth:`respond`. It runs in a cancel scope that the client's going away, or the end of
    a shutdown's grace period, cancels.
    """

    # Slots: a request is made per call, and its two dozen attributes are set in a slot each
    # rather than in a dict made for it.
    __slots__ = (
        "_body_read",
        "_cancel_message",
        "_cancelled",
        "_client_gone",
        "_closes",
        "_coding",
        "_connection",
        "_headers",
        "_message",
        "_response_sent",
        "_response_started",
        "_running",
        "_scope",
        "bytes_in",
        "bytes_out",
        "connection_id",
        "content_length",
        "method",
        "path",
        "query",
        "request_id",
        "started",
        "status",
        "subject",
    )

    def __init__(self, connection: HttpConnection, message: _Message) -> None:
        target = message.target
        if target[0] != _SLASH:  # llhttp refuses an empty target
            target = _origin_form(target)
        path, _, query = target.partition(b"?")
        # The method is one of llhttp's names, ASCII: the default codec (UTF-8) decodes it the
        # same, on CPython's fast path, where a codec named is looked up by its name.
        self.method: str = message.method.decode()
        """The request method, upper-case as sent: ``GET``, ``POST``..."""
        self.path: str = path.decode("latin-1")
        """The target's path, still percent-encoded: ``/v2/models/add_sub/infer``."""
        self.query: str = query.decode("latin-1") if query else ""
        """The target's query string, without the ``?`` (empty when none)."""
        self._headers: list[tuple[str, str]] | None = None
        self._coding = message.content_encoding
        coded = self._coding is not None and is_coded(self._coding) and message.content_length != 0
        self.content_length: int | None = None if coded else message.content_length
        """The body's size as announced; ``None`` when it is known only once it has arrived:
        chunked, or compressed (the size is what it decodes to)."""
        self.connection_id: int = connection.connection_id
        """The connection the request came on: unique among the process's connections."""
        sent_id = message.request_id
        self.request_id = (
            new_request_id() if sent_id is None else request_id(sent_id.decode("latin-1"))
        )
        """The request's id (:func:`~trio_infer.transport.access_log.request_id`): echoed in
        the response's ``x-request-id`` and logged."""
        self.subject = ""
        """What the request is for, as the handler names it (a model), for the access log."""
        self.started = connection.now()
        """When the request's head arrived (the Trio clock)."""
        self.status = 0
        """The status of the response sent (0: none yet)."""
        self.bytes_in = 0
        """Bytes of body received."""
        self.bytes_out = 0
        """Bytes of response body sent."""
        self._connection = connection
        self._message = message
        self._body_read = False
        self._response_started = False
        #: Set once a response has been written whole.
        self._response_sent = False
        #: Set when the response said ``Connection: close``.
        self._closes = False
        #: Set when the client is gone: nothing is to be sent any more.
        self._client_gone = False
        #: Why the request's scope was cancelled by the server (None: it was not).
        self._cancel_message: str | None = None
        #: The scope the handler runs in: the connection's (see HttpConnection._serve_request).
        self._scope: trio.CancelScope | None = None
        #: Whether the handler runs: only then does a cancel reach its scope.
        self._running = False
        #: Whether the request's scope was cancelled while its handler ran.
        self._cancelled = False

    @property
    def headers(self) -> list[tuple[str, str]]:
        """The request headers in order, names lower-case (decoded when first asked for: most
        GETs never are)."""
        headers = self._headers
        if headers is None:
            headers = self._headers = [
                (name.decode("latin-1"), value.decode("latin-1"))
                for name, value in self._message.headers
            ]
        return headers

    @property
    def fields(self) -> Sequence[tuple[bytes, bytes]]:
        """The request headers in order as received, names lower-case: :attr:`headers`
        undecoded, for a handler that keeps or looks for a few of them."""
        return self._message.headers

    def header(self, name: str) -> str | None:
        """The value of the first header called ``name`` (lower-case), or None: looked for
        among the fields as received, only its value decoded."""
        wanted = name.encode("latin-1")
        for key, value in self._message.headers:
            if key == wanted:
                return value.decode("latin-1")
        return None

    async def receive_body(
        self,
        on_data: Callable[[int], None] | None = None,
        limit: int | None = None,
        aligned_at: int = 0,
    ) -> bytearray | memoryview:
        """Read the whole request body and return it (once per request; not for ``GET`` and
        ``HEAD``, whose handlers read none).

        Args:
            on_data: Called with each piece's size before the piece is kept, so a chunked body
                can be counted against a budget as it arrives (its exception, if any, ends the
                read and passes to the caller). A compressed body calls it for what is sent,
                then for what that decodes to.
            limit: The most bytes the body may take, if less than ``max_body_size``.
            aligned_at: An offset in the body whose byte is to start 16-aligned in memory (a
                binary tensor's, read in place only where aligned for its dtype): the body
                is gathered after ``-aligned_at % 16`` bytes of padding in a block the
                allocator aligns to 16, and the padding dropped from its front, which moves
                the bytearray's start, not its bytes. Layout only: the bytes are the same.

        Returns:
            The body, decoded when it was sent gzip or deflate (Content-Encoding): decoded
            once it has arrived whole, the limit bounding what is sent and what it decodes to.
            A bytearray, or a writable memoryview of bytes (format ``B``) when it was read from
            the socket straight into its place (a large body of announced size, sent as is).

        Raises:
            HttpError: A body of unannounced size grew over the limit (413), the body did not
                arrive within ``receive_timeout`` of this call (408), it is malformed or its
                compressed data corrupt (400), or its coding is not decoded here (415).
        """
        assert not self._body_read, "a request body is read once"
        self._body_read = True
        connection = self._connection
        message = self._message
        limits = connection.limits
        limit = limits.max_body_size if limit is None else min(limit, limits.max_body_size)
        decoder: BodyDecoder | None = None
        if self._coding is not None:  # without the header, a body is sent as it is
            try:
                decoder = body_decoder(self._coding, limit)
            except ContentCodingError as exc:
                raise HttpError(exc.status, exc.message) from None
        # RFC 9110 10.1.1: no 100 once some of the body has come, or when its framing says
        # there is none (Content-Length: 0, or neither it nor chunked).
        if (
            message.expects_continue
            and not message.complete
            and not message.body_size
            and not connection.buffered
        ):
            await connection.send([_CONTINUE], self)
        pad = -aligned_at % 16
        length = message.content_length
        if (
            length is not None
            and _STRAIGHT_BODY <= length <= _STRAIGHT_MAX
            and decoder is None
            and on_data is None
            and connection.reads_straight(message)
        ):
            if length > limit:
                raise _too_large(limit)
            received: bytearray | memoryview = await connection.receive_straight(self, pad)
        else:
            body = bytearray(pad)
            body = self._take_body(body, pad, on_data, decoder, limit)
            # What is buffered of the body (most small ones come with their head) is parsed
            # before the timeout's scope is entered: parsing never waits, and the scope costs
            # more.
            while not message.complete and connection.parse_body(message):
                body = self._take_body(body, pad, on_data, decoder, limit)
            if not message.complete:
                # The rest of a body that did not come with its head: waited for.
                with trio.move_on_after(limits.receive_timeout) as waiting:
                    while not message.complete:
                        if not connection.parse_body(message) and not await connection.fill():
                            # The client closed its socket in the middle of its body: gone.
                            self._cancel_as_gone()
                            await trio.lowlevel.checkpoint()
                        body = self._take_body(body, pad, on_data, decoder, limit)
                if waiting.cancelled_caught:
                    raise HttpError(
                        408,
                        f"the request body did not arrive within {limits.receive_timeout:g} s",
                    )
            if decoder is not None:
                await _decode(decoder, body, on_data)
            del body[:pad]
            received = body
        self.bytes_in = len(received)
        # From now on the client has nothing more to send for this request: its socket
        # becoming readable means it closed it (or pipelines, which is served in turn).
        connection.watch(self)
        return received

    def _take_body(
        self,
        body: bytearray,
        pad: int,
        on_data: Callable[[int], None] | None,
        decoder: BodyDecoder | None,
        limit: int,
    ) -> bytearray:
        """Move the body's pieces parsed so far to ``body`` (after its ``pad`` bytes of
        padding), or to the decoder that keeps a compressed body until it has arrived whole;
        return the body.

        Pieces nobody counts as they come are left with the message until the body is whole
        or they are :data:`_HELD_PIECES`, and the first of them joined with the padding in
        one block of their size: a bytearray grown by a second piece is reallocated, which
        copies it.
        """
        message = self._message
        if decoder is None and on_data is None:
            # Every piece parsed is the body's (none is decoded): its size so far is theirs.
            if message.body_size > limit:
                raise _too_large(limit)
            if not message.complete and len(message.body) < _HELD_PIECES:
                return body
            if len(body) == pad:
                body = bytearray().join([body, *message.body])
                message.body.clear()
                return body
        for piece in message.body:
            if decoder is not None:
                try:
                    decoder.add(piece)
                except ContentCodingError as exc:
                    raise HttpError(exc.status, exc.message) from None
            elif len(body) - pad + len(piece) > limit:
                raise _too_large(limit)
            if on_data is not None:
                on_data(len(piece))
            if decoder is None:
                body += piece
        message.body.clear()
        return body

    async def respond(
        self,
        status: int,
        headers: Sequence[tuple[str, str]] = (),
        body: Sequence[Buffer] = (),
        lines: str = "",
    ) -> None:
        """Send the response (once per request): ``status``, ``headers`` (``content-length``
        is added) and ``body``, the buffers written in order with vectored writes.

        ``lines`` are header fields of the server's own, already rendered as
        :func:`header_lines` renders them (each ``name: value`` ended by CRLF), written after
        ``headers`` as they are: a handler renders its constant fields once, not per response.

        Returns once the socket has taken all of it, so what holds the body's memory is given
        back only after it has left. A client that reads none of it for the send timeout is
        taken as gone: the request's scope is cancelled and this raises ``Cancelled``.
        """
        assert not self._response_started, "one response per request"
        connection = self._connection
        size = 0
        for part in body:
            if isinstance(part, memoryview):
                # Written as it is (any format: its bytes, nbytes of them), in one piece.
                if not part.c_contiguous:
                    raise ValueError("a response's buffers are C-contiguous")
                size += part.nbytes
            else:
                size += len(part)
        fields = header_lines(headers) if headers else ""
        # The fields added here need no check for line breaks: the request id is printable
        # ASCII (request_id), the rest are the server's own.
        if connection.closes_after(self):
            close = _CLOSE_LINE
        else:
            close = _KEEP_ALIVE_LINE if self._message.http_1_0 else ""
        head = (
            f"{status_line(status)}{fields}{lines}content-length: {size}\r\n"
            f"{REQUEST_ID_HEADER}: {self.request_id}\r\n{close}\r\n"
        ).encode("latin-1")
        self._response_started = True
        self.status = status
        self.bytes_out = size
        parts: list[Buffer] = [head]
        total = len(head)
        if not connection.head_only and size:
            parts += body
            total += size
        # Most responses leave in one write, which needs no coroutine of send's: it is
        # awaited only for what the socket did not take at once.
        sent = connection.write_now(parts)
        if sent == total:
            self._response_sent = True
        else:
            self._response_sent = await connection.send_rest(unsent(parts, sent), self)

    def _cancel_as_gone(self) -> None:
        self._client_gone = True
        self._cancel_scope()

    def _cancel(self, message: str) -> None:
        """Cancel the request: the connection answers 503 with ``message`` if it can."""
        if self._cancel_message is None:
            self._cancel_message = message
        self._cancel_scope()

    def _cancel_scope(self) -> None:
        if self._running and self._scope is not None:
            self._cancelled = True
            self._scope.cancel()


class HttpConnection:
    """One client connection: the parser, the socket, and the request being served.

    What has been received and not yet parsed is kept as bytes; the parser (httptools, llhttp)
    is fed a request's head up to the blank line that ends it, and its body up to its end when
    its length is known, so a pipelined request is parsed only when its turn comes (a chunked
    body's end is found by parsing: at most a slice past it is parsed ahead).

    Args:
        stream: The accepted socket, or TLS over one.
        handler: Runs each request.
        limits: The bounds the connection keeps.
        requests_in_flight: Counts the requests being served, across connections.
        access_log: Write one access-log record per request
            (:mod:`trio_infer.transport.access_log`).
    """

    def __init__(
        self,
        stream: trio.SocketStream | trio.SSLStream[trio.SocketStream],
        handler: HttpHandler,
        limits: HttpLimits,
        requests_in_flight: CallCounter,
        access_log: bool = False,
        timer: _WaitTimer | None = None,
        helpers: trio.Nursery | None = None,
        ends: _EndWatch | None = None,
    ) -> None:
        self.connection_id = next(_connection_ids)
        """Unique among the process's connections, never reused."""
        self.limits = limits
        """The bounds this connection keeps."""
        self.closing = False
        """Set when the server drains or the connection is past its maximum age: the request
        in flight is the connection's last."""
        self.at_end = False
        """Set once the client's input has ended (or the socket broke)."""
        self._parse = _Parse(limits.max_header_size, limits.max_header_fields)
        #: Received, not yet parsed.
        self._buffer = bytearray()
        #: Why the parser stopped; raised when the request it concerns is read.
        self._broken: HttpError | None = None
        #: Bytes of the next request's head parsed before its end arrived.
        self._head_fed = 0
        #: The last bytes of a head the parser began past a chunked body's end, in the slice
        #: that ended the body (:meth:`parse_body`), the head not yet whole: as many as the
        #: blank line that ends the head may begin among. Empty otherwise.
        self._head_tail = b""
        self._stream = stream
        self._plain: trio.socket.SocketType | None = None
        #: The plaintext socket's descriptor (-1 over TLS), read and written directly.
        self._fd = -1
        #: The last read filled the read size: the next is tried before waiting.
        self._more_likely = False
        if isinstance(stream, trio.SocketStream):
            self._plain = stream.socket
            self._socket = stream.socket
            self._fd = stream.socket.fileno()
        else:
            self._socket = stream.transport_stream.socket
        #: The socket's descriptor, plaintext or under TLS: what the end watch registers.
        self._socket_fd = self._socket.fileno()
        self._handler = handler
        self._access_log = access_log
        self._requests_in_flight = requests_in_flight
        #: The request being served (None between requests).
        self._request: HttpRequest | None = None
        #: The connection's scope: cancelled while it waits for a request's head, by a drain
        #: or by the timer past the wait's deadline (see run).
        self._waiting = trio.CancelScope()
        #: Whether ``_waiting`` was cancelled: only this class cancels it (:meth:`_cancel_wait`),
        #: and the flag costs less to read than the scope's ``cancel_called``, which reads the
        #: clock.
        self._wait_cancelled = False
        #: When the wait for a request's head ends (Trio clock; inf while none is waited for):
        #: the timer cancels the wait past it (:meth:`_time_out`).
        self._wait_deadline = math.inf
        #: The server's timer; None: the connection runs one of its own (a connection made
        #: outside a server).
        self._timer = timer
        #: This connection in the timer's heap: emptied when it ends, so that what the heap
        #: keeps until its deadlines come is not the connection.
        self._timer_entry: list[HttpConnection | None] = [self]
        #: The earliest deadline this connection has in the timer's heap (inf: none).
        self._timed_until = math.inf
        #: Whether the connection waits for a request's head.
        self._idle = False
        #: A drain found the client's next request arriving, and counted it in flight until
        #: it is answered (see :meth:`drain`).
        self._arriving = False
        #: Requests whose heads were received on this connection.
        self._served = 0
        self.head_only = False
        """Whether the request being answered is a HEAD: its answer is a head, its
        ``content-length`` that of the body a GET would get, and no body (RFC 9110 9.3.2)."""
        #: When the connection reaches its maximum age (Trio clock; inf: never).
        self._retire_at = retirement_time(trio.current_time(), limits.max_connection_age)
        #: The run's clock, read directly: trio.current_time() reaches it through two more
        #: calls, and a run keeps one clock.
        self.now: Callable[[], float] = trio.lowlevel.current_clock().current_time
        #: A request whose scope was cancelled while its handler ran: finished (answered 503
        #: if it can be) outside that scope, which was the connection's, once it has exited.
        self._unfinished: HttpRequest | None = None
        #: Where the connection's disconnect watcher runs: the server's nursery for its
        #: connections' helpers, or (a connection made outside a server) one of its own, with
        #: its timer, while run() runs.
        self._helpers = helpers
        #: The server's end watch, which watches the requests of this connection whose bodies
        #: were read; None: the connection runs one of its own (a connection made outside a
        #: server), or (no EPOLLRDHUP) a disconnect watcher task.
        self._ends = ends
        #: The disconnect watcher's scope for its life: cancelled when the connection ends.
        self._watcher_life: trio.CancelScope | None = None
        #: The request whose client the disconnect watcher watches (None: none): set once its
        #: body is read, cleared when its handler returns or the socket turned readable.
        self._watched: HttpRequest | None = None
        #: Whether the disconnect watcher has been started (at the connection's first body).
        self._watcher_started = False
        #: The disconnect watcher while it is parked, waiting for a request to watch.
        self._parked: trio.lowlevel.Task | None = None
        #: The disconnect watcher's scope while it waits for the socket: cancelled when the
        #: handler of the request it watches returns.
        self._watch_scope: trio.CancelScope | None = None

    @property
    def buffered(self) -> int:
        """Bytes received from the client and not parsed yet."""
        return len(self._buffer)

    async def run(self) -> None:
        """Serve requests one after the other until the connection ends; then close it.

        The connection's scope is cancelled only while it waits for a request's head: by a
        drain, or by the server's timer (:class:`_WaitTimer`) past the wait's deadline. The
        deadline kept as a number costs next to nothing per request; one scope for the
        connection's life with its deadline moved twice a request cost about a tenth of a
        small request, a scope of its own for each wait twice that, and a timer task for
        each connection a third of a connection's setup. A scope once cancelled stays so: a
        head that arrived in the pass that cancelled it is served outside it, and the next
        wait gets a new one.
        """
        wants_ends = self._ends is None and _END_EVENTS is not None
        if self._helpers is not None and self._timer is not None and not wants_ends:
            await self._serve_and_end()
            return
        async with trio.open_nursery() as helpers:
            self._helpers = helpers
            if self._timer is None:
                self._timer = _WaitTimer(_shortest_timeout(self.limits))
                helpers.start_soon(self._timer.run)
            if wants_ends:
                self._ends = _EndWatch()
                helpers.start_soon(self._ends.run)
            try:
                await self._serve_and_end()
            finally:
                helpers.cancel_scope.cancel()

    async def _serve_and_end(self) -> None:
        try:
            await self._serve()
        finally:
            # The timer's heap lets go of the connection; its watcher ends.
            self._timer_entry[0] = None
            if self._watcher_life is not None:
                self._watcher_life.cancel()

    def _wait_until(self, deadline: float) -> None:
        """Set the deadline of the wait for a request's head (inf: none is waited for)."""
        self._wait_deadline = deadline
        if deadline < self._timed_until:
            self._timed_until = deadline
            assert self._timer is not None, "a head is waited for in HttpConnection.run"
            self._timer.add(deadline, self._timer_entry)

    def _time_out(self, now: float) -> None:
        """Called by the timer when one of this connection's deadlines is due: cancel the wait
        if its deadline has passed, or have the timer come back at its deadline."""
        self._timed_until = math.inf
        deadline = self._wait_deadline
        if deadline <= now:
            self._cancel_wait()
        elif deadline != math.inf:
            self._wait_until(deadline)

    async def _serve(self) -> None:
        should_linger = False
        try:
            error: HttpError | None = None
            while True:
                scope = self._waiting
                late: _Message | None = None
                with scope:
                    while True:
                        try:
                            message = await self._next_request()
                        except HttpError as exc:
                            error = exc
                            break
                        if message is None:
                            break
                        if self._wait_cancelled:
                            # Cancelled (a drain, the deadline) in the pass its head arrived
                            # in: a scope stays cancelled, so the request is served outside it.
                            late = message
                            break
                        if not await self._serve_request(message, scope):
                            should_linger = not self.at_end
                            break
                # The wait for a head was cancelled (a drain, the deadline)...
                waited_out = scope.cancelled_caught
                if self._unfinished is not None:
                    # ...or a request, in the connection's scope (which it ran in): the
                    # connection's last.
                    waited_out = False
                    await self._finish_cancelled()
                    should_linger = not self.at_end
                    break
                if late is None:
                    break
                self._new_wait()
                if not await self._serve_in_scope_of_its_own(late):
                    should_linger = not self.at_end
                    break
            if waited_out and self._head_begun() and not self.closing:
                error = HttpError(
                    408,
                    f"the request's head did not arrive within {self.limits.handshake_timeout:g} s",
                )
            elif waited_out and error is None and not self.at_end:
                # A drain or the idle timeout ended the wait for the next request, which the
                # client may have sent meanwhile: served if it has, the connection's last. Its
                # bytes unread, the close would be a reset, and the client would see no answer.
                try:
                    message = await self._arrived_request()
                except HttpError as exc:
                    error = exc
                else:
                    if message is not None:
                        await self._serve_in_scope_of_its_own(message)
                finally:
                    self._arrived()
                should_linger = True
            if error is not None:
                await self._answer_error(error.status, error.message)
                should_linger = True
            await end_connection(self._stream, lingering=should_linger)
        finally:
            if self._unfinished is not None:  # something other than its cancel ended it
                self._end_request(self._unfinished)
                self._unfinished = None
            self._arrived()
            if self._ends is not None:
                self._ends.forget(self._socket_fd)
            await trio.aclose_forcefully(self._stream)

    def drain(self) -> None:
        """Serve no request after the one in flight: close the connection now if it waits for
        its next request (answering one the client had already sent), or once its response is
        written."""
        self.closing = True
        if self._idle:
            if not self._arriving and self._next_arriving():
                # Counted in flight from now, so that a shutdown gives it its grace period.
                self._arriving = True
                self._requests_in_flight.increment()
            self._cancel_wait()

    def _cancel_wait(self) -> None:
        self._wait_cancelled = True
        self._waiting.cancel()

    def _new_wait(self) -> trio.CancelScope:
        """A new scope for the connection's waits, its predecessor having been cancelled."""
        self._waiting = trio.CancelScope()
        self._wait_cancelled = False
        return self._waiting

    def _arrived(self) -> None:
        """The request a drain found arriving has been answered (or never came)."""
        if self._arriving:
            self._arriving = False
            self._requests_in_flight.decrement()

    def retire_if_due(self) -> None:
        """Past its maximum age, make the response about to be sent the connection's last."""
        if self._retire_at != math.inf and self.now() >= self._retire_at:
            self.closing = True

    def cancel_request(self, message: str) -> None:
        """Cancel the request in flight, which is answered 503 with ``message`` if it has not
        started its response."""
        if self._request is not None:
            self._request._cancel(message)

    async def fill(self, size: int = _READ_SIZE) -> bool:
        """Receive more from the client into the buffer, at most ``size`` bytes; False at the
        end of its input (or a broken socket), after which :attr:`at_end` is set.

        Plaintext is read on the descriptor (Trio keeps it non-blocking). Trio's ``recv``
        tries a read first, which on a keep-alive connection fails (the client sends its next
        request only once answered), and yields again after reading; here a read is tried at
        once only after one that filled the read size (more is likely waiting), with a
        checkpoint. The read is this coroutine's own, not a call to another: a keep-alive
        connection waits here once a request, and each coroutine between its loop and the
        wait is passed through twice a wait.
        """
        if self.at_end:
            await trio.lowlevel.checkpoint()
            return False
        fd = self._fd
        try:
            if fd < 0:
                data = await self._stream.receive_some(size)
            else:
                # Waited for by its descriptor too: given the socket, Trio asks it for its
                # descriptor on every wait.
                if self._more_likely:
                    await trio.lowlevel.checkpoint()
                else:
                    await trio.lowlevel.wait_readable(fd)
                while True:
                    try:
                        data = os.read(fd, size)
                    except BlockingIOError:
                        await trio.lowlevel.wait_readable(fd)  # woken without data after all
                        continue
                    self._more_likely = len(data) == size
                    break
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            data = b""
        if not data:
            self.at_end = True
            return False
        self._buffer += data
        return True

    def reads_straight(self, message: _Message) -> bool:
        """Whether ``message``'s body, of known length, may be received straight into its
        buffer: on a plaintext socket, the parser not stopped, and none of the body parsed
        (a chunked body before it can have had the parser read ahead into it)."""
        return self._fd >= 0 and self._broken is None and not message.body_size

    async def receive_straight(self, request: HttpRequest, pad: int) -> memoryview:
        """Receive ``request``'s body, of known length, whole: a writable view of bytes
        starting ``pad`` bytes into a block the allocator aligns to 16, what is buffered of it
        copied once, the rest read from the socket into its place, and never more than the body
        (what follows it stays buffered, or in the socket). The parser sees none of it and
        starts anew after it, the body's end being known from its length.

        Raises:
            HttpError: The body did not arrive within ``receive_timeout`` (408).
        """
        message = request._message
        length = message.content_length
        assert length is not None, "a body of known length"
        buffer = self._buffer
        held = min(len(buffer), length)
        # Memory not zeroed first: each of its bytes is written below (what is buffered copied,
        # the rest read) before the body is returned, and a body not read whole is never
        # returned (the request is cancelled or answered 408).
        body = numpy.empty(pad + length, numpy.uint8).data[pad:]
        with memoryview(buffer) as view, view[:held] as part:
            body[:held] = part
        del buffer[:held]
        done = held
        end = length
        if done < end:
            # Tried before the timeout's scope is entered: the rest has often arrived already.
            done += await self._read_into(request, body, done, end)
        if done < end:
            limit = self.limits.receive_timeout
            with trio.move_on_after(limit) as waiting:
                while done < end:
                    await trio.lowlevel.wait_readable(self._fd)
                    done += await self._read_into(request, body, done, end)
            if waiting.cancelled_caught:
                raise HttpError(408, f"the request body did not arrive within {limit:g} s")
        message.body_size = length
        message.complete = True
        self._parse.restart()
        # A read that filled its size before the body was read here filled it with the body,
        # which is taken: what follows it, a client sends once answered, so the next read waits
        # for the socket rather than fail on it first.
        self._more_likely = False
        return body

    async def _read_into(self, request: HttpRequest, body: memoryview, start: int, end: int) -> int:
        """Read what the socket has of ``body[start:end]`` into its place, without waiting:
        the bytes read (0 when none had arrived). At the end of the client's input (or a
        broken socket) in the middle of the body, the client is gone: the request is cancelled.
        """
        try:
            with body[start:end] as place:
                got = os.readv(self._fd, [place])
        except BlockingIOError:
            return 0
        except OSError:
            got = 0
        if not got:
            self.at_end = True
            request._cancel_as_gone()
            await trio.lowlevel.checkpoint()
        return got

    def parse_body(self, message: _Message) -> bool:
        """Parse what is buffered of ``message``'s body; False if nothing was.

        Raises:
            HttpError: The body is malformed (400), or the parser stopped on it.
        """
        if self._broken is not None:
            raise self._broken
        buffer = self._buffer
        if not buffer:
            return False
        if message.content_length is not None:
            size = min(len(buffer), message.content_length - message.body_size)
            self._feed(size)
        else:
            size = min(len(buffer), _CHUNKED_SLICE)
            before = message.body_size
            last = bytes(buffer[max(size - 3, 0) : size])
            self._feed(size)
            messages = self._parse.messages
            if message.complete and messages[-1] is not message and not messages[-1].head_done:
                # The parser read on past the body's end into the next request's head, and
                # what ends that head may come split between these bytes and the next.
                self._head_tail = last
            # Framing (a size line, its extensions, the trailers) is bounded like a head: at
            # most max_header_size between two pieces of data, or after the last, counted a
            # slice at a time. llhttp holds none of it, but httptools builds a trailer field
            # in memory until its line ends.
            message.framing = 0 if message.body_size > before else message.framing + size
            if message.framing > self.limits.max_header_size and not message.complete:
                self._broken = HttpError(
                    400,
                    f"malformed request body: over {self.limits.max_header_size} bytes of "
                    f"chunked framing (size lines, extensions, trailers) without data",
                )
        if self._broken is not None and not message.complete:
            raise self._broken
        return True

    def _feed(self, size: int) -> None:
        """Parse the first ``size`` bytes buffered; a parse error is kept in ``_broken``."""
        buffer = self._buffer
        try:
            if size == len(buffer):
                # The parser holds the buffer for the call only: it may shrink after.
                self._parse.parser.feed_data(buffer)
            else:
                # A copy of the part (a head, what is left of a body, a chunked slice): a view
                # of it would have to be released before the buffer shrinks, which costs more
                # than copying a head.
                self._parse.parser.feed_data(buffer[:size])
        except httptools.HttpParserUpgrade:
            # llhttp stops after a request that asks to switch protocols (or CONNECT). None
            # is switched here: the request is answered as it is, the connection closed after
            # it (_Message.upgrade), and nothing after it parsed.
            self._broken = HttpError(400, "nothing is read after a protocol upgrade")
            if self._parse.messages:
                self._parse.messages[-1].upgrade = True
        except httptools.HttpParserError as exc:
            self._broken = self._parse_error(exc)
        del buffer[:size]

    def _parse_error(self, exc: httptools.HttpParserError) -> HttpError:
        """The answer to the request the parser stopped on."""
        if self._parse.refusal is not None:
            return HttpError(*self._parse.refusal)
        if isinstance(exc, httptools.HttpParserCallbackError):
            # A bug in a callback, not the client's doing.
            logger.error("the HTTP parser's callback failed", exc_info=exc.__context__)
            return HttpError(500, "internal server error")
        reason = str(exc)
        if "Content-Length" in reason and "Transfer-Encoding" in reason:
            # A proxy in front that believed one framing would see another request in the
            # body (request smuggling). RFC 9112 6.3: an error, and the connection closes.
            return HttpError(400, _BOTH_FRAMINGS)
        messages = self._parse.messages
        if messages and messages[-1].head_done:
            return HttpError(400, f"malformed request body: {reason}")
        return HttpError(400, f"malformed request: {reason}")

    def _parse_head(self) -> bool:
        """Parse what is buffered of the next request's head, up to the blank line that ends
        it (what follows stays buffered), or, when the head has not come whole, all but the
        last bytes that may be the start of that blank line (its end may come split across
        reads); False if nothing was."""
        buffer = self._buffer
        tail = self._head_tail
        end = buffer.find(b"\r\n\r\n")
        if end >= 0:
            size = end + 4
        else:
            # Held back: the bytes that may begin the blank line, which may have begun in the
            # tail when fewer than its start have come since.
            size = len(buffer) - _blank_line_begun(tail + buffer[-3:] if tail else buffer)
        if tail:
            # A head begun past a chunked body's end: its blank line may have begun among the
            # bytes the parser read of it, and end among the first ones here.
            straddling = (tail + buffer[:3]).find(b"\r\n\r\n")
            if straddling >= 0:
                size = straddling + 4 - len(tail)
            if size > 0:
                self._head_tail = b""
        if size <= 0:
            return False
        self._feed(size)
        self._head_fed += size
        return True

    async def _next_request(self, last: bool = False) -> _Message | None:
        """The next request's line and headers; None when the connection is to end: the
        client closed it, or the server drains (unless this is the ``last`` request it reads,
        one that had begun to arrive).

        A new connection has the handshake timeout to send its first request's head; a
        keep-alive one the idle timeout to start the next, and the handshake timeout to finish
        it once started: the connection's scope is cancelled past them (:meth:`run` answers 408
        to a head begun and not finished).

        Raises:
            HttpError: the request's head is malformed (400) or too large (414, 431), or it
                asks for what is not served (501, 505).
        """
        if self.closing and not last:
            return None
        limits = self.limits
        timeout = limits.idle_timeout if self._served else limits.handshake_timeout
        self._wait_until(self.now() + timeout)
        self._idle = True
        messages = self._parse.messages
        self.head_only = False
        self._head_fed = 0
        hurried = False
        try:
            while True:
                if messages and messages[0].head_done:
                    message = messages[0]
                    self._head_fed = 0
                    self._served += 1
                    self.head_only = message.method == b"HEAD"
                    return message
                if self._broken is not None:
                    # A head refused once its method was read (a 417, a 505...): a HEAD's
                    # answer is a head alone, as when a handler refuses it (RFC 9110 9.3.2).
                    self.head_only = bool(messages) and messages[-1].method == b"HEAD"
                    raise self._broken
                if self._head_fed > limits.max_header_size:
                    raise HttpError(431, headers_too_large(limits.max_header_size))
                # (A keep-alive connection's buffer is empty when it starts to wait: nothing
                # to parse, nor a call to find that out.)
                if self._buffer and self._parse_head():
                    continue
                if not hurried and (self._buffer or self._head_fed or messages):
                    # A head has begun (_head_begun, without its call: a keep-alive connection
                    # passes here once a request) and must wait for the rest of it (most come
                    # whole in one read, and never get here).
                    hurried = True
                    self._wait_until(
                        min(self._wait_deadline, self.now() + limits.handshake_timeout)
                    )
                if not await self.fill(_HEAD_READ_SIZE):
                    return None  # the client closed, in the middle of a head or not
        finally:
            self._idle = False
            self._wait_deadline = math.inf

    async def _arrived_request(self) -> _Message | None:
        """After the wait for the next request was cancelled: that request, if some of it has
        arrived, read in a new wait (its head then has the handshake timeout); None if none has.

        Raises:
            HttpError: as :meth:`_next_request`.
        """
        self.closing = True  # its answer is the connection's last
        if not self._next_arriving():
            return None
        with self._new_wait():
            return await self._next_request(last=True)
        return None  # cancelled again (a drain, the deadline): nothing more is waited for

    def _next_arriving(self) -> bool:
        """Whether some of the next request has arrived: buffered, or in the socket."""
        return self._head_begun() or _readable_now(self._socket)

    def _head_begun(self) -> bool:
        """Whether some of a request's head has arrived (and not all of it)."""
        return bool(self._buffer or self._head_fed or self._parse.messages)

    async def _serve_in_scope_of_its_own(self, message: _Message) -> bool:
        """:meth:`_serve_request` for a request read outside the connection's scope (which was
        cancelled)."""
        with trio.CancelScope() as scope:
            served = await self._serve_request(message, scope)
        if self._unfinished is not None:
            await self._finish_cancelled()
            return False
        return served

    async def _serve_request(self, message: _Message, scope: trio.CancelScope) -> bool:
        """Run the handler on one request and make sure it is answered; whether the connection
        may carry another.

        The handler runs in ``scope``, the caller's: the connection's scope, which nothing
        else cancels while a request runs, rather than a scope entered for each request (that
        cost a sixth of a small request). If the request is cancelled while its handler runs
        (its client gone, the end of a shutdown's grace period), it is left to the caller to
        finish once ``scope`` has exited (:meth:`_finish_cancelled`), and the connection ends.
        """
        request = HttpRequest(self, message)
        length = message.content_length
        if length is not None and length > self.limits.max_body_size:
            # Refused before any of the body is read, let alone buffered.
            await self._answer_error(
                413,
                f"the request body of {length} bytes is larger than the maximum of "
                f"{self.limits.max_body_size} bytes",
            )
            return False
        self._request = request
        counter = self._requests_in_flight
        counter.increment()
        counter.started += 1
        try:
            request._scope = scope
            request._running = True
            failure: HttpError | None = None
            try:
                await self._handler(request)
            except HttpError as error:
                failure = error
            except Exception:
                logger.exception("unexpected error in %s %s", request.method, request.path)
                failure = HttpError(500, "internal server error")
            finally:
                request._running = False
                # The disconnect watch (if its body was read) ends with the handler.
                if self._watched is not None or self._watch_scope is not None:
                    self._unwatch()
                if request._cancelled:
                    # Cancelled whether it raised Cancelled or not: the scope stays so.
                    self._unfinished = request
            if request._cancelled:
                return False
            if failure is None and request._response_sent and not request._client_gone:
                # Answered whole: what _finish_request decides without a coroutine of its own.
                return not request._closes
            return await self._finish_request(request, failure)
        finally:
            if self._unfinished is not request:
                self._end_request(request)

    async def _finish_cancelled(self) -> None:
        """Finish the request cancelled while its handler ran, outside its scope."""
        request = self._unfinished
        assert request is not None
        try:
            await self._finish_request(request, None)
        finally:
            self._unfinished = None
            self._end_request(request)

    async def _finish_request(self, request: HttpRequest, failure: HttpError | None) -> bool:
        """Make sure ``request``, whose handler has returned (with ``failure``), is answered;
        whether the connection may carry another.

        :meth:`_serve_request` decides the common case itself (no failure, the response sent
        whole, the client still there: the connection carries another unless the response
        said it closes); what this decides for that case must stay the same.
        """
        if request._client_gone:
            return False
        if request._response_started:
            if request._cancelled or not request._response_sent:
                return False  # cut off in the middle of the response
        elif request._cancel_message is not None:
            failure = HttpError(503, request._cancel_message)
        elif failure is None:
            logger.error("%s %s: the handler sent no response", request.method, request.path)
            failure = HttpError(500, "internal server error")
        if failure is not None:
            await self._answer_error(failure.status, failure.message, request, failure.fields)
            if request._client_gone:
                return False
        return request._response_sent and not request._closes

    def _end_request(self, request: HttpRequest) -> None:
        """The request is done with: no longer in flight, and logged."""
        self._request = None
        self._parse.messages.popleft()
        self._requests_in_flight.decrement()
        if self._access_log and ACCESS_LOGGER.isEnabledFor(logging.INFO):
            log_call(
                CallRecord(
                    "http",
                    f"{request.method} {request.path}",
                    request.subject,
                    str(request.status) if request.status else _CLIENT_CLOSED_REQUEST,
                    self.now() - request.started,
                    request.bytes_in,
                    request.bytes_out,
                    request.request_id,
                )
            )

    async def _answer_error(
        self,
        status: int,
        message: str,
        request: HttpRequest | None = None,
        extra: Sequence[tuple[str, str]] = (),
    ) -> None:
        """Answer ``{"error": message}`` with ``status`` (and the header fields ``extra``), if
        a response can still be sent: for ``request``, or (None) for a request no handler
        saw, after which the connection closes."""
        body = error_body(message)
        fields = [_JSON, ("content-length", str(len(body))), *extra]
        if request is None:
            self.closing = True
            fields.append(_CLOSE)
        else:
            if request._response_started:
                return
            request._response_started = True
            request.status = status
            request.bytes_out = len(body)
            fields.append((REQUEST_ID_HEADER, request.request_id))
            if self.closes_after(request):
                fields.append(_CLOSE)
            elif request._message.http_1_0:
                fields.append(_KEEP_ALIVE)
        data: list[Buffer] = [response_head(status, fields)]
        if not self.head_only:
            data.append(body)
        sent = await self.send(data, request)
        if request is not None:
            request._response_sent = sent

    def closes_after(self, request: HttpRequest) -> bool:
        """Whether ``request``'s response is the connection's last (it then says so): the
        server drains, the connection is past its age, the client asked, the request asked to
        switch protocols, or its body was not read whole (what is left of it cannot be told
        from the next request: what has arrived of it is dropped)."""
        if self._retire_at != math.inf:
            self.retire_if_due()
        message = request._message
        if not message.complete:
            with contextlib.suppress(HttpError):
                while not message.complete and self.parse_body(message):
                    pass
            message.body.clear()
        request._closes = (
            self.closing or not message.keep_alive or message.upgrade or not message.complete
        )
        return request._closes

    def write_now(self, data: Sequence[Buffer]) -> int:
        """Bytes of ``data`` one vectored write gives the socket at once, which needs no
        timeout: 0 over TLS, or when the socket takes none now or fails (the writes of
        :meth:`send_rest` then wait for it, or find out why)."""
        if self._plain is None:
            return 0
        try:
            return os.writev(self._fd, data[:MAX_BUFFERS])
        except OSError:
            return 0

    async def send(
        self, data: Sequence[Buffer], request: HttpRequest | None, size: int = -1
    ) -> bool:
        """Write ``data`` in order; whether it was. A client that takes none of it for the
        send timeout, or whose socket broke, is gone: ``request`` (if any) is cancelled, and
        the connection ends after it. ``size``, when the caller knows it, is the bytes of
        ``data``: a write that took them all then needs no count of what is left."""
        sent = self.write_now(data)
        if sent == size:
            return True
        return await self.send_rest(unsent(data, sent), request)

    async def send_rest(self, data: Sequence[Buffer], request: HttpRequest | None) -> bool:
        """:meth:`send` for what is left after :meth:`write_now` took what the socket would
        at once: a write that finds the socket full waits for it, for the send timeout at
        most."""
        limit = self.limits.send_timeout
        try:
            while data:
                with trio.move_on_after(limit):
                    if self._plain is not None:
                        sent = await self._plain.sendmsg(data[:MAX_BUFFERS])
                    else:
                        # Encrypted, every byte is copied anyway: one piece at a time, so that
                        # the timeout measures the client's progress.
                        piece = first_bytes(data, _TLS_WRITE_SIZE)
                        await self._stream.send_all(piece)
                        sent = len(piece)
                    data = unsent(data, sent)
                    continue
                raise trio.BrokenResourceError(f"the client read nothing for {limit:g} s")
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            if isinstance(exc, OSError) and exc.errno not in (errno.EBADF, errno.ENOTSOCK):
                logger.debug("client gone while sending: %s", exc)
            self.at_end = True
            self.closing = True
            if request is not None:
                request._cancel_as_gone()
                await trio.lowlevel.checkpoint()
            return False
        return True

    def watch(self, request: HttpRequest) -> None:
        """Have ``request`` cancelled when its client closes its socket (or it breaks) before
        the request's handler returns: by the end watch (:class:`_EndWatch`), or where there
        is none by the disconnect watcher, started the first time. Reads nothing: what the
        client sends next (a pipelined request) stays in the socket for the next cycle."""
        self._watched = request
        if self._ends is not None:
            self._ends.add(self._socket_fd, self)
            return
        if not self._watcher_started:
            self._watcher_started = True
            assert self._helpers is not None, "a request runs in HttpConnection.run"
            self._watcher_life = trio.CancelScope()
            self._helpers.start_soon(self._watch_disconnects, self._watcher_life)
        elif self._parked is not None:
            trio.lowlevel.reschedule(self._parked)
            self._parked = None

    def _unwatch(self) -> None:
        """End the watch of the request being served, if any: the connection's own reads may
        wait for the socket from now on (Trio lets one task at a time wait to read it; the
        cancel takes the watcher's wait off the socket at once)."""
        self._watched = None
        if self._ends is not None:
            # The socket stays registered: its end, reported while no request is watched,
            # cancels nothing (the connection's own read finds it).
            return
        if self._watch_scope is not None:
            self._watch_scope.cancel()
            self._watch_scope = None

    def _client_ended(self) -> None:
        """Called by the end watch: the client ended its socket (or it broke), which cancels
        the request watched, if one is; between such requests the connection's own read finds
        the end."""
        request = self._watched
        if request is not None:
            self._watched = None
            self.at_end = True
            request._cancel_as_gone()

    def _abort_park(self, _: object) -> trio.lowlevel.Abort:
        self._parked = None
        return trio.lowlevel.Abort.SUCCEEDED

    async def _watch_disconnects(self, life: trio.CancelScope) -> None:
        """The disconnect watcher (:meth:`_watch`), for the connection's life: it runs among
        the server's tasks, so that a connection opens no nursery of its own, and a fault in
        it is logged, not let through to them."""
        with life:
            try:
                await self._watch()
            except Exception:
                logger.exception(
                    "the disconnect watcher failed: its connection's requests are no longer "
                    "cancelled when their client goes"
                )

    async def _watch(self) -> None:
        """The disconnect watcher: one task for the connection's life, rather than a nursery
        and a task for each request with a body. It waits for the socket to turn readable
        while a request is watched (:meth:`watch`), and is parked between them."""
        while True:
            request = self._watched
            if request is None:
                self._parked = trio.lowlevel.current_task()
                await trio.lowlevel.wait_task_rescheduled(self._abort_park)
                continue
            with trio.CancelScope() as scope:
                self._watch_scope = scope
                await trio.lowlevel.wait_readable(self._socket)
            if self._watch_scope is scope:
                self._watch_scope = None
            if self._watched is not request:
                continue  # its handler returned (the wait was cancelled, or it raced the end)
            # Readable: the client's next request, or the end of its input.
            try:
                peeked = await self._socket.recv(1, socket.MSG_PEEK)
            except OSError:
                peeked = b""
            ended = not peeked
            if peeked and self._watched is request:
                # Bytes before any end: a pipelined request, or (TLS) a close_notify alert.
                # A readable socket is not waited for again; its end (FIN) still is, by an
                # epoll of its own that reports only that (EPOLLRDHUP), unread bytes or not.
                ended = await self._wait_for_end(request)
            if self._watched is request:
                self._watched = None
            if ended:
                self.at_end = True
                request._cancel_as_gone()

    async def _wait_for_end(self, request: HttpRequest) -> bool:
        """Wait, while ``request`` is watched, for the client's socket to end: whether it did
        (False when the watch ended first, or the platform cannot tell)."""
        rdhup = getattr(select, "EPOLLRDHUP", None)
        if rdhup is None or not hasattr(select, "epoll"):
            return False
        with select.epoll(1) as poller:
            poller.register(self._socket.fileno(), rdhup)
            with trio.CancelScope() as scope:
                self._watch_scope = scope
                await trio.lowlevel.wait_readable(poller.fileno())
            if self._watch_scope is scope:
                self._watch_scope = None
            if self._watched is not request:
                return False
        return True


@dataclass(frozen=True)
class HttpStatistics:
    """A snapshot of the HTTP connections.

    Attributes:
        connections: Connections open now.
        requests: Requests being served on them.
        requests_started: Requests handed to the handler since the server started.
    """

    connections: int
    requests: int
    requests_started: int


class HttpServer(ConnectionServer[HttpConnection]):
    """Accepts HTTP/1.1 connections and serves each in its own task, for the life of
    :meth:`serve` (:class:`~trio_infer.transport.listening.ConnectionServer`): on shutdown,
    idle keep-alive connections close at once, and a request still running at the end of the
    grace period is cancelled and answered 503.

    Args:
        handler: Runs each request.
        limits: The bounds every connection keeps.
        ssl_context: Serve TLS with this server-side context; plaintext when None.
        access_log: Write one access-log record per request
            (:mod:`trio_infer.transport.access_log`).
    """

    def __init__(
        self,
        handler: HttpHandler,
        limits: HttpLimits | None = None,
        *,
        ssl_context: ssl.SSLContext | None = None,
        access_log: bool = False,
    ) -> None:
        super().__init__(ssl_context)
        self._handler = handler
        self._access_log = access_log
        self._limits = limits or HttpLimits()
        self._timer = _WaitTimer(_shortest_timeout(self._limits))
        #: Watches the ends of the sockets of requests running (None: not on this platform).
        self._ends: _EndWatch | None = None
        #: The nursery of the connections' helpers (the timer, disconnect watchers) while
        #: serve() runs.
        self._helpers: trio.Nursery | None = None
        self.requests_in_flight = self._in_flight
        """Requests being served, across connections."""

    def statistics(self) -> HttpStatistics:
        """Return a snapshot of the open connections and their requests."""
        return HttpStatistics(
            connections=len(self._connections),
            requests=self.requests_in_flight.count,
            requests_started=self.requests_in_flight.started,
        )

    async def serve(
        self,
        listeners: list[trio.SocketListener],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """:meth:`ConnectionServer.serve`, with the connections' wait timer beside it."""
        async with trio.open_nursery() as helpers:
            helpers.start_soon(self._timer.run)
            if _END_EVENTS is not None:
                self._ends = _EndWatch()
                helpers.start_soon(self._ends.run)
            self._helpers = helpers
            try:
                await super().serve(listeners, task_status=task_status)
            finally:
                self._helpers = None
                self._ends = None
                helpers.cancel_scope.cancel()

    def _connect(self, transport: Transport) -> HttpConnection:
        return HttpConnection(
            transport,
            self._handler,
            self._limits,
            self.requests_in_flight,
            self._access_log,
            self._timer,
            self._helpers,
            self._ends,
        )

    def _end_calls(self, connection: HttpConnection) -> None:
        connection.cancel_request("server shut down before the request finished")
