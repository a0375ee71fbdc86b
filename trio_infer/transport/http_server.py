"""HTTP/1.1 on Trio, driven by h11: one task per connection, one request at a time on it.

Ownership, top to bottom::

    HttpServer.serve                   owns the listeners and every connection
    ├── accept loops                   one per listener, in the server's accepting scope
    └── HttpConnection.run             one per client connection: reads a request, runs it,
        │                              writes its response, and again (keep-alive)
        └── request nursery            one per request that may have a body (not GET or
            │                          HEAD), in the request's cancel scope
            ├── handler(request)       the front-end: reads the body, works, responds
            └── disconnect watch       once the body is read: the client closing its socket
                                       cancels the request

Invariants:

- Every request gets exactly one response, or none when its client is gone: the handler's, or
  the one :meth:`HttpConnection._serve_request` writes when the handler sent none (the error
  it raised, 500 for a bug, 503 when the shutdown cut it off). A response is never started
  twice, and a connection whose response was cut off half-way is closed, never reused.
- A request whose client goes away (its socket's end, a reset, a response it reads none of for
  the send timeout) is cancelled: its handler's scope, and with it whatever the handler waits
  on. Nothing is answered then.
- What a client may make the server hold is bounded before it is read: header blocks by
  ``max_header_size`` (431), bodies by ``max_body_size`` (413, from ``Content-Length`` before
  any of the body is read; a chunked body as it arrives), and the time each part may take by
  the handshake, receive, idle and send timeouts.
- Nothing here knows JSON, tensors or models: a handler sees a request line, headers and body
  bytes, and sends a status, headers and body buffers (written with vectored writes, large
  ones from the handler's own memory). The one format this module writes itself is the error
  body of the V2 protocol, ``{"error": "..."}``, for the errors it answers on its own.
"""

from __future__ import annotations

import contextlib
import errno
import http
import itertools
import json
import logging
import socket
import ssl
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import h11
import trio

from trio_infer.buffers import MAX_BUFFERS, Buffer, first_bytes, unsent, write_some
from trio_infer.transport.access_log import (
    ACCESS_LOGGER,
    REQUEST_ID_HEADER,
    CallRecord,
    log_call,
    request_id,
)
from trio_infer.transport.connection_age import retirement_time
from trio_infer.transport.listening import CallCounter, ConnectionServer, Transport

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
#: The most one TLS write encrypts and sends, so the send timeout measures a client's progress.
_TLS_WRITE_SIZE = 256 * 1024
#: How long a connection closed by the server after an error keeps reading (and discarding)
#: what the client still sends: closing a socket with unread data resets it, and the reset
#: can reach the client before the response it was sent, which the client then never reads.
_LINGER = 0.5
_LINGER_BYTES = 1024 * 1024
#: Numbers the process's HTTP connections, never reusing a number. Negative, so that they are
#: never equal to the gRPC transport's (both are owners in the same memory budget).
_connection_ids = itertools.count(-1, -1)
#: Reason phrases by status, encoded once.
_REASONS = {status.value: status.phrase.encode() for status in http.HTTPStatus}
_JSON = (b"content-type", b"application/json")
_CLOSE = (b"connection", b"close")
_REQUEST_ID = REQUEST_ID_HEADER.encode("ascii")
_CONTINUE = h11.InformationalResponse(status_code=100, headers=[], reason=b"Continue")


@dataclass(frozen=True)
class HttpLimits:
    """The bounds every HTTP connection keeps.

    Args:
        max_body_size: The largest request body accepted, in bytes (413 past it).
        max_header_size: The largest request line and header block accepted, in bytes (431
            past it).
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
    handshake_timeout: float = 10.0
    receive_timeout: float = 30.0
    idle_timeout: float = 300.0
    send_timeout: float = 30.0
    max_connection_age: float | None = None


#: Methods whose handlers read no body (their requests run without a disconnect watch).
_BODILESS = frozenset(("GET", "HEAD"))


class HttpError(Exception):
    """A request the transport, or a handler, answers with an HTTP error status.

    Raised by :meth:`HttpRequest.receive_body` (a body too large, too slow, or malformed); a
    handler may raise it too. The connection answers ``{"error": message}`` with ``status``,
    unless a response was already started.

    Args:
        status: The HTTP status, 4xx or 5xx.
        message: Why, for the client.
    """

    def __init__(self, status: int, message: str) -> None:
        super().__init__(status, message)
        self.status = status
        self.message = message

    def __str__(self) -> str:
        return self.message


def error_body(message: str) -> bytes:
    """The V2 protocol's error body, ``{"error": message}``, as JSON bytes."""
    return json.dumps({"error": message}).encode()


class HttpRequest:
    """One HTTP request as its handler sees it: the request line, headers, and the body to read.

    The handler reads the body (at most once) with :meth:`receive_body` and sends one response
    with :meth:`respond`. It runs in a cancel scope that the client's going away, or the end of
    a shutdown's grace period, cancels.
    """

    def __init__(self, connection: HttpConnection, event: h11.Request) -> None:
        target = event.target
        path, _, query = target.partition(b"?")
        self.method: str = event.method.decode("ascii")
        """The request method, upper-case as sent: ``GET``, ``POST``..."""
        self.path: str = path.decode("latin-1")
        """The target's path, still percent-encoded: ``/v2/models/add_sub/infer``."""
        self.query: str = query.decode("latin-1")
        """The target's query string, without the ``?`` (empty when none)."""
        self.headers: list[tuple[str, str]] = [
            (name.decode("latin-1"), value.decode("latin-1")) for name, value in event.headers
        ]
        """The request headers in order, names lower-case."""
        self.content_length: int | None = None
        """The body's announced size; ``None`` for a chunked body (its size is known only once
        it has arrived)."""
        self.connection_id: int = connection.connection_id
        """The connection the request came on: unique among the process's connections."""
        self.request_id = request_id(self.header(REQUEST_ID_HEADER))
        """The request's id (:func:`~trio_infer.transport.access_log.request_id`): echoed in
        the response's ``x-request-id`` and logged."""
        self.subject = ""
        """What the request is for, as the handler names it (a model), for the access log."""
        self.started = trio.current_time()
        """When the request's head arrived (the Trio clock)."""
        self.status = 0
        """The status of the response sent (0: none yet)."""
        self.bytes_in = 0
        """Bytes of body received."""
        self.bytes_out = 0
        """Bytes of response body sent."""
        self._connection = connection
        self._body_read = False
        self._response_started = False
        #: Set when the client is gone: nothing is to be sent any more.
        self._client_gone = False
        #: Why the request's scope was cancelled by the server (None: it was not).
        self._cancel_message: str | None = None
        self._scope = trio.CancelScope()
        self._nursery: trio.Nursery | None = None
        chunked = False
        for name, value in event.headers:
            if name == b"content-length":
                self.content_length = int(value)  # h11 checked it is one decimal number
            elif name == b"transfer-encoding":
                chunked = True
        if self.content_length is None and not chunked:
            self.content_length = 0

    def header(self, name: str) -> str | None:
        """The value of the first header called ``name`` (lower-case), or None."""
        for key, value in self.headers:
            if key == name:
                return value
        return None

    async def receive_body(self, on_data: Callable[[int], None] | None = None) -> bytearray:
        """Read the whole request body and return it (once per request; not for ``GET`` and
        ``HEAD``, whose handlers read none).

        Args:
            on_data: Called with each piece's size before the piece is kept, so a chunked body
                can be counted against a budget as it arrives (its exception, if any, ends the
                read and passes to the caller).

        Raises:
            HttpError: A chunked body grew over ``max_body_size`` (413), the body did not
                arrive within ``receive_timeout`` of this call (408), or it is malformed (400).
        """
        assert not self._body_read, "a request body is read once"
        self._body_read = True
        connection = self._connection
        protocol = connection.protocol
        limits = connection.limits
        if protocol.they_are_waiting_for_100_continue:
            await connection.send([protocol.send(_CONTINUE) or b""], self)
        body = bytearray()
        with trio.move_on_after(limits.receive_timeout) as waiting:
            while True:
                try:
                    event = protocol.next_event()
                except h11.RemoteProtocolError as exc:
                    if connection.at_end:
                        # The client closed its socket in the middle of its body: it is gone.
                        self._cancel_as_gone()
                        await trio.lowlevel.checkpoint()
                    raise HttpError(400, f"malformed request body: {exc}") from None
                if event is h11.NEED_DATA:
                    protocol.receive_data(await connection.receive())
                elif isinstance(event, h11.Data):
                    if len(body) + len(event.data) > limits.max_body_size:
                        raise HttpError(
                            413,
                            f"the request body is larger than the maximum of "
                            f"{limits.max_body_size} bytes",
                        )
                    if on_data is not None:
                        on_data(len(event.data))
                    body += event.data
                elif isinstance(event, h11.EndOfMessage):
                    break
        if waiting.cancelled_caught:
            raise HttpError(
                408,
                f"the request body did not arrive within {limits.receive_timeout:g} s",
            )
        self.bytes_in = len(body)
        # From now on the client has nothing more to send for this request: its socket
        # becoming readable means it closed it (or pipelines, which is served in turn).
        assert self._nursery is not None, "GET and HEAD requests have no body to read"
        self._nursery.start_soon(connection.watch_disconnect, self)
        return body

    async def respond(
        self,
        status: int,
        headers: Sequence[tuple[str, str]] = (),
        body: Sequence[Buffer] = (),
    ) -> None:
        """Send the response (once per request): ``status``, ``headers`` (``content-length``
        is added) and ``body``, the buffers written in order with vectored writes.

        Returns once the socket has taken all of it, so what holds the body's memory is given
        back only after it has left. A client that reads none of it for the send timeout is
        taken as gone: the request's scope is cancelled and this raises ``Cancelled``.
        """
        assert not self._response_started, "one response per request"
        self._response_started = True
        connection = self._connection
        protocol = connection.protocol
        views = [memoryview(part).cast("B") for part in body]
        head_fields = [(name.encode("latin-1"), value.encode("latin-1")) for name, value in headers]
        self.status = status
        self.bytes_out = sum(len(view) for view in views)
        head_fields.append((b"content-length", str(self.bytes_out).encode()))
        head_fields.append((_REQUEST_ID, self.request_id.encode("ascii")))
        connection.retire_if_due()
        if connection.closing or not connection.skip_unread_body():
            # Closed after this response: the server drains, the connection is past its age,
            # or the body was not read whole (what is left of it cannot be told from the next
            # request).
            head_fields.append(_CLOSE)
        head = protocol.send(
            h11.Response(status_code=status, headers=head_fields, reason=_REASONS.get(status, b""))
        )
        assert head is not None
        parts: list[Buffer] = [head]
        for view in views:
            if view and not connection.head_only:
                # h11 checks the length against content-length and passes the view through
                # untouched (its annotation says bytes; any buffer with a len works).
                data = h11.Data(data=view)  # type: ignore[arg-type]
                parts.extend(protocol.send_with_data_passthrough(data) or ())
        protocol.send(h11.EndOfMessage())
        await connection.send(parts, self)

    def _cancel_as_gone(self) -> None:
        self._client_gone = True
        self._scope.cancel()

    def _cancel(self, message: str) -> None:
        """Cancel the request: the connection answers 503 with ``message`` if it can."""
        if self._cancel_message is None:
            self._cancel_message = message
        self._scope.cancel()


class HttpConnection:
    """One client connection: h11's state, the socket, and the request being served.

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
    ) -> None:
        self.connection_id = next(_connection_ids)
        """Unique among the process's connections, never reused."""
        self.limits = limits
        """The bounds this connection keeps."""
        # h11 bounds what it buffers of an incomplete header block; a complete one that came
        # in one read is measured in _next_request.
        self.protocol = h11.Connection(h11.SERVER, max_incomplete_event_size=limits.max_header_size)
        """h11's state machine for the connection."""
        self.closing = False
        """Set when the server drains or the connection is past its maximum age: the request
        in flight is the connection's last."""
        self.at_end = False
        """Set once the client's input has ended (or the socket broke)."""
        self._stream = stream
        self._plain: trio.socket.SocketType | None = None
        if isinstance(stream, trio.SocketStream):
            self._plain = stream.socket
            self._socket = stream.socket
        else:
            self._socket = stream.transport_stream.socket
        self._handler = handler
        self._access_log = access_log
        self._requests_in_flight = requests_in_flight
        #: The request being served (None between requests).
        self._request: HttpRequest | None = None
        #: Cancelled by the drain while the connection waits for its next request.
        self._waiting = trio.CancelScope()
        #: Requests whose heads were received on this connection.
        self._served = 0
        self.head_only = False
        """Whether the request being answered is a HEAD: its answer is a head, its
        ``content-length`` that of the body a GET would get, and no body (RFC 9110 9.3.2)."""
        #: When the connection reaches its maximum age (Trio clock; inf: never).
        self._retire_at = retirement_time(trio.current_time(), limits.max_connection_age)

    async def run(self) -> None:
        """Serve requests one after the other until the connection ends; then close it."""
        linger = False
        try:
            while True:
                try:
                    event = await self._next_request()
                except HttpError as error:
                    await self._answer_error(error.status, error.message)
                    linger = True
                    break
                if event is None:
                    break
                if not await self._serve_request(event):
                    linger = not self.at_end
                    break
                self.protocol.start_next_cycle()
            if linger:
                await self._linger()
        finally:
            await trio.aclose_forcefully(self._stream)

    def drain(self) -> None:
        """Serve no request after the one in flight: close the connection now if it waits for
        its next request, or once its response is written."""
        self.closing = True
        self._waiting.cancel()

    def retire_if_due(self) -> None:
        """Past its maximum age, make the response about to be sent the connection's last."""
        if trio.current_time() >= self._retire_at:
            self.closing = True

    def cancel_request(self, message: str) -> None:
        """Cancel the request in flight, which is answered 503 with ``message`` if it has not
        started its response."""
        if self._request is not None:
            self._request._cancel(message)

    async def _next_request(self) -> h11.Request | None:
        """The next request's line and headers; None when the connection is to end: the
        client closed it or sent nothing in time, or the server drains.

        A new connection has the handshake timeout to send its first request's head; a
        keep-alive one the idle timeout to start the next, and the handshake timeout to finish
        it once started.

        Raises:
            HttpError: the request's head is malformed (400), too large (431), or too slow
                to arrive once started (408).
        """
        protocol = self.protocol
        limits = self.limits
        timeout = limits.idle_timeout if self._served else limits.handshake_timeout
        self._waiting = trio.CancelScope(deadline=trio.current_time() + timeout)
        if self.closing:
            self._waiting.cancel()
        started = bool(protocol.trailing_data[0])
        self.head_only = False
        with self._waiting:
            while True:
                try:
                    event = protocol.next_event()
                except h11.RemoteProtocolError as exc:
                    if self.at_end:
                        return None  # the client closed in the middle of a request head
                    if exc.error_status_hint == 431:
                        raise HttpError(431, self._headers_too_large()) from None
                    raise HttpError(exc.error_status_hint, f"malformed request: {exc}") from None
                if isinstance(event, h11.Request):
                    size = len(event.target) + sum(
                        len(name) + len(value) + 4 for name, value in event.headers
                    )
                    if size > limits.max_header_size:
                        raise HttpError(431, self._headers_too_large())
                    if _framed_twice(event):
                        # h11 lets Transfer-Encoding win; a proxy in front may have believed
                        # Content-Length, and would see another request in this body (request
                        # smuggling). RFC 9112 6.3: an error, and the connection closes.
                        raise HttpError(
                            400, "the request has both Content-Length and Transfer-Encoding"
                        )
                    self._served += 1
                    self.head_only = event.method == b"HEAD"
                    return event
                if event is not h11.NEED_DATA:
                    return None  # ConnectionClosed, or PAUSED after a close
                data = await self.receive()
                if data and not started:
                    started = True
                    self._waiting.deadline = min(
                        self._waiting.deadline, trio.current_time() + limits.handshake_timeout
                    )
                protocol.receive_data(data)
        if started and not self.closing:
            raise HttpError(
                408, f"the request's head did not arrive within {limits.handshake_timeout:g} s"
            )
        return None

    def _headers_too_large(self) -> str:
        return (
            f"the request's headers are larger than the maximum of "
            f"{self.limits.max_header_size} bytes"
        )

    async def _serve_request(self, event: h11.Request) -> bool:
        """Run the handler on one request and make sure it is answered; whether the connection
        may carry another."""
        request = HttpRequest(self, event)
        length = request.content_length
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
            failure: HttpError | None = None
            with request._scope:
                if request.method in _BODILESS:
                    # Nothing to read, so no disconnect watch: no nursery to hold one.
                    failure = await self._run_handler(request)
                else:
                    async with trio.open_nursery() as nursery:
                        request._nursery = nursery
                        failure = await self._run_handler(request)
                        # The disconnect watch ends with the handler.
                        nursery.cancel_scope.cancel()
            if request._client_gone:
                return False
            if request._response_started:
                if request._scope.cancelled_caught or self.protocol.our_state is not h11.DONE:
                    return False  # cut off in the middle of the response
            elif request._cancel_message is not None:
                failure = HttpError(503, request._cancel_message)
            elif failure is None:
                logger.error("%s %s: the handler sent no response", request.method, request.path)
                failure = HttpError(500, "internal server error")
            if failure is not None:
                await self._answer_error(failure.status, failure.message, request)
                if request._client_gone:
                    return False
            return (
                not self.closing
                and self.protocol.our_state is h11.DONE
                and self.protocol.their_state is h11.DONE
            )
        finally:
            self._request = None
            counter.decrement()
            if self._access_log and ACCESS_LOGGER.isEnabledFor(logging.INFO):
                log_call(
                    CallRecord(
                        "http",
                        f"{request.method} {request.path}",
                        request.subject,
                        str(request.status) if request.status else "client gone",
                        trio.current_time() - request.started,
                        request.bytes_in,
                        request.bytes_out,
                        request.request_id,
                    )
                )

    async def _run_handler(self, request: HttpRequest) -> HttpError | None:
        """Run the handler; the error it ended with, if any (500 for a bug)."""
        try:
            await self._handler(request)
        except HttpError as error:
            return error
        except Exception:
            logger.exception("unexpected error in %s %s", request.method, request.path)
            return HttpError(500, "internal server error")
        return None

    async def _answer_error(
        self, status: int, message: str, request: HttpRequest | None = None
    ) -> None:
        """Answer ``{"error": message}`` with ``status``, if a response can still be sent."""
        if self.protocol.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            return
        if request is None:
            # The server's own answer to a request no handler saw: the connection closes.
            self.closing = True
        body = error_body(message)
        fields = [_JSON, (b"content-length", str(len(body)).encode())]
        if request is not None:
            request.status = status
            request.bytes_out = len(body)
            fields.append((_REQUEST_ID, request.request_id.encode("ascii")))
        self.retire_if_due()
        if self.closing or not self.skip_unread_body():
            fields.append(_CLOSE)
        response = h11.Response(
            status_code=status, headers=fields, reason=_REASONS.get(status, b"")
        )
        with contextlib.suppress(h11.LocalProtocolError):
            data: list[Buffer] = [self.protocol.send(response) or b""]
            if not self.head_only:
                data.append(self.protocol.send(h11.Data(data=body)) or b"")
            data.append(self.protocol.send(h11.EndOfMessage()) or b"")
            await self.send(data, request)

    def skip_unread_body(self) -> bool:
        """Drop what has arrived of a body the handler did not read; whether all of it had
        (an empty body always has), so the connection can carry another request."""
        protocol = self.protocol
        with contextlib.suppress(h11.RemoteProtocolError):
            while protocol.their_state is h11.SEND_BODY:
                if protocol.next_event() is h11.NEED_DATA:
                    break
        return protocol.their_state is h11.DONE

    async def receive(self) -> bytes:
        """The next bytes from the client; ``b""`` at the end of its input (or a broken
        socket), after which :attr:`at_end` is set."""
        if self.at_end:
            await trio.lowlevel.checkpoint()
            return b""
        try:
            data = await self._stream.receive_some(_READ_SIZE)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            data = b""
        if not data:
            self.at_end = True
        # A socket's reads are bytes already (no copy); h11 takes bytes.
        return bytes(data)

    async def send(self, data: Sequence[Buffer], request: HttpRequest | None) -> None:
        """Write ``data`` in order. A client that takes none of it for the send timeout, or
        whose socket broke, is gone: ``request`` (if any) is cancelled, and the connection
        ends after it."""
        limit = self.limits.send_timeout
        try:
            if self._plain is not None:
                # What the socket takes at once needs no timeout: one vectored write first.
                with contextlib.suppress(BlockingIOError):
                    data = write_some(self._plain.fileno(), data)
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

    async def watch_disconnect(self, request: HttpRequest) -> None:
        """Cancel ``request`` when its client closes its socket (or it breaks) while the
        request runs. Reads nothing: what the client sends next (a pipelined request) stays in
        the socket for the next cycle."""
        try:
            peeked = await self._socket.recv(1, socket.MSG_PEEK)
        except OSError:
            peeked = b""
        if not peeked:
            self.at_end = True
            request._cancel_as_gone()

    async def _linger(self) -> None:
        """Close the sending side and read what the client still sends for a moment, so that
        the response just written is not lost to a reset."""
        if self._plain is None:
            return
        with contextlib.suppress(OSError):
            self._plain.shutdown(socket.SHUT_WR)
        received = 0
        with trio.move_on_after(_LINGER):
            while received < _LINGER_BYTES:
                data = await self.receive()
                if not data:
                    break
                received += len(data)


def _framed_twice(event: h11.Request) -> bool:
    """Whether a request's head gives its body's length both ways."""
    names = {name for name, _ in event.headers}
    return b"content-length" in names and b"transfer-encoding" in names


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
        self.requests_in_flight = self._in_flight
        """Requests being served, across connections."""

    def statistics(self) -> HttpStatistics:
        """Return a snapshot of the open connections and their requests."""
        return HttpStatistics(
            connections=len(self._connections),
            requests=self.requests_in_flight.count,
            requests_started=self.requests_in_flight.started,
        )

    def _connect(self, transport: Transport) -> HttpConnection:
        return HttpConnection(
            transport, self._handler, self._limits, self.requests_in_flight, self._access_log
        )

    def _end_calls(self, connection: HttpConnection) -> None:
        connection.cancel_request("server shut down before the request finished")
