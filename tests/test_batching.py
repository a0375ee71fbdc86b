"""Adaptive batching: the planner's rule, and real batches on a real server with real workers.

The integration tests use a test model, ``Rows``, that echoes ``x`` as ``y`` and reports on every
row the row count of the batch it ran in and its worker's pid: a client sees directly whom it
shared a batch with. Requests run together only with equal parameters, so a test puts requests
in the same batch or in different ones by their parameters.
"""

from __future__ import annotations

import gc
import json
import logging
import math
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import trio
import trio.testing

from tests.probe import process_exists
from tests.support import GrpcioClient, eventually, start_server
from trio_infer.errors import InferError, ModelFailed, StatusCode
from trio_infer.model import Parameters
from trio_infer.protobuf._proto import grpc_predict_v2_pb2 as pb
from trio_infer.protobuf.codec import (
    decode_inputs,
    decode_outputs,
    encode_inputs,
    encode_parameters,
)
from trio_infer.repository.settings import EXAMPLES, ModelSettings, TensorSpec, load_repository
from trio_infer.scheduling import batching
from trio_infer.scheduling.batching import (
    BatchPlan,
    BatchStatistics,
    ModelBatcher,
    batch_key,
    batching_enabled,
    concatenate_inputs,
    plan_batch,
    split_outputs,
)
from trio_infer.scheduling.priority import DEFAULT_PRIORITY
from trio_infer.scheduling.reply import Reply
from trio_infer.scheduling.statistics import RequestTiming, Timing
from trio_infer.server import RunningServer

# -- the planner ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Waiting:
    key: Hashable = "k"
    rows: int = 1
    arrived: float = 0.0
    deadline: float = math.inf
    priority: int = DEFAULT_PRIORITY


def plan(
    *waiting: Waiting, now: float = 0.0, size: int = 8, time: float = 1.0, lead: float = 0.0
) -> BatchPlan:
    return plan_batch(waiting, now=now, max_batch_size=size, max_batch_time=time, lead=lead)


def test_an_empty_queue_waits_for_a_change() -> None:
    assert plan() == BatchPlan((), math.inf)


def test_a_full_batch_runs_at_once() -> None:
    queue = [Waiting(rows=3), Waiting(rows=5), Waiting(rows=1)]
    assert plan(*queue, size=8) == BatchPlan((0, 1), 0.0)


def test_a_batch_waits_until_its_oldest_member_has_waited_max_batch_time() -> None:
    queue = [Waiting(arrived=1.0), Waiting(arrived=1.5)]
    assert plan(*queue, now=1.6, time=2.0) == BatchPlan((), 3.0)
    assert plan(*queue, now=3.0, time=2.0) == BatchPlan((0, 1), 3.0)


def test_a_members_deadline_brings_its_batch_forward_by_the_lead() -> None:
    queue = [Waiting(arrived=0.0), Waiting(arrived=0.1, deadline=0.5)]
    assert plan(*queue, now=0.1, time=2.0, lead=0.2) == BatchPlan((), 0.3)
    assert plan(*queue, now=0.3, time=2.0, lead=0.2) == BatchPlan((0, 1), 0.3)


def test_a_member_already_past_its_latest_start_runs_at_once() -> None:
    queue = [Waiting(arrived=0.0, deadline=0.01)]
    assert plan(*queue, now=0.0, time=2.0, lead=0.05) == BatchPlan((0,), 0.0)


def test_zero_max_batch_time_runs_whatever_is_waiting_at_once() -> None:
    queue = [Waiting(rows=2), Waiting(rows=3)]
    assert plan(*queue, time=0.0) == BatchPlan((0, 1), 0.0)


def test_a_request_larger_than_max_batch_size_runs_alone() -> None:
    assert plan(Waiting(rows=20), Waiting(rows=1), size=8) == BatchPlan((0,), 0.0)


def test_a_batch_the_next_request_would_overflow_runs_at_once_and_nobody_overtakes() -> None:
    # 5 + 4 > 8 closes the first batch; the 1-row request behind the 4 rows must not jump in.
    queue = [Waiting(rows=5), Waiting(rows=4), Waiting(rows=1)]
    assert plan(*queue, size=8) == BatchPlan((0,), 0.0)
    assert plan(*queue[1:], size=8) == BatchPlan((), 1.0)


def test_with_full_only_a_full_batch_of_another_key_runs_before_an_older_open_one() -> None:
    queue = [Waiting("a", 2, arrived=0.0), Waiting("b", 8, arrived=0.5)]
    full_only = plan_batch(
        queue, now=5.0, max_batch_size=8, max_batch_time=1.0, lead=0.0, full_only=True
    )
    assert full_only == BatchPlan((1,), 5.0)
    assert plan_batch(
        queue[:1], now=5.0, max_batch_size=8, max_batch_time=1.0, lead=0.0, full_only=True
    ) == BatchPlan((), math.inf)


def test_requests_with_different_keys_never_share_a_batch() -> None:
    queue = [Waiting("a", 2), Waiting("b", 2), Waiting("a", 2), Waiting("b", 3)]
    assert plan(*queue, size=4) == BatchPlan((0, 2), 0.0)
    assert plan(queue[1], queue[3], size=4) == BatchPlan((0,), 0.0)  # 2 + 3 > 4: closed


def test_a_younger_key_that_is_due_runs_before_an_older_key_that_is_not() -> None:
    queue = [Waiting("a", arrived=0.0), Waiting("b", arrived=0.125, deadline=0.5)]
    assert plan(*queue, now=0.25, time=1.0, lead=0.25) == BatchPlan((1,), 0.25)
    assert plan(*queue, now=0.125, time=1.0, lead=0.25) == BatchPlan((), 0.25)


def test_the_oldest_ready_batch_runs_first() -> None:
    queue = [Waiting("a", 8), Waiting("b", 8)]
    assert plan(*queue, size=8) == BatchPlan((0,), 0.0)


def test_of_the_ready_batches_the_oldest_of_the_highest_level_runs_first() -> None:
    queue = [
        Waiting("low", 8, priority=3),
        Waiting("normal", 8, priority=2),
        Waiting("high", 1, priority=1),  # can still grow: not ready
        Waiting("high too", 8, priority=1),
        Waiting("high last", 8, priority=1),
    ]
    assert plan(*queue, size=8) == BatchPlan((3,), 0.0)
    assert plan(*queue[:3], size=8) == BatchPlan((1,), 0.0)
    assert plan(*queue[:3], size=8, now=1.0) == BatchPlan((2,), 1.0)


def test_with_full_only_no_batch_goes_ahead_of_a_waiting_one_of_a_higher_level() -> None:
    queue = [Waiting("high", 1, priority=1), Waiting("low", 8, priority=3)]
    options = {"now": 5.0, "max_batch_size": 8, "max_batch_time": 1.0, "lead": 0.0}
    assert plan_batch(queue, full_only=True, **options) == BatchPlan((), math.inf)
    assert plan_batch(queue[1:], full_only=True, **options) == BatchPlan((0,), 5.0)
    assert plan_batch(queue, **options) == BatchPlan((0,), 5.0)


# -- keys, rows, concatenation and splitting ----------------------------------------------------


def key_of(parameters: Parameters | None = None, **inputs: np.ndarray) -> Hashable:
    return batch_key(inputs, parameters or Parameters())


def test_requests_differing_only_in_row_count_have_the_same_key() -> None:
    assert key_of(x=np.zeros((1, 3), np.float32)) == key_of(x=np.zeros((7, 3), np.float32))
    a = {"x": np.zeros((1, 3)), "y": np.zeros((1,))}
    assert batch_key(a, Parameters()) == batch_key(dict(reversed(a.items())), Parameters())
    # Mappings equal in another order: the same key.
    values = {"p": 1, "q": "s"}
    per_tensor = {"x": {"r": 2.0, "s": True}, "y": {}}
    headers = {"x-user": "b", "user-agent": "c"}
    assert batch_key(a, Parameters(values, per_tensor, headers)) == batch_key(
        a,
        Parameters(
            dict(reversed(values.items())),
            {name: dict(reversed(own.items())) for name, own in reversed(per_tensor.items())},
            dict(reversed(headers.items())),
        ),
    )


@pytest.mark.parametrize(
    ("inputs", "parameters"),
    [
        ({"x": np.zeros((2, 4), np.float32)}, Parameters()),  # trailing dims
        ({"x": np.zeros((2, 3, 1), np.float32)}, Parameters()),  # rank
        ({"x": np.zeros((2, 3), np.float64)}, Parameters()),  # datatype
        ({"z": np.zeros((2, 3), np.float32)}, Parameters()),  # name
        ({"x": np.zeros((2, 3), np.float32)}, Parameters({"p": 2})),  # a parameter's value
        ({"x": np.zeros((2, 3), np.float32)}, Parameters({"p": True})),  # ... or its type
        ({"x": np.zeros((2, 3), np.float32)}, Parameters({"p": 1}, inputs={"x": {"q": 1}})),
        ({"x": np.zeros((2, 3), np.float32)}, Parameters({"p": 1}, headers={"x-user": "b"})),
    ],
)
def test_requests_that_differ_otherwise_have_different_keys(
    inputs: dict[str, np.ndarray], parameters: Parameters
) -> None:
    reference = key_of(Parameters({"p": 1}), x=np.zeros((2, 3), np.float32))
    assert batch_key(inputs, parameters) != reference


def test_batching_is_on_for_max_batch_size_above_one_with_a_batch_dimension() -> None:
    examples = {settings.name: settings for settings in load_repository(EXAMPLES)}
    assert [name for name, s in examples.items() if batching_enabled(s)] == ["add_sub", "dense"]
    x = (TensorSpec("x", "FP32", (-1, 3)),)
    assert batching_enabled(ModelSettings("m", "a.B", inputs=x, max_batch_size=2))
    assert not batching_enabled(ModelSettings("m", "a.B", inputs=x, max_batch_size=1))
    fixed = (TensorSpec("x", "FP32", (4, 3)),)
    assert not batching_enabled(ModelSettings("m", "a.B", inputs=fixed, max_batch_size=8))


def test_a_batch_of_one_passes_its_inputs_through_and_larger_ones_concatenate() -> None:
    one = {"x": np.arange(3.0).reshape(1, 3)}
    assert concatenate_inputs([one])["x"] is one["x"]
    two = {"x": np.arange(6.0).reshape(2, 3)}
    joined = concatenate_inputs([one, two])
    np.testing.assert_array_equal(joined["x"], np.concatenate([one["x"], two["x"]]))


def test_outputs_are_split_by_each_members_row_count() -> None:
    y = np.arange(12).reshape(6, 2)
    parts = split_outputs({"y": y}, [1, 0, 2, 3], "m")
    assert [part["y"].tolist() for part in parts] == [
        y[:1].tolist(),
        [],
        y[1:3].tolist(),
        y[3:].tolist(),
    ]


def test_members_of_a_batch_get_their_own_rows_and_a_batch_of_one_the_outputs() -> None:
    # A response is sent from its arrays' memory: a member slow to read its response must
    # hold its rows, not the whole batch's.
    y = np.arange(12).reshape(6, 2)
    assert not any(np.shares_memory(part["y"], y) for part in split_outputs({"y": y}, [2, 4], "m"))
    [alone] = split_outputs({"y": y}, [6], "m")
    assert alone["y"] is y


@pytest.mark.parametrize("output", [np.zeros((5, 2)), np.float32(1.0) * np.ones(())])
def test_an_output_without_the_batchs_rows_fails_the_batch_naming_the_output(
    output: np.ndarray,
) -> None:
    with pytest.raises(ModelFailed) as caught:
        split_outputs({"y": np.zeros((6, 2)), "z": output}, [1, 5], "m")
    shape = list(output.shape)
    assert caught.value.message == (
        f"model 'm' output 'z' has shape {shape}, but a batched model must return one row per "
        "input row: its batch had 6 row(s)"
    )


# -- a crashing batcher (a fake pool stands in for a bug; tests/test_failures.py does it for real)


class CrashingPool:
    """Fails its first call with something no pool raises, once ``release`` is set; echoes ``x``
    as ``y`` afterwards."""

    def __init__(self) -> None:
        self.calls = 0
        self.release = trio.Event()

    async def predict(
        self,
        settings: ModelSettings,
        inputs: dict[str, np.ndarray],
        parameters: Parameters,
        priority: int = DEFAULT_PRIORITY,
        *,
        timing: Timing | None = None,
        deadline: float | None = None,
    ) -> dict[str, np.ndarray]:
        self.calls += 1
        if self.calls == 1:
            await self.release.wait()
            raise RuntimeError("a bug")
        return {"y": inputs["x"]}


CRASHED = (
    "internal error in the batching of model 'm': the batcher holding the request crashed "
    "(logged by the server)"
)


async def test_a_crashing_batcher_fails_only_the_requests_it_held_and_is_replaced(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A batch time, so that the first request waits for a batcher rather than going alone.
    settings = ModelSettings("m", "a.B", max_batch_size=4, max_batch_time=0.001)
    pool = CrashingPool()
    batcher = ModelBatcher(settings, pool, batchers=1)
    errors: list[InferError] = []
    served: list[int] = []

    async def request(key: int = 0) -> None:
        parameters = Parameters({"key": key})
        try:
            outputs = await batcher.predict({"x": np.full((1, 2), key)}, 1, parameters, math.inf)
        except InferError as exc:
            errors.append(exc)
        else:
            served.append(int(outputs["y"][0, 0]))

    async with trio.open_nursery() as nursery:
        await nursery.start(batcher.run)
        nursery.start_soon(request)
        await eventually(lambda: pool.calls == 1)
        nursery.start_soon(request, 1)  # it queues behind the batch that will crash
        nursery.start_soon(request, 2)
        await eventually(lambda: batcher.statistics().waiting == 2)
        pool.release.set()
        await eventually(lambda: len(errors) + len(served) == 3)
        await request(3)  # the replacement batcher serves later requests too
        nursery.cancel_scope.cancel()
    assert [(e.code, e.message) for e in errors] == [(StatusCode.INTERNAL, CRASHED)]
    assert sorted(served) == [1, 2, 3]
    stats = batcher.statistics()
    assert (stats.batches, stats.waiting, stats.batcher_crashes) == (4, 0, 1)
    [record] = [r for r in caplog.records if r.name == "trio_infer.scheduling.batching"]
    assert record.levelno == logging.ERROR
    assert record.getMessage() == (
        "internal error: a batcher of model 'm' crashed while running a batch (RuntimeError: a "
        "bug); the 1 request(s) it held failed, and a fresh batcher replaces it"
    )
    assert "Traceback" in caplog.text
    assert "RuntimeError: a bug" in caplog.text


async def test_a_batcher_that_crashes_while_planning_fails_the_queue_it_planned_from(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The planner is a pure function: nothing real makes it raise, so it is made to, once.
    settings = ModelSettings("m", "a.B", max_batch_size=4, max_batch_time=0.0)
    pool = CrashingPool()
    pool.calls = 1  # no crash in the pool
    batcher = ModelBatcher(settings, pool, batchers=1)
    real_plan = batching.plan_batch
    crashes = 0

    def plan_once(waiting: Any, **kwargs: Any) -> BatchPlan:
        nonlocal crashes
        if len(waiting) == 2 and not crashes:
            crashes += 1
            raise AssertionError("a planning bug")
        return real_plan(waiting, **kwargs)

    monkeypatch.setattr(batching, "plan_batch", plan_once)
    errors: list[InferError] = []

    async def request() -> None:
        with pytest.raises(InferError) as caught:
            await batcher.predict({"x": np.zeros((1, 2))}, 1, Parameters(), math.inf)
        errors.append(caught.value)

    async with trio.open_nursery() as nursery:
        # Both join the queue before the batchers start, so the first plan sees both (Trio
        # runs ready tasks in a random order).
        nursery.start_soon(request)
        nursery.start_soon(request)
        await eventually(lambda: batcher.statistics().waiting == 2)
        await nursery.start(batcher.run)
        await eventually(lambda: len(errors) == 2)
        outputs = await batcher.predict({"x": np.ones((1, 2))}, 1, Parameters(), math.inf)
        nursery.cancel_scope.cancel()
    assert [(e.code, e.message) for e in errors] == [(StatusCode.INTERNAL, CRASHED)] * 2
    assert outputs["y"].tolist() == [[1.0, 1.0]]
    assert batcher.statistics().batcher_crashes == 1
    [record] = [r for r in caplog.records if r.name == "trio_infer.scheduling.batching"]
    assert "crashed while planning a batch (AssertionError: a planning bug)" in record.getMessage()
    assert "the 2 request(s) it held failed" in record.getMessage()


async def test_a_request_that_finds_nothing_of_its_model_running_or_waiting_goes_at_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # From the request's own task, not a batcher's; the next, while it runs, waits for one.
    settings = ModelSettings("m", "a.B", max_batch_size=4, max_batch_time=0.0)
    pool = GatedPool()
    callers: list[str] = []
    gated_predict = pool.predict

    async def predict(*args: Any, **kwargs: Any) -> dict[str, np.ndarray]:
        callers.append(trio.lowlevel.current_task().name.rsplit(".", 1)[-1])
        return await gated_predict(*args, **kwargs)

    pool.predict = predict  # type: ignore[method-assign]
    batcher = ModelBatcher(settings, pool, batchers=2)
    served: list[int] = []

    async def request() -> None:
        outputs = await batcher.predict({"x": np.ones((1, 2))}, 1, Parameters(), math.inf)
        served.append(len(outputs["y"]))

    async with trio.open_nursery() as nursery:
        await nursery.start(batcher.run)
        for _ in range(2):
            nursery.start_soon(request)
            await trio.testing.wait_all_tasks_blocked()
        assert callers == ["request", "_batcher"]
        pool.release.set()
        await eventually(lambda: len(served) == 2)
        # Both ended, nothing waits: the next request goes at once again.
        nursery.start_soon(request)
        await eventually(lambda: len(served) == 3)
        nursery.cancel_scope.cancel()
    assert callers == ["request", "_batcher", "request"]
    stats = batcher.statistics()
    assert (stats.batches, stats.requests, stats.rows) == (3, 3, 3)

    # A bug met on that path fails its request as a crashed batcher's would, and is counted.
    crash_pool = CrashingPool()
    crash_pool.release.set()
    crashing = ModelBatcher(settings, crash_pool, batchers=1)
    async with trio.open_nursery() as nursery:
        await nursery.start(crashing.run)
        with pytest.raises(InferError) as caught:
            await crashing.predict({"x": np.ones((1, 2))}, 1, Parameters(), math.inf)
        outputs = await crashing.predict({"x": np.ones((1, 2))}, 1, Parameters(), math.inf)
        nursery.cancel_scope.cancel()
    assert (caught.value.code, caught.value.message) == (StatusCode.INTERNAL, CRASHED)
    assert outputs["y"].tolist() == [[1.0, 1.0]]
    assert crashing.statistics().batcher_crashes == 1
    [record] = [r for r in caplog.records if r.name == "trio_infer.scheduling.batching"]
    assert record.getMessage() == (
        "internal error: a batch of one of model 'm' crashed (RuntimeError: a bug); its request "
        "failed"
    )


class GatedPool:
    """Holds every call until ``release`` is set; counts the calls it holds."""

    def __init__(self) -> None:
        self.holding = 0
        self.release = trio.Event()
        self.calls: list[tuple[int, int]] = []
        """Each call's rows and priority, in the order they came."""

    async def predict(
        self,
        settings: ModelSettings,
        inputs: dict[str, np.ndarray],
        parameters: Parameters,
        priority: int = DEFAULT_PRIORITY,
        *,
        timing: Timing | None = None,
        deadline: float | None = None,
    ) -> dict[str, np.ndarray]:
        self.holding += 1
        self.calls.append((len(inputs["x"]), priority))
        try:
            await self.release.wait()
            return {"y": inputs["x"]}
        finally:
            self.holding -= 1


async def test_a_request_waits_in_the_queue_from_when_it_reaches_the_batcher(
    mock_clock: trio.testing.MockClock,
) -> None:
    # The first goes at once (a batch of one, from its own task), the second joins the queue
    # behind it: each one's queue wait starts at its arrival, as the core does not set it.
    settings = ModelSettings("m", "a.B", max_batch_size=4, max_batch_time=0.0)
    pool = GatedPool()
    batcher = ModelBatcher(settings, pool, batchers=1)
    timings = [Timing(), Timing()]
    arrivals: list[float] = []
    served: list[Timing] = []

    async def request(timing: Timing) -> None:
        arrivals.append(trio.current_time())
        await batcher.predict({"x": np.ones((1, 2))}, 1, Parameters(), math.inf, timing=timing)
        served.append(timing)

    async with trio.open_nursery() as nursery:
        await nursery.start(batcher.run)
        for timing in timings:
            nursery.start_soon(request, timing)
            await trio.testing.wait_all_tasks_blocked()
            mock_clock.jump(1.0)
        assert (pool.holding, batcher.statistics().waiting) == (1, 1)
        pool.release.set()
        await trio.testing.wait_all_tasks_blocked()
        assert served == timings
        nursery.cancel_scope.cancel()
    assert [timing.queued for timing in timings] == arrivals
    assert arrivals[1] - arrivals[0] == 1.0


async def test_only_a_full_batch_goes_to_the_pool_ahead_of_a_free_worker() -> None:
    settings = ModelSettings("m", "a.B", max_batch_size=4, max_batch_time=0.0)
    pool = GatedPool()
    batcher = ModelBatcher(settings, pool, batchers=1, ahead=1)
    served: list[int] = []

    async def request() -> None:
        out = await batcher.predict({"x": np.ones((1, 2))}, 1, Parameters(), math.inf)
        served.append(len(out["y"]))

    async with trio.open_nursery() as nursery:
        await nursery.start(batcher.run)
        nursery.start_soon(request)
        await trio.testing.wait_all_tasks_blocked()
        # The first batch holds the only worker; two rows could still be joined by others.
        for _ in range(2):
            nursery.start_soon(request)
        await trio.testing.wait_all_tasks_blocked()
        assert (pool.holding, batcher.statistics().waiting) == (1, 2)
        # Four rows fill a batch: it goes ahead.
        for _ in range(2):
            nursery.start_soon(request)
        await trio.testing.wait_all_tasks_blocked()
        assert (pool.holding, batcher.statistics().waiting) == (2, 0)
        pool.release.set()
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    assert served == [1] * 5
    assert batcher.statistics().batches == 2


async def test_a_request_that_fills_a_batch_alone_goes_to_the_pool_directly() -> None:
    settings = ModelSettings("m", "a.B", max_batch_size=4, max_batch_time=10.0)
    pool = GatedPool()
    batcher = ModelBatcher(settings, pool, batchers=1)

    async def request(rows: int) -> None:
        out = await batcher.predict({"x": np.ones((rows, 2))}, rows, Parameters(), math.inf)
        assert len(out["y"]) == rows

    async with trio.open_nursery() as nursery:
        await nursery.start(batcher.run)
        nursery.start_soon(request, 1)  # waits up to max_batch_time for others to join it
        nursery.start_soon(request, 4)
        nursery.start_soon(request, 5)
        await trio.testing.wait_all_tasks_blocked()
        assert (pool.holding, batcher.statistics().waiting) == (2, 1)
        pool.release.set()
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    statistics = batcher.statistics()
    assert (statistics.alone, statistics.batches) == (2, 0)


async def test_batches_of_a_higher_priority_run_first_and_levels_never_share_one() -> None:
    settings = ModelSettings("m", "a.B", max_batch_size=4, max_batch_time=0.0)
    pool = GatedPool()
    batcher = ModelBatcher(settings, pool, batchers=1)

    async def request(priority: int) -> None:
        await batcher.predict({"x": np.ones((1, 2))}, 1, Parameters(), math.inf, priority)

    async with trio.open_nursery() as nursery:
        await nursery.start(batcher.run)
        async with trio.open_nursery() as requests:
            requests.start_soon(request, 2)
            await trio.testing.wait_all_tasks_blocked()
            for priority in (3, 2, 3, 1, 1):
                requests.start_soon(request, priority)
                await trio.testing.wait_all_tasks_blocked()
            assert (pool.holding, batcher.statistics().waiting) == (1, 5)
            pool.release.set()
        nursery.cancel_scope.cancel()
    assert pool.calls == [(1, 2), (2, 1), (1, 2), (2, 3)]


# -- real batches on a real server -------------------------------------------------------------

ROWS_MODEL = """
import os
import time
from pathlib import Path

import numpy as np

from trio_infer import Model


class Rows(Model):
    def predict(self, inputs, parameters):
        tag = parameters.get("tag")
        if tag:
            log = Path(self.settings.parameters.extra["log_dir"]) / f"{tag}.start"
            log.write_text(str(os.getpid()))
        time.sleep(parameters.get("delay_ms", 0) / 1000)
        action = parameters.get("action", "ok")
        if action == "fail":
            raise ValueError("this batch is cursed")
        if action == "exit":
            os._exit(3)
        x = inputs["x"]
        rows = len(x) - 1 if action == "short" else len(x)
        outputs = {
            "y": x,
            "batch_rows": np.full(rows, len(x), np.int64),
            "pid": np.full(rows, os.getpid(), np.int64),
        }
        # Answers that are not the declared outputs (when the settings declare them).
        if action == "wide":
            outputs["y"] = np.zeros((len(x), x.shape[1] + 1), x.dtype)
        elif action == "int32":
            outputs["pid"] = outputs["pid"].astype(np.int32)
        elif action == "missing":
            del outputs["pid"]
        elif action == "extra":
            outputs["z"] = x
        return outputs
"""


class Repository:
    """A model repository in a temporary folder, and the log the Rows model writes to."""

    def __init__(self, root: Path) -> None:
        self.root = root / "repository"
        self.log = root / "log"
        self.root.mkdir()
        self.log.mkdir()

    def add(self, name: str, **settings: Any) -> Repository:
        folder = self.root / name
        folder.mkdir()
        (folder / "rows_model.py").write_text(ROWS_MODEL)
        document = {"name": name, "implementation": "rows_model.Rows", **settings}
        document.setdefault("parameters", {"extra": {"log_dir": str(self.log)}})
        (folder / "model-settings.json").write_text(json.dumps(document))
        return self

    def add_example(self, example: str, name: str, **batching: float) -> Repository:
        document = json.loads((EXAMPLES / example / "model-settings.json").read_text())
        folder = self.root / name
        folder.mkdir()
        document |= batching | {"name": name}
        (folder / "model-settings.json").write_text(json.dumps(document))
        return self

    def pid(self, tag: str) -> int:
        return int((self.log / f"{tag}.start").read_text())


def request_for(
    model: str, inputs: Mapping[str, np.ndarray], **parameters: bool | int | float | str
) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=model)
    encode_inputs(request, list(inputs.items()), raw=True)
    encode_parameters(request.parameters, parameters)
    return request


class Calls:
    """Concurrent grpcio calls: each starts at once on grpcio's own threads."""

    def __init__(self, client: GrpcioClient) -> None:
        self.client = client

    def start(self, request: pb.ModelInferRequest, timeout: float | None = 10.0) -> Any:
        return self.client.stub.ModelInfer.future(request, timeout=timeout)

    async def outputs(self, future: Any) -> dict[str, np.ndarray]:
        return decode_outputs(await trio.to_thread.run_sync(future.result))

    async def error(self, future: Any) -> grpc.RpcError:
        error = await trio.to_thread.run_sync(future.exception)
        assert isinstance(error, grpc.RpcError), error
        return error


def statistics(server: RunningServer, model: str) -> BatchStatistics:
    batcher = server.core.batching.get(model)
    assert batcher is not None
    return batcher.statistics()


def rows_request(rows: int, cols: int = 3, dtype: type = np.float32, **parameters: Any) -> Any:
    x = np.arange(rows * cols).reshape(rows, cols).astype(dtype)
    return request_for("rows", {"x": x}, **parameters)


async def test_batched_results_equal_unbatched_results(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    # add_sub is element-wise, so a batched row is bit for bit the row run alone. dense is a
    # matrix product: BLAS picks its kernel (gemv for one row, gemm blocked by the row count,
    # per CPU) by the batch's size, and float rounding follows the kernel (~1e-5), so its rows
    # are compared within that. A row routed back to the wrong request differs by ~1.
    rows = {"add_sub": [1, 2, 3, 5], "dense": [2, 3, 4, 7]}
    repository = Repository(tmp_path)
    for model, sizes in rows.items():
        repository.add_example(model, model, max_batch_size=sum(sizes), max_batch_time=5.0)
        repository.add_example(model, f"{model}_alone", max_batch_size=0)
    server = await start_server(nursery, repository.root)
    client = GrpcioClient(server.port)
    calls = Calls(client)
    rng = np.random.default_rng(3)
    for model, sizes in rows.items():
        names = ["INPUT0", "INPUT1"] if model == "add_sub" else ["x"]
        cols = 16 if model == "add_sub" else 256
        requests = [
            request_for(model, {n: rng.standard_normal((r, cols), np.float32) for n in names})
            for r in sizes
        ]
        batched = [calls.start(request) for request in requests]
        for request, future in zip(requests, batched, strict=True):
            alone = pb.ModelInferRequest()
            alone.CopyFrom(request)
            alone.model_name = f"{model}_alone"
            expected = decode_outputs(await client.call("ModelInfer", alone, timeout=10))
            got = await calls.outputs(future)
            assert got.keys() == expected.keys()
            for name in got:
                if model == "add_sub":
                    np.testing.assert_array_equal(got[name], expected[name], strict=True)
                else:
                    assert got[name].shape == expected[name].shape
                    np.testing.assert_allclose(got[name], expected[name], rtol=0, atol=1e-4)
        stats = statistics(server, model)
        assert (stats.batches, stats.max_batch_requests, stats.rows) == (1, 4, sum(sizes))


async def test_requests_with_other_trailing_shapes_datatypes_or_parameters_never_share_a_batch(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    repository = Repository(tmp_path).add("rows", max_batch_size=4, max_batch_time=0.3)
    server = await start_server(nursery, repository.root)
    calls = Calls(GrpcioClient(server.port))
    sent = {
        "a": rows_request(1),
        "b": rows_request(2),  # joins a: 3 rows of 4, so the batch waits max_batch_time
        "other shape": rows_request(1, cols=4),
        "other datatype": rows_request(1, dtype=np.int32),
        "other parameters": rows_request(1, mode=1),
    }
    futures = {name: calls.start(request) for name, request in sent.items()}
    batch_rows = {}
    for name, future in futures.items():
        outputs = await calls.outputs(future)
        np.testing.assert_array_equal(outputs["y"], decode_inputs(sent[name])["x"])
        batch_rows[name] = int(outputs["batch_rows"][0])
    assert batch_rows == {
        "a": 3,
        "b": 3,
        "other shape": 1,
        "other datatype": 1,
        "other parameters": 1,
    }
    stats = statistics(server, "rows")
    assert (stats.batches, stats.requests, stats.max_batch_requests) == (4, 5, 2)


async def test_a_batch_never_waits_past_a_members_deadline(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    repository = Repository(tmp_path).add("rows", max_batch_size=64, max_batch_time=30.0)
    server = await start_server(nursery, repository.root)
    client = GrpcioClient(server.port)
    # An answer after the deadline would be DEADLINE_EXCEEDED: this one waited for company
    # until just before it, not for max_batch_time.
    response = await client.call("ModelInfer", rows_request(2), timeout=0.5)
    assert decode_outputs(response)["batch_rows"].tolist() == [2, 2]
    assert 0.4 < statistics(server, "rows").max_queue_wait < 0.5


async def test_queued_requests_that_expire_or_are_cancelled_leave_and_the_rest_run(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    # One worker, so one batcher: while "s" runs, everything else queues.
    repository = Repository(tmp_path).add("rows", max_batch_size=64, max_batch_time=0.0)
    server = await start_server(nursery, repository.root, workers=1)
    calls = Calls(GrpcioClient(server.port))
    running = calls.start(rows_request(1, tag="s", delay_ms=800))
    await eventually(lambda: (repository.log / "s.start").exists())
    expires = calls.start(rows_request(1, tag="g1"), timeout=0.2)
    cancelled = calls.start(rows_request(2, tag="g1"), timeout=None)
    survivor = calls.start(rows_request(3, tag="g1"))
    # A batch whose members all leave never runs.
    gone = [calls.start(rows_request(1, tag="g2"), timeout=t) for t in (0.2, 0.3)]
    await eventually(lambda: statistics(server, "rows").waiting == 5)
    cancelled.cancel()
    await eventually(lambda: statistics(server, "rows").waiting == 4)
    for future in [expires, *gone]:
        assert (await calls.error(future)).code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert (await calls.outputs(running))["batch_rows"].tolist() == [1]
    assert (await calls.outputs(survivor))["batch_rows"].tolist() == [3, 3, 3]
    assert not (repository.log / "g2.start").exists()
    stats = statistics(server, "rows")
    assert (stats.batches, stats.requests, stats.abandoned, stats.waiting) == (2, 2, 4, 0)


async def test_a_member_that_leaves_a_running_batch_gets_its_status_and_the_others_results(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    repository = Repository(tmp_path).add("rows", max_batch_size=3, max_batch_time=5.0)
    server = await start_server(nursery, repository.root, workers=1)
    client = GrpcioClient(server.port)
    calls = Calls(client)
    leaver = calls.start(rows_request(1, tag="ab", delay_ms=1500), timeout=0.3)
    stayer = calls.start(rows_request(2, tag="ab", delay_ms=1500))
    assert (await calls.error(leaver)).code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # The server has finished the leaver's call, not just its client: one call is left.
    await eventually(lambda: server.statistics().admission.in_flight == {"rows": 1})
    outputs = await calls.outputs(stayer)
    assert outputs["batch_rows"].tolist() == [3, 3]
    # The worker was not killed for the leaver: it answers the next call too.
    pid = repository.pid("ab")
    assert outputs["pid"].tolist() == [pid, pid]
    after = decode_outputs(await client.call("ModelInfer", rows_request(3), timeout=5))
    assert after["pid"].tolist() == [pid] * 3


async def test_when_every_member_leaves_a_running_batch_its_worker_is_killed(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    repository = Repository(tmp_path).add("rows", max_batch_size=2, max_batch_time=5.0)
    server = await start_server(nursery, repository.root, workers=1)
    client = GrpcioClient(server.port)
    calls = Calls(client)
    futures = [
        calls.start(rows_request(1, tag="gone", delay_ms=10_000), timeout=t) for t in (0.3, 0.4)
    ]
    for future in futures:
        assert (await calls.error(future)).code() == grpc.StatusCode.DEADLINE_EXCEEDED
    pid = repository.pid("gone")
    await eventually(lambda: not process_exists(pid))
    await eventually(lambda: server.core.pool.statistics().busy == 0)
    after = decode_outputs(await client.call("ModelInfer", rows_request(2), timeout=5))
    assert pid not in after["pid"].tolist()
    # The last request filled a batch by itself: it went to the pool without one.
    assert (statistics(server, "rows").batches, statistics(server, "rows").alone) == (1, 1)


async def test_a_failing_batch_fails_only_its_own_members_each_with_the_error(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    repository = Repository(tmp_path).add("rows", max_batch_size=2, max_batch_time=5.0)
    server = await start_server(nursery, repository.root)
    calls = Calls(GrpcioClient(server.port))
    actions = ["fail", "exit", "short", "ok"]
    futures = {
        action: [calls.start(rows_request(1, action=action)) for _ in range(2)]
        for action in actions
    }
    ok = [await calls.outputs(future) for future in futures.pop("ok")]
    assert [outputs["batch_rows"].tolist() for outputs in ok] == [[2], [2]]
    expected = {
        "fail": (grpc.StatusCode.INTERNAL, "ValueError: this batch is cursed"),
        "exit": (
            grpc.StatusCode.UNAVAILABLE,
            "worker process died while running model 'rows' (exit code 3)",
        ),
        "short": (
            grpc.StatusCode.INTERNAL,
            "model 'rows' output 'batch_rows' has shape [1], but a batched model must return "
            "one row per input row: its batch had 2 row(s)",
        ),
    }
    for action, members in futures.items():
        for future in members:
            error = await calls.error(future)
            assert (error.code(), error.details()) == expected[action]
    stats = statistics(server, "rows")
    assert (stats.batches, stats.max_batch_requests, stats.requests) == (4, 2, 8)


ROWS_TENSORS: dict[str, Any] = {
    "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 3]}],
    "outputs": [
        {"name": "y", "datatype": "FP32", "shape": [-1, 3]},
        {"name": "batch_rows", "datatype": "INT64", "shape": [-1]},
        {"name": "pid", "datatype": "INT64", "shape": [-1]},
    ],
}


async def test_outputs_that_are_not_the_declared_ones_fail_every_member_with_its_own_message(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    # Each batch is full with a request of one row and one of two (max_batch_size 3), so each
    # member's outputs are its rows of the batch's; a shape's message names the member's own.
    repository = Repository(tmp_path).add(
        "rows", max_batch_size=3, max_batch_time=5.0, **ROWS_TENSORS
    )
    server = await start_server(nursery, repository.root)
    calls = Calls(GrpcioClient(server.port))
    actions = ["wide", "int32", "missing", "extra", "ok"]
    futures = {
        action: [calls.start(rows_request(rows, action=action)) for rows in (1, 2)]
        for action in actions
    }
    ok = [await calls.outputs(future) for future in futures.pop("ok")]
    assert [outputs["batch_rows"].tolist() for outputs in ok] == [[3], [3, 3]]
    expected = {
        "wide": [
            f"model 'rows' output 'y' has shape [{rows}, 4], but the model declares [-1, 3] "
            f"(its first dimension is the request's batch size, {rows})"
            for rows in (1, 2)
        ],
        "int32": ["model 'rows' output 'pid' is INT32, but the model declares INT64"] * 2,
        "missing": ["model 'rows' did not return its declared output(s) 'pid'"] * 2,
        "extra": [
            "model 'rows' returned output 'z', which it does not declare; its declared outputs "
            "are 'y', 'batch_rows', 'pid'"
        ]
        * 2,
    }
    for action, members in futures.items():
        errors = [await calls.error(future) for future in members]
        assert [(e.code(), e.details()) for e in errors] == [
            (grpc.StatusCode.INTERNAL, message) for message in expected[action]
        ]
    stats = statistics(server, "rows")
    assert (stats.batches, stats.max_batch_requests, stats.requests) == (5, 2, 10)
    [model] = server.core.model_statistics("rows")
    assert model.requests[StatusCode.OK] == 2
    assert model.requests[StatusCode.INTERNAL] == 8
    assert (model.executions, model.inferences) == (5, 15)


async def test_a_fixed_first_output_dimension_is_checked_against_each_members_rows(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    # y declares 2 rows: a batch of two one-row requests has them, but neither request does.
    tensors = json.loads(json.dumps(ROWS_TENSORS))
    tensors["outputs"][0]["shape"] = [2, 3]
    repository = Repository(tmp_path).add("rows", max_batch_size=2, max_batch_time=5.0, **tensors)
    server = await start_server(nursery, repository.root)
    calls = Calls(GrpcioClient(server.port))
    members = [calls.start(rows_request(1)) for _ in range(2)]
    for future in members:
        error = await calls.error(future)
        assert (error.code(), error.details()) == (
            grpc.StatusCode.INTERNAL,
            "model 'rows' output 'y' has shape [1, 3], but the model declares [2, 3]",
        )
    alone = await calls.outputs(calls.start(rows_request(2)))
    assert alone["y"].shape == (2, 3)
    stats = statistics(server, "rows")
    assert (stats.batches, stats.max_batch_requests, stats.alone) == (1, 2, 1)


async def test_a_batchs_requests_are_freed_when_answered_not_left_to_the_cyclic_collector(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    # Garbage in a cycle waits for a collection of the cyclic collector, which walks every
    # young object. With the collector off, what a batch's requests held must be freed by the
    # time they are answered.
    repository = Repository(tmp_path).add("rows", max_batch_size=2, max_batch_time=5.0)
    server = await start_server(nursery, repository.root)
    calls = Calls(GrpcioClient(server.port))
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        futures = [calls.start(rows_request(1)) for _ in range(2)]
        for future in futures:
            await calls.outputs(future)
        # Every call's task has ended: what is left of them is garbage or freed.
        await trio.testing.wait_all_tasks_blocked()
        gc.collect()
        left = sorted({type(o).__name__ for o in gc.garbage if type(o) in _PER_REQUEST})
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert statistics(server, "rows").max_batch_requests == 2
    assert left == []


#: The objects each request of a batch makes in the core and the batcher.
_PER_REQUEST = {Reply, RequestTiming, Parameters}
