"""gRPC calls on Trio: one nursery per connection, each call in a cancel scope no other call shares.

Ownership, top to bottom::

    GrpcServer.serve                  owns the listeners and every connection
    └── Connection.run                one nursery per client connection
        ├── writer                    sends what the protocol queued, once per scheduling tick
        │                             (a call alone on its connection sends its own answer)
        ├── reader                    bytes -> events; cancels the calls they orphan
        ├── watchdog                  closes it after the handshake or the idle timeout
        ├── retirement                with a maximum age: GOAWAY at that age, UNAVAILABLE for
        │                             the calls still in flight after its grace
        └── runner                    runs calls one after another in its scope (a new
            │                         one after a call that had it cancelled); a new
            │                         runner only when none is idle
            └── call (one per stream) the runner's scope, deadline = arrival + grpc-timeout
                └── handler(call)     the service: reads, works, sends

A call of a method the service answers at once (``immediate``: a synchronous function of the
server's state) whose whole request arrives in the read that starts it is answered by the reader
itself, before it reads again: no task and no scope, as nothing in it can wait, time out or need
cancelling. Any other such call (its request not complete yet, an answer the client's window
cannot take now, an answer that would wait) runs in a task as every call does.

A task that has run its call waits for the next one the connection starts (at most
:data:`_MAX_IDLE_RUNNERS` of them wait): waking it costs less than Trio's start and end of a
task (``docs/performance.md``). A runner's calls run in its one scope, each under its own
deadline, while it is theirs alone: entering and leaving a scope for each call would cost more
than moving the deadline. A call handed to an idle runner is put in its scope at once, its
deadline replacing the one of the call before (an idle runner keeps it: a deadline that passes
while the runner waits cancels only the wait, and the runner waits again in a new scope). A
scope once cancelled stays cancelled, so the call after one that had it cancelled gets a new
one; a cancel that comes before a call is in a scope cancels the scope it is then put in. A
call's status and cleanup are its own whichever task runs it, and an idle runner holds no call;
the connection's end cancels the idle ones with the rest of its nursery.

Invariants:

- Every call ends with exactly one status, sent by :meth:`Connection._finish` (or, for a call
  answered at once, :meth:`Connection._answer_held`) and nowhere else: the handler's outcome,
  DEADLINE_EXCEEDED when its deadline passed, or the reason whoever cancelled it gave. A call
  the client reset gets nothing: nobody is listening.
- Whatever a call waits on is woken when its producer goes away: the reader closes every call's
  inbound queue when it exits, for whatever reason, and a stream reset cancels the call's scope.
- Nothing here knows protobuf or models: a handler sees bytes (a request message may come as
  the ``bytearray`` it was received into, which the handler then owns) and sends bytes, as one
  buffer or several (large ones go to the socket from the handler's own memory).
"""

from __future__ import annotations

import collections
import contextlib
import errno
import itertools
import logging
import math
import os
import socket
import ssl
import struct
from collections.abc import Awaitable, Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import outcome
import trio

from trio_infer.buffers import MAX_BUFFERS, Buffer, first_bytes, unsent, write_some
from trio_infer.errors import InferError, StatusCode
from trio_infer.transport.access_log import (
    ACCESS_LOGGER,
    REQUEST_ID_HEADER,
    CallRecord,
    log_call,
    new_request_id,
    request_id,
)
from trio_infer.transport.connection_age import retirement_time
from trio_infer.transport.grpc_protocol import (
    BY_REFERENCE_BYTES,
    CallRejected,
    ConnectionTerminated,
    MessageAnnounced,
    MessageReceived,
    MessageRefused,
    Metadata,
    ProtocolLimits,
    ProtocolViolation,
    RequestEnded,
    RequestReceived,
    ServerProtocol,
    StreamReset,
    WholeRequest,
)
from trio_infer.transport.lingering import end_connection
from trio_infer.transport.listening import CallCounter, ConnectionServer, Transport

__all__ = [
    "Call",
    "Connection",
    "GrpcServer",
    "Handler",
    "Immediate",
    "Metadata",
    "ProtocolLimits",
    "TransportStatistics",
]

logger = logging.getLogger(__name__)

Handler = Callable[["Call"], Awaitable[None]]
Immediate = Callable[["Call", int], Buffer | None]
"""Answers a call at once, in the connection's reader, when the client has sent its whole
request, one message of the ``int`` bytes announced, and ended it: the handler takes the message
with :meth:`Call.receive_message_nowait` and returns the response message (sent with status OK,
as one message and the status), or raises :class:`~trio_infer.errors.InferError` for another
status. It must not wait for anything. It returns None, before taking the message and having
changed nothing, when it cannot answer without waiting: the call then runs in a task, as every
call of a method without one does, its :data:`Handler` reading the same message."""
#: No method answered at once.
_NO_IMMEDIATE: Mapping[str, Immediate] = MappingProxyType({})

_READ_SIZE = 256 * 1024
#: The most the GOAWAY that answers a peer's protocol error may take to send, and the write
#: under way before it to end.
_GOODBYE_TIME = 0.2
#: The most one TLS write encrypts and sends, so the send timeout measures a client's progress.
_TLS_WRITE_SIZE = 256 * 1024
_Inbound = int | Buffer | InferError
#: Numbers the process's connections, never reusing a number.
_connection_ids = itertools.count()
_MESSAGE_PREFIX = struct.Struct(">?I")
#: Read once: a member read off its enum class goes through the metaclass's slow hook.
_OK = StatusCode.OK
#: The streams reset in a read that resets none (most reads).
_NO_RESETS: frozenset[int] = frozenset()
#: Runners a connection keeps waiting for its next calls once theirs have ended: enough for the
#: calls a client usually keeps in flight on one connection; past it, a runner ends with its
#: call, as a task per call would.
_MAX_IDLE_RUNNERS = 32


class _InboundQueue:
    """What the client sent on one call, in order, for the call's one reader; closed when the
    client has sent its last (or is gone).

    A memory channel's receive side with one reader and no bound on the count (the bytes are
    bounded by flow control), without what a channel costs on every call's path: its two
    objects, statistics and per-operation signal protection took about 10 us a call.
    """

    __slots__ = ("_closed", "_items", "_reader")

    def __init__(self) -> None:
        self._items: collections.deque[_Inbound] = collections.deque()
        self._closed = False
        self._reader: trio.lowlevel.Task | None = None

    def put(self, item: _Inbound) -> None:
        """Queue ``item`` (the reader, if it waits, wakes); after :meth:`close`, dropped."""
        if not self._closed:
            self._items.append(item)
            if self._reader is not None:  # most items come before their call's task runs
                self._wake()

    def put_last(self, length: int, message: Buffer) -> None:
        """A message's announced ``length``, the message, then :meth:`close`: a whole request
        (the reader, if it waits, wakes once)."""
        if not self._closed:
            self._items.append(length)
            self._items.append(message)
            self._closed = True
            if self._reader is not None:
                self._wake()

    def close(self) -> None:
        """No more items: the reader gets what is queued, then the end."""
        self._closed = True
        if self._reader is not None:
            self._wake()

    def get_nowait(self) -> _Inbound:
        """The next item.

        Raises:
            trio.WouldBlock: none yet.
            trio.EndOfChannel: none will come.
        """
        if self._items:
            return self._items.popleft()
        if self._closed:
            raise trio.EndOfChannel
        raise trio.WouldBlock

    async def get(self) -> _Inbound:
        """Wait for the next item (not a checkpoint when one is queued: callers check for
        cancellation first).

        Raises:
            trio.EndOfChannel: none will come.
        """
        if not self._items and not self._closed:
            assert self._reader is None, "one reader"
            self._reader = trio.lowlevel.current_task()

            def abort(_: object) -> trio.lowlevel.Abort:
                self._reader = None
                return trio.lowlevel.Abort.SUCCEEDED

            await trio.lowlevel.wait_task_rescheduled(abort)
        return self.get_nowait()

    def one_message(self) -> int | None:
        """The length of the one message queued, when the client sent exactly one, whole, and
        then ended its request (the queue is closed); None otherwise. Nothing is taken."""
        items = self._items
        if (
            self._closed
            and len(items) == 2
            and isinstance(items[1], bytes | bytearray | memoryview)
        ):
            length = items[0]
            assert isinstance(length, int), "a message is always announced first"
            return length
        return None

    @property
    def waiting(self) -> bool:
        """Whether the reader is waiting in :meth:`get` for the next item."""
        return self._reader is not None

    def _wake(self) -> None:
        assert self._reader is not None, "a reader waits"
        trio.lowlevel.reschedule(self._reader)
        self._reader = None


class Call:
    """One gRPC call as its handler sees it: a method, metadata, a deadline, and messages.

    The handler returns normally for OK, or raises :class:`~trio_infer.errors.InferError` for any
    other status. Its deadline is already enforced by the cancel scope the handler runs in.
    """

    __slots__ = (
        "_announced",
        "_connection",
        "_headers_sent",
        "_inbound",
        "_message_half_sent",
        "_on_sent",
        "_reset",
        "_stream_id",
        "bytes_in",
        "bytes_out",
        "connection_id",
        "deadline",
        "idle",
        "initial_metadata",
        "metadata",
        "method",
        "request_id",
        "started",
        "subject",
        "trailing_metadata",
    )

    def __init__(
        self,
        connection: Connection,
        stream_id: int,
        method: str,
        metadata: Metadata,
        deadline: float,
        request_id: str = "",
        started: float | None = None,
    ) -> None:
        self.method = method
        """The gRPC method path, e.g. ``/inference.GRPCInferenceService/ModelInfer``."""
        self.metadata = metadata
        """Request metadata: ``(name, value)`` pairs, lower-case names, ``bytes`` for ``-bin``."""
        self.deadline = deadline
        """The client's deadline on the Trio clock (``math.inf`` when it set none)."""
        self.connection_id: int = connection.connection_id
        """The connection the call came on: unique among the process's connections."""
        self.initial_metadata: Metadata = ()
        """Sent with the response headers; set it before the first :meth:`send_message`."""
        self.trailing_metadata: Metadata = ()
        """Sent with the status that ends the call."""
        self.request_id = request_id
        """The call's id (:func:`~trio_infer.transport.access_log.request_id`): echoed in the
        response's ``x-request-id`` and logged; ``""``: none."""
        self.subject = ""
        """What the call is for, as the handler names it (a model), for the access log."""
        self.started = trio.current_time() if started is None else started
        """When the call started (the Trio clock; ``started``, read by the caller, if given)."""
        self.bytes_in = 0
        """Bytes of request messages received whole."""
        self.bytes_out = 0
        """Bytes of response messages queued to send."""
        self._connection = connection
        self._stream_id = stream_id
        # What the client sent, in order: a message's announced length, then the message. The
        # count is unbounded, the bytes are not: the client can send no more than its stream
        # window ahead of what the handler has admitted.
        self._inbound = _InboundQueue()
        self._announced: int | None = None
        self._headers_sent = False
        self._message_half_sent = False
        #: Called once what the call queued has been written (see :meth:`release_when_sent`).
        self._on_sent: Callable[[], None] | None = None
        #: The client reset the stream (or the connection is gone): it wants no answer.
        self._reset = False
        self.idle = False
        """Set by a handler while nothing of its call is under way but the wait for the next
        request message (a stream with no message in flight): the connection's reader does
        not hold that message back for a pass of the scheduler, which the call has no use
        for (see :meth:`Connection._calls_at_work`)."""

    async def receive_message_length(self) -> int | None:
        """Wait for the prefix of the next request message and return the message's length,
        before its body is read; ``None`` once the client has sent its last message.

        Until :meth:`receive_message` admits it, the client can send no more of the message
        than its 128 KiB stream window: a handler that cannot take it yet holds nothing.

        Raises:
            InferError: the message cannot be taken (too large: RESOURCE_EXHAUSTED).
        """
        if self._announced is None:
            item = await self._next_item()
            if item is None:
                return None
            assert isinstance(item, int), "a message is always announced first"
            self._announced = item
        return self._announced

    async def receive_sole_message_length(self) -> int | None:
        """:meth:`receive_message_length` of a call's one request message (a unary call's, a
        health Watch's), whose client has nothing to wait for before sending it: its prefix
        must come within ``receive_timeout`` of the call's start, so that a call that never
        sends it holds its stream, and its share of the connection's streams, no longer than
        an admitted message that never comes holds its reservation.

        Raises:
            InferError: The prefix did not come in time (DEADLINE_EXCEEDED); as
                :meth:`receive_message_length`.
        """
        limit = self._connection.protocol.limits.receive_timeout
        with trio.move_on_at(self.started + limit):
            return await self.receive_message_length()
        raise InferError(
            f"the call's request message did not begin within {limit:g} s of the call",
            StatusCode.DEADLINE_EXCEEDED,
        )

    def receive_message_length_nowait(self) -> int | None:
        """The length of the next request message, as :meth:`receive_message_length` returns
        it, when that needs no wait: the message is announced already, or the client sent it
        whole as its one message and ended its request (a unary call's usual request). None
        otherwise, with nothing taken: :meth:`receive_message_length` waits for it.

        Not a checkpoint: the caller checks for cancellation first, as
        :meth:`receive_message_length` does before it takes a message's prefix.
        """
        if self._announced is None:
            inbound = self._inbound
            length = inbound.one_message()
            if length is None:
                return None
            inbound.get_nowait()  # the prefix whose length one_message read
            self._announced = length
        return self._announced

    async def receive_message(self) -> Buffer | None:
        """Admit the next request message and wait for all of it; ``None`` once the client
        has sent its last one.

        Raises:
            InferError: the message cannot be taken (too large: RESOURCE_EXHAUSTED).
        """
        # Usually announced already (the handler reserved room for it): no coroutine then.
        length = self._announced
        if length is None:
            length = await self.receive_message_length()
            if length is None:
                return None
        if self._connection.protocol.admit(self._stream_id, length):
            self._connection.flush()
        try:
            # A unary request usually came whole with its prefix: no scope to enter then.
            item: _Inbound | None = self._inbound.get_nowait()
        except (trio.WouldBlock, trio.EndOfChannel):
            limit = self._connection.protocol.limits.receive_timeout
            item = None
            with trio.move_on_after(limit) as waiting:
                item = await self._next_item()
            if waiting.cancelled_caught:
                raise InferError(
                    f"the request message of {length} bytes did not arrive within {limit:g} s "
                    "of its admission",
                    StatusCode.DEADLINE_EXCEEDED,
                ) from None
        else:
            await trio.lowlevel.checkpoint_if_cancelled()
            if isinstance(item, InferError):
                raise item
        if item is None:
            raise InferError(
                "the client ended the call in the middle of a message", StatusCode.INVALID_ARGUMENT
            )
        assert isinstance(item, bytes | bytearray | memoryview), (
            "an announced message is followed by it"
        )
        self._announced = None
        self.bytes_in += length
        return item

    def receive_message_nowait(self) -> Buffer:
        """Take the request message an :data:`Immediate` handler answers, without waiting: it
        has arrived whole (and is counted in :attr:`bytes_in`, as :meth:`receive_message`
        counts it)."""
        length = self._announced
        assert length is not None, "an immediate call's message is announced before it runs"
        item = self._inbound.get_nowait()
        assert isinstance(item, bytes | bytearray | memoryview), (
            "an immediate call's message is all there"
        )
        self._announced = None
        self.bytes_in += length
        return item

    def another_message_nowait(self) -> bool:
        """Whether the client has already announced a request message after the one received,
        without waiting (a unary call that has one is malformed).

        Raises:
            InferError: what the next message's arrival failed with, if it did.
        """
        if self._announced is not None:
            return True
        try:
            item = self._inbound.get_nowait()
        except (trio.WouldBlock, trio.EndOfChannel):
            return False
        if isinstance(item, InferError):
            raise item
        assert isinstance(item, int), "a message is always announced first"
        self._announced = item
        return True

    async def _next_item(self) -> int | Buffer | None:
        # A unary call's request usually arrives whole in the read that starts the call: taken
        # at once, it costs no pass of the scheduler (a checkpoint is one). A call cancelled
        # before it ran must still stop here, before the handler admits or queues it.
        await trio.lowlevel.checkpoint_if_cancelled()
        inbound = self._inbound
        try:
            try:
                item = inbound.get_nowait()  # no coroutine to wait in when it is there
            except trio.WouldBlock:
                item = await inbound.get()
        except trio.EndOfChannel:
            return None
        if isinstance(item, InferError):
            raise item
        return item

    def release_when_sent(self, release: Callable[[], None]) -> None:
        """Have ``release`` called once everything this call queued to send, its status
        included, has been written to the socket, or the connection is gone; not when the
        handler returns. Large response parts are written from the handler's memory, so what
        holds that memory is given back only when the bytes have left. One per call.
        """
        assert self._on_sent is None, "one release per call"
        self._on_sent = release

    def release_when_written(self, release: Callable[[], None]) -> None:
        """Have ``release`` called once everything queued on the connection so far (this
        call's messages included) has been written to the socket, or the connection is gone:
        for what one message of a stream holds, while the call goes on."""
        self._connection._release_when_written(release)

    async def send_message(
        self, message: Buffer | Sequence[Buffer], *, last: bool = False, alone: bool = False
    ) -> None:
        """Send one response message, waiting for the client's flow-control window as needed.

        The message may come in parts, sent back to back as one message. Parts of 64 KiB or
        more are sent from their own memory, which passes to the connection: it is written to
        the socket later, possibly after the call has ended, and must never change.

        With ``last``, the handler says it returns right after: what is left of the message
        then leaves with the call's status, in one write, rather than waking the writer for
        itself first (as gRPC's unary calls send the message and the status in one batch).

        With ``alone``, the handler says it has nothing else to send soon (a stream's only
        message in flight): on a connection with no other call, the message is written at
        once, a scheduling tick before the writer would send it (as a unary call's answer is).
        """
        connection = self._connection
        protocol = connection.protocol
        if self._reset:
            # A reset processed in the tick the handler's result arrived, before it could see
            # its cancellation: nobody is listening, and the stream is closed.
            raise InferError("the client cancelled the call", StatusCode.CANCELLED)
        if not self._headers_sent:
            protocol.start_response(self._stream_id, self.initial_metadata, self.request_id)
            self._headers_sent = True
        pending = _data_frames(message)
        self.bytes_out += _size(pending)
        send_timeout = protocol.limits.send_timeout
        # When the client last let the message progress: read at the first stall after it
        # (a few microseconds late at most), not after every chunk sent.
        progress: float | None = None
        max_unsent = protocol.limits.max_unsent_bytes
        while pending:
            # Room left before max_unsent_bytes (negative past it): a call queues no more
            # response data than this. unsent_bytes() written out: this runs for every chunk.
            room = max_unsent - connection._taken - protocol.pending_bytes()
            window = protocol.send_window(self._stream_id)
            if room < window:  # not min(): a builtin call parsing its arguments, every chunk
                window = room
            if window <= 0:
                if progress is None:
                    progress = trio.current_time()
                connection.flush()
                # A client that stops reading must not hold its call (and what the call has
                # reserved) for ever, deadline or not.
                with trio.move_on_at(progress + send_timeout) as waiting:
                    if room <= 0:
                        await connection.wait_written()
                    else:
                        await connection.wait_window_update()
                if waiting.cancelled_caught:
                    raise InferError(
                        f"the client read none of its response for {send_timeout:g} s",
                        StatusCode.CANCELLED,
                    )
                if room <= 0:
                    progress = trio.current_time()  # the client read some of what was queued
                continue
            chunk = pending.pop()
            if len(chunk) > window:
                pending.append(chunk[window:])
                chunk = chunk[:window]
            protocol.send_data(self._stream_id, chunk)
            # Only once some of it is sent: a call that ends before then can still have its
            # status follow the messages before, which trailers after part of one would corrupt.
            self._message_half_sent = True
            progress = None
        self._message_half_sent = False
        if not last and not (alone and connection.write_alone()):
            connection.flush()


def _data_frames(message: Buffer | Sequence[Buffer]) -> list[memoryview]:
    """A message with its gRPC prefix, as the payloads of its DATA frames, last one first.

    Parts too small to be worth a frame of their own are joined (with the prefix); larger ones
    are views of the caller's memory. So a response with one raw output is two frames: the
    prefix, the protobuf fields and the output's field key, then the output. A payload larger
    than the client's window or frame size is cut when it is sent.
    """
    whole = message
    if type(message) is list and len(message) == 1:
        whole = message[0]  # an answer its encoder joined in one buffer
    if type(whole) is bytes and len(whole) < BY_REFERENCE_BYTES:  # a small serialised one
        return [memoryview(_MESSAGE_PREFIX.pack(False, len(whole)) + whole)]
    parts = [message] if isinstance(message, bytes | bytearray | memoryview) else message
    views = [memoryview(part).cast("B") for part in parts]
    frames: list[memoryview] = []
    joined = bytearray(_MESSAGE_PREFIX.pack(False, _size(views)))
    for view in views:
        if len(view) < BY_REFERENCE_BYTES:
            joined += view
            continue
        if joined:
            frames.append(memoryview(joined))
            joined = bytearray()
        frames.append(view)
    if joined:
        frames.append(memoryview(joined))
    frames.reverse()
    return frames


def _sender(response: Buffer) -> Handler:
    """A call's handler that sends ``response``, made already, as its one message."""

    async def send(call: Call) -> None:
        await call.send_message(response, last=True)

    return send


def _size(buffers: Sequence[Buffer]) -> int:
    # A loop, not sum() over a generator: a call's path sizes a few short lists.
    size = 0
    for part in buffers:
        size += memoryview(part).nbytes
    return size


@dataclass(slots=True)
class _CallState:
    """The transport's private record of a call in flight."""

    call: Call
    #: The scope the call runs in, its runner's; None until a runner takes the call.
    scope: trio.CancelScope | None = None
    #: Cancelled before a runner took it: the scope it runs in is cancelled at once.
    cancelled: bool = False
    #: The status to send if ``scope`` is cancelled; a passed deadline is the default.
    cancel_status: StatusCode = StatusCode.DEADLINE_EXCEEDED
    cancel_message: str = "deadline exceeded"

    def cancel(self, status: StatusCode, message: str) -> None:
        self.cancel_status = status
        self.cancel_message = message
        if self.scope is None:
            self.cancelled = True
        else:
            self.scope.cancel()


class Connection:
    """One client connection: its protocol state, its socket, and the calls it carries.

    The stream is a plain socket, read and written on its descriptor (no copy, no pass of the
    scheduler more than needed), or TLS over one, read and written through Trio's SSLStream.
    """

    def __init__(
        self,
        stream: trio.SocketStream | trio.SSLStream[trio.SocketStream],
        handler: Handler,
        limits: ProtocolLimits,
        calls_in_flight: CallCounter,
        access_log: bool = False,
        immediate: Mapping[str, Immediate] = _NO_IMMEDIATE,
    ) -> None:
        self.connection_id = next(_connection_ids)
        """Unique among the process's connections, never reused."""
        self.protocol = ServerProtocol(limits)
        self._stream = stream
        #: The stream's socket; None for TLS, whose bytes go through the SSLStream.
        self._plain: trio.socket.SocketType | None = None
        #: The plain socket's descriptor (-1 for TLS), read once: Trio's ``fileno()`` is a
        #: Python call, and the reader and writers use it on every read and write. The socket
        #: is closed only at the end of :meth:`run`, after its nursery (every task that reads
        #: or writes it) and the GOAWAY it may send then, so the number never names another
        #: socket while it is used.
        self._fd = -1
        if isinstance(stream, trio.SocketStream):
            self._plain = stream.socket
            self._socket = stream.socket
            self._fd = stream.socket.fileno()
        else:
            self._socket = stream.transport_stream.socket
        #: The run's clock, read directly: ``trio.current_time()`` is three Python calls to the
        #: same ``current_time`` of it, and a call reads the clock two or three times.
        self._clock = trio.lowlevel.current_clock()
        #: The writer is in a write: nothing else may write until it is done.
        self._writing = False
        self._handler = handler
        self._immediate = immediate
        self._access_log = access_log
        self._calls: dict[int, _CallState] = {}
        #: Calls of methods answered at once, from their HEADERS to the end of the events of
        #: the same read (:meth:`_answer_held`), in the order they came; never in ``_calls``
        #: meanwhile. Nothing can reset or cancel one in that time: a reset among the same
        #: events starts no call, and no other task runs while the reader handles them.
        self._held: dict[int, Call] = {}
        self._calls_in_flight = calls_in_flight
        self._flush_needed = trio.Event()
        self._window_updated = trio.Event()
        #: Set when the writer has written something; made anew by whoever waits.
        self._written_some = trio.Event()
        #: Bytes written to the socket since the connection opened.
        self._written = 0
        #: Bytes the writer has taken from the protocol and not written yet.
        self._taken = 0
        # Invariant: marks are non-decreasing, and a release is called once the connection has
        # written as many bytes as its mark, or when the connection ends.
        self._releases: collections.deque[tuple[int, Callable[[], None]]] = collections.deque()
        #: Why new calls are refused (None while they are accepted).
        self._refusing: str | None = None
        self._goaway_sent = False
        self._closing = False
        #: Streams the client reset in the frames being dispatched: calls among them are not
        #: started, refused ones are already closed and get no status.
        self._reset_in_read: AbstractSet[int] = _NO_RESETS
        #: The peer broke HTTP/2: a GOAWAY is queued to send before the socket closes.
        self._goodbye_pending = False
        self._nursery: trio.Nursery | None = None
        #: Runners waiting for a call (:meth:`_runner`), each with its scope, the last to wait
        #: last.
        self._idle_runners: list[tuple[trio.lowlevel.Task, trio.CancelScope]] = []
        #: Since when the connection has carried no call (Trio clock): what the watchdog reads.
        self._idle_since = trio.current_time()
        #: Set once the client's preface and first SETTINGS have arrived.
        self._handshake = trio.Event()
        #: Set when the last call in flight ends, for a reader waiting on a half-closed socket.
        self._no_calls: trio.Event | None = None
        #: When the connection reaches its maximum age (Trio clock; inf: never).
        self._retire_at = retirement_time(trio.current_time(), limits.max_connection_age)
        #: The protocol's events, by type, to what the connection does with them.
        self._handlers: dict[type, Callable[[Any], None]] = {
            RequestReceived: self._start_call,
            MessageAnnounced: self._message_announced,
            MessageReceived: self._message_received,
            RequestEnded: self._request_ended,
            WholeRequest: self._whole_request,
            MessageRefused: self._message_refused,
            StreamReset: self._stream_reset,
            CallRejected: self._call_rejected,
            ConnectionTerminated: self._connection_terminated,
        }

    def flush(self) -> None:
        """Ask the writer to send whatever the protocol has queued."""
        self._flush_needed.set()

    async def wait_window_update(self) -> None:
        """Wait until the client opens some flow-control window."""
        if self._window_updated.is_set():
            # Set by an update that came before this wait: made anew here, not on every update
            # (a gRPC client sends one with nearly every call, and few calls ever wait).
            self._window_updated = trio.Event()
        await self._window_updated.wait()

    def unsent_bytes(self) -> int:
        """Bytes queued for the client and not yet written to the socket."""
        return self._taken + self.protocol.pending_bytes()

    async def wait_written(self) -> None:
        """Wait until the writer has written something to the socket."""
        if self._written_some.is_set():
            self._written_some = trio.Event()
        self.flush()
        await self._written_some.wait()

    async def run(self) -> None:
        """Serve the connection until the client closes it or the caller cancels."""
        self.protocol.initiate_connection()
        self.flush()
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._writer)
                nursery.start_soon(self._watchdog)
                if self._retire_at < math.inf:
                    nursery.start_soon(self._retire)
                try:
                    await self._reader()
                finally:
                    # Calls still running have nobody to answer to: their client is gone.
                    for state in self._calls.values():
                        state.call._reset = True
                        state.call._inbound.close()
                    if self._goodbye_pending and self._writing and self._plain is None:
                        # A TLS write cut off mid-way breaks the stream, and the GOAWAY
                        # would be lost with it: the write under way ends first (briefly).
                        await self._finish_write()
                    nursery.cancel_scope.cancel()
        finally:
            try:
                try:
                    if self._goodbye_pending:
                        await self._send_goodbye()
                    # A connection that sent GOAWAY lingers: its client may still be sending, and a
                    # reset could cost it the GOAWAY.
                    await end_connection(
                        self._stream, lingering=self._closing or self._goodbye_pending
                    )
                finally:
                    # Closed however the above ends (a shutdown's deadline can cut a linger).
                    await trio.aclose_forcefully(self._stream)
            finally:
                # Nothing more will be written: what waited for its bytes to leave is free.
                while self._releases:
                    self._releases.popleft()[1]()

    async def _finish_write(self) -> None:
        """Wait (shielded, for as long as :meth:`_send_goodbye` may take) until the writer is
        not in a write."""
        with trio.move_on_after(_GOODBYE_TIME) as scope:
            scope.shield = True
            while self._writing:
                await self.wait_written()

    async def _send_goodbye(self) -> None:
        # The writer is gone (it may have been cut off mid-write), so this is best effort: the
        # GOAWAY tells a well-behaved client why, and a broken one gets a closed socket anyway.
        with trio.move_on_after(_GOODBYE_TIME) as scope:
            scope.shield = True
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                await self._send(self.protocol.data_to_send())

    def drain(self, reason: str = "server is shutting down") -> None:
        """Refuse new calls (GOAWAY) and let the calls in flight finish."""
        if not self._goaway_sent:
            self._goaway_sent = True
            self._refusing = reason
            self.protocol.go_away()
            self.flush()

    async def _watchdog(self) -> None:
        """Close a connection its client leaves idle: no preface and first SETTINGS within the
        handshake timeout (cut off), or no call in flight for the idle timeout (GOAWAY, then
        closed). Frames that start no call (PINGs, SETTINGS...) do not keep it open."""
        limits = self.protocol.limits
        with trio.move_on_after(limits.handshake_timeout):
            await self._handshake.wait()
        if not self._handshake.is_set():
            logger.debug("closing a connection that sent no preface in time")
            assert self._nursery is not None
            self._nursery.cancel_scope.cancel()
            return
        while True:
            quiet_until = self._idle_since + limits.idle_timeout
            if trio.current_time() >= quiet_until and not self._calls:
                break
            # Busy, or busy since: look again when it could next be idle long enough.
            await trio.sleep_until(max(quiet_until, trio.current_time() + limits.idle_timeout / 4))
        logger.debug("closing a connection idle for %g s", limits.idle_timeout)
        self.drain("connection idle")
        self.close()

    async def _retire(self) -> None:
        """At the connection's maximum age: GOAWAY (as a drain sends it), so that its client
        opens a new connection, which may reach another replica; the calls in flight finish,
        for up to the grace if there is one, the rest then end with UNAVAILABLE; the connection
        closes once they have ended."""
        await trio.sleep_until(self._retire_at)
        logger.debug("retiring a connection at its maximum age")
        self.drain("connection reached its maximum age")
        self.close()
        grace = self.protocol.limits.max_connection_age_grace
        if grace is None:
            return
        await trio.sleep(grace)
        self.cancel_calls(
            StatusCode.UNAVAILABLE,
            "the connection reached its maximum age and the call outlived its grace period",
        )

    def cancel_calls(self, status: StatusCode, message: str) -> None:
        """End every call in flight with ``status`` (e.g. UNAVAILABLE at the end of a drain)."""
        for state in self._calls.values():
            state.cancel(status, message)

    def close(self) -> None:
        """Close the connection once its calls have ended and their statuses are sent."""
        self._closing = True
        self.flush()

    async def _writer(self) -> None:
        assert self._nursery is not None
        while True:
            await self._flush_needed.wait()
            self._flush_needed = trio.Event()
            data = self.protocol.data_to_send()
            if data:
                # Everything queued since the last send goes out in one write: many small
                # frames from many calls cost one syscall per scheduling tick, not per frame.
                self._writing = True
                try:
                    await self._send(data)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    # The client is gone, or read nothing for the send timeout: its calls have
                    # nobody to answer to.
                    self._nursery.cancel_scope.cancel()
                    return
                finally:
                    self._writing = False
            # A call that ended during the write queued its status and asked for a flush: send
            # that before closing, or its status is lost with the connection.
            if self._closing and not self._calls and not self._flush_needed.is_set():
                self._nursery.cancel_scope.cancel()

    async def _send(self, data: list[Buffer]) -> None:
        """Write buffers in order; give up (BrokenResourceError) when the socket takes none of
        them for the send timeout: a client that reads nothing holds no connection for ever."""
        self._taken = _size(data)
        limit = self.protocol.limits.send_timeout
        try:
            if self._plain is not None:
                # What the socket takes at once needs no timeout: one vectored write first.
                try:
                    rest = write_some(self._fd, data)
                except BlockingIOError:
                    rest = data
                self._wrote(self._taken - _size(rest))
                data = rest
            while data:
                with trio.move_on_after(limit):
                    if self._plain is not None:
                        # As few sendmsg calls as the socket takes the buffers in.
                        sent = await self._plain.sendmsg(data[:MAX_BUFFERS])
                        data = unsent(data, sent)
                    else:
                        # Encrypted, every byte is copied anyway: one piece at a time, so that
                        # the timeout measures the client's progress.
                        piece = first_bytes(data, _TLS_WRITE_SIZE)
                        await self._stream.send_all(piece)
                        sent = len(piece)
                        data = unsent(data, sent)
                    self._wrote(sent)
                    continue
                raise trio.BrokenResourceError(f"the client read nothing for {limit:g} s")
        except OSError as exc:
            # As SocketStream.send_all reports them.
            if exc.errno in (errno.EBADF, errno.ENOTSOCK):
                raise trio.ClosedResourceError("this socket was already closed") from None
            raise trio.BrokenResourceError(f"socket connection broken: {exc}") from exc
        finally:
            self._taken = 0

    def _wrote(self, nbytes: int) -> None:
        """Account for ``nbytes`` written: wake who waits for room, release what has left."""
        if not nbytes:
            return
        self._written += nbytes
        self._taken = max(self._taken - nbytes, 0)
        self._written_some.set()
        releases = self._releases
        while releases and releases[0][0] <= self._written:
            releases.popleft()[1]()

    def _release_when_written(self, release: Callable[[], None]) -> None:
        """Call ``release`` once what is queued now has been written."""
        unsent = self._taken + self.protocol.pending_bytes()  # unsent_bytes(), on every call's path
        if not unsent:
            release()
        else:
            self._releases.append((self._written + unsent, release))

    async def _reader(self) -> None:
        drained = False
        protocol = self.protocol
        handlers = self._handlers
        max_unsent = protocol.limits.max_unsent_bytes
        handshaken = False
        while True:
            # More queued for the client than max_unsent_bytes? (unsent_bytes() written out:
            # this runs for every read.)
            if self._taken + protocol.pending_bytes() > max_unsent:
                # The client is not reading what it asked for: handle no more of its requests
                # (or PINGs to answer) until it does. The writer's send timeout ends the wait.
                await self.wait_written()
                continue
            if protocol.input_pending:
                # The last read's frames are handled in slices, other work between them.
                await trio.lowlevel.checkpoint()
                data: bytes | bytearray = b""
            else:
                try:
                    data = await self._read(drained)
                except BlockingIOError:
                    drained = True  # woken without data after all
                    continue
                except (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
                    return  # the connection is broken, or closed under us
                if not data:
                    await self._wait_after_end_of_input()
                    return
                drained = len(data) < _READ_SIZE
            try:
                events = protocol.receive_data(data)
            except ProtocolViolation as exc:
                logger.warning("closing connection: %s", exc)
                self._goodbye_pending = True
                return
            if not handshaken and protocol.handshake_done:
                handshaken = True
                self._handshake.set()
            self._reset_in_read = protocol.resets
            for event in events:
                handler = handlers.get(type(event))
                if handler is not None:  # others (a PING's ACK, SETTINGS' ACK) need nothing
                    handler(event)
            if self._held:
                self._answer_held()
            if protocol.take_window_opened():
                self._window_updated.set()
            if protocol.has_data_to_send():
                self.flush()
            pause = protocol.take_read_pause()
            if pause:
                # The client cancels calls faster than the bound on resets: what it sent is
                # handled, what it sends next is read no sooner than the bound allows.
                await trio.sleep(pause)

    async def _read(self, drained: bool) -> bytes | bytearray:
        """The next bytes from the client; ``b""`` at the end of its input.

        Raises:
            BlockingIOError: woken without data after all (plain sockets).
        """
        if self._plain is None:
            return await self._stream.receive_some(_READ_SIZE)
        if drained:
            # The last read emptied the socket: a read now would fail (an exception and a
            # system call, on every request's path), so wait for more first.
            await trio.lowlevel.wait_readable(self._fd)
        if not drained or self._calls_at_work():
            # Reading in a loop must let other tasks run (after a wait, they have); and while
            # calls are at work, a pass of the scheduler lets them run and more requests
            # gather, to be read and answered together.
            await trio.lowlevel.checkpoint()
        # Read on the descriptor (Trio keeps it non-blocking) rather than with Trio's recv,
        # which always yields after reading: on an idle connection that would put a pass of
        # the scheduler between the wait that said data was there and the read.
        return os.read(self._fd, _READ_SIZE)

    def _calls_at_work(self) -> bool:
        """Whether a call in flight may have work to run: all but those whose handler says the
        call is :attr:`Call.idle` and waits for its next request message. The pass of the
        scheduler before a read is spent for those only: an idle call has nothing to run, and
        the pass would only hold its next message back. A stream with messages in flight is
        at work (its answers and the requests that gather meanwhile go out and come in
        together)."""
        # A loop, not any() over a generator: on the path of every read.
        for state in self._calls.values():
            call = state.call
            if not call.idle or not call._inbound.waiting:
                return True
        return False

    async def _wait_after_end_of_input(self) -> None:
        """The client sent its last byte: answer the calls in flight and write what is queued,
        unless the client is gone.

        A TCP half-close (shutdown of the client's sending side) still reads answers; a closed
        socket looks the same until something is sent to it, which its host answers with a
        reset. So PINGs go out, more rarely as time passes, and the socket's error is looked at
        after each, until the calls have ended and their answers are written, or the reset has
        come. No request data can come any more: calls still waiting for some end at once.
        """
        for state in self._calls.values():
            state.call._inbound.close()
        pause = 0.005
        while self._calls or self.unsent_bytes():
            with trio.move_on_after(pause):
                if self._calls:
                    self.protocol.ping()
                    self.flush()
                    self._no_calls = trio.Event()
                    await self._no_calls.wait()
                else:
                    # A client that reads none of it is dropped by the writer's send timeout.
                    await self.wait_written()
            if self._socket.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                return  # reset: the client is gone
            pause = min(pause * 2, 1.0)

    # A stream's events go to its call in a task, or to its call held to be answered at once.

    def _message_announced(self, event: MessageAnnounced) -> None:
        state = self._calls.get(event.stream_id)
        call = state.call if state is not None else self._held.get(event.stream_id)
        if call is not None:
            call._inbound.put(event.length)

    def _message_received(self, event: MessageReceived) -> None:
        state = self._calls.get(event.stream_id)
        call = state.call if state is not None else self._held.get(event.stream_id)
        if call is not None:
            call._inbound.put(event.data)

    def _request_ended(self, event: RequestEnded) -> None:
        state = self._calls.get(event.stream_id)
        call = state.call if state is not None else self._held.get(event.stream_id)
        if call is not None:
            call._inbound.close()

    def _whole_request(self, event: WholeRequest) -> None:
        state = self._calls.get(event.stream_id)
        call = state.call if state is not None else self._held.get(event.stream_id)
        if call is not None:
            call._inbound.put_last(event.length, event.data)

    def _message_refused(self, event: MessageRefused) -> None:
        state = self._calls.get(event.stream_id)
        call = state.call if state is not None else self._held.get(event.stream_id)
        if call is not None:
            call._inbound.put(InferError(event.message, event.status))
            call._inbound.close()

    def _stream_reset(self, event: StreamReset) -> None:
        state = self._calls.get(event.stream_id)
        if state is not None:
            state.call._reset = True
            # What the client's library reports (gRPC's mapping of RST_STREAM codes): a
            # cancel of its own, or INTERNAL for the PROTOCOL_ERROR a malformed request gets.
            if event.by_client:
                state.cancel(StatusCode.CANCELLED, "the client cancelled the call")
            else:
                state.cancel(StatusCode.INTERNAL, "the request was malformed: its stream was reset")

    def _call_rejected(self, event: CallRejected) -> None:
        self._refuse(event.stream_id, event.status, event.message, event.fields)

    def _connection_terminated(self, event: ConnectionTerminated) -> None:
        # The client said it starts no new calls; one that does anyway gets an answer.
        self._refusing = self._refusing or "the client sent GOAWAY on this connection"

    def _start_call(self, event: RequestReceived) -> None:
        stream_id: int = event.stream_id
        if stream_id in self._reset_in_read:
            # Opened and reset in the frames handled together (a cancel right after the call,
            # or a rapid-reset flood): nobody waits for an answer, so no task is started.
            return
        if self._refusing is not None:
            self._refuse(stream_id, StatusCode.UNAVAILABLE, self._refusing)
            return
        now = self._clock.current_time()
        deadline = math.inf
        if event.timeout is not None:
            deadline = now + event.timeout
        metadata = tuple(event.custom_metadata)
        sent = None
        for name, value in metadata:
            if name == REQUEST_ID_HEADER:
                sent = value
                break
        call = Call(
            self,
            stream_id,
            f"/{event.service_name}/{event.method_name}",
            metadata,
            deadline,
            new_request_id() if sent is None else request_id(sent),
            now,
        )
        self._calls_in_flight.started += 1
        if call.method in self._immediate:
            # Answered once the events of this read are handled, if its request is in by then.
            self._held[stream_id] = call
        else:
            self._start_task(call, self._handler)

    def _start_task(self, call: Call, handler: Handler) -> None:
        """Run ``call`` in a task of the connection's nursery, under its deadline: an idle
        runner's, or a new runner's."""
        state = _CallState(call)
        self._calls[call._stream_id] = state
        self._calls_in_flight.increment()
        self._calls_in_flight.in_tasks += 1
        if self._idle_runners:
            task, scope = self._idle_runners.pop()
            trio.lowlevel.reschedule(task, outcome.Value((state, handler)))
            # Put in the runner's scope now, before the scheduler's next pass: the deadline of
            # the runner's call before, kept while it waited, can then no longer cancel it. The
            # runner no longer waits, so a cancel of its scope now (a deadline passed already,
            # a call cancelled before it started) reaches it at its next checkpoint, in the call.
            self._enter(state, scope)
            return
        assert self._nursery is not None
        self._nursery.start_soon(self._runner, state, handler)

    async def _runner(self, state: _CallState, handler: Handler) -> None:
        """Run ``state``'s call, then each call :meth:`_start_task` hands this task while it
        waits idle; end when :data:`_MAX_IDLE_RUNNERS` others wait already. The calls run in
        one scope until one of them has it cancelled, then in a new one."""
        task = trio.lowlevel.current_task()
        idle = self._idle_runners
        waiting: tuple[trio.lowlevel.Task, trio.CancelScope]

        def abort(raise_cancel: trio.lowlevel.RaiseCancelT) -> trio.lowlevel.Abort:
            # Cancelled while idle (the connection is ending, or the deadline of the call before
            # passed): no call may be handed to it.
            idle.remove(waiting)
            return trio.lowlevel.Abort.SUCCEEDED

        # The call this task runs and its handler; None while it waits idle, for an idle
        # runner holds nothing of the call it ran (its request, its answer).
        job: tuple[_CallState, Handler] | None = (state, handler)
        del state, handler
        while True:
            scope = trio.CancelScope()
            try:
                with scope:
                    if job is not None:  # the call the task was started for
                        self._enter(job[0], scope)
                    while True:
                        if job is None:
                            if len(idle) >= _MAX_IDLE_RUNNERS:
                                return
                            waiting = (task, scope)
                            idle.append(waiting)
                            # _start_task puts the call it hands here in this scope.
                            job = await trio.lowlevel.wait_task_rescheduled(abort)
                        status, message = await self._run_handler(job[0].call, job[1])
                        done, job = job[0], None
                        self._finish(done, status, message)
                        del done
                        if scope.cancel_called:
                            break  # after the call's last checkpoint: the scope is spent
            except BaseException:
                # Cancelled with its connection, or the handler let more than an Exception
                # out: the call is cleaned up, and has nobody to answer to.
                if job is not None:
                    self._release(job[0])
                raise
            if job is not None:
                # Its scope caught the cancel: a passed deadline, or whoever cancelled it.
                done, job = job[0], None
                self._finish(done, done.cancel_status, done.cancel_message)
                del done

    def _answer_held(self) -> None:
        """Answer the calls held since their HEADERS among the events just handled: each one
        whose whole request is in, and whose deadline has not passed, at once, when its answer
        fits the client's windows now; the others in a task, as any call (one whose answer was
        made and does not fit, a task that sends it)."""
        held = self._held
        self._held = {}
        protocol = self.protocol
        max_unsent = protocol.limits.max_unsent_bytes
        answered = False
        for stream_id, call in held.items():
            length = call._inbound.one_message()
            # The clock read for each call that has a deadline, as a task reads it entering its
            # deadline's scope: the answers before it took time.
            if length is None or (
                call.deadline < math.inf and call.deadline <= self._clock.current_time()
            ):
                # Its request is not all in (its task reads what has come and waits for the
                # rest), or its deadline has already passed (its task ends it at its first
                # checkpoint, DEADLINE_EXCEEDED).
                self._start_task(call, self._handler)
                continue
            call._inbound.get_nowait()  # its announced length: taken as the call's
            call._announced = length
            status, message = _OK, ""
            ended = False
            try:
                response = self._immediate[call.method](call, length)
                if response is None:
                    self._start_task(call, self._handler)  # it would wait: as any call
                    continue
                room = max_unsent - self._taken - protocol.pending_bytes()
                if (
                    type(response) is bytes
                    and not call.initial_metadata
                    and not call.trailing_metadata
                    and len(response) + _MESSAGE_PREFIX.size <= room
                    and protocol.answer(stream_id, response, call.request_id)
                ):
                    # Headers, message and OK trailers queued together: the call has ended.
                    call._headers_sent = True
                    call.bytes_out += len(response) + _MESSAGE_PREFIX.size
                    ended = True
                else:
                    frames = _data_frames(response)
                    size = _size(frames)
                    if size > protocol.send_window(stream_id) or size > room:
                        self._start_task(call, _sender(response))
                        continue
                    protocol.start_response(stream_id, call.initial_metadata, call.request_id)
                    call._headers_sent = True
                    while frames:
                        protocol.send_data(stream_id, frames.pop())
                    call.bytes_out += size
            except InferError as exc:
                status, message = exc.code, exc.message
            except Exception:
                logger.exception("unexpected error in %s", call.method)
                status, message = StatusCode.INTERNAL, "internal server error"
            if not ended:
                self._end(call, status, message)
            if self._access_log:
                self._log(call, status)
            if call._on_sent is not None:
                self._release_when_written(call._on_sent)
            answered = True
        if not answered:
            return
        if not self._calls:
            self._idle_since = self._clock.current_time()
        if not self.write_alone() or self._closing:
            self.flush()

    def _refuse(
        self,
        stream_id: int,
        status: StatusCode,
        message: str,
        fields: Sequence[tuple[str, str]] = (),
    ) -> None:
        # A client that started a call just before our GOAWAY reached it resets the call when
        # the GOAWAY arrives, often in the same packet: h2 has closed the stream by now, and
        # answering it would raise.
        if stream_id not in self._reset_in_read:
            self.protocol.end_response(
                stream_id, status, message, (), headers_sent=False, fields=fields
            )

    def _enter(self, state: _CallState, scope: trio.CancelScope) -> None:
        """Put ``state``'s call in ``scope`` (a runner's, which runs it next) under the call's
        deadline, which replaces the scope's (the call before's, or none); cancel the scope if
        the deadline has passed or the call was cancelled already."""
        state.scope = scope
        deadline = state.call.deadline
        # Moving a scope's deadline costs a context manager and Trio's deadline bookkeeping:
        # only when it changes.
        if deadline != scope.deadline:
            scope.deadline = deadline
        # As a scope entered with a deadline that has passed: cancelled at once.
        if deadline != math.inf and deadline <= self._clock.current_time():
            scope.cancel()
        if state.cancelled:
            scope.cancel()

    async def _run_handler(self, call: Call, handler: Handler) -> tuple[StatusCode, str]:
        """Run ``call`` (put in the runner's scope already); the status its handler's outcome
        gives. A cancel of the scope goes up as Trio's ``Cancelled``."""
        try:
            await handler(call)
        except InferError as exc:
            return exc.code, exc.message
        except Exception:
            logger.exception("unexpected error in %s", call.method)
            return StatusCode.INTERNAL, "internal server error"
        return _OK, ""

    def _finish(self, state: _CallState, status: StatusCode, message: str) -> None:
        """End ``state``'s call with ``status`` and clean it up."""
        call = state.call
        try:
            self._end(call, status, message)
            if not self.write_alone():
                self.flush()
            if self._access_log:
                self._log(call, status)
        finally:
            self._release(state)

    def _release(self, state: _CallState) -> None:
        """Forget ``state``'s call, which has ended: what it held is released."""
        call = state.call
        del self._calls[call._stream_id]
        self._calls_in_flight.decrement()
        call._inbound.close()
        if call._on_sent is not None:
            self._release_when_written(call._on_sent)
        if not self._calls:
            self._idle_since = self._clock.current_time()
            if self._no_calls is not None:
                self._no_calls.set()
        if self._closing:
            self.flush()

    def _end(self, call: Call, status: StatusCode, message: str) -> None:
        """Queue the status that ends ``call`` (nothing for a call its client reset)."""
        stream_id = call._stream_id
        if call._reset:
            return
        if call._message_half_sent:
            # Trailers after half a message would corrupt the stream; the client's own deadline
            # (or the reset) tells it what happened.
            self.protocol.reset(stream_id)
        else:
            self.protocol.end_response(
                stream_id,
                status,
                message,
                call.trailing_metadata,
                headers_sent=call._headers_sent,
                request_id=call.request_id,
            )

    def _log(self, call: Call, status: StatusCode) -> None:
        """The call's access-log record (the access log is on), if its logger takes it."""
        if ACCESS_LOGGER.isEnabledFor(logging.INFO):
            log_call(
                CallRecord(
                    "grpc",
                    call.method,
                    call.subject,
                    status.name,
                    self._clock.current_time() - call.started,
                    call.bytes_in,
                    call.bytes_out,
                    call.request_id,
                )
            )

    def write_alone(self) -> bool:
        """Write what is queued at once if the connection carries one call and the writer is
        not in a write (a plain socket only); whether all of it went. Otherwise the writer
        must be woken (:meth:`flush`) for what is left."""
        if len(self._calls) > 1 or self._writing or self._plain is None:
            return False
        return self._write_now()

    def _write_now(self) -> bool:
        """Write what is queued at once, without waiting; whether all of it went.

        For a call alone on its connection: its answer leaves a scheduling tick sooner than the
        writer would send it. With several calls in flight, one write per tick for all of them
        costs less, so they leave it to the writer. Never while the writer is in a write: what
        it is sending must go first.
        """
        assert self._plain is not None, "TLS is written by the writer only"
        data = self.protocol.data_to_send()
        if not data:
            return True
        try:
            # On the socket's descriptor, which Trio keeps non-blocking: it never waits.
            rest = write_some(self._fd, data)
        except OSError:
            rest = data  # the buffer is full, or the connection broken: the writer will see
        if rest:
            self.protocol.put_back(rest)
        self._wrote(_size(data) - _size(rest))
        return not rest


@dataclass(frozen=True)
class TransportStatistics:
    """A snapshot of the gRPC connections.

    Attributes:
        connections: Connections open now.
        calls: Calls in flight on them.
        calls_started: Calls started since the server started (a stream opened and reset in
            the same slice of a read starts none).
        calls_in_tasks: Of those, the calls run in a task; the others were answered at once
            by their connection's reader.
        unsent_bytes: Bytes queued for their clients and not yet written, in all.
        largest_unsent_bytes: The most of those held for one connection.
    """

    connections: int
    calls: int
    calls_started: int
    calls_in_tasks: int
    unsent_bytes: int
    largest_unsent_bytes: int


class GrpcServer(ConnectionServer[Connection]):
    """Accepts connections and runs each in its own nursery, for the life of :meth:`serve`
    (:class:`~trio_infer.transport.listening.ConnectionServer`): a drain sends GOAWAY, and
    the calls still running at the end of a shutdown's grace period end with UNAVAILABLE.

    Args:
        handler: Runs each call.
        limits: The bounds every connection keeps.
        ssl_context: Serve TLS with this server-side context (see
            :func:`trio_infer.transport.tls.server_context`); plaintext when None.
        access_log: Write one access-log record per call
            (:mod:`trio_infer.transport.access_log`).
        immediate: The methods answered at once, each by its :data:`Immediate`, when a call's
            whole request comes with its start (``handler`` runs the others, and these
            otherwise).
    """

    def __init__(
        self,
        handler: Handler,
        limits: ProtocolLimits | None = None,
        *,
        ssl_context: ssl.SSLContext | None = None,
        access_log: bool = False,
        immediate: Mapping[str, Immediate] = _NO_IMMEDIATE,
    ) -> None:
        super().__init__(ssl_context)
        self._handler = handler
        self._limits = limits or ProtocolLimits()
        self._access_log = access_log
        self._immediate = immediate
        self.calls_in_flight = self._in_flight
        """Calls in flight, across connections."""

    def statistics(self) -> TransportStatistics:
        """Return a snapshot of the open connections."""
        return TransportStatistics(
            connections=len(self._connections),
            calls=self.calls_in_flight.count,
            calls_started=self.calls_in_flight.started,
            calls_in_tasks=self.calls_in_flight.in_tasks,
            unsent_bytes=sum(c.unsent_bytes() for c in self._connections),
            largest_unsent_bytes=max((c.unsent_bytes() for c in self._connections), default=0),
        )

    def _connect(self, transport: Transport) -> Connection:
        return Connection(
            transport,
            self._handler,
            self._limits,
            self.calls_in_flight,
            self._access_log,
            self._immediate,
        )

    def _drain_late(self, connection: Connection) -> None:
        connection.drain()
        connection.close()

    def _end_calls(self, connection: Connection) -> None:
        connection.cancel_calls(StatusCode.UNAVAILABLE, "server shut down before the call finished")
        connection.close()
