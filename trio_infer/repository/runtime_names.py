"""Other servers' names for the built-in runtimes: MLServer's runtime classes, Triton's and
KServe's model platform names.

Pure tables: the settings loader (:mod:`trio_infer.repository.settings`) maps these names when
it reads a ``model-settings.json``.

Runtimes are mapped by name, always, whether MLServer's packages are installed or not: the
built-in runtimes are what trio-infer serves, and the same model-settings.json must mean the
same model on every machine.
"""

from __future__ import annotations

__all__ = [
    "BUILT_IN_RUNTIMES",
    "IMPLEMENTATION_ALIASES",
    "PLATFORM_RUNTIMES",
    "built_in_implementation",
]

#: The built-in runtimes (:mod:`trio_infer.runtimes`) by format.
BUILT_IN_RUNTIMES = {
    "sklearn": "trio_infer.runtimes.sklearn.SKLearnModel",
    "xgboost": "trio_infer.runtimes.xgboost.XGBoostModel",
    "onnx": "trio_infer.runtimes.onnx.OnnxModel",
}

#: MLServer's runtime classes (as its documentation names them, and by their modules' full
#: paths) and the built-in runtime each is served by.
IMPLEMENTATION_ALIASES = {
    "mlserver_sklearn.SKLearnModel": BUILT_IN_RUNTIMES["sklearn"],
    "mlserver_sklearn.sklearn.SKLearnModel": BUILT_IN_RUNTIMES["sklearn"],
    "mlserver_xgboost.XGBoostModel": BUILT_IN_RUNTIMES["xgboost"],
    "mlserver_xgboost.xgboost.XGBoostModel": BUILT_IN_RUNTIMES["xgboost"],
}

#: ``platform`` values that name a built-in runtime when the settings name no
#: ``implementation``: Triton's platform for ONNX models, and KServe's model format names.
PLATFORM_RUNTIMES = {
    "onnxruntime_onnx": BUILT_IN_RUNTIMES["onnx"],
    "onnx": BUILT_IN_RUNTIMES["onnx"],
    "sklearn": BUILT_IN_RUNTIMES["sklearn"],
    "xgboost": BUILT_IN_RUNTIMES["xgboost"],
}


def built_in_implementation(implementation: str) -> str:
    """The class that serves ``implementation``: the built-in runtime for one of MLServer's,
    else ``implementation`` itself."""
    return IMPLEMENTATION_ALIASES.get(implementation, implementation)
