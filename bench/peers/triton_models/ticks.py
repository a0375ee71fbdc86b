"""``ticks`` for Triton's Python backend in decoupled mode (``<repository>/ticks/1/model.py``).

Sends request parameter ``count`` responses (default 8), ``y = x + i`` for the i-th, the first
at once and each next after a blocking sleep of parameter ``delay_ms`` (default 2), through the
request's response sender, then the final flag: the twin of trio-infer's
``bench/peers/trio_models/ticks/bench_ticks.py``.
"""

from __future__ import annotations

import json
import time
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils  # provided by the stub


class TritonPythonModel:
    """``count`` responses, ``delay_ms`` apart, per request."""

    def execute(self, requests: list[Any]) -> None:
        """Answer each request through its sender; a decoupled ``execute`` returns None."""
        for request in requests:
            sender = request.get_response_sender()
            parameters = json.loads(request.parameters() or "{}")
            count = int(parameters.get("count", 8))
            delay = int(parameters.get("delay_ms", 2)) / 1000
            x = pb_utils.get_input_tensor_by_name(request, "x").as_numpy()
            for i in range(count):
                if i:
                    time.sleep(delay)
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("y", x + np.float32(i))]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
