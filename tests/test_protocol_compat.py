"""Our protocol must be wire-identical to Triton's, message by message and method by method.

Third-party clients (tritonclient, KServe's SDK, anything generated from Triton's
grpc_service.proto) only interoperate if every message we define has exactly their field names,
numbers, types, labels, oneofs and map shapes, every enum their value names and numbers, and
every method we serve has their name, types and streaming flags. tritonclient ships Triton's
descriptors (grpc_service.proto and the model_config.proto it imports), so we compare against
them.

Each side is loaded in a subprocess of its own, which prints its serialized
``FileDescriptorProto``; here they are only parsed as plain messages, never registered, so what
is compared does not depend on which copies of the protocol this process has imported.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from typing import Any

import pytest
from google.protobuf import descriptor_pb2

_DUMP = textwrap.dedent(
    """
    import sys
    from google.protobuf import descriptor_pb2
    import {module} as m
    proto = descriptor_pb2.FileDescriptorProto()
    m.DESCRIPTOR.CopyToProto(proto)
    sys.stdout.write(proto.SerializeToString().hex())
    """
)


def _load(module: str) -> descriptor_pb2.FileDescriptorProto:
    result = subprocess.run(
        [sys.executable, "-c", _DUMP.format(module=module)],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert result.returncode == 0, f"importing {module} failed:\n{result.stderr}"
    proto = descriptor_pb2.FileDescriptorProto()
    proto.ParseFromString(bytes.fromhex(result.stdout))
    return proto


@pytest.fixture(scope="module")
def ours() -> descriptor_pb2.FileDescriptorProto:
    return _load("trio_infer.protobuf._proto.grpc_predict_v2_pb2")


@pytest.fixture(scope="module")
def triton() -> descriptor_pb2.FileDescriptorProto:
    # Only read from a subprocess: importing it here would register Triton's inference.* in
    # this process. tritonclient is a test dependency, so its absence fails the test.
    return _load("tritonclient.grpc.service_pb2")


@pytest.fixture(scope="module")
def ours_config() -> descriptor_pb2.FileDescriptorProto:
    return _load("trio_infer.protobuf._proto.model_config_pb2")


@pytest.fixture(scope="module")
def triton_config() -> descriptor_pb2.FileDescriptorProto:
    return _load("tritonclient.grpc.model_config_pb2")


def _messages(messages: Any, prefix: str) -> dict[str, descriptor_pb2.DescriptorProto]:
    """Flatten messages, nested ones included, keyed by fully qualified name."""
    found: dict[str, descriptor_pb2.DescriptorProto] = {}
    for message in messages:
        name = f"{prefix}.{message.name}"
        found[name] = message
        found.update(_messages(message.nested_type, name))
    return found


def _enums(
    file: descriptor_pb2.FileDescriptorProto,
) -> dict[str, dict[str, int]]:
    """Every enum of a file, nested ones included, keyed by fully qualified name: its values'
    numbers by name."""
    found = {f".{file.package}.{enum.name}": enum for enum in file.enum_type}
    for name, message in _messages(file.message_type, f".{file.package}").items():
        found.update({f"{name}.{enum.name}": enum for enum in message.enum_type})
    return {name: {v.name: v.number for v in enum.value} for name, enum in found.items()}


def _field_signature(
    message: descriptor_pb2.DescriptorProto,
) -> dict[str, tuple[object, ...]]:
    """What decides a field's wire format and generated API, keyed by field name."""
    signature: dict[str, tuple[object, ...]] = {}
    for field in message.field:
        oneof = (
            message.oneof_decl[field.oneof_index].name if field.HasField("oneof_index") else None
        )
        signature[field.name] = (
            field.number,
            descriptor_pb2.FieldDescriptorProto.Type.Name(field.type),
            descriptor_pb2.FieldDescriptorProto.Label.Name(field.label),
            field.type_name,
            oneof,
            field.proto3_optional,
        )
    return signature


def test_same_package(
    ours: descriptor_pb2.FileDescriptorProto, triton: descriptor_pb2.FileDescriptorProto
) -> None:
    assert ours.package == triton.package == "inference"
    assert ours.syntax == triton.syntax == "proto3"


def _differences(
    ours: descriptor_pb2.FileDescriptorProto, triton: descriptor_pb2.FileDescriptorProto
) -> list[str]:
    """How the messages and enums ``ours`` defines differ from Triton's of the same names (what
    Triton has and we do not define is not a difference)."""
    ours_by_name = _messages(ours.message_type, f".{ours.package}")
    triton_by_name = _messages(triton.message_type, f".{triton.package}")
    problems: list[str] = []
    for name, message in ours_by_name.items():
        theirs = triton_by_name.get(name)
        if theirs is None:
            problems.append(f"{name}: Triton has no such message")
            continue
        if message.options.map_entry != theirs.options.map_entry:
            problems.append(f"{name}: map_entry {message.options.map_entry} vs Triton's")
        mine, reference = _field_signature(message), _field_signature(theirs)
        for field in sorted(mine.keys() | reference.keys()):
            if mine.get(field) != reference.get(field):
                problems.append(
                    f"{name}.{field}: ours {mine.get(field)} != Triton {reference.get(field)}"
                )
        if [o.name for o in message.oneof_decl] != [o.name for o in theirs.oneof_decl]:
            problems.append(f"{name}: oneofs differ")
        if sorted(e.name for e in message.enum_type) != sorted(e.name for e in theirs.enum_type):
            problems.append(f"{name}: nested enums differ")
    triton_enums = _enums(triton)
    for name, values in _enums(ours).items():
        if values != triton_enums.get(name):
            problems.append(f"{name}: ours {values} != Triton {triton_enums.get(name)}")
    return problems


def test_every_message_matches_triton(
    ours: descriptor_pb2.FileDescriptorProto, triton: descriptor_pb2.FileDescriptorProto
) -> None:
    problems = _differences(ours, triton)
    assert not problems, "\n".join(problems)
    # Guard the comparison itself: it must have looked at the whole protocol.
    ours_by_name = _messages(ours.message_type, f".{ours.package}")
    for required in (
        ".inference.ModelInferRequest.InferInputTensor",
        ".inference.ModelInferResponse.InferOutputTensor",
        ".inference.InferParameter",
        ".inference.InferTensorContents",
        ".inference.ModelStreamInferResponse",
        ".inference.RepositoryModelLoadRequest.ParametersEntry",
        ".inference.ModelConfigResponse",
        ".inference.ModelStatisticsResponse",
        ".inference.ModelStatistics.ResponseStatsEntry",
        ".inference.InferBatchStatistics",
    ):
        assert required in ours_by_name


def test_model_config_matches_triton(
    ours_config: descriptor_pb2.FileDescriptorProto,
    triton_config: descriptor_pb2.FileDescriptorProto,
) -> None:
    assert ours_config.package == triton_config.package == "inference"
    assert ours_config.syntax == triton_config.syntax == "proto3"
    problems = _differences(ours_config, triton_config)
    assert not problems, "\n".join(problems)
    # A config carries whatever Triton's ModelConfig may hold: every message and enum it
    # reaches, through fields and nesting, is defined here too.
    theirs = _messages(triton_config.message_type, f".{triton_config.package}")
    triton_enums = _enums(triton_config)
    reached: set[str] = set()
    pending = [".inference.ModelConfig"]
    while pending:
        name = pending.pop()
        if name in reached:
            continue
        reached.add(name)
        if name in theirs:
            pending.extend(f.type_name for f in theirs[name].field if f.type_name)
            pending.extend(f"{name}.{nested.name}" for nested in theirs[name].nested_type)
            pending.extend(f"{name}.{enum.name}" for enum in theirs[name].enum_type)
    defined = _messages(ours_config.message_type, f".{ours_config.package}").keys()
    missing = sorted(reached - defined - _enums(ours_config).keys())
    assert not missing, f"Triton's ModelConfig reaches what we do not define: {missing}"
    assert ".inference.DataType" in reached & triton_enums.keys()
    assert ".inference.ModelSequenceBatching.Control.Kind" in reached


def test_the_services_model_config_is_the_model_config_protos(
    ours: descriptor_pb2.FileDescriptorProto, triton: descriptor_pb2.FileDescriptorProto
) -> None:
    # Both import their model_config.proto (ours under its package path) for ModelConfig.
    assert [d.rsplit("/", 1)[-1] for d in ours.dependency] == list(triton.dependency)
    assert list(triton.dependency) == ["model_config.proto"]
    [config] = [f for m in ours.message_type if m.name == "ModelConfigResponse" for f in m.field]
    assert config.type_name == ".inference.ModelConfig"


def test_service_methods_match_triton(
    ours: descriptor_pb2.FileDescriptorProto, triton: descriptor_pb2.FileDescriptorProto
) -> None:
    [service] = ours.service
    [reference] = [s for s in triton.service if s.name == service.name]
    assert service.name == "GRPCInferenceService"
    theirs = {m.name: m for m in reference.method}
    for method in service.method:
        assert method.name in theirs, f"Triton has no method {method.name}"
        other = theirs[method.name]
        assert (
            method.input_type,
            method.output_type,
            method.client_streaming,
            method.server_streaming,
        ) == (
            other.input_type,
            other.output_type,
            other.client_streaming,
            other.server_streaming,
        ), method.name
    assert [m.name for m in service.method] == [
        "ServerLive",
        "ServerReady",
        "ModelReady",
        "ServerMetadata",
        "ModelMetadata",
        "ModelInfer",
        "ModelStreamInfer",
        "ModelConfig",
        "ModelStatistics",
        "RepositoryIndex",
        "RepositoryModelLoad",
        "RepositoryModelUnload",
    ]


def test_health_matches_grpc_health_v1() -> None:
    # The standard's numbers, spelled out, and grpcio-health-checking's own descriptor.
    proto = _load("trio_infer.protobuf._proto.health_pb2")
    reference = _load("grpc_health.v1.health_pb2")
    assert proto.package == reference.package == "grpc.health.v1"
    assert [m.SerializeToString() for m in proto.message_type] == [
        m.SerializeToString() for m in reference.message_type
    ]
    assert [s.SerializeToString() for s in proto.service] == [
        s.SerializeToString() for s in reference.service
    ]
    messages = _messages(proto.message_type, ".grpc.health.v1")
    assert _field_signature(messages[".grpc.health.v1.HealthCheckRequest"]) == {
        "service": (1, "TYPE_STRING", "LABEL_OPTIONAL", "", None, False)
    }
    response = messages[".grpc.health.v1.HealthCheckResponse"]
    assert _field_signature(response) == {
        "status": (
            1,
            "TYPE_ENUM",
            "LABEL_OPTIONAL",
            ".grpc.health.v1.HealthCheckResponse.ServingStatus",
            None,
            False,
        )
    }
    [enum] = response.enum_type
    assert {v.name: v.number for v in enum.value} == {
        "UNKNOWN": 0,
        "SERVING": 1,
        "NOT_SERVING": 2,
        "SERVICE_UNKNOWN": 3,
    }
    [service] = proto.service
    assert service.name == "Health"
    assert [
        (m.name, m.input_type, m.output_type, m.client_streaming, m.server_streaming)
        for m in service.method
    ] == [
        (
            "Check",
            ".grpc.health.v1.HealthCheckRequest",
            ".grpc.health.v1.HealthCheckResponse",
            False,
            False,
        ),
        (
            "Watch",
            ".grpc.health.v1.HealthCheckRequest",
            ".grpc.health.v1.HealthCheckResponse",
            False,
            True,
        ),
    ]
