"""The one load generator used for every server: grpc.aio, or HTTP/1.1 for REST; closed loop.

``concurrency`` coroutines share one channel (one HTTP/2 connection); each sends a call, waits
for its answer, and sends the next, so exactly ``concurrency`` calls are in flight. Calls that
end during the warm-up are discarded. Requests are built once per scenario, so the client's own
cost is the same for every server. REST calls (:class:`RestClient`) run through the same loop,
on keep-alive HTTP/1.1 connections, one per call in flight.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import grpc
import numpy as np
import orjson

from trio_infer.protobuf._proto import grpc_predict_v2_pb2 as pb
from trio_infer.protobuf._proto import grpc_predict_v2_pb2_grpc as pb_grpc
from trio_infer.protobuf.codec import decode_outputs, encode_inputs

#: Upper bound on calls one coroutine sends in one run, whatever the duration.
MAX_CALLS_PER_CLIENT = 2_000_000
#: Channel options: large messages allowed, no transparent retries (errors must show).
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.enable_retries", 0),
]
#: The dense model's weights, as every server computes them.
WEIGHTS = np.random.default_rng(0).standard_normal((256, 256)).astype(np.float32)

Call = Callable[[float], Awaitable[object]]
"""Sends one call with the given timeout (seconds) and returns its response."""


@dataclass(frozen=True)
class Summary:
    """What one window of calls comes to."""

    throughput: float
    """Successful calls per second."""
    p50_ms: float
    p99_ms: float
    """Latency percentiles over successful calls (over every call when none succeeded)."""
    requests: int
    """Calls that ended in the window, whatever their status."""
    errors: dict[str, int]
    """Failed calls by status name."""


@dataclass
class Samples:
    """Calls that ended after the warm-up: start and end (seconds from the end of the warm-up,
    so the measured window is ``[0, duration)``) and status name (``OK`` or a gRPC code).

    ``firsts`` is when the first attempt of the same request started: earlier than the start
    when the call resends a request refused before (``retry_on`` of :func:`closed_loop`).
    """

    duration: float
    starts: list[float] = field(default_factory=list)
    ends: list[float] = field(default_factory=list)
    statuses: list[str] = field(default_factory=list)
    firsts: list[float] = field(default_factory=list)

    def __add__(self, other: Samples) -> Samples:
        """The calls of both, over the same window (clients in two processes)."""
        return Samples(
            self.duration,
            self.starts + other.starts,
            self.ends + other.ends,
            self.statuses + other.statuses,
            self.firsts + other.firsts,
        )

    def in_window(self, start: float, end: float) -> list[int]:
        """Indices of the calls that ended in ``[start, end)``."""
        return [i for i, t in enumerate(self.ends) if start <= t < end]

    def summary(self, start: float = 0.0, end: float | None = None) -> Summary:
        """Throughput, latency percentiles and errors of the calls that ended in a window."""
        end = self.duration if end is None else end
        chosen = self.in_window(start, end)
        statuses = Counter(self.statuses[i] for i in chosen)
        ok = [self.ends[i] - self.starts[i] for i in chosen if self.statuses[i] == "OK"]
        latencies = ok or [self.ends[i] - self.starts[i] for i in chosen]
        p50, p99 = (
            (float(np.percentile(latencies, 50)) * 1e3, float(np.percentile(latencies, 99)) * 1e3)
            if latencies
            else (float("nan"), float("nan"))
        )
        return Summary(
            throughput=len(ok) / (end - start) if end > start else 0.0,
            p50_ms=p50,
            p99_ms=p99,
            requests=len(chosen),
            errors={status: n for status, n in sorted(statuses.items()) if status != "OK"},
        )

    def ok_since_first(self, start: float = 0.0, end: float | None = None) -> tuple[float, float]:
        """p50 and p99 (ms) of the OK calls that ended in a window, each timed from the start
        of its request's first attempt (so including refused attempts and waits between)."""
        end = self.duration if end is None else end
        latencies = [
            self.ends[i] - self.firsts[i]
            for i in self.in_window(start, end)
            if self.statuses[i] == "OK"
        ]
        if not latencies:
            return float("nan"), float("nan")
        return (
            float(np.percentile(latencies, 50)) * 1e3,
            float(np.percentile(latencies, 99)) * 1e3,
        )


def status_of(error: BaseException) -> str:
    """The status name a failed call ends with, as the table shows it."""
    if isinstance(error, grpc.aio.AioRpcError):
        return str(error.code().name)
    if isinstance(error, HttpStatusError):
        return f"HTTP_{error.status}"
    return f"CLIENT_{type(error).__name__}"


def open_channel(target: str) -> grpc.aio.Channel:
    """A fresh channel (one connection) to ``target``."""
    return grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)


def stub_for(channel: grpc.aio.Channel) -> pb_grpc.GRPCInferenceServiceStub:
    """The V2 stub on a channel."""
    return pb_grpc.GRPCInferenceServiceStub(channel)


def infer_serialized_once(channel: grpc.aio.Channel, request: pb.ModelInferRequest) -> Call:
    """ModelInfer with ``request``, serialised once for every attempt.

    The stub serialises its request on every call. For the overload scenarios' 4 MiB request,
    resent after each refusal, that was about 1 ms of this process's CPU per attempt, taken
    from the two cores it shares with the server (measured at ten times the budget's load:
    client CPU 6.6 -> 5.5 s in 10 s, and admitted calls' p50 107 -> 77-92 ms).
    """
    method = channel.unary_unary(
        "/inference.GRPCInferenceService/ModelInfer",
        request_serializer=None,  # bytes are sent as they are
        response_deserializer=pb.ModelInferResponse.FromString,
    )
    data = request.SerializeToString()

    def call(timeout: float) -> Awaitable[object]:
        return method(data, timeout=timeout)

    return call


# ------------------------------------------------------------------------------------------
# Requests


def dense_input(rows: int) -> np.ndarray:
    """The dense model's input for a scenario: ``rows`` x 256 FP32, seed 1."""
    return np.random.default_rng(1).standard_normal((rows, 256)).astype(np.float32)


def infer_request(
    model: str,
    x: np.ndarray,
    *,
    raw: bool,
    delay_ms: int | None = None,
    priority: int = 0,
    input_name: str = "x",
) -> pb.ModelInferRequest:
    """A ModelInfer request with input ``x`` (named ``input_name``), raw or typed, an optional
    ``delay_ms`` and an optional ``priority`` (sent, as Triton's client does, only when not 0)."""
    request = pb.ModelInferRequest(model_name=model)
    encode_inputs(request, [(input_name, x)], raw=raw)
    if delay_ms is not None:
        request.parameters["delay_ms"].int64_param = delay_ms
    if priority:
        request.parameters["priority"].uint64_param = priority
    return request


def outputs_of(response: object) -> dict[str, np.ndarray]:
    """The output tensors of a gRPC or a REST (:class:`RestInferResponse`) inference response."""
    if isinstance(response, RestInferResponse):
        return response.outputs()
    assert isinstance(response, pb.ModelInferResponse)
    return decode_outputs(response)


def check_dense(response: object, x: np.ndarray) -> str:
    """``ok`` when a dense response (gRPC or REST) holds ``tanh(x @ W)``, else what is wrong."""
    try:
        y = outputs_of(response)["y"]
    except Exception as error:
        return f"undecodable: {error}"
    expected = np.tanh(x @ WEIGHTS)
    if y.shape != expected.shape:
        return f"shape {y.shape} != {expected.shape}"
    if not np.allclose(y, expected, rtol=1e-3, atol=1e-4):
        return f"values differ by up to {float(np.abs(y - expected).max()):.3g}"
    return "ok"


def add_sub_inputs() -> tuple[np.ndarray, np.ndarray]:
    """``add_sub``'s two inputs: 1 x 16 FP32 each, seed 2."""
    rng = np.random.default_rng(2)
    return tuple(rng.standard_normal((2, 1, 16)).astype(np.float32))  # type: ignore[return-value]


def add_sub_request(a: np.ndarray, b: np.ndarray) -> pb.ModelInferRequest:
    """A raw ``add_sub`` request with inputs ``INPUT0`` = a and ``INPUT1`` = b."""
    request = pb.ModelInferRequest(model_name="add_sub")
    encode_inputs(request, [("INPUT0", a), ("INPUT1", b)], raw=True)
    return request


def check_output(response: object, name: str, expected: np.ndarray) -> str:
    """``ok`` when output ``name`` of a response holds ``expected`` (FP32 tolerance)."""
    try:
        outputs = outputs_of(response)
    except Exception as error:
        return f"undecodable: {error}"
    if name not in outputs:
        return f"no output {name!r} (outputs {list(outputs)})"
    y = outputs[name]
    if y.size != expected.size or not np.allclose(y.reshape(expected.shape), expected):
        return f"{name} differs"
    return "ok"


def check_add_sub(response: object, a: np.ndarray, b: np.ndarray) -> str:
    """``ok`` when an add_sub response holds ``a + b`` and ``a - b``."""
    for name, expected in (("OUTPUT0", a + b), ("OUTPUT1", a - b)):
        check = check_output(response, name, expected)
        if check != "ok":
            return check
    return "ok"


def check_echo(response: object, x: np.ndarray) -> str:
    """``ok`` when a sleep response echoes ``x`` as output ``x``."""
    try:
        outputs = outputs_of(response)
    except Exception as error:
        return f"undecodable: {error}"
    if "x" not in outputs or not np.array_equal(outputs["x"].reshape(x.shape), x):
        return f"echo differs (outputs {list(outputs)})"
    return "ok"


# ------------------------------------------------------------------------------------------
# Load


@dataclass(frozen=True)
class Action:
    """Something to do once while the load runs, ``at`` seconds after the warm-up."""

    at: float
    run: Callable[[], None]


@dataclass(frozen=True)
class Backoff:
    """How long a client waits before it resends a refused request, as grpcio's retries do
    (gRPC core's ``BackOff``, with the retry filter's jitter of 0.2): the n-th resend waits
    ``min(initial * multiplier ** (n - 1), maximum) * uniform(1 - jitter, 1 + jitter)``
    seconds. The count starts again after a call that was not refused."""

    initial: float = 0.05
    maximum: float = 1.0
    multiplier: float = 2.0
    jitter: float = 0.2

    def delay(self, retry: int, rng: random.Random) -> float:
        """Seconds to wait before the ``retry``-th resend (1 for the first)."""
        backoff = min(self.initial * self.multiplier ** (retry - 1), self.maximum)
        return backoff * rng.uniform(1.0 - self.jitter, 1.0 + self.jitter)


async def closed_loop(
    call: Call,
    *,
    concurrency: int,
    warmup: float = 0.0,
    origin: float | None = None,
    duration: float,
    call_timeout: float,
    actions: Sequence[Action] = (),
    retry_on: Collection[str] = (),
    backoff: Backoff | None = None,
    seed: int = 0,
) -> Samples:
    """Run ``concurrency`` closed-loop clients through a warm-up and a measured window of
    ``duration`` seconds, which starts ``warmup`` seconds from now, or at ``origin`` on
    ``time.perf_counter()``'s clock (to line up with clients in another process).

    No call starts after the window ends; calls in flight then are awaited (each is bounded by
    ``call_timeout``) and, ending after the window, not counted in it. A call that ends with a
    status in ``retry_on`` is resent: its next call is the same request (``Samples.firsts``),
    sent at once, or after a wait by ``backoff`` (never past the window's end), whose jitter
    comes from a generator seeded with ``seed``.
    """
    samples = Samples(duration)
    origin = time.perf_counter() + warmup if origin is None else origin
    stop = origin + duration
    rng = random.Random(seed)

    async def client() -> None:
        first: float | None = None
        retries = 0
        for _ in range(MAX_CALLS_PER_CLIENT):
            started = time.perf_counter()
            if started >= stop:
                return
            first = started if first is None else first
            try:
                await call(call_timeout)
                status = "OK"
            except Exception as error:
                status = status_of(error)
            ended = time.perf_counter()
            if ended >= origin:
                samples.starts.append(started - origin)
                samples.ends.append(ended - origin)
                samples.statuses.append(status)
                samples.firsts.append(first - origin)
            if status not in retry_on:
                first, retries = None, 0
                continue
            retries += 1
            if backoff is not None:
                wait = backoff.delay(retries, rng)
                await asyncio.sleep(max(0.0, min(wait, stop - time.perf_counter())))

    async with asyncio.TaskGroup() as group:
        for _ in range(concurrency):
            group.create_task(client())
        for action in actions:
            group.create_task(_act(origin, action))
    return samples


async def _act(origin: float, action: Action) -> None:
    """Run ``action`` at ``origin + action.at`` on ``time.perf_counter()``'s clock."""
    await asyncio.sleep(max(0.0, origin + action.at - time.perf_counter()))
    action.run()


async def first_fast_call(
    call: Call, *, fast: float, call_timeout: float, limit: float
) -> tuple[float | None, Counter[str]]:
    """Send one call at a time until one succeeds in under ``fast`` seconds.

    Returns:
        Seconds from now until that call ended (None if none did within ``limit`` seconds),
        and the statuses of the calls sent meanwhile.
    """
    begin = time.perf_counter()
    statuses: Counter[str] = Counter()
    for _ in range(1_000_000):
        started = time.perf_counter()
        if started - begin >= limit:
            break
        try:
            await call(min(call_timeout, max(0.001, begin + limit - started)))
            status = "OK"
        except Exception as error:
            status = status_of(error)
        ended = time.perf_counter()
        statuses[status] += 1
        if status == "OK" and ended - started < fast:
            return ended - begin, statuses
        if status != "OK":
            # A server that refuses at once (UNAVAILABLE) must not turn this into a busy loop.
            await asyncio.sleep(0.005)
    return None, statuses


# ------------------------------------------------------------------------------------------
# Streams

#: The decoupled model's response parameter that marks a request's last response.
FINAL = "triton_final_response"


def stream_method(channel: grpc.aio.Channel) -> Any:
    """ModelStreamInfer on a channel: requests go as bytes (serialised by the caller)."""
    return channel.stream_stream(
        "/inference.GRPCInferenceService/ModelStreamInfer",
        request_serializer=None,
        response_deserializer=pb.ModelStreamInferResponse.FromString,
    )


def is_final(response: pb.ModelStreamInferResponse) -> bool:
    """Whether a stream response ends its request: an error, or a response that is not
    marked ``triton_final_response`` false (one response per request carries no mark)."""
    if response.error_message:
        return True
    mark = response.infer_response.parameters.get(FINAL)
    return mark is None or mark.bool_param


async def stream_responses(
    channel: grpc.aio.Channel, request: pb.ModelInferRequest, deadline: float
) -> list[pb.ModelStreamInferResponse]:
    """Send one request alone on a stream of its own (half-closed after it); its responses."""
    message = pb.ModelInferRequest()
    message.CopyFrom(request)
    message.id = "first"
    call = stream_method(channel)(timeout=deadline)
    await call.write(message.SerializeToString())
    await call.done_writing()
    return [response async for response in call]


async def stream_window(
    channel: grpc.aio.Channel,
    request: pb.ModelInferRequest,
    *,
    window: int,
    warmup: float,
    duration: float,
    call_timeout: float,
    actions: Sequence[Action] = (),
) -> tuple[Samples, Samples]:
    """One ModelStreamInfer stream with ``window`` requests in flight: a request is sent
    whenever one has ended (its final response came back, matched by ``id``), through a
    warm-up and a measured window of ``duration`` seconds; ``actions`` run as in
    :func:`closed_loop`.

    Each message is ``request`` with an ``id`` of its own, serialised when it is sent (as the
    stub serialises a unary call's). No request is sent after the window ends; the stream is
    half-closed once those in flight ended.

    Returns:
        The requests that ended after the warm-up (start to final response, status ``OK`` or
        ``STREAM_ERROR`` for an ``error_message``), and the same requests timed from start to
        first response (time to first response of a decoupled model).
    """
    done, first = Samples(duration), Samples(duration)
    origin = time.perf_counter() + warmup
    stop = origin + duration
    slots = asyncio.Semaphore(window)
    pending: dict[str, list[float]] = {}  # id -> [start, first response]
    # The stream's deadline: the whole run and the calls in flight at its end.
    call = stream_method(channel)(timeout=warmup + duration + call_timeout)
    message = pb.ModelInferRequest()
    message.CopyFrom(request)

    def record(start: float, first_at: float, ended: float, status: str) -> None:
        if ended < origin:
            return
        for samples, end in ((done, ended), (first, first_at)):
            samples.starts.append(start - origin)
            samples.ends.append(end - origin)
            samples.statuses.append(status)

    async def writer() -> None:
        for number in range(MAX_CALLS_PER_CLIENT):
            await slots.acquire()
            started = time.perf_counter()
            if started >= stop:
                break
            message.id = str(number)
            data = message.SerializeToString()
            pending[message.id] = [started, 0.0]
            await call.write(data)
        for _ in range(window - 1):  # holding one slot: the others come back as requests end
            await slots.acquire()
        await call.done_writing()

    async def reader() -> None:
        async for response in call:
            now = time.perf_counter()
            entry = pending.get(response.infer_response.id)
            if entry is None:
                continue  # not ours (no id): cannot be matched
            entry[1] = entry[1] or now
            if is_final(response):
                del pending[response.infer_response.id]
                status = "STREAM_ERROR" if response.error_message else "OK"
                record(entry[0], entry[1], now, status)
                slots.release()
        # The server ended the stream with requests in flight: they failed; let the writer see.
        now = time.perf_counter()
        for start, first_at in pending.values():
            record(start, first_at or now, now, "STREAM_ENDED")
        pending.clear()
        for _ in range(window):
            slots.release()

    try:
        async with asyncio.TaskGroup() as group:
            group.create_task(writer())
            group.create_task(reader())
            for action in actions:
                group.create_task(_act(origin, action))
    except* (grpc.aio.AioRpcError, grpc.aio.UsageError) as failed:
        status = status_of(failed.exceptions[0])
        now = time.perf_counter()
        for start, first_at in pending.values():
            record(start, first_at or now, now, status)
    return done, first


# ------------------------------------------------------------------------------------------
# REST
#
# HTTP/1.1 written and read by hand on asyncio's protocol callbacks, not an HTTP library, so
# that the client is not the ceiling of the rows it measures: against a server that answers at
# once, several times the calls/s of aiohttp, and hundreds of times httpx's (bench/README.md,
# "REST"). Only what the servers benchmarked send is read: a status line, headers and a
# Content-Length or chunked body (KServe's binary responses are chunked); no 1xx responses.

#: The header of Triton's binary tensor extension: the length of the message's JSON part,
#: followed by the tensors' raw bytes.
JSON_LENGTH_HEADER = "Inference-Header-Content-Length"
#: The V2 REST datatypes the benchmark's models answer with, as little-endian numpy dtypes.
REST_DTYPES = {"FP32": "<f4", "FP64": "<f8", "INT32": "<i4", "INT64": "<i8"}


class HttpStatusError(Exception):
    """A REST call answered with a status other than 200 (:func:`status_of`: ``HTTP_<code>``)."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"HTTP {status}: {body[:200]!r}")
        self.status = status


@dataclass(frozen=True)
class HttpResponse:
    """One HTTP response: its status, headers (names in lower case) and body."""

    status: int
    headers: dict[str, str]
    body: bytes


def _parse_head(head: bytes) -> tuple[int, dict[str, str], int | None]:
    """Status, headers and body length of a response head (without its blank line); the
    length is None for a chunked body."""
    status_line, *lines = head.decode("latin-1").split("\r\n")
    status = int(status_line.split(" ", 2)[1])
    headers = {}
    for line in lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    if "chunked" in headers.get("transfer-encoding", "").lower():
        return status, headers, None
    if "content-length" in headers:
        return status, headers, int(headers["content-length"])
    if status in (204, 304):
        return status, headers, 0
    raise ValueError(f"response without Content-Length: {status_line} {headers}")


def _take_chunked(buffer: bytearray) -> bytes | None:
    """A whole chunked body from the start of ``buffer`` (removed from it, trailers dropped),
    or None while some of it has not arrived."""
    parts = []
    position = 0
    while (line_end := buffer.find(b"\r\n", position)) >= 0:
        size = int(bytes(buffer[position:line_end]).partition(b";")[0], 16)
        if size == 0:
            end = buffer.find(b"\r\n\r\n", line_end)  # after the trailers, if any
            if end < 0:
                return None
            del buffer[: end + 4]
            return b"".join(parts)
        start = line_end + 2
        if len(buffer) < start + size + 2:
            return None
        parts.append(bytes(buffer[start : start + size]))
        position = start + size + 2
    return None


class _HttpConnection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection carrying one request at a time (no pipelining)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._buffer = bytearray()
        self._head: tuple[int, dict[str, str], int | None] | None = None
        self._waiter: asyncio.Future[HttpResponse] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Keep the transport to write requests to."""
        # uvloop's transports have the methods but are not asyncio.Transport subclasses.
        self.transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        """Fail the request in flight, if any: its response will not come."""
        self.closed = True
        self._fail(exc or ConnectionResetError("the server closed the connection"))

    def send(self, message: bytes) -> asyncio.Future[HttpResponse]:
        """Write a whole request; the future is its response."""
        assert self.transport is not None
        assert self._waiter is None
        self._waiter = asyncio.get_running_loop().create_future()
        self.transport.write(message)
        return self._waiter

    def close(self) -> None:
        """Close the connection (a request in flight fails)."""
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        """Collect the response: its head, then its body; a response this client cannot read
        fails its call and closes the connection."""
        self._buffer += data
        try:
            response = self._take_response()
        except ValueError as error:
            self._fail(error)
            self.close()
            return
        if response is None:
            return
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(response)

    def _take_response(self) -> HttpResponse | None:
        """The response at the start of the buffer once it is whole (removed from it)."""
        if self._head is None:
            end = self._buffer.find(b"\r\n\r\n")
            if end < 0:
                return None
            self._head = _parse_head(bytes(self._buffer[:end]))
            del self._buffer[: end + 4]
        status, headers, length = self._head
        if length is None:
            body = _take_chunked(self._buffer)
            if body is None:
                return None
        elif len(self._buffer) < length:
            return None
        else:
            body = bytes(self._buffer[:length])
            del self._buffer[:length]
        self._head = None
        return HttpResponse(status, headers, body)

    def _fail(self, error: BaseException) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(error)


class RestClient:
    """Keep-alive HTTP/1.1 connections to one server, as a REST load balancer's pool keeps them.

    A call takes an idle connection, or opens one when none is idle, and gives it back once its
    response is read: ``C`` closed-loop clients keep ``C`` connections, each with one request in
    flight. A connection whose call failed or timed out is closed, never reused (its response
    may still come); so is one the server marks ``Connection: close``.
    """

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self._idle: list[_HttpConnection] = []

    async def __aenter__(self) -> RestClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Close every idle connection (every one, once no call is in flight)."""
        for connection in self._idle:
            connection.close()
        self._idle.clear()

    async def request(self, message: bytes, time_limit: float) -> HttpResponse:
        """Send ``message`` (a whole request, :func:`http_request`) and read its response.

        Raises:
            TimeoutError: No response within ``time_limit`` seconds (connecting included).
            OSError: The connection failed or the server closed it.
            ValueError: The response is not one this client reads (no Content-Length).
        """
        connection = None
        while self._idle and connection is None:
            idle = self._idle.pop()
            connection = None if idle.closed else idle
        try:
            async with asyncio.timeout(time_limit):
                if connection is None:
                    _, connection = await asyncio.get_running_loop().create_connection(
                        _HttpConnection, self.host, self.port
                    )
                response = await connection.send(message)
        except BaseException:
            if connection is not None:
                connection.close()
            raise
        if connection.closed or response.headers.get("connection", "").lower() == "close":
            connection.close()
        else:
            self._idle.append(connection)
        return response


def http_request(
    method: str, path: str, port: int, body: bytes = b"", headers: Mapping[str, str] | None = None
) -> bytes:
    """A whole HTTP/1.1 request to 127.0.0.1:``port``, built once and sent as it is."""
    lines = [f"{method} {path} HTTP/1.1", f"Host: 127.0.0.1:{port}"]
    lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
    if body or method != "GET":
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def rest_infer_body(x: np.ndarray, *, binary: bool) -> tuple[bytes, dict[str, str]]:
    """A V2 REST inference request's body with FP32 input ``x``, and its headers.

    JSON: the tensor's values as a flat ``data`` list (orjson writes each float32's shortest
    form). ``binary``: Triton's binary tensor extension, as ``tritonclient.http`` sends it: the
    input's ``binary_data_size`` in the JSON, its raw little-endian bytes after it, the JSON's
    length in :data:`JSON_LENGTH_HEADER`, and ``binary_data_output`` asking for every output
    in binary too.
    """
    tensor: dict[str, Any] = {"name": "x", "datatype": "FP32", "shape": list(x.shape)}
    if not binary:
        tensor["data"] = x.astype(np.float32).ravel()
        body = orjson.dumps({"inputs": [tensor]}, option=orjson.OPT_SERIALIZE_NUMPY)
        return body, {"Content-Type": "application/json"}
    raw = x.astype("<f4").tobytes()
    tensor["parameters"] = {"binary_data_size": len(raw)}
    header = orjson.dumps({"inputs": [tensor], "parameters": {"binary_data_output": True}})
    return header + raw, {
        "Content-Type": "application/octet-stream",
        JSON_LENGTH_HEADER: str(len(header)),
    }


@dataclass(frozen=True)
class RestInferResponse:
    """A V2 REST inference response: its JSON, parsed, and the raw bytes after it (the binary
    extension's output tensors; empty for a JSON response)."""

    header: dict[str, Any]
    binary: memoryview

    @classmethod
    def parse(cls, response: HttpResponse) -> RestInferResponse:
        """Split and parse a response body (orjson), as a client reading every answer does."""
        body = memoryview(response.body)
        length = response.headers.get(JSON_LENGTH_HEADER.lower())
        if length is None:
            return cls(orjson.loads(body), body[len(body) :])
        return cls(orjson.loads(body[: int(length)]), body[int(length) :])

    def outputs(self) -> dict[str, np.ndarray]:
        """The output tensors by name, from their ``data`` or their binary part."""
        outputs = {}
        offset = 0
        for output in self.header["outputs"]:
            dtype = np.dtype(REST_DTYPES[output["datatype"]])
            size = (output.get("parameters") or {}).get("binary_data_size")
            if size is None:
                array = np.asarray(output["data"], dtype=dtype)
            else:
                array = np.frombuffer(self.binary[offset : offset + size], dtype=dtype)
                offset += size
            outputs[output["name"]] = array.reshape(output["shape"])
        return outputs


def rest_call(rest: RestClient, message: bytes, *, infer: bool) -> Call:
    """A REST call sending ``message``; it fails (:class:`HttpStatusError`) unless answered
    200, and returns the response, parsed as a :class:`RestInferResponse` when ``infer``."""

    async def call(time_limit: float) -> object:
        response = await rest.request(message, time_limit)
        if response.status != 200:
            raise HttpStatusError(response.status, response.body)
        return RestInferResponse.parse(response) if infer else response

    return call
