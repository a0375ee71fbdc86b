"""Instructions per call of trio-infer's front-end, counted by callgrind: a figure that does not
drift with the machine's speed, for comparing small changes.

    .venv/bin/python -m bench.instructions [--baseline REV] [--calls N] [--scenarios LIST]
                                           [--worker]

Each build (this working tree, and trio-infer as of ``--baseline REV``, installed as
``python -m bench --baseline`` installs it) is started once with one worker, under
``valgrind --tool=callgrind``. Its workers start through multiprocessing's fork server, which
execs a fresh interpreter, so callgrind does not follow them: the count is the front-end
process's alone. Per scenario, one synchronous client (one gRPC channel, or one keep-alive
HTTP/1.1 connection) makes ``--warmup`` calls one at a time (the first one's answer is
checked), zeroes the counters (``callgrind_control -z``), makes ``--calls`` calls one at a
time and dumps them (``callgrind_control -d``): the dump's total Ir over the calls is the
row's instructions per call. The table goes to stdout and, with ``results.jsonl`` and the
servers' logs, to ``bench/results/<timestamp>-instructions/``.

With ``--in-flight K``, the calls go out in bursts of K, and the next burst only when every
answer of the one before is in (unary gRPC calls as K futures on the one channel, stream
messages as K messages before the first answer is read, REST calls on K keep-alive
connections, each request written before the first answer is read). Under callgrind the
server is about a hundred times slower than its client, so one read of the server finds the
whole burst: the count is that of a server with K calls in flight, and it repeats from run
to run as the one-at-a-time count does (where a real load's batches depend on timing).

With ``--worker``, valgrind follows the server's children too (``--trace-children=yes``: the
fork server, and the worker it forks): the worker process is zeroed and dumped with the
front-end, and each row has both counts.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from types import FrameType

import grpc

from bench import client, servers
from bench.servers import PeerUnavailable, ServerKind, ServerProcess
from trio_infer.protobuf._proto import grpc_predict_v2_pb2 as pb
from trio_infer.protobuf._proto import grpc_predict_v2_pb2_grpc as pb_grpc

#: Seconds a server under callgrind (about 100 times slower) gets to be ready.
START_TIMEOUT = 300.0
#: Seconds one call may take (the first call of a scenario is the slowest).
CALL_TIMEOUT = 60.0
#: Seconds ``callgrind_control`` may take to reach the server and the dump to appear.
CONTROL_TIMEOUT = 60.0
#: Where a dump gives its total: ``summary:`` or ``totals:``, then the events (Ir first).
TOTAL_PREFIXES = ("summary:", "totals:")
#: The scenarios, in the table's order.
SCENARIOS = (
    "live",
    "dense-n1",
    "dense-n64",
    "add_sub",
    "model-ready",
    "stream-dense-n1",
    "stream-add_sub",
    "rest-live",
    "rest-dense-n1",
    "rest-dense-n1-binary",
    "rest-dense-n64-binary",
)


def log(message: str) -> None:
    """Progress on stderr, so stdout holds only the table."""
    print(f"[instructions {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------
# Callgrind


def require_tools() -> tuple[str, str]:
    """The paths of ``valgrind`` and ``callgrind_control``.

    Raises:
        ValueError: One of them is not on PATH (the message says which, and how to get it).
    """
    found = {name: shutil.which(name) for name in ("valgrind", "callgrind_control")}
    lacking = [name for name, path in found.items() if path is None]
    if lacking:
        raise ValueError(
            f"bench.instructions needs {' and '.join(lacking)}, not on PATH "
            "(Debian/Ubuntu: apt-get install valgrind)"
        )
    return found["valgrind"] or "", found["callgrind_control"] or ""


@dataclass(eq=False)
class CallgrindServer(ServerProcess):
    """A :class:`ServerProcess` started under ``valgrind --tool=callgrind`` (valgrind runs the
    program in its own process: the server's pid is the traced one), its dumps in
    ``out_dir``."""

    valgrind: str = "valgrind"
    out_dir: Path = field(default_factory=Path)
    trace_children: bool = False

    def _command(self) -> list[str]:
        return [
            self.valgrind,
            "--tool=callgrind",
            "--dump-instr=no",
            f"--trace-children={'yes' if self.trace_children else 'no'}",
            f"--callgrind-out-file={self.out_dir / 'callgrind.out.%p'}",
            *super()._command(),
        ]


def total_ir(dump: Path) -> int | None:
    """The total Ir of a callgrind dump; None while the file lacks its total line."""
    try:
        lines = dump.read_text(errors="replace").splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith(TOTAL_PREFIXES):
            return int(line.split()[1])
    return None


@dataclass
class Counter:
    """Zeroes and dumps one traced process's counters with ``callgrind_control``; its dumps
    are the files of ``out_dir`` named after its pid (``callgrind.out.<pid>...``)."""

    control: str
    pid: int
    out_dir: Path
    seen: set[Path] = field(default_factory=set)

    def _run(self, option: str) -> None:
        done = subprocess.run(
            [self.control, option, str(self.pid)],
            capture_output=True, text=True, timeout=CONTROL_TIMEOUT, check=False,
        )  # fmt: skip
        if done.returncode != 0:
            output = (done.stdout + done.stderr).strip()
            raise RuntimeError(f"callgrind_control {option} {self.pid} failed: {output}")

    def zero(self) -> None:
        """Zero the counters; the dumps so far are not the next one."""
        self._run("-z")
        self.seen.update(self._dumps())

    def _dumps(self) -> set[Path]:
        own = f"callgrind.out.{self.pid}"
        return {
            path
            for path in self.out_dir.iterdir()
            if path.name == own or path.name.startswith(own + ".")
        }

    def dump(self) -> int:
        """Dump the counters (which zeroes them) and return the dump's total Ir.

        Raises:
            RuntimeError: No complete new dump appeared in time.
        """
        self._run("-d")
        deadline = time.monotonic() + CONTROL_TIMEOUT
        while time.monotonic() < deadline:
            for path in sorted(self._dumps() - self.seen):
                total = total_ir(path)
                if total is not None:
                    self.seen.add(path)
                    return total
            time.sleep(0.1)
        raise RuntimeError(f"no callgrind dump of pid {self.pid} in {self.out_dir}")


# ------------------------------------------------------------------------------------------
# The client: synchronous, one call at a time


@dataclass(frozen=True)
class Probe:
    """One scenario's call (a whole request, built once), the same call ``k`` times at once
    (``burst(k)`` returns the ``k`` answers), and the check of an answer (``ok``, or what is
    wrong)."""

    call: Callable[[], object]
    check: Callable[[object], str]
    burst: Callable[[int], list[object]]


class Client:
    """One gRPC channel (grpcio's blocking stub) and one keep-alive HTTP/1.1 connection to a
    server: every call is the same work for the server."""

    def __init__(self, server: ServerProcess) -> None:
        self.channel = grpc.insecure_channel(server.target, options=client.CHANNEL_OPTIONS)
        self.stub = pb_grpc.GRPCInferenceServiceStub(self.channel)
        self.http_port = server.http_port
        #: Keep-alive connections, opened as bursts need them; the first is the one-at-a-time
        #: calls'.
        self.http: list[http.client.HTTPConnection] = []
        #: The open ModelStreamInfer streams' requests (None ends one), by scenario.
        self._streams: list[queue.SimpleQueue[pb.ModelInferRequest | None]] = []

    def close(self) -> None:
        """End the streams and close both connections."""
        for sending in self._streams:
            sending.put(None)
        self.channel.close()
        for connection in self.http:
            connection.close()

    def _connections(self, count: int) -> list[http.client.HTTPConnection]:
        """The first ``count`` keep-alive connections, opened as needed."""
        if self.http_port is None:
            raise RuntimeError("this build serves no REST")
        while len(self.http) < count:
            opened = http.client.HTTPConnection("127.0.0.1", self.http_port, CALL_TIMEOUT)
            self.http.append(opened)
        return self.http[:count]

    def rest(self, method: str, path: str, body: bytes, headers: dict[str, str]) -> object:
        """One REST call on the first keep-alive connection.

        Raises:
            HttpStatusError: It was not answered 200.
        """
        return self.rest_burst(1, method, path, body, headers)[0]

    def rest_burst(
        self, count: int, method: str, path: str, body: bytes, headers: dict[str, str]
    ) -> list[object]:
        """The same REST call on ``count`` keep-alive connections: every request is written
        before the first answer is read.

        Raises:
            HttpStatusError: One was not answered 200.
        """
        connections = self._connections(count)
        for connection in connections:
            connection.request(method, path, body=body or None, headers=headers)
        return [self._answer(connection) for connection in connections]

    @staticmethod
    def _answer(connection: http.client.HTTPConnection) -> object:
        """The answer to the request written on ``connection``.

        Raises:
            HttpStatusError: It was not 200.
        """
        answer = connection.getresponse()
        data = answer.read()
        if answer.status != 200:
            raise client.HttpStatusError(answer.status, data)
        return client.HttpResponse(
            answer.status, {k.lower(): v for k, v in answer.getheaders()}, data
        )

    def probe(self, scenario: str) -> Probe:
        """The call and check of a scenario of :data:`SCENARIOS`."""
        if scenario == "live":
            return self._live()
        if scenario == "model-ready":
            return self._model_ready()
        if scenario.startswith("dense-n"):
            return self._dense(int(scenario.removeprefix("dense-n")))
        if scenario == "add_sub":
            a, b = client.add_sub_inputs()
            return self._unary(
                self.stub.ModelInfer,
                client.add_sub_request(a, b),
                lambda response: client.check_add_sub(response, a, b),
            )
        if scenario == "stream-dense-n1":
            x = client.dense_input(1)
            request = client.infer_request("dense", x, raw=True)
            return self._stream(request, lambda response: client.check_dense(response, x))
        if scenario == "stream-add_sub":
            a, b = client.add_sub_inputs()
            request = client.add_sub_request(a, b)
            return self._stream(request, lambda response: client.check_add_sub(response, a, b))
        if scenario == "rest-live":
            return self._rest_live()
        if scenario == "rest-dense-n1":
            return self._rest_dense(1, binary=False)
        if scenario == "rest-dense-n1-binary":
            return self._rest_dense(1, binary=True)
        if scenario == "rest-dense-n64-binary":
            return self._rest_dense(64, binary=True)
        raise ValueError(f"unknown scenario {scenario!r}")

    def _live(self) -> Probe:
        request = pb.ServerLiveRequest()

        def check(response: object) -> str:
            live = isinstance(response, pb.ServerLiveResponse) and response.live
            return "ok" if live else f"not live: {response!r}"

        return self._unary(self.stub.ServerLive, request, check)

    def _model_ready(self) -> Probe:
        request = pb.ModelReadyRequest(name="dense")

        def check(response: object) -> str:
            ready = isinstance(response, pb.ModelReadyResponse) and response.ready
            return "ok" if ready else f"not ready: {response!r}"

        return self._unary(self.stub.ModelReady, request, check)

    @staticmethod
    def _unary(
        method: grpc.UnaryUnaryMultiCallable, request: object, check: Callable[[object], str]
    ) -> Probe:
        """A unary call; a burst is ``k`` futures on the channel, then their answers."""

        def burst(count: int) -> list[object]:
            futures = [method.future(request, timeout=CALL_TIMEOUT) for _ in range(count)]
            return [future.result() for future in futures]

        return Probe(lambda: method(request, timeout=CALL_TIMEOUT), check, burst)

    def _dense(self, rows: int) -> Probe:
        x = client.dense_input(rows)
        request = client.infer_request("dense", x, raw=True)
        return self._unary(
            self.stub.ModelInfer, request, lambda response: client.check_dense(response, x)
        )

    def _stream(
        self,
        request: pb.ModelInferRequest,
        check_answer: Callable[[pb.ModelInferResponse], str],
    ) -> Probe:
        """One message at a time over a ModelStreamInfer stream of its own."""
        sending: queue.SimpleQueue[pb.ModelInferRequest | None] = queue.SimpleQueue()
        self._streams.append(sending)
        answers = self.stub.ModelStreamInfer(iter(sending.get, None))

        def burst(count: int) -> list[object]:
            for _ in range(count):
                sending.put(request)
            return [next(answers) for _ in range(count)]

        def check(response: object) -> str:
            assert isinstance(response, pb.ModelStreamInferResponse)
            if response.error_message:
                return f"error_message: {response.error_message}"
            return check_answer(response.infer_response)

        return Probe(lambda: burst(1)[0], check, burst)

    def _rest_live(self) -> Probe:
        return Probe(
            lambda: self.rest("GET", "/v2/health/live", b"", {}),
            lambda response: "ok",  # self.rest raised unless it was 200
            lambda count: self.rest_burst(count, "GET", "/v2/health/live", b"", {}),
        )

    def _rest_dense(self, rows: int, *, binary: bool) -> Probe:
        """``dense`` over REST: JSON, or with ``binary`` Triton's binary tensor extension (the
        request the load rows send: the input's bytes after the JSON, its length in
        ``Inference-Header-Content-Length``, ``binary_data_output`` asking for the outputs in
        binary)."""
        x = client.dense_input(rows)
        body, headers = client.rest_infer_body(x, binary=binary)

        def burst(count: int) -> list[object]:
            return self.rest_burst(count, "POST", "/v2/models/dense/infer", body, headers)

        def check(response: object) -> str:
            assert isinstance(response, client.HttpResponse)
            return client.check_dense(client.RestInferResponse.parse(response), x)

        return Probe(lambda: burst(1)[0], check, burst)


# ------------------------------------------------------------------------------------------
# Measuring


@dataclass
class Row:
    """One scenario on one build: the dumps' total Ir over ``calls`` calls, the front-end's
    and (with ``--worker``) the worker processes'."""

    build: str
    scenario: str
    calls: int
    instructions: int
    check: str
    worker_instructions: int | None = None

    @property
    def per_call(self) -> float:
        """The front-end's instructions per call."""
        return self.instructions / self.calls

    @property
    def worker_per_call(self) -> float | None:
        """The workers' instructions per call; None when they were not counted."""
        if self.worker_instructions is None:
            return None
        return self.worker_instructions / self.calls


def measure_scenario(
    probe: Probe,
    counter: Counter,
    calls: int,
    warmup: int,
    workers: Sequence[Counter] = (),
    in_flight: int = 1,
) -> tuple[int, int, str]:
    """Warm up (the first burst's answers checked), zero, make ``calls`` calls (a multiple of
    ``in_flight``) in bursts of ``in_flight``, dump: the total Ir of the calls in the
    front-end, in ``workers`` (0 without any), and the check."""
    make: Callable[[], object] = probe.call
    if in_flight > 1:
        make = lambda: probe.burst(in_flight)  # noqa: E731
    checks = [probe.check(answer) for answer in probe.burst(in_flight)]
    check = next((found for found in checks if found != "ok"), "ok")
    for _ in range(max(warmup // in_flight, 1)):
        make()
    for each in [counter, *workers]:
        each.zero()
    for _ in range(calls // in_flight):
        make()
    return counter.dump(), sum(worker.dump() for worker in workers), check


@dataclass(frozen=True)
class Build:
    """A trio-infer to measure: its kind (the working tree's, or a baseline) and Python."""

    kind: ServerKind
    python: Path


def measure_build(
    build: Build,
    chosen: Sequence[str],
    calls: int,
    warmup: int,
    run_dir: Path,
    worker: bool,
    in_flight: int = 1,
) -> list[Row]:
    """Start one server of ``build`` under callgrind (its workers too with ``worker``),
    measure every scenario on it, stop it and remove its callgrind files."""
    valgrind, control = require_tools()
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="bench-callgrind-") as out_dir:
        server = CallgrindServer(
            build.kind,
            build.python,
            1,
            run_dir,
            valgrind=valgrind,
            out_dir=Path(out_dir),
            trace_children=worker,
        )
        try:
            took = server.start(timeout=START_TIMEOUT)
            log(f"{build.kind.name} ready under callgrind in {took:.0f} s (pid {server.pid})")
            counter = Counter(control, server.pid, Path(out_dir))
            workers = [Counter(control, pid, Path(out_dir)) for pid in worker_pids(server, worker)]
            connection = Client(server)
            try:
                for scenario in chosen:
                    total, in_workers, check = measure_scenario(
                        connection.probe(scenario), counter, calls, warmup, workers, in_flight
                    )
                    row = Row(build.kind.name, scenario, calls, total, check)
                    if worker:
                        row.worker_instructions = in_workers
                    rows.append(row)
                    counts = f"{row.per_call:,.0f} Ir/call"
                    if row.worker_per_call is not None:
                        counts += f", worker {row.worker_per_call:,.0f}"
                    log(f"{build.kind.name} {scenario}: {counts} ({check})")
            finally:
                connection.close()
        finally:
            server.stop()
    return rows


def worker_pids(server: ServerProcess, worker: bool) -> list[int]:
    """The pids of the server's worker processes to count (none without ``worker``).

    Raises:
        RuntimeError: ``worker``, and the server has none (its kind names none, or none runs).
    """
    if not worker:
        return []
    found = server.kind.find_workers(server.pid) if server.kind.find_workers else []
    if not found:
        raise RuntimeError(f"--worker: no worker process of {server.kind.name} found")
    return found


def builds(revision: str | None) -> list[Build]:
    """The working tree's trio-infer, and the ``revision``'s when given (installed on first
    use by :func:`bench.servers.ensure_installed`), each waiting only for the models the
    scenarios call (``dense``, ``add_sub``) and serving the built-in examples.

    Raises:
        ValueError: ``revision`` names no commit.
        PeerUnavailable: The baseline did not install.
    """
    kinds = [servers.SERVERS["trio-infer"]]
    if revision:
        kinds.append(servers.baseline(revision))
    return [
        Build(replace(kind, models=("dense", "add_sub")), servers.ensure_installed(kind, log))
        for kind in kinds
    ]


# ------------------------------------------------------------------------------------------
# Report


def table(rows: Sequence[Row], names: Sequence[str]) -> str:
    """The markdown table: one line per scenario, instructions per call of each build and,
    with a baseline, new / baseline; the same for the workers when they were counted."""
    by_key = {(row.build, row.scenario): row for row in rows}
    scenarios = list(dict.fromkeys(row.scenario for row in rows))
    ratio = len(names) == 2
    counts: list[tuple[str, Callable[[Row], float | None]]] = [("", lambda row: row.per_call)]
    if any(row.worker_instructions is not None for row in rows):
        counts.append(("worker ", lambda row: row.worker_per_call))
    header = ["scenario"]
    for what, _ in counts:
        header += [f"{name} {what}Ir/call" for name in names]
        header += [f"{what}new / baseline"] if ratio else []
    lines = ["| " + " | ".join(header) + " |", "| --- |" + " ---: |" * (len(header) - 1)]
    for scenario in scenarios:
        found = [by_key.get((name, scenario)) for name in names]
        cells = [scenario]
        for _, count in counts:
            values = [count(row) if row else None for row in found]
            cells += [f"{value:,.0f}" if value is not None else "-" for value in values]
            if ratio:
                new, old = values
                cells.append(f"{new / old:.3f}" if new is not None and old else "-")
        lines.append("| " + " | ".join(cells) + " |")
    failed = [row for row in rows if row.check != "ok"]
    lines += [f"\nCHECK: {row.build} {row.scenario}: {row.check}" for row in failed]
    return "\n".join(lines)


def save(run_dir: Path, rows: Sequence[Row], text: str, meta: dict[str, object]) -> None:
    """``table.md`` and ``results.jsonl`` (a ``"type": "run"`` line, then one per row)."""
    (run_dir / "table.md").write_text(text + "\n")
    with (run_dir / "results.jsonl").open("w") as out:
        out.write(json.dumps({"type": "run", **meta}) + "\n")
        for row in rows:
            line = {"type": "result", **asdict(row), "per_call": round(row.per_call)}
            if row.worker_per_call is not None:
                line["worker_per_call"] = round(row.worker_per_call)
            out.write(json.dumps(line) + "\n")


# ------------------------------------------------------------------------------------------
# Command line


def select(text: str) -> list[str]:
    """``--scenarios``: names or prefixes (``dense``, ``rest``), comma-separated; ``all``. A
    whole name is that scenario alone, even where it is also a prefix (``rest-dense-n1``).

    Raises:
        ValueError: A name matches no scenario.
    """
    chosen: list[str] = []
    for token in (t.strip() for t in text.split(",") if t.strip()):
        found = (
            [token]
            if token in SCENARIOS
            else [s for s in SCENARIOS if token == "all" or s.startswith(token + "-")]
        )
        if not found:
            raise ValueError(f"unknown scenario {token!r}; known: {', '.join(SCENARIOS)}")
        chosen += [s for s in found if s not in chosen]
    return [s for s in SCENARIOS if s in chosen]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.instructions", description=(__doc__ or "").split("\n\n")[0]
    )
    parser.add_argument("--baseline", metavar="REV", help="also measure trio-infer as of REV")
    parser.add_argument("--calls", type=int, default=300, help="measured calls per scenario")
    parser.add_argument(
        "--warmup", type=int, default=100, help="calls before each scenario's count (default 100)"
    )
    parser.add_argument(
        "--scenarios", default="all", help=f"names or prefixes of {', '.join(SCENARIOS)}"
    )
    parser.add_argument(
        "--in-flight",
        type=int,
        default=1,
        metavar="K",
        help="calls in bursts of K, each burst answered before the next (default 1)",
    )
    parser.add_argument(
        "--worker",
        action="store_true",
        help="also count the worker process (valgrind follows the server's children)",
    )
    return parser


def _interrupt(signum: int, frame: FrameType | None) -> None:
    """SIGTERM and SIGHUP act as Ctrl+C: the servers are stopped on the way out."""
    raise KeyboardInterrupt


def tree_state() -> str:
    """The working tree's commit, with ``+dirty`` when ``trio_infer/`` has changes not
    committed (a count of a tree edited meanwhile is not that commit's)."""
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        cwd=servers.REPO, capture_output=True, text=True, check=False,
    ).stdout.strip()  # fmt: skip
    changes = subprocess.run(
        ["git", "status", "--porcelain", "--", "trio_infer"],
        cwd=servers.REPO, capture_output=True, text=True, check=False,
    ).stdout.strip()  # fmt: skip
    return head + ("+dirty" if changes else "")


def _run(args: argparse.Namespace, chosen: list[str], run_dir: Path) -> int:
    """Measure every build one after the other, then print and save the table."""
    began = time.monotonic()
    tree = tree_state()
    measured = builds(args.baseline)
    rows: list[Row] = []
    for build in measured:
        rows += measure_build(
            build, chosen, args.calls, args.warmup, run_dir, args.worker, args.in_flight
        )
    names = [build.kind.name for build in measured]
    text = table(rows, names)
    meta = {
        "stamp": run_dir.name.removesuffix("-instructions"),
        "builds": names,
        "tree": tree,
        "tree_after": tree_state(),
        "scenarios": chosen,
        "calls": args.calls,
        "warmup": args.warmup,
        "in_flight": args.in_flight,
        "worker": args.worker,
        "python": platform.python_version(),
        "seconds": round(time.monotonic() - began, 1),
    }
    save(run_dir, rows, text, meta)
    if meta["tree_after"] != tree:
        log(
            f"trio_infer/ changed during the run ({tree} -> {meta['tree_after']}): "
            f"the {names[0]} rows may mix versions"
        )
    print(text)
    log(f"{len(rows)} rows in {meta['seconds']} s; {run_dir / 'results.jsonl'}")
    return 0 if all(row.check == "ok" for row in rows) else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Count, print and save; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        require_tools()
        chosen = select(args.scenarios)
    except ValueError as error:
        log(str(error))
        return 2
    if args.calls < 1 or args.warmup < 1 or args.in_flight < 1:
        log("--calls, --warmup and --in-flight must be at least 1")
        return 2
    if args.calls % args.in_flight:
        log(f"--calls ({args.calls}) must be a multiple of --in-flight ({args.in_flight})")
        return 2
    run_dir = servers.RESULTS / f"{time.strftime('%Y%m%d-%H%M%S')}-instructions"
    run_dir.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGHUP, _interrupt)
    # The same string hashes in every run: dict and set layouts (and so the instructions
    # spent probing them) do not change from one start to the next.
    os.environ["PYTHONHASHSEED"] = "0"
    try:
        return _run(args, chosen, run_dir)
    except (ValueError, PeerUnavailable, RuntimeError, grpc.RpcError, OSError) as error:
        log(f"failed: {error}")
        return 1
    except KeyboardInterrupt:
        log("interrupted: servers stopped")
        return 130
    finally:
        servers.stop_all()


if __name__ == "__main__":
    sys.exit(main())
