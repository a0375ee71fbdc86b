"""Prometheus metrics of a running server, made from its statistics when scraped.

Nothing here runs on a request's path: the core, the batchers and the pool keep plain counters
(:mod:`trio_infer.scheduling.statistics` and the ``statistics()`` snapshots), and
:class:`ServerMetrics`, a ``prometheus_client`` collector on a registry of its own (not the
process-wide default one, so two servers in one process do not mix), reads them at each scrape
and yields metric families. ``render`` gives the body and content type of a ``GET /metrics``
answer.

Names follow Prometheus' conventions: a ``trio_infer_`` prefix, base units (seconds, bytes),
``_total`` on counters. A model's series carry ``model`` and ``version`` labels (``version`` is
``""`` for an unversioned model), and every served model has them from the first scrape, with
zeros before its first request; the README's "Metrics" section lists every metric and the
Triton metric it corresponds to.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from trio_infer.core.service import InferenceCore
from trio_infer.scheduling.statistics import HistogramSnapshot, ModelStatistics

__all__ = ["BATCH_SIZE_BUCKETS", "ServerMetrics", "TransportCounts"]

#: Upper bounds (rows, inclusive) of the batch size histogram's buckets.
BATCH_SIZE_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)

_MODEL = ("model", "version")


@dataclass(frozen=True, slots=True)
class TransportCounts:
    """What the metrics show of one transport (its own snapshot, in words every protocol
    shares).

    Attributes:
        connections: Connections open now.
        calls: Calls in flight now (on gRPC, each is an HTTP/2 stream; on HTTP, a request).
        calls_started: Calls started since the server started.
    """

    connections: int
    calls: int
    calls_started: int


class ServerMetrics:
    """The Prometheus metrics of one server: a collector, registered on a registry of its own.

    Args:
        core: The server's V2 core: its models, recorder, pool, admission and batching are
            read at each scrape.
        transports: Returns a snapshot of each transport, by protocol name (``"grpc"``,
            ``"http"``).
        task_crashes: Returns the internal tasks that crashed, by kind (see
            ``trio_infer.server.ServerStatistics.task_crashes``).
    """

    def __init__(
        self,
        core: InferenceCore,
        *,
        transports: Callable[[], Mapping[str, TransportCounts]] = dict,
        task_crashes: Callable[[], Mapping[str, int]] = dict,
    ) -> None:
        self._core = core
        self._transports = transports
        self._task_crashes = task_crashes
        self.registry = CollectorRegistry(auto_describe=False)
        """The registry the metrics are on; another collector may be registered beside them."""
        self.registry.register(self)

    def render(self) -> tuple[bytes, str]:
        """The metrics now, in Prometheus' text format: ``(body, content type)``, the answer
        to ``GET /metrics``."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def describe(self) -> list[Metric]:
        """Nothing: the registry need not collect at registration to learn the names."""
        return []

    def collect(self) -> Iterator[Metric]:
        """Yield every metric family, read from the server's statistics now."""
        core = self._core
        models = [
            core.recorder.model(settings.name, settings.version).statistics()
            for settings in core.registry
        ]
        yield from self._model_metrics(models)
        yield from self._admission_metrics()
        yield from self._worker_metrics()
        yield from self._transport_metrics()
        crashes = CounterMetricFamily(
            "trio_infer_task_crashes",
            "Internal tasks that raised (bugs), by kind; each failed the calls it held, was "
            "logged and was replaced.",
            labels=["task"],
        )
        for task, count in sorted(self._task_crashes().items()):
            crashes.add_metric([task], count)
        yield crashes

    def _model_metrics(self, models: Sequence[ModelStatistics]) -> Iterator[Metric]:
        core = self._core
        pool = core.pool.statistics()
        batching = core.batching.statistics()
        requests = CounterMetricFamily(
            "trio_infer_requests",
            "Inference requests that ended, by model and final status (gRPC status name).",
            labels=[*_MODEL, "status"],
        )
        request_duration = _histogram(
            "trio_infer_request_duration_seconds",
            "Seconds inference requests took in the server's core, whatever their status.",
        )
        queue_duration = _histogram(
            "trio_infer_queue_duration_seconds",
            "Seconds successful requests waited for a worker to start their call (in the "
            "batcher's queue and the worker pool's).",
        )
        compute_duration = _histogram(
            "trio_infer_compute_duration_seconds",
            "Seconds successful requests' worker calls spent in the model's code (a batch's "
            "whole time for each of its requests).",
        )
        inferences = CounterMetricFamily(
            "trio_infer_inferences",
            "Rows computed by successful executions (a batch of n rows counts n).",
            labels=_MODEL,
        )
        executions = CounterMetricFamily(
            "trio_infer_executions",
            "Successful executions (worker calls) of the model; a batch counts once.",
            labels=_MODEL,
        )
        batch_size = _histogram(
            "trio_infer_batch_size",
            "Rows per successful execution.",
        )
        in_flight = GaugeMetricFamily(
            "trio_infer_requests_in_flight",
            "Inference requests in the server's core now.",
            labels=_MODEL,
        )
        waiting = GaugeMetricFamily(
            "trio_infer_requests_waiting",
            "Inference requests waiting for a worker to start their call now.",
            labels=_MODEL,
        )
        ready = GaugeMetricFamily(
            "trio_infer_model_ready",
            "Whether the model takes requests now (1) or not (0).",
            labels=_MODEL,
        )
        last = GaugeMetricFamily(
            "trio_infer_last_inference_timestamp_seconds",
            "When the model's last request ended (Unix time; 0 before the first).",
            labels=_MODEL,
        )
        for model in models:
            labels = [model.name, model.version]
            for status, count in model.requests.items():
                requests.add_metric([*labels, status.name], count)
            _add_histogram(request_duration, labels, model.request_duration)
            _add_histogram(queue_duration, labels, model.queue_duration)
            _add_histogram(compute_duration, labels, model.compute_duration)
            inferences.add_metric(labels, model.inferences)
            executions.add_metric(labels, model.executions)
            _add_histogram(batch_size, labels, _batch_sizes(model.batch_sizes))
            in_flight.add_metric(labels, model.in_flight)
            batches = batching.get(model.name)
            queued = batches.waiting if batches is not None else 0
            waiting.add_metric(labels, queued + pool.waiting_by_model.get(model.name, 0))
            ready.add_metric(labels, 1 if core.model_ready(model.name) else 0)
            last.add_metric(labels, model.last_inference)
        yield from (requests, request_duration, queue_duration, compute_duration)
        yield from (inferences, executions, batch_size, in_flight, waiting, ready, last)

    def _admission_metrics(self) -> Iterator[Metric]:
        admission = self._core.admission.statistics()
        yield GaugeMetricFamily(
            "trio_infer_memory_budget_bytes",
            "The memory budget: the most bytes requests in flight may reserve together.",
            value=admission.budget_bytes,
        )
        yield GaugeMetricFamily(
            "trio_infer_memory_reserved_bytes",
            "Bytes of the memory budget reserved by requests now.",
            value=admission.reserved_bytes,
        )
        yield GaugeMetricFamily(
            "trio_infer_memory_waiting_requests",
            "Requests waiting for room in the memory budget now.",
            value=admission.waiting,
        )
        yield GaugeMetricFamily(
            "trio_infer_memory_shedding",
            "Whether a standing queue for the memory budget is being shed (1) or not (0).",
            value=1 if admission.shedding else 0,
        )
        refusals = CounterMetricFamily(
            "trio_infer_refusals",
            "Requests refused with RESOURCE_EXHAUSTED, by the bound that refused them.",
            labels=["bound"],
        )
        for bound, count in sorted(admission.rejected.items()):
            refusals.add_metric([bound], count)
        yield refusals

    def _worker_metrics(self) -> Iterator[Metric]:
        pool = self._core.pool.statistics()
        yield GaugeMetricFamily(
            "trio_infer_workers_configured",
            "Worker processes the pool runs at most.",
            value=pool.workers,
        )
        workers = GaugeMetricFamily(
            "trio_infer_workers",
            "Worker processes now, by state: busy (running a call), idle, down (its last "
            "start failed; it tries again).",
            labels=["state"],
        )
        for state, count in (("busy", pool.busy), ("idle", pool.idle), ("down", pool.down)):
            workers.add_metric([state], count)
        yield workers
        yield CounterMetricFamily(
            "trio_infer_worker_starts",
            "Worker processes started: the first ones, and replacements of those that ended.",
            value=pool.started,
        )
        deaths = CounterMetricFamily(
            "trio_infer_worker_deaths",
            "Worker processes that ended other than by the server's shutdown, by cause: crash "
            "(died unasked), killed (by the server: its call's requester was gone), "
            "start_failed (could not be started).",
            labels=["cause"],
        )
        for cause, count in (
            ("crash", pool.crashed),
            ("killed", pool.killed),
            ("start_failed", pool.failed_starts),
        ):
            deaths.add_metric([cause], count)
        yield deaths
        yield CounterMetricFamily(
            "trio_infer_deadline_refusals",
            "Worker calls not started because their deadline was closer than the model's "
            "shortest recent call (their requests end DEADLINE_EXCEEDED).",
            value=pool.not_started,
        )

    def _transport_metrics(self) -> Iterator[Metric]:
        connections = GaugeMetricFamily(
            "trio_infer_connections",
            "Client connections open now, by protocol.",
            labels=["protocol"],
        )
        calls = GaugeMetricFamily(
            "trio_infer_calls_in_flight",
            "Calls in flight now, by protocol (on gRPC, each is an HTTP/2 stream).",
            labels=["protocol"],
        )
        started = CounterMetricFamily(
            "trio_infer_calls",
            "Calls started, by protocol (every method, not only inference).",
            labels=["protocol"],
        )
        for protocol, counts in sorted(self._transports().items()):
            connections.add_metric([protocol], counts.connections)
            calls.add_metric([protocol], counts.calls)
            started.add_metric([protocol], counts.calls_started)
        yield from (connections, calls, started)


def _histogram(name: str, documentation: str) -> HistogramMetricFamily:
    return HistogramMetricFamily(name, documentation, labels=_MODEL)


def _add_histogram(
    family: HistogramMetricFamily, labels: Sequence[str], histogram: HistogramSnapshot
) -> None:
    family.add_metric(
        labels,
        [
            ("+Inf" if bound == math.inf else repr(bound), count)
            for bound, count in histogram.cumulative()
        ],
        histogram.sum,
    )


def _batch_sizes(batch_sizes: Mapping[int, tuple[int, float]]) -> HistogramSnapshot:
    """The executions by size as a histogram of :data:`BATCH_SIZE_BUCKETS`: exact, since a size
    is a whole number of rows."""
    counts = [0] * (len(BATCH_SIZE_BUCKETS) + 1)
    total = 0
    for rows, (executions, _) in batch_sizes.items():
        counts[bisect_left(BATCH_SIZE_BUCKETS, rows)] += executions
        total += rows * executions
    return HistogramSnapshot(tuple(map(float, BATCH_SIZE_BUCKETS)), tuple(counts), float(total))
