"""The gRPC front-end's side of the core's contract: the metadata of the core's answer reaches
the client as gRPC metadata (a real transport on a loopback port, real worker processes, a
grpcio client), and a request decoded in one pass is the one the service's stages decode."""

from __future__ import annotations

import itertools
import math
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import trio

from tests.support import GrpcioClient
from trio_infer.core.service import RESERVED_PER_BYTE, InferenceCore
from trio_infer.core.types import InferenceRequest, InferenceResponse, RequestContext
from trio_infer.errors import InvalidInput
from trio_infer.frontends.grpc_service import GrpcService, _decoded_known
from trio_infer.protobuf._proto import grpc_predict_v2_pb2 as pb
from trio_infer.protobuf.codec import decode_outputs, encode_inputs
from trio_infer.protobuf.wire import WireInferRequest
from trio_infer.repository.registry import ModelRegistry
from trio_infer.repository.settings import EXAMPLES, load_repository
from trio_infer.scheduling.admission import Admission, Reservation
from trio_infer.transport.grpc_server import GrpcServer
from trio_infer.workers.pool import WorkerPool


class TaggingCore(InferenceCore):
    """The real core, which also answers with the request's id in a header and a trailer."""

    async def infer(  # type: ignore[override]
        self,
        request: InferenceRequest,
        context: RequestContext,
        encode: Callable[[InferenceResponse], Awaitable[Any]] | None = None,
    ) -> Any:
        async def tagged(response: InferenceResponse) -> Any:
            response.headers = {"x-call": request.id}
            response.trailers = {"x-served-by": response.model_name}
            return response if encode is None else await encode(response)

        return await super().infer(request, context, tagged)


async def test_response_headers_and_trailers_from_the_core_reach_the_client(
    nursery: trio.Nursery,
) -> None:
    registry = ModelRegistry(load_repository(EXAMPLES))
    async with WorkerPool.open(1) as pool:
        echo = registry.lookup("echo")
        await pool.warm_up([echo])
        registry.set_ready("echo", True)
        core = TaggingCore(registry, pool, Admission(64 * 1024 * 1024))
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        await nursery.start(GrpcServer(GrpcService(core).handle).serve, listeners)
        client = GrpcioClient(listeners[0].socket.getsockname()[1])

        request = pb.ModelInferRequest(model_name="echo", id="call-7")
        x = np.arange(6, dtype=np.int32).reshape(2, 3)
        encode_inputs(request, [("x", x)], raw=True)
        response, call = await client.call_with_metadata("ModelInfer", request, timeout=10)

        np.testing.assert_array_equal(decode_outputs(response)["x"], x)
        assert ("x-call", "call-7") in call.initial_metadata()
        assert ("x-served-by", "echo") in call.trailing_metadata()
        nursery.cancel_scope.cancel()


def _decodable_requests() -> list[pb.ModelInferRequest]:
    """Raw requests in every way that matters to the one-pass decoding: layouts of each kind,
    sizes right and wrong, a name twice, entries missing or extra, typed contents beside the
    raw ones, parameters on an input, outputs asked for."""
    layouts = [
        ("FP32", [2, 3], 24),
        ("INT64", [4], 32),
        ("UINT8", [1, 5], 5),
        ("FP16", [3], 6),
        ("INT32", [0, 2], 0),
    ]
    requests = []
    for (a_type, a_shape, a_size), (b_type, b_shape, b_size) in itertools.product(
        layouts, repeat=2
    ):
        for a_bytes, b_bytes, b_name in itertools.product(
            (a_size, a_size + 4), (b_size, b_size - 2), ("b", "a")
        ):
            request = pb.ModelInferRequest(model_name="m", model_version="2", id="r")
            for name, datatype, shape, size in (
                ("a", a_type, a_shape, a_bytes),
                (b_name, b_type, b_shape, b_bytes),
            ):
                tensor = request.inputs.add(name=name, datatype=datatype)
                tensor.shape.extend(shape)
                request.raw_input_contents.append(bytes(i % 256 for i in range(max(size, 0))))
            requests.append(request)
    one = pb.ModelInferRequest(model_name="m", id="one")
    one.inputs.add(name="x", datatype="FP32", shape=[2]).parameters["unit"].string_param = "cm"
    one.raw_input_contents.append(bytes(8))
    one.outputs.add(name="y")
    one.outputs.add(name="z")
    missing = pb.ModelInferRequest(model_name="m")
    missing.inputs.add(name="x", datatype="FP32", shape=[2])
    missing.inputs.add(name="w", datatype="FP32", shape=[2])
    missing.raw_input_contents.append(bytes(8))
    extra = pb.ModelInferRequest(model_name="m")
    extra.inputs.add(name="x", datatype="FP32", shape=[2])
    extra.raw_input_contents.extend([bytes(8), bytes(8)])
    typed_beside = pb.ModelInferRequest(model_name="m")
    typed_beside.inputs.add(name="x", datatype="FP32", shape=[2]).contents.fp32_contents.append(1)
    typed_beside.raw_input_contents.append(bytes(8))
    typed = pb.ModelInferRequest(model_name="m")
    typed.inputs.add(name="x", datatype="FP32", shape=[2]).contents.fp32_contents.extend([1, 2])
    return [*requests, one, missing, extra, typed_beside, typed]


def _same_decoding(
    fast: tuple[InferenceRequest, Any], staged: tuple[InferenceRequest, Any], what: str
) -> None:
    (request, state), (expected, expected_state) = fast, staged
    assert state == expected_state, what
    assert (request.model_name, request.model_version, request.id) == (
        expected.model_name,
        expected.model_version,
        expected.id,
    ), what
    assert (request.parameters, request.input_parameters, request.outputs) == (
        expected.parameters,
        expected.input_parameters,
        expected.outputs,
    ), what
    assert list(request.inputs) == list(expected.inputs), what
    for name, array in request.inputs.items():
        other = expected.inputs[name]
        assert (array.dtype, array.shape, array.flags.writeable) == (
            other.dtype,
            other.shape,
            other.flags.writeable,
        ), what
        np.testing.assert_array_equal(array, other, err_msg=what)


async def test_a_request_decoded_without_waiting_is_the_one_the_service_decodes() -> None:
    # _decoded_known short-cuts GrpcService._decoded for a request without parameters: for
    # every request it gives the same request and state, or nothing (then _decoded refuses
    # the request in its own words, or decodes it in its stages).
    registry = ModelRegistry(load_repository(EXAMPLES))
    admission = Admission(64 * 1024 * 1024)
    async with WorkerPool.open(1) as pool:
        service = GrpcService(InferenceCore(registry, pool, admission))

        def parsed(request: pb.ModelInferRequest) -> tuple[Any, RequestContext]:
            wire = WireInferRequest.FromString(request.SerializeToString())
            reservation = Reservation(admission, RESERVED_PER_BYTE * request.ByteSize())
            return wire, RequestContext(math.inf, {}, reservation)

        taken = 0
        for request in _decodable_requests():
            what = str(request)
            wire, context = parsed(request)
            before = _decoded_known(wire, wire.raw_input_contents, context.reservation)
            wire, context = parsed(request)
            try:
                staged = await service._decoded(wire, wire.raw_input_contents, context, {})
            except InvalidInput:
                staged = None
            # Once decoded by the stages, the request's layouts are known.
            wire, context = parsed(request)
            after = _decoded_known(wire, wire.raw_input_contents, context.reservation)
            for fast in (before, after):
                if fast is not None:
                    assert staged is not None, what
                    _same_decoding(fast, staged, what)
                    assert not wire.raw_input_contents, what
            taken += after is not None
        # The one-pass decoding did take the requests of layouts that fit.
        assert taken >= 25
