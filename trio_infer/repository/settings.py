"""Model settings and the model repository: ``model-settings.json`` files -> ``ModelSettings``.

A repository is a folder with one subfolder per model; each model folder holds a
``model-settings.json`` and, usually, the model's code and weights::

    models/
    ├── add_sub/
    │   └── model-settings.json
    └── my_model/
        ├── model-settings.json     {"implementation": "model.MyModel",
        │                            "parameters": {"uri": "./weights.npy"}}
        ├── model.py
        └── weights.npy

Field names follow MLServer's ``model-settings.json`` where MLServer has the field, so files can be
brought across. As in MLServer, the settings are pydantic models: pydantic checks types and
ranges, and the few rules of this server (an import path, a known datatype, tensor names unique)
are named validators below. Parsing is strict: a misspelt field is an error naming the file and
the field, not a setting silently ignored, and no value is converted (``"16"`` is not a shape
dimension, ``true`` is not a batch size).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator, ConfigDict, Field, Strict, ValidationError
from pydantic.dataclasses import dataclass
from pydantic_core import ErrorDetails, PydanticCustomError

from trio_infer.datatypes import DATATYPES
from trio_infer.repository.runtime_names import PLATFORM_RUNTIMES, built_in_implementation

__all__ = [
    "EXAMPLES",
    "SETTINGS_FILE",
    "ModelParameters",
    "ModelSettings",
    "RepositoryEntry",
    "SettingsError",
    "TensorSpec",
    "folder_revision",
    "load_model_settings",
    "load_repository",
    "scan_repository",
]

#: The file that marks a folder as a model folder.
SETTINGS_FILE = "model-settings.json"

#: The built-in example repository, served when no repository is given.
EXAMPLES: Path = Path(__file__).resolve().parent.parent / "examples"


class SettingsError(ValueError):
    """Raised when a settings file or a repository is invalid; the message names the file."""


# --- validators ----------------------------------------------------------------------------------
# Each enforces one rule that pydantic's types and constraints do not express. They raise
# PydanticCustomError, so their messages read like pydantic's own ("Input should be ...").

# "package.module.ClassName": at least a module and a class, each a Python identifier.
_IMPORT_PATH = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")


def _import_path(value: str) -> str:
    if not _IMPORT_PATH.fullmatch(value):
        raise PydanticCustomError(
            "import_path", "Input should be an import path 'package.module.Class'"
        )
    return value


def _known_datatype(value: str) -> str:
    if value not in DATATYPES:
        raise PydanticCustomError(
            "datatype",
            "Input should be one of the datatypes ({known})",
            {"known": ", ".join(DATATYPES)},
        )
    return value


def _unique_tensor_names(specs: tuple[TensorSpec, ...]) -> tuple[TensorSpec, ...]:
    seen: set[str] = set()
    for spec in specs:
        if spec.name in seen:
            raise PydanticCustomError(
                "duplicate_tensor_name",
                "tensor name {name} appears twice",
                {"name": repr(spec.name)},
            )
        seen.add(spec.name)
    return specs


def _null_is_unversioned(value: Any) -> Any:
    # MLServer writes an unversioned model as "version": null.
    return "" if value is None else value


# Strict scalars: no value is converted (bool is an int subclass, but "max_batch_size": true is a
# mistake, not 1). An int is taken where seconds are expected. Containers stay lax so that a JSON
# list fills a tuple field.
_String = Annotated[str, Strict()]
_Name = Annotated[str, Strict(), Field(min_length=1)]
# Upper bounds are those of the fields of Triton's ModelConfig and of the V2 protocol's
# metadata that carry each setting (ModelConfig, ModelMetadata), so that every setting accepted
# can be described to a client: max_batch_size is an int32, max_queue_size a uint32, a shape's
# dimensions int64s, and max_batch_time and max_sequence_idle_microseconds uint64s of
# microseconds (max_batch_time to 2**63 microseconds, so that its rounding cannot pass 2**64).
_BatchSize = Annotated[int, Strict(), Field(ge=0, le=2**31 - 1)]
_QueueSize = Annotated[int, Strict(), Field(ge=1, le=2**32 - 1)]
_Microseconds = Annotated[int, Strict(), Field(ge=1, le=2**64 - 1)]
_BatchTime = Annotated[float, Strict(), Field(ge=0, le=2**63 // 10**6, allow_inf_nan=False)]
_PositiveSeconds = Annotated[float, Strict(), Field(gt=0, allow_inf_nan=False)]
_Dimension = Annotated[int, Strict(), Field(ge=-1, le=2**63 - 1)]  # -1: any size

# A misspelt field is an error, at every level.
_CONFIG = ConfigDict(extra="forbid")


# Pydantic dataclasses, not BaseModels: they keep dataclass construction (positional, as in
# TensorSpec("x", "FP32", (-1, 3)) and ModelSettings("m", "a.B")), dataclasses.replace, and
# dataclass equality, hashing, pickling and immutability, with each field a plain instance
# attribute; pydantic validates every construction from the file or from code.
@dataclass(frozen=True, config=_CONFIG)
class TensorSpec:
    """A declared tensor: its name, datatype and shape (``-1`` marks a free dimension)."""

    name: _Name
    datatype: Annotated[str, Strict(), AfterValidator(_known_datatype)]
    shape: tuple[_Dimension, ...]


_TensorSpecs = Annotated[tuple[TensorSpec, ...], AfterValidator(_unique_tensor_names)]


@dataclass(frozen=True, config=_CONFIG)
class ModelParameters:
    """The ``parameters`` object of ``model-settings.json``.

    ``uri`` is kept as written; :attr:`ModelSettings.model_uri` resolves it. ``extra`` is
    free-form JSON for the model's own use. It takes no part in hashing (a dict is not hashable)
    but does in equality.
    """

    uri: _String | None = None
    version: Annotated[_String, BeforeValidator(_null_is_unversioned)] = ""
    format: _String | None = None
    content_type: _String | None = None
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict, hash=False)


@dataclass(frozen=True, config=_CONFIG)
class ModelSettings:
    """Everything the server knows about one model before loading it. Picklable.

    ``path`` is the model's folder (set by the loader, never read from JSON); worker processes put
    it on ``sys.path`` so a folder's own ``model.py`` can be named ``"model.MyModel"``.
    ``implementation`` names a built-in runtime (:mod:`trio_infer.runtimes`) when it names one of
    MLServer's (``mlserver_sklearn.SKLearnModel``...), or when it is not set and ``platform`` names
    a format one serves (``onnxruntime_onnx``...): :mod:`trio_infer.repository.runtime_names`.
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

    ``decoupled`` (Triton's ``model_transaction_policy { decoupled: true }``) declares a model
    whose ``predict`` is a generator, sync or async, yielding 0..N output dicts per request. It is
    a setting, not guessed from the class: the server never imports model code (workers do), yet
    must know before any worker has loaded the model that ModelInfer refuses it and that it
    cannot batch. A worker checks that the class agrees when it loads the model.

    Raises:
        pydantic.ValidationError: A field has the wrong type or an out-of-range value (when
            constructed in code; :func:`load_model_settings` raises ``SettingsError``).
    """

    name: _Name
    # "" (not set) only when platform names a built-in runtime: __post_init__ fills it in.
    implementation: Annotated[
        str, Strict(), AfterValidator(_import_path), AfterValidator(built_in_implementation)
    ] = ""
    path: Path | None = None
    platform: _String = ""
    versions: tuple[_String, ...] = ()
    inputs: _TensorSpecs = ()
    outputs: _TensorSpecs = ()
    parameters: ModelParameters = dataclasses.field(default_factory=ModelParameters)
    max_batch_size: _BatchSize = 0
    max_batch_time: _BatchTime = 0.0
    max_queue_size: _QueueSize = 1024
    timeout: _PositiveSeconds | None = None
    decoupled: Annotated[bool, Strict()] = False
    """Whether the model answers a request with 0..N responses (its ``predict`` is a
    generator): served on ModelStreamInfer only, and never batched."""
    max_sequence_idle_microseconds: _Microseconds = 1_000_000
    """How long a sequence (``trio_infer.scheduling.sequences``) may have no request in flight
    before it is ended, its worker no longer held for it (Triton's setting and default, 1 s)."""
    revision: str = ""
    """What the model's folder held when these settings were read (set by the loader, never
    read from JSON: :func:`folder_revision`): a worker builds the model anew, its code imported
    again, for settings of another revision, so a reload sees changed code and weights."""

    def __post_init__(self) -> None:
        if not self.implementation:
            runtime = PLATFORM_RUNTIMES.get(self.platform)
            if runtime is None:
                raise PydanticCustomError(
                    "implementation_missing",
                    "implementation: Field required: name the model's class "
                    "('package.module.Class'), or a platform served by a built-in runtime "
                    "({platforms})",
                    {"platforms": ", ".join(PLATFORM_RUNTIMES)},
                )
            # Frozen: set as the dataclass's own __init__ sets fields.
            object.__setattr__(self, "implementation", runtime)
        if self.decoupled and self.max_batch_size > 1:
            raise PydanticCustomError(
                "decoupled_batching",
                'max_batch_size is {size}, but a decoupled model ("decoupled": true) does not '
                "batch: set max_batch_size to 0 or 1",
                {"size": self.max_batch_size},
            )

    @property
    def version(self) -> str:
        """The model's version (``parameters.version``; ``""`` when unversioned)."""
        return self.parameters.version

    @property
    def model_uri(self) -> Path | None:
        """Where the model's weights are: ``parameters.uri`` resolved as MLServer resolves it.

        A relative uri is relative to the model's folder (``path``, the folder holding
        ``model-settings.json``), not to the server's working directory; an absolute one is
        returned as written. ``None`` when no uri is set (none, or ``""``). Without a ``path``
        (settings made in code) a relative uri is returned as written.
        """
        uri = self.parameters.uri
        if not uri:
            return None
        written = Path(uri)
        if written.is_absolute() or self.path is None:
            return written
        # Joined and normalised lexically, as MLServer does: "../shared/w.npy" names a file in a
        # sibling folder without touching the file system.
        return Path(os.path.normpath(self.path / written))


def load_model_settings(
    path: Path, override: Mapping[str, Any] | None = None, *, revision: str = ""
) -> ModelSettings:
    """Read ``<path>/model-settings.json``.

    Args:
        path: The model's folder. The model's ``name`` defaults to the folder's name.
        override: Top-level fields that replace the file's (a repository load's ``config``),
            checked as the file's are.
        revision: The folder's :func:`folder_revision`, recorded in the settings.

    Returns:
        The validated settings, with ``path`` and ``revision`` set.

    Raises:
        SettingsError: The file is missing, is not valid JSON, repeats a key, has an unknown
            field (at any level), or a field has the wrong type or an out-of-range value. The
            message is one line, ``<file>: <field>: <problem>, got <value>``.
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
    if not isinstance(document, dict):
        raise SettingsError(f"{file}: the file must be a JSON object, got {_kind(document)}")
    if override:
        document = {**document, **override}
        file = Path(f"{file} (with the load's config)")
    for key in _SET_BY_LOADER:
        if key in document:
            raise SettingsError(f"{file}: {_unknown_field((key,))}")
    try:
        return ModelSettings(**{"name": path.name, **document, "path": path, "revision": revision})
    except ValidationError as exc:
        raise SettingsError(f"{file}: {_describe(_first_problem(exc))}") from None


def folder_revision(path: Path) -> str:
    """A fingerprint of a model folder's files (names, sizes, modification times), to tell a
    changed model from an unchanged one without reading its files. ``__pycache__`` folders,
    which importing the model writes, do not count."""
    digest = hashlib.blake2b(digest_size=12)
    for root, folders, files in os.walk(path):
        folders[:] = sorted(f for f in folders if f != "__pycache__")
        for name in sorted(files):
            try:
                stat = os.stat(os.path.join(root, name))
            except OSError:
                continue  # removed while walking: the next look sees the change
            digest.update(
                f"{os.path.relpath(os.path.join(root, name), path)}\0{stat.st_size}\0"
                f"{stat.st_mtime_ns}\0".encode("utf-8", "surrogateescape")
            )
    return digest.hexdigest()


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
    found = scan_repository(root)
    for entry in found.values():
        if entry.error is not None:
            raise SettingsError(entry.error)
    if not found:
        raise SettingsError(f"{root}: model repository holds no model (no */{SETTINGS_FILE})")
    return [entry.settings for entry in found.values() if entry.settings is not None]


@dataclasses.dataclass(frozen=True)
class RepositoryEntry:
    """One model folder of a repository, as :func:`scan_repository` found it."""

    name: str
    """The model's name (its folder's, when its settings could not be read)."""
    folder: Path
    settings: ModelSettings | None
    """Its settings; None when they could not be read."""
    error: str | None = None
    """Why they could not be read: the file's problem, a name declared twice, a folder that
    leads out of the repository."""


def scan_repository(root: Path) -> dict[str, RepositoryEntry]:
    """Every model folder of a repository (each subfolder with a settings file), by model name,
    sorted; a folder whose settings cannot be read is an entry with its error.

    Raises:
        SettingsError: ``root`` is not a folder.
    """
    if not root.is_dir():
        raise SettingsError(f"{root}: model repository is not a folder")
    found: dict[str, RepositoryEntry] = {}
    inside = root.resolve()
    for folder in sorted(p for p in root.iterdir() if (p / SETTINGS_FILE).is_file()):
        if not folder.resolve().is_relative_to(inside):
            found[folder.name] = RepositoryEntry(
                folder.name, folder, None, f"{folder}: the folder leads out of the repository"
            )
            continue
        try:
            settings = load_model_settings(folder, revision=folder_revision(folder))
        except SettingsError as exc:
            found[folder.name] = RepositoryEntry(folder.name, folder, None, str(exc))
            continue
        previous = found.get(settings.name)
        if previous is not None:
            error = (
                f"model name {settings.name!r} is declared twice: by "
                f"{previous.folder / SETTINGS_FILE} and by {folder / SETTINGS_FILE}"
            )
            found[settings.name] = RepositoryEntry(settings.name, folder, None, error)
            continue
        found[settings.name] = RepositoryEntry(settings.name, folder, settings)
    return {name: found[name] for name in sorted(found)}


# --- error messages ------------------------------------------------------------------------------
# Every message reads "<file>: <field>: <problem>, got <value>", the field as a path into the
# file ("inputs[0].shape[1]"); an unknown field's, "<file>: unknown field '<field>' (known: ...)".


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


#: ModelSettings fields that the loader sets and the file may not.
_SET_BY_LOADER = frozenset({"path", "revision"})

#: The class of the object a field name opens, to list the fields known there.
_NESTED: dict[str, type] = {
    "inputs": TensorSpec,
    "outputs": TensorSpec,
    "parameters": ModelParameters,
}

# The file is JSON: its containers are named as JSON names them, not as Python does.
_JSON_WORDS = {
    "tuple_type": "Input should be a list",
    "dict_type": "Input should be an object",
    "dataclass_type": "Input should be an object",
}

# Pydantic's names for a field the class does not have (from keywords, from a dict).
_UNKNOWN_FIELD = frozenset({"unexpected_keyword_argument", "extra_forbidden"})

# Errors whose input is not the offending value (a missing field's input is the object that
# lacks it; a repeated name's is the whole list, and the message names the name).
_NO_GIVEN_VALUE = frozenset(
    {"missing", "duplicate_tensor_name", "decoupled_batching", "implementation_missing"}
)


def _first_problem(exc: ValidationError) -> ErrorDetails:
    # One problem per message, one line that says what to fix. An unknown field comes first: a
    # misspelt field is also reported missing, and the misspelling is the cause.
    errors = exc.errors()
    return next((e for e in errors if e["type"] in _UNKNOWN_FIELD), errors[0])


def _describe(error: ErrorDetails) -> str:
    loc = error["loc"]
    if error["type"] in _UNKNOWN_FIELD:
        return _unknown_field(loc)
    problem = _JSON_WORDS.get(error["type"], error["msg"])
    if error["type"] in _NO_GIVEN_VALUE:
        # A rule across fields (loc empty) names its fields itself.
        return f"{_where(loc)}: {problem}" if loc else problem
    return f"{_where(loc)}: {problem}, got {_kind(error['input'])}"


def _unknown_field(loc: tuple[int | str, ...]) -> str:
    holder: type = ModelSettings
    for part in loc[:-1]:
        if isinstance(part, str):
            holder = _NESTED[part]
    known = sorted(f.name for f in dataclasses.fields(holder) if f.name not in _SET_BY_LOADER)
    return f"unknown field {_where(loc)!r} (known: {', '.join(known)})"


def _where(loc: tuple[int | str, ...]) -> str:
    parts: list[str] = []
    for part in loc:
        if isinstance(part, int):
            parts.append(f"[{part}]")
        else:
            parts.append(f".{part}" if parts else part)
    return "".join(parts) or "the file"


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
