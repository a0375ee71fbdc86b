"""A bare grpc.aio server answering ServerLive and ServerReady: the transport's own ceiling.

Usage: ``python -m bench.peers.grpcio_server PORT`` (runs in the benchmark's interpreter, which
has grpcio). It uses trio-infer's generated stubs, so the messages are byte for byte the same.
"""

from __future__ import annotations

import asyncio
import signal
import sys

import grpc

from trio_infer.protobuf._proto import grpc_predict_v2_pb2 as pb
from trio_infer.protobuf._proto import grpc_predict_v2_pb2_grpc as pb_grpc


class LiveOnly(pb_grpc.GRPCInferenceServiceServicer):
    """Answers the two health calls; every other method is UNIMPLEMENTED."""

    async def ServerLive(
        self, request: pb.ServerLiveRequest, context: grpc.aio.ServicerContext
    ) -> pb.ServerLiveResponse:
        """Always live."""
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(
        self, request: pb.ServerReadyRequest, context: grpc.aio.ServicerContext
    ) -> pb.ServerReadyResponse:
        """Always ready."""
        return pb.ServerReadyResponse(ready=True)


async def serve(port: int) -> None:
    """Serve on 127.0.0.1:PORT until SIGINT or SIGTERM."""
    server = grpc.aio.server()
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(LiveOnly(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    await server.stop(grace=1.0)


if __name__ == "__main__":
    asyncio.run(serve(int(sys.argv[1])))
