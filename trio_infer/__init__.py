"""trio-infer: an Open Inference Protocol model server built on Trio's structured concurrency.

The public API: :class:`Model` and :class:`Parameters` for writing models, :class:`ModelSettings`
for what a repository declares, and the errors a model may raise to choose its status.
``trio_infer.server`` embeds the server in a Trio program; ``trio_infer.client`` calls one.

This package is imported by every worker process, so it imports nothing of the server side.
"""

from typing import TYPE_CHECKING, Any

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
from trio_infer.model import Model, Parameters
from trio_infer.settings import ModelSettings

if TYPE_CHECKING:
    from trio_infer.client import InferenceClient, InferResult

__all__ = [
    "InferError",
    "InferResult",
    "InferenceClient",
    "InvalidInput",
    "Model",
    "ModelFailed",
    "ModelNotFound",
    "ModelSettings",
    "Overloaded",
    "Parameters",
    "StatusCode",
    "Unavailable",
    "Unimplemented",
]


def __getattr__(name: str) -> Any:
    # The client imports purerpc, h2 and anyio, which worker processes never need: it is loaded
    # on first use of its names rather than with the package.
    if name in ("InferenceClient", "InferResult"):
        from trio_infer import client

        return getattr(client, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
