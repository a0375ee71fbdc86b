"""The example models. Their results are compared with other servers', so the math is exact.

- ``add_sub``: ``OUTPUT0 = INPUT0 + INPUT1``, ``OUTPUT1 = INPUT0 - INPUT1`` (FP32 ``[-1, 16]``).
- ``echo``: every input back as the output of the same name, any datatype.
- ``dense``: ``y = tanh(x @ W)``, ``x`` FP32 ``[-1, 256]``, ``W`` a fixed random 256x256 matrix.
- ``sleep``: blocks its worker for ``delay_ms`` (request parameter, default 100), then echoes.
"""

from __future__ import annotations

import time

import numpy as np

from trio_infer.errors import InvalidInput
from trio_infer.model import Model, Parameters

__all__ = ["AddSub", "Dense", "Echo", "Sleep"]


class AddSub(Model):
    """Element-wise sum and difference of two FP32 tensors."""

    def predict(
        self, inputs: dict[str, np.ndarray], parameters: Parameters
    ) -> dict[str, np.ndarray]:
        """Return ``OUTPUT0 = INPUT0 + INPUT1`` and ``OUTPUT1 = INPUT0 - INPUT1``."""
        a, b = inputs["INPUT0"], inputs["INPUT1"]
        return {"OUTPUT0": a + b, "OUTPUT1": a - b}


class Echo(Model):
    """Returns its inputs unchanged."""

    def predict(
        self, inputs: dict[str, np.ndarray], parameters: Parameters
    ) -> dict[str, np.ndarray]:
        """Return every input as the output of the same name."""
        return dict(inputs)


class Dense(Model):
    """One dense layer, ``y = tanh(x @ W)``, with fixed weights (seed 0)."""

    weights: np.ndarray

    def load(self) -> None:
        """Build the 256x256 FP32 weight matrix from seed 0."""
        rng = np.random.default_rng(0)
        self.weights = rng.standard_normal((256, 256)).astype(np.float32)

    def predict(
        self, inputs: dict[str, np.ndarray], parameters: Parameters
    ) -> dict[str, np.ndarray]:
        """Return ``y = tanh(x @ W)``."""
        return {"y": np.tanh(inputs["x"] @ self.weights)}


class Sleep(Model):
    """Holds its worker for a while (``time.sleep``, not a Trio sleep), then echoes its inputs.

    Useful to exercise deadlines, cancellation and worker saturation.
    """

    def predict(
        self, inputs: dict[str, np.ndarray], parameters: Parameters
    ) -> dict[str, np.ndarray]:
        """Sleep ``parameters["delay_ms"]`` milliseconds (default 100), then echo the inputs.

        Raises:
            InvalidInput: ``delay_ms`` is not a non-negative integer.
        """
        delay_ms = parameters.get("delay_ms", 100)
        # bool is an int subclass, but "delay_ms": true is a client mistake.
        if not isinstance(delay_ms, int) or isinstance(delay_ms, bool) or delay_ms < 0:
            raise InvalidInput(
                f"parameter 'delay_ms' must be a non-negative integer, got {delay_ms!r}"
            )
        time.sleep(delay_ms / 1000)
        return dict(inputs)
