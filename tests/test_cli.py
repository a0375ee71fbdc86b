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

from tests.test_shutdown import EXIT_SLACK, TIMEOUT, Server, v2_stub, wait_until
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
        argv = ["--host", "127.0.0.1", "--grpc-port", "0", "--workers", "2", *options]
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
        wait_until(
            lambda: (
                stub.ServerReady(
                    pb.ServerReadyRequest(), timeout=TIMEOUT, wait_for_ready=True
                ).ready
            ),
            "ServerReady",
        )
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
