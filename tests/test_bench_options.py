"""The benchmark tools' options (``--cpus``, ``bench.instructions``): refused precisely when a
careless hand types them wrong, before any server starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.instructions import select
from bench.servers import parse_cpu_sets

ROOT = Path(__file__).resolve().parent.parent


def test_sets_are_read_as_taskset_reads_them_in_the_order_given() -> None:
    sets = parse_cpu_sets("0/0-3/0,2/0-7:2", available=range(8))
    assert [s.spec for s in sets] == ["0", "0-3", "0,2", "0-7:2"]
    assert [sorted(s.cpus) for s in sets] == [[0], [0, 1, 2, 3], [0, 2], [0, 2, 4, 6]]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "an empty CPU set"),
        ("0/", "an empty CPU set"),
        ("abc", "'abc' is not a CPU list as `taskset -c` takes one"),
        ("1-0", "'1-0' is not a CPU list"),
        ("0-1:0", "'0-1:0' is not a CPU list"),
        ("-1", "'-1' is not a CPU list"),
        ("7", "'7' names CPU 7, which this machine lacks (the benchmark may use CPUs 0-1)"),
        ("0/0", "'0' is the same set as '0'"),
        ("0-1/1,0", "'1,0' is the same set as '0-1'"),
    ],
)
def test_a_bad_set_is_refused_naming_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=r"^--cpus: ") as refused:
        parse_cpu_sets(text, available=[0, 1])
    assert message in str(refused.value)


def test_the_command_refuses_a_bad_set_with_exit_2_before_starting_any_server() -> None:
    lacking = max(os.sched_getaffinity(0)) + 1
    done = subprocess.run(
        [sys.executable, "-m", "bench", "--servers", "trio-infer", "--cpus", f"0/{lacking}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert f"names CPU {lacking}, which this machine lacks" in done.stderr
    assert "ready on" not in done.stderr


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--scenarios", "nope"], "unknown scenario 'nope'; known: live, dense-n1"),
        (["--calls", "0"], "--calls, --warmup and --in-flight must be at least 1"),
        (["--warmup", "-1"], "--calls, --warmup and --in-flight must be at least 1"),
        (["--in-flight", "0"], "--calls, --warmup and --in-flight must be at least 1"),
        (["--in-flight", "x"], "argument --in-flight: invalid int value: 'x'"),
        (["--calls", "30", "--in-flight", "25"], "--calls (30) must be a multiple of --in-flight"),
    ],
)
def test_the_instruction_count_refuses_bad_options_with_exit_2(
    arguments: list[str], message: str
) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.instructions", *arguments],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert message in done.stderr + done.stdout


def test_the_instruction_count_says_valgrind_is_missing() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.instructions", "--calls", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PATH": ""},
    )
    assert done.returncode == 2
    assert "valgrind" in done.stderr + done.stdout


def test_a_scenario_named_whole_is_that_scenario_alone_and_a_prefix_names_its_family() -> None:
    assert select("rest-dense-n1") == ["rest-dense-n1"]
    assert select("rest-dense-n1-binary,rest-live") == ["rest-live", "rest-dense-n1-binary"]
    assert select("rest") == [
        "rest-live",
        "rest-dense-n1",
        "rest-dense-n1-binary",
        "rest-dense-n64-binary",
    ]
    assert select("dense") == ["dense-n1", "dense-n64"]
    assert select("stream-add_sub,add_sub") == ["add_sub", "stream-add_sub"]
