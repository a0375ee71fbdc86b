"""The Open Inference Protocol's datatypes and the numpy dtypes that hold them.

Shared by every layer that sees tensors (settings, admission, the V2 core, the protobuf codec,
the client); it imports nothing of the package but its errors.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from trio_infer.errors import ModelFailed

__all__ = ["DATATYPES", "datatype_of", "shape_text"]

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


#: Numeric datatypes by numpy (kind, itemsize); byte order does not change the datatype.
_DATATYPE_BY_KIND: dict[tuple[str, int], str] = {
    (dtype.kind, dtype.itemsize): name for name, dtype in DATATYPES.items() if name != "BYTES"
}

#: numpy kinds that hold strings: bytes_, str_, and numpy 2's variable-width StringDType.
_STRING_KINDS = frozenset("SUT")


def datatype_of(array: np.ndarray) -> str:
    """Return the Open Inference Protocol datatype that holds an array's elements.

    Byte order does not matter. Object arrays are taken to be BYTES without looking at their
    elements (that costs a pass; encoders check them as they encode them), and so
    are numpy ``bytes_``/``str_`` and variable-width string arrays.

    Args:
        array: Any numpy array.

    Returns:
        One of the keys of :data:`DATATYPES`.

    Raises:
        ModelFailed: If no datatype holds the dtype, e.g. complex, datetime or structured.
    """
    dtype = array.dtype
    if dtype.kind == "O" or dtype.kind in _STRING_KINDS:
        return "BYTES"
    datatype = _DATATYPE_BY_KIND.get((dtype.kind, dtype.itemsize))
    if datatype is None:
        raise ModelFailed(
            f"numpy dtype {dtype} has no Open Inference Protocol datatype; use one of "
            "bool, (u)int8-64, float16/32/64, or bytes/str"
        )
    return datatype


def shape_text(shape: Sequence[int]) -> str:
    """A shape as error messages write it: ``[2, 16]``."""
    return "[" + ", ".join(str(dim) for dim in shape) + "]"
