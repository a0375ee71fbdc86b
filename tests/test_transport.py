"""The transport on its own: real sockets, a real grpcio client, handlers written for each test."""

from __future__ import annotations

import concurrent.futures
import functools
import gc
import itertools
import socket
import urllib.parse
from collections.abc import AsyncIterator, Callable
from types import SimpleNamespace
from typing import Any

import grpc
import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
import numpy as np
import pytest
import trio
import trio.testing
from hyperframe.frame import GoAwayFrame

from tests.support import eventually
from trio_infer.errors import InvalidInput, StatusCode
from trio_infer.transport.grpc_server import (
    Call,
    Connection,
    GrpcServer,
    ProtocolLimits,
    _InboundQueue,
)

MiB = 1024 * 1024
LARGE_METADATA = "v" * 20_000


class Harness:
    """A GrpcServer on a loopback port whose handler records what each call saw."""

    def __init__(self, port: int, server: GrpcServer) -> None:
        self.port = port
        self.server = server
        self.cancelled: list[str] = []
        self.sleeping = trio.Event()
        self.cancel_seen = trio.Event()
        self.held = 0
        self.all_held = trio.Event()
        self.hold_count = 0
        self.release = trio.Event()
        self.channel = grpc.insecure_channel(
            f"127.0.0.1:{port}",
            options=[
                ("grpc.max_send_message_length", 128 * MiB),
                ("grpc.max_receive_message_length", 128 * MiB),
            ],
        )

    def method(self, name: str) -> grpc.UnaryUnaryMultiCallable:
        return self.channel.unary_unary(f"/test.Service/{name}")

    async def call(self, name: str, request: bytes, **kwargs: Any) -> Any:
        return await trio.to_thread.run_sync(lambda: self.method(name).with_call(request, **kwargs))

    async def error(self, name: str, request: bytes, **kwargs: Any) -> grpc.RpcError:
        with pytest.raises(grpc.RpcError) as caught:
            await self.call(name, request, **kwargs)
        return caught.value


def make_handler(harness_ref: list[Harness]) -> Callable[[Call], Any]:
    async def handler(call: Call) -> None:
        harness = harness_ref[0]
        method = call.method.rsplit("/", 1)[1]
        data = await call.receive_message()
        assert data is not None
        try:
            if method == "Echo":
                call.initial_metadata = tuple(
                    (f"echo-{name}", value) for name, value in call.metadata
                )
                call.trailing_metadata = (("x-length", str(len(data))),)
                await call.send_message(data)
            elif method == "LargeMetadata":
                call.initial_metadata = (("x-large", LARGE_METADATA),)
                await call.send_message(data)
            elif method == "Parts":
                # Small parts (joined into frames) between large ones (sent from this memory).
                view = memoryview(data)
                cuts = [0, 3, 3 + 70_000, 3 + 70_010, 3 + 70_010 + 65_536, 200_000, len(data)]
                await call.send_message([view[a:b] for a, b in itertools.pairwise(cuts)])
            elif method in ("EchoEach", "EchoEachAlone"):
                # Every request message echoed as it comes, as a stream's answers are sent:
                # with ``alone``, each is written at once rather than by the writer, and the
                # call is idle while it waits for the next (the reader reads it at once).
                alone = method == "EchoEachAlone"
                while data is not None:
                    await call.send_message(data, alone=alone)
                    call.idle = alone
                    data = await call.receive_message()
                    call.idle = False
            elif method == "Invalid":
                raise InvalidInput("input 'x' is wrong")
            elif method == "Crash":
                raise RuntimeError("a bug in the handler")
            elif method == "Sleep":
                harness.sleeping.set()
                await trio.sleep_forever()
            elif method == "Hold":
                # Answered once ``hold_count`` calls wait here together and the test releases them.
                harness.held += 1
                if harness.held == harness.hold_count:
                    harness.all_held.set()
                await harness.release.wait()
                await call.send_message(data)
        except trio.Cancelled:
            harness.cancelled.append(method)
            harness.cancel_seen.set()
            raise

    return handler


@pytest.fixture
async def harness(nursery: trio.Nursery) -> AsyncIterator[Harness]:
    ref: list[Harness] = []
    server = GrpcServer(make_handler(ref), ProtocolLimits(max_message_size=64 * MiB))
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    await nursery.start(server.serve, listeners)
    ref.append(Harness(listeners[0].socket.getsockname()[1], server))
    yield ref[0]
    ref[0].channel.close()


async def test_a_call_returns_its_message_and_metadata_both_ways(harness: Harness) -> None:
    response, call = await harness.call(
        "Echo", b"hello", metadata=(("x-user", "alice"), ("x-token-bin", b"\x00\xff"))
    )
    assert response == b"hello"
    initial = dict(call.initial_metadata())
    assert initial["echo-x-user"] == "alice"
    assert initial["echo-x-token-bin"] == b"\x00\xff"
    assert dict(call.trailing_metadata())["x-length"] == "5"


async def test_a_handler_error_is_the_call_status_and_the_connection_lives_on(
    harness: Harness,
) -> None:
    error = await harness.error("Invalid", b"x")
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == "input 'x' is wrong"
    error = await harness.error("Crash", b"x")
    assert error.code() == grpc.StatusCode.INTERNAL
    assert error.details() == "internal server error"
    response, _ = await harness.call("Echo", b"still here")
    assert response == b"still here"


async def test_the_client_deadline_cancels_the_handler(harness: Harness) -> None:
    error = await harness.error("Sleep", b"x", timeout=0.3)
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # The client's own timer may end its wait a moment before the server's scope (whose
    # deadline counts from the request's arrival) or the client's RST_STREAM cancels the handler.
    with trio.fail_after(10):
        await harness.cancel_seen.wait()
    assert harness.cancelled == ["Sleep"]
    await harness.server.calls_in_flight.wait_idle()


async def test_a_client_cancel_cancels_the_handler(harness: Harness) -> None:
    future = harness.method("Sleep").future(b"x")
    await harness.sleeping.wait()
    future.cancel()
    with trio.fail_after(5):
        await harness.cancel_seen.wait()
        await harness.server.calls_in_flight.wait_idle()
    assert harness.cancelled == ["Sleep"]


async def test_a_closed_connection_cancels_its_calls(harness: Harness) -> None:
    future = harness.method("Sleep").future(b"x")
    await harness.sleeping.wait()
    harness.channel.close()
    with trio.fail_after(5):
        await harness.cancel_seen.wait()
    assert harness.cancelled == ["Sleep"]
    assert future.exception() is not None


async def test_calls_after_cancelled_and_expired_ones_on_a_connection_run_to_their_end(
    harness: Harness,
) -> None:
    # The tasks that ran the cancelled calls run the next ones: each call has its own scope.
    for _ in range(3):
        future = harness.method("Sleep").future(b"x")
        await harness.sleeping.wait()
        harness.sleeping = trio.Event()
        future.cancel()
        error = await harness.error("Sleep", b"x", timeout=0.2)
        assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        # Set by the expired call: the next round's wait is for its own call.
        harness.sleeping = trio.Event()
        await harness.server.calls_in_flight.wait_idle()
        responses = await trio.to_thread.run_sync(
            lambda: [
                f.result() for f in [harness.method("Echo").future(b"%d" % i) for i in range(8)]
            ]
        )
        assert responses == [b"%d" % i for i in range(8)]
    # Each cancelled and each expired call was cancelled in its handler.
    assert harness.cancelled == ["Sleep"] * 6


async def test_the_deadline_of_a_call_that_ended_in_time_does_not_reach_the_next_call(
    harness: Harness,
) -> None:
    # One call at a time: the task that ran the first call, and its scope, run the second.
    response, _ = await harness.call("Echo", b"in time", timeout=2)
    assert response == b"in time"
    harness.hold_count = 1
    future = harness.method("Hold").future(b"held past it")
    await harness.all_held.wait()
    # The first call's deadline passes while the second, which has none, waits.
    await trio.sleep(2.5)
    harness.release.set()
    assert await trio.to_thread.run_sync(future.result) == b"held past it"
    assert harness.cancelled == []
    (connection,) = harness.server._connections
    assert len(connection._idle_runners) == 1


async def test_the_deadline_an_idle_runner_keeps_from_its_call_cancels_only_its_wait(
    harness: Harness,
) -> None:
    # One call at a time: the task that ran the first call waits for the next with its scope,
    # whose deadline is still the first call's.
    response, _ = await harness.call("Echo", b"in time", timeout=1.5)
    assert response == b"in time"
    (connection,) = harness.server._connections
    ((runner, kept),) = connection._idle_runners
    assert kept.deadline < float("inf")
    # The deadline passes while the task waits: its wait is cancelled, and it waits again, in a
    # new scope without a deadline.
    await eventually(lambda: kept.cancel_called)
    await eventually(lambda: [task for task, _ in connection._idle_runners] == [runner])
    ((_, fresh),) = connection._idle_runners
    assert fresh is not kept
    assert fresh.deadline == float("inf")
    # Its next calls, with a deadline and without, run to their end in that scope.
    response, _ = await harness.call("Echo", b"with a deadline", timeout=5)
    assert response == b"with a deadline"
    harness.hold_count = 1
    future = harness.method("Hold").future(b"without one")
    await harness.all_held.wait()
    harness.release.set()
    assert await trio.to_thread.run_sync(future.result) == b"without one"
    assert harness.cancelled == []
    assert connection._idle_runners == [(runner, fresh)]
    assert fresh.deadline == float("inf")
    assert not fresh.cancel_called


def _calls_alive() -> int:
    gc.collect()
    return sum(1 for thing in gc.get_objects() if type(thing) is Call)


async def test_the_tasks_kept_for_a_connections_next_calls_are_bounded_hold_no_call_and_end(
    harness: Harness,
) -> None:
    calls = 40
    harness.hold_count = calls
    pool = concurrent.futures.ThreadPoolExecutor(calls)
    futures = [pool.submit(harness.method("Hold"), b"%d" % i) for i in range(calls)]
    await harness.all_held.wait()
    harness.release.set()
    assert await trio.to_thread.run_sync(lambda: [f.result() for f in futures]) == [
        b"%d" % i for i in range(calls)
    ]
    pool.shutdown()
    await harness.server.calls_in_flight.wait_idle()
    (connection,) = harness.server._connections
    # 40 calls ran at once; as many tasks as the connection keeps wait for the next ones.
    assert len(connection._idle_runners) == 32
    assert _calls_alive() == 0
    harness.channel.close()
    # The idle tasks end with their connection's nursery; the connection is then gone.
    await eventually(lambda: harness.server.statistics().connections == 0)


async def test_an_oversized_message_fails_only_its_own_call(harness: Harness) -> None:
    other = harness.method("Sleep").future(b"x", timeout=20)
    await harness.sleeping.wait()
    error = await harness.error("Echo", b"x" * (65 * MiB))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error.details() == (
        f"request message of {65 * MiB} bytes is larger than the maximum of {64 * MiB} bytes"
    )
    assert not other.done()
    response, _ = await harness.call("Echo", b"after")
    assert response == b"after"
    other.cancel()


async def test_large_messages_cross_both_ways(harness: Harness) -> None:
    for size in (16 * MiB, 40 * MiB):
        payload = bytes(range(256)) * (size // 256)
        response, _ = await harness.call("Echo", payload)
        assert response == payload


async def test_a_message_sent_in_parts_arrives_whole(harness: Harness) -> None:
    payload = np.random.default_rng(5).bytes(3 * MiB)
    response, _ = await harness.call("Parts", payload)
    assert response == payload


async def test_stream_messages_written_at_once_arrive_as_those_the_writer_sends(
    harness: Harness,
) -> None:
    # Small messages (written whole at once) and ones larger than the client's window and the
    # socket's buffers (what one write does not take is left to the writer), in order.
    rng = np.random.default_rng(7)
    messages = [rng.bytes(size) for size in (1, 100, 70_000, 3 * MiB, 5, 1 * MiB, 17)]

    def stream(method: str) -> list[bytes]:
        echo = harness.channel.stream_stream(f"/test.Service/{method}")
        return list(echo(iter(messages)))

    alone = await trio.to_thread.run_sync(stream, "EchoEachAlone")
    by_writer = await trio.to_thread.run_sync(stream, "EchoEach")
    assert alone == by_writer == messages


async def test_the_reader_yields_before_a_read_unless_every_call_is_idle_and_waiting() -> None:
    waiting = _InboundQueue()
    ready = _InboundQueue()
    ready.put(0)

    def at_work(*calls: tuple[bool, _InboundQueue]) -> bool:
        states = {
            stream_id: SimpleNamespace(call=SimpleNamespace(idle=idle, _inbound=inbound))
            for stream_id, (idle, inbound) in enumerate(calls)
        }
        return Connection._calls_at_work(SimpleNamespace(_calls=states))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiting.get)
        await trio.testing.wait_all_tasks_blocked()
        assert waiting.waiting
        assert not ready.waiting
        assert not at_work()
        assert not at_work((True, waiting))
        assert not at_work((True, waiting), (True, waiting))
        # Not idle (a stream with messages in flight), or not waiting (its handler runs).
        assert at_work((False, waiting))
        assert at_work((True, ready))
        assert at_work((True, waiting), (False, waiting))
        waiting.put(1)


async def test_25_concurrent_256k_calls_keep_the_connection(harness: Harness) -> None:
    # h2 3.2.0 used to answer the WINDOW_UPDATEs grpcio sends for just-closed streams with a
    # GOAWAY, failing every call on the connection.
    payload = b"\xab" * (256 * 1024)

    def load() -> list[bytes]:
        with concurrent.futures.ThreadPoolExecutor(25) as pool:
            return list(pool.map(lambda _: harness.method("Echo")(payload), range(200)))

    responses = await trio.to_thread.run_sync(load)
    assert responses == [payload] * 200


async def test_a_client_that_is_not_http2_is_dropped_and_others_served(harness: Harness) -> None:
    def speak_http1() -> None:
        with socket.create_connection(("127.0.0.1", harness.port)) as raw:
            raw.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            raw.settimeout(5)
            while raw.recv(4096):  # the server must close the connection
                pass

    await trio.to_thread.run_sync(speak_http1)
    response, _ = await harness.call("Echo", b"ok")
    assert response == b"ok"


def _raw_h2_exchange(
    port: int,
    requests: list[list[tuple[str, str]]],
    message: bytes = b"x",
    *,
    goaway: bool = False,
) -> list[dict[str, str]]:
    """Send each header list as a call carrying ``message`` on ONE connection, within the
    server's flow-control windows; return the headers and trailers each stream got back
    (``reset`` when it was reset instead).

    Received data is never acknowledged, so the server can send at most the default 64 KiB
    window per stream: a client that stops reading. With ``goaway``, a GOAWAY follows the
    requests at once (h2's own would refuse the answers, so it is sent as a raw frame)."""
    # The client sends the headers exactly as given, invalid ones included.
    connection = h2.connection.H2Connection(
        h2.config.H2Configuration(
            client_side=True, validate_outbound_headers=False, normalize_outbound_headers=False
        )
    )
    connection.initiate_connection()
    answers: dict[int, dict[str, str]] = {}
    unsent: dict[int, bytes] = {}
    for headers in requests:
        stream_id = connection.get_next_available_stream_id()
        answers[stream_id] = {}
        connection.send_headers(stream_id, headers)
        unsent[stream_id] = b"\x00" + len(message).to_bytes(4, "big") + message
    ended: set[int] = set()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(5)
        while len(ended) < len(requests):
            for stream_id, body in list(unsent.items()):
                if stream_id in ended:
                    del unsent[stream_id]
                    continue
                step = min(
                    connection.local_flow_control_window(stream_id),
                    connection.max_outbound_frame_size,
                )
                while body and step > 0:
                    chunk, body = body[:step], body[step:]
                    connection.send_data(stream_id, chunk, end_stream=not body)
                    step = min(
                        connection.local_flow_control_window(stream_id),
                        connection.max_outbound_frame_size,
                    )
                unsent[stream_id] = body
                if not body:
                    del unsent[stream_id]
            sock.sendall(connection.data_to_send())
            if goaway and not unsent:
                sock.sendall(GoAwayFrame(0, last_stream_id=0).serialize())
                goaway = False
            _read_answers(sock, connection, answers, ended)
    return [answers[stream_id] for stream_id in sorted(answers)]


def _read_answers(
    sock: socket.socket,
    connection: h2.connection.H2Connection,
    answers: dict[int, dict[str, str]],
    ended: set[int],
) -> None:
    """Read once from ``sock``: each stream's headers and trailers into ``answers`` (``reset``
    when it was reset), the ids of the streams that ended into ``ended``; then send what the
    client's h2 has to say back.

    Raises:
        ConnectionError: The server closed the connection.
    """
    data = sock.recv(65536)
    if not data:
        raise ConnectionError("the server closed the connection")
    for event in connection.receive_data(data):
        if isinstance(event, h2.events.ResponseReceived | h2.events.TrailersReceived):
            answers[event.stream_id].update(
                (name.decode(), value.decode()) for name, value in event.headers
            )
        if isinstance(event, h2.events.StreamReset):
            answers[event.stream_id]["reset"] = str(event.error_code)
        if isinstance(event, h2.events.StreamEnded | h2.events.StreamReset):
            ended.add(event.stream_id)
    sock.sendall(connection.data_to_send())


GOOD_HEADERS = [
    (":method", "POST"),
    (":scheme", "http"),
    (":path", "/test.Service/Echo"),
    (":authority", "localhost"),
    ("te", "trailers"),
    ("content-type", "application/grpc"),
]


def _late_reader_echo(port: int, message: bytes) -> tuple[bytes, dict[str, str]]:
    """Send one Echo call, wait until the server can do nothing more before reading any of the
    answer, then read it all. Runs in a thread of the server's Trio run."""
    connection = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    connection.local_settings = h2.settings.Settings(
        client=True,
        initial_values={
            h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 16 * MiB,
            h2.settings.SettingCodes.MAX_FRAME_SIZE: 16 * MiB - 1,
        },
    )
    connection.max_inbound_frame_size = (
        16 * MiB - 1
    )  # h2 takes it from the settings only once acknowledged
    connection.initiate_connection()
    connection.increment_flow_control_window(64 * MiB)
    stream_id = connection.get_next_available_stream_id()
    connection.send_headers(stream_id, GOOD_HEADERS)
    body = b"\x00" + len(message).to_bytes(4, "big") + message
    received = bytearray()
    trailers: dict[str, str] = {}
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 * 1024)
        sock.settimeout(5)
        while body:  # the request, as the server's window allows
            while body and connection.local_flow_control_window(stream_id):
                step = min(
                    connection.local_flow_control_window(stream_id),
                    connection.max_outbound_frame_size,
                    len(body),
                )
                connection.send_data(stream_id, body[:step], end_stream=step == len(body))
                body = body[step:]
            sock.sendall(connection.data_to_send())
            if body:
                connection.receive_data(sock.recv(65536))
        # Every task of the server blocked: its answer fills the socket's buffers and waits.
        trio.from_thread.run(trio.testing.wait_all_tasks_blocked)
        while "grpc-status" not in trailers:
            data = sock.recv(1 << 20)
            if not data:
                raise ConnectionError("the server closed the connection")
            for event in connection.receive_data(data):
                if isinstance(event, h2.events.DataReceived):
                    received += event.data
                    connection.acknowledge_received_data(event.flow_controlled_length, stream_id)
                if isinstance(event, h2.events.TrailersReceived):
                    trailers = {name.decode(): value.decode() for name, value in event.headers}
            sock.sendall(connection.data_to_send())
    return bytes(received), trailers


async def test_an_answer_larger_than_the_socket_buffers_arrives_whole_to_a_late_reader(
    harness: Harness,
) -> None:
    # The call ends with most of its answer unsent: what one write does not take is sent by
    # the writer, in order, as the client reads.
    message = np.random.default_rng(6).bytes(3 * MiB)
    received, trailers = await trio.to_thread.run_sync(_late_reader_echo, harness.port, message)
    assert trailers["grpc-status"] == "0"
    assert received == b"\x00" + len(message).to_bytes(4, "big") + message


async def test_a_call_whose_deadline_passed_before_it_ran_never_gets_its_message(
    harness: Harness,
) -> None:
    # HEADERS and DATA in one write: the message is there when the call first runs.
    [answer] = await trio.to_thread.run_sync(
        _raw_h2_exchange, harness.port, [[*GOOD_HEADERS, ("grpc-timeout", "1n")]]
    )
    assert (answer["grpc-status"], answer["grpc-message"]) == ("4", "deadline exceeded")


async def test_calls_handed_to_a_runner_that_waits_with_a_deadline_each_end_as_their_own(
    harness: Harness,
) -> None:
    # The first call leaves its task waiting with its scope, whose deadline is still that
    # call's. The next ones come at once: the first of them, handed to that task, has a deadline
    # already passed, so the scope it is put in is cancelled before the task runs again; the
    # others run in tasks of their own, with a deadline and without.
    with_one = [*GOOD_HEADERS, ("grpc-timeout", "10S")]
    later = [[*GOOD_HEADERS, ("grpc-timeout", "1n")], with_one, GOOD_HEADERS]
    answers = await trio.to_thread.run_sync(
        _calls_after_one_ended, harness.port, len(later), with_one, later
    )
    assert [(answer["grpc-status"], answer.get("grpc-message")) for answer in answers] == [
        ("0", None),
        ("4", "deadline exceeded"),
        ("0", None),
        ("0", None),
    ]


async def test_a_malformed_request_fails_only_its_own_stream(harness: Harness) -> None:
    good = GOOD_HEADERS
    bad_content_type = [(k, "text/plain" if k == "content-type" else v) for k, v in good]
    bad_timeout = [*good, ("grpc-timeout", "soon")]
    huge_timeout = [*good, ("grpc-timeout", "99999999999999999999H")]
    two_content_types = [*good, ("content-type", "application/grpc")]
    answers = await trio.to_thread.run_sync(
        _raw_h2_exchange,
        harness.port,
        [bad_content_type, bad_timeout, huge_timeout, two_content_types, good],
    )
    messages = [urllib.parse.unquote(answer["grpc-message"]) for answer in answers[:4]]
    assert [answer["grpc-status"] for answer in answers[:4]] == [
        str(StatusCode.INVALID_ARGUMENT.value)
    ] * 4
    assert messages[0] == "content-type 'text/plain' is not application/grpc"
    assert messages[1].startswith("grpc-timeout 'soon' is not a gRPC timeout")
    assert messages[2].startswith("grpc-timeout '99999999999999999999...' is not a gRPC timeout")
    assert messages[3] == "content-type appears 2 times; a gRPC call sends it once"
    assert answers[4]["grpc-status"] == "0"


async def test_headers_http2_forbids_reset_only_their_own_stream(harness: Harness) -> None:
    # RFC 9113 §8.1.1: a malformed request is a stream error, not a connection error.
    upper_case_name = [*GOOD_HEADERS, ("X-Upper", "1")]
    connection_specific = [*GOOD_HEADERS, ("connection", "keep-alive")]
    not_utf8 = [*GOOD_HEADERS, ("x-name", b"\xff\xfe")]
    no_path = [(k, v) for k, v in GOOD_HEADERS if k != ":path"]
    answers = await trio.to_thread.run_sync(
        _raw_h2_exchange,
        harness.port,
        [upper_case_name, connection_specific, GOOD_HEADERS, not_utf8, no_path, GOOD_HEADERS],
    )
    protocol_error = {"reset": str(h2.errors.ErrorCodes.PROTOCOL_ERROR)}
    assert [answers[i] for i in (0, 1, 3, 4)] == [protocol_error] * 4
    assert answers[2]["grpc-status"] == answers[5]["grpc-status"] == "0"


def _h2_client() -> h2.connection.H2Connection:
    connection = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    connection.initiate_connection()
    return connection


def _exchange_until_closed(port: int, data: bytes) -> list[object]:
    """Send ``data`` after a client preface on a new connection; return every h2 event the
    server's bytes make until it closes the connection."""
    connection = _h2_client()
    events: list[object] = []
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(5)
        sock.sendall(connection.data_to_send() + data)
        while received := sock.recv(65536):
            try:
                events += connection.receive_data(received)
            except h2.exceptions.ProtocolError:
                break  # h2 refuses what follows the server's GOAWAY; the GOAWAY came first
    return events


def _frames_of_every_kind(port: int) -> dict[int, dict[str, object]]:
    """Three Echo calls on one connection, their frames in the shapes a client may choose:
    plain; HEADERS with priority and DATA with padding; a header block in CONTINUATION frames.
    Return each stream's answer: its message and the fields of its headers and trailers."""
    connection = _h2_client()
    message = b"\x00\x00\x00\x00\x05hello"
    connection.send_headers(1, [*GOOD_HEADERS, ("x-shape", "plain")])
    connection.send_data(1, message, end_stream=True)
    connection.send_headers(3, [*GOOD_HEADERS, ("x-shape", "padded")], priority_weight=42)
    connection.send_data(3, message, end_stream=True, pad_length=7)
    frame_size = connection.max_outbound_frame_size
    connection.max_outbound_frame_size = 32  # splits this stream's header block
    connection.send_headers(5, [*GOOD_HEADERS, ("x-shape", "continued")])
    connection.max_outbound_frame_size = frame_size
    connection.send_data(5, message, end_stream=True)
    answers: dict[int, dict[str, object]] = {1: {}, 3: {}, 5: {}}
    for event in _events_until_ended(port, connection, len(answers)):
        if isinstance(event, h2.events.ResponseReceived | h2.events.TrailersReceived):
            answers[event.stream_id].update(
                (name.decode(), value.decode()) for name, value in event.headers
            )
        elif isinstance(event, h2.events.DataReceived):
            answers[event.stream_id]["message"] = event.data
    return answers


def _events_until_ended(
    port: int, connection: h2.connection.H2Connection, streams: int
) -> list[h2.events.Event]:
    """Send what ``connection`` has queued on a new connection to the server; return the
    events of its answers until ``streams`` streams have ended."""
    events: list[h2.events.Event] = []
    ended = 0
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(5)
        sock.sendall(connection.data_to_send())
        while ended < streams:
            for event in connection.receive_data(sock.recv(65536)):
                events.append(event)
                ended += isinstance(event, h2.events.StreamEnded)
            sock.sendall(connection.data_to_send())
    return events


async def test_frames_in_every_shape_a_client_may_choose_are_read_alike(
    harness: Harness,
) -> None:
    # The frames every call brings are parsed by hand; padded, prioritised and continued ones
    # by hyperframe. Both must read the same calls.
    answers = await trio.to_thread.run_sync(_frames_of_every_kind, harness.port)
    for stream_id, shape in [(1, "plain"), (3, "padded"), (5, "continued")]:
        answer = answers[stream_id]
        assert answer["message"] == b"\x00\x00\x00\x00\x05hello"
        assert (answer["grpc-status"], answer["echo-x-shape"]) == ("0", shape)


def _calls_in_frames(port: int, shapes: dict[str, list[bytes]]) -> dict[str, bytes]:
    """One call per shape on one connection, its request body sent as the shape's DATA frames
    (END_STREAM on the last); return each call's answer, by its shape's name."""
    connection = _h2_client()
    names: dict[int, str] = {}
    for name, frames in shapes.items():
        stream_id = connection.get_next_available_stream_id()
        names[stream_id] = name
        connection.send_headers(stream_id, [*GOOD_HEADERS, ("x-shape", name)])
        for index, frame in enumerate(frames):
            connection.send_data(stream_id, frame, end_stream=index == len(frames) - 1)
    answers = dict.fromkeys(shapes, b"")
    for event in _events_until_ended(port, connection, len(shapes)):
        if isinstance(event, h2.events.DataReceived):
            answers[names[event.stream_id]] += event.data
    return answers


async def test_a_message_length_taken_without_waiting_is_the_one_waited_for(
    nursery: trio.Nursery,
) -> None:
    # receive_message_length_nowait short-cuts receive_message_length for a request whole in
    # hand: in every framing, it gives the same length or nothing, and takes nothing then.
    seen: dict[str, tuple[int | None, int | None, bytes | None, bool]] = {}

    async def handler(call: Call) -> None:
        nowait = call.receive_message_length_nowait()
        length = await call.receive_message_length()
        received = None if length is None else await call.receive_message()
        data = None if received is None else bytes(received)
        seen[dict(call.metadata)["x-shape"]] = (nowait, length, data, call.another_message_nowait())
        await call.send_message(data or b"")

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    await nursery.start(GrpcServer(handler, ProtocolLimits()).serve, listeners)
    message = b"hello"
    framed = b"\x00" + len(message).to_bytes(4, "big") + message
    shapes = {
        "whole": [framed],
        "ended-after": [framed, b""],
        "prefix-apart": [framed[:5], framed[5:]],
        "cut-in-the-prefix": [framed[:2], framed[2:]],
        "cut-in-the-message": [framed[:7], framed[7:]],
        "two-messages": [framed + framed],
        "two-frames-two-messages": [framed, framed],
        "no-message": [b""],
        "empty-message": [b"\x00\x00\x00\x00\x00"],
    }
    answers = await trio.to_thread.run_sync(
        _calls_in_frames, listeners[0].socket.getsockname()[1], shapes
    )
    assert set(seen) == set(shapes)
    for name, (nowait, length, data, another) in seen.items():
        assert nowait is None or nowait == length, name
        expected = b"" if name == "empty-message" else message
        assert data == (None if name == "no-message" else expected), name
        assert another == name.startswith("two"), name
        assert answers[name] == (b"\x00" + len(data or b"").to_bytes(4, "big") + (data or b"")), (
            name
        )
    # The one request whole in hand when its call starts is taken without waiting.
    assert seen["whole"][0] == len(message)
    assert seen["empty-message"][0] == 0


def _frame(kind: int, flags: int, stream_id: int, payload: bytes) -> bytes:
    header = len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream_id.to_bytes(4, "big")
    return header + payload


@pytest.mark.parametrize(
    ("frames", "error"),
    [
        # DATA on stream 0 (RFC 9113 §6.1).
        ([_frame(0x0, 0x1, 0, b"x")], h2.errors.ErrorCodes.PROTOCOL_ERROR),
        # A WINDOW_UPDATE of five bytes (§6.9).
        ([_frame(0x8, 0x0, 0, b"\x00\x00\x00\x01\x00")], h2.errors.ErrorCodes.FRAME_SIZE_ERROR),
        # A WINDOW_UPDATE past the largest window (§6.9.1).
        (
            [_frame(0x8, 0x0, 0, (2**31 - 1).to_bytes(4, "big"))],
            h2.errors.ErrorCodes.FLOW_CONTROL_ERROR,
        ),
        # A frame valid on its own, between a HEADERS frame and the CONTINUATION that should
        # follow it (§6.10).
        (
            [
                _frame(0x1, 0x0, 1, b"\x83"),
                _frame(0x8, 0x0, 0, b"\x00\x00\x00\x01"),
                _frame(0x9, 0x4, 1, b"\x86"),
            ],
            h2.errors.ErrorCodes.PROTOCOL_ERROR,
        ),
    ],
    ids=[
        "data-on-stream-0",
        "short-window-update",
        "window-past-the-largest",
        "window-update-inside-a-header-block",
    ],
)
async def test_frames_http2_forbids_close_the_connection_with_goaway(
    harness: Harness, frames: list[bytes], error: h2.errors.ErrorCodes
) -> None:
    events = await trio.to_thread.run_sync(_exchange_until_closed, harness.port, b"".join(frames))
    goaways = [e for e in events if isinstance(e, h2.events.ConnectionTerminated)]
    assert len(goaways) == 1
    assert goaways[0].error_code == error
    response, _ = await harness.call("Echo", b"still serving")
    assert response == b"still serving"


async def test_response_headers_larger_than_a_frame_arrive_in_continuation_frames(
    harness: Harness,
) -> None:
    # 20 KB of initial metadata cannot fit one 16 KiB frame.
    headers = [(k, "/test.Service/LargeMetadata" if k == ":path" else v) for k, v in GOOD_HEADERS]
    answers = await trio.to_thread.run_sync(_raw_h2_exchange, harness.port, [headers])
    assert (answers[0]["grpc-status"], answers[0]["x-large"]) == ("0", LARGE_METADATA)


async def test_a_client_goaway_lets_its_calls_in_flight_finish(harness: Harness) -> None:
    # RFC 9113 §6.8: a graceful GOAWAY only says the client will start no new calls.
    answers = await trio.to_thread.run_sync(
        functools.partial(_raw_h2_exchange, harness.port, [GOOD_HEADERS], b"bye", goaway=True)
    )
    assert answers[0]["grpc-status"] == "0"


async def serve_echo(nursery: trio.Nursery, limits: ProtocolLimits) -> tuple[GrpcServer, int]:
    """A GrpcServer that echoes each call's message, on a loopback port."""

    async def echo(call: Call) -> None:
        data = await call.receive_message()
        assert data is not None
        await call.send_message(data)

    server = GrpcServer(echo, limits)
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    await nursery.start(server.serve, listeners)
    return server, listeners[0].socket.getsockname()[1]


async def test_streams_over_the_limit_are_refused_not_the_connection(
    nursery: trio.Nursery,
) -> None:
    _, port = await serve_echo(nursery, ProtocolLimits(max_concurrent_streams=2))
    answers = await trio.to_thread.run_sync(_raw_h2_exchange, port, [GOOD_HEADERS] * 3)
    assert [answer.get("grpc-status") for answer in answers[:2]] == ["0", "0"]
    assert answers[2] == {"reset": str(h2.errors.ErrorCodes.REFUSED_STREAM)}


def _calls_after_one_ended(
    port: int,
    count: int,
    first: list[tuple[str, str]] = GOOD_HEADERS,
    later: list[list[tuple[str, str]]] | None = None,
) -> list[dict[str, str]]:
    """On one connection, make one call (with headers ``first``) and read all of its answer
    (its stream is then closed at both ends), then send ``count`` more at once (with the
    headers of ``later``, in order; by default ``GOOD_HEADERS``). Returns the headers and
    trailers each stream got back (``reset`` when it was reset instead), by stream id."""
    connection = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    connection.initiate_connection()
    message = b"\x00\x00\x00\x00\x01x"
    answers: dict[int, dict[str, str]] = {}
    headers = {1: first}
    for index, each in enumerate(later or [GOOD_HEADERS] * count):
        headers[3 + 2 * index] = each
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(5)
        for streams in ([1], [3 + 2 * i for i in range(count)]):
            for stream_id in streams:
                answers[stream_id] = {}
                connection.send_headers(stream_id, headers[stream_id])
                connection.send_data(stream_id, message, end_stream=True)
            sock.sendall(connection.data_to_send())
            ended: set[int] = set()
            while len(ended) < len(streams):
                _read_answers(sock, connection, answers, ended)
            # The client's h2 would not open more streams than the server's limit: it is told
            # of a higher one, so that the server's refusal is what is tested.
            connection.remote_settings[h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS] = count
            connection.remote_settings.acknowledge()
    return [answers[stream_id] for stream_id in sorted(answers)]


async def test_a_stream_that_ended_does_not_count_against_the_limit(
    nursery: trio.Nursery,
) -> None:
    # The ended stream is still among the two streams the server holds when the second call
    # opens: the open ones are counted then, and only the third call is over the limit.
    _, port = await serve_echo(nursery, ProtocolLimits(max_concurrent_streams=2))
    answers = await trio.to_thread.run_sync(_calls_after_one_ended, port, 3)
    assert [answer.get("grpc-status") for answer in answers[:3]] == ["0", "0", "0"]
    assert answers[3] == {"reset": str(h2.errors.ErrorCodes.REFUSED_STREAM)}


async def test_a_deadline_that_passes_while_sending_ends_the_call(harness: Harness) -> None:
    headers = [*GOOD_HEADERS, ("grpc-timeout", "300m")]
    # A 1 MiB answer to a client that reads only 64 KiB: the server waits for window until the
    # deadline, then abandons the half-sent message with RST_STREAM rather than hanging.
    answers = await trio.to_thread.run_sync(_raw_h2_exchange, harness.port, [headers], b"y" * MiB)
    assert answers[0]["reset"] == str(h2.errors.ErrorCodes.CANCEL)
    await harness.server.calls_in_flight.wait_idle()


async def test_a_client_that_stops_reading_is_dropped_after_the_send_timeout(
    nursery: trio.Nursery,
) -> None:
    # No deadline this time: only the send timeout keeps the call (and what it holds) bounded.
    server, port = await serve_echo(nursery, ProtocolLimits(send_timeout=0.3))
    answers = await trio.to_thread.run_sync(_raw_h2_exchange, port, [GOOD_HEADERS], b"z" * MiB)
    assert answers[0]["reset"] == str(h2.errors.ErrorCodes.CANCEL)
    await server.calls_in_flight.wait_idle()


def _stalled_answer_amid_connection_updates(port: int, updates: int) -> str | None:
    """Send a 1 MiB call to an echo server and never open its stream's window again; meanwhile
    send up to ``updates`` connection-level WINDOW_UPDATEs, 0.1 s apart, each of which wakes a
    sender waiting for window but opens none on the stream. The error code of the stream's
    reset, or None if it was not reset while they were sent."""
    connection = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    connection.initiate_connection()
    stream_id = connection.get_next_available_stream_id()
    connection.send_headers(stream_id, GOOD_HEADERS)
    body = b"\x00" + MiB.to_bytes(4, "big") + b"u" * MiB
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(0.1)
        while updates > 0:
            step = min(
                connection.local_flow_control_window(stream_id), connection.max_outbound_frame_size
            )
            if body and step > 0:
                chunk, body = body[:step], body[step:]
                connection.send_data(stream_id, chunk, end_stream=not body)
            elif not body:
                connection.increment_flow_control_window(1)
                updates -= 1
            sock.sendall(connection.data_to_send())
            try:
                data = sock.recv(65536)
            except TimeoutError:
                continue
            if not data:
                raise ConnectionError("the server closed the connection")
            for event in connection.receive_data(data):
                if isinstance(event, h2.events.StreamReset):
                    return str(event.error_code)
    return None


async def test_window_updates_that_open_no_room_do_not_hold_off_the_send_timeout(
    nursery: trio.Nursery,
) -> None:
    # Each connection-level update wakes the call's sender, which finds its stream's window
    # still shut: the send timeout counts from the stall, not from the last wake-up, so the call
    # is dropped 0.3 s in, long before the client's 100 updates (10 s) run out.
    server, port = await serve_echo(nursery, ProtocolLimits(send_timeout=0.3))
    reset = await trio.to_thread.run_sync(_stalled_answer_amid_connection_updates, port, 100)
    assert reset == str(h2.errors.ErrorCodes.CANCEL)
    await server.calls_in_flight.wait_idle()


def _answer_opened_by_settings(port: int) -> tuple[int, str | None]:
    """Send a 1 MiB call to an echo server, the connection's window open wide enough for the
    whole answer but the stream's left at 64 KiB; once the answer has spent that and every task
    of the server is blocked (its sender waiting for the window), raise
    SETTINGS_INITIAL_WINDOW_SIZE, which opens the stream's window (RFC 9113 §6.9.2). No
    WINDOW_UPDATE is ever sent, so the SETTINGS frame alone can wake the sender. The answer's
    bytes received and its grpc-status (None if it did not end). Runs in a thread of the
    server's Trio run."""
    connection = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    connection.initiate_connection()
    connection.increment_flow_control_window(64 * MiB)
    stream_id = connection.get_next_available_stream_id()
    connection.send_headers(stream_id, GOOD_HEADERS)
    body = b"\x00" + MiB.to_bytes(4, "big") + b"s" * MiB
    received, status, opened = 0, None, False
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(5)
        while status is None:
            while body and connection.local_flow_control_window(stream_id):
                step = min(
                    connection.local_flow_control_window(stream_id),
                    connection.max_outbound_frame_size,
                )
                chunk, body = body[:step], body[step:]
                connection.send_data(stream_id, chunk, end_stream=not body)
            sock.sendall(connection.data_to_send())
            if not opened and received >= 65535:  # the stream's first window, all spent
                opened = True
                trio.from_thread.run(trio.testing.wait_all_tasks_blocked)
                connection.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 4 * MiB})
                sock.sendall(connection.data_to_send())
            data = sock.recv(65536)
            if not data:
                break
            for event in connection.receive_data(data):
                if isinstance(event, h2.events.DataReceived):
                    received += len(event.data)
                elif isinstance(event, h2.events.TrailersReceived):
                    status = dict(event.headers).get(b"grpc-status", b"").decode()
    return received, status


async def test_a_settings_frame_that_opens_the_streams_windows_wakes_a_stalled_answer(
    nursery: trio.Nursery,
) -> None:
    _, port = await serve_echo(nursery, ProtocolLimits())
    received, status = await trio.to_thread.run_sync(_answer_opened_by_settings, port)
    assert (received, status) == (5 + MiB, "0")


async def test_shutdown_lets_calls_finish_then_cancels_the_rest(harness: Harness) -> None:
    future = harness.method("Sleep").future(b"x")
    await harness.sleeping.wait()
    await harness.server.shutdown(grace_period=0.2)
    error = await trio.to_thread.run_sync(future.exception)
    assert isinstance(error, grpc.RpcError)
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert "shut down" in error.details()


def test_status_codes_match_grpc() -> None:
    for code in grpc.StatusCode:
        assert StatusCode(code.value[0]).name == code.name
