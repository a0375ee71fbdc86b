"""``--max-connection-age``: connections retired at their age so that clients rebalance.

The pure rule (when a connection is due, spread at random) on its own; then the gRPC transport
with a real grpcio client (GOAWAY, reconnection, the grace of the calls in flight), the HTTP
transport with httpx (``Connection: close``, idle connections closed), and the option wired
through a real server (a raw HTTP/2 client sees the GOAWAY).

Ages are short (0.2-0.3 s) so that a test sees several connections in a second or two.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import AsyncIterator, Iterator

import grpc
import h2.config
import h2.connection
import httpx
import hyperframe.frame
import pytest
import trio
import trio.testing

from tests.support import start_server
from tests.test_shutdown import frames
from trio_infer.cli import main
from trio_infer.transport.connection_age import AGE_JITTER, retirement_time
from trio_infer.transport.grpc_server import Call, GrpcServer, ProtocolLimits
from trio_infer.transport.http_server import HttpLimits, HttpRequest, HttpServer

AGE = 0.3
#: Long enough for several retirements at AGE.
LOOP = 1.5
TIMEOUT = 10


# -- the rule --------------------------------------------------------------------------------


def test_no_age_means_never() -> None:
    assert retirement_time(12.0, None) == math.inf


def test_the_age_is_spread_by_ten_percent_either_way() -> None:
    assert AGE_JITTER == 0.1
    assert retirement_time(100.0, 10.0, lambda low, high: low) == pytest.approx(109.0)
    assert retirement_time(100.0, 10.0, lambda low, high: high) == pytest.approx(111.0)
    drawn = [retirement_time(0.0, 10.0, random.Random(seed).uniform) for seed in range(200)]
    assert all(9.0 <= due <= 11.0 for due in drawn)
    # Spread over the whole range: connections opened together are not retired together.
    assert min(drawn) < 9.2
    assert max(drawn) > 10.8


# -- gRPC ------------------------------------------------------------------------------------


class Recorder:
    """A handler that records the connection of every call: ``Echo`` answers its message,
    ``Sleep`` sleeps for the seconds its message says (``inf``: until cancelled)."""

    def __init__(self) -> None:
        self.connections: list[int] = []
        self.sleeping = trio.Event()

    async def __call__(self, call: Call) -> None:
        data = await call.receive_message()
        assert data is not None
        self.connections.append(call.connection_id)
        if call.method.endswith("/Sleep"):
            self.sleeping.set()
            await trio.sleep(float(data))
        await call.send_message(data)


async def _grpc_server(
    nursery: trio.Nursery, recorder: Recorder, limits: ProtocolLimits
) -> tuple[GrpcServer, int]:
    server = GrpcServer(recorder, limits)
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    await nursery.start(server.serve, listeners)
    return server, listeners[0].socket.getsockname()[1]


@pytest.fixture
def channel_factory() -> Iterator[list[grpc.Channel]]:
    channels: list[grpc.Channel] = []
    yield channels
    for channel in channels:
        channel.close()


def _channel(channels: list[grpc.Channel], port: int) -> grpc.Channel:
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    channels.append(channel)
    return channel


# One loop: the GOAWAY often comes between two calls, with none in flight (the connection is
# closed at once). Four: calls are always in flight, and some start while the GOAWAY travels.
@pytest.mark.parametrize("loops", [1, 4])
async def test_a_busy_grpc_channel_reconnects_at_the_age_and_no_call_fails(
    nursery: trio.Nursery, channel_factory: list[grpc.Channel], loops: int
) -> None:
    recorder = Recorder()
    _, port = await _grpc_server(nursery, recorder, ProtocolLimits(max_connection_age=AGE))
    echo = _channel(channel_factory, port).unary_unary("/test.Service/Echo")
    answered = 0

    def loop() -> None:
        nonlocal answered
        end = time.monotonic() + LOOP
        while time.monotonic() < end:
            assert echo(b"ping", timeout=TIMEOUT) == b"ping"
            answered += 1

    async with trio.open_nursery() as callers:
        for _ in range(loops):
            callers.start_soon(trio.to_thread.run_sync, loop)
    assert answered == len(recorder.connections)
    # One connection at a time, replaced every 0.27-0.33 s (and a moment to reconnect).
    assert 3 <= len(set(recorder.connections)) <= LOOP / (AGE * (1 - AGE_JITTER)) + 1


async def test_a_client_still_sending_when_its_connection_is_retired_is_not_reset(
    nursery: trio.Nursery,
) -> None:
    # A grpc client sends new calls until it has read the GOAWAY. Had the server closed its
    # socket with those bytes unread, or closed it before they came, its host would answer
    # with a reset, which can cost the client the GOAWAY and fail those calls instead of
    # retrying them ("broken pipe"). The server half-closes and reads until the client closes.
    _, port = await _grpc_server(nursery, Recorder(), ProtocolLimits(max_connection_age=AGE))
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    await stream.send_all(client.data_to_send())
    received = bytearray()
    with trio.fail_after(TIMEOUT):
        while data := await stream.receive_some(65536):
            received += data
        kinds = [type(f) for f in frames(bytes(received))]
        assert hyperframe.frame.GoAwayFrame in kinds
        # The server's side has ended; the client's is open, and what it sends is taken: a
        # reset in answer to the first PING would fail the second (EPIPE).
        for _ in range(2):
            client.ping(b"12345678")
            await stream.send_all(client.data_to_send())
            await trio.testing.wait_all_tasks_blocked()
        assert await stream.receive_some(65536) == b""
    await stream.aclose()


async def test_a_long_call_in_flight_at_the_age_finishes_within_the_grace(
    nursery: trio.Nursery, channel_factory: list[grpc.Channel]
) -> None:
    recorder = Recorder()
    limits = ProtocolLimits(max_connection_age=0.2, max_connection_age_grace=5.0)
    _, port = await _grpc_server(nursery, recorder, limits)
    channel = _channel(channel_factory, port)
    sleep = channel.unary_unary("/test.Service/Sleep")
    echo = channel.unary_unary("/test.Service/Echo")
    results: list[bytes] = []
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as calls:
            calls.start_soon(
                trio.to_thread.run_sync, lambda: results.append(sleep(b"1.0", timeout=TIMEOUT))
            )
            await recorder.sleeping.wait()
            await trio.sleep(0.5)  # past the age: the connection got GOAWAY
            # A new call goes on a new connection while the long one finishes on the old.
            assert await trio.to_thread.run_sync(lambda: echo(b"x", timeout=TIMEOUT)) == b"x"
    assert results == [b"1.0"]
    first, second = recorder.connections
    assert first != second


async def test_a_call_that_outlives_the_grace_ends_with_unavailable(
    nursery: trio.Nursery, channel_factory: list[grpc.Channel]
) -> None:
    recorder = Recorder()
    limits = ProtocolLimits(max_connection_age=0.2, max_connection_age_grace=0.3)
    _, port = await _grpc_server(nursery, recorder, limits)
    sleep = _channel(channel_factory, port).unary_unary("/test.Service/Sleep")
    started = trio.current_time()
    with pytest.raises(grpc.RpcError) as caught:
        await trio.to_thread.run_sync(lambda: sleep(b"inf", timeout=TIMEOUT))
    elapsed = trio.current_time() - started
    error = caught.value
    # Ended by the server at its age (0.18-0.22 s) plus the grace: UNAVAILABLE naming the age,
    # not the client's DEADLINE_EXCEEDED, and not before the grace had passed.
    assert error.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
    assert "maximum age" in error.details()  # type: ignore[attr-defined]
    assert elapsed >= 0.45


# -- HTTP/1.1 --------------------------------------------------------------------------------


async def _connection_id(request: HttpRequest) -> None:
    await request.respond(
        200, [("content-type", "text/plain")], [str(request.connection_id).encode()]
    )


async def _http_server(nursery: trio.Nursery) -> tuple[HttpServer, str]:
    server = HttpServer(_connection_id, HttpLimits(max_connection_age=AGE))
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    await nursery.start(server.serve, listeners)
    return server, f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}"


@pytest.fixture
async def http_client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=TIMEOUT) as client:
        yield client


async def test_a_busy_keep_alive_connection_is_closed_after_the_age(
    nursery: trio.Nursery, http_client: httpx.AsyncClient
) -> None:
    _, url = await _http_server(nursery)
    connections: list[str] = []
    closes = 0
    end = trio.current_time() + LOOP
    while trio.current_time() < end:
        response = await http_client.get(url)
        assert response.status_code == 200
        connections.append(response.text)
        closes += response.headers.get("connection") == "close"
    assert 3 <= len(set(connections)) <= LOOP / (AGE * (1 - AGE_JITTER)) + 1
    # Each connection ended with a Connection: close of the server's (the last one too, if the
    # loop ended right after it).
    assert closes in (len(set(connections)) - 1, len(set(connections)))


async def test_an_idle_keep_alive_connection_ends_with_its_next_response_past_the_age(
    nursery: trio.Nursery, http_client: httpx.AsyncClient
) -> None:
    # Not closed while idle: that would race with a request the client is sending.
    server, url = await _http_server(nursery)
    first = await http_client.get(url)
    assert first.headers.get("connection") != "close"
    await trio.sleep(AGE * (1 + AGE_JITTER) + 0.05)
    assert server.statistics().connections == 1
    second = await http_client.get(url)
    assert (second.text, second.headers.get("connection")) == (first.text, "close")
    third = await http_client.get(url)
    assert third.status_code == 200
    assert third.text != first.text


# -- through the server ----------------------------------------------------------------------


async def test_the_server_options_retire_grpc_and_rest_connections(
    nursery: trio.Nursery, http_client: httpx.AsyncClient
) -> None:
    server = await start_server(
        nursery, workers=1, max_connection_age=AGE, max_connection_age_grace=1.0
    )
    # gRPC: a client that opened a connection and sends nothing gets GOAWAY NO_ERROR at the
    # age (its idle timeout is 300 s).
    stream = await trio.open_tcp_stream("127.0.0.1", server.port)
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    await stream.send_all(client.data_to_send())
    received = bytearray()
    started = trio.current_time()
    with trio.fail_after(TIMEOUT):
        while data := await stream.receive_some(65536):
            received += data
    await stream.aclose()
    assert trio.current_time() - started >= AGE * (1 - AGE_JITTER)
    goaways = [f for f in frames(bytes(received)) if isinstance(f, hyperframe.frame.GoAwayFrame)]
    assert [(g.error_code, g.last_stream_id) for g in goaways] == [(0, 0)]
    # REST: a keep-alive connection's first response past the age says Connection: close.
    url = f"http://127.0.0.1:{server.http_port}/v2/health/live"
    assert (await http_client.get(url)).headers.get("connection") != "close"
    await trio.sleep(AGE * (1 + AGE_JITTER) + 0.05)
    assert (await http_client.get(url)).headers.get("connection") == "close"


@pytest.mark.parametrize(
    "options",
    [
        ["--max-connection-age", "0"],
        ["--max-connection-age", "nan"],
        ["--max-connection-age", "inf"],
        ["--max-connection-age-grace", "5"],
        ["--max-connection-age", "60", "--max-connection-age-grace", "-1"],
    ],
)
def test_invalid_ages_are_refused_at_start(options: list[str]) -> None:
    assert main(["serve", *options]) == 2
