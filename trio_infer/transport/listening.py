"""What both servers (gRPC and HTTP) do alike with their listeners: accept connections, and
count the calls in flight so that a drain can wait for none."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import trio

__all__ = ["CallCounter", "accept_loop"]

logger = logging.getLogger(__name__)

#: Seconds an accept loop waits after a failed accept (out of file descriptors and the like).
_ACCEPT_BACKOFF = 0.1


class CallCounter:
    """Counts calls in flight across connections, so a drain can wait for none."""

    def __init__(self) -> None:
        self._count = 0
        self.started = 0
        """Calls started since the server started."""
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
