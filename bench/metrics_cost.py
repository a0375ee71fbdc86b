"""What the metrics cost: the recording a request makes on the hot path, and a scrape.

    .venv/bin/python -m bench.metrics_cost [--calls N]

Runs in one Trio run, no sockets and no workers: each line times, over N iterations (median of
5 repeats), exactly what the server adds per request, against an empty loop:

- ``unbatched``: what ``InferenceCore.infer`` and the pool do for a request that runs alone:
  the request's timing entered and exited (two clock reads, the status, three histogram
  observations), ``queued`` stamped (a clock read), the pool's ``ran`` and the execution.
- ``batch member``: the same with the batcher's share for one member of a batch of 8 (copying
  the batch's timing, one eighth of the batch's execution).
- ``failed``: a request refused by validation (the exception passes through the timing).
- ``scrape``: ``ServerMetrics.render()`` for 4 models with traffic recorded (milliseconds).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable

import trio

from trio_infer.errors import InvalidInput
from trio_infer.scheduling.statistics import StatisticsRecorder, Timing


def _per_call(loop: Callable[[int], None], calls: int) -> float:
    """Median seconds per iteration of ``loop(calls)`` over 5 repeats."""
    times = []
    for _ in range(5):
        began = time.perf_counter()
        loop(calls)
        times.append((time.perf_counter() - began) / calls)
    return statistics.median(times)


def _empty(calls: int) -> None:
    for _ in range(calls):
        pass


def _unbatched(recorder: StatisticsRecorder, name: str = "add_sub") -> Callable[[int], None]:
    def loop(calls: int) -> None:
        for _ in range(calls):
            model = recorder.model(name, "")
            with model.request(math.inf) as timing:
                timing.queued = trio.current_time()
                timing.ran(timing.queued, 0.0002)
                timing.executed(1)

    return loop


def _batch_member(recorder: StatisticsRecorder) -> Callable[[int], None]:
    batch = Timing(8)
    batch.ran(0.0, 0.0004)

    def loop(calls: int) -> None:
        for index in range(calls):
            model = recorder.model("dense", "")
            with model.request(math.inf) as timing:
                timing.queued = trio.current_time()
                timing.started = batch.started
                timing.compute = batch.compute
            if index % 8 == 0:
                model.executed(8, batch.compute)

    return loop


def _failed(recorder: StatisticsRecorder) -> Callable[[int], None]:
    error = InvalidInput("missing input")

    def loop(calls: int) -> None:
        for _ in range(calls):
            try:
                with recorder.model("add_sub", "").request(math.inf):
                    raise error
            except InvalidInput:
                pass

    return loop


def _without_recording_failed(calls: int) -> None:
    error = InvalidInput("missing input")
    for _ in range(calls):
        try:
            raise error
        except InvalidInput:
            pass


async def _measure(calls: int) -> None:
    recorder = StatisticsRecorder()
    empty = _per_call(_empty, calls)
    rows = [
        ("unbatched", _per_call(_unbatched(recorder), calls) - empty),
        ("batch member", _per_call(_batch_member(recorder), calls) - empty),
        (
            "failed",
            _per_call(_failed(recorder), calls) - _per_call(_without_recording_failed, calls),
        ),
    ]
    for name, seconds in rows:
        print(f"{name:14} {seconds * 1e6:6.2f} us per request")
    print(f"{'scrape':14} {await _scrape_ms(calls):6.2f} ms per render (4 models)")


async def _scrape_ms(calls: int) -> float:
    # Imported here: the lines above need none of the server.
    from trio_infer.core.service import InferenceCore
    from trio_infer.observability.metrics import ServerMetrics
    from trio_infer.repository.registry import ModelRegistry
    from trio_infer.repository.settings import EXAMPLES, load_repository
    from trio_infer.scheduling.admission import Admission
    from trio_infer.workers.pool import WorkerPool

    async with WorkerPool.open(1) as pool:  # no call is made: no worker starts
        registry = ModelRegistry(load_repository(EXAMPLES))
        core = InferenceCore(registry, pool, Admission(1 << 30))
        for settings in registry:
            _unbatched(core.recorder, settings.name)(calls // 10)
            registry.set_ready(settings.name, True)
        metrics = ServerMetrics(core)
        renders = 200
        began = time.perf_counter()
        for _ in range(renders):
            metrics.render()
        return (time.perf_counter() - began) / renders * 1e3


def main() -> None:
    """Print the cost of recording one request, and of one scrape."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200_000, help="iterations per repeat")
    trio.run(_measure, parser.parse_args().calls)


if __name__ == "__main__":
    main()
