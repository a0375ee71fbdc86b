"""The scenarios: what each one sends, for how long, and what it reports.

=================  ========================================================================
``live-cC``         ServerLive (an empty unary call) at concurrency C: the transport ceiling.
``dense-nN-F-cC``   ``dense`` with N rows (1 or 64), F = raw or typed contents, concurrency C.
``sleep10-c25``     ``sleep`` with ``delay_ms`` 10 at concurrency 25: worker scheduling only.
``kill``            ``sleep`` 10 ms at C=25; one worker gets SIGKILL: failed calls and the time
                    until throughput is back to 90 % of what it was before.
``storm``           25 clients send ``sleep`` 100 ms with a 50 ms deadline; then the time until
                    a normal call (``delay_ms`` 1, 5 s deadline) ends in under 50 ms again.
=================  ========================================================================

Scenarios always run in this order; ``kill`` and ``storm`` come last because they can leave a
server degraded (the server is restarted when they do).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bench import client
from bench.servers import ServerProcess
from trio_infer._proto import grpc_predict_v2_pb2 as pb


@dataclass(frozen=True)
class Scenario:
    """One measured situation; ``kind`` is one of live, dense, sleep, kill, storm."""

    name: str
    kind: str
    concurrency: int
    rows: int = 1
    raw: bool = True
    delay_ms: int = 0


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
    scenarios.append(Scenario("kill", "kill", 25, delay_ms=10))
    scenarios.append(Scenario("storm", "storm", 25, delay_ms=100))
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
    storm: float
    recovery_limit: float
    kill_before: float
    kill_after: float
    timeout: float = 10.0

    @classmethod
    def choose(cls, duration: float | None, quick: bool) -> Timing:
        """The full run's timing, or ``--quick``'s (a run of every server under 2 minutes)."""
        if quick:
            return cls(
                warmup=0.25, duration=duration or 0.8, storm=2.0, recovery_limit=8.0,
                kill_before=1.0, kill_after=2.0,
            )  # fmt: skip
        duration = duration or 5.0
        return cls(
            warmup=1.0, duration=duration, storm=4.0, recovery_limit=60.0,
            kill_before=2.0, kill_after=max(4.0, duration),
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

    def absorb(self, summary: client.Summary) -> None:
        """Take throughput, percentiles, request count and errors from a summary."""
        self.throughput = summary.throughput
        self.p50_ms = summary.p50_ms
        self.p99_ms = summary.p99_ms
        self.requests = summary.requests
        self.errors = summary.errors


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
    if scenario.kind == "dense":
        x = client.dense_input(scenario.rows)
        request = client.infer_request("dense", x, raw=scenario.raw)
        return _infer(stub, request), lambda response: client.check_dense(response, x)
    echo = _echo_input()
    request = client.infer_request("sleep", echo, raw=scenario.raw, delay_ms=scenario.delay_ms)
    return _infer(stub, request), lambda response: client.check_echo(response, echo)


async def _checked_first_call(call: client.Call, check: Callable[[object], str]) -> str:
    try:
        return check(await call(10.0))
    except Exception as error:
        return f"first call failed: {client.status_of(error)}"


async def _load(server: ServerProcess, scenario: Scenario, timing: Timing) -> Result:
    result = Result(server.kind.name, scenario.name, scenario.kind, scenario.concurrency)
    async with client.open_channel(server.target) as channel:
        call, check = _calls(client.stub_for(channel), scenario)
        result.check = await _checked_first_call(call, check)
        samples = await client.closed_loop(
            call,
            concurrency=scenario.concurrency,
            warmup=timing.warmup,
            duration=timing.duration,
            call_timeout=timing.timeout,
        )
    result.absorb(samples.summary())
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


def run(server: ServerProcess, scenario: Scenario, timing: Timing) -> Result:
    """Run one scenario against a started server."""
    runner = {"kill": _kill, "storm": _storm}.get(scenario.kind, _load)
    return asyncio.run(runner(server, scenario, timing))
