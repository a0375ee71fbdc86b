"""The XGBoost runtime: a booster from a JSON, UBJ (or legacy binary) model file.

Settings (``model-settings.json``)::

    {"implementation": "trio_infer.runtimes.xgboost.XGBoostModel",
     "parameters": {"uri": "./model.json", "extra": {"predict_fn": "predict_proba"}}}

``"implementation": "mlserver_xgboost.XGBoostModel"`` names this class too, so an MLServer
repository is served unchanged.

- The file: ``parameters.uri`` (relative to the model's folder), or a folder holding
  ``model.bst``, ``model.json`` or ``model.ubj`` (MLServer's names, in its order); without a uri,
  the model's folder is searched for them. Whatever saved it (``Booster.save_model``,
  ``XGBClassifier.save_model``...), the file is read as a ``Booster``: no scikit-learn needed.
- ``parameters.extra.predict_fn``: ``predict`` (default) or ``predict_proba``. The output tensor
  is named after it, as MLServer names it. Results equal those of the scikit-learn interface
  MLServer serves the file with: for a classifier saved by ``XGBClassifier`` (the file records
  it), ``predict`` gives class labels and ``predict_proba`` a probability per class; for any
  other file, ``predict`` gives what the booster predicts (``XGBRegressor.predict``: values, or
  probabilities for a booster trained with a logistic objective), and ``predict_proba`` is
  refused, as MLServer refuses it. A model trained with early stopping predicts with its best
  iteration, as those classes do.
- ``parameters.extra.nthread``: XGBoost's threads in this worker, 1 by default: workers share
  the machine's cores, and each worker running a pool sized to all of them oversubscribes it.
- Input: the request's one tensor, whatever its name, is the feature matrix (one row per
  sample), as in MLServer. Rows are independent, so the model batches (``max_batch_size``).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from trio_infer.errors import ModelFailed
from trio_infer.runtimes._common import (
    ExtraSettings,
    FeatureMatrixModel,
    missing_library,
    unreadable,
)

__all__ = ["PREDICT_FUNCTIONS", "WELLKNOWN_FILES", "XGBoostModel"]

#: The methods ``parameters.extra.predict_fn`` may name.
PREDICT_FUNCTIONS = ("predict", "predict_proba")

#: The files looked for in the folder ``parameters.uri`` names (MLServer's, in its order).
WELLKNOWN_FILES = ("model.bst", "model.json", "model.ubj")

_RUNTIME = "XGBoost"


class XGBoostModel(FeatureMatrixModel):
    """Serves an XGBoost booster; see the module's docstring for its settings."""

    RUNTIME = _RUNTIME
    PREDICT_FUNCTIONS = PREDICT_FUNCTIONS
    WELLKNOWN_FILES = WELLKNOWN_FILES
    EXTRA_SETTINGS = ("nthread",)

    def _load(self, extra: ExtraSettings) -> tuple[int | None, str]:
        """Read the booster, what kind of estimator saved it, and its features a row.

        Raises:
            ModelFailed: XGBoost is not installed, the file is missing or unreadable, or
                ``predict_proba`` is asked of a model that is not a classifier.
        """
        threads = extra.count("nthread", 1)
        try:
            import xgboost
        except ImportError as exc:
            raise missing_library(_RUNTIME, "xgboost", "xgboost", exc) from None
        path = self._model_file()
        try:
            booster = xgboost.Booster(model_file=path)
            config = json.loads(booster.save_config())
        except Exception as exc:
            raise unreadable(path, "an XGBoost model", exc) from None
        booster.set_param({"nthread": threads})
        learner = config["learner"]
        self._booster: Any = booster
        self._objective: str = learner["objective"]["name"]
        # XGBoost counts a binary classifier as 0 classes; the scikit-learn interface as 2.
        self._classes = max(int(learner["learner_model_param"]["num_class"]), 2)
        # What the scikit-learn interface predicts with (XGBModel._get_iteration_range): the
        # best iteration of early stopping when the file records one, else every tree.
        best = booster.attr("best_iteration")
        self._iterations = (0, 0) if best is None else (0, int(best) + 1)
        # The estimator class that saved the file, if one did (XGBModel.save_model).
        saved_by = json.loads(booster.attr("scikit_learn") or "{}").get("_estimator_type")
        self._classifier = saved_by == "classifier"
        if self.method == "predict_proba" and not self._classifier:
            kind = "a regressor" if saved_by else "a booster with no estimator type"
            raise ModelFailed(
                f"predict_proba needs a classifier saved by XGBClassifier.save_model; {path} "
                f"holds {kind} (parameters.extra.predict_fn: use predict)"
            )
        return booster.num_features(), f"the booster from {path}"

    def _predict_rows(self, features: np.ndarray) -> np.ndarray:
        if self.method == "predict_proba":
            return self._probabilities(features)
        if self._classifier:
            return self._labels(features)
        return self._values(features, "value")

    def _values(self, features: np.ndarray, kind: str) -> np.ndarray:
        result: np.ndarray = self._booster.inplace_predict(
            features, iteration_range=self._iterations, predict_type=kind, missing=np.nan
        )
        return result

    # The two below follow XGBClassifier.predict and predict_proba, branch for branch, so that a
    # classifier's results are what MLServer serves, bit for bit.

    def _labels(self, features: np.ndarray) -> np.ndarray:
        probabilities = self._values(features, "value")
        if probabilities.ndim > 1 and self._classes != 2:
            return np.asarray(np.argmax(probabilities, axis=1))
        if probabilities.ndim > 1 and probabilities.shape[1] != 1:  # multi-label
            labels = np.zeros(probabilities.shape)
            labels[probabilities > 0.5] = 1
            return labels
        if self._objective == "multi:softmax":  # the booster predicts the label
            return probabilities.astype(np.int32)
        return (probabilities > 0.5).astype(np.int64)

    def _probabilities(self, features: np.ndarray) -> np.ndarray:
        if self._objective == "multi:softmax":  # the booster predicts labels: from the margins
            margins = self._values(features, "margin")
            exponentials = np.exp(margins - np.amax(margins, axis=1, keepdims=True))
            result: np.ndarray = exponentials / np.sum(exponentials, axis=1, keepdims=True)
            return result
        probabilities = self._values(features, "value")
        if probabilities.ndim == 2 and (
            probabilities.shape[1] == self._classes
            or (self._classes == 2 and probabilities.shape[1] >= 2)
        ):
            return probabilities  # multi-class, or multi-label
        return np.vstack((1.0 - probabilities, probabilities)).transpose()
