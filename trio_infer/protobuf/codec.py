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

import collections
import math
from collections.abc import Callable, Iterable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
from google.protobuf.message import DecodeError

from trio_infer.buffers import Buffer
from trio_infer.datatypes import (
    DATATYPES,
    LENGTH_PREFIX,
    MAX_RANK,
    bytes_elements,
    datatype_of,
    object_array,
    shape_problem,
    shape_text,
)
from trio_infer.errors import InferError, InvalidInput, ModelFailed
from trio_infer.protobuf import wire
from trio_infer.protobuf._proto.grpc_predict_v2_pb2 import (
    InferParameter,
    InferTensorContents,
    ModelInferRequest,
    ModelInferResponse,
    ModelStreamInferResponse,
)

__all__ = [
    "BYTES_ELEMENT_OVERHEAD",
    "MAX_BYTES_ELEMENTS",
    "MAX_PARAMETERS",
    "UNPACKED_LIMIT",
    "DecodingCost",
    "EncodingCost",
    "WireInputs",
    "decode_inputs",
    "decode_known_raw",
    "decode_outputs",
    "decode_parameters",
    "decoding_cost",
    "encode_inputs",
    "encode_outputs",
    "encode_parameters",
    "encode_raw_as_is",
    "encode_response",
    "encoding_cost",
    "prepare_inputs",
    "serialize_response",
    "stream_response",
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

#: Each datatype's and typed field's dtype in little-endian order, the wire's: made once, as
#: ``newbyteorder`` makes a new dtype at every call.
_LITTLE: dict[str, np.dtype[Any]] = {name: dt.newbyteorder("<") for name, dt in DATATYPES.items()}
_FIELD_LITTLE: dict[str, np.dtype[Any]] = {
    name: dt.newbyteorder("<") for name, dt in _FIELD_DTYPE.items()
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


_MAX_ELEMENT_BYTES = 2**32 - 1

#: Parameters one map (a request's, a tensor's) may hold. Each becomes Python objects decoded
#: one by one on the event loop; V2 clients send a handful.
MAX_PARAMETERS = 1024
#: Elements one BYTES tensor may hold. Each becomes a Python ``bytes`` object, decoded one by one
#: on the event loop, at about ten times the memory of a short element's bytes: a cap keeps both
#: the loop's stall and the memory beyond what was reserved bounded.
MAX_BYTES_ELEMENTS = 1 << 20

#: Bytes one BYTES element holds beyond its payload once decoded: a Python ``bytes`` object's
#: header (33 bytes, rounded up by the allocator), its slot in a list and in the object array,
#: and protobuf's view of it in a parsed typed field. Conservative: empty and one-byte elements
#: are shared objects and cost only their slots.
BYTES_ELEMENT_OVERHEAD = 96

#: Elements decoded in one step of a typed field. Between steps the interpreter may hand the
#: GIL to another thread: a decode run off the event loop lets the loop run at the switch
#: interval instead of waiting for the whole field.
_DECODE_CHUNK = 1 << 13

#: The memory one element of each typed field takes once protobuf has parsed it: twice its
#: size, as a repeated field grows by doubling while it is parsed.
_FIELD_ITEMSIZE: dict[str, int] = {
    "bool_contents": 2,
    "int_contents": 8,
    "int64_contents": 16,
    "uint_contents": 8,
    "uint64_contents": 16,
    "fp32_contents": 8,
    "fp64_contents": 16,
}

#: Contents whose packed fields the wire view cannot take as blobs (elements sent unpacked,
#: fields the protocol does not define, a field split into very many records) are parsed by
#: the real ``InferTensorContents`` instead, element by element on the event loop, up to this
#: many bytes: each element takes at least two bytes unpacked, so that stall stays about a
#: millisecond. Larger ones are refused; every protobuf encoder packs proto3 numeric fields.
UNPACKED_LIMIT = 1 << 16

#: Records of one packed field (or of one input's ``contents``) the wire view takes: each is a
#: Python ``bytes`` object, and encoders write one (merging messages, a few).
_MAX_RECORDS = 64

#: The typed fields whose elements are fixed-width little-endian, not varints.
_FIXED_FIELDS = frozenset({"fp32_contents", "fp64_contents"})

#: Every typed field in field-number order, the order ``ListFields`` reports them in.
_FIELD_ORDER = tuple(f.name for f in InferTensorContents.DESCRIPTOR.fields)
_FIELD_BY_NUMBER = {f.number: f.name for f in InferTensorContents.DESCRIPTOR.fields}

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

# DecodingCost, WireInputs, _WireContents and EncodingCost are made for every request: slotted,
# not frozen, as a frozen dataclass sets each field through object.__setattr__, which costs
# several times a plain slot's store.


@dataclass(slots=True)
class DecodingCost:
    """What decoding a parsed request's inputs takes (see :func:`decoding_cost`)."""

    nbytes: int
    """Bytes decoding holds beyond the request's message: typed contents as parsed and as
    arrays, BYTES elements as Python objects. Raw numeric inputs are views of the message's
    buffers and cost nothing more."""
    elements: int
    """Elements converted (typed contents and BYTES): the decode's time."""


@dataclass(slots=True)
class _WireContents:
    """One input's typed contents split by :func:`prepare_inputs`: numeric fields as blobs."""

    blobs: dict[str, list[memoryview]]
    """Each numeric field that has records: its packed payloads, in wire order."""
    counts: dict[str, list[int]]
    """The elements in each of those payloads."""
    bytes_elements: int
    """The elements of ``bytes_contents`` (only counted: a BYTES input is parsed for real)."""
    fields: list[str]
    """The fields holding at least one element, in field-number order (as ``ListFields``)."""

    def held(self, name: str) -> int:
        if name == "bytes_contents":
            return self.bytes_elements
        return sum(self.counts.get(name, ()))


_Contents = InferTensorContents | _WireContents


@dataclass(slots=True)
class WireInputs:
    """A request's inputs as parsed by the wire view (:func:`prepare_inputs`), to decode."""

    tensors: Sequence[Any]
    """The request's ``inputs``, as a list (wire-view tensors: name, datatype, shape as in the
    real one)."""
    raw: Sequence[bytes]
    """The request's ``raw_input_contents``."""
    contents: list[_Contents | None]
    """Each input's typed contents, or ``None`` where the input has no ``contents``."""
    held: int
    """Bytes the split contents hold (a copy of each input's contents taken from the request)."""


def prepare_inputs(request: Any) -> WireInputs:
    """Split a :data:`~trio_infer.protobuf.wire.WireInferRequest`'s typed contents into blobs.

    Each input's ``contents`` is copied out of the request and split into its records: a packed
    numeric field is a record whose payload is decoded later, with numpy, from a zero-copy
    slice. Contents that are not all packed (elements sent unpacked, one record each; fields
    the protocol does not define; more than a few records) are parsed by the real
    ``InferTensorContents`` if at most :data:`UNPACKED_LIMIT` bytes, so they decode exactly as
    in the real request, and refused if larger. A BYTES input's contents are parsed by the real
    type: its elements are one record each however they are declared. Costs a copy of the
    typed contents and, for varint fields, a vectorised count.

    A request that uses ``raw_input_contents`` is checked first for an input whose contents
    hold data too, before any contents is split or counted (see :func:`decode_inputs`); the
    contents of the others hold nothing and are not kept.

    Raises:
        InvalidInput: If an input has typed contents holding data in a request that uses
            ``raw_input_contents``, contents are not a valid ``InferTensorContents`` (a packed
            fixed-width field is not a whole number of elements, a packed varint field ends in
            a truncated varint, ...), or contents not all packed exceed :data:`UNPACKED_LIMIT`.
    """
    # Repeated fields are read as slices (lists): a protobuf repeated field has no iterator,
    # and Python's fallback indexes it until an IndexError, formatted at the end of every loop.
    tensors = request.inputs[:]
    raw_contents = request.raw_input_contents
    raw = len(raw_contents) > 0
    if raw:
        # Loops rather than generators, on every raw request's path; the refusal is
        # _check_not_mixed's, which finds the first tensor that holds data again.
        for tensor in tensors:
            for occurrence in tensor.contents[:]:
                if occurrence:
                    _check_not_mixed(
                        tensors,
                        (any(len(held) for held in each.contents[:]) for each in tensors),
                        request.model_name,
                        _REQUEST_IN,
                    )
        # Every input's contents are empty messages: nothing to keep.
        return WireInputs(tensors, raw_contents, [None] * len(tensors), 0)
    contents: list[_Contents | None] = []
    held = 0
    for tensor in tensors:
        records = tensor.contents
        if not len(records):
            contents.append(None)
            continue
        where = f"input '{tensor.name}'"
        if len(records) > _MAX_RECORDS and len(records) > UNPACKED_LIMIT // 2:
            raise InvalidInput(
                f"{where}: contents appears {len(records)} times in the request; send it once"
            )
        # Each occurrence of a message field is a whole message; protobuf merges them in order.
        occurrences: list[bytes] = records[:]
        size = sum(len(occurrence) for occurrence in occurrences)
        if tensor.datatype == "BYTES":
            contents.append(_parse_contents(where, occurrences))
            continue
        split: list[tuple[int, memoryview]] = []
        try:
            for occurrence in occurrences:
                split += wire.split_records(memoryview(occurrence), _MAX_RECORDS - len(split))
        except wire.Irregular:
            if size > UNPACKED_LIMIT:
                raise InvalidInput(
                    f"{where}: contents has elements sent unpacked (a record per element), "
                    f"fields the protocol does not define, or more than {_MAX_RECORDS} "
                    f"records, in {size} bytes; contents over {UNPACKED_LIMIT} bytes are "
                    "taken only packed (protobuf's default for proto3 numeric fields): send "
                    "them packed or in raw_input_contents"
                ) from None
            contents.append(_parse_contents(where, occurrences))
            continue
        held += size
        blobs: dict[str, list[memoryview]] = {}
        counts: dict[str, list[int]] = {}
        bytes_elements = 0
        for number, payload in split:
            name = _FIELD_BY_NUMBER.get(number)
            if name is None:
                continue  # a field the protocol does not define: the real parse ignores it too
            if name == "bytes_contents":
                bytes_elements += 1
                continue
            blobs.setdefault(name, []).append(payload)
            counts.setdefault(name, []).append(_count_elements(where, name, payload))
        fields = [
            name
            for name in _FIELD_ORDER
            if (bytes_elements if name == "bytes_contents" else sum(counts.get(name, ())))
        ]
        contents.append(_WireContents(blobs, counts, bytes_elements, fields))
    return WireInputs(tensors, raw_contents, contents, held)


def _check_not_mixed(
    tensors: Sequence[Any], holds_data: Iterable[bool], model_name: str, side: _Side
) -> None:
    """Refuse the first tensor whose typed contents hold data in a message that uses raw
    contents, in Triton's words (clients match them), before anything else of it is checked.

    Args:
        tensors: The message's tensors.
        holds_data: For each tensor, whether its ``contents`` hold any bytes. An empty
            ``contents`` beside raw data is taken: MLServer's client sends one.
        model_name: The model the message is for.
        side: Which message this is.
    """
    for tensor, holding in zip(tensors, holds_data, strict=True):
        if holding:
            raise side.error(
                f"contents field must not be specified when using {side.raw_field} for "
                f"'{tensor.name}' for model '{model_name}': send every {side.role} raw or every "
                f"{side.role} typed, not both"
            )


def _parse_contents(where: str, occurrences: list[bytes]) -> InferTensorContents:
    contents = InferTensorContents()
    try:
        for occurrence in occurrences:
            contents.MergeFromString(occurrence)
    except DecodeError as exc:
        raise InvalidInput(
            f"the request is not a valid inference.ModelInferRequest: {where}: contents: {exc}"
        ) from None
    return contents


def _count_elements(where: str, name: str, payload: memoryview) -> int:
    if name in _FIXED_FIELDS:
        itemsize = _FIELD_DTYPE[name].itemsize
        if len(payload) % itemsize:
            raise InvalidInput(
                f"the request is not a valid inference.ModelInferRequest: {where}: packed "
                f"contents.{name} has {len(payload)} bytes, not a whole number of "
                f"{itemsize}-byte elements"
            )
        return len(payload) // itemsize
    try:
        return wire.count_varints(payload)
    except wire.VarintError as exc:
        raise InvalidInput(
            f"the request is not a valid inference.ModelInferRequest: {where}: "
            f"contents.{name}: {exc}"
        ) from None


def decoding_cost(request: ModelInferRequest | WireInputs, message_size: int) -> DecodingCost:
    """The memory and work :func:`decode_inputs` will take for ``request``, without decoding.

    Typed contents are small on the wire and large in memory. Parsed by the real message, a
    varint of one byte is an INT64 of 8 bytes, up to 16 in a parsed field that grew by
    doubling, and 8 more in the array. Prepared by :func:`prepare_inputs`, the packed blobs are
    already held (:attr:`WireInputs.held`) and decoding adds the array, a narrowed copy for the
    narrow integer datatypes, and bounded scratch for varints. Each BYTES element becomes a
    Python object of :data:`BYTES_ELEMENT_OVERHEAD` bytes beyond its payload, and the payloads
    are copied (together at most the message). Only the fields' counts are read, never an
    element or a raw buffer, so a server can reserve its answer before it decodes. Malformed
    requests are costed as sent; decoding then refuses them.

    Args:
        request: The parsed request, or its inputs prepared by :func:`prepare_inputs`.
        message_size: The size of its message in bytes.
    """
    if isinstance(request, WireInputs):
        tensors: Sequence[Any] = request.tensors
        contents = request.contents
        raw = len(request.raw) > 0
        nbytes = request.held
    else:
        tensors = request.inputs
        contents = [t.contents if t.HasField("contents") else None for t in request.inputs]
        raw = len(request.raw_input_contents) > 0
        nbytes = 0
    elements = 0
    payloads = False
    # Indexed, not zipped: zip's strict= is a keyword, which costs a call a dict (every list
    # here is one entry per tensor, made so).
    for index, tensor in enumerate(tensors):
        typed = contents[index]
        datatype = tensor.datatype
        if raw:
            if datatype == "BYTES":
                shape = tensor.shape
                # The rank first: a product of thousands of huge dimensions is a number of
                # millions of bits, seconds of the event loop (decoding refuses such a shape).
                valid = len(shape) <= MAX_RANK and all(dim >= 0 for dim in shape)
                declared = math.prod(shape) if valid else 0
                # Each element takes at least its 4-byte prefix: no more fit in the message.
                count = min(declared, message_size // LENGTH_PREFIX, MAX_BYTES_ELEMENTS)
                nbytes += count * BYTES_ELEMENT_OVERHEAD
                elements += count
                payloads = True
            continue
        if typed is None:
            continue
        narrow = DATATYPES[datatype].itemsize if datatype in _NARROW_RANGE else 0
        if isinstance(typed, _WireContents):
            for name in typed.fields:
                count = typed.held(name)
                elements += count
                if name == "bytes_contents":
                    nbytes += count * BYTES_ELEMENT_OVERHEAD
                    payloads = True
                else:
                    # The array decoded from the blobs, and a narrowed copy of that.
                    nbytes += count * (_FIELD_DTYPE[name].itemsize + narrow)
                    if name not in _FIXED_FIELDS:
                        nbytes += wire.varint_scratch(count)
            continue
        for descriptor, values in typed.ListFields():
            count = len(values)
            elements += count
            if descriptor.name == "bytes_contents":
                nbytes += count * BYTES_ELEMENT_OVERHEAD
                payloads = True
            else:
                wide = _FIELD_DTYPE[descriptor.name].itemsize
                # The parsed field, the array decoded from it, and a narrowed copy of that.
                nbytes += count * (_FIELD_ITEMSIZE[descriptor.name] + wide + narrow)
    if payloads:
        nbytes += message_size
    return DecodingCost(nbytes, elements)


def decode_inputs(request: ModelInferRequest | WireInputs) -> dict[str, np.ndarray]:
    """Decode every input tensor of a request into a numpy array.

    Raw numeric inputs are zero-copy, read-only views of the request's buffers, so a model that
    wants to modify an input in place must copy it first. BYTES inputs are object arrays of
    ``bytes``. A request prepared by :func:`prepare_inputs` decodes to the same arrays as the
    same bytes parsed as a ``ModelInferRequest``, or both are refused.

    Args:
        request: The request, or its inputs prepared by :func:`prepare_inputs`; its inputs
            carry data either all in ``raw_input_contents`` (one entry per input, in order) or
            all in their typed ``contents``.

    Returns:
        The arrays by input name, in the request's order, each with the datatype's dtype
        (see :data:`DATATYPES`) and the declared shape.

    Raises:
        InvalidInput: If a name repeats, a datatype is unknown, a shape is negative or too large,
            raw and typed data are mixed, the number of raw buffers is not the number of inputs,
            data sits in the wrong typed field, the data does not hold exactly the elements
            the shape declares, or (prepared) a packed varint is malformed.
    """
    if isinstance(request, WireInputs):
        # prepare_inputs has refused raw and typed data mixed.
        return _decode_tensors(request.tensors, request.raw, request.contents, _REQUEST_IN)
    contents = _real_contents(
        request.inputs, request.raw_input_contents, request.model_name, _REQUEST_IN
    )
    return _decode_tensors(request.inputs, request.raw_input_contents, contents, _REQUEST_IN)


def decode_known_raw(
    request: Any, raw: Sequence[Buffer]
) -> tuple[list[Any], dict[str, np.ndarray]] | None:
    """A raw request's inputs decoded in one pass, when each is of a numeric layout decoded
    before (:data:`_RAW_LAYOUTS`): the request's ``inputs`` (a list) and the arrays by name, as
    :func:`decode_inputs` gives them.

    Such inputs are views of the request's buffers: :func:`decoding_cost` is nothing beyond the
    message, so nothing needs reserving before they are made, and the three stages are one
    pass over the inputs. ``None`` for any other request (typed, contents beside raw data, a
    raw entry per input missing or extra, an unremembered layout or size, a name twice), and
    nothing made: it takes :func:`prepare_inputs`, :func:`decoding_cost` and
    :func:`decode_inputs`, which refuse what is wrong in their own words.

    Args:
        request: A :data:`~trio_infer.protobuf.wire.WireInferRequest`.
        raw: Its ``raw_input_contents``, or the entries
            :func:`~trio_infer.protobuf.wire.raw_input_suffix` split off its message (then
            the request holds none): the arrays view them.
    """
    tensors: list[Any] = request.inputs[:]
    if not raw or len(raw) != len(tensors):
        return None
    decoded: dict[str, np.ndarray] = {}
    for index, tensor in enumerate(tensors):
        if len(tensor.contents):  # even an empty one: prepare_inputs decides what it holds
            return None
        shape = tuple(tensor.shape[:])
        layout = _RAW_LAYOUTS.get((tensor.datatype, shape))
        buffer = raw[index]
        name = tensor.name
        if layout is None or len(buffer) != layout[1] or name in decoded:
            return None
        decoded[name] = np.ndarray(shape, layout[0], buffer)
    return tensors, decoded


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
    contents = _real_contents(
        response.outputs, response.raw_output_contents, response.model_name, _RESPONSE_IN
    )
    return _decode_tensors(response.outputs, response.raw_output_contents, contents, _RESPONSE_IN)


def _real_contents(
    tensors: Sequence[_Tensor], raw: Sequence[bytes], model_name: str, side: _Side
) -> list[_Contents | None]:
    """Each tensor's typed contents (``None``: none, or the message uses raw data), raw and
    typed data mixed refused first."""
    if raw:
        holds_data = (t.HasField("contents") and t.contents.ByteSize() > 0 for t in tensors)
        _check_not_mixed(tensors, holds_data, model_name, side)
        return [None] * len(tensors)
    return [t.contents if t.HasField("contents") else None for t in tensors]


def _decode_tensors(
    tensors: Sequence[Any],
    raw: Sequence[bytes],
    contents: Sequence[_Contents | None],
    side: _Side,
) -> dict[str, np.ndarray]:
    if raw and len(raw) != len(tensors):
        raise side.error(
            f"{side.message} has {len(tensors)} {side.role}s but {len(raw)} {side.raw_field} "
            f"entries; {side.raw_field} needs exactly one entry per {side.role}, in "
            f"{side.role} order"
        )
    decoded: dict[str, np.ndarray] = {}
    for index, tensor in enumerate(tensors):  # indexed: see decoding_cost
        typed = contents[index]
        name = tensor.name
        datatype = tensor.datatype
        # A slice first: a protobuf repeated field is iterated by indexing until an IndexError.
        shape = tuple(tensor.shape[:])
        if raw:
            # Typed data beside raw data was refused before this: typed is None. A layout
            # seen valid before, with the bytes it needs, is every check passed already.
            buffer = raw[index]
            layout = _RAW_LAYOUTS.get((datatype, shape))
            if layout is not None and len(buffer) == layout[1] and name not in decoded:
                decoded[name] = np.ndarray(shape, layout[0], buffer)
                continue
        where = f"{side.role} '{name}'"
        if name in decoded:
            raise side.error(f"{where} appears more than once in the {side.message}")
        _check_datatype(where, datatype, side)
        _check_shape(where, shape, datatype, side)
        if datatype == "BYTES" and math.prod(shape) > MAX_BYTES_ELEMENTS:
            raise side.error(
                f"{where}: shape {shape_text(shape)} has {math.prod(shape)} BYTES elements; "
                f"at most {MAX_BYTES_ELEMENTS} are taken"
            )
        if raw:
            decoded[name] = _decode_raw(where, datatype, shape, raw[index], index, side)
        else:
            decoded[name] = _decode_typed(
                where, datatype, shape, InferTensorContents() if typed is None else typed, side
            )
    return decoded


#: The dtype and byte size of a raw tensor by (datatype, shape), for the numeric datatypes whose
#: every byte string of that size is valid (not BOOL, not BYTES), once one such tensor has been
#: decoded: a model's tensors repeat a few layouts, and the checks cost more than the decode.
#: Bounded like :data:`_METADATA`; only dict operations touch it (decodes off the loop share it).
_RAW_LAYOUTS: dict[tuple[str, tuple[int, ...]], tuple[np.dtype[Any], int]] = {}
_RAW_LAYOUT_ENTRIES = 1024
_RAW_LAYOUT_RANK = 8


def _check_datatype(where: str, datatype: str, side: _Side) -> None:
    if datatype not in DATATYPES:
        raise side.error(
            f"{where}: unknown datatype '{datatype}'; valid datatypes are {_VALID_DATATYPES}"
        )


def _check_shape(where: str, shape: tuple[int, ...], datatype: str, side: _Side) -> None:
    problem = shape_problem(shape, DATATYPES[datatype].itemsize, side.message)
    if problem is not None:
        raise side.error(f"{where}: {problem}")


def _set_fields(contents: _Contents) -> list[str]:
    if isinstance(contents, _WireContents):
        return contents.fields
    # ListFields reports exactly the repeated fields that hold at least one value.
    return [field.name for field, _ in contents.ListFields()]


def _decode_raw(
    where: str, datatype: str, shape: tuple[int, ...], buffer: bytes, index: int, side: _Side
) -> np.ndarray:
    count = math.prod(shape)
    if datatype == "BYTES":
        return bytes_elements(buffer, shape, f"{where}: {side.raw_field}[{index}]", side.error)
    dtype = _LITTLE[datatype]
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
    if datatype == "BOOL":
        # Any other byte would give a bool array whose values compare unequal to True.
        octets = np.frombuffer(buffer, np.uint8)
        if octets.size and octets.max() > 1:
            position = int(np.argmax(octets > 1))
            raise side.error(
                f"{where}: raw BOOL element {position} is byte {int(octets[position])}; "
                "BOOL elements must be 0 or 1"
            )
    elif len(shape) <= _RAW_LAYOUT_RANK:
        if len(_RAW_LAYOUTS) >= _RAW_LAYOUT_ENTRIES:
            _RAW_LAYOUTS.clear()  # a model whose shapes never repeat: start again
        _RAW_LAYOUTS[datatype, shape] = (dtype, size)
    # The array of its shape over the buffer (exactly its size, checked above) in one call, not
    # frombuffer's flat array and a reshaped view of it; read-only, as the buffer is bytes.
    # Positional: numpy parses keyword arguments apart, at a cost on every input.
    return np.ndarray(shape, dtype, buffer)


def _decode_typed(
    where: str,
    datatype: str,
    shape: tuple[int, ...],
    contents: _Contents,
    side: _Side,
) -> np.ndarray:
    typed_fields = _set_fields(contents)
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
    count = math.prod(shape)
    held = contents.held(field) if isinstance(contents, _WireContents) else None
    values = getattr(contents, field) if held is None else ()
    if held is None:
        held = len(values)
    if held != count:
        raise side.error(
            f"{where}: shape {shape_text(shape)} has {count} elements but "
            f"contents.{field} holds {held} values"
        )
    if isinstance(contents, _WireContents):
        # prepare_inputs parses a BYTES input's contents with the real type.
        assert datatype != "BYTES"
        wide = _decode_blobs(where, field, contents, count, side)
        return _narrowed(where, datatype, wide, side).reshape(shape)
    if datatype == "BYTES":
        elements: list[bytes] = []
        for start in range(0, count, _DECODE_CHUNK):
            elements.extend(values[start : start + _DECODE_CHUNK])
        return object_array(elements, shape)
    wide = np.empty(count, dtype=_FIELD_DTYPE[field])
    items = iter(values)
    for start in range(0, count, _DECODE_CHUNK):
        # fromiter with a count takes that many from the shared iterator and no more.
        end = min(start + _DECODE_CHUNK, count)
        wide[start:end] = np.fromiter(items, dtype=wide.dtype, count=end - start)
    return _narrowed(where, datatype, wide, side).reshape(shape)


def _decode_blobs(
    where: str, field: str, contents: _WireContents, count: int, side: _Side
) -> np.ndarray:
    wide = np.empty(count, dtype=_FIELD_DTYPE[field])
    done = 0
    records = zip(contents.blobs.get(field, ()), contents.counts.get(field, ()), strict=True)
    for payload, held in records:
        part = wide[done : done + held]
        if field in _FIXED_FIELDS:
            part[:] = np.frombuffer(payload, dtype=wide.dtype.newbyteorder("<"))
        else:
            try:
                wire.decode_varints(payload, part)
            except wire.VarintError as exc:
                raise side.error(f"{where}: contents.{field}: {exc}") from None
        done += held
    return wide


def _narrowed(where: str, datatype: str, wide: np.ndarray, side: _Side) -> np.ndarray:
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
    return wide


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


@dataclass(slots=True)
class EncodingCost:
    """What encoding a model's outputs takes (see :func:`encoding_cost`)."""

    nbytes: int
    """Bytes :func:`encode_response` allocates: typed contents' packed blobs, framed BYTES
    outputs, copies of arrays not already little-endian C-order, small raw outputs joined with
    the answer's records, and its temporaries. An output sent from its array's own memory (raw,
    64 KiB or more) costs nothing here."""
    outputs: int
    """Bytes the output arrays themselves hold: numeric ones their ``nbytes``, BYTES ones
    their elements as Python objects (:data:`BYTES_ELEMENT_OVERHEAD` each) and payloads. The
    encoded buffers of an output sent from its own memory are these bytes."""
    elements: int
    """Elements converted or copied (typed contents, BYTES, copied raw arrays): the encode's
    time."""
    datatypes: list[str]
    """Each output's datatype, in order: :func:`encode_response` takes them from here rather
    than finding them again."""


def encoding_cost(outputs: Sequence[tuple[str, np.ndarray]], *, raw: bool) -> EncodingCost:
    """The memory and work :func:`encode_response` will take for ``outputs``, without encoding.

    Decides each output's encoding exactly as :func:`encode_response` does (every output raw
    when one is FP16). Typed varint contents are bounded by their widest element (one pass
    for the array's minimum and maximum), so the bound is exact for elements of one size.
    BYTES outputs take a pass over their elements for their lengths, without keeping an
    object per element.

    Raises:
        ModelFailed: As :func:`encode_response` would: an array's dtype has no datatype, a
            BYTES element is neither ``bytes`` nor ``str``, a raw one exceeds 4 GiB.
    """
    arrays, datatypes, raw = _tensors_to_encode(outputs, raw, _RESPONSE_OUT)
    nbytes = 0
    held = 0
    elements = 0
    for index, (name, array) in enumerate(arrays):  # indexed: see decoding_cost
        datatype = datatypes[index]
        count = array.size
        nbytes += _metadata_cost(name, array.ndim)
        if datatype == "BYTES":
            where = f"output '{name}'"
            _, lengths, converted = _bytes_lengths(where, array, _RESPONSE_OUT)
            if raw:
                _check_raw_lengths(where, lengths, _RESPONSE_OUT)
            payload = int(lengths.sum())
            held += array.nbytes + count * BYTES_ELEMENT_OVERHEAD + payload
            if converted:
                # A list of the elements, and a bytes object for each str converted.
                nbytes += count * (8 + BYTES_ELEMENT_OVERHEAD) + payload
            framed = int(_header_sizes(lengths, raw).sum()) + payload
            # The framed output, and one step's joined payloads and mask.
            nbytes += framed + count * _FRAMING_SCRATCH_PER_ELEMENT
            nbytes += 2 * min(framed, _FRAMING_STEP_BYTES)
            nbytes += _FRAMING_STEP_SCRATCH_PER_ELEMENT * min(count, _FRAMING_STEP)
            elements += count
            continue
        held += array.nbytes
        # A blob under _SEPARATE_BLOB (raw contents, a fixed-width or BOOL field's packed
        # payload), copied or not, is copied again when joined with the answer's records.
        if raw:
            size = array.nbytes
            if not _is_little_c_order(array, _LITTLE[datatype]):
                nbytes += size
                elements += count
            if size < _SEPARATE_BLOB:
                nbytes += size
            continue
        field = _CONTENTS_FIELD[datatype]
        assert field is not None  # FP16, the only datatype without one, forces raw above
        elements += count
        if field in _FIXED_FIELDS:
            size = count * _FIELD_DTYPE[field].itemsize
            if not _is_little_c_order(array, _FIELD_LITTLE[field]):
                nbytes += size
            if size < _SEPARATE_BLOB:
                nbytes += size
        elif datatype == "BOOL":
            if _bool_copy_needed(array):
                nbytes += count
            if count < _SEPARATE_BLOB:
                nbytes += count
        elif count:
            nbytes += count * _widest_varint(array) + wire.varint_encode_scratch(count)
            nbytes += _JOINED_BYTES + _SEPARATE_BLOB  # one buffer of parts being joined
    return EncodingCost(nbytes, held, elements, datatypes)


def encode_response(
    response: ModelInferResponse,
    outputs: Sequence[tuple[str, np.ndarray]],
    *,
    raw: bool,
    datatypes: Sequence[str] | None = None,
) -> list[Buffer]:
    """``response`` with one output tensor per ``(name, array)`` appended, serialised.

    Encodes as :func:`encode_outputs` then :func:`serialize_response` do (the same datatypes,
    every output raw when one is FP16, ``str`` elements as UTF-8), and the buffers joined are
    byte for byte what protobuf serialises for the response holding those outputs; but no
    element becomes a Python object. Each output's metadata is serialised by protobuf, and its
    contents are written after it as the length-delimited records protobuf would write: typed
    numeric contents as one packed blob made with numpy (fixed-width elements as their
    little-endian bytes, varint fields with :func:`~trio_infer.protobuf.wire.encode_varint_parts`),
    BYTES as one buffer of length-prefixed (raw) or keyed (typed) elements. Blobs and raw
    contents of 64 KiB or more stay separate buffers, so they reach the socket without a join;
    smaller ones are joined with the records around them (the transport would copy them into
    its frame anyway). A typed FP32 or FP64 output, like a raw one, is sent from its array's own
    memory when that is already little-endian C-order.

    ``response`` should hold no outputs or raw contents; it is not changed. ``datatypes``, when
    given, are the outputs' as :func:`encoding_cost` found them (:attr:`EncodingCost.datatypes`).

    Raises:
        ModelFailed: If an array's dtype has no datatype, a BYTES output holds an element that
            is neither ``bytes`` nor ``str``, or a raw BYTES element exceeds 4 GiB.
    """
    if datatypes is None:
        arrays, datatypes, raw = _tensors_to_encode(outputs, raw, _RESPONSE_OUT)
    else:
        arrays, raw = outputs, _all_raw(raw, datatypes)
    head = response.SerializeToString()
    if raw:
        records: list[bytes] = []
        # Each raw output's contents: an array, or bytes of one, joinable as they are.
        raw_contents: list[np.ndarray | memoryview] = []
        for index, (name, array) in enumerate(arrays):  # indexed: see decoding_cost
            datatype = datatypes[index]
            records.append(_output_metadata(name, datatype, array.shape)[1])
            if datatype == "BYTES":
                where = f"output '{name}'"
                elements, lengths, _ = _bytes_lengths(where, array, _RESPONSE_OUT)
                _check_raw_lengths(where, lengths, _RESPONSE_OUT)
                raw_contents.append(_frame_elements(elements, lengths, raw=True))
            elif (
                array.nbytes < _SEPARATE_BLOB
                and array.flags.c_contiguous
                and array.dtype == _LITTLE[datatype]
            ):
                # Joined with the small parts: its bytes as they are, no view made of them.
                raw_contents.append(array)
            else:
                raw_contents.append(_raw_view(array, datatype))
        return _raw_buffers(head, records, raw_contents)
    writer = _Writer(head)
    for index, (name, array) in enumerate(arrays):  # indexed: see decoding_cost
        datatype = datatypes[index]
        meta = _output_metadata(name, datatype, array.shape)[0]
        if datatype == "BYTES":
            elements, lengths, _ = _bytes_lengths(f"output '{name}'", array, _RESPONSE_OUT)
            # bytes_contents is not packed: its records are the contents message itself.
            blobs = [_frame_elements(elements, lengths, raw=False)]
            field_header = b""
            blob_size = blobs[0].nbytes
        else:
            field, blobs = _typed_blobs(datatype, array)
            blob_size = sum(blob.nbytes for blob in blobs)
            # An empty packed field is not written, as protobuf omits an empty repeated field.
            field_header = _FIELD_KEY[field] + _varint(blob_size) if blob_size else b""
        contents_size = len(field_header) + blob_size
        contents_header = _CONTENTS_KEY + _varint(contents_size)
        tensor_size = len(meta) + len(contents_header) + contents_size
        opening = _OUTPUT_KEY + _varint(tensor_size) + meta + contents_header + field_header
        writer.small(opening, len(opening))
        # Each part is let go once written: joined small parts then replace, not add to, them.
        queue = collections.deque(blobs)
        del blobs
        while queue:
            writer.blob(queue.popleft())
    return writer.finish()


#: The datatype of each numeric dtype in little-endian order, the wire's: a raw output of one
#: of these in C order is sent from its own memory, nothing converted.
_AS_IS: dict[np.dtype[Any], str] = {
    little: name for name, little in _LITTLE.items() if name != "BYTES"
}


def encode_raw_as_is(
    response: ModelInferResponse,
    outputs: Sequence[tuple[str, np.ndarray]],
    reserve: Callable[[EncodingCost], None],
) -> list[Buffer] | None:
    """:func:`encode_response` of ``outputs`` raw, when each is a numeric array in
    little-endian C order, with what it takes (:func:`encoding_cost`) passed to ``reserve``
    before anything is joined: one pass over the outputs for both.

    Such outputs are sent or joined from their own memory: nothing is converted, and no check
    can fail. ``None`` for any other outputs, with nothing reserved: they take
    :func:`encoding_cost` and :func:`encode_response`.
    """
    datatypes: list[str] = []
    records: list[bytes] = []
    contents: list[np.ndarray | memoryview] = []
    nbytes = 0
    held = 0
    for name, array in outputs:
        datatype = _AS_IS.get(array.dtype)
        if datatype is None or not array.flags.c_contiguous:
            return None
        shape = array.shape
        size = array.nbytes
        datatypes.append(datatype)
        records.append(_output_metadata(name, datatype, shape)[1])
        nbytes += _metadata_cost(name, len(shape))
        held += size
        if size < _SEPARATE_BLOB:
            # Joined with the answer's records: a copy, as encoding_cost counts it.
            nbytes += size
            contents.append(array)
        else:
            # Its own memory as bytes (not empty: at least _SEPARATE_BLOB of them).
            contents.append(array.data.cast("B"))
    reserve(EncodingCost(nbytes, held, 0, datatypes))
    return _raw_buffers(response.SerializeToString(), records, contents)


def _metadata_cost(name: str, rank: int) -> int:
    """What one output's metadata and the records' keys and lengths take serialised."""
    return _METADATA_ALLOWANCE + 4 * len(name) + wire.MAX_VARINT_BYTES * rank


def _raw_buffers(
    head: bytes, records: list[bytes], contents: list[np.ndarray | memoryview]
) -> list[Buffer]:
    """A raw answer's buffers in order: ``head`` (the serialised response without outputs),
    each output's record, then each output's ``raw_output_contents`` entry, as
    :class:`_Writer` gives them."""
    parts: list[bytes | np.ndarray | memoryview] = [head, *records]
    joined = len(head)
    for record in records:
        joined += len(record)
    for each in contents:
        size = each.nbytes
        key = _RAW_OUTPUT_KEY + _varint(size)
        parts.append(key)
        parts.append(each)
        # A large output is a buffer of its own: never one join with the rest.
        joined += len(key) + (size if size < _SEPARATE_BLOB else _JOINED_BYTES)
    if joined < _JOINED_BYTES:
        # The writer would join every part into one buffer: joined at once, without it.
        return [b"".join(parts)]  # type: ignore[arg-type]
    writer = _Writer(head)
    for index in range(1, len(parts)):
        part = parts[index]
        if isinstance(part, bytes):  # a record or a key
            writer.small(part, len(part))
        else:
            writer.blob(part)
    return writer.finish()


def _output_metadata(name: str, datatype: str, shape: tuple[int, ...]) -> tuple[bytes, bytes]:
    """An output tensor's name, datatype and shape, serialised (an ``InferOutputTensor``), and
    the record of a raw output's tensor in the response (the metadata after its key and
    length): remembered, as a model's outputs repeat a few names and shapes, and protobuf takes
    microseconds to make and serialise one."""
    key = (name, datatype, shape)
    found = _METADATA.get(key)
    if found is None:
        meta = ModelInferResponse.InferOutputTensor(
            name=name, datatype=datatype, shape=shape
        ).SerializeToString()
        found = meta, _OUTPUT_KEY + _varint(len(meta)) + meta
        if len(name) <= _METADATA_NAME_LENGTH and len(shape) <= _METADATA_RANK:
            if len(_METADATA) >= _METADATA_ENTRIES:
                _METADATA.clear()  # a model whose shapes never repeat: start again
            _METADATA[key] = found
    return found


#: Serialised output metadata and raw records by (name, datatype, shape),
#: :func:`_output_metadata`'s: at most this many entries, each of names and ranks at most these
#: (a few hundred KiB in all). Only dict operations touch it, atomic under the GIL: encodes off
#: the loop share it safely.
_METADATA: dict[tuple[str, str, tuple[int, ...]], tuple[bytes, bytes]] = {}
_METADATA_ENTRIES = 1024
_METADATA_NAME_LENGTH = 128
_METADATA_RANK = 8

#: Bytes allowed for one output beyond its name and shape: its serialised metadata (datatype,
#: keys, lengths) and the few small Python objects its encoding makes.
_METADATA_ALLOWANCE = 4096
#: The record keys written around typed contents: an output in the response, the contents in
#: an output, and each field in the contents (all length-delimited, wire type 2).
_OUTPUT_KEY = bytes([ModelInferResponse.DESCRIPTOR.fields_by_name["outputs"].number << 3 | 2])
_CONTENTS_KEY = bytes(
    [ModelInferResponse.InferOutputTensor.DESCRIPTOR.fields_by_name["contents"].number << 3 | 2]
)
_FIELD_KEY = {f.name: bytes([f.number << 3 | 2]) for f in InferTensorContents.DESCRIPTOR.fields}

#: Blobs at least this large are sent as buffers of their own. Smaller ones, and the pieces
#: of serialised metadata between them, are joined into buffers of up to about
#: :data:`_JOINED_BYTES`: small outputs do not make many small writes, and a large varint field
#: (encoded in many small parts) is copied a bounded piece at a time.
_SEPARATE_BLOB = 1 << 16
_JOINED_BYTES = 1 << 20


class _Writer:
    """Buffers in order: small pieces joined, large blobs kept as they are (one per answer:
    slotted)."""

    __slots__ = ("_parts", "_pending", "_pending_size")

    def __init__(self, first: bytes) -> None:
        self._parts: list[Buffer] = []
        self._pending: list[Buffer | np.ndarray] = [first]
        self._pending_size = len(first)

    def small(self, data: Buffer | np.ndarray, size: int) -> None:
        """Add ``data`` of ``size`` bytes (C-contiguous) to what is joined."""
        self._pending.append(data)
        self._pending_size += size
        if self._pending_size >= _JOINED_BYTES:
            self._flush()

    def blob(self, blob: np.ndarray | memoryview) -> None:
        """Add ``blob`` (C-contiguous), joined if small, else as a buffer of its own."""
        size = blob.nbytes
        if size < _SEPARATE_BLOB:
            self.small(blob, size)
            return
        self._flush()
        self._parts.append(blob.data if isinstance(blob, np.ndarray) else blob)

    def _flush(self) -> None:
        if self._pending_size:
            # C-contiguous arrays are bytes-like; numpy's stubs do not say so.
            self._parts.append(b"".join(self._pending))  # type: ignore[arg-type]
        self._pending = []
        self._pending_size = 0

    def finish(self) -> list[Buffer]:
        self._flush()
        return self._parts


def _tensors_to_encode(
    arrays: Sequence[tuple[str, np.ndarray]], raw: bool, side: _Side
) -> tuple[Sequence[tuple[str, np.ndarray]], list[str], bool]:
    datatypes: list[str] = []
    for name, array in arrays:
        try:
            datatypes.append(datatype_of(array))
        except ModelFailed as error:
            raise side.error(f"{side.role} '{name}': {error.message}") from None
    return arrays, datatypes, _all_raw(raw, datatypes)


def _all_raw(raw: bool, datatypes: Sequence[str]) -> bool:
    """Whether tensors of ``datatypes`` are encoded raw, ``raw`` asked: FP16 has no typed
    field, and one message cannot mix raw and typed tensors."""
    return raw or "FP16" in datatypes


def _is_little_c_order(array: np.ndarray, little: np.dtype[Any]) -> bool:
    return bool(array.flags.c_contiguous) and array.dtype == little


def _raw_view(array: np.ndarray, datatype: str) -> memoryview:
    little = _LITTLE[datatype]
    if array.size and array.flags.c_contiguous and array.dtype == little:
        # Its own memory as bytes, as below without numpy's three calls (memoryview refuses
        # to cast a view with a zero in its shape: an empty array goes below).
        return array.data.cast("B")
    # A copy in little-endian C order for any other array.
    return np.ascontiguousarray(array, little).reshape(-1).view(np.uint8).data


def _bool_copy_needed(array: np.ndarray) -> bool:
    # A bool array's bytes are its varints (0 and 1) unless a view made other bytes of it.
    if not array.flags.c_contiguous:
        return True
    octets = array.reshape(-1).view(np.uint8)
    return bool(octets.size) and int(octets.max()) > 1


def _typed_blobs(datatype: str, array: np.ndarray) -> tuple[str, list[np.ndarray]]:
    """The payload of an output's packed typed field (uint8 arrays, in order), and the field."""
    field = _CONTENTS_FIELD[datatype]
    assert field is not None  # FP16 is encoded raw
    assert field != "bytes_contents"  # BYTES outputs are framed by _frame_elements
    if field in _FIXED_FIELDS:
        little = np.ascontiguousarray(array, _FIELD_LITTLE[field])
        return field, [little.reshape(-1).view(np.uint8)]
    if datatype == "BOOL":
        if _bool_copy_needed(array):
            return field, [np.not_equal(array.reshape(-1), False).view(np.uint8)]
        return field, [array.reshape(-1).view(np.uint8)]
    return field, wire.encode_varint_parts(array)


def _widest_varint(array: np.ndarray) -> int:
    """The bytes of the widest varint of a non-empty integer array, as protobuf widens it."""
    if array.dtype.kind == "i" and int(array.min()) < 0:
        return wire.MAX_VARINT_BYTES  # sign-extended to 64 bits
    return int(wire.varint_sizes(np.array([int(array.max())], np.uint64))[0])


#: Elements framed in one step of :func:`_frame_elements`, and the bytes one step frames
#: (unless one element alone is larger): the step's payloads are joined and masked, so these
#: bound the temporaries.
_FRAMING_STEP = 1 << 16
_FRAMING_STEP_BYTES = 1 << 20
#: Bytes :func:`_frame_elements` holds per element of the whole output (its lengths, header
#: sizes, sizes and ends, eight bytes each), and per element of one step (offsets, indices,
#: header bytes and their int64 temporaries, the list ``bytes.join`` makes), with room to spare.
_FRAMING_SCRATCH_PER_ELEMENT = 32
_FRAMING_STEP_SCRATCH_PER_ELEMENT = 128
#: The key of a ``bytes_contents`` record, which starts every typed BYTES element.
_BYTES_KEY = _FIELD_KEY["bytes_contents"][0]


def _bytes_lengths(
    where: str, array: np.ndarray, side: _Side
) -> tuple[Sequence[bytes], np.ndarray, bool]:
    """A BYTES array's elements as bytes, their lengths (int64), and whether any was converted.

    An object array of ``bytes`` is used as it is (a view when C-order); only arrays holding
    ``str`` or numpy strings are converted, one element at a time.
    """
    flat = array.reshape(-1)
    count = flat.size
    # Passes over the elements go a step at a time: one C call over all of them would hold the
    # GIL throughout, and an encode in a thread would stall the event loop as long.
    kinds: set[type] = set()
    if flat.dtype == np.object_:
        for start in range(0, count, _FRAMING_STEP):
            kinds.update(map(type, flat[start : start + _FRAMING_STEP]))
    if flat.dtype == np.object_ and all(issubclass(kind, bytes) for kind in kinds):
        # An object array is a sequence of its elements; numpy's stubs do not say so.
        elements: Sequence[bytes] = cast(Sequence[bytes], flat)
        converted = False
    else:
        elements = _bytes_elements(where, array, side)
        converted = True
    lengths = np.empty(count, np.int64)
    for start in range(0, count, _FRAMING_STEP):
        step = elements[start : start + _FRAMING_STEP]
        lengths[start : start + len(step)] = np.fromiter(map(len, step), np.int64, len(step))
    return elements, lengths, converted


def _check_raw_lengths(where: str, lengths: np.ndarray, side: _Side) -> None:
    too_long = lengths > _MAX_ELEMENT_BYTES
    if too_long.any():
        position = int(np.argmax(too_long))
        raise side.error(
            f"{where}: BYTES element {position} has {int(lengths[position])} bytes; a raw "
            f"element holds at most {_MAX_ELEMENT_BYTES}"
        )


def _header_sizes(lengths: np.ndarray, raw: bool) -> np.ndarray:
    """The bytes before each element: its 4-byte length (raw), or its key and varint length."""
    if raw:
        return np.full(lengths.shape, LENGTH_PREFIX, np.int64)
    return wire.varint_sizes(lengths.view(np.uint64)).astype(np.int64) + 1


def _header_byte(index: int, lengths: np.ndarray, raw: bool) -> np.ndarray:
    """Byte ``index`` of the headers of elements of these lengths (each at least that long)."""
    if raw:
        return ((lengths >> (8 * index)) & 0xFF).astype(np.uint8)
    if index == 0:
        return np.full(lengths.shape, _BYTES_KEY, np.uint8)
    shift = 7 * (index - 1)
    octets = ((lengths >> shift) & 0x7F).astype(np.uint8)
    octets[(lengths >> (shift + 7)) > 0] |= 0x80
    return octets


def _frame_elements(elements: Sequence[bytes], lengths: np.ndarray, *, raw: bool) -> np.ndarray:
    """BYTES elements each after its header, as one uint8 array.

    Raw, a header is the element's length as a little-endian uint32 (``raw_output_contents``);
    typed, it is the key and varint length of a ``bytes_contents`` record, so the result is a
    serialised ``InferTensorContents``. Works a step of elements at a time: each step's headers
    are written with numpy and its payloads joined once and copied around them through a
    mask, so no object is made per element.
    """
    count = lengths.size
    headers = _header_sizes(lengths, raw)
    sizes = headers + lengths
    ends = np.cumsum(sizes)
    out = np.empty(int(ends[-1]) if count else 0, np.uint8)
    start = 0
    while start < count:
        base = int(ends[start - 1]) if start else 0
        fits = int(np.searchsorted(ends, base + _FRAMING_STEP_BYTES, "right"))
        stop = max(start + 1, min(start + _FRAMING_STEP, fits))
        step = out[base : int(ends[stop - 1])]
        if stop == start + 1:
            # One element alone (it may be large): its header, then its payload copied once.
            header = int(headers[start])
            for index in range(header):
                step[index] = _header_byte(index, lengths[start : start + 1], raw)[0]
            step[header:] = np.frombuffer(elements[start], np.uint8)
        else:
            firsts = ends[start:stop] - sizes[start:stop] - base
            step_lengths = lengths[start:stop]
            step_headers = headers[start:stop]
            payload = np.ones(step.size, np.bool_)
            for index in range(int(step_headers.max())):
                longer = np.flatnonzero(step_headers > index)
                positions = firsts[longer] + index
                step[positions] = _header_byte(index, step_lengths[longer], raw)
                payload[positions] = False
            step[payload] = np.frombuffer(b"".join(elements[start:stop]), np.uint8)
        start = stop
    return out


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


def stream_response(infer_response: Sequence[Buffer]) -> list[Buffer]:
    """A ``ModelStreamInferResponse`` whose ``infer_response`` is the serialised
    ModelInferResponse in ``infer_response`` (buffers in order, as :func:`encode_response`
    gives them), as buffers in order: a key and a length before them, none of them copied."""
    # A loop, not sum over a generator: a generator's frame costs more than its few steps.
    size = 0
    for part in infer_response:
        size += memoryview(part).nbytes
    return [_INFER_RESPONSE_KEY + _varint(size), *infer_response]


def _varint(value: int) -> bytes:
    """``value`` (at least 0) in the protocol buffer varint encoding."""
    if value < 0x80:
        return _ONE_BYTE_VARINTS[value]
    if value < 0x4000:  # a tensor of 128 bytes to 16 KiB: its length without a loop
        return bytes((value & 0x7F | 0x80, value >> 7))
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


#: The varints of one byte (0 to 127), made once: a small message's lengths are these.
_ONE_BYTE_VARINTS = [bytes((value,)) for value in range(0x80)]

#: The key of a ModelStreamInferResponse's ``infer_response``: length delimited.
_INFER_RESPONSE_KEY = _varint(
    ModelStreamInferResponse.DESCRIPTOR.fields_by_name["infer_response"].number << 3 | 2
)
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
    # asarray is free for arrays and lets a caller pass a numpy scalar.
    arrays = [(name, np.asarray(array)) for name, array in arrays]
    arrays, datatypes, raw = _tensors_to_encode(arrays, raw, side)
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
            little = np.ascontiguousarray(array, _LITTLE[datatype])
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
        parts.append(len(element).to_bytes(LENGTH_PREFIX, "little"))
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
    count = len(params)
    if count > MAX_PARAMETERS:
        raise InvalidInput(f"{count} parameters in one map; at most {MAX_PARAMETERS} are taken")
    if not count:
        return {}  # most maps: no items view and its generator (a protobuf map has no items)
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
