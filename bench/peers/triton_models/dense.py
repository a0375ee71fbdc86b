"""``dense`` for Triton's Python backend (copied to ``<repository>/dense/1/model.py``).

``y = tanh(x @ W)`` with ``W = default_rng(0).standard_normal((256, 256))`` as FP32. With the
dynamic batcher on, ``execute`` gets up to 64 rows' worth of requests at once: their inputs are
stacked into one matrix product, as a batching model does, and the result split back.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils  # provided by the stub


class TritonPythonModel:
    """The layer, one instance per stub process."""

    def initialize(self, args: dict[str, Any]) -> None:
        """Build the weight matrix."""
        self._weights = np.random.default_rng(0).standard_normal((256, 256)).astype(np.float32)

    def execute(self, requests: list[Any]) -> list[Any]:
        """One response per request, in order."""
        inputs = [pb_utils.get_input_tensor_by_name(r, "x").as_numpy() for r in requests]
        y = np.tanh(np.concatenate(inputs) @ self._weights)
        bounds = np.cumsum([len(x) for x in inputs])[:-1]
        return [
            pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("y", part)])
            for part in np.split(y, bounds)
        ]
