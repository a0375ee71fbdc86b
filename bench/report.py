"""The results as one markdown table and as JSON lines."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.scenarios import Result

BASELINE = "trio-infer"


def _number(value: float | None, digits: int = 1) -> str:
    if value is None or math.isnan(value):
        return "-"
    return f"{value:,.{digits}f}"


def _ratio(result: Result, baseline: Result | None) -> str:
    if (
        baseline is None
        or result.server == BASELINE
        or not result.throughput
        or not baseline.throughput
    ):
        return "-"
    return f"{result.throughput / baseline.throughput:.2f}"


def _errors(errors: dict[str, int]) -> str:
    return ", ".join(f"{status} {count}" for status, count in errors.items()) or "0"


def _notes(result: Result) -> str:
    parts = [result.notes] if result.notes else []
    if "cpu_server_us_per_call" in result.extra:
        descendants = result.extra.get("cpu_processes", 1) - 1
        parts.insert(
            0,
            f"cpu µs/call: server process {_cpu(result, 'cpu_server_us_per_call')}"
            f"{_cores(result)} + {descendants} descendants "
            f"{_cpu(result, 'cpu_workers_us_per_call')}",
        )
    if result.check and result.check != "ok":
        parts.insert(0, f"CHECK: {result.check}")
    return "; ".join(parts).replace("|", "/")


def _cpu(result: Result, key: str) -> str:
    """A CPU-per-call figure of a load row's ``extra`` (``-`` where none was measured)."""
    return _number(result.extra.get(key), 0)


def _cores(result: Result) -> str:
    """The cores the server process kept busy, `` (0.88 of a core)``; empty where none were
    measured (rows of runs before the figure)."""
    cores = result.extra.get("cpu_server_cores")
    return "" if cores is None else f" ({cores:.2f} of a core)"


def _cpu_sets(results: Sequence[Result]) -> list[str | None]:
    """The CPU sets of the rows (``--cpus``), in the order first met; ``[None]`` unpinned."""
    return list(dict.fromkeys(r.cpus for r in results)) or [None]


def table(results: Sequence[Result]) -> str:
    """The markdown table: one row per server and scenario, grouped by scenario (and within it
    by CPU set, with a ``cpus`` column after the scenario's, when ``--cpus`` pinned the servers).

    The ratio is the server's throughput over trio-infer's in the same scenario and CPU set.
    ``cpu µs/call`` is the server's CPU (with its workers) per successful call, ``client
    µs/call`` the benchmark's own (:class:`bench.scenarios.CpuWindow`); the notes split the
    server's.
    """
    baselines = {(r.scenario, r.cpus): r for r in results if r.server == BASELINE}
    order: dict[str, int] = {}
    for result in results:
        order.setdefault(result.scenario, len(order))
    sets = _cpu_sets(results)
    rows = sorted(
        results, key=lambda r: (order[r.scenario], sets.index(r.cpus), r.server != BASELINE)
    )
    pinned = sets != [None]
    lines = [
        "| server | scenario | " + ("cpus | " if pinned else "") + "req/s | p50 ms | p99 ms "
        "| cpu µs/call | client µs/call | errors | x trio-infer | notes |",
        "| --- | --- | " + ("--- | " if pinned else "") + "---: | ---: | ---: | ---: | ---: "
        "| --- | ---: | --- |",
    ]
    for r in rows:
        cpus = f"{r.cpus or '-'} | " if pinned else ""
        lines.append(
            f"| {r.server} | {r.scenario} | {cpus}{_number(r.throughput, 0)} "
            f"| {_number(r.p50_ms, 2)} | {_number(r.p99_ms, 2)} | {_cpu(r, 'cpu_us_per_call')} "
            f"| {_cpu(r, 'client_cpu_us_per_call')} | {_errors(r.errors)} | "
            f"{_ratio(r, baselines.get((r.scenario, r.cpus)))} | {_notes(r)} |"
        )
    return "\n".join(lines)


def _per_second(times: Sequence[float], values: Sequence[float]) -> str:
    """The largest value in each whole second, ``t=<second>: <value>``."""
    peaks: dict[int, float] = {}
    for at, value in zip(times, values, strict=True):
        second = math.floor(at)
        peaks[second] = max(peaks.get(second, value), value)
    return " ".join(f"{second:+d}s:{value:.0f}" for second, value in sorted(peaks.items()))


def _overload_section(rows: Sequence[Result]) -> list[str]:
    first = rows[0].extra
    lines = [
        "",
        f"### Overload: `echo`, {first['message_bytes']:,} B messages, "
        f"`--memory-budget` {first['budget_mib']:g} MiB ({first['fit']} requests fit)",
        "",
        "| server | scenario | clients (measured + others) | deadline s | OK req/s "
        "| measured OK p50 / p99 ms | others' OK p50 / p99 ms "
        "| measured OK p50 / p99 from 1st attempt ms | calls "
        "| RESOURCE_EXHAUSTED | other errors "
        "| CPU cores measured / others / server / workers (machine) "
        "| server RSS idle / max / peak MiB "
        "| workers idle / max MiB | worker pids seen | max RSS - budget MiB |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: "
        "| ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        e = r.extra
        others = {status: n for status, n in r.errors.items() if status != "RESOURCE_EXHAUSTED"}
        cpu = e.get("cpu_cores")
        cores = (
            f"{cpu['client']:.2f} / {cpu['others']:.2f} / {cpu['server']:.2f} / "
            f"{cpu['workers']:.2f} ({cpu['machine']:.2f} of {cpu['cores']:g})"
            if cpu
            else "-"
        )
        theirs = (
            f"{_number(e.get('others_p50_ms'), 0)} / {_number(e.get('others_p99_ms'), 0)}"
            if e["others"]
            else "-"
        )
        lines.append(
            f"| {r.server} | {r.scenario} | {e['measured']} + "
            f"{e['others']} | {e['deadline_s']:g} | {_number(r.throughput)} "
            f"| {_number(r.p50_ms, 0)} / {_number(r.p99_ms, 0)} | {theirs} "
            f"| {_number(e.get('ok_first_p50_ms'), 0)} / {_number(e.get('ok_first_p99_ms'), 0)} "
            f"| {r.requests} "
            f"| {e['rejected']} ({e['rejected_share']:.0%}) | {_errors(others)} | {cores} "
            f"| {e['rss_idle_mib']:g} / {e['rss_max_mib']:g} / {e['rss_hwm_mib']:g} "
            f"| {e['workers_idle_mib']:g} / {e['workers_max_mib']:g} | {e['workers_seen']} "
            f"| {e['overhead_mib']:+g} |"
        )
    # The baselines: rows whose calls all succeeded (no overload to refuse).
    p99 = {r.scenario: r.p99_ms for r in rows if r.p99_ms is not None and math.isfinite(r.p99_ms)}
    bases = [
        r.scenario for r in rows if not r.errors and r.extra["measured_ok"] and r.scenario in p99
    ]
    compared = [name for name in p99 if name not in bases]
    if bases and compared:
        lines.append("")
        lines.append(
            "Measured clients' OK p99 against the rows that refused nothing, "
            + " / ".join(f"{base} ({p99[base]:.0f} ms)" for base in bases)
            + ": "
            + "; ".join(
                f"{name} " + " / ".join(f"{p99[name] / p99[base]:.2f}x" for base in bases)
                for name in compared
            )
            + "."
        )
    lines.append("")
    lines.append(
        "Fixed overhead, the server's peak RSS minus the budget: "
        + "; ".join(
            f"{r.scenario} {r.extra['overhead_mib']:+g} MiB "
            f"({r.extra['overhead_mib'] - r.extra['rss_idle_mib']:+.1f} MiB beyond its idle "
            f"{r.extra['rss_idle_mib']:g} MiB)"
            for r in rows
        )
        + "; with the workers' RSS added: "
        + "; ".join(f"{r.scenario} {r.extra['overhead_total_mib']:+g} MiB" for r in rows)
        + "."
    )
    lines.append("")
    lines.append("Server RSS over time, largest sample per second in MiB (0 s: window start):")
    lines.append("")
    lines += [
        f"- {r.server} {r.scenario}: {_per_second(r.extra['rss_t'], r.extra['rss_server_mib'])}"
        for r in rows
    ]
    return lines


def _batching_section(rows: Sequence[Result]) -> list[str]:
    lines = [
        "",
        "### Batching: `dense`, 1 row, raw; `max_batch_size` 0 (off) or the example's (on)",
        "",
        "| server | C | batching | req/s | p50 ms | p99 ms | mean batch | largest "
        "| req/s on / off | p99 on / off |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    off = {(r.server, r.concurrency): r for r in rows if not r.extra["batching"]}
    for r in sorted(rows, key=lambda r: (r.server, r.concurrency, r.extra["batching"])):
        e = r.extra
        base = off.get((r.server, r.concurrency))
        gain = p99_ratio = "-"
        if e["batching"] and base is not None:
            if r.throughput and base.throughput:
                gain = f"{r.throughput / base.throughput:.2f}"
            if r.p99_ms and base.p99_ms:
                p99_ratio = f"{r.p99_ms / base.p99_ms:.2f}"
        mode = f"on ({e['max_batch_size']})" if e["batching"] else "off"
        mean = "-" if e["mean_batch"] is None else f"{e['mean_batch']:.2f}"
        lines.append(
            f"| {r.server} | {r.concurrency} | {mode} | {_number(r.throughput, 0)} "
            f"| {_number(r.p50_ms, 2)} | {_number(r.p99_ms, 2)} | {mean} "
            f"| {e['max_batch'] or '-'} | {gain} | {p99_ratio} |"
        )
    logged = [r for r in rows if r.extra.get("server_log")]
    lines.append("")
    lines.append(
        "Mean batch: requests per model call in the measured window, counted by the model "
        "(bench/batch_probe.py). "
        + (
            "Server log: "
            + "; ".join(
                f"{r.scenario} {r.extra['server_log']['mean_requests']:.2f}" for r in logged
            )
            if logged
            else "The server logs no batching totals."
        )
    )
    return lines


def _attacker_summary(seen: dict[str, Any]) -> str:
    """The attacker's counts, short: connections, how they ended, its calls' ends (top 3)."""
    if "failed" in seen:
        return str(seen["failed"])

    def top(counts: dict[str, int]) -> str:
        return ", ".join(f"{k} {n:,}" for k, n in list(counts.items())[:3])

    parts = [f"{seen.get('connections', 0):,} conns"]
    if seen.get("ended"):
        parts.append(top(seen["ended"]))
    if seen.get("calls"):
        parts.append(top(seen["calls"]))
    if seen.get("blocked"):
        parts.append(f"writes blocked {seen['blocked']}")
    parts.append(f"{seen.get('sent_bytes', 0) / 2**20:,.0f} MiB written")
    return "; ".join(parts)


def _hostile_section(rows: Sequence[Result]) -> list[str]:
    first = rows[0].extra
    lines = [
        "",
        f"### Hostile clients: a bystander (`dense` 1 row, raw, C={rows[0].concurrency}, "
        f"deadline {first['deadline_s']:g} s) alone, then beside each attack; "
        f"`--memory-budget` {first['budget_mib']:g} MiB",
        "",
        "| server | attack | alone req/s | alone p50 / p99 ms | attacked req/s "
        "| attacked p50 / p99 ms | errors (alone; attacked) | req/s x | p99 x "
        "| server RSS idle / peak MiB | peak - budget MiB | workers max MiB "
        "| server CPU cores alone / attacked | attacker CPU cores | outcome | attacker saw |",
        "| --- | --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: "
        "| ---: | ---: | --- | --- |",
    ]
    for r in rows:
        e = r.extra
        alone_cpu, attack_cpu = e.get("cpu_alone"), e.get("cpu_attack")
        cores = (
            f"{alone_cpu['server']:.2f} / {attack_cpu['server']:.2f}"
            if alone_cpu and attack_cpu
            else "-"
        )
        outcome = e["outcome"] + ("" if e["server_alive"] else " (SERVER DIED)")
        lines.append(
            f"| {r.server} | {e['attack']} | {_number(e['alone_throughput'], 0)} "
            f"| {_number(e['alone_p50_ms'], 2)} / {_number(e['alone_p99_ms'], 2)} "
            f"| {_number(r.throughput, 0)} | {_number(r.p50_ms, 2)} / {_number(r.p99_ms, 2)} "
            f"| {_errors(e['alone_errors'])}; {_errors(r.errors)} "
            f"| {_number(e['throughput_ratio'], 2)} | {_number(e['p99_ratio'], 2)} "
            f"| {e['rss_idle_mib']:g} / {e['rss_peak_mib']:g} | {e['over_budget_mib']:+g} "
            f"| {e['workers_attack_max_mib']:g} | {cores} "
            f"| {_number(attack_cpu['others'], 2) if attack_cpu else '-'} | {outcome} "
            f"| {_attacker_summary(e['attacker']).replace('|', '/')} |"
        )
    lines.append("")
    lines.append(
        "Alone: the bystander's window right before the attack, on the same server (started "
        "afresh for each attack). Attacked: the same window length beside the attack, after "
        f"{first['ramp_s']:g} s of it. Peak: the server process's largest RSS sample (every "
        "50 ms) or its VmHWM, whichever is larger; workers: the largest sum of their RSS "
        "samples. CPU: cores used over the window (the attacker runs at nice 19). "
        "Outcome: what most of the attacker's calls or connections ended with "
        "(`blocked`: the server stopped reading it; `held`: nothing ended its connections)."
    )
    late = [r for r in rows if r.extra.get("after") not in (None, "ok")]
    if late:
        lines.append("")
        lines.append(
            "A call right after the attack stopped: "
            + "; ".join(f"{r.extra['attack']}: {r.extra['after']}" for r in late)
            + "."
        )
    return lines


def _repository_section(rows: Sequence[Result]) -> list[str]:
    """Per server: ``dense`` quiet and churned side by side (with each round), the ratios
    churned / quiet, and the churn's operations: how many, how long, which failed."""
    churned = [r for r in rows if r.extra["condition"] == "churn"]
    first = (churned or rows)[0].extra
    lines = [
        "",
        f"### Repository: `dense` 1 row, raw, C={rows[0].concurrency}, quiet and beside the "
        f"churn of `{first['churn_model']}` (cycles of unload and load, and once every "
        f"{first['reload_every']} cycles a reload with `config` "
        f"`{json.dumps(first['churn_config'])}`), {first['window_s']:g} s windows",
        "",
        "| server | condition | req/s | p50 ms | p99 ms | errors | req/s per round "
        "| p99 ms per round | req/s x | p50 x | p99 x |",
        "| --- | --- | ---: | ---: | ---: | --- | --- | --- | ---: | ---: | ---: |",
    ]
    quiet = {r.server: r for r in rows if r.extra["condition"] == "quiet"}
    for r in sorted(rows, key=lambda r: (r.server, r.extra["condition"] == "churn")):
        base = quiet.get(r.server) if r.extra["condition"] == "churn" else None
        ratios = [
            _number(getattr(r, name) / getattr(base, name), 2)
            if base is not None and getattr(r, name) and getattr(base, name)
            else "-"
            for name in ("throughput", "p50_ms", "p99_ms")
        ]
        rounds = r.extra.get("rounds") or [
            {"throughput": r.throughput, "p50_ms": r.p50_ms, "p99_ms": r.p99_ms}
        ]
        lines.append(
            f"| {r.server} | {r.extra['condition']} | {_number(r.throughput, 0)} "
            f"| {_number(r.p50_ms, 2)} | {_number(r.p99_ms, 2)} | {_errors(r.errors)} "
            f"| {' / '.join(_number(x['throughput'], 0) for x in rounds)} "
            f"| {' / '.join(_number(x['p99_ms'], 2) for x in rounds)} | {' | '.join(ratios)} |"
        )
    for r in churned:
        lines += [
            "",
            f"{r.server}: operations on `{r.extra['churn_model']}` that ended in the windows",
            "",
            "| operation | per window | p50 ms | p99 ms | failed |",
            "| --- | --- | ---: | ---: | --- |",
        ]
        for op, t in r.extra["operations"].items():
            lines.append(
                f"| {op} | {' / '.join(str(n) for n in t['per_round'])} "
                f"| {_number(t['p50_ms'], 1)} | {_number(t['p99_ms'], 1)} "
                f"| {_errors(t['errors'])} |"
            )
        if r.extra["failed"]:
            lines += ["", f"Repository calls that failed ({r.extra['failed']}, first 20):", ""]
            lines += [f"- {failure}" for failure in r.extra["failures"]]
    lines += [
        "",
        "Rows: the median of the rounds; the two conditions alternate (quiet first in even "
        "rounds) on one server started for them. x: churned / quiet. An operation's latency is "
        "the RepositoryModelLoad or RepositoryModelUnload call's, one at a time on a channel of "
        "its own.",
    ]
    return lines


def details(results: Sequence[Result]) -> str:
    """The overload, batching, hostile and repository sections (empty when none ran); with
    ``--cpus``, once per CPU set, under a heading naming it."""
    sets = _cpu_sets(results)
    if sets == [None]:
        return _details(results)
    parts = []
    for cpus in sets:
        section = _details([r for r in results if r.cpus == cpus])
        if section:
            parts.append(f"\n## Servers pinned to CPUs {cpus or '(none)'}\n{section}")
    return "\n".join(parts)


def _details(results: Sequence[Result]) -> str:
    """The sections of rows of one CPU set."""
    overload = [r for r in results if r.kind == "overload" and r.extra]
    batching = [r for r in results if r.kind == "batching" and r.extra]
    hostile = [r for r in results if r.kind == "hostile" and r.extra]
    repository = [r for r in results if r.kind == "repository" and r.extra]
    lines = (
        (_overload_section(overload) if overload else [])
        + (_batching_section(batching) if batching else [])
        + (_hostile_section(hostile) if hostile else [])
        + (_repository_section(repository) if repository else [])
    )
    return "\n".join(lines)


def _clean(value: Any) -> Any:
    """NaN is not JSON: write it as null."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {key: _clean(item) for key, item in value.items()}
    return value


def write_jsonl(results: Sequence[Result], path: Path, meta: dict[str, Any]) -> None:
    """One JSON object per line: first the run's settings (``"type": "run"``), then results."""
    with path.open("w") as out:
        out.write(json.dumps({"type": "run", **meta}) + "\n")
        for result in results:
            out.write(json.dumps(_clean({"type": "result", **asdict(result)})) + "\n")
