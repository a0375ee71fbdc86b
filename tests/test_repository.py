"""The repository extension (index, load, unload) and the control modes, against a real server
with real worker processes, called by tritonclient (gRPC and HTTP) and grpcio.

Every model here is ``probe.Probe`` (below): a test controls it with files. Its folder's
``weight`` file is its answer (``y = x + weight + bias + 1000 * CODE``: ``CODE`` is a constant
of its code, ``bias`` a setting), a ``fail`` file makes its ``load()`` raise with the file's
text, and it leaves marker files in a state folder outside the repository (files written
inside would change the folder, which ``poll`` mode and a reload would take for a new
revision): ``loaded-<name>-<weight>-<pid>-<id>`` when a worker loads it and
``freed-<same>`` when that instance is garbage collected, which proves its memory was freed.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc
import httpx
import pytest
import trio
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
from tritonclient.utils import InferenceServerException

from tests.support import GrpcioClient, eventually, start_server
from tests.test_hostile import answers
from trio_infer.core.repository import ControlMode
from trio_infer.protobuf._proto import grpc_predict_v2_pb2 as pb
from trio_infer.protobuf._proto import health_pb2
from trio_infer.protobuf.codec import decode_outputs
from trio_infer.repository.settings import scan_repository
from trio_infer.server import RunningServer

T = TypeVar("T")

MODEL = """
import os
import time
import uuid
import weakref
from pathlib import Path

import numpy as np

from trio_infer import Model

CODE = {code}
FAIL = {fail!r}


class Probe(Model):
    def load(self):
        if FAIL:
            raise RuntimeError(FAIL)
        folder = self.settings.path
        fail = folder / "fail"
        if fail.exists():
            raise RuntimeError(fail.read_text())
        extra = self.settings.parameters.extra
        self.state = Path(extra["state"])
        weight = (folder / "weight").read_text().strip()
        self.answer = float(weight) + float(extra.get("bias", 0)) + 1000 * CODE
        tag = f"{{self.settings.name}}-{{weight}}-{{os.getpid()}}-{{uuid.uuid4().hex}}"
        (self.state / f"loaded-{{tag}}").touch()
        # Not a method of self: the finalizer must not keep the model alive.
        weakref.finalize(self, (self.state / f"freed-{{tag}}").touch)

    def predict(self, inputs, parameters):
        if parameters.get("hold"):
            # Held until the test writes 'release' (30 s at most).
            (self.state / f"holding-{{os.getpid()}}").touch()
            for _ in range(3000):
                if (self.state / "release").exists():
                    break
                time.sleep(0.01)
        time.sleep(float(parameters.get("sleep", 0)))
        return {{"y": inputs["x"] + np.float32(self.answer)}}
"""


def replace_file(path: Path, text: str) -> None:
    """Write ``path`` whole at once: a poll must never read it half written."""
    staged = path.with_name(f".{path.name}.new")
    staged.write_text(text)
    os.replace(staged, path)


@dataclass
class Repository:
    """A model repository of probes, and the state folder they write their markers in."""

    root: Path
    state: Path

    def add(
        self,
        name: str,
        weight: float = 1,
        *,
        code: int = 0,
        settings: dict[str, Any] | None = None,
    ) -> Path:
        folder = self.root / name
        folder.mkdir(parents=True, exist_ok=True)
        self.write_settings(name, settings or {})
        self.write_weight(name, weight)
        self.write_code(name, code)
        return folder

    def write_settings(self, name: str, settings: dict[str, Any]) -> None:
        document = {
            "implementation": "probe.Probe",
            "parameters": {"extra": {"state": str(self.state)}},
        } | settings
        replace_file(self.root / name / "model-settings.json", json.dumps(document))

    def write_code(self, name: str, code: int, fail: str = "") -> None:
        """The model's code: ``CODE`` is ``code``; a ``fail`` text makes its load() raise."""
        replace_file(self.root / name / "probe.py", MODEL.format(code=code, fail=fail))

    def write_weight(self, name: str, weight: float) -> None:
        replace_file(self.root / name / "weight", f"{weight:g}")

    def instances(self, kind: str, name: str) -> set[str]:
        """The ``<weight>-<pid>-<id>`` of each ``kind`` (loaded, freed) marker of ``name``."""
        prefix = f"{kind}-{name}-"
        return {p.name[len(prefix) :] for p in self.state.iterdir() if p.name.startswith(prefix)}

    def loaded_pids(self, name: str, weight: float | None = None) -> set[int]:
        """The worker pids that loaded model ``name`` (with that weight)."""
        pids = set()
        for instance in self.instances("loaded", name):
            loaded_weight, pid, _ = instance.split("-")
            if weight is None or loaded_weight == f"{weight:g}":
                pids.add(int(pid))
        return pids


@pytest.fixture
def repo(tmp_path: Path) -> Repository:
    state = tmp_path / "state"
    state.mkdir()
    return Repository(tmp_path / "repository", state)


# -- clients --------------------------------------------------------------------------------------


def _request(model: str, x: float = 0.0, **parameters: float) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=model)
    tensor = request.inputs.add(name="x", datatype="FP32", shape=[1])
    tensor.contents.fp32_contents.append(x)
    for key, value in parameters.items():
        request.parameters[key].double_param = value
    return request


async def infer(client: GrpcioClient, model: str, **parameters: float) -> float:
    """Model ``model``'s answer to x = 0 (its weight, bias and code), over grpcio."""
    response = await client.call("ModelInfer", _request(model, **parameters), timeout=30)
    return float(decode_outputs(response)["y"][0])


async def infer_error(client: GrpcioClient, model: str) -> grpc.RpcError:
    return await client.error("ModelInfer", _request(model), timeout=30)


@dataclass
class Triton:
    """tritonclient over gRPC and HTTP, each call from a thread (they block)."""

    server: RunningServer
    _grpc: triton_grpc.InferenceServerClient = field(init=False)

    def __post_init__(self) -> None:
        self._grpc = triton_grpc.InferenceServerClient(f"127.0.0.1:{self.server.port}")

    async def grpc(self, call: Callable[[triton_grpc.InferenceServerClient], T]) -> T:
        return await trio.to_thread.run_sync(call, self._grpc)

    async def http(self, call: Callable[[triton_http.InferenceServerClient], T]) -> T:
        def run() -> T:
            # A client of its own in the thread that uses it: geventhttpclient's connections
            # belong to the thread (its gevent hub) that made them.
            client = triton_http.InferenceServerClient(f"127.0.0.1:{self.server.http_port}")
            try:
                return call(client)
            finally:
                client.close()

        return await trio.to_thread.run_sync(run)

    async def grpc_error(
        self, call: Callable[[triton_grpc.InferenceServerClient], object]
    ) -> tuple[str, str]:
        """``(status, message)`` of a call that must fail."""
        with pytest.raises(InferenceServerException) as caught:
            await self.grpc(call)
        return str(caught.value.status()), str(caught.value.message())

    async def http_error(
        self, call: Callable[[triton_http.InferenceServerClient], object]
    ) -> tuple[str, str]:
        with pytest.raises(InferenceServerException) as caught:
            await self.http(call)
        return str(caught.value.status()), str(caught.value.message())

    async def index(self, both: bool = True) -> dict[str, tuple[str, str, str]]:
        """The index over gRPC, checked to agree with HTTP's (``both``; only while nothing
        changes): name -> (version, state, reason)."""
        over_grpc = await self.grpc(lambda c: c.get_model_repository_index(as_json=True))
        by_grpc = {
            m["name"]: (m.get("version", ""), m.get("state", ""), m.get("reason", ""))
            for m in over_grpc.get("models", [])
        }
        if both:
            over_http = await self.http(lambda c: c.get_model_repository_index())
            by_http = {m["name"]: (m["version"], m["state"], m["reason"]) for m in over_http}
            assert by_grpc == by_http
        return by_grpc

    def close(self) -> None:
        self._grpc.close()


@pytest.fixture
def clients() -> Iterator[Callable[[RunningServer], tuple[Triton, GrpcioClient]]]:
    made: list[tuple[Triton, GrpcioClient]] = []

    def make(server: RunningServer) -> tuple[Triton, GrpcioClient]:
        pair = (Triton(server), GrpcioClient(server.port))
        made.append(pair)
        return pair

    yield make
    for tritonclient, grpcio in made:
        tritonclient.close()
        grpcio.channel.close()


Clients = Callable[[RunningServer], tuple[Triton, GrpcioClient]]

INVALID = "StatusCode.INVALID_ARGUMENT"
NOT_FOUND = "StatusCode.NOT_FOUND"


async def explicit(
    nursery: trio.Nursery, repo: Repository, *load: str, **config: Any
) -> RunningServer:
    return await start_server(
        nursery,
        repo.root,
        model_control_mode=ControlMode.EXPLICIT,
        load_models=load,
        **config,
    )


# -- 1. tritonclient's repository calls ------------------------------------------------------------


async def test_tritonclient_indexes_loads_and_unloads_over_grpc_and_http(
    nursery: trio.Nursery, repo: Repository, clients: Clients
) -> None:
    repo.add("alpha", 1)
    repo.add("beta", 2)
    repo.add("broken", 3)
    (repo.root / "broken" / "fail").write_text("no weights here")
    repo.add("misspelt", 4, settings={"colour": "red"})
    server = await explicit(nursery, repo, "alpha")
    triton, grpcio = clients(server)
    settings_error = scan_repository(repo.root)["misspelt"].error
    assert settings_error is not None
    assert "unknown field 'colour'" in settings_error

    assert await triton.index() == {
        "alpha": ("", "READY", ""),
        "beta": ("", "UNAVAILABLE", "not loaded"),
        "broken": ("", "UNAVAILABLE", "not loaded"),
        "misspelt": ("", "UNAVAILABLE", settings_error),
    }

    # Load over gRPC, then ready over both.
    await triton.grpc(lambda c: c.load_model("beta"))
    assert await triton.grpc(lambda c: c.is_model_ready("beta"))
    assert await triton.http(lambda c: c.is_model_ready("beta"))
    assert await infer(grpcio, "beta") == 2
    assert (await triton.index())["beta"] == ("", "READY", "")

    # A load with config: the JSON's fields override the folder's settings.
    config = {"parameters": {"version": "7", "extra": {"state": str(repo.state), "bias": 10}}}
    await triton.http(lambda c: c.load_model("beta", config=json.dumps(config)))
    assert await triton.http(lambda c: c.is_model_ready("beta", "7"))
    assert await triton.grpc(lambda c: c.is_model_ready("beta"))
    assert await infer(grpcio, "beta") == 12
    assert (await triton.index())["beta"] == ("7", "READY", "")
    # Without config, the folder's settings again.
    await triton.grpc(lambda c: c.load_model("beta"))
    assert await infer(grpcio, "beta") == 2
    assert (await triton.index())["beta"] == ("", "READY", "")

    # A config that is not JSON, or names an unknown field: refused, beta serves on.
    status, message = await triton.grpc_error(lambda c: c.load_model("beta", config="{"))
    assert (status, message.startswith("load parameter 'config' is not valid JSON")) == (
        INVALID,
        True,
    )
    # Nested deeper than the parser goes: a refusal, not an internal error.
    status, message = await triton.grpc_error(lambda c: c.load_model("beta", config="[" * 60_000))
    assert (status, message) == (
        INVALID,
        "load parameter 'config' is not valid JSON: it is nested too deeply",
    )
    status, message = await triton.http_error(
        lambda c: c.load_model("beta", config='{"colour": "red"}')
    )
    assert status == "400"
    assert "unknown field 'colour'" in message
    # A config may not rename the model: it would serve beta's code as alpha.
    status, message = await triton.grpc_error(
        lambda c: c.load_model("beta", config='{"name": "alpha"}')
    )
    assert (status, message) == (
        INVALID,
        "model 'beta' cannot be loaded: its config renames it to 'alpha'",
    )
    assert await infer(grpcio, "alpha") == 1
    assert await infer(grpcio, "beta") == 2

    # A model whose load() raises: the caller gets the error; the index keeps it as reason.
    status, message = await triton.grpc_error(lambda c: c.load_model("broken"))
    assert status == "StatusCode.INTERNAL"
    assert "RuntimeError: no weights here" in message
    version, state, reason = (await triton.index())["broken"]
    assert (version, state) == ("", "UNAVAILABLE")
    assert "RuntimeError: no weights here" in reason
    assert not await triton.http(lambda c: c.is_model_ready("broken"))
    # A settings file that is invalid: INVALID_ARGUMENT with the file's error.
    status, message = await triton.http_error(lambda c: c.load_model("misspelt"))
    assert status == "400"
    assert settings_error in message
    status, message = await triton.grpc_error(lambda c: c.load_model("nope"))
    assert status == NOT_FOUND

    # Unload over HTTP and gRPC: not ready from then on, and the index says why.
    await triton.http(lambda c: c.unload_model("beta"))
    assert not await triton.http(lambda c: c.is_model_ready("beta"))
    await triton.grpc(lambda c: c.unload_model("alpha"))
    assert not await triton.http(lambda c: c.is_model_ready("alpha"))
    index = await triton.index()
    assert index["alpha"] == ("", "UNAVAILABLE", "unloaded")
    assert index["beta"] == ("", "UNAVAILABLE", "unloaded")
    status, message = await triton.grpc_error(lambda c: c.unload_model("alpha"))
    assert status == NOT_FOUND
    assert (await infer_error(grpcio, "alpha")).code() == grpc.StatusCode.UNAVAILABLE
    # Loaded again after an unload.
    await triton.grpc(lambda c: c.load_model("alpha"))
    assert await infer(grpcio, "alpha") == 1
    assert (await triton.index())["alpha"] == ("", "READY", "")


# -- 2. a broken model's load error reaches its callers ------------------------------------------


async def index_entry(
    triton: Triton, name: str, state: str, reason: str = "", within: float = 20.0
) -> str:
    """Wait until the index lists model ``name`` in ``state`` with a reason that holds
    ``reason``; its reason."""
    with trio.fail_after(within):
        while True:
            entry = (await triton.index(both=False)).get(name)
            if entry is not None and entry[1] == state and reason in entry[2]:
                return entry[2]
            await trio.sleep(0.05)


async def test_settings_past_what_tritons_config_carries_are_refused_and_metadata_answers(
    nursery: trio.Nursery, repo: Repository, clients: Clients
) -> None:
    # Each setting is described to clients in a field of Triton's ModelConfig or of the V2
    # metadata: a value that field cannot hold would make ModelConfig and ModelMetadata fail
    # for as long as the model is served, so the load refuses it and the model serves on.
    batching = {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1]}],
        "max_batch_size": 8,
    }
    repo.add("model", 1, settings=batching)
    server = await explicit(nursery, repo, "model")
    triton, grpcio = clients(server)

    def dims(size: int) -> dict[str, Any]:
        return {"inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, size]}]}

    past = [
        ({"max_batch_size": 2**31}, "max_batch_size: Input should be less than or equal to "),
        ({"max_queue_size": 2**32}, "max_queue_size: Input should be less than or equal to "),
        ({"max_batch_time": 1e13}, "max_batch_time: Input should be less than or equal to "),
        (
            {"max_sequence_idle_microseconds": 2**64},
            "max_sequence_idle_microseconds: Input should be less than or equal to ",
        ),
        (dims(2**63), "inputs[0].shape[1]: Input should be less than or equal to "),
    ]
    for config, problem in past:
        status, message = await triton.http_error(
            lambda c, config=config: c.load_model("model", config=json.dumps(config))  # type: ignore[misc]
        )
        assert (status, problem in message) == ("400", True), (config, message)
        assert (await triton.grpc(lambda c: c.get_model_config("model"))).config.max_batch_size == 8
        assert await triton.grpc(lambda c: c.get_model_metadata("model")) is not None
        assert await infer(grpcio, "model") == 1

    # At the bounds, both describe the model as configured.
    await triton.http(
        lambda c: c.load_model(
            "model",
            config=json.dumps(
                batching
                | dims(2**63 - 1)
                | {"max_batch_size": 2**31 - 1, "max_queue_size": 2**32 - 1}
                | {"max_batch_time": 2**63 // 10**6}
            ),
        )
    )
    config = (await triton.grpc(lambda c: c.get_model_config("model"))).config
    assert config.max_batch_size == 2**31 - 1
    assert list(config.input[0].dims) == [2**63 - 1]
    assert config.dynamic_batching.default_queue_policy.max_queue_size == 2**32 - 1
    assert config.dynamic_batching.max_queue_delay_microseconds == round(2**63 // 10**6 * 1e6)
    metadata = await triton.grpc(lambda c: c.get_model_metadata("model"))
    assert list(metadata.inputs[0].shape) == [-1, 2**63 - 1]
    await triton.http(
        lambda c: c.load_model(
            "model", config=json.dumps({"max_sequence_idle_microseconds": 2**64 - 1})
        )
    )
    config = (await triton.grpc(lambda c: c.get_model_config("model"))).config
    assert config.sequence_batching.max_sequence_idle_microseconds == 2**64 - 1


async def test_a_broken_models_load_error_shows_in_the_index_and_reaches_its_callers(
    nursery: trio.Nursery, repo: Repository, clients: Clients
) -> None:
    repo.add("alpha", 1)
    repo.add("broken", 3)
    (repo.root / "broken" / "fail").write_text("the weights are corrupt")
    repo.add("never", 4)
    (repo.root / "never" / "fail").write_text("never loads")
    # Served from the start, broken fails to load (and is tried again with backoff).
    server = await explicit(nursery, repo, "alpha", "broken", wait_ready=False)
    triton, grpcio = clients(server)
    expected = "loading model 'broken' failed: RuntimeError: the weights are corrupt"
    await index_entry(triton, "broken", "UNAVAILABLE", expected)
    response, call = await grpcio.call_with_metadata(
        "ModelReady", pb.ModelReadyRequest(name="broken")
    )
    assert not response.ready
    # ModelReady's metadata says why, over gRPC and REST.
    trailing = dict(call.trailing_metadata())
    assert (trailing["x-model-state"], trailing["x-model-reason"]) == ("UNAVAILABLE", expected)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.http_port}") as rest:
        ready = await rest.get("/v2/models/broken/ready")
    assert ready.status_code == 400
    assert (ready.headers["x-model-state"], ready.headers["x-model-reason"]) == (
        "UNAVAILABLE",
        expected,
    )
    assert not await triton.grpc(lambda c: c.is_model_ready("broken"))
    assert not await triton.http(lambda c: c.is_model_ready("broken"))
    error = await infer_error(grpcio, "broken")
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert f"model 'broken' is not ready: {expected}" in error.details()
    # Other models serve meanwhile.
    assert await infer(grpcio, "alpha") == 1

    # A model never served whose explicit load fails: its calls say why too.
    status, message = await triton.grpc_error(lambda c: c.load_model("never"))
    assert status == "StatusCode.INTERNAL"
    assert "RuntimeError: never loads" in message
    await index_entry(triton, "never", "UNAVAILABLE", "RuntimeError: never loads")
    error = await infer_error(grpcio, "never")
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert error.details().startswith("Request for unknown model: 'never'")
    assert "RuntimeError: never loads" in error.details()

    # Mended, the broken model loads.
    (repo.root / "broken" / "fail").unlink()
    await triton.grpc(lambda c: c.load_model("broken"))
    assert await infer(grpcio, "broken") == 3
    assert await index_entry(triton, "broken", "READY") == ""


# -- 3. load and unload while calls run ------------------------------------------------------------


@dataclass
class Traffic:
    """Calls to one model in a loop until stopped: how many succeeded, how each failed."""

    client: GrpcioClient
    model: str
    answer: float
    sleep: float
    ok: int = 0
    wrong: list[float] = field(default_factory=list)
    errors: list[tuple[grpc.StatusCode, str]] = field(default_factory=list)
    stopped: bool = False

    async def run(self) -> None:
        while not self.stopped:
            try:
                # The timeout only turns a hung call into a failure the test reports.
                answer = await infer(self.client, self.model, sleep=self.sleep)
            except grpc.RpcError as error:
                self.errors.append((error.code(), error.details()))
                await trio.sleep(0.01)  # refused at once: no busy loop
            else:
                if answer == self.answer:
                    self.ok += 1
                else:
                    self.wrong.append(answer)

    async def wait_ok(self, more: int) -> None:
        target = self.ok + more
        with trio.fail_after(30):
            while self.ok < target:  # noqa: ASYNC110 - counted by another task, no event
                await trio.sleep(0.01)

    async def wait_errors(self, more: int) -> None:
        target = len(self.errors) + more
        with trio.fail_after(30):
            while len(self.errors) < target:  # noqa: ASYNC110 - as in wait_ok
                await trio.sleep(0.01)


#: A probe whose calls are batched (up to 4 rows), so that unloading stops its batcher too.
BATCHING: dict[str, Any] = {
    "max_batch_size": 4,
    "max_batch_time": 0.005,
    "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1]}],
}


@pytest.mark.parametrize("victim_settings", [{}, BATCHING], ids=["unbatched", "batching"])
async def test_load_and_unload_while_calls_run_frees_the_model_in_every_worker(
    nursery: trio.Nursery, repo: Repository, clients: Clients, victim_settings: dict[str, Any]
) -> None:
    repo.add("steady", 1)
    repo.add("victim", 2, settings=victim_settings)
    server = await explicit(nursery, repo, "steady", "victim", grace_period=10)
    triton, grpcio = clients(server)
    steady = [Traffic(grpcio, "steady", 1, 0.005) for _ in range(3)]
    victim = [Traffic(grpcio, "victim", 2, 0.02) for _ in range(3)]
    async with trio.open_nursery() as calls:
        for traffic in steady + victim:
            calls.start_soon(traffic.run)
        for traffic in steady + victim:
            await traffic.wait_ok(3)
        loaded = repo.instances("loaded", "victim")
        assert len(repo.loaded_pids("victim")) == 2  # one instance in each worker

        await triton.grpc(lambda c: c.unload_model("victim"))
        # Returned once every worker dropped it, its memory freed there.
        assert repo.instances("freed", "victim") == loaded
        for traffic in victim:
            await traffic.wait_errors(2)
        for traffic in steady:
            await traffic.wait_ok(3)

        await triton.http(lambda c: c.load_model("victim"))
        for traffic in victim:
            await traffic.wait_ok(3)
        reloaded = repo.instances("loaded", "victim") - loaded
        assert len(reloaded) == 2
        await triton.http(lambda c: c.unload_model("victim"))
        assert repo.instances("freed", "victim") == loaded | reloaded
        for traffic in steady:
            await traffic.wait_ok(3)
        for traffic in steady + victim:
            traffic.stopped = True

    for traffic in steady:
        assert (traffic.errors, traffic.wrong) == ([], [])
    for traffic in victim:
        assert traffic.wrong == []
        # Refused at once with UNAVAILABLE (never INTERNAL, never a timeout).
        assert {code for code, _ in traffic.errors} == {grpc.StatusCode.UNAVAILABLE}
    # Nothing dropped: the steady model's instances were never freed.
    assert repo.instances("freed", "steady") == set()


async def test_a_load_while_an_unload_waits_for_calls_keeps_the_model_served(
    nursery: trio.Nursery, repo: Repository, clients: Clients
) -> None:
    repo.add("model", 2)
    server = await explicit(nursery, repo, "model", grace_period=20)
    triton, grpcio = clients(server)
    held: list[float] = []

    async def held_call() -> None:
        held.append(await infer(grpcio, "model", hold=1))

    async with trio.open_nursery() as calls:
        calls.start_soon(held_call)
        await eventually(lambda: any(p.name.startswith("holding-") for p in repo.state.iterdir()))
        unloaded = trio.Event()

        async def unload() -> None:
            await triton.grpc(lambda c: c.unload_model("model"))
            unloaded.set()

        calls.start_soon(unload)
        assert await index_entry(triton, "model", "UNLOADING") == "unloading"
        # Loaded again before the unload could drop it: every worker holds these settings
        # already, so the load does not wait for the worker that runs the held call, and the
        # unload's drop, when it comes, finds the model served again: the load wins.
        loaded = trio.Event()

        async def load() -> None:
            await triton.grpc(lambda c: c.load_model("model"))
            loaded.set()

        calls.start_soon(load)
        with trio.fail_after(10):
            await loaded.wait()
        assert not unloaded.is_set()
        assert await index_entry(triton, "model", "READY") == ""
        (repo.state / "release").touch()
        await unloaded.wait()
        await loaded.wait()
    assert held == [2]
    # Served still, in every worker: the unload's end must not drop what the load serves.
    for _ in range(6):
        assert await infer(grpcio, "model") == 2
    assert (await triton.index())["model"] == ("", "READY", "")


async def test_a_second_unload_of_a_model_being_unloaded_waits_for_the_first(
    nursery: trio.Nursery, repo: Repository, clients: Clients
) -> None:
    repo.add("model", 2)
    server = await explicit(nursery, repo, "model", grace_period=20)
    triton, grpcio = clients(server)

    async def held_call() -> None:
        assert await infer(grpcio, "model", hold=1) == 2

    async with trio.open_nursery() as calls:
        calls.start_soon(held_call)
        await eventually(lambda: any(p.name.startswith("holding-") for p in repo.state.iterdir()))
        released = False
        done: list[tuple[str, bool]] = []

        async def unload(which: str) -> None:
            await triton.grpc(lambda c: c.unload_model("model"))
            done.append((which, released))

        calls.start_soon(unload, "first")
        assert await index_entry(triton, "model", "UNLOADING") == "unloading"
        calls.start_soon(unload, "second")
        # Both unloads reach the server beside the held call before it is let go.
        await eventually(lambda: server.statistics().transport.calls >= 3)
        released = True
        (repo.state / "release").touch()
    # Neither answered before the held call ended: the second waited for the first's end.
    assert sorted(done) == [("first", True), ("second", True)]
    assert (await triton.index())["model"][1:] == ("UNAVAILABLE", "unloaded")


async def test_a_batching_model_loads_when_none_batched_at_start_and_reloads(
    nursery: trio.Nursery, repo: Repository, clients: Clients
) -> None:
    repo.add("plain", 1)
    repo.add("batched", 2, settings=BATCHING)
    server = await explicit(nursery, repo, "plain")
    triton, grpcio = clients(server)
    # No batcher ran at start: the load starts the first one.
    await triton.grpc(lambda c: c.load_model("batched"))
    assert await infer(grpcio, "batched") == 2
    traffic = Traffic(grpcio, "batched", 2, 0.005)
    async with trio.open_nursery() as calls:
        calls.start_soon(traffic.run)
        await traffic.wait_ok(3)
        # A reload replaces the batcher; calls keep being served, by one version or the other.
        repo.write_weight("batched", 3)
        await triton.grpc(lambda c: c.load_model("batched"))
        traffic.answer = 3
        await traffic.wait_ok(3)
        traffic.stopped = True
    assert traffic.errors == []
    assert set(traffic.wrong) <= {2}
    assert server.statistics().batching["batched"].batches > 0
    await triton.grpc(lambda c: c.unload_model("batched"))
    assert "batched" not in server.statistics().batching
    # Loaded again after its batcher, the last one, was retired.
    await triton.grpc(lambda c: c.load_model("batched"))
    assert await infer(grpcio, "batched") == 3


# -- 4. reload ------------------------------------------------------------------------------------


async def test_a_reload_takes_new_weights_and_code_and_a_failing_one_keeps_the_old(
    nursery: trio.Nursery, repo: Repository, clients: Clients
) -> None:
    repo.add("model", 1)
    repo.add("other", 5)
    server = await explicit(nursery, repo, "model", "other")
    triton, grpcio = clients(server)
    first = repo.instances("loaded", "model")
    held: list[float] = []

    async def held_call() -> None:
        held.append(await infer(grpcio, "model", hold=1))

    async with trio.open_nursery() as calls:
        calls.start_soon(held_call)
        await eventually(lambda: any(p.name.startswith("holding-") for p in repo.state.iterdir()))
        repo.write_weight("model", 2)
        repo.write_code("model", 1)
        # The idle worker loads the new version and the server switches to it while the held
        # call runs: the load does not wait for that call.
        await triton.grpc(lambda c: c.load_model("model"))
        assert len(repo.instances("loaded", "model") - first) == 1
        assert await infer(grpcio, "model") == 1002
        assert await infer(grpcio, "other") == 5
        (repo.state / "release").touch()
    # The call in flight answered with the old version, every call since with the new one; the
    # worker that ran it loaded the new version after it.
    assert held == [1]
    await eventually(lambda: len(repo.instances("loaded", "model") - first) == 2)
    for _ in range(6):
        assert await infer(grpcio, "model") == 1002
    # The old version is dropped from every worker once its calls are done.
    await eventually(lambda: first <= repo.instances("freed", "model"))
    second = repo.instances("loaded", "model") - first

    # New code whose load() raises: the caller gets the error, the old version serves on.
    repo.write_code("model", 2, fail="the new code is broken")
    status, message = await triton.grpc_error(lambda c: c.load_model("model"))
    assert status == "StatusCode.INTERNAL"
    assert "RuntimeError: the new code is broken" in message
    status, message = await triton.http_error(lambda c: c.load_model("model"))
    assert status == "500"
    assert "RuntimeError: the new code is broken" in message
    for _ in range(6):
        assert await infer(grpcio, "model") == 1002
    assert await triton.grpc(lambda c: c.is_model_ready("model"))
    assert (await triton.index())["model"] == ("", "READY", "")
    assert not second & repo.instances("freed", "model")
    # Mended code loads.
    repo.write_code("model", 3)
    await triton.http(lambda c: c.load_model("model"))
    assert await infer(grpcio, "model") == 3002


# -- 5. control modes -----------------------------------------------------------------------------


async def test_mode_none_serves_every_model_and_refuses_load_and_unload(
    nursery: trio.Nursery, repo: Repository, clients: Clients
) -> None:
    repo.add("alpha", 1)
    repo.add("beta", 2)
    server = await start_server(nursery, repo.root)
    triton, grpcio = clients(server)
    assert await triton.index() == {
        "alpha": ("", "READY", ""),
        "beta": ("", "READY", ""),
    }
    for call in (lambda c: c.load_model("alpha"), lambda c: c.unload_model("alpha")):
        status, message = await triton.grpc_error(call)
        assert status == "StatusCode.FAILED_PRECONDITION"
        assert "--model-control-mode none" in message
        status, message = await triton.http_error(call)
        assert status == "400"  # http_status(FAILED_PRECONDITION)
        assert "--model-control-mode none" in message
    assert await infer(grpcio, "alpha") == 1
    assert repo.instances("freed", "alpha") == set()


async def test_mode_explicit_loads_every_model_with_a_star(
    nursery: trio.Nursery, repo: Repository, clients: Clients
) -> None:
    repo.add("alpha", 1)
    repo.add("beta", 2)
    server = await explicit(nursery, repo, "*")
    triton, grpcio = clients(server)
    assert await triton.index() == {
        "alpha": ("", "READY", ""),
        "beta": ("", "READY", ""),
    }
    assert await infer(grpcio, "beta") == 2


async def test_mode_poll_follows_added_changed_and_removed_models(
    nursery: trio.Nursery,
    repo: Repository,
    clients: Clients,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    repo.add("steady", 1)
    repo.add("changing", 2)
    repo.add("removed", 3)
    server = await start_server(
        nursery, repo.root, model_control_mode=ControlMode.POLL, repository_poll_interval=0.2
    )
    triton, grpcio = clients(server)
    steady = Traffic(grpcio, "steady", 1, 0.005)
    async with trio.open_nursery() as calls:
        calls.start_soon(steady.run)
        await steady.wait_ok(3)

        # Added: made aside, then moved in whole.
        staging = Repository(tmp_path / "staging", repo.state)
        staging.add("added", 4)
        os.rename(staging.root / "added", repo.root / "added")
        assert await index_entry(triton, "added", "READY") == ""
        assert await infer(grpcio, "added") == 4

        repo.write_weight("changing", 5)
        with trio.fail_after(20):
            while await infer(grpcio, "changing") != 5:  # noqa: ASYNC110 - the server's poll
                await trio.sleep(0.05)
        # Settings that no longer read: the poll says so and the version before serves on.
        repo.write_settings("changing", {"colour": "red"})
        await eventually(lambda: "model 'changing' was not (re)loaded" in caplog.text)
        assert await infer(grpcio, "changing") == 5
        # (gRPC's index alone: the two could see different polls.)
        assert (await triton.index(both=False))["changing"] == ("", "READY", "")

        removed = repo.root / "removed"
        for path in removed.iterdir():
            path.unlink()
        removed.rmdir()
        with trio.fail_after(20):
            while "removed" in await triton.index(both=False):  # noqa: ASYNC110 - the server's poll
                await trio.sleep(0.05)
        assert (await infer_error(grpcio, "removed")).code() == grpc.StatusCode.UNAVAILABLE
        await eventually(lambda: len(repo.instances("freed", "removed")) == 2)

        status, _ = await triton.grpc_error(lambda c: c.load_model("steady"))
        assert status == "StatusCode.FAILED_PRECONDITION"
        await steady.wait_ok(3)
        steady.stopped = True
    assert (steady.errors, steady.wrong) == ([], [])
    # The unchanged model was never reloaded.
    assert repo.instances("freed", "steady") == set()
    assert len(repo.instances("loaded", "steady")) == 2


# -- 6. safety ------------------------------------------------------------------------------------

INVALID_CODE = grpc.StatusCode.INVALID_ARGUMENT
UNSAFE_NAMES = ["a/b", "..", ".", "/etc", "x\0y", "escape", "a\\b"]


async def test_names_that_are_not_a_plain_folder_of_the_repository_are_refused(
    nursery: trio.Nursery, repo: Repository, clients: Clients, tmp_path: Path
) -> None:
    repo.add("alpha", 1)
    # A folder outside the repository, with a model, and a link to it inside.
    outside = Repository(tmp_path / "outside", repo.state)
    outside.add("escape", 9)
    (repo.root / "escape").symlink_to(outside.root / "escape", target_is_directory=True)
    (repo.root / "a").mkdir()
    server = await explicit(nursery, repo, "alpha")
    triton, grpcio = clients(server)
    before = await triton.index()
    assert before["escape"][1] == "UNAVAILABLE"
    assert "leads out of the repository" in before["escape"][2]
    for name in UNSAFE_NAMES:
        # A plain name (the link's) is refused by the load, which reads the folder; its unload
        # finds no such model served.
        unload_code = grpc.StatusCode.NOT_FOUND if name == "escape" else INVALID_CODE
        for method, request, code in (
            ("RepositoryModelLoad", pb.RepositoryModelLoadRequest(model_name=name), INVALID_CODE),
            (
                "RepositoryModelUnload",
                pb.RepositoryModelUnloadRequest(model_name=name),
                unload_code,
            ),
        ):
            error = await grpcio.error(method, request)
            assert error.code() == code, (name, method)
        for load in (True, False) if name != "escape" else (True,):

            def call(
                c: triton_http.InferenceServerClient, name: str = name, load: bool = load
            ) -> None:
                c.load_model(name) if load else c.unload_model(name)

            status, message = await triton.http_error(call)
            assert status == "400", (name, load, message)
        assert await infer(grpcio, "alpha") == 1
    assert await triton.index() == before
    assert repo.instances("loaded", "escape") == set()


def _repository_calls(headers: dict[str, str]) -> list[Callable[[Any], object]]:
    """Index, load and unload, with these headers (for either tritonclient)."""
    return [
        lambda c: c.get_model_repository_index(headers=headers),
        lambda c: c.load_model("beta", headers=headers),
        lambda c: c.unload_model("alpha", headers=headers),
    ]


async def test_restricted_repository_control_needs_the_header(
    nursery: trio.Nursery, repo: Repository, clients: Clients
) -> None:
    repo.add("alpha", 1)
    repo.add("beta", 2)
    server = await explicit(
        nursery, repo, "alpha", repository_control_header=("admin-key", "s3cret")
    )
    triton, grpcio = clients(server)
    for headers in ({}, {"admin-key": "wrong"}, {"admin-key": "s3cret2"}, {"other": "s3cret"}):
        for call in _repository_calls(headers):
            status, message = await triton.grpc_error(call)
            assert status == "StatusCode.PERMISSION_DENIED", headers
            assert "needs header 'admin-key'" in message
            status, message = await triton.http_error(call)
            assert status == "403", headers
        # Inference is not restricted.
        assert await infer(grpcio, "alpha") == 1
    # Values that are not ASCII (UTF-8, or bytes no text encodes) are refused as any other,
    # over both entrances, rather than fail the comparison.
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.http_port}") as client:
        for sent in ("s3cr\u00e9t".encode(), b"\xff\xfe"):
            response = await client.post("/v2/repository/index", headers=[(b"admin-key", sent)])
            assert response.status_code == 403, sent
            assert "needs header 'admin-key'" in response.json()["error"]
    index_headers = [
        (b":method", b"POST"),
        (b":scheme", b"http"),
        (b":path", b"/inference.GRPCInferenceService/RepositoryIndex"),
        (b":authority", b"x"),
        (b"te", b"trailers"),
        (b"content-type", b"application/grpc"),
        (b"admin-key", "s3cr\u00e9t".encode()),
    ]
    answered = await trio.to_thread.run_sync(
        answers,
        server.port,
        [(1, "headers", index_headers), (1, "data", b"\0" * 5), (1, "end", None)],
    )
    assert answered[1]["grpc-status"] == "7", answered  # PERMISSION_DENIED
    assert not await triton.http(lambda c: c.is_model_ready("beta"))

    granted = {"admin-key": "s3cret"}
    await triton.grpc(lambda c: c.load_model("beta", headers=granted))
    assert await infer(grpcio, "beta") == 2
    # HTTP header names are case-insensitive.
    await triton.http(lambda c: c.unload_model("beta", headers={"Admin-Key": "s3cret"}))
    index = await triton.http(lambda c: c.get_model_repository_index(headers=granted))
    assert {m["name"]: m["state"] for m in index} == {"alpha": "READY", "beta": "UNAVAILABLE"}
    grpc_index = await triton.grpc(
        lambda c: c.get_model_repository_index(headers=granted, as_json=True)
    )
    assert [m["name"] for m in grpc_index["models"]] == ["alpha", "beta"]


# -- 8. a worker crash after an unload and a reload -----------------------------------------------


async def test_a_replacement_worker_loads_only_the_models_served_now(
    nursery: trio.Nursery, repo: Repository, clients: Clients
) -> None:
    repo.add("kept", 1)
    repo.add("dropped", 2)
    server = await explicit(nursery, repo, "kept", "dropped")
    triton, grpcio = clients(server)
    await triton.grpc(lambda c: c.unload_model("dropped"))
    repo.write_weight("kept", 3)
    await triton.grpc(lambda c: c.load_model("kept"))
    workers = repo.loaded_pids("kept", 3)
    assert len(workers) == 2
    await eventually(lambda: len(repo.instances("freed", "kept")) == 2)  # weight 1's

    os.kill(min(workers), signal.SIGKILL)
    await eventually(lambda: bool(repo.loaded_pids("kept", 3) - workers), within=20)
    (replacement,) = repo.loaded_pids("kept", 3) - workers
    assert replacement not in repo.loaded_pids("kept", 1)
    assert replacement not in repo.loaded_pids("dropped")
    for _ in range(6):
        assert await infer(grpcio, "kept") == 3
    assert (await infer_error(grpcio, "dropped")).code() == grpc.StatusCode.UNAVAILABLE
    assert replacement not in repo.loaded_pids("dropped")


# -- readiness of a model no longer served ---------------------------------------------------------


async def test_an_unloaded_model_is_not_ready_rather_than_an_error(
    nursery: trio.Nursery, repo: Repository, clients: Clients
) -> None:
    repo.add("alpha", 1)
    server = await explicit(nursery, repo, "alpha")
    triton, grpcio = clients(server)
    await triton.grpc(lambda c: c.unload_model("alpha"))
    assert not await triton.grpc(lambda c: c.is_model_ready("alpha"))
    check = await grpcio.call_health("Check", health_pb2.HealthCheckRequest(service="alpha"))
    assert check.status == health_pb2.HealthCheckResponse.ServingStatus.NOT_SERVING


async def test_mode_poll_starts_on_an_empty_repository_and_serves_what_comes(
    nursery: trio.Nursery, repo: Repository, clients: Clients, tmp_path: Path
) -> None:
    repo.root.mkdir()
    server = await start_server(
        nursery, repo.root, model_control_mode=ControlMode.POLL, repository_poll_interval=0.2
    )
    triton, grpcio = clients(server)
    assert await triton.index() == {}
    staging = Repository(tmp_path / "staging", repo.state)
    staging.add("first", 6)
    os.rename(staging.root / "first", repo.root / "first")
    assert await index_entry(triton, "first", "READY") == ""
    assert await infer(grpcio, "first") == 6


async def test_mode_poll_says_once_that_a_folder_cannot_be_read(
    nursery: trio.Nursery,
    repo: Repository,
    clients: Clients,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    repo.add("steady", 1)
    server = await start_server(
        nursery, repo.root, model_control_mode=ControlMode.POLL, repository_poll_interval=0.05
    )
    triton, grpcio = clients(server)
    staging = Repository(tmp_path / "staging", repo.state)
    staging.add("broken", 2)
    (staging.root / "broken" / "model-settings.json").write_text("{not json")
    os.rename(staging.root / "broken", repo.root / "broken")
    said = "model 'broken' was not (re)loaded"
    await eventually(lambda: said in caplog.text)
    polls = server.models.polls
    await eventually(lambda: server.models.polls >= polls + 5)
    assert caplog.text.count(said) == 1
    assert (await triton.index())["broken"][1] == "UNAVAILABLE"
    assert await infer(grpcio, "steady") == 1
