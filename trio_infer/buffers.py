"""Byte buffers sent in order with vectored writes (``sendmsg``), none of them joined first.

Both sockets that carry tensors use this: a worker's (:mod:`trio_infer.worker_wire`) and a
client's (:mod:`trio_infer.transport`), so that a large array goes from its own memory to the
kernel without a copy in Python.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["MAX_BUFFERS", "Buffer", "unsent"]

Buffer = bytes | bytearray | memoryview

#: Buffers one sendmsg takes, well below any system's IOV_MAX (1024 on Linux): more are sent in
#: several calls.
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
