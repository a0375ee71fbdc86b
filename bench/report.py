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
    if result.check and result.check != "ok":
        parts.insert(0, f"CHECK: {result.check}")
    return "; ".join(parts).replace("|", "/")


def table(results: Sequence[Result]) -> str:
    """The markdown table: one row per server and scenario, grouped by scenario.

    The ratio is the server's throughput over trio-infer's in the same scenario.
    """
    baselines = {r.scenario: r for r in results if r.server == BASELINE}
    order: dict[str, int] = {}
    for result in results:
        order.setdefault(result.scenario, len(order))
    rows = sorted(results, key=lambda r: (order[r.scenario], r.server != BASELINE))
    lines = [
        "| server | scenario | req/s | p50 ms | p99 ms | errors | x trio-infer | notes |",
        "| --- | --- | ---: | ---: | ---: | --- | ---: | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r.server} | {r.scenario} | {_number(r.throughput, 0)} | {_number(r.p50_ms, 2)} "
            f"| {_number(r.p99_ms, 2)} | {_errors(r.errors)} | "
            f"{_ratio(r, baselines.get(r.scenario))} | {_notes(r)} |"
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
