"""Bare transports, the ceilings: a grpc.aio server answering ServerLive and ServerReady, and an
HTTP/1.1 listener answering the REST client's requests with responses made in advance.

Usage: ``python -m bench.peers.grpcio_server GRPC_PORT HTTP_PORT`` (runs in the benchmark's
interpreter, which has grpcio). It uses trio-infer's generated stubs, so the messages are byte
for byte the same. The HTTP side works out nothing per request: ``GET`` gets 200 with an empty
body, and ``POST /v2/models/dense/infer`` gets ``tanh(x @ W)`` of the benchmark's own input for
the rows in the request's ``"shape":[N,`` (``bench.client.dense_input``), in JSON or in Triton's
binary extension as the request is. It runs in a process of its own on uvloop: on asyncio's own
loop beside grpc.aio it answered fewer calls/s than Triton's HTTP server (23,000 against 29,000
on ``rest-live-c25``), so it, not the client, was the ceiling. Its rows are the REST client's.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import re
import signal
import sys
from typing import cast

import grpc
import numpy as np
import orjson
import uvloop

from bench import client
from trio_infer.protobuf._proto import grpc_predict_v2_pb2 as pb
from trio_infer.protobuf._proto import grpc_predict_v2_pb2_grpc as pb_grpc

#: The rows a REST ``dense`` scenario sends (``rest-dense-n1-*``, ``rest-dense-n64-*``).
REST_ROWS = (1, 64)
#: Where a REST request's rows are found: the client writes ``shape`` before ``data``.
SHAPE = re.compile(rb'"shape":\[(\d+),')


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


def _http_response(body: bytes, headers: dict[str, str]) -> bytes:
    head = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
    return f"HTTP/1.1 200 OK\r\n{head}content-length: {len(body)}\r\n\r\n".encode() + body


def canned_dense() -> dict[tuple[int, bool], bytes]:
    """The whole ``dense`` response for each (rows, binary) a REST scenario sends."""
    responses = {}
    for rows in REST_ROWS:
        y = np.tanh(client.dense_input(rows) @ client.WEIGHTS).astype("<f4")
        output = {"name": "y", "datatype": "FP32", "shape": list(y.shape)}
        json_output = {**output, "data": y.ravel()}
        body = orjson.dumps(
            {"model_name": "dense", "outputs": [json_output]}, option=orjson.OPT_SERIALIZE_NUMPY
        )
        responses[rows, False] = _http_response(body, {"content-type": "application/json"})
        binary_output = {**output, "parameters": {"binary_data_size": y.nbytes}}
        header = orjson.dumps({"model_name": "dense", "outputs": [binary_output]})
        responses[rows, True] = _http_response(
            header + y.tobytes(),
            {
                "content-type": "application/octet-stream",
                client.JSON_LENGTH_HEADER.lower(): str(len(header)),
            },
        )
    return responses


class CannedHttp(asyncio.Protocol):
    """One HTTP/1.1 connection: each request, once its Content-Length body is in, gets its
    response made in advance (a request it has none for gets 404)."""

    LIVE = _http_response(b"", {})
    NOT_FOUND = b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n"

    def __init__(self, dense: dict[tuple[int, bool], bytes]) -> None:
        self.dense = dense
        self.buffer = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Keep the transport to answer on."""
        # uvloop's transports have the methods but are not asyncio.Transport subclasses.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        """Answer every whole request in the buffer."""
        assert self.transport is not None
        self.buffer += data
        while (end := self.buffer.find(b"\r\n\r\n")) >= 0:
            head = bytes(self.buffer[:end]).lower()
            length = re.search(rb"\r\ncontent-length: *(\d+)", head)
            size = end + 4 + (int(length[1]) if length else 0)
            if len(self.buffer) < size:
                return
            body = bytes(self.buffer[end + 4 : size])
            del self.buffer[:size]
            if head.startswith(b"get "):
                self.transport.write(self.LIVE)
                continue
            rows = SHAPE.search(body[:256])
            binary = client.JSON_LENGTH_HEADER.lower().encode() in head
            answer = self.dense.get((int(rows[1]), binary)) if rows else None
            self.transport.write(answer or self.NOT_FOUND)


async def serve_http(port: int) -> None:
    """Answer HTTP/1.1 on 127.0.0.1:PORT until the process is stopped."""
    dense = canned_dense()
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: CannedHttp(dense), "127.0.0.1", port)
    async with server:
        await server.serve_forever()


def run_http(port: int) -> None:
    """The HTTP side's process: :func:`serve_http` on uvloop."""
    uvloop.run(serve_http(port))


async def serve(grpc_port: int) -> None:
    """Serve gRPC on 127.0.0.1 until SIGINT or SIGTERM."""
    server = grpc.aio.server()
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(LiveOnly(), server)
    server.add_insecure_port(f"127.0.0.1:{grpc_port}")
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    await server.stop(grace=1.0)


if __name__ == "__main__":
    # Spawned before grpc starts its threads (a fork after would copy them half-way).
    http = multiprocessing.get_context("spawn").Process(
        target=run_http, args=(int(sys.argv[2]),), daemon=True
    )
    http.start()
    try:
        asyncio.run(serve(int(sys.argv[1])))
    finally:
        http.terminate()
        http.join(2.0)
