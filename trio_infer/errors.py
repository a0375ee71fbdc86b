"""Every way a request can fail, and the one gRPC status (and HTTP status) each maps to.

This module is the status table of the server. Code anywhere in the pipeline raises one of the
exceptions below; the transport turns it into the call's status and message, once, at the edge.
The REST front-end answers the HTTP status of the same row
(:func:`trio_infer.frontends.http_service.http_status`): Triton's where Triton has the code, the
``google.rpc.Code`` mapping where it has not (RESOURCE_EXHAUSTED, DEADLINE_EXCEEDED).

| exception         | cause                                         | gRPC status        | HTTP |
| ----------------- | --------------------------------------------- | ------------------ | ---- |
| ``ModelNotFound`` | unknown model or version                      | NOT_FOUND          | 404  |
| ``InvalidInput``  | malformed: shapes, datatypes, sizes, names    | INVALID_ARGUMENT   | 400  |
| ``Unavailable``   | model not ready, server draining, worker died | UNAVAILABLE        | 503  |
| ``Overloaded``    | a queue or memory bound is full (named)       | RESOURCE_EXHAUSTED | 429  |
| ``TooLarge``      | the request alone needs more than a memory    | RESOURCE_EXHAUSTED | 413  |
|                   | bound ever holds (named): no retry can pass   |                    |      |
| ``ModelFailed``   | the model raised                              | INTERNAL           | 500  |
| ``Unimplemented`` | method not served (decoupled model over REST) | UNIMPLEMENTED      | 501  |
| ``InferError``    | a model that chose its own status             | the chosen one     | its  |
| (a cancel scope)  | the deadline passed                           | DEADLINE_EXCEEDED  | 504  |
| (a cancel scope)  | the client cancelled                          | CANCELLED          | none |

Deadline expiry (DEADLINE_EXCEEDED) and client cancellation (CANCELLED) are not exceptions: they
are cancel scopes owned by the request, and the transport reports them. A REST client that went
away is sent nothing; Triton's 400 for CANCELLED is what a model that raises it gets.
"""

from __future__ import annotations

import enum
from typing import ClassVar


def shown(value: str, limit: int = 64) -> str:
    """``value`` as an error message may repeat it: its first ``limit`` characters. One byte of
    HPACK can stand for a header value of kilobytes, and a message field for megabytes, so a
    message that echoed it whole would answer a few bytes with kilobytes, and a gRPC status
    with trailers larger than a client takes (grpcio's limit on metadata)."""
    return value if len(value) <= limit else value[:limit] + "..."


class StatusCode(enum.IntEnum):
    """The gRPC status codes (the numbers are fixed by the gRPC specification)."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


class InferError(Exception):
    """A failure that ends a call with a gRPC status and a message for the client.

    Model code may raise it directly to choose the status its caller sees, for example
    ``raise InferError("user quota used up", StatusCode.RESOURCE_EXHAUSTED)``. It is picklable, so
    it crosses the worker-process boundary unchanged.

    Args:
        message: Sent to the client as ``grpc-message``.
        status: Overrides the class's status.
    """

    status: ClassVar[StatusCode] = StatusCode.INTERNAL

    def __init__(self, message: str, status: StatusCode | None = None) -> None:
        super().__init__(message, status)
        self.message = message
        self.code = status if status is not None else type(self).status

    def __str__(self) -> str:
        return self.message


class ModelNotFound(InferError):
    """Raised when a request names a model or version the server does not have."""

    status = StatusCode.NOT_FOUND


class InvalidInput(InferError):
    """Raised when a request is malformed; the message names the tensor and what was expected."""

    status = StatusCode.INVALID_ARGUMENT


class Unavailable(InferError):
    """Raised when the model cannot serve now: not ready, the server drains, a worker died."""

    status = StatusCode.UNAVAILABLE


class Overloaded(InferError):
    """Raised when admitting a request would exceed a bound; the message names the bound."""

    status = StatusCode.RESOURCE_EXHAUSTED


class TooLarge(Overloaded):
    """Raised when a request alone needs more than a memory bound ever holds (the whole budget,
    or a connection's share of it): unlike the other refusals, sending it again cannot succeed.
    The message names the bound."""


class ModelFailed(InferError):
    """Raised when the model's own code raised; the message is the model's."""

    status = StatusCode.INTERNAL


class Unimplemented(InferError):
    """Raised when a client calls a method this server does not serve."""

    status = StatusCode.UNIMPLEMENTED
