"""Shutdown of ``trio-infer serve``, end to end: the real command in a subprocess, real worker
processes, real signals, a real grpcio client.

What must hold: the first SIGINT or SIGTERM stops accepting new calls (GOAWAY; new calls get
UNAVAILABLE), lets the calls in flight finish within ``--grace-period``, ends the rest with
UNAVAILABLE, shuts the workers down and exits 0. A second signal exits at once, with 128 plus its
number (130 for SIGINT, 143 for SIGTERM). Either way: no process of the server's is left, no
traceback, and the exit comes within the grace period plus a second.

Each server runs in a session of its own (``start_new_session``), so every process it starts -
the fork server, multiprocessing's resource tracker, the workers - is found by its session id in
/proc. Zombies count as gone: they have exited and only wait to be reaped, and once the server
has exited its children are reaped by PID 1, whenever that gets to it. A terminal's Ctrl+C, which
reaches the whole foreground process group, is imitated with ``os.killpg``.

Calls run the test model ``hold``: the example ``sleep`` model (parameter ``delay_ms``) that
first writes its worker's pid to the file named by parameter ``marker``. A test waits for that
file rather than for a fixed time: it is how the test knows the call is running in a worker.

The last tests drive the transport in process with a raw HTTP/2 client, for shutdown races a
real client only hits now and then.

Timing: exits are timed from just before the signal to the reaping of the server process
(``Popen.wait`` polls, so up to 50 ms late). Measured on 2 cores: a call that outlives a 1 s
grace period ends 1.005-1.008 s after the signal and the server exits at 1.07 s (its worker
killed, the statuses sent, the pool closed, the interpreter gone: 70 ms past the grace period,
930 ms inside the bound); a second signal exits in 60-220 ms. Asserted bounds: the grace period
plus a second plus ``EXIT_SLACK``, and ``AT_ONCE`` after a second signal.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import h2.config
import h2.connection
import h2.settings
import hpack
import hyperframe.frame
import numpy as np
import pytest
import trio
import trio.testing

from trio_infer.errors import StatusCode
from trio_infer.protobuf._proto import grpc_predict_v2_pb2 as pb
from trio_infer.protobuf._proto import grpc_predict_v2_pb2_grpc
from trio_infer.protobuf.codec import encode_inputs, encode_parameters
from trio_infer.transport.grpc_server import Call, GrpcServer, ProtocolLimits
from trio_infer.transport.http_server import HttpLimits, HttpRequest, HttpServer

#: Allowed beyond the issue's "grace period plus a second" for Popen.wait's polling and a loaded
#: machine; measured exits do not need it (module doc).
EXIT_SLACK = 0.25
#: "At once", for the exit after a second signal (measured: 60-220 ms).
AT_ONCE = 1.0
#: Bound on waits for things that take well under a second when all is well.
TIMEOUT = 20.0

HOLD_MODEL = '''
import os

from trio_infer.examples.models import Sleep


class Hold(Sleep):
    """The example sleep model, which first writes its worker's pid to parameters["marker"]."""

    def predict(self, inputs, parameters):
        marker = parameters["marker"]
        with open(marker + ".tmp", "w") as file:
            file.write(str(os.getpid()))
        os.replace(marker + ".tmp", marker)
        return super().predict(inputs, parameters)
'''


def wait_until(condition: Callable[[], bool], what: str, timeout: float = TIMEOUT) -> None:
    """Poll ``condition`` until it holds; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.005)


@dataclass(frozen=True)
class Process:
    pid: int
    ppid: int
    state: str
    command: str


def session_processes(session: int) -> list[Process]:
    """The processes of ``session`` that have not exited (zombies have)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            command = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:  # exited meanwhile
            continue
        # pid (comm) state ppid pgrp session ...; comm may hold spaces and parentheses.
        state, ppid, _, sid = stat[stat.rindex(")") + 2 :].split()[:4]
        if int(sid) == session and state != "Z":
            found.append(Process(int(entry), int(ppid), state, command.decode(errors="replace")))
    return found


def wait_server_ready(stub: Any) -> None:
    """Wait until the server behind ``stub`` (a V2 stub) answers ServerReady true."""
    request = pb.ServerReadyRequest()
    wait_until(
        lambda: stub.ServerReady(request, timeout=TIMEOUT, wait_for_ready=True).ready,
        "ServerReady",
    )


def v2_stub(channel: grpc.Channel) -> Any:
    """A grpcio stub of the V2 service (generated code: untyped)."""
    return grpc_predict_v2_pb2_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]


def port_refuses_connections(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return False
    except ConnectionRefusedError:
        return True


@dataclass
class HeldCall:
    """A ``hold`` call started with grpcio's future API."""

    future: Any  # grpc.Future
    marker: Path

    def running(self) -> bool:
        """Whether the call has reached a worker."""
        return self.marker.exists()

    def worker_pid(self) -> int:
        wait_until(self.running, f"the call holding {self.marker.name} to reach a worker")
        return int(self.marker.read_text())

    def error(self) -> grpc.RpcError:
        """Wait for the call to fail; return its error."""
        error = self.future.exception(timeout=TIMEOUT)
        assert isinstance(error, grpc.RpcError), "the call succeeded"
        return error


class Server:
    """``trio-infer serve`` in a subprocess and session of its own, and a grpcio client of it.

    Its stderr is read by a thread (the pipe never fills); the port comes from the log line.
    """

    def __init__(self, argv: list[str], markers: Path) -> None:
        self._markers = markers
        self._calls = 0
        self._lines: list[str] = []
        self._changed = threading.Condition()
        self._eof = False
        self.channel: grpc.Channel | None = None
        self.process = subprocess.Popen(
            [sys.executable, "-m", "trio_infer", "serve", *argv],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.session = self.process.pid
        self._reader = threading.Thread(target=self._read_stderr, daemon=True)
        self._reader.start()

    def _read_stderr(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            with self._changed:
                self._lines.append(line)
                self._changed.notify_all()
        with self._changed:
            self._eof = True
            self._changed.notify_all()

    def wait_for_line(self, pattern: str, timeout: float = TIMEOUT) -> re.Match[str]:
        """Wait until the server logs a line matching ``pattern``; return the match."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for line in self._lines:
                    if match := re.search(pattern, line):
                        return match
                remaining = deadline - time.monotonic()
                if self._eof or remaining <= 0:
                    raise AssertionError(f"no log line matches {pattern!r}:\n{self.stderr()}")
                self._changed.wait(remaining)

    def stderr(self) -> str:
        """Everything the server logged (all of it once every process holding the pipe is
        gone: the server, its fork server, resource tracker and workers)."""
        self._reader.join(TIMEOUT if self.process.poll() is not None else 0)
        with self._changed:
            return "".join(self._lines)

    def start(self) -> Server:
        """Wait for the port and for ServerReady, then connect a grpcio channel."""
        port = int(self.wait_for_line(r"serving .* on 127\.0\.0\.1:(\d+) ").group(1))
        self.port = port
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self.stub = v2_stub(self.channel)
        wait_server_ready(self.stub)
        return self

    def hold(self, delay_ms: int, stub: Any = None) -> HeldCall:
        """Start a ``hold`` call of ``delay_ms`` milliseconds."""
        self._calls += 1
        marker = self._markers / f"call-{self._calls}"
        request = pb.ModelInferRequest(model_name="hold")
        encode_inputs(request, [("x", np.zeros(1, np.float32))], raw=True)
        encode_parameters(request.parameters, {"delay_ms": delay_ms, "marker": str(marker)})
        return HeldCall((stub or self.stub).ModelInfer.future(request), marker)

    def result(self, call: HeldCall) -> Any:
        """Wait for ``call`` to succeed; return its response."""
        try:
            return call.future.result(timeout=TIMEOUT)
        except grpc.RpcError as exc:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(TIMEOUT)
            raise AssertionError(
                f"{exc.code()}: {exc.details()}\n"
                f"exit status {self.process.returncode}, log:\n{self.stderr()}"
            ) from None

    def send(self, signum: signal.Signals, *, group: bool = False) -> float:
        """Send ``signum`` to the server, or to its whole process group as a terminal does;
        return the time it was sent."""
        now = time.monotonic()
        if group:
            os.killpg(self.session, signum)
        else:
            self.process.send_signal(signum)
        return now

    def wait_exit(self, deadline: float) -> float:
        """Wait for the server to exit, until ``deadline`` (``time.monotonic()``) at most;
        return when it exited."""
        try:
            self.process.wait(max(deadline - time.monotonic(), 0))
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running at the deadline:\n{self.stderr()}") from None
        return time.monotonic()

    def workers(self) -> list[int]:
        """The pids of the worker processes: the fork server's children."""
        processes = session_processes(self.session)
        forkservers = {
            p.pid
            for p in processes
            if p.ppid == self.process.pid and "multiprocessing.forkserver" in p.command
        }
        assert len(forkservers) == 1, processes
        return [p.pid for p in processes if p.ppid in forkservers]

    def assert_clean_exit(self, status: int) -> None:
        """Exit status ``status``, no traceback, and no process of the server left."""
        left: list[Process] = []

        def nothing_left() -> bool:
            left[:] = session_processes(self.session)
            return not left

        with contextlib.suppress(AssertionError):
            wait_until(nothing_left, "the server's processes to exit", timeout=2)
        stderr = self.stderr()
        assert self.process.returncode == status, stderr
        assert "Traceback" not in stderr, stderr
        assert not left, f"left running: {left}\n{stderr}"

    def close(self) -> None:
        """Kill whatever is left of the server's session and release the pipe and channel."""
        if self.channel is not None:
            self.channel.close()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.session, signal.SIGKILL)
        self.process.wait()
        self._reader.join(TIMEOUT)
        assert self.process.stderr is not None
        self.process.stderr.close()


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    """A repository with the one model ``hold``."""
    folder = tmp_path / "repository" / "hold"
    folder.mkdir(parents=True)
    settings = {"name": "hold", "implementation": "hold_model.Hold"}
    (folder / "model-settings.json").write_text(json.dumps(settings))
    (folder / "hold_model.py").write_text(HOLD_MODEL)
    return folder.parent


@pytest.fixture
def serve(repository: Path, tmp_path: Path) -> Iterator[Callable[..., Server]]:
    """Start ``trio-infer serve`` with two workers; kill what is left of it afterwards."""
    servers: list[Server] = []

    def start(*, grace: float | str, args: tuple[str, ...] | None = None) -> Server:
        if args is None:
            args = (str(repository), "--host", "127.0.0.1", "--grpc-port", "0")
        argv = [*args, "--http-port", "0", "--workers", "2", "--grace-period", str(grace)]
        server = Server(argv, tmp_path)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.close()


# -- the first signal: drain ------------------------------------------------------------------


def test_sigterm_lets_calls_in_flight_finish_and_refuses_new_ones(
    serve: Callable[..., Server],
) -> None:
    grace = 5.0
    server = serve(grace=grace).start()
    calls = [server.hold(500) for _ in range(4)]  # 2 workers: two run, two wait for a worker
    wait_until(lambda: sum(call.running() for call in calls) == 2, "both workers to be busy")
    signalled = server.send(signal.SIGTERM)
    in_flight = server.wait_for_line(r"shutting down: (\d+) call\(s\) in flight").group(1)
    assert in_flight == "4"

    # The listener is closed at once: a new call is refused before it reaches the server, on
    # a new channel as on the old one (which got GOAWAY); either way UNAVAILABLE.
    wait_until(lambda: port_refuses_connections(server.port), "the listener to close")
    late = server.hold(0)
    assert late.error().code() == grpc.StatusCode.UNAVAILABLE
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = v2_stub(channel)
        new = server.hold(0, stub)
        error = new.error()
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert "Connection refused" in error.details()
    assert not late.running()
    assert not new.running()

    for call in calls:
        response = server.result(call)
        assert response.model_name == "hold"
    exited = server.wait_exit(signalled + grace + 1 + EXIT_SLACK) - signalled
    # The grace period is an upper bound: the server stops when its last call has ended.
    assert exited < grace, f"waited out the grace period: exited after {exited:.2f} s"
    server.assert_clean_exit(0)


def test_ctrl_c_ends_a_call_that_outlives_the_grace_period_with_unavailable(
    serve: Callable[..., Server],
) -> None:
    grace = 1.0
    server = serve(grace=grace).start()
    call = server.hold(60_000)
    call.worker_pid()
    signalled = server.send(signal.SIGINT, group=True)
    error = call.error()
    ended = time.monotonic() - signalled
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert error.details() == "server shut down before the call finished"
    assert ended >= grace - 0.05, f"cut off {ended:.2f} s into a {grace} s grace period"
    server.wait_exit(signalled + grace + 1 + EXIT_SLACK)
    server.assert_clean_exit(0)


def test_a_second_ctrl_c_exits_at_once(serve: Callable[..., Server]) -> None:
    server = serve(grace=30.0).start()
    call = server.hold(60_000)
    call.worker_pid()
    server.send(signal.SIGINT, group=True)
    server.wait_for_line(r"SIGINT: shutting down")
    second = server.send(signal.SIGINT, group=True)
    server.wait_exit(second + AT_ONCE)
    # The connection is cut: the client learns it from the closed socket, not from a status.
    assert call.error().code() == grpc.StatusCode.UNAVAILABLE
    assert "SIGINT again: exiting now (exit status 130)" in server.stderr()
    # Not 0: what runs the server (a shell, systemd, Kubernetes) sees that the drain was cut.
    server.assert_clean_exit(130)


def test_a_second_sigterm_exits_at_once_with_143(serve: Callable[..., Server]) -> None:
    server = serve(grace=30.0).start()
    call = server.hold(60_000)
    call.worker_pid()
    server.send(signal.SIGTERM)
    server.wait_for_line(r"SIGTERM: shutting down")
    second = server.send(signal.SIGTERM)
    server.wait_exit(second + AT_ONCE)
    assert call.error().code() == grpc.StatusCode.UNAVAILABLE
    assert "SIGTERM again: exiting now (exit status 143)" in server.stderr()
    server.assert_clean_exit(143)


@pytest.mark.parametrize("killed", ["idle", "busy"])
def test_sigterm_after_a_worker_was_killed(serve: Callable[..., Server], killed: str) -> None:
    grace = 5.0
    server = serve(grace=grace).start()
    workers = server.workers()
    assert len(workers) == 2
    if killed == "idle":
        os.kill(workers[0], signal.SIGKILL)
        wait_until(
            lambda: workers[0] not in {p.pid for p in session_processes(server.session)},
            "the worker to die",
        )
        survivor = server.hold(500)
        survivor.worker_pid()
    else:
        # Both workers busy; one is killed mid-call, and the server starts loading the models
        # into a replacement while the shutdown begins.
        victim, survivor = server.hold(60_000), server.hold(800)
        os.kill(victim.worker_pid(), signal.SIGKILL)
        error = victim.error()
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        assert "worker process died" in error.details()
    signalled = server.send(signal.SIGTERM)
    assert server.result(survivor).model_name == "hold"
    server.wait_exit(signalled + grace + 1 + EXIT_SLACK)
    server.assert_clean_exit(0)


# -- not serving at all -----------------------------------------------------------------------


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield taken.getsockname()[1]


@pytest.mark.parametrize(
    ("option", "value", "status", "message"),
    [
        ("--grpc-port", "busy", 1, r"cannot serve on 127\.0\.0\.1:\d+: .*Address already in use"),
        ("--grpc-port", "65536", 2, r"--grpc-port must be between 0 and 65535"),
        ("--grace-period", "-1", 2, r"--grace-period must be a number of seconds"),
        ("--grace-period", "nan", 2, r"--grace-period must be a number of seconds"),
        ("--max-waiting-bytes", "-1", 2, r"--max-waiting-bytes must be at least 0"),
        ("--receive-timeout", "0", 2, r"--receive-timeout must be a number of seconds, more"),
        ("--receive-timeout", "nan", 2, r"--receive-timeout must be a number of seconds, more"),
        ("--receive-timeout", "inf", 2, r"--receive-timeout must be a number of seconds, more"),
        ("--handshake-timeout", "-1", 2, r"--handshake-timeout must be a number of seconds, more"),
        ("--idle-timeout", "0", 2, r"--idle-timeout must be a number of seconds, more"),
        (
            "--keepalive-min-interval",
            "-5",
            2,
            r"--keepalive-min-interval must be a number of seconds, more",
        ),
        (
            "--keepalive-min-interval",
            "soon",
            2,
            r"--keepalive-min-interval: invalid float value: 'soon'",
        ),
    ],
    ids=[
        "port-in-use",
        "port-out-of-range",
        "negative-grace",
        "nan-grace",
        "negative-waiting",
        "zero-receive-timeout",
        "nan-receive-timeout",
        "infinite-receive-timeout",
        "negative-handshake-timeout",
        "zero-idle-timeout",
        "negative-keepalive-interval",
        "word-keepalive-interval",
    ],
)
def test_a_bad_option_is_one_line_and_a_nonzero_status(
    serve: Callable[..., Server],
    busy_port: int,
    option: str,
    value: str,
    status: int,
    message: str,
) -> None:
    port = "0"
    if option == "--grpc-port":
        port = str(busy_port) if value == "busy" else value
    grace = value if option == "--grace-period" else "30"
    extra = (option, value) if option not in ("--grpc-port", "--grace-period") else ()
    server = serve(grace=grace, args=("--host", "127.0.0.1", "--grpc-port", port, *extra))
    assert server.process.wait(TIMEOUT) == status
    lines = server.stderr().splitlines()
    assert len(lines) == 1, lines
    assert re.search(message, lines[0]), lines[0]
    server.assert_clean_exit(status)


# -- known gaps: the worker pool and the service ---------------------------------------------------


def test_sigterm_to_the_whole_process_group_lets_calls_finish(
    serve: Callable[..., Server],
) -> None:
    # What systemd does by default (KillMode=control-group), as do `kill -TERM -PGID` and
    # timeout(1): every process of the service gets the SIGTERM, not just the server.
    grace = 5.0
    server = serve(grace=grace).start()
    calls = [server.hold(500) for _ in range(2)]
    for call in calls:
        call.worker_pid()
    signalled = server.send(signal.SIGTERM, group=True)
    for call in calls:
        assert server.result(call).model_name == "hold"
    server.wait_exit(signalled + grace + 1 + EXIT_SLACK)
    server.assert_clean_exit(0)


@pytest.mark.parametrize("signals", ["SIGTERM", "SIGINT-twice"])
def test_a_hung_idle_worker_does_not_hold_up_the_exit(
    serve: Callable[..., Server], signals: str
) -> None:
    # A stopped process neither runs nor exits when asked: a worker stuck in C code, or one
    # whose model left a non-daemon thread running, behaves the same at shutdown.
    grace = 1.0 if signals == "SIGTERM" else 30.0
    server = serve(grace=grace).start()
    os.kill(server.workers()[0], signal.SIGSTOP)
    if signals == "SIGTERM":
        signalled = server.send(signal.SIGTERM)
        server.wait_exit(signalled + grace + 1 + EXIT_SLACK)
    else:
        server.send(signal.SIGINT, group=True)
        server.wait_for_line(r"SIGINT: shutting down")
        second = server.send(signal.SIGINT, group=True)
        server.wait_exit(second + AT_ONCE)
    server.assert_clean_exit(0 if signals == "SIGTERM" else 130)


@pytest.mark.parametrize("run", range(3))
def test_no_worker_outlives_the_server_when_one_is_killed_just_before_sigterm(
    serve: Callable[..., Server], run: int
) -> None:
    # The readiness keeper starts a replacement for the killed worker while the drain begins:
    # the server must still have every worker gone by the time it exits. The fork server and
    # the resource tracker, which exit when the server's end of their pipes closes, are not
    # workers.
    del run
    server = serve(grace=5.0).start()
    helpers = {p.pid for p in session_processes(server.session) if p.ppid == server.process.pid}
    os.kill(server.workers()[0], signal.SIGKILL)
    server.wait_for_line(r"worker process \d+ died")
    signalled = server.send(signal.SIGTERM)
    server.wait_exit(signalled + 5.0 + 1 + EXIT_SLACK)
    left = [p for p in session_processes(server.session) if p.pid not in helpers]
    assert not left, f"running when the server exited: {left}\n{server.stderr()}"
    server.assert_clean_exit(0)


def test_a_call_whose_request_is_still_arriving_when_the_drain_begins_is_served(
    serve: Callable[..., Server], tmp_path: Path
) -> None:
    # Under load this is what happens to a call whose handler has not yet read its request
    # when the signal comes; here its request is sent in two halves, around the signal.
    grace = 5.0
    server = serve(grace=grace).start()
    request = pb.ModelInferRequest(model_name="hold")
    encode_inputs(request, [("x", np.zeros(1, np.float32))], raw=True)
    encode_parameters(request.parameters, {"delay_ms": 0, "marker": str(tmp_path / "late")})
    message = _grpc_message(request.SerializeToString())
    client = _h2_client()
    client.send_headers(1, _grpc_headers("/inference.GRPCInferenceService/ModelInfer"))
    client.send_data(1, message[:8])
    client.ping(b"in-order")  # answered once everything before it has been dispatched
    received = bytearray()
    with socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT) as sock:
        sock.sendall(client.data_to_send())
        while not any(
            isinstance(frame, hyperframe.frame.PingFrame) and "ACK" in frame.flags
            for frame in frames(bytes(received))
        ):
            data = sock.recv(65536)
            assert data, "the server closed the connection"
            received += data
        signalled = server.send(signal.SIGTERM)
        assert server.wait_for_line(r"shutting down: (\d+) call\(s\)").group(1) == "1"
        client.send_data(1, message[8:], end_stream=True)
        sock.sendall(client.data_to_send())
        while data := sock.recv(65536):
            received += data
    trailers = _trailers_by_stream(bytes(received))
    assert trailers[1]["grpc-status"] == "0", urllib.parse.unquote(
        trailers[1].get("grpc-message", "")
    )
    server.wait_exit(signalled + grace + 1 + EXIT_SLACK)
    server.assert_clean_exit(0)


# -- the transport's part of the drain, in process ---------------------------------------------


def _grpc_headers(path: str, content_type: str = "application/grpc") -> list[tuple[str, str]]:
    return [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", path),
        (":authority", "localhost"),
        ("te", "trailers"),
        ("content-type", content_type),
    ]


def _h2_client(window: int = 65535) -> Any:
    """An HTTP/2 client connection (h2, sans I/O) that lets the server send ``window`` bytes
    on each stream and on the connection before any acknowledgement."""
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    if window > 65535:
        client.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: window})
        client.increment_flow_control_window(window - 65535)
    return client


def _grpc_message(data: bytes) -> bytes:
    return b"\x00" + len(data).to_bytes(4, "big") + data


def frames(received: bytes) -> Iterator[Any]:
    """The complete HTTP/2 frames in a server's byte stream (the preface is a frame too).

    Parsed frame by frame rather than with h2's client, whose state machine refuses frames
    after a GOAWAY that a graceful shutdown does send them after."""
    view = memoryview(received)
    while len(view) >= 9:
        frame, length = hyperframe.frame.Frame.parse_frame_header(view[:9])
        if len(view) < 9 + length:
            return
        frame.parse_body(view[9 : 9 + length])
        view = view[9 + length :]
        yield frame


def _trailers_by_stream(received: bytes) -> dict[int, dict[str, str]]:
    """Each ended stream's last header block, from a server's byte stream."""
    decoder = hpack.Decoder()
    decoder.max_allowed_table_size = 1 << 16
    trailers: dict[int, dict[str, str]] = {}
    for frame in frames(received):
        if isinstance(frame, hyperframe.frame.HeadersFrame):
            assert "END_HEADERS" in frame.flags, "CONTINUATION frames are not expected here"
            headers = {
                name.decode(): value.decode()
                for name, value in decoder.decode(frame.data, raw=True)
            }
            if "END_STREAM" in frame.flags:
                trailers[frame.stream_id] = headers
    return trailers


async def _serve_in_process(
    nursery: trio.Nursery, handler: Callable[[Call], Any], limits: ProtocolLimits | None = None
) -> tuple[GrpcServer, trio.SocketStream]:
    """A GrpcServer on a loopback port, and a TCP connection to it."""
    server = GrpcServer(handler, limits)
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    await nursery.start(server.serve, listeners)
    stream = await trio.open_tcp_stream("127.0.0.1", listeners[0].socket.getsockname()[1])
    return server, stream


async def _read_to_eof(stream: trio.SocketStream) -> bytes:
    received = bytearray()
    while data := await stream.receive_some(1 << 20):
        received += data
    await stream.aclose()
    return bytes(received)


async def test_statuses_queued_while_the_writer_is_blocked_are_sent_before_closing(
    nursery: trio.Nursery,
) -> None:
    # A status queued while the connection's writer is blocked in send_all (a client slow to
    # read) used to be dropped: when the send returned, the writer saw "closing, no calls
    # left" and closed the connection without sending what had been queued meanwhile.
    big_sent, hold_started = trio.Event(), trio.Event()

    async def handler(call: Call) -> None:
        await call.receive_message()
        if call.method.endswith("/Big"):
            await call.send_message(bytes(32 * 1024 * 1024))  # more than the socket buffers
            big_sent.set()
        else:
            hold_started.set()
            await trio.sleep_forever()

    # Big's answer is queued whole (its call would otherwise wait for the client to read).
    limits = ProtocolLimits(max_unsent_bytes=64 * 1024 * 1024)
    server, stream = await _serve_in_process(nursery, handler, limits)
    client = _h2_client(window=2**31 - 1)
    for path in ("/test.Service/Big", "/test.Service/Hold"):
        stream_id = client.get_next_available_stream_id()
        client.send_headers(stream_id, _grpc_headers(path))
        client.send_data(stream_id, _grpc_message(b"x"), end_stream=True)
    with trio.fail_after(TIMEOUT):
        await stream.send_all(client.data_to_send())
        # Not reading: the writer is stuck sending Big's answer (and its status) while Hold
        # is cancelled and queues its own status.
        await big_sent.wait()
        await hold_started.wait()
        await server.shutdown(grace_period=0)
        await server.calls_in_flight.wait_idle()
        trailers = _trailers_by_stream(await _read_to_eof(stream))

    assert trailers[1]["grpc-status"] == "0"
    assert trailers[3]["grpc-status"] == str(StatusCode.UNAVAILABLE.value)
    message = urllib.parse.unquote(trailers[3]["grpc-message"])
    assert message == "server shut down before the call finished"


@pytest.mark.parametrize("refused", ["draining", "malformed"])
async def test_a_refused_stream_reset_in_the_same_read_that_opened_it_is_skipped(
    nursery: trio.Nursery, refused: str
) -> None:
    # A client that sent a call just before our GOAWAY reached it resets that call when the
    # GOAWAY arrives, often in the same packet as the call. The server refused such a call
    # with a status sent on the spot - on a stream h2 had already closed - and crashed with a
    # traceback, cutting off every call in flight. A malformed call took the same path.
    started, release = trio.Event(), trio.Event()

    async def handler(call: Call) -> None:
        await call.receive_message()
        started.set()
        await release.wait()
        await call.send_message(b"done")

    server, stream = await _serve_in_process(nursery, handler)
    client = _h2_client()
    client.send_headers(1, _grpc_headers("/test.Service/Hold"))
    client.send_data(1, _grpc_message(b"x"), end_stream=True)
    with trio.fail_after(TIMEOUT):
        await stream.send_all(client.data_to_send())
        await started.wait()
        if refused == "draining":
            server.stop_accepting()
        content_type = "application/grpc" if refused == "draining" else "text/plain"
        client.send_headers(3, _grpc_headers("/test.Service/Hold", content_type))
        client.send_data(3, _grpc_message(b"x"))
        client.reset_stream(3)
        await stream.send_all(client.data_to_send())  # one write: one read for the server
        release.set()
        await server.shutdown(grace_period=TIMEOUT)
        trailers = _trailers_by_stream(await _read_to_eof(stream))
    assert list(trailers) == [1], trailers  # nothing for the stream the client reset
    assert trailers[1]["grpc-status"] == "0"


# -- a request that arrives as its keep-alive connection drains ------------------------------


def _response(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a reset raises)."""
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    return received


async def _ok_then_slow(request: HttpRequest) -> None:
    if request.path == "/slow":
        await trio.sleep(0.2)  # a model call's time
    await request.respond(200, [("content-type", "text/plain")], [b"ok"])


async def _served_once(
    nursery: trio.Nursery, handler: Callable[[HttpRequest], Awaitable[None]], sock: socket.socket
) -> HttpServer:
    """An HTTP server serving ``handler`` in ``nursery``, ``sock`` connected to it and its
    answer to ``GET /ok`` read: the connection is kept alive, waiting for a next request."""
    server = HttpServer(handler, HttpLimits())
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    await nursery.start(server.serve, listeners)
    sock.connect(listeners[0].socket.getsockname()[:2])
    sock.settimeout(10)
    sock.sendall(b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\n")
    first = await trio.to_thread.run_sync(sock.recv, 65536)
    assert first.startswith(b"HTTP/1.1 200")
    return server


async def test_a_request_that_arrived_on_an_idle_connection_as_it_drains_is_answered() -> None:
    # The client's next request is in the server's socket when a shutdown's drain ends the
    # wait for it: it is served within the grace period (counted in flight from the drain),
    # the connection's last, and the connection then closes without a reset (which would have
    # lost the answer and made the client see "connection reset"). As run_server does, the
    # connections are cut off once the shutdown returns.
    with socket.socket() as sock:
        async with trio.open_nursery() as nursery:
            server = await _served_once(nursery, _ok_then_slow, sock)
            await trio.testing.wait_all_tasks_blocked()  # it waits for the next head
            sock.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")  # in its socket now
            await server.shutdown(grace_period=10)  # before the connection's task runs again
            nursery.cancel_scope.cancel()
        answer = await trio.to_thread.run_sync(_response, sock)
    assert answer.startswith(b"HTTP/1.1 200")
    assert b"\r\nconnection: close\r\n" in answer.lower()
    assert answer.endswith(b"ok")


async def test_a_connection_cut_off_while_it_lingers_still_closes_its_socket() -> None:
    # A shutdown's deadline (run_server's _CLOSE_SLACK) can end a connection's linger: its
    # socket must be closed all the same, not left to the garbage collector.
    async def never_called(call: Call) -> None:
        raise AssertionError

    def open_descriptors() -> int:
        return len(os.listdir("/proc/self/fd"))

    server = GrpcServer(never_called, ProtocolLimits())
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve, listeners)
        port = listeners[0].socket.getsockname()[1]
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        client.initiate_connection()
        await stream.send_all(client.data_to_send())
        await stream.receive_some(65536)  # the server's preface: the connection is up
        before = open_descriptors()
        server.stop_accepting()  # GOAWAY, and the listener closes
        for connection in list(server._connections):
            connection.close()  # no call in flight: it ends, and lingers for the client
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    after = open_descriptors()
    await stream.aclose()
    assert after <= before - 2  # the listener's socket and the connection's


@pytest.mark.parametrize("arrived", [b"", b"GET /slow HT"])
async def test_a_request_racing_the_drain_of_its_idle_connection_is_answered_or_never_read(
    arrived: bytes,
) -> None:
    # A drain ends a keep-alive connection's wait for its next request while the client sends
    # one. Part of its head already there: the rest is waited for and the request answered,
    # the connection's last. None of it there: the server's side is closed first, the request
    # then read and dropped, and the client reads the end of the connection, not a reset.
    served: list[str] = []

    async def handler(request: HttpRequest) -> None:
        served.append(request.path)
        await _ok_then_slow(request)

    with socket.socket() as sock:
        async with trio.open_nursery() as nursery:
            server = await _served_once(nursery, handler, sock)
            if arrived:
                sock.sendall(arrived)
            await trio.testing.wait_all_tasks_blocked()  # the head's first bytes taken
            nursery.start_soon(functools.partial(server.shutdown, grace_period=10))
            if not arrived:
                # The server's end of the connection reaches the client before the request.
                await trio.to_thread.run_sync(select.select, [sock], [], [], 10)
            sock.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n"[len(arrived) :])
            answer = await trio.to_thread.run_sync(_response, sock)
            nursery.cancel_scope.cancel()
    if arrived:
        assert answer.startswith(b"HTTP/1.1 200")
        assert b"\r\nconnection: close\r\n" in answer.lower()
        assert served == ["/ok", "/slow"]
    else:
        assert answer == b""
        assert served == ["/ok"]
