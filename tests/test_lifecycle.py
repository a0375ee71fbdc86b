"""No request is ever stranded: deadlines, client cancellation, worker crashes, hung models.

Each test tries to break one guarantee of the server against real worker processes. A test
model (``Probe``) writes its worker's pid to a file named after the request's ``tag`` when a call
starts, so tests can see which calls reached a worker and kill that worker from outside.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import random
import signal
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np
import pytest
import trio

from tests.conftest import GrpcioClient, start_server
from trio_infer._proto import grpc_predict_v2_pb2 as pb
from trio_infer.server import RunningServer
from trio_infer.tensors import decode_outputs, encode_inputs, encode_parameters

PROBE = """
import ctypes
import os
import time
from pathlib import Path

import numpy as np

from trio_infer import Model


class Probe(Model):
    def predict(self, inputs, parameters):
        tag = parameters.get("tag")
        if tag:
            log = Path(self.settings.parameters.extra["log_dir"]) / f"{tag}.start"
            log.write_text(str(os.getpid()))
        action = parameters.get("action", "ok")
        if action == "sleep":
            time.sleep(parameters.get("delay_ms", 100) / 1000)
        elif action == "hang":
            while True:
                time.sleep(1)
        elif action == "segfault":
            ctypes.string_at(0)
        elif action == "exit":
            os._exit(3)
        return {"pid": np.array([os.getpid()], dtype=np.int64)}
"""


def write_probe_repository(root: Path, **settings: object) -> Path:
    folder = root / "repository" / "probe"
    folder.mkdir(parents=True)
    (folder / "probe_model.py").write_text(PROBE)
    log_dir = root / "log"
    log_dir.mkdir()
    document = {
        "name": "probe",
        "implementation": "probe_model.Probe",
        "parameters": {"extra": {"log_dir": str(log_dir)}},
        **settings,
    }
    (folder / "model-settings.json").write_text(json.dumps(document))
    return root / "repository"


def probe_request(**parameters: bool | int | float | str) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="probe")
    encode_inputs(request, [("x", np.zeros(1, np.float32))], raw=True)
    encode_parameters(request.parameters, parameters)
    return request


class Probe:
    """A server running the probe model, a grpcio client, and the probe's start log."""

    def __init__(self, server: RunningServer, log_dir: Path) -> None:
        self.server = server
        self.client = GrpcioClient(server.port)
        self.log_dir = log_dir

    def started(self, tag: str) -> bool:
        return (self.log_dir / f"{tag}.start").exists()

    def pid(self, tag: str) -> int:
        return int((self.log_dir / f"{tag}.start").read_text())

    async def wait_started(self, tag: str) -> int:
        await eventually(lambda: self.started(tag) and bool(self.pid_text(tag)))
        return self.pid(tag)

    def pid_text(self, tag: str) -> str:
        return (self.log_dir / f"{tag}.start").read_text()

    async def call(
        self, deadline: float | None = None, **parameters: bool | int | float | str
    ) -> int:
        response = await self.client.call(
            "ModelInfer", probe_request(**parameters), timeout=deadline
        )
        return int(decode_outputs(response)["pid"][0])

    async def error(
        self, deadline: float | None = None, **parameters: bool | int | float | str
    ) -> grpc.RpcError:
        return await self.client.error("ModelInfer", probe_request(**parameters), timeout=deadline)

    async def wait_idle(self) -> None:
        """The server has no call in flight and no worker busy."""
        await eventually(
            lambda: (
                self.server.service.pool.statistics().busy == 0
                and self.server.service.pool.statistics().waiting == 0
            )
        )


async def eventually(condition: Callable[[], bool], within: float = 10.0) -> None:
    """Wait for state owned by another process or thread to satisfy ``condition``."""
    with trio.fail_after(within):
        while not condition():  # noqa: ASYNC110 - the state lives outside this Trio run
            await trio.sleep(0.01)


def process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A killed child of the fork server stays a zombie until reaped; it runs no code.
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split(") ", 1)[1][0] != "Z"


async def start_probe(
    nursery: trio.Nursery, tmp_path: Path, workers: int = 2, **settings: object
) -> Probe:
    repository = write_probe_repository(tmp_path, **settings)
    server = await start_server(nursery, repository, workers=workers)
    return Probe(server, tmp_path / "log")


@pytest.fixture
async def probe(nursery: trio.Nursery, tmp_path: Path) -> Probe:
    return await start_probe(nursery, tmp_path)


# -- deadlines --------------------------------------------------------------------------------


async def test_a_deadline_that_passes_while_running_kills_the_worker(probe: Probe) -> None:
    start = time.monotonic()
    error = await probe.error(deadline=0.3, tag="slow", action="sleep", delay_ms=5000)
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - start < 2
    pid = probe.pid("slow")
    await eventually(lambda: not process_exists(pid))
    await probe.wait_idle()
    assert await probe.call(deadline=5) != pid


async def test_a_deadline_that_passes_while_queued_never_reaches_a_worker(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    probe = await start_probe(nursery, tmp_path, workers=1)
    busy = probe.client.stub.ModelInfer.future(
        probe_request(tag="busy", action="sleep", delay_ms=1000), timeout=10
    )
    await probe.wait_started("busy")
    error = await probe.error(deadline=0.2, tag="queued")
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert probe.server.service.pool.statistics().waiting == 0
    await trio.to_thread.run_sync(busy.result)
    assert await probe.call(deadline=5, tag="after") == probe.pid("busy")
    assert not probe.started("queued")


async def test_a_model_timeout_bounds_a_hung_call_without_a_deadline(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    probe = await start_probe(nursery, tmp_path, timeout=0.3)
    error = await probe.error(tag="hung", action="hang")
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert error.details() == "model 'probe' did not answer within its timeout of 0.3 s"
    pid = probe.pid("hung")
    await eventually(lambda: not process_exists(pid))
    assert await probe.call(deadline=5) != pid


# -- the client goes away ---------------------------------------------------------------------


async def test_a_client_cancel_kills_the_worker_running_its_call(probe: Probe) -> None:
    future = probe.client.stub.ModelInfer.future(
        probe_request(tag="cancelled", action="sleep", delay_ms=10_000)
    )
    pid = await probe.wait_started("cancelled")
    future.cancel()
    await eventually(lambda: not process_exists(pid))
    await probe.wait_idle()
    assert await probe.call(deadline=5) != pid


async def test_a_dropped_connection_kills_the_worker_running_its_call(probe: Probe) -> None:
    future = probe.client.stub.ModelInfer.future(
        probe_request(tag="dropped", action="sleep", delay_ms=10_000)
    )
    pid = await probe.wait_started("dropped")
    probe.client.channel.close()
    assert future.cancelled() or future.exception() is not None
    await eventually(lambda: not process_exists(pid))
    await probe.wait_idle()


# -- worker crashes ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("action", "cause"),
    [
        ("kill", "killed by signal SIGKILL"),
        ("segfault", "killed by signal SIGSEGV"),
        ("exit", "exit code 3"),
    ],
)
async def test_a_dying_worker_fails_only_its_call_and_is_replaced(
    probe: Probe, action: str, cause: str
) -> None:
    if action == "kill":
        future = probe.client.stub.ModelInfer.future(
            probe_request(tag="victim", action="sleep", delay_ms=10_000), timeout=20
        )
        os.kill(await probe.wait_started("victim"), signal.SIGKILL)
        error = await trio.to_thread.run_sync(future.exception)
    else:
        error = await probe.error(deadline=10, tag="victim", action=action)
    assert isinstance(error, grpc.RpcError)
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert error.details() == f"worker process died while running model 'probe' ({cause})"
    pids = {await probe.call(deadline=5) for _ in range(4)}
    assert probe.pid("victim") not in pids
    ready = await probe.client.call("ModelReady", pb.ModelReadyRequest(name="probe"))
    assert ready.ready


async def test_kill_9_under_25_concurrent_requests_fails_only_the_victims(probe: Probe) -> None:
    outcomes: Counter[str] = Counter()

    def one(index: int) -> None:
        request = probe_request(tag=f"load-{index}", action="sleep", delay_ms=100)
        try:
            probe.client.stub.ModelInfer(request, timeout=20)
            outcomes["OK"] += 1
        except grpc.RpcError as error:
            outcomes[f"{error.code().name}: {error.details()}"] += 1

    def load() -> None:
        with concurrent.futures.ThreadPoolExecutor(25) as pool:
            list(pool.map(one, range(60)))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.to_thread.run_sync, load)
        os.kill(await probe.wait_started("load-10"), signal.SIGKILL)
    # Each worker holds one call at a time: the kill fails exactly the call it was running.
    killed = (
        "UNAVAILABLE: worker process died while running model 'probe' (killed by signal SIGKILL)"
    )
    assert outcomes == {"OK": 59, killed: 1}
    await probe.wait_idle()


# -- readiness --------------------------------------------------------------------------------


async def test_a_model_that_cannot_load_is_not_ready_and_the_others_serve(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    repository = write_probe_repository(tmp_path)
    broken = repository / "broken"
    broken.mkdir()
    (broken / "broken_model.py").write_text(
        "from trio_infer import Model\n\n"
        "class Broken(Model):\n"
        "    def load(self):\n"
        "        raise OSError('weights file missing')\n"
    )
    (broken / "model-settings.json").write_text(
        json.dumps({"name": "broken", "implementation": "broken_model.Broken"})
    )
    server = await start_server(nursery, repository, wait_ready=False)
    probe = Probe(server, tmp_path / "log")

    async def model_ready(name: str) -> bool:
        response = await probe.client.call("ModelReady", pb.ModelReadyRequest(name=name))
        return bool(response.ready)

    with trio.fail_after(10):
        while not await model_ready("probe"):  # noqa: ASYNC110 - asking the server is the point
            await trio.sleep(0.05)
    assert not await model_ready("broken")
    assert not (await probe.client.call("ServerReady", pb.ServerReadyRequest())).ready
    request = pb.ModelInferRequest(model_name="broken")
    error = await probe.client.error("ModelInfer", request)
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert error.details() == "model 'broken' is not ready"
    assert await probe.call(deadline=5) > 0


# -- storms and chaos -------------------------------------------------------------------------


async def test_after_a_deadline_storm_a_normal_request_is_served(probe: Probe) -> None:
    # MLServer's failure: 25 clients, a 100 ms model, 50 ms deadlines; afterwards every request
    # failed for minutes because the workers still ran every abandoned call.
    stop_at = time.monotonic() + 1.5
    codes: Counter[grpc.StatusCode] = Counter()

    def storm() -> None:
        while time.monotonic() < stop_at:
            try:
                probe.client.stub.ModelInfer(
                    probe_request(action="sleep", delay_ms=100), timeout=0.05
                )
                codes[grpc.StatusCode.OK] += 1
            except grpc.RpcError as error:
                codes[error.code()] += 1

    def storms() -> None:
        with concurrent.futures.ThreadPoolExecutor(25) as pool:
            for future in [pool.submit(storm) for _ in range(25)]:
                future.result()

    await trio.to_thread.run_sync(storms)
    assert set(codes) == {grpc.StatusCode.DEADLINE_EXCEEDED}
    # Served at once, within a deadline MLServer missed for ~185 s (speed is measured in bench/).
    await probe.call(deadline=2, action="sleep", delay_ms=1)
    await probe.wait_idle()


async def test_chaos_every_request_ends_with_exactly_one_status(probe: Probe) -> None:
    rng = random.Random(7)
    plans = [(rng.uniform(0.05, 1.0), rng.randint(0, 150), rng.random() < 0.1) for _ in range(300)]
    results: list[str] = []

    def one(plan: tuple[float, int, bool]) -> None:
        deadline, delay_ms, cancel = plan
        request = probe_request(tag=f"c{delay_ms}", action="sleep", delay_ms=delay_ms)
        future = probe.client.stub.ModelInfer.future(request, timeout=deadline)
        if cancel:
            time.sleep(deadline / 3)
            future.cancel()
        try:
            future.result()
            outcome = "OK"
        except grpc.FutureCancelledError:
            outcome = "CANCELLED"
        except grpc.RpcError as error:
            outcome = error.code().name
            if outcome == "DEADLINE_EXCEEDED" and error.details() == "deadline exceeded":
                outcome = "DEADLINE_EXCEEDED by the server"
        results.append(outcome)

    def load() -> None:
        with concurrent.futures.ThreadPoolExecutor(25) as pool:
            list(pool.map(one, plans))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.to_thread.run_sync, load)
        for tag in ("c120", "c140"):
            with trio.move_on_after(5):
                pid = await probe.wait_started(tag)
                os.kill(pid, signal.SIGKILL)
    assert len(results) == len(plans)
    outcomes = Counter(results)
    assert set(outcomes) <= {
        "OK",
        "CANCELLED",
        "DEADLINE_EXCEEDED",
        "DEADLINE_EXCEEDED by the server",
        "UNAVAILABLE",
    }, outcomes
    assert outcomes["OK"] > 0
    assert outcomes["DEADLINE_EXCEEDED by the server"] > 0
    # Nothing is left behind: no call in flight, no worker busy for nobody.
    await probe.wait_idle()
    assert probe.server.service.pool.statistics().busy == 0
    assert await probe.call(deadline=5) > 0
