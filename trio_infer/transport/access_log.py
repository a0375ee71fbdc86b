"""Request ids and the access log, the same for every transport.

Every call has a request id: the client's ``x-request-id`` when it sent a usable one, else one
made here. The transport echoes it in the response's ``x-request-id`` header and logs it.

The access log is the ``trio_infer.access`` logger at INFO: one record per call, whose message
says the call in one line and whose attributes (``protocol``, ``method``, ``model``, ``status``,
``duration_ms``, ``bytes_in``, ``bytes_out``, ``request_id``) carry the same fields for a JSON
formatter. It is off unless ``--access-log`` turns it on: a record costs about as much as the
rest of a small call's protocol work (docs/performance.md).

What a client chose (the method path, the model's name, the request id) is written bounded,
and in the one-line message escaped (:func:`log_text`): a model name holding a line break must
not write a second, forged record, nor a name of megabytes a record of megabytes.
"""

from __future__ import annotations

import itertools
import logging
import os
from dataclasses import dataclass

from trio_infer.transport.quoting import shown

__all__ = [
    "ACCESS_LOGGER",
    "REQUEST_ID_HEADER",
    "CallRecord",
    "log_call",
    "log_text",
    "new_request_id",
    "request_id",
]

#: The header (gRPC metadata) that carries a call's request id, both ways.
REQUEST_ID_HEADER = "x-request-id"

ACCESS_LOGGER = logging.getLogger("trio_infer.access")
"""Where the access log goes (one INFO record per call); off unless turned on."""

#: The longest client request id echoed and logged; a longer one is replaced by one made here.
_MAX_REQUEST_ID = 128
#: The most characters of a client's text (a method path, a model's name) a record carries:
#: more than any model name a repository folder can hold.
_MAX_LOGGED = 512
# Unique across the replicas of a deployment with high probability (the random part) and
# within this process for sure (the count), at a fraction of uuid4's cost per call. The
# prefix ends with the dash that joins it to the count: one concatenation makes an id.
_PREFIX = os.urandom(6).hex() + "-"
_count = itertools.count(1)


def request_id(sent: str | bytes | None) -> str:
    """A call's request id: ``sent`` (the client's ``x-request-id``) when it is printable ASCII
    of at most 128 characters, else a new id, unique to this call.

    A client's id is refused rather than cut or escaped: it is echoed in a header and written
    to logs, where a control character or megabytes of it would do harm.
    """
    if (
        isinstance(sent, str)
        and 0 < len(sent) <= _MAX_REQUEST_ID
        and sent.isascii()
        and sent.isprintable()
    ):
        return sent
    return new_request_id()


def new_request_id() -> str:
    """A new request id, unique to this call: for a call whose client sent none."""
    # hex() and a slice, not a format spec: the same digits (lower-case, no leading zeros)
    # without the format's parsing at each call.
    return _PREFIX + hex(next(_count))[2:]


@dataclass(frozen=True, slots=True)
class CallRecord:
    """One call, as the access log says it.

    Args:
        protocol: ``grpc`` or ``http``.
        method: The gRPC method path, or the HTTP method and path.
        model: What the call was for, as its front-end names it (a model's name), or ``""``.
        status: The call's status: a gRPC status name, or an HTTP status code.
        duration: Seconds from the call's start to its end.
        bytes_in: Bytes of request messages (gRPC) or body (HTTP) received.
        bytes_out: Bytes of response messages or body sent.
        request_id: The call's request id (:func:`request_id`).
    """

    protocol: str
    method: str
    model: str
    status: str
    duration: float
    bytes_in: int
    bytes_out: int
    request_id: str


def log_text(value: str) -> str:
    """``value`` (a client's text) as one field of the access log's one-line message: its first
    characters (:func:`~trio_infer.transport.quoting.shown`), each backslash and each
    character that is not printable (line breaks, NUL, Unicode's line and paragraph
    separators) written as a Python escape (``\\x0a``, ``\\u2028``), so that the field
    stays on its line and an escaped value is told from one sent as it reads."""
    cut = shown(value, _MAX_LOGGED)
    if cut.isprintable() and "\\" not in cut:
        return cut
    return "".join(
        character if character.isprintable() and character != "\\" else _escape(character)
        for character in cut
    )


def _escape(character: str) -> str:
    """``character`` as a Python escape of its code point."""
    code = ord(character)
    if code <= 0xFF:
        return f"\\x{code:02x}"
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def log_call(record: CallRecord) -> None:
    """Write ``record`` to the access log (callers check ``ACCESS_LOGGER.isEnabledFor(INFO)``
    first, so that a call pays for nothing while the log is off). The client's text is bounded
    in the record's fields and escaped in its message (:func:`log_text`)."""
    duration_ms = round(record.duration * 1000, 3)
    method = shown(record.method, _MAX_LOGGED)
    model = shown(record.model, _MAX_LOGGED)
    ACCESS_LOGGER.info(
        "%s %s %s %s %.3fms in=%d out=%d id=%s",
        record.protocol,
        log_text(method),
        log_text(model) if model else "-",
        record.status,
        duration_ms,
        record.bytes_in,
        record.bytes_out,
        log_text(record.request_id),
        extra={
            "protocol": record.protocol,
            "method": method,
            "model": model,
            "status": record.status,
            "duration_ms": duration_ms,
            "bytes_in": record.bytes_in,
            "bytes_out": record.bytes_out,
            "request_id": record.request_id,
        },
    )
