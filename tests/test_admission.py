"""Bounded work: the memory budget, per-model queues and transport backpressure.

The budget's rules are tested on :class:`Admission` directly (with Trio's virtual clock); the
bounds as a client meets them, over real sockets against real worker processes.
"""

from __future__ import annotations

import concurrent.futures
import math
import socket
import threading
from collections import Counter
from pathlib import Path

import grpc
import h2.config
import h2.connection
import h2.events
import h2.settings
import numpy as np
import pytest
import trio
import trio.testing

from tests.probe import Probe, probe_request, start_probe
from tests.support import GrpcioClient, MiB, eventually, start_server
from trio_infer.errors import Overloaded, TooLarge
from trio_infer.protobuf._proto import grpc_predict_v2_pb2 as pb
from trio_infer.protobuf.codec import encode_inputs
from trio_infer.repository.settings import ModelSettings, TensorSpec
from trio_infer.scheduling.admission import Admission, OutputSize
from trio_infer.server import RunningServer

# -- the budget's rules -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("outputs", "inputs", "expected"),
    [
        # -1 first: the request's batch size, the first dimension of its first input.
        ((TensorSpec("y", "FP32", (-1, 256)),), {"x": np.zeros((3, 2))}, 3 * 256 * 4),
        # A fixed first dimension beside it; a scalar first input counts one row.
        (
            (TensorSpec("y", "FP16", (-1, 2, 3)), TensorSpec("n", "INT64", (4,))),
            {"s": np.zeros(()), "x": np.zeros((5, 1))},
            2 * 3 * 2 + 4 * 8,
        ),
        # No inputs: one row.
        ((TensorSpec("y", "UINT8", (-1,)),), {}, 1),
        # A request of no rows has none of the rows' bytes.
        (
            (TensorSpec("y", "INT32", (-1, 2)), TensorSpec("n", "INT8", (3,))),
            {"x": np.zeros((0, 2))},
            3,
        ),
        # Sizes that cannot be known: 0, whatever the other outputs.
        (
            (TensorSpec("y", "FP32", (-1, 2)), TensorSpec("b", "BYTES", (-1,))),
            {"x": np.zeros((2, 2))},
            0,
        ),
        ((TensorSpec("y", "FP32", (2, -1)),), {"x": np.zeros((2, 2))}, 0),
        ((TensorSpec("y", "FP32", (-1, -1)),), {"x": np.zeros((2, 2))}, 0),
        (
            (TensorSpec("y", "FP32", (-1, 2)), TensorSpec("s", "FP64", ())),
            {"x": np.zeros((2, 2))},
            0,
        ),
        ((), {"x": np.zeros((2, 2))}, 0),
    ],
)
def test_the_outputs_size_is_estimated_from_the_declared_outputs_and_the_batch_size(
    outputs: tuple[TensorSpec, ...], inputs: dict[str, np.ndarray], expected: int
) -> None:
    size = OutputSize(outputs)
    assert size.estimate(inputs) == expected
    # The batch size read already by the caller stands for the inputs' first dimension.
    first = next(iter(inputs.values()), np.zeros(()))
    rows = first.shape[0] if first.ndim else 1
    assert size.estimate({}, rows) == expected


async def test_reservations_are_granted_first_come_first_served() -> None:
    admission = Admission(budget_bytes=100, max_waiting_bytes=200)
    order: list[str] = []

    async def request(name: str, nbytes: int, hold: trio.Event) -> None:
        async with admission.reserve(nbytes, math.inf):
            order.append(name)
            await hold.wait()

    first, second, third = trio.Event(), trio.Event(), trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(request, "first", 60, first)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(request, "big", 50, second)
        await trio.testing.wait_all_tasks_blocked()
        # 40 bytes would fit now, but "big" came first: no overtaking, so no starvation.
        nursery.start_soon(request, "small", 40, third)
        await trio.testing.wait_all_tasks_blocked()
        assert order == ["first"]
        assert admission.statistics().waiting == 2
        first.set()
        await trio.testing.wait_all_tasks_blocked()
        # Both fit once "first" is gone, and are let in together.
        assert sorted(order) == ["big", "first", "small"]
        second.set()
        third.set()
    assert admission.statistics().reserved_bytes == 0


async def test_a_cancelled_waiter_leaves_the_queue_and_lets_the_next_in() -> None:
    admission = Admission(budget_bytes=100, max_waiting_bytes=200)
    release = trio.Event()
    granted: list[int] = []

    async def hold(nbytes: int, task_status: trio.TaskStatus[trio.CancelScope]) -> None:
        with trio.CancelScope() as scope:
            task_status.started(scope)
            async with admission.reserve(nbytes, math.inf):
                granted.append(nbytes)
                await release.wait()

    async with trio.open_nursery() as nursery:
        await nursery.start(hold, 60)
        big_waiter: trio.CancelScope = await nursery.start(hold, 90)  # cannot fit beside 60
        await nursery.start(hold, 30)  # fits, but must not overtake the 90 ahead of it
        await trio.testing.wait_all_tasks_blocked()
        assert granted == [60]
        big_waiter.cancel()
        await trio.testing.wait_all_tasks_blocked()
        # The waiter at the head gave up: the one behind it fits and is let in at once.
        assert granted == [60, 30]
        assert admission.statistics().waiting == 0
        release.set()
    assert admission.statistics().reserved_bytes == 0


async def test_past_the_waiting_room_a_request_is_refused_at_once() -> None:
    admission = Admission(budget_bytes=100)  # the waiting room holds a quarter of the budget
    release = trio.Event()

    async def hold(nbytes: int) -> None:
        async with admission.reserve(nbytes, math.inf):
            await release.wait()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(hold, 100)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(hold, 20)
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(Overloaded) as caught:
            async with admission.reserve(10, math.inf):
                pass  # pragma: no cover - never admitted
        assert caught.value.message == (
            "memory budget full: 100 of 100 bytes reserved and 20 of 25 bytes that may wait "
            "for room already waiting (--memory-budget, --max-waiting-bytes)"
        )
        assert admission.statistics().waiting == 1
        release.set()
    assert admission.statistics().rejected == {"memory_budget": 1}


async def test_a_request_larger_than_the_budget_is_refused_at_once() -> None:
    admission = Admission(budget_bytes=100)
    with pytest.raises(Overloaded) as caught:
        async with admission.reserve(101, math.inf):
            pass  # pragma: no cover - never admitted
    assert caught.value.message == (
        "request needs 101 bytes, more than the whole memory budget of 100 bytes (--memory-budget)"
    )
    assert admission.statistics().rejected == {"memory_budget": 1}


async def test_a_model_slot_is_held_from_entering_its_block_to_leaving_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    admission = Admission(budget_bytes=100)
    settings = ModelSettings("m", "a.B", max_queue_size=1)
    slot = admission.model_slot(settings)
    assert admission.statistics().in_flight == {}  # made, not entered: nothing taken

    def failing_request() -> None:
        with slot:
            assert admission.statistics().in_flight == {"m": 1}
            with pytest.raises(Overloaded), admission.model_slot(settings):
                pass  # pragma: no cover - refused on entering
            raise RuntimeError("the request failed")

    with pytest.raises(RuntimeError):
        failing_request()
    assert admission.statistics().in_flight == {}
    assert admission.statistics().rejected == {"max_queue_size": 1}
    with trio.fail_after(1):  # no slot of these settings is held: it returns at once
        await admission.wait_idle(settings)


async def test_a_caller_without_a_deadline_waits_at_most_max_wait(
    autojump_clock: trio.testing.MockClock,
) -> None:
    admission = Admission(budget_bytes=100, max_wait=2.0)
    async with admission.reserve(100, math.inf):
        start = trio.current_time()
        with pytest.raises(Overloaded) as caught:
            async with admission.reserve(1, math.inf):
                pass  # pragma: no cover - never admitted
        assert trio.current_time() - start == pytest.approx(2.0)
    assert "waited 2 s for 1 bytes" in caught.value.message
    assert admission.statistics().reserved_bytes == 0


async def test_a_standing_queue_turns_waiting_into_refusal_until_the_overload_ends(
    autojump_clock: trio.testing.MockClock,
) -> None:
    admission = Admission(budget_bytes=100, max_waiting_bytes=10_000)
    outcomes: list[str] = []
    refusals: set[str] = set()

    async def request(hold: float) -> None:
        try:
            async with admission.reserve(100, math.inf):
                outcomes.append("admitted")
                await trio.sleep(hold)
        except Overloaded as exc:
            outcomes.append("refused")
            refusals.add(exc.message.partition(", and ")[2])

    # A burst shorter than the interval waits: nobody is refused.
    async with trio.open_nursery() as nursery:
        for _ in range(3):
            nursery.start_soon(request, 0.02)
    assert outcomes == ["admitted"] * 3
    assert not admission.statistics().shedding

    # Sustained overload: a request every 10 ms, each holding the whole budget for 20 ms.
    outcomes.clear()
    async with trio.open_nursery() as nursery:
        for _ in range(60):
            nursery.start_soon(request, 0.02)
            await trio.sleep(0.01)
        assert admission.statistics().shedding
    assert outcomes[:5] == ["admitted"] * 5  # a queue formed before it was seen to stand
    assert refusals == {
        "requests have waited over 5 ms for room for 0.1 s: refused rather than queued "
        "(--memory-budget)"
    }
    # Without shedding, all 60 would have queued and been admitted one by one; with it, the
    # budget admits what it can serve in the 0.6 s of arrivals (one per 20 ms) and refuses
    # the rest at once.
    assert outcomes.count("admitted") <= 0.6 / 0.02 + 1

    # Light load after it: every 10 ms two requests arrive together, each holding the whole
    # budget for 1 ms, so the second waits 1 ms. Probes (requests let wait) show the queue no
    # longer stands, and shedding ends.
    outcomes.clear()
    refusals.clear()
    async with trio.open_nursery() as nursery:
        for _ in range(100):
            nursery.start_soon(request, 0.001)
            nursery.start_soon(request, 0.001)
            await trio.sleep(0.01)
    assert not admission.statistics().shedding
    # Three probes, an interval apart, end it: at most four intervals' worth are refused.
    assert outcomes.count("refused") <= 4 * admission.interval / 0.01
    assert outcomes[-100:] == ["admitted"] * 100
    assert admission.statistics().reserved_bytes == 0


async def test_while_shedding_a_probe_waits_at_most_target_wait_and_light_load_ends_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    admission = Admission(budget_bytes=100, max_waiting_bytes=200)
    refused: dict[str, float] = {}

    async def request(name: str, hold: float) -> None:
        arrived = trio.current_time()
        try:
            async with admission.reserve(100, math.inf):
                await trio.sleep(hold)
        except Overloaded:
            refused[name] = trio.current_time() - arrived

    async with trio.open_nursery() as nursery:
        # Each waits 0.3 s for the one before: a queue that stands for over an interval.
        for name in ("first", "second", "third"):
            nursery.start_soon(request, name, 0.3)
            await trio.sleep(0.01)
        await trio.sleep(0.65 - 0.03)
        assert admission.statistics().shedding  # seen when "third" got room, at 0.6 s
        nursery.start_soon(request, "refused", 0.0)  # within an interval of that: no probe
        await trio.sleep(admission.interval)
        nursery.start_soon(request, "probe", 0.0)
    assert refused == {"refused": 0.0, "probe": pytest.approx(admission.target_wait)}
    statistics = admission.statistics()
    assert (statistics.shedding, statistics.waiting, statistics.reserved_bytes) == (True, 0, 0)
    # Requests that find room at once bring no probe; an interval after the last refusal,
    # one of them ends shedding.
    async with admission.reserve(50, math.inf):
        assert not admission.statistics().shedding


async def test_a_request_of_no_bytes_holds_nothing_and_shows_room_as_any_request(
    autojump_clock: trio.testing.MockClock,
) -> None:
    admission = Admission(budget_bytes=100, max_waiting_bytes=200, max_owner_bytes=50)

    async def hold() -> None:
        async with admission.reserve(100, math.inf):
            await trio.sleep(0.3)

    async with trio.open_nursery() as nursery:
        # Each waits 0.3 s for the one before: a queue that stands for over an interval.
        for _ in range(3):
            nursery.start_soon(hold)
            await trio.sleep(0.01)
        await trio.sleep(0.35 - 0.03)
        # Behind a waiter: it would wait, and holds nothing.
        assert admission.reserve_nowait(0, "client") is None
        assert (admission.statistics().waiting, admission.statistics().reserved_bytes) == (1, 100)
        await trio.sleep(0.3)
        assert admission.statistics().shedding  # seen when the last got room, at 0.6 s
        # No waiter, and no refusal since: as any request that finds room, it ends the
        # shedding, holding nothing.
        assert admission.reserve_nowait(0, "client") is None
        statistics = admission.statistics()
        assert (statistics.shedding, statistics.reserved_bytes) == (False, 100)
    # Nothing held for the client: its whole share is there.
    reservation = admission.reserve_nowait(50, "client")
    assert reservation is not None
    reservation.release()
    assert admission.statistics().reserved_bytes == 0


async def test_one_connection_holds_at_most_its_share_and_others_still_get_room() -> None:
    admission = Admission(budget_bytes=100)  # a connection's share: half the budget
    async with admission.reserve(30, math.inf, owner=1), admission.reserve(20, math.inf, owner=1):
        with pytest.raises(Overloaded) as caught:
            async with admission.reserve(1, math.inf, owner=1):
                pass  # pragma: no cover - never admitted
        assert caught.value.message == (
            "connection's share of the memory budget full: the request needs 1 more bytes, "
            "the connection holds 50 of its 50 (--max-connection-bytes)"
        )
        # Refused at once although the budget has room; another connection gets it.
        async with admission.reserve(50, math.inf, owner=2):
            assert admission.statistics().reserved_bytes == 100
    # Its bytes given back, the connection has its whole share again.
    async with admission.reserve(50, math.inf, owner=1):
        pass
    statistics = admission.statistics()
    assert (statistics.reserved_bytes, statistics.rejected) == (0, {"max_connection_bytes": 1})


async def test_a_request_larger_than_the_share_is_refused_and_one_without_owner_is_not() -> None:
    admission = Admission(budget_bytes=100, max_owner_bytes=40)
    with pytest.raises(TooLarge, match="needs 41 bytes: more than a connection's whole share"):
        async with admission.reserve(41, math.inf, owner="a"):
            pass  # pragma: no cover - never admitted
    async with admission.reserve(100, math.inf):
        assert admission.statistics().reserved_bytes == 100


async def test_a_refusal_no_retry_can_pass_is_too_large_and_one_of_a_full_bound_is_not() -> None:
    admission = Admission(budget_bytes=100, max_owner_bytes=50)
    with pytest.raises(TooLarge, match="needs 101 bytes, more than the whole memory budget of 100"):
        admission.reserve_nowait(101)
    async with admission.reserve(30, math.inf, owner="a") as held:
        # Growth is judged by what the request would hold in all, before what is full now.
        with pytest.raises(TooLarge, match="needs 21 more bytes, 51 in all: more than a conn"):
            held.grow_nowait(21, "the parse")
        with pytest.raises(TooLarge, match="71 more bytes, 101 in all: more than the whole"):
            held.grow_nowait(71, "the parse")
        async with admission.reserve(15, math.inf, owner="a"):
            with pytest.raises(Overloaded, match="the connection holds 45 of its 50") as share:
                held.grow_nowait(10, "the parse")
            assert not isinstance(share.value, TooLarge)
        async with admission.reserve(65, math.inf):
            with pytest.raises(Overloaded, match="memory budget full") as full:
                held.grow_nowait(10, "the parse")
            assert not isinstance(full.value, TooLarge)
        held.grow_nowait(10, "the parse")
        assert admission.statistics().reserved_bytes == 40
    assert admission.statistics().rejected == {"memory_budget": 3, "max_connection_bytes": 2}


async def test_requests_of_no_bytes_from_one_connection_end_in_any_order() -> None:
    # ServerLive and friends announce empty messages: several at once on one connection hold
    # nothing of its share, whichever ends first.
    admission = Admission(budget_bytes=100)
    async with admission.reserve(0, math.inf, owner=1), admission.reserve(0, math.inf, owner=1):
        pass
    async with admission.reserve(10, math.inf, owner=1):
        async with admission.reserve(0, math.inf, owner=1):
            pass
        async with admission.reserve(40, math.inf, owner=1):  # the 10 still count
            with pytest.raises(Overloaded, match="the connection holds 50 of its 50"):
                async with admission.reserve(1, math.inf, owner=1):
                    pass  # pragma: no cover - never admitted
    async with admission.reserve(50, math.inf, owner=1):
        assert admission.statistics().reserved_bytes == 50


async def test_grown_bytes_count_against_the_share() -> None:
    admission = Admission(budget_bytes=100)
    async with admission.reserve(40, math.inf, owner="a") as reservation:
        reservation.grow_nowait(10, "the outputs")
        # The request alone would then hold more than a share: no retry can pass.
        with pytest.raises(TooLarge) as caught:
            reservation.grow_nowait(1, "the decoded inputs")
        assert caught.value.message == (
            "the decoded inputs needs 1 more bytes, 51 in all: more than a connection's whole "
            "share of the memory budget, 50 bytes (--max-connection-bytes)"
        )
        assert reservation.nbytes == 50
    # The grown bytes were given back with the rest.
    async with admission.reserve(50, math.inf, owner="a"):
        assert admission.statistics().reserved_bytes == 50


async def test_a_waiter_whose_connection_filled_its_share_meanwhile_is_refused_at_grant() -> None:
    admission = Admission(budget_bytes=100, max_waiting_bytes=100, max_owner_bytes=60)
    releases = {name: trio.Event() for name in ("a", "b", "c")}
    outcomes: dict[str, str] = {}

    async def hold(name: str, nbytes: int) -> None:
        owner = name[0]
        try:
            async with admission.reserve(nbytes, math.inf, owner=owner):
                outcomes[name] = "admitted"
                await releases[owner].wait()
        except Overloaded as exc:
            outcomes[name] = exc.message

    async with trio.open_nursery() as nursery:
        for name, nbytes in (("b", 60), ("c", 40), ("a1", 30), ("a2", 40)):
            nursery.start_soon(hold, name, nbytes)
            await trio.testing.wait_all_tasks_blocked()
        # Each of a's requests fits its share alone: both wait for the full budget.
        assert admission.statistics().waiting == 2
        releases["c"].set()
        await trio.testing.wait_all_tasks_blocked()
        assert outcomes["a1"] == "admitted"
        releases["b"].set()
        await trio.testing.wait_all_tasks_blocked()
        # The budget has room for a2 now, a's share does not.
        assert outcomes["a2"] == (
            "connection's share of the memory budget full: the request needs 40 more bytes, "
            "the connection holds 30 of its 60 (--max-connection-bytes)"
        )
        releases["a"].set()
    statistics = admission.statistics()
    assert (statistics.reserved_bytes, statistics.waiting) == (0, 0)
    assert statistics.rejected == {"max_connection_bytes": 1}
    # Every share given back: a has all of its own again.
    async with admission.reserve(60, math.inf, owner="a"):
        pass


# -- the bounds over the wire -----------------------------------------------------------------


async def test_a_full_queue_is_refused_at_once_and_other_models_are_served(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    probe = await start_probe(nursery, tmp_path, server={"workers": 1}, max_queue_size=2)
    slow = [
        probe.client.stub.ModelInfer.future(
            probe_request(tag=f"slow{i}", action="sleep", delay_ms=600), timeout=10
        )
        for i in range(2)
    ]
    await eventually(lambda: probe.server.statistics().admission.in_flight == {"probe": 2})
    error = await probe.error(deadline=5, tag="refused")
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error.details() == "model 'probe' has 2 requests in flight, its max_queue_size"
    assert not probe.started("refused")
    for future in slow:
        await trio.to_thread.run_sync(future.result)
    # The queue drained: the model takes requests again.
    assert await probe.call(deadline=5) > 0
    statistics = probe.server.statistics().admission
    assert statistics.rejected == {"max_queue_size": 1}
    assert statistics.in_flight == {}


async def test_requests_wait_for_a_worker_by_priority_then_in_arrival_order(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    probe = await start_probe(nursery, tmp_path, server={"workers": 1})
    pool = probe.server.core.pool
    futures = [
        probe.client.stub.ModelInfer.future(
            probe_request(tag="busy", action="sleep", delay_ms=300), timeout=20
        )
    ]
    await probe.wait_started("busy")
    # The worker is sent one call ahead of the one it runs, whatever its priority; the others
    # wait in the pool's queue.
    arrivals = [("ahead", 3), ("low", 3), ("default", 0), ("normal", 2), ("high", 1), ("high 2", 1)]
    for waiting, (tag, priority) in enumerate(arrivals, start=1):
        request = probe_request(tag=tag, action="sleep", delay_ms=20, priority=priority)
        futures.append(probe.client.stub.ModelInfer.future(request, timeout=20))
        await eventually(lambda: pool.statistics().waiting == waiting)  # noqa: B023 (awaited here)
    assert not probe.started("ahead")
    for future in futures:
        await trio.to_thread.run_sync(future.result)
    started = sorted(
        ["busy", *(tag for tag, _ in arrivals)],
        key=lambda tag: (probe.log_dir / f"{tag}.start").stat().st_mtime_ns,
    )
    assert started == ["busy", "ahead", "high", "high 2", "default", "normal", "low"]


@pytest.mark.parametrize("priority", [4, -1, True, 1.0, "high"])
async def test_a_priority_that_is_not_a_level_is_invalid_argument(
    probe: Probe, priority: bool | int | float | str
) -> None:
    error = await probe.error(deadline=5, tag="bad", priority=priority)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == (
        "parameter 'priority' must be an integer from 0 to 3 (1 is the highest level, 3 the "
        f"lowest, 0 the default, 2), got {priority!r}"
    )
    assert not probe.started("bad")


def echo_request(nbytes: int) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="echo")
    encode_inputs(request, [("x", np.zeros(nbytes, np.uint8))], raw=True)
    return request


async def test_a_request_larger_than_the_budget_is_refused_naming_the_bound(
    nursery: trio.Nursery,
) -> None:
    server = await start_server(nursery, memory_budget=2 * MiB)
    client = GrpcioClient(server.port)
    error = await client.error("ModelInfer", echo_request(2 * MiB))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "more than the whole memory budget of 2097152 bytes (--memory-budget)" in (
        error.details()
    )
    await client.call("ModelInfer", echo_request(1024))
    assert server.statistics().admission.reserved_bytes == 0
    client.channel.close()


async def test_requests_beyond_the_budget_wait_or_are_refused_and_never_exceed_it(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    # Each request reserves three times its ~300 KiB message: 4 MiB admits four at a time, and
    # its waiting room (a quarter of the budget) holds one more. Ten clients: the rest are
    # refused. All ten share one connection, here allowed the whole budget.
    budget = 4 * MiB
    probe = await start_probe(
        nursery, tmp_path, server={"memory_budget": budget, "max_connection_bytes": budget}
    )
    payload = np.zeros(300 * 1024, np.uint8)
    peak_reserved = peak_waiting = 0
    outcomes: Counter[str] = Counter()

    def request(index: int) -> None:
        message = pb.ModelInferRequest(model_name="probe")
        encode_inputs(message, [("x", payload)], raw=True)
        message.parameters["action"].string_param = "sleep"
        message.parameters["delay_ms"].int64_param = 100
        try:
            probe.client.stub.ModelInfer(message, timeout=20)
            outcomes["OK"] += 1
        except grpc.RpcError as error:
            outcomes[error.code().name] += 1

    def load() -> None:
        with concurrent.futures.ThreadPoolExecutor(10) as pool:
            list(pool.map(request, range(40)))

    async with trio.open_nursery() as load_nursery:
        load_nursery.start_soon(trio.to_thread.run_sync, load)
        while load_nursery.child_tasks:
            statistics = probe.server.statistics().admission
            peak_reserved = max(peak_reserved, statistics.reserved_bytes)
            peak_waiting = max(peak_waiting, statistics.waiting)
            await trio.sleep(0.005)
    assert 0 < peak_reserved <= budget
    assert 0 < peak_waiting <= 1
    assert set(outcomes) == {"OK", "RESOURCE_EXHAUSTED"}, outcomes
    assert (
        probe.server.statistics().admission.rejected["memory_budget"]
        == outcomes["RESOURCE_EXHAUSTED"]
    )
    await eventually(lambda: probe.server.statistics().admission.reserved_bytes == 0)


async def test_with_no_waiting_room_what_does_not_fit_is_refused_at_once(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    probe = await start_probe(
        nursery,
        tmp_path,
        server={"memory_budget": 4 * MiB, "max_waiting_bytes": 0, "max_connection_bytes": 4 * MiB},
    )
    # 1 MiB reserves 3 MiB of the 4; then 512 KiB (1.5 MiB) does not fit. Both calls share a
    # connection, here allowed the whole budget.
    holder = probe.client.stub.ModelInfer.future(
        sized_probe_request(MiB, tag="holder", action="sleep", delay_ms=600), timeout=10
    )
    await probe.wait_started("holder")
    with trio.fail_after(5):
        error = await probe.client.error("ModelInfer", sized_probe_request(MiB // 2), timeout=5)
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error.details().startswith("memory budget full: ")
    assert error.details().endswith(
        " bytes reserved and 0 of 0 bytes that may wait for room already waiting "
        "(--memory-budget, --max-waiting-bytes)"
    )
    assert probe.server.statistics().admission.waiting == 0
    await trio.to_thread.run_sync(holder.result)


def sized_probe_request(nbytes: int, **parameters: str | int) -> pb.ModelInferRequest:
    request = probe_request(**parameters)
    del request.inputs[:]
    del request.raw_input_contents[:]
    encode_inputs(request, [("x", np.zeros(nbytes, np.uint8))], raw=True)
    return request


async def test_reservations_return_to_zero_after_cancels_and_errors(probe: Probe) -> None:
    future = probe.client.stub.ModelInfer.future(
        probe_request(tag="cancel", action="sleep", delay_ms=5000)
    )
    await probe.wait_started("cancel")
    assert probe.server.statistics().admission.reserved_bytes > 0
    future.cancel()
    error = await probe.error(deadline=5, action="exit")
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    error = await probe.client.error("ModelInfer", pb.ModelInferRequest(model_name="nope"))
    assert error.code() == grpc.StatusCode.NOT_FOUND
    await eventually(lambda: probe.server.statistics().admission.reserved_bytes == 0)
    assert probe.server.statistics().admission.in_flight == {}


# -- transport backpressure -------------------------------------------------------------------


GRPC_HEADERS = [
    (":method", "POST"),
    (":scheme", "http"),
    (":path", "/inference.GRPCInferenceService/ModelInfer"),
    (":authority", "localhost"),
    ("te", "trailers"),
    ("content-type", "application/grpc"),
]


def _announce_only(port: int, length: int) -> tuple[dict[str, str], int]:
    """Start a call whose message prefix announces ``length`` bytes and send as much of it as
    the server's window allows. Return the call's trailers and how many bytes were sent."""
    connection = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    connection.initiate_connection()
    stream_id = connection.get_next_available_stream_id()
    connection.send_headers(stream_id, GRPC_HEADERS)
    body = b"\x00" + length.to_bytes(4, "big") + bytes(length)
    sent = 0
    trailers: dict[str, str] = {}
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(5)
        while "grpc-status" not in trailers:
            window = min(
                connection.local_flow_control_window(stream_id),
                connection.max_outbound_frame_size,
                len(body) - sent,
            )
            if window > 0:
                connection.send_data(stream_id, body[sent : sent + window])
                sent += window
            sock.sendall(connection.data_to_send())
            for event in connection.receive_data(sock.recv(65536)):
                if isinstance(event, h2.events.ResponseReceived | h2.events.TrailersReceived):
                    trailers.update((k.decode(), v.decode()) for k, v in event.headers)
                if isinstance(event, h2.events.StreamReset):
                    trailers.setdefault("grpc-status", "reset")
    return trailers, sent


async def test_a_request_that_cannot_fit_is_refused_from_its_prefix_without_reading_it(
    nursery: trio.Nursery,
) -> None:
    server = await start_server(nursery, memory_budget=4 * MiB)
    trailers, sent = await trio.to_thread.run_sync(_announce_only, server.port, 32 * MiB)
    assert trailers["grpc-status"] == str(grpc.StatusCode.RESOURCE_EXHAUSTED.value[0])
    # The server let the client send its 128 KiB stream window, not the 32 MiB it announced.
    assert sent <= 128 * 1024


def _stop_reading_after_request(port: int, sent: threading.Event, release: threading.Event) -> None:
    """Ask for an 8 MiB echo with windows wide open, then stop reading the socket at all."""
    connection = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    connection.initiate_connection()
    connection.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 2**31 - 1})
    connection.increment_flow_control_window(2**30)
    stream_id = connection.get_next_available_stream_id()
    connection.send_headers(stream_id, GRPC_HEADERS)
    message = echo_request(8 * MiB).SerializeToString()
    body = b"\x00" + len(message).to_bytes(4, "big") + message
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(5)
        while body:
            window = min(
                connection.local_flow_control_window(stream_id),
                connection.max_outbound_frame_size,
            )
            chunk, body = body[:window], body[window:]
            if chunk:
                connection.send_data(stream_id, chunk, end_stream=not body)
            sock.sendall(connection.data_to_send())
            if body and not chunk:  # out of window: wait for the server to admit the message
                connection.receive_data(sock.recv(65536))
        sent.set()
        release.wait(10)


async def test_a_client_that_stops_reading_does_not_block_other_clients(
    server: RunningServer, grpcio_client: GrpcioClient
) -> None:
    sent, release = threading.Event(), threading.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(
            trio.to_thread.run_sync, _stop_reading_after_request, server.port, sent, release
        )
        await trio.to_thread.run_sync(sent.wait)
        # The server is now stuck writing 8 MiB to a socket nobody reads; others do not notice.
        for _ in range(20):
            response = await grpcio_client.call("ModelInfer", echo_request(1024), timeout=5)
            assert response.model_name == "echo"
        release.set()
    # The stuck client went away in the middle of the server's write: only its connection ends.
    response = await grpcio_client.call("ModelInfer", echo_request(1024), timeout=5)
    assert response.model_name == "echo"


async def test_concurrent_empty_requests_on_one_connection_are_all_served(
    nursery: trio.Nursery,
) -> None:
    # 200 ServerLive calls at once through one channel: empty messages, one connection's share.
    server = await start_server(nursery)
    client = GrpcioClient(server.port)
    futures = [
        client.stub.ServerLive.future(pb.ServerLiveRequest(), timeout=10) for _ in range(200)
    ]
    answers = await trio.to_thread.run_sync(lambda: [future.result().live for future in futures])
    assert answers == [True] * 200
    assert server.statistics().admission.reserved_bytes == 0
