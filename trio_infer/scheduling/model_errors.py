"""The log of the errors models raise: at most one line per model per interval.

Model errors are logged in the server process, where a failed call is known: by the worker pool
for a model's own errors, and by a batcher for outputs that do not split into rows. One log is
shared by both, so a model gets one line per interval whichever found its error.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import ClassVar

import trio

from trio_infer.errors import InferError

__all__ = ["ModelErrorLog", "model_logger"]

#: Where model errors are logged: apart from the server's own messages, so that an operator can
#: route or silence them by this name.
model_logger = logging.getLogger("trio_infer.models")


@dataclass
class _Quiet:
    """When the last line about a model was logged, and its errors counted since."""

    logged: float
    suppressed: int = 0


class ModelErrorLog:
    """Logs the errors models raise, at most one line per model per :attr:`interval` seconds.

    A model that fails on every call must not flood the log: after a line about a model, its
    errors are only counted for ``interval`` seconds, and the next line says how many were not
    logged. A line names the model, the status and the error's message (which holds the model's
    traceback only when the server runs with ``debug``).

    Lines are WARNINGs, not ERRORs: the server is well, the failure stays with that model's
    calls, and their clients got the error; ERROR is kept for faults of the server itself (a
    crashed internal task, a model that cannot be loaded).
    """

    interval: ClassVar[float] = 10.0
    """Seconds between two lines about one model (read at each error)."""

    def __init__(self) -> None:
        self._quiet: dict[str, _Quiet] = {}

    def record(self, model: str, error: InferError, now: float | None = None) -> bool:
        """Log a model's error, or count it if a line about that model is recent.

        Args:
            model: The model's name.
            error: What its call failed with.
            now: The current time (default: Trio's clock).

        Returns:
            Whether a line was logged.
        """
        if now is None:
            now = trio.current_time()
        quiet = self._quiet.get(model)
        if quiet is not None and now - quiet.logged < self.interval:
            quiet.suppressed += 1
            return False
        suppressed = quiet.suppressed if quiet is not None else 0
        self._quiet[model] = _Quiet(now)
        model_logger.warning(
            "model '%s' failed (%s): %s%s",
            model,
            error.code.name,
            error.message,
            f" [{suppressed} more error(s) of this model since the previous line were not logged]"
            if suppressed
            else "",
        )
        return True
