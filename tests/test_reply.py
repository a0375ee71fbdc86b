"""The reply slot's one reader: woken once by the fill, never after a cancel, and a checkpoint
even when the slot is filled already (as ``trio.Event.wait`` is)."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from trio_infer.errors import InferError, StatusCode
from trio_infer.scheduling.reply import Reply


async def test_the_reader_is_woken_by_the_first_fill_only() -> None:
    reply: Reply[int] = Reply()
    got: list[int] = []

    async def read() -> None:
        got.append(await reply.wait())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read)
        await trio.testing.wait_all_tasks_blocked()
        assert not reply.filled
        reply.set_result(7)
        reply.set_error(InferError("later", StatusCode.INTERNAL))
        assert reply.filled
    assert got == [7]


async def test_a_reader_cancelled_while_waiting_is_not_woken_by_a_later_fill() -> None:
    reply: Reply[int] = Reply()
    with trio.CancelScope() as scope:

        async def cancel_when_blocked() -> None:
            await trio.testing.wait_all_tasks_blocked()
            scope.cancel()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(cancel_when_blocked)
            await reply.wait()
    assert scope.cancelled_caught
    reply.set_result(1)  # would reschedule a task that is not waiting, and crash the run
    await trio.testing.wait_all_tasks_blocked()
    assert await reply.wait() == 1


async def test_waiting_on_a_filled_reply_is_a_checkpoint_then_raises_a_fresh_error() -> None:
    reply: Reply[int] = Reply()
    error = InferError("no worker", StatusCode.UNAVAILABLE)
    reply.set_error(error)
    with trio.CancelScope() as scope:
        scope.cancel()
        await reply.wait()
    assert scope.cancelled_caught
    with pytest.raises(InferError, match="no worker") as raised:
        await reply.wait()
    assert raised.value is not error
    assert raised.value.code == StatusCode.UNAVAILABLE
