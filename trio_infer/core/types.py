"""What every front-end hands the V2 core, and what it gets back.

A unary gRPC call, one message of a gRPC stream and a REST request all become an
:class:`InferenceRequest` with a :class:`RequestContext` before they reach the core; the core
answers with an :class:`InferenceResponse`. None of these types knows protobuf, JSON or HTTP.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from trio_infer.model import ParameterValue
from trio_infer.repository.settings import TensorSpec
from trio_infer.scheduling.admission import Reservation
from trio_infer.scheduling.statistics import ModelStatistics

# Reservation, ModelStatistics and TensorSpec are re-exported: a front-end sees them through the
# core only.
__all__ = [
    "InferenceRequest",
    "InferenceResponse",
    "ModelMetadata",
    "ModelStatistics",
    "RequestContext",
    "Reservation",
    "ServerMetadata",
    "TensorSpec",
]


@dataclass(slots=True)
class InferenceRequest:
    """One inference request, decoded.

    Args:
        model_name: The model asked for.
        model_version: Its version; ``""`` for whichever is served.
        id: The request's id, echoed in the response.
        inputs: The input tensors by name, in the request's order, decoded into arrays of the
            datatypes' dtypes (:data:`trio_infer.datatypes.DATATYPES`).
        parameters: The request-level parameters. The core takes out the ones it acts on
            (``priority``) before the model sees them.
        input_parameters: Per-input parameters, by input name.
        outputs: The names of the outputs asked for, in order; empty for all of them.
    """

    model_name: str
    model_version: str
    id: str
    inputs: dict[str, np.ndarray]
    parameters: dict[str, ParameterValue] = field(default_factory=dict)
    input_parameters: Mapping[str, Mapping[str, ParameterValue]] = field(default_factory=dict)
    outputs: Sequence[str] = ()


@dataclass(slots=True)
class InferenceResponse:
    """The answer to an :class:`InferenceRequest`: its outputs, in the order to send them, and
    the metadata its model set (:class:`trio_infer.model.Response`), checked already."""

    model_name: str
    model_version: str
    id: str
    outputs: list[tuple[str, np.ndarray]]
    headers: Mapping[str, str] = field(default_factory=dict)
    """Sent before the response (gRPC initial metadata, HTTP headers)."""
    trailers: Mapping[str, str] = field(default_factory=dict)
    """Sent after it (gRPC trailing metadata; HTTP/1.1 sends them as headers)."""


@dataclass(slots=True)
class RequestContext:
    """What the core needs of the entrance a request came through.

    Args:
        deadline: The caller's deadline on the Trio clock (``math.inf`` when it set none). The
            front-end already runs the request in a cancel scope with this deadline; the core
            reads it to plan batches and to bound waits.
        headers: The request's metadata (lower-case names), as models see it in
            ``parameters.headers``.
        reservation: The request's grant from the memory budget, made by the front-end from the
            size it announced before its body was read (:meth:`InferenceCore.reserve`).
    """

    deadline: float
    headers: Mapping[str, str]
    reservation: Reservation


@dataclass(frozen=True, slots=True)
class ServerMetadata:
    """The server's name, version and the protocol extensions it serves."""

    name: str
    version: str
    extensions: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class ModelMetadata:
    """A model's metadata as the protocol reports it."""

    name: str
    versions: tuple[str, ...]
    platform: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
