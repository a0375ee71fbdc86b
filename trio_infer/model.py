"""The model API: subclass ``Model``, override ``load()`` and ``predict()``.

A model is a folder with a ``model-settings.json`` naming the class, and the code beside it::

    # models/scale/model.py
    import numpy as np
    from trio_infer.model import Model, Parameters

    class Scale(Model):
        def load(self) -> None:
            self.factor = np.float32(self.settings.parameters.extra.get("factor", 2.0))

        def predict(
            self, inputs: dict[str, np.ndarray], parameters: Parameters
        ) -> dict[str, np.ndarray]:
            factor = parameters.get("factor", self.factor)
            return {"y": inputs["x"] * factor}

    # models/scale/model-settings.json
    {"implementation": "model.Scale", "parameters": {"extra": {"factor": 3.0}}}

Each worker process creates the model once and calls ``load()`` once, before its first
``predict()``; afterwards ``predict()`` is called for every request (or batch), one call at a time
per process. The model's folder is on ``sys.path``, so ``model.Scale`` names the folder's own
``model.py``.

A model reads its weights in ``load()``. ``parameters.uri`` says where they are;
``self.settings.model_uri`` is that uri as a ``Path``, a relative uri resolved against the model's
folder (as MLServer resolves it), so the server may run from any working directory.
``self.settings.path`` is the folder itself, for files the settings do not name::

    # models/linear/model-settings.json
    {"implementation": "model.Linear", "parameters": {"uri": "./weights.npy"}}

    # models/linear/model.py
    class Linear(Model):
        def load(self) -> None:
            self.w = np.load(self.settings.model_uri)  # models/linear/weights.npy
            self.labels = (self.settings.path / "labels.txt").read_text().split()

        def predict(self, inputs, parameters):
            return {"y": inputs["x"] @ self.w}

A stateful model keeps per-sequence state in its process: the requests of one sequence
(tritonclient's ``sequence_id``, ``sequence_start``, ``sequence_end``, which ``predict`` sees in its
parameters) all run in one worker process, one at a time and in order. Reset a sequence's state at
``sequence_start`` and drop it at ``sequence_end``; the model is not told when a sequence idles out
(``max_sequence_idle_microseconds``), so a model that must bound its memory against clients that
never end their sequences bounds it itself.

To send response metadata, return a :class:`Response` instead of the dict::

    def predict(self, inputs, parameters):
        y, hit = self.cached(inputs["x"])
        return Response({"y": y}, headers={"x-cache": "hit" if hit else "miss"})

On a unary call ``headers`` are the response's initial metadata (gRPC) or headers (REST), and
``trailers`` its trailing metadata (REST sends them as headers: HTTP/1.1 responses have no
trailers here). On a stream (ModelStreamInfer) the first response sent carries the stream's
initial metadata, so the headers of that response are sent there; the headers of later responses
and the trailers of all go in the stream's trailers, the last value of a name winning. A batched
model's metadata goes to every request of the batch; a decoupled model may yield ``Response``
items too.

To fail a request with a status of your choice, raise
``trio_infer.errors.InferError("message", StatusCode.X)``; any other exception fails the request
with ``INTERNAL`` and the exception's type and message.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TypeVar, overload

import numpy as np

from trio_infer.repository.settings import ModelSettings

__all__ = [
    "MAX_RESPONSE_METADATA",
    "Model",
    "ModelOutputs",
    "ParameterValue",
    "Parameters",
    "Response",
]

#: The types a request parameter can have (the protocol's ``InferParameter`` choices).
ParameterValue = bool | int | float | str
_T = TypeVar("_T")


#: The most bytes (names and values) of headers, or of trailers, one model response may set, and
#: a stream's trailers may gather: with the server's own, well under the 8 KiB of metadata gRPC
#: clients take by default.
MAX_RESPONSE_METADATA = 4096


@dataclass(frozen=True, slots=True)
class Response:
    """A model's outputs with response metadata: what ``predict`` may return (or a decoupled
    model yield) instead of the bare dict of outputs.

    Names are lower-cased; a name must be made of ``a-z 0-9 - _ .`` and a value of printable
    ASCII (gRPC's rules for text metadata); names of the protocols' own (``content-type``,
    ``grpc-*``, ``x-request-id``...) and binary ones (``-bin``) are refused, and so is more than
    4 KiB of metadata in all: a model breaking these fails its request (``INTERNAL``) with a
    message naming the problem.

    Args:
        outputs: The output tensors by name, as ``predict`` would return them.
        headers: Response headers (gRPC initial metadata).
        trailers: Response trailers (gRPC trailing metadata).
    """

    outputs: dict[str, np.ndarray]
    headers: Mapping[str, str] = field(default_factory=dict)
    trailers: Mapping[str, str] = field(default_factory=dict)


#: What a model call gives back: the outputs by name, or a :class:`Response` with metadata.
ModelOutputs = dict[str, np.ndarray] | Response


@dataclass(frozen=True, init=False, repr=False)
class Parameters(Mapping[str, ParameterValue]):
    """A request's parameters: a read-only mapping, plus per-tensor parameters and headers.

    ``parameters["delay_ms"]`` and ``parameters.get("delay_ms", 100)`` read the request-level
    parameters; ``parameters.inputs["INPUT0"]`` the parameters sent with one input tensor;
    ``parameters.headers["x-user"]`` the request's metadata (header names are lower-case).
    Picklable, so it crosses into worker processes.

    Args:
        values: The request-level parameters.
        inputs: Per-input-tensor parameters, by tensor name.
        headers: Request metadata; names are lower-cased here.
    """

    # Not named "values": that would hide Mapping.values().
    _values: Mapping[str, ParameterValue]
    inputs: Mapping[str, Mapping[str, ParameterValue]]
    headers: Mapping[str, str]

    # Mappings are not hashable; without this, dataclass would add a __hash__ that fails on
    # the dict fields with a confusing message.
    __hash__ = None  # type: ignore[assignment]

    def __init__(
        self,
        values: Mapping[str, ParameterValue] | None = None,
        inputs: Mapping[str, Mapping[str, ParameterValue]] | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        # Own plain-dict copies: a caller's mutable mapping must not change a request in flight,
        # and a dict always pickles (a MappingProxyType, say, does not). Set in __dict__, as
        # the dataclass is frozen (object.__setattr__ costs a call each; every request makes
        # one), and no comprehension for an empty mapping.
        fields = self.__dict__
        fields["_values"] = dict(values) if values else {}
        fields["inputs"] = {k: dict(v) for k, v in inputs.items()} if inputs else {}
        fields["headers"] = {k.lower(): v for k, v in headers.items()} if headers else {}

    def __getitem__(self, key: str) -> ParameterValue:
        return self._values[key]

    # Mapping's own get and __contains__ go through __getitem__ and a KeyError for each absent
    # key; every request asks for parameters it usually lacks (the sequence flags).
    @overload
    def get(self, key: str) -> ParameterValue | None: ...
    @overload
    def get(self, key: str, default: ParameterValue | _T) -> ParameterValue | _T: ...
    def get(self, key: str, default: object = None) -> object:
        """The parameter ``key``, or ``default`` when the request has none."""
        return self._values.get(key, default)

    def __contains__(self, key: object) -> bool:
        return key in self._values

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"Parameters({self._values!r}, inputs={self.inputs!r}, headers={self.headers!r})"


class Model:
    """Base class for models. Subclass, override ``load()`` and ``predict()``.

    Args:
        settings: The model's settings, as read from its ``model-settings.json``; available as
            ``self.settings`` (``self.settings.path`` is the model's folder,
            ``self.settings.model_uri`` its weights' path).
    """

    def __init__(self, settings: ModelSettings) -> None:
        self.settings = settings

    def load(self) -> None:
        """Prepare the model: read weights, build state. Called once per worker process.

        Runs before the process's first ``predict()``. The default does nothing.

        Raises:
            Exception: Any exception fails the load: the model is not ready, its requests fail
                with ``UNAVAILABLE`` and a message ending with the exception's type and message
                (as ModelReady and the repository index say), and the server loads it again
                after 1, 2, 4... up to 30 seconds.
        """

    def predict(self, inputs: dict[str, np.ndarray], parameters: Parameters) -> ModelOutputs:
        """Compute the outputs of one request (or one batch) from its inputs.

        Args:
            inputs: The input tensors by name, as numpy arrays (``BYTES`` tensors are object
                arrays of ``bytes``).
            parameters: The request's parameters, per-tensor parameters and headers.

        Returns:
            The output tensors by name, or a :class:`Response` holding them with response
            metadata.

        Raises:
            trio_infer.errors.InferError: To end the request with the status it carries.
            Exception: Anything else ends the request with ``INTERNAL`` and its message.
        """
        raise NotImplementedError(f"{type(self).__qualname__} does not override predict()")
