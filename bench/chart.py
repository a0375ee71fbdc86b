"""The PNG charts: p99 latency against throughput, one line per server (``chart.png``), and
the overload scenarios' RSS over time (``rss.png``).

``python -m bench.chart RESULTS.jsonl CHART.png [RSS.png]`` needs only matplotlib (it imports
nothing else from the project), so it can run in the small ``bench/.venvs/chart`` venv when the
benchmark's own interpreter lacks matplotlib.
"""

from __future__ import annotations

import json
import sys
from itertools import pairwise
from pathlib import Path
from typing import Any

#: One panel per family of scenarios; each line joins a server's points in concurrency order.
PANELS = [
    ("dense-n1-raw", "dense, 1 row, raw"),
    ("dense-n1-typed", "dense, 1 row, typed"),
    ("dense-n64-raw", "dense, 64 rows, raw"),
    ("dense-n64-typed", "dense, 64 rows, typed"),
    ("live", "ServerLive (transport ceiling)"),
    ("sleep10", "sleep 10 ms, C=25"),
]


def _family(scenario: str) -> str:
    return scenario.rsplit("-c", 1)[0]


def _series(row: dict[str, Any]) -> str:
    """A row's line: its server, and the CPUs it was pinned to (``--cpus``) if it was."""
    cpus = row.get("cpus")
    return row["server"] if cpus is None else f"{row['server']} on CPUs {cpus}"


def render(results_path: Path, chart_path: Path) -> None:
    """Draw the chart of a results file's load scenarios."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    rows: list[dict[str, Any]] = [
        json.loads(line) for line in results_path.read_text().splitlines() if line.strip()
    ]
    points = [
        row
        for row in rows
        if row.get("type") == "result" and row.get("throughput") and row.get("p99_ms")
    ]
    servers = sorted(
        {_series(row) for row in points},
        key=lambda s: (s.partition(" on CPUs ")[0] != "trio-infer", s),
    )
    colors = {server: f"C{index}" for index, server in enumerate(servers)}
    figure, axes = plt.subplots(2, 3, figsize=(15, 9), squeeze=False)
    for axis, (family, title) in zip(axes.flat, PANELS, strict=True):
        for server in servers:
            mine = sorted(
                (
                    row
                    for row in points
                    if _series(row) == server and _family(row["scenario"]) == family
                ),
                key=lambda row: row["concurrency"],
            )
            if not mine:
                continue
            xs = [row["throughput"] for row in mine]
            ys = [row["p99_ms"] for row in mine]
            axis.plot(xs, ys, "o-", color=colors[server], label=server)
            for row, x, y in zip(mine, xs, ys, strict=True):
                axis.annotate(
                    f"C={row['concurrency']}",
                    (x, y),
                    fontsize=7,
                    textcoords="offset points",
                    xytext=(4, 4),
                )
        axis.set_title(title)
        axis.set_xscale("log")
        axis.set_yscale("log")
        for scale in (axis.xaxis, axis.yaxis):
            scale.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
            scale.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
            scale.set_minor_formatter(NullFormatter())
        axis.set_xlabel("throughput, req/s")
        axis.set_ylabel("p99 latency, ms")
        axis.grid(True, which="both", alpha=0.3)
        if axis.lines:
            axis.legend(fontsize=8)
        else:
            axis.text(0.5, 0.5, "not measured", ha="center", transform=axis.transAxes)
    figure.suptitle("p99 latency against throughput (closed loop, 127.0.0.1)")
    figure.tight_layout()
    figure.savefig(chart_path, dpi=100)
    plt.close(figure)


def render_rss(results_path: Path, chart_path: Path) -> bool:
    """Draw RSS over time of each overload row, one panel each; False when there is none."""
    rows = [
        row
        for row in (json.loads(line) for line in results_path.read_text().splitlines() if line)
        if row.get("type") == "result"
        and row.get("kind") == "overload"
        and (row.get("extra") or {}).get("rss_t")
    ]
    if not rows:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(
        1, len(rows), figsize=(6 * len(rows), 4.5), squeeze=False, sharey=True
    )
    for axis, row in zip(axes.flat, rows, strict=True):
        extra = row["extra"]
        times = extra["rss_t"]
        server = extra["rss_server_mib"]
        total = [s + w for s, w in zip(server, extra["rss_workers_mib"], strict=True)]
        axis.plot(times, server, color="C0", label="server process")
        axis.plot(times, extra["rss_workers_mib"], color="C1", label="workers (sum)")
        axis.plot(times, total, color="C2", linestyle=":", label="server + workers")
        axis.axhline(extra["budget_mib"], color="C3", linestyle="--", label="memory budget")
        axis.axhline(
            extra["rss_idle_mib"] + extra["budget_mib"],
            color="C3",
            linestyle=":",
            label="idle server + budget",
        )
        axis.axvspan(0, extra["window_s"], color="0.9", zorder=0)
        errors = row.get("errors") or {}
        axis.set_title(
            f"{_series(row)} {row['scenario']}: C={row['concurrency']}, "
            f"{row['throughput'] or 0:.0f} OK/s, p99 {row['p99_ms'] or 0:.0f} ms, "
            f"RESOURCE_EXHAUSTED {errors.get('RESOURCE_EXHAUSTED', 0)}",
            fontsize=9,
        )
        axis.set_xlabel("seconds from the start of the measured window (shaded)")
        axis.set_ylabel("RSS, MiB")
        axis.set_ylim(bottom=0)
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize=7, loc="lower right")
    figure.suptitle(
        f"RSS every {_interval(rows[0]):g} s under a memory budget "
        f"({rows[0]['extra']['budget_mib']:g} MiB), {rows[0]['extra']['message_bytes']:,} B "
        "requests"
    )
    figure.tight_layout()
    figure.savefig(chart_path, dpi=100)
    plt.close(figure)
    return True


def _interval(row: dict[str, Any]) -> float:
    """The sampling interval of an overload row (the median step between samples)."""
    times = row["extra"]["rss_t"]
    steps = sorted(b - a for a, b in pairwise(times))
    return round(steps[len(steps) // 2], 2) if steps else 0.0


if __name__ == "__main__":
    render(Path(sys.argv[1]), Path(sys.argv[2]))
    if len(sys.argv) > 3:
        render_rss(Path(sys.argv[1]), Path(sys.argv[3]))
