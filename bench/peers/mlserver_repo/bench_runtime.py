"""The ``dense`` and ``sleep`` models as MLServer custom runtimes (runs in MLServer's venv).

``mlserver start bench/peers/mlserver_repo`` finds ``dense/`` and ``sleep/`` through their
``model-settings.json``; this folder is put on ``PYTHONPATH`` by the benchmark so that the
parallel workers can import ``bench_runtime`` too.
"""

from __future__ import annotations

import time

import numpy as np
from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.errors import MLServerError
from mlserver.types import InferenceRequest, InferenceResponse


class Dense(MLModel):
    """``y = tanh(x @ W)`` with ``W = default_rng(0).standard_normal((256, 256))`` as FP32."""

    async def load(self) -> bool:
        """Build the weight matrix."""
        self._weights = np.random.default_rng(0).standard_normal((256, 256)).astype(np.float32)
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        """Apply the layer to input ``x``."""
        x = NumpyCodec.decode_input(payload.inputs[0])
        y = np.tanh(x @ self._weights)
        return InferenceResponse(model_name=self.name, outputs=[NumpyCodec.encode_output("y", y)])


class Sleep(MLModel):
    """Blocks its worker for parameter ``delay_ms`` (default 100), then echoes every input."""

    async def load(self) -> bool:
        """Nothing to load."""
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        """Sleep (blocking, like a model that computes), then echo."""
        delay_ms = 100
        if payload.parameters is not None:
            delay_ms = getattr(payload.parameters, "delay_ms", delay_ms)
        if not isinstance(delay_ms, int) or delay_ms < 0:
            raise MLServerError(f"delay_ms must be a non-negative integer, got {delay_ms!r}", 400)
        # Blocking on purpose: the model stands for computation that holds its worker.
        time.sleep(delay_ms / 1000)  # noqa: ASYNC251
        outputs = [
            NumpyCodec.encode_output(tensor.name, NumpyCodec.decode_input(tensor))
            for tensor in payload.inputs
        ]
        return InferenceResponse(model_name=self.name, outputs=outputs)
