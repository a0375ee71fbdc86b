"""TLS and mutual TLS against a real server: grpcio secure channels, tritonclient's ``ssl=True``,
the bundled client, and clients that must be refused without harm to the others.

Certificates are made for each test by trustme: a CA that signs the server's certificate (for
127.0.0.1 and localhost), a client CA that signs the clients' certificates, and a rogue CA that
the server does not trust.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import ssl
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import h2.config
import h2.connection
import h2.events
import httpx
import numpy as np
import pytest
import trio
import tritonclient.grpc as triton
import trustme

from tests.support import GrpcioClient, eventually, start_server
from trio_infer.client import InferenceClient
from trio_infer.errors import Unavailable
from trio_infer.protobuf._proto import grpc_predict_v2_pb2 as pb
from trio_infer.protobuf._proto import grpc_predict_v2_pb2_grpc, health_pb2_grpc
from trio_infer.protobuf.codec import decode_outputs, encode_inputs, encode_parameters
from trio_infer.server import RunningServer

A = np.arange(16, dtype=np.float32).reshape(1, 16)
B = np.full((1, 16), 0.5, dtype=np.float32)
#: What the server logs when a TLS handshake fails (trio_infer.transport.grpc_server).
HANDSHAKE_FAILED = "closed a connection whose TLS handshake did not complete"


@dataclass(frozen=True)
class Identity:
    """A certificate chain and its key, as PEM files."""

    cert: Path
    key: Path


@dataclass(frozen=True)
class Pki:
    server_ca: Path
    server: Identity
    client_ca: Path
    client: Identity
    rogue: Identity


def _identity(ca: trustme.CA, folder: Path, name: str, *identities: str) -> Identity:
    issued = ca.issue_cert(*identities)
    identity = Identity(folder / f"{name}.pem", folder / f"{name}-key.pem")
    for number, blob in enumerate(issued.cert_chain_pems):
        blob.write_to_path(str(identity.cert), append=number > 0)
    issued.private_key_pem.write_to_path(str(identity.key))
    return identity


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    server_ca, client_ca, rogue_ca = trustme.CA(), trustme.CA(), trustme.CA()
    server_ca.cert_pem.write_to_path(str(tmp_path / "server-ca.pem"))
    client_ca.cert_pem.write_to_path(str(tmp_path / "client-ca.pem"))
    return Pki(
        server_ca=tmp_path / "server-ca.pem",
        server=_identity(server_ca, tmp_path, "server", "127.0.0.1", "localhost"),
        client_ca=tmp_path / "client-ca.pem",
        client=_identity(client_ca, tmp_path, "client", "client@example.com"),
        rogue=_identity(rogue_ca, tmp_path, "rogue", "client@example.com"),
    )


@pytest.fixture
def server_logs(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.DEBUG, logger="trio_infer")
    return caplog


async def start_tls_server(nursery: trio.Nursery, pki: Pki, **options: Any) -> RunningServer:
    """A server with one worker and the test PKI's server identity, started with ``options``."""
    return await start_server(
        nursery, workers=1, tls_cert=pki.server.cert, tls_key=pki.server.key, **options
    )


@pytest.fixture
async def tls_server(nursery: trio.Nursery, pki: Pki) -> RunningServer:
    return await start_tls_server(nursery, pki)


@pytest.fixture
async def mtls_server(nursery: trio.Nursery, pki: Pki) -> RunningServer:
    return await start_tls_server(nursery, pki, tls_client_ca=pki.client_ca)


class SecureClient(GrpcioClient):
    """grpcio stubs on a secure channel that trusts the server's CA, with a client identity
    for mutual TLS."""

    def __init__(self, port: int, pki: Pki, identity: Identity | None = None) -> None:
        credentials = grpc.ssl_channel_credentials(
            root_certificates=pki.server_ca.read_bytes(),
            private_key=identity.key.read_bytes() if identity else None,
            certificate_chain=identity.cert.read_bytes() if identity else None,
        )
        self.channel = grpc.secure_channel(f"127.0.0.1:{port}", credentials)
        self.stub = grpc_predict_v2_pb2_grpc.GRPCInferenceServiceStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)


@pytest.fixture
def clients() -> Iterator[list[GrpcioClient]]:
    """Closes the grpcio clients a test appends."""
    made: list[GrpcioClient] = []
    yield made
    for client in made:
        client.channel.close()


def _add_sub_request() -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="add_sub")
    encode_inputs(request, [("INPUT0", A), ("INPUT1", B)], raw=True)
    return request


async def _assert_serves(client: GrpcioClient) -> None:
    assert (await client.call("ServerLive", pb.ServerLiveRequest(), timeout=10)).live
    response = await client.call("ModelInfer", _add_sub_request(), timeout=10)
    outputs = decode_outputs(response)
    np.testing.assert_array_equal(outputs["OUTPUT0"], A + B)
    np.testing.assert_array_equal(outputs["OUTPUT1"], A - B)


def _no_warnings_or_errors(logs: pytest.LogCaptureFixture) -> list[str]:
    return [
        f"{record.levelname} {record.name}: {record.getMessage()}"
        for record in logs.records
        if record.levelno >= logging.WARNING
    ]


async def _handshake_failures_logged(logs: pytest.LogCaptureFixture, count: int) -> None:
    def logged() -> bool:
        failures = [r for r in logs.records if r.getMessage() == HANDSHAKE_FAILED]
        assert all(r.levelno == logging.DEBUG for r in failures)
        return len(failures) >= count

    await eventually(logged)


# -- TLS ----------------------------------------------------------------------------------------


async def test_a_grpcio_secure_channel_calls_server_live_and_model_infer(
    tls_server: RunningServer, pki: Pki, clients: list[GrpcioClient]
) -> None:
    client = SecureClient(tls_server.port, pki)
    clients.append(client)
    await _assert_serves(client)


async def test_tritonclient_with_ssl_is_ready_and_infers(
    tls_server: RunningServer, pki: Pki
) -> None:
    report = await trio.to_thread.run_sync(
        _triton_calls, tls_server.port, {"root_certificates": str(pki.server_ca)}
    )
    assert report == {"ready": True, "sum_ok": True}


def _triton_calls(port: int, tls: dict[str, str]) -> dict[str, Any]:
    client = triton.InferenceServerClient(f"127.0.0.1:{port}", ssl=True, **tls)
    try:
        inputs = [triton.InferInput(name, [1, 16], "FP32") for name in ("INPUT0", "INPUT1")]
        inputs[0].set_data_from_numpy(A)
        inputs[1].set_data_from_numpy(B)
        result = client.infer("add_sub", inputs, client_timeout=10)
        return {
            "ready": client.is_server_ready(client_timeout=10),
            "sum_ok": bool(np.array_equal(result.as_numpy("OUTPUT0"), A + B)),
        }
    finally:
        client.close()


async def test_the_server_negotiates_h2_and_tls_1_2_or_newer(
    tls_server: RunningServer, pki: Pki
) -> None:
    context = ssl.create_default_context(cafile=pki.server_ca)
    context.set_alpn_protocols(["http/1.1", "h2"])
    stream = await trio.open_tcp_stream("127.0.0.1", tls_server.port)
    async with trio.SSLStream(stream, context, server_hostname="127.0.0.1") as tls:
        await tls.do_handshake()
        assert tls.selected_alpn_protocol() == "h2"
        assert tls.version() in ("TLSv1.2", "TLSv1.3")


async def test_a_plaintext_client_on_the_tls_port_fails_cleanly_and_the_server_keeps_serving(
    tls_server: RunningServer,
    pki: Pki,
    clients: list[GrpcioClient],
    server_logs: pytest.LogCaptureFixture,
) -> None:
    bystander = SecureClient(tls_server.port, pki)
    clients.append(bystander)
    await _assert_serves(bystander)

    plaintext = GrpcioClient(tls_server.port)
    clients.append(plaintext)
    error = await plaintext.error("ServerLive", pb.ServerLiveRequest(), timeout=10)
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    # The HTTP/2 preface by hand, as a client with prior knowledge would send it.
    async with await trio.open_tcp_stream("127.0.0.1", tls_server.port) as raw:
        await raw.send_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes(64))
        await _read_until_closed(raw)

    await _assert_serves(bystander)
    await _handshake_failures_logged(server_logs, 2)
    assert _no_warnings_or_errors(server_logs) == []


async def _read_until_closed(stream: trio.SocketStream) -> None:
    """Read until the server closes the connection (a TLS alert may come first)."""
    with trio.fail_after(10):
        try:
            while await stream.receive_some(4096):
                pass
        except trio.BrokenResourceError:
            pass  # reset: closed with bytes unread


@pytest.mark.parametrize("stage", ["tcp-only", "tls-without-preface"])
async def test_the_handshake_timeout_covers_the_tls_handshake_and_the_preface(
    nursery: trio.Nursery, pki: Pki, stage: str
) -> None:
    server = await start_tls_server(nursery, pki, handshake_timeout=0.2)
    stream = await trio.open_tcp_stream("127.0.0.1", server.port)
    if stage == "tcp-only":
        await _read_until_closed(stream)
        await stream.aclose()
        return
    context = ssl.create_default_context(cafile=pki.server_ca)
    context.set_alpn_protocols(["h2"])
    async with trio.SSLStream(stream, context, server_hostname="127.0.0.1") as tls:
        await tls.do_handshake()
        with trio.fail_after(10):
            # The server's SETTINGS, then nothing: the connection is closed, with close_notify
            # (a TCP end without one would raise BrokenResourceError here).
            while await tls.receive_some(4096):
                pass


# -- mutual TLS ---------------------------------------------------------------------------------


async def test_mtls_serves_a_client_certificate_from_the_client_ca(
    mtls_server: RunningServer, pki: Pki, clients: list[GrpcioClient]
) -> None:
    client = SecureClient(mtls_server.port, pki, pki.client)
    clients.append(client)
    await _assert_serves(client)


async def test_mtls_refuses_clients_without_a_certificate_or_with_another_cas(
    mtls_server: RunningServer,
    pki: Pki,
    clients: list[GrpcioClient],
    server_logs: pytest.LogCaptureFixture,
) -> None:
    bystander = SecureClient(mtls_server.port, pki, pki.client)
    clients.append(bystander)
    await _assert_serves(bystander)

    for identity in (None, pki.rogue):
        refused = SecureClient(mtls_server.port, pki, identity)
        clients.append(refused)
        error = await refused.error("ServerLive", pb.ServerLiveRequest(), timeout=10)
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        await _assert_serves(bystander)

    await _handshake_failures_logged(server_logs, 2)
    assert _no_warnings_or_errors(server_logs) == []


async def test_tritonclient_with_a_client_certificate_is_ready_and_infers(
    mtls_server: RunningServer, pki: Pki
) -> None:
    tls = {
        "root_certificates": str(pki.server_ca),
        "private_key": str(pki.client.key),
        "certificate_chain": str(pki.client.cert),
    }
    report = await trio.to_thread.run_sync(_triton_calls, mtls_server.port, tls)
    assert report == {"ready": True, "sum_ok": True}


# -- the bundled client -------------------------------------------------------------------------


def _client_context(pki: Pki, identity: Identity | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=pki.server_ca)
    context.set_alpn_protocols(["h2"])
    if identity is not None:
        context.load_cert_chain(identity.cert, identity.key)
    return context


async def test_the_bundled_client_connects_with_tls(tls_server: RunningServer, pki: Pki) -> None:
    async with InferenceClient.connect(
        "127.0.0.1", tls_server.port, ssl_context=_client_context(pki)
    ) as client:
        assert await client.server_live(timeout=10)
        result = await client.infer("add_sub", {"INPUT0": A, "INPUT1": B}, timeout=10)
        np.testing.assert_array_equal(result["OUTPUT1"], A - B)


async def test_the_bundled_client_with_a_client_certificate_is_served_under_mtls(
    mtls_server: RunningServer, pki: Pki
) -> None:
    context = _client_context(pki, pki.client)
    async with InferenceClient.connect("127.0.0.1", mtls_server.port, ssl_context=context) as c:
        result = await c.infer("add_sub", {"INPUT0": A, "INPUT1": B}, timeout=10)
        np.testing.assert_array_equal(result["OUTPUT0"], A + B)


async def test_the_bundled_client_refused_by_mtls_or_distrusting_the_server_is_unavailable(
    mtls_server: RunningServer, pki: Pki
) -> None:
    distrusting = ssl.create_default_context()  # the system's CAs: not the test's server CA
    for context in (_client_context(pki), _client_context(pki, pki.rogue), distrusting):
        with pytest.raises(Unavailable, match=r"cannot connect to 127\.0\.0\.1:"):
            async with InferenceClient.connect(
                "127.0.0.1", mtls_server.port, ssl_context=context
            ) as client:
                await client.server_live(timeout=10)


async def test_the_bundled_client_reports_a_servers_tls_alert_as_unavailable(pki: Pki) -> None:
    # trio-infer does not send its alert (Trio's SSLStream drops it with the connection); this
    # server does, after a TLS 1.3 handshake the client already took as done: the alert comes
    # as the client's first read.
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(pki.server.cert, pki.server.key)
    context.load_verify_locations(pki.client_ca)
    context.verify_mode = ssl.CERT_REQUIRED
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(10)
        server = threading.Thread(target=_refuse_one_client, args=(listener, context))
        server.start()
        try:
            with trio.fail_after(10), pytest.raises(Unavailable) as refused:
                async with InferenceClient.connect(
                    "127.0.0.1", listener.getsockname()[1], ssl_context=_client_context(pki)
                ):
                    pass
        finally:
            await trio.to_thread.run_sync(server.join)
    assert refused.value.message.endswith(": TLS failed: TLSV13_ALERT_CERTIFICATE_REQUIRED")


def _refuse_one_client(listener: socket.socket, context: ssl.SSLContext) -> None:
    """Refuse one client's TLS handshake with an alert, on blocking sockets."""
    connection, _ = listener.accept()
    with connection:
        connection.settimeout(10)
        incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        tls = context.wrap_bio(incoming, outgoing, server_side=True)
        while True:
            try:
                tls.do_handshake()
            except ssl.SSLWantReadError:
                pass
            except ssl.SSLError:
                break  # refused: the alert is queued
            connection.sendall(outgoing.read())
            data = connection.recv(65536)
            if not data:
                return
            incoming.write(data)
        connection.sendall(outgoing.read())
        # Open until the client closes: closed now, the connection could be reset before the
        # client reads the alert.
        while connection.recv(65536):
            pass


# -- the end of a client's input ------------------------------------------------------------------


def _sleep_call_then_tcp_half_close(port: int, context: ssl.SSLContext) -> dict[str, str]:
    """Over TLS: a call to ``sleep`` (300 ms), then a TCP half-close without TLS's
    close_notify (as a client process shutting its socket does); the call's status."""
    request = pb.ModelInferRequest(model_name="sleep")
    encode_inputs(request, [("x", np.zeros(1, np.float32))], raw=True)
    encode_parameters(request.parameters, {"delay_ms": 300})
    message = request.SerializeToString()
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    client.send_headers(
        1,
        [
            (":method", "POST"),
            (":scheme", "https"),
            (":path", "/inference.GRPCInferenceService/ModelInfer"),
            (":authority", "127.0.0.1"),
            ("te", "trailers"),
            ("content-type", "application/grpc"),
        ],
    )
    client.send_data(1, b"\x00" + len(message).to_bytes(4, "big") + message, end_stream=True)
    status: dict[str, str] = {}
    with context.wrap_socket(
        socket.create_connection(("127.0.0.1", port)), server_hostname="127.0.0.1"
    ) as sock:
        sock.settimeout(10)
        sock.sendall(client.data_to_send())
        with socket.socket(fileno=os.dup(sock.fileno())) as same:
            same.shutdown(socket.SHUT_WR)
        while chunk := sock.recv(65536):
            for event in client.receive_data(chunk):
                if isinstance(event, h2.events.TrailersReceived):
                    status.update((n.decode(), v.decode()) for n, v in event.headers)
    return status


async def test_calls_in_flight_are_answered_after_a_tcp_half_close_under_tls(
    tls_server: RunningServer, pki: Pki
) -> None:
    status = await trio.to_thread.run_sync(
        _sleep_call_then_tcp_half_close, tls_server.port, _client_context(pki)
    )
    assert status.get("grpc-status") == "0", status


async def test_a_rest_client_that_closes_with_close_notify_cancels_its_worker_call(
    tls_server: RunningServer, pki: Pki
) -> None:
    # A TLS client closing sends close_notify first: bytes on the socket, as a pipelined
    # request would be, then the TCP end. The end still cancels the request it left running.
    tcp = await trio.open_tcp_stream("127.0.0.1", tls_server.http_port)
    context = ssl.create_default_context(cafile=pki.server_ca)
    stream = trio.SSLStream(tcp, context, server_hostname="127.0.0.1")
    body = json.dumps(
        {
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1.0]}],
            "parameters": {"delay_ms": 20_000},
        }
    ).encode()
    await stream.send_all(
        b"POST /v2/models/sleep/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    await eventually(lambda: tls_server.statistics().pool.busy == 1)
    await stream.aclose()  # close_notify, then the socket's end
    # The call is stopped (its worker killed) long before its 20 s would end.
    await eventually(lambda: tls_server.statistics().pool.busy == 0, within=5)
    assert tls_server.statistics().admission.reserved_bytes == 0


def _frame(kind: int, flags: int, stream_id: int, payload: bytes) -> bytes:
    header = len(payload).to_bytes(3, "big") + bytes([kind, flags])
    return header + stream_id.to_bytes(4, "big") + payload


async def _goaway_after_a_protocol_error(port: int, context: ssl.SSLContext) -> bytes | None:
    """Send the preface, SETTINGS and, at once, a DATA frame on stream 0 (a connection error);
    read to the end: the GOAWAY frame's payload the server sent, or None."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    received = bytearray()
    async with trio.SSLStream(stream, context, server_hostname="127.0.0.1") as tls:
        await tls.send_all(
            b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + _frame(0x4, 0, 0, b"") + _frame(0x4, 1, 0, b"")
        )
        await tls.send_all(_frame(0x0, 0, 0, b"x"))
        with trio.fail_after(10):
            while True:
                try:
                    chunk = await tls.receive_some(65536)
                except trio.BrokenResourceError:
                    break
                if not chunk:
                    break
                received += chunk
    return _goaway(received)


def _goaway(received: bytes | bytearray) -> bytes | None:
    """The payload of the GOAWAY frame among the HTTP/2 frames ``received``, or None."""
    received = bytearray(received)
    while len(received) >= 9:
        length = int.from_bytes(received[:3], "big")
        if received[3] == 0x7:
            return bytes(received[9 : 9 + length])
        del received[: 9 + length]
    return None


async def test_a_protocol_error_under_tls_is_answered_with_goaway_however_the_writer_was_busy(
    tls_server: RunningServer, pki: Pki
) -> None:
    # The server's first writes (its SETTINGS, in the TLS handshake's wake) may be under way when
    # the error is read: the GOAWAY must still be sent after them, not lost with a TLS stream
    # that a write cut off mid-way has broken. Many connections, so that some meet a busy writer.
    context = ssl.create_default_context(cafile=pki.server_ca)
    context.set_alpn_protocols(["h2"])
    for _ in range(20):
        goaway = await _goaway_after_a_protocol_error(tls_server.port, context)
        assert goaway is not None
        assert int.from_bytes(goaway[4:8], "big") == 0x1  # PROTOCOL_ERROR


# -- the server's end of a connection: close_notify ---------------------------------------------

#: A client's HTTP/2 preface, its SETTINGS and its ACK of the server's.
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + _frame(0x4, 0, 0, b"") + _frame(0x4, 1, 0, b"")
_LIVE = b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n"


def _connect(port: int, context: ssl.SSLContext, data: bytes = b"") -> ssl.SSLSocket:
    """A TLS connection (handshake done) that has sent ``data``. Its reads raise
    ``ssl.SSLEOFError`` at a TCP end that no close_notify came before (Python's default would
    read a clean end)."""
    sock = context.wrap_socket(
        socket.create_connection(("127.0.0.1", port)),
        server_hostname="127.0.0.1",
        suppress_ragged_eofs=False,
    )
    sock.sendall(data)
    return sock


def _read_to_the_end(sock: ssl.SSLSocket) -> bytes:
    """Everything the server sends until its close_notify; then the socket is closed."""
    received = bytearray()
    with sock:
        while chunk := sock.recv(65536):
            received += chunk
    return bytes(received)


def _exchange(port: int, context: ssl.SSLContext, data: bytes) -> bytes:
    return _read_to_the_end(_connect(port, context, data))


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", 200),
        (b"GET /v2/health/live HTTP/1.0\r\n\r\n", 200),
        (b"NOT HTTP\r\n\r\n", 400),
        # Most of the head is never read: TLS records the client sent are left unread.
        (b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n", 431),
        # Answered from the head: the body's records are left unread.
        (
            b"POST /v2/models/echo/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000000\r\n\r\n"
            + b"x" * 100_000,
            413,
        ),
    ],
    ids=["connection-close", "http-1.0", "bad-request", "head-too-large", "body-too-large"],
)
async def test_a_rest_connection_closed_after_its_answer_ends_with_close_notify(
    tls_server: RunningServer, pki: Pki, request_bytes: bytes, status: int
) -> None:
    context = ssl.create_default_context(cafile=pki.server_ca)
    received = await trio.to_thread.run_sync(
        _exchange, tls_server.http_port, context, request_bytes
    )
    assert received.startswith(f"HTTP/1.1 {status} ".encode()), received[:100]


@pytest.mark.parametrize("request_bytes", [_LIVE, b""], ids=["after-a-request", "no-request"])
async def test_a_rest_connection_left_idle_is_closed_with_close_notify(
    nursery: trio.Nursery, pki: Pki, request_bytes: bytes
) -> None:
    # With no request, the server has written nothing: TLS 1.3's session tickets, which Trio
    # holds back until the first write, must go before the alert, or the client cannot read it.
    server = await start_tls_server(nursery, pki, idle_timeout=0.2, handshake_timeout=1.0)
    context = ssl.create_default_context(cafile=pki.server_ca)
    received = await trio.to_thread.run_sync(_exchange, server.http_port, context, request_bytes)
    assert received.startswith(b"HTTP/1.1 200 ") if request_bytes else received == b""


@pytest.mark.parametrize(
    ("overrides", "data", "error_code"),
    [
        ({"idle_timeout": 0.2}, b"", 0x0),
        ({"max_connection_age": 0.2}, b"", 0x0),
        ({}, _frame(0x0, 0, 0, b"x"), 0x1),  # DATA on stream 0: PROTOCOL_ERROR
    ],
    ids=["idle-timeout", "max-connection-age", "protocol-error"],
)
async def test_a_grpc_connection_closed_after_goaway_ends_with_close_notify(
    nursery: trio.Nursery, pki: Pki, overrides: dict[str, float], data: bytes, error_code: int
) -> None:
    server = await start_tls_server(nursery, pki, **overrides)
    received = await trio.to_thread.run_sync(
        _exchange, server.port, _client_context(pki), _H2_PREFACE + data
    )
    goaway = _goaway(received)
    assert goaway is not None
    assert int.from_bytes(goaway[4:8], "big") == error_code


def _read_at_least(sock: ssl.SSLSocket, size: int) -> bytes:
    received = bytearray()
    while len(received) < size:
        chunk = sock.recv(65536)
        assert chunk, "the server closed the connection"
        received += chunk
    return bytes(received)


def _idle_rest_connection(port: int, context: ssl.SSLContext) -> ssl.SSLSocket:
    """A keep-alive connection that has had its request answered."""
    sock = _connect(port, context, _LIVE)
    assert _read_at_least(sock, 1).startswith(b"HTTP/1.1 200 ")  # one TLS record
    return sock


def _idle_grpc_connection(port: int, context: ssl.SSLContext) -> tuple[ssl.SSLSocket, bytes]:
    """A connection that has sent its preface and received the server's first frames (so the
    server's side of the TLS handshake is done), and those frames."""
    sock = _connect(port, context, _H2_PREFACE)
    return sock, _read_at_least(sock, 9)


async def test_a_drain_ends_idle_tls_connections_with_close_notify_though_no_client_reads(
    pki: Pki,
) -> None:
    # The clients neither read more nor close until the server has stopped: the alert's send
    # and the wait for the client's end are bounded, and many such connections hold no drain
    # up.
    rest_context = ssl.create_default_context(cafile=pki.server_ca)
    rest: list[ssl.SSLSocket] = []
    grpc_: list[tuple[ssl.SSLSocket, bytes]] = []
    async with trio.open_nursery() as nursery:
        server = await start_tls_server(nursery, pki)
        for _ in range(8):
            rest.append(
                await trio.to_thread.run_sync(_idle_rest_connection, server.http_port, rest_context)
            )
            grpc_.append(
                await trio.to_thread.run_sync(
                    _idle_grpc_connection, server.port, _client_context(pki)
                )
            )
        server.shutdown()
    for sock in rest:
        assert await trio.to_thread.run_sync(_read_to_the_end, sock) == b""
    for sock, first in grpc_:
        goaway = _goaway(first + await trio.to_thread.run_sync(_read_to_the_end, sock))
        assert goaway is not None
        assert int.from_bytes(goaway[4:8], "big") == 0x0  # NO_ERROR


async def test_the_metrics_port_stays_plaintext_for_a_scraper_without_certificates(
    nursery: trio.Nursery, pki: Pki
) -> None:
    server = await start_tls_server(nursery, pki, tls_client_ca=pki.client_ca, metrics_port=0)
    async with httpx.AsyncClient() as plain:
        scraped = await plain.get(f"http://127.0.0.1:{server.metrics_port}/metrics")
        assert scraped.status_code == 200
        assert "trio_infer_model_ready" in scraped.text
        # The REST port speaks only TLS, and under mutual TLS only to a client certificate.
        with pytest.raises(httpx.TransportError):
            await plain.get(f"http://127.0.0.1:{server.http_port}/metrics")
