"""Worker processes for model code: a fixed number of them, started by trio-parallel.

Model code runs in worker processes so that it can use every core, block, crash or be killed
without taking the server with it. Each worker keeps the models it has loaded
(``trio_infer.workers.child``).

::

    WorkerPool.open               the pool's nursery, inside trio-parallel's worker context
    └── lane (one per worker)     starts a worker when there is work, another when it ends
        └── a worker's life       its own nursery
            ├── the process       trio-parallel runs child.serve in it, for its whole life
            └── the talk          over a Unix socket with child.serve
                ├── receiver      reads the worker's reports, fills their calls' replies
                └── sender        sends calls (the next before the current ends), cancels

A call (``predict``, ``warm_up``) joins the pool's queue (one per priority level,
``trio_infer.scheduling.priority``) and waits on its own reply
(``trio_infer.scheduling.reply``). A lane takes it when its worker has room and from then on
owns it: the lane fills the reply on every exit path (the result, the model's error, the
worker's death, the pool's shutdown). A worker is sent its next call while it runs the current one
(``CALLS_PER_WORKER``), so that it starts the next at once.

Cancellation: a cancelled call that waits in the queue leaves it; one that was sent but has not
started is cancelled in the worker, which skips it; one that runs kills its worker at once (its
result would have no reader, and a model call cannot be interrupted any other way). The worker
may have ended that call and started the next one sent to it just before the signal landed: that
call, killed for another's sake, goes back to the queue to run again, once.

Decoupled models (``generate``): the call's reply is a ``ReplyStream`` that the lane fills with
each item the worker sends, as it comes. Backpressure is by credits (``wire.ITEMS_AHEAD``): the
worker steps its generator only while it has one, and the lane gives one back each time the
request takes an item, so a request that reads slowly stalls the generator and at most
``ITEMS_AHEAD`` items of a call are ever held. A cancelled generating call is stopped by the
worker between two items (it closes the generator); one still running ``STOP_GRACE`` seconds
later (stuck inside a step) has its worker killed, as a plain call's would be at once. A worker
running a generating call is sent nothing else until it ends. Calls sent
after a killed one had not started: they go back to the head of the queue. The lane starts a
replacement worker, which loads its models when they are next called.

Sequences (``trio_infer.scheduling.sequences``): a call of a stateful model's sequence runs on
the lane its sequence is pinned to (the least loaded one when the sequence starts). It waits in
that lane's ``pinned`` queue, in arrival order, which the lane takes after its ``private`` calls
and before the pool's queue, and no other lane takes. When a lane's worker ends, its sequences are
lost (their state was in the process): their waiting calls fail with ``Unavailable``, and so do
their later ones until a ``sequence_start``. They are lost as soon as the lane knows its worker
ended: a sequence started from then on is a new worker's, on that lane only if no other will do.

Error handling: a worker that dies mid-call fails that call with ``Unavailable`` naming the
signal or exit code; the calls sent after it go back to the queue, and the pool keeps serving.
Once its lane knows it has exited, a worker is sent no call, though its connection may outlive it
(a child process the model started holds it open): the lane counts as having no worker, the
other lanes are woken to take the pool's calls (or start a worker for them), and only the lane's
own calls wait for the replacement.
Each death is one WARNING line: the worker's pid, the cause and the calls it failed. A model's
error is logged where its call ends, in this process, at most one line per model per interval
(``trio_infer.scheduling.model_errors.ModelErrorLog``).

Supervision: a lane whose task raises (a bug: an assertion, an unexpected exception) fails the
calls it held with INTERNAL, its worker is killed with it (it is a child of the lane), the crash
is logged with its traceback and counted (``PoolStatistics.lane_crashes``), and a fresh lane
takes its place: a new task in the pool's nursery, never a detached one. The pool and the other
lanes go on.

A worker that cannot be started (out of file descriptors, say) fails only the calls that waited
for it; its lane is down: it takes no calls and tries again after a pause that doubles with each
failure in a row, each cause logged as one WARNING. ``warm_up`` counts it as not warm, not as a
failure of the models. Calls are refused at once only while every lane is down.

Resource handling: leaving ``open`` fails calls still queued, starts no worker from then on,
closes every worker's connection (its ``serve`` returns and trio-parallel stops the idle
process) and kills any worker that has not left after ``GRACE_PERIOD`` seconds; then it waits
for every worker process that ever connected to have exited, killing one still running, so no
worker outlives the pool. Leaving it by an exception or a cancellation kills the workers at once.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import multiprocessing
import multiprocessing.forkserver
import os
import select
import signal
import socket
import struct
import sys
import tempfile
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import trio
import trio_parallel

from trio_infer.errors import InferError, ModelFailed, StatusCode, TooLarge, Unavailable
from trio_infer.model import ModelOutputs, Parameters
from trio_infer.repository.settings import ModelSettings
from trio_infer.scheduling.model_errors import ModelErrorLog
from trio_infer.scheduling.priority import DEFAULT_PRIORITY, PRIORITY_LEVELS
from trio_infer.scheduling.reply import Reply, ReplyStream
from trio_infer.scheduling.sequences import Pin, SequenceFlags, SequenceTable
from trio_infer.scheduling.statistics import Timing
from trio_infer.workers import child, wire

__all__ = [
    "CALLS_PER_WORKER",
    "GRACE_PERIOD",
    "STOP_GRACE",
    "PoolStatistics",
    "WorkerPool",
    "reported_error",
]

#: Seconds idle workers get to exit when the pool closes before they are killed. A healthy idle
#: worker exits within milliseconds; this only bounds how long a stuck one can delay the
#: server's exit, which must come within its own grace period plus a second.
GRACE_PERIOD = 0.25
#: Seconds a worker gets to stop a cancelled generating call (it checks between two items)
#: before it is killed: what bounds a generator stuck inside one step.
STOP_GRACE = 1.0

_log = logging.getLogger(__name__)
#: How many recent successful calls of a model its shortest call time is taken from.
_RECENT_CALLS = 16
#: After this many calls of a model refused in a row, one is started anyway.
_MAX_REFUSED_IN_A_ROW = 8
#: Unloaded settings remembered, to refuse their late calls (see WorkerPool.unload).
_MAX_RETIRED = 64
#: Calls a worker holds at once: the one it runs and the next, so that it starts the next
#: without waiting for a round trip through the server. More would hold more inputs in the
#: socket and delay cancels no further.
CALLS_PER_WORKER = 2
#: Seconds an ended worker's connection is read for its last reports (normally at once).
_LAST_REPORTS_TIME = 1.0
#: Seconds a lane waits after its worker failed to start before it starts another; doubled
#: after each failure in a row, up to ``_RESTART_PAUSE_MAX``.
_RESTART_PAUSE = 0.1
#: The longest wait between starts of a lane whose workers keep failing to start: what bounds
#: both the work spent on a broken environment and how late a lane comes back once it is fixed.
_RESTART_PAUSE_MAX = 5.0

# Worker type. A replacement worker starts on the request path (after a crash or a cancelled
# call), so its start-up is latency someone waits for:
#   SPAWN       not preferred: a new interpreter imports numpy, protobuf and this package each time.
#   FORKSERVER  used where available: a fork of a server process that imported the _PRELOAD
#               modules once (pages shared copy-on-write), so a new worker imports nothing.
#   FORK        not used: forking the Trio process copies its threads' locks in any state.
# Caveat: multiprocessing re-runs the parent's __main__ script in every worker (as __mp_main__;
# "python -m pkg" with a pkg/__main__.py is exempt), so whatever that script imports at module
# level is imported by each new worker, at every start.

# Modules every worker imports; multiprocessing's child set-up itself needs logging and pkgutil.
_PRELOAD = [
    "trio_infer.workers.forkserver",
    "logging",
    "pkgutil",
    "_trio_parallel_workers",
    "trio_infer.workers.child",
]


@dataclass(frozen=True)
class PoolStatistics:
    """A snapshot of a pool.

    Attributes:
        workers: The number of worker processes the pool runs at most.
        busy: Workers running a call now.
        idle: Live workers waiting for a call.
        waiting: Calls that will run and have not started: in the pool's queue, or sent to a
            worker behind the call it runs.
        crashed: Workers that died unasked since the pool opened (kills on cancel are not
            crashes).
        not_started: Calls refused when a worker could take them because their deadline was closer
            than the model's shortest recent call time.
        lane_crashes: Lanes whose task raised (a bug in this process, not a worker's death),
            each replaced by a fresh lane.
        down: Lanes without a worker because their last start failed (out of file
            descriptors, say); each takes no call and tries again after a pause.
        failed_starts: Worker processes that could not be started since the pool opened.
        started: Worker processes that started (connected) since the pool opened: the first
            ones and their replacements.
        killed: Workers the pool killed since it opened: each was running a call whose
            requester was gone (a deadline, a cancel), or sent a report that could not be read.
        waiting_by_model: The requests of ``waiting``'s calls, by model (a batch's call counts
            its requests); models with none are left out.
    """

    workers: int
    busy: int
    idle: int
    waiting: int
    crashed: int
    not_started: int
    lane_crashes: int = 0
    down: int = 0
    failed_starts: int = 0
    started: int = 0
    killed: int = 0
    waiting_by_model: dict[str, int] = field(default_factory=dict)


class WorkerPool:
    """Runs model code in a fixed number of worker processes.

    Create it with ``WorkerPool.open``; all methods must be called inside that block.
    """

    def __init__(self, context: Any, workers: int, folder: str, max_report_bytes: int) -> None:
        self._context = context
        # Bytes one report of a worker may take: what the header of a report says is checked
        # against it before the receiver allocates it (wire.reader).
        self.max_report_bytes = max_report_bytes
        # Each lane runs one trio-parallel job: its worker's serve loop, for the worker's life.
        self._limiter = trio.CapacityLimiter(workers)
        self._lanes = [_Lane(self, i, os.path.join(folder, f"{i}.sock")) for i in range(workers)]
        # The pool's nursery, set by open: where lanes run, and replacements of crashed ones.
        self._nursery: trio.Nursery | None = None
        self._lane_crashes = 0
        self.model_errors = ModelErrorLog()
        """Where model errors are logged; batchers share it (one line per model per interval)."""
        # Unbounded here: every call is a request the server has admitted, and admission is
        # what bounds them.
        self._queue = _Queue()
        # The live sequences, each pinned to a lane (see ``predict``).
        self._sequences: SequenceTable[_Lane] = SequenceTable()
        self._ids = itertools.count()
        self._closing = False
        self._crashed = 0
        self._crash = trio.Event()
        self._timings: dict[str, _CallTimes] = {}
        self._pickled_settings: dict[tuple[str, str], tuple[ModelSettings, bytes]] = {}
        # Settings unloaded since (pickled, most recent last): a late call of one fails here,
        # before any worker (a replacement's too) could load them again behind the caller's
        # back; the last few are kept (child.py keeps the same in each worker).
        self._retired: dict[bytes, str] = {}
        self._not_started = 0
        self._failed_starts = 0
        self._started = 0
        self._kills = 0
        # Every worker process that has connected and may not have exited, by pid: its pidfd,
        # which names that process and no later one with the same pid.
        self._processes: dict[int, int] = {}
        #: The run's clock, read directly: ``trio.current_time()`` is three Python calls to
        #: the same ``current_time`` of it, and a call's path reads it several times.
        self._now = trio.lowlevel.current_clock().current_time

    @classmethod
    @asynccontextmanager
    async def open(
        cls,
        workers: int,
        *,
        debug: bool = False,
        threads_per_worker: int = 1,
        max_report_bytes: int = sys.maxsize,
    ) -> AsyncIterator[WorkerPool]:
        """Open a pool; workers start on first use (or ``warm_up``) and are stopped on exit.

        Args:
            workers: The number of worker processes (at least 1).
            debug: Append the model's traceback to ``ModelFailed`` messages.
            threads_per_worker: Threads each worker's BLAS / OpenMP libraries may use. Workers
                share the machine's cores: keep ``workers * threads_per_worker`` at or below
                the core count.
            max_report_bytes: The most bytes a worker's report (a call's outputs or error)
                may take; a larger one fails its call with ``TooLarge`` and its worker is
                replaced.

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
            init=partial(child.configure, threads_per_worker, debug),
            grace_period=GRACE_PERIOD,
            worker_type=worker_type,
        )
        context = await manager.__aenter__()
        pool: WorkerPool | None = None
        try:
            # Only this user may connect to the workers' sockets (mkdtemp makes the folder 0700).
            with tempfile.TemporaryDirectory(prefix="trio-infer-") as folder:
                # Raised after the lanes' nursery: through it, the error would come out wrapped
                # in an ExceptionGroup.
                body_error: BaseException | None = None
                async with trio.open_nursery() as nursery:
                    pool = cls(context, workers, folder, max_report_bytes)
                    pool._nursery = nursery
                    for lane in pool._lanes:
                        nursery.start_soon(pool._run_lane, lane)
                    try:
                        yield pool
                    except BaseException as exc:
                        body_error = exc
                        nursery.cancel_scope.cancel()
                    finally:
                        pool._close()
                        # Lanes close their connections and workers leave within milliseconds;
                        # one that does not (a call still running) is killed.
                        nursery.cancel_scope.deadline = trio.current_time() + GRACE_PERIOD
                if body_error is not None:
                    raise body_error
        finally:
            # trio-parallel shields the shutdown; GRACE_PERIOD bounds it.
            try:
                await manager.__aexit__(None, None, None)
            except trio_parallel.BrokenWorkerError as exc:
                # Stragglers were killed, or an idle worker had died: nothing is left running,
                # and the shutdown itself (or the error that caused it) matters more.
                _log.warning("worker pool shut down uncleanly: %s", exc.args[0])
            if pool is not None:
                await pool._reap()

    async def warm_up(
        self,
        models: Sequence[ModelSettings],
        *,
        keep_serving: bool = False,
        busy_wait: float = math.inf,
    ) -> int:
        """Start every worker process and load every model in each.

        No load waits for a running call: a worker that is idle loads at once, and this waits
        for it; a busy worker's load is sent ahead of any other call it is sent, and it loads
        the models once the calls it runs have ended, after this has returned (the lanes'
        private calls keep their order, so an ``unload`` sent later drops them after). When
        no worker is idle, this waits for the first busy one to load them, ``busy_wait``
        seconds at most. A busy worker whose load fails logs it and loads the models again when
        it is next called with them.

        A worker that loaded these models already (by an earlier ``warm_up`` in its process's
        life) is not asked again. With ``keep_serving`` (models are served beside these), one
        idle worker loads them only once another has, so that a slow ``load()`` does not take
        every worker from the models served meanwhile.

        A worker that cannot be started (out of file descriptors, say) is not a failure of the
        models: its lane tries again on its own (``PoolStatistics.down``), and
        ``wait_workers_changed`` returns once it has a worker, whose models are then to be
        loaded.

        Args:
            models: The models to load.

        Returns:
            How many workers have every model loaded: at least 1; fewer than ``workers`` while
            some lanes are down or some workers load them behind their calls.

        Raises:
            InferError: A model failed to load (the first failure; the message names the
                model). Workers that loaded every model stay warm.
            Unavailable: A worker died while loading, no worker could be started, or every
                worker ran calls that did not end within ``busy_wait`` (the loads sent to them
                still follow those calls).
        """
        pickled = tuple(self._pickled(s) for s in models)
        for key in pickled:
            self._retired.pop(key, None)  # loaded again on purpose

        lanes = [lane for lane in self._lanes if lane.down or not lane.holds.issuperset(pickled)]
        # Those not in lanes hold the models already.
        loading = _Loading(", ".join(repr(s.name) for s in models), len(self._lanes) - len(lanes))
        later: list[_Lane] = []
        idle = [lane for lane in lanes if lane.idle]
        if keep_serving and idle and (len(idle) > 1 or loading.loaded):
            # One idle worker goes on serving while another loads.
            later = [idle[-1]]
            lanes.remove(idle[-1])
        try:
            for group in (lanes, later):
                async with trio.open_nursery() as nursery:
                    for lane in group:
                        self._send_load(lane, pickled, loading, nursery)
                if loading.errors:
                    raise loading.errors[0]
            # No idle worker loaded them (none was idle, or none could start): the first busy
            # one. Not before the last group: an idle worker kept serving loads sooner.
            with trio.move_on_after(busy_wait):
                while not (loading.loaded or loading.errors) and loading.behind.count:
                    await loading.behind.one_ends()
            if loading.errors:
                raise loading.errors[0]
            if not loading.loaded and loading.behind.count:
                raise Unavailable(
                    f"loading model(s) {loading.names} failed: every worker ran calls that did "
                    f"not end within {busy_wait:g} s; try again once one has ended"
                )
        finally:
            loading.returned = True
        if not loading.loaded:
            raise loading.not_started[0]
        return loading.loaded

    def _send_load(
        self, lane: _Lane, pickled: tuple[bytes, ...], loading: _Loading, nursery: trio.Nursery
    ) -> None:
        """Send a lane its load; its end is awaited in ``nursery`` if the lane is idle, in the
        pool's (behind the calls it runs) if not."""
        if lane.down:
            loading.not_started.append(lane.start_error())
            return
        behind = not lane.idle
        call = self._call("loading models", None, child.load_all, pickled)
        try:
            self._enqueue(call, lane.private)
        except InferError as exc:
            loading.errors.append(exc)
            return
        lane.holds.update(pickled)
        if behind:
            loading.behind.count += 1
            assert self._nursery is not None
            nursery = self._nursery
        nursery.start_soon(self._end_load, lane, call, pickled, loading, behind)

    async def _end_load(
        self, lane: _Lane, call: _Call, pickled: tuple[bytes, ...], loading: _Loading, behind: bool
    ) -> None:
        try:
            await self._reply(call)
        except _StartFailed as exc:
            loading.not_started.append(exc)
        except InferError as exc:
            lane.holds.difference_update(pickled)
            # A busy worker's failure fails the warm-up only while no worker has loaded them.
            if not (loading.returned or (behind and loading.loaded)):
                loading.errors.append(exc)
            elif not self._closing:
                _log.warning(
                    "worker lane %d could not load model(s) %s after the calls it ran: %s; "
                    "it loads them when next called with them",
                    lane.index,
                    loading.names,
                    exc.message,
                )
        except BaseException:
            # Given up on (the warm-up was cancelled): the worker skipped the load, never got
            # it, or was killed for it; it must not count as holding the models.
            lane.holds.difference_update(pickled)
            raise
        else:
            loading.loaded += 1
        finally:
            if behind:
                loading.behind.ended()

    async def unload(
        self,
        settings: ModelSettings,
        busy_deadline: float = -math.inf,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> int:
        """Drop a model from every live worker, freeing its memory there; how many workers
        dropped it by the time this returns.

        ``task_status.started()`` comes once every drop is sent (``nursery.start``): a load
        sent from then on follows the drop in every worker (the lanes' private calls keep
        their order), so its caller need not wait for the drops to end before loading the
        same settings again.

        Each worker drops it after the calls it was sent before (a call of the model still
        queued would load it again: its caller ends its calls first). Idle workers are waited
        for; a busy one drops it once the calls it runs have ended, waited for until
        ``busy_deadline`` (Trio time) and in the pool's nursery after that. A worker that dies
        meanwhile, or cannot be started, does not have it either.
        """
        pickled = self._pickled(settings)
        self._retired[pickled] = settings.name
        if len(self._retired) > _MAX_RETIRED:
            del self._retired[next(iter(self._retired))]
        dropped = 0
        pending = _Behind()

        async def drop(call: _Call, behind: bool) -> None:
            nonlocal dropped
            try:
                with contextlib.suppress(Unavailable):
                    dropped += bool(await self._reply(call))
            finally:
                if behind:
                    pending.ended()

        async with trio.open_nursery() as nursery:
            for lane in self._lanes:
                lane.holds.discard(pickled)
                if lane.down:
                    continue
                behind = not lane.idle
                call = self._call(f"unloading model {settings.name!r}", None, child.unload, pickled)
                try:
                    self._enqueue(call, lane.private)
                except Unavailable:
                    continue
                assert self._nursery is not None
                pending.count += behind
                (self._nursery if behind else nursery).start_soon(drop, call, behind)
            task_status.started()
        with trio.move_on_at(busy_deadline):
            while pending.count:
                await pending.one_ends()
        return dropped

    async def predict(
        self,
        settings: ModelSettings,
        inputs: dict[str, np.ndarray],
        parameters: Parameters,
        priority: int = DEFAULT_PRIORITY,
        sequence: SequenceFlags | None = None,
        timing: Timing | None = None,
        deadline: float | None = None,
    ) -> ModelOutputs:
        """Run one model call in a worker, waiting for a free worker first.

        Calls wait for a worker by priority level, then in arrival order (see
        :mod:`trio_infer.scheduling.priority`).

        Cancelling the call (a deadline, a client gone) while it runs kills the worker running
        it; the pool starts a replacement, which loads its models when they are next called.
        So that deadlines under load do not turn into a stream of killed workers, a call whose
        deadline (the enclosing cancel scopes') would pass before the shortest of the model's
        recent calls could end is not started: it is refused at once if even a free worker
        could not end it in time, otherwise when a worker could take it. A
        model's call time may depend on its inputs, and a call that is not started teaches
        nothing: so after a few refusals in a row, one call is started anyway.

        A call of a ``sequence`` (:mod:`trio_infer.scheduling.sequences`) runs on the worker
        of its sequence, after the sequence's earlier calls, whatever its priority: the first
        call of a sequence picks the least loaded lane, and the sequence's later calls wait in
        that lane's own queue, which it takes before the pool's. A sequence whose worker ends
        (a crash, or a kill on cancel) is lost: its calls that wait fail, and so do its later
        ones until a ``sequence_start`` begins it again.

        Args:
            settings: The model; a worker loads it on first use.
            inputs: The input tensors by name.
            parameters: The request's parameters.
            priority: The call's level, 1 (the highest) to ``PRIORITY_LEVELS``.
            sequence: The sequence the call belongs to, if any.
            timing: Filled when the call succeeds: when the worker started it, and the
                seconds it spent in the model's code.
            deadline: The effective deadline of the caller's cancel scopes (Trio clock), when
                the caller knows it; None: read from the scopes (a walk up every enclosing
                scope, about 35k instructions at a gRPC call's depth).

        Returns:
            The model's outputs by name, or its ``Response`` (outputs with metadata).

        Raises:
            InferError: The model raised one; its status is kept.
            ModelFailed: The model raised anything else, or returned something other than
                ``dict[str, numpy.ndarray]``.
            Unavailable: The worker process died during the call, or the pool is closed, or
                the call's sequence was lost with its worker.
            InvalidInput: The call's sequence is not live and the call does not start it.
        """
        call = self._model_call(settings, child.predict, inputs, parameters, deadline)
        call.timing = timing
        home = self._home(call, settings, sequence, priority)
        try:
            self._enqueue(call, home)
        except BaseException:
            self._finished(call)
            raise
        # Queued and awaited here rather than in a coroutine of its own: every model call's path.
        outputs: ModelOutputs = await self._reply(call)
        return outputs

    async def generate(
        self,
        settings: ModelSettings,
        inputs: dict[str, np.ndarray],
        parameters: Parameters,
        each: Callable[[ModelOutputs], Awaitable[None]],
        priority: int = DEFAULT_PRIORITY,
        sequence: SequenceFlags | None = None,
        timing: Timing | None = None,
    ) -> None:
        """Run a decoupled model's call in a worker: ``await each(outputs)`` for every item its
        generator yields, as it comes, in order; return at the generator's end.

        The generator does not run ahead of ``each`` by more than ``wire.ITEMS_AHEAD`` items:
        it waits in the worker. Cancelling the call (or ``each`` raising) stops the generator
        between two items, or kills its worker if a step outlasts ``STOP_GRACE``.

        Raises:
            InferError: The model raised one (after the items yielded before it).
            ModelFailed: The model raised anything else, its ``predict`` is not a generator,
                or an item is not ``dict[str, numpy.ndarray]``.
            Unavailable: The worker process died during the call, or the pool is closed, or
                the call's sequence was lost with its worker.
            InvalidInput: The call's sequence is not live and the call does not start it (a
                call of a ``sequence`` runs as ``predict`` says).
        """
        call = self._model_call(settings, child.generate, inputs, parameters)
        call.decoupled = True
        call.timing = timing  # filled as predict's, the compute being the whole generation's
        stream: ReplyStream[ModelOutputs] = ReplyStream(
            wire.ITEMS_AHEAD, partial(self._credit, call)
        )
        call.reply = stream
        home = self._home(call, settings, sequence, priority)
        try:
            self._enqueue(call, home)
            try:
                while True:
                    more, item = await stream.next()
                    if not more:
                        return
                    assert item is not None
                    await each(item)
            finally:
                if not stream.filled:
                    self._abandon(call)
        finally:
            self._finished(call)

    def _credit(self, call: _Call) -> None:
        if call.lane is not None:
            call.lane.credit(call)

    async def wait_workers_changed(self) -> None:
        """Wait until a worker process dies unasked (kills on cancel are not crashes), a
        crashed lane is replaced, or a lane that was down has a worker again: each way a fresh
        worker needs its models loaded."""
        await self._crash.wait()

    def statistics(self) -> PoolStatistics:
        """Return a snapshot of the pool's workers and calls."""
        return PoolStatistics(
            workers=len(self._lanes),
            busy=sum(1 for lane in self._lanes if lane.outstanding),
            idle=sum(
                1 for lane in self._lanes if lane.live and lane.connected and not lane.outstanding
            ),
            waiting=len(self._queue) + sum(lane.waiting() for lane in self._lanes),
            crashed=self._crashed,
            not_started=self._not_started,
            lane_crashes=self._lane_crashes,
            down=sum(1 for lane in self._lanes if lane.down),
            failed_starts=self._failed_starts,
            started=self._started,
            killed=self._kills,
            waiting_by_model=self._waiting_by_model(),
        )

    def _waiting_by_model(self) -> dict[str, int]:
        waiting: dict[str, int] = {}
        held = (c for lane in self._lanes for c in lane.waiting_calls())
        for call in itertools.chain(self._queue, held):
            if call.model is not None:
                requests = call.timing.requests if call.timing is not None else 1
                waiting[call.model] = waiting.get(call.model, 0) + requests
        return waiting

    async def _run_lane(self, lane: _Lane, pause: float = 0.0) -> None:
        """Run one lane; if it raises, fail what it held and start a fresh one in its place."""
        # A replacement waits first: a bug that raises before any call is taken must not turn
        # into a loop that logs tracebacks as fast as it can.
        if pause:
            await trio.sleep(pause)
        try:
            await lane.run()
        except* Exception as crash:
            # Cancellations (a shutdown at the same moment) are not caught: they end the task.
            self._replace_crashed_lane(lane, crash)

    def _replace_crashed_lane(self, lane: _Lane, crash: BaseException) -> None:
        self._lane_crashes += 1
        self._sequences.lose(lane, f"worker lane {lane.index} crashed")
        failed = lane.fail_held()
        if not lane.crashed_in_life:
            worker = "it had no worker process"
        else:
            pid = lane.pid if lane.pid is not None else "(pid unknown)"
            worker = f"its worker process {pid} was stopped with it"
        _log.error(
            "internal error: worker lane %d crashed (%s); %d call(s) it held failed, %s, and a "
            "fresh lane replaces it",
            lane.index,
            _summary(crash),
            failed,
            worker,
            exc_info=crash,
        )
        fresh = _Lane(self, lane.index, lane.address)
        self._lanes[lane.index] = fresh
        assert self._nursery is not None
        self._nursery.start_soon(self._run_lane, fresh, _RESTART_PAUSE)
        self._wake_crash_waiters()

    def _model_call(
        self,
        settings: ModelSettings,
        function: Callable[..., Any],
        inputs: dict[str, np.ndarray],
        parameters: Parameters,
        deadline: float | None = None,
    ) -> _Call:
        pickled = self._pickled(settings)
        if pickled in self._retired:
            raise Unavailable(f"model {settings.name!r} was unloaded")
        return self._call(
            f"running model {settings.name!r}",
            settings.name,
            function,
            pickled,
            inputs,
            parameters,
            deadline=deadline,
        )

    def _call(
        self,
        what: str,
        model: str | None,
        function: Callable[..., Any],
        *args: object,
        deadline: float | None = None,
    ) -> _Call:
        # function is one of child.JOBS: the worker is sent its name.
        return _Call(
            id=next(self._ids),
            what=what,
            model=model,
            message=(function.__name__, args),
            deadline=trio.current_effective_deadline() if deadline is None else deadline,
        )

    async def _reply(self, call: _Call) -> Any:
        """Wait for the reply of a call sent to the queues; one given up on is abandoned."""
        try:
            assert isinstance(call.reply, Reply), "a generating call is WorkerPool.generate's"
            try:
                return await call.reply.wait()
            finally:
                if not call.reply.filled:
                    self._abandon(call)
        finally:
            self._finished(call)

    def _home(
        self, call: _Call, settings: ModelSettings, sequence: SequenceFlags | None, priority: int
    ) -> deque[_Call]:
        """The queue a call waits in: its priority level's, or its sequence's lane's."""
        home = self._queue.level(priority)
        if sequence is None:
            return home
        call.pin = self._sequences.route(
            settings.name,
            sequence,
            settings.max_sequence_idle_microseconds / 1e6,
            trio.current_time(),
            self._least_loaded_lane,
        )
        return call.pin.holder.pinned

    def _finished(self, call: _Call) -> None:
        if call.pin is not None:
            self._sequences.finished(call.pin, trio.current_time())

    def _least_loaded_lane(self) -> _Lane:
        """Where a new sequence runs: a lane that is up and not still reading a worker that
        ended (its next worker is not started yet), with the fewest calls, then the fewest
        sequences."""
        return min(
            self._lanes,
            key=lambda lane: (
                lane.down,
                lane.connected and not lane.live,
                len(lane.outstanding) + len(lane.pinned),
                self._sequences.held_by(lane),
                lane.index,
            ),
        )

    def _lose_sequences(self, lane: _Lane, cause: str) -> None:
        """Mark the sequences of a lane whose worker ended lost, and fail their waiting calls
        (every call in ``pinned``: each was routed before the worker ended)."""
        self._sequences.lose(lane, cause)
        for call in lane.pinned:
            assert call.pin is not None, "a call in a lane's pinned queue has a sequence"
            call.pin.lose(cause)  # one that ended (sequence_end) is no longer in the table
            call.reply.set_error(Unavailable(call.pin.lost or ""))
        lane.pinned.clear()

    def _enqueue(self, call: _Call, home: deque[_Call]) -> None:
        if self._closing:
            raise Unavailable(f"the worker pool is shut down (while {call.what})")
        for lane in self._lanes:  # a loop, not all() and a generator: on every call's path
            if not lane.down:
                break
        else:
            # No lane could take it before its pause ends: fail now rather than by the deadline.
            raise self._lanes[0].start_error()
        # A call that could not end in time on a worker free now is refused now, rather than
        # when a worker could take it: its caller learns at once, and it holds no place.
        if self._in_time(call, None):
            call.home = home
            home.append(call)
            self._wake_lanes()

    def _abandon(self, call: _Call) -> None:
        call.abandoned = True
        if call.lane is None:
            call.home.remove(call)
        else:
            call.lane.abandon(call)

    def _wake_lanes(self) -> None:
        for lane in self._lanes:
            # A lane whose sender waits idle sends what it can take now, from this task: the
            # sender's own turn would cost a pass of the scheduler on every call's path.
            lane.send_now()
        for lane in self._lanes:
            if self._closing or not lane.sender_idle:
                lane.wake()

    def _in_time(self, call: _Call, lane: _Lane | None) -> bool:
        """Whether a call may go to ``lane`` now (None: to a free worker); if not, fail it.

        See ``predict``; a call started to learn the model's call time again is let through.
        """
        if call.model is None or call.forced:
            return True
        times = self._times(call.model)
        shortest = times.shortest
        now = self._now()
        left = call.deadline - now - (lane.free_in(now) if lane is not None else 0.0)
        if left >= shortest:
            times.refused_in_a_row = 0
            return True
        if times.refused_in_a_row >= _MAX_REFUSED_IN_A_ROW:
            times.refused_in_a_row = 0
            call.forced = True
            return True
        times.refused_in_a_row += 1
        self._not_started += 1
        when = " when a worker could start it" if lane is not None else ""
        call.reply.set_error(
            InferError(
                f"deadline exceeded: model '{call.model}' has recently taken at least "
                f"{shortest * 1000:.0f} ms and {max(left, 0) * 1000:.0f} ms were left{when}",
                StatusCode.DEADLINE_EXCEEDED,
            )
        )
        return False

    def _learn(self, model: str | None, seconds: float) -> None:
        if model is not None:
            self._times(model).learn(seconds)

    def _times(self, model: str) -> _CallTimes:
        # Not setdefault: it would build (and drop) a _CallTimes and its deque on every call.
        times = self._timings.get(model)
        if times is None:
            times = self._timings[model] = _CallTimes()
        return times

    def _shortest(self, model: str | None) -> float:
        times = self._timings.get(model) if model is not None else None
        return times.shortest if times is not None else 0.0

    def _note_crash(self) -> None:
        self._crashed += 1
        self._wake_crash_waiters()

    def _wake_crash_waiters(self) -> None:
        self._crash.set()
        self._crash = trio.Event()

    def _close(self) -> None:
        self._closing = True
        queues: list[_Queue | deque[_Call]] = [self._queue]
        for lane in self._lanes:
            queues += [lane.private, lane.pinned]
        for queue in queues:
            for call in queue:
                call.reply.set_error(
                    Unavailable(f"the worker pool is shut down (while {call.what})")
                )
            queue.clear()
        self._wake_lanes()

    def _track(self, pid: int | None) -> None:
        """Remember a connected worker process, to make sure it has exited when the pool has."""
        if pid is None or pid in self._processes:
            return
        with contextlib.suppress(OSError):  # gone already, or no pidfd here: nothing to hold
            self._processes[pid] = os.pidfd_open(pid)

    def _kill(self, pid: int | None) -> None:
        """Kill a connected worker process through its pidfd, if it has not exited.

        trio-parallel sends no signal to a process it believes has exited, and it believes so of
        every worker a fork server started once that fork server is gone: the worker's exit
        status comes through the fork server, whose end of the pipe then reads as exit code 255.
        CPython 3.11's fork server dies (EOFError) when a client runs out of file descriptors
        halfway through asking it for a process, so a worker whose call was abandoned would
        otherwise go on running it, no longer the pool's.
        """
        fd = self._processes.get(pid) if pid is not None else None
        if fd is not None and not _exited(fd):
            assert pid is not None
            _kill_group(pid)
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(fd, signal.SIGKILL)

    def _forget_exited(self, pid: int | None) -> None:
        if pid is not None and pid in self._processes and _exited(self._processes[pid]):
            os.close(self._processes.pop(pid))
            _kill_group(pid)

    async def _reap(self) -> None:
        """Return once every worker process that ever connected has exited.

        trio-parallel waits for the workers it knows of; this holds whatever path a worker took
        (a replacement that started while the pool was closing, say): one still running after
        ``GRACE_PERIOD`` is killed, so none outlives the pool, nor the server.
        """
        with trio.CancelScope(shield=True):
            for pid, fd in list(self._processes.items()):
                with trio.move_on_after(GRACE_PERIOD):
                    await trio.lowlevel.wait_readable(fd)
                if not _exited(fd):
                    _log.warning("worker process %d outlived the pool: killed", pid)
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
                    await trio.lowlevel.wait_readable(fd)
                del self._processes[pid]
                os.close(fd)
                _kill_group(pid)

    def _pickled(self, settings: ModelSettings) -> bytes:
        # Keyed by identity (hashing settings would cost more than pickling them); the entry
        # holds the settings, so the identity stays theirs.
        key = (settings.name, settings.version)
        entry = self._pickled_settings.get(key)
        if entry is None or entry[0] is not settings:
            entry = self._pickled_settings[key] = (
                settings,
                child.pickled_settings(settings),
            )
        return entry[1]


class _StartFailed(Unavailable):
    """A worker process could not be started: a failure of the lane, not of a model."""


class _Behind:
    """Private calls sent behind a busy worker's calls, whose ends are awaited in the pool's
    nursery: how many have not ended, and a way to wait for the next that does."""

    def __init__(self) -> None:
        self.count = 0
        self._ended = trio.Event()

    def ended(self) -> None:
        """One of them has ended."""
        self.count -= 1
        self._ended.set()
        self._ended = trio.Event()

    async def one_ends(self) -> None:
        """Wait until the next of them ends."""
        await self._ended.wait()


@dataclass
class _Loading:
    """What one ``warm_up``'s loads have come to; the loads sent behind a busy worker's calls
    end in the pool's nursery, possibly after the ``warm_up`` has returned."""

    names: str
    """The models, for log lines."""
    loaded: int
    """Workers that hold every model."""
    errors: list[InferError] = field(default_factory=list)
    not_started: list[Unavailable] = field(default_factory=list)
    behind: _Behind = field(default_factory=lambda: _Behind())
    """Its loads sent behind a busy worker's calls."""
    returned: bool = False
    """Whether the ``warm_up`` has returned (or raised): a failure is then logged."""


class _Queue:
    """Calls no lane has taken yet: one first-in, first-out queue per priority level."""

    def __init__(self) -> None:
        self._levels = tuple(deque[_Call]() for _ in range(PRIORITY_LEVELS))

    def level(self, priority: int) -> deque[_Call]:
        """The queue of level ``priority``: a call's home (see ``_Call.home``)."""
        if not 1 <= priority <= PRIORITY_LEVELS:
            raise ValueError(f"priority must be from 1 to {PRIORITY_LEVELS}, got {priority}")
        return self._levels[priority - 1]

    def popleft(self) -> _Call:
        """Remove and return the oldest call of the highest level that has one."""
        for level in self._levels:
            if level:
                return level.popleft()
        raise IndexError("pop from an empty queue")

    def clear(self) -> None:
        for level in self._levels:
            level.clear()

    def __iter__(self) -> Iterator[_Call]:
        return itertools.chain.from_iterable(self._levels)

    def __bool__(self) -> bool:
        return any(self._levels)

    def __len__(self) -> int:
        return sum(len(level) for level in self._levels)


# eq=False: calls are compared by identity (deque.remove), never by their arrays.
@dataclass(eq=False)
class _Call:
    """One job for a worker and its requester's reply; the requester is its only reader."""

    id: int
    what: str
    """What the call does, for error messages: ``running model 'dense'``."""
    model: str | None
    """The model whose call times this call teaches (None: not a model call)."""
    message: tuple[str, tuple[object, ...]]
    """The job's name in ``child.JOBS``, and its arguments."""
    deadline: float
    reply: Reply[Any] | ReplyStream[Any] = field(default_factory=Reply)
    home: deque[_Call] = field(default_factory=deque)
    """The queue it waits in until a lane takes it, and goes back to if it must run again."""
    lane: _Lane | None = None
    """The lane it was sent to; None while it waits in ``home``."""
    abandoned: bool = False
    forced: bool = False
    """Sent whatever its deadline, after refusals in a row, to learn the call time again."""
    decoupled: bool = False
    """A generating call (``WorkerPool.generate``): its reply is a ``ReplyStream``."""
    pin: Pin[_Lane] | None = None
    """The sequence it belongs to: its home is then its lane's ``pinned``."""
    timing: Timing | None = None
    """Its requester's, filled when the call succeeds."""
    requeued: bool = False
    """Sent back to the queue once already after its worker was killed for another call."""


class _Lane:
    """One worker's place in the pool: at most one process at a time, and the calls sent to it.

    ``outstanding`` are the calls sent to the current process, in order; the worker runs them
    in that order, so the first is running (or about to), and the others have not started.
    """

    def __init__(self, pool: WorkerPool, index: int, address: str) -> None:
        self._pool = pool
        self.index = index
        """Its place in the pool's list of lanes; a replacement takes the same."""
        self.address = address
        """The path of the Unix socket its workers connect to."""
        self.pid: int | None = None
        """The current (or last) worker process's id, once known."""
        self.crashed_in_life = False
        """Whether the lane's task raised during a worker's life (which killed the worker)."""
        self._failed_starts = 0
        # The causes of the failed starts in a row, each logged as a WARNING once.
        self._start_failures: set[str] = set()
        self.private: deque[_Call] = deque()
        """Calls for this worker only (a warm-up), taken before the pool's queue."""
        self.holds: set[bytes] = set()
        """The models (pickled settings) its worker process has loaded, or will have once its
        ``private`` calls sent so far are done (WorkerPool.warm_up and unload): emptied when a
        process ends."""
        self.pinned: deque[_Call] = deque()
        """Calls of the sequences this worker runs, in arrival order: taken after ``private``,
        before the pool's queue, and by no other lane."""
        self.outstanding: deque[_Call] = deque()
        self.connected = False
        self._cancels: list[int] = []
        self._credits: dict[int, int] = {}
        # When a cancelled generating call that has not stopped has its worker killed.
        self._stop_by = math.inf
        self._wake = trio.Event()
        # True only while the sender waits with nothing to send on a healthy connection: then
        # any task may send a frame at once (send_now). A frame it could not send whole is left
        # in _unsent for the sender, which sends it before anything else.
        self._sender_idle = False
        self._connection: socket.socket | None = None
        self._unsent: tuple[list[wire.Buffer], _Call | None] | None = None
        # The call whose frame the worker's closed connection refused (not written whole): the
        # worker was gone before it could read it, so it never ran there (see _settle).
        self._undelivered: _Call | None = None
        self._head_started = 0.0
        # The current process's life. live: the lane has a worker process, starting or running;
        # False from the moment the lane knows it ended (see _worker_ended), though its
        # connection may still be read for its last reports. Only a live lane takes calls, and
        # only a live one without calls counts as a free worker (_has_work, _take).
        self.live = False
        self._process = trio.CancelScope()
        self._connecting = trio.CancelScope()
        self._talking = trio.CancelScope()
        # Cancelled when the process's job has ended (_run_process): _watch_exit waits no more.
        self._watching = trio.CancelScope()
        # The worker connection while the receiver waits for the start of a report with
        # nothing read: then every report the worker sent has been taken (None otherwise).
        self._awaiting_report: socket.socket | None = None
        self._killed = False
        # Whether the current life's worker has connected: its sequences are then lost when it
        # ends (_worker_ended), rather than with a start that failed (_not_started_at_all).
        self._connected_in_life = False
        self._moved_on = False
        self._leaving = False
        self._exit_cause = "cause unknown"

    @property
    def idle(self) -> bool:
        """Whether a call sent to it privately now would start without waiting for another."""
        return not (self.down or self.outstanding or self.private)

    @property
    def down(self) -> bool:
        """Whether its last worker failed to start: it takes no calls until one starts."""
        return self._failed_starts > 0

    def start_error(self) -> Unavailable:
        """The error for calls that waited for this lane's worker, which could not start."""
        return _StartFailed(f"a worker process could not start ({self._exit_cause})")

    def wake(self) -> None:
        """Have the lane look at the queues again."""
        self._wake.set()

    @property
    def sender_idle(self) -> bool:
        """Whether the sender waits with nothing to send (what the queues hold is not for it)."""
        return self._sender_idle

    def send_now(self) -> None:
        """Send what the lane would send next, from the calling task, if its sender waits idle.

        Frames go with non-blocking writes until there is nothing more to send or one is not
        taken whole: its rest (or all of it, when the write failed) is left to the sender, which
        sends it first, and meets the same error if the connection is broken.
        """
        if not self._sender_idle:
            return
        assert self._connection is not None
        # Not idle while sending: _next_frame may wake the lanes, and this one must not start
        # a second frame before the first is written.
        self._sender_idle = False
        try:
            self._stop_overdue()
            while True:
                frame, call = self._next_frame()
                if frame is None:
                    break
                # A write that fails leaves the frame whole to the sender, which meets the
                # error again and handles it.
                try:  # noqa: SIM105 (no suppress object made and entered on every call's path)
                    frame = wire.send_some(self._connection, frame)
                except OSError:
                    pass
                if frame:
                    self._unsent = (frame, call)
                    self._wake.set()
                    return
        except BaseException:
            self._wake.set()
            raise
        self._sender_idle = True

    def abandon(self, call: _Call) -> None:
        """Stop a call sent to this lane whose requester is gone."""
        if not self.connected or call not in self.outstanding:
            return  # the worker is gone (its calls are being settled), or the call is done
        if call.decoupled:
            # The worker stops it between two items (or skips it); past STOP_GRACE, the
            # sender kills the worker if it still runs it.
            self._cancels.append(call.id)
            self._stop_by = min(self._stop_by, trio.current_time() + STOP_GRACE)
            self.wake()
        elif call is self.outstanding[0]:
            # It runs, or it is done and its report is not read yet. While the receiver waits
            # for a report with none begun and the connection holds nothing, the worker still
            # runs it: killed now. Otherwise the receiver is reading, or is woken by what the
            # worker sent: it reads that, then kills the worker if this call is still the one
            # it runs (_stop_abandoned, before it next waits).
            waiting = self._awaiting_report
            if waiting is not None and not _holds_data(waiting):
                self._stop_abandoned()
        else:
            self._cancels.append(call.id)
            self.wake()

    def credit(self, call: _Call) -> None:
        """Let a generating call's worker step its generator once more (an item was taken)."""
        if self.connected and call in self.outstanding:
            self._credits[call.id] = self._credits.get(call.id, 0) + 1
            self.wake()

    def waiting(self) -> int:
        """Calls for this worker that will run but have not started."""
        return sum(1 for _ in self.waiting_calls())

    def waiting_calls(self) -> Iterator[_Call]:
        """The calls :meth:`waiting` counts."""
        yield from self.private
        yield from self.pinned
        for call in itertools.islice(self.outstanding, 1, None):
            if not call.abandoned:
                yield call

    def fail_held(self) -> int:
        """Fail every call this lane holds, after its task crashed; return how many.

        The lane's state is not to be trusted after a bug, so the calls sent to its worker are
        failed rather than sent back to the queue: the one that caused the crash could crash the
        next lane too.
        """
        calls = [
            call
            for call in [*self.outstanding, *self.private, *self.pinned]
            if not call.reply.filled
        ]
        self.outstanding.clear()
        self.private.clear()
        self.pinned.clear()
        for call in calls:
            call.reply.set_error(
                InferError(
                    f"internal error in the worker pool while {call.what}: the lane holding "
                    "the call crashed (logged by the server)",
                    StatusCode.INTERNAL,
                )
            )
        return len(calls)

    def kill(self) -> None:
        """Kill the current worker process: at once through its pidfd once it has connected,
        and through trio-parallel's ``kill_on_cancel``, which sends its signal only when its
        task next runs. In between, the worker could finish the call it was killed for and
        start the next one it was sent, which the kill would then cost."""
        self._killed = True
        self._pool._kill(self.pid)
        self._process.cancel()

    def free_in(self, now: float) -> float:
        """About how long until this worker could start a call sent now."""
        wait = 0.0
        for position, call in enumerate(self.outstanding):
            expected = self._pool._shortest(call.model)
            wait += max(expected - (now - self._head_started), 0.0) if position == 0 else expected
        return wait

    async def run(self) -> None:
        """Start a worker when there is work for it, and another when it ends; until closing.

        A lane whose worker could not start is down: it tries again after a pause that doubles
        with each failure in a row (up to ``_RESTART_PAUSE_MAX``), work or not, since the pool
        is a worker short until then.
        """
        while True:
            while not (self.down or self._has_work()):
                if self._pool._closing:
                    return
                await self._sleep()
            if self._pool._closing:
                return  # no worker starts once the pool is shutting down
            if not await self._live():
                pause = min(_RESTART_PAUSE * 2 ** (self._failed_starts - 1), _RESTART_PAUSE_MAX)
                with trio.move_on_after(pause):
                    while not self._pool._closing:
                        await self._sleep()

    def _has_work(self) -> bool:
        if self.private or self.pinned:
            return True
        pool = self._pool
        # A live idle worker elsewhere takes the pool's calls sooner than a new one here.
        return bool(pool._queue) and not any(
            lane.live and not lane.outstanding for lane in pool._lanes
        )

    async def _sleep(self) -> None:
        await self._wake.wait()
        self._wake = trio.Event()

    async def _live(self) -> bool:
        """One worker process's life: start it, talk to it until it ends, settle its calls.

        Returns:
            Whether the worker started (connected).
        """
        self._process, self._connecting, self._talking, self._watching = (
            trio.CancelScope(),
            trio.CancelScope(),
            trio.CancelScope(),
            trio.CancelScope(),
        )
        self._killed = self._connected_in_life = self._moved_on = self._leaving = False
        self._exit_cause = "cause unknown"
        self.pid = None
        self.live = True
        orderly = connected = crashed = False
        try:
            async with trio.open_nursery() as life:
                connection = await self._start(life)
                if connection is not None:
                    connected = self._connected_in_life = True
                    with connection, self._talking:
                        self.connected = True
                        try:
                            await self._talk(connection)
                        finally:
                            self.connected = False
            orderly = True
        except Exception:
            # A bug: the life nursery killed the worker on the way out, and the calls are left
            # to the pool, which fails them as this lane's (WorkerPool._replace_crashed_lane).
            crashed = self.crashed_in_life = True
            raise
        finally:
            self.live = False
            self.holds.clear()
            self._pool._forget_exited(self.pid)
            # A crash leaves the calls to the pool (see above); otherwise they are settled here.
            if not crashed:
                if orderly and not connected:
                    self._not_started_at_all()
                else:
                    self._settle(orderly)
        return connected

    async def _start(self, life: trio.Nursery) -> socket.socket | None:
        """Start a worker process in ``life``; its connection, or None if it ended first."""
        try:
            with _listening(self.address) as listener:
                life.start_soon(self._run_process)
                with self._connecting:
                    connection = await _accept(listener)
                    self.pid = _peer_pid(connection)
                    self._pool._track(self.pid)
                    life.start_soon(self._watch_exit, self.pid)
                    self._pool._started += 1
                    if self.down:
                        _log.info(
                            "worker lane %d: worker process %s started after %d failed start(s)",
                            self.index,
                            self.pid,
                            self._failed_starts,
                        )
                        self._failed_starts = 0
                        self._start_failures.clear()
                        self._pool._wake_crash_waiters()  # its models are to be loaded
                    else:
                        _log.debug(
                            "worker lane %d: worker process %s started", self.index, self.pid
                        )
                    return connection
        except OSError as exc:
            # No socket for it (out of file descriptors, say): stop the process if it started.
            self._exit_cause = f"{type(exc).__name__}: {exc}"
            self.kill()
        return None

    async def _watch_exit(self, pid: int | None) -> None:
        """Kill the worker's process group once the worker has exited, until trio-parallel
        knows it has: it learns so from the end of a pipe, which a process the model started
        holds open after the worker died, and it would wait on it for ever."""
        fd = self._pool._processes.get(pid) if pid is not None else None
        if fd is None:
            return  # no pidfd: the pool cannot tell, nor wait
        assert pid is not None
        with self._watching:
            await trio.lowlevel.wait_readable(fd)
            _kill_group(pid)

    async def _run_process(self) -> None:
        returned = False
        try:
            with self._process:
                await self._pool._context.run_sync(
                    child.serve,
                    self.address,
                    kill_on_cancel=True,
                    limiter=self._pool._limiter,
                )
                returned = True
        except trio_parallel.BrokenWorkerError as exc:
            self._exit_cause = _exit_cause(exc)
            self.pid = getattr(exc.args[-1] if exc.args else None, "pid", None) or self.pid
        except Exception as exc:
            # serve itself failed, before or after connecting: this life is over all the same.
            # The process, if it started, is alive and idle in trio-parallel's hands.
            returned = True
            self._exit_cause = f"{type(exc).__name__}: {exc}"
        finally:
            # A call written to its connection from now on would never run, though the
            # connection may still take it (a child process the model started holds it open).
            self.live = False
            self._watching.cancel()
            if not returned:
                # Killed on cancel, or broken: trio-parallel's kill may not have reached it.
                self._pool._kill(self.pid)
            self._connecting.cancel()
            # The worker's last reports are read at once, normally; this bounds a connection
            # that outlives its worker (a child process the model started holds it open).
            self._talking.deadline = min(
                self._talking.deadline, trio.current_time() + _LAST_REPORTS_TIME
            )
        # Not reached when the life is cancelled (the pool shuts down, or the lane crashed),
        # whose calls the pool fails.
        self._worker_ended()

    def _worker_ended(self) -> None:
        """The current worker process has exited (or its serve returned), and the lane knows it."""
        pool = self._pool
        if self._connected_in_life and not pool._closing:
            # Now, not when the talk ends: a sequence started meanwhile (pinned here when no other
            # lane will do) waits for the next worker, rather than being lost with this one.
            pool._lose_sequences(self, self._loss_cause())
        # Calls other lanes left for this one as a free worker: they take them now, or start
        # a worker for them.
        pool._wake_lanes()

    def _loss_cause(self) -> str:
        """Why the current worker's sequences are lost: its process, and how it ended."""
        pid = self.pid if self.pid is not None else "pid unknown"
        crashed = not self._killed and not self._leaving
        return f"process {pid}, {self._exit_cause if crashed else 'stopped by the pool'}"

    async def _talk(self, connection: socket.socket) -> None:
        async with trio.open_nursery() as talk:
            talk.start_soon(self._receive, connection, talk.cancel_scope)
            await self._send(connection)

    async def _send(self, connection: socket.socket) -> None:
        """Send calls and cancels, one writer for the connection; until the talk ends."""
        self._connection = connection
        try:
            await self._send_frames(connection)
        finally:
            self._sender_idle = False
            self._connection = self._unsent = None

    async def _send_frames(self, connection: socket.socket) -> None:
        while True:
            self._stop_overdue()
            frame: list[wire.Buffer] | None
            if self._unsent is not None:
                (frame, call), self._unsent = self._unsent, None
            else:
                frame, call = self._next_frame()
            if frame is not None:
                try:
                    await _send_frame(connection, frame)
                except (BrokenPipeError, ConnectionResetError):
                    # The worker is gone: the receiver reads its last reports and ends the talk.
                    self._undelivered = call
                    await trio.sleep_forever()
                except OSError as exc:
                    # The connection is broken mid-frame: the worker cannot go on with it, and
                    # the call it runs may have started.
                    self._moved_on = True
                    if call is not None:
                        self.outstanding.remove(call)
                        call.reply.set_error(
                            Unavailable(f"cannot send the call to a worker: {exc} ({call.what})")
                        )
                    self.kill()
                    await trio.sleep_forever()
            elif self._pool._closing and not self.outstanding:
                # Done: the worker's serve returns at the end of the connection.
                self._leaving = True
                with contextlib.suppress(OSError):
                    connection.shutdown(socket.SHUT_WR)
                await trio.sleep_forever()
            else:
                self._sender_idle = True
                try:
                    with trio.move_on_at(self._stop_by):
                        await self._sleep()
                finally:
                    self._sender_idle = False

    def _stop_overdue(self) -> None:
        """Kill the worker if it still runs a cancelled generating call past its STOP_GRACE."""
        # Twice a call: the clock is read only when a stop is due at all.
        if self._stop_by == math.inf or self._stop_by > self._pool._now():
            return
        self._stop_by = math.inf
        head = self.outstanding[0] if self.outstanding else None
        if head is not None and head.decoupled and head.abandoned and not self._killed:
            _log.debug(
                "worker process %s did not stop a cancelled generating call within %g s: killed",
                self.pid,
                STOP_GRACE,
            )
            self.kill()

    def _next_frame(self) -> tuple[list[wire.Buffer] | None, _Call | None]:
        if self._cancels:
            frame = wire.pack(list(self._cancels))
            self._cancels.clear()
            return frame, None
        if self._credits:
            frame = wire.pack(dict(self._credits))
            self._credits.clear()
            return frame, None
        retired = self._pool._retired
        while (call := self._take()) is not None:
            name, args = call.message
            if call.model is not None and retired and args[0] in retired:
                # Unloaded since it was queued (it outlived the grace period, or went back to
                # the queue when its worker died): a worker that never had the settings would
                # load them again, for good, behind the unload.
                call.reply.set_error(Unavailable(f"model {call.model!r} was unloaded"))
                continue
            try:
                frame = wire.pack((call.id, name, args))
            except Exception as exc:
                call.reply.set_error(
                    ModelFailed(f"{type(exc).__name__}: {exc} (while {call.what})")
                )
                continue
            if not self.outstanding:
                self._head_started = self._pool._now()
            # From here on the lane holds it: a crash of the lane fails it (fail_held).
            self.outstanding.append(call)
            call.lane = self
            if self._pool._queue:
                # More work: a lane without a worker may start one for it.
                self._pool._wake_lanes()
            return frame, call
        return None, None

    def _take(self) -> _Call | None:
        if self._killed or not self.live:
            return None
        if self.private:
            return self.private.popleft()
        pool = self._pool
        if len(self.outstanding) >= CALLS_PER_WORKER:
            return None
        if self.outstanding and self.outstanding[-1].decoupled:
            return None  # it may run for long: a call sent behind it would wait as long
        while self.pinned:  # no other lane takes them
            call = self.pinned.popleft()
            if pool._in_time(call, self):
                return call
        queue = pool._queue
        if not queue:
            return None
        if self.outstanding and any(lane.live and not lane.outstanding for lane in pool._lanes):
            return None  # an idle worker starts it sooner
        while queue:
            call = queue.popleft()
            if pool._in_time(call, self):
                return call
        return None

    async def _receive(self, connection: socket.socket, talk: trio.CancelScope) -> None:
        """Read the worker's reports until the connection ends, then end the talk."""
        try:
            staging = wire.Staging()
            # Each report that is not taken whole gets its own reader, and the first part it
            # wants, at its start: both are set before they are read.
            parse: Generator[memoryview, None, object]
            view: memoryview
            reporting = False  # part of a report is read: the call it reports on has ended
            drained = False  # the last fill took all the socket held (Staging.drained)
            report: Any  # (done, skipped, item), as wire's module docstring says
            while True:
                if not reporting:
                    # A report's start: one read into the staging buffer, and a report that
                    # came whole in it is taken at once (as wire.Receiver takes it).
                    if not staging.held:
                        # After a fill that took all the socket held, a read would find
                        # nothing (a system call and an exception, on every call's path): the
                        # receiver waits first. Unless the call at the head is abandoned: its
                        # worker is killed only after a read that finds nothing, for a report
                        # of it may have come since the fill.
                        empty = drained and not self._head_to_stop()
                        if not empty:
                            try:
                                if not staging.fill(connection):
                                    return
                            except BlockingIOError:
                                # Every report the worker has sent is read, so the first
                                # outstanding call is the one it runs: if abandoned, killed.
                                self._stop_abandoned()
                                empty = True
                            except ConnectionResetError:
                                return
                        if empty:
                            drained = False
                            # Not in a cancel scope that abandon cancels (entering and leaving
                            # one is about 48k instructions, on every call): abandon kills the
                            # worker itself while this waits.
                            self._awaiting_report = connection
                            try:
                                await trio.lowlevel.wait_readable(connection)
                            finally:
                                self._awaiting_report = None
                            continue
                        drained = staging.drained
                    reporting = True
                    try:
                        whole, report = staging.take_message()
                    except Exception as exc:
                        self._unreadable_report(exc)
                        return
                    if whole:
                        self._on_report(*report)
                        reporting = False
                        continue
                    # The rest of it is read through parse, from what the staged bytes do
                    # not hold whole (its buffers, or all of it).
                    parse = staging.take_start(self._pool.max_report_bytes)
                    try:
                        view = next(parse)
                    except Exception as exc:
                        self._unreadable_report(exc)
                        return
                    drained = False  # the rest is read in pieces of the report's sizes
                if view:
                    try:
                        received = staging.read(connection, view)
                    except BlockingIOError:
                        await trio.lowlevel.wait_readable(connection)
                        continue
                    except ConnectionResetError:
                        return
                    if received is None:
                        return
                    view = received
                    if view:
                        continue
                try:
                    view = parse.send(None)
                    continue
                except StopIteration as done:
                    report = done.value
                except Exception as exc:
                    self._unreadable_report(exc)
                    return
                self._on_report(*report)
                reporting = False
        finally:
            # The talk is over, its sender cancelled: until it has unwound, a submitting task
            # must not write a call to this connection (send_now), whose worker is gone. The
            # call would count as one the worker died running; it waits for the next worker.
            self._sender_idle = False
            talk.cancel()

    def _head_to_stop(self) -> bool:
        """Whether the first outstanding call is abandoned and its worker is to be killed
        once it is known to run it (a generating call is stopped by the worker, or by the
        sender past its STOP_GRACE)."""
        head = self.outstanding[0] if self.outstanding else None
        return head is not None and head.abandoned and not head.decoupled and not self._killed

    def _stop_abandoned(self) -> None:
        if self._head_to_stop():
            self.kill()

    def _unreadable_report(self, exc: Exception) -> None:
        # A report that does not unpickle here (a class only the worker has): its call fails.
        # The worker went on to its next call, and its state is unknown: it is replaced.
        if self.outstanding:
            call = self.outstanding.popleft()
            error = (
                TooLarge(f"the worker's report takes {exc} (while {call.what})")
                if isinstance(exc, TooLarge)
                else ModelFailed(f"{type(exc).__name__}: {exc} (while {call.what})")
            )
            if call.model is not None:
                self._pool.model_errors.record(call.model, error)
            call.reply.set_error(error)
        self._moved_on = True
        self.kill()

    def _on_report(
        self,
        done: tuple[int, bool, Any, float] | None,
        skipped: list[int],
        item: tuple[int, Any] | None = None,
    ) -> None:
        if item is not None:
            # An item of the generating call the worker runs, the first outstanding one.
            call_id, outputs = item
            call = self.outstanding[0]
            assert call.id == call_id, f"item of call {call_id}, expected call {call.id}"
            assert isinstance(call.reply, ReplyStream), "an item of a call that is not generating"
            call.reply.put(outputs)
            return
        if skipped:
            gone = set(skipped)
            kept: deque[_Call] = deque()
            for call in self.outstanding:
                if call.id not in gone:
                    kept.append(call)
                elif not call.abandoned:
                    # The worker skips only calls it was told were cancelled; one still wanted
                    # gets an answer all the same.
                    call.reply.set_error(ModelFailed(f"the worker skipped the call ({call.what})"))
            self.outstanding = kept
        if done is not None:
            call_id, ok, value, seconds = done
            # Calls run in the order they were sent, so the first outstanding one is done. It
            # stays outstanding until its reply is filled: if anything here raises, the lane's
            # crash fails it with the others it held.
            call = self.outstanding[0]
            assert call.id == call_id, f"report of call {call_id}, expected call {call.id}"
            # The worker started this call when the one before it ended (or when it was sent
            # to an idle worker); it starts the next now.
            started, self._head_started = self._head_started, self._pool._now()
            # Reported after the kill was decided: the call after it may have started since.
            self._moved_on = self._killed
            if ok:
                if not call.decoupled:  # a generation's length teaches nothing of the next
                    self._pool._learn(call.model, seconds)
                if call.timing is not None:
                    call.timing.ran(started, seconds)
                call.reply.set_result(value)
            else:
                error = reported_error(value)
                if call.model is not None:
                    self._pool.model_errors.record(call.model, error)
                call.reply.set_error(error)
            self.outstanding.popleft()
        head = self.outstanding[0] if self.outstanding else None
        if head is not None and head.decoupled and head.abandoned:
            # Cancelled before it started, and it may have started before the cancel came.
            self._stop_by = min(self._stop_by, trio.current_time() + STOP_GRACE)
            self.wake()  # its sender waits until then
        self.send_now()
        if not self._sender_idle:
            self.wake()

    def _not_started_at_all(self) -> None:
        # Nothing was sent, so nothing was lost; but what waits for this worker would wait for
        # ever if each try failed the same way (a broken environment, say). Calls in the pool's
        # queue fail too when no other worker is there or starting to take them.
        self._failed_starts += 1
        self._pool._failed_starts += 1
        error = self.start_error()
        self._pool._lose_sequences(self, f"a worker process could not start: {self._exit_cause}")
        waiting = list(self.private) + list(self.pinned)
        self.private.clear()
        self.pinned.clear()
        if any(lane.live or not lane.down for lane in self._pool._lanes):
            self._pool._wake_lanes()  # a busy worker may take more now that this one is gone
        else:
            waiting += self._pool._queue
            self._pool._queue.clear()
        for call in waiting:
            call.reply.set_error(error)
        # The lane tries again with backoff until a worker starts: each cause is a WARNING
        # once per run of failures, so that a broken environment is a line, not a line a try.
        new_cause = self._exit_cause not in self._start_failures
        self._start_failures.add(self._exit_cause)
        _log.log(
            logging.WARNING if new_cause else logging.DEBUG,
            "worker lane %d: a worker process could not start (%s): %d call(s) failed; the "
            "lane takes no calls and tries again; failed starts in a row: %d",
            self.index,
            self._exit_cause,
            len(waiting),
            self._failed_starts,
        )

    def _settle(self, orderly: bool) -> None:
        """Fill or requeue the calls the ended worker held."""
        pool = self._pool
        calls = list(self.outstanding)
        self.outstanding.clear()
        self._cancels.clear()
        self._credits.clear()
        self._stop_by = math.inf
        undelivered, self._undelivered = self._undelivered, None
        if not orderly or pool._closing:
            for call in calls + list(self.private) + list(self.pinned):
                call.reply.set_error(
                    Unavailable(f"the worker pool is shut down (while {call.what})")
                )
            self.private.clear()
            self.pinned.clear()
            return
        crashed = not self._killed and not self._leaving
        if crashed:
            pool._note_crash()
        elif self._killed:
            pool._kills += 1
        failed = 0
        # The first call was running if the worker died on its own, or if it went on to it
        # after it was told to stop; the others had not started, nor had one whose frame the
        # dead worker's connection refused (it died idle, before the lane noticed). One the
        # pool stopped for another call's sake (it may have just started) runs again, once: a
        # model call is a function of its inputs, and a second kill in a row is not a race but
        # a pattern.
        if (
            calls
            and not calls[0].abandoned
            and calls[0] is not undelivered
            and (crashed or self._moved_on)
        ):
            head = calls[0]
            if not crashed and not head.requeued:
                head.requeued = True
            else:
                calls.pop(0)
                message = (
                    f"worker process died while {head.what} ({self._exit_cause})"
                    if crashed
                    else f"worker process was stopped while {head.what} (because of another "
                    "call it held)"
                )
                head.reply.set_error(Unavailable(message))
                failed = 1
        calls = [call for call in calls if not call.abandoned]
        for call in [c for c in calls if isinstance(c.reply, ReplyStream) and c.reply.given]:
            # Its first items were answered: it cannot start again from the start.
            calls.remove(call)
            call.reply.set_error(Unavailable(f"worker process was stopped while {call.what}"))
            failed += 1
        # The sequences' state went with the process (they were lost when it ended): their calls
        # it held fail. The calls in pinned came since, for the next worker.
        sequences = [call for call in calls if call.pin is not None]
        calls = [call for call in calls if call.pin is None]
        for call in sequences:
            assert call.pin is not None
            # One that ended (sequence_end) had left the table, which did not mark it.
            call.pin.lose(self._loss_cause())
            call.reply.set_error(Unavailable(call.pin.lost or ""))
        failed += len(sequences)
        for call in reversed(calls):
            call.lane = None
            call.home.appendleft(call)
        if crashed:
            _log.warning(
                "worker process %s died (%s): %d call(s) failed with it, %d sent back to the "
                "queue; a replacement starts when there is work",
                self.pid if self.pid is not None else "(pid unknown)",
                self._exit_cause,
                failed,
                len(calls),
            )
        elif self._killed:
            _log.debug(
                "worker process %s was stopped by the pool: %d call(s) failed with it, %d sent "
                "back to the queue",
                self.pid,
                failed,
                len(calls),
            )
        if calls:
            pool._wake_lanes()


async def _accept(listener: socket.socket) -> socket.socket:
    while True:
        try:
            connection, _ = listener.accept()
        except BlockingIOError:
            await trio.lowlevel.wait_readable(listener)
        else:
            connection.setblocking(False)
            return connection


@contextmanager
def _listening(address: str) -> Iterator[socket.socket]:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(address)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.setblocking(False)
        listener.bind(address)
        listener.listen(1)
        yield listener
    finally:
        listener.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(address)


# The connection is a plain non-blocking socket driven with trio.lowlevel's waits, not a
# trio.SocketStream: Trio's socket methods end a read or write that did not block with a
# scheduler pass, and a call makes several; here a task waits only when there is nothing to do.


def _holds_data(connection: socket.socket) -> bool:
    """Whether a read of the worker connection would not block: bytes wait, or its end (or
    an error, which the receiver meets when it reads)."""
    try:
        connection.recv(1, socket.MSG_PEEK)
    except BlockingIOError:
        return False
    except OSError:
        return True
    return True


async def _send_frame(connection: socket.socket, frame: list[wire.Buffer]) -> None:
    while frame:
        try:
            frame = wire.send_some(connection, frame)
        except BlockingIOError:
            await trio.lowlevel.wait_writable(connection)


@dataclass
class _CallTimes:
    """What the pool knows of one model's call times."""

    recent: deque[float] = field(default_factory=lambda: deque(maxlen=_RECENT_CALLS))
    refused_in_a_row: int = 0
    #: The least of ``recent`` (0 while it is empty), kept as each time is learnt: it is read
    #: for every call sent, and each worker's place in the queue, far more often than a
    #: model's time is learnt.
    shortest: float = 0.0

    def learn(self, seconds: float) -> None:
        """Add a call's time to ``recent``."""
        self.recent.append(seconds)
        self.shortest = min(self.recent)


def _peer_pid(connection: socket.socket) -> int | None:
    """The process id of a Unix socket's peer (Linux); None where the OS does not say."""
    option = getattr(socket, "SO_PEERCRED", None)
    if option is None:
        return None
    try:
        credentials = connection.getsockopt(socket.SOL_SOCKET, option, struct.calcsize("3i"))
    except OSError:
        return None
    pid: int = struct.unpack("3i", credentials)[0]
    return pid or None


def _kill_group(pid: int) -> None:
    """Kill the process group of the worker process ``pid`` (``child.configure`` makes it):
    the processes its model started, which would otherwise outlive it, holding its connection
    and the fork server's pipe (and so the fork server) open. Done while the worker lives, or
    at once once it is known to have exited: its pid names the group as long as any process
    of it lives, and a new process would have to take the pid and make a group of it between
    the two to be reached instead."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def _exited(pidfd: int) -> bool:
    """Whether the process a pidfd names has exited (a pidfd is readable from then on)."""
    poll = select.poll()  # not select.select: it takes no descriptor past FD_SETSIZE
    poll.register(pidfd, select.POLLIN)
    return bool(poll.poll(0))


def _summary(crash: BaseException) -> str:
    """``Type: message`` of each exception a crash is made of, without the groups around them."""
    if isinstance(crash, BaseExceptionGroup):
        return "; ".join(_summary(inner) for inner in crash.exceptions)
    return f"{type(crash).__name__}: {crash}"


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
    # preloads with. Workers apply their own thread limits at start (child.configure), so a
    # later pool with other limits still gets them.
    multiprocessing.get_context("forkserver").set_forkserver_preload(_PRELOAD)
    with _environment(dict.fromkeys(child.THREAD_VARIABLES, str(threads_per_worker))):
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


def reported_error(value: object) -> InferError:
    """The error a call whose worker reported a failure ends with: the one reported, its
    status made a ``StatusCode``, when a failed call can end with it (a gRPC status other than
    OK, a text message); otherwise a ``ModelFailed`` that says what was reported. A model
    chooses its error's status and message: OK would answer a failed call as a success with
    no response, and a number that is no gRPC status breaks what is counted by status."""
    if not isinstance(value, InferError):
        return ModelFailed(f"the worker reported a failure that is not an error: {value!r:.200}")
    code, message = value.code, value.message
    if type(code) not in _CODE_TYPES or code not in _ERROR_CODES:
        return ModelFailed(
            f"the model failed with status {code!r:.40}, not a gRPC error status: {message!r:.200}"
        )
    if type(message) is not str:
        return ModelFailed(f"the model failed with a message that is not text: {message!r:.200}")
    value.code = StatusCode(code)  # what is logged and counted names it
    return value


_CODE_TYPES = (int, StatusCode)
_ERROR_CODES = frozenset(StatusCode) - {StatusCode.OK}
