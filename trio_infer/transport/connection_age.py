"""When a client connection has lived long enough (``--max-connection-age``).

Behind a Kubernetes Service, whose virtual IP balances connections and not calls, a long-lived
HTTP/2 connection pins its client to one replica for as long as it lives: replicas added later
get none of its calls. gRPC servers therefore retire a connection once it reaches a maximum age
(grpc's ``max_connection_age_ms``): GOAWAY, the client opens a new connection, and that one may
reach another replica. Both servers here (gRPC and HTTP/1.1) retire their connections by the
same rule, :func:`retirement_time`.

The age is spread by up to 10 % either way at random, as gRPC spreads it, so that connections
opened together (a client's pool, every client after a rollout) do not all reconnect together
either, which would pin them again in a herd.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

__all__ = ["AGE_JITTER", "retirement_time"]

#: How far a connection's age is spread either way, as a fraction (gRPC's
#: ``MAX_CONNECTION_AGE_JITTER``).
AGE_JITTER = 0.1


def retirement_time(
    opened: float,
    max_age: float | None,
    uniform: Callable[[float, float], float] = random.uniform,
) -> float:
    """When a connection opened at ``opened`` is due to be retired, on the same clock.

    Args:
        opened: When the connection was accepted.
        max_age: The maximum age in seconds; None: connections are never retired (``math.inf``
            is returned).
        uniform: Draws the spread: a number between its two arguments (``random.uniform``;
            tests pass a fixed one).

    Returns:
        ``opened`` plus ``max_age`` times a factor drawn between 0.9 and 1.1.
    """
    if max_age is None:
        return math.inf
    return opened + max_age * uniform(1 - AGE_JITTER, 1 + AGE_JITTER)
