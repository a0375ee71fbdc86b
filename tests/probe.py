"""A test model that reports on itself, and a server running it.

``Probe`` writes its worker's pid to ``<log>/<tag>.start`` when a call with parameter ``tag``
starts, then does what parameter ``action`` says (``sleep`` for ``delay_ms``, ``hang``,
``segfault``, ``exit``), so tests can see which calls reached a worker and kill that worker.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import trio

from tests.support import GrpcioClient, eventually, start_server
from trio_infer.protobuf._proto import grpc_predict_v2_pb2 as pb
from trio_infer.protobuf.codec import decode_outputs, encode_inputs, encode_parameters
from trio_infer.server import RunningServer

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
                self.server.core.pool.statistics().busy == 0
                and self.server.core.pool.statistics().waiting == 0
            )
        )


def process_exists(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie runs no code), asked of a process that may be reaped at
    any moment, between two of the questions too."""
    try:
        os.kill(pid, 0)
        # A killed child of the fork server stays a zombie until reaped; it runs no code.
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ", 1)[1][0] != "Z"
    except (ProcessLookupError, FileNotFoundError):
        return False


async def start_probe(
    nursery: trio.Nursery,
    tmp_path: Path,
    *,
    server: dict[str, Any] | None = None,
    **settings: object,
) -> Probe:
    """Serve the probe model; ``settings`` go to its model-settings.json, ``server`` to the
    server's configuration (two workers unless it says otherwise)."""
    repository = write_probe_repository(tmp_path, **settings)
    running = await start_server(nursery, repository, **({"workers": 2} | (server or {})))
    return Probe(running, tmp_path / "log")
