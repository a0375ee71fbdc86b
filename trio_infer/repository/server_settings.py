"""MLServer's server-wide ``settings.json``, read for the ``trio-infer serve`` options it has an
equivalent of: an MLServer deployment's folder is served as it is.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trio_infer.repository.settings import SettingsError

__all__ = ["SERVER_SETTINGS_FILE", "ServerDefaults", "read_server_settings", "server_defaults"]

#: The server-wide settings file of MLServer, in the folder ``mlserver start`` is given.
SERVER_SETTINGS_FILE = "settings.json"


@dataclass(frozen=True)
class ServerDefaults:
    """What an MLServer ``settings.json`` says that ``trio-infer serve`` has an option for."""

    file: Path
    options: dict[str, Any]
    """Defaults for the options, by their ``argparse`` names (``workers``, ``grpc_port``...);
    options given on the command line win."""
    ignored: tuple[str, ...]
    """The file's fields that have no equivalent here, sorted."""


# field -> (option, the JSON type it must have). MLServer's Settings class names the fields.
_OPTIONS: dict[str, tuple[str, type]] = {
    "debug": ("debug", bool),
    "host": ("host", str),
    "http_port": ("http_port", int),
    "grpc_port": ("grpc_port", int),
    "metrics_port": ("metrics_port", int),
    "grpc_max_message_length": ("max_message_size", int),
    "parallel_workers": ("workers", int),
    "load_models_at_startup": ("model_control_mode", bool),
}


def server_defaults(document: Mapping[str, Any], file: Path) -> ServerDefaults:
    """Map an MLServer ``settings.json`` to ``trio-infer serve``'s option defaults.

    ``debug``, ``host``, ``http_port``, ``grpc_port`` and ``metrics_port`` are the options of
    those names; ``grpc_max_message_length`` is ``max_message_size``; ``parallel_workers`` is
    ``workers`` (MLServer's 0, models run in the server's own process, is 1 here: models always
    run in worker processes); ``load_models_at_startup: false`` is the ``explicit`` control mode
    (no model loaded at start, the repository API loads them). MLServer's
    ``model_repository_root`` is not read: ``mlserver start FOLDER`` replaces it with the
    folder, which is the repository given here too.

    Args:
        document: The parsed file.
        file: The file, for messages.

    Raises:
        SettingsError: A mapped field has the wrong type; the message names the file and field.
    """
    options: dict[str, Any] = {}
    for field, value in document.items():
        if field not in _OPTIONS or value is None:
            continue  # None: MLServer's "not set" for its optional fields
        option, kind = _OPTIONS[field]
        # The exact type: bool is an int subclass, but true is not a port.
        if type(value) is not kind:
            raise SettingsError(f"{file}: {field}: expected {kind.__name__}, got {value!r}")
        if field == "parallel_workers":
            options[option] = value or 1  # MLServer's 0: see the docstring
        elif field == "load_models_at_startup":
            options[option] = "none" if value else "explicit"
        else:
            options[option] = value
    ignored = tuple(sorted(field for field in document if field not in _OPTIONS))
    return ServerDefaults(file, options, ignored)


def read_server_settings(folder: Path) -> ServerDefaults | None:
    """Read ``<folder>/settings.json`` (MLServer's server settings), if there is one.

    Raises:
        SettingsError: The file cannot be read, is not a JSON object, or a mapped field has
            the wrong type.
    """
    file = folder / SERVER_SETTINGS_FILE
    if not file.is_file():
        return None
    try:
        document = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise SettingsError(f"{file}: cannot read: {exc}") from None
    if not isinstance(document, dict):
        raise SettingsError(f"{file}: the file must be a JSON object")
    return server_defaults(document, file)
