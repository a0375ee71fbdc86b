"""model-settings.json parsing and the model repository: strict, and errors name file and field."""

from __future__ import annotations

import dataclasses
import json
import pickle
import re
from pathlib import Path
from typing import Any

import numpy as np
import pydantic
import pytest
import trio

from tests.support import GrpcioClient, start_server
from trio_infer.protobuf._proto import grpc_predict_v2_pb2 as pb
from trio_infer.protobuf.codec import decode_outputs, encode_inputs
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
            "max_sequence_idle_microseconds": 5_000_000,
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
        max_sequence_idle_microseconds=5_000_000,
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
        f"{folder}/model-settings.json: unknown field 'max_batch_sizes' (known: decoupled, "
        "implementation, inputs, max_batch_size, max_batch_time, max_queue_size, "
        "max_sequence_idle_microseconds, name, outputs, parameters, platform, timeout, versions)"
    )


@pytest.mark.parametrize(
    ("document", "problem"),
    [
        (
            {**MINIMAL, "inputs": [{"name": "x", "datatype": "FLOAT32", "shape": [1]}]},
            "inputs[0].datatype: Input should be one of the datatypes (BOOL, UINT8, UINT16, "
            "UINT32, UINT64, INT8, INT16, INT32, INT64, FP16, FP32, FP64, BYTES), got the string "
            "'FLOAT32'",
        ),
        (
            {**MINIMAL, "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, "16"]}]},
            "inputs[0].shape[1]: Input should be a valid integer, got the string '16'",
        ),
        (
            {**MINIMAL, "inputs": [{"name": "x", "datatype": "FP32", "shape": [2.5]}]},
            "inputs[0].shape[0]: Input should be a valid integer, got the number 2.5",
        ),
        (
            {**MINIMAL, "inputs": [{"name": "x", "datatype": "FP32", "shape": [-2]}]},
            "inputs[0].shape[0]: Input should be greater than or equal to -1, got the number -2",
        ),
        (
            {**MINIMAL, "inputs": [{"name": "x", "shape": [1]}]},
            "inputs[0].datatype: Field required",
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
        (
            {**MINIMAL, "max_batch_size": -1},
            "max_batch_size: Input should be greater than or equal to 0, got the number -1",
        ),
        (
            {**MINIMAL, "max_batch_size": True},
            "max_batch_size: Input should be a valid integer, got a boolean",
        ),
        (
            {**MINIMAL, "max_batch_time": -0.1},
            "max_batch_time: Input should be greater than or equal to 0, got the number -0.1",
        ),
        (
            {**MINIMAL, "max_queue_size": 0},
            "max_queue_size: Input should be greater than or equal to 1, got the number 0",
        ),
        ({**MINIMAL, "timeout": 0}, "timeout: Input should be greater than 0, got the number 0"),
        ({**MINIMAL, "versions": "v1"}, "versions: Input should be a list, got the string 'v1'"),
        (
            {**MINIMAL, "parameters": {"extra": []}},
            "parameters.extra: Input should be an object, got a list",
        ),
        (
            {**MINIMAL, "parameters": {"uri": 3}},
            "parameters.uri: Input should be a valid string, got the number 3",
        ),
        (
            {**MINIMAL, "name": ""},
            "name: String should have at least 1 character, got the string ''",
        ),
        ({"name": "m"}, "implementation: Field required"),
        (
            {"implementation": "MyModel"},
            "implementation: Input should be an import path 'package.module.Class', got the "
            "string 'MyModel'",
        ),
        (
            {**MINIMAL, "inputs": [{"name": "", "datatype": "FP32", "shape": [1]}]},
            "inputs[0].name: String should have at least 1 character, got the string ''",
        ),
        ({**MINIMAL, "inputs": "x"}, "inputs: Input should be a list, got the string 'x'"),
        (
            {**MINIMAL, "outputs": ["y"]},
            "outputs[0]: Input should be an object, got the string 'y'",
        ),
        (
            {**MINIMAL, "max_batch_size": 2.0},
            "max_batch_size: Input should be a valid integer, got the number 2.0",
        ),
        (
            '{"implementation": "model.M", "max_batch_time": Infinity}',
            "max_batch_time: Input should be a finite number, got the number inf",
        ),
        ({**MINIMAL, "timeout": True}, "timeout: Input should be a valid number, got a boolean"),
        (
            {**MINIMAL, "parameters": {"uri": ["a.npy"]}},
            "parameters.uri: Input should be a valid string, got a list",
        ),
        (
            {**MINIMAL, "parameters": {"version": 2}},
            "parameters.version: Input should be a valid string, got the number 2",
        ),
        ({**MINIMAL, "parameters": []}, "parameters: Input should be an object, got a list"),
        # The model's folder is where the file is, never what it says.
        (
            {**MINIMAL, "path": "/elsewhere"},
            "unknown field 'path' (known: decoupled, implementation, ",
        ),
        # A misspelt required field is reported as the unknown field it is, not as missing.
        ({"implementaton": "model.M"}, "unknown field 'implementaton' (known: decoupled, "),
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


def test_several_problems_are_reported_as_the_first_on_one_line(tmp_path: Path) -> None:
    folder = write(tmp_path / "m", {**MINIMAL, "versions": [1], "max_queue_size": -5})
    with pytest.raises(SettingsError) as caught:
        load_model_settings(folder)
    assert str(caught.value) == (
        f"{folder}/model-settings.json: versions[0]: Input should be a valid string, got the "
        "number 1"
    )


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


def test_settings_made_in_code_are_validated_immutable_and_replaceable() -> None:
    spec = TensorSpec("x", "FP32", [-1, 3])  # type: ignore[arg-type]
    assert spec.shape == (-1, 3)  # a list becomes the tuple the field declares
    settings = ModelSettings("m", "model.M", inputs=(spec,), max_batch_size=4)
    assert settings.inputs == (TensorSpec("x", "FP32", (-1, 3)),)
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.max_batch_size = 8  # type: ignore[misc]
    with pytest.raises(pydantic.ValidationError, match="datatype"):
        TensorSpec("x", "FLOAT32", (1,))
    with pytest.raises(pydantic.ValidationError, match="max_batch_sizes"):
        ModelSettings("m", "model.M", max_batch_sizes=4)  # type: ignore[call-arg]
    changed = dataclasses.replace(
        settings, parameters=dataclasses.replace(settings.parameters, extra={"k": 1})
    )
    assert changed.parameters.extra == {"k": 1}
    assert changed != settings
    # extra takes part in equality, not in hashing (a dict is not hashable).
    assert hash(changed) == hash(settings)
    with pytest.raises(pydantic.ValidationError, match="greater than or equal to 0"):
        dataclasses.replace(settings, max_batch_size=-1)


# --- parameters.uri: where a model's weights are -------------------------------------------------


def test_a_relative_uri_is_resolved_against_the_settings_folder(tmp_path: Path) -> None:
    folder = write(tmp_path / "m", {**MINIMAL, "parameters": {"uri": "./weights/w.npy"}})
    settings = load_model_settings(folder)
    assert settings.parameters.uri == "./weights/w.npy"  # kept as written
    assert settings.model_uri == folder / "weights" / "w.npy"
    bare = write(tmp_path / "bare", {**MINIMAL, "parameters": {"uri": "w.npy"}})
    assert load_model_settings(bare).model_uri == bare / "w.npy"
    # Normalised as MLServer normalises it: a sibling folder's file, named without "..".
    shared = write(tmp_path / "s", {**MINIMAL, "parameters": {"uri": "../shared/w.npy"}})
    assert load_model_settings(shared).model_uri == tmp_path / "shared" / "w.npy"


def test_an_absolute_uri_stays_as_written(tmp_path: Path) -> None:
    folder = write(tmp_path / "m", {**MINIMAL, "parameters": {"uri": "/srv/weights/w.npy"}})
    assert load_model_settings(folder).model_uri == Path("/srv/weights/w.npy")


def test_no_uri_is_no_model_uri(tmp_path: Path) -> None:
    assert load_model_settings(write(tmp_path / "a", MINIMAL)).model_uri is None
    unset = write(tmp_path / "b", {**MINIMAL, "parameters": {"uri": None}})
    assert load_model_settings(unset).model_uri is None
    empty = write(tmp_path / "c", {**MINIMAL, "parameters": {"uri": ""}})
    assert load_model_settings(empty).model_uri is None


def test_without_a_folder_a_relative_uri_stays_as_written() -> None:
    settings = ModelSettings("m", "model.M", parameters=ModelParameters(uri="w.npy"))
    assert settings.model_uri == Path("w.npy")


WEIGHTS_MODEL = '''
import numpy as np
from trio_infer import Model


class Weights(Model):
    """Loads its weights from parameters.uri and returns them for any request."""

    def load(self):
        self.weights = np.load(self.settings.model_uri)

    def predict(self, inputs, parameters):
        return {"weights": self.weights}
'''


async def test_a_model_loads_its_weights_from_its_uri(
    nursery: trio.Nursery, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    weights = np.arange(6, dtype=np.float32).reshape(2, 3) / 4
    folder = write(
        tmp_path / "repository" / "weights",
        {"implementation": "model.Weights", "parameters": {"uri": "./data/w.npy"}},
    )
    (folder / "data").mkdir()
    np.save(folder / "data" / "w.npy", weights)
    (folder / "model.py").write_text(WEIGHTS_MODEL)
    # The uri is relative to the model's folder, not to the working directory.
    monkeypatch.chdir(tmp_path)
    server = await start_server(nursery, tmp_path / "repository", workers=1)
    client = GrpcioClient(server.port)
    request = pb.ModelInferRequest(model_name="weights")
    encode_inputs(request, [("x", np.zeros(1, np.float32))], raw=True)
    response = await client.call("ModelInfer", request)
    client.channel.close()
    np.testing.assert_array_equal(decode_outputs(response)["weights"], weights)
