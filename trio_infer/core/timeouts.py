"""A request's own deadline, from its ``timeout`` parameter: the same on every entrance.

Triton's ``timeout`` request parameter (microseconds; ``tritonclient``'s ``timeout=`` sends it)
bounds one request, inside whatever deadline its entrance gives it (a gRPC call's
``grpc-timeout``; a REST request has none of its own). Each front-end takes it out of the
decoded parameters with :func:`take_timeout` before the model sees them, and runs the request
in a cancel scope with that deadline, ending it with :data:`TIMED_OUT` when it passes.
"""

from __future__ import annotations

import math

import trio

from trio_infer.errors import InvalidInput
from trio_infer.model import ParameterValue

__all__ = ["TIMED_OUT", "take_timeout"]

#: The message of a request ended by its own ``timeout`` (DEADLINE_EXCEEDED).
TIMED_OUT = "deadline exceeded (the request's timeout parameter)"


def take_timeout(parameters: dict[str, ParameterValue]) -> float:
    """When the request's ``timeout`` parameter (microseconds; 0 is none) says it must end, on
    the Trio clock (``math.inf``: it sets none). The parameter is taken out of ``parameters``.

    Raises:
        InvalidInput: ``timeout`` is not an integer number of microseconds, at least 0.
    """
    if "timeout" not in parameters:
        return math.inf
    microseconds = parameters.pop("timeout")
    # bool is an int subclass, but "timeout": true is a client mistake.
    if not isinstance(microseconds, int) or isinstance(microseconds, bool) or microseconds < 0:
        raise InvalidInput("parameter 'timeout' must be an int64 of microseconds, at least 0")
    return trio.current_time() + microseconds / 1e6 if microseconds else math.inf
