"""The server's TLS context, built from PEM files, with errors that name the file and the problem.

:func:`server_context` reads a certificate chain, its private key and, for mutual TLS, the CA
certificates that client certificates must chain to. The context it returns is what gRPC over
HTTP/2 requires (RFC 9113 §9.2): TLS 1.2 or newer, ALPN ``h2``, no renegotiation and no
compression, and TLS 1.2 limited to AEAD ciphers with ephemeral key exchange.

The files are checked before OpenSSL sees them, because OpenSSL's own errors do not say which
file is wrong (``[SSL] PEM lib``): a missing file, one that holds no PEM block of the kind
expected (a key given as the certificate, say), a block that does not parse, an encrypted key
(OpenSSL would prompt for its passphrase on the terminal), and a key that does not match the
certificate are each a :class:`TLSFileError` naming the file.

:func:`send_close_notify` ends the server's side of a TLS connection it closes gracefully.
"""

from __future__ import annotations

import contextlib
import re
import ssl
from pathlib import Path
from typing import Literal

import trio

__all__ = [
    "TLSFileError",
    "TLSRole",
    "handshake_completed",
    "send_close_notify",
    "server_context",
]

#: What a file is for: the server's certificate chain, its private key, the client CAs.
TLSRole = Literal["certificate", "key", "client CA"]

#: RFC 9113 §9.2.2 forbids TLS 1.2 cipher suites without ephemeral key exchange or an AEAD
#: cipher (clients may refuse the connection with INADEQUATE_SECURITY). TLS 1.3's suites all
#: qualify and are not affected by this string.
_TLS12_CIPHERS = "ECDHE+AESGCM:ECDHE+CHACHA20:DHE+AESGCM:DHE+CHACHA20:!aNULL"
_CERTIFICATE = re.compile(
    rb"-----BEGIN CERTIFICATE-----\r?\n.*?-----END CERTIFICATE-----", re.DOTALL
)
_PRIVATE_KEY = re.compile(rb"-----BEGIN (?:RSA |EC |DSA |ENCRYPTED )?PRIVATE KEY-----")
_ENCRYPTED_KEY = re.compile(rb"-----BEGIN ENCRYPTED PRIVATE KEY-----|Proc-Type: 4,ENCRYPTED")


class TLSFileError(ValueError):
    """A TLS file is missing, unreadable, or not what its role requires.

    Attributes:
        role: What the file was given as: ``"certificate"``, ``"key"`` or ``"client CA"``.
        path: The file, as it was given.
        problem: What is wrong with it, e.g. ``"no such file"``.
    """

    def __init__(self, role: TLSRole, path: Path, problem: str) -> None:
        super().__init__(f"TLS {role} file {path}: {problem}")
        self.role: TLSRole = role
        self.path = path
        self.problem = problem


def server_context(
    cert_file: Path, key_file: Path, client_ca_file: Path | None = None
) -> ssl.SSLContext:
    """Build the server's TLS context from PEM files.

    Args:
        cert_file: The server's certificate, followed by any intermediate certificates.
        key_file: The certificate's private key (unencrypted).
        client_ca_file: CA certificates that client certificates must chain to. When given,
            every client must present a valid certificate (mutual TLS); otherwise none is asked
            for.

    Returns:
        A server-side context: TLS 1.2 or newer, ALPN ``h2``.

    Raises:
        TLSFileError: A file cannot be read, or does not hold what its role requires, or the
            key does not match the certificate.
    """
    _certificates("certificate", cert_file, _read("certificate", cert_file))
    key = _read("key", key_file)
    if _PRIVATE_KEY.search(key) is None:
        raise TLSFileError("key", key_file, "holds no PEM private key")
    if _ENCRYPTED_KEY.search(key) is not None:
        raise TLSFileError(
            "key", key_file, "is encrypted with a passphrase, which is not supported"
        )

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.options |= ssl.OP_NO_COMPRESSION | ssl.OP_NO_RENEGOTIATION
    # A client's TCP half-close comes without close_notify (HTTP/2 ends with GOAWAY, not TLS
    # alerts): read as the end of its input, not a broken stream, so its calls in flight are
    # still answered. Truncation cannot hide in it: every gRPC message is length-prefixed.
    context.options |= getattr(ssl, "OP_IGNORE_UNEXPECTED_EOF", 0)
    context.set_ciphers(_TLS12_CIPHERS)
    context.set_alpn_protocols(["h2"])
    try:
        # The password callback refuses: without it, OpenSSL would prompt on the terminal for
        # a passphrase that the checks above did not recognise.
        context.load_cert_chain(cert_file, key_file, password=_no_passphrase)
    except ssl.SSLError as exc:
        if exc.reason == "KEY_VALUES_MISMATCH":
            raise TLSFileError(
                "key", key_file, f"does not match the certificate in {cert_file}"
            ) from None
        # The certificates parsed above, so what OpenSSL could not read is the key.
        raise TLSFileError("key", key_file, "holds a malformed private key") from None
    except _PassphraseNeeded:
        raise TLSFileError(
            "key", key_file, "is encrypted with a passphrase, which is not supported"
        ) from None

    if client_ca_file is not None:
        authorities = _certificates("client CA", client_ca_file, _read("client CA", client_ca_file))
        for authority in authorities:
            context.load_verify_locations(cadata=authority)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


class _PassphraseNeeded(Exception):
    pass


def _no_passphrase() -> str:
    raise _PassphraseNeeded


def _read(role: TLSRole, path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise TLSFileError(role, path, "no such file") from None
    except IsADirectoryError:
        raise TLSFileError(role, path, "is a directory, not a file") from None
    except OSError as exc:
        raise TLSFileError(role, path, f"cannot be read ({exc.strerror})") from None


def _certificates(role: TLSRole, path: Path, content: bytes) -> list[bytes]:
    """The DER certificates of a PEM file, each checked to parse."""
    blocks = _CERTIFICATE.findall(content)
    if not blocks:
        if _PRIVATE_KEY.search(content) is not None:
            raise TLSFileError(role, path, "holds a private key but no PEM certificate")
        raise TLSFileError(role, path, "holds no PEM certificate")
    certificates = []
    for number, block in enumerate(blocks, 1):
        try:
            der = ssl.PEM_cert_to_DER_cert(block.decode("ascii"))
            # A scratch context parses it, the one public way to have OpenSSL read a
            # certificate.
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_verify_locations(cadata=der)
        except (ValueError, ssl.SSLError):
            # OpenSSL's reason ("not enough data", "no start line") would not help more.
            raise TLSFileError(
                role, path, f"certificate {number} of {len(blocks)} is malformed"
            ) from None
        certificates.append(der)
    return certificates


def handshake_completed(stream: trio.SSLStream[trio.SocketStream]) -> bool:
    """Whether ``stream``'s TLS handshake has completed."""
    try:
        stream.selected_alpn_protocol()
    except trio.NeedHandshakeError:
        return False
    return True


async def send_close_notify(stream: trio.SSLStream[trio.SocketStream]) -> None:
    """Send TLS's close_notify alert on ``stream``, and leave its socket open.

    RFC 8446 §6.1: each side sends close_notify before it closes its side of the connection,
    unless it has sent an error alert; without one the client sees a truncation ("EOF occurred in
    violation of protocol"). The caller then ends the socket (a linger reads what the client
    still sends) and closes it.

    Nothing is sent when the handshake has not completed (there is no session to close), or
    when the stream is broken: a write cut off mid-record, or a TLS error, after either of
    which the client could not read the alert. A client gone is not reported. No other task
    may be using the stream; a client that reads nothing can hold the send up, so the caller
    bounds it.
    """
    # Trio sends close_notify only from SSLStream.aclose() without https_compatible, which
    # closes the socket right after (no linger); and there, as in SSLStream.unwrap(), the alert
    # is lost when the client has sent records not yet read (a body the server will not read,
    # pipelined requests): Python's SSLObject.unwrap() calls SSL_shutdown a second time, which
    # fails on them (APPLICATION_DATA_AFTER_CLOSE_NOTIFY) after the first queued the alert. So
    # the alert is taken from the stream's SSLObject and sent here, through attributes of
    # Trio's SSLStream that are not its API. A Trio without them gets the close without the
    # alert, as before this existed, rather than an error on every close; the close_notify
    # tests in tests/test_tls.py fail on such a Trio.
    state = getattr(stream, "_state", None)
    ssl_object = getattr(stream, "_ssl_object", None)
    outgoing = getattr(stream, "_outgoing", None)
    if (
        not isinstance(ssl_object, ssl.SSLObject)
        or not isinstance(outgoing, ssl.MemoryBIO)
        or not hasattr(stream, "_delayed_outgoing")
        or getattr(state, "name", None) != "OK"
        or not handshake_completed(stream)
    ):
        return
    # The alert is queued whatever it raises: the client's close_notify has not come
    # (SSLWantReadError), or records the client sent are unread.
    with contextlib.suppress(ssl.SSLError):
        ssl_object.unwrap()
    alert = outgoing.read()
    delayed: bytes | None = stream._delayed_outgoing
    if delayed is not None:
        # TLS 1.3 session tickets, which Trio holds back until the server's first write: the
        # alert's record number counts them, so the client could not decrypt it without them.
        alert = delayed + alert
        stream._delayed_outgoing = None
    with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
        await stream.transport_stream.send_all(alert)
