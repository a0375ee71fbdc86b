"""A model's configuration as Triton describes one, derived from its settings.

Triton's ``ModelConfig`` RPC (and the tools that read it: ``tritonclient``'s
``get_model_config``, perf_analyzer, model analyzers) expect what Triton's ``config.pbtxt``
holds. trio-infer's models are described by ``model-settings.json``; :func:`model_configuration`
says the same things in Triton's terms, as plain data a front-end encodes (the gRPC front-end
into ``inference.ModelConfig``). Only what the settings and the server actually decide is
filled: a field Triton has and trio-infer has no counterpart for is left out rather than
guessed.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass

from trio_infer.repository.settings import ModelSettings, TensorSpec
from trio_infer.scheduling.batching import batching_enabled
from trio_infer.scheduling.priority import DEFAULT_PRIORITY, PRIORITY_LEVELS

__all__ = [
    "BACKEND",
    "DynamicBatching",
    "ModelConfiguration",
    "SequenceBatching",
    "model_configuration",
]

#: The backend every model runs on: Python code in worker processes, as Triton's Python backend.
BACKEND = "python"

#: ``max_sequence_idle_microseconds`` when a model's settings do not set it.
_DEFAULT_SEQUENCE_IDLE: object = next(
    f.default
    for f in dataclasses.fields(ModelSettings)
    if f.name == "max_sequence_idle_microseconds"
)


@dataclass(frozen=True, slots=True)
class DynamicBatching:
    """How a batching model's requests are batched (Triton's ``dynamic_batching``).

    Attributes:
        max_queue_delay_microseconds: How long a batch's first request waits for others
            (the settings' ``max_batch_time``).
        priority_levels: The request priority levels (:mod:`trio_infer.scheduling.priority`).
        default_priority_level: The level of a request that sets none.
        max_queue_size: The most requests of the model in flight, queued or running (the
            settings' ``max_queue_size``; Triton's bounds the queued ones only).
    """

    max_queue_delay_microseconds: int
    priority_levels: int
    default_priority_level: int
    max_queue_size: int


@dataclass(frozen=True, slots=True)
class SequenceBatching:
    """How a stateful model's sequences are kept (Triton's ``sequence_batching``).

    Attributes:
        max_sequence_idle_microseconds: How long a sequence may have no request in flight
            before it is ended.
    """

    max_sequence_idle_microseconds: int


@dataclass(frozen=True, slots=True)
class ModelConfiguration:
    """A model's configuration in Triton's terms.

    Attributes:
        name: The model's name.
        platform: The settings' ``platform`` (``""`` when they set none, as for Triton's Python
            models).
        backend: What runs it: always :data:`BACKEND`.
        max_batch_size: The most rows a batch holds; 0 when the model does not batch.
        inputs: The declared inputs; their ``shape`` is Triton's ``dims``, without the batch
            dimension when ``max_batch_size`` is above 0.
        outputs: The declared outputs, likewise.
        dynamic_batching: Set when the model batches and keeps no sequences.
        sequence_batching: Set when the model's settings set ``max_sequence_idle_microseconds``
            to other than its default (a stateful model: the settings cannot tell the default
            written out from one left out). Triton's config has one scheduler, and this one
            wins over ``dynamic_batching``: it tells clients to send sequences.
        instance_count: The worker processes that each run an instance of the model.
        parameters: The settings' ``parameters.extra``, each value a string (JSON for those
            that are not strings).
        decoupled: Whether the model answers a request with 0..N responses.
    """

    name: str
    platform: str
    backend: str
    max_batch_size: int
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    dynamic_batching: DynamicBatching | None
    sequence_batching: SequenceBatching | None
    instance_count: int
    parameters: Mapping[str, str]
    decoupled: bool


def model_configuration(settings: ModelSettings, instances: int) -> ModelConfiguration:
    """Describe a model in Triton's terms.

    Args:
        settings: The model's settings.
        instances: The worker processes that run it (every worker loads every model).

    Returns:
        The model's configuration.
    """
    batching = batching_enabled(settings)
    # Triton's dims leave out the batch dimension of a model that batches; a model that does
    # not (whatever its max_batch_size says) declares whole shapes, so it reports 0.
    first = 1 if batching else 0
    sequences = settings.max_sequence_idle_microseconds != _DEFAULT_SEQUENCE_IDLE
    return ModelConfiguration(
        name=settings.name,
        platform=settings.platform,
        backend=BACKEND,
        max_batch_size=settings.max_batch_size if batching else 0,
        inputs=tuple(_dims(spec, first) for spec in settings.inputs),
        outputs=tuple(_dims(spec, first) for spec in settings.outputs),
        dynamic_batching=DynamicBatching(
            max_queue_delay_microseconds=round(settings.max_batch_time * 1_000_000),
            priority_levels=PRIORITY_LEVELS,
            default_priority_level=DEFAULT_PRIORITY,
            max_queue_size=settings.max_queue_size,
        )
        if batching and not sequences
        else None,
        sequence_batching=SequenceBatching(settings.max_sequence_idle_microseconds)
        if sequences
        else None,
        instance_count=instances,
        parameters={
            name: value if isinstance(value, str) else json.dumps(value)
            for name, value in settings.parameters.extra.items()
        },
        decoupled=settings.decoupled,
    )


def _dims(spec: TensorSpec, first: int) -> TensorSpec:
    """``spec`` with its shape from dimension ``first`` on."""
    return TensorSpec(spec.name, spec.datatype, spec.shape[first:])
