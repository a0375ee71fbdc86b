"""Checking a decoded request against its model's declared tensors (pure functions).

Every front-end decodes a request's tensors first, checking that each is well formed on its own
(its datatype, its shape, data that fills it); what is checked here is whether they are what the
model declared. Every mismatch raises :class:`~trio_infer.errors.InvalidInput` naming the model
and the tensor.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from trio_infer.datatypes import datatype_of, shape_text
from trio_infer.errors import InvalidInput
from trio_infer.repository.settings import TensorSpec

__all__ = ["select_outputs", "validate_inputs"]


def _quoted(names: Iterable[str]) -> str:
    return ", ".join(f"'{name}'" for name in names) or "none"


def validate_inputs(
    inputs: Mapping[str, np.ndarray], declared: Sequence[TensorSpec], model_name: str
) -> None:
    """Check a request's input names, datatypes and shapes against a model's declared inputs.

    Only metadata is read, not data. A model that declares no inputs accepts anything. ``-1`` in
    a declared shape matches any size.

    Args:
        inputs: The request's decoded inputs, by name.
        declared: The model's declared inputs.
        model_name: Named in error messages.

    Raises:
        InvalidInput: If the request sends an input the model does not declare, omits a
            declared one, or sends one with another datatype, rank or fixed dimension.
    """
    if not declared:
        return
    specs = {spec.name: spec for spec in declared}
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
        if len(shape) != len(spec.shape):
            raise InvalidInput(
                f"model '{model_name}' input '{name}': expected shape {shape_text(spec.shape)} "
                f"(rank {len(spec.shape)}), got {shape_text(shape)} (rank {len(shape)})"
            )
        for axis, (want, got) in enumerate(zip(spec.shape, shape, strict=True)):
            if want != -1 and want != got:
                raise InvalidInput(
                    f"model '{model_name}' input '{name}': expected shape "
                    f"{shape_text(spec.shape)}, got {shape_text(shape)} "
                    f"(dimension {axis} must be {want})"
                )
    missing = [name for name in specs if name not in inputs]
    if missing:
        raise InvalidInput(f"model '{model_name}': request is missing input(s) {_quoted(missing)}")


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
