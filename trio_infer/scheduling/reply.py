"""A reply slot: the one place a waiting request learns how its work ended.

A request task creates its slot, hands it to whoever does the work (a batch, a worker lane) and
waits on it; it is the slot's only reader. Whoever holds the slot fills it on every exit path,
with a result or an error, so the waiter always wakes: there is no registry of pending requests
to get out of step with the work.

A call that answers more than once (a decoupled model's) has a :class:`ReplyStream`: items as
they come, then an end that is filled like a :class:`Reply`. It holds at most ``capacity`` items:
whoever fills it must be told, through ``on_take``, each time the reader takes one, and may add
one more each time (the worker pool turns that into a credit for the worker, whose generator
waits for one before it steps again).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

import trio

from trio_infer.errors import InferError

__all__ = ["Reply", "ReplyStream"]

_T = TypeVar("_T")


class Reply(Generic[_T]):
    """A result or an error, filled at most once (later fills are ignored).

    Its one reader parks on Trio's low-level primitives rather than on a ``trio.Event``: no
    event made per call, and ``filled`` a plain attribute read on every call's path.
    """

    __slots__ = ("_error", "_result", "_waiter", "filled")

    def __init__(self) -> None:
        self.filled = False
        """Whether a result or an error has been set."""
        self._result: _T | None = None
        self._error: InferError | None = None
        # The reader's task while it waits unfilled: woken, once, by the fill.
        self._waiter: trio.lowlevel.Task | None = None

    def set_result(self, result: _T) -> None:
        """Fill the slot with a result, unless it is filled already."""
        if not self.filled:
            self._result = result
            self._fill()

    def set_error(self, error: InferError) -> None:
        """Fill the slot with an error, unless it is filled already."""
        if not self.filled:
            # The reader raises its own instance: one error raised in several tasks would
            # gather all their tracebacks.
            self._error = type(error)(error.message, error.code)
            self._fill()

    def _fill(self) -> None:
        self.filled = True
        waiter, self._waiter = self._waiter, None
        if waiter is not None:
            trio.lowlevel.reschedule(waiter)

    async def wait(self) -> _T:
        """Wait until the slot is filled; return the result or raise the error. A checkpoint
        (cancellation and a scheduler pass) whether or not it is filled already, as
        ``trio.Event.wait`` is."""
        if self.filled:
            await trio.lowlevel.checkpoint()
        else:
            assert self._waiter is None, "a reply has one reader"
            self._waiter = trio.lowlevel.current_task()
            # A bound method, not a closure made for each wait.
            await trio.lowlevel.wait_task_rescheduled(self._abort)
        if self._error is not None:
            raise self._error
        # Filled without an error: the result is the reply's (not a runtime cast's call).
        return self._result  # type: ignore[return-value]

    def _abort(self, _: object) -> trio.lowlevel.Abort:
        # Cancelled while unfilled: the fill must not wake the task again.
        self._waiter = None
        return trio.lowlevel.Abort.SUCCEEDED


class ReplyStream(Generic[_T]):
    """Items, then an end (``None``) or an error; at most ``capacity`` items held at once.

    It fills like a :class:`Reply` (``set_result(None)`` ends it, ``set_error`` fails it; both at
    most once), so whoever holds a call's slot fills either kind alike on every exit path.

    Args:
        capacity: Items it may hold unread; ``put`` past that is a bug of the filler.
        on_take: Called each time the reader takes an item (room for one more).
    """

    def __init__(self, capacity: int, on_take: Callable[[], None]) -> None:
        self._capacity = capacity
        self._on_take = on_take
        self._items: deque[_T] = deque()
        self._end: Reply[None] = Reply()
        self._changed = trio.Event()
        self.given = 0
        """Items put so far: a call that gave any cannot be run again from the start."""

    @property
    def filled(self) -> bool:
        """Whether the end (or an error) has been set."""
        return self._end.filled

    def put(self, item: _T) -> None:
        """Add an item, unless the stream has ended.

        Raises:
            RuntimeError: It holds ``capacity`` items already.
        """
        if self.filled:
            return
        if len(self._items) >= self._capacity:
            raise RuntimeError(f"more than {self._capacity} items were given ahead of the reader")
        self._items.append(item)
        self.given += 1
        self._wake()

    def set_result(self, result: None) -> None:
        """End the stream after the items it holds (unless it has ended already)."""
        self._end.set_result(result)
        self._wake()

    def set_error(self, error: InferError) -> None:
        """Fail the stream after the items it holds (unless it has ended already)."""
        self._end.set_error(error)
        self._wake()

    async def next(self) -> tuple[bool, _T | None]:
        """Wait for the next item: ``(True, item)``, or ``(False, None)`` at the end.

        Raises:
            InferError: The stream failed (after every item given before the failure).
        """
        while not self._items and not self.filled:
            await self._changed.wait()
        if self._items:
            item = self._items.popleft()
            self._on_take()
            return True, item
        await self._end.wait()  # raises the error, if any
        return False, None

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()
