"""Model settings and the model repository: ``model-settings.json`` files -> ``ModelSettings``.

A repository is a folder with one subfolder per model; each model folder holds a
``model-settings.json`` and, usually, the model's code and weights::

    models/
    ├── add_sub/
    │   └── model-settings.json
    └── my_model/
        ├── model-settings.json     {"implementation": "model.MyModel", "max_batch_size": 8}
        └── model.py

Field names follow MLServer's ``model-settings.json`` where MLServer has the field, so files can be
brought across. Parsing is strict: a misspelt field is an error naming the file and the field, not
a setting silently ignored.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from trio_infer.datatypes import DATATYPES

__all__ = [
    "EXAMPLES",
    "SETTINGS_FILE",
    "ModelParameters",
    "ModelSettings",
    "SettingsError",
    "TensorSpec",
    "load_model_settings",
    "load_repository",
]

#: The file that marks a folder as a model folder.
SETTINGS_FILE = "model-settings.json"

#: The built-in example repository, served when no repository is given.
EXAMPLES: Path = Path(__file__).resolve().parent.parent / "examples"

_T = TypeVar("_T")

# "package.module.ClassName": at least a module and a class, each a Python identifier.
_IMPLEMENTATION = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")


@dataclass(frozen=True)
class TensorSpec:
    """A declared tensor: its name, datatype and shape (``-1`` marks a free dimension)."""

    name: str
    datatype: str
    shape: tuple[int, ...]


class SettingsError(ValueError):
    """Raised when a settings file or a repository is invalid; the message names the file."""


@dataclass(frozen=True)
class ModelParameters:
    """The ``parameters`` object of ``model-settings.json``.

    ``extra`` is free-form JSON for the model's own use. It takes no part in hashing (a dict is
    not hashable) but does in equality.
    """

    uri: str | None = None
    version: str = ""
    format: str | None = None
    content_type: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict, hash=False)


@dataclass(frozen=True)
class ModelSettings:
    """Everything the server knows about one model before loading it. Picklable.

    ``path`` is the model's folder (set by the loader, never read from JSON); worker processes put
    it on ``sys.path`` so a folder's own ``model.py`` can be named ``"model.MyModel"``.
    ``max_batch_time`` and ``timeout`` are in seconds; ``timeout`` bounds a model call for callers
    that have no deadline of their own.

    Batching (``trio_infer.scheduling.batching``) is on when ``max_batch_size`` is more than 1 and
    every declared input has ``-1`` as its first dimension, the batch dimension. Requests with the
    same input names, datatypes and trailing dimensions and equal parameters then run as one model
    call, their inputs concatenated along dimension 0; every output must have the batch's total rows
    as its first dimension and is cut back into each request's rows. A batch is filled to
    ``max_batch_size`` rows (a larger request runs alone) and leaves when full, when its oldest
    request has waited ``max_batch_time`` (0: take what is waiting and go), or earlier if a member's
    deadline (or ``timeout``) requires it.
    """

    name: str
    implementation: str
    path: Path | None = None
    platform: str = ""
    versions: tuple[str, ...] = ()
    inputs: tuple[TensorSpec, ...] = ()
    outputs: tuple[TensorSpec, ...] = ()
    parameters: ModelParameters = field(default_factory=ModelParameters)
    max_batch_size: int = 0
    max_batch_time: float = 0.0
    max_queue_size: int = 1024
    timeout: float | None = None

    @property
    def version(self) -> str:
        """The model's version (``parameters.version``; ``""`` when unversioned)."""
        return self.parameters.version


def load_model_settings(path: Path) -> ModelSettings:
    """Read ``<path>/model-settings.json``.

    Args:
        path: The model's folder. The model's ``name`` defaults to the folder's name.

    Returns:
        The validated settings, with ``path`` set to the folder.

    Raises:
        SettingsError: The file is missing, is not valid JSON, has an unknown field (at any
            level), or a field has the wrong type or an out-of-range value. The message starts
            with the file's path and names the field.
    """
    file = path / SETTINGS_FILE
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as exc:
        raise SettingsError(f"{file}: cannot read: {exc.strerror or exc}") from None
    try:
        document = json.loads(text, object_pairs_hook=_reject_duplicate_keys)
    except ValueError as exc:
        raise SettingsError(f"{file}: not valid JSON: {exc}") from None
    except _DuplicateKey as exc:
        raise SettingsError(f"{file}: {exc}") from None
    try:
        return _parse_settings(document, path)
    except _FieldError as exc:
        raise SettingsError(f"{file}: {exc}") from None


def load_repository(root: Path) -> list[ModelSettings]:
    """Read every model of a repository: each subfolder of ``root`` with a settings file.

    Subfolders without a ``model-settings.json`` are ignored (``__pycache__``, data folders).

    Args:
        root: The repository folder.

    Returns:
        The models' settings, sorted by model name.

    Raises:
        SettingsError: ``root`` is not a folder, holds no model, two files declare the same
            model name (both files are named), or a settings file is invalid.
    """
    if not root.is_dir():
        raise SettingsError(f"{root}: model repository is not a folder")
    found: dict[str, ModelSettings] = {}
    for folder in sorted(p for p in root.iterdir() if (p / SETTINGS_FILE).is_file()):
        settings = load_model_settings(folder)
        previous = found.get(settings.name)
        if previous is not None:
            assert previous.path is not None
            raise SettingsError(
                f"model name {settings.name!r} is declared twice: by "
                f"{previous.path / SETTINGS_FILE} and by {folder / SETTINGS_FILE}"
            )
        found[settings.name] = settings
    if not found:
        raise SettingsError(f"{root}: model repository holds no model (no */{SETTINGS_FILE})")
    return [found[name] for name in sorted(found)]


# --- parsing -------------------------------------------------------------------------------------
# Parsers raise _FieldError with the field's location ("inputs[0].shape"); load_model_settings
# prefixes the file, so every message reads "<file>: <field>: <problem>".


class _FieldError(Exception):
    pass


class _DuplicateKey(Exception):
    pass


def _reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # json keeps the last of repeated keys; a repeated key is almost always an editing mistake.
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise _DuplicateKey(f"key {key!r} appears twice in one object")
        result[key] = value
    return result


def _object(value: Any, where: str, known: frozenset[str]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _FieldError(f"{where or 'the file'} must be a JSON object, got {_kind(value)}")
    unknown = sorted(set(value) - known)
    if unknown:
        name = f"{where}.{unknown[0]}" if where else unknown[0]
        raise _FieldError(f"unknown field {name!r} (known: {', '.join(sorted(known))})")
    return value


def _get(
    obj: dict[str, Any], key: str, where: str, check: Callable[[Any, str], _T], default: _T
) -> _T:
    if key not in obj:
        return default
    return check(obj[key], f"{where}.{key}" if where else key)


def _string(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise _FieldError(f"{where} must be a string, got {_kind(value)}")
    return value


def _optional_string(value: Any, where: str) -> str | None:
    return None if value is None else _string(value, where)


def _non_negative_int(value: Any, where: str) -> int:
    # bool is an int subclass; "max_batch_size": true is a mistake, not 1.
    if not isinstance(value, int) or isinstance(value, bool):
        raise _FieldError(f"{where} must be an integer, got {_kind(value)}")
    if value < 0:
        raise _FieldError(f"{where} must not be negative, got {value}")
    return value


def _positive_int(value: Any, where: str) -> int:
    number = _non_negative_int(value, where)
    if number == 0:
        raise _FieldError(f"{where} must be at least 1, got 0")
    return number


def _non_negative_seconds(value: Any, where: str) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise _FieldError(f"{where} must be a number of seconds, got {_kind(value)}")
    if not math.isfinite(value) or value < 0:
        raise _FieldError(f"{where} must be a finite, non-negative number of seconds, got {value}")
    return float(value)


def _optional_positive_seconds(value: Any, where: str) -> float | None:
    if value is None:
        return None
    seconds = _non_negative_seconds(value, where)
    if seconds == 0:
        raise _FieldError(f"{where} must be more than 0 seconds (or null for no timeout)")
    return seconds


def _string_list(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise _FieldError(f"{where} must be a list of strings, got {_kind(value)}")
    return tuple(_string(item, f"{where}[{i}]") for i, item in enumerate(value))


_TENSOR_FIELDS = frozenset({"name", "datatype", "shape"})


def _tensor_spec(value: Any, where: str) -> TensorSpec:
    obj = _object(value, where, _TENSOR_FIELDS)
    missing = sorted(_TENSOR_FIELDS - set(obj))
    if missing:
        raise _FieldError(f"{where}.{missing[0]} is required")
    name = _string(obj["name"], f"{where}.name")
    if not name:
        raise _FieldError(f"{where}.name must not be empty")
    datatype = _string(obj["datatype"], f"{where}.datatype")
    if datatype not in DATATYPES:
        raise _FieldError(
            f"{where}.datatype {datatype!r} is not a datatype (known: {', '.join(DATATYPES)})"
        )
    shape = obj["shape"]
    if not isinstance(shape, list):
        raise _FieldError(f"{where}.shape must be a list of integers, got {_kind(shape)}")
    dims: list[int] = []
    for i, dim in enumerate(shape):
        if not isinstance(dim, int) or isinstance(dim, bool):
            raise _FieldError(f"{where}.shape[{i}] must be an integer, got {_kind(dim)}")
        if dim < -1:
            raise _FieldError(f"{where}.shape[{i}] must be -1 (any size) or a size >= 0, got {dim}")
        dims.append(dim)
    return TensorSpec(name=name, datatype=datatype, shape=tuple(dims))


def _tensor_specs(value: Any, where: str) -> tuple[TensorSpec, ...]:
    if not isinstance(value, list):
        raise _FieldError(f"{where} must be a list of tensors, got {_kind(value)}")
    specs = tuple(_tensor_spec(item, f"{where}[{i}]") for i, item in enumerate(value))
    seen: set[str] = set()
    for spec in specs:
        if spec.name in seen:
            raise _FieldError(f"{where}: tensor name {spec.name!r} appears twice")
        seen.add(spec.name)
    return specs


_PARAMETER_FIELDS = frozenset({"uri", "version", "format", "content_type", "extra"})


def _extra(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _FieldError(f"{where} must be a JSON object, got {_kind(value)}")
    return value


def _parameters(value: Any, where: str) -> ModelParameters:
    obj = _object(value, where, _PARAMETER_FIELDS)
    return ModelParameters(
        uri=_get(obj, "uri", where, _optional_string, None),
        # MLServer writes an unversioned model as "version": null.
        version=_get(obj, "version", where, _optional_string, None) or "",
        format=_get(obj, "format", where, _optional_string, None),
        content_type=_get(obj, "content_type", where, _optional_string, None),
        extra=_get(obj, "extra", where, _extra, {}),
    )


_SETTINGS_FIELDS = frozenset(
    {
        "name",
        "implementation",
        "platform",
        "versions",
        "inputs",
        "outputs",
        "parameters",
        "max_batch_size",
        "max_batch_time",
        "max_queue_size",
        "timeout",
    }
)
_DEFAULTS = ModelSettings(name="", implementation="")


def _parse_settings(document: Any, folder: Path) -> ModelSettings:
    obj = _object(document, "", _SETTINGS_FIELDS)
    name = _get(obj, "name", "", _string, folder.name)
    if not name:
        raise _FieldError("name must not be empty")
    if "implementation" not in obj:
        raise _FieldError("implementation is required (an import path: 'package.module.Class')")
    implementation = _string(obj["implementation"], "implementation")
    if not _IMPLEMENTATION.fullmatch(implementation):
        raise _FieldError(
            f"implementation {implementation!r} must be an import path 'package.module.Class'"
        )
    d = _DEFAULTS
    return ModelSettings(
        name=name,
        implementation=implementation,
        path=folder,
        platform=_get(obj, "platform", "", _string, d.platform),
        versions=_get(obj, "versions", "", _string_list, d.versions),
        inputs=_get(obj, "inputs", "", _tensor_specs, d.inputs),
        outputs=_get(obj, "outputs", "", _tensor_specs, d.outputs),
        parameters=_get(obj, "parameters", "", _parameters, d.parameters),
        max_batch_size=_get(obj, "max_batch_size", "", _non_negative_int, d.max_batch_size),
        max_batch_time=_get(obj, "max_batch_time", "", _non_negative_seconds, d.max_batch_time),
        max_queue_size=_get(obj, "max_queue_size", "", _positive_int, d.max_queue_size),
        timeout=_get(obj, "timeout", "", _optional_positive_seconds, d.timeout),
    )


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return f"the number {value}"
    if isinstance(value, str):
        return f"the string {value!r}"
    if isinstance(value, list):
        return "a list"
    return "an object"
