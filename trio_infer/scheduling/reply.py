"""A reply slot: the one place a waiting request learns how its work ended.

A request task creates its slot, hands it to whoever does the work (a batch, a worker lane) and
waits on it; it is the slot's only reader. Whoever holds the slot fills it on every exit path,
with a result or an error, so the waiter always wakes: there is no registry of pending requests
to get out of step with the work.
"""

from __future__ import annotations

from typing import Generic, TypeVar, cast

import trio

from trio_infer.errors import InferError

__all__ = ["Reply"]

_T = TypeVar("_T")


class Reply(Generic[_T]):
    """A result or an error, filled at most once (later fills are ignored)."""

    def __init__(self) -> None:
        self._filled = trio.Event()
        self._result: _T | None = None
        self._error: InferError | None = None

    @property
    def filled(self) -> bool:
        """Whether a result or an error has been set."""
        return self._filled.is_set()

    def set_result(self, result: _T) -> None:
        """Fill the slot with a result, unless it is filled already."""
        if not self.filled:
            self._result = result
            self._filled.set()

    def set_error(self, error: InferError) -> None:
        """Fill the slot with an error, unless it is filled already."""
        if not self.filled:
            # The reader raises its own instance: one error raised in several tasks would
            # gather all their tracebacks.
            self._error = type(error)(error.message, error.code)
            self._filled.set()

    async def wait(self) -> _T:
        """Wait until the slot is filled; return the result or raise the error."""
        await self._filled.wait()
        if self._error is not None:
            raise self._error
        return cast(_T, self._result)
