"""Calls answered at once: the methods the gRPC service answers from the server's state alone
(ServerLive, ModelReady, ModelMetadata...) are answered by the connection's reader when their
whole request comes with their start, without a task; any other way they come, they run in a
task as before. Real servers on loopback ports, with grpcio, tritonclient and raw HTTP/2.

Each answer is compared with the one a server without immediate methods (every call in a task,
as before) gives on the same core; the transports' count of calls run in a task shows which
way a call went.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import math
import subprocess
import sys
import weakref
from collections.abc import AsyncIterator, Callable

import grpc
import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.settings
import hpack
import numpy as np
import pytest
import trio

from tests.support import eventually, start_server
from trio_infer.errors import InferError, Overloaded, StatusCode
from trio_infer.frontends.grpc_service import GrpcService
from trio_infer.protobuf._proto import grpc_predict_v2_pb2 as pb
from trio_infer.protobuf._proto import health_pb2
from trio_infer.protobuf.codec import decode_outputs, encode_inputs
from trio_infer.scheduling.admission import Admission
from trio_infer.server import RunningServer
from trio_infer.transport.grpc_server import Call, GrpcServer, Immediate

V2 = "/inference.GRPCInferenceService/"
CHECK = "/grpc.health.v1.Health/Check"
TIMEOUT = 10.0


def _in_tasks_so_far() -> dict[GrpcServer, int]:
    """Each gRPC transport alive in this process, those of the tests run before this one
    included, with the calls it has run in a task (its statistics' count)."""
    return {
        thing: thing.statistics().calls_in_tasks
        for thing in gc.get_objects()
        if type(thing) is GrpcServer
    }


class CallTasks:
    """Counts the calls the gRPC transports run in a task from when it is made.

    Server by server: a server alive when it is made may be released before it is read (a
    failed test's, which pytest holds by its traceback until the next test's call begins), and
    its calls must not be taken off the others'.
    """

    def __init__(self) -> None:
        self._before: weakref.WeakKeyDictionary[GrpcServer, int] = weakref.WeakKeyDictionary(
            _in_tasks_so_far()
        )

    @property
    def started(self) -> int:
        """Calls run in a task since then, whichever server ran them."""
        return sum(
            count - self._before.get(server, 0) for server, count in _in_tasks_so_far().items()
        )


@pytest.fixture
def call_tasks() -> CallTasks:
    return CallTasks()


async def serve_in_tasks(
    nursery: trio.Nursery, server: RunningServer, *, access_log: bool = False
) -> int:
    """Serve ``server``'s core on another port with every call in a task (no immediate
    methods): the answers as they were before; its port."""
    service = GrpcService(server.core, server.models)
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    await nursery.start(GrpcServer(service.handle, access_log=access_log).serve, listeners)
    port: int = listeners[0].socket.getsockname()[1]
    return port


class Outcome:
    """A unary call's whole answer as a client sees it: the response message's bytes (None
    when it failed), its status and message, and its metadata but the request id (which is
    each call's own)."""

    def __init__(
        self,
        message: bytes | None,
        code: grpc.StatusCode,
        details: str | None,
        initial: list[tuple[str, str | bytes]],
        trailing: list[tuple[str, str | bytes]],
    ) -> None:
        self.message = message
        self.code = code
        self.details = details
        self.initial = initial
        self.trailing = trailing
        self.request_ids = [v for k, v in initial + trailing if k == "x-request-id"]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Outcome) and self._key() == other._key()

    def _key(self) -> tuple[object, ...]:
        def kept(metadata: list[tuple[str, str | bytes]]) -> list[tuple[str, str | bytes]]:
            return [(k, v) for k, v in metadata if k != "x-request-id"]

        return (self.message, self.code, self.details, kept(self.initial), kept(self.trailing))

    def __repr__(self) -> str:
        return f"Outcome{self._key()!r}"


def unary(
    port: int, method: str, request: bytes, metadata: tuple[tuple[str, str], ...] = ()
) -> Outcome:
    """One call of ``method`` with ``request`` (bytes) on a new grpcio channel."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_unary(method)
        try:
            message, done = call.with_call(request, timeout=TIMEOUT, metadata=metadata)
        except grpc.RpcError as error:
            if not isinstance(error, grpc.Call):
                raise
            return Outcome(
                None,
                error.code(),
                error.details(),
                list(error.initial_metadata() or ()),
                list(error.trailing_metadata() or ()),
            )
        return Outcome(
            message,
            done.code(),
            done.details() or None,
            list(done.initial_metadata() or ()),
            list(done.trailing_metadata() or ()),
        )


#: Every immediate method, known and unknown models, a request that is not the message.
CALLS = [
    (V2 + "ServerLive", pb.ServerLiveRequest().SerializeToString()),
    (V2 + "ServerReady", pb.ServerReadyRequest().SerializeToString()),
    (V2 + "ServerMetadata", pb.ServerMetadataRequest().SerializeToString()),
    (V2 + "ModelReady", pb.ModelReadyRequest(name="echo").SerializeToString()),
    (V2 + "ModelReady", pb.ModelReadyRequest(name="no_such_model").SerializeToString()),
    (V2 + "ModelReady", pb.ModelReadyRequest(name="echo", version="9").SerializeToString()),
    (V2 + "ModelReady", b"\xff\xff"),
    (V2 + "ModelMetadata", pb.ModelMetadataRequest(name="add_sub").SerializeToString()),
    (V2 + "ModelMetadata", pb.ModelMetadataRequest(name="no_such_model").SerializeToString()),
    (V2 + "ModelConfig", pb.ModelConfigRequest(name="add_sub").SerializeToString()),
    (V2 + "ModelConfig", pb.ModelConfigRequest(name="no_such_model").SerializeToString()),
    (V2 + "ModelStatistics", pb.ModelStatisticsRequest(name="echo").SerializeToString()),
    (V2 + "ModelStatistics", pb.ModelStatisticsRequest().SerializeToString()),
    (V2 + "ModelStatistics", pb.ModelStatisticsRequest(name="nope").SerializeToString()),
    (CHECK, health_pb2.HealthCheckRequest().SerializeToString()),
    (CHECK, health_pb2.HealthCheckRequest(service="echo").SerializeToString()),
    (CHECK, health_pb2.HealthCheckRequest(service="nope").SerializeToString()),
]


@pytest.mark.parametrize(("method", "request_bytes"), CALLS)
async def test_each_immediate_call_is_answered_at_once_as_its_task_answered_it(
    nursery: trio.Nursery,
    server: RunningServer,
    call_tasks: CallTasks,
    method: str,
    request_bytes: bytes,
) -> None:
    in_tasks = await serve_in_tasks(nursery, server)
    before = await trio.to_thread.run_sync(unary, in_tasks, method, request_bytes)
    assert call_tasks.started == 1
    now = await trio.to_thread.run_sync(unary, server.port, method, request_bytes)
    assert call_tasks.started == 1, "answered without a task"
    assert now == before
    assert len(now.request_ids) == 1


async def test_a_failed_call_answered_at_once_says_why_as_before(server: RunningServer) -> None:
    request = pb.ModelReadyRequest(name="no_such_model").SerializeToString()
    outcome = await trio.to_thread.run_sync(unary, server.port, V2 + "ModelReady", request)
    assert outcome.code == grpc.StatusCode.NOT_FOUND
    assert outcome.details is not None
    assert "no_such_model" in outcome.details


async def test_immediate_calls_echo_the_clients_request_id(
    server: RunningServer, call_tasks: CallTasks
) -> None:
    live = pb.ServerLiveRequest().SerializeToString()
    missing = pb.ModelReadyRequest(name="no_such_model").SerializeToString()
    ok = await trio.to_thread.run_sync(
        unary, server.port, V2 + "ServerLive", live, (("x-request-id", "live-1"),)
    )
    failed = await trio.to_thread.run_sync(
        unary, server.port, V2 + "ModelReady", missing, (("x-request-id", "ready-2"),)
    )
    assert ("x-request-id", "live-1") in ok.initial
    # A trailers-only answer: the id goes with the status.
    assert ("x-request-id", "ready-2") in failed.trailing
    assert call_tasks.started == 0


TRITON_CLIENT = r"""
import json
import sys

import tritonclient.grpc as triton
from tritonclient.utils import InferenceServerException

client = triton.InferenceServerClient(f"127.0.0.1:{sys.argv[1]}")
headers = {"x-request-id": "triton-7"}


def attempt(call):
    try:
        return ["ok", call()]
    except InferenceServerException as error:
        return ["error", error.status(), error.message()]


report = {
    "live": attempt(lambda: client.is_server_live(headers=headers)),
    "ready": attempt(lambda: client.is_server_ready(headers=headers)),
    "model_ready": attempt(lambda: client.is_model_ready("add_sub", headers=headers)),
    "unknown_ready": attempt(lambda: client.is_model_ready("no_such_model", headers=headers)),
    "server": attempt(lambda: client.get_server_metadata(as_json=True)),
    "metadata": attempt(lambda: client.get_model_metadata("add_sub", as_json=True)),
    "unknown_metadata": attempt(lambda: client.get_model_metadata("no_such_model")),
    "config": attempt(lambda: client.get_model_config("add_sub", as_json=True)),
    "unknown_config": attempt(lambda: client.get_model_config("no_such_model")),
    "statistics": attempt(lambda: client.get_inference_statistics("add_sub", as_json=True)),
    "unknown_statistics": attempt(lambda: client.get_inference_statistics("no_such_model")),
}
print(json.dumps(report, sort_keys=True))
"""


def triton_report(port: int) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-c", TRITON_CLIENT, str(port)],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    report: dict[str, object] = json.loads(done.stdout)
    return report


async def test_tritonclient_sees_the_same_answers_as_before(
    nursery: trio.Nursery, server: RunningServer, call_tasks: CallTasks
) -> None:
    in_tasks = await serve_in_tasks(nursery, server)
    before = await trio.to_thread.run_sync(triton_report, in_tasks)
    started = call_tasks.started
    assert started >= len(before)
    now = await trio.to_thread.run_sync(triton_report, server.port)
    assert call_tasks.started == started, "every call answered at once"
    assert now == before
    assert now["live"] == ["ok", True]
    assert now["model_ready"] == ["ok", True]
    assert now["unknown_ready"][:2] == ["error", "StatusCode.NOT_FOUND"]  # type: ignore[index]


async def test_the_access_log_records_immediate_calls_as_before(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture, call_tasks: CallTasks
) -> None:
    server = await start_server(nursery, access_log=True)
    in_tasks = await serve_in_tasks(nursery, server, access_log=True)
    calls = [
        (V2 + "ServerLive", pb.ServerLiveRequest().SerializeToString(), "a"),
        (V2 + "ModelReady", pb.ModelReadyRequest(name="echo").SerializeToString(), "b"),
        (V2 + "ModelReady", pb.ModelReadyRequest(name="nope").SerializeToString(), "c"),
        (V2 + "ModelMetadata", pb.ModelMetadataRequest(name="echo").SerializeToString(), "d"),
    ]
    records: dict[int, list[tuple[object, ...]]] = {}
    caplog.set_level(logging.INFO, logger="trio_infer.access")
    for port in (in_tasks, server.port):
        caplog.clear()
        for method, request, id_ in calls:
            metadata = (("x-request-id", id_),)
            await trio.to_thread.run_sync(unary, port, method, request, metadata)
        records[port] = [
            (r.method, r.model, r.status, r.bytes_in, r.bytes_out, r.request_id)  # type: ignore[attr-defined]
            for r in caplog.records
            if r.name == "trio_infer.access"
        ]
    assert call_tasks.started == len(calls)  # the server in tasks' only
    assert records[server.port] == records[in_tasks]
    live, ready, missing, metadata = records[server.port]
    assert live == (V2 + "ServerLive", "", "OK", 0, 7, "a")
    assert ready[1:4] == ("echo", "OK", len(calls[1][1]))
    assert missing[1:3] == ("nope", "NOT_FOUND")
    assert metadata[1:3] == ("echo", "OK")


# -- raw HTTP/2 ---------------------------------------------------------------------------


def headers_for(method: str) -> list[tuple[str, str]]:
    return [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", method),
        (":authority", "x"),
        ("te", "trailers"),
        ("content-type", "application/grpc"),
    ]


def frame(kind: int, flags: int, stream_id: int, payload: bytes) -> bytes:
    """An HTTP/2 frame, by hand."""
    header = len(payload).to_bytes(3, "big") + bytes([kind, flags])
    return header + stream_id.to_bytes(4, "big") + payload


def grpc_message(payload: bytes) -> bytes:
    return b"\x00" + len(payload).to_bytes(4, "big") + payload


class RawClient:
    """A client on a Trio socket that sends with h2 what the test says, when it says, and
    reads the server's frames by hand (h2 would refuse what follows a GOAWAY): each stream's
    headers and trailers, message bytes, end or reset. It acknowledges SETTINGS and PINGs and
    gives back the window of every DATA frame it reads."""

    def __init__(self, stream: trio.SocketStream, settings: dict[int, int] | None = None) -> None:
        self.stream = stream
        self.h2 = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        if settings:
            self.h2.local_settings = h2.settings.Settings(client=True, initial_values=settings)
        self.h2.initiate_connection()
        self.decoder = hpack.Decoder()
        self.received = bytearray()
        self.owed = bytearray()
        self.block = b""
        self.headers: dict[int, dict[str, str]] = {}
        self.data: dict[int, bytes] = {}
        self.ended: set[int] = set()
        self.reset: set[int] = set()
        self.goaway = False
        #: The payloads of the PINGs the server acknowledged.
        self.pongs: set[bytes] = set()

    @classmethod
    @contextlib.asynccontextmanager
    async def connect(
        cls, port: int, settings: dict[int, int] | None = None
    ) -> AsyncIterator[RawClient]:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            yield cls(stream, settings)

    def call(
        self,
        stream_id: int,
        method: str,
        message: bytes,
        *,
        end: bool = True,
        extra: tuple[tuple[str, str], ...] = (),
    ) -> None:
        """Queue a call's HEADERS (with ``extra`` fields) and its message (and END_STREAM,
        with ``end``)."""
        self.h2.send_headers(stream_id, headers_for(method) + list(extra))
        self.h2.send_data(stream_id, grpc_message(message), end_stream=end)

    async def read_past(self) -> None:
        """Send a PING after what is queued, and read until the server acknowledges it: the
        server has read and handled everything sent before it by then."""
        payload = len(self.pongs).to_bytes(8, "big")
        self.h2.ping(payload)
        await self.read_until(lambda: payload in self.pongs)

    async def flush(self) -> None:
        data = self.h2.data_to_send() + self.owed
        self.owed = bytearray()
        if data:
            await self.stream.send_all(data)

    async def read_until(self, done: Callable[[], bool]) -> None:
        await self.flush()
        with trio.fail_after(TIMEOUT):
            while not done():
                chunk = await self.stream.receive_some(65536)
                assert chunk, "the server closed the connection"
                self.received += chunk
                self._take_frames()
                await self.flush()

    def _take_frames(self) -> None:
        while len(self.received) >= 9:
            length = int.from_bytes(self.received[:3], "big")
            if len(self.received) < 9 + length:
                return
            kind, flags = self.received[3], self.received[4]
            stream_id = int.from_bytes(self.received[5:9], "big") & 0x7FFFFFFF
            payload = bytes(self.received[9 : 9 + length])
            del self.received[: 9 + length]
            self._frame(kind, flags, stream_id, payload)

    def _frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        if kind == 0x0:  # DATA
            self.data[stream_id] = self.data.get(stream_id, b"") + payload
            if payload:
                increment = len(payload).to_bytes(4, "big")
                self.owed += frame(0x8, 0x0, 0, increment) + frame(0x8, 0x0, stream_id, increment)
        elif kind in (0x1, 0x9):  # HEADERS, CONTINUATION
            self.block += payload
            if flags & 0x4:  # END_HEADERS
                fields = self.decoder.decode(self.block, raw=True)
                self.block = b""
                self.headers.setdefault(stream_id, {}).update(
                    (name.decode(), value.decode()) for name, value in fields
                )
        elif kind == 0x3:
            self.reset.add(stream_id)
        elif kind == 0x4 and not flags & 0x1:
            self.owed += frame(0x4, 0x1, 0, b"")  # SETTINGS' ACK
        elif kind == 0x6 and not flags & 0x1:
            self.owed += frame(0x6, 0x1, 0, payload)  # PING's ACK
        elif kind == 0x6:
            self.pongs.add(payload)
        elif kind == 0x7:
            self.goaway = True
        if kind in (0x0, 0x1) and flags & 0x1:  # END_STREAM
            self.ended.add(stream_id)

    def status(self, stream_id: int) -> str | None:
        return self.headers.get(stream_id, {}).get("grpc-status")

    def message(self, stream_id: int) -> bytes:
        data = self.data.get(stream_id, b"")
        assert int.from_bytes(data[1:5], "big") == len(data) - 5
        return data[5:]


LIVE = pb.ServerLiveRequest().SerializeToString()


async def test_a_client_with_no_window_gets_its_answer_once_it_opens_one(
    server: RunningServer, call_tasks: CallTasks
) -> None:
    # SETTINGS_INITIAL_WINDOW_SIZE 0: no answer fits at once; the call's task sends it when the
    # client's WINDOW_UPDATE comes.
    no_window = {h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0}
    async with RawClient.connect(server.port, no_window) as client:
        client.call(1, V2 + "ServerLive", LIVE)
        await client.read_until(lambda: 1 in client.headers)
        assert 1 not in client.data
        client.h2.increment_flow_control_window(64, stream_id=1)
        await client.read_until(lambda: 1 in client.ended)
    assert client.status(1) == "0"
    assert pb.ServerLiveResponse.FromString(client.message(1)).live
    assert call_tasks.started == 1


async def test_the_count_of_calls_in_tasks_keeps_those_of_servers_alive_when_it_is_read(
    nursery: trio.Nursery,
) -> None:
    # A server alive when the count begins and released before it is read (a failed test's)
    # takes nothing off the count: only its own calls go with it.
    async def echo(call: Call) -> None:
        message = await call.receive_message()
        assert message is not None
        await call.send_message(bytes(message), last=True)

    async def one_call(port: int) -> None:
        async with RawClient.connect(port) as client:
            client.call(1, "/t.S/Echo", b"x")
            await client.read_until(lambda: 1 in client.ended)
        assert client.status(1) == "0"

    async with trio.open_nursery() as earlier:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        released = GrpcServer(echo)
        await earlier.start(released.serve, listeners)
        await one_call(listeners[0].socket.getsockname()[1])
        count = CallTasks()
        gone = weakref.ref(released)
        del released, listeners
        earlier.cancel_scope.cancel()
    gc.collect()
    assert gone() is None
    assert count.started == 0
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    await nursery.start(GrpcServer(echo).serve, listeners)
    await one_call(listeners[0].socket.getsockname()[1])
    assert count.started == 1


async def test_a_call_reset_with_its_headers_is_not_answered(
    server: RunningServer, call_tasks: CallTasks
) -> None:
    transport = server.statistics().transport
    assert transport is not None
    before = transport.calls_started
    async with RawClient.connect(server.port) as client:
        client.call(1, V2 + "ServerLive", LIVE)
        client.h2.reset_stream(1, h2.errors.ErrorCodes.CANCEL)
        client.call(3, V2 + "ServerLive", LIVE)
        await client.read_until(lambda: 3 in client.ended)
    assert client.status(3) == "0"
    assert 1 not in client.headers
    assert 1 not in client.data
    transport = server.statistics().transport
    assert transport is not None
    assert transport.calls_started == before + 1
    assert call_tasks.started == 0


async def test_a_call_reset_after_its_headers_alone_is_not_answered(
    server: RunningServer, call_tasks: CallTasks
) -> None:
    # Its message had not come: it waits in a task, which the reset ends without an answer.
    async with RawClient.connect(server.port) as client:
        client.h2.send_headers(1, headers_for(V2 + "ServerLive"))
        await client.flush()
        await eventually(lambda: call_tasks.started == 1)
        client.h2.reset_stream(1, h2.errors.ErrorCodes.CANCEL)
        client.call(3, V2 + "ServerLive", LIVE)
        await client.read_until(lambda: 3 in client.ended)
    assert client.status(3) == "0"
    assert 1 not in client.headers
    assert 1 not in client.data
    assert call_tasks.started == 1


async def test_a_message_that_comes_after_its_headers_is_answered_in_a_task(
    server: RunningServer, call_tasks: CallTasks
) -> None:
    ready = pb.ModelReadyRequest(name="echo").SerializeToString()
    framed = grpc_message(ready)
    async with RawClient.connect(server.port) as client:
        client.h2.send_headers(1, headers_for(V2 + "ModelReady"))
        client.h2.send_data(1, framed[:7])  # its prefix and 2 bytes of 6
        await client.flush()
        await eventually(lambda: call_tasks.started == 1)
        client.h2.send_data(1, framed[7:], end_stream=True)
        await client.read_until(lambda: 1 in client.ended)
        # Whole, but not ended: answered in a task too, before the client half-closes.
        client.call(3, V2 + "ModelReady", ready, end=False)
        await client.read_until(lambda: 3 in client.ended)
    for stream in (1, 3):
        assert client.status(stream) == "0"
        assert pb.ModelReadyResponse.FromString(client.message(stream)).ready
    assert call_tasks.started == 2


async def test_a_call_whose_deadline_passed_as_it_came_fails_as_before(
    nursery: trio.Nursery, server: RunningServer
) -> None:
    # grpc-timeout 1n: the deadline has passed by the time the call is answered, at once or
    # in a task.
    in_tasks = await serve_in_tasks(nursery, server)
    statuses = []
    for port in (in_tasks, server.port):
        async with RawClient.connect(port) as client:
            client.call(1, V2 + "ServerLive", LIVE, extra=(("grpc-timeout", "1n"),))
            await client.read_until(lambda: 1 in client.ended)
        assert 1 not in client.data
        statuses.append(client.status(1))
    assert statuses == [str(int(StatusCode.DEADLINE_EXCEEDED))] * 2


async def test_a_call_with_two_messages_in_one_read_fails_as_before(
    nursery: trio.Nursery, server: RunningServer, call_tasks: CallTasks
) -> None:
    in_tasks = await serve_in_tasks(nursery, server)
    statuses = []
    for port in (in_tasks, server.port):
        async with RawClient.connect(port) as client:
            client.h2.send_headers(1, headers_for(V2 + "ServerLive"))
            client.h2.send_data(1, grpc_message(LIVE) * 2, end_stream=True)
            await client.read_until(lambda: 1 in client.ended)
        assert 1 not in client.data
        statuses.append((client.status(1), client.headers[1].get("grpc-message")))
    assert statuses[0] == statuses[1]
    assert statuses[1][0] == str(int(StatusCode.INVALID_ARGUMENT))
    assert call_tasks.started == 2


def echo_request(value: int) -> bytes:
    request = pb.ModelInferRequest(model_name="echo")
    encode_inputs(request, [("x", np.full(3, value, dtype=np.int32))], raw=True)
    return request.SerializeToString()


async def test_immediate_calls_between_model_calls_in_one_read_each_get_their_own_answer(
    server: RunningServer, call_tasks: CallTasks
) -> None:
    expected: dict[int, Callable[[RawClient, int], None]] = {}

    def echoed(value: int) -> Callable[[RawClient, int], None]:
        def check(client: RawClient, stream: int) -> None:
            response = pb.ModelInferResponse.FromString(client.message(stream))
            np.testing.assert_array_equal(decode_outputs(response)["x"], np.full(3, value))

        return check

    def ready(client: RawClient, stream: int) -> None:
        assert pb.ModelReadyResponse.FromString(client.message(stream)).ready

    def live(client: RawClient, stream: int) -> None:
        assert pb.ServerLiveResponse.FromString(client.message(stream)).live

    def missing(client: RawClient, stream: int) -> None:
        assert client.status(stream) == "5"
        assert stream not in client.data

    async with RawClient.connect(server.port) as client:
        for i in range(40):
            stream = 2 * i + 1
            kind = i % 4
            if kind == 0:
                client.call(stream, V2 + "ModelInfer", echo_request(i))
                expected[stream] = echoed(i)
            elif kind == 1:
                client.call(stream, V2 + "ServerLive", LIVE)
                expected[stream] = live
            elif kind == 2:
                request = pb.ModelReadyRequest(name="echo").SerializeToString()
                client.call(stream, V2 + "ModelReady", request)
                expected[stream] = ready
            else:
                request = pb.ModelReadyRequest(name=f"none-{i}").SerializeToString()
                client.call(stream, V2 + "ModelReady", request)
                expected[stream] = missing
        await client.read_until(lambda: client.ended >= set(expected))
    for stream, check in expected.items():
        if check is not missing:
            assert client.status(stream) == "0", (stream, client.headers.get(stream))
        check(client, stream)
    assert call_tasks.started == 10  # the model calls'


async def test_many_immediate_calls_beside_model_calls_on_one_grpcio_channel(
    server: RunningServer,
) -> None:
    def run() -> None:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            infer = channel.unary_unary(V2 + "ModelInfer")
            ready = channel.unary_unary(V2 + "ModelReady")
            live = channel.unary_unary(V2 + "ServerLive")
            calls = []
            for i in range(60):
                calls.append(("infer", i, infer.future(echo_request(i), timeout=TIMEOUT)))
                request = pb.ModelReadyRequest(name="echo").SerializeToString()
                calls.append(("ready", i, ready.future(request, timeout=TIMEOUT)))
                calls.append(("live", i, live.future(LIVE, timeout=TIMEOUT)))
            for kind, i, future in calls:
                answer = future.result()
                if kind == "infer":
                    response = pb.ModelInferResponse.FromString(answer)
                    np.testing.assert_array_equal(decode_outputs(response)["x"], np.full(3, i))
                elif kind == "ready":
                    assert pb.ModelReadyResponse.FromString(answer).ready
                else:
                    assert pb.ServerLiveResponse.FromString(answer).live

    await trio.to_thread.run_sync(run)


async def test_calls_after_the_clients_goaway_are_refused_and_those_before_answered(
    server: RunningServer, call_tasks: CallTasks
) -> None:
    async with RawClient.connect(server.port) as client:
        client.call(1, V2 + "ServerLive", LIVE)
        before = client.h2.data_to_send()
        client.call(3, V2 + "ServerLive", LIVE)
        after = client.h2.data_to_send()
        # The client's GOAWAY between the two, in the same write (by hand: h2 would send
        # nothing after it).
        goaway = frame(0x7, 0x0, 0, bytes(8))
        await client.stream.send_all(before + goaway + after)
        await client.read_until(lambda: {1, 3} <= client.ended)
    assert client.status(1) == "0"
    assert pb.ServerLiveResponse.FromString(client.message(1)).live
    assert client.status(3) == str(int(StatusCode.UNAVAILABLE))
    assert 3 not in client.data
    assert call_tasks.started == 0


async def test_calls_that_come_after_the_drains_goaway_are_refused(
    server: RunningServer, call_tasks: CallTasks
) -> None:
    # A model call whose message is announced and not sent keeps the connection in flight
    # through the drain; ServerLive after the GOAWAY is refused, as before; the model call
    # then ends as usual.
    body = grpc_message(echo_request(7))
    async with RawClient.connect(server.port) as client:
        client.call(1, V2 + "ServerLive", LIVE)
        client.h2.send_headers(3, headers_for(V2 + "ModelInfer"))
        client.h2.send_data(3, body[:5])
        await client.read_until(lambda: 1 in client.ended)
        await eventually(lambda: call_tasks.started == 1)
        # Queued now, sent after the GOAWAY.
        client.call(5, V2 + "ServerLive", LIVE)
        client.h2.send_data(3, body[5:], end_stream=True)
        late = client.h2.data_to_send()
        server.shutdown()
        await client.read_until(lambda: client.goaway)
        await client.stream.send_all(late)
        await client.read_until(lambda: {3, 5} <= client.ended)
    assert client.status(1) == "0"
    assert client.status(5) == str(int(StatusCode.UNAVAILABLE))
    assert 5 not in client.data
    assert client.status(3) == "0"
    response = pb.ModelInferResponse.FromString(client.message(3))
    np.testing.assert_array_equal(decode_outputs(response)["x"], np.full(3, 7))
    assert call_tasks.started == 1


BUDGET = 1024 * 1024


def admission_of(server: RunningServer) -> tuple[int, int]:
    """The bytes reserved in ``server``'s memory budget, and the requests waiting for room."""
    statistics = server.statistics().admission
    return statistics.reserved_bytes, statistics.waiting


async def hold_most_of_the_budget(server: RunningServer, holder: RawClient) -> None:
    """A model call on ``holder``'s stream 1 that announces 300 KiB and holds 900 KiB of the
    budget (its announced size three times) while it waits for its message."""
    holder.h2.send_headers(1, headers_for(V2 + "ModelInfer"))
    holder.h2.send_data(1, b"\x00" + (300 * 1024).to_bytes(4, "big"))
    await holder.flush()
    await eventually(lambda: admission_of(server)[0] >= 900 * 1024)


async def wait_for_room(server: RunningServer, waiter: RawClient) -> None:
    """A model call on ``waiter``'s stream 1 waiting for room in the budget that
    :func:`hold_most_of_the_budget` left."""
    waiter.h2.send_headers(1, headers_for(V2 + "ModelInfer"))
    waiter.h2.send_data(1, b"\x00" + (50 * 1024).to_bytes(4, "big"))
    await waiter.flush()
    await eventually(lambda: admission_of(server)[1] == 1)


@contextlib.asynccontextmanager
async def budget_held(nursery: trio.Nursery) -> AsyncIterator[tuple[RunningServer, RawClient]]:
    """A server whose budget one model call holds most of while a second waits for room (each
    on a connection of its own), and a third connection to probe it on."""
    server = await start_server(nursery, memory_budget=BUDGET, max_connection_bytes=BUDGET)
    async with (
        RawClient.connect(server.port) as holder,
        RawClient.connect(server.port) as waiter,
        RawClient.connect(server.port) as prober,
    ):
        await hold_most_of_the_budget(server, holder)
        await wait_for_room(server, waiter)
        yield server, prober


async def call_in_pieces(client: RawClient, stream_id: int, method: str, message: bytes) -> None:
    """Send a call in three pieces, each read and handled by the server before the next is
    sent: its HEADERS, then its message's prefix and first half, then the rest and
    END_STREAM."""
    framed = grpc_message(message)
    half = 5 + len(message) // 2
    client.h2.send_headers(stream_id, headers_for(method))
    await client.read_past()
    client.h2.send_data(stream_id, framed[:half])
    await client.read_past()
    client.h2.send_data(stream_id, framed[half:], end_stream=True)
    await client.flush()


LIVENESS = health_pb2.HealthCheckRequest(service="liveness").SerializeToString()
SERVING = health_pb2.HealthCheckResponse.ServingStatus.SERVING


async def test_an_immediate_call_is_answered_while_model_requests_wait_for_room_in_the_budget(
    nursery: trio.Nursery, call_tasks: CallTasks
) -> None:
    # One call holds most of the budget, a second waits for room: a ServerLive (a probe, its
    # message already read) is answered at once, as over REST, not queued behind them, where a
    # Kubernetes probe's timeout would pass and its pod be restarted for being busy.
    async with budget_held(nursery) as (server, prober):
        prober.call(1, V2 + "ServerLive", LIVE)
        await prober.flush()
        await prober.read_until(lambda: 1 in prober.ended)
        assert admission_of(server)[1] == 1  # the model request still waits
        assert call_tasks.started == 2  # the model requests'
    assert prober.status(1) == "0"
    assert pb.ServerLiveResponse.FromString(prober.message(1)).live


async def test_a_probe_whose_request_comes_in_pieces_waits_for_no_room_in_the_budget(
    nursery: trio.Nursery, call_tasks: CallTasks
) -> None:
    # A probe's request that comes in pieces runs in a task: the task takes room only if there
    # is some now, as the transport does answering at once, and never waits behind the model
    # requests waiting for memory (it waited in the queue, and was answered only once the
    # model request ahead of it gave up after max_wait).
    async with budget_held(nursery) as (server, prober):
        await call_in_pieces(prober, 1, CHECK, LIVENESS)
        await prober.read_until(lambda: 1 in prober.ended)
        assert admission_of(server)[1] == 1  # the model request still waits
        assert call_tasks.started == 3  # the model requests', and the probe's
    assert prober.status(1) == "0"
    assert health_pb2.HealthCheckResponse.FromString(prober.message(1)).status == SERVING


@pytest.mark.parametrize("pieces", [False, True], ids=["whole", "in-pieces"])
async def test_a_probe_past_its_connections_share_of_the_budget_is_refused(
    nursery: trio.Nursery, pieces: bool
) -> None:
    # Room is never waited for, but a share is a share: a probe whose bytes would take its
    # connection past --max-connection-bytes is refused, answered at once or in a task.
    server = await start_server(nursery, memory_budget=BUDGET, max_connection_bytes=940 * 1024)
    # 15 KB: three times that takes the 900 KiB held past 940 KiB, not the budget past 1 MiB.
    large = health_pb2.HealthCheckRequest(service="x" * 15_000).SerializeToString()
    async with RawClient.connect(server.port) as client:
        await hold_most_of_the_budget(server, client)
        if pieces:
            await call_in_pieces(client, 3, CHECK, large)
        else:
            client.call(3, CHECK, large)
        await client.read_until(lambda: 3 in client.ended)
    assert client.status(3) == str(int(StatusCode.RESOURCE_EXHAUSTED))
    assert "max-connection-bytes" in client.headers[3]["grpc-message"]
    assert 3 not in client.data


# -- the transport's contract, with handlers of the test's own ---------------------------------


async def serve_methods(
    nursery: trio.Nursery, immediate: dict[str, Immediate], *, access_log: bool = False
) -> tuple[int, list[tuple[str, bytes]]]:
    """A GrpcServer whose handler echoes each call's message (and records it), with
    ``immediate``; its port and the handler's record."""
    handled: list[tuple[str, bytes]] = []

    async def echo(call: Call) -> None:
        message = await call.receive_message()
        assert message is not None
        handled.append((call.method, bytes(message)))
        await call.send_message(bytes(message), last=True)

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    server = GrpcServer(echo, immediate=immediate, access_log=access_log)
    await nursery.start(server.serve, listeners)
    port: int = listeners[0].socket.getsockname()[1]
    return port, handled


async def test_an_immediate_handler_that_fails_answers_internal(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture, call_tasks: CallTasks
) -> None:
    def boom(call: Call, length: int) -> bytes:
        call.receive_message_nowait()
        raise RuntimeError("a bug")

    def refused(call: Call, length: int) -> bytes:
        raise Overloaded("not now")

    port, handled = await serve_methods(nursery, {"/t.S/Boom": boom, "/t.S/Refused": refused})
    failed = await trio.to_thread.run_sync(unary, port, "/t.S/Boom", b"x")
    assert (failed.code, failed.details) == (grpc.StatusCode.INTERNAL, "internal server error")
    assert any(r.getMessage() == "unexpected error in /t.S/Boom" for r in caplog.records)
    overloaded = await trio.to_thread.run_sync(unary, port, "/t.S/Refused", b"x")
    assert (overloaded.code, overloaded.details) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "not now")
    assert handled == []
    assert call_tasks.started == 0


async def test_an_immediate_handler_that_would_wait_leaves_the_call_to_a_task(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture, call_tasks: CallTasks
) -> None:
    def later(call: Call, length: int) -> bytes | None:
        assert length == 5
        return None

    def now(call: Call, length: int) -> bytes:
        call.subject = "s"
        call.trailing_metadata = (("x-t", "1"),)
        return bytes(call.receive_message_nowait()).upper()

    caplog.set_level(logging.INFO, logger="trio_infer.access")
    port, handled = await serve_methods(
        nursery, {"/t.S/Later": later, "/t.S/Now": now}, access_log=True
    )
    waited = await trio.to_thread.run_sync(unary, port, "/t.S/Later", b"hello")
    answered = await trio.to_thread.run_sync(unary, port, "/t.S/Now", b"hello")
    assert waited.message == b"hello"
    assert handled == [("/t.S/Later", b"hello")]
    assert answered.message == b"HELLO"
    assert ("x-t", "1") in answered.trailing
    assert call_tasks.started == 1
    logged = [
        (r.method, r.model, r.status, r.bytes_in, r.bytes_out)  # type: ignore[attr-defined]
        for r in caplog.records
        if r.name == "trio_infer.access"
    ]
    # bytes_out counts the answer's 5-byte prefix too, as for every call.
    assert logged == [("/t.S/Later", "", "OK", 5, 10), ("/t.S/Now", "s", "OK", 5, 10)]


@pytest.mark.parametrize("window", [100, 1 << 20])
async def test_an_immediate_answer_is_sent_at_once_only_when_the_clients_windows_take_it(
    nursery: trio.Nursery, call_tasks: CallTasks, window: int
) -> None:
    # 200 KiB: larger than a frame (sent by reference, in several), and than a window of 100.
    large = bytes(range(256)) * 800

    def big(call: Call, length: int) -> bytes:
        call.receive_message_nowait()
        return large

    port, _ = await serve_methods(nursery, {"/t.S/Big": big})
    settings = {
        h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: window,
        h2.settings.SettingCodes.MAX_FRAME_SIZE: (1 << 24) - 1,
    }
    async with RawClient.connect(port, settings) as client:
        client.h2.increment_flow_control_window(window)  # the connection's, as the stream's
        client.call(1, "/t.S/Big", b"x")
        await client.read_until(lambda: 1 in client.ended)
    assert client.status(1) == "0"
    assert client.message(1) == large
    assert call_tasks.started == (window < len(large))


async def test_an_infer_error_from_an_immediate_handler_is_the_calls_status(
    nursery: trio.Nursery,
) -> None:
    def missing(call: Call, length: int) -> bytes:
        call.receive_message_nowait()
        call.trailing_metadata = (("x-why", "gone"),)
        raise InferError("no such thing", StatusCode.NOT_FOUND)

    port, _ = await serve_methods(nursery, {"/t.S/Missing": missing})
    outcome = await trio.to_thread.run_sync(unary, port, "/t.S/Missing", b"")
    assert (outcome.code, outcome.details) == (grpc.StatusCode.NOT_FOUND, "no such thing")
    assert ("x-why", "gone") in outcome.trailing


async def test_a_call_whose_deadline_passed_while_the_calls_before_it_were_answered_fails(
    nursery: trio.Nursery, mock_clock: trio.testing.MockClock, call_tasks: CallTasks
) -> None:
    # Two calls in one read, each with a deadline of 1 s; answering one takes 2 s of the clock
    # (a jump: work, not a wait). The first is answered; by the second's turn its deadline has
    # passed, and it ends DEADLINE_EXCEEDED, as its task would entering its deadline's scope.
    mock_clock.rate = 1.0

    def slow(call: Call, length: int) -> bytes:
        mock_clock.jump(2.0)
        return bytes(call.receive_message_nowait())

    port, handled = await serve_methods(nursery, {"/t.S/Slow": slow})
    async with RawClient.connect(port) as client:
        for stream_id in (1, 3):
            client.call(stream_id, "/t.S/Slow", b"x", extra=(("grpc-timeout", "1S"),))
        await client.read_until(lambda: {1, 3} <= client.ended)
    assert client.status(1) == "0"
    assert client.message(1) == b"x"
    assert client.status(3) == str(int(StatusCode.DEADLINE_EXCEEDED))
    assert 3 not in client.data
    assert handled == []
    assert call_tasks.started == 1


# -- the memory budget without waiting --------------------------------------------------------


async def test_reserve_nowait_grants_what_reserve_grants_at_once_and_nothing_else() -> None:
    admission = Admission(1000, max_waiting_bytes=1000, max_owner_bytes=600)
    first = admission.reserve_nowait(500, "a")
    assert first is not None
    assert admission.statistics().reserved_bytes == 500
    with pytest.raises(Overloaded, match="max-connection-bytes"):
        admission.reserve_nowait(200, "a")  # past its owner's share, as reserve refuses it
    with pytest.raises(Overloaded):
        admission.reserve_nowait(2000)  # past the whole budget
    assert admission.reserve_nowait(600, "b") is None  # reserve would wait for room
    async with trio.open_nursery() as nursery:
        # A request waiting for room: nothing is granted past it, however small.
        nursery.start_soon(_hold, admission, 600, "c")
        await eventually(lambda: admission.statistics().waiting == 1)
        assert admission.reserve_nowait(0, "d") is None
        first.release()
        await eventually(lambda: admission.statistics().waiting == 0)
    assert admission.reserve_nowait(0, "d") is None  # room now, but no bytes to hold
    assert admission.statistics().reserved_bytes == 0


async def test_a_reservation_that_never_waits_holds_what_reserve_nowait_would_or_nothing() -> None:
    admission = Admission(1000, max_waiting_bytes=1000, max_owner_bytes=600)
    async with admission.reserve(500, math.inf, "a", wait=False) as first:
        assert (first.granted, first.nbytes) == (500, 500)
        with pytest.raises(Overloaded, match="max-connection-bytes"):
            async with admission.reserve(200, math.inf, "a", wait=False):
                pass  # past its owner's share: refused, as reserve refuses it
        async with admission.reserve(600, math.inf, "b", wait=False) as none:
            # reserve would wait for room: held without it, and nothing to give back
            assert (none.granted, none.nbytes) == (0, 0)
            assert (admission.statistics().reserved_bytes, admission.statistics().waiting) == (
                500,
                0,
            )
    assert admission.statistics().reserved_bytes == 0


async def _hold(admission: Admission, nbytes: int, owner: str) -> None:
    async with admission.reserve(nbytes, math.inf, owner):
        pass
