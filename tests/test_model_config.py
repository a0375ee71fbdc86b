"""Triton's ModelConfig and ModelStatistics: tritonclient (gRPC and HTTP), grpcio stubs and httpx
against a real server.

The repository holds the example models (add_sub and dense batch, echo does not), a decoupled
model and a stateful one that sets its sequence idle time, with a platform and free-form
parameters. tritonclient runs in this process (it shares it with trio_infer's protocol modules:
tests/test_coexistence.py), called from a thread so Trio keeps running.
"""

from __future__ import annotations

import json
import pickle
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import trio
import tritonclient.grpc as triton
from google.protobuf import json_format
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from tritonclient.utils import InferenceServerException

from tests.support import GrpcioClient, start_server, write_repository
from trio_infer.core.model_config import model_configuration
from trio_infer.core.repository import ControlMode
from trio_infer.datatypes import DATATYPES
from trio_infer.protobuf._proto import grpc_predict_v2_pb2 as pb
from trio_infer.protobuf._proto import model_config_pb2 as mc
from trio_infer.protobuf.codec import encode_inputs
from trio_infer.protobuf.triton_json import message_json
from trio_infer.protobuf.triton_types import TRITON_DATA_TYPES
from trio_infer.repository.settings import EXAMPLES, ModelSettings, TensorSpec
from trio_infer.server import RunningServer

MODELS = textwrap.dedent(
    """
    import numpy as np

    from trio_infer.model import Model


    class Count(Model):
        def predict(self, inputs, parameters):
            for i in range(int(inputs["n"][0])):
                yield {"i": np.array([i], np.int32)}


    class Remember(Model):
        def predict(self, inputs, parameters):
            return {"y": inputs["x"]}
    """
)

#: The extra models, beside copies of the examples' settings.
_EXTRA = {
    "count": {
        "implementation": "extra_models.Count",
        "decoupled": True,
        "inputs": [{"name": "n", "datatype": "INT32", "shape": [1]}],
        "outputs": [{"name": "i", "datatype": "INT32", "shape": [1]}],
    },
    "remember": {
        "implementation": "extra_models.Remember",
        "platform": "custom_stateful",
        "max_sequence_idle_microseconds": 5_000_000,
        "inputs": [{"name": "x", "datatype": "BYTES", "shape": [-1]}],
        "outputs": [{"name": "y", "datatype": "BYTES", "shape": [-1]}],
        "parameters": {"extra": {"label": "kept", "threshold": 0.5, "sizes": [1, 2]}},
    },
}


def _repository(root: Path) -> Path:
    for name in ("add_sub", "dense", "echo"):
        (root / name).mkdir(parents=True)
        (root / name / "model-settings.json").write_text(
            (EXAMPLES / name / "model-settings.json").read_text()
        )
    return write_repository(root, _EXTRA, "extra_models", MODELS)


async def _serve(nursery: trio.Nursery, tmp_path: Path, **overrides: Any) -> RunningServer:
    return await start_server(nursery, _repository(tmp_path / "repository"), **overrides)


@pytest.fixture
async def server(nursery: trio.Nursery, tmp_path: Path) -> RunningServer:
    return await _serve(nursery, tmp_path, workers=2)


@pytest.fixture
def client(server: RunningServer) -> triton.InferenceServerClient:
    return triton.InferenceServerClient(f"127.0.0.1:{server.port}")


async def _in_thread(call: Callable[[], Any]) -> Any:
    return await trio.to_thread.run_sync(call)


def _instances(name: str) -> list[dict[str, Any]]:
    return [{"name": f"{name}_0", "kind": "KIND_CPU", "count": 2}]


_LATEST = {"latest": {"num_versions": 1}}
_NOT_DECOUPLED: dict[str, Any] = {}  # protobuf's JSON leaves out a false bool

# What tritonclient's get_model_config(as_json=True) reads: protobuf's JSON of Triton's
# ModelConfigResponse, which writes 64-bit integers as strings and leaves defaults out.
EXPECTED_CONFIGS: dict[str, dict[str, Any]] = {
    "add_sub": {
        "name": "add_sub",
        "backend": "python",
        "version_policy": _LATEST,
        "max_batch_size": 64,
        "input": [
            {"name": "INPUT0", "data_type": "TYPE_FP32", "dims": ["16"]},
            {"name": "INPUT1", "data_type": "TYPE_FP32", "dims": ["16"]},
        ],
        "output": [
            {"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": ["16"]},
            {"name": "OUTPUT1", "data_type": "TYPE_FP32", "dims": ["16"]},
        ],
        "dynamic_batching": {
            "priority_levels": "3",
            "default_priority_level": "2",
            "default_queue_policy": {"max_queue_size": 1024},
        },
        "instance_group": _instances("add_sub"),
        "model_transaction_policy": _NOT_DECOUPLED,
    },
    "dense": {
        "name": "dense",
        "backend": "python",
        "version_policy": _LATEST,
        "max_batch_size": 64,
        "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": ["256"]}],
        "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": ["256"]}],
        "dynamic_batching": {
            "priority_levels": "3",
            "default_priority_level": "2",
            "default_queue_policy": {"max_queue_size": 1024},
        },
        "instance_group": _instances("dense"),
        "model_transaction_policy": _NOT_DECOUPLED,
    },
    "echo": {
        "name": "echo",
        "backend": "python",
        "version_policy": _LATEST,
        "instance_group": _instances("echo"),
        "model_transaction_policy": _NOT_DECOUPLED,
    },
    "count": {
        "name": "count",
        "backend": "python",
        "version_policy": _LATEST,
        "input": [{"name": "n", "data_type": "TYPE_INT32", "dims": ["1"]}],
        "output": [{"name": "i", "data_type": "TYPE_INT32", "dims": ["1"]}],
        "instance_group": _instances("count"),
        "model_transaction_policy": {"decoupled": True},
    },
    "remember": {
        "name": "remember",
        "platform": "custom_stateful",
        "backend": "python",
        "version_policy": _LATEST,
        # It does not batch (max_batch_size 0): its dims are whole shapes.
        "input": [{"name": "x", "data_type": "TYPE_STRING", "dims": ["-1"]}],
        "output": [{"name": "y", "data_type": "TYPE_STRING", "dims": ["-1"]}],
        "sequence_batching": {"max_sequence_idle_microseconds": "5000000"},
        "instance_group": _instances("remember"),
        "parameters": {
            "label": {"string_value": "kept"},
            "threshold": {"string_value": "0.5"},
            "sizes": {"string_value": "[1, 2]"},
        },
        "model_transaction_policy": _NOT_DECOUPLED,
    },
}


async def test_tritonclient_reads_every_models_config(
    client: triton.InferenceServerClient,
) -> None:
    for name, expected in EXPECTED_CONFIGS.items():
        answer = await _in_thread(lambda name=name: client.get_model_config(name, as_json=True))
        assert answer == {"config": expected}, name


async def test_grpcio_stubs_read_a_batching_models_config(server: RunningServer) -> None:
    stub = GrpcioClient(server.port)
    try:
        response = await stub.call("ModelConfig", pb.ModelConfigRequest(name="add_sub"))
        versioned = await stub.call(
            "ModelConfig", pb.ModelConfigRequest(name="add_sub", version="")
        )
    finally:
        stub.channel.close()
    config = response.config
    assert versioned == response
    assert config.WhichOneof("scheduling_choice") == "dynamic_batching"
    assert [(t.name, t.data_type, list(t.dims)) for t in config.input] == [
        ("INPUT0", mc.TYPE_FP32, [16]),
        ("INPUT1", mc.TYPE_FP32, [16]),
    ]
    assert config.max_batch_size == 64
    assert config.dynamic_batching.max_queue_delay_microseconds == 0
    [group] = config.instance_group
    assert (group.kind, group.count) == (mc.ModelInstanceGroup.KIND_CPU, 2)


async def test_unknown_models_and_versions_are_not_found(
    server: RunningServer, client: triton.InferenceServerClient
) -> None:
    for call in (
        lambda: client.get_model_config("no_such_model"),
        lambda: client.get_inference_statistics("no_such_model"),
        lambda: client.get_model_config("add_sub", "7"),
        lambda: client.get_inference_statistics("add_sub", "7"),
    ):
        with pytest.raises(InferenceServerException) as caught:
            await _in_thread(call)
        assert caught.value.status() == "StatusCode.NOT_FOUND"
    stub = GrpcioClient(server.port)
    try:
        missing = await stub.error("ModelConfig", pb.ModelConfigRequest(name="no_such_model"))
        unknown = await stub.error(
            "ModelStatistics", pb.ModelStatisticsRequest(name="no_such_model")
        )
        metadata = await stub.error("ModelMetadata", pb.ModelMetadataRequest(name="no_such_model"))
    finally:
        stub.channel.close()
    # The same status and message as ModelMetadata's for an unknown model.
    for error in (missing, unknown):
        assert (error.code(), error.details()) == (grpc.StatusCode.NOT_FOUND, metadata.details())
    assert "'no_such_model'" in metadata.details()


def _add_sub_inputs(rows: int, columns: int = 16) -> list[triton.InferInput]:
    inputs = [triton.InferInput(name, [rows, columns], "FP32") for name in ("INPUT0", "INPUT1")]
    for tensor in inputs:
        tensor.set_data_from_numpy(np.ones((rows, columns), np.float32))
    return inputs


async def test_statistics_count_exactly_the_traffic_sent(
    server: RunningServer, client: triton.InferenceServerClient
) -> None:
    before = time.time() * 1000
    # One call at a time, so each runs as an execution of its own: rows 1, 2, 3, 3.
    rows = [1, 2, 3, 3]
    for n in rows:
        await _in_thread(lambda n=n: client.infer("add_sub", _add_sub_inputs(n)))
    # Two failures the core counts: inputs that do not match the declared shape.
    for _ in range(2):
        with pytest.raises(InferenceServerException):
            await _in_thread(lambda: client.infer("add_sub", _add_sub_inputs(1, columns=3)))
    # A model that does not batch counts one inference per request, whatever its rows.
    text = triton.InferInput("text", [3], "BYTES")
    text.set_data_from_numpy(np.array([b"a", b"b", b"c"], dtype=np.object_))
    for _ in range(3):
        await _in_thread(lambda: client.infer("echo", [text]))
    after = time.time() * 1000

    answer = await _in_thread(lambda: client.get_inference_statistics("add_sub", as_json=True))
    [add_sub] = answer["model_stats"]
    assert before <= int(add_sub["last_inference"]) <= after
    stats = add_sub["inference_stats"]
    assert (add_sub["name"], add_sub.get("version", "")) == ("add_sub", "")
    assert (add_sub["inference_count"], add_sub["execution_count"]) == ("9", "4")
    assert (stats["success"]["count"], stats["fail"]["count"]) == ("4", "2")
    assert stats["queue"]["count"] == stats["compute_infer"]["count"] == "4"
    # Durations are there, and a request's whole time holds its compute time.
    assert int(stats["success"]["ns"]) >= int(stats["compute_infer"]["ns"]) > 0
    assert int(stats["fail"]["ns"]) > 0
    # Not measured (compute_input, compute_output) or not kept (the cache's): there, as in
    # Triton, with zero counts (protobuf's JSON leaves the zeros out).
    assert stats.keys() == {
        "success",
        "fail",
        "queue",
        "compute_input",
        "compute_infer",
        "compute_output",
        "cache_hit",
        "cache_miss",
    }
    for unmeasured in ("compute_input", "compute_output", "cache_hit", "cache_miss"):
        assert stats[unmeasured] == {}
    assert [(b["batch_size"], b["compute_infer"]["count"]) for b in add_sub["batch_stats"]] == [
        ("1", "1"),
        ("2", "1"),
        ("3", "2"),
    ]
    assert all(b["compute_input"] == b["compute_output"] == {} for b in add_sub["batch_stats"])

    # Every served model, by name; dense, never called, with zeros.
    everything = await _in_thread(lambda: client.get_inference_statistics())
    by_name = {s.name: s for s in everything.model_stats}
    assert list(by_name) == sorted(EXPECTED_CONFIGS)
    echo = by_name["echo"]
    assert (echo.inference_count, echo.execution_count) == (3, 3)
    assert (echo.inference_stats.success.count, echo.inference_stats.fail.count) == (3, 0)
    assert [(b.batch_size, b.compute_infer.count) for b in echo.batch_stats] == [(1, 3)]
    dense = by_name["dense"]
    assert (dense.last_inference, dense.inference_count, dense.execution_count) == (0, 0, 0)
    assert dense.inference_stats.success.count == dense.inference_stats.fail.count == 0
    assert not dense.batch_stats
    assert by_name["add_sub"].inference_stats.success.count == 4


async def test_grpcio_stubs_read_statistics_after_a_decoupled_models_stream(
    server: RunningServer,
) -> None:
    request = pb.ModelInferRequest(model_name="count", id="c")
    encode_inputs(request, [("n", np.array([3], np.int32))], raw=True)
    stub = GrpcioClient(server.port)
    try:
        responses = await trio.to_thread.run_sync(
            lambda: list(stub.stub.ModelStreamInfer(iter([request]), timeout=30))
        )
        response = await stub.call("ModelStatistics", pb.ModelStatisticsRequest(name="count"))
    finally:
        stub.channel.close()
    assert [r.error_message for r in responses] == ["", "", ""]
    [count] = response.model_stats
    assert (count.name, count.inference_count, count.execution_count) == ("count", 1, 1)
    assert (count.inference_stats.success.count, count.inference_stats.fail.count) == (1, 0)


# -- the pure parts -------------------------------------------------------------------------


def test_config_messages_pickle_as_their_own_classes() -> None:
    # model_config_pb2 is in the private pool like the others: its nested messages and map
    # entries are not in the default symbol database, where protobuf would look them up.
    device = mc.ModelInstanceGroup.SecondaryDevice(device_id=3)
    config = mc.ModelConfig(name="m", parameters={"k": mc.ModelParameter(string_value="v")})
    for message in (device, config, config.parameters["k"], mc.ModelVersionPolicy.Latest()):
        copied = pickle.loads(pickle.dumps(message))
        assert type(copied) is type(message)
        assert copied == message


def test_every_datatype_has_its_triton_type() -> None:
    assert TRITON_DATA_TYPES.keys() == DATATYPES.keys()
    for datatype, triton_type in TRITON_DATA_TYPES.items():
        expected = "TYPE_STRING" if datatype == "BYTES" else f"TYPE_{datatype}"
        assert mc.DataType.Name(triton_type) == expected


def test_a_model_whose_inputs_have_no_batch_dimension_reports_no_batching() -> None:
    # max_batch_size above 1, but an input without -1 first: the server does not batch it, so
    # Triton's config must not say it does (nor cut a dimension off its shapes).
    settings = ModelSettings(
        "fixed",
        "a.B",
        inputs=(TensorSpec("x", "FP32", (4, 2)),),
        outputs=(TensorSpec("y", "FP32", (-1, 2)),),
        max_batch_size=8,
        max_batch_time=0.0025,
    )
    config = model_configuration(settings, instances=3)
    assert (config.max_batch_size, config.dynamic_batching) == (0, None)
    assert [spec.shape for spec in (*config.inputs, *config.outputs)] == [(4, 2), (-1, 2)]
    batching = model_configuration(
        ModelSettings(
            "batching",
            "a.B",
            inputs=(TensorSpec("x", "FP32", (-1, 2)),),
            max_batch_size=8,
            max_batch_time=0.0025,
        ),
        instances=3,
    )
    assert batching.dynamic_batching is not None
    assert batching.dynamic_batching.max_queue_delay_microseconds == 2500
    assert (batching.max_batch_size, batching.inputs[0].shape, batching.instance_count) == (
        8,
        (2,),
        3,
    )


@pytest.mark.parametrize("rest", [True, False])
async def test_server_metadata_lists_exactly_the_extensions_served(
    nursery: trio.Nursery, rest: bool
) -> None:
    server = await start_server(nursery, **({} if rest else {"http_port": None}))
    client = GrpcioClient(server.port)
    metadata = await client.call("ServerMetadata", pb.ServerMetadataRequest())
    expected = {
        "model_configuration",
        "model_repository",
        "parameters",
        "schedule_policy",
        "sequence",
        "statistics",
    }
    # Triton's binary tensor data is an extension of REST: listed only when REST is served.
    assert set(metadata.extensions) == (expected | {"binary_tensor_data"} if rest else expected)


def _filled(message: Message, depth: int = 0) -> list[int]:
    """Set every field of ``message`` reachable within a few levels (nested messages, two
    elements of each repeated field, an entry of each map) to a value unlike its default, the
    64-bit integers to their extremes; return those integers."""
    integers: list[int] = []
    for field in message.DESCRIPTOR.fields:
        if field.containing_oneof is not None and message.WhichOneof(field.containing_oneof.name):
            continue
        entry = field.message_type
        if entry is not None and entry.GetOptions().map_entry:
            # A map's key is a JSON object's key, a string whatever its type.
            key, value_field = _scalar(entry.fields_by_name["key"]), entry.fields_by_name["value"]
            mapping = getattr(message, field.name)
            if value_field.message_type is not None:
                integers += _filled(mapping[key], depth + 1) if depth < 4 else []
            else:
                value = _scalar(value_field)
                mapping[key] = value
                integers += [value] if value_field.type in _INT64_TYPES else []
        elif entry is not None:
            if depth < 4:
                if field.is_repeated:
                    for _ in range(2):
                        integers += _filled(getattr(message, field.name).add(), depth + 1)
                else:
                    integers += _filled(getattr(message, field.name), depth + 1)
        elif field.is_repeated:
            values = [_scalar(field), _scalar(field, second=True)]
            getattr(message, field.name).extend(values)
            integers += values if field.type in _INT64_TYPES else []
        else:
            value = _scalar(field)
            setattr(message, field.name, value)
            integers += [value] if field.type in _INT64_TYPES else []
    return integers


_INT64_TYPES = {
    FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT64: (2**64 - 1, 2**53 + 1),
    FieldDescriptor.TYPE_FIXED64: (2**64 - 1, 2**53 + 1),
}


def _scalar(field: FieldDescriptor, *, second: bool = False) -> Any:
    if field.type in _INT64_TYPES:
        return _INT64_TYPES[field.type][second]
    if field.enum_type is not None:
        return field.enum_type.values[-1].number
    if field.type == FieldDescriptor.TYPE_BOOL:
        return True
    if field.type == FieldDescriptor.TYPE_STRING:
        return "s2" if second else "s"
    if field.type == FieldDescriptor.TYPE_BYTES:
        return b"b"
    if (
        field.cpp_type == FieldDescriptor.CPPTYPE_DOUBLE
        or field.cpp_type == FieldDescriptor.CPPTYPE_FLOAT
    ):
        return 0.5
    return 7 if second else 5


def _leaves(document: Any) -> list[Any]:
    if isinstance(document, dict):
        return [leaf for value in document.values() for leaf in _leaves(value)]
    if isinstance(document, list):
        return [leaf for value in document for leaf in _leaves(value)]
    return [document]


@pytest.mark.parametrize(
    "message_type", [mc.ModelConfig, pb.ModelConfigResponse, pb.ModelStatisticsResponse]
)
def test_every_64_bit_integer_is_a_json_number(message_type: type[Message]) -> None:
    message = message_type()
    integers = _filled(message)
    assert integers  # the messages served have 64-bit integers, nested, repeated and in maps
    document = message_json(message)
    # protobuf's JSON mapping takes numbers for 64-bit integers: nothing is lost or changed.
    assert json_format.ParseDict(json.loads(json.dumps(document)), message_type()) == message
    leaves = _leaves(document)
    for value in integers:
        assert str(value) not in leaves
        assert any(type(leaf) is int and leaf == value for leaf in leaves)
    # The rest is protobuf's JSON mapping: .proto field names, fields with no presence written.
    default = json_format.MessageToDict(
        message, always_print_fields_with_no_presence=True, preserving_proto_field_name=True
    )
    assert [str(leaf) for leaf in _leaves(document)] == [str(leaf) for leaf in _leaves(default)]


def test_fields_at_their_defaults_are_written() -> None:
    document = message_json(mc.ModelConfig(name="m"))
    assert (document["max_batch_size"], document["input"], document["parameters"]) == (0, [], {})
    assert "dynamic_batching" not in document  # a message field has presence


# -- over REST --------------------------------------------------------------------------------


def _http_calls(port: int, calls: Callable[[Any], dict[str, Any]]) -> dict[str, Any]:
    """``calls`` made with a tritonclient.http client, from a thread (it is blocking)."""
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(f"127.0.0.1:{port}")
    try:
        return calls(client)
    finally:
        client.close()


def _rest_answers(client: Any) -> dict[str, Any]:
    answers = {f"config {name}": client.get_model_config(name) for name in EXPECTED_CONFIGS}
    answers |= {f"stats {name}": client.get_inference_statistics(name) for name in EXPECTED_CONFIGS}
    answers["versioned config"] = client.get_model_config("add_sub", "")
    answers["stats"] = client.get_inference_statistics()
    return answers


def _grpc_answers(client: triton.InferenceServerClient) -> dict[str, Any]:
    # Triton's JSON of each message, as the REST endpoint must write it.
    answers = {
        f"config {name}": message_json(client.get_model_config(name).config)
        for name in EXPECTED_CONFIGS
    }
    answers |= {
        f"stats {name}": message_json(client.get_inference_statistics(name))
        for name in EXPECTED_CONFIGS
    }
    answers["versioned config"] = answers["config add_sub"]
    answers["stats"] = message_json(client.get_inference_statistics())
    return answers


async def test_tritonclient_http_reads_what_grpc_does_after_known_traffic(
    server: RunningServer, client: triton.InferenceServerClient
) -> None:
    for n in (1, 2, 3):
        await _in_thread(lambda n=n: client.infer("add_sub", _add_sub_inputs(n)))
    text = triton.InferInput("text", [2], "BYTES")
    text.set_data_from_numpy(np.array([b"a", b"b"], dtype=np.object_))
    await _in_thread(lambda: client.infer("echo", [text]))
    x = triton.InferInput("x", [1], "BYTES")
    x.set_data_from_numpy(np.array([b"s"], dtype=np.object_))
    for start, end in ((True, False), (False, True)):
        await _in_thread(
            lambda start=start, end=end: client.infer(
                "remember", [x], sequence_id=7, sequence_start=start, sequence_end=end
            )
        )

    rest = await _in_thread(lambda: _http_calls(server.http_port, _rest_answers))
    grpc_answers = await _in_thread(lambda: _grpc_answers(client))
    assert rest == grpc_answers

    # The configuration object itself, every field written, 64-bit integers as numbers.
    add_sub, echo = rest["config add_sub"], rest["config echo"]
    assert (add_sub["name"], add_sub["max_batch_size"]) == ("add_sub", 64)
    assert [tensor["dims"] for tensor in add_sub["input"]] == [[16], [16]]
    assert add_sub["dynamic_batching"]["priority_levels"] == 3
    assert (echo["max_batch_size"], echo["platform"], echo["model_warmup"]) == (0, "", [])
    assert "dynamic_batching" not in echo  # a message field unset: no presence, left out
    remember = rest["config remember"]["sequence_batching"]
    assert remember["max_sequence_idle_microseconds"] == 5_000_000
    assert rest["config count"]["model_transaction_policy"] == {"decoupled": True}
    assert rest["config dense"]["model_transaction_policy"] == {"decoupled": False}

    # Counts exact, as numbers, zeros written.
    [stats] = rest["stats add_sub"]["model_stats"]
    inference = stats["inference_stats"]
    assert (stats["name"], stats["version"]) == ("add_sub", "")
    assert (stats["inference_count"], stats["execution_count"]) == (6, 3)
    assert (inference["success"]["count"], inference["fail"]) == (3, {"count": 0, "ns": 0})
    assert inference["compute_input"] == inference["cache_miss"] == {"count": 0, "ns": 0}
    assert [(b["batch_size"], b["compute_infer"]["count"]) for b in stats["batch_stats"]] == [
        (1, 1),
        (2, 1),
        (3, 1),
    ]
    [sequence] = rest["stats remember"]["model_stats"]
    assert (sequence["inference_count"], sequence["inference_stats"]["success"]["count"]) == (2, 2)
    everything = rest["stats"]["model_stats"]
    assert [s["name"] for s in everything] == sorted(EXPECTED_CONFIGS)
    dense = everything[[s["name"] for s in everything].index("dense")]
    assert (dense["last_inference"], dense["inference_count"], dense["batch_stats"]) == (0, 0, [])


async def _get(
    server: RunningServer, path: str, method: str = "GET", **kwargs: Any
) -> httpx.Response:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.http_port}") as http:
        return await http.request(method, path, **kwargs)


_ROUTES = ("/v2/models/add_sub/config", "/v2/models/add_sub/stats", "/v2/models/stats")


async def test_rest_refusals_of_config_and_statistics_are_the_metadata_routes(
    server: RunningServer,
) -> None:
    # An unknown model, version or a malformed one: the status and error model metadata gets.
    for path in ("/v2/models/no_such_model", "/v2/models/add_sub/versions/7"):
        expected = await _get(server, path)
        for action in ("config", "stats"):
            answer = await _get(server, f"{path}/{action}")
            assert (answer.status_code, answer.json()) == (expected.status_code, expected.json())
            assert answer.status_code == 404
            assert answer.headers["content-type"] == "application/json"
    malformed = await _get(server, "/v2/models/add_sub/versions/one/config")
    assert malformed.status_code == 400
    assert "failed to get model version" in malformed.json()["error"]
    assert (await _get(server, "/v2/models/add_sub/versions/one/stats")).json() == (
        malformed.json()
    )

    # A percent-encoded name is the name.
    plain = (await _get(server, "/v2/models/add_sub/config")).json()
    assert (await _get(server, "/v2/models/add%5Fsub/config")).json() == plain
    assert (await _get(server, "/v2/models/st%61ts")).json()["model_stats"]

    for path in _ROUTES:
        # Only GET and HEAD; HEAD is GET's head without its body.
        for method in ("POST", "PUT", "DELETE"):
            refused = await _get(server, path, method, content=b"{}")
            assert (refused.status_code, refused.headers["allow"]) == (405, "GET, HEAD"), path
        got, head = await _get(server, path), await _get(server, path, "HEAD")
        assert (head.status_code, head.content) == (200, b"")
        assert head.headers["content-length"] == got.headers["content-length"]
        # A body on the GET: as on the other GETs, too large is refused unread.
        big = await _get(server, path, content=b" " * (64 * 1024 + 1))
        assert big.status_code == 413, path
        assert (await _get(server, path, content=b"{}")).status_code == 200

    # Near misses are no route.
    for path in (
        "/v2/models/stats/extra",
        "/v2/models/stats/",
        "/v2/models/add_sub/config/",
        "/v2/models/add_sub/configs",
        "/v2/models/add_sub/config/stats",
        "/v2/models/add_sub/versions//stats",
        "/v2/models//stats",
        "/v2/model/stats",
        "/v2/stats",
    ):
        missing = await _get(server, path)
        assert missing.status_code == 404, path
        assert "error" in missing.json()


async def test_the_repository_restriction_leaves_config_and_statistics_open(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    # Triton has restriction groups of their own for these (model-config, statistics); the
    # server restricts only the repository extension.
    server = await _serve(nursery, tmp_path, repository_control_header=("admin-key", "s3cret"))
    index = await _get(server, "/v2/repository/index", "POST")
    assert index.status_code == 403
    for path in _ROUTES:
        assert (await _get(server, path)).status_code == 200, path
    stub = GrpcioClient(server.port)
    try:
        await stub.call("ModelConfig", pb.ModelConfigRequest(name="add_sub"))
        await stub.call("ModelStatistics", pb.ModelStatisticsRequest())
    finally:
        stub.channel.close()


async def test_an_unloaded_models_config_and_statistics_are_unavailable_over_both(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    server = await _serve(
        nursery, tmp_path, model_control_mode=ControlMode.EXPLICIT, load_models=("*",)
    )
    assert (await _get(server, "/v2/repository/models/echo/unload", "POST")).status_code == 200
    stub = GrpcioClient(server.port)
    try:
        config = await stub.error("ModelConfig", pb.ModelConfigRequest(name="echo"))
        statistics = await stub.error("ModelStatistics", pb.ModelStatisticsRequest(name="echo"))
        everything = await stub.call("ModelStatistics", pb.ModelStatisticsRequest())
    finally:
        stub.channel.close()
    assert config.code() == statistics.code() == grpc.StatusCode.UNAVAILABLE
    for action, error in (("config", config), ("stats", statistics)):
        answer = await _get(server, f"/v2/models/echo/{action}")
        assert (answer.status_code, answer.json()) == (503, {"error": error.details()})
    assert (await _get(server, "/v2/models/stats")).json() == message_json(everything)
