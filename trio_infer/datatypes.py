"""The Open Inference Protocol's datatypes and the numpy dtypes that hold them.

Shared by every layer that sees tensors (settings, admission, the V2 core, the protobuf codec,
the client); it imports nothing of the package but its errors.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from trio_infer.errors import ModelFailed

__all__ = [
    "DATATYPES",
    "LENGTH_PREFIX",
    "MAX_RANK",
    "bytes_elements",
    "datatype_of",
    "object_array",
    "shape_problem",
    "shape_text",
]

#: numpy 1.x caps arrays at 32 dimensions (2.x at 64): the smaller, so every supported numpy
#: can reshape what passes.
MAX_RANK = 32
#: The most bytes numpy can index (its index type's largest value).
MAX_INDEX = int(np.iinfo(np.intp).max)

#: BYTES elements sent as bytes (gRPC's raw contents, REST's binary tensor data) are each
#: prefixed by their length, a little-endian uint32.
LENGTH_PREFIX = 4

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

#: Every datatype by its dtype (native byte order), the dtypes most arrays have: found with one
#: dict lookup. A dtype equal to one of these is of the same kind and size, so it holds the same
#: datatype; any other (another byte order, strings, unsupported kinds) is found by its kind.
_DATATYPE_BY_DTYPE: dict[np.dtype[np.generic], str] = {
    dtype: name for name, dtype in DATATYPES.items()
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
    datatype = _DATATYPE_BY_DTYPE.get(dtype)
    if datatype is not None:
        return datatype
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


def object_array(elements: Sequence[object], shape: tuple[int, ...]) -> np.ndarray:
    """A BYTES tensor of ``shape`` holding ``elements`` (as many as the shape's)."""
    # np.array(list_of_bytes) would build a fixed-width 'S' array and strip trailing NULs.
    array = np.empty(len(elements), dtype=np.object_)
    array[:] = elements
    return array.reshape(shape)


def bytes_elements(
    buffer: bytes | bytearray | memoryview,
    shape: tuple[int, ...],
    where: str,
    error: Callable[[str], Exception],
) -> np.ndarray:
    """The BYTES tensor of ``shape`` whose elements ``buffer`` holds, each after its length
    (:data:`LENGTH_PREFIX`), filling it exactly.

    Raises:
        Exception: ``error(message)``, the message starting with ``where``, when the buffer is
            too short for the shape's elements, an element overruns it, or bytes are left.
    """
    count = math.prod(shape)
    size = len(buffer) if not isinstance(buffer, memoryview) else buffer.nbytes
    # Each element takes at least its prefix, so this bounds the loop by the data actually sent
    # before anything is allocated for a huge declared shape.
    if count * LENGTH_PREFIX > size:
        raise error(
            f"{where} holds {size} bytes, too few for the {count} length-prefixed BYTES "
            f"elements of shape {shape_text(shape)}"
        )
    elements: list[bytes] = []
    offset = 0
    for position in range(count):
        if offset + LENGTH_PREFIX > size:
            raise error(
                f"{where} runs out at the 4-byte length prefix of BYTES element {position} "
                f"(offset {offset}, {size} bytes in all); shape {shape_text(shape)} "
                f"declares {count} elements"
            )
        length = int.from_bytes(buffer[offset : offset + LENGTH_PREFIX], "little")
        start = offset + LENGTH_PREFIX
        end = start + length
        if end > size:
            raise error(
                f"{where}: BYTES element {position} declares {length} bytes but only "
                f"{size - start} remain"
            )
        elements.append(bytes(buffer[start:end]))
        offset = end
    if offset != size:
        raise error(
            f"{where} has {size - offset} bytes after the {count} BYTES elements that shape "
            f"{shape_text(shape)} declares"
        )
    return object_array(elements, shape)


def shape_problem(shape: tuple[int, ...], itemsize: int, kind: str = "request") -> str | None:
    """What is wrong with a tensor's declared ``shape`` (``None``: nothing), for a message
    ``"<tensor>: <problem>"``: more than :data:`MAX_RANK` dimensions, a negative dimension
    (``kind`` says whose shapes must be concrete), or more bytes of ``itemsize`` than numpy
    can index.

    The rank is checked first: the other messages write the shape, and the product of
    thousands of huge dimensions is a number of millions of bits, seconds to compute.
    """
    if len(shape) > MAX_RANK:
        return f"shape has {len(shape)} dimensions; at most {MAX_RANK} are supported"
    if shape and min(shape) < 0:  # min without default=: no keyword parsed
        return f"shape {shape_text(shape)} has a negative dimension; {kind} shapes must be concrete"
    # numpy refuses shapes whose nonzero dimensions overflow its index type even when another
    # dimension is 0, so that product is bounded too.
    size = math.prod(shape) if all(shape) else math.prod(dim for dim in shape if dim)
    if size * itemsize > MAX_INDEX:
        return f"shape {shape_text(shape)} is too large"
    return None
