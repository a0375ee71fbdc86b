"""Vectored writes: what is left to send after a partial write."""

from __future__ import annotations

import numpy as np
import pytest

from trio_infer.buffers import unsent


@pytest.mark.parametrize("sent", range(0, 23))
def test_what_is_left_is_the_rest_of_the_bytes_whatever_the_item_size(sent: int) -> None:
    ints = np.arange(4, dtype="<i4")
    buffers = [b"ab", memoryview(ints), bytearray(b"cdef")]
    whole = b"ab" + ints.tobytes() + b"cdef"
    left = unsent(buffers, sent)
    assert b"".join(bytes(buffer) for buffer in left) == whole[sent:]
