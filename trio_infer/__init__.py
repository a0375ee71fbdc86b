"""trio-infer: an Open Inference Protocol model server built on Trio's structured concurrency.

The public API: :class:`Model`, :class:`Parameters` and :class:`Response` for writing models,
:class:`ModelSettings` for what a repository declares, and the errors a model may raise to choose
its status.
``trio_infer.server`` embeds the server in a Trio program; ``trio_infer.client`` calls one.

This package is imported by every worker process, so it imports nothing of the server side.
"""

from trio_infer.errors import (
    InferError,
    InvalidInput,
    ModelFailed,
    ModelNotFound,
    Overloaded,
    StatusCode,
    Unavailable,
    Unimplemented,
)
from trio_infer.model import Model, Parameters, Response
from trio_infer.repository.settings import ModelSettings

__all__ = [
    "InferError",
    "InvalidInput",
    "Model",
    "ModelFailed",
    "ModelNotFound",
    "ModelSettings",
    "Overloaded",
    "Parameters",
    "Response",
    "StatusCode",
    "Unavailable",
    "Unimplemented",
]
