"""``ticks`` for trio-infer: a decoupled model (``bench/peers/trio_models/ticks``).

Yields request parameter ``count`` responses (default 8), ``y = x + i`` for the i-th, the first
at once and each next after a blocking sleep of parameter ``delay_ms`` (default 2): a small
stand-in for token-by-token generation. Triton's twin is ``bench/peers/triton_models/ticks.py``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np

from trio_infer import Model, Parameters


class Ticks(Model):
    """``count`` responses, ``delay_ms`` apart."""

    def predict(  # type: ignore[override]
        self, inputs: dict[str, np.ndarray], parameters: Parameters
    ) -> Iterator[dict[str, np.ndarray]]:
        """Yield ``{"y": x + i}`` for i in ``range(count)``, sleeping ``delay_ms`` between."""
        x = inputs["x"]
        count = int(parameters.get("count", 8))
        delay = int(parameters.get("delay_ms", 2)) / 1000
        for i in range(count):
            if i:
                time.sleep(delay)
            yield {"y": x + np.float32(i)}
