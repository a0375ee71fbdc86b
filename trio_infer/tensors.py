"""Open Inference Protocol tensors <-> numpy arrays (pure functions, no I/O).

A request carries each input tensor's data in one of two ways: typed, in the repeated field of
``InferTensorContents`` that the datatype selects, or raw, as one little-endian byte string per
input in ``raw_input_contents``. Responses are written the same two ways. This module converts
both directions, checks requests against a model's declared inputs, and converts parameters.

Every malformed request raises :class:`~trio_infer.errors.InvalidInput` with a message that
names the tensor and says what was expected; every unencodable model output raises
:class:`~trio_infer.errors.ModelFailed` naming the output.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from trio_infer._proto.grpc_predict_v2_pb2 import (
    InferParameter,
    InferTensorContents,
    ModelInferRequest,
    ModelInferResponse,
)
from trio_infer.errors import InvalidInput, ModelFailed

__all__ = [
    "DATATYPES",
    "TensorSpec",
    "datatype_of",
    "decode_inputs",
    "decode_parameters",
    "encode_outputs",
    "encode_parameters",
    "select_outputs",
    "validate_request",
]

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


#: The ``InferTensorContents`` field that carries each datatype's typed data. FP16 has none: the
#: protocol only lets it travel raw.
_CONTENTS_FIELD: dict[str, str | None] = {
    "BOOL": "bool_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "FP16": None,
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}

#: The numpy dtype matching each typed field's protobuf scalar type; narrower integer
#: datatypes share a 32-bit field and are range-checked when narrowed.
_FIELD_DTYPE: dict[str, np.dtype[np.generic]] = {
    "bool_contents": np.dtype(np.bool_),
    "int_contents": np.dtype(np.int32),
    "int64_contents": np.dtype(np.int64),
    "uint_contents": np.dtype(np.uint32),
    "uint64_contents": np.dtype(np.uint64),
    "fp32_contents": np.dtype(np.float32),
    "fp64_contents": np.dtype(np.float64),
}

#: Numeric datatypes by numpy (kind, itemsize); byte order does not change the datatype.
_DATATYPE_BY_KIND: dict[tuple[str, int], str] = {
    (dtype.kind, dtype.itemsize): name for name, dtype in DATATYPES.items() if name != "BYTES"
}

#: The ranges of the integer datatypes narrower than their shared 32-bit typed field.
_NARROW_RANGE: dict[str, tuple[int, int]] = {
    name: (int(np.iinfo(kind).min), int(np.iinfo(kind).max))
    for name, kind in (
        ("INT8", np.int8),
        ("INT16", np.int16),
        ("UINT8", np.uint8),
        ("UINT16", np.uint16),
    )
}

#: numpy kinds that hold strings: bytes_, str_, and numpy 2's variable-width StringDType.
_STRING_KINDS = frozenset("SUT")

#: numpy 1.x caps arrays at 32 dimensions (2.x at 64); enforce the smaller so every supported
#: numpy can reshape what passes validation.
_MAX_RANK = 32

#: Raw BYTES elements are prefixed by their length as a little-endian uint32.
_LENGTH_PREFIX = 4
_MAX_ELEMENT_BYTES = 2**32 - 1

_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1
_UINT64_MAX = 2**64 - 1

_VALID_DATATYPES = ", ".join(DATATYPES)


def _quoted(names: Sequence[str] | Mapping[str, Any]) -> str:
    return ", ".join(f"'{name}'" for name in names) or "none"


def _shape_text(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(dim) for dim in shape) + "]"


# --------------------------------------------------------------------------------------------
# Decoding requests


def decode_inputs(request: ModelInferRequest) -> dict[str, np.ndarray]:
    """Decode every input tensor of a request into a numpy array.

    Raw numeric inputs are zero-copy, read-only views of the request's buffers, so a model that
    wants to modify an input in place must copy it first. BYTES inputs are object arrays of
    ``bytes``.

    Args:
        request: The request; its inputs carry data either all in ``raw_input_contents`` (one
            entry per input, in order) or all in their typed ``contents``.

    Returns:
        The arrays by input name, in the request's order, each with the datatype's dtype
        (see :data:`DATATYPES`) and the declared shape.

    Raises:
        InvalidInput: If a name repeats, a datatype is unknown, a shape is negative or too large,
            raw and typed data are mixed, the number of raw buffers is not the number of inputs,
            data sits in the wrong typed field, or the data does not hold exactly the elements
            the shape declares.
    """
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise InvalidInput(
            f"request has {len(request.inputs)} inputs but {len(raw)} raw_input_contents "
            "entries; raw_input_contents needs exactly one entry per input, in input order"
        )
    decoded: dict[str, np.ndarray] = {}
    for index, tensor in enumerate(request.inputs):
        name = tensor.name
        if name in decoded:
            raise InvalidInput(f"input '{name}' appears more than once in the request")
        datatype = _checked_datatype(name, tensor.datatype)
        shape = _checked_shape(name, tensor.shape, datatype)
        typed_fields = _set_fields(tensor.contents) if tensor.HasField("contents") else []
        if raw:
            if typed_fields:
                raise InvalidInput(
                    f"input '{name}' has typed contents.{typed_fields[0]} but the request uses "
                    "raw_input_contents; send every input raw or every input typed, not both"
                )
            decoded[name] = _decode_raw(name, datatype, shape, raw[index], index)
        else:
            decoded[name] = _decode_typed(name, datatype, shape, tensor.contents, typed_fields)
    return decoded


def _checked_datatype(name: str, datatype: str) -> str:
    if datatype not in DATATYPES:
        raise InvalidInput(
            f"input '{name}': unknown datatype '{datatype}'; valid datatypes are {_VALID_DATATYPES}"
        )
    return datatype


def _checked_shape(name: str, dims: Sequence[int], datatype: str) -> tuple[int, ...]:
    shape = tuple(dims)
    if any(dim < 0 for dim in shape):
        raise InvalidInput(
            f"input '{name}': shape {_shape_text(shape)} has a negative dimension; "
            "request shapes must be concrete"
        )
    if len(shape) > _MAX_RANK:
        raise InvalidInput(
            f"input '{name}': shape has {len(shape)} dimensions; at most {_MAX_RANK} are supported"
        )
    # numpy refuses shapes whose nonzero dimensions overflow its index type even when another
    # dimension is 0, so bound that product too (Python ints cannot overflow here).
    nonzero = math.prod(dim for dim in shape if dim)
    if nonzero * DATATYPES[datatype].itemsize > np.iinfo(np.intp).max:
        raise InvalidInput(f"input '{name}': shape {_shape_text(shape)} is too large")
    return shape


def _set_fields(contents: InferTensorContents) -> list[str]:
    # ListFields reports exactly the repeated fields that hold at least one value.
    return [field.name for field, _ in contents.ListFields()]


def _decode_raw(
    name: str, datatype: str, shape: tuple[int, ...], buffer: bytes, index: int
) -> np.ndarray:
    count = math.prod(shape)
    if datatype == "BYTES":
        return _decode_raw_bytes(name, shape, count, buffer, index)
    dtype = DATATYPES[datatype].newbyteorder("<")
    itemsize = dtype.itemsize
    size = len(buffer)
    if size != count * itemsize:
        if size % itemsize:
            held = f"{size} bytes, not a whole number of {itemsize}-byte {datatype} elements"
        else:
            held = f"{size // itemsize} {datatype} elements ({size} bytes)"
        raise InvalidInput(
            f"input '{name}': shape {_shape_text(shape)} has {count} elements but "
            f"raw_input_contents[{index}] holds {held}"
        )
    array = np.frombuffer(buffer, dtype=dtype)
    if datatype == "BOOL":
        # Any other byte would give a bool array whose values compare unequal to True.
        octets = array.view(np.uint8)
        if octets.size and octets.max() > 1:
            position = int(np.argmax(octets > 1))
            raise InvalidInput(
                f"input '{name}': raw BOOL element {position} is byte {int(octets[position])}; "
                "BOOL elements must be 0 or 1"
            )
    return array.reshape(shape)


def _decode_raw_bytes(
    name: str, shape: tuple[int, ...], count: int, buffer: bytes, index: int
) -> np.ndarray:
    where = f"input '{name}': raw_input_contents[{index}]"
    size = len(buffer)
    # Each element takes at least its prefix, so this bounds the loop by the data actually sent
    # before anything is allocated for a huge declared shape.
    if count * _LENGTH_PREFIX > size:
        raise InvalidInput(
            f"{where} holds {size} bytes, too few for the {count} length-prefixed BYTES "
            f"elements of shape {_shape_text(shape)}"
        )
    elements: list[bytes] = []
    offset = 0
    for position in range(count):
        if offset + _LENGTH_PREFIX > size:
            raise InvalidInput(
                f"{where} runs out at the 4-byte length prefix of BYTES element {position} "
                f"(offset {offset}, {size} bytes in all); shape {_shape_text(shape)} "
                f"declares {count} elements"
            )
        length = int.from_bytes(buffer[offset : offset + _LENGTH_PREFIX], "little")
        start = offset + _LENGTH_PREFIX
        end = start + length
        if end > size:
            raise InvalidInput(
                f"{where}: BYTES element {position} declares {length} bytes but only "
                f"{size - start} remain"
            )
        elements.append(buffer[start:end])
        offset = end
    if offset != size:
        raise InvalidInput(
            f"{where} has {size - offset} bytes after the {count} BYTES elements that shape "
            f"{_shape_text(shape)} declares"
        )
    return _object_array(elements, shape)


def _object_array(elements: Sequence[object], shape: tuple[int, ...]) -> np.ndarray:
    # np.array(list_of_bytes) would build a fixed-width 'S' array and strip trailing NULs.
    array = np.empty(len(elements), dtype=np.object_)
    array[:] = elements
    return array.reshape(shape)


def _decode_typed(
    name: str,
    datatype: str,
    shape: tuple[int, ...],
    contents: InferTensorContents,
    typed_fields: list[str],
) -> np.ndarray:
    field = _CONTENTS_FIELD[datatype]
    if field is None:
        raise InvalidInput(
            f"input '{name}': FP16 has no typed contents field; send FP16 data in "
            "raw_input_contents"
        )
    wrong = [other for other in typed_fields if other != field]
    if wrong:
        raise InvalidInput(
            f"input '{name}': datatype {datatype} takes its data in contents.{field}, "
            f"but contents.{wrong[0]} is set"
        )
    values = getattr(contents, field)
    count = math.prod(shape)
    if len(values) != count:
        raise InvalidInput(
            f"input '{name}': shape {_shape_text(shape)} has {count} elements but "
            f"contents.{field} holds {len(values)} values"
        )
    if datatype == "BYTES":
        return _object_array(list(values), shape)
    wide = np.fromiter(values, dtype=_FIELD_DTYPE[field], count=count)
    bounds = _NARROW_RANGE.get(datatype)
    if bounds is not None:
        # INT8/INT16/UINT8/UINT16 share a 32-bit field; narrowing must not wrap silently.
        low, high = bounds
        bad = (wide < low) | (wide > high)
        if bad.any():
            position = int(np.argmax(bad))
            raise InvalidInput(
                f"input '{name}': {datatype} element {position} is {int(wide[position])}, "
                f"outside [{low}, {high}]"
            )
        wide = wide.astype(DATATYPES[datatype])
    return wide.reshape(shape)


# --------------------------------------------------------------------------------------------
# Encoding responses


def datatype_of(array: np.ndarray) -> str:
    """Return the Open Inference Protocol datatype that holds an array's elements.

    Byte order does not matter. Object arrays are taken to be BYTES without looking at their
    elements (that costs a pass; :func:`encode_outputs` checks them as it encodes them), and so
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


def encode_outputs(
    response: ModelInferResponse,
    outputs: Sequence[tuple[str, np.ndarray]],
    *,
    raw: bool,
) -> None:
    """Append one output tensor per ``(name, array)`` to a response, in order.

    Each tensor's datatype comes from :func:`datatype_of` and its shape from the array. Raw
    outputs go to ``raw_output_contents`` as little-endian C-order bytes whatever the array's
    byte order and strides; typed outputs go to the datatype's ``contents`` field. ``str``
    elements of BYTES outputs are encoded as UTF-8.

    FP16 has no typed field, so a response with an FP16 output is encoded raw even when
    ``raw`` is false: the protocol does not let one response mix raw and typed outputs.

    Args:
        response: The response to append to. On error it may hold some of the outputs and
            should be discarded.
        outputs: The arrays to send, by name, in the order to send them.
        raw: Whether to use ``raw_output_contents`` rather than typed contents.

    Raises:
        ModelFailed: If an array's dtype has no datatype, a BYTES output holds an element that
            is neither ``bytes`` nor ``str``, or a raw BYTES element exceeds 4 GiB.
    """
    # asarray is free for arrays and lets a model return a numpy scalar.
    outputs = [(name, np.asarray(array)) for name, array in outputs]
    datatypes: list[str] = []
    for name, array in outputs:
        try:
            datatypes.append(datatype_of(array))
        except ModelFailed as error:
            raise ModelFailed(f"output '{name}': {error.message}") from None
    raw = raw or "FP16" in datatypes
    for (name, array), datatype in zip(outputs, datatypes, strict=True):
        tensor = response.outputs.add()
        tensor.name = name
        tensor.datatype = datatype
        tensor.shape.extend(array.shape)
        if datatype == "BYTES":
            elements = _bytes_elements(name, array)
            if raw:
                response.raw_output_contents.append(_pack_bytes(name, elements))
            else:
                tensor.contents.bytes_contents.extend(elements)
        elif raw:
            # astype is a no-op for little-endian arrays; tobytes makes C order from any strides.
            little = array.astype(DATATYPES[datatype].newbyteorder("<"), copy=False)
            response.raw_output_contents.append(little.tobytes())
        else:
            field = _CONTENTS_FIELD[datatype]
            assert field is not None  # FP16, the only datatype without one, forces raw above
            # tolist converts in C; extending from the ndarray itself goes element by element.
            getattr(tensor.contents, field).extend(array.ravel().tolist())


def _bytes_elements(name: str, array: np.ndarray) -> list[bytes]:
    elements: list[bytes] = []
    for position, element in enumerate(array.ravel().tolist()):
        if isinstance(element, bytes):
            elements.append(element)
        elif isinstance(element, str):
            try:
                elements.append(element.encode("utf-8"))
            except UnicodeEncodeError as error:
                # Lone surrogates, e.g. from os.fsdecode of undecodable bytes.
                raise ModelFailed(
                    f"output '{name}': BYTES element {position} is a str that UTF-8 cannot "
                    f"encode ({error.reason} at index {error.start})"
                ) from None
        else:
            raise ModelFailed(
                f"output '{name}': BYTES element {position} is {type(element).__name__}; "
                "BYTES outputs hold bytes or str"
            )
    return elements


def _pack_bytes(name: str, elements: list[bytes]) -> bytes:
    parts: list[bytes] = []
    for position, element in enumerate(elements):
        if len(element) > _MAX_ELEMENT_BYTES:
            raise ModelFailed(
                f"output '{name}': BYTES element {position} has {len(element)} bytes; a raw "
                f"element holds at most {_MAX_ELEMENT_BYTES}"
            )
        parts.append(len(element).to_bytes(_LENGTH_PREFIX, "little"))
        parts.append(element)
    return b"".join(parts)


# --------------------------------------------------------------------------------------------
# Parameters


def decode_parameters(params: Mapping[str, InferParameter]) -> dict[str, bool | int | float | str]:
    """Convert a protocol parameter map into plain Python values.

    Args:
        params: A request's, tensor's or response's ``parameters`` map.

    Returns:
        Each parameter's value: ``bool``, ``int`` (from ``int64_param`` or ``uint64_param``),
        ``float`` or ``str``.

    Raises:
        InvalidInput: If a parameter has no value set.
    """
    values: dict[str, bool | int | float | str] = {}
    for key, param in params.items():
        choice = param.WhichOneof("parameter_choice")
        if choice is None:
            raise InvalidInput(f"parameter '{key}' has no value set")
        value: bool | int | float | str = getattr(param, choice)
        values[key] = value
    return values


def encode_parameters(
    target_map: MutableMapping[str, InferParameter],
    values: Mapping[str, bool | int | float | str],
) -> None:
    """Set parameters in a protocol parameter map, replacing any of the same key.

    Integers go to ``int64_param``, or to ``uint64_param`` when only that can hold them. numpy
    scalars are accepted as their Python equivalents.

    Args:
        target_map: A message's ``parameters`` map field.
        values: The parameters to set.

    Raises:
        ModelFailed: If a value is not a bool, int, float or str, or an int does not fit in 64
            bits.
    """
    for key, value in values.items():
        param = target_map[key]
        # bool before int: bool is a subclass of int. numpy scalars are not Python ints or
        # bools, so they are tested for separately.
        if isinstance(value, bool | np.bool_):
            param.bool_param = bool(value)
        elif isinstance(value, int | np.integer):
            number = int(value)
            if _INT64_MIN <= number <= _INT64_MAX:
                param.int64_param = number
            elif _INT64_MAX < number <= _UINT64_MAX:
                param.uint64_param = number
            else:
                raise ModelFailed(f"parameter '{key}': {number} does not fit in 64 bits")
        elif isinstance(value, float | np.floating):
            param.double_param = float(value)
        elif isinstance(value, str):
            param.string_param = value
        else:
            raise ModelFailed(
                f"parameter '{key}' is {type(value).__name__}; parameters are bool, int, "
                "float or str"
            )


# --------------------------------------------------------------------------------------------
# Checking requests against a model


def validate_request(
    request: ModelInferRequest, inputs: Sequence[TensorSpec], model_name: str
) -> None:
    """Check a request's input names, datatypes and shapes against a model's declared inputs.

    Only metadata is checked, not data, so this is cheap and runs before any decoding. A model
    that declares no inputs accepts anything. ``-1`` in a declared shape matches any size.

    Args:
        request: The request to check.
        inputs: The model's declared inputs.
        model_name: Named in error messages.

    Raises:
        InvalidInput: If the request sends an input twice, sends one the model does not declare,
            omits a declared one, or sends one with another datatype, rank or fixed dimension.
    """
    if not inputs:
        return
    declared = {spec.name: spec for spec in inputs}
    seen: set[str] = set()
    for tensor in request.inputs:
        name = tensor.name
        if name in seen:
            raise InvalidInput(f"model '{model_name}': input '{name}' appears more than once")
        seen.add(name)
        spec = declared.get(name)
        if spec is None:
            raise InvalidInput(
                f"model '{model_name}' has no input '{name}'; its inputs are {_quoted(declared)}"
            )
        if tensor.datatype != spec.datatype:
            raise InvalidInput(
                f"model '{model_name}' input '{name}': expected datatype {spec.datatype}, "
                f"got {tensor.datatype or 'none'}"
            )
        shape = tuple(tensor.shape)
        if len(shape) != len(spec.shape):
            raise InvalidInput(
                f"model '{model_name}' input '{name}': expected shape {_shape_text(spec.shape)} "
                f"(rank {len(spec.shape)}), got {_shape_text(shape)} (rank {len(shape)})"
            )
        for axis, (want, got) in enumerate(zip(spec.shape, shape, strict=True)):
            if want != -1 and want != got:
                raise InvalidInput(
                    f"model '{model_name}' input '{name}': expected shape "
                    f"{_shape_text(spec.shape)}, got {_shape_text(shape)} "
                    f"(dimension {axis} must be {want})"
                )
    missing = [name for name in declared if name not in seen]
    if missing:
        raise InvalidInput(f"model '{model_name}': request is missing input(s) {_quoted(missing)}")


def select_outputs(
    outputs: Mapping[str, np.ndarray], requested: Sequence[str], model_name: str
) -> list[tuple[str, np.ndarray]]:
    """Pick the outputs to send back.

    Args:
        outputs: What the model produced, in the model's order.
        requested: The names the request asked for, in its order; empty means all.
        model_name: Named in error messages.

    Returns:
        ``(name, array)`` pairs: all outputs in the model's order when none were requested,
        else exactly the requested ones in the request's order.

    Raises:
        InvalidInput: If a requested output was not produced, or is requested twice.
    """
    if not requested:
        return list(outputs.items())
    selected: list[tuple[str, np.ndarray]] = []
    chosen: set[str] = set()
    for name in requested:
        if name not in outputs:
            raise InvalidInput(
                f"model '{model_name}' has no output '{name}'; its outputs are {_quoted(outputs)}"
            )
        if name in chosen:
            raise InvalidInput(f"model '{model_name}': output '{name}' is requested twice")
        chosen.add(name)
        selected.append((name, outputs[name]))
    return selected
