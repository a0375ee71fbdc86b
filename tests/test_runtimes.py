"""The built-in runtimes (trio_infer.runtimes) served by a real server, real workers and real
clients: models made here by scikit-learn, skops, skl2onnx and XGBoost, from MLServer-style
repositories and from trio-infer's own settings. Predictions equal what the libraries compute
in this process; a model that cannot load tells the client why."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx
import joblib
import numpy as np
import onnxruntime
import pytest
import skops.io
import trio
import xgboost
from skl2onnx import to_onnx
from sklearn.datasets import make_classification
from sklearn.ensemble import RandomForestClassifier
from sklearn.linear_model import LinearRegression

from tests.support import GrpcioClient, start_server
from trio_infer.client import InferenceClient
from trio_infer.datatypes import DATATYPES
from trio_infer.errors import ModelFailed
from trio_infer.protobuf._proto import grpc_predict_v2_pb2 as pb
from trio_infer.repository.settings import ModelSettings, TensorSpec
from trio_infer.runtimes._common import check_feature_count
from trio_infer.server import RunningServer

#: What skops does not trust by default in a forest: its trees' node arrays.
TREE = "sklearn.tree._tree.Tree"


@dataclass
class Made:
    """The test models' files and what the libraries predict for ``features`` in-process."""

    folder: Path
    features: np.ndarray
    expected: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)


def _write(repository: Path, name: str, settings: dict[str, Any]) -> Path:
    folder = repository / name
    folder.mkdir(parents=True)
    (folder / "model-settings.json").write_text(json.dumps(settings))
    return folder


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> Made:
    """Tiny models, trained on a generated data set with fixed seeds (no downloads)."""
    folder = tmp_path_factory.mktemp("made")
    x, y = make_classification(
        n_samples=120, n_features=4, n_informative=3, n_redundant=0, random_state=0
    )
    made = Made(folder, x[:7])
    forest = RandomForestClassifier(n_estimators=5, max_depth=3, random_state=0).fit(x, y)
    joblib.dump(forest, folder / "forest.joblib")
    skops.io.dump(forest, folder / "forest.skops")
    made.expected["forest.predict"] = {"predict": forest.predict(made.features)}
    made.expected["forest.predict_proba"] = {"predict_proba": forest.predict_proba(made.features)}
    # zipmap off: a classifier's probabilities as a tensor, not a sequence of maps.
    onnx_model = to_onnx(forest, x[:1].astype(np.float32), options={"zipmap": False})
    (folder / "forest.onnx").write_bytes(onnx_model.SerializeToString())
    zipmap = to_onnx(forest, x[:1].astype(np.float32))
    (folder / "zipmap.onnx").write_bytes(zipmap.SerializeToString())
    session = onnxruntime.InferenceSession(
        str(folder / "forest.onnx"), providers=["CPUExecutionProvider"]
    )
    labels, probabilities = session.run(None, {"X": made.features.astype(np.float32)})
    made.expected["forest.onnx"] = {"label": labels, "probabilities": probabilities}
    classifier = xgboost.XGBClassifier(n_estimators=4, max_depth=2, random_state=0).fit(x, y)
    classifier.save_model(folder / "classifier.json")
    classifier.save_model(folder / "classifier.ubj")
    made.expected["xgb.predict"] = {"predict": classifier.predict(made.features)}
    made.expected["xgb.predict_proba"] = {"predict_proba": classifier.predict_proba(made.features)}
    booster = xgboost.train(
        {"objective": "reg:squarederror", "max_depth": 2}, xgboost.DMatrix(x, label=x[:, 0]), 3
    )
    booster.save_model(folder / "booster.json")
    made.expected["booster"] = {"predict": booster.predict(xgboost.DMatrix(made.features))}
    joblib.dump(LinearRegression().fit(x, y), folder / "linear.joblib")
    return made


def _served(made: Made, root: Path) -> Path:
    """A repository of every working model: MLServer's settings and trio-infer's own."""
    repository = root / "served"
    f = made.folder
    # MLServer's model-settings.json, as `mlserver start` reads it.
    _write(
        repository,
        "sk_mlserver",
        {
            "name": "sk_mlserver",
            "implementation": "mlserver_sklearn.SKLearnModel",
            "parameters": {"uri": str(f / "forest.joblib"), "version": "v1"},
        },
    )
    _write(
        repository,
        "xgb_mlserver",
        {
            "name": "xgb_mlserver",
            "implementation": "mlserver_xgboost.XGBoostModel",
            "parameters": {"uri": str(f / "classifier.json")},
        },
    )
    # trio-infer's own: a skops file beside the settings (a relative uri), batching.
    skops_folder = _write(
        repository,
        "sk_skops",
        {
            "implementation": "trio_infer.runtimes.sklearn.SKLearnModel",
            "parameters": {
                "uri": "./model.skops",
                "extra": {"predict_fn": "predict_proba", "skops_trusted_types": [TREE]},
            },
            "max_batch_size": 16,
            "max_batch_time": 0.05,
            "inputs": [{"name": "features", "datatype": "FP64", "shape": [-1, 4]}],
        },
    )
    (skops_folder / "model.skops").write_bytes((f / "forest.skops").read_bytes())
    # The uri names a folder: the runtime finds model.ubj in it, as MLServer would.
    ubj_folder = _write(
        repository,
        "xgb_ubj",
        {
            "implementation": "trio_infer.runtimes.xgboost.XGBoostModel",
            "parameters": {"uri": "./weights", "extra": {"predict_fn": "predict_proba"}},
        },
    )
    (ubj_folder / "weights").mkdir()
    (ubj_folder / "weights" / "model.ubj").write_bytes((f / "classifier.ubj").read_bytes())
    # No uri: model.json in the model's folder.
    booster_folder = _write(
        repository,
        "xgb_booster",
        {
            "implementation": "trio_infer.runtimes.xgboost.XGBoostModel",
            "max_batch_size": 8,
            "inputs": [{"name": "x", "datatype": "FP64", "shape": [-1, 4]}],
        },
    )
    (booster_folder / "model.json").write_bytes((f / "booster.json").read_bytes())
    # Triton's platform name, no implementation, nothing declared: read from the model.
    _write(
        repository,
        "onnx_platform",
        {"platform": "onnxruntime_onnx", "parameters": {"uri": str(f / "forest.onnx")}},
    )
    # Declared, batched, one of the two outputs.
    _write(
        repository,
        "onnx_batched",
        {
            "implementation": "trio_infer.runtimes.onnx.OnnxModel",
            "parameters": {"uri": str(f / "forest.onnx"), "extra": {"intra_op_num_threads": 1}},
            "max_batch_size": 16,
            "max_batch_time": 0.05,
            "inputs": [{"name": "X", "datatype": "FP32", "shape": [-1, 4]}],
            "outputs": [{"name": "probabilities", "datatype": "FP32", "shape": [-1, 2]}],
        },
    )
    return repository


#: Each served model: (the expected results' key, the input's datatype).
SERVED = {
    "sk_mlserver": ("forest.predict", "FP64"),
    "sk_skops": ("forest.predict_proba", "FP64"),
    "xgb_mlserver": ("xgb.predict", "FP64"),
    "xgb_ubj": ("xgb.predict_proba", "FP64"),
    "xgb_booster": ("booster", "FP64"),
    "onnx_platform": ("forest.onnx", "FP32"),
    "onnx_batched": ("forest.onnx", "FP32"),
}


@pytest.fixture
async def served(nursery: trio.Nursery, made: Made, tmp_path: Path) -> RunningServer:
    return await start_server(nursery, _served(made, tmp_path))


@pytest.fixture
def grpcio(served: RunningServer) -> Iterator[GrpcioClient]:
    client = GrpcioClient(served.port)
    yield client
    client.channel.close()


def _input_name(model: str) -> str:
    return {"sk_skops": "features", "onnx_platform": "X", "onnx_batched": "X"}.get(model, "x")


def _expected(made: Made, model: str) -> dict[str, np.ndarray]:
    key, _ = SERVED[model]
    expected = made.expected[key]
    if model == "onnx_batched":  # declares one output: only that one is sent
        return {"probabilities": expected["probabilities"]}
    return expected


def _assert_equal(model: str, got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert got.keys() == want.keys(), model
    for name, array in want.items():
        assert got[name].dtype == array.dtype, (model, name)
        # Bit for bit: the same library, the same inputs, in a worker instead of here.
        np.testing.assert_array_equal(got[name], array, err_msg=f"{model} {name}")


async def test_each_runtime_predicts_as_its_library_does_over_grpc_and_rest(
    served: RunningServer, made: Made
) -> None:
    async with (
        InferenceClient.connect("127.0.0.1", served.port) as client,
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{served.http_port}", timeout=30) as rest,
    ):
        for model, (_, datatype) in SERVED.items():
            features = made.features.astype(DATATYPES[datatype])
            want = _expected(made, model)
            result = await client.infer(model, {_input_name(model): features})
            _assert_equal(model, result.outputs, want)
            body = {
                "inputs": [
                    {
                        "name": _input_name(model),
                        "datatype": datatype,
                        "shape": list(features.shape),
                        "data": features.flatten().tolist(),
                    }
                ]
            }
            response = await rest.post(f"/v2/models/{model}/infer", json=body)
            assert response.status_code == 200, response.text
            outputs = {
                output["name"]: np.array(output["data"], DATATYPES[output["datatype"]]).reshape(
                    output["shape"]
                )
                for output in response.json()["outputs"]
            }
            _assert_equal(model, outputs, want)
    # The ONNX model's tensors, read from the model, match sklearn's own to float tolerance.
    forest = joblib.load(made.folder / "forest.joblib")
    np.testing.assert_allclose(
        made.expected["forest.onnx"]["probabilities"],
        forest.predict_proba(made.features.astype(np.float32)),
        atol=1e-5,
    )
    np.testing.assert_array_equal(
        made.expected["forest.onnx"]["label"], made.expected["forest.predict"]["predict"]
    )


async def test_batched_requests_each_get_their_own_rows(served: RunningServer, made: Made) -> None:
    # Requests of 1 to 3 rows arrive together and run as batches; each answer holds its rows.
    async with InferenceClient.connect("127.0.0.1", served.port) as client:

        async def one(model: str, start: int, rows: int) -> None:
            _, datatype = SERVED[model]
            features = made.features[start : start + rows].astype(DATATYPES[datatype])
            result = await client.infer(model, {_input_name(model): features})
            want = {
                name: array[start : start + rows] for name, array in _expected(made, model).items()
            }
            _assert_equal(model, result.outputs, want)

        async with trio.open_nursery() as nursery:
            for model in ("sk_skops", "xgb_booster", "onnx_batched"):
                for start, rows in ((0, 1), (1, 3), (4, 2), (6, 1), (2, 2)):
                    nursery.start_soon(one, model, start, rows)


def _broken(made: Made, root: Path) -> Path:
    repository = root / "broken"
    f = made.folder
    sklearn_class = "mlserver_sklearn.SKLearnModel"
    garbage = root / "garbage.bin"
    garbage.write_bytes(b"this is no model file\n" * 10)
    _write(
        repository,
        "bad_file",
        {"implementation": sklearn_class, "parameters": {"uri": str(garbage)}},
    )
    _write(
        repository,
        "missing_file",
        {"implementation": sklearn_class, "parameters": {"uri": "./nope.joblib"}},
    )
    _write(
        repository,
        "bad_predict_fn",
        {
            "implementation": sklearn_class,
            "parameters": {
                "uri": str(f / "forest.joblib"),
                "extra": {"predict_fn": "predict_probability"},
            },
        },
    )
    _write(
        repository,
        "no_such_method",
        {
            "implementation": sklearn_class,
            "parameters": {
                "uri": str(f / "linear.joblib"),
                "extra": {"predict_fn": "predict_proba"},
            },
        },
    )
    _write(
        repository,
        "untrusted",
        {"implementation": sklearn_class, "parameters": {"uri": str(f / "forest.skops")}},
    )
    _write(repository, "onnx_corrupt", {"platform": "onnx", "parameters": {"uri": str(garbage)}})
    # Files cut in half (a copy interrupted), and files of another runtime's format.
    for source in ("forest.joblib", "forest.onnx"):
        whole = (f / source).read_bytes()
        (root / f"half.{source}").write_bytes(whole[: len(whole) // 2])
    whole_json = (f / "classifier.json").read_text()
    (root / "half.classifier.json").write_text(whole_json[: len(whole_json) // 2])
    _write(
        repository,
        "half_joblib",
        {"implementation": sklearn_class, "parameters": {"uri": str(root / "half.forest.joblib")}},
    )
    _write(
        repository,
        "onnx_as_joblib",
        {"implementation": sklearn_class, "parameters": {"uri": str(f / "forest.onnx")}},
    )
    _write(
        repository,
        "half_onnx",
        {"platform": "onnx", "parameters": {"uri": str(root / "half.forest.onnx")}},
    )
    _write(
        repository,
        "half_xgboost",
        {
            "implementation": "mlserver_xgboost.XGBoostModel",
            "parameters": {"uri": str(root / "half.classifier.json")},
        },
    )
    _write(
        repository,
        "joblib_as_xgboost",
        {
            "implementation": "mlserver_xgboost.XGBoostModel",
            "parameters": {"uri": str(f / "forest.joblib")},
        },
    )
    # Declared inputs whose rows are not the file's (it reads four features).
    _write(
        repository,
        "sklearn_rows",
        {
            "implementation": sklearn_class,
            "parameters": {"uri": str(f / "forest.joblib")},
            "inputs": [{"name": "X", "datatype": "FP64", "shape": [-1, 9]}],
        },
    )
    _write(
        repository,
        "xgboost_rows",
        {
            "implementation": "mlserver_xgboost.XGBoostModel",
            "parameters": {"uri": str(f / "classifier.json")},
            "inputs": [{"name": "X", "datatype": "FP32", "shape": [-1, 7]}],
        },
    )
    _write(
        repository,
        "onnx_zipmap",
        {"platform": "onnx", "parameters": {"uri": str(f / "zipmap.onnx")}},
    )
    _write(
        repository,
        "onnx_mismatch",
        {
            "platform": "onnxruntime_onnx",
            "parameters": {"uri": str(f / "forest.onnx")},
            "inputs": [{"name": "X", "datatype": "FP64", "shape": [-1, 4]}],
        },
    )
    _write(
        repository,
        "booster_proba",
        {
            "implementation": "mlserver_xgboost.XGBoostModel",
            "parameters": {
                "uri": str(f / "booster.json"),
                "extra": {"predict_fn": "predict_proba"},
            },
        },
    )
    return repository


async def test_a_model_that_cannot_load_tells_the_client_why(
    nursery: trio.Nursery, made: Made, tmp_path: Path
) -> None:
    f = made.folder
    reasons = {
        "bad_file": f"cannot read {tmp_path / 'garbage.bin'} as a joblib or pickle file: ",
        "missing_file": (
            f"model file {tmp_path / 'broken' / 'missing_file' / 'nope.joblib'} "
            "(parameters.uri) does not exist"
        ),
        "bad_predict_fn": (
            "parameters.extra.predict_fn is 'predict_probability'; it must be one of predict, "
            "predict_proba, predict_log_proba, decision_function, transform"
        ),
        "no_such_method": (
            f"LinearRegression from {f / 'linear.joblib'} has no predict_proba() "
            "(parameters.extra.predict_fn); it has: predict"
        ),
        "untrusted": (
            f"{f / 'forest.skops'} holds types skops does not trust by default: {TREE}; review "
            "them, and list those you trust in parameters.extra.skops_trusted_types"
        ),
        "onnx_corrupt": f"cannot read {tmp_path / 'garbage.bin'} as an ONNX model: ",
        "half_joblib": (
            f"cannot read {tmp_path / 'half.forest.joblib'} as a joblib or pickle file: "
        ),
        "onnx_as_joblib": f"cannot read {f / 'forest.onnx'} as a joblib or pickle file: ",
        "half_onnx": f"cannot read {tmp_path / 'half.forest.onnx'} as an ONNX model: ",
        "half_xgboost": f"cannot read {tmp_path / 'half.classifier.json'} as an XGBoost model: ",
        "joblib_as_xgboost": f"cannot read {f / 'forest.joblib'} as an XGBoost model: ",
        "sklearn_rows": (
            "declared input 'X' is FP64 [-1, 9], rows of 9 features; RandomForestClassifier "
            f"from {f / 'forest.joblib'} reads rows of 4"
        ),
        "xgboost_rows": (
            "declared input 'X' is FP32 [-1, 7], rows of 7 features; the booster from "
            f"{f / 'classifier.json'} reads rows of 4"
        ),
        "onnx_zipmap": (
            "the model's tensor 'output_probability' is seq(map(int64,tensor(float))), which the "
            "V2 protocol cannot carry"
        ),
        "onnx_mismatch": "declared input 'X' is FP64 [-1, 4], the model's is 'X' (FP32 [-1, 4])",
        "booster_proba": (
            f"predict_proba needs a classifier saved by XGBClassifier.save_model; "
            f"{f / 'booster.json'} holds a booster with no estimator type"
        ),
    }
    server = await start_server(nursery, _broken(made, tmp_path), wait_ready=False)
    client = GrpcioClient(server.port)
    try:
        for model, reason in reasons.items():
            details = ""
            with trio.fail_after(30):
                while "failed:" not in details:
                    error = await client.error("ModelInfer", pb.ModelInferRequest(model_name=model))
                    assert error.code() == grpc.StatusCode.UNAVAILABLE
                    details = error.details() or ""
                    await trio.sleep(0.05)
            # The runtime's own words after the worker's prefix: no exception type between.
            assert details.startswith(
                f"model '{model}' is not ready: loading model '{model}' failed: {reason}"
            ), details
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.http_port}") as rest:
            # A failed model is tried again with backoff, LOADING meanwhile: read between tries.
            with trio.fail_after(30):
                while True:
                    index = (await rest.post("/v2/repository/index", json={})).json()
                    if all(entry["state"] == "UNAVAILABLE" for entry in index):
                        break
                    await trio.sleep(0.05)
        assert {entry["name"]: entry["reason"][:40] for entry in index} == {
            model: f"loading model '{model}' failed: {reason}"[:40]
            for model, reason in reasons.items()
        }
    finally:
        client.channel.close()


@pytest.mark.parametrize(
    ("implementation", "library", "extra"),
    [
        ("trio_infer.runtimes.sklearn.SKLearnModel", "sklearn", "sklearn"),
        ("trio_infer.runtimes.xgboost.XGBoostModel", "xgboost", "xgboost"),
        ("trio_infer.runtimes.onnx.OnnxModel", "onnxruntime", "onnx"),
    ],
)
def test_a_missing_extra_is_named_with_its_pip_install(
    monkeypatch: pytest.MonkeyPatch, implementation: str, library: str, extra: str
) -> None:
    module_name, _, class_name = implementation.rpartition(".")
    module = __import__(module_name, fromlist=[class_name])
    # None in sys.modules: importing the library raises ImportError, as if not installed.
    monkeypatch.setitem(sys.modules, library, None)
    model = getattr(module, class_name)(ModelSettings("m", implementation))
    with pytest.raises(ModelFailed, match=rf"pip install 'trio-infer\[{extra}\]'$"):
        model.load()


def test_the_server_side_never_imports_the_runtimes_libraries(tmp_path: Path) -> None:
    # What the server process imports to serve a repository of built-in runtime models.
    repository = tmp_path / "repository"
    _write(repository, "m", {"implementation": "mlserver_sklearn.SKLearnModel"})
    _write(repository, "o", {"platform": "onnxruntime_onnx"})
    script = (
        "import sys, trio_infer.cli, trio_infer.server, trio_infer.runtimes.sklearn, "
        "trio_infer.runtimes.xgboost, trio_infer.runtimes.onnx\n"
        "from trio_infer.repository.settings import load_repository\n"
        f"load_repository(__import__('pathlib').Path({str(repository)!r}))\n"
        "print(sorted({'sklearn', 'xgboost', 'onnxruntime', 'skops', 'joblib', 'scipy'} "
        "& set(sys.modules)))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60
    )
    assert result.stdout.strip() == "[]"


def test_only_a_matrix_of_fixed_rows_other_than_the_files_is_refused() -> None:
    def spec(*shape: int) -> TensorSpec:
        return TensorSpec("X", "FP32", shape)

    # Rows of any length, a vector of texts, a file that does not say, inputs the model does
    # not take as one matrix: nothing to compare.
    for inputs, features in [
        ((spec(-1, -1),), 4),
        ((spec(-1),), 4),
        ((spec(-1, 9),), None),
        ((spec(-1, 4),), 4),
        ((spec(2, 4),), 4),
        ((spec(-1, 9), TensorSpec("Y", "FP32", (-1, 9))), 4),
        ((), 4),
    ]:
        check_feature_count(inputs, features, "m")
    with pytest.raises(ModelFailed, match=r"^declared input 'X' is FP32 \[3, 5\], rows of 5 "):
        check_feature_count((spec(3, 5),), 4, "m")
