"""trio_infer's protocol modules share a process with other libraries' copies of the protocol.

tritonclient, MLServer and grpcio-health-checking each register the same full names
(``inference.ModelInferRequest``, ``grpc.health.v1.HealthCheckRequest``) in protobuf's default
descriptor pool; ours are in a private pool (``trio_infer/protobuf/_pool.py``), so each library
loads, in either order, and their messages and ours still parse each other's bytes.

Import order decides what happens, so every case runs in a fresh interpreter. tritonclient and
MLServer cannot be imported into one process together whatever trio_infer does (they collide with
each other), so each is paired with trio_infer separately. The worker cases load such a library
from a model's ``load()`` in a real server's worker process, as a model written for another V2
server would.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import trio

from tests.support import GrpcioClient, start_server
from trio_infer.protobuf import codec
from trio_infer.protobuf._proto import grpc_predict_v2_pb2 as pb

#: Run in a fresh interpreter with the parties to import, in order, as arguments. Each party is
#: imported whole, then each one's messages are built, serialised and parsed by the other side.
#: Prints a JSON report; any failed check exits non-zero.
_SCRIPT = textwrap.dedent(
    r'''
    import importlib
    import json
    import pickle
    import sys
    import warnings

    import numpy as np

    X = np.array([[1.5, -2.0, 0.25]], dtype=np.float32)


    def import_trio_infer():
        import trio_infer.client
        import trio_infer.server

        for name in ("grpc_predict_v2", "health"):
            for suffix in ("_pb2", "_pb2_grpc", "_grpc"):
                importlib.import_module(f"trio_infer.protobuf._proto.{name}{suffix}")


    def import_tritonclient():
        import tritonclient.grpc


    def import_mlserver():
        import mlserver
        import mlserver.grpc.dataplane_pb2


    def import_grpc_health():
        import grpc_health.v1.health
        import grpc_health.v1.health_pb2_grpc


    for party in sys.argv[1:]:
        globals()["import_" + party]()

    from google.protobuf import descriptor_pool

    from trio_infer.protobuf import codec
    from trio_infer.protobuf._proto import grpc_predict_v2_pb2 as pb
    from trio_infer.protobuf._proto import health_pb2


    def ours_parsing(theirs_bytes):
        """Our reading of another library's serialised request: the decoded x."""
        request = pb.ModelInferRequest.FromString(theirs_bytes)
        return codec.decode_inputs(request)["x"].tolist()


    def our_request():
        request = pb.ModelInferRequest(model_name="m", id="ours")
        codec.encode_inputs(request, [("x", X)], raw=True)
        return request.SerializeToString()


    def default_pool_file(name):
        try:
            return descriptor_pool.Default().FindMessageTypeByName(name).file.name
        except KeyError:
            return None


    tensor = pb.ModelInferRequest.InferInputTensor(name="x", shape=[1, 3])
    unpickled = pickle.loads(pickle.dumps(tensor))
    report = {
        "ours": {
            "request": ours_parsing(our_request()),
            "nested_pickle_same_class": type(unpickled) is type(tensor) and unpickled == tensor,
        },
        "default_pool": {
            "inference.ModelInferRequest": default_pool_file("inference.ModelInferRequest"),
            "grpc.health.v1.HealthCheckRequest": default_pool_file(
                "grpc.health.v1.HealthCheckRequest"
            ),
        },
    }

    if "tritonclient" in sys.argv:
        from tritonclient.grpc import service_pb2

        theirs = service_pb2.ModelInferRequest(
            model_name="m",
            inputs=[
                service_pb2.ModelInferRequest.InferInputTensor(
                    name="x", datatype="FP32", shape=[1, 3]
                )
            ],
            raw_input_contents=[X.tobytes()],
        )
        parsed = service_pb2.ModelInferRequest.FromString(our_request())
        report["tritonclient"] = {
            "ours_parsing_theirs": ours_parsing(theirs.SerializeToString()),
            "theirs_parsing_ours": np.frombuffer(parsed.raw_input_contents[0], np.float32)
            .reshape(tuple(parsed.inputs[0].shape))
            .tolist(),
        }

    if "mlserver" in sys.argv:
        from mlserver.grpc.converters import ModelInferRequestConverter
        from mlserver.types import InferenceRequest, RequestInput

        theirs = ModelInferRequestConverter.from_types(
            InferenceRequest(
                inputs=[
                    RequestInput(name="x", shape=[1, 3], datatype="FP32", data=X.ravel().tolist())
                ]
            ),
            model_name="m",
        )
        typed = pb.ModelInferRequest(model_name="m")
        codec.encode_inputs(typed, [("x", X)], raw=False)
        with warnings.catch_warnings():
            # MLServer's converter calls pydantic's deprecated construct(): its warning.
            warnings.simplefilter("ignore", DeprecationWarning)
            back = ModelInferRequestConverter.to_types(
                type(theirs).FromString(typed.SerializeToString())
            )
        report["mlserver"] = {
            "ours_parsing_theirs": ours_parsing(theirs.SerializeToString()),
            "theirs_parsing_ours": {
                "name": back.inputs[0].name,
                "shape": list(back.inputs[0].shape),
                "data": list(back.inputs[0].data.root),
            },
        }

    if "grpc_health" in sys.argv:
        from grpc_health.v1 import health_pb2 as their_health

        theirs = their_health.HealthCheckRequest(service="inference.GRPCInferenceService")
        ours = health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)
        report["grpc_health"] = {
            "ours_parsing_theirs": health_pb2.HealthCheckRequest.FromString(
                theirs.SerializeToString()
            ).service,
            "theirs_parsing_ours": their_health.HealthCheckResponse.ServingStatus.Name(
                their_health.HealthCheckResponse.FromString(ours.SerializeToString()).status
            ),
        }

    print(json.dumps(report))
    '''
)

X = [[1.5, -2.0, 0.25]]

#: Where protobuf's default pool finds each name once a library is imported: that library's
#: copy (so it really loaded), never ours.
_DEFAULT_POOL_FILES = {
    "tritonclient": {"inference.ModelInferRequest": "grpc_service.proto"},
    "mlserver": {"inference.ModelInferRequest": "dataplane.proto"},
    "grpc_health": {"grpc.health.v1.HealthCheckRequest": "grpc_health/v1/health.proto"},
}

_EXPECTED = {
    "tritonclient": {"ours_parsing_theirs": X, "theirs_parsing_ours": X},
    "mlserver": {
        "ours_parsing_theirs": X,
        "theirs_parsing_ours": {"name": "x", "shape": [1, 3], "data": X[0]},
    },
    "grpc_health": {
        "ours_parsing_theirs": "inference.GRPCInferenceService",
        "theirs_parsing_ours": "SERVING",
    },
}


def _run(*parties: str) -> dict[str, object]:
    result = subprocess.run(
        [sys.executable, "-W", "error", "-c", _SCRIPT, *parties],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert result.returncode == 0, f"importing {' then '.join(parties)} failed:\n{result.stderr}"
    report: dict[str, object] = json.loads(result.stdout)
    return report


@pytest.mark.parametrize(
    "parties",
    [
        ("trio_infer", "tritonclient"),
        ("tritonclient", "trio_infer"),
        ("trio_infer", "mlserver"),
        ("mlserver", "trio_infer"),
        ("trio_infer", "grpc_health"),
        ("grpc_health", "trio_infer"),
        ("grpc_health", "tritonclient", "trio_infer"),
    ],
    ids="-then-".join,
)
def test_trio_infer_and_another_copy_of_the_protocol_in_one_process(
    parties: tuple[str, ...],
) -> None:
    report = _run(*parties)
    others = [party for party in parties if party != "trio_infer"]
    assert report["ours"] == {"request": X, "nested_pickle_same_class": True}
    default_pool: dict[str, str | None] = {
        "inference.ModelInferRequest": None,
        "grpc.health.v1.HealthCheckRequest": None,
    }
    for other in others:
        default_pool.update(_DEFAULT_POOL_FILES[other])
    assert report["default_pool"] == default_pool
    for other in others:
        assert report[other] == _EXPECTED[other], other


def test_trio_infer_alone_leaves_the_default_pool_empty_of_its_names() -> None:
    report = _run("trio_infer")
    assert report["default_pool"] == {
        "inference.ModelInferRequest": None,
        "grpc.health.v1.HealthCheckRequest": None,
    }
    assert report["ours"] == {"request": X, "nested_pickle_same_class": True}


# -- in a worker process --------------------------------------------------------------------

#: A model written against another V2 library: ``load()`` imports it beside trio_infer's own
#: client (as a model that forwards to another server would), ``predict`` builds that library's
#: request from its input and decodes it with trio_infer's codec.
_MODEL = """
import numpy as np
from google.protobuf import descriptor_pool

from trio_infer.model import Model


class Coexisting(Model):
    def load(self):
        import trio_infer.client
{imports}
        self.default_pool_file = descriptor_pool.Default().FindMessageTypeByName(
            "inference.ModelInferRequest"
        ).file.name

    def predict(self, inputs, parameters):
        from trio_infer.protobuf import codec
        from trio_infer.protobuf._proto import grpc_predict_v2_pb2 as pb

        x = inputs["x"]
{build}
        decoded = codec.decode_inputs(pb.ModelInferRequest.FromString(serialized))["x"]
        return {{
            "y": decoded * 2,
            "default_pool_file": np.array([self.default_pool_file.encode()], dtype=object),
        }}
"""

_WORKER_LIBRARIES = {
    "tritonclient": (
        "import tritonclient.grpc",
        """\
from tritonclient.grpc import service_pb2

serialized = service_pb2.ModelInferRequest(
    model_name="m",
    inputs=[
        service_pb2.ModelInferRequest.InferInputTensor(
            name="x", datatype="FP32", shape=list(x.shape)
        )
    ],
    raw_input_contents=[x.tobytes()],
).SerializeToString()
""",
        "grpc_service.proto",
    ),
    "mlserver": (
        "import mlserver\nimport mlserver.grpc.dataplane_pb2",
        """\
from mlserver.grpc.converters import ModelInferRequestConverter
from mlserver.types import InferenceRequest, RequestInput

request = InferenceRequest(
    inputs=[
        RequestInput(name="x", shape=list(x.shape), datatype="FP32", data=x.ravel().tolist())
    ]
)
serialized = ModelInferRequestConverter.from_types(request, model_name="m").SerializeToString()
""",
        "dataplane.proto",
    ),
}


async def _wait_loaded(client: GrpcioClient, caplog: pytest.LogCaptureFixture) -> None:
    """Wait until the model is ready; fail with the server's reason as soon as loading fails.

    The server retries a failed load with backoff and stays not ready meanwhile, so waiting for
    readiness alone would only end at the deadline.
    """
    with trio.fail_after(60):
        while not (await client.call("ModelReady", pb.ModelReadyRequest(name="coexisting"))).ready:
            failures = [r.getMessage() for r in caplog.records if "loading model" in r.getMessage()]
            if failures:
                pytest.fail(failures[0])
            await trio.sleep(0.05)


@pytest.mark.parametrize("library", sorted(_WORKER_LIBRARIES))
async def test_a_model_loading_another_v2_library_serves(
    nursery: trio.Nursery, tmp_path: Path, caplog: pytest.LogCaptureFixture, library: str
) -> None:
    imports, build, default_pool_file = _WORKER_LIBRARIES[library]
    folder = tmp_path / "repository" / "coexisting"
    folder.mkdir(parents=True)
    (folder / "model.py").write_text(
        _MODEL.format(
            imports=textwrap.indent(imports, " " * 8), build=textwrap.indent(build, " " * 8)
        )
    )
    (folder / "model-settings.json").write_text(
        json.dumps({"name": "coexisting", "implementation": "model.Coexisting"})
    )
    server = await start_server(nursery, tmp_path / "repository", wait_ready=False, workers=1)
    client = GrpcioClient(server.port)
    try:
        await _wait_loaded(client, caplog)
        x = np.array([[1.5, -2.0, 0.25]], dtype=np.float32)
        request = pb.ModelInferRequest(model_name="coexisting")
        codec.encode_inputs(request, [("x", x)], raw=True)
        outputs = codec.decode_outputs(await client.call("ModelInfer", request, timeout=30))
    finally:
        client.channel.close()
    np.testing.assert_array_equal(outputs["y"], x * 2)
    assert outputs["default_pool_file"].tolist() == [default_pool_file.encode()]
