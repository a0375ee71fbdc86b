"""Helpers for tests: a model repository written from its settings, a server on a free
loopback port, a grpcio client, polling, and an h2 client facing a ServerProtocol without a
socket."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import grpc
import h2.config
import h2.connection
import pytest
import trio

from trio_infer.protobuf._proto import grpc_predict_v2_pb2_grpc, health_pb2_grpc
from trio_infer.server import RunningServer, ServerConfig, run_server
from trio_infer.transport.grpc_protocol import ProtocolLimits, ServerProtocol

MiB = 1024 * 1024

#: A gRPC request's headers, for a client talking to a ServerProtocol without a socket.
GRPC_REQUEST = [
    (":method", "POST"),
    (":scheme", "http"),
    (":path", "/pkg.S/M"),
    (":authority", "x"),
    ("te", "trailers"),
    ("content-type", "application/grpc"),
]


def client_and_server() -> tuple[h2.connection.H2Connection, ServerProtocol]:
    """h2's client and a ServerProtocol, each with its preface queued, no socket between."""
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    server = ServerProtocol(ProtocolLimits())
    server.initiate_connection()
    return client, server


def write_repository(
    root: Path, models: Mapping[str, Mapping[str, Any]], module: str, source: str
) -> Path:
    """Write a model repository at ``root``: a folder per model, named after it, holding its
    ``model-settings.json`` (``models[name]``) and the module ``module`` (``source``) that the
    settings' ``implementation`` names. Returns ``root``."""
    for name, settings in models.items():
        (root / name).mkdir(parents=True)
        (root / name / "model-settings.json").write_text(json.dumps(settings))
        (root / name / f"{module}.py").write_text(source)
    return root


async def start_server(
    nursery: trio.Nursery,
    repository: Path | None = None,
    *,
    wait_ready: bool = True,
    **overrides: Any,
) -> RunningServer:
    """Start a server on a free loopback port and (by default) wait until its models are ready."""
    settings: dict[str, Any] = {"host": "127.0.0.1", "grpc_port": 0, "http_port": 0, "workers": 2}
    if repository is not None:
        settings["repository"] = repository
    config = ServerConfig(**(settings | overrides))
    server: RunningServer = await nursery.start(run_server, config)
    if wait_ready:
        await server.wait_ready()
    return server


class GrpcioClient:
    """grpcio stubs generated from protos/, called from a thread so Trio keeps running."""

    def __init__(self, port: int) -> None:
        self.channel = grpc.insecure_channel(
            f"127.0.0.1:{port}",
            options=[
                ("grpc.max_send_message_length", 128 * MiB),
                ("grpc.max_receive_message_length", 128 * MiB),
            ],
        )
        self.stub = grpc_predict_v2_pb2_grpc.GRPCInferenceServiceStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    async def call(self, method: str, request: Any, **kwargs: Any) -> Any:
        """Call ``method`` on the V2 service; kwargs go to grpcio (timeout, metadata)."""
        return await trio.to_thread.run_sync(lambda: getattr(self.stub, method)(request, **kwargs))

    async def call_with_metadata(self, method: str, request: Any, **kwargs: Any) -> Any:
        """Like :meth:`call`, returning ``(response, grpc.Call)`` for the call's metadata."""
        return await trio.to_thread.run_sync(
            lambda: getattr(self.stub, method).with_call(request, **kwargs)
        )

    async def error(self, method: str, request: Any, **kwargs: Any) -> grpc.RpcError:
        """Call ``method``, which must fail; return the error (its code() and details())."""
        with pytest.raises(grpc.RpcError) as caught:
            await self.call(method, request, **kwargs)
        return caught.value

    async def call_health(self, method: str, request: Any, **kwargs: Any) -> Any:
        """Call ``method`` on grpc.health.v1.Health."""
        call = getattr(self.health, method)
        return await trio.to_thread.run_sync(lambda: call(request, **kwargs))

    async def error_health(self, method: str, request: Any, **kwargs: Any) -> grpc.RpcError:
        """Call ``method`` on grpc.health.v1.Health, which must fail; return the error."""
        with pytest.raises(grpc.RpcError) as caught:
            await self.call_health(method, request, **kwargs)
        return caught.value


async def eventually(condition: Callable[[], bool], within: float = 10.0) -> None:
    """Wait for state owned by another process or thread to satisfy ``condition``."""
    with trio.fail_after(within):
        while not condition():  # noqa: ASYNC110 - the state lives outside this Trio run
            await trio.sleep(0.01)


class Peaks:
    """The most unsent bytes one connection held, and the most bytes reserved, seen while
    :meth:`watch` runs (it samples ``server.statistics()`` every 10 ms until cancelled)."""

    def __init__(self, server: RunningServer) -> None:
        self.server = server
        self.unsent = 0
        self.reserved = 0

    async def watch(self) -> None:
        while True:
            statistics = self.server.statistics()
            assert statistics.transport is not None
            self.unsent = max(self.unsent, statistics.transport.largest_unsent_bytes)
            self.reserved = max(self.reserved, statistics.admission.reserved_bytes)
            await trio.sleep(0.01)
