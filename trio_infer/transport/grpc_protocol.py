"""The server side of gRPC over HTTP/2 as a sans-I/O state machine: bytes in, events out.

Built on purerpc's protocol layer (``purerpc.grpclib``), which drives h2. This is the only module
that imports purerpc or h2 on the server side; :mod:`trio_infer.transport.grpc_server` does the I/O.

What purerpc 0.8.0 gets wrong for a server, and what this module changes:

- A malformed request (bad ``:path``, content type, ``grpc-timeout``...) raises out of
  ``receive_data`` and so takes the whole connection down; here it fails only its own stream
  (:class:`CallRejected`).
- A message over the size limit likewise killed the connection; here it is
  :class:`MessageRefused` for its stream only, and the stream's buffer is dropped at once.
- RST_STREAM and GOAWAY from the client were swallowed; here they are :class:`StreamReset` and
  :class:`ConnectionTerminated`, so the transport can cancel the work they orphan.
- A client opening more streams than SETTINGS_MAX_CONCURRENT_STREAMS made h2 close the whole
  connection; here only the extra stream is refused (RST_STREAM REFUSED_STREAM).
- h2 3.2.0 (the newest h2 that purerpc's ``h2<4`` allows) treats a WINDOW_UPDATE or RST_STREAM
  for a stream it has already cleaned up as a connection error and sends GOAWAY. RFC 9113 §5.1
  says both may arrive shortly after a stream closes and must be ignored; grpcio clients send
  them under load (25 concurrent 256 KiB calls reproduce it). :class:`_H2Connection` ignores
  them.
- h2 treats a malformed header block (an upper-case name, a connection-specific header, a value
  that is not UTF-8) as a connection error; RFC 9113 §8.1.1 makes it a stream error, and here
  only that stream is reset (RST_STREAM PROTOCOL_ERROR).
- h2 ends the connection when a request's body is longer or shorter than its ``content-length``,
  or when that field is not a number (and reads ``-5``, ``+5`` or ``5_0`` as numbers, and a
  field repeated with two values as its first). RFC 9113 §8.1.1 makes all of these malformed
  requests, stream errors: here the stream is reset (RST_STREAM PROTOCOL_ERROR), the field
  must be digits (RFC 9110 §8.6; repeated, with one value), and the body is checked against
  it wherever the request ends (on DATA, trailers or its headers).
- h2 answers DATA on a stream the server reset with a RST_STREAM of its own, and returns its
  window only once half the connection's window was spent so. RFC 9113 §5.1 says such frames,
  sent before the client saw the reset, are ignored; here they are, and the window of every
  DATA frame dropped is returned as that of the DATA a call reads.
- purerpc opened 64 MiB per stream and 1 GiB per connection. Here a stream's window is 128 KiB
  until its call admits a message: each message is announced (:class:`MessageAnnounced`) as soon
  as its 5-byte prefix arrives, and the client may send the rest only after
  :meth:`ServerProtocol.admit`. A request the server cannot take yet is not read, let alone
  buffered; per connection, unadmitted data is at most 128 KiB times the stream limit.
"""

from __future__ import annotations

import collections
import contextlib
import re
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias
from urllib.parse import quote

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings
import h2.stream
from h2.connection import ConnectionInputs, ConnectionState, _decode_headers
from h2.errors import ErrorCodes
from h2.exceptions import FrameDataMissingError
from h2.frame_buffer import FrameBuffer
from h2.settings import SettingCodes
from h2.stream import H2StreamStateMachine, StreamClosedBy, StreamInputs
from h2.stream import _decode_headers as _headers_to_str
from h2.utilities import HeaderValidationFlags, normalize_inbound_headers, validate_headers
from h2.windows import WindowManager
from hpack import HeaderTuple, NeverIndexedHeaderTuple
from hyperframe.exceptions import InvalidFrameError, InvalidPaddingError
from hyperframe.frame import GoAwayFrame, RstStreamFrame
from purerpc.grpclib.config import GRPCConfiguration
from purerpc.grpclib.connection import GRPCConnection
from purerpc.grpclib.events import RequestEnded, RequestReceived
from purerpc.grpclib.exceptions import ProtocolError as _PurerpcProtocolError
from purerpc.grpclib.headers import HeaderDict, sanitize_headers

from trio_infer.buffers import Buffer
from trio_infer.errors import StatusCode
from trio_infer.transport.access_log import REQUEST_ID_HEADER
from trio_infer.transport.header_blocks import (
    MAX_REMEMBERED_BYTES,
    CachingDecoder,
    CachingEncoder,
    decoded_size,
    never_indexed,
    never_indexed_name,
)
from trio_infer.transport.quoting import shown

__all__ = [
    "CallRejected",
    "ConnectionTerminated",
    "MessageAnnounced",
    "MessageReceived",
    "MessageRefused",
    "PingPolicy",
    "ProtocolLimits",
    "ProtocolViolation",
    "RateLimit",
    "RequestEnded",
    "RequestReceived",
    "ServerProtocol",
    "StreamReset",
    "WholeRequest",
    "at_deadline",
    "grpc_message_value",
]

Metadata = tuple[tuple[str, str | bytes], ...]
#: Told to a client refused for its message encoding, as gRPC's compression spec asks: the
#: encodings the server takes.
_ACCEPTED_ENCODINGS = (("grpc-accept-encoding", "identity"),)

#: Headers smaller than this are all a V2 client ever sends; the limit bounds per-stream memory.
_MAX_HEADER_LIST_SIZE = 16 * 1024
#: Larger frames mean fewer of them, and much of h2's cost is paid per frame.
_MAX_INBOUND_FRAME_SIZE = 128 * 1024
#: Request bytes a client may send on a stream before its call admits them: enough for a
#: request of up to 128 KiB (a 64-row FP32 tensor of 512 columns, say) to arrive whole, in one
#: frame, without waiting a round trip for its admission. With the default stream limit, a
#: connection can make the server hold at most 12.8 MiB it has not admitted.
_STREAM_WINDOW = 128 * 1024
#: When less unadmitted room than this is left, admitting a message tops the window back up.
_STREAM_WINDOW_LOW = 16 * 1024
_MESSAGE_PREFIX = struct.Struct(">?I")
#: From this length on, a message that comes whole in one DATA frame is a view of the frame's
#: bytes, not a copy of them; a smaller one is copied, which a parser reads without a copy of
#: its own (it copies a view first).
_VIEWED_MESSAGE = 16 * 1024
#: An HTTP/2 frame header (RFC 9113 §4.1), as hyperframe packs it: length (24 bits, high and
#: low part), type, flags, stream id.
_FRAME_HEADER = struct.Struct(">HBBBL")


def _frame_header(size: int, kind: int, flags: int, stream_id: int) -> bytes:
    return _FRAME_HEADER.pack(size >> 8, size & 0xFF, kind, flags, stream_id)


#: Frame types and flags (RFC 9113 §6) of the frames handled here rather than by hyperframe.
_DATA = 0x0
_HEADERS = 0x1
_WINDOW_UPDATE = 0x8
_CONTINUATION = 0x9
_END_STREAM = 0x1
_END_HEADERS = 0x4
_PADDED = 0x8
_PRIORITY = 0x20
#: A frame header's stream identifier, without the reserved bit (RFC 9113 §4.1).
_STREAM_ID_MASK = 0x7FFFFFFF
_UINT32 = struct.Struct(">L")
#: hyperframe's flags as h2 tests them (``"END_STREAM" in frame.flags``).
_FLAG_NAMES = {
    0: frozenset(),
    _END_STREAM: frozenset({"END_STREAM"}),
    _END_HEADERS: frozenset({"END_HEADERS"}),
    _END_STREAM | _END_HEADERS: frozenset({"END_STREAM", "END_HEADERS"}),
}
#: DATA frames at least this large are sent from the caller's memory instead of being copied
#: (several times) into h2's send buffer.
BY_REFERENCE_BYTES = 64 * 1024
#: Distinct request header lists whose checked and parsed forms are remembered, per connection.
_MAX_CHECKED_HEADER_LISTS = 64
_REQUEST_HEADERS = HeaderValidationFlags(
    is_client=False, is_trailer=False, is_response_header=False, is_push_promise=False
)
_REQUEST_TRAILERS = _REQUEST_HEADERS._replace(is_trailer=True)


class _MalformedRequest(Exception):
    """A request's headers are not those of a gRPC call (the message says why): the call is
    answered with ``status``."""

    def __init__(self, message: str, status: StatusCode = StatusCode.INVALID_ARGUMENT) -> None:
        super().__init__(message)
        self.status = status


class _MalformedBlock(h2.exceptions.ProtocolError):  # type: ignore[misc]
    """A header block, decoded, makes its request malformed (RFC 9113 §8.1.1): a stream error,
    not the connection error h2 makes of its ProtocolError."""


class _BadContentLength(_MalformedBlock):
    """A request's ``content-length`` fields do not state one length."""


class _UnendedTrailers(_MalformedBlock):
    """A request's second header block (its trailers) does not end its stream (§8.1)."""


def _declared_length(headers: Sequence[tuple[bytes, bytes]]) -> int | None:
    """The body length a request's header fields (as decoded, bytes) declare; None if they
    have no ``content-length``.

    Raises:
        _BadContentLength: a value that is not 1*DIGIT (RFC 9110 §8.6), or fields repeated
            with different values. The same value repeated is that value (as §8.6 allows).
    """
    declared = None
    for name, value in headers:
        if name == b"content-length":
            # bytes.isdigit: ASCII digits only, at least one (no sign, space, "_" or list).
            if not value.isdigit() or (declared is not None and int(value) != declared):
                raise _BadContentLength("the request's content-length is not one length")
            declared = int(value)
    return declared


class _RequestStream(h2.stream.H2Stream):  # type: ignore[misc]
    """h2's stream, for a request: its ``content-length`` read by :func:`_declared_length`
    (h2 reads it with ``int()``), from the request's headers only. A ``content-length`` in
    trailers frames nothing (RFC 9110 §6.5.1), so it changes nothing (h2 took it as the
    body's length)."""

    def receive_headers(self, headers: Any, end_stream: bool, header_encoding: Any) -> Any:
        # Open, or answered and still open on the client's side, the stream has had its
        # request's header block: this one is its trailers.
        state = self.state_machine.state
        if not end_stream and (state is _OPEN or state is _HALF_CLOSED_LOCAL):
            raise _UnendedTrailers("request trailers without END_STREAM")
        return super().receive_headers(headers, end_stream, header_encoding)

    def _initialize_content_length(self, headers: Sequence[tuple[bytes, bytes]]) -> None:
        if not self.state_machine.trailers_received:
            self._expected_content_length = _declared_length(headers)

    def ended_short(self) -> bool:
        """Whether the request, ended, has a body shorter than its content-length declared
        (a body longer than it fails the DATA frame that outgrows it)."""
        expected: int | None = self._expected_content_length
        return expected is not None and expected != self._actual_content_length


def _request_stream(
    stream_id: int, config: Any, inbound_window_size: int, outbound_window_size: int
) -> _RequestStream:
    """``_RequestStream(stream_id, config, inbound_window_size, outbound_window_size)``: the
    attributes h2 3.2's ``H2Stream``, ``H2StreamStateMachine`` and ``WindowManager``
    constructors set, with the same values, set here (a test holds the two equal). Their three
    Python constructors and the state machine's read of ``StreamState.IDLE`` off its enum
    class were about half the cost of opening a call's stream.
    ``inbound_window_size`` is at most the largest window, which ``WindowManager`` asserts:
    it is this server's own setting."""
    states = _new_object(H2StreamStateMachine)
    states.state = _IDLE
    states.stream_id = stream_id
    states.client = None
    states.headers_sent = None
    states.trailers_sent = None
    states.headers_received = None
    states.trailers_received = None
    states.stream_closed_by = None
    window = _new_object(WindowManager)
    window.max_window_size = inbound_window_size
    window.current_window_size = inbound_window_size
    window._bytes_processed = 0
    stream: _RequestStream = _new_object(_RequestStream)
    stream.state_machine = states
    stream.stream_id = stream_id
    stream.max_outbound_frame_size = None
    stream.request_method = None
    stream.outbound_flow_control_window = outbound_window_size
    stream._inbound_window_manager = window
    stream._expected_content_length = None
    stream._actual_content_length = 0
    stream._authority = None
    stream.config = config
    return stream


#: gRPC's TimeoutValue and TimeoutUnit (PROTOCOL-HTTP2.md): at most 8 digits, then a unit.
_GRPC_TIMEOUT = re.compile(r"[0-9]{1,8}[HMSmun]")
#: Seconds in each TimeoutUnit.
_TIMEOUT_UNITS = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}


#: What a grpc-message value may carry as it is (PROTOCOL-HTTP2.md, Percent-Byte-Unencoded):
#: space and the printable ASCII characters but ``%``.
_UNENCODED = "".join(chr(byte) for byte in range(0x20, 0x7F) if byte != ord("%"))


#: The longest ``grpc-message`` value sent, in bytes once encoded: half of grpcio's default
#: limit on a response's metadata, past which it refuses the whole status.
_MAX_MESSAGE_VALUE = 4096


def grpc_message_value(message: str) -> str:
    """A status message as gRPC's ``grpc-message`` trailer carries it: UTF-8, percent-encoded
    only where the protocol requires (``%``, control characters and non-ASCII), as grpc's own
    servers send it, so that a client shows it readable even where it does not decode it; and
    a space at either end, which would make the field malformed (RFC 9113 §8.2.1).

    A message whose value would be longer than a client takes (one that repeats a client's
    megabyte name, say) is cut, and ends in ``...``: a client must see the call's status, not
    its own refusal of the trailers that carry it."""
    value = quote(message, safe=_UNENCODED)
    if len(value) > _MAX_MESSAGE_VALUE:
        # Room for the "..." and for a leading space's "%20".
        cut = _fitting(message, _MAX_MESSAGE_VALUE - len("...") - len("%20"))
        value = quote(cut + "...", safe=_UNENCODED)
    if value.startswith(" "):
        value = "%20" + value[1:]
    if value.endswith(" "):
        value = value[:-1] + "%20"
    return value


def _fitting(message: str, budget: int) -> str:
    """The longest start of ``message`` whose ``grpc-message`` encoding takes at most
    ``budget`` bytes."""
    used = 0
    for index, character in enumerate(message):
        used += 1 if character in _UNENCODED else 3 * len(character.encode())
        if used > budget:
            return message[:index]
    return message


#: The ``x-request-id`` field, coded as :func:`never_indexed` codes it, up to its value.
_REQUEST_ID_FIELD = never_indexed_name(REQUEST_ID_HEADER)


def _request_id(value: str) -> bytes:
    """The ``x-request-id`` response field, coded; nothing for ``""``. A request id is
    printable ASCII (``access_log.request_id``): one byte a character. Below 127 of them (every
    id the server makes, and most clients') its literal's length is one byte, and the field is
    coded here, with no call per part as :func:`never_indexed` makes."""
    if not value:
        return b""
    if len(value) < 0x7F:
        return _REQUEST_ID_FIELD + bytes((len(value),)) + value.encode("ascii")
    return never_indexed(REQUEST_ID_HEADER, value)


def request_headers_problem(headers: Sequence[tuple[str, str]]) -> str | None:
    """What makes a request's (HTTP/2-valid) headers not a gRPC call, or None if nothing.

    A pure function of the header list, so each rule is tested directly: ``:method`` is POST,
    ``:scheme`` http or https, ``te`` is sent (HTTP/2 allows it only as ``trailers``),
    ``content-type`` appears once and is ``application/grpc`` (or ``application/grpc+...``), and
    ``grpc-timeout``, if sent, appears once and is gRPC's form of a timeout.
    """
    values: dict[str, list[str]] = {}
    for name, value in headers:
        values.setdefault(name, []).append(value)
    method = values.get(":method", [""])[0]
    if method != "POST":
        return f"the request's :method is {shown(method)!r}; gRPC calls are POST"
    scheme = values.get(":scheme", [""])[0]
    if scheme not in ("http", "https"):
        return f"the request's :scheme is {shown(scheme)!r}; gRPC calls are http or https"
    if "te" not in values:
        return "the request has no te field; gRPC calls send te: trailers"
    content_types = values.get("content-type", [])
    if len(content_types) != 1:
        return f"content-type appears {len(content_types)} times; a gRPC call sends it once"
    content_type = content_types[0]
    if content_type != "application/grpc" and not content_type.startswith(
        ("application/grpc+", "application/grpc;")
    ):
        return f"content-type {shown(content_type)!r} is not application/grpc"
    return timeout_problem(values.get("grpc-timeout", []))


def method_path_problem(path: str) -> str | None:
    """What makes a request's ``:path`` not a gRPC method's, ``/service/method``, or None."""
    if path.startswith("/") and path.count("/") == 2:
        return None
    return f"method {shown(path)} is not served here; a gRPC method's path is /service/method"


def timeout_problem(values: Sequence[str]) -> str | None:
    """What is wrong with a request's ``grpc-timeout`` values (all of them), or None."""
    if len(values) > 1:
        return f"grpc-timeout appears {len(values)} times"
    if values and not _GRPC_TIMEOUT.fullmatch(values[0]):
        return (
            f"grpc-timeout {shown(values[0], 20)!r} is not a gRPC timeout (1 to 8 digits and "
            "a unit: H, M, S, m, u or n)"
        )
    return None


#: How early before a call's deadline (as the server reckons it, from when it read the call) its
#: client's cancel may arrive and still be that deadline, as a fraction of the timeout, and
#: beyond it: the client's clock started when it sent the call.
_DEADLINE_SLACK = (0.2, 0.001)


def at_deadline(now: float, deadline: float | None, timeout: float) -> bool:
    """Whether a call's client cancelling it at ``now`` is its deadline passing (``deadline``
    and ``timeout`` in seconds; None: the call has none), which a client sends for every call
    that runs out of time: such cancels count against the wider ``_DEADLINE_RESETS``."""
    if deadline is None:
        return False
    fraction, least = _DEADLINE_SLACK
    return now >= deadline - fraction * timeout - least


class RateLimit:
    """A token bucket: at most ``burst`` events at once, and ``rate`` a second over time.

    Args:
        rate: Events a second it refills by.
        burst: The most it holds (and starts with).
    """

    def __init__(self, rate: float, burst: float) -> None:
        self.rate = rate
        self.burst = burst
        self._tokens = burst
        self._last: float | None = None

    def take(self, now: float) -> bool:
        """Whether one more event at ``now`` (seconds, any monotonic clock) is within bounds."""
        self._refill(now)
        if self._tokens < 1:
            return False
        self._tokens -= 1
        return True

    def owe(self, now: float) -> float:
        """Count one more event at ``now``, within bounds or not; return how long to wait
        before the next one for the events, over time, to keep to ``rate`` (0 while within)."""
        self._refill(now)
        self._tokens -= 1
        return -self._tokens / self.rate if self._tokens < 0 else 0.0

    def _refill(self, now: float) -> None:
        if self._last is not None:
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
        self._last = now


class PingPolicy:
    """gRPC's keepalive enforcement as a pure decision: a PING that comes sooner than
    ``min_interval`` after the one before is a strike, the response data sent between two PINGs
    forgives the strikes (a client's flow-control probes ride on its calls), and more than
    ``max_strikes`` strikes end the connection.

    Args:
        min_interval: The shortest interval between two PINGs that is not a strike, in seconds.
        max_strikes: Strikes forgiven.
    """

    def __init__(self, min_interval: float, max_strikes: int) -> None:
        self.min_interval = min_interval
        self.max_strikes = max_strikes
        self._last: float | None = None
        self._strikes = 0

    def received(self, now: float) -> bool:
        """Whether a PING at ``now`` (seconds, any monotonic clock) is still tolerated."""
        if self._last is not None and now - self._last < self.min_interval:
            self._strikes += 1
        self._last = now
        return self._strikes <= self.max_strikes

    def data_sent(self) -> None:
        """The server sent response headers or data: earlier PINGs are forgiven."""
        self._strikes = 0


class _TooManyPings(h2.exceptions.ProtocolError):  # type: ignore[misc]
    """A client pinged more often than :class:`PingPolicy` allows."""

    error_code = ErrorCodes.ENHANCE_YOUR_CALM


#: The GOAWAY debug data gRPC clients read as "ping less often" (they double their interval).
_TOO_MANY_PINGS = b"too_many_pings"
#: Frames handled in one :meth:`ServerProtocol.receive_data`: a read full of tiny frames is
#: handled in slices, with other connections' work between them.
_FRAMES_PER_PASS = 512

#: Calls a client may cancel (RST_STREAM) before their deadline, per connection, before its
#: frames are read more slowly: a rapid-reset attack (CVE-2023-44487) resets tens of thousands
#: of calls a second, each having cost the server a call. A grpc client cancels a call whose
#: deadline passes, thousands a second in a deadline storm: those count against a wider bound
#: (:func:`at_deadline`). And a client's other calls share its connection: past either bound,
#: the connection is not closed but read no faster than the bound allows.
_RESETS = (1000.0, 500.0)
#: The bound on cancels at a call's deadline, which the client sets: wider, for deadline storms,
#: but a bound all the same (a client could send every call with a deadline that has passed).
_DEADLINE_RESETS = (10_000.0, 5_000.0)
#: SETTINGS frames a client may send, per connection: one at the start and a few later at most;
#: each costs an ACK.
_SETTINGS_FRAMES = (10.0, 100.0)


class ProtocolViolation(Exception):
    """The peer broke HTTP/2 so badly the connection must close (a GOAWAY is queued to send)."""


@dataclass(frozen=True)
class ProtocolLimits:
    """Bounds on what one connection may make the server hold.

    Args:
        max_message_size: The largest request message accepted, in bytes.
        max_concurrent_streams: Calls one connection may have open at once (advertised as
            SETTINGS_MAX_CONCURRENT_STREAMS).
        connection_window: Connection-level receive window in bytes. It is returned to the
            client as data arrives (streams' windows are what bound buffering), so it only
            needs to cover one round trip's worth of data.
        send_timeout: How long a response may wait for the client to open its flow-control
            window before the call is abandoned (a client that stopped reading).
        receive_timeout: How long an admitted request message may take to arrive whole, and a
            unary call's one message to begin, whatever the call's deadline: a client that
            announces a message and never sends it holds what was reserved for it no longer
            than this, nor one that never begins it its stream.
        handshake_timeout: How long a new connection may take to send its preface and first
            SETTINGS frame before it is closed.
        idle_timeout: How long a connection may carry no call before it is closed (with
            GOAWAY): an idle client cannot hold a file descriptor for ever.
        max_unsent_bytes: Bytes queued for a connection's socket but not yet written past which
            its calls wait to queue more and its requests are not read: a client that stops
            reading makes the server hold no more than this for it (and what its calls
            reserved).
        min_ping_interval: A client's PINGs closer together than this, more than
            ``max_ping_strikes`` times in a row with no response data sent between them, end
            the connection with GOAWAY ENHANCE_YOUR_CALM "too_many_pings" (gRPC's keepalive
            enforcement, with its defaults).
        max_ping_strikes: PINGs too early that are forgiven.
        max_connection_age: Seconds after which a connection gets GOAWAY, spread by up to 10 %
            either way (:mod:`~trio_infer.transport.connection_age`), so that its client
            reconnects and may reach another replica; None: connections live on.
        max_connection_age_grace: Seconds the calls in flight on a connection retired by its
            age get to finish; the rest then end with UNAVAILABLE and the connection closes.
            None: as long as they take.
    """

    max_message_size: int = 64 * 1024 * 1024
    max_concurrent_streams: int = 100
    connection_window: int = 16 * 1024 * 1024
    send_timeout: float = 30.0
    receive_timeout: float = 30.0
    handshake_timeout: float = 10.0
    idle_timeout: float = 300.0
    max_unsent_bytes: int = 4 * 1024 * 1024
    min_ping_interval: float = 300.0
    max_ping_strikes: int = 2
    max_connection_age: float | None = None
    max_connection_age_grace: float | None = None


@dataclass(frozen=True)
class CallRejected:
    """A stream whose request headers are not a valid gRPC call; nothing else is affected."""

    stream_id: int
    status: StatusCode
    message: str
    fields: tuple[tuple[str, str], ...] = ()
    """gRPC's own fields sent with the status: what the client needs to call again (the
    encodings accepted)."""


# The events a call brings are made for every call: plain dataclasses, whose __init__ sets
# fields without the object.__setattr__ call a frozen one makes per field.
@dataclass
class MessageAnnounced:
    """The prefix of a stream's next request message arrived: the message has ``length`` bytes.

    The client may send more than the first 128 KiB of it only once the call admits it.
    """

    stream_id: int
    length: int


@dataclass
class MessageReceived:
    """A whole request message arrived on a stream."""

    stream_id: int
    #: A read-only view of the DATA frame's bytes for a large message that came in one.
    data: bytes | bytearray | memoryview


@dataclass
class WholeRequest:
    """A stream's whole request arrived in one DATA frame: one message of ``length`` bytes
    (prefix and all), then the client's END_STREAM. What :class:`MessageAnnounced`,
    :class:`MessageReceived` and ``RequestEnded`` would say, in one event, as a unary call's
    request comes."""

    stream_id: int
    length: int
    #: A read-only view of the DATA frame's bytes for a large message.
    data: bytes | memoryview


@dataclass(frozen=True)
class MessageRefused:
    """A stream's request message cannot be taken (too large, compressed); the call must end
    with ``status``. Other streams are unaffected."""

    stream_id: int
    status: StatusCode
    message: str


@dataclass(frozen=True)
class StreamReset:
    """A stream was reset: by the client (it cancelled the call), or by the server, for a
    malformed request. Either way its call, if one started, has nobody to answer."""

    stream_id: int
    #: Whether the client reset it (else the server did, the request being malformed).
    by_client: bool


@dataclass(frozen=True)
class ConnectionTerminated:
    """The client sent GOAWAY: it will start no new calls on this connection."""


Event: TypeAlias = (
    RequestReceived
    | MessageReceived
    | RequestEnded
    | CallRejected
    | MessageAnnounced
    | WholeRequest
    | MessageRefused
    | StreamReset
    | ConnectionTerminated
)


#: This module's events (and purerpc's it hands on), none of them h2's: what a handler of
#: :attr:`_H2Connection._handled_here` returns is among them, or an h2 event to dispatch.
_OWN_EVENTS = frozenset(
    {
        RequestReceived,
        MessageReceived,
        RequestEnded,
        CallRejected,
        MessageAnnounced,
        WholeRequest,
        MessageRefused,
        StreamReset,
        ConnectionTerminated,
    }
)


class _DataRecord:
    """A DATA frame without padding, as h2's handler reads it (made by
    :meth:`_FrameBuffer.take`): its flags as hyperframe's names, END_STREAM alone kept."""

    __slots__ = ("data", "flags", "flow_controlled_length", "stream_id")
    stream_id: int
    flags: frozenset[str]
    #: The frame's body: its own bytes, or a view of a frame joined from two reads.
    data: bytes | memoryview
    flow_controlled_length: int


class _HeadersRecord:
    """A HEADERS frame holding a whole header block, without padding or priority, as h2's
    handler reads it (made by :meth:`_FrameBuffer.take`): its flags as hyperframe's names,
    END_STREAM and END_HEADERS kept."""

    __slots__ = ("data", "flags", "stream_id")
    stream_id: int
    flags: frozenset[str]
    data: bytes


class _WindowUpdateRecord:
    """A WINDOW_UPDATE frame, as h2's handler reads it (made by :meth:`_FrameBuffer.take`)."""

    __slots__ = ("stream_id", "window_increment")
    stream_id: int
    window_increment: int


def _frame_rest(start: memoryview) -> int:
    """How many bytes the frame that ``start`` begins with still lacks: its 9-byte header's
    length and the header, less what ``start`` holds; 0 while the header is incomplete."""
    if len(start) < 9:
        return 0
    return 9 + int.from_bytes(start[:3], "big") - len(start)


def _data_received(frame: Any) -> h2.events.DataReceived:
    """h2's event for a DATA frame received."""
    received = h2.events.DataReceived()
    received.stream_id = frame.stream_id
    received.data = frame.data
    received.flow_controlled_length = frame.flow_controlled_length
    return received


def _with_end(received: Any, stream_id: int, ended: bool) -> list[Any]:
    """h2's event for a request's frame, followed by the stream's StreamEnded (kept with it as
    h2 keeps it) if the frame ended the stream."""
    if not ended:
        return [received]
    end = h2.events.StreamEnded()
    end.stream_id = stream_id
    received.stream_ended = end
    return [received, end]


class _OpenedBlock:
    """A request header block, by its bytes, that opened a stream and left the connection's
    HPACK table as it was: what decoding and checking it gave, valid while the table and the
    decoder's limits are those it was decoded under (decoding it again would then give the
    same headers and pass the same checks, changing nothing)."""

    __slots__ = ("content_length", "headers", "limits", "request", "version")

    def __init__(
        self, version: int, limits: tuple[int, int], headers: list[Any], content_length: Any
    ) -> None:
        self.version = version
        self.limits = limits
        #: The headers as :meth:`_H2Connection._checked` gave them; never changed.
        self.headers = headers
        #: h2's ``_expected_content_length`` for a stream these headers open.
        self.content_length = content_length
        #: What :class:`ServerProtocol` parsed from them (a request with no stream id, never
        #: handed out), once it has: a request from the same bytes is a copy of it.
        self.request: RequestReceived | None = None


# The enum members read on every call's path, as module constants: a member read off its class
# goes through the slow attribute hook of a metaclass that defines ``__getattr__`` (EnumType).
_IDLE = h2.stream.StreamState.IDLE
_OPEN = h2.stream.StreamState.OPEN
_HALF_CLOSED_REMOTE = h2.stream.StreamState.HALF_CLOSED_REMOTE
_HALF_CLOSED_LOCAL = h2.stream.StreamState.HALF_CLOSED_LOCAL
_CLOSED = h2.stream.StreamState.CLOSED
_CLOSED_BY_SENT_END = StreamClosedBy.SEND_END_STREAM
_CLOSED_BY_SENT_RESET = StreamClosedBy.SEND_RST_STREAM
_SERVER_OPEN = ConnectionState.SERVER_OPEN
_SEND_HEADERS = ConnectionInputs.SEND_HEADERS
_SEND_DATA = ConnectionInputs.SEND_DATA
_RECV_HEADERS = ConnectionInputs.RECV_HEADERS
_INITIAL_WINDOW_SIZE = SettingCodes.INITIAL_WINDOW_SIZE
_MAX_CONCURRENT_STREAMS = SettingCodes.MAX_CONCURRENT_STREAMS


def _connection_input(h2_connection: Any, sent: ConnectionInputs) -> None:
    """Give h2's connection state machine a SEND_HEADERS, SEND_DATA or RECV_HEADERS input. In
    SERVER_OPEN, where a connection spends its life, h2's transition for each is to stay, doing
    nothing: only another state needs the machine (which opens the connection on its first
    request, and refuses the input after a GOAWAY)."""
    if h2_connection.state_machine.state is not _SERVER_OPEN:
        h2_connection.state_machine.process_input(sent)


def _headers_sent(states: Any, end_stream: bool) -> None:
    """Give a stream's h2 state machine a SEND_HEADERS input, and SEND_END_STREAM if
    ``end_stream``: by hand in OPEN and HALF_CLOSED_REMOTE, where a server's stream answers, as
    h2's transitions do there (headers, then trailers, marked sent; END_STREAM half-closes an
    OPEN stream and closes a HALF_CLOSED_REMOTE one, closed by the server's END_STREAM); through
    h2's machine in any other state, or for a block h2 would refuse, to raise what it raises.
    Each input through h2's machine costs a tuple of enums hashed in Python."""
    state = states.state
    if (state is _OPEN or state is _HALF_CLOSED_REMOTE) and states.client is False:
        if not states.headers_sent:
            states.headers_sent = True
        elif not states.trailers_sent:
            states.trailers_sent = True
        else:
            states.process_input(StreamInputs.SEND_HEADERS)  # raises: trailers twice
        if end_stream:
            if state is _OPEN:
                states.state = _HALF_CLOSED_LOCAL
            else:
                states.state = _CLOSED
                states.stream_closed_by = _CLOSED_BY_SENT_END
        return
    states.process_input(StreamInputs.SEND_HEADERS)
    if end_stream:
        states.process_input(StreamInputs.SEND_END_STREAM)


def _data_sent(states: Any) -> None:
    """Give a stream's h2 state machine a SEND_DATA input: nothing to do in OPEN and
    HALF_CLOSED_REMOTE, where h2's transition for it is to stay; h2's machine in any other
    state, which it changes or refuses."""
    state = states.state
    if state is not _OPEN and state is not _HALF_CLOSED_REMOTE:
        states.process_input(StreamInputs.SEND_DATA)


_new_object = object.__new__
_ordered_setitem = collections.OrderedDict.__setitem__
#: The bound of h2's ``_closed_streams`` (the SizeLimitDict its connection makes with it).
_MAX_CLOSED_STREAMS = h2.connection.H2Connection.MAX_CLOSED_STREAMS


def _queue_block(h2_connection: Any, stream_id: int, block: bytes, flags: int) -> None:
    """Queue a header block as a HEADERS frame with ``flags`` (END_HEADERS added), or, longer
    than a frame, cut into CONTINUATION frames as h2 cuts it."""
    size = len(block)
    frame_size = h2_connection.max_outbound_frame_size
    if size <= frame_size:  # the usual case: one frame
        h2_connection._data_to_send += _FRAME_HEADER.pack(
            size >> 8, size & 0xFF, _HEADERS, flags | _END_HEADERS, stream_id
        )
        h2_connection._data_to_send += block
        return
    # A block has no bound of its own: a response's metadata has none.
    kind = _HEADERS
    with memoryview(block) as view:
        for start in range(0, size, frame_size):
            piece = view[start : start + frame_size]
            if start + frame_size >= size:
                flags |= _END_HEADERS
            h2_connection._data_to_send += _frame_header(len(piece), kind, flags, stream_id)
            h2_connection._data_to_send += piece
            kind, flags = _CONTINUATION, 0


def _forget_closed(h2_connection: Any, stream_id: int, states: Any) -> None:
    """Forget a stream its trailers closed, as h2 forgets a closed stream when it next counts
    the open ones (at the stream limit, with a walk over every stream it holds); how it closed
    is kept for the late frames RFC 9113 §5.1 allows."""
    del h2_connection.streams[stream_id]
    # h2's SizeLimitDict.__setitem__ (an OrderedDict's, then its bound kept) without its two
    # Python calls.
    closed = h2_connection._closed_streams
    _ordered_setitem(closed, stream_id, states.stream_closed_by)
    if len(closed) > _MAX_CLOSED_STREAMS:
        closed.popitem(last=False)


class _FrameBuffer(FrameBuffer):  # type: ignore[misc]
    """h2's inbound frame buffer, without its quadratic copying, and with the frames every call
    brings parsed by hand.

    h2 keeps unread bytes in ``bytes`` and re-slices all of them after every frame, so one read
    holding many frames (a 256 KiB read of 64 KiB requests holds about twenty) copied the read
    about ten times over. Here the bytes are read from a position that moves past each frame:
    a read is kept as it came, and only the start of a frame that it did not end is copied.
    The next read's bytes that end that frame are joined to its start, into one ``bytes`` of
    the frame alone, and the rest of the read is taken from where the frame ended, in place.
    Each frame's body is copied once more, by its parser; that of a DATA frame joined from two
    reads is a view of the joined bytes, which hold nothing else.

    A gRPC client sends HEADERS, DATA and often a WINDOW_UPDATE with every call. hyperframe's
    objects for them (a frame, its flags, their parsers) were a large part of the time it took
    to read a small call; here they are records carrying just what h2's handlers read of them.
    A frame hyperframe would reject (DATA or HEADERS on stream 0, a WINDOW_UPDATE of the wrong
    size), one with padding or priority, a header block in several frames, and any frame in
    the middle of one (h2 must see it to refuse it) still go through hyperframe.
    """

    def __init__(self, server: bool) -> None:
        super().__init__(server=server)
        #: The bytes of the last read (after the start of a frame the read before did not end);
        #: those before ``_at`` are taken. Once every whole frame is taken, only the start of
        #: the next is kept: a connection holds no more of its reads than one frame.
        self.data = b""
        self._at = 0
        #: A read whose first bytes ended the frame ``data`` holds (joined to its start), and
        #: where in it the next frame starts: taken once that frame is. None otherwise.
        self._rest: bytes | None = None
        self._rest_at = 0
        self.max_header_block = _MAX_HEADER_LIST_SIZE
        """The most encoded bytes one header block may have (HEADERS and its CONTINUATIONs)."""

    def add_data(self, data: bytes | bytearray) -> None:
        """Add a read's bytes after those not taken yet."""
        if self._preamble_len:
            # The connection's first bytes: h2 checks (and drops) its preface.
            self.data, self._at = self.data[self._at :], 0
            super().add_data(bytes(data))
        elif self._at == len(self.data):
            self.data, self._at = bytes(data), 0  # a read's bytes object is kept, not copied
        elif data:
            with memoryview(self.data) as held, held[self._at :] as start:
                ending = _frame_rest(start)
                if 0 < ending < len(data):
                    # Only the bytes that end the frame are joined to its start; the rest of
                    # the read is kept as it came, and taken once that frame is.
                    self._rest, self._rest_at = bytes(data), ending
                    with memoryview(data) as read, read[:ending] as end:
                        self.data = b"".join((start, end))
                else:
                    self.data = b"".join((start, data))
            self._at = 0

    def next(self) -> Any:
        frame = self.take()
        if frame is None:
            raise StopIteration
        return frame

    def take(self) -> Any:
        """The next whole frame, or None until more data is added (h2's ``next`` without
        the exception it raises at the end of every read)."""
        data = self.data
        at = self._at
        while len(data) - at >= 9:
            high, low, kind, flags, stream_id = _FRAME_HEADER.unpack_from(data, at)
            length = (high << 8) | low
            stream_id &= _STREAM_ID_MASK
            # Both limits are enforced from a frame's 9-byte header, before its body is
            # buffered or a header block decoded: a peer cannot make the server hold or decode
            # more than it advertised by announcing it.
            if length > self.max_frame_size:
                self._validate_frame_length(length)  # raises
            # The frames every call brings are taken by hand, by type, when nothing about them
            # needs hyperframe (see the class). Each record is made field by field, as its
            # __init__ makes it, without the Python call: three or four of them a call.
            record: Any = None
            if kind == _DATA:
                if stream_id and not flags & _PADDED and not self._headers_buffer:
                    record = _new_object(_DataRecord)
                    record.flags = _FLAG_NAMES[flags & _END_STREAM]
                    record.flow_controlled_length = length
            elif kind == _WINDOW_UPDATE:
                if length == 4 and not self._headers_buffer:
                    if len(data) - at < 13:
                        break
                    update: _WindowUpdateRecord = _new_object(_WindowUpdateRecord)
                    update.stream_id = stream_id
                    update.window_increment = _UINT32.unpack_from(data, at + 9)[0]
                    self._at = at + 13
                    return update
            elif kind in (_HEADERS, _CONTINUATION):
                buffered = self._headers_buffer
                if buffered or length > self.max_header_block:
                    self._check_header_block(length)
                if (
                    kind == _HEADERS
                    and stream_id
                    and not buffered
                    and flags & (_END_HEADERS | _PADDED | _PRIORITY) == _END_HEADERS
                ):
                    record = _new_object(_HeadersRecord)
                    record.flags = _FLAG_NAMES[flags & (_END_STREAM | _END_HEADERS)]
            end = at + 9 + length
            if record is not None:  # a DATA or HEADERS record, once its body is in
                if len(data) < end:
                    break
                record.stream_id = stream_id
                if kind == _DATA and self._rest is not None:
                    # A DATA frame joined from two reads: ``data`` holds that frame alone, of
                    # which its body is a view (read-only, as bytes are), not a second copy.
                    record.data = memoryview(data)[9:]
                else:
                    record.data = data[at + 9 : end]  # its own bytes
                self._at = end
                return record
            try:
                frame, length = self._parse_frame_header(data[at : at + 9])
            except InvalidFrameError as exc:
                raise h2.exceptions.ProtocolError(f"invalid frame header: {exc}") from exc
            if len(data) < end:
                break
            if frame is not None:  # None: a frame type h2 does not know, skipped
                try:
                    with memoryview(data) as view, view[at + 9 : end] as body:
                        frame.parse_body(body)
                except InvalidFrameError as exc:
                    raise FrameDataMissingError("Frame data missing or invalid") from exc
            at = self._at = end
            frame = self._update_header_buffer(frame)
            if frame is not None:  # None: part of a header block still being assembled
                return frame
        if self._rest is not None and at == len(data):
            # The frame joined from two reads is taken: on to the rest of the second read.
            self.data, self._at = self._rest, self._rest_at
            self._rest = None
            return self.take()
        if at:
            self.data, self._at = data[at:], 0
        return None

    def _check_header_block(self, length: int) -> None:
        # An encoder uses Huffman coding only where it is shorter, so a block's encoded size
        # is at most its decoded size: a block longer than the header list limit cannot fit it.
        # Its HPACK state is then lost, so the connection ends (RFC 9113 §10.5.1).
        block = length + sum(len(frame.data) for frame in self._headers_buffer)
        if block > self.max_header_block:
            raise h2.exceptions.DenialOfServiceError(
                f"a header block of more than {self.max_header_block} bytes "
                "(SETTINGS_MAX_HEADER_LIST_SIZE)"
            )


#: The largest flow-control window (RFC 9113 §6.9.1).
_MAX_WINDOW = 2**31 - 1


class _H2Connection(h2.connection.H2Connection):  # type: ignore[misc]
    """h2's connection, tolerant of the late frames RFC 9113 §5.1 allows on closed streams,
    failing only the stream of a malformed header block, doing the work for header blocks
    that repeat once per connection, and queueing large DATA payloads by reference (take what
    is queued with :meth:`ServerProtocol.data_to_send`, not h2's own ``data_to_send``).

    It is configured to hand over inbound headers unchecked, as bytes: they are checked (by h2's
    own validation) and decoded here, once per distinct header list.
    """

    highest_inbound_stream_id: int
    _data_to_send: bytearray
    encoder: Any
    decoder: Any
    #: See :attr:`open_inbound_streams`.
    _inbound_counted: int | None = None

    def __init__(self, config: h2.config.H2Configuration, pings: PingPolicy) -> None:
        super().__init__(config)
        self.pings = pings
        #: Response headers or data were queued since the last PING: the send path marks it, and
        #: the next PING tells :attr:`pings` (before it counts), rather than every frame sent.
        self.answered = False
        #: The frames of the last read are not all handled yet (see :meth:`receive_data`).
        self.input_pending = False
        #: A WINDOW_UPDATE opened a window since :meth:`ServerProtocol.take_window_opened`.
        self.window_opened = False
        #: A frame of the last :meth:`receive_data` went through h2's dispatch.
        self.dispatched = False
        #: Seconds to wait before reading more of the client's frames (calls it cancelled
        #: faster than their bounds allow); the transport takes it with ``take_read_pause``.
        self.read_pause = 0.0
        #: Debug data for the GOAWAY that ends the connection, when h2 sends one.
        self._goodbye_reason = b""
        self.encoder = CachingEncoder()
        self.decoder = CachingDecoder()
        # What is advertised is enforced, from the first block on: a client need not wait for
        # the SETTINGS ACK before it sends, and neither does the limit.
        self.decoder.max_header_list_size = _MAX_HEADER_LIST_SIZE
        self._checked_header_lists: dict[tuple[Any, ...], list[Any]] = {}
        self._opened_blocks: dict[bytes, _OpenedBlock] = {}
        #: The remembered block that the last request :meth:`_open_request` opened came as
        #: (None: one not remembered).
        self.opened_block: _OpenedBlock | None = None
        self.incoming_buffer = _FrameBuffer(server=not config.client_side)
        self._frame_dispatch_table[_DataRecord] = self._receive_data_frame
        self._frame_dispatch_table[_HeadersRecord] = self._receive_headers_frame
        self._frame_dispatch_table[_WindowUpdateRecord] = self._receive_window_update_frame
        #: The records' handlers for frames that need nothing of h2: each returns the frame's
        #: events, or None when h2 must handle the frame. None of them raises the stream
        #: errors h2's dispatch catches, nor has a frame to send.
        self._handled_here: dict[type, Callable[[Any], list[Any] | None]] = {
            _DataRecord: self._request_data,
            _HeadersRecord: self._new_request,
            _WindowUpdateRecord: self._window_increment,
        }
        self._resets = RateLimit(*_RESETS)
        self._deadline_resets = RateLimit(*_DEADLINE_RESETS)
        self._settings_frames = RateLimit(*_SETTINGS_FRAMES)
        #: What is queued to send ahead of ``_data_to_send``, in order: earlier contents of that
        #: buffer, and large DATA frames as a header and the payload itself.
        self.queued: list[Buffer] = []
        #: The bytes of :attr:`queued`, counted as parts are queued and taken: they are asked
        #: for at every read and every answer sent, while the queue grows with the answers
        #: that wait for the writer.
        self.queued_bytes = 0

    def receive_data(self, data: bytes | bytearray) -> list[Any]:
        """h2's ``receive_data``, handling at most :data:`_FRAMES_PER_PASS` frames; the rest of
        the read stays buffered and ``input_pending`` says so (call again with ``b""``).
        ``dispatched`` says whether any frame went through h2's dispatch: only then can the
        events include h2's own (the handlers of :attr:`_handled_here` may return others)."""
        buffer = self.incoming_buffer
        buffer.add_data(data)
        buffer.max_frame_size = self.max_inbound_frame_size
        events: list[Any] = []
        self.input_pending = False
        self.dispatched = False
        handlers = self._handled_here
        try:
            for _ in range(_FRAMES_PER_PASS):
                frame = buffer.take()
                if frame is None:
                    return events
                # A frame every call brings is handled here when nothing is wrong with it;
                # otherwise (None) h2 dispatches it, and catches the stream errors only its
                # handlers raise.
                handler = handlers.get(frame.__class__)
                received = None if handler is None else handler(frame)
                if received is None:
                    received = self._receive_frame(frame)
                    self.dispatched = True
                events.extend(received)
        except InvalidPaddingError:
            self._terminate_connection(ErrorCodes.PROTOCOL_ERROR)
            raise h2.exceptions.ProtocolError("a frame with invalid padding") from None
        except h2.exceptions.ProtocolError as exc:
            # As h2 does: a GOAWAY before the error goes up.
            self._terminate_connection(exc.error_code)
            raise
        self.input_pending = True
        return events

    def _terminate_connection(self, error_code: Any) -> None:
        frame = GoAwayFrame(
            stream_id=0,
            last_stream_id=self.highest_inbound_stream_id,
            error_code=error_code,
            additional_data=self._goodbye_reason,
        )
        self.state_machine.process_input(ConnectionInputs.SEND_GOAWAY)
        self._prepare_for_sending([frame])

    def queue_data_frame(self, stream_id: int, payload: Buffer) -> None:
        """Queue a DATA frame (no flags) carrying ``payload``, after everything queued so far.

        h2 would serialise it into its buffer: three copies of the payload (memoryview.tobytes,
        the body's join, header + body), then a fourth into the buffer. A small payload is
        copied once, into the buffer; a large one is queued by reference, behind its header.
        """
        size = memoryview(payload).nbytes
        header = _frame_header(size, _DATA, 0, stream_id)
        if size < BY_REFERENCE_BYTES:
            self._data_to_send += header
            self._data_to_send += payload
            return
        if self._data_to_send:
            self.queued.append(self._data_to_send)
            self.queued_bytes += len(self._data_to_send)
            self._data_to_send = bytearray()
        self.queued.append(header)
        self.queued.append(payload)
        self.queued_bytes += len(header) + size

    def clear_outbound_data_buffer(self) -> None:
        super().clear_outbound_data_buffer()
        self.queued.clear()
        self.queued_bytes = 0

    def _is_cleaned_up(self, stream_id: int) -> bool:
        return (
            stream_id != 0
            and stream_id not in self.streams
            and stream_id <= self.highest_inbound_stream_id
        )

    @property
    def open_inbound_streams(self) -> int:
        """h2's count of the open inbound streams (which also forgets closed ones), or the
        count just made for the header block being received: h2 counts again, over the same
        streams, before it opens the block's stream."""
        if self._inbound_counted is not None:
            return self._inbound_counted
        count: int = self._open_streams(int(not self.config.client_side))
        return count

    def _open_request(self, frame: Any) -> tuple[list[Any], bool] | list[Any] | None:
        """A header block opening a new stream: refused over the limit (``[]``: no events);
        opened, with an odd id and no priority, as a request: its checked headers and whether
        it ended the stream, as a tuple (or ``[reset]``, h2's StreamReset of a stream reset for
        malformed headers). None for any other block, which h2 handles."""
        stream_id = frame.stream_id
        if stream_id <= self.highest_inbound_stream_id:
            return None
        # Settings read by their codes, not h2's properties (which read the codes off the enum),
        # and off the current values (``Settings[code]`` is a Python call): ServerProtocol's
        # local settings always name the stream limit. h2's count walks every
        # stream it holds, the closed ones it has not yet forgotten included: it is needed only
        # when they are as many as the limit, since the open inbound ones are among them. That
        # walk forgets the closed ones, so the streams held stay within the limit.
        limit = self.local_settings._settings[_MAX_CONCURRENT_STREAMS][0]
        if len(self.streams) >= limit and self.open_inbound_streams >= limit:
            # RFC 9113 §5.1.2: a stream over the limit is refused, not the whole connection
            # (h2 raises a connection error). Its header block is still decoded, because
            # HPACK state is shared by every stream of the connection.
            _decode_headers(self.decoder, frame.data)
            self.highest_inbound_stream_id = stream_id
            self._closed_streams[stream_id] = StreamClosedBy.SEND_RST_STREAM
            refusal = RstStreamFrame(stream_id)
            refusal.error_code = ErrorCodes.REFUSED_STREAM
            self._prepare_for_sending([refusal])
            return []
        if not stream_id % 2 or "PRIORITY" in frame.flags:
            return None
        decoder = self.decoder
        version = decoder.header_table.version
        limits = (decoder.max_header_list_size, decoder.max_allowed_table_size)
        known = self._opened_blocks.get(frame.data)
        if known is not None and known.version == version and known.limits == limits:
            # The block would decode to the same headers, pass the same checks and leave the
            # table as it is: the stream is opened as _request_opened opens it, without them.
            stream, ended = self._open_stream(frame)
            stream._expected_content_length = known.content_length
            self.opened_block = known
            checked = known.headers
        else:
            self.opened_block = None
            headers, stream, ended = self._request_opened(frame)
            try:
                checked = self._checked(headers, _REQUEST_HEADERS)
                stream._initialize_content_length(headers)
            except (h2.exceptions.ProtocolError, UnicodeDecodeError, IndexError):
                return [self._stream_error(stream_id)]  # as _receive_headers_frame fails it
            if (
                decoder.header_table.version == version
                and max(len(frame.data), decoded_size(checked)) <= MAX_REMEMBERED_BYTES
            ):
                if len(self._opened_blocks) >= _MAX_CHECKED_HEADER_LISTS:
                    self._opened_blocks.clear()
                known = _OpenedBlock(version, limits, checked, stream._expected_content_length)
                self._opened_blocks[frame.data] = self.opened_block = known
        if ended and stream._expected_content_length:
            # RFC 9113 §8.1.1: a body of no DATA at all is not the content-length's.
            return [self._stream_error(stream_id)]
        return checked, ended

    def _new_request(self, frame: Any) -> list[Any] | None:
        """:meth:`_open_request` as h2's events: a request opened is its RequestReceived (and
        StreamEnded, with END_STREAM)."""
        opened = self._open_request(frame)
        if not isinstance(opened, tuple):
            return opened
        headers, ended = opened
        received = h2.events.RequestReceived()
        received.stream_id = frame.stream_id
        received.headers = headers
        return _with_end(received, frame.stream_id, ended)

    def _receive_headers_frame(self, frame: Any) -> Any:
        events = self._new_request(frame)
        if events is not None:
            return [], events
        if self._stream_closed_by(frame.stream_id) is _CLOSED_BY_SENT_RESET:
            # A header block (request trailers) on a stream the server reset: the client may
            # have sent it before it saw the reset, and RFC 9113 §5.1 says it is ignored (h2
            # answered it with a RST_STREAM of STREAM_CLOSED). It is decoded all the same, as
            # h2 decodes it: the HPACK dynamic table is the connection's, and the blocks that
            # follow refer to what this one added to it. A stream is closed once it is reset,
            # so a block on one closed otherwise, or still open, goes to h2 as before.
            _decode_headers(self.decoder, frame.data)
            return [], []
        try:
            if frame.stream_id > self.highest_inbound_stream_id:
                # A new stream under the limit that h2 opens: it counts the open streams again.
                self._inbound_counted = self.open_inbound_streams
                try:
                    frames, events = super()._receive_headers_frame(frame)
                finally:
                    self._inbound_counted = None
            else:
                frames, events = super()._receive_headers_frame(frame)
        except _MalformedBlock:
            # Raised once the block is decoded (the connection's HPACK state intact): as below.
            return [], [self._stream_error(frame.stream_id)]
        try:
            for event in events:
                if isinstance(event, h2.events.RequestReceived):
                    event.headers = self._checked(event.headers, _REQUEST_HEADERS)
                elif isinstance(event, h2.events.TrailersReceived):
                    event.headers = self._checked(event.headers, _REQUEST_TRAILERS)
        except (h2.exceptions.ProtocolError, UnicodeDecodeError, IndexError):
            # RFC 9113 §8.1.1: a malformed request is a stream error. The header block was
            # decoded, so the connection's HPACK state is intact and other streams go on.
            # (h2's checks index a name's first character: an empty name is an IndexError.)
            return frames, [self._stream_error(frame.stream_id)]
        if "END_STREAM" in frame.flags and self.streams[frame.stream_id].ended_short():
            return frames, [self._stream_error(frame.stream_id)]  # RFC 9113 §8.1.1, as above
        return frames, events

    def _request_opened(self, frame: Any) -> tuple[list[Any], _RequestStream, bool]:
        """A request's header block opening a new stream (one under the limit, with an odd id):
        done as h2 does it (the block decoded, the connection's state machine given the block
        unless it is open, where that changes nothing; the stream made, its state machine moved
        to OPEN, or HALF_CLOSED_REMOTE with END_STREAM), but the stream's state machine set by
        hand: its inputs cost a tuple of enums hashed in Python each. Returns the headers as
        decoded (a list of the decoder's own, as this connection's configuration asks of h2),
        the stream, and whether the block ended the stream. The content-length is the
        caller's to read, once the headers are checked.

        One difference from h2, on purpose: a block with a response's ``:status`` (h2 takes an
        informational one for a response its state machine refuses, and ends the connection)
        is a malformed request like any other, and :meth:`_checked` fails its stream only.

        Raises:
            h2.exceptions.ProtocolError: what h2 raises for this block.
        """
        headers = _decode_headers(self.decoder, frame.data)
        stream, ended = self._open_stream(frame)
        return headers, stream, ended

    def _open_stream(self, frame: Any) -> tuple[_RequestStream, bool]:
        """The stream a request's HEADERS opens, its state machine moved by hand (to OPEN, or
        HALF_CLOSED_REMOTE with END_STREAM), and whether the block ended it."""
        if self.state_machine.state is not _SERVER_OPEN:  # _connection_input, without its call
            self.state_machine.process_input(_RECV_HEADERS)
        stream = self._new_request_stream(frame.stream_id)
        states = stream.state_machine
        states.state = _OPEN
        states.client = False
        states.headers_received = True
        ended = "END_STREAM" in frame.flags
        if ended:
            states.state = _HALF_CLOSED_REMOTE
        return stream, ended

    def _begin_new_stream(self, stream_id: int, allowed_ids: Any) -> _RequestStream:
        """h2's, making every stream a client opens a :class:`_RequestStream` (a server opens
        none: it never pushes); h2's own for any other id, to refuse it as h2 does."""
        if stream_id % 2 == int(allowed_ids) and stream_id > self.highest_inbound_stream_id:
            return self._new_request_stream(stream_id)
        stream: _RequestStream = super()._begin_new_stream(stream_id, allowed_ids)
        return stream

    def _new_request_stream(self, stream_id: int) -> _RequestStream:
        """h2's ``_begin_new_stream`` for a stream the client opens, its id odd and above every
        earlier one (the caller's checks): the same stream (a :class:`_RequestStream`, made by
        :func:`_request_stream`), and the same record of it, without the steps that cannot
        change the outcome then (the id's checks; the calls to the configuration's logger,
        which is h2's that logs nothing), each a Python call. The initial windows are read off
        the settings' current values (``Settings[code]`` is a Python call; both are always
        set, so never the KeyError it raises for an unset one)."""
        stream = _request_stream(
            stream_id,
            self.config,
            self.local_settings._settings[_INITIAL_WINDOW_SIZE][0],
            self.remote_settings._settings[_INITIAL_WINDOW_SIZE][0],
        )
        stream.max_inbound_frame_size = self.max_inbound_frame_size
        stream.max_outbound_frame_size = self.max_outbound_frame_size
        self.streams[stream_id] = stream
        self.highest_inbound_stream_id = stream_id
        return stream

    def _stream_error(self, stream_id: int) -> h2.events.StreamReset:
        """Reset one stream with PROTOCOL_ERROR; the event tells the layers above."""
        self.reset_stream(stream_id, ErrorCodes.PROTOCOL_ERROR)
        reset = h2.events.StreamReset()
        reset.stream_id = stream_id
        reset.error_code = ErrorCodes.PROTOCOL_ERROR
        reset.remote_reset = False
        return reset

    def _checked(self, headers: list[Any], flags: HeaderValidationFlags) -> list[Any]:
        """``headers`` validated and normalised by h2's rules, names and values as ``str``."""
        # A never-indexed field equals a plain one with the same name and value, but must keep
        # its class: the classes are part of the key.
        key = (*headers, *map(type, headers), flags)
        checked = self._checked_header_lists.get(key)
        if checked is not None:
            return list(checked)
        checked = list(
            _headers_to_str(
                validate_headers(normalize_inbound_headers(headers, flags), flags), "utf-8"
            )
        )
        if decoded_size(headers) <= MAX_REMEMBERED_BYTES:
            if len(self._checked_header_lists) >= _MAX_CHECKED_HEADER_LISTS:
                self._checked_header_lists.clear()
            self._checked_header_lists[key] = checked
            return list(checked)
        return checked

    def _receive_goaway_frame(self, frame: Any) -> Any:
        # h2 3.2.0 closes the whole connection on any GOAWAY and drops what is queued to send.
        # A graceful GOAWAY (RFC 9113 §6.8) only says the client starts no new calls: the ones
        # in flight still get their answers, so the state machine is left as it is.
        event = h2.events.ConnectionTerminated()
        event.error_code = frame.error_code
        event.last_stream_id = frame.last_stream_id
        event.additional_data = frame.additional_data or None
        return [], [event]

    def _receive_data_frame(self, frame: Any) -> Any:
        events = self._request_data(frame)
        if events is None:
            try:
                return super()._receive_data_frame(frame)
            except h2.exceptions.InvalidBodyLengthError:
                return [], self.malformed_body(frame)
        return [], events

    def _request_data(self, frame: Any) -> list[Any] | None:
        """A request's DATA on its open stream: its events; None for any other DATA."""
        try:
            ended = self._take_request_data(frame)
        except h2.exceptions.InvalidBodyLengthError:
            return self.malformed_body(frame)
        if ended is None:
            return None
        return _with_end(_data_received(frame), frame.stream_id, ended)

    def malformed_body(self, frame: Any) -> list[Any]:
        """h2's events for a request's DATA, taken (its windows spent), that made its body
        longer than its content-length, or ended it shorter: a malformed request, a stream
        error (RFC 9113 §8.1.1). The stream's reset (PROTOCOL_ERROR), then the DATA as
        received: the stream has no call any more, so it is dropped, and its window returned
        to the client as that of any DATA (§6.9: it counted against the connection's)."""
        return [self._stream_error(frame.stream_id), _data_received(frame)]

    def _handle_data_on_closed_stream(self, events: list[Any], exc: Any, frame: Any) -> Any:
        # DATA on a stream that is closed, its windows spent. On one the server had reset, the
        # client may have sent it before it saw the reset: RFC 9113 §5.1 says it is ignored
        # (h2 answered it with a RST_STREAM). h2 remembers how the last 65,536 closed streams
        # closed. On one closed otherwise, or forgotten, or half-closed by the client's
        # END_STREAM (h2 closes that one now, as reset by the server: ``exc`` then carries
        # the reset's event), it is a stream error of type STREAM_CLOSED (§5.1, §6.1),
        # answered as h2 answers it. Either way its window is returned as that of any DATA
        # dropped, the DATA handed on as received to a stream with no call (h2 returned it
        # only once DATA dropped so added up to half the connection's window).
        frames = []
        if exc._events or self._stream_closed_by(exc.stream_id) is not _CLOSED_BY_SENT_RESET:
            refusal = RstStreamFrame(exc.stream_id)
            refusal.error_code = exc.error_code
            frames.append(refusal)
        return frames, [*events, *exc._events, _data_received(frame)]

    def _take_request_data(self, frame: Any) -> bool | None:
        """A request's DATA on its open stream, taken: whether it ended the stream. None for
        any other DATA, left as it is for h2.

        Raises:
            h2.exceptions.InvalidBodyLengthError: the DATA, taken, made the body longer than
                its content-length, or ended it shorter (:meth:`malformed_body`).
        """
        stream = self.streams.get(frame.stream_id)
        if (
            self.state_machine.state is not _SERVER_OPEN
            or stream is None
            or stream.state_machine.state is not _OPEN
        ):
            return None
        # A request's DATA on its open stream: done here as h2 does it (both windows spent,
        # the body's length checked against a content-length, END_STREAM half-closes the
        # stream), without the connection's and the stream's state machines, whose inputs
        # change nothing else here and cost a tuple of enums hashed in Python each.
        # Each step by hand where it cannot fail, as h2's method does it: without a call each.
        length = frame.flow_controlled_length
        connection_window = self._inbound_flow_control_window_manager
        stream_window = stream._inbound_window_manager
        if (
            connection_window.current_window_size >= length
            and stream_window.current_window_size >= length
        ):
            connection_window.current_window_size -= length
            stream_window.current_window_size -= length
        else:  # past a window: h2's methods spend them and raise what they raise
            connection_window.window_consumed(length)
            stream_window.window_consumed(length)
        end_stream = "END_STREAM" in frame.flags
        if stream._expected_content_length is None:  # then h2's method only counts the body
            stream._actual_content_length += len(frame.data)
        else:
            stream._track_content_length(len(frame.data), end_stream)
        if end_stream:
            stream.state_machine.state = _HALF_CLOSED_REMOTE
        return end_stream

    def _receive_window_update_frame(self, frame: Any) -> Any:
        events = self._window_increment(frame)
        if events is not None:
            return [], events
        if self._is_cleaned_up(frame.stream_id):
            return [], []
        if frame.window_increment == 0 and frame.stream_id in self.streams:
            # RFC 9113 §6.9: an increment of 0 on a stream is an error of that stream only
            # (h2 ends the whole connection).
            return [], [self._stream_error(frame.stream_id)]
        return super()._receive_window_update_frame(frame)

    def _window_increment(self, frame: Any) -> list[Any] | None:
        """A WINDOW_UPDATE that opens a window of the open connection or of a stream open
        or half-closed (remote) without overflowing it: no event, :attr:`window_opened` set;
        None for any other."""
        increment = frame.window_increment
        stream_id = frame.stream_id
        if self.state_machine.state is _SERVER_OPEN and increment > 0:
            # A client sends two of these a call, one for the connection and one for the call's
            # stream: done here as h2 does them when nothing is wrong (neither state changes),
            # without h2's two state machines, which cost about 5 us a call.
            if stream_id == 0:
                if self.outbound_flow_control_window + increment <= _MAX_WINDOW:
                    self.outbound_flow_control_window += increment
                    self.window_opened = True
                    return []
            else:
                # In OPEN and HALF_CLOSED_REMOTE a WINDOW_UPDATE only adds to the stream's
                # window (h2's state machine changes nothing else in them).
                stream = self.streams.get(stream_id)
                state = None if stream is None else stream.state_machine.state
                if (
                    state is _OPEN or state is _HALF_CLOSED_REMOTE
                ) and stream.outbound_flow_control_window + increment <= _MAX_WINDOW:
                    stream.outbound_flow_control_window += increment
                    self.window_opened = True
                    return []
        return None

    def _receive_rst_stream_frame(self, frame: Any) -> Any:
        if self._is_cleaned_up(frame.stream_id):
            return [], []
        stream = self.streams.get(frame.stream_id)
        if stream is not None and not stream.closed:  # a call cancelled, not one that has ended
            now = time.monotonic()
            deadline = getattr(stream, "grpc_deadline", None)
            timeout = getattr(stream, "grpc_timeout", 0.0)
            bound = self._deadline_resets if at_deadline(now, deadline, timeout) else self._resets
            self.read_pause = max(self.read_pause, bound.owe(now))
        return super()._receive_rst_stream_frame(frame)

    def _receive_ping_frame(self, frame: Any) -> Any:
        if "ACK" not in frame.flags:
            if self.answered:
                self.answered = False
                self.pings.data_sent()
            if not self.pings.received(time.monotonic()):
                self._goodbye_reason = _TOO_MANY_PINGS
                raise _TooManyPings("the client sent PINGs too often (gRPC's too_many_pings)")
        return super()._receive_ping_frame(frame)

    def _receive_naked_continuation(self, frame: Any) -> Any:
        # RFC 9113 §6.10: a CONTINUATION that no open header block precedes is a connection
        # error of type PROTOCOL_ERROR, whichever stream it names. h2 hands it to its stream,
        # and the answer then hung on how far h2 had forgotten that stream: PROTOCOL_ERROR on
        # one it still held; STREAM_CLOSED on one forgotten after END_STREAM (as a stream its
        # trailers close is, at once); on one forgotten after a reset, a RST_STREAM only, the
        # connection going on.
        raise h2.exceptions.ProtocolError("a CONTINUATION frame with no header block open")

    def _receive_settings_frame(self, frame: Any) -> Any:
        if "ACK" not in frame.flags and not self._settings_frames.take(time.monotonic()):
            raise h2.exceptions.DenialOfServiceError("too many SETTINGS frames")
        return super()._receive_settings_frame(frame)


class _InboundStream:
    """One stream's request side: reassembles its messages and tracks its receive window."""

    def __init__(self, stream_id: int, max_message_size: int) -> None:
        self.stream_id = stream_id
        self.max_message_size = max_message_size
        self.buffer = bytearray()
        #: The length of the message being received, once its prefix has arrived.
        self.length: int | None = None
        #: Bytes the client may send in all: the initial window plus every grant since.
        self.allowed = _STREAM_WINDOW
        #: Bytes of messages (with their prefixes) the call has admitted, and of DATA frames'
        #: padding, which is admitted as it comes.
        self.admitted = 0
        self.refused = False

    def whole(self, data: bytes | memoryview) -> bytes | memoryview | None:
        """The message ``data`` holds, when it holds one whole, its prefix and all, and
        nothing else, with nothing of another buffered (as a unary call sends its message): a
        view of a large one's bytes, a copy of a small one's. None otherwise (:meth:`feed`
        takes it then), and for a refused stream, whose data is dropped."""
        if (
            self.refused
            or self.length is not None
            or self.buffer
            or len(data) < _MESSAGE_PREFIX.size
        ):
            return None
        compressed, length = _MESSAGE_PREFIX.unpack_from(data)
        if (
            compressed
            or length != len(data) - _MESSAGE_PREFIX.size
            or length > self.max_message_size
        ):
            return None
        if length < _VIEWED_MESSAGE:
            # ``bytes`` of its own even when the frame's body is a view (a frame joined from
            # two reads): a parser copies a small view before it reads it.
            return bytes(data[_MESSAGE_PREFIX.size :])
        return memoryview(data)[_MESSAGE_PREFIX.size :]

    def feed(self, data: bytes | memoryview) -> list[Event]:
        whole = self.whole(data)
        if whole is not None:  # the events the buffer would give, without it
            return [
                MessageAnnounced(self.stream_id, len(whole)),
                MessageReceived(self.stream_id, whole),
            ]
        return self.feed_buffered(data)

    def feed_buffered(self, data: bytes | memoryview) -> list[Event]:
        """:meth:`feed` of ``data`` that :meth:`whole` has found no whole message in."""
        if self.refused:
            return []  # the rest of a refused message, in flight before the call's answer
        self.buffer += data
        events: list[Event] = []
        while True:
            if self.length is None:
                if len(self.buffer) < _MESSAGE_PREFIX.size:
                    return events
                compressed, length = _MESSAGE_PREFIX.unpack_from(self.buffer)
                del self.buffer[: _MESSAGE_PREFIX.size]
                if compressed:
                    events.append(
                        self._refuse(
                            StatusCode.INTERNAL, "compressed message without a grpc-encoding"
                        )
                    )
                    return events
                if length > self.max_message_size:
                    events.append(
                        self._refuse(
                            StatusCode.RESOURCE_EXHAUSTED,
                            f"request message of {length} bytes is larger than the maximum of "
                            f"{self.max_message_size} bytes",
                        )
                    )
                    return events
                self.length = length
                events.append(MessageAnnounced(self.stream_id, length))
            if len(self.buffer) < self.length:
                return events
            message: bytes | bytearray
            if len(self.buffer) == self.length >= _VIEWED_MESSAGE:
                # The usual case, a unary call's one message: the buffer is handed over, not
                # copied, so a large message costs no pass over its bytes. A small one is bytes
                # of its own, as when it comes whole.
                message, self.buffer = self.buffer, bytearray()
            else:
                with memoryview(self.buffer) as view, view[: self.length] as body:
                    message = bytes(body)  # one copy (slicing the bytearray first made two)
                del self.buffer[: self.length]
            self.length = None
            events.append(MessageReceived(self.stream_id, message))

    def end(self) -> RequestEnded | MessageRefused:
        """The event of the client's END_STREAM: the request's end, or, when it came part way
        into a message (its prefix or its body), the message refused, saying how far."""
        if self.refused or not (self.buffer or self.length is not None):
            return RequestEnded(self.stream_id)
        if self.length is None:
            arrived = f"{len(self.buffer)} of a message's {_MESSAGE_PREFIX.size} prefix bytes"
        else:
            arrived = f"{len(self.buffer)} of its message's {self.length} bytes"
        return self._refuse(StatusCode.INVALID_ARGUMENT, f"the request ended after {arrived}")

    def _refuse(self, status: StatusCode, message: str) -> MessageRefused:
        self.refused = True
        self.buffer = bytearray()
        return MessageRefused(self.stream_id, status, message)


#: The fields of a response's headers, and those that start its trailers by status code (which
#: indexes them), after the headers or alone (a trailers-only response): the same objects for
#: every call, which the encoder remembers the coding of.
_RESPONSE_HEADERS = ((":status", "200"), ("content-type", "application/grpc"))
_TRAILERS = tuple((("grpc-status", str(int(code))),) for code in sorted(StatusCode))
_TRAILERS_ONLY = tuple((*_RESPONSE_HEADERS, *trailers) for trailers in _TRAILERS)
_TRAILERS_OK = _TRAILERS[StatusCode.OK]


class ServerProtocol(GRPCConnection):  # type: ignore[misc]
    """One server-side gRPC connection's protocol state. Feed it bytes, send what it queues.

    Every method is synchronous and does no I/O: after calling any of them, the caller sends
    :meth:`data_to_send` to the socket.
    """

    def __init__(self, limits: ProtocolLimits) -> None:
        self.limits = limits
        self.handshake_done = False
        """Whether the client's preface and first SETTINGS frame have arrived."""
        super().__init__(
            GRPCConfiguration(client_side=False, max_message_length=limits.max_message_size)
        )
        # purerpc builds a stock H2Connection in its constructor; swap in the tolerant one
        # before any frame is exchanged.
        self.h2_connection: Any = _H2Connection(
            h2.config.H2Configuration(
                client_side=False,
                # Inbound headers are checked and decoded by _H2Connection, once per distinct
                # header list; h2 would do it again for every call.
                header_encoding=None,
                validate_inbound_headers=False,
                normalize_inbound_headers=False,
                # The headers we send are built here and always valid; checking and
                # normalising them again would cost every call for nothing.
                validate_outbound_headers=False,
                normalize_outbound_headers=False,
            ),
            PingPolicy(limits.min_ping_interval, limits.max_ping_strikes),
        )
        self.h2_connection.clear_outbound_data_buffer()
        self._set_h2_connection_local_settings()
        events = h2.events
        #: h2's events, by type, to their handlers (purerpc's, or this class's): purerpc finds
        #: each with a chain of isinstance checks, about fifty a call.
        self._handlers: dict[type, Callable[[Any], list[Event]]] = {
            events.RequestReceived: self._request_received,
            events.ResponseReceived: self._response_received,
            events.TrailersReceived: self._trailers_received,
            events.InformationalResponseReceived: self._informational_response_received,
            events.DataReceived: self._data_received,
            events.WindowUpdated: self._window_updated,
            events.RemoteSettingsChanged: self._remote_settings_changed,
            events.PingAcknowledged: self._ping_acknowledged,
            events.StreamEnded: self._stream_ended,
            events.StreamReset: self._stream_reset,
            events.PushedStreamReceived: self._push_stream_received,
            events.SettingsAcknowledged: self._settings_acknowledged,
            events.PriorityUpdated: self._priority_updated,
            events.ConnectionTerminated: self._connection_terminated,
            events.AlternativeServiceAvailable: self._alternative_service_available,
            events.UnknownFrameReceived: self._unknown_frame_received,
        }
        # A call's HEADERS and DATA give this class's events at once, without h2's events
        # (made, then dispatched here by type); h2's handlers remain for the frames that need
        # them, and their events are still dispatched by :meth:`receive_data`.
        self.h2_connection._handled_here[_HeadersRecord] = self._headers_frame
        self.h2_connection._handled_here[_DataRecord] = self._data_frame
        # Invariant: a stream is here while the client may still send on it and no status has
        # been sent for it.
        self._inbound: dict[int, _InboundStream] = {}
        #: Connection-window bytes received but not yet returned to the client.
        self._unreturned = 0
        self._parsed_requests: dict[tuple[Any, ...], RequestReceived] = {}
        #: The streams reset among the events :meth:`receive_data` last returned (the
        #: :class:`StreamReset` events' streams).
        self.resets: set[int] = set()

    # -- purerpc hooks -------------------------------------------------------------------------

    def _set_h2_connection_local_settings(self) -> None:
        self.h2_connection.local_settings = h2.settings.Settings(
            client=False,
            initial_values={
                SettingCodes.MAX_CONCURRENT_STREAMS: self.limits.max_concurrent_streams,
                SettingCodes.INITIAL_WINDOW_SIZE: _STREAM_WINDOW,
                SettingCodes.MAX_FRAME_SIZE: _MAX_INBOUND_FRAME_SIZE,
                SettingCodes.MAX_HEADER_LIST_SIZE: _MAX_HEADER_LIST_SIZE,
            },
        )
        self.h2_connection.max_inbound_frame_size = _MAX_INBOUND_FRAME_SIZE

    def initiate_connection(self) -> None:
        """Queue the server preface (SETTINGS) and open the connection-level window."""
        self.h2_connection.initiate_connection()
        increment = self.limits.connection_window - self.h2_connection.inbound_flow_control_window
        if increment > 0:
            self.h2_connection.increment_flow_control_window(increment)

    def _headers_frame(self, frame: _HeadersRecord) -> list[Event] | None:
        """h2's handler of a header block and :meth:`_request_received` in one, for a block
        :meth:`_H2Connection._open_request` takes; None for any other."""
        opened = self.h2_connection._open_request(frame)
        if not isinstance(opened, tuple):
            if opened:  # a malformed request, its stream reset
                return self._stream_reset(opened[0])
            return None if opened is None else []  # h2's, or refused
        headers, ended = opened
        stream_id = frame.stream_id
        known = self.h2_connection.opened_block
        if known is not None and known.request is not None and not ended:
            # The same bytes as a request parsed before (grpc-timeout included): a copy of it.
            request: RequestReceived = _new_object(RequestReceived)
            request.__dict__.update(known.request.__dict__)
            request.stream_id = stream_id
            return self._accepted(stream_id, request)
        events = self._request(stream_id, headers, ended)
        if ended:
            events.extend(self._ended(stream_id))
        elif known is not None and type(events[0]) is RequestReceived:
            template: RequestReceived = _new_object(RequestReceived)
            template.__dict__.update(events[0].__dict__)
            template.stream_id = None
            known.request = template
        return events

    def _data_frame(self, frame: _DataRecord) -> list[Event] | None:
        """h2's handler of a DATA frame and :meth:`_data_received` in one, for a request's DATA
        on its open stream; None for any other, and for every DATA after a frame of the same
        read that went through h2's dispatch: that frame's events (a RequestReceived that
        opens the call this DATA is for) are handled only once the read's frames are taken, and
        this DATA's must come after them, as h2's DataReceived."""
        h2_connection = self.h2_connection
        if h2_connection.dispatched:
            return None
        try:
            ended = h2_connection._take_request_data(frame)
        except h2.exceptions.InvalidBodyLengthError:
            reset, dropped = h2_connection.malformed_body(frame)
            return [*self._stream_reset(reset), *self._data_received(dropped)]
        if ended is None:
            return None
        return self._data(frame.stream_id, frame.data, frame.flow_controlled_length, ended)

    def _request_received(self, event: h2.events.RequestReceived) -> list[Event]:
        return self._request(event.stream_id, event.headers, event.stream_ended is not None)

    def _request(self, stream_id: int, headers: list[Any], ended: bool) -> list[Event]:
        try:
            if ended:
                raise _PurerpcProtocolError("the request ended before any message was sent")
            request = self._parsed_request(stream_id, headers)
            if request.message_encoding not in (None, "identity"):
                # Compressed requests would need a decompressor sized by our limits; clients
                # only compress when told the server accepts it, and we never say so.
                return [
                    CallRejected(
                        stream_id,
                        StatusCode.UNIMPLEMENTED,
                        f"message encoding {request.message_encoding!r} is not supported",
                        _ACCEPTED_ENCODINGS,
                    )
                ]
        except _MalformedRequest as exc:
            return [CallRejected(stream_id, exc.status, str(exc))]
        except Exception:
            # purerpc's parser raises whatever a header it did not expect makes it trip on;
            # what it tripped on is its own business, not the client's.
            return [
                CallRejected(
                    stream_id, StatusCode.INVALID_ARGUMENT, "malformed gRPC request headers"
                )
            ]
        return self._accepted(stream_id, request)

    def _accepted(self, stream_id: int, request: RequestReceived) -> list[Event]:
        """A request taken: its stream's inbound side made, its deadline kept with it."""
        self._inbound[stream_id] = _InboundStream(stream_id, self.limits.max_message_size)
        # Kept with h2's stream, which goes when the stream does (already, if a frame handled
        # with its HEADERS closed it).
        stream = self.h2_connection.streams.get(stream_id)
        if request.timeout is not None and stream is not None:
            stream.grpc_timeout = request.timeout
            stream.grpc_deadline = time.monotonic() + request.timeout
        return [request]

    def _parsed_request(self, stream_id: int, headers: list[Any]) -> RequestReceived:
        """purerpc's parse of a request's headers, done once per distinct header list (a
        client repeats the same few, and the parse was a sizeable part of reading a small
        request). ``grpc-timeout``, which differs call by call, is left out of the list and
        read here; the request's ``timeout`` is in seconds (a float), or None.

        Raises:
            _MalformedRequest: the headers are not a gRPC call's.
        """
        rest: list[Any] = []
        timeouts: list[str] = []
        for field in headers:
            if field[0] == "grpc-timeout":
                timeouts.append(field[1])
            else:
                rest.append(field)
        problem = timeout_problem(timeouts)
        if problem is not None:
            raise _MalformedRequest(problem)
        key = tuple(rest)
        parsed = self._parsed_requests.get(key)
        if parsed is None:
            problem = request_headers_problem(rest)
            if problem is not None:
                raise _MalformedRequest(problem)
            # As gRPC's own servers answer a path that names no method they serve.
            problem = method_path_problem(next(value for name, value in rest if name == ":path"))
            if problem is not None:
                raise _MalformedRequest(problem, StatusCode.UNIMPLEMENTED)
            parsed = RequestReceived.parse_from_stream_id_and_headers_destructive(
                stream_id, HeaderDict(rest)
            )
            if parsed.message_accept_encoding is not None:
                # The one list among the attributes: copies would share it.
                parsed.message_accept_encoding = tuple(parsed.message_accept_encoding)
            if decoded_size(rest) <= MAX_REMEMBERED_BYTES:
                if len(self._parsed_requests) >= _MAX_CHECKED_HEADER_LISTS:
                    self._parsed_requests.clear()
                self._parsed_requests[key] = parsed
        # Every attribute is immutable (strings, tuples): a shallow copy is a request of its
        # own (made by hand, which is quicker than copy.copy).
        request: RequestReceived = object.__new__(RequestReceived)
        request.__dict__.update(parsed.__dict__)
        request.stream_id = stream_id
        if timeouts:
            text = timeouts[0]
            request.timeout = int(text[:-1]) * _TIMEOUT_UNITS[text[-1]]
        return request

    def _data_received(self, event: h2.events.DataReceived) -> list[Event]:
        # Its StreamEnded, if it ended the stream, follows: the request has ended by then.
        ended = event.stream_ended is not None
        return self._data(event.stream_id, event.data, event.flow_controlled_length, ended)

    def _data(
        self, stream_id: int, data: bytes | memoryview, flow_controlled_length: int, ended: bool
    ) -> list[Event]:
        """The events of a request's DATA, and of its END_STREAM when ``ended``."""
        # Streams' windows bound what is buffered; the connection window is handed back as
        # data arrives, in batches so that large requests do not cost a frame per frame.
        self._unreturned += flow_controlled_length
        if self._unreturned >= self.limits.connection_window // 4:
            self.h2_connection.increment_flow_control_window(self._unreturned)
            self._unreturned = 0
        inbound = self._inbound.get(stream_id)
        if inbound is None:
            return []  # a call already answered (e.g. its message was refused): drop the data
        if flow_controlled_length != len(data) and not inbound.refused:
            # The frame's padding counts against the stream's window (RFC 9113 §6.9.1) but
            # holds nothing: admitted as it comes, or the client's window would shrink by it
            # for good and a stream of padded frames stall, its message never whole.
            self._admitted(inbound, flow_controlled_length - len(data))
        if not ended:
            return inbound.feed(data)
        del self._inbound[stream_id]
        whole = inbound.whole(data)
        if whole is not None:
            return [WholeRequest(stream_id, len(whole), whole)]
        events = inbound.feed_buffered(data)
        events.append(inbound.end())
        return events

    def _trailers_received(self, event: h2.events.TrailersReceived) -> list[Event]:
        # Request trailers are legal HTTP/2 (RFC 9113 §8.1) but carry nothing gRPC reads: they
        # are dropped, and the END_STREAM they came with ends the request as usual.
        return []

    def _stream_ended(self, event: h2.events.StreamEnded) -> list[Event]:
        return self._ended(event.stream_id)

    def _ended(self, stream_id: int) -> list[Event]:
        inbound = self._inbound.pop(stream_id, None)
        if inbound is None:
            return []
        return [inbound.end()]

    def _stream_reset(self, event: h2.events.StreamReset) -> list[Event]:
        self._inbound.pop(event.stream_id, None)
        self.resets.add(event.stream_id)
        return [StreamReset(event.stream_id, event.remote_reset)]

    def _window_updated(self, event: h2.events.WindowUpdated) -> list[Event]:
        self.h2_connection.window_opened = True
        return []

    def _remote_settings_changed(self, event: h2.events.RemoteSettingsChanged) -> list[Event]:
        # The client's first SETTINGS frame follows its preface: the handshake is done. New
        # settings may open windows (SETTINGS_INITIAL_WINDOW_SIZE), as purerpc takes them to.
        self.handshake_done = True
        self.h2_connection.window_opened = True
        return []

    def _connection_terminated(self, event: h2.events.ConnectionTerminated) -> list[Event]:
        return [ConnectionTerminated()]

    # -- the interface the transport uses ------------------------------------------------------

    @property
    def input_pending(self) -> bool:
        """Whether frames of earlier reads are still to be handled: call :meth:`receive_data`
        with ``b""`` (after letting other work run) before reading more."""
        pending: bool = self.h2_connection.input_pending
        return pending

    def pending_bytes(self) -> int:
        """Bytes queued to send that :meth:`data_to_send` has not handed out yet."""
        h2_connection = self.h2_connection
        pending: int = len(h2_connection._data_to_send) + h2_connection.queued_bytes
        return pending

    def take_window_opened(self) -> bool:
        """Whether a WINDOW_UPDATE from the client opened a flow-control window since the last
        time this was asked (a client sends one or two with nearly every call, and whoever
        waits for room is woken once for all of them)."""
        h2_connection = self.h2_connection
        opened: bool = h2_connection.window_opened
        h2_connection.window_opened = False
        return opened

    def take_read_pause(self) -> float:
        """Seconds the transport must wait before it reads more from the client (0: none):
        the client cancels calls faster than the bound on resets, and is slowed to it."""
        pause: float = self.h2_connection.read_pause
        self.h2_connection.read_pause = 0.0
        return pause

    def ping(self) -> None:
        """Queue a PING (its ACK is not waited for): a probe whose only use is to be sent.
        Nothing is queued on a connection h2 has closed."""
        with contextlib.suppress(h2.exceptions.ProtocolError):
            self.h2_connection.ping(b"\x00" * 8)

    def receive_data(self, data: bytes | bytearray) -> list[Event]:
        """Feed bytes read from the socket; return the events they complete. A read holding
        many frames is handled in slices: see :attr:`input_pending`.

        Raises:
            ProtocolViolation: the peer broke HTTP/2; a GOAWAY is queued and the connection
                must be closed after sending it.
        """
        if self.resets:  # the last read's, which the caller may still hold
            self.resets = set()
        h2_connection = self.h2_connection
        try:
            received: list[Any] = h2_connection.receive_data(data)
            if not h2_connection.dispatched:  # the usual case: every event is already ours
                return received
            events: list[Event] = []
            handlers = self._handlers
            for event in received:
                kind = type(event)
                if kind in _OWN_EVENTS:  # made by a handler of the connection's own
                    events.append(event)
                    continue
                handler = handlers.get(kind)
                if handler is not None:  # others (PingAckReceived...) carry nothing for gRPC
                    events.extend(handler(event))
        except h2.exceptions.ProtocolError as exc:
            raise ProtocolViolation(f"HTTP/2 protocol error: {exc}") from exc
        return events

    def data_to_send(self) -> list[Buffer]:
        """Take everything queued to send, as buffers to write in order (a vectored write).

        Large DATA payloads are the buffers the calls passed to :meth:`send_data`, not copies.
        h2's buffer itself is handed over and replaced (purerpc copies it into ``bytes``, a
        copy of every byte sent). ``_data_to_send`` is private to h2, but every h2 that purerpc
        accepts (3.x) keeps its queue there, and purerpc's own patch of ``data_to_send`` relies
        on it too.
        """
        h2_connection = self.h2_connection
        data: list[Buffer] = h2_connection.queued
        h2_connection.queued = []
        h2_connection.queued_bytes = 0
        if h2_connection._data_to_send:
            data.append(h2_connection._data_to_send)
            h2_connection._data_to_send = bytearray()
        return data

    def has_data_to_send(self) -> bool:
        """Whether anything is queued to send."""
        return bool(self.h2_connection.queued or self.h2_connection._data_to_send)

    def put_back(self, data: list[Buffer]) -> None:
        """Queue again, ahead of anything queued since, what :meth:`data_to_send` gave that
        could not be sent."""
        h2_connection = self.h2_connection
        h2_connection.queued[:0] = data
        h2_connection.queued_bytes += sum(memoryview(part).nbytes for part in data)

    def send_window(self, stream_id: int) -> int:
        """Bytes of DATA that may be sent on ``stream_id`` now (0 when the stream is closed).

        h2's ``local_flow_control_window`` read off the stream directly (h2 raises
        StreamClosedError for a stream it no longer has, which is 0 here; a call's stream is
        never one the client has not opened yet)."""
        h2_connection = self.h2_connection
        stream = h2_connection.streams.get(stream_id)
        if stream is None:
            return 0
        # The least of three, compared here: min() parses its arguments and iterates them, on
        # every message's path.
        window: int = stream.outbound_flow_control_window
        connection_window: int = h2_connection.outbound_flow_control_window
        if connection_window < window:
            window = connection_window
        frame_size: int = h2_connection.max_outbound_frame_size
        return frame_size if frame_size < window else window

    def start_response(self, stream_id: int, metadata: Metadata, request_id: str = "") -> None:
        """Queue the response headers, with the handler's initial metadata and the call's
        ``x-request-id`` (none when ``""``)."""
        headers: Sequence[Any] = _RESPONSE_HEADERS
        if metadata:  # most calls have none: no list then
            headers = [*_RESPONSE_HEADERS, *sanitize_headers(metadata)]
        self._send_headers(stream_id, headers, end_stream=False, extra=_request_id(request_id))

    def send_data(self, stream_id: int, data: Buffer) -> None:
        """Queue ``data`` as one DATA frame; it must fit :meth:`send_window`.

        Does what h2's ``send_data`` does (state machines, flow-control windows), but packs the
        frame here (see :meth:`_send_headers`). Payloads of 64 KiB or more are queued by
        reference: they must never change.
        """
        h2_connection = self.h2_connection
        size = memoryview(data).nbytes
        stream = h2_connection.streams.get(stream_id)
        if (
            stream is None
            or size > stream.outbound_flow_control_window
            or size > h2_connection.outbound_flow_control_window
            or size > h2_connection.max_outbound_frame_size
        ):
            # A closed stream, or a payload over the window: h2 raises what it raises for those.
            h2_connection.send_data(stream_id, data)
            return
        if h2_connection.state_machine.state is not _SERVER_OPEN:
            _connection_input(h2_connection, _SEND_DATA)
        states = stream.state_machine
        if states.state is not _OPEN and states.state is not _HALF_CLOSED_REMOTE:
            _data_sent(states)
        h2_connection.answered = True
        stream.outbound_flow_control_window -= size
        h2_connection.outbound_flow_control_window -= size
        if size < BY_REFERENCE_BYTES:  # as queue_data_frame queues a small payload
            h2_connection._data_to_send += _FRAME_HEADER.pack(
                size >> 8, size & 0xFF, _DATA, 0, stream_id
            )
            h2_connection._data_to_send += data
        else:
            h2_connection.queue_data_frame(stream_id, data)

    def _send_headers(
        self, stream_id: int, headers: Sequence[Any], *, end_stream: bool, extra: bytes = b""
    ) -> None:
        """h2's ``send_headers`` for a response's headers or trailers: the same state machine
        inputs and h2's own HPACK encoder, a block longer than a frame cut into CONTINUATION
        frames as h2 cuts it, but the frames packed here. Building and serialising hyperframe's
        frame objects was most of the cost of answering a call. ``extra``: fields already coded
        (:func:`never_indexed`), appended to the block.

        One difference from h2, on purpose: a state machine that refuses the block raises
        before the encoder sees it (h2 encodes first, and its table then holds entries the
        client's decoder never got). A stream h2 no longer has goes to h2 itself, to raise.
        """
        h2_connection = self.h2_connection
        stream = h2_connection.streams.get(stream_id)
        if stream is None:
            h2_connection.send_headers(stream_id, headers, end_stream=end_stream)
            return
        if h2_connection.state_machine.state is not _SERVER_OPEN:
            _connection_input(h2_connection, _SEND_HEADERS)
        h2_connection.answered = True
        stream_states = stream.state_machine
        _headers_sent(stream_states, end_stream)
        flags = 0
        if end_stream:
            flags = _END_STREAM
        elif stream_states.trailers_sent:
            raise h2.exceptions.ProtocolError("Trailers must have END_STREAM set.")
        block = h2_connection.encoder.encode(headers)
        if extra:
            block += extra
        _queue_block(h2_connection, stream_id, block, flags)

    def end_response(
        self,
        stream_id: int,
        status: StatusCode,
        message: str,
        metadata: Metadata,
        *,
        headers_sent: bool,
        request_id: str = "",
        fields: Sequence[tuple[str, str]] = (),
    ) -> None:
        """Queue the trailers that end a call; a call that sent nothing gets a trailers-only
        response, with its ``x-request-id`` (none when ``""``). Requests still streaming in are
        then told to stop (RST_STREAM NO_ERROR). ``metadata`` is the handler's, ``fields``
        gRPC's own (``grpc-accept-encoding``), sent as they are."""
        trailers: Sequence[tuple[str, str] | HeaderTuple]
        if headers_sent:
            trailers = _TRAILERS[status]
            extra = b""
        else:
            trailers = _TRAILERS_ONLY[status]
            extra = _request_id(request_id)
        if message or metadata or fields:
            trailers = list(trailers)
            if message:
                # Messages differ call to call: indexed, each would take a place in the
                # connection's HPACK table, evicting the headers every response repeats.
                trailers.append(
                    NeverIndexedHeaderTuple("grpc-message", grpc_message_value(message))
                )
            if metadata:
                trailers.extend(sanitize_headers(metadata))
            trailers.extend(fields)
        self._send_headers(stream_id, trailers, end_stream=True, extra=extra)
        self._inbound.pop(stream_id, None)
        h2_connection = self.h2_connection
        stream = h2_connection.streams.get(stream_id)
        if stream is None:
            return
        states = stream.state_machine
        # h2's ``stream.closed``, without reading CLOSED off the enum.
        if states.state is _CLOSED:
            # The usual case, the client's END_STREAM already in: the trailers closed the
            # stream, forgotten now.
            _forget_closed(h2_connection, stream_id, states)
        else:
            # The client is still sending (its END_STREAM has not come): tell it to stop, which
            # also frees the stream's slot under SETTINGS_MAX_CONCURRENT_STREAMS.
            h2_connection.reset_stream(stream_id, ErrorCodes.NO_ERROR)

    def answer(self, stream_id: int, message: bytes, request_id: str = "") -> bool:
        """Queue a whole answer that ends its call with OK, in one pass: the same frames, and
        the same states after them, as :meth:`start_response` (no metadata), :meth:`send_data`
        of ``message`` with its gRPC prefix, and :meth:`end_response` (OK, no message or
        metadata, ``headers_sent``). Whether it did: only for a stream whose request has ended
        and which has sent nothing, on the open connection, the payload fitting both windows
        and one frame below :data:`BY_REFERENCE_BYTES`; nothing is queued otherwise, and the
        caller answers those three ways."""
        h2_connection = self.h2_connection
        stream = h2_connection.streams.get(stream_id)
        if stream is None or h2_connection.state_machine.state is not _SERVER_OPEN:
            return False
        states = stream.state_machine
        size = _MESSAGE_PREFIX.size + len(message)
        if (
            states.state is not _HALF_CLOSED_REMOTE
            or states.client is not False
            or states.headers_sent
            or size >= BY_REFERENCE_BYTES
            or size > stream.outbound_flow_control_window
            or size > h2_connection.outbound_flow_control_window
            or size > h2_connection.max_outbound_frame_size
        ):
            return False
        # The moves _headers_sent, _data_sent and _headers_sent again make from
        # HALF_CLOSED_REMOTE: the trailers' END_STREAM closes the stream.
        states.headers_sent = True
        states.trailers_sent = True
        states.state = _CLOSED
        states.stream_closed_by = _CLOSED_BY_SENT_END
        h2_connection.answered = True
        stream.outbound_flow_control_window -= size
        h2_connection.outbound_flow_control_window -= size
        encoder = h2_connection.encoder
        _queue_block(
            h2_connection, stream_id, encoder.encode(_RESPONSE_HEADERS) + _request_id(request_id), 0
        )
        h2_connection._data_to_send += _FRAME_HEADER.pack(
            size >> 8, size & 0xFF, _DATA, 0, stream_id
        ) + _MESSAGE_PREFIX.pack(False, len(message))
        h2_connection._data_to_send += message
        _queue_block(h2_connection, stream_id, encoder.encode(_TRAILERS_OK), _END_STREAM)
        self._inbound.pop(stream_id, None)
        _forget_closed(h2_connection, stream_id, states)
        return True

    def reset(self, stream_id: int) -> None:
        """Abandon a stream with RST_STREAM CANCEL, if it is still open."""
        self._inbound.pop(stream_id, None)
        stream = self.h2_connection.streams.get(stream_id)
        if stream is not None and stream.state_machine.state is not _CLOSED:
            self.h2_connection.reset_stream(stream_id, ErrorCodes.CANCEL)

    def admit(self, stream_id: int, length: int) -> bool:
        """Let the client send the rest of an announced message of ``length`` bytes; whether
        that queued a WINDOW_UPDATE to send (a message that fits its stream's first 128 KiB
        needs none).

        Keeps up to 128 KiB of unadmitted room open beyond it, so the prefix of the next message
        (on a streaming call) can arrive and be announced.
        """
        inbound = self._inbound.get(stream_id)
        if inbound is None:
            return False  # the client has sent everything already
        return self._admitted(inbound, _MESSAGE_PREFIX.size + length)

    def _admitted(self, inbound: _InboundStream, size: int) -> bool:
        """Count ``size`` more bytes of ``inbound``'s stream as admitted, and top its window
        back up to 128 KiB of unadmitted room when less than 16 KiB is left; whether that
        queued a WINDOW_UPDATE."""
        inbound.admitted += size
        room = inbound.allowed - inbound.admitted
        if room >= _STREAM_WINDOW_LOW:
            return False
        grant = _STREAM_WINDOW - room
        self.h2_connection.increment_flow_control_window(grant, stream_id=inbound.stream_id)
        inbound.allowed += grant
        return True

    def go_away(self) -> None:
        """Queue a GOAWAY: the client must start no new calls here (graceful shutdown).

        h2's own ``close_connection`` moves the connection to a state that refuses every later
        frame, including the DATA and trailers of calls still in flight, so the frame is queued
        directly and the connection stays usable until those calls end.
        """
        frame = GoAwayFrame(
            stream_id=0,
            last_stream_id=self.h2_connection.highest_inbound_stream_id,
            error_code=ErrorCodes.NO_ERROR,
        )
        self.h2_connection._prepare_for_sending([frame])
