"""The ``trio-infer`` command's options, end to end: ``--version``, ``--log-level``, ``--debug``.

The real command runs in a subprocess (``tests.test_shutdown.Server``: a session of its own, its
stderr read line by line); a worker is killed with a real ``kill -9``. Exit statuses after
signals are in ``tests/test_shutdown.py``.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from importlib.metadata import version
from pathlib import Path

import grpc
import pytest
import trustme

from tests.test_shutdown import (
    EXIT_SLACK,
    TIMEOUT,
    Server,
    v2_stub,
    wait_server_ready,
)
from trio_infer.cli import port_clash
from trio_infer.protobuf._proto import grpc_predict_v2_pb2 as pb

GRACE = 5.0
#: A log line: "<date> <time> <LEVEL> <logger>: <message>" (trio_infer.cli's format).
LINE = re.compile(r"^\S+ \S+ (?P<level>[A-Z]+) (?P<logger>[\w.]+): ")


def run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trio_infer", *argv],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Callable[..., Server]]:
    """Start ``trio-infer serve`` (the built-in examples, two workers) with extra options."""
    servers: list[Server] = []

    def start(*options: str) -> Server:
        argv = ["--host", "127.0.0.1", "--grpc-port", "0", "--http-port", "0", "--workers", "2"]
        argv += options
        argv += ["--grace-period", str(GRACE)]
        server = Server(argv, tmp_path)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.close()


def levels_and_loggers(stderr: str) -> list[tuple[str, str]]:
    """The level and logger of each log line (tracebacks' lines are not log lines)."""
    return [(m["level"], m["logger"]) for line in stderr.splitlines() if (m := LINE.match(line))]


def test_version_prints_the_name_and_version_and_exits_0() -> None:
    done = run("--version")
    assert (done.returncode, done.stdout, done.stderr) == (
        0,
        f"trio-infer {version('trio-infer')}\n",
        "",
    )


@pytest.mark.parametrize("value", ["LOUD", "warn", "10"])
def test_a_bad_log_level_exits_2_naming_the_option_and_the_choices(value: str) -> None:
    done = run("serve", "--log-level", value)
    assert done.returncode == 2
    assert done.stdout == ""
    assert (
        f"trio-infer serve: error: argument --log-level: invalid choice: '{value.upper()}' "
        "(choose from 'DEBUG', 'INFO', 'WARNING', 'ERROR')"
    ) in done.stderr


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--strict-readiness", "maybe"], "argument --strict-readiness: expected true or false"),
        (["--log-format", "xml"], "argument --log-format: invalid choice: 'xml'"),
        (["--http-port", "70000"], "--http-port must be between 0 and 65535"),
        (["--metrics-port", "-1"], "--metrics-port must be between 0 and 65535"),
        (
            ["--grpc-port", "18123", "--http-port", "18123"],
            "--grpc-port and --http-port are both 18123: each needs a port of its own",
        ),
        (
            ["--http-port", "18124", "--metrics-port", "18124"],
            "--http-port and --metrics-port are both 18124",
        ),
        (
            ["--no-http", "--grpc-port", "18125", "--metrics-port", "18125"],
            "--grpc-port and --metrics-port are both 18125",
        ),
        (["--repository-poll-secs", "0"], "--repository-poll-secs must be a number of seconds"),
        (["--repository-poll-secs", "nan"], "--repository-poll-secs must be a number of seconds"),
        (["--model-control-mode", "auto"], "argument --model-control-mode: invalid choice"),
        # No abbreviations: a misspelt option is not taken for another one.
        (["--repository", "x"], "unrecognized arguments: --repository"),
    ],
)
def test_a_bad_value_of_a_new_option_is_one_line_and_exit_2(argv: list[str], said: str) -> None:
    done = run("serve", "--grpc-port", "0", "--http-port", "0", *argv)
    assert done.returncode == 2
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert said in done.stderr


@pytest.mark.parametrize(
    ("ports", "clash"),
    [
        ((("--grpc-port", 0), ("--http-port", 0), ("--metrics-port", 0)), None),
        (
            (("--grpc-port", 8081), ("--http-port", None), ("--metrics-port", 8081)),
            "--grpc-port and --metrics-port are both 8081",
        ),
        (
            (("--grpc-port", 8081), ("--http-port", 8081), ("--metrics-port", None)),
            "--grpc-port and --http-port are both 8081",
        ),
        ((("--grpc-port", 8081), ("--http-port", None), ("--metrics-port", None)), None),
        ((("--grpc-port", 1), ("--http-port", 2), ("--metrics-port", 3)), None),
    ],
)
def test_only_two_fixed_ports_that_are_the_same_clash(
    ports: tuple[tuple[str, int | None], ...], clash: str | None
) -> None:
    found = port_clash(ports)
    assert found == (None if clash is None else f"{clash}: each needs a port of its own")


def free_port() -> int:
    # Without INFO lines the server does not say which port it got: it is given one.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


def test_log_level_warning_hides_info_and_shows_a_workers_death(
    serve: Callable[..., Server],
) -> None:
    port = free_port()
    server = serve("--log-level", "warning", "--grpc-port", str(port))  # any case
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = v2_stub(channel)
        wait_server_ready(stub)
    workers = server.workers()
    assert len(workers) == 2
    os.kill(workers[0], signal.SIGKILL)
    server.wait_for_line(
        rf"WARNING trio_infer\.workers\.pool: worker process {workers[0]} died \(killed by "
        r"signal SIGKILL\): 0 call\(s\) failed with it, 0 sent back to the queue"
    )
    signalled = server.send(signal.SIGTERM)
    server.wait_exit(signalled + GRACE + 1 + EXIT_SLACK)
    server.assert_clean_exit(0)
    lines = levels_and_loggers(server.stderr())
    assert lines == [
        ("WARNING", "trio_infer.workers.pool"),
        ("WARNING", "trio_infer"),  # SIGTERM: shutting down ...
    ], server.stderr()


def test_debug_logs_the_servers_debug_lines_but_no_librarys(
    serve: Callable[..., Server],
) -> None:
    server = serve("--debug").start()
    # Calls through HTTP/2 and HPACK: at DEBUG, h2 and hpack would log every header block.
    for _ in range(3):
        assert server.stub.ServerReady(pb.ServerReadyRequest(), timeout=TIMEOUT).ready
    signalled = server.send(signal.SIGTERM)
    server.wait_exit(signalled + GRACE + 1 + EXIT_SLACK)
    server.assert_clean_exit(0)
    lines = levels_and_loggers(server.stderr())
    ours = {logger for level, logger in lines if level == "DEBUG"}
    assert "trio_infer.workers.pool" in ours  # "worker lane 0: worker process ... started"
    theirs = [
        (level, logger)
        for level, logger in lines
        if not (logger == "trio_infer" or logger.startswith("trio_infer."))
    ]
    assert theirs == [], server.stderr()


@pytest.mark.parametrize("value", ["0", "-1", "1001"])
def test_a_connection_share_outside_the_budget_is_one_line_and_exit_2(value: str) -> None:
    done = run("serve", "--memory-budget", "1000", "--max-connection-bytes", value)
    assert done.returncode == 2
    lines = done.stderr.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].endswith("--max-connection-bytes must be between 1 and --memory-budget")


# -- TLS files ------------------------------------------------------------------------------------


@pytest.fixture
def tls_files(tmp_path: Path) -> dict[str, Path]:
    """A server certificate and key, a key of another certificate, a client CA, and a file
    that is not PEM, made by trustme."""
    ca = trustme.CA()
    issued = ca.issue_cert("127.0.0.1")
    files = {name: tmp_path / f"{name}.pem" for name in ("cert", "key", "other-key", "ca")}
    issued.cert_chain_pems[0].write_to_path(str(files["cert"]))
    issued.private_key_pem.write_to_path(str(files["key"]))
    ca.issue_cert("elsewhere").private_key_pem.write_to_path(str(files["other-key"]))
    ca.cert_pem.write_to_path(str(files["ca"]))
    files["not-pem"] = tmp_path / "notes.txt"
    files["not-pem"].write_text("not a certificate\n")
    files["missing"] = tmp_path / "missing.pem"
    return files


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (("--tls-cert", "missing", "--tls-key", "key"), "--tls-cert {missing}: no such file"),
        (
            ("--tls-cert", "cert", "--tls-key", "other-key"),
            "--tls-key {other-key}: does not match the certificate in {cert}",
        ),
        (
            ("--tls-cert", "not-pem", "--tls-key", "key"),
            "--tls-cert {not-pem}: holds no PEM certificate",
        ),
        (
            ("--tls-cert", "key", "--tls-key", "key"),
            "--tls-cert {key}: holds a private key but no PEM certificate",
        ),
        (
            ("--tls-cert", "cert", "--tls-key", "cert"),
            "--tls-key {cert}: holds no PEM private key",
        ),
        (
            ("--tls-cert", "cert", "--tls-key", "key", "--tls-client-ca", "not-pem"),
            "--tls-client-ca {not-pem}: holds no PEM certificate",
        ),
        (("--tls-key", "key"), "--tls-key needs --tls-cert"),
        (("--tls-client-ca", "ca"), "--tls-client-ca needs --tls-cert and --tls-key"),
        (("--tls-cert", "cert"), "--tls-cert needs --tls-key"),
    ],
    ids=[
        "missing-cert",
        "key-not-matching",
        "cert-not-pem",
        "key-as-cert",
        "cert-as-key",
        "client-ca-not-pem",
        "key-without-cert",
        "client-ca-without-cert",
        "cert-without-key",
    ],
)
def test_a_bad_tls_file_or_option_is_one_line_naming_it_and_exit_2(
    tls_files: dict[str, Path], options: tuple[str, ...], message: str
) -> None:
    argv = [str(tls_files[value]) if value in tls_files else value for value in options]
    done = run("serve", *argv)
    assert (done.returncode, done.stdout) == (2, "")
    lines = done.stderr.splitlines()
    assert len(lines) == 1, lines
    expected = message.format_map({name: str(path) for name, path in tls_files.items()})
    assert lines[0].endswith(f"ERROR trio_infer: {expected}"), lines[0]


def test_the_start_line_says_the_server_serves_mutual_tls(
    serve: Callable[..., Server], tls_files: dict[str, Path]
) -> None:
    server = serve(
        "--tls-cert",
        str(tls_files["cert"]),
        "--tls-key",
        str(tls_files["key"]),
        "--tls-client-ca",
        str(tls_files["ca"]),
    )
    server.wait_for_line(
        r"INFO trio_infer\.server: serving 4 model\(s\) from \S+ on 127\.0\.0\.1:\d+ over "
        r"mutual TLS \(client certificates required\) with 2 worker\(s\)$"
    )
