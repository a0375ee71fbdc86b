"""``sleep`` for Triton's Python backend (copied to ``<repository>/sleep/1/model.py``).

Blocks for request parameter ``delay_ms`` (default 100), then echoes input ``x``. Triton hands
the Python backend a request's parameters as a JSON object (``request.parameters()``).
"""

from __future__ import annotations

import json
import time
from typing import Any

import triton_python_backend_utils as pb_utils  # provided by the stub


def _delay_ms(request: Any) -> int:
    value = json.loads(request.parameters() or "{}").get("delay_ms", 100)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"delay_ms must be a non-negative integer, got {value!r}")
    return value


class TritonPythonModel:
    """Sleeps (blocking, like a model that computes), then echoes."""

    def execute(self, requests: list[Any]) -> list[Any]:
        """One response per request, in order; a bad ``delay_ms`` fails its request only."""
        responses = []
        for request in requests:
            try:
                delay_ms = _delay_ms(request)
            except ValueError as error:
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(error))))
                continue
            time.sleep(delay_ms / 1000)
            x = pb_utils.get_input_tensor_by_name(request, "x").as_numpy()
            responses.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("x", x)]))
        return responses
