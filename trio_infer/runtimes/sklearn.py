"""The scikit-learn runtime: an estimator (or pipeline) from a joblib / pickle or a skops file.

Settings (``model-settings.json``)::

    {"implementation": "trio_infer.runtimes.sklearn.SKLearnModel",
     "parameters": {"uri": "./model.joblib", "extra": {"predict_fn": "predict_proba"}}}

``"implementation": "mlserver_sklearn.SKLearnModel"`` names this class too, so an MLServer
repository is served unchanged.

- The file: ``parameters.uri`` (relative to the model's folder), or a folder holding
  ``model.joblib``, ``model.pickle``, ``model.pkl`` (MLServer's names) or ``model.skops``; without
  a uri, the model's folder is searched for them. ``.skops`` files are read with skops, the
  others with joblib (which reads plain pickles too).
- Loading a joblib or pickle file runs whatever code the file names: serve only files you trust.
  A skops file is read without running code. skops trusts its own list of types (scikit-learn's
  estimators, numpy and scipy containers); any other type in the file fails the load, naming the
  type, until the settings list it in ``parameters.extra.skops_trusted_types``. That list is a
  decision someone made after reviewing the types (skops warns that a crafted tree, for one,
  can crash the process), kept with the model; trusting whatever the file declares would undo
  what skops is for.
- ``parameters.extra.predict_fn``: the method called, ``predict`` (default), ``predict_proba``,
  ``predict_log_proba``, ``decision_function`` or ``transform``: MLServer's setting. The one
  output tensor is named after it (``"predict"``, ``"predict_proba"``...), as MLServer names it,
  with the datatype of the result (``INT64`` labels, ``FP64`` probabilities, ``BYTES`` for
  string labels).
- Input: the request's one tensor, whatever its name, is the feature matrix (one row per
  sample), as in MLServer. Rows are independent, so the model batches (``max_batch_size``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from trio_infer.errors import ModelFailed
from trio_infer.runtimes._common import (
    ExtraSettings,
    FeatureMatrixModel,
    missing_library,
    unreadable,
)

__all__ = ["PREDICT_FUNCTIONS", "WELLKNOWN_FILES", "SKLearnModel"]

#: The methods ``parameters.extra.predict_fn`` may name.
PREDICT_FUNCTIONS = (
    "predict",
    "predict_proba",
    "predict_log_proba",
    "decision_function",
    "transform",
)

#: The files looked for in the folder ``parameters.uri`` names (MLServer's, then skops').
WELLKNOWN_FILES = ("model.joblib", "model.pickle", "model.pkl", "model.skops")

_RUNTIME = "scikit-learn"


class SKLearnModel(FeatureMatrixModel):
    """Serves a scikit-learn estimator; see the module's docstring for its settings."""

    RUNTIME = _RUNTIME
    PREDICT_FUNCTIONS = PREDICT_FUNCTIONS
    WELLKNOWN_FILES = WELLKNOWN_FILES
    EXTRA_SETTINGS = ("skops_trusted_types",)

    def _load(self, extra: ExtraSettings) -> tuple[int | None, str]:
        """Read the estimator and pick its method; its features a row are its
        ``n_features_in_`` (scikit-learn's, set by ``fit``), when it has one.

        Raises:
            ModelFailed: scikit-learn (or skops) is not installed, the file is missing or
                unreadable, holds types skops does not trust, or the estimator has no
                ``predict_fn`` method; the message says which.
        """
        trusted = extra.names("skops_trusted_types")
        try:
            # Imported before the file is read: unpickling an estimator imports scikit-learn,
            # and its absence must not read as a corrupt file.
            import sklearn  # noqa: F401
        except ImportError as exc:
            raise missing_library(_RUNTIME, "scikit-learn", "sklearn", exc) from None
        path = self._model_file()
        if path.suffix == ".skops":
            estimator = _load_skops(path, trusted)
        elif trusted:
            raise ModelFailed(
                f"parameters.extra.skops_trusted_types is for skops files; {path} is not one "
                "(a joblib or pickle file trusts everything it names)"
            )
        else:
            estimator = _load_joblib(path)
        # A pipeline hides the methods its last step lacks (AttributeError): getattr's default.
        function = getattr(estimator, self.method, None)
        if not callable(function):
            has = [name for name in PREDICT_FUNCTIONS if callable(getattr(estimator, name, None))]
            raise ModelFailed(
                f"{type(estimator).__name__} from {path} has no {self.method}() "
                f"(parameters.extra.predict_fn); it has: {', '.join(has) or 'none of them'}"
            )
        self._function: Callable[[np.ndarray], Any] = function
        # A pipeline whose first step takes text has none; a custom estimator may have any.
        features = getattr(estimator, "n_features_in_", None)
        count = features if isinstance(features, int) and not isinstance(features, bool) else None
        return count, f"{type(estimator).__name__} from {path}"

    def _predict_rows(self, features: np.ndarray) -> np.ndarray:
        result = self._function(features)
        # transform() of some estimators gives a scipy sparse matrix; the protocol is dense.
        if hasattr(result, "toarray"):
            result = result.toarray()
        return np.asarray(result)


def _load_joblib(path: Path) -> Any:
    import joblib  # a dependency of scikit-learn, imported just above

    try:
        return joblib.load(path)
    except Exception as exc:
        raise unreadable(path, "a joblib or pickle file", exc) from None


def _load_skops(path: Path, trusted: list[str]) -> Any:
    try:
        import skops.io
    except ImportError as exc:
        raise missing_library(f"{_RUNTIME} (.skops files)", "skops", "sklearn", exc) from None
    try:
        untrusted = [
            name for name in skops.io.get_untrusted_types(file=path) if name not in trusted
        ]
    except Exception as exc:
        raise unreadable(path, "a skops file", exc) from None
    if untrusted:
        raise ModelFailed(
            f"{path} holds types skops does not trust by default: {', '.join(untrusted)}; "
            "review them, and list those you trust in parameters.extra.skops_trusted_types"
        )
    try:
        return skops.io.load(path, trusted=trusted)
    except Exception as exc:
        raise unreadable(path, "a skops file", exc) from None
