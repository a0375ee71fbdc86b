"""The scenarios: what each one sends, for how long, and what it reports.

=================  ========================================================================
``live-cC``         ServerLive (an empty unary call) at concurrency C: the transport ceiling.
``dense-nN-F-cC``   ``dense`` with N rows (1 or 64), F = raw or typed contents, concurrency C.
``sleep10-c25``     ``sleep`` with ``delay_ms`` 10 at concurrency 25: worker scheduling only.
``add_sub-c25``     unary ``add_sub`` (1 row) at concurrency 25: beside its stream.
``stream-M-c25``    one ModelStreamInfer stream with 25 requests in flight (``add_sub``, or
                    ``dense`` 1 row): messages/s and per-message latency.
``decoupled-*``     ``ticks`` (8 responses 2 ms apart) one request at a time on one stream:
                    time to first response (and to the last).
``rest-live-c25``   REST ``GET /v2/health/live`` at concurrency 25: the HTTP stack's floor.
``rest-dense-nN-F`` REST ``dense`` with N rows (1 or 64), F = ``json`` or ``bin`` (Triton's
                    binary tensor extension), concurrency 25, a connection per call in flight.
``runtime-R-nN-c25`` the built-in runtimes' models (:mod:`bench.peers.runtime_models`), R =
                    ``sklearn`` (a random forest, against MLServer's mlserver-sklearn) or
                    ``onnx`` (the same forest in ONNX), N rows (1 or 64), raw, concurrency 25.
``kill``            ``sleep`` 10 ms at C=25; one worker gets SIGKILL: failed calls and the time
                    until throughput is back to 90 % of what it was before.
``storm``           25 clients send ``sleep`` 100 ms with a 50 ms deadline; then the time until
                    a normal call (``delay_ms`` 1, 5 s deadline) ends in under 50 ms again.
``overload-xL``     trio-infer with a 64 MiB memory budget; ``echo`` with 4 MiB messages from L
                    times the clients the budget admits (5): refusals, latency of the admitted
                    calls of the first 5 clients (the others run in a second process), RSS of
                    the server and of its workers over time, CPU of the clients and the
                    server. ``overload-x1`` and ``overload-full`` (6 clients, the budget
                    always full) refuse nothing. A refused request is resent after an
                    exponential backoff with jitter (``-backoff``, L = 2, 5, 10, 20), or at once
                    (``overload-x10``, ``-d1s``: 1 s deadline); ``-nowait``: the server lets
                    no request wait for room in its budget.
``priority``        ``sleep`` 10 ms from 25 clients, 5 of which send ``priority`` 1 (Triton's
                    parameter; MLServer and KServe ignore it): latency of those 5 against
                    that of the other 20.
``batching-M-cC``   ``dense`` 1 row at concurrency C, on a copy of the example repository with
                    batching off (``max_batch_size`` 0) or on (the example's): throughput,
                    latency and the mean batch size.
``hostile-A``       trio-infer with a 256 MiB memory budget; a bystander (``dense`` 1 row, C=4)
                    alone, then beside attack A (:mod:`bench.attacks`, a process of its own):
                    its latency, throughput and errors both times, the server's peak RSS and
                    CPU, and what the attacker saw.
``repository-c25``  trio-infer in ``--model-control-mode explicit``; ``dense`` 1 row at C=25,
                    quiet and beside a loop that unloads, loads and now and then reloads (with
                    a ``config``) a copy of ``dense`` under another name, in alternating
                    rounds: two rows (``repository-quiet-c25``, ``repository-churn-c25``), the
                    churn's operations counted and timed.
=================  ========================================================================

Scenarios always run in this order, each on every server before the next; ``kill`` and
``storm`` come last because they can leave a server degraded (it is restarted when they do).
``live``, ``dense``, ``sleep``, ``add_sub``, ``stream``, ``decoupled``, the REST and the
``runtime`` scenarios run in rounds (``--rounds``), the servers taking turns.
``overload``, ``batching``, ``hostile`` and ``repository`` (trio-infer only) each start a server
of their own, after the shared ones stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import math
import os
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from bench import attacks, batch_probe, client
from bench.servers import (
    REPO,
    REST_KINDS,
    RUNTIME_KINDS,
    CpuSet,
    CpuSnapshot,
    MemorySampler,
    ServerKind,
    ServerProcess,
    copy_repository,
    cpu_seconds,
)
from trio_infer.protobuf._proto import grpc_predict_v2_pb2 as pb
from trio_infer.repository.settings import EXAMPLES, SETTINGS_FILE

MIB = 1024 * 1024
#: overload: the server's ``--memory-budget`` and the size of each request message.
OVERLOAD_BUDGET = 64 * MIB
OVERLOAD_MESSAGE = 4 * MIB
#: overload: the budget a request reserves, in multiples of its message (what the server does).
OVERLOAD_RESERVED = 3
#: overload: clients, as multiples of the requests the budget admits at once, of the scenarios
#: whose clients back off when refused (the baselines refuse nothing: ``overload-x1``, and
#: ``overload-full`` with one client more, which keeps the budget full).
OVERLOAD_BACKOFF_LOADS = (2, 5, 10, 20)
#: overload: each call's deadline, seconds, and the shorter one of ``overload-x10-d1s``.
OVERLOAD_DEADLINE = 5.0
OVERLOAD_SHORT_DEADLINE = 1.0
#: overload: the status that means "refused, resend later", and ``overload-x10-backoff``'s
#: wait before resending (as grpcio's retries: 50 ms doubling up to 1 s, jitter +-20 %).
OVERLOAD_REFUSED = "RESOURCE_EXHAUSTED"
OVERLOAD_BACKOFF = client.Backoff(initial=0.05, maximum=1.0, multiplier=2.0, jitter=0.2)
#: overload: seconds between two RSS samples.
RSS_INTERVAL = 0.1
#: batching: the concurrencies, each run with batching off and on.
BATCHING_CONCURRENCY = (25, 100)
#: priority: of the ``sleep`` scenario's clients, how many send priority 1.
PRIORITY_CLIENTS = 5
#: Scenario kinds that run on a server of their own, started with their own settings.
OWN_SERVER_KINDS = frozenset({"overload", "batching", "hostile", "repository"})
#: hostile: the bystander's concurrency, and each of its calls' deadline in seconds (short
#: enough that a bystander kept waiting shows as DEADLINE_EXCEEDED within the window).
HOSTILE_CONCURRENCY = 4
HOSTILE_DEADLINE = 2.0
#: hostile: seconds between two RSS samples.
HOSTILE_RSS_INTERVAL = 0.05
#: stream: requests in flight on the one stream (and the unary ``add_sub`` row's concurrency).
STREAM_WINDOW = 25
#: decoupled: responses ``ticks`` sends per request, and the sleep between two, ms.
TICKS_COUNT = 8
TICKS_DELAY_MS = 2
#: rest: concurrency, as many keep-alive connections (one per call in flight).
REST_CONCURRENCY = 25
#: repository: the concurrency of the ``dense`` calls measured (as the ``dense-n1-raw-c25`` row).
REPOSITORY_CONCURRENCY = 25
#: repository: the model the churn unloads and loads, a copy of ``dense`` under this name
#: (another model than the one measured, so that only the churn's side effects are seen).
CHURN_MODEL = "dense_churn"
#: repository: every CHURN_RELOAD_EVERY-th cycle of the churn ends with a reload of the loaded
#: model with ``config`` CHURN_CONFIG (settings that differ from the folder's, so that the
#: reload loads new settings and drops the old ones instead of answering "served already").
CHURN_RELOAD_EVERY = 3
CHURN_CONFIG: dict[str, Any] = {"max_batch_size": 16}
#: repository: the churn's operations, in the order a cycle runs them.
CHURN_OPERATIONS = ("unload", "load", "reload")
#: repository: each load or unload's deadline, seconds (a load into both workers, behind the
#: measured calls, takes tens of milliseconds here; one taking this long is a failure to see).
CHURN_TIMEOUT = 30.0
#: runtime: the concurrency, and each family's model (:mod:`bench.peers.runtime_models`).
RUNTIME_CONCURRENCY = 25
RUNTIME_FAMILIES = (("sklearn", "sklearn_forest"), ("onnx", "onnx_forest"))
#: Scenario kinds measured in several rounds, the servers taking turns (see :func:`merge_rounds`).
ROUND_KINDS = (
    frozenset({"live", "dense", "sleep", "add_sub", "stream", "decoupled"})
    | REST_KINDS
    | RUNTIME_KINDS
)


@dataclass(frozen=True)
class Scenario:
    """One measured situation; ``kind`` is one of live, dense, sleep, add_sub, stream,
    decoupled, rest-live, rest-dense, runtime, priority, kill, storm, overload, batching,
    hostile, repository."""

    name: str
    kind: str
    concurrency: int
    rows: int = 1
    raw: bool = True
    """dense: tensors in ``raw_input_contents``, else typed contents; rest-dense: in Triton's
    binary tensor extension, else JSON."""
    delay_ms: int = 0
    """sleep: the model's delay; repository: the pause after each churn operation."""
    load: int = 0
    """overload: clients as a multiple of the requests the memory budget admits at once."""
    deadline: float = 0.0
    """overload: each call's deadline in seconds."""
    backoff: bool = False
    """overload: a refused request is resent after :data:`OVERLOAD_BACKOFF`, not at once."""
    no_waiting: bool = False
    """overload: the server runs with ``--max-waiting-bytes 0``: what does not fit is refused."""
    batching: bool = False
    """batching: ``dense`` keeps the example's ``max_batch_size`` (on) or gets 0 (off)."""
    attack: str = ""
    """hostile: the attack of :mod:`bench.attacks` beside the bystander."""
    model: str = ""
    """stream: the model each message calls (``add_sub`` or ``dense``); runtime: the model
    called (``sklearn_forest`` or ``onnx_forest``)."""

    @property
    def own_server(self) -> bool:
        """Whether this scenario starts a server of its own (see :func:`run_on_own_server`)."""
        return self.kind in OWN_SERVER_KINDS


def all_scenarios() -> list[Scenario]:
    """Every scenario, in the order they run."""
    scenarios = [Scenario(f"live-c{c}", "live", c) for c in (1, 25)]
    for rows in (1, 64):
        for raw in (True, False):
            contents = "raw" if raw else "typed"
            scenarios += [
                Scenario(f"dense-n{rows}-{contents}-c{c}", "dense", c, rows=rows, raw=raw)
                for c in (1, 25, 100)
            ]
    scenarios.append(Scenario("sleep10-c25", "sleep", 25, delay_ms=10))
    scenarios.append(Scenario(f"add_sub-c{STREAM_WINDOW}", "add_sub", STREAM_WINDOW))
    scenarios += [
        Scenario(f"stream-{name}-c{STREAM_WINDOW}", "stream", STREAM_WINDOW, model=model)
        for name, model in (("add_sub", "add_sub"), ("dense-n1", "dense"))
    ]
    scenarios.append(Scenario("decoupled-ticks-c1", "decoupled", 1, delay_ms=TICKS_DELAY_MS))
    rest = REST_CONCURRENCY
    scenarios.append(Scenario(f"rest-live-c{rest}", "rest-live", rest))
    scenarios += [
        Scenario(
            f"rest-dense-n{rows}-{'bin' if binary else 'json'}-c{rest}",
            "rest-dense",
            rest,
            rows=rows,
            raw=binary,
        )
        for binary in (False, True)
        for rows in (1, 64)
    ]
    c = RUNTIME_CONCURRENCY
    scenarios += [
        Scenario(f"runtime-{family}-n{rows}-c{c}", "runtime", c, rows=rows, model=model)
        for family, model in RUNTIME_FAMILIES
        for rows in (1, 64)
    ]
    scenarios.append(Scenario("priority", "priority", 25, delay_ms=10))
    scenarios.append(Scenario("kill", "kill", 25, delay_ms=10))
    scenarios.append(Scenario("storm", "storm", 25, delay_ms=100))
    fit, deadline = overload_fit(), OVERLOAD_DEADLINE
    scenarios.append(Scenario("overload-x1", "overload", fit, load=1, deadline=deadline))
    # One client more than fit: the budget is always full, and the one waiting gets room.
    scenarios.append(
        Scenario("overload-full", "overload", fit + 1, load=1, deadline=deadline, backoff=True)
    )
    scenarios += [
        Scenario(
            f"overload-x{load}-backoff",
            "overload",
            fit * load,
            load=load,
            deadline=deadline,
            backoff=True,
        )
        for load in OVERLOAD_BACKOFF_LOADS
    ]
    scenarios.append(
        Scenario(
            "overload-x10-backoff-nowait",
            "overload",
            fit * 10,
            load=10,
            deadline=deadline,
            backoff=True,
            no_waiting=True,
        )
    )
    short = OVERLOAD_SHORT_DEADLINE
    scenarios += [
        Scenario("overload-x10", "overload", fit * 10, load=10, deadline=deadline),
        Scenario(f"overload-x10-d{short:g}s", "overload", fit * 10, load=10, deadline=short),
    ]
    for c in BATCHING_CONCURRENCY:
        scenarios += [
            Scenario(f"batching-{mode}-c{c}", "batching", c, batching=mode == "on")
            for mode in ("off", "on")
        ]
    scenarios += [
        Scenario(f"hostile-{attack}", "hostile", HOSTILE_CONCURRENCY, attack=attack)
        for attack in attacks.ATTACKS
    ]
    c = REPOSITORY_CONCURRENCY
    scenarios.append(Scenario(f"repository-c{c}", "repository", c))
    # The same at an operator's pace: one operation a second.
    scenarios.append(Scenario(f"repository-paced-c{c}", "repository", c, delay_ms=1000))
    return scenarios


def select(spec: str) -> list[Scenario]:
    """The scenarios a comma-separated ``--scenarios`` value names, in running order.

    A word selects every scenario whose name is that word or starts with that word followed
    by ``-``, or whose kind is that word (``dense``, ``dense-n64``, ``dense-n1-raw-c25``).

    Raises:
        ValueError: A word selects nothing.
    """
    words = [word.strip() for word in spec.split(",") if word.strip()]
    chosen: list[Scenario] = []
    for word in words:
        hits = [
            s
            for s in all_scenarios()
            if word in ("all", s.name, s.kind) or s.name.startswith(word + "-")
        ]
        if not hits:
            names = ", ".join(s.name for s in all_scenarios())
            raise ValueError(f"no scenario matches {word!r}; scenarios: {names}")
        chosen += [s for s in hits if s not in chosen]
    order = {s.name: i for i, s in enumerate(all_scenarios())}
    return sorted(chosen, key=lambda s: order[s.name])


@dataclass(frozen=True)
class Timing:
    """How long each part of a scenario runs, in seconds."""

    warmup: float
    duration: float
    """Measured seconds of a load scenario, in each round."""
    rounds: int
    """Rounds of each load scenario (:data:`ROUND_KINDS`); the others run once."""

    @property
    def once(self) -> float:
        """Measured seconds of a scenario that runs once (priority, batching): as long as a
        load scenario's rounds together."""
        return self.duration * self.rounds

    storm: float
    recovery_limit: float
    kill_before: float
    kill_after: float
    overload_warmup: float
    overload: float
    hostile_ramp: float
    """hostile: seconds the attack runs before the bystander's window beside it starts."""
    hostile: float
    """hostile: measured seconds of the bystander, alone and again beside the attack."""
    timeout: float = 10.0

    @classmethod
    def choose(cls, duration: float | None, quick: bool, rounds: int | None = None) -> Timing:
        """The full run's timing, or ``--quick``'s (a run of every server under 2 minutes)."""
        if quick:
            return cls(
                warmup=0.25, duration=duration or 0.8, rounds=rounds or 1, storm=2.0,
                recovery_limit=5.0, kill_before=1.0, kill_after=2.0, overload_warmup=1.5,
                overload=max(2.0, duration or 0.0), hostile_ramp=0.5,
                hostile=max(1.5, duration or 0.0),
            )  # fmt: skip
        duration = duration or 2.0
        return cls(
            warmup=1.0, duration=duration, rounds=rounds or 3, storm=4.0, recovery_limit=60.0,
            kill_before=2.0, kill_after=max(4.0, duration), overload_warmup=5.0,
            overload=max(10.0, duration), hostile_ramp=1.0, hostile=max(8.0, duration),
        )  # fmt: skip


@dataclass
class Result:
    """One row of the table (and one JSON line)."""

    server: str
    scenario: str
    kind: str
    concurrency: int
    throughput: float | None = None
    p50_ms: float | None = None
    p99_ms: float | None = None
    requests: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    check: str = ""
    notes: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    restart: bool = False
    """The scenario left the server degraded: restart it before the next one."""
    cpus: str | None = None
    """The CPU set the server was pinned to (``--cpus``, ``taskset -c`` syntax); None: not
    pinned. The table compares servers within one set."""

    def absorb(self, summary: client.Summary) -> None:
        """Take throughput, percentiles, request count and errors from a summary."""
        self.throughput = summary.throughput
        self.p50_ms = summary.p50_ms
        self.p99_ms = summary.p99_ms
        self.requests = summary.requests
        self.errors = summary.errors


#: ``extra`` of a load row: CPU microseconds per successful call over its measured window (see
#: :class:`CpuWindow`): the server with its descendants (the table's ``cpu µs/call``), the
#: server process alone, its descendants alone, and the benchmark's process (the client).
CPU_PER_CALL = (
    "cpu_us_per_call",
    "cpu_server_us_per_call",
    "cpu_workers_us_per_call",
    "client_cpu_us_per_call",
)
#: ``extra`` of a load row: the cores the server process alone kept busy over its measured
#: window (1.0: one core all the time). A front-end near 1.0 is the row's ceiling: less CPU a
#: call then shows as more calls a second; one well under it waits for its client or workers.
CPU_CORES = ("cpu_server_cores",)
#: What each round of a load row keeps of its CPU in ``extra["rounds"]``: the figures, and the
#: processes read (the server and its descendants) and gone in the window (their CPU missed).
CPU_COUNTED = (*CPU_PER_CALL, *CPU_CORES, "cpu_processes", "cpu_exited")


@dataclass
class CpuWindow:
    """The CPU a server (with every descendant: workers, stubs, helpers) and the benchmark's
    process use over one measured window, read from /proc at its start and end by the two
    actions of :meth:`actions`, per successful call (:meth:`per_call`).

    The server's side is what a bigger machine scales with; the client's is what the shared
    cores spend on the load itself.
    """

    server_pid: int
    duration: float
    start: CpuSnapshot | None = None
    end: CpuSnapshot | None = None

    def actions(self) -> list[client.Action]:
        """Snapshots at the window's start and end, for ``closed_loop`` or ``stream_window``."""
        return [client.Action(0.0, self._begin), client.Action(self.duration, self._finish)]

    def _begin(self) -> None:
        snapshot = CpuSnapshot.take(self.server_pid)
        # The client's CPU is read after the snapshot's /proc scan here and before it at the
        # end, so that neither scan (about 5 ms each) counts as the client's cost of the calls.
        self.start = dataclasses.replace(snapshot, client=cpu_seconds(os.getpid()) or 0.0)

    def _finish(self) -> None:
        mine = cpu_seconds(os.getpid()) or 0.0
        self.end = dataclasses.replace(CpuSnapshot.take(self.server_pid), client=mine)

    def per_call(self, summary: client.Summary) -> dict[str, Any]:
        """:data:`CPU_PER_CALL` for a window of ``summary``'s calls, :data:`CPU_CORES`,
        ``cpu_processes`` (the server and its descendants at the end) and ``cpu_exited``
        (descendants gone in between, whose ticks are missed); empty without both snapshots or
        a successful call.

        Each figure is CPU seconds over the seconds between the snapshots (cores), over the
        window's successful calls per second: the snapshots are taken within a few
        milliseconds of the window's edges, not on them, and a rate over each's own span keeps
        that difference out.
        """
        if self.start is None or self.end is None or not summary.throughput:
            return {}
        seconds = self.end.at - self.start.at
        if seconds <= 0:
            return {}
        spent = self.start.spent(self.end)
        per_call = {
            "server": spent["server"] + spent["workers"],
            "server_only": spent["server"],
            "workers": spent["workers"],
            "client": spent["client"],
        }
        return {
            **{
                key: round(per_call[name] / seconds / summary.throughput * 1e6, 1)
                for key, name in zip(CPU_PER_CALL, per_call, strict=True)
            },
            "cpu_server_cores": round(spent["server"] / seconds, 3),
            "cpu_processes": 1 + len(self.end.children),
            "cpu_exited": self.start.exited(self.end),
        }


def _absorb_cpu(result: Result, window: CpuWindow, summary: client.Summary) -> None:
    """Put ``window``'s CPU per call into ``result.extra`` (and say so when processes exited
    in the window, since their ticks are missing from it)."""
    result.extra.update(window.per_call(summary))
    exited = result.extra.get("cpu_exited")
    if exited:
        note = f"{exited} server processes exited in the window: their CPU is not counted"
        result.notes = "; ".join(filter(None, [result.notes, note]))


def merge_rounds(rounds: Sequence[Result]) -> Result:
    """One row from the rounds of a scenario on one server: the median of each number.

    The servers take turns within each round, so every server's rounds are spread over the
    same minutes; the median keeps one round that the shared machine slowed down from moving
    the row. Rounds that crashed are left out of the medians and counted in ``check``. Errors
    are those of every round, and ``extra["rounds"]`` keeps each round's numbers. A scenario
    the server cannot run (``n/a``: no number in any round) keeps its first round's row.
    """
    measured = [r for r in rounds if r.kind != "crash"]
    if len(rounds) == 1 or not measured or all(r.throughput is None for r in rounds):
        return rounds[0]
    merged = dataclasses.replace(measured[0], errors={}, notes="", extra={})
    for name in ("throughput", "p50_ms", "p99_ms"):
        values = [getattr(r, name) for r in measured if getattr(r, name) is not None]
        setattr(merged, name, statistics.median(values) if values else None)
    merged.requests = sum(r.requests for r in rounds)
    for r in rounds:
        for status, count in r.errors.items():
            merged.errors[status] = merged.errors.get(status, 0) + count
    crashed = len(rounds) - len(measured)
    failed = next((r.check for r in measured if r.check not in ("", "ok")), "")
    merged.check = failed or (f"{crashed} of {len(rounds)} rounds crashed" if crashed else "ok")
    merged.restart = any(r.restart for r in rounds)
    cpu = {
        key: [r.extra[key] for r in measured if key in r.extra]
        for key in (*CPU_PER_CALL, *CPU_CORES)
    }
    merged.notes = "; ".join(
        [r.notes for r in rounds if r.notes]
        + [
            f"median of {len(measured)} rounds: req/s "
            + "/".join(f"{r.throughput or 0:,.0f}" for r in measured)
            + ", p99 "
            + "/".join(f"{r.p99_ms or 0:.2f}" for r in measured)
            + " ms"
            + (
                ", cpu µs/call " + "/".join(f"{v:,.0f}" for v in cpu["cpu_us_per_call"])
                if cpu["cpu_us_per_call"]
                else ""
            )
        ]
    )
    merged.extra = {
        "rounds": [
            {"throughput": r.throughput, "p50_ms": r.p50_ms, "p99_ms": r.p99_ms}
            | {key: r.extra[key] for key in CPU_COUNTED if key in r.extra}
            for r in measured
        ]
    }
    # Each CPU figure is the median of its own rounds, as req/s is (so with 3 rounds or more,
    # the server's and the workers' medians need not add up to the total's).
    merged.extra |= {key: statistics.median(values) for key, values in cpu.items() if values}
    processes = [r.extra["cpu_processes"] for r in measured if "cpu_processes" in r.extra]
    if processes:
        merged.extra["cpu_processes"] = max(processes)
    return merged


def _echo_input() -> np.ndarray:
    return np.arange(16, dtype=np.float32).reshape(1, 16)


def _infer(stub: Any, request: pb.ModelInferRequest) -> client.Call:
    def call(timeout: float) -> Any:
        return stub.ModelInfer(request, timeout=timeout)

    return call


def _calls(stub: Any, scenario: Scenario) -> tuple[client.Call, Callable[[object], str]]:
    """The call a scenario repeats, and the check of one response."""
    if scenario.kind == "live":
        live = pb.ServerLiveRequest()

        def call(timeout: float) -> Any:
            return stub.ServerLive(live, timeout=timeout)

        def check_live(response: object) -> str:
            return "ok" if getattr(response, "live", False) else "live is false"

        return call, check_live
    if scenario.kind in ("dense", "add_sub"):
        request, check = _request(scenario.kind, scenario.rows)
        return _infer(stub, request), check
    if scenario.kind == "runtime":
        request, check = _runtime_request(scenario.model, scenario.rows)
        return _infer(stub, request), check
    echo = _echo_input()
    request = client.infer_request("sleep", echo, raw=scenario.raw, delay_ms=scenario.delay_ms)
    return _infer(stub, request), lambda response: client.check_echo(response, echo)


def _request(model: str, rows: int = 1) -> tuple[pb.ModelInferRequest, Callable[[object], str]]:
    """A raw ``dense`` (``rows`` rows) or ``add_sub`` (1 row) request, and its check."""
    if model == "dense":
        x = client.dense_input(rows)
        request = client.infer_request("dense", x, raw=True)
        return request, lambda response: client.check_dense(response, x)
    a, b = client.add_sub_inputs()
    return client.add_sub_request(a, b), lambda response: client.check_add_sub(response, a, b)


def _runtime_request(model: str, rows: int) -> tuple[pb.ModelInferRequest, Callable[[object], str]]:
    """A raw request of ``rows`` rows to a runtime model, and the check of its answer against
    the model's prediction in this process."""
    # scikit-learn is imported only when a runtime scenario runs: it is not a bench extra.
    from bench.peers import runtime_models

    spec = runtime_models.MODELS[model]
    x = runtime_models.features(spec, rows)
    expected = runtime_models.predict(spec, x)
    request = client.infer_request(model, x, raw=True, input_name=spec.input_name)
    return request, lambda response: client.check_output(response, spec.output, expected)


def _runtime_missing(server: ServerProcess, scenario: Scenario) -> str:
    """Why ``server`` does not run a ``runtime`` scenario (the row says ``-``); empty if it does."""
    if scenario.model not in server.kind.runtime_models:
        return server.kind.no_runtime
    if scenario.model not in server.models:
        # with_runtime_models wrote no such folder: no scikit-learn, or skl2onnx, here.
        return f"{scenario.model} not written (see the log: scikit-learn or skl2onnx missing?)"
    return ""


def _ticks_request() -> tuple[pb.ModelInferRequest, np.ndarray]:
    """``ticks``' request: input ``x`` of 16 FP32, TICKS_COUNT responses TICKS_DELAY_MS apart,
    each sent at once (``triton_enable_empty_final_response``: an empty final one follows)."""
    x = _echo_input()
    request = client.infer_request("ticks", x, raw=True, delay_ms=TICKS_DELAY_MS)
    request.parameters["count"].int64_param = TICKS_COUNT
    request.parameters["triton_enable_empty_final_response"].bool_param = True
    return request, x


def _check_ticks(responses: Sequence[pb.ModelStreamInferResponse], x: np.ndarray) -> str:
    """``ok`` when ``ticks`` answered ``y = x + i`` for each i, then an empty final response."""
    errors = [r.error_message for r in responses if r.error_message]
    if errors:
        return f"error: {errors[0][:80]}"
    data = [r for r in responses if r.infer_response.outputs]
    if len(data) != TICKS_COUNT:
        return f"{len(data)} responses with outputs, not {TICKS_COUNT}"
    for i, response in enumerate(data):
        check = client.check_output(response.infer_response, "y", x + np.float32(i))
        if check != "ok":
            return f"response {i}: {check}"
    if not responses or not client.is_final(responses[-1]) or responses[-1].infer_response.outputs:
        return "no empty final response"
    return "ok"


async def _checked_first_call(call: client.Call, check: Callable[[object], str]) -> str:
    try:
        return check(await call(10.0))
    except Exception as error:
        return f"first call failed: {client.status_of(error)}"


def _rest_calls(
    rest: client.RestClient, scenario: Scenario
) -> tuple[client.Call, Callable[[object], str]]:
    """A REST scenario's call (its request built once) and the check of one response."""
    if scenario.kind == "rest-live":
        message = client.http_request("GET", "/v2/health/live", rest.port)
        return client.rest_call(rest, message, infer=False), lambda response: "ok"
    x = client.dense_input(scenario.rows)
    body, headers = client.rest_infer_body(x, binary=scenario.raw)
    message = client.http_request("POST", "/v2/models/dense/infer", rest.port, body, headers)
    return client.rest_call(rest, message, infer=True), lambda r: client.check_dense(r, x)


def _rest_missing(server: ServerProcess, scenario: Scenario) -> str:
    """Why ``server`` cannot run a REST ``scenario`` (the row says ``n/a``); empty if it can."""
    if server.http_port is None:
        return "this version has no REST (no --http-port)"
    if scenario.kind == "rest-dense" and scenario.raw:
        return server.kind.no_binary_rest
    return ""


@contextlib.asynccontextmanager
async def _connected(
    server: ServerProcess, scenario: Scenario
) -> AsyncIterator[tuple[client.Call, Callable[[object], str]]]:
    """A load scenario's call and check, on one gRPC channel (one HTTP/2 connection), or for
    REST on a :class:`client.RestClient` (a keep-alive connection per call in flight)."""
    if scenario.kind in REST_KINDS:
        assert server.http_port is not None
        async with client.RestClient("127.0.0.1", server.http_port) as rest:
            yield _rest_calls(rest, scenario)
    else:
        async with client.open_channel(server.target) as channel:
            yield _calls(client.stub_for(channel), scenario)


async def _load(server: ServerProcess, scenario: Scenario, timing: Timing) -> Result:
    result = Result(server.kind.name, scenario.name, scenario.kind, scenario.concurrency)
    missing = (
        _rest_missing(server, scenario)
        if scenario.kind in REST_KINDS
        else _runtime_missing(server, scenario)
        if scenario.kind in RUNTIME_KINDS
        else ""
    )
    if missing:
        result.notes = f"n/a: {missing}"
        return result
    cpu = CpuWindow(server.pid, timing.duration)
    async with _connected(server, scenario) as (call, check):
        result.check = await _checked_first_call(call, check)
        samples = await client.closed_loop(
            call,
            concurrency=scenario.concurrency,
            warmup=timing.warmup,
            duration=timing.duration,
            call_timeout=timing.timeout,
            actions=cpu.actions(),
        )
    summary = samples.summary()
    result.absorb(summary)
    _absorb_cpu(result, cpu, summary)
    return result


async def _stream(server: ServerProcess, scenario: Scenario, timing: Timing) -> Result:
    """One stream, STREAM_WINDOW requests in flight (``stream``), or one at a time on a
    decoupled model (``decoupled``: the row's p50/p99 are the time to first response)."""
    result = Result(server.kind.name, scenario.name, scenario.kind, scenario.concurrency)
    if scenario.kind == "decoupled":
        request, x = _ticks_request()
    else:
        request, check = _request(scenario.model, scenario.rows)
    async with client.open_channel(server.target) as channel:
        try:
            responses = await client.stream_responses(channel, request, 10.0)
            if scenario.kind == "decoupled":
                result.check = _check_ticks(responses, x)
            elif responses[0].error_message:
                result.check = f"error: {responses[0].error_message[:80]}"
            else:
                result.check = check(responses[0].infer_response)
        except Exception as error:
            result.check = f"first call failed: {client.status_of(error)}"
        cpu = CpuWindow(server.pid, timing.duration)
        done, first = await client.stream_window(
            channel,
            request,
            window=scenario.concurrency,
            warmup=timing.warmup,
            duration=timing.duration,
            call_timeout=timing.timeout,
            actions=cpu.actions(),
        )
    # Per request (decoupled: its responses together), ended in the window with its last.
    last = done.summary()
    if scenario.kind == "decoupled":
        result.absorb(first.summary())
        result.extra["last_p50_ms"], result.extra["last_p99_ms"] = last.p50_ms, last.p99_ms
        result.notes = f"to last: p50 {last.p50_ms:.2f}, p99 {last.p99_ms:.2f} ms"
    else:
        result.absorb(last)
    _absorb_cpu(result, cpu, last)
    return result


async def _priority(server: ServerProcess, scenario: Scenario, timing: Timing) -> Result:
    """The high-priority clients' numbers in the row; the others' in its notes."""
    result = Result(server.kind.name, scenario.name, scenario.kind, scenario.concurrency)
    echo = _echo_input()
    high = client.infer_request("sleep", echo, raw=True, delay_ms=scenario.delay_ms, priority=1)
    default = client.infer_request("sleep", echo, raw=True, delay_ms=scenario.delay_ms)
    async with client.open_channel(server.target) as channel:
        stub = client.stub_for(channel)
        result.check = await _checked_first_call(
            _infer(stub, high), lambda response: client.check_echo(response, echo)
        )
        loops = [
            client.closed_loop(
                _infer(stub, request),
                concurrency=concurrency,
                warmup=timing.warmup,
                duration=timing.once,
                call_timeout=timing.timeout,
            )
            for request, concurrency in (
                (high, PRIORITY_CLIENTS),
                (default, scenario.concurrency - PRIORITY_CLIENTS),
            )
        ]
        high_samples, default_samples = await asyncio.gather(*loops)
    result.absorb(high_samples.summary())
    others = default_samples.summary()
    result.errors = dict(Counter(result.errors) + Counter(others.errors))
    result.notes = (
        f"{PRIORITY_CLIENTS} clients at priority 1 (the row); the other "
        f"{scenario.concurrency - PRIORITY_CLIENTS}: {others.throughput:,.0f} req/s, "
        f"p50 {others.p50_ms:.1f} p99 {others.p99_ms:.1f} ms"
    )
    result.extra = {
        "priority_clients": PRIORITY_CLIENTS,
        "others_throughput": others.throughput,
        "others_p50_ms": others.p50_ms,
        "others_p99_ms": others.p99_ms,
    }
    return result


def _recovery_time(samples: client.Samples, kill_at: float, baseline: float) -> float | None:
    """Seconds after the kill until a 0.5 s window holds 90 % of the baseline's OK calls."""
    window, step = 0.5, 0.05
    oks = sorted(
        end for end, status in zip(samples.ends, samples.statuses, strict=True) if status == "OK"
    )
    ends = np.asarray(oks)
    steps = max(0, math.floor((samples.duration - window - kill_at) / step) + 1)
    for index in range(steps):
        start = kill_at + index * step
        count = np.searchsorted(ends, start + window) - np.searchsorted(ends, start)
        if count >= 0.9 * baseline * window:
            return start - kill_at
    return None


async def _kill(server: ServerProcess, scenario: Scenario, timing: Timing) -> Result:
    result = Result(server.kind.name, scenario.name, scenario.kind, scenario.concurrency)
    if server.kind.find_workers is None:
        result.notes = f"n/a: {server.kind.workers_note}"
        return result
    killed: dict[str, Any] = {}

    def kill_one() -> None:
        pids = server.worker_pids()
        killed["workers_before"] = len(pids)
        if pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pids[0], signal.SIGKILL)
                killed["pid"] = pids[0]

    async with client.open_channel(server.target) as channel:
        call, check = _calls(client.stub_for(channel), scenario)
        result.check = await _checked_first_call(call, check)
        samples = await client.closed_loop(
            call,
            concurrency=scenario.concurrency,
            warmup=timing.warmup,
            duration=timing.kill_before + timing.kill_after,
            call_timeout=5.0,
            actions=[client.Action(timing.kill_before, kill_one)],
        )
    result.absorb(samples.summary())
    baseline = samples.summary(0.0, timing.kill_before).throughput
    after = samples.summary(timing.kill_before)
    recovery = _recovery_time(samples, timing.kill_before, baseline)
    workers_after = len(server.worker_pids())
    failed = sum(after.errors.values())
    result.extra = {
        **killed,
        "workers_after": workers_after,
        "baseline_throughput": baseline,
        "failed": failed,
        "failed_by_status": after.errors,
        "recovery_s": recovery,
    }
    if "pid" not in killed:
        result.notes = "no worker found to kill"
        return result
    back = (
        f"full throughput after {recovery:.2f} s"
        if recovery is not None
        else (f"throughput not back within {timing.kill_after:.1f} s")
    )
    result.notes = f"{failed} failed; {back}; workers {killed['workers_before']}->{workers_after}"
    result.restart = recovery is None or workers_after < killed["workers_before"]
    return result


async def _storm(server: ServerProcess, scenario: Scenario, timing: Timing) -> Result:
    result = Result(server.kind.name, scenario.name, scenario.kind, scenario.concurrency)
    echo = _echo_input()
    async with client.open_channel(server.target) as channel:
        stub = client.stub_for(channel)
        storm = client.infer_request("sleep", echo, raw=True, delay_ms=scenario.delay_ms)
        samples = await client.closed_loop(
            _infer(stub, storm),
            concurrency=scenario.concurrency,
            warmup=0.0,
            duration=timing.storm,
            call_timeout=0.05,
        )
    result.absorb(samples.summary())
    async with client.open_channel(server.target) as channel:
        probe = client.infer_request("sleep", echo, raw=True, delay_ms=1)
        recovery, statuses = await client.first_fast_call(
            _infer(client.stub_for(channel), probe),
            fast=0.05,
            call_timeout=5.0,
            limit=timing.recovery_limit,
        )
    result.extra = {"recovery_s": recovery, "probes": dict(statuses)}
    probes = ", ".join(f"{status} {count}" for status, count in sorted(statuses.items()))
    if recovery is None:
        result.notes = f"not fast again within {timing.recovery_limit:.0f} s (probes: {probes})"
        result.restart = True
    else:
        result.notes = f"fast again {recovery:.2f} s after the storm (probes: {probes})"
    return result


# ------------------------------------------------------------------------------------------
# overload: a memory budget, and ten times the clients it admits


@functools.cache
def overload_input() -> tuple[np.ndarray, pb.ModelInferRequest]:
    """The overload scenarios' ``echo`` input and request: one raw FP32 tensor, sized so the
    message is just under ``OVERLOAD_MESSAGE`` bytes (1 KiB left for the protobuf fields)."""
    elements = (OVERLOAD_MESSAGE - 1024) // 4
    x = np.arange(elements, dtype=np.float32).reshape(1, elements)
    request = client.infer_request("echo", x, raw=True)
    assert request.ByteSize() <= OVERLOAD_MESSAGE
    return x, request


def overload_fit() -> int:
    """How many overload requests the budget admits at once.

    Each reserves three times its message (``trio_infer/service.py``): the request, its
    decoded copy and an answer as large (``echo`` declares no outputs, so the server assumes an
    answer of the request's size).
    """
    return OVERLOAD_BUDGET // (OVERLOAD_RESERVED * overload_input()[1].ByteSize())


def _mib(kib: float) -> float:
    return round(kib / 1024, 1)


async def _start_others(
    target: str, clients: int, origin: float, duration: float, scenario: Scenario
) -> asyncio.subprocess.Process | None:
    """The overload's other clients, in a process of their own (:mod:`bench.extra_clients`)."""
    if clients <= 0:
        return None
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.extra_clients", target, str(clients), repr(origin),
        str(duration), str(scenario.deadline), *(["--backoff"] if scenario.backoff else []),
        stdout=asyncio.subprocess.PIPE, cwd=REPO,
    )  # fmt: skip


class _OthersFailed(Exception):
    """The overload's other clients did not report their calls."""


async def _samples_of(others: asyncio.subprocess.Process) -> client.Samples:
    output, _ = await others.communicate()
    if others.returncode != 0:
        raise _OthersFailed(f"other clients exited with {others.returncode}")
    try:
        return client.Samples(**json.loads(output))
    except (ValueError, TypeError) as error:
        raise _OthersFailed(f"other clients reported no samples: {error}") from None


async def _overload(server: ServerProcess, scenario: Scenario, timing: Timing) -> Result:
    """The first ``fit`` clients run here and are the row's latency; the others run in a
    second process (:mod:`bench.extra_clients`) and count in its throughput and refusals."""
    result = Result(server.kind.name, scenario.name, scenario.kind, scenario.concurrency)
    x, request = overload_input()
    measured = min(overload_fit(), scenario.concurrency)
    cpu: dict[str, CpuSnapshot] = {}
    others: asyncio.subprocess.Process | None = None

    def take_cpu(name: str, others_pid: int | None) -> Callable[[], None]:
        return lambda: cpu.__setitem__(name, CpuSnapshot.take(server.pid, others_pid))

    with MemorySampler(server, RSS_INTERVAL) as sampler:
        await asyncio.sleep(3 * RSS_INTERVAL)  # idle samples first
        async with client.open_channel(server.target) as channel:
            call = client.infer_serialized_once(channel, request)
            result.check = await _checked_first_call(call, lambda r: client.check_echo(r, x))
            origin = time.perf_counter() + timing.overload_warmup
            try:
                others = await _start_others(
                    server.target, scenario.concurrency - measured, origin, timing.overload,
                    scenario,
                )  # fmt: skip
                others_pid = others.pid if others is not None else None
                samples = await client.closed_loop(
                    call,
                    concurrency=measured,
                    origin=origin,
                    duration=timing.overload,
                    call_timeout=scenario.deadline,
                    actions=[
                        client.Action(0.0, take_cpu("start", others_pid)),
                        client.Action(timing.overload, take_cpu("end", others_pid)),
                    ],
                    retry_on=(OVERLOAD_REFUSED,),
                    backoff=OVERLOAD_BACKOFF if scenario.backoff else None,
                )
                # Their calls in flight at the window's end may run out their deadline first.
                async with asyncio.timeout(scenario.deadline + 30.0):
                    theirs = await _samples_of(others) if others is not None else None
            except _OthersFailed as error:
                result.check = str(error)
                return result
            except TimeoutError:
                result.check = "the other clients did not stop after the window"
                return result
            finally:
                if others is not None and others.returncode is None:
                    others.kill()
                    await others.wait()
        await asyncio.sleep(3 * RSS_INTERVAL)  # and a few after the load
    everyone = samples + theirs if theirs is not None else samples
    result.absorb(everyone.summary())
    # The row's latency is the measured clients' alone (the same clients as at x1), and over
    # their OK calls only: a summary without any falls back to every call's latency.
    mine = samples.summary()
    mine_ok = mine.requests - sum(mine.errors.values())
    result.p50_ms, result.p99_ms = (mine.p50_ms, mine.p99_ms) if mine_ok else (math.nan, math.nan)
    their = theirs.summary() if theirs is not None else None
    their_ok = their is not None and their.requests > sum(their.errors.values())
    first_p50, first_p99 = samples.ok_since_first()
    split = cpu["start"].until(cpu["end"]) if len(cpu) == 2 else None
    memory = sampler.samples
    if not memory:
        result.notes = "no RSS samples (server gone?)"
        return result
    rejected = result.errors.get(OVERLOAD_REFUSED, 0)
    share = rejected / result.requests if result.requests else 0.0
    budget = OVERLOAD_BUDGET / MIB
    server_max = max(m.server for m in memory)
    total_max = max(m.server + m.workers for m in memory)
    peak = max(server_max, sampler.server_peak_kib)
    result.extra = {
        "budget_mib": budget,
        "message_bytes": request.ByteSize(),
        "fit": overload_fit(),
        "load": scenario.load,
        "measured": measured,
        "measured_ok": mine_ok,
        "others": scenario.concurrency - measured,
        "others_p50_ms": their.p50_ms if their is not None and their_ok else None,
        "others_p99_ms": their.p99_ms if their is not None and their_ok else None,
        "deadline_s": scenario.deadline,
        "backoff": (
            {
                "initial_s": OVERLOAD_BACKOFF.initial,
                "max_s": OVERLOAD_BACKOFF.maximum,
                "multiplier": OVERLOAD_BACKOFF.multiplier,
                "jitter": OVERLOAD_BACKOFF.jitter,
            }
            if scenario.backoff
            else None
        ),
        "window_s": timing.overload,
        "ok_first_p50_ms": first_p50,
        "ok_first_p99_ms": first_p99,
        "cpu_cores": split,
        "ok": result.requests - sum(result.errors.values()),
        "rejected": rejected,
        "rejected_share": share,
        "rss_idle_mib": _mib(memory[0].server),
        "workers_idle_mib": _mib(memory[0].workers),
        "rss_max_mib": _mib(server_max),
        "rss_hwm_mib": _mib(sampler.server_peak_kib),
        "workers_max_mib": _mib(max(m.workers for m in memory)),
        "total_max_mib": _mib(total_max),
        "workers_seen": len(sampler.workers_seen),
        "overhead_mib": round(_mib(peak) - budget, 1),
        "overhead_total_mib": round(_mib(total_max) - budget, 1),
        "rss_t": [round(m.at - origin, 2) for m in memory],
        "rss_server_mib": [_mib(m.server) for m in memory],
        "rss_workers_mib": [_mib(m.workers) for m in memory],
    }
    e = result.extra
    resend = (
        f"backoff {OVERLOAD_BACKOFF.initial * 1e3:g} ms x{OVERLOAD_BACKOFF.multiplier:g} "
        f"to {OVERLOAD_BACKOFF.maximum:g} s, jitter {OVERLOAD_BACKOFF.jitter:.0%}"
        if scenario.backoff
        else "resent at once"
    )
    result.notes = (
        f"{e['fit']} fit in {budget:g} MiB, deadline {scenario.deadline:g} s; p50/p99: the "
        f"{measured} measured clients' {mine_ok} OK calls, req/s: all {scenario.concurrency}; "
        f"RESOURCE_EXHAUSTED {rejected} ({share:.0%}), {resend}; "
        f"OK p50/p99 from first attempt {first_p50:.0f}/{first_p99:.0f} ms; "
        f"RSS max {e['rss_max_mib']:g} MiB (peak {e['rss_hwm_mib']:g}, idle "
        f"{e['rss_idle_mib']:g}), workers max {e['workers_max_mib']:g} MiB; "
        f"max RSS - budget {e['overhead_mib']:+g} MiB"
    )
    if split is not None:
        result.notes += "; " + cpu_note(split)
    if e["workers_seen"] > server.workers:
        result.notes += f"; {e['workers_seen']} worker pids seen (workers replaced)"
    late = min(theirs.starts, default=0.0) if theirs is not None else 0.0
    if late > 0.5:
        result.notes += f"; the other clients' first call started {late:.1f} s into the window"
    return result


def cpu_note(split: dict[str, float]) -> str:
    """The CPU split of an overload window, in cores (CPU seconds per second)."""
    clients = split["client"] + split["others"]
    used = clients + split["server"] + split["workers"]
    share = f" ({clients / used:.0%} clients)" if used > 0 else ""
    return (
        f"CPU cores: measured clients {split['client']:.2f}, other clients {split['others']:.2f}, "
        f"server {split['server']:.2f}, workers {split['workers']:.2f}{share}; "
        f"machine {split['machine']:.2f} of {split['cores']:g} busy"
    )


# ------------------------------------------------------------------------------------------
# batching: dense N=1 with max_batch_size 0 or the example's


def _example_repository(root: Path) -> Path:
    """A copy of the example repository (every model folder of ``trio_infer/examples`` with
    its settings) in ``root/repository``, for a scenario's own server to serve."""
    return copy_repository(EXAMPLES, root / "repository", models_only=True)


def _batching_repository(root: Path, on: bool) -> Path:
    """A copy of the example repository under ``root``; ``dense`` counts its calls
    (:mod:`bench.batch_probe`) and, when ``on`` is false, has ``max_batch_size`` 0."""
    repository = _example_repository(root)
    dense = repository / "dense"
    settings = json.loads((dense / SETTINGS_FILE).read_text())
    settings["implementation"] = f"bench_batch_probe.{batch_probe.CountingDense.__name__}"
    if not on:
        settings["max_batch_size"] = 0
    (dense / SETTINGS_FILE).write_text(json.dumps(settings, indent=2) + "\n")
    shutil.copyfile(batch_probe.__file__, dense / "bench_batch_probe.py")
    return repository


def _read_batches(path: Path, start: float, end: float) -> list[int]:
    """The rows of each model call logged by the probe between ``start`` and ``end``."""
    rows: list[int] = []
    with contextlib.suppress(FileNotFoundError), path.open() as lines:
        for line in lines:
            at, _, count = line.partition(" ")
            with contextlib.suppress(ValueError):
                if start <= float(at) < end:
                    rows.append(int(count))
    return rows


#: The line the server would log for each batching model when it stops (not logged yet; read
#: when present): ``model 'dense': 412 batches, 5230 requests, 5230 rows``.
SERVER_BATCHING_LINE = re.compile(
    r"model '(?P<model>[^']+)': (?P<batches>\d+) batches, (?P<requests>\d+) requests, "
    r"(?P<rows>\d+) rows"
)


def server_log_batching(log_path: Path, model: str) -> dict[str, Any] | None:
    """The batching totals of ``model`` in the last start of a server's log, if it logs them."""
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return None
    found = None
    for match in SERVER_BATCHING_LINE.finditer(text.rpartition("==== start")[2]):
        if match["model"] == model:
            found = match
    if found is None:
        return None
    batches, requests = int(found["batches"]), int(found["requests"])
    return {
        "batches": batches,
        "requests": requests,
        "rows": int(found["rows"]),
        "mean_requests": requests / batches if batches else None,
    }


async def _batching(
    server: ServerProcess, scenario: Scenario, timing: Timing, *, repository: Path
) -> Result:
    result = Result(server.kind.name, scenario.name, scenario.kind, scenario.concurrency)
    x = client.dense_input(scenario.rows)
    request = client.infer_request("dense", x, raw=scenario.raw)
    window: dict[str, float] = {}

    def mark(name: str) -> Callable[[], None]:
        return lambda: window.__setitem__(name, time.monotonic())

    async with client.open_channel(server.target) as channel:
        call = _infer(client.stub_for(channel), request)
        result.check = await _checked_first_call(call, lambda r: client.check_dense(r, x))
        samples = await client.closed_loop(
            call,
            concurrency=scenario.concurrency,
            warmup=timing.warmup,
            duration=timing.once,
            call_timeout=timing.timeout,
            actions=[
                client.Action(0.0, mark("start")),
                client.Action(timing.once, mark("end")),
            ],
        )
    result.absorb(samples.summary())
    settings = json.loads((repository / "dense" / SETTINGS_FILE).read_text())
    rows = _read_batches(
        repository / "dense" / batch_probe.LOG_NAME, window["start"], window["end"]
    )
    mean = sum(rows) / len(rows) if rows else None
    result.extra = {
        "batching": scenario.batching,
        "max_batch_size": settings.get("max_batch_size", 0),
        "max_batch_time": settings.get("max_batch_time", 0),
        "batches": len(rows),
        "batched_rows": sum(rows),
        "mean_batch": mean,
        "max_batch": max(rows, default=None),
    }
    result.notes = f"max_batch_size {result.extra['max_batch_size']}; " + (
        f"mean batch {mean:.2f} requests ({len(rows)} model calls in the window, largest "
        f"{result.extra['max_batch']})"
        if mean
        else "no model call logged in the window"
    )
    return result


# ------------------------------------------------------------------------------------------
# hostile: a well-behaved client alone, then beside an attack


def attack_outcome(seen: dict[str, Any]) -> str:
    """One word for what an attacker saw (:class:`bench.attacks.Outcomes` as JSON):
    ``blocked`` when the server stopped reading it; else the status most of its calls ended
    with (for ``trailers``, those that sent trailers); else how most of its connections ended
    other than being held to the end (a GOAWAY's code, ``reset``, ``closed``); else ``held``."""
    if seen.get("blocked"):
        return "blocked"
    calls: dict[str, int] = seen.get("calls", {})
    if seen.get("attack") == "trailers":
        calls = {k: n for k, n in calls.items() if k.startswith("trailers:")}
    ended = {k: n for k, n in calls.items() if not k.endswith("open at the end")}
    if ended:
        return max(ended, key=lambda k: ended[k]).rpartition(": ")[2].replace(" ", "-")
    closed = {k: n for k, n in seen.get("ended", {}).items() if k != "held"}
    if closed:
        return max(closed, key=lambda k: closed[k]).removeprefix("GOAWAY ").replace(" ", "-")
    return "held"


async def _start_attack(target: str, attack: str, until: float) -> asyncio.subprocess.Process:
    """The attacker, in a process of its own (:mod:`bench.attacks`)."""
    host, _, port = target.rpartition(":")
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.attacks", attack, host, port, repr(until),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=REPO,
    )  # fmt: skip


async def _attack_report(attacker: asyncio.subprocess.Process, limit: float) -> dict[str, Any]:
    """What the attacker printed; after ``limit`` seconds it is killed and reports nothing."""
    try:
        async with asyncio.timeout(limit):
            output, errors = await attacker.communicate()
    except TimeoutError:
        return {"failed": f"the attacker did not stop within {limit:.0f} s of its end"}
    finally:
        if attacker.returncode is None:
            attacker.kill()
            await attacker.wait()
    try:
        report: dict[str, Any] = json.loads(output)
    except ValueError:
        tail = errors.decode(errors="replace").strip().splitlines()[-1:]
        return {"failed": f"the attacker exited with {attacker.returncode}: {tail}"}
    return report


def _peak(memory: Sequence[Any], start: float, end: float, part: str) -> float:
    return _mib(max((getattr(m, part) for m in memory if start <= m.at <= end), default=0))


async def _hostile(server: ServerProcess, scenario: Scenario, timing: Timing) -> Result:
    """The bystander alone for a window, then the attack starts and, after a ramp, the same
    bystander for a window beside it; the attacker stops by itself at that window's end. The
    row is the bystander under attack; ``extra`` has it alone, the ratios, RSS and CPU."""
    result = Result(server.kind.name, scenario.name, scenario.kind, scenario.concurrency)
    x = client.dense_input(1)
    request = client.infer_request("dense", x, raw=True)
    cpu: dict[str, CpuSnapshot] = {}
    attacker_pid: list[int] = []

    def take_cpu(name: str) -> Callable[[], None]:
        return lambda: cpu.__setitem__(
            name, CpuSnapshot.take(server.pid, attacker_pid[0] if attacker_pid else None)
        )

    def window(origin: float | None, start: str, end: str) -> Awaitable[client.Samples]:
        return client.closed_loop(
            call,
            concurrency=scenario.concurrency,
            warmup=timing.warmup,
            origin=origin,
            duration=timing.hostile,
            call_timeout=HOSTILE_DEADLINE,
            actions=[
                client.Action(0.0, take_cpu(start)),
                client.Action(timing.hostile, take_cpu(end)),
            ],
        )

    with MemorySampler(server, HOSTILE_RSS_INTERVAL) as sampler:
        await asyncio.sleep(5 * HOSTILE_RSS_INTERVAL)  # idle samples first
        async with client.open_channel(server.target) as channel:
            call = _infer(client.stub_for(channel), request)
            result.check = await _checked_first_call(call, lambda r: client.check_dense(r, x))
            alone = await window(None, "alone start", "alone end")
            attack_start = time.perf_counter()
            origin = attack_start + timing.hostile_ramp
            until = origin + timing.hostile
            attacker = await _start_attack(server.target, scenario.attack, until)
            attacker_pid.append(attacker.pid)
            try:
                under = await window(origin, "attack start", "attack end")
            finally:
                seen = await _attack_report(attacker, until - time.perf_counter() + 20.0)
            attack_end = time.perf_counter()
            # Whether the server serves normally once the attacker is gone.
            await asyncio.sleep(0.2)
            after = await _checked_first_call(call, lambda r: client.check_dense(r, x))
        await asyncio.sleep(5 * HOSTILE_RSS_INTERVAL)
    result.absorb(under.summary())
    calm = alone.summary()
    memory = sampler.samples
    if not memory:
        result.notes = "no RSS samples (server gone?)"
        return result
    alive = server.alive()
    idle = memory[0]
    e: dict[str, Any] = {
        "attack": scenario.attack,
        "budget_mib": attacks.BUDGET / MIB,
        "deadline_s": HOSTILE_DEADLINE,
        "window_s": timing.hostile,
        "ramp_s": timing.hostile_ramp,
        "alone_throughput": calm.throughput,
        "alone_p50_ms": calm.p50_ms,
        "alone_p99_ms": calm.p99_ms,
        "alone_requests": calm.requests,
        "alone_errors": calm.errors,
        "throughput_ratio": result.throughput / calm.throughput if calm.throughput else None,
        "p50_ratio": result.p50_ms / calm.p50_ms if calm.p50_ms else None,
        "p99_ratio": result.p99_ms / calm.p99_ms if calm.p99_ms else None,
        "rss_idle_mib": _mib(idle.server),
        "workers_idle_mib": _mib(idle.workers),
        "rss_alone_max_mib": _peak(memory, 0.0, attack_start, "server"),
        "rss_attack_max_mib": _peak(memory, attack_start, attack_end, "server"),
        "rss_hwm_mib": _mib(sampler.server_peak_kib),
        "workers_attack_max_mib": _peak(memory, attack_start, attack_end, "workers"),
        "workers_seen": len(sampler.workers_seen),
        "cpu_alone": (cpu["alone start"].until(cpu["alone end"]) if "alone end" in cpu else None),
        "cpu_attack": (
            cpu["attack start"].until(cpu["attack end"]) if "attack end" in cpu else None
        ),
        "attacker": seen,
        "outcome": "failed" if "failed" in seen else attack_outcome(seen),
        "after": after,
        "server_alive": alive,
        "rss_t": [round(m.at - origin, 2) for m in memory],
        "rss_server_mib": [_mib(m.server) for m in memory],
    }
    e["rss_peak_mib"] = max(e["rss_attack_max_mib"], e["rss_hwm_mib"])
    e["over_budget_mib"] = round(e["rss_peak_mib"] - e["budget_mib"], 1)
    result.extra = e
    cores = e["cpu_attack"]
    result.notes = (
        f"{scenario.attack}: outcome {e['outcome']}; bystander alone "
        f"{calm.throughput:,.0f} req/s p50 {calm.p50_ms:.2f} p99 {calm.p99_ms:.2f} ms"
        f"{' errors ' + str(sum(calm.errors.values())) if calm.errors else ''}; "
        f"server RSS idle {e['rss_idle_mib']:g} MiB, peak {e['rss_peak_mib']:g} MiB "
        f"(budget {e['budget_mib']:g}), workers max {e['workers_attack_max_mib']:g} MiB"
        + (
            f"; CPU cores under attack: server {cores['server']:.2f}, workers "
            f"{cores['workers']:.2f}, attacker {cores['others']:.2f}"
            if cores
            else ""
        )
        + ("" if after == "ok" else f"; after the attack: {after}")
        + ("" if alive else "; THE SERVER DIED")
    )
    if "failed" in seen:
        result.check = str(seen["failed"])
    result.restart = not alive
    return result


# ------------------------------------------------------------------------------------------
# repository: dense calls, quiet and beside models being loaded and unloaded


def _churn_repository(root: Path) -> Path:
    """A copy of the example repository under ``root`` with a copy of ``dense`` named
    :data:`CHURN_MODEL` (the same code and settings, in a folder of its own)."""
    repository = _example_repository(root)
    folder = repository / CHURN_MODEL
    shutil.copytree(repository / "dense", folder)
    settings = json.loads((folder / SETTINGS_FILE).read_text())
    settings["name"] = CHURN_MODEL
    (folder / SETTINGS_FILE).write_text(json.dumps(settings, indent=2) + "\n")
    return repository


@dataclass
class _Churn:
    """What the churn did in one window: per operation (:data:`CHURN_OPERATIONS`), the ones
    that ended in it (times from the window's start, as :class:`client.Samples` has them), and
    the status and message of each that failed (whenever it ended)."""

    operations: dict[str, client.Samples]
    failures: list[str] = field(default_factory=list)


async def _churn(stub: Any, origin: float, stop: float, churn: _Churn, pause: float) -> None:
    """Unload and load CHURN_MODEL one operation at a time, as one operator's tool would, with
    ``pause`` seconds after each (0: back to back), and reload it with a ``config`` every
    CHURN_RELOAD_EVERY-th cycle, until ``stop`` on ``time.perf_counter()``'s clock. A cycle
    that has begun is finished, so the model is served again when the loop ends (the next
    round's churn begins with an unload); an operation that ends after ``stop`` is not counted
    in the window."""
    # The reload's ``config`` is the field tritonclient's ``load_model(config=)`` sends.
    reload = pb.RepositoryModelLoadRequest(model_name=CHURN_MODEL)
    reload.parameters["config"].string_param = json.dumps(CHURN_CONFIG)
    plan: list[tuple[str, Any, Any]] = [
        (
            "unload",
            stub.RepositoryModelUnload,
            pb.RepositoryModelUnloadRequest(model_name=CHURN_MODEL),
        ),
        ("load", stub.RepositoryModelLoad, pb.RepositoryModelLoadRequest(model_name=CHURN_MODEL)),
        ("reload", stub.RepositoryModelLoad, reload),
    ]
    cycle = 0
    while time.perf_counter() < stop:
        cycle += 1
        for name, method, request in plan:
            if name == "reload" and cycle % CHURN_RELOAD_EVERY:
                continue
            started = time.perf_counter()
            try:
                await method(request, timeout=CHURN_TIMEOUT)
                status = "OK"
            except Exception as error:
                status = client.status_of(error)
                details = error.details() if isinstance(error, grpc.aio.AioRpcError) else error
                churn.failures.append(f"{name} (cycle {cycle}): {status} {details}")
            ended = time.perf_counter()
            samples = churn.operations[name]
            if origin <= ended < stop:
                samples.starts.append(started - origin)
                samples.ends.append(ended - origin)
                samples.statuses.append(status)
                samples.firsts.append(started - origin)
            if pause:
                await asyncio.sleep(pause)


async def _repository_round(
    server: ServerProcess, scenario: Scenario, timing: Timing, call: client.Call, admin: Any,
    churned: bool,
) -> tuple[Result, _Churn | None]:  # fmt: skip
    """One window of the measured ``dense`` calls, quiet or with the churn running from the
    warm-up's start to the window's end; its row and what the churn did."""
    condition = "churn" if churned else "quiet"
    name = scenario.name.replace("repository-", f"repository-{condition}-", 1)
    result = Result(server.kind.name, name, scenario.kind, scenario.concurrency)
    origin = time.perf_counter() + timing.warmup
    churn = _Churn({op: client.Samples(timing.duration) for op in CHURN_OPERATIONS})
    async with asyncio.TaskGroup() as group:
        if churned:
            pause = scenario.delay_ms / 1000
            group.create_task(_churn(admin, origin, origin + timing.duration, churn, pause))
        samples = await client.closed_loop(
            call,
            concurrency=scenario.concurrency,
            origin=origin,
            duration=timing.duration,
            call_timeout=timing.timeout,
        )
    result.absorb(samples.summary())
    return result, churn if churned else None


def _churn_totals(churns: Sequence[_Churn]) -> dict[str, Any]:
    """The churn's operations over every round: per operation, how many ended in a window
    (per round, and in all), their p50/p99 over all rounds and their failed statuses."""
    totals: dict[str, Any] = {}
    for op in CHURN_OPERATIONS:
        rounds = [churn.operations[op] for churn in churns]
        pooled = functools.reduce(lambda a, b: a + b, rounds)
        summary = pooled.summary()
        totals[op] = {
            "per_round": [len(samples.ends) for samples in rounds],
            "count": summary.requests,
            "p50_ms": summary.p50_ms if summary.requests else None,
            "p99_ms": summary.p99_ms if summary.requests else None,
            "errors": summary.errors,
        }
    return totals


async def _repository(server: ServerProcess, scenario: Scenario, timing: Timing) -> list[Result]:
    """``dense`` 1 row, raw, at the scenario's concurrency, for ``timing.rounds`` rounds of two
    windows each, quiet and churned, in alternating order (a drift of the machine's speed then
    favours neither); a row per condition, the median of its rounds (:func:`merge_rounds`).
    The churn runs on a channel of its own, as an operator's tool would."""
    x = client.dense_input(1)
    request = client.infer_request("dense", x, raw=True)
    rounds: dict[bool, list[Result]] = {False: [], True: []}
    churns: list[_Churn] = []
    async with (
        client.open_channel(server.target) as channel,
        client.open_channel(server.target) as admin_channel,
    ):
        call = _infer(client.stub_for(channel), request)
        admin = client.stub_for(admin_channel)
        check = await _checked_first_call(call, lambda r: client.check_dense(r, x))
        # Loaded at start (--load-model '*'); a load of a served model answers at once, and
        # checks that the server takes repository calls before any window counts them.
        load = pb.RepositoryModelLoadRequest(model_name=CHURN_MODEL)
        loaded = await _checked_first_call(
            lambda t: admin.RepositoryModelLoad(load, timeout=t), lambda r: "ok"
        )
        for index in range(timing.rounds):
            for churned in (False, True) if index % 2 == 0 else (True, False):
                result, churn = await _repository_round(
                    server, scenario, timing, call, admin, churned
                )
                result.check = check if loaded == "ok" else f"{CHURN_MODEL}: {loaded}"
                rounds[churned].append(result)
                if churn is not None:
                    churns.append(churn)
    quiet, churned_row = merge_rounds(rounds[False]), merge_rounds(rounds[True])
    totals = _churn_totals(churns)
    failures = [f for churn in churns for f in churn.failures]
    ops = "; ".join(
        f"{op} {'/'.join(str(n) for n in t['per_round'])} (p50 {t['p50_ms'] or math.nan:.1f}, "
        f"p99 {t['p99_ms'] or math.nan:.1f} ms)"
        for op, t in totals.items()
    )
    for row in (quiet, churned_row):
        row.extra.update(
            condition="churn" if row is churned_row else "quiet",
            churn_model=CHURN_MODEL,
            churn_config=CHURN_CONFIG,
            reload_every=CHURN_RELOAD_EVERY,
            window_s=timing.duration,
        )
    churned_row.extra.update(operations=totals, failures=failures[:20], failed=len(failures))
    churned_row.notes = "; ".join(
        filter(
            None,
            [
                f"{CHURN_MODEL} operations ended per window: {ops}",
                f"REPOSITORY CALLS FAILED ({len(failures)}): {failures[0]}" if failures else "",
                churned_row.notes,
            ],
        )
    )
    quiet.notes = "; ".join(filter(None, ["no load or unload", quiet.notes]))
    return [quiet, churned_row]


async def _rows(rows: Awaitable[Result | list[Result]]) -> list[Result]:
    """A scenario's rows: its one row, or (``repository``) one per condition."""
    done = await rows
    return [done] if isinstance(done, Result) else done


def run_on_own_server(
    kind: ServerKind, python: Path, workers: int, run_dir: Path, scenario: Scenario,
    timing: Timing, log: Callable[[str], None], cpus: CpuSet | None = None,
) -> list[Result]:  # fmt: skip
    """Start a server for ``scenario`` alone (its memory budget, or its copy of the example
    repository), pinned to ``cpus`` if given, run the scenario, stop the server; its rows (one,
    or ``repository``'s two), marked with the CPU set.

    Raises:
        PeerUnavailable: The server did not start.
    """
    with tempfile.TemporaryDirectory(prefix=f"bench-{scenario.name}-") as tmp:
        runner: Callable[[ServerProcess, Scenario, Timing], Awaitable[Result | list[Result]]]
        if scenario.kind == "overload":
            args: tuple[str, ...] = ("--memory-budget", str(OVERLOAD_BUDGET))
            if kind.name == "trio-infer":
                # The measured clients share one channel, as the other clients do: the budget,
                # not one connection's share of it, is the bound these rows measure (a
                # baseline's older tree has no share, nor the option).
                args += ("--max-connection-bytes", str(OVERLOAD_BUDGET))
            if scenario.no_waiting:
                args += ("--max-waiting-bytes", "0")
            runner = _overload
        elif scenario.kind == "hostile":
            args = ("--memory-budget", str(attacks.BUDGET))
            runner = _hostile
        elif scenario.kind == "repository":
            # Every model loaded at start, then loaded and unloaded by the scenario's calls.
            repository = _churn_repository(Path(tmp))
            args = ("--model-control-mode", "explicit", "--load-model", "*", str(repository))
            runner = _repository
        else:
            repository = _batching_repository(Path(tmp), scenario.batching)
            args = (str(repository),)
            runner = functools.partial(_batching, repository=repository)
        server = ServerProcess(
            kind, python, workers, run_dir, extra_args=args, label=scenario.name, cpus=cpus
        )
        pinned = f" on CPUs {cpus.spec}" if cpus else ""
        try:
            took = server.start()
            log(f"{kind.name} for {scenario.name}{pinned} ready in {took:.1f} s (pid {server.pid})")
            results = asyncio.run(_rows(runner(server, scenario, timing)))
        finally:
            server.stop()
        for result in results:
            result.cpus = cpus.spec if cpus else None
    if scenario.kind == "batching":
        result = results[0]
        from_log = server_log_batching(server.log_path, "dense")
        result.extra["server_log"] = from_log
        if from_log is not None and from_log["mean_requests"] is not None:
            result.notes += f"; server log: mean {from_log['mean_requests']:.2f} requests per batch"
    return results


def run(server: ServerProcess, scenario: Scenario, timing: Timing) -> Result:
    """Run one scenario against a started server (not one of :data:`OWN_SERVER_KINDS`)."""
    runners = {"kill": _kill, "storm": _storm, "priority": _priority}
    runners |= {"stream": _stream, "decoupled": _stream}
    runner = runners.get(scenario.kind, _load)
    return asyncio.run(runner(server, scenario, timing))
