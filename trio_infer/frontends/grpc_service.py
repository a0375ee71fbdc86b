"""The gRPC front-end: ``inference.GRPCInferenceService`` and ``grpc.health.v1.Health``.

The transport hands over a :class:`~trio_infer.transport.grpc_server.Call` of bytes; this module
routes it by method, reserves room for it in the memory budget from its announced size before its
body is read, parses it, builds the core's request and context, and encodes the core's answer
back into protobuf. What a call means is the core's (:mod:`trio_infer.core.service`); what the
bytes are is this module's.
"""

from __future__ import annotations

import functools
import hmac
import logging
import math
from collections.abc import Awaitable, Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, NamedTuple

import numpy as np
import trio
from google.protobuf.message import DecodeError, Message

from trio_infer.buffers import Buffer
from trio_infer.core.repository import ModelManager, config_override
from trio_infer.core.service import RESERVED_PER_BYTE, InferenceCore
from trio_infer.core.timeouts import TIMED_OUT, take_timeout
from trio_infer.core.types import (
    InferenceRequest,
    InferenceResponse,
    RequestContext,
    Reservation,
    TensorSpec,
)
from trio_infer.errors import (
    InferError,
    InvalidInput,
    ModelNotFound,
    Overloaded,
    StatusCode,
    Unavailable,
    Unimplemented,
)
from trio_infer.frontends.triton_messages import model_config_response, model_statistics_response
from trio_infer.model import MAX_RESPONSE_METADATA, ParameterValue
from trio_infer.protobuf._proto import grpc_predict_v2_pb2 as pb
from trio_infer.protobuf._proto import health_pb2
from trio_infer.protobuf.codec import (
    EncodingCost,
    decode_inputs,
    decode_known_raw,
    decode_parameters,
    decoding_cost,
    encode_raw_as_is,
    encode_response,
    encoding_cost,
    prepare_inputs,
    stream_response,
)
from trio_infer.protobuf.field_count import MODEL_INFER_REQUEST, FieldTree, count_fields
from trio_infer.protobuf.wire import WireInferRequest, raw_input_suffix
from trio_infer.transport.access_log import REQUEST_ID_HEADER
from trio_infer.transport.grpc_server import Call, Immediate
from trio_infer.transport.quoting import header_text, shown

__all__ = ["GrpcService"]

logger = logging.getLogger(__name__)

_V2 = "/inference.GRPCInferenceService/"
_HEALTH = "/grpc.health.v1.Health/"
_SERVING = health_pb2.HealthCheckResponse.ServingStatus.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.ServingStatus.NOT_SERVING
_UNKNOWN = health_pb2.HealthCheckResponse.ServingStatus.SERVICE_UNKNOWN
_WATCH = _HEALTH + "Watch"
#: Inputs with more elements to convert one by one than this are decoded in a thread, and
#: outputs with more elements to convert or copy are encoded in one: on the event loop they
#: would hold it for more than a few milliseconds (docs/performance.md).
_OFF_LOOP_ELEMENTS = 1 << 15
#: Requests larger than this have their typed contents copied out and counted in a thread:
#: the copy and the count are linear in the contents (docs/performance.md).
_OFF_LOOP_PREPARE = 1 << 20


_STREAM_INFER = _V2 + "ModelStreamInfer"
#: Messages of one stream in flight at once (admitted and not yet answered); the next is not
#: read until one ends.
_STREAM_IN_FLIGHT = 64
_TRAILERS_FULL = (
    f"the model's response metadata would take the stream's trailers past "
    f"{MAX_RESPONSE_METADATA} bytes"
)
#: Triton's response parameter marking a request's last response on a stream.
_FINAL = "triton_final_response"
#: Triton's request parameter asking for an empty response after a decoupled model's last one.
_EMPTY_FINAL = "triton_enable_empty_final_response"
#: The request parameter (the name of Triton's REST option) that asks, set to false, for outputs
#: in typed contents. Answers are raw otherwise, whatever the request used, as Triton's gRPC
#: answers always are: tritonclient reads numeric outputs from raw_output_contents only.
_BINARY_OUTPUT = "binary_data_output"
#: The largest request message of a method that is not ModelInfer: names and versions, no
#: tensors. A larger one is refused from its prefix, never read or parsed.
_MAX_SMALL_MESSAGE = 64 * 1024
#: From this size on, a ModelInfer request's raw inputs are split off its message before it is
#: parsed (:func:`_parsed_infer`): walking its records costs less than the two copies of them
#: the parse and the reading of each entry make.
_SPLIT_MESSAGE = 16 * 1024
#: Fields a ModelInferRequest may have outside its tensors' contents (counted before it is
#: parsed: see :mod:`trio_infer.protobuf.field_count`): four full parameter maps and thousands
#: of tensors.
MAX_REQUEST_FIELDS = 16 * 1024
_NO_METADATA: Mapping[str, str] = MappingProxyType({})
#: What a negative int64 adds up to as the uint64 of the same bits.
_UINT64 = 1 << 64


@dataclass(frozen=True)
class _Route:
    request_type: type[Message]
    #: A handler returns its response, or (ModelInfer) the buffers of one already serialised.
    handler: Callable[[Any, Call, Reservation], Awaitable[Message | list[Buffer]]]
    #: The largest request message taken (None: the transport's --max-message-size).
    max_message: int | None = _MAX_SMALL_MESSAGE
    #: The submessages whose fields are counted before parsing (None: the message is small
    #: enough for its parse to be cheap whatever it holds).
    fields: FieldTree | None = None
    #: The protocol's name of the request message (``request_type`` may be a view of it).
    message_name: str = ""
    #: For a method answered from the server's state alone, without waiting (see
    #: :func:`_from_state`): that answer, which ``handler`` gives in a call's task.
    answer: Callable[[Any, Call], Message] | None = None
    #: ModelInfer: its handler takes the request and its raw inputs (:func:`_parsed_infer`).
    splits_raw: bool = False

    def __post_init__(self) -> None:
        if not self.message_name:
            object.__setattr__(self, "message_name", self.request_type.DESCRIPTOR.full_name)


def _from_state(request_type: type[Message], answer: Callable[[Any, Call], Message]) -> _Route:
    """The route of a method whose ``answer`` is a function of the request and the server's
    state, which never waits: the transport may give it at once
    (:attr:`GrpcService.immediate`), or the route's handler in the call's task."""

    async def handler(request: Any, call: Call, reservation: Reservation) -> Message:
        return answer(request, call)

    return _Route(request_type, handler, answer=answer)


class GrpcService:
    """The transport's handler for every gRPC method: adapts a :class:`Call` to the core.

    Args:
        core: The V2 core every front-end calls.
        models: The model manager, for the repository extension (None: not served).
        control_header: ``(name, value)`` the repository extension's calls must carry (None:
            unrestricted).
    """

    def __init__(
        self,
        core: InferenceCore,
        models: ModelManager | None = None,
        *,
        control_header: tuple[str, str] | None = None,
    ) -> None:
        self.core = core
        self._models = models
        self._control_header = control_header
        # One decode in a thread at a time: each thread that wants the GIL is another switch
        # interval the event loop may wait for it.
        self._decoding = trio.CapacityLimiter(1)
        self._routes: dict[str, _Route] = {
            _V2 + "ServerLive": _from_state(pb.ServerLiveRequest, self._server_live),
            _V2 + "ServerReady": _from_state(pb.ServerReadyRequest, self._server_ready),
            _V2 + "ModelReady": _from_state(pb.ModelReadyRequest, self._model_ready),
            _V2 + "ServerMetadata": _from_state(pb.ServerMetadataRequest, self._server_metadata),
            _V2 + "ModelMetadata": _from_state(pb.ModelMetadataRequest, self._model_metadata),
            _V2 + "ModelConfig": _from_state(pb.ModelConfigRequest, self._model_config),
            _V2 + "ModelStatistics": _from_state(pb.ModelStatisticsRequest, self._model_statistics),
            # The wire view: typed contents arrive as blobs, decoded by the codec with numpy.
            _V2 + "ModelInfer": _Route(
                WireInferRequest,
                self._model_infer,
                None,
                MODEL_INFER_REQUEST,
                pb.ModelInferRequest.DESCRIPTOR.full_name,
                splits_raw=True,
            ),
            _HEALTH + "Check": _from_state(health_pb2.HealthCheckRequest, self._health_check),
        }
        if models is not None:
            self._routes |= {
                _V2 + "RepositoryIndex": _Route(pb.RepositoryIndexRequest, self._index),
                _V2 + "RepositoryModelLoad": _Route(pb.RepositoryModelLoadRequest, self._load),
                _V2 + "RepositoryModelUnload": _Route(
                    pb.RepositoryModelUnloadRequest, self._unload
                ),
            }
        self.immediate: Mapping[str, Immediate] = MappingProxyType(
            {
                method: functools.partial(self._answer_now, route, route.answer)
                for method, route in self._routes.items()
                if route.answer is not None
            }
        )
        """The methods the transport may answer at once (``GrpcServer``'s ``immediate``):
        those answered from the server's state alone."""

    async def handle(self, call: Call) -> None:
        """Serve one call: a unary method, ModelStreamInfer, or health Watch."""
        if call.method == _STREAM_INFER:
            await self._stream_infer(call)
            return
        if call.method == _WATCH:
            await self._health_watch(call)
            return
        route = self._routes.get(call.method)
        if route is None:
            raise Unimplemented(f"method {shown(call.method, 200)} is not served here")
        # A unary request usually came whole in the read that started the call: its length is
        # taken without the coroutines that would wait for it, once the call is known not to
        # be cancelled (as they know it before they take a message's prefix).
        await trio.lowlevel.checkpoint_if_cancelled()
        length = call.receive_message_length_nowait()
        if length is None:
            length = await self._announced_length(call, route)
        else:
            _check_length(call, route, length)
        # A route answered from the server's state takes room only if there is some now, never
        # waiting, in a task (its request came in pieces) as when the transport answers it at
        # once (:meth:`_answer_now`).
        async with self.core.reserve(
            length, call.deadline, call.connection_id, wait=route.answer is None
        ) as reservation:
            request = _request_of(route, await call.receive_message())
            response = await route.handler(request, call, reservation)
            # A unary call is one message. One more that arrived by now fails the call; the
            # end of the request is not waited for (a client may half-close late, or never).
            if call.another_message_nowait():
                raise InvalidInput(
                    f"{call.method} takes one request message and the client sent more"
                )
            # Large outputs are written from their own memory, possibly after the handler has
            # returned, or been cut off with part of the answer queued: the reservation covers
            # them until their bytes have left, whichever way the call ends.
            call.release_when_sent(reservation.release_later())
            await call.send_message(
                response.SerializeToString() if isinstance(response, Message) else response,
                last=True,
            )

    @staticmethod
    async def _announced_length(call: Call, route: _Route) -> int:
        """The length of the call's one request message, announced by its prefix; the room
        for it is reserved before the message is read.

        Raises:
            InvalidInput: The client sent no message.
            Overloaded: The message is larger than the route takes.
            InferError: Its prefix did not come within the receive timeout (DEADLINE_EXCEEDED).
        """
        length = await call.receive_sole_message_length()
        if length is None:
            raise InvalidInput(f"{call.method} expects one request message and got none")
        _check_length(call, route, length)
        return length

    def _answer_now(
        self, route: _Route, answer: Callable[[Any, Call], Message], call: Call, length: int
    ) -> Buffer:
        """A call of a route answered from the server's state, its whole request in, answered
        as :meth:`handle` answers it, without waiting (an :data:`Immediate`)."""
        _check_length(call, route, length)
        # Its message is already read and is dropped once answered, and its answer waits in the
        # connection's bounded unsent bytes: room in the budget is taken when there is some now
        # but never waited for (in a task too: see :meth:`handle`), so a probe is answered while
        # model requests wait for memory (as over REST, whose health routes reserve nothing). A
        # client past its share is refused as any call is.
        reservation = self.core.reserve_nowait(length, call.connection_id)
        try:
            response = answer(_parsed(route, call.receive_message_nowait()), call)
        except BaseException:
            if reservation is not None:
                reservation.release()
            raise
        if reservation is not None:
            call.release_when_sent(reservation.release_later())
        return response.SerializeToString()

    def _server_live(self, request: pb.ServerLiveRequest, call: Call) -> Message:
        return pb.ServerLiveResponse(live=self.core.server_live())

    def _server_ready(self, request: pb.ServerReadyRequest, call: Call) -> Message:
        return pb.ServerReadyResponse(ready=self.core.server_ready())

    def _model_ready(self, request: pb.ModelReadyRequest, call: Call) -> Message:
        call.subject = request.name
        ready = self.core.model_ready(request.name, request.version)
        if not ready:
            # Why, for a client or an operator: the index's state and reason (a load's error).
            state, reason = self.core.model_state(request.name)
            call.trailing_metadata = (
                ("x-model-state", state),
                ("x-model-reason", header_text(reason)),
            )
        return pb.ModelReadyResponse(ready=ready)

    def _server_metadata(self, request: pb.ServerMetadataRequest, call: Call) -> Message:
        metadata = self.core.server_metadata()
        return pb.ServerMetadataResponse(
            name=metadata.name, version=metadata.version, extensions=list(metadata.extensions)
        )

    def _model_metadata(self, request: pb.ModelMetadataRequest, call: Call) -> Message:
        call.subject = request.name
        metadata = self.core.model_metadata(request.name, request.version)
        return pb.ModelMetadataResponse(
            name=metadata.name,
            versions=list(metadata.versions),
            platform=metadata.platform,
            inputs=[_tensor_metadata(spec) for spec in metadata.inputs],
            outputs=[_tensor_metadata(spec) for spec in metadata.outputs],
        )

    def _model_config(self, request: pb.ModelConfigRequest, call: Call) -> Message:
        call.subject = request.name
        return model_config_response(self.core.model_config(request.name, request.version))

    def _model_statistics(self, request: pb.ModelStatisticsRequest, call: Call) -> Message:
        call.subject = request.name
        return model_statistics_response(self.core.model_statistics(request.name, request.version))

    async def _model_infer(
        self, parsed: tuple[Any, Sequence[Buffer]], call: Call, reservation: Reservation
    ) -> list[Buffer]:
        request, raw = parsed
        call.subject = request.model_name
        # Positional, here and for the request and state _decoded makes: a keyword call of a
        # dataclass's __init__ costs about twice a positional one, on every call.
        context = RequestContext(call.deadline, _model_headers(call), reservation)
        parameters = request.parameters
        if parameters:
            answer = await self._infer_in_time(request, raw, context)
        else:
            # Most requests: no parameters, so no timeout of their own (the call's scope bounds
            # them), and no coroutine of _infer_in_time's.
            answer = await self._infer(request, raw, context, parameters)
        if answer.headers:
            call.initial_metadata = tuple(answer.headers.items())
        if answer.trailers:
            call.trailing_metadata = tuple(answer.trailers.items())
        return answer.buffers

    async def _stream_infer(self, call: Call) -> None:
        """ModelStreamInfer: each request message is a request of its own, in a task of the
        stream's nursery, answered as soon as it is done (completion order; the answer carries
        the request's id). A message that fails is answered with its ``error_message`` and the
        stream goes on; the stream's own deadline, a reset or a lost connection ends them all.

        The next message is read only once the one before is admitted (its bytes reserved,
        here, in order) and while fewer than ``_STREAM_IN_FLIGHT`` are in flight, so a client
        that sends faster than the models serve is held back by HTTP/2 flow control; one whose
        message the budget refuses outright ends the stream (RESOURCE_EXHAUSTED): its body
        cannot be skipped without being read. So does a message refused from its prefix, with
        the refusal's status. Messages that arrived together are admitted in one pass and their
        tasks start together, so they reach a batching model together.
        """
        sending = _StreamSender(call)
        slots = trio.Semaphore(_STREAM_IN_FLIGHT)
        turns = _SequenceTurns()
        # A stream's metadata is its first header block's: the same for all its messages.
        headers = _model_headers(call)
        refused: InferError | None = None
        infer_route = self._routes[_V2 + "ModelInfer"]
        async with trio.open_nursery() as messages:
            sending.scope = messages.cancel_scope
            # Idle while no message is in flight (the last one to end says so again).
            call.idle = True
            while True:
                try:
                    length = await call.receive_message_length()
                except InferError as error:
                    # Refused from its prefix (over the size limit, compressed, the request
                    # ended inside it): as a message refused before it was read, below.
                    refused = error
                    break
                if length is None:
                    break
                call.idle = False
                # Without a pass of the scheduler when a slot is free (Semaphore.acquire always
                # yields): messages that came together are admitted together.
                try:
                    slots.acquire_nowait()
                except trio.WouldBlock:
                    await slots.acquire()
                # The message's reservation passes to its task, which gives its bytes back
                # through ``release_later`` (``held`` is left only if it never gets there).
                held = self.core.reserve(length, call.deadline, call.connection_id)
                reservation = None
                try:
                    reservation = await held.__aenter__()
                    data = await call.receive_message()
                except BaseException as error:
                    if reservation is not None:
                        await held.__aexit__(type(error), error, error.__traceback__)
                    slots.release()
                    if not isinstance(error, InferError):
                        raise
                    # Refused before it was read (the budget, its receive timeout): the stream
                    # ends with that status once the messages in flight are answered. Raised
                    # out of the nursery, it would reach the transport wrapped in a group.
                    refused = error
                    break
                assert data is not None, "an announced message arrives or the call fails"
                # Parsed here, in the order sent, so that a sequence's requests take their
                # turns in that order (the tasks started next run in any order).
                request: Any
                raw: Sequence[Buffer] = ()
                try:
                    request, raw = _parsed_infer(infer_route, data)
                except InferError as error:
                    request = error
                except Exception:
                    logger.exception("unexpected error parsing a message of %s", call.method)
                    request = InferError("internal server error", StatusCode.INTERNAL)
                del data
                turn = None if isinstance(request, InferError) else turns.take(request)
                messages.start_soon(
                    self._stream_message,
                    call,
                    reservation,
                    request,
                    raw,
                    headers,
                    turn,
                    sending,
                    slots,
                )
        call.trailing_metadata = tuple(sending.trailers.items())
        if sending.failure is not None:
            raise sending.failure
        if refused is not None:
            raise refused

    async def _stream_message(
        self,
        call: Call,
        reservation: Reservation,
        request: Any,
        raw: Sequence[Buffer],
        headers: Mapping[str, str],
        turn: _Turn | None,
        sending: _StreamSender,
        slots: trio.Semaphore,
    ) -> None:
        """One message of a stream, from its admission (``reservation``, whose bytes are the
        task's to give back) to its answer. ``request`` is the parsed
        request, or the InferError its parse failed with, and ``raw`` its raw inputs (see
        :func:`_parsed_infer`); ``headers``: the stream's metadata as models see it; ``turn``
        orders it among its sequence's."""
        try:
            try:
                if turn is None:
                    answer = await self._stream_answer(
                        call, request, raw, headers, reservation, sending
                    )
                else:
                    try:
                        answer = await self._turn_answer(
                            call, request, raw, headers, reservation, sending, turn
                        )
                    finally:
                        turn.answered()
                if answer is not None and not sending.claim(answer):
                    answer = _stream_error(_TRAILERS_FULL, request)
                    sending.claim(answer)
                del request, raw
                if answer is not None:
                    # The stream's only message in flight has no other answer to leave with:
                    # written at once when its connection has no other call.
                    alone = slots.value == _STREAM_IN_FLIGHT - 1
                    # Not contextlib.suppress: its object and two calls, on every message.
                    try:  # noqa: SIM105
                        await sending.send(answer.buffers, alone=alone)
                    except InferError:
                        pass  # the stream ends with it
            finally:
                # Sent or not, the answer's buffers may be queued: held until written. The
                # bytes leave the reservation's block with the release, which is all that
                # leaving the block would do (so it is not left: a coroutine per message).
                call.release_when_written(reservation.release_later())
                if turn is not None:
                    await turn.leave()
        finally:
            slots.release()
            if slots.value == _STREAM_IN_FLIGHT:
                call.idle = True

    async def _turn_answer(
        self,
        call: Call,
        request: Any,
        raw: Sequence[Buffer],
        headers: Mapping[str, str],
        reservation: Reservation,
        sending: _StreamSender,
        turn: _Turn,
    ) -> _Answer | None:
        """:meth:`_stream_answer` of a sequence's request, once the request before it has been
        answered: its own ``timeout`` bounds that wait too (its clock starts when it arrives)."""
        try:
            own = _own_deadline(request.parameters)
        except InferError as error:
            return _stream_error(error.message, request)
        if not await turn.wait(own):
            return _stream_error(TIMED_OUT, request)
        return await self._stream_answer(call, request, raw, headers, reservation, sending, own)

    async def _stream_answer(
        self,
        call: Call,
        request: Any,
        raw: Sequence[Buffer],
        headers: Mapping[str, str],
        reservation: Reservation,
        sending: _StreamSender,
        own: float | None = None,
    ) -> _Answer | None:
        """One stream message's answer: its ModelInferResponse, or its error; None when a
        decoupled model's responses were sent already (:meth:`_stream_each`). ``own``: its
        ``timeout`` parameter's deadline, when it was taken out already."""
        try:
            if isinstance(request, InferError):
                failure = request
                request = None
                raise failure
            context = RequestContext(call.deadline, headers, reservation)  # positional: cheaper
            if self.core.decoupled(request.model_name, request.model_version):
                await self._stream_each(call, request, raw, context, sending, own)
                return None
            parameters = request.parameters
            if own is None and not parameters:
                # No timeout of its own, as in _model_infer: no coroutine of _infer_in_time's.
                answer = await self._infer(request, raw, context, parameters)
            else:
                answer = await self._infer_in_time(request, raw, context, own)
            return _Answer(stream_response(answer.buffers), answer.headers, answer.trailers)
        except InferError as error:
            message = error.message
        except Exception:
            logger.exception("unexpected error in a message of %s", call.method)
            message = "internal server error"
        return _stream_error(message, request)

    async def _stream_each(
        self,
        call: Call,
        request: Any,
        raw: Sequence[Buffer],
        context: RequestContext,
        sending: _StreamSender,
        own: float | None = None,
    ) -> None:
        """A decoupled model's responses to one stream message, each sent as the model yields
        it, with the request's id and Triton's ``triton_final_response`` parameter.

        With ``triton_enable_empty_final_response`` each response goes at once, marked not
        final, and an empty one marked final follows the last. Without it (Triton's default)
        the last response itself is marked final, so each is held until the model yields the
        next or ends: it cannot be known to be the last before. A model that yields nothing
        then gets no response (as in Triton). An error is the message's ``error_message``, sent
        after the responses yielded before it.
        """
        parameters = request.parameters
        empty_final = _take_flag(parameters, _EMPTY_FINAL)
        if own is None:
            own = _own_deadline(parameters)
        context.deadline = min(context.deadline, own)
        held: InferenceResponse | None = None
        state = _Decoded(raw=True, nbytes=0, message_size=0)

        async def send(answer: InferenceResponse, final: bool) -> None:
            reservation = context.reservation
            encoded = _encoded_as_is(answer, state, reservation, final) or await self._encoded(
                answer, state, reservation, final
            )
            if not sending.claim(answer):
                raise InferError(_TRAILERS_FULL, StatusCode.INTERNAL)
            await sending.send(stream_response(encoded))

        async def respond(answer: InferenceResponse) -> None:
            nonlocal held
            if empty_final:
                await send(answer, False)
                return
            if held is not None:
                await send(held, False)
            held = answer

        with trio.move_on_at(own) as timed:
            decoded, state = await self._decoded(request, raw, context, parameters)
            try:
                await self.core.infer_each(decoded, context, respond)
            except InferError:
                if held is not None:
                    await send(held, False)
                raise
            if empty_final:
                await send(
                    InferenceResponse(
                        request.model_name, request.model_version, request.id, outputs=[]
                    ),
                    True,
                )
            elif held is not None:
                await send(held, True)
            return
        assert timed.cancelled_caught
        raise InferError(TIMED_OUT, StatusCode.DEADLINE_EXCEEDED)

    async def _infer_in_time(
        self,
        request: Any,
        raw: Sequence[Buffer],
        context: RequestContext,
        own: float | None = None,
    ) -> _Answer:
        """:meth:`_infer`, ended with DEADLINE_EXCEEDED at the request's own ``timeout``
        (its call's deadline is the call's cancel scope); ``own``, that deadline when it was
        taken out of the request already."""
        # The parameters map read once for the timeout, binary_data_output and the rest: most
        # requests have none, and then no function looks in it.
        parameters = request.parameters
        if own is None:
            own = _own_deadline(parameters) if parameters else math.inf
        if own == math.inf:
            # No timeout of its own: its call's scope bounds it, and a scope costs microseconds.
            return await self._infer(request, raw, context, parameters)
        context.deadline = min(context.deadline, own)
        with trio.move_on_at(own) as timed:
            return await self._infer(request, raw, context, parameters)
        assert timed.cancelled_caught
        raise InferError(TIMED_OUT, StatusCode.DEADLINE_EXCEEDED)

    async def _infer(
        self,
        request: Any,
        raw: Sequence[Buffer],
        context: RequestContext,
        parameters: MutableMapping[str, Any],
    ) -> _Answer:
        """Decode ``request`` (a WireInferRequest: a ModelInferRequest whose inputs' contents
        are still serialised, see trio_infer.protobuf.wire; ``raw``, its raw inputs, see
        :func:`_parsed_infer`; ``parameters``, its parameters map), run it through the core
        and encode its answer (a serialised ModelInferResponse, as buffers in order).

        The answer is encoded within the core's call: a refusal of it (its size over the memory
        budget, an output no datatype can carry) is then the status its statistics record.
        """
        # Most requests: no parameters, raw inputs of known layouts, decoded without the
        # coroutine of the others.
        known = None if parameters else _decoded_known(request, raw, context.reservation)
        decoded, state = known or await self._decoded(request, raw, context, parameters)
        return await self.core.infer(
            decoded, context, functools.partial(self._answer, state, context)
        )

    async def _answer(
        self, state: _Decoded, context: RequestContext, answer: InferenceResponse
    ) -> _Answer:
        """``answer`` encoded, with the metadata its model set."""
        # Most answers are encoded as they are, without the coroutine of the other encodings.
        reservation = context.reservation
        encoded = _encoded_as_is(answer, state, reservation) or await self._encoded(
            answer, state, reservation
        )
        return _Answer(encoded, answer.headers, answer.trailers)

    async def _decoded(
        self,
        request: Any,
        raw: Sequence[Buffer],
        context: RequestContext,
        parameters: MutableMapping[str, Any],
    ) -> tuple[InferenceRequest, _Decoded]:
        """The core's request from a WireInferRequest (``raw``, its raw inputs, see
        :func:`_parsed_infer`; ``parameters``, its parameters map), its decoded size reserved
        first."""
        reservation = context.reservation
        raw_output = _take_flag(parameters, _BINARY_OUTPUT, default=True) if parameters else True
        message_size = reservation.granted // RESERVED_PER_BYTE
        known = decode_known_raw(request, raw)
        if known is None:
            if raw and not request.raw_input_contents:
                # Split off its message: the stages read them from the request, as parsed whole.
                request.raw_input_contents.extend([bytes(entry) for entry in raw])
            tensors, inputs, nbytes = await self._decode_staged(request, reservation, message_size)
        else:
            # Views of the message's buffers: nothing beyond the message to reserve.
            tensors, inputs = known
            nbytes = 0
        values: dict[str, ParameterValue] = {}
        if parameters:  # most requests have none: no call for them
            values = decode_parameters(parameters)
            _sequence_id_as_uint64(values)
        return _inference_request(request, tensors, inputs, values), _Decoded(
            raw_output, nbytes, message_size
        )

    async def _decode_staged(
        self, request: Any, reservation: Reservation, message_size: int
    ) -> tuple[Sequence[Any], dict[str, np.ndarray], int]:
        """A WireInferRequest's inputs (as a list) and their arrays by name, and what the
        arrays take, reserved before they are made."""
        if message_size > _OFF_LOOP_PREPARE:
            prepared = await trio.to_thread.run_sync(
                prepare_inputs, request, limiter=self._decoding, abandon_on_cancel=False
            )
        else:
            prepared = prepare_inputs(request)
        decoded = decoding_cost(prepared, message_size)
        # The reservation holds one message's size for the decoded inputs; typed contents and
        # BYTES elements can take many times that in memory, reserved before they are made.
        extra = decoded.nbytes - message_size
        if extra > 0:
            reservation.grow_nowait(extra, "the decoded inputs")
        if decoded.elements > _OFF_LOOP_ELEMENTS:
            inputs = await trio.to_thread.run_sync(
                decode_inputs, prepared, limiter=self._decoding, abandon_on_cancel=False
            )
        else:
            inputs = decode_inputs(prepared)
        return prepared.tensors, inputs, decoded.nbytes

    async def _encoded(
        self,
        answer: InferenceResponse,
        state: _Decoded,
        reservation: Reservation,
        final: bool | None = None,
    ) -> list[Buffer]:
        """The serialised ModelInferResponse of ``answer`` (buffers in order), what encoding it
        takes reserved first; ``final``: its ``triton_final_response`` parameter (None: none).
        For an answer :func:`_encoded_as_is` does not take."""
        raw = state.raw
        response = _response_head(answer, final)
        # Arrays: a worker refuses a model's output that is not an ndarray.
        outputs = answer.outputs
        # Elements the encode converts or copies one way or another (raw numeric outputs in
        # little-endian C order are sent from their own memory): known without a pass.
        converted = 0
        for _, array in outputs:
            if not raw or array.dtype.kind in "OSU" or not array.flags.c_contiguous:
                converted += array.size
        if converted > _OFF_LOOP_ELEMENTS:

            def encode_off_loop() -> list[Buffer]:
                cost = encoding_cost(outputs, raw=raw)
                trio.from_thread.run_sync(_reserve_answer, reservation, state, cost)
                return encode_response(response, outputs, raw=raw, datatypes=cost.datatypes)

            # Costing (a pass over the arrays) and encoding both run off the loop; only the
            # reservation's growth comes back to it.
            return await trio.to_thread.run_sync(
                encode_off_loop, limiter=self._decoding, abandon_on_cancel=False
            )
        cost = encoding_cost(outputs, raw=raw)
        _reserve_answer(reservation, state, cost)
        # Raw outputs go to the socket from the arrays' memory, not through a serialised copy.
        return encode_response(response, outputs, raw=raw, datatypes=cost.datatypes)

    # -- the repository extension ---------------------------------------------------------------

    def _manager(self, call: Call, repository_name: str) -> ModelManager:
        """The model manager, once the call may use it.

        Raises:
            InferError: PERMISSION_DENIED without the control header's value; NOT_FOUND for
                another repository than the one served.
        """
        assert self._models is not None, "routed only when served"
        if self._control_header is not None:
            name, value = self._control_header
            sent = next((v for n, v in call.metadata if n == name), None)
            # Compared as UTF-8 bytes: compare_digest refuses str with non-ASCII characters,
            # which a client may send.
            if not isinstance(sent, str) or not hmac.compare_digest(sent.encode(), value.encode()):
                raise InferError(
                    f"the model repository extension is restricted: it needs header '{name}'",
                    StatusCode.PERMISSION_DENIED,
                )
        if repository_name and repository_name != self._models.repository.name:
            raise ModelNotFound(
                f"no repository '{shown(repository_name)}' is served here (the one served is "
                f"'{self._models.repository.name}')"
            )
        return self._models

    async def _index(
        self, request: pb.RepositoryIndexRequest, call: Call, reservation: Reservation
    ) -> Message:
        manager = self._manager(call, request.repository_name)
        return pb.RepositoryIndexResponse(
            models=[
                pb.RepositoryIndexResponse.ModelIndex(
                    name=entry.name, version=entry.version, state=entry.state, reason=entry.reason
                )
                for entry in await manager.index(ready_only=request.ready)
            ]
        )

    async def _load(
        self, request: pb.RepositoryModelLoadRequest, call: Call, reservation: Reservation
    ) -> Message:
        manager = self._manager(call, request.repository_name)
        call.subject = request.model_name
        config: dict[str, Any] | None = None
        for key, parameter in request.parameters.items():
            if key != "config":
                raise InvalidInput(
                    f"load parameter '{shown(key)}' is not served (only 'config': JSON fields "
                    "of model-settings.json that override the folder's)"
                )
            if parameter.WhichOneof("parameter_choice") != "string_param":
                raise InvalidInput("load parameter 'config' must be a string of JSON")
            config = config_override(parameter.string_param)
        await manager.load(request.model_name, config)
        return pb.RepositoryModelLoadResponse()

    async def _unload(
        self, request: pb.RepositoryModelUnloadRequest, call: Call, reservation: Reservation
    ) -> Message:
        manager = self._manager(call, request.repository_name)
        call.subject = request.model_name
        for key in request.parameters:
            if key != "unload_dependents":
                raise InvalidInput(f"unload parameter '{shown(key)}' is not served")
        await manager.unload(request.model_name)
        return pb.RepositoryModelUnloadResponse()

    def _health_check(self, request: health_pb2.HealthCheckRequest, call: Call) -> Message:
        ready = self.core.health(request.service)
        if ready is None:
            raise ModelNotFound(f"unknown service '{shown(request.service)}'")
        return health_pb2.HealthCheckResponse(status=_SERVING if ready else _NOT_SERVING)

    async def _health_watch(self, call: Call) -> None:
        """``grpc.health.v1.Health/Watch``: the service's status at once, then each change of
        it (a model loaded or lost, the drain); an unknown service is SERVICE_UNKNOWN until it
        is served. The drain's NOT_SERVING is the last: the call then ends UNAVAILABLE, so
        that watchers do not hold the grace period."""
        route = self._routes[_HEALTH + "Check"]
        length = await self._announced_length(call, route)
        async with self.core.reserve(length, call.deadline, call.connection_id):
            service = _request_of(route, await call.receive_message()).service
        sent: int | None = None
        while True:
            changes = self.core.health_changes
            ready = self.core.health(service)
            status = _UNKNOWN if ready is None else _SERVING if ready else _NOT_SERVING
            if status != sent:
                await call.send_message(
                    health_pb2.HealthCheckResponse(status=status).SerializeToString()
                )
                sent = status
            if self.core.draining:
                raise Unavailable("the server is shutting down")
            await self.core.wait_health_changed(changes)


class _Answer(NamedTuple):
    """An encoded response (buffers in order) and the metadata its model set."""

    buffers: list[Buffer]
    headers: Mapping[str, str] = _NO_METADATA
    trailers: Mapping[str, str] = _NO_METADATA


def _stream_error(message: str, request: Any) -> _Answer:
    """A stream message's answer when it failed: its ``error_message``, with the request's
    model and id when it was parsed."""
    failed = pb.ModelStreamInferResponse(error_message=message)
    if request is not None and not isinstance(request, InferError):
        failed.infer_response.model_name = request.model_name
        failed.infer_response.model_version = request.model_version
        failed.infer_response.id = request.id
    return _Answer([failed.SerializeToString()])


@dataclass(slots=True)
class _Decoded:
    """What encoding a request's answer needs to know of the request as it was decoded (made
    for every request: slotted, not frozen, as a frozen field's store is a call)."""

    raw: bool
    """Whether its outputs go back raw (``binary_data_output``, true by default)."""
    nbytes: int
    """What its decoded inputs take (held in the reservation)."""
    message_size: int
    """Its message's size (the reservation's unit)."""


def _decoded_known(
    request: Any, raw: Sequence[Buffer], reservation: Reservation
) -> tuple[InferenceRequest, _Decoded] | None:
    """The core's request from a WireInferRequest without parameters whose raw inputs are of
    layouts decoded before (:func:`~trio_infer.protobuf.codec.decode_known_raw`), as
    :meth:`GrpcService._decoded` makes it, without waiting; None for any other request, with
    nothing taken or made."""
    known = decode_known_raw(request, raw)
    if known is None:
        return None
    tensors, inputs = known
    # Views of the message's buffers: nothing beyond the message to reserve.
    return _inference_request(request, tensors, inputs, {}), _Decoded(
        True, 0, reservation.granted // RESERVED_PER_BYTE
    )


def _inference_request(
    request: Any,
    tensors: Sequence[Any],
    inputs: dict[str, np.ndarray],
    parameters: dict[str, ParameterValue],
) -> InferenceRequest:
    """The core's request of a WireInferRequest whose ``inputs`` (the arrays by name, of its
    ``tensors``, a list) are decoded, with its request-level ``parameters`` decoded."""
    # The arrays are views of their own copies of the raw buffers, or of the message's (split
    # off it): the request's entries are not needed any more, and a large request would
    # otherwise be held twice.
    request.ClearField("raw_input_contents")
    # The inputs' names are the arrays' keys, in the tensors' order (decode_inputs refuses a
    # name that repeats), and the tensors a list already: no second slice of the repeated
    # field, nor a second read of each name. Indexed, not zipped: zip's strict= is a
    # keyword, which costs a call a dict. Most inputs have no parameters: no call for them.
    input_parameters: dict[str, dict[str, ParameterValue]] = {}
    for index, name in enumerate(inputs):
        given = tensors[index].parameters
        input_parameters[name] = decode_parameters(given) if given else {}
    return InferenceRequest(
        request.model_name,
        request.model_version,
        request.id,
        inputs,
        parameters,
        input_parameters,
        [output.name for output in request.outputs[:]],  # outputs
    )


def _reserve_answer(reservation: Reservation, state: _Decoded, cost: EncodingCost) -> None:
    """Grow ``reservation`` to hold the answer to the request ``state`` describes, as encoding
    it will ``cost``."""
    # What the reservation holds for the answer: all of it but the message and the decoded
    # inputs (both still held). The output arrays and what encoding them allocates must fit in
    # that or be added; the bytes stay reserved until the answer's buffers are written
    # (handle's release_when_sent).
    message_size = state.message_size
    # The larger of the two, compared here: max() parses its arguments, on every call's path.
    inputs = state.nbytes if state.nbytes > message_size else message_size
    share = reservation.nbytes - message_size - inputs
    extra = cost.outputs + cost.nbytes - share
    if extra > 0:
        reservation.grow_nowait(extra, "the encoded outputs")


def _response_head(answer: InferenceResponse, final: bool | None) -> Any:
    """The ModelInferResponse of ``answer`` without its outputs; ``final``: its
    ``triton_final_response`` parameter (None: none)."""
    response = pb.ModelInferResponse(
        model_name=answer.model_name, model_version=answer.model_version, id=answer.id
    )
    if final is not None:
        response.parameters[_FINAL].bool_param = final
    return response


def _encoded_as_is(
    answer: InferenceResponse,
    state: _Decoded,
    reservation: Reservation,
    final: bool | None = None,
) -> list[Buffer] | None:
    """The serialised ModelInferResponse of ``answer`` (buffers in order), its cost reserved
    first, when its outputs go raw from their own memory (costed, reserved and joined in one
    pass, see :func:`encode_raw_as_is`); None, with nothing reserved, for any other answer
    (:meth:`GrpcService._encoded`'s). ``final``: its ``triton_final_response`` parameter."""
    if not state.raw:
        return None
    return encode_raw_as_is(
        _response_head(answer, final),
        answer.outputs,
        functools.partial(_reserve_answer, reservation, state),
    )


def _model_headers(call: Call) -> dict[str, str]:
    """The call's metadata as its model sees it: the text entries, but the request id, which
    is the server's (logged and echoed), differs call to call, and would keep every call out of
    its neighbours' batches (a batch's members share their headers)."""
    if not call.metadata:  # most calls: no comprehension for them
        return {}
    return {
        name: value
        for name, value in call.metadata
        if isinstance(value, str) and name != REQUEST_ID_HEADER
    }


def _take_flag(parameters: MutableMapping[str, Any], name: str, default: bool = False) -> bool:
    """A bool request parameter's value (``default`` when absent), taken out of ``parameters``
    (a request's map: those the model sees).

    Raises:
        InvalidInput: The parameter is not a bool.
    """
    if name not in parameters:
        return default
    parameter = parameters[name]
    if parameter.WhichOneof("parameter_choice") != "bool_param":
        raise InvalidInput(f"parameter '{name}' must be a bool")
    value = bool(parameter.bool_param)
    del parameters[name]
    return value


class _Turn:
    """One request's place among its sequence's on a stream: it runs once the request before
    it has been answered (or fails when its own ``timeout`` passes first), and the next one
    runs once it has been answered."""

    def __init__(self, before: trio.Event | None, done: trio.Event) -> None:
        self._before = before
        self._done = done

    async def wait(self, deadline: float) -> bool:
        """Wait until the request before it has been answered, or ``deadline``: whether it
        was."""
        if self._before is None or self._before.is_set():
            return True
        with trio.move_on_at(deadline):
            await self._before.wait()
        return self._before.is_set()

    def answered(self) -> None:
        """It has been answered: the next request may go, unless this one gave up waiting
        (its timeout) before the one ahead of it was answered (see :meth:`leave`)."""
        if self._before is None or self._before.is_set():
            self._done.set()

    async def leave(self) -> None:
        """Its answer has been sent: the next request may go once the one ahead of this one
        has been answered too, or they could reach the worker out of order."""
        try:
            if not self._done.is_set() and self._before is not None:
                await self._before.wait()
        finally:
            self._done.set()


class _SequenceTurns:
    """A stream's sequences (requests with Triton's ``sequence_id``): each request of one waits
    for the one sent before it to be answered, so they reach its worker in the order sent (the
    stream's tasks run in any order). Other requests take no turn."""

    def __init__(self) -> None:
        #: The last request of each sequence, by (model, version, id): its end.
        self._last: dict[tuple[str, str, object], trio.Event] = {}

    def take(self, request: Any) -> _Turn | None:
        """``request``'s turn, taken now; None when it is no sequence's."""
        parameters = request.parameters
        if "sequence_id" not in parameters:
            return None
        parameter = parameters["sequence_id"]
        value = getattr(parameter, parameter.WhichOneof("parameter_choice") or "int64_param")
        if not value:
            return None
        key = (request.model_name, request.model_version, _as_uint64(value))
        done = trio.Event()
        before = self._last.get(key)
        self._last[key] = done
        if before is not None and before.is_set():
            before = None
        # Keep the table to the sequences with requests in flight.
        for stale in [k for k, event in self._last.items() if event.is_set()]:
            del self._last[stale]
        return _Turn(before, done)


def _size_of(metadata: Mapping[str, str], name: str) -> int:
    """The bytes ``name`` and its value take in ``metadata`` (0 when absent)."""
    value = metadata.get(name)
    return 0 if value is None else len(name) + len(value)


class _StreamSender:
    """Sends a stream's answers one at a time, each whole, and gathers the metadata their models
    set. The first send that fails (a client that reads none of its answers for the send
    timeout, or reset the stream) fails the stream: the messages in flight are cancelled, later
    sends raise the same error at once (nothing more may follow half a message), and the stream
    ends with it.

    The headers of the answer sent first are the stream's initial metadata (sent with it); the
    headers of later answers, which can no longer be sent as such, and the trailers of all are
    gathered into :attr:`trailers`, the last value of a name winning, at most
    ``MAX_RESPONSE_METADATA`` bytes in all."""

    def __init__(self, call: Call) -> None:
        self._call = call
        #: A send is under way: later ones wait in ``_waiting``, first come, first served,
        #: and each is handed the turn by the one before (it stays set until none waits).
        self._busy = False
        self._waiting = trio.lowlevel.ParkingLot()
        self._first = True
        self._trailers_size = 0
        self.trailers: dict[str, str] = {}
        """The stream's trailing metadata, as gathered so far."""
        self.failure: InferError | None = None
        #: The scope of the stream's messages, cancelled by a failed send.
        self.scope = trio.CancelScope()

    def claim(self, answer: _Answer | InferenceResponse) -> bool:
        """Take the metadata of an answer about to be sent (the next :meth:`send` of this task,
        with no checkpoint between: sends keep the order of claims). False, and nothing taken,
        when its metadata would take the trailers past the bound."""
        headers, trailers = answer.headers, answer.trailers
        if not headers and not trailers:
            if self._first:
                self._first = False
            return True
        late = {} if self._first else dict(headers)
        late.update(trailers)
        # The size once gathered: a name already there is counted at its new value (a longer
        # value for the same name must not slip past the bound).
        size = self._trailers_size + sum(
            len(name) + len(value) - _size_of(self.trailers, name) for name, value in late.items()
        )
        if size > MAX_RESPONSE_METADATA:
            return False
        if self._first:
            self._call.initial_metadata = tuple(headers.items())
            self._first = False
        self.trailers.update(late)
        self._trailers_size = size
        return True

    async def send(self, message: list[Buffer], *, alone: bool = False) -> None:
        """Send ``message`` after those before it; ``alone``: as :meth:`Call.send_message`
        takes it.

        Raises:
            InferError: this send, or an earlier one, failed.
        """
        if self.failure is not None:
            raise self.failure
        # Without a pass of the scheduler when nothing else is sending: answers finished
        # together leave together. Not a trio.Lock, whose owner bookkeeping (its parking-lot
        # breaker) is work on every message: only this class takes these turns.
        if self._busy:
            await self._waiting.park()  # unparked with the turn; a cancelled wait has none
        else:
            self._busy = True
        try:
            if self.failure is not None:
                raise self.failure
            await self._call.send_message(message, alone=alone)
        except InferError as error:
            if self.failure is None:
                self.failure = error
                self.scope.cancel()
            raise
        finally:
            if self._waiting:
                self._waiting.unpark()
            else:
                self._busy = False


def _check_length(call: Call, route: _Route, length: int) -> None:
    """Refuse a request message of ``length`` bytes larger than ``route`` takes.

    Raises:
        Overloaded: It is.
    """
    if route.max_message is not None and length > route.max_message:
        raise Overloaded(
            f"request message of {length} bytes is larger than the maximum of "
            f"{route.max_message} bytes for {call.method}"
        )


def _request_of(route: _Route, data: Buffer | None) -> Any:
    """``route``'s request parsed from ``data``, the call's announced request message, which
    :meth:`Call.receive_message` returned (its room reserved first).

    Raises:
        InvalidInput: The message is not a valid one.
    """
    assert data is not None, "an announced message arrives or the call fails"
    return _parsed_infer(route, data) if route.splits_raw else _parsed(route, data)


def _parsed_infer(route: _Route, data: Buffer) -> tuple[Any, Sequence[Buffer]]:
    """A ModelInfer request parsed from ``data`` as :func:`_parsed` parses it, and its raw
    inputs: the request's ``raw_input_contents``, or, for a large message whose raw inputs are
    its last records (:func:`~trio_infer.protobuf.wire.raw_input_suffix`, as clients write
    them), read-only slices of ``data`` and the request parsed from the records before them,
    holding none: the arrays made of them view the message, not two copies of it.

    Raises:
        InvalidInput: ``data`` is not that message, or has too many fields.
    """
    if len(data) >= _SPLIT_MESSAGE:
        split = raw_input_suffix(memoryview(data).toreadonly())
        if split is not None:
            start, raw = split
            return _parsed(route, data, data[:start]), raw
    request = _parsed(route, data)
    return request, request.raw_input_contents


def _parsed(route: _Route, data: Buffer, head: Buffer | None = None) -> Any:
    """``route``'s request message parsed from ``data`` (from its first records ``head``,
    when given), the fields of ``data`` counted first when the route says so.

    Raises:
        InvalidInput: ``data`` is not that message, or has too many fields.
    """
    if (
        route.fields is not None
        and len(data) > _MAX_SMALL_MESSAGE
        and count_fields(data, route.fields, MAX_REQUEST_FIELDS) > MAX_REQUEST_FIELDS
    ):
        raise InvalidInput(
            f"the request has more than {MAX_REQUEST_FIELDS} fields outside its tensors' contents"
        )
    try:
        # The stubs say bytes; protobuf parses any bytes-like object.
        parsed = data if head is None else head
        return route.request_type.FromString(parsed)  # type: ignore[arg-type]
    except DecodeError:
        # protobuf's message says no more than which type, under the view's name.
        raise InvalidInput(f"the request is not a valid {route.message_name}") from None


def _sequence_id_as_uint64(parameters: dict[str, ParameterValue]) -> None:
    """Read a request's integer ``sequence_id`` as the uint64 it stands for.

    Triton's integer sequence ids are uint64, and int64_param carries them: Triton's C++ client
    (and perf_analyzer) sends an id of 2**63 or more there as the negative int64 of the same
    bits, and Triton's server reads it back as that uint64. So a negative int64_param is that
    id here too, the same sequence as a uint64_param or a REST number of that value; only a
    REST number (which Triton reads as uint64) can be a negative id, and is refused.
    """
    sequence_id = parameters.get("sequence_id")
    if type(sequence_id) is int:
        parameters["sequence_id"] = _as_uint64(sequence_id)


def _as_uint64(sequence_id: ParameterValue) -> ParameterValue:
    """An integer sequence id as the uint64 of its bits (a negative int64_param's), any other
    id unchanged: :func:`_sequence_id_as_uint64`, for the request and its stream's turns."""
    if type(sequence_id) is int and sequence_id < 0:
        return sequence_id + _UINT64
    return sequence_id


def _own_deadline(parameters: MutableMapping[str, Any]) -> float:
    """:func:`~trio_infer.core.timeouts.take_timeout` for a request still in protobuf (its
    ``parameters`` map): read before its tensors are decoded, so that its deadline bounds the
    decoding too.

    Raises:
        InvalidInput: ``timeout`` is not an int64 of microseconds, at least 0.
    """
    if "timeout" not in parameters:
        return math.inf
    parameter = parameters["timeout"]
    kind = parameter.WhichOneof("parameter_choice")
    # Any other kind is refused by take_timeout, as a REST request's would be.
    value: ParameterValue = parameter.int64_param if kind == "int64_param" else "not an int64"
    del parameters["timeout"]
    return take_timeout({"timeout": value})


def _tensor_metadata(spec: TensorSpec) -> pb.ModelMetadataResponse.TensorMetadata:
    return pb.ModelMetadataResponse.TensorMetadata(
        name=spec.name, datatype=spec.datatype, shape=spec.shape
    )
