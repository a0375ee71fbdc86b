"""The ``dense`` example model, counting its calls: how the batching scenarios see batch sizes.

The batching scenarios copy this file into the ``dense`` folder of a temporary copy of the
example repository (as ``bench_batch_probe.py``) and point ``implementation`` at
``bench_batch_probe.CountingDense``. Each worker appends one line per model call, that is per
batch, to ``batches.log`` in the model's folder: ``<time.monotonic()> <rows>``. The monotonic
clock is the same in every process, so the benchmark counts the calls of its measured window.
One small ``os.write`` per call is all this adds to the model.

It runs inside the server's workers and imports only the example model.
"""

from __future__ import annotations

import os
import time

import numpy as np

from trio_infer.examples.models import Dense
from trio_infer.model import Parameters

#: The log's name, in the model's folder.
LOG_NAME = "batches.log"


class CountingDense(Dense):
    """``Dense``, plus one line per call in ``batches.log``: when, and how many rows."""

    def load(self) -> None:
        """Load the weights and open the log for appending."""
        super().load()
        assert self.settings.path is not None
        self._log = os.open(
            self.settings.path / LOG_NAME, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644
        )

    def predict(
        self, inputs: dict[str, np.ndarray], parameters: Parameters
    ) -> dict[str, np.ndarray]:
        """Return ``tanh(x @ W)`` and log the call's rows (one batch)."""
        outputs = super().predict(inputs, parameters)
        os.write(self._log, b"%.6f %d\n" % (time.monotonic(), inputs["x"].shape[0]))
        return outputs
