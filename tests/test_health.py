"""grpc.health.v1 Check and Watch, and --strict-readiness, against a real server whose model's
loading a test controls: a model that cannot load, a worker killed so its replacement's load
crashes, and the drain."""

from __future__ import annotations

import json
import os
import queue
import signal
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import trio

from tests.support import GrpcioClient, start_server
from trio_infer.protobuf._proto import grpc_predict_v2_pb2 as pb
from trio_infer.protobuf._proto import health_pb2
from trio_infer.server import RunningServer

SERVING = health_pb2.HealthCheckResponse.ServingStatus.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.ServingStatus.NOT_SERVING
UNKNOWN = health_pb2.HealthCheckResponse.ServingStatus.SERVICE_UNKNOWN

MODEL = textwrap.dedent(
    '''
    import os
    from pathlib import Path

    from trio_infer import Model


    class Gated(Model):
        """Loads only while the file 'open' is in its folder; a worker that finds 'poison'
        there dies loading it. Writes its worker's pid to 'pid'."""

        def load(self):
            folder = self.settings.path
            if (folder / "poison").exists():
                os._exit(3)
            if not (folder / "open").exists():
                raise RuntimeError("the gate is closed")
            (folder / "pid").write_text(str(os.getpid()))

        def predict(self, inputs, parameters):
            return dict(inputs)
    '''
)


@pytest.fixture
def gated(tmp_path: Path) -> Path:
    """A repository with one model, ``gated``; its folder is the fixture's value's ``gated``."""
    folder = tmp_path / "repository" / "gated"
    folder.mkdir(parents=True)
    (folder / "model-settings.json").write_text(json.dumps({"implementation": "gated.Gated"}))
    (folder / "gated.py").write_text(MODEL)
    return tmp_path / "repository"


class Watcher:
    """A grpcio Watch of one service, read by a thread into a queue of statuses; the call's end
    (its status code) goes in last."""

    def __init__(self, client: GrpcioClient, service: str) -> None:
        self.statuses: queue.Queue[Any] = queue.Queue()
        self._call = client.health.Watch(health_pb2.HealthCheckRequest(service=service))
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for response in self._call:
                self.statuses.put(response.status)
            self.statuses.put(grpc.StatusCode.OK)
        except grpc.RpcError as error:
            self.statuses.put(error.code())

    async def next(self) -> Any:
        """The next status (or the call's end), within 20 s."""
        return await trio.to_thread.run_sync(lambda: self.statuses.get(timeout=20))

    def cancel(self) -> None:
        self._call.cancel()
        self._thread.join(5)


@pytest.fixture
def watchers() -> Iterator[list[Watcher]]:
    made: list[Watcher] = []
    yield made
    for watcher in made:
        watcher.cancel()


async def test_watch_streams_a_models_readiness_as_it_changes(
    nursery: trio.Nursery, gated: Path, watchers: list[Watcher]
) -> None:
    server = await start_server(nursery, gated, wait_ready=False, workers=1)
    client = GrpcioClient(server.port)
    server_watch = Watcher(client, "")
    model_watch = Watcher(client, "gated")
    unknown_watch = Watcher(client, "no-such-model")
    watchers += [server_watch, model_watch, unknown_watch]
    assert await server_watch.next() == NOT_SERVING
    assert await model_watch.next() == NOT_SERVING
    assert await unknown_watch.next() == UNKNOWN
    # The keeper retries the load (1 s, then 2 s...): the gate opens, the model turns ready.
    (gated / "gated" / "open").touch()
    assert await model_watch.next() == SERVING
    assert await server_watch.next() == SERVING
    check = await client.call_health("Check", health_pb2.HealthCheckRequest(service="gated"))
    assert check.status == SERVING

    # A crash that leaves the model unloadable: the replacement worker dies loading it.
    (gated / "gated" / "poison").touch()
    os.kill(int((gated / "gated" / "pid").read_text()), signal.SIGKILL)
    assert await model_watch.next() == NOT_SERVING
    assert await server_watch.next() == NOT_SERVING
    (gated / "gated" / "poison").unlink()
    assert await model_watch.next() == SERVING
    # Nothing is sent while nothing changes; an unknown service stays unknown.
    assert unknown_watch.statuses.empty()


async def test_the_drain_ends_every_watch_without_holding_the_grace_period(
    nursery: trio.Nursery, gated: Path, watchers: list[Watcher]
) -> None:
    (gated / "gated" / "open").touch()
    server = await start_server(nursery, gated, grace_period=60)
    client = GrpcioClient(server.port)
    watch = Watcher(client, "")
    watchers.append(watch)
    assert await watch.next() == SERVING
    server.shutdown()
    assert await watch.next() == NOT_SERVING
    assert await watch.next() == grpc.StatusCode.UNAVAILABLE
    # The server's task ends: no call held the 60 s grace period.
    with trio.fail_after(20):
        while nursery.child_tasks:  # noqa: ASYNC110 - waits for run_server to return
            await trio.sleep(0.05)


async def test_strict_readiness_false_keeps_the_server_ready_without_its_models(
    nursery: trio.Nursery, gated: Path
) -> None:
    server: RunningServer = await start_server(
        nursery, gated, wait_ready=False, strict_readiness=False
    )
    client = GrpcioClient(server.port)
    assert (await client.call("ServerReady", pb.ServerReadyRequest())).ready
    assert not (await client.call("ModelReady", pb.ModelReadyRequest(name="gated"))).ready
    check = await client.call_health("Check", health_pb2.HealthCheckRequest(service=""))
    assert check.status == SERVING
    model = await client.call_health("Check", health_pb2.HealthCheckRequest(service="gated"))
    assert model.status == NOT_SERVING


async def test_strict_readiness_is_the_default(nursery: trio.Nursery, gated: Path) -> None:
    server = await start_server(nursery, gated, wait_ready=False)
    client = GrpcioClient(server.port)
    assert not (await client.call("ServerReady", pb.ServerReadyRequest())).ready
    error = await client.error_health("Check", health_pb2.HealthCheckRequest(service="nope"))
    assert error.code() == grpc.StatusCode.NOT_FOUND
