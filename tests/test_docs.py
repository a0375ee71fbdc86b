"""What README.md and docs/ tell users, held to what the code does: the options the
Configuration table lists and their defaults, every option the prose names, the Metrics
table's series, types and labels on a real server's ``/metrics``, and README's client examples
run as written against a real server."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from tests.support import start_server
from trio_infer.cli import _parser

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
#: The documents whose prose names server options (docs/performance.md names the bench's).
PROSE = [README, *((ROOT / "docs" / name).read_text() for name in ("architecture.md", "deploy.md"))]
#: Options of the other commands these documents show (podman, pip, pytest, the bench,
#: CPython's configure).
OTHER_PROGRAMS_OPTIONS = {
    "--build-arg",
    "--check",
    "--enable-optimizations",
    "--no-deps",
    "--quick",
    "--rm",
    "--rounds",
    "--with-lto",
}
#: A memory budget that a request of its size overflows (it reserves three times its size).
BUDGET = 4096
OPTION = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def section_table(text: str, heading: str) -> list[list[str]]:
    """The cells of each body row of the first table under ``heading`` (a ``#`` line)."""
    section = text.split(f"\n{heading}\n", 1)[1]
    rows: list[list[str]] = []
    for line in section.splitlines():
        if line.startswith("|"):
            cells = re.split(r"(?<!\\)\|", line.strip()[1:-1])  # not at an escaped \|
            rows.append([cell.strip() for cell in cells])
        elif rows:
            break
    return rows[2:]  # past the header and its rule


def serve_help(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> str:
    """What ``trio-infer serve --help`` prints, on a terminal wide enough that no option's name
    is broken across lines."""
    monkeypatch.setenv("COLUMNS", "1000")
    with pytest.raises(SystemExit) as exited:
        _parser().parse_args(["serve", "--help"])
    assert exited.value.code == 0
    return capsys.readouterr().out


def test_the_configuration_table_lists_every_option_of_serve_and_no_other(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    rows = section_table(README, "## Configuration")
    listed = {option for row in rows for option in OPTION.findall(row[0])}
    served = set(OPTION.findall(serve_help(capsys, monkeypatch))) - {"--help"}
    assert listed == served


def test_the_configuration_tables_literal_defaults_are_the_parsers() -> None:
    defaults = vars(_parser().parse_args(["serve"]))
    checked = 0
    for option_cell, default_cell, _ in section_table(README, "## Configuration"):
        options = OPTION.findall(option_cell)
        dest = options[0][2:].replace("-", "_") if len(options) == 1 else None
        if dest not in defaults:
            continue
        default = defaults[dest]
        if default_cell == "none":
            assert default in (None, []), options
        elif default_cell == "off":
            assert default is False, options
        elif literal := re.fullmatch(r"`([^`]+)`", default_cell):
            text = literal[1]
            if isinstance(default, bool):
                assert text == str(default).lower(), options
            elif isinstance(default, int | float):
                assert float(text) == default, options
            else:
                assert text == default, options
        else:
            continue  # prose: "the CPU count", "64 MiB", "a quarter of the budget"
        checked += 1
    assert checked >= 20


def test_every_option_the_documents_name_is_an_option_of_the_command(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    served = set(OPTION.findall(serve_help(capsys, monkeypatch))) | {"--version"}
    named = {option for text in PROSE for option in OPTION.findall(text)}
    assert named - served - OTHER_PROGRAMS_OPTIONS == set()


async def test_the_metrics_table_names_every_series_with_its_type_and_labels(
    nursery: trio.Nursery,
) -> None:
    server = await start_server(nursery, memory_budget=BUDGET)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.http_port}") as rest:
        # One refusal by a bound, so that the refusals' series has a sample to show its labels.
        refused = await rest.post("/v2/models/echo/infer", content=b" " * BUDGET)
        scraped = await rest.get("/metrics")
    assert refused.status_code == 413
    families = {family.name: family for family in text_string_to_metric_families(scraped.text)}
    documented: dict[str, tuple[str, set[str]]] = {}
    for name, kind, labels, *_ in section_table(README, "## Metrics"):
        # prometheus_client names a counter's family without its _total.
        family = name.strip("`").removesuffix("_total")
        documented[family] = (kind, {label for label in labels.split(", ") if label})
    assert documented.keys() == families.keys()
    for name, (kind, labels) in documented.items():
        family = families[name]
        assert family.type == kind, name
        assert family.samples, name
        for sample in family.samples:
            assert sample.labels.keys() - {"le"} == labels, name


def python_examples() -> dict[str, str]:
    """README's Python examples by their first line that is not an import or blank."""
    blocks = re.findall(r"```python\n(.*?)```", README, re.S)
    return {
        next(
            line for line in block.splitlines() if line and not line.startswith(("import", "from"))
        ): block
        for block in blocks
    }


async def test_the_readmes_client_examples_run_as_written(
    nursery: trio.Nursery, capsys: pytest.CaptureFixture[str]
) -> None:
    server = await start_server(nursery, workers=1)
    assert server.http_port is not None
    examples = python_examples()
    (bundled,) = (code for first, code in examples.items() if first.startswith("async def main"))
    (stream,) = (code for first, code in examples.items() if first.startswith("# Inside main()"))
    (triton,) = (code for code in examples.values() if "import tritonclient.grpc" in code)
    # The stream example goes inside main(), after the print of its last call's result.
    lines = bundled.splitlines()
    at = next(n for n, line in enumerate(lines) if line.lstrip().startswith("print(result"))
    indent = lines[at][: len(lines[at]) - len(lines[at].lstrip())]
    inside = [f"{indent}{line}" if line else line for line in stream.splitlines()]
    bundled = "\n".join([*lines[: at + 1], *inside, *lines[at + 1 :]])
    # tritonclient.http "is the same with import tritonclient.http as triton and port 8080".
    rest = triton.replace("tritonclient.grpc", "tritonclient.http").replace("8081", "8080")
    for code in (bundled, triton, rest):
        code = code.replace("8081", str(server.port)).replace("8080", str(server.http_port))
        await trio.to_thread.run_sync(exec, code, {})
    printed = capsys.readouterr().out
    twos = "[[2. 2. 2. 2. 2. 2. 2. 2. 2. 2. 2. 2. 2. 2. 2. 2.]]"
    head = ["True True", "True trio-infer", "['INPUT0', 'INPUT1']", twos]
    assert printed.splitlines()[:4] == head
    assert printed.endswith(f"{twos}\n{twos}\n")  # tritonclient.grpc's, then .http's
    # A stream's answer is its id and OUTPUT0, INPUT0 (x * id) + INPUT1 (x), numpy's lines
    # broken where it breaks them.
    answers = re.findall(r"^(\d+) \[\[([^]]*)\]\]$", printed, re.M)
    assert sorted(int(i) for i, _ in answers) == list(range(100))
    for i, values in answers:
        assert values.split() == [f"{int(i) + 1}."] * 16
