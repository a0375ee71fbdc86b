"""Closing a connection without losing the last bytes sent: :func:`linger`, on real sockets.

A mock clock that runs at a hundredth of real time makes :data:`LINGER_SECONDS` a hundred real
seconds, so a linger that ends within ten real seconds ended by the peer or by the byte bound.
"""

from __future__ import annotations

import contextlib

import pytest
import trio
import trio.testing

from trio_infer.transport.lingering import LINGER_SECONDS, linger

SLOW = 0.01
#: Ten seconds of real time at SLOW.
TIMEOUT = 10 * SLOW


@pytest.fixture
def slow_clock(mock_clock: trio.testing.MockClock) -> trio.testing.MockClock:
    mock_clock.rate = SLOW
    return mock_clock


async def _flood(sock: trio.socket.SocketType) -> None:
    with contextlib.suppress(OSError):
        while True:
            await sock.send(b"x" * 65536)


async def test_the_sending_side_ends_and_what_comes_is_dropped_until_the_peer_closes(
    slow_clock: trio.testing.MockClock,
) -> None:
    ours, theirs = trio.socket.socketpair()
    with ours, theirs:
        await theirs.send(b"a request the server will not read")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(linger, ours)
            # The peer sees the end of the server's side, and may still send.
            with trio.fail_after(TIMEOUT):
                assert await theirs.recv(100) == b""
                await theirs.send(b"sent after the end, before reading it")
                theirs.close()


async def test_a_peer_that_sends_on_and_on_is_read_for_at_most_linger_bytes(
    slow_clock: trio.testing.MockClock,
) -> None:
    ours, theirs = trio.socket.socketpair()
    with ours, theirs:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_flood, theirs)
            with trio.fail_after(TIMEOUT):
                await linger(ours)
            nursery.cancel_scope.cancel()


async def test_a_silent_peer_is_waited_for_linger_seconds(
    autojump_clock: trio.testing.MockClock,
) -> None:
    ours, theirs = trio.socket.socketpair()
    with ours, theirs:
        start = trio.current_time()
        await linger(ours)
        assert trio.current_time() - start == pytest.approx(LINGER_SECONDS)
        with trio.fail_after(1):
            assert await theirs.recv(100) == b""


async def test_a_socket_already_broken_is_left_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    ours, theirs = trio.socket.socketpair()
    ours.close()
    with theirs:
        start = trio.current_time()
        await linger(ours)
        assert trio.current_time() == start
