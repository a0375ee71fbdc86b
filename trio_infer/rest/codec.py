"""Open Inference Protocol REST bodies <-> numpy arrays (pure functions, no I/O).

An inference request's body is a JSON object, followed, when any input is sent binary, by each
such input's bytes in input order; the ``Inference-Header-Content-Length`` header gives the
JSON part's length. A JSON input carries its elements in ``data``, row-major, flat or nested (as
Triton reads it, any nesting whose values are as many as the shape's elements); a binary input
carries a ``binary_data_size`` parameter and its bytes little-endian, BOOL one byte per element,
BYTES each element as a 4-byte little-endian length and its bytes.
Responses are written the same way: an output goes binary when its request output asked for it
(``binary_data``) or, failing that, when the request did for every output
(``binary_data_output``).

Decoding runs in two steps so that a server can reserve memory before it allocates:
:func:`parse_infer_request` parses the JSON part (whose own cost :func:`parsing_cost` bounds
from its length) and checks every field, and :func:`decode_inputs` then builds the arrays,
whose size :attr:`ParsedInferRequest.decoded_nbytes` gives first. :func:`decode_infer_request`
does both.

JSON numbers become arrays one of two ways. A large numeric tensor (:data:`FAST_JSON_MIN_ELEMENTS`
elements or more, any datatype but BOOL and BYTES) is read from a simdjson parse of the JSON part
straight into a buffer of doubles or 64-bit integers, with no Python object per element; every
other tensor, and any large one the fast path cannot decide, goes through orjson's Python
objects and numpy, whose checks and messages are the reference. Both flatten nested data as
Triton does: only the values, their row-major order and their count matter. On that path a
small flat float tensor is packed as doubles by ``struct`` rather than inferred by numpy,
wherever that gives the same array (else numpy's inference decides).

Every malformed request raises :class:`~trio_infer.errors.InvalidInput` with a message that
names the tensor and what is wrong; every output that cannot be written raises
:class:`~trio_infer.errors.ModelFailed` naming the output, but a BYTES output asked for as JSON
whose elements are not UTF-8, which the request can ask for as binary data instead
(``InvalidInput``).
"""

from __future__ import annotations

import functools
import math
import re
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NoReturn

import numpy as np
import orjson

try:
    import simdjson
except ImportError:  # pragma: no cover - no wheel for this Python: every tensor takes orjson
    _HAVE_SIMDJSON = False
else:
    _HAVE_SIMDJSON = True

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
from trio_infer.errors import InvalidInput, ModelFailed

__all__ = [
    "BYTES_ELEMENT_OVERHEAD",
    "FAST_JSON_MIN_ELEMENTS",
    "MAX_BYTES_ELEMENTS",
    "MAX_PARAMETERS",
    "PARSED_BYTES_PER_JSON_BYTE",
    "BinaryOutputs",
    "ParameterValue",
    "ParsedInferRequest",
    "RestInferRequest",
    "decode_infer_request",
    "decode_inputs",
    "encode_infer_response",
    "input_arrays",
    "parse_infer_request",
    "parsing_cost",
]

#: A parameter's value: the same union as ``trio_infer.model.ParameterValue``, written out
#: because the model module imports the repository's settings, which a codec has no use for.
ParameterValue = bool | int | float | str

#: Memory a parsed JSON document may hold per byte of its text, at worst: ``{},`` is three
#: bytes and becomes an empty dict (64 bytes) and its slot in a list (8). Numbers cost at most
#: 8 (``1e1,``: a float of 24 bytes and a slot), strings about 11.
PARSED_BYTES_PER_JSON_BYTE = 24

#: Parameters one map (a request's, a tensor's) may hold.
MAX_PARAMETERS = 1024
#: Elements one BYTES tensor may hold: each becomes a Python ``bytes`` object.
MAX_BYTES_ELEMENTS = 1 << 20
#: Bytes one decoded BYTES element holds beyond its payload: a ``bytes`` object's header
#: (33 bytes, rounded up by the allocator) and its slots in a list and in the object array.
BYTES_ELEMENT_OVERHEAD = 96

#: Elements from which a numeric JSON tensor is decoded without a Python object per element.
#: The paths cross near 512 elements (FP32; fewer for integers); above it the fast path is
#: 1.7-4x faster. The margin keeps off a parse that finds no such tensor, which costs about
#: half of orjson's time (docs/performance.md).
FAST_JSON_MIN_ELEMENTS = 2048

_COMMA = ord(",")
#: How a bool ends in JSON text: ``true`` or ``false`` and then whitespace, ``,``, ``]`` or
#: ``}``. No number has it (an exponent's ``e`` is followed by a digit or a sign), nor a key
#: (its quote follows): a JSON part without it holds no bool, and its numeric data need not be
#: looked through for one. One search for both literals: an alternation would defeat the
#: search's literal prefix, which makes it about ten times faster.
_BOOL_END = re.compile(rb"e[\t\n\r ,\]}]")

_MAX_ELEMENT_BYTES = 2**32 - 1
#: Bytes per element of the array numpy infers from a JSON list of numbers (int64, uint64 or
#: float64) before it is converted to the datatype's dtype.
_INFERRED_ITEMSIZE = 8

_VALID_DATATYPES = ", ".join(DATATYPES)
#: Each integer datatype's smallest and largest value.
_INTEGER_RANGE: dict[str, tuple[int, int]] = {
    name: (int(np.iinfo(dtype.name).min), int(np.iinfo(dtype.name).max))
    for name, dtype in DATATYPES.items()
    if dtype.kind in "iu"
}
#: The datatypes whose JSON elements are not numbers.
_NOT_NUMBERS = frozenset(("BOOL", "BYTES"))
_FLOAT_DATATYPES = frozenset(name for name, dtype in DATATYPES.items() if dtype.kind == "f")
#: Each datatype's dtype in the byte order of binary data: little-endian.
_BINARY_DTYPES = {name: dtype.newbyteorder("<") for name, dtype in DATATYPES.items()}
#: The datatypes the fast path reads, and the 64-bit buffer each is read into: simdjson converts
#: an integer to a double (exactly up to 2**53) and reads integers into int64/uint64 exactly,
#: refusing a float, a string, null, a bool or an object (TypeError) and a value out of the
#: 64-bit type's range (ValueError) instead of converting them.
_BUFFER_OF_KIND: dict[str, tuple[Literal["d", "i", "u"], type[np.generic]]] = {
    "f": ("d", np.float64),
    "i": ("i", np.int64),
    "u": ("u", np.uint64),
}
_FAST_BUFFER = {
    name: _BUFFER_OF_KIND[dtype.kind]
    for name, dtype in DATATYPES.items()
    if dtype.kind in _BUFFER_OF_KIND
}
#: Integers beyond this magnitude are not all exact as doubles: a float64 that large may be an
#: integer that simdjson rounded once to a double and numpy would round again to FP32, where
#: the orjson path rounds it once from int64.
_EXACT_DOUBLE_LIMIT = 2.0**53
#: Below this magnitude every value of a float datatype's tensor may be packed as a double and
#: cast, as the orjson path's inferred array would be: an integer is exact as a double (so it
#: is rounded once, as from int64) and the cast cannot overflow. Above it, that path decides.
_PACKED_LIMIT = {
    "FP16": float(np.finfo(np.float16).max),
    "FP32": _EXACT_DOUBLE_LIMIT,
    "FP64": _EXACT_DOUBLE_LIMIT,
}
#: The most elements packed that way: ``struct.pack`` takes them as arguments, a tuple of a
#: pointer each beside the packed doubles, which stays small below this.
_PACKED_MAX_ELEMENTS = FAST_JSON_MIN_ELEMENTS

#: Request layouts remembered (:class:`_Layout`), and the largest JSON part one is remembered
#: for: at most about 32 times 2 KiB of text and what it parses to (PARSED_BYTES_PER_JSON_BYTE a
#: byte) are held, whatever clients send.
_MAX_LAYOUTS = 32
_MAX_LAYOUT_JSON = 2048

#: The parameters the binary tensor data extension defines; taken out of the maps the request
#: hands on, since they describe the body's layout, not the inference.
_BINARY_DATA_SIZE = "binary_data_size"
_BINARY_DATA = "binary_data"
_BINARY_DATA_OUTPUT = "binary_data_output"


# --------------------------------------------------------------------------------------------
# What a request decodes to


@dataclass(frozen=True)
class BinaryOutputs:
    """Which outputs a request asked to have back as binary data."""

    default: bool = False
    """The request's ``binary_data_output``: binary for every output that does not say."""
    by_name: Mapping[str, bool] | None = None
    """Each requested output's own ``binary_data``, where given; it overrides the default."""

    def is_binary(self, name: str) -> bool:
        """Whether output ``name`` is written as binary data after the JSON part."""
        if self.by_name is not None:
            chosen = self.by_name.get(name)
            if chosen is not None:
                return chosen
        return self.default


#: The two choices of a request that names no output's own: shared, as they are immutable.
_NO_BINARY = BinaryOutputs()
_ALL_BINARY = BinaryOutputs(default=True)


# The request types are not frozen: a frozen dataclass sets each field through
# object.__setattr__, which costs several times a plain slot's store, for every request.
@dataclass(slots=True)
class RestInferRequest:
    """A decoded inference request (see :func:`decode_infer_request`)."""

    id: str
    """The request's ``id``, empty when not given."""
    inputs: dict[str, np.ndarray]
    """The input arrays by name, in the request's order, each with its datatype's dtype (see
    :data:`~trio_infer.datatypes.DATATYPES`) and the declared shape. Binary numeric inputs
    are read-only views of the body where it is aligned for the dtype."""
    datatypes: dict[str, str]
    """Each input's declared datatype (a BYTES input sent empty has no elements to tell)."""
    parameters: dict[str, ParameterValue]
    """The request's parameters, without ``binary_data_output``."""
    input_parameters: dict[str, dict[str, ParameterValue]]
    """Each input's parameters (every input has an entry), without ``binary_data_size``."""
    outputs: list[str]
    """The requested outputs' names, in order; empty when the request names none (all)."""
    binary_outputs: BinaryOutputs
    """Which outputs to write binary: pass it to :func:`encode_infer_response`."""
    output_parameters: dict[str, dict[str, ParameterValue]]
    """Each requested output's parameters, without ``binary_data``."""


@dataclass(frozen=True)
class _LazyNumbers:
    """A large numeric tensor's JSON data, left in simdjson's parsed document."""

    array: simdjson.Array
    json: memoryview
    """The request's JSON part, parsed again by orjson only if the fast path cannot decide."""
    index: int
    """The input's position in the request's ``inputs``."""


@dataclass(slots=True)
class _InputSpec:
    """One input as the JSON part declares it, checked; its data not yet converted."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    data: list[Any] | _LazyNumbers | None
    """The JSON ``data`` list as parsed (left unconverted for the fast path), or ``None`` for a
    binary input."""
    binary: memoryview | None
    """A binary input's bytes, a slice of the body."""
    copy_nbytes: int
    """Bytes decoding copies a binary input into: its size where the body is not aligned for
    the dtype, else 0 (a view)."""
    array: np.ndarray | None = None
    """A binary numeric input's array in its shape, a view of :attr:`binary` (None for BYTES
    and JSON inputs): made when its alignment is checked, and decoded from there."""


@dataclass(slots=True)
class ParsedInferRequest:
    """A request whose JSON part is parsed and checked, its tensors not yet decoded.

    Made by :func:`parse_infer_request`; :func:`decode_inputs` finishes it.
    """

    id: str
    parameters: dict[str, ParameterValue]
    input_parameters: dict[str, dict[str, ParameterValue]]
    outputs: list[str]
    binary_outputs: BinaryOutputs
    output_parameters: dict[str, dict[str, ParameterValue]]
    decoded_nbytes: int
    """An upper bound on the bytes :func:`decode_inputs` allocates, from the declared shapes
    and datatypes: for JSON numbers the array numpy infers and the converted one; for BYTES
    the elements' objects and payloads; for binary inputs nothing (views of the body) except
    a copy of those the body does not align."""
    _inputs: list[_InputSpec]
    _may_hold_bools: bool
    """Whether a JSON numeric input's ``data`` list may hold a bool: the JSON part has the end
    of a ``true`` or ``false`` (looked for only when such a list was parsed)."""


# --------------------------------------------------------------------------------------------
# Decoding


def parsing_cost(json_nbytes: int) -> int:
    """An upper bound on the memory parsing a JSON part of ``json_nbytes`` bytes holds.

    The parsed document is Python objects (each number in ``data`` one); a server reserves
    this before :func:`parse_infer_request`, from the header length or the body's.
    """
    return json_nbytes * PARSED_BYTES_PER_JSON_BYTE


def decode_infer_request(
    body: bytes | bytearray | memoryview, header_length: int | None
) -> RestInferRequest:
    """Decode a whole inference request body: :func:`parse_infer_request`, then
    :func:`decode_inputs`.

    Raises:
        InvalidInput: As those two do.
    """
    return decode_inputs(parse_infer_request(body, header_length))


def parse_infer_request(
    body: bytes | bytearray | memoryview, header_length: int | None
) -> ParsedInferRequest:
    """Parse and check the JSON part of an inference request body, without decoding tensors.

    Args:
        body: The whole request body. Binary inputs are decoded as views of it, so it must not
            change while the request is in use.
        header_length: The ``Inference-Header-Content-Length`` header: the JSON part's length
            in bytes, the rest being binary input data; ``None`` when the header is absent and
            the whole body is JSON.

    Returns:
        The request's fields, each input's declared datatype and shape with its data still as
        parsed, and what decoding will allocate.

    Raises:
        InvalidInput: If the header length is negative or beyond the body; the JSON part is not
            a JSON object; a field is missing or of the wrong type; a name repeats; a datatype
            is unknown; a shape is negative or too large; an input has both or neither of
            ``data`` and ``binary_data_size``; binary data overruns the body, does not fill
            it, or does not match the shape; a parameter is not a bool, number or string.
    """
    view = memoryview(body).cast("B")
    size = view.nbytes
    has_header = header_length is not None
    if header_length is None:
        header_length = size
    elif header_length < 0:
        raise InvalidInput(f"Inference-Header-Content-Length is negative ({header_length})")
    elif header_length > size:
        raise InvalidInput(
            f"Inference-Header-Content-Length is {header_length} but the body has only {size} bytes"
        )
    json_part = view[:header_length]
    key: tuple[bytes, int] | None = None
    if has_header and header_length < size and header_length <= _MAX_LAYOUT_JSON:
        # Binary data follows a small JSON part: a client that sends its tensors binary sends
        # the same JSON part for each request of a shape, whose fields were checked once.
        key = (bytes(json_part), size)
        layout = _LAYOUTS.get(key)
        if layout is not None:
            return layout.parsed(view)
    document = _parse_lazily(json_part)
    if document is None:
        document = _parse(json_part)
    if not isinstance(document, dict):
        raise InvalidInput(
            f"the request's JSON is {_json_type(document)}; an inference request is an object"
        )

    request_id = document.get("id", "")
    if not isinstance(request_id, str):
        raise InvalidInput(f"the request's 'id' is {_json_type(request_id)}; it is a string")
    parameters = _parameters("the request", document.get("parameters"))
    default_binary = parameters.pop(_BINARY_DATA_OUTPUT, False)
    if not isinstance(default_binary, bool):
        raise InvalidInput(
            f"the request's parameter '{_BINARY_DATA_OUTPUT}' is "
            f"{_json_type(default_binary)}; it is a bool"
        )

    raw_inputs = document.get("inputs")
    if not isinstance(raw_inputs, list):
        problem = "missing" if raw_inputs is None else _json_type(raw_inputs)
        raise InvalidInput(f"the request's 'inputs' is {problem}; it is a list of inputs")
    offset = header_length
    specs: list[_InputSpec] = []
    costs: list[int] = []
    input_parameters: dict[str, dict[str, ParameterValue]] = {}
    decoded_nbytes = 0
    for index, raw in enumerate(raw_inputs):
        spec, cost = _input_spec(index, raw, view, offset, has_header)
        costs.append(cost)
        if spec.name in input_parameters:
            raise InvalidInput(f"input '{spec.name}' appears more than once in the request")
        input_parameters[spec.name] = _parameters(f"input '{spec.name}'", raw.get("parameters"))
        input_parameters[spec.name].pop(_BINARY_DATA_SIZE, None)
        if spec.binary is not None:
            offset += spec.binary.nbytes
        specs.append(spec)
        decoded_nbytes += cost
    if offset != size:
        raise InvalidInput(
            f"the body has {size - offset} bytes after the JSON part and the binary data of "
            "the inputs; each input sent binary declares its size in 'binary_data_size'"
        )

    # A bool among numbers is refused, but numpy and struct take it as 0 or 1, and a look at
    # each element's type costs about as much as numpy's conversion: decoding looks only when
    # the text spells one, and only for numeric data parsed as lists (a large tensor left in
    # simdjson's document refuses a bool by itself).
    may_hold_bools = (
        any(isinstance(spec.data, list) and spec.datatype not in _NOT_NUMBERS for spec in specs)
        and _BOOL_END.search(json_part) is not None
    )
    outputs, by_name, output_parameters = _requested_outputs(document.get("outputs"))
    if by_name:
        binary_outputs = BinaryOutputs(default_binary, by_name)
    else:
        binary_outputs = _ALL_BINARY if default_binary else _NO_BINARY
    # Positional: a class called with keywords gets them as a dict made for the call.
    parsed = ParsedInferRequest(
        request_id,
        parameters,
        input_parameters,
        outputs,
        binary_outputs,
        output_parameters,
        decoded_nbytes,
        specs,
        may_hold_bools,
    )
    if key is not None and all(spec.binary is not None for spec in specs):
        if len(_LAYOUTS) >= _MAX_LAYOUTS:
            _LAYOUTS.clear()
        _LAYOUTS[key] = _Layout.of(parsed, header_length, costs)
    return parsed


@dataclass(frozen=True, slots=True)
class _Layout:
    """What :func:`parse_infer_request` found in a request whose inputs are all binary, kept by
    its JSON part's bytes and its body's size: every field but the inputs' bytes, which are
    all the next request with the same JSON part and size has of its own. Its fields need no
    second check (the JSON is the same text, the body as long); whether each input's place in
    its body is aligned is read again (the body is elsewhere in memory), and its data are
    checked as they are decoded (a BOOL's bytes, a BYTES tensor's lengths), as for any request.
    """

    id: str
    parameters: dict[str, ParameterValue]
    #: Each input's name, datatype, shape, offset in the body, size, and (BYTES) decoding cost.
    inputs: tuple[tuple[str, str, tuple[int, ...], int, int, int], ...]
    input_parameters: dict[str, dict[str, ParameterValue]]
    outputs: tuple[str, ...]
    binary_outputs: BinaryOutputs
    output_parameters: dict[str, dict[str, ParameterValue]]

    @classmethod
    def of(cls, parsed: ParsedInferRequest, header_length: int, costs: list[int]) -> _Layout:
        """The layout of ``parsed``, whose inputs are all binary, their data from
        ``header_length`` on; ``costs``: each input's decoding cost as parsed. Its maps are
        copies: the request's own are handed on, and a caller may take from them."""
        inputs = []
        offset = header_length
        for spec, cost in zip(parsed._inputs, costs, strict=True):
            assert spec.binary is not None, "only requests of binary inputs have a layout"
            size = spec.binary.nbytes
            inputs.append((spec.name, spec.datatype, spec.shape, offset, size, cost))
            offset += size
        return cls(
            parsed.id,
            dict(parsed.parameters),
            tuple(inputs),
            _copied(parsed.input_parameters),
            tuple(parsed.outputs),
            parsed.binary_outputs,
            _copied(parsed.output_parameters),
        )

    def parsed(self, body: memoryview) -> ParsedInferRequest:
        """The request ``body`` (of this layout's JSON part and size) as
        :func:`parse_infer_request` gives it."""
        specs: list[_InputSpec] = []
        decoded_nbytes = 0
        for name, datatype, shape, offset, size, cost in self.inputs:
            binary = body[offset : offset + size]
            if datatype == "BYTES":
                spec = _InputSpec(name, datatype, shape, None, binary, 0)
            else:
                spec, cost = _binary_numeric(name, datatype, shape, binary)
            specs.append(spec)
            decoded_nbytes += cost
        # Positional: a class called with keywords gets them as a dict made for the call.
        return ParsedInferRequest(
            self.id,
            dict(self.parameters),
            _copied(self.input_parameters),
            list(self.outputs),
            self.binary_outputs,
            _copied(self.output_parameters),
            decoded_nbytes,
            specs,
            False,
        )


def _copied(
    maps: dict[str, dict[str, ParameterValue]],
) -> dict[str, dict[str, ParameterValue]]:
    # A loop, not a comprehension: the comprehension is a function made and called (Python 3.11).
    copied = {}
    for name, values in maps.items():
        copied[name] = dict(values)
    return copied


#: Layouts by JSON part and body size (:class:`_Layout`); emptied when full.
_LAYOUTS: dict[tuple[bytes, int], _Layout] = {}


def decode_inputs(parsed: ParsedInferRequest) -> RestInferRequest:
    """Convert a parsed request's input data to numpy arrays (:func:`input_arrays`), with the
    request's other fields.

    Raises:
        InvalidInput: As :func:`input_arrays`.
    """
    return RestInferRequest(
        id=parsed.id,
        inputs=input_arrays(parsed),
        datatypes={spec.name: spec.datatype for spec in parsed._inputs},
        parameters=parsed.parameters,
        input_parameters=parsed.input_parameters,
        outputs=parsed.outputs,
        binary_outputs=parsed.binary_outputs,
        output_parameters=parsed.output_parameters,
    )


def input_arrays(parsed: ParsedInferRequest) -> dict[str, np.ndarray]:
    """A parsed request's input data as numpy arrays, by name in the request's order: what
    :func:`decode_inputs` gives as ``inputs``, for a caller that takes the other fields from
    ``parsed`` itself.

    JSON numbers are converted by numpy from the parsed lists, in C, or for a large numeric
    tensor from simdjson's buffer of them; they must be of the datatype's kind (``true``/
    ``false`` for BOOL, integers within range for the integer datatypes, numbers within range
    for the float ones; a bool is not a number), flat or nested any way, as many as the
    shape's elements (as Triton takes them). BYTES elements are strings, encoded UTF-8. Binary
    data is checked and viewed.

    Raises:
        InvalidInput: Naming the input and the first offending element, if the data's
            structure or count does not match the shape, an element is of the wrong kind or
            out of range, a BOOL byte is not 0 or 1, or binary BYTES elements are malformed.
    """
    inputs: dict[str, np.ndarray] = {}
    for spec in parsed._inputs:
        where = f"input '{spec.name}'"
        if spec.binary is not None:
            inputs[spec.name] = _decode_binary(where, spec)
        elif isinstance(spec.data, _LazyNumbers):
            inputs[spec.name] = _decode_lazy(where, spec.datatype, spec.shape, spec.data)
        else:
            assert spec.data is not None  # _input_spec requires one of the two
            inputs[spec.name] = _decode_json(
                where, spec.datatype, spec.shape, spec.data, parsed._may_hold_bools
            )
    return inputs


def _parse(json_part: memoryview) -> Any:
    try:
        return orjson.loads(json_part)
    except orjson.JSONDecodeError as error:
        raise InvalidInput(f"the request's JSON is malformed: {error}") from None


def _parse_lazily(json_part: memoryview) -> dict[str, Any] | None:
    """The JSON part as orjson would give it, but with each large numeric input's ``data`` left
    in simdjson's document (a :class:`_LazyNumbers`); ``None`` when no input is such, or when
    simdjson cannot tell (then orjson parses, and names any error)."""
    if not _HAVE_SIMDJSON or json_part.nbytes < 2 * FAST_JSON_MIN_ELEMENTS:
        # Each JSON number takes two bytes at least ("0,"): no tensor here is large.
        return None
    if np.count_nonzero(np.frombuffer(json_part, dtype=np.uint8) == _COMMA) < (
        FAST_JSON_MIN_ELEMENTS - 1
    ):
        # Nor here, and this count (0.2 ns a byte) is cheaper than a parse to find out.
        return None
    try:
        # A parser per request: a document lives until its request is decoded, possibly on
        # another thread, and a parser's next parse would invalidate it.
        document = simdjson.Parser().parse(json_part)
    except (ValueError, RuntimeError):
        # Malformed, or what orjson takes and simdjson does not (integers beyond 64 bits).
        return None
    fields = _fields(document)
    if fields is None:
        return None
    raw_inputs = fields.get("inputs")
    if not isinstance(raw_inputs, simdjson.Array):
        return None
    inputs: list[Any] = []
    lazy = False
    for index, raw in enumerate(raw_inputs):
        entry = _fields(raw)
        if entry is None:
            if isinstance(raw, simdjson.Object):
                return None
            inputs.append(_unbox(raw))
            continue
        data = entry.pop("data", None)
        converted = {key: _unbox(value) for key, value in entry.items()}
        if isinstance(data, simdjson.Array) and _is_large_numeric(converted):
            converted["data"] = _LazyNumbers(data, json_part, index)
            lazy = True
        elif data is not None:
            converted["data"] = _unbox(data)
        inputs.append(converted)
    if not lazy:
        return None
    return {key: inputs if key == "inputs" else _unbox(value) for key, value in fields.items()}


def _fields(value: object) -> dict[str, Any] | None:
    """A simdjson object's fields, their values unconverted (its ``items`` would convert
    them all); ``None`` if it is not an object or repeats a key, whose last value orjson
    keeps where simdjson's lookup finds the first."""
    if not isinstance(value, simdjson.Object):
        return None
    keys = list(value)
    if len(set(keys)) != len(keys):
        return None
    return {key: value[key] for key in keys}


def _unbox(value: object) -> Any:
    """A simdjson value as orjson parses it: dicts, lists, str, int, float, bool, None."""
    if isinstance(value, simdjson.Object):
        return value.as_dict()
    if isinstance(value, simdjson.Array):
        return value.as_list()
    return value


def _is_large_numeric(raw: dict[str, Any]) -> bool:
    """Whether an input's fields declare a numeric tensor large enough for the fast path
    (a field that is wrong just leaves it to the checks of :func:`_input_spec`)."""
    if raw.get("datatype") not in _FAST_BUFFER:
        return False
    shape = raw.get("shape")
    # The rank first: the product of thousands of huge dimensions takes seconds to compute.
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_RANK
        or not all(isinstance(dim, int) and not isinstance(dim, bool) and dim >= 0 for dim in shape)
    ):
        return False
    return math.prod(shape) >= FAST_JSON_MIN_ELEMENTS


def _input_spec(
    index: int, raw: object, body: memoryview, offset: int, has_header: bool
) -> tuple[_InputSpec, int]:
    """Check one input's JSON; return it and what decoding it allocates."""
    if not isinstance(raw, dict):
        raise InvalidInput(f"the request's inputs[{index}] is {_json_type(raw)}; it is an object")
    name = raw.get("name")
    if not isinstance(name, str):
        problem = "missing" if name is None else _json_type(name)
        raise InvalidInput(f"the request's inputs[{index}] 'name' is {problem}; it is a string")
    where = f"input '{name}'"
    datatype = raw.get("datatype")
    if not isinstance(datatype, str):
        problem = "missing" if datatype is None else _json_type(datatype)
        raise InvalidInput(f"{where}: 'datatype' is {problem}; it is a string")
    if datatype not in DATATYPES:
        raise InvalidInput(
            f"{where}: unknown datatype '{datatype}'; valid datatypes are {_VALID_DATATYPES}"
        )
    shape = _shape(where, raw.get("shape"), datatype)
    count = math.prod(shape)
    if datatype == "BYTES" and count > MAX_BYTES_ELEMENTS:
        raise InvalidInput(
            f"{where}: shape {shape_text(shape)} has {count} BYTES elements; at most "
            f"{MAX_BYTES_ELEMENTS} are taken"
        )
    parameters = raw.get("parameters")
    size = parameters.get(_BINARY_DATA_SIZE) if isinstance(parameters, dict) else None
    data = raw.get("data")
    if size is None:
        if not isinstance(data, list | _LazyNumbers):
            problem = "missing" if data is None else _json_type(data)
            raise InvalidInput(
                f"{where}: 'data' is {problem}; an input carries a list in 'data' or sends "
                f"its data binary with a '{_BINARY_DATA_SIZE}' parameter"
            )
        if datatype == "BYTES":
            # Each element a Python bytes object; the payloads are at most the JSON's text.
            cost = count * BYTES_ELEMENT_OVERHEAD + body.nbytes
        else:
            # Either path holds an 8-byte element per number and then the converted array.
            # simdjson's buffer also has a slot per nested list; each list is at least two
            # bytes of JSON, for which parsing_cost's 24 bytes a byte leave room beside
            # simdjson's own parse (about 14 bytes a byte).
            cost = count * (_INFERRED_ITEMSIZE + DATATYPES[datatype].itemsize)
        return _InputSpec(name, datatype, shape, data, None, 0), cost

    if data is not None:
        raise InvalidInput(
            f"{where} has both 'data' and a '{_BINARY_DATA_SIZE}' parameter; send one"
        )
    if not has_header:
        raise InvalidInput(
            f"{where} has a '{_BINARY_DATA_SIZE}' parameter but the request has no "
            "Inference-Header-Content-Length header to say where the binary data starts"
        )
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise InvalidInput(
            f"{where}: parameter '{_BINARY_DATA_SIZE}' is {size!r}; it is a byte count, an "
            "integer of at least 0"
        )
    left = body.nbytes - offset
    if size > left:
        raise InvalidInput(
            f"{where}: '{_BINARY_DATA_SIZE}' is {size} but only {left} bytes of the body are "
            "left for it"
        )
    binary = body[offset : offset + size]
    if datatype == "BYTES":
        # Each element takes at least its prefix: no more fit in the data sent.
        elements = min(count, size // LENGTH_PREFIX)
        return _InputSpec(name, datatype, shape, None, binary, 0), (
            elements * BYTES_ELEMENT_OVERHEAD + size
        )
    itemsize = DATATYPES[datatype].itemsize
    if size != count * itemsize:
        if size % itemsize:
            held = f"{size} bytes, not a whole number of {itemsize}-byte {datatype} elements"
        else:
            held = f"{size // itemsize} {datatype} elements ({size} bytes)"
        raise InvalidInput(
            f"{where}: shape {shape_text(shape)} has {count} elements but "
            f"'{_BINARY_DATA_SIZE}' is {held}"
        )
    return _binary_numeric(name, datatype, shape, binary)


def _binary_numeric(
    name: str, datatype: str, shape: tuple[int, ...], binary: memoryview
) -> tuple[_InputSpec, int]:
    """A binary numeric input of ``binary``'s bytes (as many as its shape takes), and its
    decoding cost: a copy when its place in the body is not aligned for its dtype (numpy's own
    test of the element's address), known before anything is decoded."""
    # Made in its shape at once: the same view as frombuffer's array reshaped, in one call.
    array = np.ndarray(shape, _BINARY_DTYPES[datatype], binary)
    copy_nbytes = 0 if array.flags.aligned else binary.nbytes
    return _InputSpec(name, datatype, shape, None, binary, copy_nbytes, array), copy_nbytes


def _shape(where: str, raw: object, datatype: str) -> tuple[int, ...]:
    # A parsed JSON integer is an int, never a subclass of it but bool.
    if not isinstance(raw, list) or not all(type(dim) is int for dim in raw):
        got = "missing" if raw is None else f"{raw!r}"
        raise InvalidInput(f"{where}: 'shape' is {got}; it is a list of integers")
    shape = tuple(raw)
    problem = shape_problem(shape, max(DATATYPES[datatype].itemsize, _INFERRED_ITEMSIZE))
    if problem is not None:
        raise InvalidInput(f"{where}: {problem}")
    return shape


def _requested_outputs(
    raw: object,
) -> tuple[list[str], dict[str, bool], dict[str, dict[str, ParameterValue]]]:
    if raw is None:
        return [], {}, {}
    if not isinstance(raw, list):
        raise InvalidInput(f"the request's 'outputs' is {_json_type(raw)}; it is a list")
    names: list[str] = []
    by_name: dict[str, bool] = {}
    parameters: dict[str, dict[str, ParameterValue]] = {}
    for index, output in enumerate(raw):
        if not isinstance(output, dict):
            raise InvalidInput(
                f"the request's outputs[{index}] is {_json_type(output)}; it is an object"
            )
        name = output.get("name")
        if not isinstance(name, str):
            problem = "missing" if name is None else _json_type(name)
            raise InvalidInput(
                f"the request's outputs[{index}] 'name' is {problem}; it is a string"
            )
        if name in parameters:
            raise InvalidInput(f"output '{name}' is requested more than once")
        own = _parameters(f"requested output '{name}'", output.get("parameters"))
        binary = own.pop(_BINARY_DATA, None)
        if binary is not None:
            if not isinstance(binary, bool):
                raise InvalidInput(
                    f"requested output '{name}': parameter '{_BINARY_DATA}' is "
                    f"{_json_type(binary)}; it is a bool"
                )
            by_name[name] = binary
        names.append(name)
        parameters[name] = own
    return names, by_name, parameters


def _parameters(where: str, raw: object) -> dict[str, ParameterValue]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise InvalidInput(f"{where}: 'parameters' is {_json_type(raw)}; it is an object")
    if len(raw) > MAX_PARAMETERS:
        raise InvalidInput(f"{where}: {len(raw)} parameters; at most {MAX_PARAMETERS} are taken")
    for key, value in raw.items():
        if not isinstance(value, bool | int | float | str):
            raise InvalidInput(
                f"{where}: parameter '{key}' is {_json_type(value)}; parameters are bools, "
                "numbers or strings"
            )
    # orjson builds a fresh dict of exactly those types: it is the result.
    return raw


def _decode_binary(where: str, spec: _InputSpec) -> np.ndarray:
    array = spec.array
    if array is None:
        assert spec.binary is not None, "_input_spec keeps the bytes of a binary input"
        return bytes_elements(spec.binary, spec.shape, f"the binary data of {where}", InvalidInput)
    if spec.datatype == "BOOL":
        # Any other byte would give a bool array whose values compare unequal to True.
        octets = array.view(np.uint8)
        if octets.size and octets.max() > 1:
            position = int(np.argmax(octets > 1))
            raise InvalidInput(
                f"{where}: binary BOOL element {position} is byte {int(octets[position])}; "
                "BOOL elements are 0 or 1"
            )
    if spec.copy_nbytes:
        # Numeric code (numpy's own, and models') may assume aligned elements.
        return array.copy()
    return array


def _decode_lazy(
    where: str, datatype: str, shape: tuple[int, ...], data: _LazyNumbers
) -> np.ndarray:
    array = _fast_json_array(datatype, shape, data.array)
    if array is not None:
        return array
    # Not decidable without the elements as objects: orjson's path converts or refuses, with
    # the message it gives any tensor.
    document = _parse(data.json)
    return _decode_json(where, datatype, shape, document["inputs"][data.index]["data"], True)


def _fast_json_array(
    datatype: str, shape: tuple[int, ...], data: simdjson.Array
) -> np.ndarray | None:
    """The array of a numeric JSON ``data`` list, read by simdjson with no Python object per
    element; ``None`` if anything is wrong with it or cannot be decided this way.

    Takes nothing the orjson path refuses, but for nesting: data nested any way whose values
    in order are the shape's count is taken, as Triton takes it. ``None`` for a string,
    null, bool or object among the numbers, a float for an integer datatype, a value outside
    the datatype's range, a count other than the shape's, an FP16/FP32 value that overflows,
    and FP16/FP32 values of magnitude 2**53 or more (maybe integers, which the orjson path
    rounds once and this one twice).
    """
    of_type, buffer_dtype = _FAST_BUFFER[datatype]
    try:
        buffer = data.as_buffer(of_type=of_type)
    except (TypeError, ValueError, RuntimeError):
        # simdjson refused an element (TypeError for the wrong type, ValueError for a
        # 64-bit overflow); it converts none.
        return None
    values = np.frombuffer(buffer, dtype=buffer_dtype)
    if values.size != math.prod(shape):
        return None
    target = DATATYPES[datatype]
    if datatype in _INTEGER_RANGE:
        if target.itemsize < values.itemsize:
            low, high = _INTEGER_RANGE[datatype]
            if values.min() < low or values.max() > high:
                return None
        return values.astype(target, copy=False).reshape(shape)
    if target == values.dtype:
        # JSON has no infinities and simdjson refuses numbers beyond a double's range.
        return values.reshape(shape)
    if np.abs(values).max() >= _EXACT_DOUBLE_LIMIT:
        return None
    with np.errstate(over="ignore"):
        converted = values.astype(target)
    if np.isinf(converted).any():
        return None
    return converted.reshape(shape)


def _decode_json(
    where: str, datatype: str, shape: tuple[int, ...], data: list[Any], may_hold_bools: bool
) -> np.ndarray:
    if datatype == "BYTES":
        elements: list[bytes] = []
        for position, element in enumerate(_leaves(where, shape, data)):
            if not isinstance(element, str):
                raise InvalidInput(
                    f"{where}: element {position} is {_json_type(element)}; BYTES elements "
                    "are strings"
                )
            # orjson refuses lone surrogates, so every parsed string encodes.
            elements.append(element.encode("utf-8"))
        return object_array(elements, shape)

    count = math.prod(shape)
    if may_hold_bools and datatype != "BOOL" and bool in map(type, _leaves(where, shape, data)):
        # struct packs a bool as a double, and numpy infers a number from bools among numbers;
        # a bool is not a number in the protocol (Triton's reader refuses it too).
        _raise_element_error(where, datatype, data, shape)
    if datatype in _PACKED_LIMIT and 0 < count <= _PACKED_MAX_ELEMENTS:
        packed = _packed_floats(datatype, shape, count, data)
        if packed is not None:
            return packed
    try:
        # numpy converts the parsed list in C: an int64, uint64 or float64 array when the
        # elements are numbers, bool when all are bools, strings or objects otherwise.
        values = np.array(data)
    except ValueError:
        # Lists of unequal lengths: no array has that structure.
        values = None
    if values is None or not (values.shape == shape or values.shape == (count,)):
        # Nested otherwise than the shape: its values in row-major order, if they are as many.
        data = _leaves(where, shape, data)
        values = np.array(data)
    if count == 0:
        return np.empty(shape, dtype=DATATYPES[datatype])

    target = DATATYPES[datatype]
    kind = values.dtype.kind
    if datatype == "BOOL":
        if kind != "b":
            _raise_element_error(where, datatype, data, shape)
        return values.reshape(shape)
    if datatype in _INTEGER_RANGE:
        if kind not in "iu":
            if datatype == "UINT64" and kind == "f":
                # numpy infers float64 for ints on both sides of INT64's largest value, which
                # only UINT64 holds: those are checked one by one, then converted exactly.
                _check_elements(where, datatype, data, shape)
                return np.array(data, dtype=target).reshape(shape)
            _raise_element_error(where, datatype, data, shape)
        low, high = _INTEGER_RANGE[datatype]
        if values.min() < low or values.max() > high:
            _raise_element_error(where, datatype, data, shape)
        return values.astype(target, copy=False).reshape(shape)
    assert datatype in _FLOAT_DATATYPES
    if kind not in "iuf":
        _raise_element_error(where, datatype, data, shape)
    with np.errstate(over="ignore"):
        converted = values.astype(target, copy=False)
    # JSON has no infinities (orjson refuses 1e400), so one here is a value the datatype
    # cannot hold.
    if converted.dtype != values.dtype and np.isinf(converted).any():
        _raise_element_error(where, datatype, data, shape)
    return converted.reshape(shape)


def _packed_floats(
    datatype: str, shape: tuple[int, ...], count: int, data: list[Any]
) -> np.ndarray | None:
    """A float datatype's array from a flat list of numbers, packed as doubles by ``struct``
    (numpy's inference of the list's dtype costs several times more); ``None`` when the
    general path must decide: nested data, a count other than the shape's, an element that is
    not a number, or a value at or beyond :data:`_PACKED_LIMIT`. The list holds no bool
    (:func:`_decode_json` refuses one first), which ``struct`` would pack as 0 or 1.

    Gives the array the general path gives: numpy infers float64 from floats mixed with
    integers and converts each the way ``struct`` does, and from integers alone int64, which
    casts to the datatype as their exact doubles do.
    """
    if len(data) != count:
        return None
    try:
        # A list, string, null or object among the numbers fails to pack, and so does an
        # integer beyond a double's range.
        values = np.frombuffer(_doubles(count).pack(*data), dtype=np.float64)
    except struct.error:
        return None
    if np.abs(values).max() >= _PACKED_LIMIT[datatype]:
        return None
    # A copy even for FP64: the array is writable, as the general path's is.
    return values.astype(DATATYPES[datatype]).reshape(shape)


@functools.cache
def _doubles(count: int) -> struct.Struct:
    """The packer of ``count`` doubles, made once for each count (at most
    :data:`_PACKED_MAX_ELEMENTS` of them): ``struct.pack`` with the format as text costs a
    sixth more for 256 elements, the text formatted and looked up at each call."""
    return struct.Struct(f"{count}d")


def _leaves(where: str, shape: tuple[int, ...], data: list[Any]) -> list[Any]:
    """The elements of ``data`` in row-major order: flat, or nested any way. As Triton's JSON
    reader (and this codec's fast path), only the count must be the shape's: ``[[1, 2], [3,
    4]]``, ``[1, 2, 3, 4]`` and ``[[1], [2, 3, 4]]`` all fill a ``[2, 2]`` tensor alike.

    Raises:
        InvalidInput: The values are not as many as the shape's elements.
    """
    flat = _flattened(data) if any(isinstance(item, list) for item in data) else data
    count = math.prod(shape)
    if len(flat) != count:
        raise InvalidInput(
            f"{where}: data holds {len(flat)} values but shape {shape_text(shape)} has "
            f"{count} elements"
        )
    return flat


def _flattened(data: list[Any]) -> list[Any]:
    """Every value of nested lists, in order; without recursion, whatever the depth."""
    flat: list[Any] = []
    stack = [iter(data)]
    while stack:
        for item in stack[-1]:
            if isinstance(item, list):
                stack.append(iter(item))
                break
            flat.append(item)
        else:
            stack.pop()
    return flat


def _raise_element_error(
    where: str, datatype: str, data: list[Any], shape: tuple[int, ...]
) -> NoReturn:
    """Raise the error naming the first element of ``data`` that ``datatype`` cannot hold."""
    _check_elements(where, datatype, data, shape)
    raise AssertionError(f"no element of {where} is wrong")  # pragma: no cover


def _check_elements(where: str, datatype: str, data: list[Any], shape: tuple[int, ...]) -> None:
    """Raise naming the first element of ``data`` that ``datatype`` cannot hold, if any."""
    target = DATATYPES[datatype]
    for position, element in enumerate(_leaves(where, shape, data)):
        problem = _element_problem(datatype, target, element)
        if problem is not None:
            raise InvalidInput(f"{where}: element {position} is {problem}")


def _element_problem(datatype: str, target: np.dtype[Any], element: object) -> str | None:
    if datatype == "BOOL":
        if isinstance(element, bool):
            return None
        return f"{_json_type(element)}; BOOL elements are true or false"
    if isinstance(element, bool) or not isinstance(element, int | float):
        return f"{_json_type(element)}; {datatype} elements are numbers"
    if datatype in _INTEGER_RANGE:
        low, high = _INTEGER_RANGE[datatype]
        if not isinstance(element, int):
            if element.is_integer() and abs(element) >= 2**63 and not 0 < element <= high:
                # orjson reads an integer literal beyond 64 bits as a float: whether it was
                # written as one or not, no integer datatype holds it. But for one within
                # UINT64's range (1e19, 10000000000000000000.0), written as a float: orjson
                # reads any integer literal up to 2**64 - 1 as an int.
                return f"{element!r}, outside {datatype}'s range [{low}, {high}]"
            return f"{element!r}, not an integer; {datatype} elements are integers"
        if not low <= element <= high:
            return f"{element}, outside {datatype}'s range [{low}, {high}]"
        return None
    largest = float(np.finfo(target.name).max)
    with np.errstate(over="ignore"):
        overflows = bool(np.isinf(np.array(element, dtype=target)))
    if overflows:
        return f"{element!r}, beyond {datatype}'s largest value {largest!r}"
    return None


def _json_type(value: object) -> str:
    """How an error names a parsed JSON value's type."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"a bool ({'true' if value else 'false'})"
    if isinstance(value, int | float):
        return f"a number ({value!r})"
    if isinstance(value, str):
        return f"a string ({value[:32]!r})"
    if isinstance(value, list):
        return "a list"
    return "an object"


# --------------------------------------------------------------------------------------------
# Encoding


def encode_infer_response(
    model_name: str,
    model_version: str,
    id: str,
    outputs: Sequence[tuple[str, np.ndarray]],
    parameters: Mapping[str, ParameterValue],
    binary: BinaryOutputs,
) -> tuple[list[Buffer], int | None]:
    """Encode an inference response body.

    JSON outputs carry their elements flat, row-major, in ``data`` (BYTES as UTF-8 strings;
    floats that are NaN or infinite become ``null``, as JSON has no such numbers). Binary
    outputs carry ``binary_data_size`` in their parameters and follow the JSON part in output
    order; a contiguous little-endian output is sent from its own memory, without a copy.

    Args:
        model_name: The response's ``model_name``.
        model_version: Its ``model_version``.
        id: The request's id; left out of the response when empty.
        outputs: The outputs by name, in the order to write them.
        parameters: The response's parameters; left out when empty.
        binary: The request's :attr:`RestInferRequest.binary_outputs`.

    Returns:
        The buffers of the body, to write in order, and the JSON part's length for the
        ``Inference-Header-Content-Length`` header when any output is binary (``None``: the
        body is all JSON).

    Raises:
        ModelFailed: If an output's dtype has no datatype, a BYTES element is neither bytes
            nor str, a binary BYTES element is over 4 GiB, or a parameter is not a bool, int,
            float or str that fits in 64 bits.
        InvalidInput: If a BYTES element of an output the request asked for as JSON is not
            UTF-8: the request can ask for that output as binary data.
    """
    entries: list[dict[str, Any]] = []
    blobs: list[Buffer] = []
    for name, array in outputs:
        where = f"output '{name}'"
        try:
            datatype = datatype_of(array)
        except ModelFailed as error:
            raise ModelFailed(f"{where}: {error}") from None
        entry: dict[str, Any] = {"name": name, "datatype": datatype, "shape": array.shape}
        if binary.is_binary(name):
            blob = _binary_blob(where, datatype, array)
            # bytes, or a view of bytes: its length is its size.
            entry["parameters"] = {_BINARY_DATA_SIZE: len(blob)}
            blobs.append(blob)
        else:
            entry["data"] = _json_data(where, datatype, array)
        entries.append(entry)
    response: dict[str, Any] = {"model_name": model_name, "model_version": model_version}
    if id:
        response["id"] = id
    if parameters:
        response["parameters"] = parameters
    response["outputs"] = entries
    try:
        header = orjson.dumps(response, option=orjson.OPT_SERIALIZE_NUMPY)
    except orjson.JSONEncodeError as error:
        raise ModelFailed(f"the response cannot be written as JSON: {error}") from None
    if not blobs:
        return [header], None
    return [header, *blobs], len(header)


def _json_data(where: str, datatype: str, array: np.ndarray) -> object:
    if datatype == "BYTES":
        strings: list[str] = []
        for position, element in enumerate(array.ravel().tolist()):
            if isinstance(element, str):
                strings.append(element)
            elif isinstance(element, bytes):
                try:
                    strings.append(element.decode("utf-8"))
                except UnicodeDecodeError:
                    # BYTES hold any bytes, so the model is not at fault; JSON strings hold
                    # text, and the request may ask for this output as binary data instead.
                    raise InvalidInput(
                        f"{where}: BYTES element {position} is not UTF-8, so it cannot be "
                        "written as a JSON string; ask for the output as binary data: "
                        f'"{_BINARY_DATA}": true in its parameters in the request\'s '
                        f'"outputs" (or "{_BINARY_DATA_OUTPUT}": true in the request\'s '
                        "parameters)"
                    ) from None
            else:
                raise ModelFailed(
                    f"{where}: BYTES element {position} is {type(element).__name__}; BYTES "
                    "outputs hold bytes or str"
                )
        return strings
    # orjson writes a C-contiguous native-endian array of numbers without a Python object per
    # element; ravel gives a contiguous copy of any other layout.
    flat = array.ravel()
    if not flat.dtype.isnative:
        flat = flat.astype(flat.dtype.newbyteorder("="))
    return flat


def _binary_blob(where: str, datatype: str, array: np.ndarray) -> Buffer:
    if datatype == "BYTES":
        parts: list[bytes] = []
        for position, element in enumerate(array.ravel().tolist()):
            if isinstance(element, str):
                try:
                    element = element.encode("utf-8")
                except UnicodeEncodeError as error:
                    # Lone surrogates, e.g. from os.fsdecode of undecodable bytes.
                    raise ModelFailed(
                        f"{where}: BYTES element {position} is a str that UTF-8 cannot "
                        f"encode ({error.reason} at index {error.start})"
                    ) from None
            elif not isinstance(element, bytes):
                raise ModelFailed(
                    f"{where}: BYTES element {position} is {type(element).__name__}; BYTES "
                    "outputs hold bytes or str"
                )
            if len(element) > _MAX_ELEMENT_BYTES:
                raise ModelFailed(
                    f"{where}: BYTES element {position} has {len(element)} bytes; a binary "
                    f"element holds at most {_MAX_ELEMENT_BYTES}"
                )
            parts.append(len(element).to_bytes(LENGTH_PREFIX, "little"))
            parts.append(element)
        return b"".join(parts)
    # BOOL is one byte per element, as numpy stores it; views it as bytes without a copy.
    target = _BINARY_DTYPES[datatype]
    if array.dtype == target:
        try:
            # Most outputs: C-contiguous and of the wire's dtype, viewed as bytes in one call
            # (of the buffer numpy gives: a subclass's ``data`` may be something else). ndarray
            # exports a buffer; numpy's stubs do not declare it.
            return memoryview(array).cast("B")  # type: ignore[arg-type]
        except TypeError:
            pass  # Not C-contiguous, or without elements: made so below.
    contiguous = np.ascontiguousarray(array, dtype=target)
    return contiguous.reshape(-1).view(np.uint8).data
