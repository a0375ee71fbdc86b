"""The REST front-end: the Open Inference Protocol's HTTP endpoints, as Triton serves them.

The HTTP transport (:mod:`trio_infer.transport.http_server`) hands over an
:class:`~trio_infer.transport.http_server.HttpRequest` of bytes; this module routes it by
method and path, reserves room in the memory budget from its ``Content-Length`` before its
body is read, decodes it (:mod:`trio_infer.rest.codec`), calls the core, and encodes the answer.

::

    GET  /v2/health/live                              200 (empty)
    GET  /v2/health/ready                             200 ready, 400 not (Triton's; empty)
    GET  /v2                                          server metadata
    GET  /v2/models/{name}[/versions/{v}]             model metadata
    GET  /v2/models/{name}[/versions/{v}]/ready       200 ready, 400 not
    GET  /v2/models/{name}[/versions/{v}]/config      Triton's ModelConfig (the model configuration
                                                      extension: the object itself)
    GET  /v2/models/stats                             Triton's ModelStatistics (the statistics
    GET  /v2/models/{name}[/versions/{v}]/stats       extension): every model's, or one's
    POST /v2/models/{name}[/versions/{v}]/infer       inference (JSON, or Triton's binary
                                                      tensor data extension)
    POST /v2/repository/index                         the repository extension (Triton's): every
    POST /v2/repository/models/{name}/load            model and its state; load (``config``
    POST /v2/repository/models/{name}/unload          parameter: settings JSON); unload
    GET  /metrics                                     Prometheus metrics (when given a renderer)

An error is ``{"error": "..."}`` with the HTTP status :func:`http_status` gives its status
code; an unknown path is 404 and a known one asked with the wrong method 405, as in Triton.
``/v2/models/stats`` is every model's statistics, as in Triton, not the metadata of a model
named ``stats`` (which ``/v2/models/stats/versions/{v}`` and ``.../stats/ready`` still name).
Configuration and statistics are Triton's messages (:mod:`~trio_infer.frontends.triton_messages`)
in Triton's JSON (:func:`~trio_infer.protobuf.triton_json.message_json`).
"""

from __future__ import annotations

import hmac
import json
import logging
import math
from collections.abc import Awaitable, Callable, Mapping
from functools import partial
from types import MappingProxyType
from typing import Any
from urllib.parse import unquote

import numpy as np
import trio

from trio_infer.buffers import Buffer
from trio_infer.core.repository import ModelManager, config_override, json_object
from trio_infer.core.service import RESERVED_PER_BYTE, InferenceCore
from trio_infer.core.timeouts import TIMED_OUT, take_timeout
from trio_infer.core.types import (
    InferenceRequest,
    InferenceResponse,
    RequestContext,
    Reservation,
    TensorSpec,
)
from trio_infer.errors import InferError, InvalidInput, StatusCode, TooLarge, Unimplemented
from trio_infer.frontends.triton_messages import model_config_response, model_statistics_response
from trio_infer.protobuf.triton_json import message_json
from trio_infer.rest import codec
from trio_infer.transport.access_log import REQUEST_ID_HEADER
from trio_infer.transport.http_server import HttpError, HttpRequest, error_body, header_lines
from trio_infer.transport.quoting import header_text, shown

__all__ = [
    "HttpService",
    "MetricsRenderer",
    "http_status",
    "infer_route",
    "metrics_handler",
    "serve_metrics",
]

logger = logging.getLogger(__name__)

#: The HTTP status of each status code. Triton's where Triton has the code
#: (``HttpCodeFromError`` in its http_server.cc: INTERNAL 500, NOT_FOUND 404, UNAVAILABLE 503,
#: UNSUPPORTED 501, and 400 for INVALID_ARG, UNKNOWN, ALREADY_EXISTS and CANCELLED); for the
#: codes Triton does not have, the HTTP mapping of ``google.rpc.Code`` (grpc-gateway's):
#: RESOURCE_EXHAUSTED 429, DEADLINE_EXCEEDED 504, and the rest.
_HTTP_STATUS = {
    StatusCode.OK: 200,
    StatusCode.CANCELLED: 400,
    StatusCode.UNKNOWN: 400,
    StatusCode.INVALID_ARGUMENT: 400,
    StatusCode.DEADLINE_EXCEEDED: 504,
    StatusCode.NOT_FOUND: 404,
    StatusCode.ALREADY_EXISTS: 400,
    StatusCode.PERMISSION_DENIED: 403,
    StatusCode.RESOURCE_EXHAUSTED: 429,
    StatusCode.FAILED_PRECONDITION: 400,
    StatusCode.ABORTED: 409,
    StatusCode.OUT_OF_RANGE: 400,
    StatusCode.UNIMPLEMENTED: 501,
    StatusCode.INTERNAL: 500,
    StatusCode.UNAVAILABLE: 503,
    StatusCode.DATA_LOSS: 500,
    StatusCode.UNAUTHENTICATED: 401,
}

_JSON = ("content-type", "application/json")
_OCTETS = ("content-type", "application/octet-stream")
#: Triton's binary tensor data extension: the size of the JSON part of a body (request or
#: response) followed by binary tensor data.
_HEADER_LENGTH = "inference-header-content-length"
#: The header lines of a JSON answer, and of an answer with binary data before its header
#: length's value: rendered once (HttpRequest.respond's ``lines``).
_JSON_LINES = header_lines([_JSON])
_BINARY_LINES = header_lines([_OCTETS]) + f"{_HEADER_LENGTH}: "
_HEADER_LENGTH_FIELD = _HEADER_LENGTH.encode("ascii")
#: Requests whose JSON part is larger than this are parsed and decoded in a thread, and
#: responses with more output elements than this are encoded in one: on the event loop they
#: would hold it for more than a few milliseconds.
_OFF_LOOP_JSON = 1 << 20
_OFF_LOOP_ELEMENTS = 1 << 15
#: The headers HTTP itself uses, and the binary extension's: not the request's metadata. Left
#: out of what the model sees, as the gRPC transport leaves out gRPC's own (content-type, te,
#: user-agent...), and so out of the batch key (which holds the headers): REST requests of
#: different clients and sizes, and REST and gRPC requests, batch together.
_PROTOCOL_HEADERS = frozenset(
    {
        "accept",
        "accept-encoding",
        "connection",
        "content-length",
        "content-type",
        "expect",
        "host",
        "keep-alive",
        "te",
        "transfer-encoding",
        "upgrade",
        "user-agent",
        _HEADER_LENGTH,
        # The server's own: a request id differs call to call (see grpc_service._model_headers).
        REQUEST_ID_HEADER,
    }
)
#: The same names as the transport gives them (HttpRequest.fields): most requests carry only
#: these, and are looked at without a header decoded.
_PROTOCOL_FIELDS = frozenset(name.encode("latin-1") for name in _PROTOCOL_HEADERS)
#: The most digits an Inference-Header-Content-Length may have (2**63 has 19).
_MAX_HEADER_LENGTH_DIGITS = 19

#: The parameters of an inference's answer: none (the encoder only reads them).
_NO_PARAMETERS: Mapping[str, codec.ParameterValue] = MappingProxyType({})
#: The parts of an inference's path around its model's name and version (infer_route).
_MODELS_PREFIX = "/v2/models/"
_VERSIONS = "/versions/"
_INFER_SUFFIX = "/infer"
#: What may follow a model's name (and version) in a path: the route of :func:`_model_route`.
_MODEL_ACTIONS = frozenset(("ready", "infer", "config", "stats"))
#: The methods of a route that only reads, as an ``allow`` field lists them.
_READ_METHODS = "GET, HEAD"
_READS = frozenset(("GET", "HEAD"))
#: The largest body of a request that carries no tensors (every route but infer): none is
#: expected; a larger one is refused before it is read.
_MAX_SMALL_BODY = 64 * 1024


def http_status(error: InferError) -> int:
    """The HTTP status a request that ends with ``error`` is answered with (see the status
    table in :mod:`trio_infer.errors`): its code's, but 413 for a request no retry can pass,
    where its code's 429 would tell the client to send it again."""
    return 413 if isinstance(error, TooLarge) else _HTTP_STATUS[error.code]


#: Renders the metrics: the body and its content type.
MetricsRenderer = Callable[[], tuple[bytes, str]]


class HttpService:
    """The HTTP transport's handler: adapts an :class:`HttpRequest` to the core.

    Args:
        core: The V2 core every front-end calls.
        models: The model manager, for the repository extension (None: not served).
        metrics: Renders ``GET /metrics`` (None: no such endpoint).
        control_header: ``(name, value)`` the repository extension's requests must carry
            (None: unrestricted).
    """

    def __init__(
        self,
        core: InferenceCore,
        models: ModelManager | None = None,
        *,
        metrics: MetricsRenderer | None = None,
        control_header: tuple[str, str] | None = None,
    ) -> None:
        self.core = core
        self._models = models
        self._metrics = metrics
        self._control_header = control_header
        #: The health checks by their paths (percent-decoded): each is answered 200 when its
        #: check passes, else 400, with no body. Looked up before any split of the path, and
        #: answered by :meth:`handle` itself: a coroutine of the route's own costs a health
        #: check a few percent.
        self._health: dict[str, Callable[[], bool]] = {
            "/v2/health/live": core.server_live,
            "/v2/health/ready": core.server_ready,
        }
        # One decode or encode in a thread at a time: each thread that wants the GIL is another
        # switch interval the event loop may wait for it.
        self._off_loop = trio.CapacityLimiter(1)

    async def handle(self, request: HttpRequest) -> None:
        """Serve one request: route it, run it, respond (errors included).

        A fixed route is run from here, the rest through :meth:`_route`: each coroutine
        between the transport and the response costs a health check a few percent.
        """
        try:
            check = self._health.get(request.path)
            if check is None:
                route = infer_route(request.path)
                if route is not None:
                    # An inference, its path in the form clients send: served without the
                    # route's split and coroutine.
                    await self._infer_at(request, *route)
                    return
                check = await self._route(request)
            if check is not None:
                _check_get(request)
                await request.respond(200 if check() else 400)
        except InferError as error:
            await _respond_error(request, http_status(error), error.message)

    async def _route(self, request: HttpRequest) -> Callable[[], bool] | None:
        """Serve a request other than a health check's; return the health check it asks for
        once its path is percent-decoded, if it is one (:meth:`handle` answers it)."""
        if request.path == "/metrics" and self._metrics is not None:
            await serve_metrics(request, self._metrics)
            return None
        segments = request.path.split("/")
        # "/v2/models/m/versions/1/infer" -> ["", "v2", "models", "m", "versions", "1", "infer"]
        if len(segments) < 2 or segments[0] or segments[1] != "v2":
            raise _not_found(request)
        rest = segments[2:]
        if "%" in request.path:
            rest = _percent_decoded(request, rest)
        if not rest:
            _check_get(request)
            await self._server_metadata(request, "", "")
        elif rest == ["health", "live"]:
            return self.core.server_live
        elif rest == ["health", "ready"]:
            return self.core.server_ready
        elif rest == ["models", "stats"]:
            _check_get(request)
            await self._model_statistics(request, "", "")
        elif rest and rest[0] == "repository" and self._models is not None:
            await self._repository(request, self._models, rest[1:])
        elif len(rest) >= 2 and rest[0] == "models" and rest[1]:
            name, version, action = _model_route(rest[1:])
            request.subject = name
            if action is None:
                raise _not_found(request)
            if action == "infer":
                await self._infer_at(request, name, version)
            elif action == "ready":
                _check_get(request)
                await self._model_ready(request, name, version)
            elif action == "config":
                _check_get(request)
                await self._model_config(request, name, version)
            elif action == "stats":
                _check_get(request)
                await self._model_statistics(request, name, version)
            else:
                _check_get(request)
                await self._model_metadata(request, name, version)
        else:
            raise _not_found(request)
        return None

    async def _repository(
        self, request: HttpRequest, manager: ModelManager, rest: list[str]
    ) -> None:
        """The repository extension: ``index``, ``models/{name}/load``, ``.../unload``."""
        if rest == ["index"]:
            action, name = "index", ""
        elif len(rest) >= 3 and rest[0] == "models" and rest[-1] in ("load", "unload"):
            # Every segment between is the name: tritonclient leaves a '/' in a name unquoted,
            # and such a name must be refused as one (INVALID_ARGUMENT), not be a 404.
            action, name = rest[-1], "/".join(rest[1:-1])
        else:
            raise _not_found(request)
        if request.method != "POST":
            raise _not_allowed("POST")
        if self._control_header is not None:
            header, value = self._control_header
            sent = request.header(header)
            # Compared as bytes: compare_digest refuses str with non-ASCII characters, which a
            # client may send. The header's bytes (decoded Latin-1) against the value's UTF-8.
            if sent is None or not hmac.compare_digest(sent.encode("latin-1"), value.encode()):
                raise InferError(
                    f"the model repository extension is restricted: it needs header '{header}'",
                    StatusCode.PERMISSION_DENIED,
                )
        request.subject = name
        body = await _small_json(request)
        parameters = body.get("parameters", {})
        if not isinstance(parameters, dict):
            raise InvalidInput("'parameters' must be a JSON object")
        if action == "index":
            ready = body.get("ready", False)
            if not isinstance(ready, bool):
                raise InvalidInput("'ready' must be a boolean")
            await _respond_json(
                request,
                [
                    {
                        "name": entry.name,
                        "version": entry.version,
                        "state": str(entry.state),
                        "reason": entry.reason,
                    }
                    for entry in await manager.index(ready_only=ready)
                ],
            )
            return
        if action == "load":
            config = None
            for key, value in parameters.items():
                if key != "config":
                    raise InvalidInput(
                        f"load parameter '{key[:100]}' is not served (only 'config')"
                    )
                if not isinstance(value, str):
                    raise InvalidInput("load parameter 'config' must be a string of JSON")
                config = config_override(value)
            await manager.load(name, config)
        else:
            await manager.unload(name)
        await request.respond(200)

    async def _model_ready(self, request: HttpRequest, name: str, version: str) -> None:
        if self.core.model_ready(name, version):
            await request.respond(200)
            return
        # Why, in headers (the body stays empty, as Triton's): the index's state and reason.
        state, reason = self.core.model_state(name)
        await request.respond(
            400, [("x-model-state", state), ("x-model-reason", header_text(reason))]
        )

    async def _server_metadata(self, request: HttpRequest, name: str, version: str) -> None:
        metadata = self.core.server_metadata()
        await _respond_json(
            request,
            {
                "name": metadata.name,
                "version": metadata.version,
                "extensions": list(metadata.extensions),
            },
        )

    async def _model_metadata(self, request: HttpRequest, name: str, version: str) -> None:
        metadata = self.core.model_metadata(name, version)
        await _respond_json(
            request,
            {
                "name": metadata.name,
                "versions": list(metadata.versions),
                "platform": metadata.platform,
                "inputs": [_tensor_metadata(spec) for spec in metadata.inputs],
                "outputs": [_tensor_metadata(spec) for spec in metadata.outputs],
            },
        )

    async def _model_config(self, request: HttpRequest, name: str, version: str) -> None:
        """Triton's ModelConfig: the ``config`` of its response, not the response (Triton's
        HTTP endpoint answers the configuration object itself)."""
        response = model_config_response(self.core.model_config(name, version))
        await _respond_json(request, message_json(response.config))

    async def _model_statistics(self, request: HttpRequest, name: str, version: str) -> None:
        """Triton's ModelStatistics: ``{"model_stats": [...]}``, every model's for no name."""
        statistics = self.core.model_statistics(name, version)
        await _respond_json(request, message_json(model_statistics_response(statistics)))

    def _infer_at(self, request: HttpRequest, name: str, version: str) -> Awaitable[None]:
        """The inference a path names (model ``name``, ``version``), to be awaited by the
        caller, without a coroutine of its own between the caller's and :meth:`_infer`.

        Raises:
            HttpError: The request is not a POST (405).
        """
        request.subject = name
        if request.method != "POST":
            raise _not_allowed("POST")
        return self._infer(request, name, version)

    async def _infer(self, request: HttpRequest, name: str, version: str) -> None:
        """``POST .../infer``: reserve from ``Content-Length``, read, decode, infer, encode.

        A chunked body is reserved as it arrives, each piece before it is kept. What parsing
        and decoding allocate beyond the body's size is reserved before each step, and the
        reservation is held until the response has been written.
        """
        if self.core.decoupled(name, version):
            raise Unimplemented(
                f"model '{name}' is decoupled (0..N responses per request): the HTTP endpoint "
                "doesn't support models with decoupled transaction policy; call it on a gRPC "
                "stream (ModelStreamInfer)"
            )
        announced = request.content_length
        async with self.core.reserve(
            announced or 0, math.inf, request.connection_id
        ) as reservation:
            grow = None if announced is not None else _chunk_counter(reservation)
            # The header length is looked at before the body is read, for where its binary
            # part lands; a bad one is answered after the body, as the body's own faults are
            # answered first.
            try:
                metadata, header_length = _metadata(request)
            except HttpError as exc:
                await request.receive_body(grow)
                raise exc from None
            body = await request.receive_body(grow, aligned_at=header_length or 0)
            parsed, inputs = await self._decoded(body, header_length, reservation)
            own = take_timeout(parsed.parameters)
            # Positional: a class called with keywords gets them as a dict made for the call.
            context = RequestContext(own, metadata, reservation)
            inference = InferenceRequest(
                name,
                version,
                parsed.id,
                inputs,
                parsed.parameters,
                parsed.input_parameters,
                parsed.outputs,
            )
            # Encoded within the core's call: a refusal of the answer (a BYTES output asked for
            # as JSON that is not UTF-8) is then the status its statistics record.
            encode = partial(self._encoded, parsed.binary_outputs)
            del parsed, inputs, body
            if own == math.inf:
                # No timeout of its own: the request's scope bounds it, and a scope costs
                # microseconds.
                headers, lines, buffers = await self.core.infer(inference, context, encode)
            else:
                with trio.move_on_at(own) as timed:
                    headers, lines, buffers = await self.core.infer(inference, context, encode)
                if timed.cancelled_caught:
                    raise InferError(TIMED_OUT, StatusCode.DEADLINE_EXCEEDED)
            await request.respond(200, headers, buffers, lines)

    async def _encoded(
        self, binary_outputs: codec.BinaryOutputs, answer: InferenceResponse
    ) -> tuple[list[tuple[str, str]], str, list[Buffer]]:
        """The response's header fields (the model's), header lines (the server's, rendered)
        and body buffers for ``answer``; encoded in a thread when its outputs are large."""
        outputs = answer.outputs
        elements = 0
        for _, array in outputs:
            elements += array.size
        arguments = (
            answer.model_name,
            answer.model_version,
            answer.id,
            outputs,
            _NO_PARAMETERS,
            binary_outputs,
        )
        if elements > _OFF_LOOP_ELEMENTS:
            buffers, json_length = await trio.to_thread.run_sync(
                codec.encode_infer_response,
                *arguments,
                limiter=self._off_loop,
                abandon_on_cancel=False,
            )
        else:
            buffers, json_length = codec.encode_infer_response(*arguments)
        # Most answers carry no metadata: their (empty) mappings are not unpacked.
        metadata = answer.headers or answer.trailers
        headers = [*answer.headers.items(), *answer.trailers.items()] if metadata else []
        # The header length's value is digits: rendered without a check for line breaks.
        lines = _JSON_LINES if json_length is None else f"{_BINARY_LINES}{json_length}\r\n"
        return headers, lines, buffers

    async def _decoded(
        self, body: bytearray | memoryview, header_length: int | None, reservation: Reservation
    ) -> tuple[codec.ParsedInferRequest, dict[str, np.ndarray]]:
        """The request ``body`` parsed, and its inputs decoded; what parsing and decoding
        allocate reserved first.

        The reservation holds the body's size once for the decoded inputs; the parsed JSON
        (Python objects, many times its text) and inputs larger than the body are added before
        they are made. Large bodies are decoded in a thread, one at a time.
        """
        json_length = len(body) if header_length is None else header_length
        share = reservation.granted // RESERVED_PER_BYTE
        reservation.grow_nowait(codec.parsing_cost(json_length), "the parsed request JSON")
        if json_length > _OFF_LOOP_JSON:
            parsed = await trio.to_thread.run_sync(
                codec.parse_infer_request,
                body,
                header_length,
                limiter=self._off_loop,
                abandon_on_cancel=False,
            )
        else:
            parsed = codec.parse_infer_request(body, header_length)
        extra = parsed.decoded_nbytes - share
        if extra > 0:
            reservation.grow_nowait(extra, "the decoded inputs")
        if json_length > _OFF_LOOP_JSON:
            inputs = await trio.to_thread.run_sync(
                codec.input_arrays, parsed, limiter=self._off_loop, abandon_on_cancel=False
            )
        else:
            inputs = codec.input_arrays(parsed)
        return parsed, inputs


def infer_route(path: str) -> tuple[str, str] | None:
    """``(name, version)`` of an inference's path as clients send it,
    ``/v2/models/{name}[/versions/{version}]/infer`` with no segment empty and nothing
    percent-encoded; None for any other path (:meth:`HttpService._route` reads it, and finds
    the same model and version for a path this reads)."""
    if not (path.startswith(_MODELS_PREFIX) and path.endswith(_INFER_SUFFIX)) or "%" in path:
        return None
    middle = path[len(_MODELS_PREFIX) : -len(_INFER_SUFFIX)]
    if "/" not in middle:
        return (middle, "") if middle else None
    name, versions, version = middle.partition(_VERSIONS)
    if not name or "/" in name or not versions or not version or "/" in version:
        return None
    return name, version


def _model_route(rest: list[str]) -> tuple[str, str, str | None]:
    """``(name, version, action)`` from what follows ``/v2/models/``: action is ``""`` for
    metadata, ``"ready"``, ``"infer"``, ``"config"`` or ``"stats"``, and None when the path is
    none of them."""
    name, rest = rest[0], rest[1:]
    version = ""
    if len(rest) >= 2 and rest[0] == "versions" and rest[1]:
        version, rest = rest[1], rest[2:]
    if not rest:
        return name, version, ""
    if len(rest) == 1 and rest[0] in _MODEL_ACTIONS:
        return name, version, rest[0]
    return name, version, None


def _percent_decoded(request: HttpRequest, segments: list[str]) -> list[str]:
    """``segments`` of the request's path with their percent-encoding decoded as UTF-8.

    Raises:
        HttpError: The bytes encoded are not UTF-8 (400): as replacement characters they would
            name a model no client asked for.
    """
    try:
        return [unquote(segment, errors="strict") for segment in segments]
    except UnicodeDecodeError:
        raise HttpError(
            400, f"the request path {shown(request.path)!r} is not UTF-8 once percent-decoded"
        ) from None


def _check_get(request: HttpRequest) -> None:
    """Check a request for a route that takes no body: GET or HEAD (RFC 9110 9.1: a server
    that serves GET serves HEAD; the transport answers it with the head alone), a body
    refused unread.

    Raises:
        HttpError: Another method (405), a body without a ``Content-Length`` (411: its size is
            known only once read), or one larger than a GET's (413).
    """
    if request.method not in _READS:
        raise _not_allowed(_READ_METHODS)
    if request.content_length is None:
        raise HttpError(411, "a GET request's body must be sent with a Content-Length")
    if request.content_length > _MAX_SMALL_BODY:
        raise HttpError(413, f"a GET request's body may be at most {_MAX_SMALL_BODY} bytes")


def _metadata(request: HttpRequest) -> tuple[dict[str, str], int | None]:
    """The request's metadata, as its model sees it (its headers but HTTP's own), and its
    ``Inference-Header-Content-Length``: where its JSON ends and its binary tensor data begins
    (None: all of it is JSON). One look through the fields finds both.

    Raises:
        HttpError: The header length is not a size within the body (400).
    """
    metadata: dict[str, str] = {}
    values: list[bytes] = []
    for name, value in request.fields:
        if name not in _PROTOCOL_FIELDS:
            metadata[name.decode("latin-1")] = value.decode("latin-1")
        elif name == _HEADER_LENGTH_FIELD:
            values.append(value)
    if not values:
        return metadata, None
    return metadata, _header_length(values)


def _header_length(values: list[bytes]) -> int:
    """The ``Inference-Header-Content-Length`` of a request that sent it (``values``: each
    time it was sent).

    Raises:
        HttpError: It is not one size within the body (400).
    """
    if len(values) > 1:
        # As a repeated Content-Length (RFC 9112 6.3): a proxy in front may have taken another
        # of them than this server would, so none is taken.
        raise HttpError(
            400, f"{_HEADER_LENGTH} is sent {len(values)} times; it is one number of bytes"
        )
    value = values[0]
    # ASCII digits only (bytes.isdigit: "\u00b2".isdigit() is true of the text, and int()
    # refuses it), and few enough for int() (which refuses over 4,300) and for any body.
    if not value.isdigit() or len(value) > _MAX_HEADER_LENGTH_DIGITS:
        shown_value = value.decode("latin-1")[:40]
        raise HttpError(400, f"{_HEADER_LENGTH} must be a number of bytes, got {shown_value!r}")
    return int(value)


async def serve_metrics(request: HttpRequest, render: MetricsRenderer) -> None:
    """Answer ``GET /metrics`` with what ``render`` gives.

    Raises:
        HttpError: Neither GET nor HEAD (405), or it has a body (413).
    """
    if request.method not in _READS:
        raise _not_allowed(_READ_METHODS)
    if request.content_length != 0:
        raise HttpError(413, "GET /metrics takes no body")
    body, content_type = render()
    await request.respond(200, [("content-type", content_type)], [body])


def metrics_handler(render: MetricsRenderer) -> Callable[[HttpRequest], Awaitable[None]]:
    """The handler of the metrics port (``--metrics-port``): ``GET /metrics``, and 404 for
    any other path."""

    async def handle(request: HttpRequest) -> None:
        if request.path != "/metrics":
            raise _not_found(request)
        await serve_metrics(request, render)

    return handle


async def _small_json(request: HttpRequest) -> dict[str, Any]:
    """The body of a request that carries no tensors: at most 64 KiB of JSON object (an empty
    body is ``{}``).

    Raises:
        HttpError: The body is larger (413): refused before it is read when its size is
            announced, as it arrives (or decodes) when it is not.
        InvalidInput: It is not a JSON object.
    """
    if request.content_length is not None and request.content_length > _MAX_SMALL_BODY:
        raise HttpError(413, f"this request's body may be at most {_MAX_SMALL_BODY} bytes")
    # As bytes: a large body comes as a memoryview, which the JSON parser does not take.
    body = bytes(await request.receive_body(limit=_MAX_SMALL_BODY))
    if not body.strip():
        return {}
    return json_object(body, "the request body")


def _chunk_counter(reservation: Reservation) -> Callable[[int], None]:
    """What a chunked body calls with each piece's size: the piece is reserved before it is
    kept, as a body announced whole would have been before it was read."""

    def grow(nbytes: int) -> None:
        reservation.grow_nowait(RESERVED_PER_BYTE * nbytes, "the request body")

    return grow


def _tensor_metadata(spec: TensorSpec) -> dict[str, object]:
    return {"name": spec.name, "datatype": spec.datatype, "shape": list(spec.shape)}


async def _respond_json(request: HttpRequest, document: object) -> None:
    await request.respond(200, (), [json.dumps(document).encode()], _JSON_LINES)


async def _respond_error(request: HttpRequest, status: int, message: str) -> None:
    await request.respond(status, (), [error_body(message)], _JSON_LINES)


def _not_found(request: HttpRequest) -> HttpError:
    return HttpError(404, f"no such endpoint: {request.method} {request.path[:200]}")


def _not_allowed(methods: str) -> HttpError:
    """405, with the ``allow`` field RFC 9110 15.5.6 requires of it."""
    return HttpError(
        405,
        f"Method Not Allowed (this endpoint takes {methods})",
        [("allow", methods)],
    )
