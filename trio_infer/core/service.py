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

from collections.abc import Awaitable, Callable, Hashable
from contextlib import AbstractAsyncContextManager
from importlib.metadata import PackageNotFoundError, version

import numpy as np
import trio

from trio_infer.core.types import (
    InferenceRequest,
    InferenceResponse,
    ModelMetadata,
    RequestContext,
    ServerMetadata,
)
from trio_infer.core.validation import select_outputs, validate_inputs
from trio_infer.errors import InferError, StatusCode, Unavailable, Unimplemented
from trio_infer.model import Parameters
from trio_infer.repository.registry import ModelRegistry
from trio_infer.repository.settings import ModelSettings
from trio_infer.scheduling.admission import Admission, Reservation, estimate_output_bytes
from trio_infer.scheduling.batching import Batching
from trio_infer.scheduling.priority import take_priority
from trio_infer.scheduling.sequences import SequenceFlags, sequence_of
from trio_infer.workers.pool import CALLS_PER_WORKER, WorkerPool

__all__ = ["SERVER_NAME", "SERVER_VERSION", "InferenceCore"]

SERVER_NAME = "trio-infer"
try:
    SERVER_VERSION = version("trio-infer")
except PackageNotFoundError:  # running from a source tree that was never installed
    SERVER_VERSION = "0+unknown"

#: How many times its announced size a request reserves before its body is read: the message,
#: its decoded tensors and an answer as large.
RESERVED_PER_BYTE = 3


class InferenceCore:
    """Serves the Open Inference Protocol's operations to every front-end.

    Args:
        registry: The served models and their readiness.
        pool: Where model code runs.
        admission: The memory budget and the per-model queue bounds.
    """

    def __init__(self, registry: ModelRegistry, pool: WorkerPool, admission: Admission) -> None:
        self.registry = registry
        self.pool = pool
        self.admission = admission
        workers = pool.statistics().workers
        self.batching = Batching(
            registry,
            pool,
            batchers=workers,
            ahead=workers * (CALLS_PER_WORKER - 1),
            model_errors=pool.model_errors,
        )
        """The batchers of the models that batch; the server runs and stops them."""
        self.draining = False
        """Set when the server shuts down: readiness turns false so load balancers move on."""

    # -- health and metadata ------------------------------------------------------------------

    def server_live(self) -> bool:
        """Whether the server can answer at all: always, while it runs."""
        return True

    def server_ready(self) -> bool:
        """Whether every model is ready and the server is not shutting down."""
        return not self.draining and self.registry.all_ready()

    def model_ready(self, name: str, version: str = "") -> bool:
        """Whether a model can take requests now.

        Raises:
            ModelNotFound: No such model (or version) is served.
        """
        settings = self.registry.lookup(name, version)
        return not self.draining and self.registry.is_ready(settings.name)

    def server_metadata(self) -> ServerMetadata:
        """The server's name, version and extensions."""
        return ServerMetadata(name=SERVER_NAME, version=SERVER_VERSION, extensions=())

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

    # -- inference ----------------------------------------------------------------------------

    def reserve(
        self, announced: int, deadline: float, owner: Hashable | None = None
    ) -> AbstractAsyncContextManager[Reservation]:
        """Reserve room in the memory budget for a request of ``announced`` bytes, before its
        body is read (``async with``); the room is given back when the block exits.

        Args:
            announced: The request message's size in bytes.
            deadline: The caller's deadline on the Trio clock (``math.inf``: none).
            owner: The client connection the request came on, as a key unique among the
                connections open: it may hold at most its share of the budget
                (``--max-connection-bytes``). ``None``: the budget alone bounds it.

        Raises:
            Overloaded: The budget cannot make room in time, or the connection's share is
                full (RESOURCE_EXHAUSTED).
        """
        return self.admission.reserve(RESERVED_PER_BYTE * announced, deadline, owner)

    def decoupled(self, name: str, version: str = "") -> bool:
        """Whether a model is decoupled (0..N responses per request: :meth:`infer_each`).

        Raises:
            ModelNotFound: No such model (or version) is served.
        """
        return self.registry.lookup(name, version).decoupled

    async def infer(self, request: InferenceRequest, context: RequestContext) -> InferenceResponse:
        """Run one inference request on its model and return the outputs it asked for.

        Runs in the caller's cancel scope, whose deadline is ``context.deadline``: cancelling it
        takes the request out of whatever queue it is in, and stops a worker call that nobody
        else waits for.

        Raises:
            Unimplemented: The model is decoupled (as Triton: UNSUPPORTED, gRPC's UNIMPLEMENTED).
            InferError: With the status the status table gives its cause.
        """
        settings = self.registry.lookup(request.model_name, request.model_version)
        if settings.decoupled:
            raise Unimplemented(
                f"model '{settings.name}' is decoupled (0..N responses per request): call it on "
                "a stream (ModelStreamInfer); ModelInfer doesn't support models with decoupled "
                "transaction policy"
            )
        self._admit(settings, request, context)
        with self.admission.model_slot(settings):
            priority, parameters = _model_parameters(request, context)
            outputs = await self._predict(
                settings,
                request.inputs,
                parameters,
                priority,
                context.deadline,
                sequence_of(parameters),
            )
        return InferenceResponse(
            model_name=settings.name,
            model_version=settings.version,
            id=request.id,
            outputs=select_outputs(outputs, request.outputs, settings.name),
        )

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
            await respond(await self.infer(request, context))
            return
        self._admit(settings, request, context)
        with self.admission.model_slot(settings):
            priority, parameters = _model_parameters(request, context)
            sequence = sequence_of(parameters)

            async def each(outputs: dict[str, np.ndarray]) -> None:
                await respond(
                    InferenceResponse(
                        model_name=settings.name,
                        model_version=settings.version,
                        id=request.id,
                        outputs=select_outputs(outputs, request.outputs, settings.name),
                    )
                )

            limit = context.deadline
            if settings.timeout is not None:
                limit = min(limit, trio.current_time() + settings.timeout)
            if limit >= context.deadline:
                # The call's own scope enforces its deadline.
                await self.pool.generate(
                    settings, request.inputs, parameters, each, priority, sequence
                )
                return
            with trio.move_on_at(limit):
                await self.pool.generate(
                    settings, request.inputs, parameters, each, priority, sequence
                )
                return
            raise InferError(
                f"model '{settings.name}' did not end within its timeout of {settings.timeout:g} s",
                StatusCode.DEADLINE_EXCEEDED,
            )

    def _admit(
        self, settings: ModelSettings, request: InferenceRequest, context: RequestContext
    ) -> None:
        """Check that the model is ready and the request fits it and the budget."""
        # Draining is not checked here: a request accepted before shutdown is served to the end.
        if not self.registry.is_ready(settings.name):
            raise Unavailable(f"model '{settings.name}' is not ready")
        validate_inputs(request.inputs, settings.inputs, settings.name)
        reservation = context.reservation
        extra = (
            estimate_output_bytes(request.inputs, settings.outputs)
            - reservation.granted // RESERVED_PER_BYTE
        )
        if extra > 0:
            reservation.grow_nowait(extra, f"the outputs of model '{settings.name}'")

    async def _predict(
        self,
        settings: ModelSettings,
        inputs: dict[str, np.ndarray],
        parameters: Parameters,
        priority: int,
        deadline: float,
        sequence: SequenceFlags | None,
    ) -> dict[str, np.ndarray]:
        # The caller's deadline is already the call's cancel scope. A model's own timeout
        # bounds callers that set none (or a later one), so a hung model cannot hold a worker
        # and a caller forever.
        limit = deadline
        if settings.timeout is not None:
            limit = min(deadline, trio.current_time() + settings.timeout)
        if limit >= deadline:
            # The call's own scope enforces its deadline.
            return await self._run_on_worker(
                settings, inputs, parameters, priority, deadline, sequence
            )
        with trio.move_on_at(limit):
            return await self._run_on_worker(
                settings, inputs, parameters, priority, limit, sequence
            )
        raise InferError(
            f"model '{settings.name}' did not answer within its timeout of {settings.timeout:g} s",
            StatusCode.DEADLINE_EXCEEDED,
        )

    async def _run_on_worker(
        self,
        settings: ModelSettings,
        inputs: dict[str, np.ndarray],
        parameters: Parameters,
        priority: int,
        limit: float,
        sequence: SequenceFlags | None,
    ) -> dict[str, np.ndarray]:
        batcher = self.batching.get(settings.name)
        if batcher is None or sequence is not None:
            # A sequence's requests run one at a time on its worker: never in a batch.
            return await self.pool.predict(settings, inputs, parameters, priority, sequence)
        # The batch is dispatched in time for the call's limit.
        return await batcher.predict(inputs, parameters, limit, priority)


def _model_parameters(request: InferenceRequest, context: RequestContext) -> tuple[int, Parameters]:
    """The request's priority level, taken out of its parameters, and the parameters its model
    sees."""
    priority = take_priority(request.parameters)
    return priority, Parameters(
        values=request.parameters, inputs=request.input_parameters, headers=context.headers
    )
