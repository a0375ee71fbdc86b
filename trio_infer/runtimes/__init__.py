"""Built-in runtimes: models served from a file, with no code of the user's.

Each is a :class:`trio_infer.model.Model` subclass that a ``model-settings.json`` names like any
other (``"implementation": "trio_infer.runtimes.sklearn.SKLearnModel"``), or by the names other
servers give it (``mlserver_sklearn.SKLearnModel``; ``"platform": "onnxruntime_onnx"``: see
:mod:`trio_infer.repository.runtime_names`):

- ``sklearn.SKLearnModel``: scikit-learn estimators from joblib / pickle or skops files;
- ``xgboost.XGBoostModel``: XGBoost boosters from JSON, UBJ (or the legacy binary) files;
- ``onnx.OnnxModel``: ONNX models run by onnxruntime.

Each library is an optional extra (``pip install 'trio-infer[sklearn]'``, ``[xgboost]``,
``[onnx]``) and is imported in ``load()``, so only the worker processes that load such a model
import it: the server process never does, nor a worker that serves other models.

May import: the model API, the repository's settings, ``trio_infer.datatypes`` and
``trio_infer.errors``. This is worker-side code: it never imports trio, the workers' pool or
any server layer.
"""
