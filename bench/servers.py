"""The servers under test: how to install, start, find the workers of, and stop each one.

Every server runs as a subprocess on 127.0.0.1 with free ports, in its own session (so its own
process group): stopping one sends SIGTERM to the server, then SIGKILL to its whole group and to
any descendant that left it, so no process outlives the benchmark, on errors and Ctrl+C too
(:func:`stop_all` runs from ``finally`` and ``atexit``).

Peers are installed on first use into their own virtual environments under ``bench/.venvs/``;
a peer that cannot be installed or started is reported as missing with the reason.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import http.client
import importlib.metadata
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import grpc

from trio_infer.protobuf._proto import grpc_predict_v2_pb2 as pb
from trio_infer.protobuf._proto import grpc_predict_v2_pb2_grpc as pb_grpc
from trio_infer.repository.settings import SETTINGS_FILE

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "bench"
PEERS = BENCH / "peers"
VENVS = BENCH / ".venvs"
RESULTS = BENCH / "results"

#: Seconds a pip install may take before the peer is declared missing.
INSTALL_TIMEOUT = 1200.0
#: Seconds a server gets to answer ServerLive and report its models ready.
START_TIMEOUT = 90.0
#: Seconds a server gets to exit after SIGTERM before its process group is killed.
STOP_TIMEOUT = 8.0


class PeerUnavailable(Exception):
    """A server could not be installed or started; the message says why."""


@dataclass(frozen=True)
class Ports:
    """The ports one server instance listens on: gRPC and REST are benchmarked (REST when the
    server has it: :attr:`ServerProcess.http_port`), metrics only where a server needs one."""

    grpc: int
    http: int
    metrics: int


@dataclass(frozen=True)
class ServerKind:
    """One kind of server: its environment, command line and how to find its workers.

    Attributes:
        name: The name used in ``--servers`` and the table.
        requirements: pip requirements of its own venv; empty to run in this interpreter.
        serves: Scenario kinds it can run (``live``, ``dense``, ``sleep``, ``priority``, ``storm``,
            ``kill``, ``rest-live``, ``rest-dense``, ...).
        command: Builds the command line from (python, ports, workers).
        environment: Extra environment variables from (ports, workers).
        find_workers: Worker pids from the server's pid; None when it has no worker processes.
        workers_note: How workers are found, or why there are none (README and table).
        models: Models to wait for before the server counts as started (on the server the
            shared scenarios run on, plus the runtime models written when a ``runtime``
            scenario runs; a scenario's own server waits for ``dense`` and ``sleep``).
        workdir: The server's working directory. A baseline runs in its own source tree, so
            that its worker processes import its own ``trio_infer``, not this checkout's.
        venv: The venv's folder under ``bench/.venvs`` (kinds with the same requirements may
            share one); ``name`` when empty.
        by_default: Whether it runs when ``--servers`` is not given.
        has_rest: Whether the server started with this Python serves REST on ``Ports.http``.
        no_binary_rest: Why its REST does not take Triton's binary tensor extension (its binary
            REST rows then show ``-`` with this note); empty when it does.
    """

    name: str
    requirements: tuple[str, ...]
    serves: frozenset[str]
    command: Callable[[Path, Ports, int], list[str]]
    environment: Callable[[Ports, int], dict[str, str]]
    find_workers: Callable[[int], list[int]] | None
    workers_note: str
    models: tuple[str, ...] = ("dense", "sleep")
    workdir: Path = REPO
    venv: str = ""
    by_default: bool = True
    repository: Path | None = None
    """The model repository of the server the shared scenarios run on (not of a scenario's own
    server), last on its command line: trio-infer's with the decoupled ``ticks``, MLServer's
    with its custom runtimes; a run with a ``runtime`` scenario serves a copy with
    ``runtime_models`` added (:func:`with_runtime_models`)."""
    has_rest: Callable[[Path], bool] = lambda python: True
    no_binary_rest: str = ""
    runtime_models: tuple[str, ...] = ()
    """The models of :mod:`bench.peers.runtime_models` it serves in the ``runtime`` scenarios."""
    no_runtime: str = ""
    """Why a ``runtime`` row of a model not in ``runtime_models`` shows ``-``."""

    @property
    def shared_args(self) -> tuple[str, ...]:
        """Appended to the command line of the server the shared scenarios run on."""
        return (str(self.repository),) if self.repository else ()


# ------------------------------------------------------------------------------------------
# /proc: process trees


@dataclass(frozen=True)
class ProcInfo:
    """One process as /proc shows it."""

    pid: int
    ppid: int
    start_ticks: int
    cmdline: str


def process_table() -> dict[int, ProcInfo]:
    """Every live process's parent, start time and command line (Linux /proc)."""
    table: dict[int, ProcInfo] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            raw_cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue  # exited meanwhile
        # The command name (field 2) may hold spaces and parentheses: split after its last ')'.
        fields = stat[stat.rindex(")") + 2 :].split()
        cmdline = raw_cmdline.replace(b"\0", b" ").decode(errors="replace").strip()
        table[pid] = ProcInfo(pid, int(fields[1]), int(fields[19]), cmdline)
    return table


def descendants(root: int, table: Mapping[int, ProcInfo] | None = None) -> list[ProcInfo]:
    """Every process below ``root`` in the process tree, parents before children."""
    table = process_table() if table is None else table
    children: dict[int, list[ProcInfo]] = {}
    for info in table.values():
        children.setdefault(info.ppid, []).append(info)
    found: list[ProcInfo] = []
    frontier = [root]
    while frontier and len(found) < 10_000:
        pid = frontier.pop()
        for child in sorted(children.get(pid, []), key=lambda info: info.pid):
            found.append(child)
            frontier.append(child.pid)
    return found


def _is_resource_tracker(info: ProcInfo) -> bool:
    return "multiprocessing.resource_tracker" in info.cmdline


def trio_infer_workers(server_pid: int) -> list[int]:
    """trio-infer's workers: the children of its multiprocessing fork server.

    trio-parallel's FORKSERVER workers are forked by the fork server (a child of the server
    whose command line names ``multiprocessing.forkserver``), so they share its command line;
    the resource tracker (``multiprocessing.resource_tracker``) is a helper, not a worker.
    """
    table = process_table()
    below = descendants(server_pid, table)
    forkservers = {
        info.pid
        for info in below
        if info.ppid == server_pid and "multiprocessing.forkserver" in info.cmdline
    }
    return [info.pid for info in below if info.ppid in forkservers]


def mlserver_workers(server_pid: int) -> list[int]:
    """MLServer's parallel workers: the server's children started by multiprocessing spawn.

    Their command lines name ``multiprocessing.spawn``; the resource tracker is excluded.
    """
    return [
        info.pid
        for info in descendants(server_pid)
        if info.ppid == server_pid
        and "multiprocessing.spawn" in info.cmdline
        and not _is_resource_tracker(info)
    ]


def triton_workers(server_pid: int) -> list[int]:
    """Triton's Python backend stubs: the server's children running
    ``triton_python_backend_stub``, one per model instance (``workers`` of ``dense`` and as many
    of ``sleep``), ``sleep``'s first, so that the ``kill`` scenario (which kills the first
    worker listed while it loads ``sleep``) kills one that holds calls. A killed stub stays a
    zombie until Triton reaps it; its command line is empty, so it is not listed.
    """
    stubs = [
        info
        for info in descendants(server_pid)
        if info.ppid == server_pid and "triton_python_backend_stub" in info.cmdline
    ]
    return [
        info.pid
        for info in sorted(
            stubs, key=lambda info: ("/sleep/1/model.py" not in info.cmdline, info.pid)
        )
    ]


def memory_kib(pid: int) -> tuple[int, int] | None:
    """A process's resident memory now and at its peak (``VmRSS``, ``VmHWM``), in KiB.

    None when the process is gone (or is a zombie, which has no memory).
    """
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return None
    found = {
        name: int(rest.split()[0])
        for name, _, rest in (line.partition(":") for line in lines)
        if name in ("VmRSS", "VmHWM")
    }
    if len(found) < 2:
        return None
    return found["VmRSS"], found["VmHWM"]


#: Clock ticks per second, the unit of CPU times in /proc.
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float | None:
    """A process's CPU time so far, user + system over all its threads (``/proc/<pid>/stat``
    fields 14 and 15), in seconds; None when the process is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def machine_cpu_seconds() -> tuple[float, float]:
    """The machine's busy and total CPU seconds since boot, summed over its cores (the
    ``cpu`` line of /proc/stat: idle and iowait are not busy)."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    total = sum(values)
    return (total - values[3] - values[4]) / CLOCK_TICKS, total / CLOCK_TICKS


@dataclass(frozen=True)
class CpuSnapshot:
    """CPU seconds used so far by the benchmark's process (the client), a second client
    process (the overload's other clients; 0 without one), a server and the server's
    descendants (its workers and helpers), and the whole machine."""

    at: float
    """``time.perf_counter()`` when taken."""
    client: float
    others: float
    server: float
    children: dict[int, float]
    machine_busy: float
    machine_total: float

    @classmethod
    def take(cls, server_pid: int, others_pid: int | None = None) -> CpuSnapshot:
        """Read them all now."""
        children = {
            info.pid: seconds
            for info in descendants(server_pid)
            if (seconds := cpu_seconds(info.pid)) is not None
        }
        busy, total = machine_cpu_seconds()
        return cls(
            at=time.perf_counter(),
            client=cpu_seconds(os.getpid()) or 0.0,
            others=(cpu_seconds(others_pid) or 0.0) if others_pid is not None else 0.0,
            server=cpu_seconds(server_pid) or 0.0,
            children=children,
            machine_busy=busy,
            machine_total=total,
        )

    def spent(self, later: CpuSnapshot) -> dict[str, float]:
        """CPU seconds used from this snapshot to ``later``: ``client``, ``others``, ``server``,
        ``workers`` (its descendants alive at ``later``; one born in between counts whole, one
        gone by then is missed with all its ticks: see :meth:`exited`) and ``machine`` (every
        process)."""
        return {
            "client": later.client - self.client,
            "others": later.others - self.others,
            "server": later.server - self.server,
            "workers": sum(t - self.children.get(pid, 0.0) for pid, t in later.children.items()),
            "machine": later.machine_busy - self.machine_busy,
        }

    def exited(self, later: CpuSnapshot) -> int:
        """Descendants seen in this snapshot and gone by ``later``: :meth:`spent` misses the
        CPU they used in between (/proc has no process left to read it from)."""
        return len(self.children.keys() - later.children.keys())

    def until(self, later: CpuSnapshot) -> dict[str, float]:
        """Cores used on average from this snapshot to ``later``: each figure of
        :meth:`spent` over the seconds between them, and ``cores`` (the machine's)."""
        seconds = later.at - self.at
        cores = (later.machine_total - self.machine_total) / seconds if seconds > 0 else 0.0
        spent = self.spent(later)
        if seconds <= 0:
            return {"seconds": 0.0, **dict.fromkeys(spent, 0.0), "cores": cores}
        return {
            "seconds": round(seconds, 2),
            **{name: round(value / seconds, 2) for name, value in spent.items()},
            "cores": round(cores),
        }


@dataclass(frozen=True)
class MemorySample:
    """Resident memory of a server at one moment, in KiB."""

    at: float
    """``time.perf_counter()`` when taken."""
    server: int
    """The server process's VmRSS."""
    workers: int
    """The sum of its worker processes' VmRSS."""


class MemorySampler:
    """Samples a server's RSS and its workers' (summed) every ``interval`` s, in a thread.

    Use as a context manager: sampling runs inside the ``with`` block. The worker list is
    refreshed every ``refresh`` s (a scan of /proc) and whenever a worker is gone.
    """

    def __init__(self, server: ServerProcess, interval: float = 0.1, refresh: float = 1.0):
        self._server_pid = server.pid
        self._find_workers = server.worker_pids
        self._interval = interval
        self._refresh = refresh
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self.samples: list[MemorySample] = []
        self.workers_seen: set[int] = set()
        """Every worker pid found (more than the pool's size: workers were replaced; a worker
        that lived less than ``refresh`` s may be missed)."""
        self.server_peak_kib = 0
        """The server process's VmHWM (kernel's high-water mark) at the last sample."""

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        workers: list[int] = []
        found_at = -math.inf
        tick = time.perf_counter()
        while True:
            now = time.perf_counter()
            if now - found_at >= self._refresh:
                workers, found_at = self._find_workers(), now
                self.workers_seen.update(workers)
            server = memory_kib(self._server_pid)
            if server is None:
                return  # the server is gone
            workers_kib = 0
            for pid in workers:
                memory = memory_kib(pid)
                if memory is None:
                    found_at = -math.inf  # a worker died: look again next time
                else:
                    workers_kib += memory[0]
            self.samples.append(MemorySample(now, server[0], workers_kib))
            self.server_peak_kib = server[1]
            tick += self._interval
            if self._stop.wait(max(0.0, tick - time.perf_counter())):
                return


# ------------------------------------------------------------------------------------------
# The servers


def _thread_env(workers: int, cores: int | None = None) -> dict[str, str]:
    """One BLAS/OpenMP thread pool per worker sized like trio-infer's (cores // workers; the
    machine's cores unless ``cores`` is given: those of a server pinned by ``--cpus``)."""
    threads = str(max(1, (cores or os.cpu_count() or 1) // workers))
    return {
        name: threads for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
    }


def _trio_infer_start(python: Path) -> list[str]:
    script = python.parent / "trio-infer"
    return [str(script)] if script.exists() else [str(python), "-m", "trio_infer"]


@functools.cache
def trio_infer_has_rest(python: Path) -> bool:
    """Whether the trio-infer installed for ``python`` serves REST (has ``--http-port``): a
    ``--baseline`` commit from before it has no REST rows."""
    done = subprocess.run(
        [*_trio_infer_start(python), "serve", "--help"],
        # Not the checkout: `python -m trio_infer` would import its trio_infer from there.
        cwd=python.parent, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    return "--http-port" in done.stdout


def _trio_infer_command(python: Path, ports: Ports, workers: int) -> list[str]:
    # Always a port of its own when it has REST: its default, 8080, may be taken.
    rest = ["--http-port", str(ports.http)] if trio_infer_has_rest(python) else []
    return [
        *_trio_infer_start(python), "serve", "--host", "127.0.0.1",
        "--grpc-port", str(ports.grpc), *rest, "--workers", str(workers), "--grace-period", "2",
    ]  # fmt: skip


def _mlserver_command(python: Path, ports: Ports, workers: int) -> list[str]:
    # The repository follows (ServerKind.repository): a run's copy when it has runtime models.
    return [str(python.parent / "mlserver"), "start"]


def _mlserver_env(ports: Ports, workers: int) -> dict[str, str]:
    return {
        "MLSERVER_HOST": "127.0.0.1",
        "MLSERVER_GRPC_PORT": str(ports.grpc),
        "MLSERVER_HTTP_PORT": str(ports.http),
        "MLSERVER_METRICS_PORT": str(ports.metrics),
        "MLSERVER_PARALLEL_WORKERS": str(workers),
        # bench_runtime.py, also in a run's copy of the repository (the same code).
        "PYTHONPATH": str(MLSERVER_MODELS),
        **_thread_env(workers),
    }


def _kserve_command(python: Path, ports: Ports, workers: int) -> list[str]:
    return [
        str(python), str(PEERS / "kserve_server.py"), "--grpc_port", str(ports.grpc),
        "--http_port", str(ports.http), "--workers", str(workers),
        "--enable_latency_logging", "false",
    ]  # fmt: skip


def _triton_command(python: Path, ports: Ports, workers: int) -> list[str]:
    return [
        str(python), str(PEERS / "triton_server.py"), str(ports.grpc), str(ports.http),
        str(workers),
    ]  # fmt: skip


def _triton_nobatch_command(python: Path, ports: Ports, workers: int) -> list[str]:
    return [*_triton_command(python, ports, workers), "--no-batching"]


def _triton_env(ports: Ports, workers: int) -> dict[str, str]:
    return _thread_env(workers)


def _grpcio_command(python: Path, ports: Ports, workers: int) -> list[str]:
    return [str(python), "-m", "bench.peers.grpcio_server", str(ports.grpc), str(ports.http)]


def _floor_command(module: str, *extra: str) -> Callable[[Path, Ports, int], list[str]]:
    def command(python: Path, ports: Ports, workers: int) -> list[str]:
        return [str(python), "-m", module, str(ports.grpc), *extra]

    return command


def _floor(name: str, command: Callable[[Path, Ports, int], list[str]], note: str) -> ServerKind:
    """A floor of a Python front-end (``bench/peers/h2_floor.py``, ``frames_floor.py``):
    ServerLive only, no REST, no workers, run only when named."""
    return ServerKind(
        name=name,
        requirements=(),
        serves=frozenset({"live"}),
        command=command,
        environment=_no_env,
        find_workers=None,
        workers_note=note,
        has_rest=lambda python: False,
        models=(),
        by_default=False,
    )


def _no_env(ports: Ports, workers: int) -> dict[str, str]:
    return {}


#: REST (HTTP/1.1): ``GET /v2/health/live`` and ``dense`` in JSON or Triton's binary extension.
REST_KINDS = frozenset({"rest-live", "rest-dense"})
ALL_KINDS = frozenset({"live", "dense", "sleep", "priority", "storm", "kill"}) | REST_KINDS
#: Unary ``add_sub``, ModelStreamInfer and a decoupled model: trio-infer and Triton only
#: (MLServer streams only with parallel workers off; KServe's V2 gRPC has no ModelStreamInfer).
STREAM_KINDS = frozenset({"add_sub", "stream", "decoupled"})
#: trio-infer alone also runs the scenarios that start it with its own settings (not a
#: ``--baseline``: its ``serves`` is ALL_KINDS, as an older tree may lack their options).
#: The built-in runtimes' models (bench/peers/runtime_models.py), against MLServer's own.
RUNTIME_KINDS = frozenset({"runtime"})
TRIO_INFER_KINDS = (
    ALL_KINDS | STREAM_KINDS | RUNTIME_KINDS | {"overload", "batching", "hostile", "repository"}
)
#: trio-infer's repository for the shared scenarios: the examples' settings plus ``ticks``.
TRIO_MODELS = PEERS / "trio_models"
#: MLServer's: ``dense`` and ``sleep`` on the custom runtimes of its ``bench_runtime.py``.
MLSERVER_MODELS = PEERS / "mlserver_repo"
STREAM_MODELS = ("dense", "sleep", "add_sub", "ticks")
#: Triton's and Triton-nobatch's ``no_runtime``.
TRITON_NO_RUNTIME = (
    "not run: the PyTriton wheel's Triton has only the Python backend (no FIL or ONNX Runtime)"
)


def _sklearn_pin() -> tuple[str, ...]:
    """``scikit-learn==<the release of this interpreter>``, for MLServer's venv: the runtime
    models' joblib file is written here, once, and read by the release that wrote it (here for
    the first answer's check, in trio-infer's workers and in MLServer's). Nothing without
    scikit-learn here (the runtime rows are then ``-``)."""
    try:
        return (f"scikit-learn=={importlib.metadata.version('scikit-learn')}",)
    except importlib.metadata.PackageNotFoundError:
        return ()


TRITON_REQUIREMENTS = ("nvidia-pytriton==0.7.0", "numpy")

SERVERS: dict[str, ServerKind] = {
    kind.name: kind
    for kind in (
        ServerKind(
            name="trio-infer",
            requirements=(),
            serves=TRIO_INFER_KINDS,
            command=_trio_infer_command,
            environment=_no_env,
            find_workers=trio_infer_workers,
            workers_note="children of the multiprocessing fork server",
            models=STREAM_MODELS,
            repository=TRIO_MODELS,
            has_rest=trio_infer_has_rest,
            runtime_models=("sklearn_forest", "onnx_forest"),
        ),
        ServerKind(
            name="mlserver",
            # uvloop 0.22+ kills MLServer 1.7.1's parallel workers at start
            # ("There is no current event loop").
            requirements=(
                "mlserver==1.7.1",
                "uvloop==0.21.0",
                "mlserver-sklearn==1.7.1",
                *_sklearn_pin(),
            ),
            serves=ALL_KINDS | RUNTIME_KINDS,
            command=_mlserver_command,
            environment=_mlserver_env,
            find_workers=mlserver_workers,
            workers_note="children started by multiprocessing spawn (parallel_workers)",
            # Its REST reads the body as JSON only (no Inference-Header-Content-Length).
            no_binary_rest="MLServer's REST has no binary tensor extension (JSON only)",
            repository=MLSERVER_MODELS,
            runtime_models=("sklearn_forest",),
            no_runtime="not run: MLServer 1.7.1 has no ONNX runtime",
        ),
        ServerKind(
            name="kserve",
            requirements=("kserve==0.21.0",),
            serves=ALL_KINDS | RUNTIME_KINDS,
            command=_kserve_command,
            environment=_no_env,
            find_workers=None,
            workers_note="no worker processes: V2 gRPC runs every model in the main process",
            no_runtime="not run: KServe serves scikit-learn and ONNX from model servers of "
            "their own (sklearnserver, Triton), not set up here",
        ),
        ServerKind(
            name="triton",
            # Triton 2.51.0's own tritonserver and Python backend, shipped in PyTriton's wheel.
            requirements=TRITON_REQUIREMENTS,
            serves=ALL_KINDS | STREAM_KINDS | RUNTIME_KINDS,
            command=_triton_command,
            models=STREAM_MODELS,
            environment=_triton_env,
            find_workers=triton_workers,
            workers_note="Python backend stubs, one per model instance (2 x N), sleep's first",
            no_runtime=TRITON_NO_RUNTIME,
        ),
        ServerKind(
            name="triton-nobatch",
            requirements=TRITON_REQUIREMENTS,
            serves=ALL_KINDS | STREAM_KINDS | RUNTIME_KINDS,
            command=_triton_nobatch_command,
            models=STREAM_MODELS,
            environment=_triton_env,
            find_workers=triton_workers,
            workers_note="Python backend stubs, one per model instance (2 x N), sleep's first",
            no_runtime=TRITON_NO_RUNTIME,
            venv="triton",
            by_default=False,  # only dense differs from triton: run it by name
        ),
        ServerKind(
            name="grpcio",
            requirements=(),
            serves=frozenset({"live"}) | REST_KINDS,
            command=_grpcio_command,
            environment=_no_env,
            find_workers=None,
            workers_note="bare grpc.aio server (ServerLive) and canned HTTP/1.1 answers",
            models=(),
        ),
        _floor(
            "h2-floor",
            _floor_command("bench.peers.h2_floor"),
            "bare h2 on Trio, one task per connection, canned ServerLive answers",
        ),
        _floor(
            "frames-floor",
            _floor_command("bench.peers.frames_floor"),
            "HTTP/2 frames parsed by hand on Trio, canned ServerLive answers",
        ),
        _floor(
            "tasks-floor",
            _floor_command("bench.peers.frames_floor", "tasks"),
            "frames-floor with a task, a cancel scope and a writer wake-up per call",
        ),
    )
}


# ------------------------------------------------------------------------------------------
# Installing


def _tail(path: Path, lines: int = 2, width: int = 240) -> str:
    """The last error lines of a log (or its last lines), short enough for a table cell."""
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    errors = [line for line in text if "ERROR" in line or "Error" in line]
    tail = " | ".join(line.strip() for line in (errors or text)[-lines:])
    return tail if len(tail) <= width else tail[: width - 3] + "..."


def ensure_installed(kind: ServerKind, log: Callable[[str], None]) -> Path:
    """The Python interpreter that runs ``kind``, installing its venv on first use.

    Raises:
        PeerUnavailable: pip failed or timed out; the message quotes pip's last error.
    """
    if not kind.requirements:
        return Path(sys.executable)
    return ensure_venv(kind.venv or kind.name, kind.requirements, log)


def ensure_venv(name: str, requirements: Sequence[str], log: Callable[[str], None]) -> Path:
    """The Python of ``bench/.venvs/NAME`` with ``requirements``, created on first use.

    A venv is reused while its marker file lists the same requirements.

    Raises:
        PeerUnavailable: pip failed or timed out; the message quotes pip's last error.
    """
    venv = VENVS / name
    python = venv / "bin" / "python"
    marker = venv / ".bench-requirements"
    wanted = "\n".join(requirements)
    if python.exists() and marker.exists() and marker.read_text() == wanted:
        return python
    RESULTS.mkdir(parents=True, exist_ok=True)
    install_log = RESULTS / f"install-{name}.log"
    log(f"installing {name} ({', '.join(requirements)}) into {venv} ...")
    steps = [
        [sys.executable, "-m", "venv", "--clear", str(venv)],
        [str(python), "-m", "pip", "install", "--quiet", "--upgrade", "pip"],
        [str(python), "-m", "pip", "install", *requirements],
    ]
    deadline = time.monotonic() + INSTALL_TIMEOUT
    with install_log.open("w") as out:
        for step in steps:
            try:
                subprocess.run(
                    step, stdout=out, stderr=subprocess.STDOUT, check=True,
                    timeout=max(1.0, deadline - time.monotonic()),
                )  # fmt: skip
            except subprocess.TimeoutExpired:
                raise PeerUnavailable(f"install timed out ({install_log})") from None
            except subprocess.CalledProcessError:
                out.flush()
                raise PeerUnavailable(f"install failed: {_tail(install_log)}") from None
    marker.write_text(wanted)
    return python


# ------------------------------------------------------------------------------------------
# Repositories


def copy_repository(source: Path, destination: Path, *, models_only: bool = False) -> Path:
    """A copy of the model repository ``source`` at ``destination`` (no ``__pycache__``), for a
    server to serve with a run's own changes; ``models_only``: only the folders that hold a
    ``model-settings.json`` (the examples' package has Python modules beside them)."""
    ignore = shutil.ignore_patterns("__pycache__")
    if not models_only:
        shutil.copytree(source, destination, ignore=ignore)
        return destination
    for folder in sorted(source.iterdir()):
        if (folder / SETTINGS_FILE).is_file():
            shutil.copytree(folder, destination / folder.name, ignore=ignore)
    return destination


def with_runtime_models(
    kinds: Sequence[ServerKind], root: Path, log: Callable[[str], None]
) -> dict[ServerKind, ServerKind]:
    """Each kind that serves runtime models, as it serves a copy of its repository under
    ``root`` with them written in (:mod:`bench.peers.runtime_models`), its readiness waiting
    for those written too. Empty when scikit-learn is not installed here (the runtime rows are
    then ``-``)."""
    chosen = [
        kind
        for kind in kinds
        if kind.runtime_models and kind.repository and "runtime" in kind.serves
    ]
    if not chosen:
        return {}
    try:
        # scikit-learn (and skl2onnx) only for runs with a runtime scenario: not a bench extra.
        from bench.peers import runtime_models
    except ImportError as error:
        log(f"no runtime models: {error} (pip install -e '.[test]' has what they need)")
        return {}
    served: dict[ServerKind, ServerKind] = {}
    for kind in chosen:
        assert kind.repository is not None
        copy = copy_repository(kind.repository, root / kind.name)
        if kind.name == "mlserver":
            runtime_models.write_models(None, copy)
        else:
            runtime_models.write_models(copy, None)
        written = tuple(name for name in kind.runtime_models if (copy / name).is_dir())
        served[kind] = replace(kind, repository=copy, models=kind.models + written)
    return served


# ------------------------------------------------------------------------------------------
# Pinning to CPUs (--cpus)


@dataclass(frozen=True)
class CpuSet:
    """CPUs a server is pinned to: started as ``taskset -c SPEC command``, so that the worker
    processes it starts inherit the mask."""

    spec: str
    """As given, in ``taskset -c`` syntax (``0``, ``0-1``, ``0,2``, ``0-7:2``): the table's
    ``cpus`` column and each row's ``cpus`` in ``results.jsonl``."""
    cpus: frozenset[int]


#: One item of a ``taskset -c`` list: a CPU, or a range with an optional stride.
_CPU_ITEM = re.compile(r"(\d+)(?:-(\d+)(?::(\d+))?)?")


def _cpu_list(cpus: Collection[int]) -> str:
    """CPUs written short, ``0-3,6``."""
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and cpu == runs[-1][-1] + 1:
            runs[-1].append(cpu)
        else:
            runs.append([cpu])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def _cpu_range(item: str) -> range | None:
    """The CPUs of one item of a ``taskset -c`` list; None when it is not one."""
    match = _CPU_ITEM.fullmatch(item)
    if match is None:
        return None
    first = int(match[1])
    last = int(match[2] or first)
    step = int(match[3] or 1)
    return range(first, last + 1, step) if first <= last and step >= 1 else None


def parse_cpu_set(spec: str, available: Collection[int]) -> CpuSet:
    """One CPU set in ``taskset -c`` syntax: comma-separated CPUs and ranges (``a-b``, with an
    optional stride ``a-b:s``).

    Raises:
        ValueError: The set is empty, is not in that syntax, or names a CPU not in
            ``available``.
    """
    spec = "".join(spec.split())  # taskset takes no spaces
    if not spec:
        raise ValueError("--cpus: an empty CPU set (each set between the slashes names a CPU)")
    cpus: set[int] = set()
    for item in spec.split(","):
        found = _cpu_range(item)
        if found is None:
            raise ValueError(
                f"--cpus: {spec!r} is not a CPU list as `taskset -c` takes one "
                "(e.g. 0, 0-1, 0,2, 0-7:2; sets are separated by /)"
            )
        cpus.update(found)
    lacking = cpus - set(available)
    if lacking:
        raise ValueError(
            f"--cpus: {spec!r} names CPU{'s' if len(lacking) > 1 else ''} {_cpu_list(lacking)}, "
            f"which this machine lacks (the benchmark may use CPUs {_cpu_list(available)})"
        )
    return CpuSet(spec, frozenset(cpus))


def parse_cpu_sets(text: str, available: Collection[int] | None = None) -> list[CpuSet]:
    """``--cpus``: CPU sets separated by ``/`` (``0/0-1``), each checked by
    :func:`parse_cpu_set` against ``available`` (default: the CPUs this process may run on,
    ``os.sched_getaffinity(0)``), in the order given.

    Raises:
        ValueError: A set is bad (empty, not ``taskset -c`` syntax, a CPU out of range) or
            given twice.
    """
    available = os.sched_getaffinity(0) if available is None else available
    sets: list[CpuSet] = []
    for spec in text.split("/"):
        cpu_set = parse_cpu_set(spec, available)
        twin = next((other for other in sets if other.cpus == cpu_set.cpus), None)
        if twin is not None:
            raise ValueError(f"--cpus: {cpu_set.spec!r} is the same set as {twin.spec!r}")
        sets.append(cpu_set)
    return sets


def require_taskset() -> str:
    """The path of ``taskset``, which pins the servers of a run with ``--cpus``.

    Raises:
        ValueError: It is not on PATH.
    """
    found = shutil.which("taskset")
    if found is None:
        raise ValueError("--cpus needs taskset (util-linux), which is not on PATH")
    return found


# ------------------------------------------------------------------------------------------
# Running


def free_port() -> int:
    """A port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


_RUNNING: set[ServerProcess] = set()


@dataclass(eq=False)
class ServerProcess:
    """One running server; :meth:`start`, then :meth:`stop` (idempotent)."""

    kind: ServerKind
    python: Path
    workers: int
    log_dir: Path
    extra_args: tuple[str, ...] = ()
    """Appended to the command line (a scenario's own server: memory budget, repository)."""
    label: str = ""
    """Names the log of a scenario's own server: ``server-<kind>-<label>.log``."""
    cpus: CpuSet | None = None
    """The CPUs it is pinned to (``--cpus``), which also name its log
    (``server-<kind>[-<label>]-cpus<spec>.log``); None: not pinned."""
    ports: Ports = field(init=False)
    process: subprocess.Popen[bytes] | None = field(init=False, default=None)
    starts: int = field(init=False, default=0)

    @property
    def target(self) -> str:
        """The gRPC address, host:port."""
        return f"127.0.0.1:{self.ports.grpc}"

    @property
    def http_port(self) -> int | None:
        """The REST port on 127.0.0.1; None when this server has no REST."""
        return self.ports.http if self.kind.has_rest(self.python) else None

    @property
    def pid(self) -> int:
        """The server's process id (also its process group id)."""
        assert self.process is not None
        return self.process.pid

    @property
    def log_path(self) -> Path:
        """Where the server's stdout and stderr go."""
        suffix = f"-{self.label}" if self.label else ""
        if self.cpus is not None:
            suffix += f"-cpus{self.cpus.spec}"
        return self.log_dir / f"server-{self.kind.name}{suffix}.log"

    @property
    def models(self) -> tuple[str, ...]:
        """The models to wait for: a scenario's own server (``label``) serves the built-in
        examples, or a copy of them, so not ``ticks``."""
        if not self.label:
            return self.kind.models
        return tuple(name for name in self.kind.models if name in ("dense", "sleep"))

    def alive(self) -> bool:
        """Whether the server process is still running."""
        return self.process is not None and self.process.poll() is None

    def worker_pids(self) -> list[int]:
        """The server's worker processes now (empty when it has none)."""
        if self.kind.find_workers is None or not self.alive():
            return []
        return self.kind.find_workers(self.pid)

    def start(self, timeout: float = START_TIMEOUT) -> float:
        """Start the server and wait until it is live with its models ready.

        Returns:
            Seconds from launch to ready.

        Raises:
            PeerUnavailable: It exited or was not ready in time; the message quotes its log.
        """
        self.stop()
        self.ports = Ports(free_port(), free_port(), free_port())
        self.log_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **self._environment()}
        env["PYTHONUNBUFFERED"] = "1"
        self.starts += 1
        launched = time.monotonic()
        with self.log_path.open("ab") as log:
            log.write(f"\n==== start {self.starts} ====\n".encode())
            log.flush()
            self.process = subprocess.Popen(
                self._command(),
                cwd=self.kind.workdir,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        _RUNNING.add(self)
        try:
            self._wait_ready(launched + timeout)
        except BaseException:
            self.stop()
            raise
        return time.monotonic() - launched

    def _command(self) -> list[str]:
        """The server's command line; after ``taskset -c SPEC`` when pinned (taskset execs it:
        the pid stays the server's, and every process it starts inherits the mask)."""
        command = [*self.kind.command(self.python, self.ports, self.workers), *self.extra_args]
        return command if self.cpus is None else ["taskset", "-c", self.cpus.spec, *command]

    def _environment(self) -> dict[str, str]:
        """The kind's extra environment; its BLAS/OpenMP thread counts (:func:`_thread_env`)
        sized for the CPUs it is pinned to, when it is."""
        extra = self.kind.environment(self.ports, self.workers)
        if self.cpus is not None:
            pinned = _thread_env(self.workers, len(self.cpus.cpus))
            extra |= {name: value for name, value in pinned.items() if name in extra}
        return extra

    def _wait_ready(self, deadline: float) -> None:
        """Until ServerLive and ModelReady of every model say so, and REST is live too (its
        listener may open after gRPC's: KServe's uvicorn processes start on their own)."""
        with grpc.insecure_channel(self.target) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            while time.monotonic() < deadline:
                if not self.alive():
                    raise PeerUnavailable(f"exited at start: {_tail(self.log_path)}")
                try:
                    if (
                        stub.ServerLive(pb.ServerLiveRequest(), timeout=1.0).live
                        and all(
                            stub.ModelReady(pb.ModelReadyRequest(name=name), timeout=1.0).ready
                            for name in self.models
                        )
                        and (self.http_port is None or _rest_live(self.http_port))
                    ):
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.2)
        raise PeerUnavailable(f"not ready after {START_TIMEOUT:.0f} s: {_tail(self.log_path)}")

    def stop(self) -> None:
        """Stop the server and every process below it; safe to call any number of times."""
        process, self.process = self.process, None
        _RUNNING.discard(self)
        if process is None:
            return
        # Remember the tree first: a process that left the group is still killed by pid.
        tree = descendants(process.pid) if process.poll() is None else []
        # SIGTERM to the server alone lets it shut its workers down itself (a signal to the
        # whole group would reach the workers at the same moment); the group gets SIGKILL.
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=STOP_TIMEOUT)
        _signal_group(process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=STOP_TIMEOUT)
        now = process_table()
        for info in tree:
            current = now.get(info.pid)
            if current is not None and current.start_ticks == info.start_ticks:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(info.pid, signal.SIGKILL)


def _rest_live(port: int) -> bool:
    """Whether ``GET /v2/health/live`` on 127.0.0.1:``port`` answers 200."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=1.0)
    try:
        connection.request("GET", "/v2/health/live")
        return connection.getresponse().status == 200
    except (OSError, http.client.HTTPException):
        return False
    finally:
        connection.close()


def _signal_group(pgid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)


def stop_all() -> None:
    """Stop every server still running (called on exit, errors and Ctrl+C)."""
    for server in list(_RUNNING):
        server.stop()


atexit.register(stop_all)


def baseline(revision: str) -> ServerKind:
    """trio-infer as of a git ``revision``, to run side by side with the working tree's.

    The revision's files are exported (``git archive``) to ``bench/.venvs/src-<commit>`` and
    installed, not editable, into a venv of its own; both are made once per commit. It runs the
    scenarios every server runs and the streams of the example models, under the name
    ``trio-infer@<commit>``.

    Raises:
        ValueError: ``revision`` names no commit.
    """
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", f"{revision}^{{commit}}"],
            cwd=REPO, capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
    except subprocess.CalledProcessError:
        raise ValueError(f"--baseline {revision!r} names no commit of this repository") from None
    source = VENVS / f"src-{commit}"
    if not source.exists():
        # Extracted beside it and renamed: an interrupted extraction leaves no tree to reuse.
        VENVS.mkdir(parents=True, exist_ok=True)
        partial = Path(tempfile.mkdtemp(prefix=f"src-{commit}-", dir=VENVS))
        archive = subprocess.run(
            ["git", "archive", commit], cwd=REPO, capture_output=True, check=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(partial)], input=archive, check=True)
        partial.rename(source)
    return replace(
        SERVERS["trio-infer"],
        name=f"trio-infer@{commit}",
        requirements=(str(source),),
        # Streams of the examples too (a tree from before ModelStreamInfer answers them
        # UNIMPLEMENTED, which its rows show); not the decoupled model, which is the bench's.
        serves=ALL_KINDS | {"add_sub", "stream"},
        workdir=source,
        models=("dense", "sleep", "add_sub"),
        repository=None,  # an older tree may not know the repository's settings
        runtime_models=(),
    )


def select(names: Sequence[str]) -> list[ServerKind]:
    """The server kinds named, in the order given.

    Raises:
        ValueError: A name is not a known server.
    """
    unknown = [name for name in names if name not in SERVERS]
    if unknown:
        raise ValueError(f"unknown server(s) {', '.join(unknown)}; known: {', '.join(SERVERS)}")
    return [SERVERS[name] for name in names]
