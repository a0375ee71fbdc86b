"""The deployment files (Containerfile, deploy/) against the schemas they must meet and the server
they run, offline.

- The Kubernetes manifests are validated strictly (unknown fields are errors) against the
  Kubernetes API schemas that ``kubernetes-validate`` ships, for the oldest release with gRPC
  probes (1.27) and the newest it knows.
- KServe's resources are not in those schemas: their fields are checked against a transcription
  of the parts of KServe's CRDs they use (below), and their containers as Kubernetes containers.
- The image cannot be built here (no container runtime): its entry point is checked against the
  command line the server parses, its ports against the server's defaults, and its wheel is
  built from exactly the files its build stage copies.
- The manifests' options parse with the server's own parser, and the sizes they derive from the
  resource limits keep the rules docs/deploy.md states.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import textwrap
import tomllib
import zipfile
from pathlib import Path
from typing import Any

import grpc
import jsonschema
import kubernetes_validate
import pytest
import trio
import yaml

from tests.support import GrpcioClient, start_server
from trio_infer.cli import _parser
from trio_infer.core.service import LIVENESS_SERVICE
from trio_infer.protobuf._proto import grpc_predict_v2_pb2 as pb
from trio_infer.protobuf._proto import health_pb2
from trio_infer.server import ServerConfig

ROOT = Path(__file__).resolve().parent.parent
CONTAINERFILE = ROOT / "Containerfile"
KUBERNETES = sorted((ROOT / "deploy" / "kubernetes").glob("*.yaml"))
SERVING_RUNTIME = ROOT / "deploy" / "kserve" / "servingruntime.yaml"
INFERENCE_SERVICE = ROOT / "deploy" / "kserve" / "inferenceservice.yaml"
#: gRPC probes are GA (on by default) from 1.27; and the newest release the schemas know.
KUBERNETES_VERSIONS = ["1.27", kubernetes_validate.utils.latest_version()]
MiB = 1024 * 1024
#: The sizing rule of docs/deploy.md: what the server process and each worker hold besides the
#: models and the requests' bytes.
SERVER_MEMORY = 256 * MiB
WORKER_MEMORY = 128 * MiB
#: The server exits within a second of its grace period (README, Configuration).
EXIT_SLACK = 1
#: A pod's terminationGracePeriodSeconds when it sets none.
KUBERNETES_TERMINATION_GRACE = 30

SERVING = health_pb2.HealthCheckResponse.ServingStatus.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.ServingStatus.NOT_SERVING


def _load(path: Path) -> dict[str, Any]:
    document = yaml.safe_load(path.read_text())
    assert isinstance(document, dict)
    return document


def _deployment() -> dict[str, Any]:
    return _load(ROOT / "deploy" / "kubernetes" / "deployment.yaml")


def _container(pod_spec: dict[str, Any]) -> dict[str, Any]:
    (container,) = pod_spec["containers"]
    assert isinstance(container, dict)
    return container


def _instructions(name: str) -> list[str]:
    """The arguments of every ``name`` instruction of the Containerfile, continuation lines
    joined."""
    text = re.sub(r"\\\n\s*", " ", CONTAINERFILE.read_text())
    return [
        line.split(None, 1)[1]
        for line in text.splitlines()
        if line.split(None, 1)[:1] == [name] and not line.startswith("#")
    ]


def _entry_point() -> list[str]:
    (entry_point,) = _instructions("ENTRYPOINT")
    command = json.loads(entry_point)  # the exec form: no shell between it and the signals
    assert isinstance(command, list)
    return command


def _serve_args(container: dict[str, Any]) -> Any:
    """The container's command line as ``trio-infer serve`` parses it."""
    command = container.get("command", _entry_point())
    assert command[:2] == ["trio-infer", "serve"]
    return _parser().parse_args(command[1:] + container.get("args", []))


def _bytes(quantity: str) -> int:
    units = {"Mi": MiB, "Gi": 1024 * MiB}
    return int(quantity[:-2]) * units[quantity[-2:]]


# -- Kubernetes ------------------------------------------------------------------------------


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("path", KUBERNETES, ids=lambda path: path.name)
def test_the_kubernetes_manifests_are_valid(path: Path, version: str) -> None:
    kubernetes_validate.validate(_load(path), version, strict=True)


def test_the_validation_is_strict_and_offline() -> None:
    deployment = _deployment()
    _container(deployment["spec"]["template"]["spec"])["readinessProbe"]["grpc"]["sevrice"] = ""
    with pytest.raises(kubernetes_validate.ValidationError, match="sevrice"):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSIONS[0], strict=True)


def test_the_ports_and_probes_are_the_servers() -> None:
    defaults = ServerConfig()
    deployment = _deployment()
    pod = deployment["spec"]["template"]["spec"]
    container = _container(pod)
    args = _serve_args(container)
    assert (args.grpc_port, args.http_port) == (defaults.grpc_port, defaults.http_port)
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert ports == {"http": defaults.http_port, "grpc": defaults.grpc_port}
    # Readiness: the server (service ""); liveness and start-up: the liveness service.
    assert container["readinessProbe"]["grpc"] == {"port": defaults.grpc_port}
    for probe in ("livenessProbe", "startupProbe"):
        grpc_probe = container[probe]["grpc"]
        assert grpc_probe == {"port": defaults.grpc_port, "service": LIVENESS_SERVICE}
    # The Services name the container's ports, and select the Deployment's pods.
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    for name in ("service.yaml", "service-headless.yaml"):
        service = _load(ROOT / "deploy" / "kubernetes" / name)["spec"]
        assert service["selector"].items() <= labels.items()
        for port in service["ports"]:
            assert ports[port["targetPort"]] == port["port"]
    headless = _load(ROOT / "deploy" / "kubernetes" / "service-headless.yaml")["spec"]
    assert headless["clusterIP"] == "None"


@pytest.mark.parametrize("manifest", ["deployment", "servingruntime"])
def test_the_termination_grace_period_covers_the_drain(manifest: str) -> None:
    if manifest == "deployment":
        pod = _deployment()["spec"]["template"]["spec"]
        container = _container(pod)
        pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
        assert pre_stop[0] == "sleep"
        hook = int(pre_stop[1])
        termination_grace = pod["terminationGracePeriodSeconds"]
    else:
        # Knative refuses a container's lifecycle hooks, and a ServingRuntime sets no grace:
        # its pods get Kubernetes' default.
        pod = _load(SERVING_RUNTIME)["spec"]
        container = _container(pod)
        assert "lifecycle" not in container
        assert "terminationGracePeriodSeconds" not in pod
        hook = 0
        termination_grace = KUBERNETES_TERMINATION_GRACE
    # The kubelet's countdown starts with the preStop hook; the drain starts after it.
    needed = hook + _serve_args(container).grace_period + EXIT_SLACK
    assert needed <= termination_grace <= needed + 10


@pytest.mark.parametrize("manifest", ["deployment", "servingruntime"])
def test_workers_and_the_memory_budget_follow_the_resource_limits(manifest: str) -> None:
    if manifest == "deployment":
        container = _container(_deployment()["spec"]["template"]["spec"])
    else:
        container = _container(_load(SERVING_RUNTIME)["spec"])
    args = _serve_args(container)
    limits = container["resources"]["limits"]
    assert container["resources"]["requests"] == limits  # Guaranteed: evicted last
    # One worker per core: os.cpu_count() in a container is the node's.
    assert args.workers == int(limits["cpu"])
    # The default budget (a quarter of the machine's memory) is the node's: it is set, and by
    # the rule of docs/deploy.md it is at most what is left with no model at all.
    assert args.memory_budget != ServerConfig().memory_budget
    left = _bytes(limits["memory"]) - SERVER_MEMORY - args.workers * WORKER_MEMORY
    assert 0 < args.memory_budget <= left // 2
    assert args.max_connection_age is not None
    assert args.max_connection_age_grace is not None


# -- KServe ----------------------------------------------------------------------------------
# KServe's CRDs (config/crd/full/serving.kserve.io_servingruntimes.yaml and
# serving.kserve.io_inferenceservices.yaml, kserve/kserve at aaac4e2, August 2026): the fields
# these manifests use, with their types and required fields as the CRDs declare them. The CRDs
# are structural, so the API server would silently drop an unknown (misspelt) field: here it is
# an error. The containers' schema is Kubernetes' Container, checked with kubernetes-validate.


def _object(properties: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": list(required),
        "additionalProperties": False,
    }


_STRING = {"type": "string"}
_METADATA = _object({"name": _STRING, "namespace": _STRING}, ("name",))
SERVING_RUNTIME_SCHEMA = _object(
    {
        "apiVersion": {"const": "serving.kserve.io/v1alpha1"},
        "kind": {"const": "ServingRuntime"},
        "metadata": _METADATA,
        "spec": _object(
            {
                "annotations": {"type": "object", "additionalProperties": _STRING},
                "supportedModelFormats": {
                    "type": "array",
                    "items": _object(
                        {
                            "name": _STRING,
                            "version": _STRING,
                            "autoSelect": {"type": "boolean"},
                            "priority": {"type": "integer", "minimum": 1},
                        },
                        ("name",),
                    ),
                },
                "protocolVersions": {
                    "type": "array",
                    "items": {"enum": ["v1", "v2", "grpc-v1", "grpc-v2"]},
                },
                "containers": {"type": "array", "items": {"type": "object"}, "minItems": 1},
            },
            ("containers",),
        ),
    },
    ("apiVersion", "kind", "metadata", "spec"),
)
INFERENCE_SERVICE_SCHEMA = _object(
    {
        "apiVersion": {"const": "serving.kserve.io/v1beta1"},
        "kind": {"const": "InferenceService"},
        "metadata": _METADATA,
        "spec": _object(
            {
                "predictor": _object(
                    {
                        "model": _object(
                            {
                                "modelFormat": _object(
                                    {"name": _STRING, "version": _STRING}, ("name",)
                                ),
                                "runtime": _STRING,
                                "protocolVersion": {"enum": ["v1", "v2", "grpc-v1", "grpc-v2"]},
                                "storageUri": _STRING,
                            }
                        )
                    }
                )
            },
            ("predictor",),
        ),
    },
    ("apiVersion", "kind", "metadata", "spec"),
)


def test_the_serving_runtime_is_valid() -> None:
    runtime = _load(SERVING_RUNTIME)
    jsonschema.validate(runtime, SERVING_RUNTIME_SCHEMA)
    container = _container(runtime["spec"])
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "x"},
        "spec": {"containers": runtime["spec"]["containers"]},
    }
    for version in KUBERNETES_VERSIONS:
        kubernetes_validate.validate(pod, version, strict=True)
    # KServe finds the container that serves the model by this name.
    assert container["name"] == "kserve-container"


def test_the_serving_runtime_serves_v2_on_both_ports_for_the_built_in_formats() -> None:
    defaults = ServerConfig()
    spec = _load(SERVING_RUNTIME)["spec"]
    assert spec["protocolVersions"] == ["v2", "grpc-v2"]
    assert {f["name"] for f in spec["supportedModelFormats"]} == {"sklearn", "xgboost", "onnx"}
    container = _container(spec)
    # The image's command, on the folder KServe's storage initializer fills.
    assert container["command"] == [*_entry_point()[:2], "/mnt/models"]
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    # KServe exposes ports named grpc (or h2c) as HTTP/2.
    assert ports == {"http1": defaults.http_port, "grpc": defaults.grpc_port}
    assert container["readinessProbe"]["grpc"] == {"port": defaults.grpc_port}
    assert container["livenessProbe"]["grpc"]["service"] == LIVENESS_SERVICE
    annotations = spec["annotations"]
    assert annotations["prometheus.kserve.io/port"] == str(defaults.http_port)
    assert annotations["prometheus.kserve.io/path"] == "/metrics"


def test_the_inference_service_is_valid_and_uses_the_runtime() -> None:
    service = _load(INFERENCE_SERVICE)
    jsonschema.validate(service, INFERENCE_SERVICE_SCHEMA)
    model = service["spec"]["predictor"]["model"]
    runtime = _load(SERVING_RUNTIME)
    assert model["runtime"] == runtime["metadata"]["name"]
    formats = {f["name"] for f in runtime["spec"]["supportedModelFormats"]}
    assert model["modelFormat"]["name"] in formats
    assert model["protocolVersion"] in runtime["spec"]["protocolVersions"]


@pytest.mark.parametrize("schema", [SERVING_RUNTIME_SCHEMA, INFERENCE_SERVICE_SCHEMA])
def test_the_kserve_schemas_refuse_a_misspelt_field(schema: dict[str, Any]) -> None:
    path = SERVING_RUNTIME if schema is SERVING_RUNTIME_SCHEMA else INFERENCE_SERVICE
    document = _load(path)
    document["spec"]["protocolVersionz"] = ["v2"]
    with pytest.raises(jsonschema.ValidationError, match="protocolVersionz"):
        jsonschema.validate(document, schema)


# -- the image -------------------------------------------------------------------------------


def test_the_entry_point_is_the_readmes_serve_command() -> None:
    readme = (ROOT / "README.md").read_text()
    # The README's command line, with the repository the image mounts at /models.
    assert "`trio-infer serve [REPOSITORY] [options]`" in readme
    assert _entry_point() == ["trio-infer", "serve", "/models"]
    assert "trio-infer serve /models" in (ROOT / "docs" / "deploy.md").read_text()
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["trio-infer"] == "trio_infer.cli:main"
    args = _parser().parse_args(_entry_point()[1:])
    assert args.repository == Path("/models")


def test_the_image_exposes_the_servers_ports_as_a_non_root_user() -> None:
    defaults = ServerConfig()
    (exposed,) = _instructions("EXPOSE")
    assert sorted(int(port) for port in exposed.split()) == sorted(
        [defaults.http_port, defaults.grpc_port]
    )
    users = _instructions("USER")
    assert users
    assert users[-1].split(":")[0] not in ("0", "root")
    # The manifests run as that user.
    pod = _deployment()["spec"]["template"]["spec"]
    assert str(pod["securityContext"]["runAsUser"]) == users[-1].split(":")[0]


def test_the_images_extras_are_the_packages_and_cover_the_serving_runtime() -> None:
    (extras,) = (arg for arg in _instructions("ARG") if arg.startswith("EXTRAS="))
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    names = extras.removeprefix("EXTRAS=").split(",")
    assert set(names) <= declared.keys()
    formats = {f["name"] for f in _load(SERVING_RUNTIME)["spec"]["supportedModelFormats"]}
    assert formats <= set(names)


def test_the_wheel_builds_from_what_the_build_stage_copies(tmp_path: Path) -> None:
    # Each COPY of the build stage (`COPY a b ./` or `COPY a ./a`), into a bare folder: the
    # wheel must build from those files alone, as in the image.
    build_stage = re.split(r"^FROM ", CONTAINERFILE.read_text(), flags=re.MULTILINE)[1]
    sources: list[str] = []
    for line in build_stage.splitlines():
        if line.startswith("COPY ") and "--from" not in line:
            sources += line.split()[1:-1]
    assert sources
    context = tmp_path / "context"
    for source in sources:
        if (ROOT / source).is_dir():
            shutil.copytree(
                ROOT / source, context / source, ignore=shutil.ignore_patterns("__pycache__")
            )
        else:
            context.mkdir(exist_ok=True)
            shutil.copy(ROOT / source, context / source)
    # Without build isolation: the test's setuptools, no download.
    subprocess.run(
        [
            *(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"),
            *("--wheel-dir", str(tmp_path / "wheels"), str(context)),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = (tmp_path / "wheels").glob("trio_infer-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
        assert "trio-infer = trio_infer.cli:main" in archive.read(entry_points).decode()
    assert "trio_infer/examples/add_sub/model-settings.json" in names
    assert "trio_infer/py.typed" in names
    # The ignore files let exactly those sources into the build context.
    for ignore in (".containerignore", ".dockerignore"):
        lines = (ROOT / ignore).read_text().splitlines()
        included = {line[1:].rstrip("/") for line in lines if line.startswith("!")}
        assert included == set(sources)
        assert "*" in lines


# -- the liveness health service ---------------------------------------------------------------

BROKEN = textwrap.dedent(
    """
    from trio_infer import Model


    class Broken(Model):
        def load(self):
            raise RuntimeError("this model cannot load")

        def predict(self, inputs, parameters):
            return dict(inputs)
    """
)


async def test_liveness_is_serving_while_a_broken_model_keeps_the_server_unready(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    folder = tmp_path / "repository" / "broken"
    folder.mkdir(parents=True)
    (folder / "model-settings.json").write_text(json.dumps({"implementation": "broken.Broken"}))
    (folder / "broken.py").write_text(BROKEN)
    server = await start_server(nursery, tmp_path / "repository", wait_ready=False, workers=1)
    client = GrpcioClient(server.port)
    try:
        check = health_pb2.HealthCheckRequest
        live = await client.call_health("Check", check(service=LIVENESS_SERVICE))
        assert live.status == SERVING
        ready = await client.call_health("Check", check(service=""))
        assert ready.status == NOT_SERVING
        assert (await client.call("ServerLive", pb.ServerLiveRequest())).live
        # An unknown name is still unknown: only the liveness name was added.
        error = await client.error_health("Check", check(service="no-such-service"))
        assert error.code() == grpc.StatusCode.NOT_FOUND  # type: ignore[attr-defined]
    finally:
        client.channel.close()
