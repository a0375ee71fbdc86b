"""Byte buffers sent in order with vectored writes, none of them joined first.

The sockets that carry tensors use this: a worker's (:mod:`trio_infer.workers.wire`) and a
client's (:mod:`trio_infer.transport.grpc_server`, :mod:`~trio_infer.transport.http_server`), so
that a large array goes from its own
memory to the kernel without a copy in Python. It sits below both, importing nothing of the
package: the worker side must not import the transport.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

__all__ = ["MAX_BUFFERS", "Buffer", "first_bytes", "unsent", "write_some"]

Buffer = bytes | bytearray | memoryview

#: Buffers one vectored write takes, well below any system's IOV_MAX (1024 on Linux): more are
#: sent in several calls.
MAX_BUFFERS = 512


def unsent(buffers: Sequence[Buffer], sent: int) -> list[Buffer]:
    """What is left of ``buffers`` once their first ``sent`` bytes are sent (empty when all)."""
    left: list[Buffer] = []
    for buffer in buffers:
        size = memoryview(buffer).nbytes
        if sent >= size:
            sent -= size
            continue
        # Cut by bytes, whatever the view's item size.
        left.append(memoryview(buffer).cast("B")[sent:] if sent else buffer)
        sent = 0
    return left


def write_some(fd: int, buffers: Sequence[Buffer]) -> list[Buffer]:
    """Write what one ``writev`` takes of ``buffers`` to ``fd``; return the rest (empty when
    all is written).

    Raises:
        BlockingIOError: ``fd`` is non-blocking and its buffer is full.
        OSError: The connection is broken or closed.
    """
    return unsent(buffers, os.writev(fd, buffers[:MAX_BUFFERS]))


def first_bytes(buffers: Sequence[Buffer], limit: int) -> bytearray:
    """The first ``limit`` bytes of ``buffers`` (all of them, if fewer), joined: a piece to
    encrypt and send, where every byte is copied anyway."""
    joined = bytearray()
    for part in buffers:
        with memoryview(part) as view, view.cast("B") as raw:
            joined += raw[: limit - len(joined)]
        if len(joined) >= limit:
            break
    return joined
