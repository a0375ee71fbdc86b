"""Other servers' names for the built-in runtimes, and MLServer's settings.json: the pure mapping,
then the ``trio-infer`` command serving an MLServer folder as it is."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import joblib
import numpy as np
import pytest
from sklearn.datasets import make_classification
from sklearn.linear_model import LogisticRegression

from tests.test_shutdown import EXIT_SLACK, TIMEOUT, Server
from trio_infer.protobuf._proto import grpc_predict_v2_pb2 as pb
from trio_infer.protobuf.codec import decode_outputs, encode_inputs
from trio_infer.repository.server_settings import ServerDefaults, server_defaults
from trio_infer.repository.settings import SettingsError, load_model_settings


def _model(root: Path, settings: dict[str, Any], name: str = "m") -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "model-settings.json").write_text(json.dumps(settings))
    return folder


@pytest.mark.parametrize(
    ("settings", "served_by"),
    [
        ({"implementation": "mlserver_sklearn.SKLearnModel"}, "sklearn.SKLearnModel"),
        ({"implementation": "mlserver_sklearn.sklearn.SKLearnModel"}, "sklearn.SKLearnModel"),
        ({"implementation": "mlserver_xgboost.XGBoostModel"}, "xgboost.XGBoostModel"),
        ({"platform": "onnxruntime_onnx"}, "onnx.OnnxModel"),
        ({"platform": "onnx"}, "onnx.OnnxModel"),
        ({"platform": "sklearn"}, "sklearn.SKLearnModel"),
        # A class named is the class served, whatever the platform says.
        ({"platform": "onnxruntime_onnx", "implementation": "model.M"}, None),
    ],
)
def test_other_servers_names_are_served_by_the_built_in_runtimes(
    tmp_path: Path, settings: dict[str, Any], served_by: str | None
) -> None:
    loaded = load_model_settings(_model(tmp_path, settings))
    expected = "model.M" if served_by is None else f"trio_infer.runtimes.{served_by}"
    assert loaded.implementation == expected
    assert loaded.platform == settings.get("platform", "")


def test_no_implementation_and_no_known_platform_is_one_line_naming_both(tmp_path: Path) -> None:
    folder = _model(tmp_path, {"platform": "tensorrt_plan"})
    with pytest.raises(SettingsError) as caught:
        load_model_settings(folder)
    assert str(caught.value) == (
        f"{folder / 'model-settings.json'}: implementation: Field required: name the model's "
        "class ('package.module.Class'), or a platform served by a built-in runtime "
        "(onnxruntime_onnx, onnx, sklearn, xgboost)"
    )


def test_mlservers_settings_json_fields_with_an_equivalent_become_option_defaults() -> None:
    document = {
        "debug": False,
        "host": "127.0.0.1",
        "http_port": 9000,
        "grpc_port": 9001,
        "metrics_port": 9002,
        "grpc_max_message_length": 1024,
        "parallel_workers": 0,
        "load_models_at_startup": False,
        "gzip_enabled": True,
        "metrics_endpoint": None,
        "tracing_server": None,
    }
    assert server_defaults(document, Path("settings.json")) == ServerDefaults(
        Path("settings.json"),
        {
            "debug": False,
            "host": "127.0.0.1",
            "http_port": 9000,
            "grpc_port": 9001,
            "metrics_port": 9002,
            "max_message_size": 1024,
            "workers": 1,  # MLServer's 0 (models in the server's process): one worker here
            "model_control_mode": "explicit",
        },
        ("gzip_enabled", "metrics_endpoint", "tracing_server"),
    )


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [("http_port", "8080", "int"), ("parallel_workers", True, "int"), ("debug", 1, "bool")],
)
def test_a_settings_json_field_of_the_wrong_type_is_one_line_and_exit_2(
    tmp_path: Path, field: str, value: object, expected: str
) -> None:
    (tmp_path / "settings.json").write_text(json.dumps({field: value}))
    _model(tmp_path, {"implementation": "mlserver_sklearn.SKLearnModel"})
    done = subprocess.run(
        [sys.executable, "-m", "trio_infer", "serve", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )
    assert done.returncode == 2
    assert done.stderr.splitlines()[-1].endswith(
        f"{tmp_path / 'settings.json'}: {field}: expected {expected}, got {value!r}"
    ), done.stderr


def test_an_mlserver_folder_is_served_as_it_is(tmp_path: Path) -> None:
    # `mlserver start folder`: settings.json and one folder per model, MLServer's own names.
    folder = tmp_path / "mlserver"
    x, y = make_classification(n_samples=60, n_features=4, random_state=0)
    classifier = LogisticRegression().fit(x, y)
    model = _model(
        folder,
        {
            "name": "classifier",
            "implementation": "mlserver_sklearn.SKLearnModel",
            "parameters": {"uri": "./model.joblib", "version": "v1"},
        },
        "classifier",
    )
    joblib.dump(classifier, model / "model.joblib")
    (folder / "settings.json").write_text(
        json.dumps(
            {
                "host": "127.0.0.1",
                "grpc_port": 0,
                "http_port": 0,
                "parallel_workers": 1,
                "debug": False,
                "gzip_enabled": True,
            }
        )
    )
    server = Server([str(folder)], tmp_path)
    try:
        server.wait_for_line(
            r"settings\.json: read debug, grpc_port, host, http_port, workers \(no equivalent "
            r"here: gzip_enabled\)"
        )
        server.start()  # on 127.0.0.1, from settings.json
        assert len(server.workers()) == 1
        request = pb.ModelInferRequest(model_name="classifier", model_version="v1")
        encode_inputs(request, [("input-0", x[:5])], raw=True)
        outputs = decode_outputs(server.stub.ModelInfer(request, timeout=TIMEOUT))
        np.testing.assert_array_equal(outputs["predict"], classifier.predict(x[:5]))
        signalled = server.send(signal.SIGTERM)
        server.wait_exit(signalled + 5 + EXIT_SLACK)
        server.assert_clean_exit(0)
    finally:
        server.close()
