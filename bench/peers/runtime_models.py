"""The built-in runtimes' benchmark models, made at bench time (no downloads, nothing committed):
a scikit-learn random forest saved with joblib, and the same converted to ONNX.

``python -m bench.peers.runtime_models TRIO_REPO MLSERVER_REPO`` writes (and ``python -m bench``
with a ``runtime`` scenario writes into its temporary copies of the servers' repositories):

- ``TRIO_REPO/sklearn_forest``: trio-infer's scikit-learn runtime, ``predict_proba``;
- ``TRIO_REPO/onnx_forest``: trio-infer's ONNX runtime (``"platform": "onnxruntime_onnx"``),
  written only where skl2onnx is installed;
- ``MLSERVER_REPO/sklearn_forest``: MLServer's own runtime (``mlserver_sklearn.SKLearnModel``)
  on the same joblib file, ``predict_proba`` too.

Every model takes one input (``x`` FP64 for scikit-learn, ``X`` FP32 for ONNX, the name
skl2onnx gives it) of shape ``[-1, FEATURES]``, and each server batches as it batches best:
trio-infer's ``max_batch_size`` counts rows (1,024: sixteen requests of 64 rows, or every
request of one row queued, join one model call, with no wait); MLServer's counts requests (64)
and its adaptive batching needs a ``max_batch_time`` over 0, the time it waits for more
(2 ms). One call of the forest takes 1.4-2 ms whether it gets one row or 64, so batching is
what these rows measure.

A joblib file is read by the scikit-learn release that wrote it: run this with the Python of the
venv whose scikit-learn both servers share (``python -m bench`` pins MLServer's venv to its own
release). :func:`predict` gives the models' answers computed in this process, for the check of
a server's first answer.
"""

from __future__ import annotations

import functools
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import joblib
import numpy as np
from sklearn.datasets import make_classification
from sklearn.ensemble import RandomForestClassifier

#: The feature matrix's columns.
FEATURES = 16
#: trio-infer: the most rows one model call takes.
TRIO_BATCH_ROWS = 1024
#: MLServer: the most requests one model call takes, and how long it waits to fill it (s).
MLSERVER_BATCH_REQUESTS = 64
MLSERVER_BATCH_TIME = 0.002


@dataclass(frozen=True)
class RuntimeModel:
    """One benchmark model: its input's name and type, and the output the check compares."""

    name: str
    input_name: str
    dtype: type[np.floating[Any]]
    output: str


SKLEARN = RuntimeModel("sklearn_forest", "x", np.float64, "predict_proba")
#: skl2onnx names the input ``X`` and, with ``zipmap`` off, the probabilities' tensor so.
ONNX = RuntimeModel("onnx_forest", "X", np.float32, "probabilities")
MODELS = {model.name: model for model in (SKLEARN, ONNX)}


@functools.cache
def _training() -> tuple[RandomForestClassifier, np.ndarray]:
    """The forest (fixed seeds), trained once per process, and its training features."""
    x, y = make_classification(n_samples=2000, n_features=FEATURES, n_informative=8, random_state=0)
    return RandomForestClassifier(n_estimators=20, max_depth=8, random_state=0).fit(x, y), x


@functools.cache
def _onnx_bytes() -> bytes | None:
    """The forest converted to ONNX; None without skl2onnx."""
    try:
        from skl2onnx import to_onnx
    except ImportError:
        return None
    forest, x = _training()
    converted = to_onnx(forest, x[:1].astype(np.float32), options={"zipmap": False})
    return bytes(converted.SerializeToString())


def _settings(folder: Path, settings: dict[str, Any]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model-settings.json").write_text(json.dumps(settings, indent=2) + "\n")


def _write_sklearn(repository: Path, implementation: str, batching: dict[str, Any]) -> None:
    folder = repository / SKLEARN.name
    _settings(
        folder,
        {
            "name": SKLEARN.name,
            "implementation": implementation,
            "parameters": {"uri": "./model.joblib", "extra": {"predict_fn": SKLEARN.output}},
            **batching,
            "inputs": [{"name": SKLEARN.input_name, "datatype": "FP64", "shape": [-1, FEATURES]}],
        },
    )
    joblib.dump(_training()[0], folder / "model.joblib")


def write_models(trio_repository: Path | None, mlserver_repository: Path | None) -> None:
    """Write the models' folders into the repositories given (None: not that server's)."""
    if mlserver_repository is not None:
        _write_sklearn(
            mlserver_repository,
            "mlserver_sklearn.SKLearnModel",
            {"max_batch_size": MLSERVER_BATCH_REQUESTS, "max_batch_time": MLSERVER_BATCH_TIME},
        )
    if trio_repository is None:
        return
    _write_sklearn(
        trio_repository,
        "trio_infer.runtimes.sklearn.SKLearnModel",
        {"max_batch_size": TRIO_BATCH_ROWS},
    )
    converted = _onnx_bytes()
    if converted is None:
        return  # no ONNX model where the converter is not installed
    folder = trio_repository / ONNX.name
    _settings(
        folder,
        {
            "name": ONNX.name,
            "platform": "onnxruntime_onnx",
            "parameters": {"uri": "./model.onnx"},
            "max_batch_size": TRIO_BATCH_ROWS,
            "inputs": [{"name": ONNX.input_name, "datatype": "FP32", "shape": [-1, FEATURES]}],
        },
    )
    (folder / "model.onnx").write_bytes(converted)


def features(model: RuntimeModel, rows: int) -> np.ndarray:
    """A request's input for ``model``: ``rows`` x FEATURES of its datatype, seed 3."""
    return np.random.default_rng(3).standard_normal((rows, FEATURES)).astype(model.dtype)


def predict(model: RuntimeModel, x: np.ndarray) -> np.ndarray:
    """``model``'s output for ``x`` computed in this process: the forest's ``predict_proba``,
    or onnxruntime running the converted forest (what the servers' workers run)."""
    if model is SKLEARN:
        return np.asarray(_training()[0].predict_proba(x))
    import onnxruntime  # only the ONNX rows' check needs it

    converted = _onnx_bytes()
    assert converted is not None, "no ONNX model without skl2onnx"
    session = onnxruntime.InferenceSession(converted, providers=["CPUExecutionProvider"])
    return np.asarray(session.run([model.output], {model.input_name: x})[0])


if __name__ == "__main__":
    write_models(Path(sys.argv[1]), Path(sys.argv[2]))
