"""The gRPC front-end's side of the core's contract: the metadata of the core's answer reaches
the client as gRPC metadata. A real transport on a loopback port, real worker processes,
a grpcio client."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import trio

from tests.support import GrpcioClient
from trio_infer.core.service import InferenceCore
from trio_infer.core.types import InferenceRequest, InferenceResponse, RequestContext
from trio_infer.frontends.grpc_service import GrpcService
from trio_infer.protobuf._proto import grpc_predict_v2_pb2 as pb
from trio_infer.protobuf.codec import decode_outputs, encode_inputs
from trio_infer.repository.registry import ModelRegistry
from trio_infer.repository.settings import EXAMPLES, load_repository
from trio_infer.scheduling.admission import Admission
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
