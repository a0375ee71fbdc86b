"""The ONNX runtime: an ONNX model run by onnxruntime.

Settings (``model-settings.json``)::

    {"platform": "onnxruntime_onnx", "parameters": {"uri": "./model.onnx"}}

Triton's ``"platform": "onnxruntime_onnx"`` (or ``"onnx"``, KServe's format name) with no
``implementation`` names this class; so does
``"implementation": "trio_infer.runtimes.onnx.OnnxModel"``.

- The file: ``parameters.uri`` (relative to the model's folder), or a folder holding
  ``model.onnx``; without a uri, the model's folder is searched for it.
- Inputs and outputs are the model's own (names, datatypes, shapes): the settings need not
  declare them. Those the settings declare are checked against the model when it loads, and a
  mismatch fails the load with a message naming the tensor: every input (or none) is declared,
  each with the model's datatype and a shape that fits the model's (its free dimensions, ``-1``
  or symbolic, may be declared either way; a fixed one must be declared as it is). Declared
  outputs may be a subset of the model's: only those are computed and sent. A model that
  batches (``max_batch_size``) declares its inputs with ``-1`` first, and the model's first
  dimension must be free for that.
- A request's input tensors are the model's inputs by name; a missing one, another datatype, or
  a shape onnxruntime refuses is ``INVALID_ARGUMENT`` for the client.
- ``parameters.extra.intra_op_num_threads`` and ``inter_op_num_threads``: onnxruntime's threads
  in this worker, 1 each by default: workers share the machine's cores, and each worker running
  a pool sized to all of them oversubscribes it.
- Outputs that are not tensors (the sequence of maps skl2onnx gives a classifier's
  probabilities by default) cannot cross the V2 protocol: the load fails and says so (convert
  with ``options={"zipmap": False}``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from trio_infer.datatypes import datatype_of, shape_text
from trio_infer.errors import InvalidInput, ModelFailed
from trio_infer.model import Model, Parameters
from trio_infer.repository.settings import TensorSpec
from trio_infer.runtimes._common import ExtraSettings, missing_library, model_file, unreadable

__all__ = ["ONNX_DATATYPES", "OnnxModel"]

#: onnxruntime's tensor types and the V2 datatypes that hold them.
ONNX_DATATYPES = {
    "tensor(bool)": "BOOL",
    "tensor(uint8)": "UINT8",
    "tensor(uint16)": "UINT16",
    "tensor(uint32)": "UINT32",
    "tensor(uint64)": "UINT64",
    "tensor(int8)": "INT8",
    "tensor(int16)": "INT16",
    "tensor(int32)": "INT32",
    "tensor(int64)": "INT64",
    "tensor(float16)": "FP16",
    "tensor(float)": "FP32",
    "tensor(double)": "FP64",
    "tensor(string)": "BYTES",
}

_RUNTIME = "ONNX"


@dataclass(frozen=True)
class _Tensor:
    """One of the model's inputs or outputs, as onnxruntime describes it."""

    name: str
    onnx_type: str
    shape: tuple[int, ...]  # -1: a free dimension (None or symbolic in the model)

    @property
    def datatype(self) -> str | None:
        """The V2 datatype; None when the value is not a tensor of one."""
        return ONNX_DATATYPES.get(self.onnx_type)

    def describe(self) -> str:
        return f"{self.name!r} ({self.datatype or self.onnx_type} {shape_text(self.shape)})"


class OnnxModel(Model):
    """Serves an ONNX model with onnxruntime; see the module's docstring for its settings."""

    def load(self) -> None:
        """Start an onnxruntime session and check the declared tensors against the model.

        Raises:
            ModelFailed: onnxruntime is not installed, the file is missing or unreadable, a
                declared tensor does not match the model's, or a served one is not a tensor.
        """
        extra = ExtraSettings(
            self.settings, _RUNTIME, ("intra_op_num_threads", "inter_op_num_threads")
        )
        intra_op = extra.count("intra_op_num_threads", 1)
        inter_op = extra.count("inter_op_num_threads", 1)
        try:
            import onnxruntime
            from onnxruntime.capi.onnxruntime_pybind11_state import InvalidArgument
        except ImportError as exc:
            raise missing_library(_RUNTIME, "onnxruntime", "onnx", exc) from None
        path = model_file(self.settings, ("model.onnx",), _RUNTIME)
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = intra_op
        options.inter_op_num_threads = inter_op
        try:
            session = onnxruntime.InferenceSession(
                str(path), options, providers=["CPUExecutionProvider"]
            )
        except Exception as exc:
            raise unreadable(path, "an ONNX model", exc) from None
        inputs = [_tensor(value) for value in session.get_inputs()]
        outputs = [_tensor(value) for value in session.get_outputs()]
        _check_declared("input", self.settings.inputs, inputs, every=True)
        _check_declared("output", self.settings.outputs, outputs, every=False)
        declared = {spec.name for spec in self.settings.outputs}
        served = [tensor for tensor in outputs if not declared or tensor.name in declared]
        for tensor in [*inputs, *served]:
            if tensor.datatype is None:
                raise ModelFailed(
                    f"the model's tensor {tensor.name!r} is {tensor.onnx_type}, which the V2 "
                    "protocol cannot carry (a classifier converted by skl2onnx: convert it "
                    'with options={"zipmap": False})'
                )
        self._session: Any = session
        self._invalid_argument: type[Exception] = InvalidArgument
        self._inputs = {tensor.name: tensor for tensor in inputs}
        self._outputs = [tensor.name for tensor in served]

    def predict(
        self, inputs: dict[str, np.ndarray], parameters: Parameters
    ) -> dict[str, np.ndarray]:
        """Run the session on the request's tensors.

        Raises:
            trio_infer.errors.InvalidInput: The inputs are not the model's, by name, datatype
                or shape.
        """
        if inputs.keys() != self._inputs.keys():
            expected = ", ".join(tensor.describe() for tensor in self._inputs.values())
            given = ", ".join(repr(name) for name in inputs) or "none"
            raise InvalidInput(f"the model's inputs are {expected}; the request has {given}")
        for name, array in inputs.items():
            tensor = self._inputs[name]
            if datatype_of(array) != tensor.datatype:
                raise InvalidInput(
                    f"input {name!r} is {datatype_of(array)}, the model takes {tensor.describe()}"
                )
        try:
            results = self._session.run(self._outputs, inputs)
        except self._invalid_argument as exc:
            # A shape the model refuses: the request's fault, with onnxruntime's explanation.
            raise InvalidInput(str(exc)) from None
        return dict(zip(self._outputs, results, strict=True))


def _tensor(value: Any) -> _Tensor:
    """An onnxruntime ``NodeArg`` as a :class:`_Tensor`."""
    shape = tuple(dim if isinstance(dim, int) else -1 for dim in value.shape)
    return _Tensor(value.name, value.type, shape)


def _check_declared(
    kind: str, declared: Sequence[TensorSpec], model: Sequence[_Tensor], *, every: bool
) -> None:
    """Check the settings' tensors against the model's.

    Args:
        kind: "input" or "output", for messages.
        declared: The tensors the settings declare (none: nothing to check).
        model: The model's tensors.
        every: Whether the declared tensors must be all of the model's (inputs: the server
            refuses requests that lack a declared one, and the model needs them all).

    Raises:
        ModelFailed: Naming the first tensor that does not match.
    """
    if not declared:
        return
    by_name: Mapping[str, _Tensor] = {tensor.name: tensor for tensor in model}
    listed = ", ".join(tensor.describe() for tensor in model)
    for spec in declared:
        tensor = by_name.get(spec.name)
        if tensor is None:
            raise ModelFailed(
                f"declared {kind} {spec.name!r} is not one of the model's {kind}s: {listed}"
            )
        fits = len(spec.shape) == len(tensor.shape) and all(
            model_dim in (-1, dim) for dim, model_dim in zip(spec.shape, tensor.shape, strict=True)
        )
        if spec.datatype != tensor.datatype or not fits:
            raise ModelFailed(
                f"declared {kind} {spec.name!r} is {spec.datatype} {shape_text(spec.shape)}, "
                f"the model's is {tensor.describe()}"
            )
    if every:
        names = {spec.name for spec in declared}
        for tensor in model:
            if tensor.name not in names:
                raise ModelFailed(
                    f"the model's {kind} {tensor.describe()} is not declared: declare every "
                    f"{kind}, or none"
                )
