"""An async Open Inference Protocol (KServe V2) client for Trio, built on purerpc.

::

    async with InferenceClient.connect("127.0.0.1", 8081) as client:
        if await client.model_ready("add_sub"):
            result = await client.infer("add_sub", {"INPUT0": a, "INPUT1": b}, timeout=2.0)
            print(result.outputs["OUTPUT0"])

Streams (ModelStreamInfer): ``async with client.stream() as stream:``, then
:meth:`InferStream.send` requests, :meth:`InferStream.done_sending`, and ``async for answer in
stream`` (:class:`StreamAnswer`, matched to its request by ``.id``).

One client is one HTTP/2 connection, shared by every call made through it, from any number of
tasks at once. It does not reconnect: once the connection is lost, every call raises
:class:`~trio_infer.errors.Unavailable` and a new client is needed.

Errors: a call that does not end with status OK raises :class:`~trio_infer.errors.InferError`
or the subclass matching its status (see :data:`ERRORS_BY_STATUS`), with the server's
``grpc-status`` as ``.code`` and its ``grpc-message`` as ``.message``. Failures on this side (a
lost connection, a passed deadline, a malformed response, an unencodable input) are
``InferError`` too, so one ``except InferError`` covers every way a call can fail; only
programming mistakes such as a malformed metadata name raise ``ValueError`` or ``TypeError``.

The calls go through purerpc's client socket, ``GRPCProtoSocket``, whose ``start_request``
is the one purerpc API that sends ``grpc-timeout``. :class:`_ClientSocket` changes what
purerpc 0.8.0 gets wrong for a client that must never hang:

- A lost connection left every call waiting forever, and a failed write crashed the task
  group that spans the caller's ``async with`` block; here both end the calls in flight with
  UNAVAILABLE.
- RST_STREAM from the server was swallowed, so its call waited forever; here it ends the call
  with the status gRPC maps the HTTP/2 error code to.
- GOAWAY made h2 refuse every later frame, failing the calls a draining server had promised to
  finish; here those finish, and only new calls (and calls the server never saw) fail.
- A response over the size limit, or malformed headers, killed the whole connection; here they
  fail only their own call.
- h2 3.2.0 treats a WINDOW_UPDATE or RST_STREAM for a stream it has already forgotten as a
  connection error; RFC 9113 §5.1 lets both arrive shortly after a stream closes.
- A send waiting for flow control on a stream the server had ended (or reset, or whose
  connection was lost) waited forever; here the stream's end wakes it, and it raises the status
  the stream ended with.
- More concurrent calls than the server's SETTINGS_MAX_CONCURRENT_STREAMS raised out of h2;
  here the extra calls wait for a free stream, and no call starts before the server's first
  SETTINGS frame has said what the limit is.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import ssl
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
import anyio.abc
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import numpy as np
import numpy.typing as npt
import outcome
import trio
from google.protobuf.message import DecodeError, Message
from purerpc.grpc_proto import GRPCProtoSocket, GRPCProtoStream
from purerpc.grpc_socket import SocketWrapper
from purerpc.grpclib.buffers import MessageWriteBuffer
from purerpc.grpclib.config import GRPCConfiguration
from purerpc.grpclib.connection import GRPCConnection
from purerpc.grpclib.events import MessageReceived, ResponseEnded, ResponseReceived, WindowUpdated
from purerpc.grpclib.exceptions import ProtocolError as PurerpcProtocolError

from trio_infer.errors import (
    InferError,
    InvalidInput,
    ModelFailed,
    ModelNotFound,
    Overloaded,
    StatusCode,
    Unavailable,
    Unimplemented,
)
from trio_infer.model import ParameterValue
from trio_infer.protobuf._proto import grpc_predict_v2_pb2 as pb
from trio_infer.protobuf.codec import (
    decode_outputs,
    decode_parameters,
    encode_inputs,
    encode_parameters,
)
from trio_infer.transport.grpc_protocol import Metadata

__all__ = [
    "ERRORS_BY_STATUS",
    "InferResult",
    "InferStream",
    "InferenceClient",
    "Metadata",
    "MetadataLike",
    "StreamAnswer",
]

#: Request metadata: ``(name, value)`` pairs or a mapping. Names are case-insensitive (they are
#: sent lower-cased); ``bytes`` values need a name ending in ``-bin``, ``str`` values one that
#: does not.
MetadataLike = Mapping[str, str | bytes] | Iterable[tuple[str, str | bytes]]

#: The exception raised for each status; any other status raises :class:`InferError` itself.
ERRORS_BY_STATUS: Mapping[StatusCode, type[InferError]] = {
    StatusCode.NOT_FOUND: ModelNotFound,
    StatusCode.INVALID_ARGUMENT: InvalidInput,
    StatusCode.UNAVAILABLE: Unavailable,
    StatusCode.RESOURCE_EXHAUSTED: Overloaded,
    StatusCode.UNIMPLEMENTED: Unimplemented,
}

_SERVICE = "inference.GRPCInferenceService"
_MiB = 1024 * 1024

#: How much longer than its timeout a call waits before giving up on its own. The server
#: enforces the same deadline, and its DEADLINE_EXCEEDED needs a moment to travel back; the
#: client's cut-off is the fallback for a server that cannot answer at all.
_DEADLINE_SLACK = 0.1

#: ``grpc-timeout`` holds at most 8 digits. purerpc writes microseconds when the timeout has a
#: fraction of a second, so timeouts too long for that are rounded up to whole seconds.
_MAX_TIMEOUT_VALUE = 99_999_999

#: How gRPC reports a stream the server reset, by HTTP/2 error code (gRPC's PROTOCOL-HTTP2
#: spec); any other code is INTERNAL.
_STATUS_BY_RESET_CODE = {
    h2.errors.ErrorCodes.REFUSED_STREAM: StatusCode.UNAVAILABLE,
    h2.errors.ErrorCodes.CANCEL: StatusCode.CANCELLED,
    h2.errors.ErrorCodes.ENHANCE_YOUR_CALM: StatusCode.RESOURCE_EXHAUSTED,
    h2.errors.ErrorCodes.INADEQUATE_SECURITY: StatusCode.PERMISSION_DENIED,
}

_ResponseT = TypeVar("_ResponseT", bound=Message)


def _error(code: StatusCode, message: str) -> InferError:
    return ERRORS_BY_STATUS.get(code, InferError)(message, code)


# --------------------------------------------------------------------------------------------
# The connection: purerpc's client socket, made to end every call it cannot complete


@dataclass(frozen=True)
class _CallFailed:
    """This side's protocol layer gave up on one call (the server's reset, a bad response)."""

    stream_id: int
    code: StatusCode
    message: str


@dataclass(frozen=True)
class _SettingsReceived:
    """The server's SETTINGS arrived: its limits are known, so calls may start."""


@dataclass(frozen=True)
class _GoAway:
    """The server will start no stream above ``last_stream_id``; the others may finish."""

    last_stream_id: int
    error_code: int


class _H2Connection(h2.connection.H2Connection):  # type: ignore[misc]
    """h2's connection, tolerant of what a gRPC server may legitimately send a client."""

    def _is_forgotten(self, stream_id: int) -> bool:
        return (
            stream_id % 2 == 1
            and stream_id not in self.streams
            and stream_id <= self.highest_outbound_stream_id
        )

    def _receive_window_update_frame(self, frame: Any) -> Any:
        if self._is_forgotten(frame.stream_id):
            return [], []
        return super()._receive_window_update_frame(frame)

    def _receive_rst_stream_frame(self, frame: Any) -> Any:
        if self._is_forgotten(frame.stream_id):
            return [], []
        return super()._receive_rst_stream_frame(frame)

    def _receive_goaway_frame(self, frame: Any) -> Any:
        # h2 would close the connection state and drop queued frames, so the calls the server
        # still means to answer could neither receive nor finish sending. Report it only.
        event = h2.events.ConnectionTerminated()
        event.error_code = frame.error_code
        event.last_stream_id = frame.last_stream_id
        event.additional_data = frame.additional_data or None
        return [], [event]


class _ClientProtocol(GRPCConnection):  # type: ignore[misc]
    """purerpc's client-side protocol state, failing single calls rather than the connection."""

    def __init__(self, max_message_size: int) -> None:
        super().__init__(GRPCConfiguration(client_side=True, max_message_length=max_message_size))
        # purerpc builds a stock H2Connection in its constructor; swap in the tolerant one
        # before any frame is exchanged.
        self.h2_connection: Any = _H2Connection(self.h2_connection.config)
        self.h2_connection.clear_outbound_data_buffer()
        self._set_h2_connection_local_settings()

    def fail(self, stream_id: int, code: StatusCode, message: str) -> list[object]:
        """Abandon a stream (RST_STREAM CANCEL) and report why to its call."""
        self.message_read_buffers.pop(stream_id, None)
        self.reset(stream_id)
        return [_CallFailed(stream_id, code, message)]

    def reset(self, stream_id: int) -> None:
        """Send RST_STREAM CANCEL on a stream that is still open, so the server stops work."""
        stream = self.h2_connection.streams.get(stream_id)
        if stream is not None and not stream.closed:
            self.h2_connection.reset_stream(stream_id, h2.errors.ErrorCodes.CANCEL)

    def _response_received(self, event: h2.events.ResponseReceived) -> list[object]:
        try:
            events: list[Any] = super()._response_received(event)
        except (PurerpcProtocolError, KeyError, ValueError) as exc:
            return self.fail(event.stream_id, StatusCode.INTERNAL, f"malformed response: {exc}")
        if event.stream_ended:
            # A trailers-only response: purerpc hands its metadata to the headers event, but
            # gRPC defines it as trailing metadata.
            received, ended = events
            ended.custom_metadata, received.custom_metadata = received.custom_metadata, ()
        return events

    def _trailers_received(self, event: h2.events.TrailersReceived) -> list[object]:
        try:
            events: list[object] = super()._trailers_received(event)
        except (PurerpcProtocolError, KeyError, ValueError) as exc:
            return self.fail(event.stream_id, StatusCode.INTERNAL, f"malformed trailers: {exc}")
        return events

    def _data_received(self, event: h2.events.DataReceived) -> list[object]:
        stream_id: int = event.stream_id
        buffer = self.message_read_buffers.get(stream_id)
        if buffer is None:
            # Data for a call already given up on: hand its bytes back to the connection window.
            self.h2_connection.acknowledge_received_data(event.flow_controlled_length, stream_id)
            return []
        try:
            buffer.data_received(event.data, event.flow_controlled_length)
            messages = list(buffer.read_all_complete_messages_flowcontrol())
        except PurerpcProtocolError as exc:
            self.h2_connection.acknowledge_received_data(event.flow_controlled_length, stream_id)
            # MessageTooLargeError is the only one a client without compression can meet.
            return self.fail(stream_id, StatusCode.RESOURCE_EXHAUSTED, str(exc))
        return [MessageReceived(stream_id, data, length) for data, length in messages]

    def _stream_reset(self, event: h2.events.StreamReset) -> list[object]:
        self.message_read_buffers.pop(event.stream_id, None)
        try:
            name = h2.errors.ErrorCodes(event.error_code).name
        except ValueError:
            name = str(event.error_code)
        code = _STATUS_BY_RESET_CODE.get(event.error_code, StatusCode.INTERNAL)
        return [_CallFailed(event.stream_id, code, f"the server reset the stream ({name})")]

    def _remote_settings_changed(self, event: h2.events.RemoteSettingsChanged) -> list[object]:
        events: list[object] = super()._remote_settings_changed(event)
        return [*events, _SettingsReceived()]

    def _connection_terminated(self, event: h2.events.ConnectionTerminated) -> list[object]:
        return [_GoAway(event.last_stream_id, int(event.error_code))]


class _SocketWriter(SocketWrapper):  # type: ignore[misc]
    """purerpc's socket writer, reporting a failed write instead of raising it."""

    def __init__(
        self,
        protocol: _ClientProtocol,
        stream: anyio.abc.ByteStream,
        on_failure: Callable[[str], None],
    ) -> None:
        super().__init__(protocol, stream)
        self._on_failure = on_failure

    async def _writer_thread(self) -> None:
        try:
            await super()._writer_thread()
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
            # Raised, it would cancel the task group that spans the caller's whole block.
            self._on_failure(f"writing to the server failed: {exc!r}")


class _ClientStream(GRPCProtoStream):  # type: ignore[misc]
    """purerpc's stream of one call, remembering how the server ended it."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.ended: ResponseEnded | _CallFailed | None = None
        """The first event that ended the call (its status, or a reset), once one has."""

    def end(self, event: ResponseEnded | _CallFailed) -> None:
        """Record the call's end and wake a sender waiting for flow control: it sends no more."""
        if self.ended is None:
            self.ended = event
        self.wake_sender()

    def wake_sender(self) -> None:
        self._flow_control_update_event.set()


class _ClientSocket(GRPCProtoSocket):  # type: ignore[misc]
    """purerpc's client socket; see the module docstring for what it changes and why."""

    StreamClass = _ClientStream

    def __init__(self, stream: anyio.abc.ByteStream, max_message_size: int) -> None:
        super().__init__(GRPCConfiguration(client_side=True), stream)
        # Replace the protocol and writer purerpc's constructor made, before anything runs.
        self.protocol = _ClientProtocol(max_message_size)
        self._grpc_connection = self.protocol
        self._socket = _SocketWriter(self.protocol, stream, self.lose)
        self.failure: str | None = None
        """Why the connection can carry no more calls, once it cannot."""
        self.refusal: str | None = None
        """Why new calls may not start here (GOAWAY), while older ones may finish."""
        self._stream_freed = trio.Event()
        self.settings_received = trio.Event()
        """Set once the server's first SETTINGS frame arrives (or the connection is lost)."""

    def lose(self, reason: str) -> None:
        """Give up on the connection: end every call in flight with UNAVAILABLE."""
        if self.failure is None:
            self.failure = reason
        for stream in self._streams.values():
            # Wakes the call: its receive raises EndOfStream once queued events are read.
            stream._incoming_events[0].close()
            stream.wake_sender()
        self._free_stream()
        self.settings_received.set()

    def release(self, stream: Any) -> None:
        """Forget a call's stream, resetting it first if the server has not ended it."""
        stream_id: int = stream.stream_id
        self._streams.pop(stream_id, None)
        # anyio warns about memory streams nobody closed; purerpc never closes them.
        for end in stream._incoming_events:
            end.close()
        self.protocol.message_read_buffers.pop(stream_id, None)
        if self.failure is None:
            self.protocol.reset(stream_id)
            self._socket._flush_event.set()
        self._free_stream()

    async def open_stream(
        self,
        method: str,
        authority: str,
        grpc_timeout: datetime.timedelta | None,
        metadata: Metadata,
    ) -> Any:
        """Start a call: send its request headers on a new stream, and return the stream."""
        stream_id = self.protocol.get_next_available_stream_id()
        try:
            return await self.start_request(
                "http",
                _SERVICE,
                method,
                authority=authority,
                timeout=grpc_timeout,
                custom_metadata=metadata,
            )
        except BaseException:
            # purerpc registers the stream before h2 accepts the headers.
            stream = self._streams.pop(stream_id, None)
            if stream is not None:
                for end in stream._incoming_events:
                    end.close()
            raise

    async def wait_for_stream(self) -> None:
        """Wait until the server's limit on concurrent streams lets one more call start."""
        h2_connection = self.protocol.h2_connection
        while (
            self.failure is None
            and self.refusal is None
            and h2_connection.open_outbound_streams
            >= h2_connection.remote_settings.max_concurrent_streams
        ):
            await self._stream_freed.wait()

    def _free_stream(self) -> None:
        self._stream_freed.set()
        self._stream_freed = trio.Event()

    async def _reader_thread(self) -> None:
        reason = "the server closed the connection"
        try:
            while True:
                try:
                    data = await self._socket.recv(self._receive_buffer_size)
                except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
                    return
                except ssl.SSLError as exc:
                    # anyio raises the server's TLS alert as it is (a client certificate
                    # refused, say); raised here, it would fail the whole connect() block.
                    reason = f"TLS failed: {exc.reason or exc}"
                    return
                try:
                    events = self.protocol.receive_data(data)
                except (h2.exceptions.ProtocolError, PurerpcProtocolError) as exc:
                    reason = f"the server broke the HTTP/2 protocol: {exc}"
                    return
                await self._socket.flush()
                for event in events:
                    await self._dispatch(event)
        finally:
            self.lose(reason)

    async def _dispatch(self, event: object) -> None:
        if isinstance(event, WindowUpdated):
            if event.stream_id == 0:
                for stream in self._streams.values():
                    await stream._set_flow_control_update()
            elif event.stream_id in self._streams:
                await self._streams[event.stream_id]._set_flow_control_update()
        elif isinstance(event, _SettingsReceived):
            self.settings_received.set()
        elif isinstance(event, _GoAway):
            self._go_away(event)
        else:
            stream_id: int = getattr(event, "stream_id", 0)
            stream = self._streams.get(stream_id)
            if stream is None:
                return  # a call already given up on
            _deliver(stream, event)
            if isinstance(event, ResponseEnded | _CallFailed):
                stream.end(event)
                stream._close_remote()

    def _go_away(self, event: _GoAway) -> None:
        try:
            why = h2.errors.ErrorCodes(event.error_code).name
        except ValueError:
            why = str(event.error_code)
        self.refusal = f"the server is closing the connection (GOAWAY {why})"
        for stream_id, stream in list(self._streams.items()):
            if stream_id > event.last_stream_id:
                # The server never saw these calls: safe to retry elsewhere.
                failed = _CallFailed(stream_id, StatusCode.UNAVAILABLE, self.refusal)
                _deliver(stream, failed)
                stream.end(failed)
        self._free_stream()


def _deliver(stream: Any, event: object) -> None:
    # Closed once the connection was given up on after a failed write: the call knows already.
    with contextlib.suppress(anyio.ClosedResourceError):
        # The buffer is unbounded, so this never blocks the reader.
        stream._incoming_events[0].send_nowait(event)


# --------------------------------------------------------------------------------------------
# The client


@dataclass(frozen=True, eq=False)
class InferResult:
    """What a successful :meth:`InferenceClient.infer` returns.

    ``result["OUTPUT0"]`` is short for ``result.outputs["OUTPUT0"]``.
    """

    outputs: dict[str, np.ndarray]
    """The output tensors by name, in the response's order. Raw numeric outputs are read-only
    views of the response's bytes; BYTES outputs are object arrays of ``bytes``."""
    model_name: str
    """The model that answered."""
    model_version: str
    """Its version, ``""`` when the model has none."""
    id: str
    """The request's ``request_id``, echoed by the server."""
    parameters: dict[str, ParameterValue]
    """The response's parameters."""
    initial_metadata: Metadata
    """Metadata the server sent with its response headers."""
    trailing_metadata: Metadata
    """Metadata the server sent with the status."""

    def __getitem__(self, name: str) -> np.ndarray:
        """Return the output tensor called ``name``.

        Raises:
            KeyError: If the response has no such output.
        """
        return self.outputs[name]


@dataclass(frozen=True, eq=False)
class StreamAnswer:
    """One answer on a stream (:meth:`InferenceClient.stream`): a request's outputs, or its error.

    ``answer["OUTPUT0"]`` is short for ``answer.outputs["OUTPUT0"]``, and raises
    :attr:`error` for an answer that has one.
    """

    id: str
    """The request's ``request_id``, echoed by the server: answers come in the order requests
    finish, so this is how an answer is matched to its request."""
    model_name: str
    """The model the request was for."""
    model_version: str
    """Its version, ``""`` when the model has none (or the server did not say)."""
    outputs: dict[str, np.ndarray]
    """The output tensors by name, decoded as :meth:`InferenceClient.infer` decodes them;
    empty when :attr:`error` is set."""
    parameters: dict[str, ParameterValue]
    """The response's parameters."""
    error: InferError | None
    """Why the request failed, or None. The protocol carries only the text of a stream
    message's error (``error_message``), not its status, so its ``.code`` is always UNKNOWN
    (INTERNAL for an answer this client cannot decode); ``.message`` is the server's text, e.g.
    ``"deadline exceeded (the request's timeout parameter)"``."""

    def __getitem__(self, name: str) -> np.ndarray:
        """Return the output tensor called ``name``.

        Raises:
            InferError: :attr:`error`, if the request failed.
            KeyError: If the response has no such output.
        """
        if self.error is not None:
            raise self.error
        return self.outputs[name]


@dataclass(frozen=True)
class _Reply:
    message: bytes
    initial_metadata: Metadata
    trailing_metadata: Metadata


class InferenceClient:
    """A connection to an Open Inference Protocol gRPC server; make one with :meth:`connect`.

    Every method takes two optional keyword arguments:

    - ``timeout``: seconds the call may take. It is sent as ``grpc-timeout`` so the server
      stops working on the call once it passes, and also enforced here; either way the call
      raises :class:`~trio_infer.errors.InferError` with status DEADLINE_EXCEEDED.
      ``None`` means no deadline of the call's own. The deadline of an enclosing cancel scope
      (``with trio.fail_after(2):``) is sent too, whichever is sooner; when that one passes
      the scope cancels the call the usual Trio way.
    - ``metadata``: request headers, e.g. ``[("x-user", "me")]``; models read them as
      ``parameters.headers``. See :data:`MetadataLike`.

    Cancelling a task during a call resets the call's stream, so the server stops its work.
    """

    def __init__(self, socket: _ClientSocket, authority: str) -> None:
        # Private: the socket is only ever made, and its lifetime owned, by connect().
        self._socket = socket
        self._authority = authority

    @classmethod
    @asynccontextmanager
    async def connect(
        cls,
        host: str,
        port: int,
        *,
        max_message_size: int = 64 * _MiB,
        ssl_context: ssl.SSLContext | None = None,
    ) -> AsyncIterator[InferenceClient]:
        """Connect to a server; the connection closes when the ``async with`` block ends.

        Args:
            host: The server's address or host name.
            port: Its gRPC port.
            max_message_size: The largest request and response message this client sends or
                accepts, in bytes (the server has its own limit).
            ssl_context: Connect with TLS, checking the server's certificate against ``host``
                (e.g. ``ssl.create_default_context(cafile=...)``; for mutual TLS, with
                ``load_cert_chain`` called on it). gRPC servers expect ALPN ``h2``:
                ``ssl_context.set_alpn_protocols(["h2"])``. Plaintext when None.

        Returns:
            An async context manager that yields the connected client.

        Raises:
            Unavailable: If the server cannot be reached, or the TLS handshake fails.
        """
        authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        stream: anyio.abc.ByteStream
        try:
            if ssl_context is None:
                stream = await anyio.connect_tcp(host, port)
            else:
                # Not standard-compatible: HTTP/2 ends a connection with GOAWAY, so closing
                # need not wait for the server's close_notify, which gRPC servers may not send.
                stream = await anyio.connect_tcp(
                    host, port, ssl_context=ssl_context, tls_standard_compatible=False
                )
        except (OSError, anyio.BrokenResourceError) as exc:
            # A failed handshake is an ssl.SSLError (an OSError), or a BrokenResourceError
            # when the server closed the connection during it.
            raise Unavailable(f"cannot connect to {authority}: {exc}") from exc
        # Exceptions are raised after the socket's task group has exited: raised through it,
        # they would come out wrapped in an ExceptionGroup.
        failure: str | None = None
        body_error: BaseException | None = None
        async with stream:
            socket = _ClientSocket(stream, max_message_size)
            async with socket:
                # Until the server's SETTINGS arrive h2 assumes no limit on concurrent streams,
                # and a burst of calls past the server's real limit would fail.
                await socket.settings_received.wait()
                failure = socket.failure
                if failure is None:
                    try:
                        yield cls(socket, authority)
                    except GeneratorExit:
                        raise  # closed without exiting the block: nothing to re-raise later
                    except BaseException as exc:
                        body_error = exc
        if failure is not None:
            raise Unavailable(f"cannot connect to {authority}: {failure}")
        if body_error is not None:
            raise body_error

    # -- health and metadata -------------------------------------------------------------------

    async def server_live(
        self,
        *,
        timeout: float | None = None,  # noqa: ASYNC109 (sent to the server as grpc-timeout)
        metadata: MetadataLike | None = None,
    ) -> bool:
        """Ask whether the server is live (serving requests at all).

        Returns:
            The server's answer.

        Raises:
            InferError: If the call fails (see the class docstring).
        """
        response, _ = await self._call(
            "ServerLive", pb.ServerLiveRequest(), pb.ServerLiveResponse, timeout, metadata
        )
        return response.live

    async def server_ready(
        self,
        *,
        timeout: float | None = None,  # noqa: ASYNC109 (sent to the server as grpc-timeout)
        metadata: MetadataLike | None = None,
    ) -> bool:
        """Ask whether every model is loaded and the server is not shutting down.

        Returns:
            The server's answer.

        Raises:
            InferError: If the call fails (see the class docstring).
        """
        response, _ = await self._call(
            "ServerReady", pb.ServerReadyRequest(), pb.ServerReadyResponse, timeout, metadata
        )
        return response.ready

    async def model_ready(
        self,
        name: str,
        version: str = "",
        *,
        timeout: float | None = None,  # noqa: ASYNC109 (sent to the server as grpc-timeout)
        metadata: MetadataLike | None = None,
    ) -> bool:
        """Ask whether a model can serve inference requests now.

        Args:
            name: The model's name.
            version: The model's version; ``""`` for the server's choice.

        Returns:
            The server's answer.

        Raises:
            ModelNotFound: If the server has no such model or version.
            InferError: If the call fails otherwise (see the class docstring).
        """
        request = pb.ModelReadyRequest(name=name, version=version)
        response, _ = await self._call(
            "ModelReady", request, pb.ModelReadyResponse, timeout, metadata
        )
        return response.ready

    async def server_metadata(
        self,
        *,
        timeout: float | None = None,  # noqa: ASYNC109 (sent to the server as grpc-timeout)
        metadata: MetadataLike | None = None,
    ) -> pb.ServerMetadataResponse:
        """Fetch the server's name, version and protocol extensions.

        Returns:
            The server's ``ServerMetadataResponse``.

        Raises:
            InferError: If the call fails (see the class docstring).
        """
        response, _ = await self._call(
            "ServerMetadata",
            pb.ServerMetadataRequest(),
            pb.ServerMetadataResponse,
            timeout,
            metadata,
        )
        return response

    async def model_metadata(
        self,
        name: str,
        version: str = "",
        *,
        timeout: float | None = None,  # noqa: ASYNC109 (sent to the server as grpc-timeout)
        metadata: MetadataLike | None = None,
    ) -> pb.ModelMetadataResponse:
        """Fetch a model's versions, platform, and declared inputs and outputs.

        Args:
            name: The model's name.
            version: The model's version; ``""`` for the server's choice.

        Returns:
            The server's ``ModelMetadataResponse``.

        Raises:
            ModelNotFound: If the server has no such model or version.
            InferError: If the call fails otherwise (see the class docstring).
        """
        request = pb.ModelMetadataRequest(name=name, version=version)
        response, _ = await self._call(
            "ModelMetadata", request, pb.ModelMetadataResponse, timeout, metadata
        )
        return response

    # -- inference -----------------------------------------------------------------------------

    async def infer(
        self,
        model_name: str,
        inputs: Mapping[str, npt.ArrayLike],
        *,
        version: str = "",
        parameters: Mapping[str, ParameterValue] | None = None,
        outputs: Sequence[str] | None = None,
        raw: bool = True,
        request_id: str = "",
        timeout: float | None = None,  # noqa: ASYNC109 (sent to the server as grpc-timeout)
        metadata: MetadataLike | None = None,
    ) -> InferResult:
        """Run a model on some inputs.

        Args:
            model_name: The model to run.
            inputs: The input tensors by name; anything ``numpy.asarray`` takes. The datatype
                follows the dtype (see :data:`trio_infer.datatypes.DATATYPES`); arrays of
                ``bytes`` or ``str`` (as object or numpy string arrays) are BYTES, with ``str``
                sent as UTF-8.
            version: The model's version; ``""`` for the server's choice.
            parameters: Request parameters, e.g. ``{"delay_ms": 5}``.
            outputs: The outputs to return, in this order; ``None`` for all of them in the
                model's order.
            raw: Send tensors as raw bytes (faster) rather than typed protobuf fields. Any
                FP16 input makes the request raw. trio-infer answers raw either way, as Triton
                does (the parameter ``binary_data_output: false`` asks it for typed outputs);
                this client reads both.
            request_id: An id the server echoes in :attr:`InferResult.id`.
            timeout: See the class docstring.
            metadata: See the class docstring.

        Returns:
            The outputs and the response's details.

        Raises:
            InvalidInput: If an input has no protocol datatype or a parameter has an unsupported
                type (raised before anything is sent), or the server rejects the request.
            ModelNotFound: If the server has no such model or version.
            InferError: If the call fails otherwise (see the class docstring).
            TypeError: If ``outputs`` is a single string rather than a sequence of names.
        """
        request = _infer_request(model_name, inputs, version, parameters, outputs, raw, request_id)
        response, reply = await self._call(
            "ModelInfer", request, pb.ModelInferResponse, timeout, metadata
        )
        try:
            decoded = decode_outputs(response)
            response_parameters = decode_parameters(response.parameters)
        except InferError as exc:
            raise InferError(
                f"the server's response is malformed: {exc.message}", StatusCode.INTERNAL
            ) from None
        return InferResult(
            outputs=decoded,
            model_name=response.model_name,
            model_version=response.model_version,
            id=response.id,
            parameters=response_parameters,
            initial_metadata=reply.initial_metadata,
            trailing_metadata=reply.trailing_metadata,
        )

    @asynccontextmanager
    async def stream(
        self,
        *,
        timeout: float | None = None,  # noqa: ASYNC109 (sent to the server as grpc-timeout)
        metadata: MetadataLike | None = None,
    ) -> AsyncIterator[InferStream]:
        """Open a ModelStreamInfer stream: many requests, each answered on its own.

        ::

            async with client.stream(timeout=60) as stream:
                await stream.send("add_sub", {"INPUT0": a, "INPUT1": b}, request_id="1")
                await stream.done_sending()
                async for answer in stream:
                    print(answer.id, answer.error or answer.outputs)

        Leaving the block cancels the stream (RST_STREAM CANCEL) if the server has not ended
        it, so the server stops working on every request still in flight. ``timeout`` bounds
        the whole stream, as does the deadline of an enclosing cancel scope (both are sent as
        ``grpc-timeout``; see the class docstring); ``metadata`` is sent with the stream and
        reaches every request's model. See :class:`InferStream` for sending and receiving.

        Returns:
            An async context manager that yields the open :class:`InferStream`.

        Raises:
            InferError: If the stream cannot be opened (see the class docstring).
        """
        headers = _checked_metadata(metadata)
        deadline = None
        if timeout is not None and timeout != math.inf:
            if not timeout > 0:
                raise ValueError(f"timeout must be a positive number of seconds, not {timeout!r}")
            deadline = trio.current_time() + timeout
        socket = self._socket
        with trio.CancelScope(deadline=_local_deadline(deadline)) as opening:
            await socket.wait_for_stream()
        if opening.cancelled_caught:
            raise InferError("deadline exceeded", StatusCode.DEADLINE_EXCEEDED)
        self._check_usable()
        wire_deadline, wire_timeout = _wire_deadline(deadline)
        raw_stream = await socket.open_stream(
            "ModelStreamInfer", self._authority, wire_timeout, headers
        )
        stream = InferStream(socket, raw_stream, self._authority, deadline, wire_deadline)
        try:
            yield stream
        finally:
            stream._close()
            socket.release(raw_stream)

    def _check_usable(self) -> None:
        """Raises Unavailable: the connection is lost, or the server takes no new calls."""
        socket = self._socket
        if socket.failure is not None:
            raise Unavailable(f"connection to {self._authority} lost: {socket.failure}")
        if socket.refusal is not None:
            raise Unavailable(socket.refusal)

    # -- one unary call ------------------------------------------------------------------------

    async def _call(
        self,
        method: str,
        request: Message,
        response_type: type[_ResponseT],
        timeout: float | None,  # noqa: ASYNC109 (sent to the server as grpc-timeout)
        metadata: MetadataLike | None,
    ) -> tuple[_ResponseT, _Reply]:
        headers = _checked_metadata(metadata)
        data = request.SerializeToString()
        limit = self._socket.protocol.config.max_message_length
        if len(data) > limit:
            raise Overloaded(
                f"the {method} request is {len(data)} bytes, over this client's "
                f"max_message_size of {limit}"
            )
        if timeout is None or timeout == math.inf:
            reply = await self._exchange(method, data, headers, None)
        else:
            if not timeout > 0:
                raise ValueError(f"timeout must be a positive number of seconds, not {timeout!r}")
            deadline = trio.current_time() + timeout
            with trio.move_on_after(timeout + _DEADLINE_SLACK):
                reply = await self._exchange(method, data, headers, deadline)
                return _parse(response_type, reply), reply
            raise InferError("deadline exceeded", StatusCode.DEADLINE_EXCEEDED)
        return _parse(response_type, reply), reply

    async def _exchange(
        self, method: str, data: bytes, headers: Metadata, deadline: float | None
    ) -> _Reply:
        socket = self._socket
        await socket.wait_for_stream()
        self._check_usable()
        _, wire_timeout = _wire_deadline(deadline)
        stream = await socket.open_stream(method, self._authority, wire_timeout, headers)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_send, stream, data)
                # Captured, then raised outside the nursery: inside, the call's own error would
                # come out wrapped in an ExceptionGroup.
                reply = await outcome.acapture(self._receive, stream, deadline)
                # The server may answer (an error, say) before taking the whole request.
                nursery.cancel_scope.cancel()
            return reply.unwrap()
        finally:
            socket.release(stream)

    async def _receive(self, stream: Any, deadline: float | None) -> _Reply:
        initial: Metadata = ()
        message: bytes | None = None
        while True:
            try:
                event = await stream._incoming_events[1].receive()
            except anyio.EndOfStream:
                raise Unavailable(
                    f"connection to {self._authority} lost: {self._socket.failure}"
                ) from None
            if isinstance(event, ResponseReceived):
                initial = tuple(event.custom_metadata)
            elif isinstance(event, MessageReceived):
                self._socket.protocol.acknowledge_received_data(
                    stream.stream_id, event.flow_controlled_length
                )
                await self._socket._socket.flush()
                if message is not None:
                    raise InferError(
                        "the server sent more than one message for a unary call",
                        StatusCode.INTERNAL,
                    )
                message = event.data
            elif isinstance(event, ResponseEnded):
                break
            elif isinstance(event, _CallFailed):
                if deadline is not None and trio.current_time() >= deadline:
                    # The server resets a call whose deadline passed mid-message.
                    raise InferError("deadline exceeded", StatusCode.DEADLINE_EXCEEDED)
                raise _error(event.code, event.message)
        error = _status_error(event)
        if error is not None:
            raise error
        if message is None:
            raise InferError(
                "the server ended a unary call without a response", StatusCode.INTERNAL
            )
        return _Reply(message, initial, tuple(event.custom_metadata))


class InferStream:
    """An open ModelStreamInfer stream; made by :meth:`InferenceClient.stream`.

    Each request sent is a request of its own on the server, answered as soon as it is done:
    answers come in the order requests finish, each carrying its request's id (give every
    request a distinct ``request_id``). A request that fails gets an answer with
    :attr:`StreamAnswer.error` and the stream goes on; the stream itself ends when the client
    is done sending and every request has been answered, or, with an error status, on its
    deadline, a server that refuses a message outright (RESOURCE_EXHAUSTED), a shutdown past
    its grace period or a lost connection (UNAVAILABLE).

    Sending and receiving are independent: send from one task and iterate in another (a
    ``trio`` nursery inside the stream's block) when there are more requests than answers the
    connection can hold unread. Several tasks may send at once (each request is written
    whole); :meth:`send` waits for HTTP/2 flow control, so a server that takes requests more
    slowly than they are sent holds the sender back.

    Every error is an :class:`~trio_infer.errors.InferError`, as for unary calls; a
    :meth:`send` or :meth:`done_sending` on a stream whose block was left, or a :meth:`send`
    after :meth:`done_sending`, raises :class:`trio.ClosedResourceError`.
    """

    def __init__(
        self,
        socket: _ClientSocket,
        stream: _ClientStream,
        authority: str,
        deadline: float | None,
        wire_deadline: float,
    ) -> None:
        # Private: made, and closed, by InferenceClient.stream().
        self._socket = socket
        self._stream = stream
        self._authority = authority
        self._deadline = deadline  # the stream's own timeout, enforced here as a fallback
        self._wire_deadline = wire_deadline  # the deadline the server enforces
        self._sending = trio.StrictFIFOLock()
        self._receiving = trio.StrictFIFOLock()
        self._done_sending = False
        self._closed = False
        self._broken: InferError | None = None  # why this side abandoned the stream
        self._finished = False
        self._final: InferError | None = None  # how iteration ended, once it has
        self.initial_metadata: Metadata = ()
        """Metadata the server sent with its response headers (once an answer has arrived)."""
        self.trailing_metadata: Metadata = ()
        """Metadata the server sent with the stream's status (once iteration has ended)."""

    async def send(
        self,
        model_name: str,
        inputs: Mapping[str, npt.ArrayLike],
        *,
        version: str = "",
        parameters: Mapping[str, ParameterValue] | None = None,
        outputs: Sequence[str] | None = None,
        raw: bool = True,
        request_id: str = "",
        timeout: float | None = None,  # noqa: ASYNC109 (sent to the server as a parameter)
    ) -> None:
        """Send one request on the stream; its answer comes through iteration.

        The arguments are :meth:`InferenceClient.infer`'s, but for ``timeout``.

        Args:
            timeout: Seconds this request may take on the server, sent as the request's
                ``timeout`` parameter (microseconds, Triton's name, as tritonclient's
                ``async_stream_infer(timeout=)``): past it the request is answered with an
                error ("deadline exceeded ...") and the stream goes on. ``None``: bounded by
                the stream's deadline only.

        Raises:
            InvalidInput: If an input has no protocol datatype or a parameter has an unsupported
                type (raised before anything is sent).
            Overloaded: If the request is larger than the client's ``max_message_size``
                (raised before anything is sent).
            InferError: If the stream has ended or ends while this request is being written:
                the stream's own final status (the server's, e.g. RESOURCE_EXHAUSTED,
                DEADLINE_EXCEEDED or UNAVAILABLE, or UNAVAILABLE for a lost connection), not
                merely that the write failed. A stream the server ended with OK, before this
                request was sent, raises FAILED_PRECONDITION.
            trio.ClosedResourceError: After :meth:`done_sending`, or outside the block.
            ValueError: If ``timeout`` is not positive, or a ``timeout`` parameter is given
                too.
            TypeError: If ``outputs`` is a single string rather than a sequence of names.

        A send cancelled (by an enclosing cancel scope) before any of its bytes were written
        leaves the stream as it was; one cancelled part-way resets the stream, which then
        fails with CANCELLED.
        """
        request = _infer_request(model_name, inputs, version, parameters, outputs, raw, request_id)
        if timeout is not None and timeout != math.inf:
            if not timeout > 0:
                raise ValueError(f"timeout must be a positive number of seconds, not {timeout!r}")
            if parameters and "timeout" in parameters:
                raise ValueError(
                    "give the request's timeout as timeout= or as a parameter, not both"
                )
            request.parameters["timeout"].int64_param = max(1, math.ceil(timeout * 1_000_000))
        data = request.SerializeToString()
        limit = self._socket.protocol.config.max_message_length
        if len(data) > limit:
            raise Overloaded(
                f"the ModelStreamInfer request is {len(data)} bytes, over this client's "
                f"max_message_size of {limit}"
            )
        async with self._sending:
            if self._done_sending:
                raise trio.ClosedResourceError("done_sending() was called: no more requests")
            with trio.CancelScope(deadline=_local_deadline(self._deadline)) as scope:
                await self._write(data)
            if scope.cancelled_caught:
                raise self._break(StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")

    async def done_sending(self) -> None:
        """Tell the server no more requests are coming (half-close the stream).

        The server answers the requests in flight and then ends the stream, which ends
        iteration. Calling it again does nothing; on a stream that has already ended, it does
        nothing either (iteration reports how it ended).

        Raises:
            trio.ClosedResourceError: Outside the stream's block.
        """
        async with self._sending:
            if self._closed:
                raise trio.ClosedResourceError("the stream's block has been left")
            if self._done_sending:
                return
            self._done_sending = True
            if self._ending() is None:
                with contextlib.suppress(h2.exceptions.StreamClosedError):
                    await self._stream.close()

    def __aiter__(self) -> InferStream:
        return self

    async def __anext__(self) -> StreamAnswer:
        """The next answer, in the order the server sends them.

        Raises:
            StopAsyncIteration: Once the server has ended the stream with OK (after
                :meth:`done_sending` and every answer).
            InferError: If the stream ends with another status, again on every later call.
            trio.ClosedResourceError: Outside the stream's block.
        """
        async with self._receiving:
            if self._finished:
                if self._final is None:
                    raise StopAsyncIteration
                raise _error(self._final.code, self._final.message)
            with trio.CancelScope(deadline=_local_deadline(self._deadline)) as scope:
                return await self._next_answer()
            assert scope.cancelled_caught
            raise self._finish(self._break(StatusCode.DEADLINE_EXCEEDED, "deadline exceeded"))

    async def _next_answer(self) -> StreamAnswer:
        stream = self._stream
        while True:
            if self._closed:
                raise trio.ClosedResourceError("the stream's block has been left")
            if self._broken is not None:
                raise self._finish(self._broken)
            try:
                event = await stream._incoming_events[1].receive()
            except (anyio.EndOfStream, anyio.ClosedResourceError):
                lost = Unavailable(f"connection to {self._authority} lost: {self._socket.failure}")
                raise self._finish(self._ending() or lost) from None
            if isinstance(event, ResponseReceived):
                self.initial_metadata = tuple(event.custom_metadata)
            elif isinstance(event, MessageReceived):
                self._socket.protocol.acknowledge_received_data(
                    stream.stream_id, event.flow_controlled_length
                )
                await self._socket._socket.flush()
                return self._answer(event.data)
            elif isinstance(event, ResponseEnded):
                self.trailing_metadata = tuple(event.custom_metadata)
                error = _status_error(event)
                if error is None:
                    self._finished = True
                    raise StopAsyncIteration
                raise self._finish(error)
            elif isinstance(event, _CallFailed):
                raise self._finish(self._failed(event))
            # Anything else (_Woken) only makes the loop look at the stream's state again.

    def _answer(self, data: bytes) -> StreamAnswer:
        try:
            response = pb.ModelStreamInferResponse.FromString(data)
        except DecodeError as exc:
            name = pb.ModelStreamInferResponse.DESCRIPTOR.full_name
            raise self._finish(
                self._break(StatusCode.INTERNAL, f"an answer is not a valid {name}: {exc}")
            ) from None
        infer = response.infer_response
        error: InferError | None = None
        outputs: dict[str, np.ndarray] = {}
        parameters: dict[str, ParameterValue] = {}
        if response.error_message:
            error = InferError(response.error_message, StatusCode.UNKNOWN)
        else:
            try:
                outputs = decode_outputs(infer)
                parameters = decode_parameters(infer.parameters)
            except InferError as exc:
                error = InferError(
                    f"the server's response is malformed: {exc.message}", StatusCode.INTERNAL
                )
        return StreamAnswer(
            id=infer.id,
            model_name=infer.model_name,
            model_version=infer.model_version,
            outputs=outputs,
            parameters=parameters,
            error=error,
        )

    async def _write(self, data: bytes) -> None:
        """Write one message, as HTTP/2 flow control lets it through."""
        stream = self._stream
        protocol = self._socket.protocol
        buffer = MessageWriteBuffer(None, protocol.config.max_message_length)
        buffer.write_message(data)
        written = False
        try:
            while buffer:
                if self._closed:
                    raise trio.ClosedResourceError("the stream's block has been left")
                error = self._ending()
                if error is not None:
                    raise error
                try:
                    window = protocol.flow_control_window(stream.stream_id)
                    if window > 0:
                        chunk = buffer.data_to_send(min(window, len(buffer)))
                        protocol.send_data(stream.stream_id, chunk)
                except h2.exceptions.StreamClosedError:
                    # h2 forgets a stream the moment it is reset; the reset's event follows.
                    raise self._ending() or InferError(
                        "the stream was closed", StatusCode.INTERNAL
                    ) from None
                if window > 0:
                    written = True
                    await self._socket._socket.flush()
                else:
                    # Woken by a WINDOW_UPDATE, the stream's end or the connection's loss.
                    await stream._wait_flow_control_update()
        except BaseException:
            if written and buffer and self._ending() is None and not self._closed:
                # Part of a message is on the wire; the rest will never follow.
                self._break(StatusCode.CANCELLED, "a send was cancelled part-way through a request")
            raise

    def _ending(self) -> InferError | None:
        """Why the stream carries no more requests (the server ended it, this side gave up
        on it, or the connection is lost), or None while it does."""
        if self._broken is not None:
            return _error(self._broken.code, self._broken.message)
        ended = self._stream.ended
        if isinstance(ended, ResponseEnded):
            return _status_error(ended) or InferError(
                "the server ended the stream (status OK) before this request was sent",
                StatusCode.FAILED_PRECONDITION,
            )
        if isinstance(ended, _CallFailed):
            return self._failed(ended)
        if self._socket.failure is not None:
            return Unavailable(f"connection to {self._authority} lost: {self._socket.failure}")
        return None

    def _failed(self, event: _CallFailed) -> InferError:
        if trio.current_time() >= self._wire_deadline:
            # The server resets a stream whose deadline passed mid-message.
            return InferError("deadline exceeded", StatusCode.DEADLINE_EXCEEDED)
        return _error(event.code, event.message)

    def _break(self, code: StatusCode, message: str) -> InferError:
        """Give up on the stream from this side: reset it, and wake whoever waits on it."""
        self._broken = _error(code, message)
        if self._socket.failure is None:
            self._socket.protocol.reset(self._stream.stream_id)
            self._socket._socket._flush_event.set()
        self._wake()
        return _error(code, message)

    def _finish(self, error: InferError) -> InferError:
        """End iteration with ``error``, which every later ``__anext__`` raises again."""
        self._finished = True
        self._final = error
        return error

    def _wake(self) -> None:
        self._stream.wake_sender()
        _deliver(self._stream, _Woken())

    def _close(self) -> None:
        """The stream's block is left: whoever still waits on it is woken to find it closed."""
        self._closed = True
        self._wake()


@dataclass(frozen=True)
class _Woken:
    """Put on a stream's event queue so a task iterating it looks at its state again."""


def _local_deadline(deadline: float | None) -> float:
    """When this side gives up on a call whose deadline is ``deadline``: a little later, so the
    server's own answer (DEADLINE_EXCEEDED) has the time to arrive."""
    return math.inf if deadline is None else deadline + _DEADLINE_SLACK


async def _send(stream: Any, data: bytes) -> None:
    try:
        await stream._send(data)
        await stream.close()
    except h2.exceptions.StreamClosedError:
        pass  # the server ended the call first; the receiving side reports its status


def _infer_request(
    model_name: str,
    inputs: Mapping[str, npt.ArrayLike],
    version: str,
    parameters: Mapping[str, ParameterValue] | None,
    outputs: Sequence[str] | None,
    raw: bool,
    request_id: str,
) -> pb.ModelInferRequest:
    if isinstance(outputs, str):
        raise TypeError(f"outputs must be a sequence of output names, not a str: [{outputs!r}]")
    request = pb.ModelInferRequest(model_name=model_name, model_version=version, id=request_id)
    encode_inputs(request, [(name, np.asarray(array)) for name, array in inputs.items()], raw=raw)
    if parameters:
        try:
            encode_parameters(request.parameters, parameters)
        except ModelFailed as exc:  # its error for a model's bad parameter: here it is ours
            raise InvalidInput(exc.message) from None
    for name in outputs or ():
        request.outputs.add(name=name)
    return request


def _status_error(event: ResponseEnded) -> InferError | None:
    """The error a call's status stands for; None for OK."""
    status = event.status
    try:
        code = StatusCode(status.int_value)
    except ValueError:
        code = StatusCode.UNKNOWN
    if code == StatusCode.OK:
        return None
    return _error(code, status.status_message)


def _parse(response_type: type[_ResponseT], reply: _Reply) -> _ResponseT:
    try:
        return response_type.FromString(reply.message)
    except DecodeError as exc:
        name = response_type.DESCRIPTOR.full_name
        raise InferError(
            f"the response is not a valid {name}: {exc}", StatusCode.INTERNAL
        ) from None


def _wire_deadline(deadline: float | None) -> tuple[float, datetime.timedelta | None]:
    """The deadline a call goes out with, ``deadline`` or an enclosing cancel scope's
    (trio.fail_after), whichever is sooner: the server stops working on a call nobody will wait
    for. With it, its grpc-timeout (None: no deadline)."""
    wire_deadline = trio.current_effective_deadline()
    if deadline is not None:
        wire_deadline = min(wire_deadline, deadline)
    if wire_deadline == math.inf:
        return wire_deadline, None
    return wire_deadline, _wire_timeout(wire_deadline - trio.current_time())


def _wire_timeout(seconds: float) -> datetime.timedelta:
    # Rounded up, and at least 1 µs: a deadline that has passed already is still sent, and the
    # server answers DEADLINE_EXCEEDED at once.
    micros = max(1, math.ceil(seconds * 1_000_000))
    if micros <= _MAX_TIMEOUT_VALUE:
        return datetime.timedelta(microseconds=micros)
    return datetime.timedelta(seconds=min(math.ceil(seconds), _MAX_TIMEOUT_VALUE))


def _checked_metadata(metadata: MetadataLike | None) -> Metadata:
    if metadata is None:
        return ()
    pairs = metadata.items() if isinstance(metadata, Mapping) else metadata
    checked: list[tuple[str, str | bytes]] = []
    for name, value in pairs:
        key = name.lower()
        if not key or key.startswith(("grpc-", ":")) or not _is_token(key):
            raise ValueError(
                f"metadata name {name!r} is not allowed: names are letters, digits, '-', '_' "
                "and '.', and must not start with 'grpc-'"
            )
        if key.endswith("-bin"):
            if not isinstance(value, bytes):
                raise TypeError(f"metadata {name!r} ends in '-bin', so its value must be bytes")
        elif not isinstance(value, str) or not all(" " <= char <= "~" for char in value):
            raise TypeError(
                f"metadata {name!r} must be a printable ASCII str (or end its name in '-bin' "
                "to send bytes)"
            )
        checked.append((key, value))
    return tuple(checked)


def _is_token(name: str) -> bool:
    return all(char.isascii() and (char.isalnum() or char in "-_.") for char in name)
