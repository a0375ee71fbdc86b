"""model-settings.json parsing and the model repository: strict, and errors name file and field."""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path
from typing import Any

import pytest

from trio_infer.repository.settings import (
    EXAMPLES,
    ModelParameters,
    ModelSettings,
    SettingsError,
    TensorSpec,
    load_model_settings,
    load_repository,
)


def write(folder: Path, document: Any) -> Path:
    """Write <folder>/model-settings.json (a str is written as is) and return the folder."""
    folder.mkdir(parents=True, exist_ok=True)
    text = document if isinstance(document, str) else json.dumps(document)
    (folder / "model-settings.json").write_text(text)
    return folder


MINIMAL = {"implementation": "model.MyModel"}


def test_a_complete_file_is_read_into_settings(tmp_path: Path) -> None:
    folder = write(
        tmp_path / "my_model",
        {
            "name": "classifier",
            "implementation": "model.MyModel",
            "platform": "sklearn",
            "versions": ["v1", "v2"],
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}],
            "outputs": [
                {"name": "label", "datatype": "BYTES", "shape": [-1]},
                {"name": "score", "datatype": "FP64", "shape": [-1, 3]},
            ],
            "parameters": {
                "uri": "./model.joblib",
                "version": "v2",
                "format": "joblib",
                "content_type": "np",
                "extra": {"threshold": 0.5, "labels": ["a", "b", "c"]},
            },
            "max_batch_size": 32,
            "max_batch_time": 0.005,
            "max_queue_size": 100,
            "timeout": 2,
        },
    )
    settings = load_model_settings(folder)
    assert settings == ModelSettings(
        name="classifier",
        implementation="model.MyModel",
        path=folder,
        platform="sklearn",
        versions=("v1", "v2"),
        inputs=(TensorSpec("x", "FP32", (-1, 4)),),
        outputs=(TensorSpec("label", "BYTES", (-1,)), TensorSpec("score", "FP64", (-1, 3))),
        parameters=ModelParameters(
            uri="./model.joblib",
            version="v2",
            format="joblib",
            content_type="np",
            extra={"threshold": 0.5, "labels": ["a", "b", "c"]},
        ),
        max_batch_size=32,
        max_batch_time=0.005,
        max_queue_size=100,
        timeout=2.0,
    )
    assert settings.version == "v2"
    # Settings cross into worker processes and key dictionaries.
    assert pickle.loads(pickle.dumps(settings)) == settings
    assert hash(settings) == hash(pickle.loads(pickle.dumps(settings)))


def test_a_minimal_file_takes_the_folder_name_and_defaults(tmp_path: Path) -> None:
    folder = write(tmp_path / "add_sub", MINIMAL)
    assert load_model_settings(folder) == ModelSettings(
        name="add_sub", implementation="model.MyModel", path=folder
    )


def test_an_unversioned_mlserver_file_reads_version_null_as_no_version(tmp_path: Path) -> None:
    folder = write(tmp_path / "m", {**MINIMAL, "parameters": {"version": None, "uri": None}})
    assert load_model_settings(folder).version == ""


@pytest.mark.parametrize(
    ("document", "field", "known"),
    [
        ({**MINIMAL, "max_batch_sizes": 4}, "max_batch_sizes", "implementation, inputs"),
        ({**MINIMAL, "parameters": {"uri": "x", "weights": 1}}, "parameters.weights", "extra"),
        (
            {**MINIMAL, "inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "dims": 1}]},
            "inputs[0].dims",
            "datatype, name, shape",
        ),
        (
            {
                **MINIMAL,
                "outputs": [
                    {"name": "y", "datatype": "FP32", "shape": [1]},
                    {"name": "z", "dtype": "FP32", "shape": [1]},
                ],
            },
            "outputs[1].dtype",
            "datatype, name, shape",
        ),
    ],
)
def test_an_unknown_field_at_any_level_is_named_with_the_file(
    tmp_path: Path, document: dict[str, Any], field: str, known: str
) -> None:
    folder = write(tmp_path / "add_sub", document)
    with pytest.raises(SettingsError) as caught:
        load_model_settings(folder)
    message = str(caught.value)
    assert message.startswith(f"{folder / 'model-settings.json'}: unknown field {field!r} (known: ")
    assert known in message


def test_the_unknown_field_message_lists_every_known_field(tmp_path: Path) -> None:
    folder = write(tmp_path / "add_sub", {**MINIMAL, "max_batch_sizes": 4})
    with pytest.raises(SettingsError) as caught:
        load_model_settings(folder)
    assert str(caught.value) == (
        f"{folder}/model-settings.json: unknown field 'max_batch_sizes' (known: implementation, "
        "inputs, max_batch_size, max_batch_time, max_queue_size, name, outputs, parameters, "
        "platform, timeout, versions)"
    )


@pytest.mark.parametrize(
    ("document", "problem"),
    [
        (
            {**MINIMAL, "inputs": [{"name": "x", "datatype": "FLOAT32", "shape": [1]}]},
            "inputs[0].datatype 'FLOAT32' is not a datatype (known: BOOL, UINT8,",
        ),
        (
            {**MINIMAL, "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, "16"]}]},
            "inputs[0].shape[1] must be an integer, got the string '16'",
        ),
        (
            {**MINIMAL, "inputs": [{"name": "x", "datatype": "FP32", "shape": [2.5]}]},
            "inputs[0].shape[0] must be an integer, got the number 2.5",
        ),
        (
            {**MINIMAL, "inputs": [{"name": "x", "datatype": "FP32", "shape": [-2]}]},
            "inputs[0].shape[0] must be -1 (any size) or a size >= 0, got -2",
        ),
        (
            {**MINIMAL, "inputs": [{"name": "x", "shape": [1]}]},
            "inputs[0].datatype is required",
        ),
        (
            {
                **MINIMAL,
                "inputs": [
                    {"name": "x", "datatype": "FP32", "shape": [1]},
                    {"name": "x", "datatype": "INT8", "shape": [1]},
                ],
            },
            "inputs: tensor name 'x' appears twice",
        ),
        ({**MINIMAL, "max_batch_size": -1}, "max_batch_size must not be negative, got -1"),
        ({**MINIMAL, "max_batch_size": True}, "max_batch_size must be an integer, got a boolean"),
        ({**MINIMAL, "max_batch_time": -0.1}, "max_batch_time must be a finite, non-negative"),
        ({**MINIMAL, "max_queue_size": 0}, "max_queue_size must be at least 1, got 0"),
        ({**MINIMAL, "timeout": 0}, "timeout must be more than 0 seconds (or null for no"),
        ({**MINIMAL, "versions": "v1"}, "versions must be a list of strings, got the string"),
        ({**MINIMAL, "parameters": {"extra": []}}, "parameters.extra must be a JSON object"),
        ({**MINIMAL, "parameters": {"uri": 3}}, "parameters.uri must be a string, got the num"),
        ({**MINIMAL, "name": ""}, "name must not be empty"),
        ({"name": "m"}, "implementation is required"),
        ({"implementation": "MyModel"}, "implementation 'MyModel' must be an import path"),
        ([MINIMAL], "the file must be a JSON object, got a list"),
        ('{"implementation": "model.M",}', "not valid JSON: "),
        ('{"implementation": "model.M", "implementation": "x.Y"}', "key 'implementation' appe"),
    ],
)
def test_an_invalid_value_is_named_with_the_file(
    tmp_path: Path, document: Any, problem: str
) -> None:
    folder = write(tmp_path / "m", document)
    with pytest.raises(SettingsError, match=re.escape(f"{folder}/model-settings.json: {problem}")):
        load_model_settings(folder)


def test_a_folder_without_settings_is_an_error_naming_the_file(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match=re.escape(f"{tmp_path}/model-settings.json: cannot")):
        load_model_settings(tmp_path)


def test_a_repository_lists_its_models_by_name(tmp_path: Path) -> None:
    write(tmp_path / "b_folder", {**MINIMAL, "name": "alpha"})
    write(tmp_path / "a_folder", {**MINIMAL, "name": "beta"})
    (tmp_path / "__pycache__").mkdir()
    (tmp_path / "notes.txt").write_text("not a model")
    models = load_repository(tmp_path)
    assert [(m.name, m.path) for m in models] == [
        ("alpha", tmp_path / "b_folder"),
        ("beta", tmp_path / "a_folder"),
    ]


def test_a_duplicate_model_name_is_an_error_naming_both_files(tmp_path: Path) -> None:
    write(tmp_path / "one", {**MINIMAL, "name": "same"})
    write(tmp_path / "two", {**MINIMAL, "name": "same"})
    with pytest.raises(SettingsError) as caught:
        load_repository(tmp_path)
    assert str(caught.value) == (
        f"model name 'same' is declared twice: by {tmp_path}/one/model-settings.json and by "
        f"{tmp_path}/two/model-settings.json"
    )


def test_an_empty_repository_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "empty_folder").mkdir()
    with pytest.raises(SettingsError, match=re.escape(f"{tmp_path}: model repository holds no")):
        load_repository(tmp_path)
    with pytest.raises(SettingsError, match="model repository is not a folder"):
        load_repository(tmp_path / "missing")


def test_an_invalid_model_fails_the_whole_repository(tmp_path: Path) -> None:
    write(tmp_path / "good", MINIMAL)
    write(tmp_path / "bad", {**MINIMAL, "max_batch_sizes": 1})
    with pytest.raises(SettingsError, match=re.escape(f"{tmp_path}/bad/model-settings.json: ")):
        load_repository(tmp_path)


def test_the_examples_repository_has_four_models() -> None:
    models = {m.name: m for m in load_repository(EXAMPLES)}
    assert sorted(models) == ["add_sub", "dense", "echo", "sleep"]
    add_sub = models["add_sub"]
    assert add_sub.implementation == "trio_infer.examples.models.AddSub"
    assert add_sub.inputs == (
        TensorSpec("INPUT0", "FP32", (-1, 16)),
        TensorSpec("INPUT1", "FP32", (-1, 16)),
    )
    assert add_sub.outputs == (
        TensorSpec("OUTPUT0", "FP32", (-1, 16)),
        TensorSpec("OUTPUT1", "FP32", (-1, 16)),
    )
    assert models["dense"].inputs == (TensorSpec("x", "FP32", (-1, 256)),)
    assert models["dense"].outputs == (TensorSpec("y", "FP32", (-1, 256)),)
    assert models["echo"].inputs == models["sleep"].inputs == ()
    batching = {name: (m.max_batch_size, m.max_batch_time) for name, m in models.items()}
    unbatched = (0, 0.0)
    assert batching == {
        "add_sub": (64, 0.0),
        "dense": (64, 0.0),
        "echo": unbatched,
        "sleep": unbatched,
    }
