"""The repository options of ``trio-infer serve`` refused at start, each in one line with exit
status 2, by the real command in a subprocess (``tests.test_cli.run``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.test_cli import run
from trio_infer.cli import restriction


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    folder = tmp_path / "repository" / "alpha"
    folder.mkdir(parents=True)
    (folder / "model-settings.json").write_text(
        json.dumps({"implementation": "trio_infer.examples.add_sub.AddSub"})
    )
    return tmp_path / "repository"


def _serve(repository: Path, *options: str) -> tuple[int, str, list[str]]:
    done = run("serve", str(repository), "--grpc-port", "0", "--http-port", "0", *options)
    return done.returncode, done.stdout, done.stderr.splitlines()


@pytest.mark.parametrize(
    "mode", [[], ["--model-control-mode", "none"], ["--model-control-mode", "poll"]]
)
def test_load_model_without_explicit_mode_exits_2_in_one_line(
    repository: Path, mode: list[str]
) -> None:
    status, stdout, lines = _serve(repository, *mode, "--load-model", "alpha")
    assert (status, stdout, len(lines)) == (2, "", 1)
    assert lines[0].endswith("--load-model needs --model-control-mode explicit")


def test_load_model_naming_a_missing_model_exits_2_in_one_line(repository: Path) -> None:
    status, stdout, lines = _serve(
        repository, "--model-control-mode", "explicit", "--load-model", "nope"
    )
    assert (status, stdout, len(lines)) == (2, "", 1)
    assert "--load-model 'nope': no folder of the repository declares that model" in lines[0]


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("admin-key=s3cret", "expected model-repository:HEADER=VALUE, got 'admin-key=s3cret'"),
        ("model-repository:admin-key", "expected model-repository:HEADER=VALUE"),
        ("model-repository:=s3cret", "expected model-repository:HEADER=VALUE"),
        ("inference:admin-key=s3cret", "only the model-repository group can be restricted"),
        # Triton's groups for the configuration and statistics extensions: served to anyone.
        ("model-config:admin-key=s3cret", "only the model-repository group can be restricted"),
        ("statistics:admin-key=s3cret", "only the model-repository group can be restricted"),
    ],
)
def test_a_bad_restricted_protocol_exits_2_in_one_line(
    repository: Path, value: str, problem: str
) -> None:
    for option in ("--grpc-restricted-protocol", "--http-restricted-api"):
        status, stdout, lines = _serve(repository, option, value)
        assert (status, stdout, len(lines)) == (2, "", 1), lines
        assert problem in lines[0]


def test_both_restriction_options_with_different_keys_exit_2_without_repeating_them(
    repository: Path,
) -> None:
    # Triton takes one per protocol; here they are one setting, which one of them would
    # otherwise silently set for both.
    status, stdout, lines = _serve(
        repository,
        "--grpc-restricted-protocol",
        "model-repository:admin-key=grpc-s3cret",
        "--http-restricted-api",
        "model-repository:admin-key=rest-s3cret",
    )
    assert (status, stdout, len(lines)) == (2, "", 1), lines
    assert "one setting for gRPC and REST alike" in lines[0]
    assert "s3cret" not in lines[0]


def test_the_restriction_given_once_or_the_same_to_both_options_is_the_one_served() -> None:
    key = ("admin-key", "s3cret")
    assert restriction([]) is None
    assert restriction([key]) == key
    assert restriction([key, key]) == key
    with pytest.raises(ValueError, match="one setting"):
        restriction([key, ("admin-key", "other")])
    with pytest.raises(ValueError, match="one setting"):
        restriction([key, ("other-key", "s3cret")])
