"""The committed modules in trio_infer/protobuf/_proto/ are exactly what protos/generate.py writes.

Editing a .proto without regenerating, or regenerating with a different grpcio-tools, fails here.
The fix is always ``python protos/generate.py`` with the pinned test dependencies installed.

The generated messages live in trio_infer's private descriptor pool (see
``trio_infer/protobuf/_pool.py``); the tests here check that they are there and not in protobuf's
default pool, under each protobuf backend, and that they pickle as their own classes. Sharing a
process with other copies of the protocol is tests/test_coexistence.py's.
"""

from __future__ import annotations

import copy
import importlib.metadata
import importlib.util
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest
from google.protobuf import descriptor_pb2

from trio_infer.protobuf._proto import grpc_predict_v2_pb2 as pb
from trio_infer.protobuf._proto import health_pb2

REPO_ROOT = Path(__file__).resolve().parent.parent
GENERATED_DIR = REPO_ROOT / "trio_infer" / "protobuf" / "_proto"


def _generate_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "_trio_infer_generate", REPO_ROOT / "protos" / "generate.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


generate = _generate_module()


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("regenerated")
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "protos" / "generate.py"), "--output-root", str(out)],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    return out


@pytest.mark.parametrize("relative", generate.expected_files())
def test_committed_code_is_current(regenerated: Path, relative: str) -> None:
    fresh = (regenerated / relative).read_bytes()
    committed_path = REPO_ROOT / relative
    assert committed_path.is_file(), f"{relative} is missing: run python protos/generate.py"
    tools = importlib.metadata.version("grpcio-tools")
    assert committed_path.read_bytes() == fresh, (
        f"{relative} is stale or was generated with another grpcio-tools (installed: {tools});"
        " run python protos/generate.py"
    )


def test_no_stray_generated_files() -> None:
    expected = {Path(name).name for name in generate.expected_files()} | {"__init__.py"}
    present = {p.name for p in GENERATED_DIR.iterdir() if p.name != "__pycache__"}
    assert present == expected


_IMPORT_ALL = textwrap.dedent(
    """
    import importlib
    import sys

    from google.protobuf import descriptor_pool
    from google.protobuf.internal import api_implementation

    from trio_infer.protobuf import _pool

    assert api_implementation.Type() == sys.argv[1], api_implementation.Type()
    for name in sys.argv[2:]:
        module = importlib.import_module(name)
        if name.endswith("_pb2"):
            assert module.DESCRIPTOR.pool is _pool.POOL, name
            assert _pool.POOL.FindFileByName(module.DESCRIPTOR.name) is module.DESCRIPTOR
            if sys.argv[1] == "upb":
                # The pure-Python backend's builder also records the classes in the default
                # pool (see trio_infer/protobuf/_pool.py); upb leaves it alone.
                try:
                    descriptor_pool.Default().FindFileByName(module.DESCRIPTOR.name)
                except KeyError:
                    pass
                else:
                    raise AssertionError(f"{name} is in the default pool")
    """
)


@pytest.mark.parametrize("backend", ["upb", "python"])
def test_generated_modules_import_cleanly_into_the_private_pool(backend: str) -> None:
    # In a fresh interpreter with warnings as errors: the protobuf gencode/runtime version check
    # and grpcio's generated-version check both run at import time, and the purerpc stubs import
    # their messages by package-absolute name.
    modules = [
        "trio_infer.protobuf._proto." + Path(name).name.removesuffix(".py")
        for name in generate.expected_files()
        if name.endswith(".py")
    ]
    result = subprocess.run(
        [sys.executable, "-W", "error", "-c", _IMPORT_ALL, backend, *modules],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
        env=os.environ | {"PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION": backend},
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("protocol", range(2, pickle.HIGHEST_PROTOCOL + 1))
def test_messages_pickle_and_copy_as_their_own_classes(protocol: int) -> None:
    # Nested messages included: protobuf would pickle those by full name, to be looked up in
    # the default pool, where ours are not.
    tensor = pb.ModelInferRequest.InferInputTensor(name="x", datatype="FP32", shape=[2])
    tensor.parameters["unit"].string_param = "m"
    request = pb.ModelInferRequest(model_name="m", inputs=[tensor], raw_input_contents=[b"ab"])
    messages = [
        request,
        tensor,
        tensor.parameters["unit"],
        pb.ModelInferRequest.ParametersEntry(key="k", value=pb.InferParameter(bool_param=True)),
        pb.ModelMetadataResponse.TensorMetadata(name="y", shape=[-1]),
        pb.RepositoryIndexResponse.ModelIndex(name="m", state="READY"),
        health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING),
    ]
    for message in messages:
        for copied in (
            pickle.loads(pickle.dumps(message, protocol=protocol)),
            copy.copy(message),
            copy.deepcopy(message),
        ):
            assert type(copied) is type(message)
            assert copied == message
            assert copied is not message


def test_rewriting_needs_protocs_output_exactly() -> None:
    committed = (GENERATED_DIR / "health_pb2.py").read_text(encoding="utf-8")
    # Already rewritten: the default-pool line is gone, so a second rewrite is refused.
    with pytest.raises(SystemExit, match="once, found 0 times"):
        generate.use_private_pool(committed, "health.proto")


def test_a_proto_importing_a_file_from_outside_protos_is_refused() -> None:
    files = descriptor_pb2.FileDescriptorSet()
    ours = files.file.add(name=f"{generate.PACKAGE_PATH}/health.proto")
    files.file.add(
        name=f"{generate.PACKAGE_PATH}/grpc_predict_v2.proto",
        dependency=[ours.name, "google/protobuf/timestamp.proto"],
    )
    with pytest.raises(
        SystemExit, match=r"grpc_predict_v2.proto imports google/protobuf/timestamp"
    ):
        generate.check_dependencies(files.SerializeToString())
    del files.file[1].dependency[1]
    generate.check_dependencies(files.SerializeToString())
