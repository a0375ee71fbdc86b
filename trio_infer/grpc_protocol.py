"""The server side of gRPC over HTTP/2 as a sans-I/O state machine: bytes in, events out.

Built on purerpc's protocol layer (``purerpc.grpclib``), which drives h2. This is the only module
that imports purerpc or h2 on the server side; :mod:`trio_infer.transport` does the I/O.

What purerpc 0.8.0 gets wrong for a server, and what this module changes:

- A malformed request (bad ``:path``, content type, ``grpc-timeout``...) raises out of
  ``receive_data`` and so takes the whole connection down; here it fails only its own stream
  (:class:`CallRejected`).
- A message over the size limit likewise killed the connection; here it is
  :class:`MessageTooLarge` for its stream only, and the stream's buffer is dropped at once.
- RST_STREAM and GOAWAY from the client were swallowed; here they are :class:`StreamReset` and
  :class:`ConnectionTerminated`, so the transport can cancel the work they orphan.
- h2 3.2.0 (which purerpc pins) treats a WINDOW_UPDATE or RST_STREAM for a stream it has already
  cleaned up as a connection error and sends GOAWAY. RFC 9113 §5.1 says both may arrive shortly
  after a stream closes and must be ignored; grpcio clients send them under load (25 concurrent
  256 KiB calls reproduce it). :class:`_H2Connection` ignores them.
- Windows and stream counts come from :class:`ProtocolLimits` instead of 64 MiB per stream and
  1 GiB per connection, so a client cannot make the server buffer without bound.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeAlias

import h2.connection
import h2.events
import h2.exceptions
import h2.settings
from h2.errors import ErrorCodes
from h2.settings import SettingCodes
from hyperframe.frame import GoAwayFrame
from purerpc.grpclib.buffers import MessageReadBuffer
from purerpc.grpclib.config import GRPCConfiguration
from purerpc.grpclib.connection import GRPCConnection
from purerpc.grpclib.events import (
    MessageReceived,
    RequestEnded,
    RequestReceived,
    WindowUpdated,
)
from purerpc.grpclib.exceptions import MessageTooLargeError
from purerpc.grpclib.exceptions import ProtocolError as _PurerpcProtocolError
from purerpc.grpclib.headers import HeaderDict
from purerpc.grpclib.status import Status

from trio_infer.errors import StatusCode

__all__ = [
    "CallRejected",
    "ConnectionTerminated",
    "MessageReceived",
    "MessageTooLarge",
    "ProtocolLimits",
    "ProtocolViolation",
    "RequestEnded",
    "RequestReceived",
    "ServerProtocol",
    "StreamReset",
    "WindowUpdated",
]

Metadata = tuple[tuple[str, str | bytes], ...]

#: Headers smaller than this are all a V2 client ever sends; the limit bounds per-stream memory.
_MAX_HEADER_LIST_SIZE = 16 * 1024
#: The HTTP/2 default; larger inbound frames cost more memory per read for no gain on loopback.
_MAX_INBOUND_FRAME_SIZE = 16 * 1024


class ProtocolViolation(Exception):
    """The peer broke HTTP/2 so badly the connection must close (a GOAWAY is queued to send)."""


@dataclass(frozen=True)
class ProtocolLimits:
    """Bounds on what one connection may make the server hold.

    Args:
        max_message_size: The largest request message accepted, in bytes.
        max_concurrent_streams: Calls one connection may have open at once (advertised as
            SETTINGS_MAX_CONCURRENT_STREAMS).
        connection_window: Connection-level receive window in bytes: the most request data in
            flight on one connection before the server has consumed it.
    """

    max_message_size: int = 64 * 1024 * 1024
    max_concurrent_streams: int = 100
    connection_window: int = 256 * 1024 * 1024


@dataclass(frozen=True)
class CallRejected:
    """A stream whose request headers are not a valid gRPC call; nothing else is affected."""

    stream_id: int
    status: StatusCode
    message: str


@dataclass(frozen=True)
class MessageTooLarge:
    """A stream's request message exceeds :attr:`ProtocolLimits.max_message_size`."""

    stream_id: int
    message: str


@dataclass(frozen=True)
class StreamReset:
    """The client reset a stream (it cancelled the call)."""

    stream_id: int


@dataclass(frozen=True)
class ConnectionTerminated:
    """The client sent GOAWAY: it will start no new calls on this connection."""


Event: TypeAlias = (
    RequestReceived
    | MessageReceived
    | RequestEnded
    | WindowUpdated
    | CallRejected
    | MessageTooLarge
    | StreamReset
    | ConnectionTerminated
)


class _H2Connection(h2.connection.H2Connection):  # type: ignore[misc]
    """h2's connection, tolerant of the late frames RFC 9113 §5.1 allows on closed streams."""

    def _is_cleaned_up(self, stream_id: int) -> bool:
        return (
            stream_id != 0
            and stream_id not in self.streams
            and stream_id <= self.highest_inbound_stream_id
        )

    def _receive_window_update_frame(self, frame: Any) -> Any:
        if self._is_cleaned_up(frame.stream_id):
            return [], []
        return super()._receive_window_update_frame(frame)

    def _receive_rst_stream_frame(self, frame: Any) -> Any:
        if self._is_cleaned_up(frame.stream_id):
            return [], []
        return super()._receive_rst_stream_frame(frame)


class ServerProtocol(GRPCConnection):  # type: ignore[misc]
    """One server-side gRPC connection's protocol state. Feed it bytes, send what it queues.

    Every method is synchronous and does no I/O: after calling any of them, the caller sends
    :meth:`data_to_send` to the socket.
    """

    def __init__(self, limits: ProtocolLimits) -> None:
        self.limits = limits
        super().__init__(
            GRPCConfiguration(client_side=False, max_message_length=limits.max_message_size)
        )
        # purerpc builds a stock H2Connection in its constructor; swap in the tolerant one
        # before any frame is exchanged.
        self.h2_connection: Any = _H2Connection(self.h2_connection.config)
        self.h2_connection.clear_outbound_data_buffer()
        self._set_h2_connection_local_settings()

    # -- purerpc hooks -------------------------------------------------------------------------

    def _set_h2_connection_local_settings(self) -> None:
        # A stream's window must hold a whole message: data is acknowledged only once the call
        # has taken the message, which is what bounds a stream's buffered bytes.
        self.h2_connection.local_settings = h2.settings.Settings(
            client=False,
            initial_values={
                SettingCodes.MAX_CONCURRENT_STREAMS: self.limits.max_concurrent_streams,
                SettingCodes.INITIAL_WINDOW_SIZE: min(
                    self.limits.max_message_size + 5, 2**31 - 1
                ),
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

    def _request_received(self, event: h2.events.RequestReceived) -> list[Event]:
        stream_id: int = event.stream_id
        try:
            if event.stream_ended:
                raise _PurerpcProtocolError("the request ended before any message was sent")
            request = RequestReceived.parse_from_stream_id_and_headers_destructive(
                stream_id, HeaderDict(event.headers)
            )
            if request.message_encoding not in (None, "identity"):
                # Compressed requests would need a decompressor sized by our limits; clients
                # only compress when told the server accepts it, and we never say so.
                return [
                    CallRejected(
                        stream_id,
                        StatusCode.UNIMPLEMENTED,
                        f"message encoding {request.message_encoding!r} is not supported",
                    )
                ]
        except (_PurerpcProtocolError, KeyError, ValueError) as exc:
            return [CallRejected(stream_id, StatusCode.INTERNAL, f"malformed gRPC request: {exc}")]
        self.message_read_buffers[stream_id] = MessageReadBuffer(
            None, self.limits.max_message_size
        )
        return [request]

    def _data_received(self, event: h2.events.DataReceived) -> list[Event]:
        buffer = self.message_read_buffers.get(event.stream_id)
        if buffer is None:
            # Data for a call already answered (e.g. after MessageTooLarge): drop it, but hand
            # its bytes back or the connection window shrinks for every other call.
            self.h2_connection.acknowledge_received_data(
                event.flow_controlled_length, event.stream_id
            )
            return []
        try:
            buffer.data_received(event.data, event.flow_controlled_length)
        except MessageTooLargeError as exc:
            del self.message_read_buffers[event.stream_id]
            self.h2_connection.acknowledge_received_data(
                event.flow_controlled_length, event.stream_id
            )
            return [MessageTooLarge(event.stream_id, str(exc))]
        return [
            MessageReceived(event.stream_id, message, flow_controlled_length)
            for message, flow_controlled_length in buffer.read_all_complete_messages_flowcontrol()
        ]

    def _stream_ended(self, event: h2.events.StreamEnded) -> list[Event]:
        if self.message_read_buffers.pop(event.stream_id, None) is None:
            return []
        return [RequestEnded(event.stream_id)]

    def _stream_reset(self, event: h2.events.StreamReset) -> list[Event]:
        self.message_read_buffers.pop(event.stream_id, None)
        return [StreamReset(event.stream_id)]

    def _connection_terminated(self, event: h2.events.ConnectionTerminated) -> list[Event]:
        return [ConnectionTerminated()]

    # -- the interface the transport uses ------------------------------------------------------

    def receive_data(self, data: bytes | bytearray) -> list[Event]:
        """Feed bytes read from the socket; return the events they complete.

        Raises:
            ProtocolViolation: the peer broke HTTP/2; a GOAWAY is queued and the connection
                must be closed after sending it.
        """
        try:
            events: list[Event] = super().receive_data(data)
        except h2.exceptions.ProtocolError as exc:
            raise ProtocolViolation(f"HTTP/2 protocol error: {exc}") from exc
        return events

    def send_window(self, stream_id: int) -> int:
        """Bytes of DATA that may be sent on ``stream_id`` now (0 when the stream is closed)."""
        try:
            window: int = self.h2_connection.local_flow_control_window(stream_id)
        except h2.exceptions.StreamClosedError:
            return 0
        return min(window, int(self.h2_connection.max_outbound_frame_size))

    def start_response(self, stream_id: int, metadata: Metadata) -> None:
        """Queue the response headers, with the handler's initial metadata."""
        super().start_response(stream_id, "", metadata)

    def end_response(
        self,
        stream_id: int,
        status: StatusCode,
        message: str,
        metadata: Metadata,
        *,
        headers_sent: bool,
    ) -> None:
        """Queue the trailers that end a call; a call that sent nothing gets a trailers-only
        response. Requests still streaming in are then told to stop (RST_STREAM NO_ERROR)."""
        grpc_status = Status(status.value, message)
        if headers_sent:
            super().end_response(stream_id, grpc_status, metadata)
        else:
            self.respond_status(stream_id, grpc_status, "", metadata)
        if stream_id in self.message_read_buffers:
            del self.message_read_buffers[stream_id]
            self.h2_connection.reset_stream(stream_id, ErrorCodes.NO_ERROR)

    def reset(self, stream_id: int) -> None:
        """Abandon a stream with RST_STREAM CANCEL, if it is still open."""
        self.message_read_buffers.pop(stream_id, None)
        stream = self.h2_connection.streams.get(stream_id)
        if stream is not None and not stream.closed:
            self.h2_connection.reset_stream(stream_id, ErrorCodes.CANCEL)

    def acknowledge(self, stream_id: int, flow_controlled_length: int) -> None:
        """Return a consumed message's bytes to the client's send window."""
        self.h2_connection.acknowledge_received_data(flow_controlled_length, stream_id)

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
