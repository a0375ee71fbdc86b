"""``python -m bench``: run the scenarios against every server, then print and save the table.

Every server is installed (first use) and started, then each scenario is measured on one
server after the other: the servers being compared are measured within seconds of each other,
not minutes, on a shared machine whose speed drifts. The load scenarios (live, dense, sleep,
REST, streams, runtime models) run in rounds, the servers taking turns in alternating order,
and each row is the median of its rounds. Only the server being measured has work: the others
sit idle. The scenarios on trio-infer alone (overload, batching, hostile, repository) then start
a server of their own each, once the shared ones have stopped. Results go to
``bench/results/<timestamp>/`` (and ``bench/results/latest``): ``table.md``, ``results.jsonl``,
``chart.png``, ``rss.png`` and the servers' logs.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

from bench import report, scenarios, servers
from bench.scenarios import Result, Scenario, Timing
from bench.servers import CpuSet, PeerUnavailable, ServerKind, ServerProcess

#: What the chart needs when this interpreter has no matplotlib (``pip install -e .[bench]``).
CHART_REQUIREMENTS = ("matplotlib>=3.8",)

#: One server under test: its kind and the CPUs it is pinned to (None: not pinned, no
#: ``--cpus``). With ``--cpus``, each kind runs once per CPU set, and they all take turns.
Slot = tuple[ServerKind, CpuSet | None]


def log(message: str) -> None:
    """Progress on stderr, so stdout holds only the table."""
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench", description=(__doc__ or "").split("\n\n")[0]
    )
    parser.add_argument(
        "--servers",
        default=",".join(name for name, kind in servers.SERVERS.items() if kind.by_default),
        help="comma-separated servers (default: %(default)s)",
    )
    parser.add_argument(
        "--scenarios",
        default="all",
        help="comma-separated scenario names or prefixes: live, dense, dense-n64, sleep, "
        "kill, storm, overload, batching, hostile, repository, rest, rest-dense-n64, runtime, "
        "dense-n1-raw-c25, batching-on, hostile-rapid-reset, ... (default: all)",
    )
    parser.add_argument(
        "--duration",
        type=float,
        help="measured seconds per round of a load scenario (default 2; 0.8 quick)",
    )
    parser.add_argument(
        "--rounds", type=int, help="rounds of each load scenario (default 3; 1 quick)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="short windows: every server in about 2 minutes"
    )
    parser.add_argument(
        "--workers", type=int, default=2, help="worker processes per server (default: 2)"
    )
    parser.add_argument(
        "--baseline",
        metavar="REV",
        help="also run trio-infer as of git revision REV (e.g. HEAD~1), side by side",
    )
    parser.add_argument(
        "--cpus",
        metavar="LIST",
        help="CPU sets in taskset -c syntax, separated by /, e.g. 0/0-1: every row is measured "
        "with each server pinned to each set (taskset -c SET), the client unpinned "
        "(default: no pinning)",
    )
    return parser


def _spec(cpus: CpuSet | None) -> str | None:
    """A row's ``cpus``: the set as given, or None when not pinned."""
    return cpus.spec if cpus is not None else None


def _name(slot: Slot) -> str:
    """A server in the progress lines: ``trio-infer``, or ``trio-infer on CPUs 0-1``."""
    kind, cpus = slot
    return kind.name if cpus is None else f"{kind.name} on CPUs {cpus.spec}"


def _summary_line(result: Result) -> str:
    numbers = (
        f"{result.throughput:,.0f} req/s p50 {result.p50_ms:.2f} p99 {result.p99_ms:.2f} ms"
        if result.throughput is not None and result.p50_ms is not None and result.p99_ms is not None
        else "-"
    )
    errors = sum(result.errors.values())
    tail = f" errors {errors}" if errors else ""
    check = f" CHECK {result.check}" if result.check not in ("", "ok") else ""
    notes = f" ({result.notes})" if result.notes else ""
    pinned = f" on CPUs {result.cpus}" if result.cpus is not None else ""
    return f"{result.server}{pinned} {result.scenario}: {numbers}{tail}{check}{notes}"


def run_all(
    kinds: Sequence[ServerKind],
    chosen: Sequence[Scenario],
    timing: Timing,
    workers: int,
    run_dir: Path,
    results: list[Result],
    cpu_sets: Sequence[CpuSet | None] = (None,),
) -> None:
    """Install every server, measure the shared scenarios, then those on a server of their own,
    each once per CPU set in ``cpu_sets`` (None: not pinned), adding rows to ``results`` as they
    come (a Ctrl+C keeps those measured); a server that cannot be installed or started becomes
    a ``missing`` row."""
    pythons: dict[ServerKind, Path] = {}
    for kind in kinds:
        if any(s.kind in kind.serves for s in chosen):
            try:
                pythons[kind] = servers.ensure_installed(kind, log)
            except PeerUnavailable as error:
                results.append(_missing(kind, str(error)))
    shared = [s for s in chosen if not s.own_server]
    if shared:
        _run_shared(pythons, shared, timing, workers, run_dir, results, cpu_sets)
    for kind, python in pythons.items():
        for scenario in (s for s in chosen if s.own_server and s.kind in kind.serves):
            for cpus in cpu_sets:
                rows = _on_own_server(kind, python, workers, run_dir, scenario, timing, cpus)
                for result in rows:
                    results.append(result)
                    log(_summary_line(result))


def _on_own_server(
    kind: ServerKind, python: Path, workers: int, run_dir: Path, scenario: Scenario,
    timing: Timing, cpus: CpuSet | None,
) -> list[Result]:  # fmt: skip
    """The rows of a scenario on a server of its own, or a ``crash`` row if it did not start."""
    try:
        return scenarios.run_on_own_server(
            kind, python, workers, run_dir, scenario, timing, log, cpus
        )
    except PeerUnavailable as error:
        log(f"{_name((kind, cpus))} for {scenario.name} did not start: {error}")
        crashed = Result(kind.name, scenario.name, "crash", 0, notes=f"no server: {error}")
        crashed.cpus = _spec(cpus)
        return [crashed]


def _missing(kind: ServerKind, why: str, cpus: CpuSet | None = None) -> Result:
    log(f"{_name((kind, cpus))} is missing: {why}")
    return Result(kind.name, "(all)", "missing", 0, notes=f"missing: {why}", cpus=_spec(cpus))


def _run_shared(
    pythons: dict[ServerKind, Path],
    shared: Sequence[Scenario],
    timing: Timing,
    workers: int,
    run_dir: Path,
    results: list[Result],
    cpu_sets: Sequence[CpuSet | None],
) -> None:
    """Start the servers together (each kind once per CPU set) and measure each scenario on one
    after the other."""
    running: dict[Slot, ServerProcess] = {}
    # The runtime models go into copies of the repositories, which live as long as the servers
    # (a restart serves them again).
    copies = tempfile.TemporaryDirectory(prefix="bench-repositories-")
    try:
        served = (
            servers.with_runtime_models(list(pythons), Path(copies.name), log)
            if any(s.kind in servers.RUNTIME_KINDS for s in shared)
            else {}
        )
        for cpus in cpu_sets:
            for kind, python in pythons.items():
                if any(s.kind in kind.serves for s in shared):
                    started = _start_shared(served.get(kind, kind), python, workers, run_dir, cpus)
                    if isinstance(started, ServerProcess):
                        running[kind, cpus] = started
                    else:
                        results.append(_missing(kind, started, cpus))
        degraded: set[Slot] = set()
        for scenario in shared:
            serving = [slot for slot in running if scenario.kind in slot[0].serves]
            rounds: dict[Slot, list[Result]] = {slot: [] for slot in serving}
            count = timing.rounds if scenario.kind in scenarios.ROUND_KINDS else 1
            try:
                for index in range(count):
                    # Alternating order: a drift of the machine's speed favours no server.
                    for slot in serving if index % 2 == 0 else serving[::-1]:
                        if slot not in running:
                            continue  # it did not restart: its missing row says why
                        server, note = _ready(running, slot, degraded, results)
                        if server is None:
                            continue
                        result = scenarios.run(server, scenario, timing)
                        result.notes = "; ".join(filter(None, [note, result.notes]))
                        result.cpus = _spec(slot[1])
                        if result.restart:
                            degraded.add(slot)
                        rounds[slot].append(result)
            finally:
                # On Ctrl+C too: the rounds measured so far make their rows.
                for slot in serving:
                    if rounds[slot]:
                        result = scenarios.merge_rounds(rounds[slot])
                        results.append(result)
                        log(_summary_line(result))
    finally:
        for server in running.values():
            server.stop()
        copies.cleanup()


def _start_shared(
    kind: ServerKind, python: Path, workers: int, run_dir: Path, cpus: CpuSet | None
) -> ServerProcess | str:
    """A started server of ``kind`` for the shared scenarios, pinned to ``cpus`` if given; or
    why it did not start."""
    server = ServerProcess(kind, python, workers, run_dir, extra_args=kind.shared_args, cpus=cpus)
    try:
        took = server.start()
    except PeerUnavailable as error:
        return str(error)
    rest = f", REST on port {server.http_port}" if server.http_port else ""
    log(f"{_name((kind, cpus))} ready on {server.target}{rest} in {took:.1f} s (pid {server.pid})")
    return server


def _ready(
    running: dict[Slot, ServerProcess],
    slot: Slot,
    degraded: set[Slot],
    results: list[Result],
) -> tuple[ServerProcess | None, str]:
    """The server of ``slot``, restarted first if it died or the last scenario left it degraded
    (kill, storm), with a note saying so; None if it does not start again, which makes a
    ``missing`` row and ends its part in the run."""
    server = running[slot]
    if slot in degraded:
        why = f"left degraded by the last scenario ({server.log_path})"
    elif not server.alive():
        why = f"died ({server.log_path})"
    else:
        return server, ""
    degraded.discard(slot)
    log(f"{_name(slot)} {why}: restarting it")
    try:
        server.start()
    except PeerUnavailable as error:
        del running[slot]
        results.append(_missing(slot[0], f"did not restart: {error}", slot[1]))
        return None, ""
    return server, f"restarted before this: {why}"


def _chart(results_path: Path, chart_path: Path, rss_path: Path) -> str:
    """Draw the charts here, or in a small matplotlib venv; returns what happened.

    ``rss_path`` (RSS over time) is drawn only when an overload scenario ran.
    """
    if importlib.util.find_spec("matplotlib") is None:
        try:
            python = servers.ensure_venv("chart", CHART_REQUIREMENTS, log)
        except PeerUnavailable as error:
            return f"no chart: {error}"
        done = subprocess.run(
            [str(python), "-m", "bench.chart", str(results_path), str(chart_path), str(rss_path)],
            cwd=servers.REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        if done.returncode != 0:
            return f"no chart: {done.stderr.strip().splitlines()[-1:]}"
    else:
        from bench.chart import render, render_rss

        render(results_path, chart_path)
        render_rss(results_path, rss_path)
    return f"chart: {chart_path}" + (f", {rss_path}" if rss_path.exists() else "")


def _cpu_sets(text: str | None) -> list[CpuSet | None]:
    """``--cpus`` as the CPU sets to run each server on; ``[None]`` (not pinned) without it.

    Raises:
        ValueError: taskset is missing, or a set is bad (the message says which and why).
    """
    if text is None:
        return [None]
    servers.require_taskset()
    return list(servers.parse_cpu_sets(text))


def _interrupt(signum: int, frame: FrameType | None) -> None:
    """SIGTERM and SIGHUP act as Ctrl+C (asyncio.run then cancels the running scenario)."""
    os.kill(os.getpid(), signal.SIGINT)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        kinds = servers.select([n.strip() for n in args.servers.split(",") if n.strip()])
        if args.baseline:
            kinds.append(servers.baseline(args.baseline))
        chosen = scenarios.select(args.scenarios)
    except ValueError as error:
        log(str(error))
        return 2
    if args.workers < 1:
        log("--workers must be at least 1")
        return 2
    if args.rounds is not None and args.rounds < 1:
        log("--rounds must be at least 1")
        return 2
    try:
        cpu_sets = _cpu_sets(args.cpus)
    except ValueError as error:
        log(str(error))
        return 2
    timing = Timing.choose(args.duration, args.quick, args.rounds)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    run_dir = servers.RESULTS / stamp
    run_dir.mkdir(parents=True, exist_ok=True)
    # Ctrl+C raises KeyboardInterrupt even where the shell started us with SIGINT ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGHUP, _interrupt)
    began = time.monotonic()
    results: list[Result] = []
    interrupted = False
    try:
        run_all(kinds, chosen, timing, args.workers, run_dir, results, cpu_sets)
    except KeyboardInterrupt:
        interrupted = True
        log("interrupted: servers stopped; reporting what was measured")
    finally:
        servers.stop_all()
    meta = {
        "stamp": stamp,
        "servers": [kind.name for kind in kinds],
        "scenarios": [s.name for s in chosen],
        "timing": vars(timing),
        "workers": args.workers,
        "cpus": os.cpu_count(),
        "cpu_sets": [cpus.spec for cpus in cpu_sets if cpus is not None] or None,
        "python": platform.python_version(),
        "interrupted": interrupted,
        "seconds": round(time.monotonic() - began, 1),
    }
    table = report.table(results)
    details = report.details(results)
    if details:
        table += "\n" + details
    results_path = run_dir / "results.jsonl"
    report.write_jsonl(results, results_path, meta)
    (run_dir / "table.md").write_text(table + "\n")
    chart = (
        _chart(results_path, run_dir / "chart.png", run_dir / "rss.png")
        if results
        else "no chart: no results"
    )
    latest = servers.RESULTS / "latest"
    if results and (latest.is_symlink() or not latest.exists()):
        latest.unlink(missing_ok=True)
        latest.symlink_to(stamp)
    print(table)
    log(f"{len(results)} rows in {meta['seconds']} s; {results_path}; {chart}")
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
