"""Open Inference Protocol tensors <-> numpy arrays (pure functions, no I/O).

(Stub: the full decoder/encoder is being written.)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: Every datatype of the Open Inference Protocol and the numpy dtype that holds it.
#: BYTES tensors are numpy object arrays whose elements are ``bytes``.
DATATYPES: dict[str, np.dtype[np.generic]] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
    "BYTES": np.dtype(np.object_),
}


@dataclass(frozen=True)
class TensorSpec:
    """A declared tensor: its name, datatype and shape (``-1`` marks a free dimension)."""

    name: str
    datatype: str
    shape: tuple[int, ...]
