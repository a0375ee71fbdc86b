"""Repository operations beside long calls: an unload whose calls outlive the grace period, a
slow load() beside other models' calls, a replaced worker beside a long stream. A real server,
real worker processes, grpcio stubs and the repository extension over gRPC."""

from __future__ import annotations

import json
import os
import signal
import textwrap
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import trio

from tests.support import GrpcioClient, eventually, start_server, write_repository
from trio_infer.core.repository import ControlMode
from trio_infer.protobuf._proto import grpc_predict_v2_pb2 as pb
from trio_infer.server import RunningServer

MODELS = textwrap.dedent(
    """
    import os
    import time

    import numpy as np

    from trio_infer.model import Model


    class Endless(Model):
        def predict(self, inputs, parameters):
            step = 0
            while True:
                time.sleep(0.01)
                pid = np.array([os.getpid()], np.int64)
                yield {"index": np.array([step], np.int32), "pid": pid}
                step += 1


    class Quick(Model):
        def predict(self, inputs, parameters):
            return {"pid": np.array([os.getpid()], np.int64)}


    class SlowLoad(Model):
        def load(self):
            # Marks in its folder: a load() has begun, and one has ended.
            (self.settings.path / "loading").touch()
            time.sleep(3)
            (self.settings.path / "loaded").touch()

        def predict(self, inputs, parameters):
            return {"pid": np.array([os.getpid()], np.int64)}
    """
)


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    models: dict[str, dict[str, Any]] = {
        "endless": {"implementation": "lifecycle_models.Endless", "decoupled": True},
        "quick": {"implementation": "lifecycle_models.Quick"},
        "other": {"implementation": "lifecycle_models.Quick"},
        "slow_load": {"implementation": "lifecycle_models.SlowLoad"},
    }
    return write_repository(tmp_path / "repository", models, "lifecycle_models", MODELS)


async def _explicit(nursery: trio.Nursery, repository: Path, *load: str) -> RunningServer:
    return await start_server(
        nursery,
        repository,
        model_control_mode=ControlMode.EXPLICIT,
        load_models=load,
        grace_period=1.0,
        workers=2,
    )


class _Stream:
    """An endless stream on model 'endless', read in a thread until cancelled."""

    def __init__(self, client: GrpcioClient) -> None:
        self.answers: list[pb.ModelStreamInferResponse] = []
        self.status: grpc.StatusCode | None = None
        self.first = threading.Event()
        self._done = threading.Event()
        self._call = client.stub.ModelStreamInfer(self._requests())
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _requests(self) -> Any:
        yield pb.ModelInferRequest(model_name="endless", id="s")
        self._done.wait()

    def _read(self) -> None:
        try:
            for answer in self._call:
                self.answers.append(answer)
                self.first.set()
        except grpc.RpcError as error:
            self.status = error.code()

    def pid(self) -> int:
        outputs = self.answers[0].infer_response
        names = [o.name for o in outputs.outputs]
        return int(np.frombuffer(outputs.raw_output_contents[names.index("pid")], np.int64)[0])

    def close(self) -> None:
        self._done.set()
        self._call.cancel()
        self._thread.join(5)


@asynccontextmanager
async def _beside_a_stream(
    nursery: trio.Nursery, repository: Path
) -> AsyncIterator[tuple[RunningServer, GrpcioClient, _Stream]]:
    """A server (2 workers, 'endless' and 'quick' loaded) with an endless stream answering."""
    server = await _explicit(nursery, repository, "endless", "quick")
    client = GrpcioClient(server.port)
    stream = _Stream(client)
    try:
        await trio.to_thread.run_sync(lambda: stream.first.wait(10))
        yield server, client, stream
    finally:
        stream.close()
        client.channel.close()


async def _repository_call(client: GrpcioClient, method: str, name: str, within: float) -> Any:
    request_type = {
        "RepositoryModelLoad": pb.RepositoryModelLoadRequest,
        "RepositoryModelUnload": pb.RepositoryModelUnloadRequest,
    }[method]
    return await client.call(method, request_type(model_name=name), timeout=within)


async def test_an_unload_ends_the_calls_that_outlive_the_grace_period(
    nursery: trio.Nursery, repository: Path
) -> None:
    async with _beside_a_stream(nursery, repository) as (server, client, stream):
        # The grace period is 1 s: the unload answers soon after, the stream's request ended.
        await _repository_call(client, "RepositoryModelUnload", "endless", within=10)
        await eventually(lambda: any("was unloaded" in a.error_message for a in stream.answers))
        # The model can be loaded again, and the manager serves other operations.
        await _repository_call(client, "RepositoryModelLoad", "endless", within=10)
        await _repository_call(client, "RepositoryModelUnload", "quick", within=10)
        await eventually(lambda: not server.statistics().admission.in_flight)


async def test_a_slow_load_leaves_the_served_models_a_worker(
    nursery: trio.Nursery, repository: Path
) -> None:
    server = await _explicit(nursery, repository, "quick")
    client = GrpcioClient(server.port)
    try:
        folder = repository / "slow_load"
        async with trio.open_nursery() as loading:
            loading.start_soon(_repository_call, client, "RepositoryModelLoad", "slow_load", 30.0)
            await eventually(lambda: (folder / "loading").exists())
            # Served by a worker that is not loading: answered before any load() has ended.
            await client.call("ModelInfer", pb.ModelInferRequest(model_name="quick"), timeout=30)
            assert not (folder / "loaded").exists()
        await client.call("ModelInfer", pb.ModelInferRequest(model_name="slow_load"), timeout=5)
    finally:
        client.channel.close()


async def test_a_replaced_worker_does_not_hold_the_manager_behind_a_long_call(
    nursery: trio.Nursery, repository: Path
) -> None:
    async with _beside_a_stream(nursery, repository) as (server, client, stream):
        # The worker that does not run the stream: kill it.
        busy = stream.pid()
        others: set[int] = set()
        while not others:
            answer = await client.call("ModelInfer", pb.ModelInferRequest(model_name="quick"))
            pid = int(np.frombuffer(answer.raw_output_contents[0], np.int64)[0])
            if pid != busy:
                others.add(pid)
        crashed = server.statistics().pool.crashed
        os.kill(others.pop(), signal.SIGKILL)
        await eventually(lambda: server.statistics().pool.crashed > crashed)
        await client.call("ModelInfer", pb.ModelInferRequest(model_name="quick"), timeout=10)
        # The manager loads the served models into the replacement; an operation queued after
        # that is answered long before the stream ends.
        error = await client.error(
            "RepositoryModelUnload", pb.RepositoryModelUnloadRequest(model_name="other"), timeout=8
        )
        assert error.code() == grpc.StatusCode.NOT_FOUND


async def test_loads_and_unloads_do_not_wait_for_a_long_call(
    nursery: trio.Nursery, repository: Path
) -> None:
    async with _beside_a_stream(nursery, repository) as (_, client, stream):
        # The stream holds one of the two workers for as long as it runs: the other loads.
        await _repository_call(client, "RepositoryModelLoad", "other", within=10)
        answer = await client.call("ModelInfer", pb.ModelInferRequest(model_name="other"))
        assert int(np.frombuffer(answer.raw_output_contents[0], np.int64)[0]) != stream.pid()
        # A reload (new settings), and an unload, both answered while the stream runs.
        await client.call(
            "RepositoryModelLoad",
            pb.RepositoryModelLoadRequest(
                model_name="other",
                parameters={
                    "config": pb.ModelRepositoryParameter(
                        string_param='{"parameters": {"extra": {"v": 2}}}'
                    )
                },
            ),
            timeout=10,
        )
        await _repository_call(client, "RepositoryModelUnload", "quick", within=10)
        answered = len(stream.answers)
        await eventually(lambda: len(stream.answers) > answered)
        assert stream.status is None


async def test_a_reload_does_not_wait_for_the_drop_before_it_beside_a_long_call(
    nursery: trio.Nursery, repository: Path
) -> None:
    server = await start_server(
        nursery,
        repository,
        model_control_mode=ControlMode.EXPLICIT,
        load_models=("endless", "other"),
        grace_period=60.0,
        workers=2,
    )
    client = GrpcioClient(server.port)
    stream = _Stream(client)

    def config(v: int) -> pb.RepositoryModelLoadRequest:
        value = json.dumps({"parameters": {"extra": {"v": v}}})
        return pb.RepositoryModelLoadRequest(
            model_name="other",
            parameters={"config": pb.ModelRepositoryParameter(string_param=value)},
        )

    try:
        await trio.to_thread.run_sync(lambda: stream.first.wait(10))
        # Each reload drops the settings before it once their calls are done (at once: there
        # are none), from the busy worker after its stream: that drop holds no later load of
        # the model back, though it may wait the whole grace period (60 s, past the client's
        # timeout) for the busy worker.
        for v in (1, 2, 3):
            await client.call("RepositoryModelLoad", config(v), timeout=10)
        answer = await client.call("ModelInfer", pb.ModelInferRequest(model_name="other"))
        assert int(np.frombuffer(answer.raw_output_contents[0], np.int64)[0]) != stream.pid()
        assert stream.status is None
    finally:
        stream.close()
        client.channel.close()


async def test_a_load_while_every_worker_runs_a_long_call_fails_after_the_grace_period(
    nursery: trio.Nursery, repository: Path
) -> None:
    server = await _explicit(nursery, repository, "endless", "quick")
    client = GrpcioClient(server.port)
    streams = [_Stream(client), _Stream(client)]
    try:
        for stream in streams:
            await trio.to_thread.run_sync(lambda stream=stream: stream.first.wait(10))
        assert len({stream.pid() for stream in streams}) == 2  # one on each worker
        # Neither worker frees up: the load fails once the grace period (1 s) has passed, and
        # the manager goes on to the unload that ends the streams.
        error = await client.error(
            "RepositoryModelLoad", pb.RepositoryModelLoadRequest(model_name="other"), timeout=10
        )
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        assert "every worker ran calls that did not end within 1 s" in error.details()
        await _repository_call(client, "RepositoryModelUnload", "endless", within=10)
        await _repository_call(client, "RepositoryModelLoad", "other", within=10)
        await client.call("ModelInfer", pb.ModelInferRequest(model_name="other"), timeout=10)
    finally:
        for stream in streams:
            stream.close()
        client.channel.close()
