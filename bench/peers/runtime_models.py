"""The built-in runtimes' benchmark models, made at bench time (no downloads, nothing committed):
a scikit-learn random forest saved with joblib, and the same converted to ONNX.

``python -m bench.peers.runtime_models TRIO_REPO MLSERVER_REPO`` writes:

- ``TRIO_REPO/sklearn_forest``: trio-infer's scikit-learn runtime, ``predict_proba``;
- ``TRIO_REPO/onnx_forest``: trio-infer's ONNX runtime (``"platform": "onnxruntime_onnx"``),
  written only where skl2onnx is installed;
- ``MLSERVER_REPO/sklearn_forest``: MLServer's own runtime (``mlserver_sklearn.SKLearnModel``)
  on the same joblib file, ``predict_proba`` too.

Every model takes ``x`` (FP64 for scikit-learn, FP32 for ONNX) of shape ``[-1, FEATURES]`` and
batches up to 64 rows, so N=1 and N=64 requests are comparable across the servers. A joblib
file is read by the scikit-learn release that wrote it: run this with the Python of the venv
whose scikit-learn both servers share.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import joblib
import numpy as np
from sklearn.datasets import make_classification
from sklearn.ensemble import RandomForestClassifier

#: The feature matrix's columns.
FEATURES = 16
#: The most rows one model call takes (requests of N=64 rows run alone; N=1 ones batch).
MAX_BATCH = 64


def _settings(folder: Path, settings: dict[str, Any]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model-settings.json").write_text(json.dumps(settings, indent=2) + "\n")


def write_models(trio_repository: Path, mlserver_repository: Path) -> None:
    """Train the forest (fixed seeds) and write the three models' folders."""
    x, y = make_classification(n_samples=2000, n_features=FEATURES, n_informative=8, random_state=0)
    forest = RandomForestClassifier(n_estimators=20, max_depth=8, random_state=0).fit(x, y)
    sklearn_input = [{"name": "x", "datatype": "FP64", "shape": [-1, FEATURES]}]
    for repository, implementation in (
        (trio_repository, "trio_infer.runtimes.sklearn.SKLearnModel"),
        (mlserver_repository, "mlserver_sklearn.SKLearnModel"),
    ):
        folder = repository / "sklearn_forest"
        _settings(
            folder,
            {
                "name": "sklearn_forest",
                "implementation": implementation,
                "parameters": {"uri": "./model.joblib", "extra": {"predict_fn": "predict_proba"}},
                "max_batch_size": MAX_BATCH,
                "inputs": sklearn_input,
            },
        )
        joblib.dump(forest, folder / "model.joblib")
    try:
        from skl2onnx import to_onnx
    except ImportError:
        return  # no ONNX scenario where the converter is not installed
    converted = to_onnx(forest, x[:1].astype(np.float32), options={"zipmap": False})
    folder = trio_repository / "onnx_forest"
    _settings(
        folder,
        {
            "name": "onnx_forest",
            "platform": "onnxruntime_onnx",
            "parameters": {"uri": "./model.onnx"},
            "max_batch_size": MAX_BATCH,
            "inputs": [{"name": "X", "datatype": "FP32", "shape": [-1, FEATURES]}],
        },
    )
    (folder / "model.onnx").write_bytes(converted.SerializeToString())


if __name__ == "__main__":
    write_models(Path(sys.argv[1]), Path(sys.argv[2]))
