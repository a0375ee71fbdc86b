"""How the server's log records are written: text lines, or one JSON object per line.

``configure`` sets up the root handler once, at start (``trio-infer serve --log-level
--log-format --access-log``). JSON lines carry ``time`` (ISO 8601, UTC), ``level``, ``logger``
and ``message``, then the fields a record was given (``extra=``: the access log's ``protocol``,
``method``, ``model``, ``status``, ``duration_ms``, ``bytes_in``, ``bytes_out``,
``request_id``), and ``exception`` (the traceback's text) when it has one: what log shippers
(Fluent Bit, Vector, Loki) parse without a pattern.
"""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime
from typing import Any

__all__ = ["LOG_FORMATS", "JsonFormatter", "configure"]

LOG_FORMATS = ("text", "json")
_TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# What every LogRecord has: the rest of its attributes are the fields it was given.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message",
    "asctime",
    "taskName",
}


class JsonFormatter(logging.Formatter):
    """Formats each record as one JSON object on one line (see the module's docstring)."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name, value in vars(record).items():
            if name not in _STANDARD:
                line[name] = value
        if record.exc_info is not None:
            line["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exception"] = record.exc_text
        # default=str: a field of a type JSON lacks is still written, as its text.
        return json.dumps(line, default=str, ensure_ascii=False)


def configure(level: int, log_format: str = "text", access_log: bool = False) -> None:
    """Send log records to stderr: the server's (``trio_infer.*``) at ``level``, the
    libraries' at WARNING at least (at DEBUG they log every frame and header they handle), and
    the access log (``trio_infer.access``, one INFO record per call) only when ``access_log``.

    Args:
        level: The server's log level.
        log_format: ``text`` or ``json`` (:data:`LOG_FORMATS`).
        access_log: Whether to write the access log (at any ``level``).
    """
    handler = logging.StreamHandler()
    formatter = JsonFormatter() if log_format == "json" else logging.Formatter(_TEXT_FORMAT)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    # The libraries' loggers inherit the root's level; ours (the "trio_infer" tree) get theirs.
    root.setLevel(max(level, logging.WARNING))
    logging.getLogger("trio_infer").setLevel(level)
    # The transports write the access log only when the server is told to (ServerConfig's
    # access_log); this lets it through whatever the server's level.
    logging.getLogger("trio_infer.access").setLevel(logging.INFO if access_log else logging.NOTSET)
