"""The ``dense`` and ``sleep`` models on KServe's Python model server (runs in KServe's venv).

Usage: ``python kserve_server.py --grpc_port P --http_port Q --workers N`` (KServe parses its own
command line). KServe serves V2 gRPC from its main process: ``--workers`` starts more REST
(uvicorn) processes only, so every gRPC call runs its model on the main event loop. The models'
``predict`` is synchronous, as in KServe's own examples, so a blocking model blocks that loop.
Each response carries the request's ``use_binary_outputs``, as KServe's own
``get_predict_response`` does: without it, REST answers in JSON whatever the request's
``binary_data_output`` asked (gRPC is unchanged: raw in, raw out).
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

import kserve
import numpy as np
from kserve.errors import InvalidInput
from kserve.protocol.infer_type import InferOutput, InferRequest, InferResponse


def _output(name: str, array: np.ndarray, raw: bool) -> InferOutput:
    output = InferOutput(name=name, shape=list(array.shape), datatype="FP32")
    output.set_data_from_numpy(array.astype(np.float32, copy=False), binary_data=raw)
    return output


def _delay_ms(parameters: Any) -> int:
    """Read ``delay_ms`` from gRPC (a map of InferParameter) or REST (a dict) parameters."""
    if not parameters or "delay_ms" not in parameters:
        return 100
    value = parameters["delay_ms"]
    if hasattr(value, "WhichOneof"):
        choice = value.WhichOneof("parameter_choice")
        value = getattr(value, choice) if choice else None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidInput(f"delay_ms must be a non-negative integer, got {value!r}")
    return value


class Dense(kserve.Model):
    """``y = tanh(x @ W)`` with ``W = default_rng(0).standard_normal((256, 256))`` as FP32."""

    def load(self) -> bool:
        """Build the weight matrix."""
        self._weights = np.random.default_rng(0).standard_normal((256, 256)).astype(np.float32)
        self.ready = True
        return self.ready

    def predict(
        self, payload: InferRequest, headers: dict[str, str] | None = None
    ) -> InferResponse:
        """Apply the layer to input ``x``."""
        x = payload.inputs[0].as_numpy()
        y = np.tanh(x @ self._weights)
        return InferResponse(
            response_id=payload.id or str(uuid.uuid4()),
            model_name=self.name,
            infer_outputs=[_output("y", y, payload.use_binary_outputs)],
            use_binary_outputs=payload.use_binary_outputs,
        )


class Sleep(kserve.Model):
    """Blocks for parameter ``delay_ms`` (default 100), then echoes every FP32 input."""

    def load(self) -> bool:
        """Nothing to load."""
        self.ready = True
        return self.ready

    def predict(
        self, payload: InferRequest, headers: dict[str, str] | None = None
    ) -> InferResponse:
        """Sleep (blocking, like a model that computes), then echo."""
        time.sleep(_delay_ms(payload.parameters) / 1000)
        return InferResponse(
            response_id=payload.id or str(uuid.uuid4()),
            model_name=self.name,
            infer_outputs=[
                _output(tensor.name, tensor.as_numpy(), payload.use_binary_outputs)
                for tensor in payload.inputs
            ],
            use_binary_outputs=payload.use_binary_outputs,
        )


if __name__ == "__main__":
    models: list[kserve.Model] = [Dense("dense"), Sleep("sleep")]
    for model in models:
        model.load()
    server = kserve.ModelServer()  # configures logging
    # Every server runs without per-request logs: KServe's gRPC interceptor logs each call's
    # method at INFO, so its logger is raised to WARNING (startup lines are lost with them).
    logging.getLogger("kserve").setLevel(logging.WARNING)
    server.start(models)
