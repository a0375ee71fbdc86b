"""The gRPC front-end: ``inference.GRPCInferenceService`` and ``grpc.health.v1.Health``.

The transport hands over a :class:`~trio_infer.transport.grpc_server.Call` of bytes; this module
routes it by method, reserves room for it in the memory budget from its announced size before its
body is read, parses it, builds the core's request and context, and encodes the core's answer
back into protobuf. What a call means is the core's (:mod:`trio_infer.core.service`); what the
bytes are is this module's.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import DecodeError, Message

from trio_infer.buffers import Buffer
from trio_infer.core.service import InferenceCore
from trio_infer.core.types import InferenceRequest, RequestContext, Reservation, TensorSpec
from trio_infer.errors import InvalidInput, ModelNotFound, Unimplemented
from trio_infer.protobuf._proto import grpc_predict_v2_pb2 as pb
from trio_infer.protobuf._proto import health_pb2
from trio_infer.protobuf.codec import (
    decode_inputs,
    decode_parameters,
    encode_outputs,
    serialize_response,
)
from trio_infer.transport.grpc_server import Call

__all__ = ["GrpcService"]

_V2 = "/inference.GRPCInferenceService/"
_HEALTH = "/grpc.health.v1.Health/"
_SERVING = health_pb2.HealthCheckResponse.ServingStatus.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.ServingStatus.NOT_SERVING


@dataclass(frozen=True)
class _Route:
    request_type: type[Message]
    #: A handler returns its response, or (ModelInfer) the buffers of one already serialised.
    handler: Callable[[Any, Call, Reservation], Awaitable[Message | list[Buffer]]]


class GrpcService:
    """The transport's handler for every gRPC method: adapts a :class:`Call` to the core.

    Args:
        core: The V2 core every front-end calls.
    """

    def __init__(self, core: InferenceCore) -> None:
        self.core = core
        self._routes: dict[str, _Route] = {
            _V2 + "ServerLive": _Route(pb.ServerLiveRequest, self._server_live),
            _V2 + "ServerReady": _Route(pb.ServerReadyRequest, self._server_ready),
            _V2 + "ModelReady": _Route(pb.ModelReadyRequest, self._model_ready),
            _V2 + "ServerMetadata": _Route(pb.ServerMetadataRequest, self._server_metadata),
            _V2 + "ModelMetadata": _Route(pb.ModelMetadataRequest, self._model_metadata),
            _V2 + "ModelInfer": _Route(pb.ModelInferRequest, self._model_infer),
            _HEALTH + "Check": _Route(health_pb2.HealthCheckRequest, self._health_check),
        }

    async def handle(self, call: Call) -> None:
        """Serve one unary call."""
        route = self._routes.get(call.method)
        if route is None:
            raise Unimplemented(f"method {call.method} is not served here")
        length = await call.receive_message_length()
        if length is None:
            raise InvalidInput(f"{call.method} expects one request message and got none")
        async with self.core.reserve(length, call.deadline) as reservation:
            data = await call.receive_message()
            assert data is not None, "an announced message arrives or the call fails"
            try:
                # The stubs say bytes; protobuf parses any bytes-like object.
                request = route.request_type.FromString(data)  # type: ignore[arg-type]
            except DecodeError as exc:
                name = route.request_type.DESCRIPTOR.full_name
                raise InvalidInput(f"the request is not a valid {name}: {exc}") from None
            del data  # the parsed request holds its own copy; drop this one early
            response = await route.handler(request, call, reservation)
            # A unary call is one message. One more that arrived by now fails the call; the
            # end of the request is not waited for (a client may half-close late, or never).
            if call.another_message_nowait():
                raise InvalidInput(
                    f"{call.method} takes one request message and the client sent more"
                )
            await call.send_message(
                response.SerializeToString() if isinstance(response, Message) else response,
                last=True,
            )

    async def _server_live(
        self, request: pb.ServerLiveRequest, call: Call, reservation: Reservation
    ) -> Message:
        return pb.ServerLiveResponse(live=self.core.server_live())

    async def _server_ready(
        self, request: pb.ServerReadyRequest, call: Call, reservation: Reservation
    ) -> Message:
        return pb.ServerReadyResponse(ready=self.core.server_ready())

    async def _model_ready(
        self, request: pb.ModelReadyRequest, call: Call, reservation: Reservation
    ) -> Message:
        return pb.ModelReadyResponse(ready=self.core.model_ready(request.name, request.version))

    async def _server_metadata(
        self, request: pb.ServerMetadataRequest, call: Call, reservation: Reservation
    ) -> Message:
        metadata = self.core.server_metadata()
        return pb.ServerMetadataResponse(
            name=metadata.name, version=metadata.version, extensions=list(metadata.extensions)
        )

    async def _model_metadata(
        self, request: pb.ModelMetadataRequest, call: Call, reservation: Reservation
    ) -> Message:
        metadata = self.core.model_metadata(request.name, request.version)
        return pb.ModelMetadataResponse(
            name=metadata.name,
            versions=list(metadata.versions),
            platform=metadata.platform,
            inputs=[_tensor_metadata(spec) for spec in metadata.inputs],
            outputs=[_tensor_metadata(spec) for spec in metadata.outputs],
        )

    async def _model_infer(
        self, request: pb.ModelInferRequest, call: Call, reservation: Reservation
    ) -> list[Buffer]:
        raw = len(request.raw_input_contents) > 0
        inputs = decode_inputs(request)
        # The arrays are views of their own copies of the raw buffers: the request's are not
        # needed any more, and a large request would otherwise be held twice.
        request.ClearField("raw_input_contents")
        context = RequestContext(
            deadline=call.deadline,
            headers={name: value for name, value in call.metadata if isinstance(value, str)},
            reservation=reservation,
        )
        answer = await self.core.infer(
            InferenceRequest(
                model_name=request.model_name,
                model_version=request.model_version,
                id=request.id,
                inputs=inputs,
                parameters=decode_parameters(request.parameters),
                input_parameters={
                    tensor.name: decode_parameters(tensor.parameters) for tensor in request.inputs
                },
                outputs=[output.name for output in request.outputs],
            ),
            context,
        )
        call.initial_metadata = tuple(context.response_headers)
        call.trailing_metadata = tuple(context.response_trailers)
        response = pb.ModelInferResponse(
            model_name=answer.model_name, model_version=answer.model_version, id=answer.id
        )
        # Raw outputs go to the socket from the arrays' memory, not through a serialised copy.
        return serialize_response(response, encode_outputs(response, answer.outputs, raw=raw))

    async def _health_check(
        self, request: health_pb2.HealthCheckRequest, call: Call, reservation: Reservation
    ) -> Message:
        if request.service in ("", "inference.GRPCInferenceService"):
            ready = self.core.server_ready()
        else:
            try:
                ready = self.core.model_ready(request.service)
            except ModelNotFound:
                raise ModelNotFound(f"unknown service '{request.service}'") from None
        return health_pb2.HealthCheckResponse(status=_SERVING if ready else _NOT_SERVING)


def _tensor_metadata(spec: TensorSpec) -> pb.ModelMetadataResponse.TensorMetadata:
    return pb.ModelMetadataResponse.TensorMetadata(
        name=spec.name, datatype=spec.datatype, shape=spec.shape
    )
