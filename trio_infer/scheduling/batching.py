"""Adaptive batching: compatible requests for one model run as one worker call.

::

    Batching.run                     a task in the server nursery; stopped after the last call
    └── ModelBatcher.run             one per batching model, with its own nursery
        └── batcher (a few per worker) plans the next batch, awaits the worker call, answers

A request task calls :meth:`ModelBatcher.predict`: it joins its model's queue and waits on its own
reply slot (a request that fills a batch by itself goes to the pool directly). A batcher takes a
batch out of the queue (:func:`plan_batch` decides which requests and when), concatenates their
inputs along dimension 0, awaits ``pool.predict`` and fills every member's slot with its rows of
the outputs (checked against the declared ones, once for the batch when that tells each
member's check), or with the error. As many batches as there are
workers may be in the pool at once, and full ones besides: the pool sends those to a worker
ahead of time, so it starts them as soon as it is done with the one before. A batch that can
still grow stays in the queue instead, where the requests that come meanwhile can join it.

Ownership and cancellation:

- Each request owns its slot and is its only reader; the queue and a batch only hold it. A batch
  fills every slot it holds on every exit path (result, error, crash, shutdown), and a stopped
  model fills the slots of its queue, so no request waits for an answer that cannot come.
- A request that is cancelled (deadline, client gone, shutdown) while queued leaves the queue; one
  cancelled while its batch runs leaves the batch and its status is sent at once, while the worker
  call goes on for the others. When the last member leaves, the call is cancelled, which kills
  its worker if the call has started (``kill_on_cancel``): nobody is left to read the result.
- A model error or a dead worker fails the members of that batch, each with its own copy of the
  error.
- A batcher that crashes (a bug: an unexpected exception) fails the requests it held with
  INTERNAL: its batch's members, or, if it crashed while planning, the queue it was planning
  from (the same queue would crash the next planner). The crash is logged with its traceback and
  counted (``BatchStatistics.batcher_crashes``), and a fresh batcher task takes its place in the
  model's nursery. The model's other batchers and its later requests go on.

Model errors are logged by :class:`ModelErrorLog`, at most one line per model per interval, in
the server process where the failed call ends (the pool for a model's own errors, the batcher for
outputs that do not split into the members' rows).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import accumulate, pairwise
from typing import Protocol

import numpy as np
import trio

from trio_infer.errors import InferError, ModelFailed, StatusCode, Unavailable
from trio_infer.model import ModelOutputs, Parameters, ParameterValue, Response
from trio_infer.repository.settings import ModelSettings
from trio_infer.scheduling.model_errors import ModelErrorLog
from trio_infer.scheduling.priority import DEFAULT_PRIORITY
from trio_infer.scheduling.reply import Reply
from trio_infer.scheduling.statistics import ModelRecorder, StatisticsRecorder, Timing

__all__ = [
    "BatchPlan",
    "BatchStatistics",
    "Batching",
    "ModelBatcher",
    "OutputsCheck",
    "Pending",
    "Predictor",
    "batch_key",
    "batching_enabled",
    "concatenate_inputs",
    "plan_batch",
    "split_outputs",
]

logger = logging.getLogger(__name__)

#: Weight of the newest worker call in the running estimate of a call's duration.
_RUN_TIME_WEIGHT = 0.2
#: Time a batch needs besides its worker call, so that a batch dispatched for a member's
#: deadline still answers before it: concatenating, splitting, encoding and sending, and a late
#: wake-up of the batcher on a busy machine. Too much only makes deadline-bound batches leave a
#: little earlier, and smaller; too little loses answers to their deadlines.
_DISPATCH_SLACK = 0.025
#: Seconds a batcher that replaces a crashed one waits before it starts.
_RESTART_PAUSE = 0.1


#: A model's check of what it returned for a request: its outputs (a ``Response``'s outputs) and
#: the request's batch size (None when its inputs have none). It raises ``ModelFailed`` when
#: they are not the declared ones (``trio_infer.core.validation.outputs_check``).
OutputsCheck = Callable[[Mapping[str, np.ndarray], int | None], None]


class Predictor(Protocol):
    """What a batcher calls: :class:`trio_infer.workers.pool.WorkerPool` or a test's fake."""

    async def predict(
        self,
        settings: ModelSettings,
        inputs: dict[str, np.ndarray],
        parameters: Parameters,
        priority: int = DEFAULT_PRIORITY,
        *,
        timing: Timing | None = None,
        deadline: float | None = None,
    ) -> ModelOutputs:
        """Run one model call; see :meth:`trio_infer.workers.pool.WorkerPool.predict`."""
        ...


# --- pure decisions --------------------------------------------------------------------------


def batching_enabled(settings: ModelSettings) -> bool:
    """Whether a model's requests are batched.

    Args:
        settings: The model's settings.

    Returns:
        True when ``max_batch_size`` is more than 1 and every declared input has ``-1`` as its
        first dimension (a model that declares no inputs qualifies; its requests are batched
        when their inputs share a first dimension).
    """
    return settings.max_batch_size > 1 and all(spec.shape[:1] == (-1,) for spec in settings.inputs)


def batch_key(inputs: Mapping[str, np.ndarray], parameters: Parameters) -> Hashable:
    """What must be equal for two requests to share a batch.

    Args:
        inputs: The request's input tensors.
        parameters: The request's parameters, per-tensor parameters and headers: a model call
            gets one ``Parameters``, so every member of a batch must have the same.

    Returns:
        A hashable value made of the input names, dtypes and trailing dimensions
        (``shape[1:]``), and the parameters with their types (``True``, ``1`` and ``1.0`` are
        equal in Python but a model may tell them apart).
    """
    return _tensors_key(inputs), _parameters_key(parameters)


# Every request of a batching model that overlaps others comes to these two, most with one
# input, no parameters, that input's own parameters empty and one header (the client's agent):
# names are unique, so sorting items never compares two arrays or two mappings; a single item
# is taken without a sort or a list, an empty mapping's part is () without a call, and the
# request's parameters are read from their dict, not through Parameters' Python __len__. Tuples
# are made from lists (cheaper than from generators).


def _tensors_key(inputs: Mapping[str, np.ndarray]) -> Hashable:
    """:func:`batch_key`'s part of the inputs. A dtype stands as itself, not as its ``str`` (a
    string made at each read): numpy keeps a dtype's hash, and equal dtypes are equal keys."""
    if len(inputs) == 1:
        for name, array in inputs.items():
            return ((name, array.dtype, array.shape[1:]),)
    return tuple([(name, array.dtype, array.shape[1:]) for name, array in sorted(inputs.items())])


def _parameters_key(parameters: Parameters) -> Hashable:
    """:func:`batch_key`'s part of the parameters."""
    values: Mapping[str, ParameterValue] = parameters.__dict__["_values"]
    per_tensor = parameters.inputs
    own: tuple[tuple[str, _Typed], ...]
    if len(per_tensor) == 1:
        for name, given in per_tensor.items():
            own = ((name, _typed(given) if given else ()),)
    else:
        own = tuple(
            [(name, _typed(given) if given else ()) for name, given in sorted(per_tensor.items())]
        )
    headers = parameters.headers
    return (
        _typed(values) if values else (),
        own,
        (tuple(headers.items()) if len(headers) == 1 else tuple(sorted(headers.items())))
        if headers
        else (),
    )


#: Parameters with their types, in name order.
_Typed = tuple[tuple[str, str, ParameterValue], ...]


def _typed(values: Mapping[str, ParameterValue]) -> _Typed:
    """``values`` (not empty) with their types, in name order."""
    return tuple(sorted([(name, type(value).__name__, value) for name, value in values.items()]))


class Pending(Protocol):
    """What :func:`plan_batch` knows of a waiting request."""

    @property
    def key(self) -> Hashable:
        """Its :func:`batch_key` and its priority; only requests with equal keys share a batch."""
        ...

    @property
    def priority(self) -> int:
        """Its priority level: 1 is the highest (see :mod:`trio_infer.scheduling.priority`)."""
        ...

    @property
    def rows(self) -> int:
        """The rows it adds to a batch: its inputs' common first dimension."""
        ...

    @property
    def arrived(self) -> float:
        """When it joined the queue (Trio clock)."""
        ...

    @property
    def deadline(self) -> float:
        """When its caller stops waiting (Trio clock; ``math.inf`` for never)."""
        ...


@dataclass(frozen=True)
class BatchPlan:
    """What a batcher does next.

    Attributes:
        take: Positions in the queue of the requests to run now, in arrival order; empty when
            no batch is ready.
        wake_at: When to plan again if the queue does not change first (``math.inf``: only when
            it changes).
    """

    take: tuple[int, ...] = ()
    wake_at: float = math.inf


def plan_batch(
    waiting: Sequence[Pending],
    *,
    now: float,
    max_batch_size: int,
    max_batch_time: float,
    lead: float,
    full_only: bool = False,
) -> BatchPlan:
    """Decide which waiting requests run as the next batch, and when.

    Requests with equal keys form batches in arrival order: each batch starts at the oldest
    request not yet placed and takes the next ones while their rows fit in ``max_batch_size``
    (the first always fits, so a request larger than that runs alone). No request overtakes an
    older one of its key, so a batch that the next request would overflow cannot grow: it is
    closed. A batch is ready when it is closed or full (``max_batch_size`` rows or more), or when
    it is due: when its oldest member has waited ``max_batch_time``, or when a member's deadline
    is no more than ``lead`` away, whichever comes first. Of the ready batches, the one of the
    highest priority level whose oldest member arrived first runs.

    Args:
        waiting: The queue, in arrival order.
        now: The current time (Trio clock).
        max_batch_size: The most rows a batch is filled to.
        max_batch_time: The longest a batch's oldest member waits for others, in seconds.
        lead: How long before a member's deadline its batch must start: the expected duration
            of a worker call plus the time to send the answer.
        full_only: Only a closed or full batch is ready (one that can still grow must wait,
            whatever its age), and none runs while a batch of a higher level waits: that one
            goes first, once a running batch ends.

    Returns:
        The batch to run now, or when to plan again.
    """
    forming: dict[Hashable, _Forming] = {}
    for position, request in enumerate(waiting):
        batch = forming.get(request.key)
        if batch is None:
            forming[request.key] = _Forming(position, request, max_batch_time, lead)
        elif not batch.closed:
            batch.offer(position, request, max_batch_size, lead)
    wake_at = math.inf
    ready: _Forming | None = None
    highest = math.inf
    # Batches in the order of their oldest members, so the first ready one of a level is its
    # oldest.
    for batch in forming.values():
        highest = min(highest, batch.priority)
        if batch.closed or batch.rows >= max_batch_size or (batch.due <= now and not full_only):
            if ready is None or batch.priority < ready.priority:
                ready = batch
        elif not full_only:
            wake_at = min(wake_at, batch.due)
    if ready is None or (full_only and ready.priority > highest):
        # Sent ahead, the lower batch would hold the batcher the higher one needs next.
        return BatchPlan((), wake_at)
    return BatchPlan(tuple(ready.positions), now)


class _Forming:
    """The first batch of one key while the queue is scanned."""

    def __init__(self, position: int, head: Pending, max_batch_time: float, lead: float) -> None:
        self.positions = [position]
        self.priority = head.priority
        self.rows = head.rows
        self.closed = False
        self.due = min(head.arrived + max_batch_time, head.deadline - lead)

    def offer(self, position: int, request: Pending, max_batch_size: int, lead: float) -> None:
        if self.rows + request.rows > max_batch_size:
            self.closed = True
            return
        self.positions.append(position)
        self.rows += request.rows
        due = request.deadline - lead
        if due < self.due:  # not min(): a builtin call parsing its arguments, every member
            self.due = due


def concatenate_inputs(batch: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Join the inputs of a batch's requests along dimension 0.

    Args:
        batch: Each member's inputs, in batch order; all have the same :func:`batch_key`.

    Returns:
        One array per input name, in the first member's order. A batch of one is passed on as
        it is (no copy), so its model call is exactly the unbatched one.
    """
    if len(batch) == 1:
        return dict(batch[0])
    return {name: np.concatenate([inputs[name] for inputs in batch]) for name in batch[0]}


def split_outputs(
    outputs: ModelOutputs, rows: Sequence[int], model_name: str
) -> list[ModelOutputs]:
    """Cut a batch's outputs into each member's rows.

    Args:
        outputs: The model's outputs for the whole batch, or its ``Response``: then each member
            gets a ``Response`` of its rows with the batch's metadata.
        rows: Each member's row count, in batch order.
        model_name: Named in error messages.

    Returns:
        Each member's outputs, in batch order: copies of its rows, so that a member whose
        response is slow to send holds its own rows and not the whole batch's (responses are
        sent from the arrays' memory); for a batch of one, the arrays themselves.

    Raises:
        ModelFailed: An output does not have the batch's total row count as its first
            dimension; the message names the output. Checked for batches of one too, so a
            model breaks the same way at any load.
    """
    if isinstance(outputs, Response):
        return [
            Response(part, outputs.headers, outputs.trailers)
            for part in _split_rows(outputs.outputs, rows, model_name)
        ]
    return list(_split_rows(outputs, rows, model_name))


def _split_rows(
    outputs: Mapping[str, np.ndarray], rows: Sequence[int], model_name: str
) -> list[dict[str, np.ndarray]]:
    total = sum(rows)
    for name, array in outputs.items():
        if array.ndim == 0 or array.shape[0] != total:
            raise ModelFailed(
                f"model '{model_name}' output '{name}' has shape {list(array.shape)}, but a "
                f"batched model must return one row per input row: its batch had {total} row(s)"
            )
    if len(rows) == 1:
        return [dict(outputs)]
    # Loops, not a comprehension of comprehensions: each member's dict would be a function
    # made and called (Python 3.11).
    items = list(outputs.items())
    parts: list[dict[str, np.ndarray]] = []
    for start, stop in pairwise(accumulate(rows, initial=0)):
        part = {}
        for name, array in items:
            part[name] = array[start:stop].copy()
        parts.append(part)
    return parts


# --- statistics ------------------------------------------------------------------------------


@dataclass(frozen=True)
class BatchStatistics:
    """A snapshot of one model's batching.

    Attributes:
        batches: Batches sent to a worker.
        requests: Requests those batches held.
        rows: Rows those batches held.
        max_batch_requests: The most requests one batch held.
        max_batch_rows: The most rows one batch held.
        total_queue_wait: Seconds the batched requests waited, summed, from joining the queue
            to their batch's dispatch.
        max_queue_wait: The longest one of them waited.
        waiting: Requests in the queue now.
        abandoned: Requests that left the queue before their batch ran (deadline, cancel).
        alone: Requests that filled a batch by themselves, so went to the pool directly.
        batcher_crashes: Batcher tasks that raised (a bug), each replaced by a fresh one.
    """

    batches: int = 0
    requests: int = 0
    rows: int = 0
    max_batch_requests: int = 0
    max_batch_rows: int = 0
    total_queue_wait: float = 0.0
    max_queue_wait: float = 0.0
    waiting: int = 0
    abandoned: int = 0
    alone: int = 0
    batcher_crashes: int = 0

    @property
    def mean_batch_requests(self) -> float:
        """Requests per batch (0 before the first)."""
        return self.requests / self.batches if self.batches else 0.0

    @property
    def mean_batch_rows(self) -> float:
        """Rows per batch (0 before the first)."""
        return self.rows / self.batches if self.batches else 0.0

    @property
    def mean_queue_wait(self) -> float:
        """Seconds a batched request waited for its batch, on average (0 before the first)."""
        return self.total_queue_wait / self.requests if self.requests else 0.0


@dataclass(slots=True)
class _BatchCounts:
    """A model's :class:`BatchStatistics` but ``waiting``, counted in place: a frozen snapshot
    rebuilt at every batch cost each call microseconds. :meth:`snapshot` makes one."""

    batches: int = 0
    requests: int = 0
    rows: int = 0
    max_batch_requests: int = 0
    max_batch_rows: int = 0
    total_queue_wait: float = 0.0
    max_queue_wait: float = 0.0
    abandoned: int = 0
    alone: int = 0
    batcher_crashes: int = 0

    def add_batch(self, rows: int, waits: Sequence[float]) -> None:
        """Count one more batch of ``rows`` rows and ``len(waits)`` requests, which waited
        ``waits`` seconds (not empty)."""
        self.batches += 1
        self.requests += len(waits)
        self.rows += rows
        self.max_batch_requests = max(self.max_batch_requests, len(waits))
        self.max_batch_rows = max(self.max_batch_rows, rows)
        self.total_queue_wait += sum(waits)
        self.max_queue_wait = max(self.max_queue_wait, *waits)

    def add_batch_of_one(self, rows: int) -> None:
        """:meth:`add_batch` of one request of ``rows`` rows that did not wait, without the
        list of its waits."""
        self.batches += 1
        self.requests += 1
        self.rows += rows
        if not self.max_batch_requests:
            self.max_batch_requests = 1
        if rows > self.max_batch_rows:
            self.max_batch_rows = rows

    def snapshot(self, waiting: int) -> BatchStatistics:
        """The statistics now, with ``waiting`` requests in the queue."""
        return BatchStatistics(
            batches=self.batches,
            requests=self.requests,
            rows=self.rows,
            max_batch_requests=self.max_batch_requests,
            max_batch_rows=self.max_batch_rows,
            total_queue_wait=self.total_queue_wait,
            max_queue_wait=self.max_queue_wait,
            waiting=waiting,
            abandoned=self.abandoned,
            alone=self.alone,
            batcher_crashes=self.batcher_crashes,
        )


# --- the pipeline ----------------------------------------------------------------------------


class _Member(Reply[ModelOutputs]):
    """A request in a model's queue or batch: its own reply slot (one object a request, not
    two), and what the planning and its batch read of it. Compared by identity
    (``list.remove``), never by its arrays."""

    __slots__ = (
        "arrived",
        "batch",
        "deadline",
        "inputs",
        "key",
        "parameters",
        "priority",
        "rows",
        "timing",
    )

    def __init__(
        self,
        inputs: dict[str, np.ndarray],
        parameters: Parameters,
        priority: int,
        key: Hashable,
        rows: int,
        arrived: float,
        deadline: float,
        timing: Timing,
    ) -> None:
        # Reply's fields set here rather than by its __init__: one call less per request.
        self.filled = False
        self._result = None
        self._error = None
        self._waiter = None
        self.inputs = inputs
        self.parameters = parameters
        self.priority = priority
        self.key = key
        self.rows = rows
        self.arrived = arrived
        self.deadline = deadline
        self.batch: _Batch | None = None
        self.timing = timing
        """Its request's, filled when its batch succeeds."""


class _Batch:
    """A running batch as its members see it: how many still wait for it, and the scope that
    stops its call. It holds no member: each member refers to its batch, and a reference back
    would make every batch a cycle, its members' requests (inputs, outputs, replies, timings,
    keys) garbage that only a collection of the cyclic garbage collector frees, a collection
    that walks every young object."""

    __slots__ = ("live", "scope")

    def __init__(self, members: int) -> None:
        self.live = members
        self.scope = trio.CancelScope()

    def leave(self) -> None:
        self.live -= 1
        if self.live == 0:
            # Nobody will read the result: stop the call, which frees (kills) its worker.
            self.scope.cancel()


class ModelBatcher:
    """One model's queue and batchers.

    Args:
        settings: The model; its ``max_batch_size`` and ``max_batch_time`` shape the batches.
        pool: Where batches run.
        batchers: How many batches of this model may run at once (one batcher task each).
        ahead: How many more may wait in the pool for a worker, if they are full. A batch sent
            ahead starts as soon as a worker is done with the one before; one that can still
            grow waits here, where later requests can join it.
        model_errors: Where the model's errors are logged (shared with the pool).
        recorder: Where the model's executions are counted (see
            :mod:`trio_infer.scheduling.statistics`); by default one of its own.
        check_outputs: What every request's outputs are checked with before it gets them
            (:meth:`predict` raises its error); None: only their rows are.
    """

    def __init__(
        self,
        settings: ModelSettings,
        pool: Predictor,
        *,
        batchers: int,
        ahead: int = 0,
        model_errors: ModelErrorLog | None = None,
        recorder: ModelRecorder | None = None,
        check_outputs: OutputsCheck | None = None,
    ) -> None:
        if batchers < 1:
            raise ValueError(f"batchers must be at least 1, got {batchers}")
        if ahead < 0:
            raise ValueError(f"ahead must be at least 0, got {ahead}")
        self.settings = settings
        self._pool = pool
        self._batchers = batchers
        self._ahead = ahead
        self._in_pool = 0
        # Invariant: arrival order; each member here has no batch and an unfilled reply.
        self._waiting: list[_Member] = []
        # Set by a change (_notify) for the tasks waiting then, and replaced: never set while
        # it is the current one. _watched says whether a task has waited on it since it was
        # made: only then must a change set it (every request joining the queue is one).
        self._changed = trio.Event()
        self._watched = False
        # One batcher plans at a time; the others run their batches meanwhile.
        self._planning = trio.Lock()
        self._stopped: InferError | None = None
        self._run_time = 0.0
        # The model's nursery, set by run: where batchers run, and replacements of crashed ones.
        self._nursery: trio.Nursery | None = None
        self._model_errors = model_errors if model_errors is not None else ModelErrorLog()
        self._recorder = (
            recorder if recorder is not None else ModelRecorder(settings.name, settings.version)
        )
        # Counts only: ``waiting`` is filled in by statistics().
        self._counts = _BatchCounts()
        # The Trio clock: run() sets the run's own clock's reading, which trio.current_time
        # finds through two more calls.
        self._now: Callable[[], float] = trio.current_time
        # Whether the model is called one request at a time: off when a request joins the
        # queue, on again when a batch of one ends with nothing else of the model running or
        # waiting (_ended_alone; see predict).
        self._one_at_a_time = True
        # The last request's Parameters and their part of its batch key (see predict).
        self._keyed: Parameters | None = None
        self._parameters_key: Hashable = ()
        self._check_outputs = check_outputs
        # One check of a batch's outputs, for its total rows, serves every member when it
        # passes only if each member's part then passes for the member's rows: so when every
        # declared output's first dimension is -1 (the split gave each member its own rows). A
        # fixed first dimension can fit the total and not a member's rows.
        self._check_once = all(spec.shape[:1] == (-1,) for spec in settings.outputs)

    async def predict(
        self,
        inputs: dict[str, np.ndarray],
        rows: int | None,
        parameters: Parameters,
        deadline: float,
        priority: int = DEFAULT_PRIORITY,
        timing: Timing | None = None,
    ) -> ModelOutputs:
        """Run one request as part of a batch.

        Cancelling the call (its deadline, its client) takes the request out of the queue, or
        out of its running batch; see the module's documentation.

        Args:
            inputs: The request's input tensors.
            rows: The size of the first dimension every input shares, as the caller found it
                checking them; None when there is none (no inputs): the request runs alone.
            parameters: The request's parameters.
            deadline: When the caller stops waiting (Trio clock), the effective deadline of its
                cancel scopes: its batch is dispatched in time for it, and the pool is given it
                for a request that goes alone.
            priority: The request's level: a batch of a higher level runs first, and requests
                of different levels never share one.
            timing: Its ``queued`` set to when the request arrives here; filled when the
                request's batch succeeds, with the batch's start and compute time (every
                member counts the whole batch's).

        Returns:
            The request's rows of the batch's outputs (with the batch's metadata, when the
            model returned a ``Response``), checked with ``check_outputs``.

        Raises:
            InferError: The model raised one, for the whole batch (its status is kept).
            ModelFailed: The model failed otherwise, an output lacks the batch's rows, or the
                request's outputs fail ``check_outputs`` (its error).
            Unavailable: The worker died during the batch, or batching has stopped.
        """
        if self._stopped is not None:
            raise type(self._stopped)(self._stopped.message, self._stopped.code)
        if timing is None:
            timing = Timing()
        # One read of the clock: the request's arrival in the queue, and a batch of one's start.
        arrived = timing.queued = self._now()
        if rows is None:
            outputs = await self._alone(inputs, parameters, priority, timing, 1, deadline)
            self._check(outputs, None)
            return outputs
        if rows >= self.settings.max_batch_size:
            # It would run alone, as a full batch: it goes to the pool as one, without the
            # queue, the planning and two task switches, which cost more than the call saves.
            self._counts.alone += 1
            outputs = await self._alone(inputs, parameters, priority, timing, rows, deadline)
            self._check(outputs, rows)
            return outputs
        if (
            self._one_at_a_time
            and not self._in_pool
            and not self._waiting
            and not self.settings.max_batch_time
            and self._nursery is not None
        ):
            # Nothing of the model runs or waits: a running batcher would take this request
            # alone at once, so it goes from this task, without the batcher's two turns (a
            # pass of the scheduler each, on the call's path).
            return await self._as_batch_of_one(
                self._alone(inputs, parameters, priority, timing, rows, deadline), rows, arrived
            )
        # Requests overlap: they go through the batchers, which let those that arrive together
        # (a wave of a closed loop, read in one pass) form one batch rather than one going alone.
        self._one_at_a_time = False
        # A Parameters object is immutable: the key of the last one seen serves while the same
        # object comes again (the core hands a model's requests without request-level
        # parameters one object while their per-input parameters and headers repeat).
        if parameters is not self._keyed:
            self._keyed = parameters
            self._parameters_key = _parameters_key(parameters)
        key = (priority, _tensors_key(inputs), self._parameters_key)
        member = _Member(inputs, parameters, priority, key, rows, arrived, deadline, timing)
        self._waiting.append(member)
        if self._watched:  # most requests of a wave join after the first woke the planner
            self._notify()
        try:
            return await member.wait()
        finally:
            if not member.filled:
                self._abandon(member)

    async def _alone(
        self,
        inputs: dict[str, np.ndarray],
        parameters: Parameters,
        priority: int,
        timing: Timing,
        rows: int,
        deadline: float,
    ) -> ModelOutputs:
        """Run a request as an execution of its own, of ``rows`` rows, from its own task
        (``deadline``: its caller's, as :meth:`predict` was given it)."""
        outputs = await self._pool.predict(
            self.settings, inputs, parameters, priority, timing=timing, deadline=deadline
        )
        self._recorder.executed(rows, timing.compute)
        return outputs

    async def _as_batch_of_one(
        self, alone: Awaitable[ModelOutputs], rows: int, started: float
    ) -> ModelOutputs:
        """Await ``alone`` (a request's :meth:`_alone`, from its own task, ``started`` then) as
        the batcher runs a batch of one: counted as one, its outputs' rows checked."""
        self._counts.add_batch_of_one(rows)
        self._in_pool += 1
        try:
            outputs = await alone
            self._learn_run_time(self._now() - started)
            (part,) = self._split(outputs, [rows])
            self._check(part, rows)
            return part
        except InferError:
            raise
        except Exception as crash:
            # A bug, as in a batcher (_run): this request fails INTERNAL, the next ones go on.
            self._count_crash()
            logger.error(
                "internal error: a batch of one of model '%s' crashed (%s: %s); its request failed",
                self.settings.name,
                type(crash).__name__,
                crash,
                exc_info=crash,
            )
            raise _crashed(self.settings.name) from None
        finally:
            self._in_pool -= 1
            self._ended_alone()
            if self._waiting:  # a batch that waits for a free worker may go now
                self._notify()

    def _ended_alone(self) -> None:
        """A batch of one ended: with nothing else of the model running or waiting, it is
        called one request at a time again."""
        if not self._waiting and not self._in_pool:
            self._one_at_a_time = True

    def _learn_run_time(self, elapsed: float) -> None:
        self._run_time += _RUN_TIME_WEIGHT * (elapsed - self._run_time)

    def _split(self, outputs: ModelOutputs, rows: list[int]) -> list[ModelOutputs]:
        try:
            return split_outputs(outputs, rows, self.settings.name)
        except ModelFailed as error:
            # The model's fault, found here rather than in the pool: logged here.
            self._model_errors.record(self.settings.name, error)
            raise

    def _check(self, outputs: ModelOutputs, rows: int | None) -> None:
        """Check a request's outputs (of ``rows`` rows) with ``check_outputs``."""
        if self._check_outputs is not None:
            self._check_outputs(outputs.outputs if isinstance(outputs, Response) else outputs, rows)

    def _failed_checks(
        self, outputs: ModelOutputs, parts: list[ModelOutputs], rows: list[int]
    ) -> list[ModelFailed | None] | None:
        """Each member's error of ``check_outputs`` (None if it passes) for its part of a
        batch's ``outputs``, in batch order; None when the whole batch passes at once."""
        if self._check_outputs is None:
            return None
        if self._check_once:
            try:
                self._check(outputs, sum(rows))
                return None
            except ModelFailed:
                # Each member's error names its own shape and rows: checked one by one.
                pass
        errors: list[ModelFailed | None] = []
        for part, count in zip(parts, rows, strict=True):
            try:
                self._check(part, count)
                errors.append(None)
            except ModelFailed as error:
                errors.append(error)
        return errors

    def statistics(self) -> BatchStatistics:
        """Return a snapshot of this model's batching."""
        return self._counts.snapshot(len(self._waiting))

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run this model's batchers until cancelled.

        A batcher that crashes is replaced (see the module's documentation). Requests still
        queued when this returns fail with ``Unavailable``.
        """
        name = self.settings.name
        self._now = trio.lowlevel.current_clock().current_time
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                for _ in range(self._batchers + self._ahead):
                    nursery.start_soon(self._batcher)
                task_status.started()
        except* Exception as crash:
            # Only a bug in the replacing itself comes here: this model's batching stops, and
            # its later requests fail, rather than the server.
            logger.error("model '%s': batching crashed and stopped", name, exc_info=crash)
            self._count_crash()
            self._stop(_crashed(name))
        finally:
            self._stop(Unavailable(f"model '{name}': batching stopped"))

    async def _batcher(self, pause: float = 0.0) -> None:
        """Plan and run batches until cancelled; if it raises, a fresh batcher replaces it."""
        # A replacement waits first, so that a bug met at every start cannot spin.
        if pause:
            await trio.sleep(pause)
        members: list[_Member] | None = None
        try:
            while True:
                members = None
                async with self._planning:
                    members, batch = await self._next_batch()
                await self._run(members, batch)
        except Exception as crash:
            # Cancellations are not caught: they end the task, as they should.
            self._replace_crashed_batcher(crash, members)

    def _replace_crashed_batcher(self, crash: Exception, members: list[_Member] | None) -> None:
        self._count_crash()
        error = _crashed(self.settings.name)
        if members is None:
            # It crashed while planning, from the queue: what it held is the queue.
            held = len(self._waiting)
            self._fail_waiting(error)
            doing = "planning a batch"
        else:
            # _run failed the batch's members already, on its way out.
            held = len(members)
            doing = "running a batch"
        logger.error(
            "internal error: a batcher of model '%s' crashed while %s (%s: %s); the %d "
            "request(s) it held failed, and a fresh batcher replaces it",
            self.settings.name,
            doing,
            type(crash).__name__,
            crash,
            held,
            exc_info=crash,
        )
        assert self._nursery is not None
        self._nursery.start_soon(self._batcher, _RESTART_PAUSE)

    def _count_crash(self) -> None:
        self._counts.batcher_crashes += 1

    async def _next_batch(self) -> tuple[list[_Member], _Batch]:
        settings = self.settings
        while True:
            now = self._now()
            plan = plan_batch(
                self._waiting,
                now=now,
                max_batch_size=settings.max_batch_size,
                max_batch_time=settings.max_batch_time,
                lead=self._run_time + _DISPATCH_SLACK,
                # Past the workers' number, only full batches go ahead: the others wait for
                # one in the pool to end (it notifies), still open to later requests.
                full_only=self._in_pool >= self._batchers,
            )
            if plan.take:
                return self._take(plan.take, now)
            changed = self._changed
            self._watched = True
            if plan.wake_at == math.inf:
                # Only a change can make a batch ready (always so with no max_batch_time and
                # no deadlines): no cancel scope for a time that never comes.
                await changed.wait()
                continue
            with trio.move_on_at(plan.wake_at):
                await changed.wait()

    def _take(self, positions: tuple[int, ...], now: float) -> tuple[list[_Member], _Batch]:
        members = [self._waiting[position] for position in positions]
        batch = _Batch(len(members))
        self._counts.add_batch(sum(m.rows for m in members), [now - m.arrived for m in members])
        # Last, so that a member is in the queue or in the batch returned, whatever raises.
        chosen = set(positions)
        self._waiting = [m for i, m in enumerate(self._waiting) if i not in chosen]
        for member in members:
            member.batch = batch
        return members, batch

    async def _run(self, members: list[_Member], batch: _Batch) -> None:
        self._in_pool += 1
        try:
            with batch.scope:
                inputs = concatenate_inputs([member.inputs for member in members])
                started = self._now()
                # Every member's parameters and priority are equal (their key): the first's
                # stand for all.
                head = members[0]
                timing = Timing(len(members))
                outputs = await self._pool.predict(
                    self.settings, inputs, head.parameters, head.priority, timing=timing
                )
                self._learn_run_time(self._now() - started)
                rows = [m.rows for m in members]
                parts = self._split(outputs, rows)
                errors = self._failed_checks(outputs, parts, rows)
                for index, (member, part) in enumerate(zip(members, parts, strict=True)):
                    # As Triton counts a batch: each member waited until the batch started,
                    # and computed for as long as the whole batch did.
                    member.timing.started = timing.started
                    member.timing.compute = timing.compute
                    error = None if errors is None else errors[index]
                    if error is None:
                        member.set_result(part)
                    else:
                        member.set_error(error)
                self._recorder.executed(sum(rows), timing.compute)
        except InferError as error:
            for member in members:
                member.set_error(error)
        except Exception:
            # A bug: the batcher is replaced (_batcher), and these requests fail.
            for member in members:
                member.set_error(_crashed(self.settings.name))
            raise
        except BaseException:
            # Cancelled: by the last member leaving (nobody reads these) or by a shutdown. The
            # other ways out have answered every member.
            stopped = Unavailable(f"model '{self.settings.name}': batching stopped")
            for member in members:
                member.set_error(stopped)
            raise
        finally:
            self._in_pool -= 1
            if len(members) == 1:
                self._ended_alone()
            self._notify()

    def _abandon(self, member: _Member) -> None:
        if member.batch is None:
            self._waiting.remove(member)
            self._counts.abandoned += 1
            # A departure can close or fill a batch of the requests behind it.
            self._notify()
        else:
            member.batch.leave()

    async def wait_idle(self) -> None:
        """Wait until no request waits here or runs in a batch: a batcher replaced by another
        (a model reloaded or unloaded) is stopped only then."""
        while self._waiting or self._in_pool:
            self._watched = True
            await self._changed.wait()

    def _notify(self) -> None:
        if self._watched:
            self._watched = False
            self._changed.set()
            self._changed = trio.Event()

    def _stop(self, error: InferError) -> None:
        if self._stopped is None:
            self._stopped = error
        self._fail_waiting(self._stopped)

    def _fail_waiting(self, error: InferError) -> None:
        waiting, self._waiting = self._waiting, []
        for member in waiting:
            member.set_error(error)
        self._notify()


class Batching:
    """The batchers of every model that batches (see :func:`batching_enabled`).

    Start it with ``await nursery.start(batching.run)`` before serving calls, and stop it with
    :meth:`stop` once no call is left.

    Args:
        models: The served models; those that do not batch are left out.
        pool: Where batches run.
        batchers: Batches of one model that may run at once (the pool's worker count: each
            batch holds a worker).
        ahead: Full batches of one model that may wait in the pool besides (see
            :class:`ModelBatcher`).
        model_errors: Where model errors are logged (shared with the pool).
        recorder: Where each model's executions are counted; by default one of its own.
        outputs_check: A model's ``check_outputs`` (see :class:`ModelBatcher`), from its
            settings; None: outputs are checked for their rows only.
    """

    def __init__(
        self,
        models: Iterable[ModelSettings],
        pool: Predictor,
        *,
        batchers: int,
        ahead: int = 0,
        model_errors: ModelErrorLog | None = None,
        recorder: StatisticsRecorder | None = None,
        outputs_check: Callable[[ModelSettings], OutputsCheck | None] | None = None,
    ) -> None:
        self._pool = pool
        self._outputs_check = outputs_check
        self._batchers = batchers
        self._ahead = ahead
        self._model_errors = model_errors
        self._recorder = recorder if recorder is not None else StatisticsRecorder()
        self._models: dict[str, ModelBatcher] = {}
        # Each batcher's own scope, so that one can be stopped alone (replace, remove).
        self._scopes: dict[ModelBatcher, trio.CancelScope] = {}
        for settings in models:
            batcher = self._batcher_of(settings)
            if batcher is not None:
                self._models[settings.name] = batcher
        self._scope = trio.CancelScope()
        self._nursery: trio.Nursery | None = None

    def _batcher_of(self, settings: ModelSettings) -> ModelBatcher | None:
        if batching_enabled(settings):
            return ModelBatcher(
                settings,
                self._pool,
                batchers=self._batchers,
                ahead=self._ahead,
                model_errors=self._model_errors,
                recorder=self._recorder.model(settings.name, settings.version),
                check_outputs=(
                    None if self._outputs_check is None else self._outputs_check(settings)
                ),
            )
        if settings.max_batch_size > 1:
            fixed = [spec.name for spec in settings.inputs if spec.shape[:1] != (-1,)]
            logger.warning(
                "model '%s' is not batched: input(s) %s have no batch dimension (-1 first)",
                settings.name,
                ", ".join(fixed),
            )
        return None

    def get(self, name: str) -> ModelBatcher | None:
        """The batcher of model ``name``, or None when that model does not batch."""
        return self._models.get(name)

    def statistics(self) -> dict[str, BatchStatistics]:
        """Return a snapshot of each batching model's batching, by model name."""
        return {name: batcher.statistics() for name, batcher in self._models.items()}

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run every model's batchers until :meth:`stop` or cancellation."""
        with self._scope:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                for batcher in self._models.values():
                    await nursery.start(self._run_batcher, batcher)
                task_status.started()
                # Open until stop(), batchers or not: a model loaded later (replace) starts its
                # batcher here, also after the last one was retired or when none served at start.
                await trio.sleep_forever()

    async def replace(self, settings: ModelSettings) -> None:
        """Serve model ``settings.name`` with these settings from now on: its requests go to a
        batcher of them (none, when they do not batch); the requests the one before holds
        are served by it first, then it stops. Needs :meth:`run`.

        The switch is made after the last checkpoint, so a caller may switch what goes with
        the settings (the registry) in the same step."""
        assert self._nursery is not None, "Batching.run has started"
        batcher = self._batcher_of(settings)
        if batcher is not None:
            await self._nursery.start(self._run_batcher, batcher)
            old = self._models.get(settings.name)
            self._models[settings.name] = batcher
        else:
            old = self._models.pop(settings.name, None)
        if old is not None:
            self._nursery.start_soon(self._retire, old)

    def remove(self, name: str) -> None:
        """Stop model ``name``'s batcher once the requests it holds are served (a model
        unloaded: it takes no more). Needs :meth:`run`."""
        old = self._models.pop(name, None)
        if old is not None:
            assert self._nursery is not None, "Batching.run has started"
            self._nursery.start_soon(self._retire, old)

    async def _run_batcher(
        self,
        batcher: ModelBatcher,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        with trio.CancelScope() as scope:
            self._scopes[batcher] = scope
            try:
                await batcher.run(task_status=task_status)
            finally:
                del self._scopes[batcher]

    async def _retire(self, batcher: ModelBatcher) -> None:
        await batcher.wait_idle()
        scope = self._scopes.get(batcher)
        if scope is not None:
            scope.cancel()

    def stop(self) -> None:
        """Stop the batchers; requests still waiting for a batch fail with ``Unavailable``."""
        self._scope.cancel()


def _crashed(model_name: str) -> InferError:
    # The crash's details are for the operator (logged), not for clients.
    return InferError(
        f"internal error in the batching of model '{model_name}': the batcher holding the "
        "request crashed (logged by the server)",
        StatusCode.INTERNAL,
    )


# --- model errors in the log -----------------------------------------------------------------
