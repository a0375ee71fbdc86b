"""The V2 core: health, metadata and inference, the same for every front-end.

A front-end (gRPC today; a stream's messages and REST build on it) turns what arrived into an
:class:`~trio_infer.core.types.InferenceRequest` and a
:class:`~trio_infer.core.types.RequestContext`, and turns the answer back into its own format.
Everything between is here, once: the model lookup, readiness, validation against the declared
inputs, the memory budget and queue bounds, priority, batching, the model's timeout and the
worker call. Errors are :class:`~trio_infer.errors.InferError`, whose status each front-end maps
to its own (the status table is :mod:`trio_infer.errors`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Hashable, Mapping
from contextlib import AbstractAsyncContextManager
from importlib.metadata import PackageNotFoundError, version
from types import MappingProxyType
from typing import Any, TypeVar, overload

import numpy as np
import trio

from trio_infer.core.model_config import ModelConfiguration, model_configuration
from trio_infer.core.types import (
    InferenceRequest,
    InferenceResponse,
    ModelMetadata,
    ModelStatistics,
    RequestContext,
    ServerMetadata,
)
from trio_infer.core.validation import (
    DeclaredTensors,
    outputs_check,
    select_outputs,
    validate_inputs,
    validate_outputs,
)
from trio_infer.errors import InferError, ModelNotFound, StatusCode, Unavailable, Unimplemented
from trio_infer.model import ModelOutputs, Parameters, Response
from trio_infer.repository.registry import ModelRegistry
from trio_infer.repository.settings import ModelSettings
from trio_infer.scheduling.admission import Admission, OutputSize, Reservation
from trio_infer.scheduling.batching import Batching, ModelBatcher
from trio_infer.scheduling.priority import DEFAULT_PRIORITY, take_priority
from trio_infer.scheduling.sequences import SequenceFlags, sequence_of
from trio_infer.scheduling.statistics import ModelRecorder, RequestTiming, StatisticsRecorder
from trio_infer.workers.pool import CALLS_PER_WORKER, WorkerPool

__all__ = ["CORE_EXTENSIONS", "LIVENESS_SERVICE", "SERVER_NAME", "SERVER_VERSION", "InferenceCore"]

SERVER_NAME = "trio-infer"
#: The health service that is SERVING whenever the server answers at all, draining or not, with
#: its models ready or not: V2's ServerLive for ``grpc.health.v1``, which is all a Kubernetes
#: gRPC probe can call. A liveness probe on ``""`` (readiness) would restart a replica for a
#: broken model, or in the middle of its drain.
LIVENESS_SERVICE = "liveness"
try:
    SERVER_VERSION = version("trio-infer")
except PackageNotFoundError:  # running from a source tree that was never installed
    SERVER_VERSION = "0+unknown"

#: The protocol extensions every front-end serves, by Triton's names: ``model_configuration``
#: (ModelConfig), ``model_repository`` (index, load, unload), ``parameters`` (request and
#: response parameters), ``schedule_policy`` (the ``priority`` and ``timeout`` request
#: parameters), ``sequence`` (sequences) and ``statistics`` (ModelStatistics). Not served:
#: ``classification``, the shared-memory ones, ``trace``, ``logging``.
CORE_EXTENSIONS = (
    "model_configuration",
    "model_repository",
    "parameters",
    "schedule_policy",
    "sequence",
    "statistics",
)

#: What a front-end's encoding of an answer gives (see :meth:`InferenceCore.infer`).
_Encoded = TypeVar("_Encoded")

#: How many times its announced size a request reserves before its body is read: the message,
#: its decoded tensors and an answer as large.
RESERVED_PER_BYTE = 3


class InferenceCore:
    """Serves the Open Inference Protocol's operations to every front-end.

    Args:
        registry: The served models and their readiness.
        pool: Where model code runs.
        admission: The memory budget and the per-model queue bounds.
        strict_readiness: Whether the server is ready only when every model is (Triton's
            ``--strict-readiness``); with False, whenever it runs and is not shutting down.
        extensions: The protocol extensions served, as ServerMetadata lists them
            (:data:`CORE_EXTENSIONS` and those of the front-ends that run).
    """

    def __init__(
        self,
        registry: ModelRegistry,
        pool: WorkerPool,
        admission: Admission,
        *,
        strict_readiness: bool = True,
        extensions: tuple[str, ...] = CORE_EXTENSIONS,
    ) -> None:
        self.registry = registry
        self.strict_readiness = strict_readiness
        self.extensions = tuple(sorted(extensions))
        self.pool = pool
        self.admission = admission
        workers = pool.statistics().workers
        self.recorder = StatisticsRecorder()
        """Each model's request statistics (``recorder.statistics()``): every request of a
        served model that reaches :meth:`infer` or :meth:`infer_each` is recorded."""
        self.batching = Batching(
            registry,
            pool,
            batchers=workers,
            ahead=workers * (CALLS_PER_WORKER - 1),
            model_errors=pool.model_errors,
            recorder=self.recorder,
            # A batcher checks its model's outputs, once for a batch where that tells each
            # member's check: the core checks the others' (see _response).
            outputs_check=outputs_check,
        )
        """The batchers of the models that batch; the server runs and stops them."""
        self.draining = False
        """Set when the server shuts down (:meth:`start_draining`): readiness turns false so
        load balancers move on."""
        # One entry per model name: settings served anew (a reload) replace it at their first
        # request (see _served).
        self._served: dict[str, _Served] = {}

    # -- health and metadata ------------------------------------------------------------------

    def server_live(self) -> bool:
        """Whether the server can answer at all: always, while it runs."""
        return True

    def server_ready(self) -> bool:
        """Whether the server is not shutting down and (with strict readiness) every model is
        ready."""
        return not self.draining and (not self.strict_readiness or self.registry.all_ready())

    def health(self, service: str) -> bool | None:
        """The readiness a health check reports for ``service``: ``""`` (or the V2 service's
        name) is the server, :data:`LIVENESS_SERVICE` its liveness (always true), a model's name
        that model; None for a name that is none of these. The server's names come first."""
        if service in ("", "inference.GRPCInferenceService"):
            return self.server_ready()
        if service == LIVENESS_SERVICE:
            return True
        try:
            return self.model_ready(service)
        except ModelNotFound:
            return None

    @property
    def health_changes(self) -> int:
        """A count of the changes to readiness, for :meth:`wait_health_changed`."""
        return self.registry.changes

    async def wait_health_changed(self, since: int) -> None:
        """Wait until a model's readiness or the server's may have changed (a model loaded or
        lost, the drain started) since :attr:`health_changes` was ``since``."""
        await self.registry.wait_changed(since)

    def start_draining(self) -> None:
        """Shutdown starts: the server and every model report not ready from now on."""
        self.draining = True
        self.registry.notify()

    def model_ready(self, name: str, version: str = "") -> bool:
        """Whether a model can take requests now: False also for a model of the repository that
        is not served (unloaded, or its load failed), as Triton answers.

        Raises:
            ModelNotFound: No such model (or version) is served, or ever was.
        """
        try:
            settings = self.registry.lookup(name, version)
        except Unavailable:
            return False
        return not self.draining and self.registry.is_ready(settings.name)

    def model_state(self, name: str) -> tuple[str, str]:
        """Model ``name``'s state as the repository index says it (``READY``, ``LOADING``,
        ``UNLOADING``, ``UNAVAILABLE``) and why it is not ready (``""`` when it is)."""
        if self.draining:
            return "UNAVAILABLE", "the server is shutting down"
        state, reason = self.registry.state(name)
        return str(state), reason

    def server_metadata(self) -> ServerMetadata:
        """The server's name, version and extensions."""
        return ServerMetadata(name=SERVER_NAME, version=SERVER_VERSION, extensions=self.extensions)

    def model_metadata(self, name: str, version: str = "") -> ModelMetadata:
        """A model's name, versions, platform and declared tensors.

        Raises:
            ModelNotFound: No such model (or version) is served.
        """
        settings = self.registry.lookup(name, version)
        versions = settings.versions or ((settings.version,) if settings.version else ())
        return ModelMetadata(
            name=settings.name,
            versions=tuple(versions),
            platform=settings.platform,
            inputs=settings.inputs,
            outputs=settings.outputs,
        )

    def model_config(self, name: str, version: str = "") -> ModelConfiguration:
        """A model's configuration in Triton's terms (Triton's ModelConfig).

        Raises:
            ModelNotFound: No such model (or version) is served.
        """
        settings = self.registry.lookup(name, version)
        return model_configuration(settings, self.pool.statistics().workers)

    def model_statistics(self, name: str = "", version: str = "") -> list[ModelStatistics]:
        """The request statistics of model ``name`` (``""``: of every served model, by name),
        zeros for a model that has had no request yet (Triton's ModelStatistics).

        Raises:
            ModelNotFound: ``name`` is given and no such model (or version) is served.
        """
        models = (
            sorted(self.registry, key=lambda s: s.name)
            if not name
            else [self.registry.lookup(name, version)]
        )
        recorded = {(s.name, s.version): s for s in self.recorder.statistics()}
        # Read-only: a model without a recorder yet gets a fresh one's zeros, not a recorder
        # (which would make it appear in the metrics as if it had been called).
        return [
            recorded.get((s.name, s.version)) or ModelRecorder(s.name, s.version).statistics()
            for s in models
        ]

    # -- inference ----------------------------------------------------------------------------

    def reserve(
        self, announced: int, deadline: float, owner: Hashable | None = None, *, wait: bool = True
    ) -> AbstractAsyncContextManager[Reservation]:
        """Reserve room in the memory budget for a request of ``announced`` bytes, before its
        body is read (``async with``); the room is given back when the block exits.

        Args:
            announced: The request message's size in bytes.
            deadline: The caller's deadline on the Trio clock (``math.inf``: none).
            owner: The client connection the request came on, as a key unique among the
                connections open: it may hold at most its share of the budget
                (``--max-connection-bytes``). ``None``: the budget alone bounds it.
            wait: False: take room only if there is some now (as :meth:`reserve_nowait`);
                otherwise the block is entered holding nothing, never waiting.

        Raises:
            Overloaded: The budget cannot make room in time, or the connection's share is
                full (RESOURCE_EXHAUSTED); :class:`~trio_infer.errors.TooLarge` when the request
                alone needs more than either holds.
        """
        # Admission.reserve's object made here, without its call.
        return Reservation(self.admission, RESERVED_PER_BYTE * announced, owner, deadline, wait)

    def reserve_nowait(self, announced: int, owner: Hashable | None = None) -> Reservation | None:
        """What :meth:`reserve` holds for a request of ``announced`` bytes, held now if it
        needs no wait; None when it would wait (nothing is held then). The caller gives it back
        (:meth:`~trio_infer.core.types.Reservation.release`, or ``release_later``).

        Raises:
            Overloaded: :meth:`reserve` would refuse the request at once.
        """
        return self.admission.reserve_nowait(RESERVED_PER_BYTE * announced, owner)

    def decoupled(self, name: str, version: str = "") -> bool:
        """Whether a model is decoupled (0..N responses per request: :meth:`infer_each`).

        Raises:
            ModelNotFound: No such model (or version) is served.
        """
        return self.registry.lookup(name, version).decoupled

    @overload
    async def infer(
        self, request: InferenceRequest, context: RequestContext, encode: None = None
    ) -> InferenceResponse: ...

    @overload
    async def infer(
        self,
        request: InferenceRequest,
        context: RequestContext,
        encode: Callable[[InferenceResponse], Awaitable[_Encoded]],
    ) -> _Encoded: ...

    async def infer(
        self,
        request: InferenceRequest,
        context: RequestContext,
        encode: Callable[[InferenceResponse], Awaitable[Any]] | None = None,
    ) -> Any:
        """Run one inference request on its model and return the outputs it asked for, or
        what ``encode`` makes of them.

        Runs in the caller's cancel scope, whose deadline is ``context.deadline``: cancelling it
        takes the request out of whatever queue it is in, and stops a worker call that nobody
        else waits for.

        Args:
            request: The request.
            context: What the core needs of its entrance.
            encode: The front-end's encoding of the answer, when it can fail (or be cancelled)
                after the model ran: it runs within the request's statistics, so the status
                they record is the one the client gets.

        Raises:
            Unimplemented: The model is decoupled (as Triton: UNSUPPORTED, gRPC's UNIMPLEMENTED).
            InferError: With the status the status table gives its cause; or what ``encode``
                raised.
        """
        settings = self.registry.lookup(request.model_name, request.model_version)
        served = self._served_as(settings)
        with RequestTiming(served.recorder, context.deadline, served.now) as timing:
            if settings.decoupled:
                raise Unimplemented(
                    f"model '{settings.name}' is decoupled (0..N responses per request): call it "
                    "on a stream (ModelStreamInfer); ModelInfer doesn't support models with "
                    "decoupled transaction policy"
                )
            batch = self._admit(served, request, context)
            # The model slot's bounds without a context manager's object and calls, on every
            # call's path: given back whatever way the call ends.
            admission = self.admission
            admission.take_slot(settings)
            try:
                priority, parameters, sequence = _model_parameters(served, request, context)
                deadline = context.deadline
                # A sequence's requests run one at a time on its worker: never in a batch.
                batcher = None if sequence is not None else self.batching.get(settings.name)
                # Without a model timeout the call's own scope enforces its deadline: the
                # worker's (or batcher's) coroutine is awaited here, without a coroutine of the
                # core around it.
                run = self._run_on_worker if settings.timeout is None else self._predict
                outputs = await run(
                    settings,
                    batcher,
                    request.inputs,
                    batch,
                    parameters,
                    priority,
                    deadline,
                    sequence,
                    timing,
                )
            finally:
                admission.release_slot(settings)
            # A batcher's answers are checked already.
            response = _response(served, request, outputs, batch, batcher is None)
            if encode is None:
                return response
            return await encode(response)

    async def infer_each(
        self,
        request: InferenceRequest,
        context: RequestContext,
        respond: Callable[[InferenceResponse], Awaitable[None]],
    ) -> None:
        """Run one request on a decoupled model: ``await respond(response)`` for each response,
        as the model yields it; return after the last.

        The model does not run ahead of ``respond`` by more than a few responses (it waits in
        its worker). Cancelling the caller's scope, or ``respond`` raising, stops the model's
        generator (see :meth:`WorkerPool.generate`). The model's ``timeout`` bounds the whole
        generation. A model that is not decoupled answers once.

        Raises:
            InferError: With the status the status table gives its cause (after the responses
                sent before it).
        """
        settings = self.registry.lookup(request.model_name, request.model_version)
        if not settings.decoupled:
            # Answered within the request's statistics, as a decoupled model's responses are.
            await self.infer(request, context, respond)
            return
        served = self._served_as(settings)
        with RequestTiming(served.recorder, context.deadline, served.now) as timing:
            batch = self._admit(served, request, context)
            # Cancellable: a generator may never end, and its model's unload must.
            with self.admission.model_slot(settings, cancellable=True):
                priority, parameters, sequence = _model_parameters(served, request, context)

                async def each(outputs: ModelOutputs) -> None:
                    await respond(_response(served, request, outputs, batch, True))

                limit = context.deadline
                if settings.timeout is not None:
                    limit = min(limit, trio.current_time() + settings.timeout)
                timing.queued = trio.current_time()
                if limit >= context.deadline:
                    # The call's own scope enforces its deadline.
                    await self.pool.generate(
                        settings, request.inputs, parameters, each, priority, sequence, timing
                    )
                    timing.executed(1)
                    return
                with trio.move_on_at(limit):
                    await self.pool.generate(
                        settings, request.inputs, parameters, each, priority, sequence, timing
                    )
                    timing.executed(1)
                    return
                raise InferError(
                    f"model '{settings.name}' did not end within its timeout of "
                    f"{settings.timeout:g} s",
                    StatusCode.DEADLINE_EXCEEDED,
                )

    def _served_as(self, settings: ModelSettings) -> _Served:
        """What requests read of ``settings``, worked out at their first request."""
        served = self._served.get(settings.name)
        if served is None or served.settings is not settings:
            served = self._served[settings.name] = _Served(settings, self.recorder)
        return served

    def _admit(
        self, served: _Served, request: InferenceRequest, context: RequestContext
    ) -> int | None:
        """Check that the model is ready and the request fits it and the budget; return its
        batch size when the model has a batch dimension (:func:`validate_inputs`), else None."""
        settings = served.settings
        # Draining is not checked here: a request accepted before shutdown is served to the end.
        if not self.registry.is_ready(settings.name):
            reason = self.registry.reason(settings.name)
            raise Unavailable(
                f"model '{settings.name}' is not ready" + (f": {reason}" if reason else "")
            )
        declared = served.declared
        batch = validate_inputs(request.inputs, declared.inputs, settings.name, declared.batched)
        reservation = context.reservation
        extra = (
            served.output_size.estimate(request.inputs, batch)
            - reservation.granted // RESERVED_PER_BYTE
        )
        if extra > 0:
            reservation.grow_nowait(extra, f"the outputs of model '{settings.name}'")
        return batch

    async def _predict(
        self,
        settings: ModelSettings,
        batcher: ModelBatcher | None,
        inputs: dict[str, np.ndarray],
        batch: int | None,
        parameters: Parameters,
        priority: int,
        deadline: float,
        sequence: SequenceFlags | None,
        timing: RequestTiming,
    ) -> ModelOutputs:
        # For a model with a ``timeout``. The caller's deadline is already the call's cancel
        # scope. A model's own timeout bounds callers that set none (or a later one), so a hung
        # model cannot hold a worker and a caller forever.
        assert settings.timeout is not None
        limit = min(deadline, trio.current_time() + settings.timeout)
        if limit >= deadline:
            # The call's own scope enforces its deadline.
            return await self._run_on_worker(
                settings, batcher, inputs, batch, parameters, priority, deadline, sequence, timing
            )
        with trio.move_on_at(limit):
            return await self._run_on_worker(
                settings, batcher, inputs, batch, parameters, priority, limit, sequence, timing
            )
        raise InferError(
            f"model '{settings.name}' did not answer within its timeout of {settings.timeout:g} s",
            StatusCode.DEADLINE_EXCEEDED,
        )

    def _run_on_worker(
        self,
        settings: ModelSettings,
        batcher: ModelBatcher | None,
        inputs: dict[str, np.ndarray],
        batch: int | None,
        parameters: Parameters,
        priority: int,
        limit: float,
        sequence: SequenceFlags | None,
        timing: RequestTiming,
    ) -> Awaitable[ModelOutputs]:
        """The model call of a request of ``batch`` rows (as ``_admit`` returned it), to be
        awaited by the caller: ``batcher``'s own coroutine (the model's, None for a sequence's
        request; it dispatches the batch in time for ``limit`` and records its executions),
        else :meth:`_unbatched`."""
        if batcher is None:
            # Triton's counts: a request of a model that does not batch is one inference, one
            # of a model that does (here only in a sequence) is as many as its rows.
            one_inference = sequence is None or self.batching.get(settings.name) is None
            return self._unbatched(
                settings,
                inputs,
                parameters,
                priority,
                limit,
                sequence,
                timing,
                1 if one_inference or batch is None else batch,
            )
        return batcher.predict(inputs, batch, parameters, limit, priority, timing)

    async def _unbatched(
        self,
        settings: ModelSettings,
        inputs: dict[str, np.ndarray],
        parameters: Parameters,
        priority: int,
        limit: float,
        sequence: SequenceFlags | None,
        timing: RequestTiming,
        inferences: int,
    ) -> ModelOutputs:
        # A sequence's requests run one at a time on its worker: never in a batch. (A batcher
        # sets the queue's start of the requests it takes.)
        timing.queued = trio.current_time()
        outputs = await self.pool.predict(
            settings, inputs, parameters, priority, sequence, timing, limit
        )
        timing.executed(inferences)
        return outputs


class _Served:
    """What every request reads of one model's settings besides the settings themselves,
    worked out once: the recorder of its statistics, its version (a property of the settings),
    its declared tensors as the checks take them and its outputs' estimated size; and the
    run's clock, read directly (made at a request, so in the run that serves it)."""

    __slots__ = ("declared", "now", "output_size", "parameters", "recorder", "settings", "version")

    def __init__(self, settings: ModelSettings, recorder: StatisticsRecorder) -> None:
        self.now = trio.lowlevel.current_clock().current_time
        self.settings = settings
        self.version = settings.version
        self.recorder = recorder.model(settings.name, self.version)
        self.declared = DeclaredTensors(settings)
        self.output_size = OutputSize(settings.outputs)
        # The Parameters of the model's last request without request-level parameters.
        self.parameters: Parameters | None = None


def _response(
    served: _Served,
    request: InferenceRequest,
    outputs: ModelOutputs,
    batch: int | None,
    check: bool,
) -> InferenceResponse:
    """The answer to ``request`` from its model's outputs (and metadata), which must be the
    declared outputs (``ModelFailed`` otherwise), checked here when ``check`` (not by a
    batcher); ``batch``: the request's batch size, as ``_admit`` returned it."""
    name = served.settings.name
    declared = served.declared.outputs
    if isinstance(outputs, Response):
        headers: Mapping[str, str] = outputs.headers
        trailers: Mapping[str, str] = outputs.trailers
        outputs = outputs.outputs
    else:
        # No metadata shares one empty mapping: the defaults would make two empty dicts a
        # request.
        headers = trailers = _NO_METADATA
    if check and declared:
        validate_outputs(outputs, declared, name, batch)
    # Positional: a class called with keywords gets them as a dict made for the call.
    return InferenceResponse(
        name,
        served.version,
        request.id,
        select_outputs(outputs, request.outputs, name),
        headers,
        trailers,
    )


#: The metadata of a response that has none: read-only, as every front-end only reads it.
_NO_METADATA: Mapping[str, str] = MappingProxyType({})


def _model_parameters(
    served: _Served, request: InferenceRequest, context: RequestContext
) -> tuple[int, Parameters, SequenceFlags | None]:
    """The request's priority level, taken out of its parameters, the parameters its model
    sees, and the sequence it belongs to."""
    values = request.parameters
    if not values:
        # Most requests: no parameter, so the default level and no sequence, without the calls
        # that would find them; and the same per-input parameters and headers as the model's
        # request before, whose Parameters serves again rather than copies of them made for
        # each request: every holder in this process only reads it (the batcher, the key, the
        # pool's pickler), and a model gets its own copy in its worker process.
        last = served.parameters
        if (
            last is not None
            and last.headers == context.headers
            and last.inputs == request.input_parameters
            # Only empty per-input parameters: == takes True for 1 and 1.0, and 0.0 for -0.0,
            # which a model may tell apart; a request would get another's values.
            and not any(request.input_parameters.values())
        ):
            return DEFAULT_PRIORITY, last, None
        last = served.parameters = Parameters(values, request.input_parameters, context.headers)
        return DEFAULT_PRIORITY, last, None
    priority = take_priority(values)
    # Positional: a class called with keywords gets them as a dict made for the call. The
    # sequence is read from the request's own dict, whose values ``parameters`` holds, without
    # a Python call per Parameters.get.
    return (
        priority,
        Parameters(values, request.input_parameters, context.headers),
        sequence_of(values),
    )
