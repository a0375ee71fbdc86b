"""Per-model request statistics, recorded on the hot path and read when someone asks.

What each model's requests did, by model and version: how many ended with each status, how long
they took in the core, how long the successful ones waited for a worker and ran on it, how many
executions (worker calls) ran how many rows. Nothing here knows a protocol or an exposition
format: the Prometheus collector (``trio_infer.observability.metrics``) and Triton's
``ModelStatistics`` read the same :class:`ModelStatistics` snapshots.

Who records what:

- :class:`trio_infer.core.service.InferenceCore` runs each request of a served model in a
  :class:`RequestTiming` block (``with RequestTiming(recorder, deadline) as timing``), which records
  the status it ended with and its duration, whichever way it ends (a cancel by its deadline is
  DEADLINE_EXCEEDED, any other CANCELLED). It sets ``timing.queued`` when it hands the request
  to the pool; a batcher sets it when the request reaches it.
- The worker pool fills a call's :class:`Timing` when the worker reports it done: when the worker
  started it (as the server saw it) and the seconds the worker measured around the model's code.
- A batcher hands its batch's timing to every member, so each member counts the batch's compute
  time and its own wait (as Triton does), and records the batch's execution once. The core
  records the executions of requests that run alone.

Cost: a request makes a few attribute updates and appends its durations to its recorder's
lists; they are counted into the histograms a few hundred at a time (one numpy pass each, about
a tenth of what a ``bisect`` and a sum per duration cost) and whenever the statistics are read,
so a reader sees every request that ended before it. Snapshots, cumulative buckets and label
sets are made when read. The measurements are in ``docs/performance.md`` ("Metrics: cost
per call").
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from types import TracebackType

import numpy as np
import trio

from trio_infer.errors import InferError, StatusCode

__all__ = [
    "DURATION_BUCKETS",
    "Histogram",
    "HistogramSnapshot",
    "ModelRecorder",
    "ModelStatistics",
    "RequestTiming",
    "StatisticsRecorder",
    "Timing",
    "final_status",
]

#: Upper bounds (seconds, inclusive) of the duration histograms' buckets; past the last is
#: ``+Inf``. From 100 us (a small call's compute) to 30 s (a long deadline), about 2.5x apart.
DURATION_BUCKETS: tuple[float, ...] = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)

#: How many request durations a :class:`ModelRecorder` holds before counting them into its
#: histograms (about 8 KiB of floats a list).
_COUNTED_EVERY = 256


class Histogram:
    """Counts of observations in fixed buckets, and their sum: a Prometheus histogram's data
    kept as plain Python numbers.

    Args:
        bounds: The buckets' upper bounds, increasing; a value equal to a bound falls in that
            bound's bucket (Prometheus' ``le``). Values past the last fall in ``+Inf``.
    """

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float] = DURATION_BUCKETS) -> None:
        if any(b >= c for b, c in pairwise(bounds)):
            raise ValueError(f"bucket bounds must increase, got {list(bounds)}")
        self.bounds = tuple(bounds)
        # Not cumulative: one increment per observation. The last count is the +Inf bucket's.
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        """Count one observation of ``value``."""
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def observe_all(self, values: list[float]) -> None:
        """Count each of ``values`` (durations: never NaN), in order: the counts and sum that
        :meth:`observe` of each in turn gives."""
        indices = np.searchsorted(self.bounds, values, side="left")  # bisect_left's index
        counts = self.counts
        for index, count in enumerate(np.bincount(indices, minlength=len(counts)).tolist()):
            counts[index] += count
        # add.accumulate adds in order, one double at a time, as ``sum += value`` does.
        self.sum = float(np.add.accumulate([self.sum, *values])[-1])

    def snapshot(self) -> HistogramSnapshot:
        """The histogram now, detached from later observations."""
        return HistogramSnapshot(self.bounds, tuple(self.counts), self.sum)


@dataclass(frozen=True, slots=True)
class HistogramSnapshot:
    """A :class:`Histogram` at one moment.

    Attributes:
        bounds: The buckets' upper bounds (inclusive); the ``+Inf`` bucket follows the last.
        counts: Observations in each bucket (not cumulative), ``+Inf``'s last.
        sum: The sum of the observed values.
    """

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    sum: float

    @property
    def count(self) -> int:
        """How many values were observed."""
        return sum(self.counts)

    def cumulative(self) -> list[tuple[float, int]]:
        """``(upper bound, observations at or below it)`` for each bucket, ``+Inf``
        (``math.inf``) last: Prometheus' ``_bucket`` series."""
        total = 0
        buckets: list[tuple[float, int]] = []
        for bound, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            total += count
            buckets.append((bound, total))
        return buckets


class Timing:
    """When one request's worker call ran: set by the core or a batcher (``queued``), filled by
    the pool or a batcher (``started``, ``compute``) when the call succeeds, read by the core
    at the end.

    Args:
        requests: The requests the call serves (a batch's members; 1 otherwise): what the
            pool counts as waiting for the call's model.
    """

    __slots__ = ("compute", "queued", "requests", "started")

    def __init__(self, requests: int = 1) -> None:
        self.requests = requests
        self.queued = 0.0
        """When the request was handed to a batcher or the pool (Trio clock)."""
        self.started: float | None = None
        """When the worker started the call, as the server saw it (Trio clock); None until the
        call succeeded."""
        self.compute = 0.0
        """Seconds the worker spent in the model's code (for a batch: the whole batch's)."""

    def ran(self, started: float, compute: float) -> None:
        """Record a successful call: when it started and its compute time."""
        self.started = started
        self.compute = compute


class RequestTiming(Timing):
    """The :class:`Timing` of one request, which records the request in its model's
    :class:`ModelRecorder`: entered when the request starts; its exit records the status the
    request ended with (:func:`final_status`), its duration and, on success, its queue wait and
    compute time, whatever ended it. ``now`` reads the Trio clock: a caller that knows the run
    passes its clock's own ``current_time``, two calls fewer than ``trio.current_time``.
    """

    __slots__ = ("_began", "_deadline", "_now", "_recorder")

    def __init__(
        self, recorder: ModelRecorder, deadline: float, now: Callable[[], float] = trio.current_time
    ) -> None:
        # Timing's fields set here rather than by its __init__: one call less per request.
        self.requests = 1
        self.queued = 0.0
        self.started = None
        self.compute = 0.0
        self._recorder = recorder
        self._deadline = deadline
        self._now = now
        self._began = 0.0

    def __enter__(self) -> RequestTiming:
        self._recorder.in_flight += 1
        self._began = self._now()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        now = self._now()
        status = StatusCode.OK if exc is None else final_status(exc, now >= self._deadline)
        self._recorder.finished(status, now - self._began, self)

    def executed(self, rows: int) -> None:
        """Record the request's call as an execution of its own, of ``rows`` rows (a batch's
        is recorded by its batcher)."""
        self._recorder.executed(rows, self.compute)


def final_status(error: BaseException | None, past_deadline: bool) -> StatusCode:
    """The status a request ends with, from what ended it.

    Args:
        error: What it raised; None when it succeeded.
        past_deadline: Whether its deadline had passed when it ended.

    Returns:
        OK; an ``InferError``'s own status; for a cancellation, DEADLINE_EXCEEDED when the
        deadline had passed, else CANCELLED (a client gone, a shutdown); for anything else (a
        bug), INTERNAL, as the front-ends answer it.
    """
    if error is None:
        return StatusCode.OK
    if isinstance(error, InferError):
        return error.code
    if isinstance(error, trio.Cancelled):
        return StatusCode.DEADLINE_EXCEEDED if past_deadline else StatusCode.CANCELLED
    return StatusCode.INTERNAL


class ModelRecorder:
    """The statistics of one model (and version), updated by every request to it.

    Only the Trio thread updates it. Read it with :meth:`statistics`.
    """

    __slots__ = (
        "_batch_compute",
        "_batch_sizes",
        "_compute",
        "_computed",
        "_failure_seconds",
        "_last_inference",
        "_queue",
        "_queued",
        "_request",
        "_requests",
        "_statuses",
        "_success_seconds",
        "executions",
        "in_flight",
        "inferences",
        "name",
        "version",
    )

    def __init__(self, name: str, version: str = "") -> None:
        self.name = name
        self.version = version
        self.in_flight = 0
        """Requests in the core now (in a :meth:`request` block)."""
        self.executions = 0
        """Successful worker calls (a batch is one)."""
        self.inferences = 0
        """Rows those calls computed (a batch of n rows is n)."""
        # Indexed by StatusCode: a list is cheaper to count into than a dict of enums.
        self._statuses = [0] * len(StatusCode)
        self._success_seconds = 0.0
        self._failure_seconds = 0.0
        self._request = Histogram()
        self._queue = Histogram()
        self._compute = Histogram()
        # Durations not yet counted into the three histograms above (see _count): every
        # request's, and a successful worker call's queue wait and compute time.
        self._requests: list[float] = []
        self._queued: list[float] = []
        self._computed: list[float] = []
        # Executions and their compute seconds, by batch size (rows).
        self._batch_sizes: dict[int, int] = {}
        self._batch_compute: dict[int, float] = {}
        self._last_inference = 0.0

    def finished(self, status: StatusCode, seconds: float, timing: Timing) -> None:
        """Record a request's end (:class:`RequestTiming` calls it).

        Args:
            status: The status it ended with.
            seconds: How long it was in the core.
            timing: Its worker call's timing: a successful request's queue wait
                (``started - queued``) and compute time are recorded from it.
        """
        self.in_flight -= 1
        self._statuses[status] += 1
        self._last_inference = time.time()
        requests = self._requests
        requests.append(seconds)
        # The successful requests' durations are never more than all requests': counting
        # when this list is full bounds all three.
        if len(requests) == _COUNTED_EVERY:
            self._count()
        if status:
            self._failure_seconds += seconds
            return
        self._success_seconds += seconds
        started = timing.started
        if started is not None:
            # A clock read a few microseconds apart can put ``started`` a hair before
            # ``queued`` when the worker was idle: a wait is never negative (max's result,
            # without its call).
            wait = started - timing.queued
            if wait < 0.0:
                wait = 0.0
            self._queued.append(wait)
            self._computed.append(timing.compute)

    def _count(self) -> None:
        """Count the durations held into the histograms, and hold none."""
        for histogram, values in (
            (self._request, self._requests),
            (self._queue, self._queued),
            (self._compute, self._computed),
        ):
            if values:
                histogram.observe_all(values)
                values.clear()

    def executed(self, rows: int, compute: float) -> None:
        """Record one successful execution (worker call) of ``rows`` rows that took
        ``compute`` seconds in the model's code."""
        self.executions += 1
        self.inferences += rows
        self._batch_sizes[rows] = self._batch_sizes.get(rows, 0) + 1
        self._batch_compute[rows] = self._batch_compute.get(rows, 0.0) + compute

    def statistics(self) -> ModelStatistics:
        """Return a snapshot of this model's statistics."""
        self._count()
        return ModelStatistics(
            name=self.name,
            version=self.version,
            requests={code: self._statuses[code] for code in StatusCode},
            success_seconds=self._success_seconds,
            failure_seconds=self._failure_seconds,
            request_duration=self._request.snapshot(),
            queue_duration=self._queue.snapshot(),
            compute_duration=self._compute.snapshot(),
            in_flight=self.in_flight,
            executions=self.executions,
            inferences=self.inferences,
            batch_sizes={
                rows: (count, self._batch_compute[rows])
                for rows, count in sorted(self._batch_sizes.items())
            },
            last_inference=self._last_inference,
        )


@dataclass(frozen=True)
class ModelStatistics:
    """A snapshot of one model's statistics (see :class:`ModelRecorder`).

    The numbers of Triton's ``ModelStatistics`` are here: ``inference_count`` is
    ``inferences``, ``execution_count`` ``executions``, ``last_inference`` (ms)
    ``last_inference * 1000``; ``inference_stats.success`` is ``requests[OK]`` and
    ``success_seconds``, ``fail`` the other statuses and ``failure_seconds``, ``queue`` and
    ``compute_infer`` the count and sum of ``queue_duration`` and ``compute_duration``;
    ``batch_stats`` is ``batch_sizes``.

    Attributes:
        name: The model.
        version: Its version (``""``: unversioned).
        requests: Requests that ended, by status (every status, 0 for none).
        success_seconds: Seconds the successful requests took, summed.
        failure_seconds: Seconds the requests that did not succeed took, summed.
        request_duration: Seconds each request took in the core, whatever its status.
        queue_duration: Seconds each successful request waited, from being handed to a batcher
            or the pool until a worker started its call.
        compute_duration: Seconds each successful request's worker call spent in the model's
            code (a batch's whole time for each of its members).
        in_flight: Requests in the core now.
        executions: Successful worker calls (a batch counts once).
        inferences: Rows those calls computed.
        batch_sizes: Successful executions by their size in rows: ``(count, compute seconds
            summed)``, by increasing size.
        last_inference: When the last request ended (seconds since the epoch; 0: never).
    """

    name: str
    version: str
    requests: dict[StatusCode, int]
    success_seconds: float
    failure_seconds: float
    request_duration: HistogramSnapshot
    queue_duration: HistogramSnapshot
    compute_duration: HistogramSnapshot
    in_flight: int
    executions: int
    inferences: int
    batch_sizes: dict[int, tuple[int, float]]
    last_inference: float


class StatisticsRecorder:
    """The :class:`ModelRecorder` of every model that has had a request, by name and version."""

    def __init__(self) -> None:
        self._models: dict[tuple[str, str], ModelRecorder] = {}

    def model(self, name: str, version: str = "") -> ModelRecorder:
        """The recorder of model ``name`` at ``version``, made on first use."""
        key = (name, version)
        recorder = self._models.get(key)
        if recorder is None:
            recorder = self._models[key] = ModelRecorder(name, version)
        return recorder

    def statistics(self) -> list[ModelStatistics]:
        """Return a snapshot of every model's statistics, by name then version."""
        return [self._models[key].statistics() for key in sorted(self._models)]
