"""``add_sub`` for Triton's Python backend (copied to ``<repository>/add_sub/1/model.py``).

``OUTPUT0 = INPUT0 + INPUT1``, ``OUTPUT1 = INPUT0 - INPUT1`` (FP32 rows of 16), as trio-infer's
example. With the dynamic batcher, ``execute`` gets several requests at once: their rows are
stacked, computed together and split back, as a batching model does.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils  # provided by the stub


class TritonPythonModel:
    """Sum and difference."""

    def execute(self, requests: list[Any]) -> list[Any]:
        """One response per request, in order."""
        a = [pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy() for r in requests]
        b = [pb_utils.get_input_tensor_by_name(r, "INPUT1").as_numpy() for r in requests]
        x, y = np.concatenate(a), np.concatenate(b)
        bounds = np.cumsum([len(part) for part in a])[:-1]
        return [
            pb_utils.InferenceResponse(
                output_tensors=[pb_utils.Tensor("OUTPUT0", s), pb_utils.Tensor("OUTPUT1", d)]
            )
            for s, d in zip(np.split(x + y, bounds), np.split(x - y, bounds), strict=True)
        ]
