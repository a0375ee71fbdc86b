"""Open Inference Protocol tensors <-> numpy arrays (pure functions, no I/O).

A request carries each input tensor's data in one of two ways: typed, in the repeated field of
``InferTensorContents`` that the datatype selects, or raw, as one little-endian byte string per
input in ``raw_input_contents``. Responses are written the same two ways. This module converts
both directions on both sides of a call (the server decodes inputs and encodes outputs, the
client encodes inputs and decodes outputs) and converts parameters. Whether a decoded request
matches its model's declared inputs is checked by :mod:`trio_infer.core.validation`.

Every malformed request raises :class:`~trio_infer.errors.InvalidInput` with a message that
names the tensor and says what was expected; every unencodable model output raises
:class:`~trio_infer.errors.ModelFailed` naming the output. On the client side, an unencodable
input raises ``InvalidInput`` and a malformed response an
:class:`~trio_infer.errors.InferError` with status INTERNAL.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass

import numpy as np

from trio_infer.buffers import Buffer
from trio_infer.datatypes import DATATYPES, datatype_of, shape_text
from trio_infer.errors import InferError, InvalidInput, ModelFailed
from trio_infer.protobuf._proto.grpc_predict_v2_pb2 import (
    InferParameter,
    InferTensorContents,
    ModelInferRequest,
    ModelInferResponse,
)

__all__ = [
    "MAX_BYTES_ELEMENTS",
    "MAX_PARAMETERS",
    "decode_inputs",
    "decode_outputs",
    "decode_parameters",
    "encode_inputs",
    "encode_outputs",
    "encode_parameters",
    "serialize_response",
]

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

#: numpy 1.x caps arrays at 32 dimensions (2.x at 64); enforce the smaller so every supported
#: numpy can reshape what passes validation.
_MAX_RANK = 32

#: Raw BYTES elements are prefixed by their length as a little-endian uint32.
_LENGTH_PREFIX = 4
_MAX_ELEMENT_BYTES = 2**32 - 1

#: Parameters one map (a request's, a tensor's) may hold. Each becomes Python objects decoded
#: one by one on the event loop; V2 clients send a handful.
MAX_PARAMETERS = 1024
#: Elements one BYTES tensor may hold. Each becomes a Python ``bytes`` object, decoded one by one
#: on the event loop, at about ten times the memory of a short element's bytes: a cap keeps both
#: the loop's stall and the memory beyond what was reserved bounded.
MAX_BYTES_ELEMENTS = 1 << 20

_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1
_UINT64_MAX = 2**64 - 1

_VALID_DATATYPES = ", ".join(DATATYPES)


# --------------------------------------------------------------------------------------------
# Which side of a call a batch of tensors belongs to
#
# Requests and responses carry tensors the same way; only the names in messages and whose fault
# malformed data is differ. One set of private functions serves all four directions.

#: An input tensor of a request or an output tensor of a response: the same fields either way.
_Tensor = ModelInferRequest.InferInputTensor | ModelInferResponse.InferOutputTensor


@dataclass(frozen=True)
class _Side:
    message: str
    """The message the tensors sit in, as named in errors: ``request`` or ``response``."""
    role: str
    """What one tensor is called in errors: ``input`` or ``output``."""
    raw_field: str
    """The message's field of raw tensor data."""
    error: type[InferError]
    """What malformed or unencodable data raises: whose fault it is decides the status."""


#: A server reading a request: malformed inputs are the client's mistake.
_REQUEST_IN = _Side("request", "input", "raw_input_contents", InvalidInput)
#: A client reading a response: malformed outputs are the server's fault (INTERNAL, as gRPC
#: clients report a response they cannot parse).
_RESPONSE_IN = _Side("response", "output", "raw_output_contents", InferError)
#: A server writing its model's outputs: an unencodable output is the model's fault.
_RESPONSE_OUT = _Side("response", "output", "raw_output_contents", ModelFailed)
#: A client writing its arrays: an unencodable input is the caller's own mistake.
_REQUEST_OUT = _Side("request", "input", "raw_input_contents", InvalidInput)


# --------------------------------------------------------------------------------------------
# Decoding


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
    return _decode_tensors(request.inputs, request.raw_input_contents, _REQUEST_IN)


def decode_outputs(response: ModelInferResponse) -> dict[str, np.ndarray]:
    """Decode every output tensor of a response into a numpy array (the client side).

    The mirror of :func:`decode_inputs`, with the same checks: raw numeric outputs are
    zero-copy, read-only views of the response's buffers; BYTES outputs are object arrays of
    ``bytes``.

    Args:
        response: The response; its outputs carry data either all in ``raw_output_contents``
            (one entry per output, in order) or all in their typed ``contents``.

    Returns:
        The arrays by output name, in the response's order, each with the datatype's dtype
        (see :data:`DATATYPES`) and the declared shape.

    Raises:
        InferError: With status INTERNAL, if the response is malformed in any way
            :func:`decode_inputs` checks for: a malformed response is the server's fault, not
            the caller's.
    """
    return _decode_tensors(response.outputs, response.raw_output_contents, _RESPONSE_IN)


def _decode_tensors(
    tensors: Sequence[_Tensor], raw: Sequence[bytes], side: _Side
) -> dict[str, np.ndarray]:
    if raw and len(raw) != len(tensors):
        raise side.error(
            f"{side.message} has {len(tensors)} {side.role}s but {len(raw)} {side.raw_field} "
            f"entries; {side.raw_field} needs exactly one entry per {side.role}, in "
            f"{side.role} order"
        )
    decoded: dict[str, np.ndarray] = {}
    for index, tensor in enumerate(tensors):
        name = tensor.name
        where = f"{side.role} '{name}'"
        if name in decoded:
            raise side.error(f"{where} appears more than once in the {side.message}")
        datatype = _checked_datatype(where, tensor.datatype, side)
        shape = _checked_shape(where, tensor.shape, datatype, side)
        if datatype == "BYTES" and math.prod(shape) > MAX_BYTES_ELEMENTS:
            raise side.error(
                f"{where}: shape {shape_text(shape)} has {math.prod(shape)} BYTES elements; "
                f"at most {MAX_BYTES_ELEMENTS} are taken"
            )
        typed_fields = _set_fields(tensor.contents) if tensor.HasField("contents") else []
        if raw:
            if typed_fields:
                raise side.error(
                    f"{where} has typed contents.{typed_fields[0]} but the {side.message} uses "
                    f"{side.raw_field}; send every {side.role} raw or every {side.role} typed, "
                    "not both"
                )
            decoded[name] = _decode_raw(where, datatype, shape, raw[index], index, side)
        else:
            decoded[name] = _decode_typed(
                where, datatype, shape, tensor.contents, typed_fields, side
            )
    return decoded


def _checked_datatype(where: str, datatype: str, side: _Side) -> str:
    if datatype not in DATATYPES:
        raise side.error(
            f"{where}: unknown datatype '{datatype}'; valid datatypes are {_VALID_DATATYPES}"
        )
    return datatype


def _checked_shape(where: str, dims: Sequence[int], datatype: str, side: _Side) -> tuple[int, ...]:
    shape = tuple(dims)
    if any(dim < 0 for dim in shape):
        raise side.error(
            f"{where}: shape {shape_text(shape)} has a negative dimension; "
            f"{side.message} shapes must be concrete"
        )
    if len(shape) > _MAX_RANK:
        raise side.error(
            f"{where}: shape has {len(shape)} dimensions; at most {_MAX_RANK} are supported"
        )
    # numpy refuses shapes whose nonzero dimensions overflow its index type even when another
    # dimension is 0, so bound that product too (Python ints cannot overflow here).
    nonzero = math.prod(dim for dim in shape if dim)
    if nonzero * DATATYPES[datatype].itemsize > np.iinfo(np.intp).max:
        raise side.error(f"{where}: shape {shape_text(shape)} is too large")
    return shape


def _set_fields(contents: InferTensorContents) -> list[str]:
    # ListFields reports exactly the repeated fields that hold at least one value.
    return [field.name for field, _ in contents.ListFields()]


def _decode_raw(
    where: str, datatype: str, shape: tuple[int, ...], buffer: bytes, index: int, side: _Side
) -> np.ndarray:
    count = math.prod(shape)
    if datatype == "BYTES":
        return _decode_raw_bytes(f"{where}: {side.raw_field}[{index}]", shape, count, buffer, side)
    dtype = DATATYPES[datatype].newbyteorder("<")
    itemsize = dtype.itemsize
    size = len(buffer)
    if size != count * itemsize:
        if size % itemsize:
            held = f"{size} bytes, not a whole number of {itemsize}-byte {datatype} elements"
        else:
            held = f"{size // itemsize} {datatype} elements ({size} bytes)"
        raise side.error(
            f"{where}: shape {shape_text(shape)} has {count} elements but "
            f"{side.raw_field}[{index}] holds {held}"
        )
    array = np.frombuffer(buffer, dtype=dtype)
    if datatype == "BOOL":
        # Any other byte would give a bool array whose values compare unequal to True.
        octets = array.view(np.uint8)
        if octets.size and octets.max() > 1:
            position = int(np.argmax(octets > 1))
            raise side.error(
                f"{where}: raw BOOL element {position} is byte {int(octets[position])}; "
                "BOOL elements must be 0 or 1"
            )
    return array.reshape(shape)


def _decode_raw_bytes(
    where: str, shape: tuple[int, ...], count: int, buffer: bytes, side: _Side
) -> np.ndarray:
    size = len(buffer)
    # Each element takes at least its prefix, so this bounds the loop by the data actually sent
    # before anything is allocated for a huge declared shape.
    if count * _LENGTH_PREFIX > size:
        raise side.error(
            f"{where} holds {size} bytes, too few for the {count} length-prefixed BYTES "
            f"elements of shape {shape_text(shape)}"
        )
    elements: list[bytes] = []
    offset = 0
    for position in range(count):
        if offset + _LENGTH_PREFIX > size:
            raise side.error(
                f"{where} runs out at the 4-byte length prefix of BYTES element {position} "
                f"(offset {offset}, {size} bytes in all); shape {shape_text(shape)} "
                f"declares {count} elements"
            )
        length = int.from_bytes(buffer[offset : offset + _LENGTH_PREFIX], "little")
        start = offset + _LENGTH_PREFIX
        end = start + length
        if end > size:
            raise side.error(
                f"{where}: BYTES element {position} declares {length} bytes but only "
                f"{size - start} remain"
            )
        elements.append(buffer[start:end])
        offset = end
    if offset != size:
        raise side.error(
            f"{where} has {size - offset} bytes after the {count} BYTES elements that shape "
            f"{shape_text(shape)} declares"
        )
    return _object_array(elements, shape)


def _object_array(elements: Sequence[object], shape: tuple[int, ...]) -> np.ndarray:
    # np.array(list_of_bytes) would build a fixed-width 'S' array and strip trailing NULs.
    array = np.empty(len(elements), dtype=np.object_)
    array[:] = elements
    return array.reshape(shape)


def _decode_typed(
    where: str,
    datatype: str,
    shape: tuple[int, ...],
    contents: InferTensorContents,
    typed_fields: list[str],
    side: _Side,
) -> np.ndarray:
    field = _CONTENTS_FIELD[datatype]
    if field is None:
        raise side.error(
            f"{where}: FP16 has no typed contents field; send FP16 data in {side.raw_field}"
        )
    wrong = [other for other in typed_fields if other != field]
    if wrong:
        raise side.error(
            f"{where}: datatype {datatype} takes its data in contents.{field}, "
            f"but contents.{wrong[0]} is set"
        )
    values = getattr(contents, field)
    count = math.prod(shape)
    if len(values) != count:
        raise side.error(
            f"{where}: shape {shape_text(shape)} has {count} elements but "
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
            raise side.error(
                f"{where}: {datatype} element {position} is {int(wide[position])}, "
                f"outside [{low}, {high}]"
            )
        wide = wide.astype(DATATYPES[datatype])
    return wide.reshape(shape)


# --------------------------------------------------------------------------------------------
# Encoding


def encode_outputs(
    response: ModelInferResponse,
    outputs: Sequence[tuple[str, np.ndarray]],
    *,
    raw: bool,
) -> list[memoryview]:
    """Append one output tensor per ``(name, array)`` to a response, in order.

    Each tensor's datatype comes from :func:`datatype_of` and its shape from the array. Typed
    outputs go to the datatype's ``contents`` field. Raw outputs are returned rather than added
    to ``raw_output_contents``, as views of little-endian C-order bytes whatever the array's
    byte order and strides (an array already so is not copied): :func:`serialize_response`
    sends them from there. ``str`` elements of BYTES outputs are encoded as UTF-8.

    FP16 has no typed field, so a response with an FP16 output is encoded raw even when
    ``raw`` is false: the protocol does not let one response mix raw and typed outputs.

    Args:
        response: The response to append to. On error it may hold some of the outputs and
            should be discarded.
        outputs: The arrays to send, by name, in the order to send them.
        raw: Whether to use ``raw_output_contents`` rather than typed contents.

    Returns:
        The raw contents, one per output, in order; empty when the outputs are typed.

    Raises:
        ModelFailed: If an array's dtype has no datatype, a BYTES output holds an element that
            is neither ``bytes`` nor ``str``, or a raw BYTES element exceeds 4 GiB.
    """
    contents: list[memoryview] = []
    _encode_tensors(response.outputs.add, contents.append, outputs, raw, _RESPONSE_OUT)
    return contents


def serialize_response(response: ModelInferResponse, raw: Sequence[memoryview]) -> list[Buffer]:
    """``response`` serialised with ``raw`` as its ``raw_output_contents``, as buffers in order.

    Together they are the bytes of the response holding those contents (the entries of a
    repeated field are encoded one after the other, and parsers take fields in any order),
    but each raw buffer is itself one of them: a large output is not copied into the message.
    """
    parts: list[Buffer] = [response.SerializeToString()]
    for view in raw:
        parts.append(_RAW_OUTPUT_KEY + _varint(view.nbytes))
        parts.append(view)
    return parts


def _varint(value: int) -> bytes:
    """``value`` (at least 0) in the protocol buffer varint encoding."""
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


#: The key of a ``raw_output_contents`` entry: its field number and wire type 2 (length
#: delimited).
_RAW_OUTPUT_KEY = _varint(
    ModelInferResponse.DESCRIPTOR.fields_by_name["raw_output_contents"].number << 3 | 2
)


def encode_inputs(
    request: ModelInferRequest,
    inputs: Sequence[tuple[str, np.ndarray]],
    *,
    raw: bool,
) -> None:
    """Append one input tensor per ``(name, array)`` to a request, in order (the client side).

    The mirror of :func:`encode_outputs`, encoding the same way: datatypes from
    :func:`datatype_of`, raw data as little-endian C-order bytes, ``str`` elements of BYTES
    inputs as UTF-8, and every input raw when any is FP16.

    Bad arrays raise :class:`~trio_infer.errors.InvalidInput` rather than ``ModelFailed``: they
    are the caller's mistake, and INVALID_ARGUMENT is what a server would answer for them.

    Args:
        request: The request to append to; it should hold no inputs yet. On error it may hold
            some of the inputs and should be discarded.
        inputs: The arrays to send, by name, in the order to send them.
        raw: Whether to use ``raw_input_contents`` rather than typed contents.

    Raises:
        InvalidInput: If an array's dtype has no datatype, a BYTES input holds an element that
            is neither ``bytes`` nor ``str``, or a raw BYTES element exceeds 4 GiB.
    """

    def add_raw(view: memoryview) -> None:
        request.raw_input_contents.append(view.tobytes())

    _encode_tensors(request.inputs.add, add_raw, inputs, raw, _REQUEST_OUT)


def _encode_tensors(
    add_tensor: Callable[[], _Tensor],
    add_raw: Callable[[memoryview], None],
    arrays: Sequence[tuple[str, np.ndarray]],
    raw: bool,
    side: _Side,
) -> None:
    # asarray is free for arrays and lets a model return a numpy scalar.
    arrays = [(name, np.asarray(array)) for name, array in arrays]
    datatypes: list[str] = []
    for name, array in arrays:
        try:
            datatypes.append(datatype_of(array))
        except ModelFailed as error:
            raise side.error(f"{side.role} '{name}': {error.message}") from None
    raw = raw or "FP16" in datatypes
    for (name, array), datatype in zip(arrays, datatypes, strict=True):
        where = f"{side.role} '{name}'"
        tensor = add_tensor()
        tensor.name = name
        tensor.datatype = datatype
        tensor.shape.extend(array.shape)
        if datatype == "BYTES":
            elements = _bytes_elements(where, array, side)
            if raw:
                add_raw(memoryview(_pack_bytes(where, elements, side)))
            else:
                tensor.contents.bytes_contents.extend(elements)
        elif raw:
            # A no-op for a little-endian C-order array; a copy in that order for any other.
            little = np.ascontiguousarray(array, DATATYPES[datatype].newbyteorder("<"))
            add_raw(little.reshape(-1).view(np.uint8).data)
        else:
            field = _CONTENTS_FIELD[datatype]
            assert field is not None  # FP16, the only datatype without one, forces raw above
            # tolist converts in C; extending from the ndarray itself goes element by element.
            getattr(tensor.contents, field).extend(array.ravel().tolist())


def _bytes_elements(where: str, array: np.ndarray, side: _Side) -> list[bytes]:
    elements: list[bytes] = []
    for position, element in enumerate(array.ravel().tolist()):
        if isinstance(element, bytes):
            elements.append(element)
        elif isinstance(element, str):
            try:
                elements.append(element.encode("utf-8"))
            except UnicodeEncodeError as error:
                # Lone surrogates, e.g. from os.fsdecode of undecodable bytes.
                raise side.error(
                    f"{where}: BYTES element {position} is a str that UTF-8 cannot "
                    f"encode ({error.reason} at index {error.start})"
                ) from None
        else:
            raise side.error(
                f"{where}: BYTES element {position} is {type(element).__name__}; "
                f"BYTES {side.role}s hold bytes or str"
            )
    return elements


def _pack_bytes(where: str, elements: list[bytes], side: _Side) -> bytes:
    parts: list[bytes] = []
    for position, element in enumerate(elements):
        if len(element) > _MAX_ELEMENT_BYTES:
            raise side.error(
                f"{where}: BYTES element {position} has {len(element)} bytes; a raw "
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
        InvalidInput: If a parameter has no value set, or there are more than
            :data:`MAX_PARAMETERS`.
    """
    if len(params) > MAX_PARAMETERS:
        raise InvalidInput(
            f"{len(params)} parameters in one map; at most {MAX_PARAMETERS} are taken"
        )
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
