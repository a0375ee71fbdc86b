"""The worker pool, with real worker processes: results, errors, crashes, kills and the cache."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import signal
import tempfile
import textwrap
import time
from collections.abc import AsyncIterator, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from tests.support import eventually
from trio_infer.errors import InferError, InvalidInput, ModelFailed, StatusCode, Unavailable
from trio_infer.model import Parameters
from trio_infer.repository.settings import (
    EXAMPLES,
    ModelSettings,
    load_model_settings,
    load_repository,
)
from trio_infer.scheduling.sequences import SequenceFlags
from trio_infer.workers.pool import _RECENT_CALLS, WorkerPool, _CallTimes

# Test models, written into a temporary repository: each model folder gets its own copy of
# model.py and names its class as "model.<Class>", as a user's repository would.
MODELS = '''
import os
import stat
import sys
import time
from pathlib import Path

import numpy as np
import threadpoolctl

from trio_infer.errors import InferError, StatusCode


class QuotaError(InferError):
    """Defined in model code, so the server process cannot import it."""

    def __init__(self, user):
        super().__init__(f"quota of {user} used up", StatusCode.RESOURCE_EXHAUSTED)


class Base:
    pass


from trio_infer.model import Model


class Pid(Model):
    def load(self):
        log = Path(self.settings.parameters.extra["log"])
        with log.open("a") as f:
            f.write(f"{os.getpid()}\\n")

    def predict(self, inputs, parameters):
        return {"pid": np.array([os.getpid()])}


class Tracked(Model):
    """Writes "load <pid>" when loaded and "drop <pid>" when dropped from its worker's cache."""

    def load(self):
        self._log("load")

    def __del__(self):
        self._log("drop")

    def _log(self, what):
        with Path(self.settings.parameters.extra["events"]).open("a") as f:
            f.write(f"{what} {os.getpid()}\\n")

    def predict(self, inputs, parameters):
        return {"pid": np.array([os.getpid()])}


class Gate(Model):
    """Runs until the file its call names exists (a minute at most)."""

    def predict(self, inputs, parameters):
        Path(parameters["pid_file"]).write_text(str(os.getpid()))
        release = Path(parameters["release"])
        for _ in range(6000):
            if release.exists():
                break
            time.sleep(0.01)
        return {}


class LargeAnswer(Gate):
    """Runs until the file its call names exists, then answers 64 MiB: more than the socket
    to the server holds at once."""

    def predict(self, inputs, parameters):
        super().predict(inputs, parameters)
        return {"y": np.ones(64 * 1024 * 1024, np.uint8)}


class Nap(Model):
    def predict(self, inputs, parameters):
        Path(parameters["pid_file"]).write_text(str(os.getpid()))
        time.sleep(30)
        return {}


class Boom(Model):
    def predict(self, inputs, parameters):
        raise ValueError("boom 42")


class BoomOnLoad(Model):
    def load(self):
        raise FileNotFoundError("weights.bin")


class Quota(Model):
    def predict(self, inputs, parameters):
        raise QuotaError(parameters.headers["x-user"])


class Unpicklable(Exception):
    def __init__(self):
        super().__init__("cannot cross")
        self.lock = __import__("threading").Lock()


class RaisesUnpicklable(Model):
    def predict(self, inputs, parameters):
        try:
            raise Unpicklable()
        except Unpicklable as exc:
            raise RuntimeError("wrapped") from exc


class ReturnsList(Model):
    def predict(self, inputs, parameters):
        return [1, 2]


class ReturnsObjects(Model):
    def predict(self, inputs, parameters):
        return {"out": np.array([Base()], dtype=object)}


class Exit(Model):
    def predict(self, inputs, parameters):
        os._exit(3)


class Exits(Model):
    def predict(self, inputs, parameters):
        sys.exit(5)


class Params(Model):
    def predict(self, inputs, parameters):
        return {
            "k": np.array([parameters["k"]]),
            "user": np.array([parameters.headers["x-user"].encode()], dtype=object),
            "scale": np.array([parameters.inputs["x"]["scale"]]),
            "trio_loaded": np.array(["trio" in sys.modules]),
        }


class Threads(Model):
    def predict(self, inputs, parameters):
        info = threadpoolctl.threadpool_info()
        np.ones((64, 64)) @ np.ones((64, 64))  # the BLAS pool's threads at work
        tasks = [int(task) for task in os.listdir("/proc/self/task")]
        return {
            "threads": np.array([lib["num_threads"] for lib in info]),
            "policies": np.array([os.sched_getscheduler(task) for task in tasks]),
            "nice": np.array([os.getpriority(os.PRIO_PROCESS, 0)]),
        }


class Count(Model):
    def predict(self, inputs, parameters):
        with open(parameters["file"], "a") as f:
            f.write(f"{os.getpid()}\\n")
        return {}


class CountNap(Model):
    def predict(self, inputs, parameters):
        with open(parameters["file"], "a") as f:
            f.write(f"{os.getpid()}\\n")
        time.sleep(parameters["delay_ms"] / 1000)
        return {"pid": np.array([os.getpid()])}


class Unsendable:
    def __reduce_ex__(self, protocol):
        raise TypeError("cannot send this")


def tagged(tag):
    """An array whose dtype carries ``tag``: it pickles with the array, as numpy pickles it
    (outputs of plain types are sent as they are)."""
    return np.zeros(2, np.dtype(np.float64, metadata={"tag": tag}))


class ReturnsUnsendable(Model):
    def predict(self, inputs, parameters):
        return {"out": tagged(Unsendable())}


class WorkerOnly:
    """Pickled by reference to this module, which the server process cannot import."""


class ReturnsWorkerOnly(Model):
    def predict(self, inputs, parameters):
        return {"out": tagged(WorkerOnly)}


class SlowWorkerOnly(Model):
    def predict(self, inputs, parameters):
        time.sleep(0.3)
        return {"out": tagged(WorkerOnly)}


class HoldsSockets(Model):
    """Starts a child process that keeps its worker's sockets open (its connection to the pool
    among them) and closes every other file it inherited (trio-parallel's pipes, whose end is
    how the pool sees the worker exit). It leaves the worker's process group, whose members
    the pool kills with the worker. The child exits after a minute."""

    def predict(self, inputs, parameters):
        holder = os.fork()
        if holder == 0:
            try:
                os.setsid()
                for fd in map(int, os.listdir("/proc/self/fd")):
                    try:
                        if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                            os.close(fd)
                    except OSError:
                        pass  # listdir's own descriptor, closed already
                time.sleep(60)
            finally:
                os._exit(0)
        return {"pid": np.array([os.getpid()]), "holder": np.array([holder])}


class Which(Model):
    def predict(self, inputs, parameters):
        return {"folder": np.array([Path(__file__).parent.name.encode()], dtype=object)}
'''


def write_model(root: Path, name: str, cls: str, source: str = MODELS, **settings: Any) -> None:
    """Write <root>/<name>/model.py and a model-settings.json naming model.<cls>."""
    folder = root / name
    folder.mkdir()
    (folder / "model.py").write_text(source)
    (folder / "model-settings.json").write_text(
        json.dumps({"implementation": f"model.{cls}", **settings})
    )


@pytest.fixture(scope="module")
def examples() -> dict[str, ModelSettings]:
    return {settings.name: settings for settings in load_repository(EXAMPLES)}


@pytest.fixture
def repo(tmp_path: Path) -> dict[str, ModelSettings]:
    root = tmp_path / "repo"
    root.mkdir()
    log = str(tmp_path / "loads.txt")
    write_model(root, "pid", "Pid", parameters={"extra": {"log": log}})
    events = str(tmp_path / "events.txt")
    write_model(root, "tracked", "Tracked", parameters={"extra": {"events": events}})
    for name, cls in [
        ("nap", "Nap"),
        ("gate", "Gate"),
        ("large_answer", "LargeAnswer"),
        ("boom", "Boom"),
        ("boom_on_load", "BoomOnLoad"),
        ("quota", "Quota"),
        ("unpicklable", "RaisesUnpicklable"),
        ("returns_list", "ReturnsList"),
        ("returns_objects", "ReturnsObjects"),
        ("exit", "Exit"),
        ("sys_exit", "Exits"),
        ("params", "Params"),
        ("threads", "Threads"),
        ("count", "Count"),
        ("count_nap", "CountNap"),
        ("returns_unsendable", "ReturnsUnsendable"),
        ("returns_worker_only", "ReturnsWorkerOnly"),
        ("slow_worker_only", "SlowWorkerOnly"),
        ("holds_sockets", "HoldsSockets"),
        ("which_a", "Which"),
        ("which_b", "Which"),
    ]:
        write_model(root, name, cls)
    return {settings.name: settings for settings in load_repository(root)}


@pytest.fixture
async def pool() -> AsyncIterator[WorkerPool]:
    async with WorkerPool.open(1) as pool:
        yield pool


NO_PARAMETERS = Parameters()


async def test_reports_taken_whole_and_read_in_parts_are_the_results(
    pool: WorkerPool, examples: dict[str, ModelSettings]
) -> None:
    # Small answers come whole in one read (taken at once), large ones in parts: either kind
    # after the other, and several sent ahead at once, each is its call's.
    sizes = [1, 4096, 3, 70_000, 70_000, 2, 5000, 1]
    rng = np.random.default_rng(2)
    sent = [rng.standard_normal(size).astype(np.float32) for size in sizes]
    for array in sent:
        out = await pool.predict(examples["echo"], {"x": array}, NO_PARAMETERS)
        np.testing.assert_array_equal(out["x"], array)
    answers: dict[int, np.ndarray] = {}

    async def call(i: int) -> None:
        out = await pool.predict(examples["echo"], {"x": sent[i]}, NO_PARAMETERS)
        answers[i] = out["x"]

    async with trio.open_nursery() as nursery:
        for i in range(len(sent)):
            nursery.start_soon(call, i)
    for i, array in enumerate(sent):
        np.testing.assert_array_equal(answers[i], array)


async def test_example_models_compute_exact_results(
    pool: WorkerPool, examples: dict[str, ModelSettings]
) -> None:
    a = np.arange(32, dtype=np.float32).reshape(2, 16)
    b = np.full((2, 16), 0.5, dtype=np.float32)
    out = await pool.predict(examples["add_sub"], {"INPUT0": a, "INPUT1": b}, NO_PARAMETERS)
    assert out.keys() == {"OUTPUT0", "OUTPUT1"}
    assert out["OUTPUT0"].dtype == out["OUTPUT1"].dtype == np.float32
    np.testing.assert_array_equal(out["OUTPUT0"], a + b)
    np.testing.assert_array_equal(out["OUTPUT1"], a - b)

    echoed = {
        "text": np.array([[b"a", b""], [b"\x00\xff", b"longer"]], dtype=object),
        "ints": np.array([-1, 2**40], dtype=np.int64),
        "flags": np.array([True, False]),
    }
    out = await pool.predict(examples["echo"], echoed, NO_PARAMETERS)
    assert out.keys() == echoed.keys()
    for name, array in echoed.items():
        assert out[name].dtype == array.dtype
        np.testing.assert_array_equal(out[name], array)

    x = np.random.default_rng(1).standard_normal((3, 256)).astype(np.float32)
    weights = np.random.default_rng(0).standard_normal((256, 256)).astype(np.float32)
    out = await pool.predict(examples["dense"], {"x": x}, NO_PARAMETERS)
    assert out["y"].dtype == np.float32
    np.testing.assert_array_equal(out["y"], np.tanh(x @ weights))

    start = time.monotonic()
    out = await pool.predict(examples["sleep"], {"x": a}, Parameters({"delay_ms": 150}))
    assert time.monotonic() - start >= 0.15
    np.testing.assert_array_equal(out["x"], a)


@pytest.mark.parametrize("left", [0.05, 30.0])
async def test_a_deadline_given_to_predict_decides_as_the_callers_scopes_would(
    pool: WorkerPool, examples: dict[str, ModelSettings], left: float
) -> None:
    # The core gives the pool its call's deadline rather than have it walk up the cancel
    # scopes for it: a call is refused, or run, the same either way.
    sleep, nap = examples["sleep"], Parameters({"delay_ms": 200})
    await pool.predict(sleep, {}, nap)  # the model's recent call time: 200 ms

    async def outcome(given: bool) -> str:
        deadline = trio.current_time() + left
        try:
            if given:
                await pool.predict(sleep, {}, nap, deadline=deadline)
                return "ran"
            with trio.move_on_at(deadline) as scope:
                await pool.predict(sleep, {}, nap)
            return "cancelled" if scope.cancelled_caught else "ran"
        except InferError as error:
            # The milliseconds left differ from one call to the next.
            return f"{error.code.name}: {error.message.split(' and ')[0]}"

    from_scopes = await outcome(given=False)
    assert from_scopes == await outcome(given=True)
    if left < 0.2:
        assert from_scopes.startswith("DEADLINE_EXCEEDED: deadline exceeded: model 'sleep'")
    else:
        assert from_scopes == "ran"


async def test_sleep_rejects_a_bad_delay_with_its_own_status(
    pool: WorkerPool, examples: dict[str, ModelSettings]
) -> None:
    with pytest.raises(InvalidInput, match=r"^parameter 'delay_ms' must be a non-negative"):
        await pool.predict(examples["sleep"], {}, Parameters({"delay_ms": "soon"}))


async def test_model_sees_parameters_headers_and_tensor_parameters(
    pool: WorkerPool, repo: dict[str, ModelSettings]
) -> None:
    parameters = Parameters({"k": 7}, inputs={"x": {"scale": 0.5}}, headers={"X-User": "ann"})
    out = await pool.predict(repo["params"], {}, parameters)
    assert out["k"].tolist() == [7]
    assert out["user"].tolist() == [b"ann"]
    assert out["scale"].tolist() == [0.5]
    # Workers import the model code and what it needs, never Trio or the server.
    assert out["trio_loaded"].tolist() == [False]


async def test_model_exception_fails_the_call_with_its_type_and_message(
    pool: WorkerPool, repo: dict[str, ModelSettings]
) -> None:
    with pytest.raises(ModelFailed) as caught:
        await pool.predict(repo["boom"], {}, NO_PARAMETERS)
    assert caught.value.message == "ValueError: boom 42"
    assert caught.value.code == StatusCode.INTERNAL
    # An exception the server process could not unpickle still arrives as its message.
    with pytest.raises(ModelFailed, match=r"^RuntimeError: wrapped$"):
        await pool.predict(repo["unpicklable"], {}, NO_PARAMETERS)
    # The worker survived both.
    assert pool.statistics().crashed == 0


async def test_debug_appends_the_model_traceback(repo: dict[str, ModelSettings]) -> None:
    async with WorkerPool.open(1, debug=True) as pool:
        with pytest.raises(ModelFailed) as caught:
            await pool.predict(repo["boom"], {}, NO_PARAMETERS)
    first, _, rest = caught.value.message.partition("\n")
    assert first == "ValueError: boom 42"
    assert rest.startswith("Traceback (most recent call last):")
    assert 'raise ValueError("boom 42")' in rest


async def test_model_raised_infer_error_keeps_its_status(
    pool: WorkerPool, repo: dict[str, ModelSettings]
) -> None:
    with pytest.raises(InferError) as caught:
        await pool.predict(repo["quota"], {}, Parameters(headers={"x-user": "bob"}))
    assert caught.value.code == StatusCode.RESOURCE_EXHAUSTED
    assert caught.value.message == "quota of bob used up"


async def test_a_load_failure_fails_the_call_and_is_retried(
    pool: WorkerPool, repo: dict[str, ModelSettings]
) -> None:
    for _ in range(2):
        with pytest.raises(ModelFailed, match=r"^FileNotFoundError: weights.bin$"):
            await pool.predict(repo["boom_on_load"], {}, NO_PARAMETERS)


async def test_warm_up_failure_names_the_model(
    pool: WorkerPool, repo: dict[str, ModelSettings]
) -> None:
    with pytest.raises(ModelFailed) as caught:
        await pool.warm_up([repo["boom"], repo["boom_on_load"]])
    assert caught.value.message == (
        "loading model 'boom_on_load' failed: FileNotFoundError: weights.bin"
    )


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ("returns_list", "model 'returns_list': predict() returned list, expected dict"),
        ("returns_objects", "model 'returns_objects': output 'out' holds a Base; object arrays"),
        ("sys_exit", "SystemExit: 5"),
        (
            "returns_unsendable",
            "the result could not be sent to the server: TypeError: cannot send this",
        ),
    ],
)
async def test_wrong_outputs_and_sys_exit_fail_the_call(
    pool: WorkerPool, repo: dict[str, ModelSettings], model: str, message: str
) -> None:
    with pytest.raises(ModelFailed) as caught:
        await pool.predict(repo[model], {}, NO_PARAMETERS)
    assert caught.value.message.startswith(message)
    assert pool.statistics().crashed == 0


async def test_killed_worker_fails_its_call_and_the_pool_recovers(
    pool: WorkerPool, repo: dict[str, ModelSettings], tmp_path: Path
) -> None:
    pid_file = tmp_path / "nap.pid"

    async def kill_when_running() -> None:
        # The model writes its pid once it runs; it is another process, so poll (bounded).
        for _ in range(1000):
            if pid_file.exists() and pid_file.read_text():
                break
            await trio.sleep(0.01)
        os.kill(int(pid_file.read_text()), signal.SIGKILL)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(kill_when_running)
        with pytest.raises(Unavailable) as caught:
            await pool.predict(repo["nap"], {}, Parameters({"pid_file": str(pid_file)}))
    assert caught.value.message == (
        "worker process died while running model 'nap' (killed by signal SIGKILL)"
    )
    assert caught.value.code == StatusCode.UNAVAILABLE

    out = await pool.predict(repo["pid"], {}, NO_PARAMETERS)
    assert out["pid"].item() != int(pid_file.read_text())
    assert pool.statistics().crashed == 1


async def test_exiting_worker_fails_its_call_with_the_exit_code(
    pool: WorkerPool, repo: dict[str, ModelSettings], examples: dict[str, ModelSettings]
) -> None:
    with pytest.raises(
        Unavailable,
        match=r"^worker process died while running model 'exit' "
        r"\(exit code 3\)$",
    ):
        await pool.predict(repo["exit"], {}, NO_PARAMETERS)
    out = await pool.predict(examples["echo"], {"a": np.ones(2)}, NO_PARAMETERS)
    np.testing.assert_array_equal(out["a"], np.ones(2))


async def test_cancelled_call_kills_its_worker_promptly_and_the_pool_serves_again(
    pool: WorkerPool, examples: dict[str, ModelSettings]
) -> None:
    # Without the kill, the shielded call would hold this scope for the model's full 20 s.
    with trio.fail_after(10), trio.move_on_after(0.2) as scope:
        await pool.predict(examples["sleep"], {}, Parameters({"delay_ms": 20_000}))
    assert scope.cancelled_caught
    await eventually(lambda: pool.statistics().busy == 0)

    out = await pool.predict(examples["sleep"], {"a": np.ones(1)}, Parameters({"delay_ms": 0}))
    np.testing.assert_array_equal(out["a"], np.ones(1))
    assert pool.statistics().crashed == 0


async def test_a_call_cancelled_after_a_report_emptied_the_connection_kills_its_worker(
    pool: WorkerPool, examples: dict[str, ModelSettings]
) -> None:
    # The first call's report came in a read that emptied the connection: the receiver then
    # waits without reading again, and the cancel of the next call reaches its worker all the
    # same (without the kill, the shielded call would hold this scope for the full 20 s).
    out = await pool.predict(examples["sleep"], {"a": np.ones(1)}, Parameters({"delay_ms": 0}))
    np.testing.assert_array_equal(out["a"], np.ones(1))
    with trio.fail_after(10), trio.move_on_after(0.2) as scope:
        await pool.predict(examples["sleep"], {}, Parameters({"delay_ms": 20_000}))
    assert scope.cancelled_caught
    await eventually(lambda: pool.statistics().killed == 1)
    out = await pool.predict(examples["sleep"], {"a": np.ones(1)}, Parameters({"delay_ms": 0}))
    np.testing.assert_array_equal(out["a"], np.ones(1))
    assert pool.statistics().crashed == 0


async def test_each_worker_loads_a_model_once(
    repo: dict[str, ModelSettings], tmp_path: Path
) -> None:
    async with WorkerPool.open(2) as pool:
        await pool.warm_up([repo["pid"]])
        loaded = [int(line) for line in (tmp_path / "loads.txt").read_text().split()]
        assert len(set(loaded)) == 2
        assert pool.statistics().idle == 2

        seen: set[int] = set()

        async def call() -> None:
            out = await pool.predict(repo["pid"], {}, NO_PARAMETERS)
            seen.add(out["pid"].item())

        async with trio.open_nursery() as nursery:
            for _ in range(20):
                nursery.start_soon(call)
        assert seen <= set(loaded)
        assert sorted(int(x) for x in (tmp_path / "loads.txt").read_text().split()) == sorted(
            loaded
        )
        stats = pool.statistics()
        assert (stats.workers, stats.busy, stats.idle, stats.waiting) == (2, 0, 2, 0)

    # Leaving the pool stops its workers.
    for pid in loaded:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


async def test_redefined_settings_reload_the_model_in_the_worker(
    pool: WorkerPool, repo: dict[str, ModelSettings], tmp_path: Path
) -> None:
    pid = repo["pid"]
    other_log = tmp_path / "other-loads.txt"
    redefined = dataclasses.replace(
        pid, parameters=dataclasses.replace(pid.parameters, extra={"log": str(other_log)})
    )
    first = await pool.predict(pid, {}, NO_PARAMETERS)
    await pool.predict(pid, {}, NO_PARAMETERS)
    assert not other_log.exists()
    again = await pool.predict(redefined, {}, NO_PARAMETERS)
    await pool.predict(redefined, {}, NO_PARAMETERS)
    # The same worker loaded the redefined model, once, and the first definition only once.
    assert again["pid"].item() == first["pid"].item()
    assert other_log.read_text().split() == [str(first["pid"].item())]
    assert (tmp_path / "loads.txt").read_text().split() == [str(first["pid"].item())]


async def test_each_model_folder_imports_its_own_model_module(
    pool: WorkerPool, tmp_path: Path
) -> None:
    root = tmp_path / "two"
    root.mkdir()
    source = textwrap.dedent(
        """
        import numpy as np
        from trio_infer.model import Model

        class Answer(Model):
            def predict(self, inputs, parameters):
                return {"answer": np.array([ANSWER])}
        """
    )
    write_model(root, "one", "Answer", source.replace("ANSWER", "1"))
    write_model(root, "two", "Answer", source.replace("ANSWER", "2"))
    one, two = load_model_settings(root / "one"), load_model_settings(root / "two")
    for settings, answer in [(one, 1), (two, 2), (one, 1), (two, 2)]:
        out = await pool.predict(settings, {}, NO_PARAMETERS)
        assert out["answer"].item() == answer


async def test_workers_limit_blas_threads(repo: dict[str, ModelSettings]) -> None:
    for threads in (1, 2):
        async with WorkerPool.open(1, threads_per_worker=threads) as pool:
            out = await pool.predict(repo["threads"], {}, NO_PARAMETERS)
        assert set(out["threads"].tolist()) == {threads}


async def test_workers_run_model_code_as_batch_work_at_the_servers_nice(
    repo: dict[str, ModelSettings],
) -> None:
    # SCHED_BATCH: a worker woken by the call sent to it does not preempt the server's thread
    # on the core they share; its share of the CPU, set by its nice value, is the server's.
    # Every thread of the worker, a BLAS pool's too.
    for threads in (1, 2):
        async with WorkerPool.open(1, threads_per_worker=threads) as pool:
            out = await pool.predict(repo["threads"], {}, NO_PARAMETERS)
        assert set(out["policies"].tolist()) == {os.SCHED_BATCH}, threads
        assert out["nice"].item() == os.getpriority(os.PRIO_PROCESS, 0)


async def test_open_rejects_a_pool_without_workers() -> None:
    with pytest.raises(ValueError, match="workers must be at least 1, got 0"):
        async with WorkerPool.open(0):
            pass


async def test_a_call_after_the_pool_closed_is_unavailable(
    examples: dict[str, ModelSettings],
) -> None:
    async with WorkerPool.open(1) as pool:
        pass
    with pytest.raises(Unavailable, match=r"^the worker pool is shut down"):
        await pool.predict(examples["echo"], {}, NO_PARAMETERS)


async def test_calls_cancelled_before_they_start_are_skipped_and_leave_the_worker_alone(
    repo: dict[str, ModelSettings], tmp_path: Path
) -> None:
    calls = tmp_path / "calls.txt"
    async with WorkerPool.open(1) as pool:
        first = (await pool.predict(repo["pid"], {}, NO_PARAMETERS))["pid"].item()
        count = partial(pool.predict, repo["count"], {}, Parameters({"file": str(calls)}))
        async with trio.open_nursery() as nursery:
            _, release = await _hold_a_worker(pool, repo, nursery, tmp_path)
            # One call is sent to the worker behind the running one, the other waits in the
            # pool's queue; both are cancelled while the worker runs the first, which ends
            # only once they are.
            async with trio.open_nursery() as counts:
                counts.start_soon(count)
                counts.start_soon(count)
                await eventually(lambda: pool.statistics().waiting == 2)
                counts.cancel_scope.cancel()
            await eventually(lambda: pool.statistics().waiting == 0)
            release.touch()

        second = (await pool.predict(repo["pid"], {}, NO_PARAMETERS))["pid"].item()
        assert second == first
        assert not calls.exists()
        assert pool.statistics().crashed == 0


async def test_a_call_cancelled_behind_the_running_one_is_skipped_not_killed(
    repo: dict[str, ModelSettings], examples: dict[str, ModelSettings], tmp_path: Path
) -> None:
    # The call sent behind the running one, and its cancel, wait unread in the worker's socket
    # while the first runs. The worker must read them before it reports the first call's end,
    # and name the skipped call in that report: reported alone, the pool may read that report,
    # find the cancelled call first among the worker's calls with nothing more to read, and
    # kill the worker as running it (a race the pool won nearly every time). An input read
    # past the staging buffer (but small enough for the socket to hold it and the cancel while
    # the first call runs) leaves the cancel in the socket after the call is read: read only
    # when the worker asks the socket, the call is skipped; else it runs.
    calls = tmp_path / "calls.txt"
    behind_input = {"x": np.zeros(64 * 1024, np.uint8)}
    async with WorkerPool.open(1) as pool:
        first = (await pool.predict(repo["pid"], {}, NO_PARAMETERS))["pid"].item()
        for _ in range(5):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(
                    pool.predict, examples["sleep"], {}, Parameters({"delay_ms": 200})
                )
                await eventually(lambda: pool.statistics().busy == 1)
                async with trio.open_nursery() as behind:
                    behind.start_soon(
                        pool.predict,
                        repo["count"],
                        behind_input,
                        Parameters({"file": str(calls)}),
                    )
                    await eventually(lambda: pool.statistics().waiting == 1)
                    behind.cancel_scope.cancel()
            await eventually(lambda: pool.statistics().waiting == 0)
        second = (await pool.predict(repo["pid"], {}, NO_PARAMETERS))["pid"].item()
        assert second == first, "the worker was killed for a call it never ran"
        assert not calls.exists()


async def test_calls_sent_behind_a_call_whose_worker_dies_run_on_its_replacement(
    repo: dict[str, ModelSettings], tmp_path: Path
) -> None:
    pid_file = tmp_path / "nap.pid"
    async with WorkerPool.open(1) as pool:
        nap = Parameters({"pid_file": str(pid_file)})
        async with trio.open_nursery() as nursery:

            async def nap_and_fail() -> None:
                with pytest.raises(Unavailable, match="killed by signal SIGKILL"):
                    await pool.predict(repo["nap"], {}, nap)

            nursery.start_soon(nap_and_fail)
            await eventually(lambda: pid_file.exists() and bool(pid_file.read_text()))
            behind = trio.Event()
            pids: list[int] = []

            async def pid_call() -> None:
                behind.set()
                pids.append((await pool.predict(repo["pid"], {}, NO_PARAMETERS))["pid"].item())

            nursery.start_soon(pid_call)
            await behind.wait()
            await eventually(lambda: pool.statistics().waiting == 1)
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
        assert len(pids) == 1
        assert pids[0] != int(pid_file.read_text())
        assert pool.statistics().crashed == 1


async def test_calls_sent_behind_a_cancelled_call_run_on_the_replacement_worker(
    repo: dict[str, ModelSettings], examples: dict[str, ModelSettings]
) -> None:
    async with WorkerPool.open(1) as pool:
        first = (await pool.predict(repo["pid"], {}, NO_PARAMETERS))["pid"].item()
        scope = trio.CancelScope()
        pids: list[int] = []

        async def long_call() -> None:
            with scope:
                await pool.predict(examples["sleep"], {}, Parameters({"delay_ms": 20_000}))

        async def pid_call() -> None:
            pids.append((await pool.predict(repo["pid"], {}, NO_PARAMETERS))["pid"].item())

        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(long_call)
                await eventually(lambda: pool.statistics().busy == 1)
                nursery.start_soon(pid_call)
                await eventually(lambda: pool.statistics().waiting == 1)
                scope.cancel()
        assert len(pids) == 1
        assert pids[0] != first
        assert pool.statistics().crashed == 0


async def test_a_result_the_server_cannot_unpickle_fails_the_call_and_the_pool_goes_on(
    pool: WorkerPool, repo: dict[str, ModelSettings], examples: dict[str, ModelSettings]
) -> None:
    with pytest.raises(ModelFailed, match=r"^ModuleNotFoundError: .*while running model"):
        await pool.predict(repo["returns_worker_only"], {}, NO_PARAMETERS)
    out = await pool.predict(examples["echo"], {"a": np.ones(2)}, NO_PARAMETERS)
    np.testing.assert_array_equal(out["a"], np.ones(2))
    assert pool.statistics().crashed == 0


async def test_a_call_sent_behind_one_that_got_its_worker_killed_runs_again(
    pool: WorkerPool, repo: dict[str, ModelSettings], tmp_path: Path
) -> None:
    # The first call's result cannot be read here, so its worker is killed, and the second,
    # sent to it behind the first, may have started: it runs again on the replacement, once,
    # rather than fail for a call that was not its own.
    starts = tmp_path / "starts.txt"
    pids: list[int] = []

    async def second_call() -> None:
        parameters = Parameters({"file": str(starts), "delay_ms": 0})
        pids.append((await pool.predict(repo["count_nap"], {}, parameters))["pid"].item())

    async with trio.open_nursery() as nursery:

        async def first_call() -> None:
            with pytest.raises(ModelFailed, match=r"^ModuleNotFoundError: "):
                await pool.predict(repo["slow_worker_only"], {}, NO_PARAMETERS)

        nursery.start_soon(first_call)
        await eventually(lambda: pool.statistics().busy == 1)
        nursery.start_soon(second_call)
        await eventually(lambda: pool.statistics().waiting == 1)
    assert len(pids) == 1
    assert pids[0] == int(starts.read_text().split()[-1])  # it ran last on the replacement
    assert pool.statistics().killed == 1
    assert pool.statistics().crashed == 0


async def test_a_call_with_more_large_tensors_than_one_send_takes_crosses_both_ways(
    pool: WorkerPool, examples: dict[str, ModelSettings]
) -> None:
    # Each 16 KiB tensor is a buffer of its own; a system takes at most 1024 in one sendmsg.
    inputs = {f"t{i}": np.full(4096, i, np.float32) for i in range(1100)}
    out = await pool.predict(examples["echo"], inputs, NO_PARAMETERS)
    assert out.keys() == inputs.keys()
    np.testing.assert_array_equal(out["t1099"], inputs["t1099"])
    assert pool.statistics().crashed == 0


async def test_concurrent_large_calls_each_get_their_own_tensors_back(
    pool: WorkerPool, examples: dict[str, ModelSettings]
) -> None:
    # Frames larger than the socket takes at once, two sent ahead to the one worker, reports
    # read in pieces through the staging buffer: every call's bytes stay its own, in order.
    results: dict[int, np.ndarray] = {}

    async def call(i: int) -> None:
        x = np.full((64 + 997 * i, 256), i, np.float32)  # 64 KiB to 11 MiB
        results[i] = (await pool.predict(examples["echo"], {"x": x}, NO_PARAMETERS))["x"]

    async with trio.open_nursery() as nursery:
        for i in range(12):
            nursery.start_soon(call, i)
    assert sorted(results) == list(range(12))
    for i, y in results.items():
        assert y.shape == (64 + 997 * i, 256)
        assert (y == i).all()
    assert pool.statistics().crashed == 0


async def test_a_call_cancelled_after_it_ended_in_the_worker_leaves_the_next_one_running(
    repo: dict[str, ModelSettings], examples: dict[str, ModelSettings], tmp_path: Path
) -> None:
    # Which of the cancelled call and the reader of its report runs first is up to Trio's
    # scheduler: a few rounds make both orders likely.
    async with WorkerPool.open(1) as pool:
        for round in range(3):
            starts = tmp_path / f"starts-{round}.txt"
            first = trio.CancelScope()
            pids: list[int] = []

            async def first_call(first: trio.CancelScope = first) -> None:
                with first:
                    await pool.predict(examples["sleep"], {}, Parameters({"delay_ms": 200}))

            async def second_call(starts: Path = starts, pids: list[int] = pids) -> None:
                parameters = Parameters({"file": str(starts), "delay_ms": 100})
                pids.append((await pool.predict(repo["count_nap"], {}, parameters))["pid"].item())

            async with trio.open_nursery() as nursery:
                nursery.start_soon(first_call)
                await eventually(lambda: pool.statistics().busy == 1)
                nursery.start_soon(second_call)
                await eventually(lambda: pool.statistics().waiting == 1)
                # The event loop is blocked while the worker ends the first call and starts the
                # second; then the first is cancelled: its report is there to read, so the
                # worker must not be killed, nor the second call run again.
                stop = time.monotonic() + 10
                while not starts.exists() and time.monotonic() < stop:
                    time.sleep(0.01)  # noqa: ASYNC251 - blocking is the point
                first.cancel()
            assert len(pids) == 1
            assert starts.read_text().split() == [str(pids[0])]
        assert pool.statistics().crashed == 0


async def _hold_a_worker(
    pool: WorkerPool, repo: dict[str, ModelSettings], nursery: trio.Nursery, tmp_path: Path
) -> tuple[int, Path]:
    """Start a call that runs until the returned file exists; its worker's pid."""
    started, release = tmp_path / "gate.pid", tmp_path / "release"
    gate = Parameters({"pid_file": str(started), "release": str(release)})
    nursery.start_soon(pool.predict, repo["gate"], {}, gate)
    await eventually(lambda: started.exists() and bool(started.read_text()))
    return int(started.read_text()), release


async def test_a_busy_worker_loads_and_drops_a_model_after_its_call_holding_up_neither(
    repo: dict[str, ModelSettings], tmp_path: Path
) -> None:
    events = tmp_path / "events.txt"
    async with WorkerPool.open(2) as pool, trio.open_nursery() as nursery:
        busy, release = await _hold_a_worker(pool, repo, nursery, tmp_path)
        # The idle worker loads it while the other runs its call; neither the load nor the
        # unload waits for that call (the release comes only after both returned).
        assert await pool.warm_up([repo["tracked"]]) == 1
        [(what, idle)] = [line.split() for line in events.read_text().splitlines()]
        assert what == "load"
        assert int(idle) != busy
        out = await pool.predict(repo["tracked"], {}, NO_PARAMETERS)
        assert out["pid"].item() == int(idle)
        assert await pool.unload(repo["tracked"]) == 1
        assert events.read_text().split() == ["load", idle, "drop", idle]
        release.touch()
        # The busy worker, once its call ends, loads the model and then drops it, in the order
        # they were sent.
        await eventually(lambda: len(events.read_text().split()) == 8)
        assert events.read_text().split()[4:] == ["load", str(busy), "drop", str(busy)]
        with pytest.raises(Unavailable, match="model 'tracked' was unloaded"):
            await pool.predict(repo["tracked"], {}, NO_PARAMETERS)


async def test_a_cancelled_warm_up_leaves_no_worker_counted_as_holding_what_it_did_not_load(
    repo: dict[str, ModelSettings], tmp_path: Path
) -> None:
    events = tmp_path / "events.txt"
    async with WorkerPool.open(1) as pool:
        # The lane has no worker yet: its load waits for one, and is given up on with the
        # warm-up; the worker never loads the model.
        with trio.CancelScope() as scope:
            scope.cancel()
            await pool.warm_up([repo["tracked"]])
        await pool.predict(repo["pid"], {}, NO_PARAMETERS)  # a worker is up now
        assert not events.exists()
        # So the next warm-up loads it there rather than count that worker as warm.
        assert await pool.warm_up([repo["tracked"]]) == 1
        [(what, _)] = [line.split() for line in events.read_text().splitlines()]
        assert what == "load"


async def test_a_warm_up_whose_first_idle_worker_cannot_start_loads_the_last_one_at_once(
    repo: dict[str, ModelSettings], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from trio_infer.workers import pool as pool_module

    events = tmp_path / "events.txt"
    async with WorkerPool.open(3) as pool, trio.open_nursery() as nursery:
        busy, release = await _hold_a_worker(pool, repo, nursery, tmp_path)
        [busy] = [lane for lane in pool._lanes if lane.outstanding]
        first_idle = next(lane for lane in pool._lanes if lane is not busy)
        listening = pool_module._listening

        @contextlib.contextmanager
        def refusing(address: str) -> Iterator[Any]:
            if address == first_idle.address:
                raise OSError(24, "Too many open files")
            with listening(address) as listener:
                yield listener

        monkeypatch.setattr(pool_module, "_listening", refusing)
        # The first idle worker cannot start and the other runs a long call: the last idle
        # one, kept serving meanwhile, loads the models rather than wait for that call.
        with trio.fail_after(10):
            assert await pool.warm_up([repo["tracked"]], keep_serving=True) == 1
        [(what, pid)] = [line.split() for line in events.read_text().splitlines()]
        assert what == "load"
        assert int(pid) != busy
        release.touch()


async def test_a_queued_call_of_settings_unloaded_since_fails_rather_than_loading_them_again(
    repo: dict[str, ModelSettings], tmp_path: Path
) -> None:
    started, release = tmp_path / "gate.pid", tmp_path / "release"
    events = tmp_path / "events.txt"
    async with WorkerPool.open(1) as pool, trio.open_nursery() as nursery:
        assert await pool.warm_up([repo["tracked"]]) == 1
        gate = Parameters({"pid_file": str(started), "release": str(release)})

        async def gated() -> None:
            with pytest.raises(Unavailable, match="worker process died"):
                await pool.predict(repo["gate"], {}, gate)

        nursery.start_soon(gated)
        await eventually(lambda: started.exists() and bool(started.read_text()))
        late: list[BaseException] = []

        async def call() -> None:
            try:
                await pool.predict(repo["tracked"], {}, NO_PARAMETERS)
            except Unavailable as exc:
                late.append(exc)

        # A call sent behind the gated one, then the settings are unloaded (its grace period
        # is over); the worker dies, and the call goes back to the queue, behind the unload.
        nursery.start_soon(call)
        await eventually(lambda: len(pool._lanes[0].outstanding) == 2)
        await pool.unload(repo["tracked"])
        os.kill(int(started.read_text()), signal.SIGKILL)
        await eventually(lambda: bool(late))
        assert "model 'tracked' was unloaded" in str(late[0])
        # The replacement never loaded them.
        assert [line.split()[0] for line in events.read_text().splitlines()] == ["load"]


async def test_workers_that_cannot_start_fail_their_calls_and_the_pool_goes_on(
    examples: dict[str, ModelSettings], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A socket path longer than AF_UNIX allows: no worker can be given its connection.
    deep = tmp_path / ("d" * 120)
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    async with WorkerPool.open(1) as pool:
        for _ in range(2):
            with pytest.raises(Unavailable, match=r"^a worker process could not start \(OSError"):
                await pool.predict(examples["echo"], {}, NO_PARAMETERS)
        assert pool.statistics().busy == 0


async def test_a_late_call_of_unloaded_settings_fails_before_any_worker_loads_them_again(
    pool: WorkerPool, repo: dict[str, ModelSettings], tmp_path: Path
) -> None:
    pid = repo["pid"]
    first = int((await pool.predict(pid, {}, NO_PARAMETERS))["pid"][0])
    assert await pool.unload(pid) == 1
    # The worker that dropped them dies; its replacement never saw the unload.
    os.kill(first, signal.SIGKILL)
    await eventually(lambda: pool.statistics().crashed == 1)
    with pytest.raises(Unavailable, match="model 'pid' was unloaded"):
        await pool.predict(pid, {}, NO_PARAMETERS)
    loads = (tmp_path / "loads.txt").read_text().split()
    assert loads == [str(first)]  # loaded once, never again behind the unload
    # Loaded again on purpose (warm_up), the settings serve again.
    await pool.warm_up([pid])
    second = int((await pool.predict(pid, {}, NO_PARAMETERS))["pid"][0])
    assert second != first


def _dead(pid: int) -> bool:
    """Whether process ``pid`` has exited (a zombie, or reaped): its sockets are closed."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[-1].startswith("Z")
    except (FileNotFoundError, ProcessLookupError):
        # Reaped before the open, or between the open and the read (ESRCH).
        return True


def _block_until_dead(pid: int) -> None:
    """Block (no checkpoint: the event loop runs nothing meanwhile) until ``pid`` has exited,
    polling the kernel's view of it for at most 10 s."""
    for _ in range(10_000):
        if _dead(pid):
            return
        time.sleep(0.001)
    raise AssertionError(f"process {pid} is still alive 10 s after SIGKILL")


async def test_a_call_sent_to_an_idle_worker_that_died_unnoticed_runs_on_another(
    pool: WorkerPool, repo: dict[str, ModelSettings]
) -> None:
    pid = repo["pid"]
    first = int((await pool.predict(pid, {}, NO_PARAMETERS))["pid"][0])
    os.kill(first, signal.SIGKILL)
    # Waited for without a checkpoint: the pool's tasks have not run since the kill, so the
    # lane still takes its worker for idle and writes the call to it, which fails. The call
    # never reached the worker: it runs on the worker that replaces it, not fails as though
    # the worker had died running it.
    _block_until_dead(first)
    second = int((await pool.predict(pid, {}, NO_PARAMETERS))["pid"][0])
    assert second != first
    assert pool.statistics().crashed == 1


#: The number of writev where this runs: a worker waiting in it, with nothing reading the
#: server's side of its socket, has sent part of its answer and not the rest.
_WRITEV = {"x86_64": 20, "aarch64": 66}[os.uname().machine]


def _block_until_sending(pid: int) -> None:
    """Block (no checkpoint: the pool reads nothing meanwhile) until ``pid`` waits in writev,
    polling the kernel's view of it for at most 10 s."""
    for _ in range(10_000):
        if Path(f"/proc/{pid}/syscall").read_text().split()[0] == str(_WRITEV):
            return
        time.sleep(0.001)
    raise AssertionError(f"process {pid} is not sending after 10 s")


async def test_a_worker_killed_halfway_through_sending_a_large_buffer_fails_its_call_only(
    pool: WorkerPool, repo: dict[str, ModelSettings], tmp_path: Path
) -> None:
    pid_file, release = tmp_path / "large.pid", tmp_path / "release"
    parameters = Parameters({"pid_file": str(pid_file), "release": str(release)})
    large = repo["large_answer"]
    async with trio.open_nursery() as nursery:

        async def call_and_fail() -> None:
            with pytest.raises(Unavailable) as caught:
                await pool.predict(large, {}, parameters)
            assert caught.value.message == (
                "worker process died while running model 'large_answer' (killed by signal SIGKILL)"
            )

        nursery.start_soon(call_and_fail)
        await eventually(lambda: pid_file.exists() and bool(pid_file.read_text()))
        pid = int(pid_file.read_text())
        # From the release to the kill, no checkpoint: the worker sends what its socket
        # takes of the answer's buffer and dies waiting for the server to read the rest.
        release.touch()
        _block_until_sending(pid)
        os.kill(pid, signal.SIGKILL)
        _block_until_dead(pid)
    assert pool.statistics().crashed == 1
    # The replacement answers whole: nothing of the dead worker's frame is read into its own.
    pid_file.unlink()
    out = await pool.predict(large, {}, parameters)
    assert int(pid_file.read_text()) != pid
    assert out["y"].shape == (64 * 1024 * 1024,)
    assert bool((out["y"] == 1).all())


class _LaneTaskEnds(trio.abc.Instrument):
    """Sets ``ended`` as a lane's task running ``method`` ends, before the tasks its end wakes
    have run: ``_receive`` once its worker's connection closed, ``_run_process`` once its
    worker process exited."""

    def __init__(self, method: str) -> None:
        self._name = f"_Lane.{method}"
        self.ended = trio.Event()

    def task_exited(self, task: trio.lowlevel.Task) -> None:
        if task.name.endswith(self._name):
            self.ended.set()


async def test_a_call_that_comes_as_a_dead_workers_talk_ends_runs_on_the_next_worker(
    pool: WorkerPool, repo: dict[str, ModelSettings]
) -> None:
    # The receiver has read the dead worker's end and ended the talk; the lane's sender, idle
    # until then, has not unwound yet. A call that comes now must not be written to the dead
    # worker's connection, where it would count as one the worker died running. Trio runs the
    # tasks of one pass in either order, a coin toss a round: in twelve rounds the call comes
    # before the sender's unwinding in all but one run in 4,096.
    pid = repo["pid"]
    instrument = _LaneTaskEnds("_receive")
    trio.lowlevel.add_instrument(instrument)
    try:
        worker = int((await pool.predict(pid, {}, NO_PARAMETERS))["pid"][0])
        for _ in range(12):
            instrument.ended = trio.Event()
            os.kill(worker, signal.SIGKILL)
            await instrument.ended.wait()
            replacement = int((await pool.predict(pid, {}, NO_PARAMETERS))["pid"][0])
            assert replacement != worker
            worker = replacement
    finally:
        trio.lowlevel.remove_instrument(instrument)
    assert pool.statistics().crashed == 12


@pytest.mark.parametrize("calls", [1, 3])
async def test_calls_after_the_worker_exited_run_on_the_next_while_a_child_holds_its_connection(
    pool: WorkerPool, repo: dict[str, ModelSettings], calls: int
) -> None:
    # The worker's child holds the worker's connection open, so no end of it comes when the
    # worker is killed: the lane reads it for the worker's last reports a while longer. Calls
    # that come once the lane knows its worker exited must not be written to that connection,
    # which takes them, where the first would count as one the worker died running. Three are
    # more than the worker would have been sent at once: the third waits in the pool's queue.
    exited = _LaneTaskEnds("_run_process")
    trio.lowlevel.add_instrument(exited)
    ran_in: list[int] = []

    async def call() -> None:
        ran_in.append(int((await pool.predict(repo["pid"], {}, NO_PARAMETERS))["pid"][0]))

    try:
        out = await pool.predict(repo["holds_sockets"], {}, NO_PARAMETERS)
        worker, holder = int(out["pid"][0]), int(out["holder"][0])
        try:
            os.kill(worker, signal.SIGKILL)
            await exited.ended.wait()
            async with trio.open_nursery() as nursery:
                for _ in range(calls):
                    nursery.start_soon(call)
        finally:
            os.kill(holder, signal.SIGKILL)
    finally:
        trio.lowlevel.remove_instrument(exited)
    assert len(ran_in) == calls
    assert worker not in ran_in
    assert pool.statistics().crashed == 1


async def test_while_an_exited_workers_connection_is_held_open_other_lanes_serve_at_once(
    repo: dict[str, ModelSettings], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The worker's child holds the worker's connection open after the worker is killed: the
    # lane's talk goes on until the child exits (its bound on reading the last reports lifted,
    # so that the child's life alone decides it, whatever the machine's speed). Once the lane
    # knows its worker exited it is no worker the pool has: the other lane, which had none,
    # starts one for a call that comes then, and new sequences are pinned there, each served
    # while the dead worker's connection is still read.
    from trio_infer.workers import pool as pool_module

    monkeypatch.setattr(pool_module, "_LAST_REPORTS_TIME", math.inf)
    exited = _LaneTaskEnds("_run_process")
    trio.lowlevel.add_instrument(exited)
    try:
        async with WorkerPool.open(2) as pool:
            out = await pool.predict(repo["holds_sockets"], {}, NO_PARAMETERS)
            worker, holder = int(out["pid"][0]), int(out["holder"][0])
            try:
                # One call started one worker: the other lane has none.
                assert pool.statistics().started == 1
                [dead] = [lane for lane in pool._lanes if lane.pid == worker]
                os.kill(worker, signal.SIGKILL)
                await exited.ended.wait()

                def served_while_the_dead_workers_talk_goes_on(out: dict[str, Any]) -> int:
                    assert not _dead(holder)
                    assert dead.connected
                    pid = int(out["pid"][0])
                    assert pid != worker
                    return pid

                out = await pool.predict(repo["pid"], {}, NO_PARAMETERS)
                other = served_while_the_dead_workers_talk_goes_on(out)
                # Two sequences: each start goes to the least loaded lane, and the dead one
                # has neither calls nor sequences.
                for sequence in (1, 2):
                    flags = SequenceFlags(sequence, start=True, end=False)
                    out = await pool.predict(repo["pid"], {}, NO_PARAMETERS, sequence=flags)
                    assert served_while_the_dead_workers_talk_goes_on(out) == other
            finally:
                os.kill(holder, signal.SIGKILL)
            # The talk ends with the child: the worker's death is settled, and the sequences,
            # never the dead worker's, go on.
            await eventually(lambda: pool.statistics().crashed == 1)
            for sequence in (1, 2):
                flags = SequenceFlags(sequence, start=False, end=True)
                out = await pool.predict(repo["pid"], {}, NO_PARAMETERS, sequence=flags)
                assert int(out["pid"][0]) == other
    finally:
        trio.lowlevel.remove_instrument(exited)


async def test_a_busy_worker_takes_a_call_behind_its_own_rather_than_leave_it_to_an_exited_one(
    repo: dict[str, ModelSettings], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A worker sent a call while it runs one leaves it to a free worker, which starts it
    # sooner; a lane whose worker exited, its connection held open by the worker's child (as
    # long as the child lives: the bound on reading the last reports lifted), is none: the busy
    # worker is sent the call at once.
    from trio_infer.workers import pool as pool_module

    monkeypatch.setattr(pool_module, "_LAST_REPORTS_TIME", math.inf)
    exited = _LaneTaskEnds("_run_process")
    trio.lowlevel.add_instrument(exited)
    try:
        async with WorkerPool.open(2) as pool, trio.open_nursery() as nursery:
            assert await pool.warm_up([repo["pid"]]) == 2
            busy, release = await _hold_a_worker(pool, repo, nursery, tmp_path)
            [gated] = [lane for lane in pool._lanes if lane.outstanding]
            out = await pool.predict(repo["holds_sockets"], {}, NO_PARAMETERS)
            worker, holder = int(out["pid"][0]), int(out["holder"][0])
            try:
                [dead] = [lane for lane in pool._lanes if lane.pid == worker]
                assert dead is not gated
                os.kill(worker, signal.SIGKILL)
                await exited.ended.wait()
                ran_in: list[int] = []

                async def call() -> None:
                    ran_in.append(
                        int((await pool.predict(repo["pid"], {}, NO_PARAMETERS))["pid"][0])
                    )

                async with trio.open_nursery() as calls:
                    calls.start_soon(call)
                    await trio.testing.wait_all_tasks_blocked()
                    assert len(gated.outstanding) == 2
                    assert not _dead(holder)
                    assert dead.connected
                    release.touch()
                assert ran_in == [busy]
            finally:
                os.kill(holder, signal.SIGKILL)
    finally:
        trio.lowlevel.remove_instrument(exited)


async def test_a_call_left_to_a_killed_idle_worker_is_taken_by_a_busy_one_once_it_exited(
    repo: dict[str, ModelSettings], tmp_path: Path
) -> None:
    # A worker whose result cannot be read here is killed with no call left: until its lane
    # knows it exited, it takes no call yet counts as a free worker, so a busy worker leaves
    # a call that comes then to it. Once the lane knows, the busy worker must take that call
    # behind its own at once, not leave it to the killed one's replacement.
    exited = _LaneTaskEnds("_run_process")
    trio.lowlevel.add_instrument(exited)
    try:
        async with WorkerPool.open(2) as pool, trio.open_nursery() as nursery:
            assert await pool.warm_up([repo["pid"]]) == 2
            busy, release = await _hold_a_worker(pool, repo, nursery, tmp_path)
            [gated] = [lane for lane in pool._lanes if lane.outstanding]
            ran_in: list[int] = []

            async def call() -> None:
                ran_in.append(int((await pool.predict(repo["pid"], {}, NO_PARAMETERS))["pid"][0]))

            async with trio.open_nursery() as calls:
                with pytest.raises(ModelFailed, match=r"^ModuleNotFoundError: "):
                    await pool.predict(repo["returns_worker_only"], {}, NO_PARAMETERS)
                calls.start_soon(call)
                await exited.ended.wait()
                await trio.testing.wait_all_tasks_blocked()
                assert len(gated.outstanding) == 2
                release.touch()
            assert ran_in == [busy]
            assert pool.statistics().killed == 1
    finally:
        trio.lowlevel.remove_instrument(exited)


async def test_a_sequence_started_as_its_only_lanes_worker_exited_runs_on_the_next_worker(
    pool: WorkerPool, repo: dict[str, ModelSettings], monkeypatch: pytest.MonkeyPatch
) -> None:
    # One lane, whose worker exited while its child holds the worker's connection open (as
    # long as the child lives: the bound on reading the last reports lifted): a sequence
    # started then can only be pinned to that lane, and is not the dead worker's. It waits for
    # the next worker, which starts once the talk with the dead one has ended (when the child
    # exits), and runs there rather than being lost with the dead worker.
    from trio_infer.workers import pool as pool_module

    monkeypatch.setattr(pool_module, "_LAST_REPORTS_TIME", math.inf)
    exited = _LaneTaskEnds("_run_process")
    trio.lowlevel.add_instrument(exited)
    ran_in: list[int] = []

    async def start_a_sequence() -> None:
        flags = SequenceFlags("s", start=True, end=False)
        out = await pool.predict(repo["pid"], {}, NO_PARAMETERS, sequence=flags)
        ran_in.append(int(out["pid"][0]))

    try:
        out = await pool.predict(repo["holds_sockets"], {}, NO_PARAMETERS)
        worker, holder = int(out["pid"][0]), int(out["holder"][0])
        try:
            os.kill(worker, signal.SIGKILL)
            await exited.ended.wait()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(start_a_sequence)
                await trio.testing.wait_all_tasks_blocked()
                assert not ran_in
                assert not _dead(holder)
                os.kill(holder, signal.SIGKILL)
        finally:
            with contextlib.suppress(ProcessLookupError):  # reaped already
                os.kill(holder, signal.SIGKILL)
    finally:
        trio.lowlevel.remove_instrument(exited)
    [replacement] = ran_in
    assert replacement != worker
    flags = SequenceFlags("s", start=False, end=True)
    assert (await pool.predict(repo["pid"], {}, NO_PARAMETERS, sequence=flags))["pid"][0] == (
        replacement
    )
    assert pool.statistics().crashed == 1


@given(st.lists(st.floats(0.0, 10.0), max_size=40))
def test_a_models_shortest_recent_call_time_is_the_least_of_its_last_calls(
    seconds: list[float],
) -> None:
    # Kept as each time is learnt: at every step, the least of the last ones, 0 before any.
    times = _CallTimes()
    assert times.shortest == 0.0
    for index, each in enumerate(seconds):
        times.learn(each)
        last = seconds[max(index + 1 - _RECENT_CALLS, 0) : index + 1]
        assert list(times.recent) == last
        assert times.shortest == min(last)
