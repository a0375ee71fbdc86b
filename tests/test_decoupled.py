"""Decoupled models (0..N responses per request): a real server, real worker processes and
tritonclient's stream API; the pool's backpressure and cancellation against a real worker."""

from __future__ import annotations

import json
import queue
import textwrap
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import trio
import tritonclient.grpc as triton
from tritonclient.utils import InferenceServerException

from tests.probe import process_exists
from tests.support import GrpcioClient, eventually, start_server, write_repository
from trio_infer.errors import InferError
from trio_infer.model import Parameters
from trio_infer.protobuf._proto import grpc_predict_v2_pb2 as pb
from trio_infer.repository.settings import ModelSettings, SettingsError, load_model_settings
from trio_infer.server import RunningServer
from trio_infer.workers import wire
from trio_infer.workers.pool import WorkerPool

MODELS = textwrap.dedent(
    '''
    import asyncio
    import os
    import time
    from pathlib import Path

    import numpy as np

    from trio_infer import InferError, Model


    def _wait_for(path):
        while not os.path.exists(path):
            time.sleep(0.005)


    class Steps(Model):
        """Yields parameter count items (index i); writes step-i before each, and closed in its
        finally; waits for the file gate-i first when it exists as a parameter gate."""

        def predict(self, inputs, parameters):
            folder = Path(parameters["folder"])
            gate = parameters.get("gate", -1)
            step = 0
            try:
                for step in range(parameters.get("count", 5)):
                    if step == gate:
                        _wait_for(folder / f"gate-{step}")
                    (folder / f"step-{step}").write_text(str(os.getpid()))
                    yield {"index": np.array([step], np.int32)}
                    if parameters.get("pause", 0.0):
                        time.sleep(parameters["pause"])
            finally:
                (folder / "closed").write_text(str(step))


    class AsyncSteps(Model):
        async def predict(self, inputs, parameters):
            for step in range(parameters.get("count", 3)):
                await asyncio.sleep(0)
                yield {"index": np.array([step], np.int32)}


    class Unfinished(InferError):
        def __init__(self):
            pass  # no message, no status: InferError's __init__ never ran


    class FailsMidStream(Model):
        def predict(self, inputs, parameters):
            yield {"index": np.array([0], np.int32)}
            raise Unfinished()


    class NotDeclared(Model):
        def predict(self, inputs, parameters):
            yield {"index": np.array([0], np.int32)}
    '''
)


def _repository(root: Path) -> Path:
    models = {
        "steps": {"implementation": "decoupled_models.Steps", "decoupled": True},
        "async_steps": {"implementation": "decoupled_models.AsyncSteps", "decoupled": True},
        "fails": {"implementation": "decoupled_models.FailsMidStream", "decoupled": True},
    }
    return write_repository(root, models, "decoupled_models", MODELS)


@pytest.fixture
async def decoupled_server(nursery: trio.Nursery, tmp_path: Path) -> RunningServer:
    return await start_server(nursery, _repository(tmp_path / "repository"))


def _stream(
    port: int,
    model: str,
    parameters: dict[str, Any],
    *,
    empty_final: bool,
    until: int | None = None,
    on_first: Any = None,
) -> list[Any]:
    """Send one request on a tritonclient stream; its responses (results, or errors) in order of
    arrival, until the one marked final (or ``until`` of them: then the stream is cancelled)."""
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client = triton.InferenceServerClient(f"127.0.0.1:{port}")
    out: list[Any] = []
    try:
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        x = triton.InferInput("x", [1], "FP32")
        x.set_data_from_numpy(np.zeros(1, np.float32))
        client.async_stream_infer(
            model,
            [x],
            request_id="req-7",
            parameters=parameters,
            enable_empty_final_response=empty_final,
        )
        while True:
            result, error = answers.get(timeout=30)
            out.append(error if error is not None else result)
            if len(out) == 1 and on_first is not None:
                on_first()
            if error is not None or _final(result) or len(out) == until:
                break
        client.stop_stream(cancel_requests=until is not None)
    finally:
        client.close()
    return out


def _final(result: Any) -> bool:
    parameter = result.get_response().parameters.get("triton_final_response")
    return parameter is not None and parameter.bool_param


@pytest.mark.parametrize("empty_final", [False, True])
async def test_each_response_arrives_in_order_with_the_id_and_the_final_flag(
    decoupled_server: RunningServer, tmp_path: Path, empty_final: bool
) -> None:
    parameters = {"folder": str(tmp_path), "count": 5}
    answers = await trio.to_thread.run_sync(
        lambda: _stream(decoupled_server.port, "steps", parameters, empty_final=empty_final)
    )
    assert all(not isinstance(a, InferenceServerException) for a in answers), answers
    assert [a.get_response().id for a in answers] == ["req-7"] * len(answers)
    flags = [_final(a) for a in answers]
    indexes = [a.as_numpy("index") for a in answers]
    if empty_final:
        assert flags == [False] * 5 + [True]
        assert [i.tolist() for i in indexes[:5]] == [[n] for n in range(5)]
        assert indexes[5] is None  # the empty final response has no outputs
    else:
        assert flags == [False] * 4 + [True]
        assert [i.tolist() for i in indexes] == [[n] for n in range(5)]


@pytest.mark.parametrize("empty_final", [False, True])
async def test_the_first_response_arrives_before_the_generator_goes_on(
    decoupled_server: RunningServer, tmp_path: Path, empty_final: bool
) -> None:
    # The generator waits at a gate that the client opens only once it has the first
    # response: if responses waited for the generator's end, this would never end. Without
    # the empty final response, a response is held until the next is yielded (it may be the
    # last, and the last is marked final), so the gate is one item later.
    gate = 1 if empty_final else 2
    opened = tmp_path / f"gate-{gate}"
    parameters = {"folder": str(tmp_path), "count": 4, "gate": gate}
    answers = await trio.to_thread.run_sync(
        lambda: _stream(
            decoupled_server.port,
            "steps",
            parameters,
            empty_final=empty_final,
            on_first=lambda: opened.write_text(""),
        )
    )
    assert [a.as_numpy("index").tolist() for a in answers[:4]] == [[n] for n in range(4)]
    assert _final(answers[-1])


async def test_an_async_generator_model_streams_too(
    decoupled_server: RunningServer, tmp_path: Path
) -> None:
    answers = await trio.to_thread.run_sync(
        lambda: _stream(decoupled_server.port, "async_steps", {"count": 3}, empty_final=True)
    )
    assert [_final(a) for a in answers] == [False, False, False, True]
    assert [a.as_numpy("index").tolist() for a in answers[:3]] == [[0], [1], [2]]


async def test_an_error_a_generator_raises_that_never_ran_its_init_fails_only_the_request(
    decoupled_server: RunningServer,
) -> None:
    # Its message and status are read to send it: that failure is the model's, not the
    # worker's, whose death would fail every call it held.
    first, error = await trio.to_thread.run_sync(
        lambda: _stream(decoupled_server.port, "fails", {}, empty_final=True)
    )
    assert first.as_numpy("index").tolist() == [0]
    assert isinstance(error, InferenceServerException)
    assert error.message() == "AttributeError: 'Unfinished' object has no attribute 'message'"
    assert decoupled_server.statistics().pool.crashed == 0


async def test_model_infer_on_a_decoupled_model_is_unimplemented_naming_it(
    decoupled_server: RunningServer,
) -> None:
    client = GrpcioClient(decoupled_server.port)
    try:
        error = await client.error("ModelInfer", pb.ModelInferRequest(model_name="steps"))
    finally:
        client.channel.close()
    assert error.code() == grpc.StatusCode.UNIMPLEMENTED
    assert "model 'steps' is decoupled" in error.details()
    assert "ModelStreamInfer" in error.details()


async def test_cancelling_the_stream_stops_the_generator_between_items(
    decoupled_server: RunningServer, tmp_path: Path
) -> None:
    count = 100_000  # about 100 s at 1 ms a step
    parameters = {"folder": str(tmp_path), "count": count, "pause": 0.001}
    answers = await trio.to_thread.run_sync(
        lambda: _stream(decoupled_server.port, "steps", parameters, empty_final=True, until=2)
    )
    assert [a.as_numpy("index").tolist() for a in answers] == [[0], [1]]
    # The generator was closed (its finally ran), not left running nor killed.
    await eventually(lambda: (tmp_path / "closed").exists())
    stopped_at = int((tmp_path / "closed").read_text())
    assert 1 <= stopped_at < count
    pid = int((tmp_path / "step-0").read_text())
    assert process_exists(pid)
    assert decoupled_server.statistics().pool.crashed == 0
    await eventually(lambda: decoupled_server.statistics().pool.busy == 0)


async def test_a_generator_stuck_in_a_step_when_cancelled_has_its_worker_killed(
    decoupled_server: RunningServer, tmp_path: Path
) -> None:
    # Step 2 waits at a gate nobody opens: the worker cannot stop it between items.
    parameters = {"folder": str(tmp_path), "count": 5, "gate": 2}
    answers = await trio.to_thread.run_sync(
        lambda: _stream(decoupled_server.port, "steps", parameters, empty_final=True, until=2)
    )
    assert len(answers) == 2
    pid = int((tmp_path / "step-0").read_text())
    # Killed STOP_GRACE after the cancel reaches the worker; the bound guards against a worker
    # never killed, with room for a loaded machine (10 s was passed once under three suites).
    await eventually(lambda: not process_exists(pid), within=60)
    assert not (tmp_path / "step-2").exists()
    assert decoupled_server.statistics().pool.crashed == 0  # a kill on cancel is no crash


# -- the pool: backpressure by credits, against a real worker --------------------------------


def _settings(root: Path, name: str, cls: str, **fields: Any) -> ModelSettings:
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "decoupled_models.py").write_text(MODELS)
    return ModelSettings(name, f"decoupled_models.{cls}", path=folder, **fields)


async def test_a_reader_that_stalls_stalls_the_generator_within_the_credits(
    tmp_path: Path,
) -> None:
    settings = _settings(tmp_path, "steps", "Steps", decoupled=True)
    count = 1000
    parameters = Parameters({"folder": str(tmp_path), "count": count})
    taken: list[int] = []
    stalled = trio.Event()

    async def each(outputs: dict[str, np.ndarray]) -> None:
        taken.append(int(outputs["index"][0]))
        if len(taken) == 2:
            stalled.set()
            await trio.sleep_forever()  # a reader that reads no more

    def steps() -> int:
        return len(list(tmp_path.glob("step-*")))

    async with WorkerPool.open(1) as pool:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pool.generate, settings, {}, parameters, each)
            await stalled.wait()
            # Two taken, ITEMS_AHEAD more sent ahead: then the generator waits for a credit.
            await eventually(lambda: steps() == 2 + wire.ITEMS_AHEAD)
            nursery.cancel_scope.cancel()
        await eventually(lambda: (tmp_path / "closed").exists())
        assert steps() == 2 + wire.ITEMS_AHEAD  # never stepped again, and was closed
        assert taken == [0, 1]
        # The same worker goes on serving: it was not killed.
        (tmp_path / "closed").unlink()
        got: list[int] = []

        async def collect(outputs: dict[str, np.ndarray]) -> None:
            got.append(int(outputs["index"][0]))

        await pool.generate(
            settings, {}, Parameters({"folder": str(tmp_path), "count": 3}), collect
        )
        assert got == [0, 1, 2]
        assert pool.statistics().crashed == 0


async def test_a_generator_predict_not_declared_decoupled_fails_to_load_with_a_clear_error(
    tmp_path: Path,
) -> None:
    settings = _settings(tmp_path, "undeclared", "NotDeclared")
    async with WorkerPool.open(1) as pool:
        with pytest.raises(InferError, match='is a generator: set "decoupled": true'):
            await pool.predict(settings, {}, Parameters())


def test_a_decoupled_model_that_batches_is_a_settings_error(tmp_path: Path) -> None:
    (tmp_path / "model-settings.json").write_text(
        json.dumps({"implementation": "a.B", "decoupled": True, "max_batch_size": 8})
    )
    with pytest.raises(SettingsError, match="max_batch_size is 8, but a decoupled model"):
        load_model_settings(tmp_path)
