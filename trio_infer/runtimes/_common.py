"""What the built-in runtimes share: finding the model file, reading ``parameters.extra``, the
errors a load fails with, and the one-tensor feature matrix (with :class:`FeatureMatrixModel`,
the shape of the scikit-learn and XGBoost runtimes).

Every error here is an ``InferError``, so the worker passes its message to the server as it is
(no exception type in front): it is what a client reads after ``model '<name>' is not ready:``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from trio_infer.errors import InvalidInput, ModelFailed
from trio_infer.model import Model, Parameters
from trio_infer.repository.settings import ModelSettings, TensorSpec

__all__ = [
    "ExtraSettings",
    "FeatureMatrixModel",
    "check_feature_count",
    "feature_matrix",
    "missing_library",
    "model_file",
    "unreadable",
]


def missing_library(runtime: str, library: str, extra: str, exc: ImportError) -> ModelFailed:
    """The error of a runtime whose library is not installed: it names the extra to install.

    Args:
        runtime: The runtime's name, as the message says it ("the ONNX runtime").
        library: The package the runtime needs ("onnxruntime").
        extra: trio-infer's extra that installs it ("onnx").
        exc: What importing it raised (a dependency of the library may be what is missing).
    """
    return ModelFailed(
        f"the {runtime} runtime needs {library}, which cannot be imported ({exc}): "
        f"pip install 'trio-infer[{extra}]'"
    )


def unreadable(path: Path, kind: str, exc: BaseException) -> ModelFailed:
    """The error of a model file the library could not read (corrupt, truncated, another
    format, a newer version of the library's)."""
    return ModelFailed(f"cannot read {path} as {kind}: {type(exc).__name__}: {exc}")


def model_file(settings: ModelSettings, wellknown: Sequence[str], runtime: str) -> Path:
    """The file a runtime loads, found as MLServer finds it.

    ``parameters.uri`` (relative to the model's folder) names a file, or a folder holding one
    of the ``wellknown`` names (the first found wins). Without a uri, the model's folder is
    searched for them, where MLServer would refuse the settings.

    Raises:
        ModelFailed: The uri names nothing, or no well-known file is where it was looked for;
            the message names the path and the names looked for.
    """
    uri = settings.model_uri
    folder = settings.path if uri is None else uri
    if folder is None:
        raise ModelFailed(
            f"the {runtime} runtime needs a model file: set parameters.uri in the model's settings"
        )
    if uri is not None and not uri.exists():
        raise ModelFailed(f"model file {uri} (parameters.uri) does not exist")
    if uri is not None and not uri.is_dir():
        return uri
    for name in wellknown:
        if (folder / name).is_file():
            return folder / name
    where = "parameters.uri" if uri is not None else "the model's folder, as no parameters.uri"
    raise ModelFailed(
        f"no model file in {folder} ({where}): the {runtime} runtime looks for "
        f"{', '.join(wellknown)}"
    )


class ExtraSettings:
    """A runtime's settings in ``parameters.extra``, each key checked once at load.

    A key the runtime does not know is refused rather than ignored: a misspelt ``predict_fn``
    would otherwise serve another method's results without a word.

    Args:
        settings: The model's settings.
        runtime: The runtime's name, for messages.
        known: The keys the runtime reads.

    Raises:
        ModelFailed: ``parameters.extra`` has a key not in ``known``.
    """

    def __init__(self, settings: ModelSettings, runtime: str, known: Sequence[str]) -> None:
        self._extra: Mapping[str, Any] = settings.parameters.extra
        for key in self._extra:
            if key not in known:
                raise ModelFailed(
                    f"parameters.extra.{key} is not a setting of the {runtime} runtime "
                    f"(known: {', '.join(known)})"
                )

    def choice(self, key: str, allowed: Sequence[str], default: str) -> str:
        """A string setting that must be one of ``allowed``.

        Raises:
            ModelFailed: It is set to anything else; the message lists ``allowed``.
        """
        value = self._extra.get(key, default)
        if value not in allowed:
            raise ModelFailed(
                f"parameters.extra.{key} is {value!r}; it must be one of {', '.join(allowed)}"
            )
        assert isinstance(value, str)
        return value

    def count(self, key: str, default: int) -> int:
        """A whole number of at least 1 (a thread count).

        Raises:
            ModelFailed: It is set to anything else.
        """
        value = self._extra.get(key, default)
        # bool is an int subclass, but true is not a thread count.
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ModelFailed(
                f"parameters.extra.{key} must be a whole number, at least 1, got {value!r}"
            )
        return value

    def names(self, key: str) -> list[str]:
        """A list of strings (empty when not set).

        Raises:
            ModelFailed: It is set to anything else.
        """
        value = self._extra.get(key, [])
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ModelFailed(f"parameters.extra.{key} must be a list of strings, got {value!r}")
        return value


def feature_matrix(inputs: Mapping[str, np.ndarray]) -> np.ndarray:
    """The request's one input tensor, whatever its name: the feature matrix of a scikit-learn
    or XGBoost model, one row per sample (MLServer's runtimes take it so too).

    Raises:
        InvalidInput: The request has more or fewer than one input tensor.
    """
    if len(inputs) != 1:
        names = ", ".join(repr(name) for name in inputs) or "none"
        raise InvalidInput(
            f"the model takes one input tensor, the feature matrix (one row per sample), "
            f"got {len(inputs)}: {names}"
        )
    (matrix,) = inputs.values()
    return matrix


def check_feature_count(inputs: Sequence[TensorSpec], features: int | None, source: str) -> None:
    """Refuse a model whose declared input (``inputs`` of its settings) is a matrix of rows of
    a fixed length other than the ``features`` its file reads (None: the file does not say):
    every request the server lets through would fail in the model, which would seem ready.

    Args:
        inputs: The declared inputs.
        features: The features a row the model reads, as its file records them.
        source: What the model is, for the message (its class and file).

    Raises:
        ModelFailed: The one declared input has two dimensions, the last fixed and not
            ``features``.
    """
    if features is None or len(inputs) != 1:
        return
    (declared,) = inputs
    if len(declared.shape) == 2 and declared.shape[1] >= 0 and declared.shape[1] != features:
        raise ModelFailed(
            f"declared input '{declared.name}' is {declared.datatype} {list(declared.shape)}, "
            f"rows of {declared.shape[1]} features; {source} reads rows of {features}"
        )


class FeatureMatrixModel(Model):
    """A runtime that reads one model file and predicts the rows of a feature matrix with the
    method ``parameters.extra.predict_fn`` names, its one output tensor named after it (as
    MLServer's scikit-learn and XGBoost runtimes do).

    A subclass names its runtime and what it accepts (the class attributes), reads its own
    settings and the file in :meth:`_load`, and predicts in :meth:`_predict_rows`.
    """

    #: The runtime's name, for messages.
    RUNTIME: ClassVar[str]
    #: The methods ``parameters.extra.predict_fn`` may name; the first is the default.
    PREDICT_FUNCTIONS: ClassVar[Sequence[str]]
    #: The file names looked for in the model's folder, or the folder ``parameters.uri`` names.
    WELLKNOWN_FILES: ClassVar[Sequence[str]]
    #: The keys of ``parameters.extra`` the runtime reads besides ``predict_fn``.
    EXTRA_SETTINGS: ClassVar[Sequence[str]] = ()

    def load(self) -> None:
        """Check ``parameters.extra``, read the model file (:meth:`_load`), then check the
        declared input against the features the file reads (:func:`check_feature_count`).

        Raises:
            ModelFailed: ``parameters.extra`` has an unknown key or an unknown ``predict_fn``,
                :meth:`_load` failed, or the declared input's rows are not the model's; the
                message says which.
        """
        extra = ExtraSettings(self.settings, self.RUNTIME, ("predict_fn", *self.EXTRA_SETTINGS))
        self.method = extra.choice("predict_fn", self.PREDICT_FUNCTIONS, self.PREDICT_FUNCTIONS[0])
        """The method ``parameters.extra.predict_fn`` names, and the output tensor's name."""
        features, source = self._load(extra)
        check_feature_count(self.settings.inputs, features, source)

    def _load(self, extra: ExtraSettings) -> tuple[int | None, str]:
        """Read the runtime's other settings, import its library, then read the model file
        (:meth:`_model_file`).

        Returns:
            The features a row the model reads (None when its file does not say), and what
            the model is for messages (its class and file).

        Raises:
            ModelFailed: The library is missing, the file is missing or unreadable, or it
                cannot serve :attr:`method`.
        """
        raise NotImplementedError

    def _model_file(self) -> Path:
        """The file to read (:func:`model_file`)."""
        return model_file(self.settings, self.WELLKNOWN_FILES, self.RUNTIME)

    def _predict_rows(self, features: np.ndarray) -> np.ndarray:
        """What :attr:`method` gives for the rows of ``features``."""
        raise NotImplementedError

    def predict(
        self, inputs: dict[str, np.ndarray], parameters: Parameters
    ) -> dict[str, np.ndarray]:
        """Predict the feature matrix's rows with :attr:`method`.

        Raises:
            trio_infer.errors.InvalidInput: The request has more than one input tensor.
        """
        return {self.method: self._predict_rows(feature_matrix(inputs))}
