"""Request priority: Triton's ``priority`` request parameter, on three levels.

A request may set the parameter ``priority`` to an integer: 1 is the highest level, 3 the
lowest, and 0 or no parameter means 2 (Triton's client sends none unless told a level). The
server takes the parameter out of the request's parameters (the model does not see it) and
orders by it what waits for a worker: the pool's queue and each batching model's queue serve a
higher level first, and the requests of one level in arrival order. Requests of different levels
do not share a batch. A worker is sent its next call while it runs one: a call already sent is
not overtaken. Triton treats a level it does not have as the default; here it is an error, so
that a client learns its level means nothing.

It orders nothing else. The memory budget is reserved from a message's gRPC prefix, before the
message and its parameters are read, so its waiters stay first come, first served; and a model
whose ``max_queue_size`` slots are taken refuses a request at once, whatever its level. A lower
level waits as long as higher ones keep the workers busy: its deadline, not its level, bounds
that wait.
"""

from __future__ import annotations

from collections.abc import MutableMapping

from trio_infer.errors import InvalidInput
from trio_infer.model import ParameterValue

__all__ = ["DEFAULT_PRIORITY", "PRIORITY_LEVELS", "take_priority"]

#: The levels, 1 (the highest) to ``PRIORITY_LEVELS`` (the lowest). Few on purpose: interactive
#: traffic above the default, background work below it.
PRIORITY_LEVELS = 3
#: The level of a request that sets no priority, or 0.
DEFAULT_PRIORITY = 2


def take_priority(parameters: MutableMapping[str, ParameterValue]) -> int:
    """Remove the ``priority`` parameter from a request's parameters and return its level.

    Args:
        parameters: The request-level parameters, decoded.

    Returns:
        The request's level, from 1 (the highest) to :data:`PRIORITY_LEVELS`.

    Raises:
        InvalidInput: The parameter is not an integer from 0 to :data:`PRIORITY_LEVELS`.
    """
    value = parameters.pop("priority", 0)
    # bool is an int in Python, but not in the protocol.
    if type(value) is not int or not 0 <= value <= PRIORITY_LEVELS:
        raise InvalidInput(
            f"parameter 'priority' must be an integer from 0 to {PRIORITY_LEVELS} (1 is the "
            f"highest level, {PRIORITY_LEVELS} the lowest, 0 the default, {DEFAULT_PRIORITY}), "
            f"got {value!r}"
        )
    return value or DEFAULT_PRIORITY
