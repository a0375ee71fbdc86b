"""Checking a request and its model's answer against the model's declared tensors (pure
functions).

Every front-end decodes a request's tensors first, checking that each is well formed on its own
(its datatype, its shape, data that fills it); what is checked here is whether they are what the
model declared, and whether the inputs of a model with a batch dimension agree on it. Every
mismatch of a request raises :class:`~trio_infer.errors.InvalidInput` naming the model and the
tensor. A model's outputs are checked against its declared outputs the same way; a mismatch
there is the model's fault and raises :class:`~trio_infer.errors.ModelFailed` (INTERNAL).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np

from trio_infer.datatypes import datatype_of, shape_text
from trio_infer.errors import InvalidInput, ModelFailed
from trio_infer.repository.settings import ModelSettings, TensorSpec

__all__ = [
    "DeclaredTensors",
    "has_batch_dimension",
    "outputs_check",
    "select_outputs",
    "validate_batch",
    "validate_inputs",
    "validate_outputs",
]


def _quoted(names: Iterable[str]) -> str:
    return ", ".join(f"'{name}'" for name in names) or "none"


class DeclaredTensors:
    """A model's declared tensors as the checks take them: its inputs and its outputs by name
    (in the declared order), and whether it has a batch dimension (:func:`has_batch_dimension`).
    Every request is checked against them: made once per model settings, not per request.

    Args:
        settings: The model's settings.
    """

    __slots__ = ("batched", "inputs", "outputs")

    def __init__(self, settings: ModelSettings) -> None:
        self.inputs: Mapping[str, TensorSpec] = _by_name(settings.inputs)
        self.outputs: Mapping[str, TensorSpec] = _by_name(settings.outputs)
        self.batched = has_batch_dimension(settings)


def _by_name(specs: Sequence[TensorSpec]) -> dict[str, TensorSpec]:
    return {spec.name: spec for spec in specs}


def validate_inputs(
    inputs: Mapping[str, np.ndarray],
    specs: Mapping[str, TensorSpec],
    model_name: str,
    batched: bool = False,
) -> int | None:
    """Check a request's input names, datatypes and shapes against a model's declared inputs,
    and, for a model with a batch dimension, that they agree on it (:func:`validate_batch`,
    whose errors come after these).

    Only metadata is read, not data. A model that declares no inputs accepts anything (but
    inputs that disagree on a batch dimension). ``-1`` in a declared shape matches any size.

    Args:
        inputs: The request's decoded inputs, by name.
        specs: The model's declared inputs by name, in the declared order
            (:attr:`DeclaredTensors.inputs`).
        model_name: Named in error messages.
        batched: Whether the model has a batch dimension (:func:`has_batch_dimension`).

    Returns:
        With ``batched``, the batch size, as :func:`validate_batch` returns it; else None.

    Raises:
        InvalidInput: If the request sends an input the model does not declare, omits a
            declared one, or sends one with another datatype, rank or fixed dimension; or,
            with ``batched``, as :func:`validate_batch`.
    """
    if not specs:
        return validate_batch(inputs, model_name) if batched else None
    # With batched, every declared shape has -1 first, so every input (of the declared rank
    # once checked) has a first dimension: the batch is read in this loop, not another.
    rows = -1
    differs: str | None = None
    for name, array in inputs.items():
        spec = specs.get(name)
        if spec is None:
            raise InvalidInput(
                f"model '{model_name}' has no input '{name}'; its inputs are {_quoted(specs)}"
            )
        datatype = datatype_of(array)
        if datatype != spec.datatype:
            raise InvalidInput(
                f"model '{model_name}' input '{name}': expected datatype {spec.datatype}, "
                f"got {datatype}"
            )
        shape = array.shape
        declared_shape = spec.shape
        if len(shape) != len(declared_shape):
            raise InvalidInput(
                f"model '{model_name}' input '{name}': expected shape "
                f"{shape_text(declared_shape)} (rank {len(declared_shape)}), got "
                f"{shape_text(shape)} (rank {len(shape)})"
            )
        # This runs for every request: the axis is found only on failure, and the ranks are
        # equal, so zip goes without strict (its check, and passing a keyword at all, cost
        # more than the loop's two steps).
        for want, got in zip(declared_shape, shape):  # noqa: B905
            if want != got and want != -1:
                raise _dimension_differs(model_name, name, declared_shape, shape)
        if batched:
            if rows < 0:
                rows = shape[0]
            elif shape[0] != rows and differs is None:
                differs = name
    # Every input is declared (checked above) and named once (a mapping's keys): fewer inputs
    # than declared ones is the one way to miss one.
    if len(inputs) < len(specs):
        missing = [name for name in specs if name not in inputs]
        raise InvalidInput(f"model '{model_name}': request is missing input(s) {_quoted(missing)}")
    if not batched:
        return None
    if differs is not None:
        raise _batch_differs(inputs, differs, model_name)
    # As many inputs as declared ones, so at least one: rows is the first one's.
    return rows


def _dimension_differs(
    model_name: str, name: str, declared: tuple[int, ...], shape: tuple[int, ...]
) -> InvalidInput:
    """The error for an input whose shape, of the declared rank, differs from the declared one
    in a fixed dimension: it names the first."""
    axis = next(
        axis
        for axis, (want, got) in enumerate(zip(declared, shape, strict=True))
        if want != got and want != -1
    )
    return InvalidInput(
        f"model '{model_name}' input '{name}': expected shape {shape_text(declared)}, got "
        f"{shape_text(shape)} (dimension {axis} must be {declared[axis]})"
    )


def has_batch_dimension(settings: ModelSettings) -> bool:
    """Whether a model's tensors have a batch dimension first, as Triton's do when
    ``max_batch_size`` is more than 0.

    Here the declared shapes include it: it is the first dimension when ``max_batch_size`` is
    more than 0 and every declared input has ``-1`` there (a model with fixed first dimensions
    has none, and does not batch).
    """
    return settings.max_batch_size > 0 and all(spec.shape[:1] == (-1,) for spec in settings.inputs)


def validate_batch(inputs: Mapping[str, np.ndarray], model_name: str) -> int | None:
    """Check that the inputs of a request to a model with a batch dimension agree on it (as
    Triton does: they would broadcast in the model, or fail in the batcher), and return it.

    Args:
        inputs: The request's decoded inputs, by name (already checked against the declared
            ones: :func:`validate_inputs`).
        model_name: Named in error messages.

    Returns:
        The common first dimension; ``None`` when there are no inputs.

    Raises:
        InvalidInput: If an input is a scalar (it has no batch dimension), or its first
            dimension is not the first input's; the message names both inputs and sizes.
    """
    rows: int | None = None
    for name, array in inputs.items():
        if not array.ndim:
            raise InvalidInput(
                f"input '{name}' has no shape but model requires batch dimension for "
                f"'{model_name}' (its max_batch_size is above 0: every input's first "
                "dimension is the batch)"
            )
        if rows is None:
            rows = int(array.shape[0])
        elif array.shape[0] != rows:
            raise _batch_differs(inputs, name, model_name)
    return rows


def _batch_differs(inputs: Mapping[str, np.ndarray], name: str, model_name: str) -> InvalidInput:
    """The error for input ``name``, whose first dimension is not the first input's."""
    first, array = next(iter(inputs.items())), inputs[name]
    return InvalidInput(
        f"input '{name}' batch size does not match other inputs for '{model_name}': "
        f"'{name}' has {array.shape[0]} (shape {shape_text(array.shape)}), "
        f"'{first[0]}' has {first[1].shape[0]} (shape {shape_text(first[1].shape)})"
    )


def validate_outputs(
    outputs: Mapping[str, np.ndarray],
    specs: Mapping[str, TensorSpec],
    model_name: str,
    batch: int | None = None,
) -> None:
    """Check a model's outputs against its declared outputs: the same names, each with the
    declared datatype and shape.

    Only metadata is read, not data. A model that declares no outputs may return anything.
    ``-1`` in a declared shape matches any size, except as the first dimension of a model with
    a batch dimension answering a request of ``batch`` rows: that dimension is the batch.

    Args:
        outputs: What the model returned, by name.
        specs: The model's declared outputs by name, in the declared order
            (:attr:`DeclaredTensors.outputs`).
        model_name: Named in error messages.
        batch: The request's batch size (:func:`validate_batch`) when the model has a batch
            dimension, else ``None``.

    Raises:
        ModelFailed: If the model returned an output it does not declare, did not return one
            it declares, or returned one with another datatype, rank or dimension; the message
            names the model, the output and what was declared.
    """
    if not specs:
        return
    if len(outputs) != len(specs):
        raise _names_differ(outputs, specs, model_name)
    for name, array in outputs.items():
        spec = specs.get(name)
        if spec is None:
            raise _names_differ(outputs, specs, model_name)
        try:
            datatype = datatype_of(array)
        except ModelFailed as error:
            raise ModelFailed(f"model '{model_name}' output '{name}': {error.message}") from None
        if datatype != spec.datatype:
            raise ModelFailed(
                f"model '{model_name}' output '{name}' is {datatype}, but the model declares "
                f"{spec.datatype}"
            )
        shape = array.shape
        want = spec.shape
        # Messages are built only on failure: this runs for every response.
        if not _fits(shape, want, batch):
            batched = (
                f" (its first dimension is the request's batch size, {batch})"
                if batch is not None and want[:1] == (-1,)
                else ""
            )
            raise ModelFailed(
                f"model '{model_name}' output '{name}' has shape {shape_text(shape)}, but the "
                f"model declares {shape_text(want)}{batched}"
            )


def outputs_check(
    settings: ModelSettings,
) -> Callable[[Mapping[str, np.ndarray], int | None], None] | None:
    """:func:`validate_outputs` against a model's declared outputs, as one call of the outputs
    and the request's batch size: what a batcher checks a model's answer with. None when the
    model declares no outputs (it may return anything)."""
    specs = _by_name(settings.outputs)
    if not specs:
        return None
    model_name = settings.name

    def check(outputs: Mapping[str, np.ndarray], batch: int | None) -> None:
        validate_outputs(outputs, specs, model_name, batch)

    return check


def _fits(shape: tuple[int, ...], want: tuple[int, ...], batch: int | None) -> bool:
    """Whether ``shape`` is a declared shape ``want`` (``-1``: any size; as the first dimension
    with a ``batch`` size, that size)."""
    if len(shape) != len(want):
        return False
    # The ranks are equal: zip without strict, as in validate_inputs.
    for w, g in zip(want, shape):  # noqa: B905
        if w != g and w != -1:
            return False
    return batch is None or not want or want[0] != -1 or shape[0] == batch


def _names_differ(
    outputs: Mapping[str, np.ndarray], specs: Mapping[str, TensorSpec], model_name: str
) -> ModelFailed:
    """The error for outputs whose names are not the declared ones: it names the first output
    returned but not declared, else the declared ones not returned."""
    names = list(specs)
    extra = [name for name in outputs if name not in names]
    if extra:
        return ModelFailed(
            f"model '{model_name}' returned output '{extra[0]}', which it does not declare; "
            f"its declared outputs are {_quoted(names)}"
        )
    missing = [name for name in names if name not in outputs]
    return ModelFailed(
        f"model '{model_name}' did not return its declared output(s) {_quoted(missing)}"
    )


def select_outputs(
    outputs: Mapping[str, np.ndarray], requested: Sequence[str], model_name: str
) -> list[tuple[str, np.ndarray]]:
    """Pick the outputs to send back.

    Args:
        outputs: What the model produced, in the model's order.
        requested: The names the request asked for, in its order; empty means all.
        model_name: Named in error messages.

    Returns:
        ``(name, array)`` pairs: all outputs in the model's order when none were requested,
        else exactly the requested ones in the request's order.

    Raises:
        InvalidInput: If a requested output was not produced, or is requested twice.
    """
    if not requested:
        return list(outputs.items())
    selected: list[tuple[str, np.ndarray]] = []
    chosen: set[str] = set()
    for name in requested:
        if name not in outputs:
            raise InvalidInput(
                f"model '{model_name}' has no output '{name}'; its outputs are {_quoted(outputs)}"
            )
        if name in chosen:
            raise InvalidInput(f"model '{model_name}': output '{name}' is requested twice")
        chosen.add(name)
        selected.append((name, outputs[name]))
    return selected
