"""What both servers (gRPC and HTTP) do alike with their listeners and connections: accept
connections (TLS-wrapped when serving TLS), run each in a task of the server's nursery, drain
them, and count the calls in flight so that a drain can wait for none."""

from __future__ import annotations

import logging
import ssl
from collections.abc import Awaitable, Callable
from typing import Generic, Protocol, TypeVar

import trio

from trio_infer.transport.tls import handshake_completed

__all__ = ["CallCounter", "ConnectionServer", "ServedConnection", "accept_loop"]

logger = logging.getLogger(__name__)

#: Seconds an accept loop waits after a failed accept (out of file descriptors and the like).
_ACCEPT_BACKOFF = 0.1


class CallCounter:
    """Counts calls in flight across connections, so a drain can wait for none."""

    def __init__(self) -> None:
        self._count = 0
        self.started = 0
        """Calls started since the server started."""
        self.in_tasks = 0
        """Of those, the calls run in a task (the gRPC transport answers some without one)."""
        #: Made by the first wait for idle, set and dropped when the count reaches zero: one
        #: call at a time would otherwise make and set an event for every call.
        self._idle: trio.Event | None = None

    @property
    def count(self) -> int:
        """Calls in flight now."""
        return self._count

    def increment(self) -> None:
        self._count += 1

    def decrement(self) -> None:
        self._count -= 1
        if self._count == 0 and self._idle is not None:
            self._idle.set()
            self._idle = None

    async def wait_idle(self) -> None:
        """Wait until no call is in flight."""
        if self._count == 0:
            await trio.lowlevel.checkpoint()
            return
        if self._idle is None:
            self._idle = trio.Event()
        await self._idle.wait()


async def accept_loop(
    listener: trio.SocketListener,
    nursery: trio.Nursery,
    serve: Callable[[trio.SocketStream], Awaitable[None]],
) -> None:
    """Accept connections on ``listener`` until cancelled, each served by ``serve`` in a task
    of ``nursery``. A failed accept is logged and retried after a pause, not spun on."""
    while True:
        try:
            stream = await listener.accept()
        except OSError as exc:
            logger.error("accept failed: %s", exc)
            await trio.sleep(_ACCEPT_BACKOFF)
            continue
        nursery.start_soon(serve, stream)


class ServedConnection(Protocol):
    """What :class:`ConnectionServer` needs of a connection."""

    async def run(self) -> None:
        """Serve the connection until it ends; then close it."""

    def drain(self) -> None:
        """Serve no new call: let those in flight finish, then close."""


Transport = trio.SocketStream | trio.SSLStream[trio.SocketStream]
_C = TypeVar("_C", bound=ServedConnection)


class ConnectionServer(Generic[_C]):
    """Accepts connections and runs each in its own task, for the life of :meth:`serve`: what
    the gRPC and the HTTP servers share. A subclass makes its connections (:meth:`_connect`)
    and ends the calls that outlive a drain's grace period (:meth:`_end_calls`).

    Args:
        ssl_context: Serve TLS with this server-side context (see
            :func:`trio_infer.transport.tls.server_context`); plaintext when None.
    """

    def __init__(self, ssl_context: ssl.SSLContext | None) -> None:
        self._ssl_context = ssl_context
        #: Invariant: every connection whose run() has started and not returned.
        self._connections: set[_C] = set()
        self._accepting = trio.CancelScope()
        self._in_flight = CallCounter()

    def _connect(self, transport: Transport) -> _C:
        """The connection that serves ``transport`` (not yet running)."""
        raise NotImplementedError

    def _drain_late(self, connection: _C) -> None:
        """Drain a connection accepted after :meth:`stop_accepting`, before it runs: it has
        no call to finish, so it closes at once."""
        connection.drain()

    def _end_calls(self, connection: _C) -> None:
        """End the calls still running on ``connection`` when a shutdown's grace period is
        over, and have it close."""
        raise NotImplementedError

    async def serve(
        self,
        listeners: list[trio.SocketListener],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Accept connections on ``listeners`` until :meth:`stop_accepting`; then wait for the
        open connections to close."""
        async with trio.open_nursery() as nursery:
            try:
                with self._accepting:
                    async with trio.open_nursery() as accept_nursery:
                        for listener in listeners:
                            accept_nursery.start_soon(
                                accept_loop, listener, nursery, self._serve_connection
                            )
                        task_status.started()
            finally:
                for listener in listeners:
                    await trio.aclose_forcefully(listener)

    async def _serve_connection(self, stream: trio.SocketStream) -> None:
        transport: Transport = stream
        if self._ssl_context is not None:
            # The handshake is left to the connection's first read and write, so that its
            # handshake timeout bounds the TLS handshake and the first request together.
            # https_compatible: HTTP/2 ends a connection with GOAWAY, and HTTP/1.1 and gRPC
            # clients may close without a close_notify; that is an end of stream, not a
            # broken one.
            transport = trio.SSLStream(
                stream, self._ssl_context, server_side=True, https_compatible=True
            )
        connection = self._connect(transport)
        if self._accepting.cancel_called:
            self._drain_late(connection)
        self._connections.add(connection)
        try:
            await connection.run()
        except Exception:
            # A bug met by one connection must not take the others down: it is logged and
            # that connection is closed.
            logger.exception("connection failed; closing it")
        finally:
            self._connections.discard(connection)
        if isinstance(transport, trio.SSLStream) and not handshake_completed(transport):
            # A plaintext client, a client certificate missing or refused, a scanner: the
            # client is told by the TLS alert or the closed socket; the server has no fault
            # to report.
            logger.debug("closed a connection whose TLS handshake did not complete")

    def stop_accepting(self) -> None:
        """Close the listeners and drain every connection; calls in flight go on."""
        self._accepting.cancel()
        for connection in self._connections:
            connection.drain()

    async def shutdown(self, grace_period: float) -> None:
        """Stop accepting, let calls in flight finish for up to ``grace_period`` seconds, then
        end the rest (:meth:`_end_calls`); every connection then closes."""
        self.stop_accepting()
        with trio.move_on_after(grace_period):
            await self._in_flight.wait_idle()
        for connection in self._connections:
            self._end_calls(connection)
