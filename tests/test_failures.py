"""Failures you can see: a dead worker, a failing model and a crashed internal task each leave
one clear trace in the log, and a crashed task is replaced without taking the server down.

Real servers on 127.0.0.1 port 0, real worker processes, a real grpcio client, real ``kill -9``.
The log is read with ``caplog``: the server runs in the test's process.

The internal-task crashes are caused for real, through the code paths they take in production:
the test model ``Rogue`` breaks the protocol between its worker and the server from inside the
worker, as model code can (it runs in that process). It finds the worker's connection and the
current call's id on the stack of ``trio_infer.workers.child`` (``serve``'s ``sock``, ``_run``'s
``call_id``) and writes a forged report on it:

- ``forge_report``: a report of a call the pool never sent. The lane's check that reports come
  in the order calls were sent fails (an AssertionError in the lane's receiver task).
- ``forge_result``: a successful report of its own call whose result is a string, not the
  ``dict`` of arrays a model call returns; the true report of the call is then dropped, so the
  worker goes on in step with the pool. The batcher's split of the outputs raises (an
  AttributeError in the batcher task).

Calls are held in a worker until the test creates the file ``<tag>.go``, so a test knows what is
running and what is queued when the fault comes; nothing waits for a fixed time.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import multiprocessing.forkserver
import os
import resource
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import trio

from tests.probe import process_exists, start_probe
from tests.support import GrpcioClient, eventually, start_server, write_repository
from trio_infer.client import InferenceClient
from trio_infer.core.repository import ModelManager
from trio_infer.errors import InferError, ModelFailed, StatusCode
from trio_infer.protobuf._proto import grpc_predict_v2_pb2 as pb
from trio_infer.protobuf.codec import decode_outputs, encode_inputs, encode_parameters
from trio_infer.scheduling.model_errors import ModelErrorLog
from trio_infer.server import RunningServer
from trio_infer.workers.pool import reported_error

ROGUE_MODEL = '''
import os
import sys
import time
from pathlib import Path

import numpy as np

from trio_infer import InferError, Model
from trio_infer.workers import child, wire


def worker_local(function, name):
    """A local variable of the worker's own loop, which is on the stack below predict."""
    frame = sys._getframe()
    while frame.f_code.co_name != function:
        frame = frame.f_back
    return frame.f_locals[name]


class Rogue(Model):
    def predict(self, inputs, parameters):
        log = Path(self.settings.parameters.extra["log_dir"])
        if parameters.get("spawn"):
            # A fork of the worker: it holds the worker's connection and the fork server's pipe.
            spawned = os.fork()
            if spawned == 0:
                time.sleep(600)
                os._exit(0)
            (log / "spawned").write_text(str(spawned))
        tag = parameters.get("tag")
        if tag:
            (log / f"{tag}.tmp").write_text(str(os.getpid()))
            os.replace(log / f"{tag}.tmp", log / f"{tag}.start")
            while not (log / f"{tag}.go").exists():
                time.sleep(0.005)  # the test, in another process, lets it go
        action = parameters.get("action", "ok")
        if action == "raise":
            raise ValueError(f"boom {parameters.get('n', 0)}")
        if action == "exit":
            os._exit(3)
        if action == "raise_status":
            raise InferError("chosen", parameters["code"])
        if action == "forge_header":
            # A header announcing a pickle of "size" bytes, and nothing of it: what the model
            # writes on its worker's socket is read as the start of a report.
            header = wire._HEADER.pack(0, parameters["size"])
            os.write(worker_local("serve", "sock").fileno(), header)
        if action == "forge_report":
            forged = ((-1, True, {}, 0.0), [])
            wire.send(worker_local("serve", "sock"), wire.pack(forged))
        if action in ("forge_result", "forge_failure"):
            ok = action == "forge_result"
            value = "not a dict" if ok else "not an InferError"
            forged = ((worker_local("_run", "call_id"), ok, value, 0.0), [])
            wire.send(worker_local("serve", "sock"), wire.pack(forged))
            # The true report of this call must not follow the forged one.
            report = child._report

            def drop_once(sock, finished, skipped):
                child._report = report
                if skipped:
                    report(sock, None, skipped)

            child._report = drop_once
        x = inputs["x"]
        return {"y": x, "pid": np.full(len(x), os.getpid(), np.int64)}
'''

X = [{"name": "x", "datatype": "FP32", "shape": [-1, 1]}]

SUBCLASSES_MODEL = """
import numpy as np

from trio_infer import Model


class Tensor(np.ndarray):
    pass


class Outputs(dict):
    pass


class Name(str):
    pass


class Text(bytes):
    pass


class Subclasses(Model):
    def predict(self, inputs, parameters):
        y = np.arange(4, dtype=np.float32)
        kind = parameters["kind"]
        if kind == "the model's ndarray":
            return {"y": y.view(Tensor)}
        if kind == "matrix":
            return {"y": np.matrix(y)}
        if kind == "masked array":
            return {"y": np.ma.masked_array(y, mask=[False, True, False, False])}
        if kind == "the model's dict":
            return Outputs(y=y)
        if kind == "the model's str as a name":
            return {Name("y"): y}
        return {"y": y, "t": np.array([Text(b"a"), Name("b")], dtype=object)}
"""

#: What each answer holds, by the kind of subclass the model returned it in.
SUBCLASS_ANSWERS = {
    "the model's ndarray": [0.0, 1.0, 2.0, 3.0],
    "matrix": [[0.0, 1.0, 2.0, 3.0]],
    "masked array": [0.0, 1.0, 2.0, 3.0],
    "the model's dict": [0.0, 1.0, 2.0, 3.0],
    "the model's str as a name": [0.0, 1.0, 2.0, 3.0],
    "the model's bytes and str in BYTES": [0.0, 1.0, 2.0, 3.0],
}


class Rogues:
    """A server running ``rogue`` (unbatched) and ``rogue_batched`` (batches of 2), a client."""

    def __init__(self, server: RunningServer, log_dir: Path) -> None:
        self.server = server
        self.client = GrpcioClient(server.port)
        self.log_dir = log_dir

    @staticmethod
    def request(model: str = "rogue", **parameters: bool | int | float | str) -> Any:
        request = pb.ModelInferRequest(model_name=model)
        encode_inputs(request, [("x", np.zeros((1, 1), np.float32))], raw=True)
        encode_parameters(request.parameters, parameters)
        return request

    async def call(self, model: str = "rogue", **parameters: bool | int | float | str) -> int:
        """Run a call that must succeed; return the pid of the worker that ran it."""
        response = await self.client.call("ModelInfer", self.request(model, **parameters))
        return int(decode_outputs(response)["pid"][0])

    async def error(
        self, model: str = "rogue", **parameters: bool | int | float | str
    ) -> grpc.RpcError:
        return await self.client.error("ModelInfer", self.request(model, **parameters))

    def start(self, model: str = "rogue", **parameters: bool | int | float | str) -> Any:
        """Start a call with grpcio's future API."""
        return self.client.stub.ModelInfer.future(self.request(model, **parameters), timeout=60)

    async def wait_started(self, tag: str) -> int:
        """Wait until the call tagged ``tag`` runs in a worker (held there); return its pid."""
        path = self.log_dir / f"{tag}.start"
        await eventually(path.exists, within=30)
        return int(path.read_text())

    def let_go(self, tag: str) -> None:
        (self.log_dir / f"{tag}.go").touch()


async def start_rogues(nursery: trio.Nursery, tmp_path: Path, **server: Any) -> Rogues:
    root, log_dir = tmp_path / "repository", tmp_path / "log"
    log_dir.mkdir()
    models = {
        "rogue": {"max_batch_size": 0},
        "rogue_batched": {"inputs": X, "max_batch_size": 2, "max_batch_time": 0},
    }
    for name, settings in models.items():
        folder = root / name
        folder.mkdir(parents=True)
        (folder / "rogue_model.py").write_text(ROGUE_MODEL)
        document = {
            "name": name,
            "implementation": "rogue_model.Rogue",
            "parameters": {"extra": {"log_dir": str(log_dir)}},
            **settings,
        }
        (folder / "model-settings.json").write_text(json.dumps(document))
    running = await start_server(nursery, root, **({"workers": 2} | server))
    return Rogues(running, log_dir)


async def result(future: Any) -> Any:
    return await trio.to_thread.run_sync(lambda: future.result(timeout=60))


async def failure(future: Any) -> grpc.RpcError:
    error = await trio.to_thread.run_sync(lambda: future.exception(timeout=60))
    assert isinstance(error, grpc.RpcError), "the call succeeded"
    return error


def warnings_and_worse(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [record for record in caplog.records if record.levelno >= logging.WARNING]


@pytest.fixture
def quiet_model_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    """One line per model for the whole test, whatever the machine's speed."""
    monkeypatch.setattr(ModelErrorLog, "interval", 3600.0)


# -- a worker's death: one WARNING line ---------------------------------------------------------


@pytest.mark.parametrize(
    ("how", "cause"), [("kill -9", "killed by signal SIGKILL"), ("exit", "exit code 3")]
)
async def test_a_dead_worker_is_one_warning_with_its_pid_cause_and_failed_calls(
    nursery: trio.Nursery,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    how: str,
    cause: str,
) -> None:
    rogues = await start_rogues(nursery, tmp_path)
    caplog.clear()
    victim = rogues.start(tag="victim", action="exit" if how == "exit" else "ok")
    pid = await rogues.wait_started("victim")
    if how == "kill -9":
        os.kill(pid, signal.SIGKILL)
    else:
        rogues.let_go("victim")
    error = await failure(victim)
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert error.details() == f"worker process died while running model 'rogue' ({cause})"
    assert rogues.server.statistics().pool.crashed == 1
    [record] = warnings_and_worse(caplog)
    assert (record.name, record.levelno) == ("trio_infer.workers.pool", logging.WARNING)
    assert record.getMessage() == (
        f"worker process {pid} died ({cause}): 1 call(s) failed with it, 0 sent back to the "
        "queue; a replacement starts when there is work"
    )
    assert record.exc_info is None
    # The pool goes on, on a new worker.
    assert await rogues.call() != pid


# -- a model's error: one line per model, rate-limited --------------------------------------------


@pytest.mark.usefixtures("quiet_model_errors")
async def test_model_errors_are_logged_once_per_model_per_interval_with_the_count_of_the_rest(
    nursery: trio.Nursery,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rogues = await start_rogues(nursery, tmp_path)
    caplog.clear()

    async def fail(n: int, model: str = "rogue") -> None:
        error = await rogues.error(model, action="raise", n=n)
        assert error.code() == grpc.StatusCode.INTERNAL
        assert error.details() == f"ValueError: boom {n}"

    async with trio.open_nursery() as calls:
        for n in range(30):
            calls.start_soon(fail, n)
    lines = [r for r in caplog.records if r.name == "trio_infer.models"]
    assert len(lines) == 1, [r.getMessage() for r in lines]
    [first] = lines
    assert first.levelno == logging.WARNING
    assert first.getMessage().startswith("model 'rogue' failed (INTERNAL): ValueError: boom ")
    assert "Traceback" not in caplog.text  # only with debug

    # Another model has a line of its own, though the first one's interval has not passed.
    await fail(100, "rogue_batched")
    # Once the interval has passed, the next line counts the errors that were not logged.
    monkeypatch.setattr(ModelErrorLog, "interval", 0.0)
    await fail(101)
    messages = [r.getMessage() for r in caplog.records if r.name == "trio_infer.models"]
    assert messages[1:] == [
        "model 'rogue_batched' failed (INTERNAL): ValueError: boom 100",
        "model 'rogue' failed (INTERNAL): ValueError: boom 101 [29 more error(s) of this model "
        "since the previous line were not logged]",
    ]
    # Model errors are the model's, not the server's: nothing else was logged.
    assert {r.name for r in warnings_and_worse(caplog)} == {"trio_infer.models"}


@pytest.mark.usefixtures("quiet_model_errors")
async def test_with_debug_the_model_error_line_holds_the_models_traceback(
    nursery: trio.Nursery, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rogues = await start_rogues(nursery, tmp_path, debug=True)
    caplog.clear()
    error = await rogues.error(action="raise", n=7)
    assert error.code() == grpc.StatusCode.INTERNAL
    [record] = [r for r in caplog.records if r.name == "trio_infer.models"]
    message = record.getMessage()
    assert message.startswith("model 'rogue' failed (INTERNAL): ValueError: boom 7\nTraceback")
    assert 'raise ValueError(f"boom' in message


def test_the_model_error_log_counts_what_it_does_not_log() -> None:
    errors = ModelErrorLog()
    boom = ModelFailed("ValueError: boom")
    quota = InferError("quota used up", StatusCode.RESOURCE_EXHAUSTED)
    assert errors.record("a", boom, now=0.0)
    assert [errors.record("a", boom, now=t) for t in (1.0, 5.0, 9.9)] == [False] * 3
    assert errors.record("b", quota, now=9.9)  # per model
    assert errors.record("a", boom, now=10.0)
    assert not errors.record("a", boom, now=19.0)
    assert errors.record("a", boom, now=20.0)
    assert errors.record("a", boom, now=100.0)


def test_the_model_error_log_lines(caplog: pytest.LogCaptureFixture) -> None:
    errors = ModelErrorLog()
    quota = InferError("quota used up", StatusCode.RESOURCE_EXHAUSTED)
    for t in (0.0, 1.0, 2.0, 10.0, 20.0):
        errors.record("a", quota, now=t)
    assert [r.getMessage() for r in caplog.records] == [
        "model 'a' failed (RESOURCE_EXHAUSTED): quota used up",
        "model 'a' failed (RESOURCE_EXHAUSTED): quota used up [2 more error(s) of this model "
        "since the previous line were not logged]",
        "model 'a' failed (RESOURCE_EXHAUSTED): quota used up",
    ]


# -- an internal task's crash: logged, counted, replaced; only its calls fail ----------------------


async def test_a_crashed_lane_fails_the_calls_it_held_and_a_fresh_lane_serves_the_rest(
    nursery: trio.Nursery, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rogues = await start_rogues(nursery, tmp_path, workers=1)
    pool = rogues.server.core.pool
    caplog.clear()
    forger = rogues.start(tag="forger", action="forge_report")
    pid = await rogues.wait_started("forger")
    behind = rogues.start()
    # The one lane holds two calls: the running one and the next. Read-only, to know that
    # ``behind`` is held by the lane rather than waiting in the pool's queue.
    await eventually(lambda: len(pool._lanes[0].outstanding) == 2)
    queued = rogues.start()
    await eventually(lambda: pool.statistics().waiting == 2)

    rogues.let_go("forger")
    held = "internal error in the worker pool while running model 'rogue': the lane holding the call crashed (logged by the server)"  # noqa: E501
    for call in (forger, behind):
        error = await failure(call)
        assert (error.code(), error.details()) == (grpc.StatusCode.INTERNAL, held)
    # What the lane did not hold runs on the fresh lane's new worker, as do later calls.
    response = await result(queued)
    fresh = int(decode_outputs(response)["pid"][0])
    assert fresh != pid
    assert {await rogues.call() for _ in range(3)} == {fresh}
    await eventually(lambda: not process_exists(pid))  # the lane's worker went with it

    statistics = rogues.server.statistics()
    assert statistics.task_crashes == {"lane": 1, "batcher": 0, "models": 0}
    assert (statistics.pool.lane_crashes, statistics.pool.crashed) == (1, 0)
    [record] = warnings_and_worse(caplog)
    assert (record.name, record.levelno) == ("trio_infer.workers.pool", logging.ERROR)
    message = record.getMessage()
    assert message.startswith("internal error: worker lane 0 crashed (AssertionError: report of ")
    assert message.endswith(
        f"; 2 call(s) it held failed, its worker process {pid} was stopped with it, and a "
        "fresh lane replaces it"
    )
    assert record.exc_info is not None
    assert "Traceback" in caplog.text
    assert "in _on_report" in caplog.text
    ready = await rogues.client.call("ServerReady", pb.ServerReadyRequest())
    assert ready.ready


async def test_a_failure_report_that_is_not_an_error_still_fails_its_call_at_once(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    # The reply is filled before the call leaves the lane's hands: a report the lane cannot
    # use as it is still answers its call, with no deadline to wait out.
    rogues = await start_rogues(nursery, tmp_path, workers=1)
    error = await rogues.client.error(
        "ModelInfer", rogues.request(action="forge_failure"), timeout=60
    )
    assert error.code() == grpc.StatusCode.INTERNAL
    assert error.details() == (
        "the worker reported a failure that is not an error: 'not an InferError'"
    )
    await rogues.call()
    assert rogues.server.statistics().task_crashes["lane"] == 0


@pytest.mark.parametrize(
    ("code", "status", "details"),
    [
        (4, grpc.StatusCode.DEADLINE_EXCEEDED, "chosen"),
        (
            0,
            grpc.StatusCode.INTERNAL,
            "the model failed with status 0, not a gRPC error status: 'chosen'",
        ),
        (
            99,
            grpc.StatusCode.INTERNAL,
            "the model failed with status 99, not a gRPC error status: 'chosen'",
        ),
    ],
)
async def test_a_model_error_with_a_number_for_status_fails_its_call_with_an_error_status(
    nursery: trio.Nursery, tmp_path: Path, code: int, status: grpc.StatusCode, details: str
) -> None:
    # A number that is a gRPC error status is that status. OK would answer the call with no
    # response (over REST a 200 whose body is the error); no status at all, its statistics.
    rogues = await start_rogues(nursery, tmp_path, workers=1)
    error = await rogues.error(action="raise_status", code=code)
    assert (error.code(), error.details()) == (status, details)
    pid = await rogues.call()
    assert (await rogues.call()) == pid, "the worker was kept"
    assert rogues.server.statistics().task_crashes["lane"] == 0


def test_a_reported_error_keeps_its_status_when_a_call_may_end_with_it() -> None:
    chosen = InferError("quota", StatusCode.RESOURCE_EXHAUSTED)
    assert reported_error(chosen) is chosen
    plain = InferError("late", 4)  # type: ignore[arg-type]
    assert reported_error(plain).code is StatusCode.DEADLINE_EXCEEDED
    for value in (InferError("x", True), InferError("x", "13"), InferError(b"x")):  # type: ignore[arg-type]
        assert type(reported_error(value)) is ModelFailed


async def test_a_report_header_past_the_memory_budget_fails_its_call_and_is_not_allocated(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    # The worker's socket carries what its model writes on it: a header that sizes a report
    # past the whole budget fails the call at once, and the worker, out of step, is replaced.
    budget = 64 * 1024 * 1024
    rogues = await start_rogues(nursery, tmp_path, workers=1, memory_budget=budget)
    pid = await rogues.call()
    error = await rogues.client.error(
        "ModelInfer", rogues.request(action="forge_header", size=2 * budget), timeout=10
    )
    assert (error.code(), error.details()) == (
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        f"the worker's report takes {2 * budget} bytes, more than the {budget} allowed "
        "(while running model 'rogue')",
    )
    assert (await rogues.call()) != pid
    statistics = rogues.server.statistics()
    assert (statistics.pool.killed, statistics.task_crashes["lane"]) == (1, 0)


@pytest.mark.parametrize("end", ["exit", "abandoned", "shutdown"])
async def test_a_process_the_model_started_ends_with_its_worker(tmp_path: Path, end: str) -> None:
    # The model's fork holds trio-parallel's pipes, whose end is how the pool learns that the
    # worker exited: it is killed with the worker, whether the worker died (its call answered
    # at once, not at its deadline), was killed for an abandoned call or stopped with the server.
    async with trio.open_nursery() as nursery:
        rogues = await start_rogues(nursery, tmp_path, workers=1)
        if end == "exit":
            request = rogues.request(spawn=True, action="exit")
            error = await rogues.client.error("ModelInfer", request, timeout=30)
            assert error.code() == grpc.StatusCode.UNAVAILABLE
        elif end == "abandoned":
            request = rogues.request(spawn=True, tag="held")
            error = await rogues.client.error("ModelInfer", request, timeout=1)
            assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        else:
            await rogues.call(spawn=True)
        spawned = int((rogues.log_dir / "spawned").read_text())
        if end != "shutdown":
            await eventually(lambda: not process_exists(spawned))
            await rogues.call()  # by the worker that replaced it
        rogues.server.shutdown()
    await eventually(lambda: not process_exists(spawned))  # killed: it dies once scheduled


async def test_outputs_of_subclasses_are_answered_as_plain_ones_by_the_same_worker(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    # The model's own classes would not unpickle in the server (a killed worker, INTERNAL);
    # numpy's were answered over gRPC and refused over REST (not JSON serializable): 500.
    settings = {"subclasses": {"name": "subclasses", "implementation": "odd.Subclasses"}}
    server = await start_server(
        nursery, write_repository(tmp_path, settings, "odd", SUBCLASSES_MODEL), workers=1
    )
    client = GrpcioClient(server.port)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.http_port}") as rest:
        for kind, y in SUBCLASS_ANSWERS.items():
            request = pb.ModelInferRequest(model_name="subclasses")
            request.parameters["kind"].string_param = kind
            outputs = decode_outputs(await client.call("ModelInfer", request))
            assert outputs["y"].tolist() == y, kind
            body = {"inputs": [], "parameters": {"kind": kind}}
            answer = await rest.post("/v2/models/subclasses/infer", json=body)
            assert answer.status_code == 200, (kind, answer.text)
            assert answer.json()["outputs"][0]["data"] == np.ravel(y).tolist(), kind
        assert outputs["t"].tolist() == [b"a", b"b"]
    assert (server.statistics().pool.killed, server.statistics().pool.crashed) == (0, 0)


async def test_a_crashed_lane_leaves_the_other_workers_calls_alone(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    rogues = await start_rogues(nursery, tmp_path)
    other = rogues.start(tag="other")
    other_pid = await rogues.wait_started("other")
    forger = rogues.start(tag="forger", action="forge_report")
    assert await rogues.wait_started("forger") != other_pid
    rogues.let_go("forger")
    assert (await failure(forger)).code() == grpc.StatusCode.INTERNAL
    await eventually(lambda: rogues.server.statistics().task_crashes["lane"] == 1)
    rogues.let_go("other")
    assert int(decode_outputs(await result(other))["pid"][0]) == other_pid
    assert rogues.server.statistics().pool.crashed == 0


async def test_a_crashed_batcher_fails_its_batch_and_a_fresh_batcher_serves_the_rest(
    nursery: trio.Nursery, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rogues = await start_rogues(nursery, tmp_path, workers=1)
    batching = rogues.server.core.batching.get("rogue_batched")
    assert batching is not None
    caplog.clear()
    first = rogues.start("rogue_batched", tag="first")
    await rogues.wait_started("first")
    # Two requests with equal parameters fill a batch of 2, which goes to the pool behind the
    # running one; a third, of another key, waits in the model's queue.
    forged = [rogues.start("rogue_batched", action="forge_result") for _ in range(2)]
    await eventually(lambda: batching.statistics().batches == 2)
    queued = rogues.start("rogue_batched", action="ok")
    await eventually(lambda: batching.statistics().waiting == 1)

    rogues.let_go("first")
    await result(first)
    crashed = (
        "internal error in the batching of model 'rogue_batched': the batcher holding the "
        "request crashed (logged by the server)"
    )
    for call in forged:
        error = await failure(call)
        assert (error.code(), error.details()) == (grpc.StatusCode.INTERNAL, crashed)
    await result(queued)
    for _ in range(3):
        await rogues.call("rogue_batched")

    statistics = rogues.server.statistics()
    assert statistics.task_crashes == {"lane": 0, "batcher": 1, "models": 0}
    assert statistics.batching["rogue_batched"].batcher_crashes == 1
    [record] = warnings_and_worse(caplog)
    assert (record.name, record.levelno) == ("trio_infer.scheduling.batching", logging.ERROR)
    assert record.getMessage() == (
        "internal error: a batcher of model 'rogue_batched' crashed while running a batch "
        "(AttributeError: 'str' object has no attribute 'items'); the 2 request(s) it held "
        "failed, and a fresh batcher replaces it"
    )
    assert record.exc_info is not None
    assert "in split_outputs" in caplog.text
    assert statistics.pool.crashed == 0  # the worker is not to blame here, nor replaced


async def test_a_crashed_model_operation_fails_alone_and_the_server_becomes_ready(
    nursery: trio.Nursery,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Nothing real makes an operation raise: the first load of the served models is made to.
    real = ModelManager._load_served
    calls = 0

    async def load_once(self: ModelManager) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise AssertionError("a model-loading bug")
        await real(self)

    monkeypatch.setattr(ModelManager, "_load_served", load_once)
    rogues = await start_rogues(nursery, tmp_path)  # waits until ready
    assert rogues.server.statistics().task_crashes == {"lane": 0, "batcher": 0, "models": 1}
    [record] = warnings_and_worse(caplog)
    assert (record.name, record.levelno) == ("trio_infer.core.repository", logging.ERROR)
    assert record.getMessage().startswith(
        "internal error: a model operation crashed (AssertionError: a model-loading bug); the "
        "served models are loaded again in "
    )
    assert record.exc_info is not None
    await rogues.call()


# -- a worker that cannot be started --------------------------------------------------------------


@contextmanager
def out_of_file_descriptors() -> Iterator[None]:
    """Use up this process's file descriptors, as a client holding connections open does: lower
    the soft limit a little above the highest open descriptor and open /dev/null until the
    kernel refuses. Both are undone on the way out."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    highest = max(int(fd) for fd in os.listdir("/proc/self/fd"))
    held: list[int] = []
    resource.setrlimit(resource.RLIMIT_NOFILE, (highest + 32, hard))
    try:
        while True:
            try:
                held.append(os.open(os.devnull, os.O_RDONLY))
            except OSError:
                break
        yield
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


async def test_a_worker_that_cannot_start_for_want_of_file_descriptors_leaves_the_models_served(
    nursery: trio.Nursery, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    probe = await start_probe(nursery, tmp_path)
    statistics = probe.server.statistics
    async with InferenceClient.connect("127.0.0.1", probe.server.port) as client:

        async def call(found: list[int], delay_ms: int = 0) -> None:
            parameters = {"action": "sleep", "delay_ms": delay_ms}
            result = await client.infer(
                "probe", {"x": np.zeros(1, np.float32)}, parameters=parameters, timeout=30
            )
            found.append(int(result["pid"][0]))

        async def serving_workers() -> set[int]:
            """The workers that serve pairs of 300 ms calls, sent until two have served one.

            An idle worker takes a call before a busy one is sent a second, but a worker may be
            busy with what the test does not see (the readiness keeper loading the model in
            every worker once a lane has a worker again), and then it can be sent both calls of
            a pair (``CALLS_PER_WORKER``). A worker that takes no calls at all still fails."""
            pids: list[int] = []
            for _ in range(10):
                async with trio.open_nursery() as calls:
                    for _ in range(2):
                        calls.start_soon(call, pids, 300)
                if len(set(pids)) >= 2:
                    break
            return set(pids)

        first = await serving_workers()
        assert len(first) == 2
        victim, survivor = sorted(first)
        caplog.clear()
        with out_of_file_descriptors():
            os.kill(victim, signal.SIGKILL)
            # Its replacement cannot start; the lane tries again, and again, and takes no call.
            await eventually(lambda: statistics().pool.failed_starts >= 3, within=30)
            assert statistics().pool.down == 1
            assert await client.model_ready("probe")
            served: list[int] = []
            for _ in range(5):
                await call(served)
            assert served == [survivor] * 5
        # Descriptors to be had again: the lane gets a worker, which loads the model.
        await eventually(lambda: statistics().pool.down == 0, within=30)
        await eventually(lambda: statistics().pool.idle == 2, within=30)
        assert statistics().pool.crashed == 1
        pids = await serving_workers()
        assert survivor in pids
        assert victim not in pids
        assert len(pids) == 2
        assert statistics().pool.crashed == 1
    # Each cause of the failed starts is one WARNING, however many tries it failed.
    causes = [
        record.getMessage().split("could not start (", 1)[1].split("): ", 1)[0]
        for record in warnings_and_worse(caplog)
        if "could not start" in record.getMessage()
    ]
    assert causes
    assert len(causes) == len(set(causes)), causes


async def test_a_worker_whose_fork_server_died_is_killed_when_its_call_is_abandoned(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    # CPython 3.11's fork server dies when a client runs out of file descriptors halfway through
    # asking it for a process (as in the test above). The workers it started go on; but
    # multiprocessing reads their exit status through it, and once any process is started (or
    # active_children is called) it records each of them as exited with code 255, so
    # trio-parallel's kill on cancel sends no signal.
    if "forkserver" not in multiprocessing.get_all_start_methods():
        pytest.skip("workers are not started by a fork server here")
    probe = await start_probe(nursery, tmp_path)
    fork_server = multiprocessing.forkserver._forkserver._forkserver_pid
    assert fork_server is not None
    os.kill(fork_server, signal.SIGKILL)
    # Not reaped here: multiprocessing reaps it when it starts another.
    await eventually(lambda: not process_exists(fork_server))
    multiprocessing.active_children()
    error = await probe.error(deadline=1.0, tag="hung", action="hang")
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    hung = probe.pid("hung")
    # Killed, not left running a call nobody waits for, outside the pool.
    await eventually(lambda: not process_exists(hung), within=5)
    # And the pool goes on, with a worker from a fork server started again.
    assert await probe.call(action="ok") != hung
