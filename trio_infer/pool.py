"""Worker processes for model code: a fixed number of them, on trio-parallel.

Model code runs in worker processes so that it can use every core, block, crash or be killed
without taking the server with it. Each worker keeps the models it has loaded
(``trio_infer.worker``); the pool only decides how many processes run at once and turns
process-level failures into the server's errors.

Resource handling: the pool is an async context manager. Leaving it waits for running calls,
asks idle workers to exit, and kills any that have not exited after ``GRACE_PERIOD`` seconds, so
no worker outlives it (an unclean shutdown is logged, not raised). A cancelled ``predict``
(deadline passed, client gone, shutdown) kills its worker at once: the call's result would have
no reader, and a model call cannot be interrupted any other way. The next call starts a
replacement, which loads its models lazily.

Error handling: a worker that dies mid-call fails that call with ``Unavailable`` naming the
signal or exit code; the pool keeps serving.
"""

from __future__ import annotations

import logging
import math
import multiprocessing
import multiprocessing.forkserver
import os
import signal
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

import numpy as np
import trio
import trio_parallel

from trio_infer import worker
from trio_infer.errors import InferError, ModelFailed, StatusCode, Unavailable
from trio_infer.model import Parameters
from trio_infer.settings import ModelSettings

__all__ = ["GRACE_PERIOD", "PoolStatistics", "WorkerPool"]

#: Seconds idle workers get to exit when the pool closes before they are killed. A healthy idle
#: worker exits within milliseconds; this only bounds how long a stuck one can delay the
#: server's exit, which must come within its own grace period plus a second.
GRACE_PERIOD = 0.25

_log = logging.getLogger(__name__)
#: How many recent successful calls of a model its shortest call time is taken from.
_RECENT_CALLS = 16
#: After this many calls of a model refused in a row, one is started anyway.
_MAX_REFUSED_IN_A_ROW = 8
_T = TypeVar("_T")

# Worker type. A replacement worker starts on the request path (after a crash or a cancelled
# call), so its start-up is latency someone waits for. Measured on 2 cores, Python 3.11,
# numpy 2.4, from the call to the result of add_sub on a fresh worker (model loaded lazily):
#   SPAWN       130-185 ms: a new interpreter imports numpy, protobuf and this package each time.
#   FORKSERVER  13-15 ms: a fork of a server process that imported the _PRELOAD modules once
#               (pages shared copy-on-write). Preloading trio_infer.worker alone gave 40 ms.
#   FORK        not used: forking the Trio process copies its threads' locks in any state.
# The first worker costs about the same either way (~150 ms; the fork server imports once).
# Round trips are alike (add_sub 1x16: p50 230-330 us, p99 ~0.5 ms; trio-parallel alone 140 us).
# Caveat: multiprocessing re-runs the parent's __main__ script in every worker (as __mp_main__;
# "python -m pkg" with a pkg/__main__.py is exempt), so whatever that script imports at module
# level is imported by each new worker: a script that imports the server costs ~120 ms more.

# Modules every worker imports; multiprocessing's child set-up itself needs logging and pkgutil.
_PRELOAD = [
    "trio_infer._forkserver",
    "logging",
    "pkgutil",
    "_trio_parallel_workers",
    "trio_infer.worker",
]


@dataclass(frozen=True)
class PoolStatistics:
    """A snapshot of a pool.

    Attributes:
        workers: The number of worker processes the pool runs at most.
        busy: Calls running (or starting their worker) now.
        idle: Live workers waiting for a call.
        waiting: Calls waiting for a free worker.
        crashed: Workers that died during a call since the pool opened (kills on cancel are
            not crashes).
        not_started: Calls refused when a worker came free because their deadline was closer
            than the model's shortest recent call time.
    """

    workers: int
    busy: int
    idle: int
    waiting: int
    crashed: int
    not_started: int


class WorkerPool:
    """Runs model code in a fixed number of worker processes.

    Create it with ``WorkerPool.open``; all methods must be called inside that block.
    """

    def __init__(self, context: Any, workers: int) -> None:
        self._context = context
        self._workers = workers
        # One token per worker: a call holds a worker process for exactly as long as a token.
        self._limiter = trio.CapacityLimiter(workers)
        # predict holds a token of _limiter itself (to look at the deadline once a worker is
        # free), so its trio-parallel call needs no second bound.
        self._held = _AlreadyHeld()
        self._crashed = 0
        self._crash = trio.Event()
        self._timings: dict[str, _CallTimes] = {}
        self._pickled_settings: dict[tuple[str, str], tuple[ModelSettings, bytes]] = {}
        self._not_started = 0

    @classmethod
    @asynccontextmanager
    async def open(
        cls, workers: int, *, debug: bool = False, threads_per_worker: int = 1
    ) -> AsyncIterator[WorkerPool]:
        """Open a pool; workers start on first use (or ``warm_up``) and are stopped on exit.

        Args:
            workers: The number of worker processes (at least 1).
            debug: Append the model's traceback to ``ModelFailed`` messages.
            threads_per_worker: Threads each worker's BLAS / OpenMP libraries may use. Workers
                share the machine's cores: keep ``workers * threads_per_worker`` at or below
                the core count.

        Yields:
            The pool.

        Raises:
            ValueError: ``workers`` or ``threads_per_worker`` is less than 1.
        """
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        if threads_per_worker < 1:
            raise ValueError(f"threads_per_worker must be at least 1, got {threads_per_worker}")
        worker_type = _prepare_worker_type(threads_per_worker)
        manager = trio_parallel.open_worker_context(
            # Idle workers hold loaded models: never let them time out.
            idle_timeout=math.inf,
            init=partial(worker.configure, threads_per_worker, debug),
            grace_period=GRACE_PERIOD,
            worker_type=worker_type,
        )
        context = await manager.__aenter__()
        try:
            yield cls(context, workers)
        finally:
            # trio-parallel shields the shutdown; GRACE_PERIOD bounds it.
            try:
                await manager.__aexit__(None, None, None)
            except trio_parallel.BrokenWorkerError as exc:
                # Stragglers were killed, or an idle worker had died: nothing is left running,
                # and the shutdown itself (or the error that caused it) matters more.
                _log.warning("worker pool shut down uncleanly: %s", exc.args[0])

    async def warm_up(self, models: Sequence[ModelSettings]) -> None:
        """Start every worker process and load every model in each.

        Args:
            models: The models to load.

        Raises:
            InferError: A model failed to load (the first failure; the message names the
                model). Workers that loaded every model stay warm.
            Unavailable: A worker died while loading.
        """
        # `workers` concurrent jobs each hold a worker until their job is done, so each gets a
        # worker of its own: a fresh one when the cache is empty.
        errors: list[InferError] = []

        async def warm_one() -> None:
            try:
                await self._run("loading models", worker.load_all, tuple(models))
            except InferError as exc:
                errors.append(exc)

        async with trio.open_nursery() as nursery:
            for _ in range(self._workers):
                nursery.start_soon(warm_one)
        if errors:
            raise errors[0]

    async def predict(
        self, settings: ModelSettings, inputs: dict[str, np.ndarray], parameters: Parameters
    ) -> dict[str, np.ndarray]:
        """Run one model call in a worker, waiting for a free worker first.

        Cancelling the call (a deadline, a client gone) kills the worker running it; the pool
        starts a replacement on the next call. So that deadlines under load do not turn into a
        stream of killed workers, a call whose deadline (the enclosing cancel scopes') is closer
        than the shortest of the model's recent calls when a worker comes free is not started.
        A model's call time may depend on its inputs, and a call that is not started teaches
        nothing: so after a few refusals in a row, one call is started anyway.

        Args:
            settings: The model; a worker loads it on first use.
            inputs: The input tensors by name.
            parameters: The request's parameters.

        Returns:
            The model's outputs by name.

        Raises:
            InferError: The model raised one; its status is kept.
            ModelFailed: The model raised anything else, or returned something other than
                ``dict[str, numpy.ndarray]``.
            Unavailable: The worker process died during the call.
        """
        name = settings.name
        times = self._timings.setdefault(name, _CallTimes())
        async with self._limiter:
            shortest = times.shortest()
            left = trio.current_effective_deadline() - trio.current_time()
            if left < shortest and times.refused_in_a_row < _MAX_REFUSED_IN_A_ROW:
                times.refused_in_a_row += 1
                self._not_started += 1
                raise InferError(
                    f"deadline exceeded: model '{name}' has recently taken at least "
                    f"{shortest * 1000:.0f} ms and {max(left, 0) * 1000:.0f} ms were left when "
                    "a worker came free",
                    StatusCode.DEADLINE_EXCEEDED,
                )
            times.refused_in_a_row = 0
            started = trio.current_time()
            outputs = await self._run(
                f"running model {name!r}",
                worker.predict,
                self._pickled(settings),
                inputs,
                parameters,
                limiter=self._held,
            )
            times.recent.append(trio.current_time() - started)
        return outputs

    def _pickled(self, settings: ModelSettings) -> bytes:
        # Keyed by identity (hashing settings would cost more than pickling them); the entry
        # holds the settings, so the identity stays theirs.
        key = (settings.name, settings.version)
        entry = self._pickled_settings.get(key)
        if entry is None or entry[0] is not settings:
            entry = self._pickled_settings[key] = (
                settings,
                worker.pickled_settings(settings),
            )
        return entry[1]

    async def wait_worker_crash(self) -> None:
        """Wait until a worker process dies during a call (kills on cancel do not count)."""
        await self._crash.wait()

    def statistics(self) -> PoolStatistics:
        """Return a snapshot of the pool's workers and calls."""
        return PoolStatistics(
            workers=self._workers,
            busy=self._limiter.borrowed_tokens,
            idle=self._context.statistics().idle_workers,
            waiting=self._limiter.statistics().tasks_waiting,
            crashed=self._crashed,
            not_started=self._not_started,
        )

    async def _run(
        self,
        what: str,
        fn: Callable[..., _T],
        *args: object,
        limiter: trio.CapacityLimiter | _AlreadyHeld | None = None,
    ) -> _T:
        try:
            result: _T = await self._context.run_sync(
                fn, *args, kill_on_cancel=True, limiter=limiter or self._limiter
            )
        except InferError:
            raise
        except trio.ClosedResourceError:
            raise Unavailable(f"the worker pool is shut down (while {what})") from None
        except trio_parallel.BrokenWorkerError as exc:
            self._crashed += 1
            self._crash.set()
            self._crash = trio.Event()
            raise Unavailable(f"worker process died while {what} ({_exit_cause(exc)})") from exc
        except Exception as exc:
            # The job or its result could not cross the process boundary (trio-parallel has
            # killed that worker): the model's doing, e.g. an unpicklable output.
            raise ModelFailed(f"{type(exc).__name__}: {exc} (while {what})") from exc
        return result


class _AlreadyHeld:
    """The limiter trio-parallel is given for a call that already holds a worker token.

    trio-parallel enters its limiter around every call; an unbounded ``CapacityLimiter`` there
    cost a scheduler pass on each call, between a worker coming free and its next job.
    """

    async def __aenter__(self) -> None:
        # A cancelled call must not take a worker (it would be killed at once); this raises
        # without a scheduler pass when there is no cancellation.
        await trio.lowlevel.checkpoint_if_cancelled()

    async def __aexit__(self, *exc_info: object) -> None:
        return None


@dataclass
class _CallTimes:
    """What the pool knows of one model's call times."""

    recent: deque[float] = field(default_factory=lambda: deque(maxlen=_RECENT_CALLS))
    refused_in_a_row: int = 0

    def shortest(self) -> float:
        return min(self.recent, default=0.0)


def _exit_cause(exc: trio_parallel.BrokenWorkerError) -> str:
    process = exc.args[-1] if exc.args else None
    code = getattr(process, "exitcode", None)
    if not isinstance(code, int):
        return "cause unknown"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _prepare_worker_type(threads_per_worker: int) -> Any:
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return trio_parallel.WorkerType.SPAWN
    # The fork server is per process and starts once: the first pool's settings are what it
    # preloads with. Workers apply their own thread limits at start (worker.configure), so a
    # later pool with other limits still gets them.
    multiprocessing.get_context("forkserver").set_forkserver_preload(_PRELOAD)
    with _environment(dict.fromkeys(worker.THREAD_VARIABLES, str(threads_per_worker))):
        # numpy sizes its BLAS thread pool when imported, and the fork server imports it.
        # Blocking, but once per process and a few milliseconds (it does not wait for the
        # preload; the first worker start does).
        multiprocessing.forkserver.ensure_running()
    return trio_parallel.WorkerType.FORKSERVER


@contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value
