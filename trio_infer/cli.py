"""The ``trio-infer`` command.

``trio-infer serve [REPOSITORY]`` serves a model repository (the built-in examples when none is
given). The first SIGINT or SIGTERM starts a graceful shutdown; a second one exits at once.

Exit status: 0 after a graceful shutdown; 128 plus the signal's number (130 for SIGINT, 143 for
SIGTERM, as a shell reports a process killed by it) when a second signal cut the shutdown short,
so that a supervisor tells a forced exit from a clean one; 1 when the port cannot be bound; 2 for
a bad option or repository.

Logging: ``--log-level`` sets this server's loggers (``trio_infer.*``); ``--debug`` also puts the
model's traceback in its error messages and, unless ``--log-level`` says otherwise, sets them to
DEBUG. The libraries' loggers (h2, hpack, purerpc, trio-parallel, asyncio...) stay at WARNING
(or ERROR if that is asked for): at DEBUG they log every frame and header they handle.
"""

from __future__ import annotations

import argparse
import gc
import logging
import math
import signal
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import trio

from trio_infer.repository.settings import SettingsError, load_repository

# Worker processes re-import the main script, which for the installed command imports this
# module: the server is imported inside functions so that each worker does not load it too.
if TYPE_CHECKING:
    from trio_infer.server import RunningServer, ServerConfig

logger = logging.getLogger("trio_infer")

_MAX_MESSAGE_SIZE = 1024 * 1024 * 1024
_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_TLS_OPTIONS = {"certificate": "--tls-cert", "key": "--tls-key", "client CA": "--tls-client-ca"}


class _OneLineErrors(argparse.ArgumentParser):
    """argparse, with a bad option or value said in one line (no usage block), exit 2: the
    same as every other invalid value, for logs and scripts that read the last line."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _parser() -> argparse.ArgumentParser:
    from trio_infer.core.service import SERVER_NAME, SERVER_VERSION
    from trio_infer.server import ServerConfig

    parser = _OneLineErrors(
        prog="trio-infer", description="An Open Inference Protocol (KServe V2) gRPC model server."
    )
    parser.add_argument("--version", action="version", version=f"{SERVER_NAME} {SERVER_VERSION}")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve a model repository over gRPC")
    defaults = ServerConfig()
    serve.add_argument(
        "repository",
        nargs="?",
        type=Path,
        default=defaults.repository,
        help="folder with one subfolder per model (default: the built-in examples)",
    )
    serve.add_argument(
        "--host", default=defaults.host, help="address to listen on (default: %(default)s)"
    )
    serve.add_argument(
        "--grpc-port",
        type=int,
        default=defaults.grpc_port,
        help="gRPC port; 0 picks a free port and logs it (default: %(default)s)",
    )
    serve.add_argument(
        "--workers",
        type=int,
        default=defaults.workers,
        help="worker processes that run model code (default: CPU count, %(default)s)",
    )
    serve.add_argument(
        "--grace-period",
        type=float,
        default=defaults.grace_period,
        help="seconds in-flight calls get to finish on shutdown (default: %(default)s)",
    )
    serve.add_argument(
        "--max-message-size",
        type=int,
        default=defaults.max_message_size,
        help="largest request message in bytes (default: %(default)s)",
    )
    serve.add_argument(
        "--memory-budget",
        type=int,
        default=defaults.memory_budget,
        help="bytes all requests in flight may hold together (default: a quarter of RAM, "
        "%(default)s)",
    )
    serve.add_argument(
        "--max-waiting-bytes",
        type=int,
        default=None,
        help="bytes requests waiting for room in the memory budget may ask for together; 0 "
        "refuses at once what does not fit (default: a quarter of the budget)",
    )
    serve.add_argument(
        "--max-connection-bytes",
        type=int,
        default=None,
        help="bytes of the memory budget the requests of one client connection may hold "
        "together; more is refused at once; the budget turns it off (default: half the budget)",
    )
    serve.add_argument(
        "--max-concurrent-streams",
        type=int,
        default=defaults.max_concurrent_streams,
        help="calls one client connection may have open at once (default: %(default)s)",
    )
    serve.add_argument(
        "--receive-timeout",
        type=float,
        default=defaults.receive_timeout,
        help="seconds an admitted request message may take to arrive whole, whatever the "
        "call's deadline (default: %(default)s)",
    )
    serve.add_argument(
        "--handshake-timeout",
        type=float,
        default=defaults.handshake_timeout,
        help="seconds a new connection may take to send its HTTP/2 preface (default: %(default)s)",
    )
    serve.add_argument(
        "--idle-timeout",
        type=float,
        default=defaults.idle_timeout,
        help="seconds a connection may carry no call before it is closed (default: %(default)s)",
    )
    serve.add_argument(
        "--keepalive-min-interval",
        type=float,
        default=defaults.keepalive_min_interval,
        help="seconds a client must leave between its keepalive PINGs when no answer was sent "
        "between them; after more than 2 sooner ones, GOAWAY too_many_pings (default: "
        "%(default)s, gRPC's)",
    )
    serve.add_argument(
        "--tls-cert",
        type=Path,
        metavar="FILE",
        help="serve TLS with this PEM certificate chain (with --tls-key; default: plaintext)",
    )
    serve.add_argument(
        "--tls-key", type=Path, metavar="FILE", help="the PEM private key of --tls-cert"
    )
    serve.add_argument(
        "--tls-client-ca",
        type=Path,
        metavar="FILE",
        help="require client certificates issued by these PEM CA certificates (mutual TLS)",
    )
    serve.add_argument(
        "--log-level",
        type=str.upper,
        choices=_LOG_LEVELS,
        default=None,
        help="the server's log level: DEBUG, INFO, WARNING or ERROR (default: INFO, or DEBUG "
        "with --debug); libraries log at WARNING at most",
    )
    serve.add_argument(
        "--debug",
        action="store_true",
        help="tracebacks in model error messages, and the server's debug logs",
    )
    return parser


def _configure_logging(level: int) -> None:
    # The libraries' loggers inherit the root's level; ours (the "trio_infer" tree) get theirs.
    logging.basicConfig(level=max(level, logging.WARNING), format=_LOG_FORMAT)
    logging.getLogger("trio_infer").setLevel(level)


async def _serve_until_signalled(config: ServerConfig) -> int | None:
    """Serve until a graceful shutdown ends (None), or a second signal cuts it short (its
    number)."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            server: RunningServer = await nursery.start(_serve_then_stop, config, nursery)
            async for signum in signals:
                name = signal.Signals(signum).name
                if server.shutting_down:
                    logger.warning("%s again: exiting now (exit status %d)", name, 128 + signum)
                    nursery.cancel_scope.cancel()
                    return int(signum)
                logger.warning(
                    "%s: shutting down, finishing calls in flight for up to %.1f s "
                    "(again to exit at once)",
                    name,
                    config.grace_period,
                )
                server.shutdown()
    return None


async def _serve_then_stop(
    config: ServerConfig,
    nursery: trio.Nursery,
    *,
    task_status: trio.TaskStatus[RunningServer] = trio.TASK_STATUS_IGNORED,
) -> None:
    from trio_infer.server import run_server

    await run_server(config, task_status=task_status)
    # The server is done; stop listening for signals too.
    nursery.cancel_scope.cancel()


def main(argv: list[str] | None = None) -> int:
    """Run the ``trio-infer`` command; returns the process exit status."""
    args = _parser().parse_args(argv)
    level = args.log_level or ("DEBUG" if args.debug else "INFO")
    _configure_logging(logging.getLevelNamesMapping()[level])
    if args.workers < 1:
        logger.error("--workers must be at least 1")
        return 2
    if not 0 <= args.grpc_port <= 65535:
        # The OS would take the port modulo 65536 and serve somewhere nobody asked for.
        logger.error("--grpc-port must be between 0 and 65535")
        return 2
    if not 0 < args.max_message_size <= _MAX_MESSAGE_SIZE:
        # An admitted message opens its stream's HTTP/2 window by its size, which the protocol
        # caps at 2^31 - 1.
        logger.error("--max-message-size must be between 1 and %d bytes", _MAX_MESSAGE_SIZE)
        return 2
    if args.memory_budget < 1 or args.max_concurrent_streams < 1:
        logger.error("--memory-budget and --max-concurrent-streams must be at least 1")
        return 2
    if args.max_waiting_bytes is not None and args.max_waiting_bytes < 0:
        logger.error("--max-waiting-bytes must be at least 0")
        return 2
    if args.max_connection_bytes is not None and not (
        0 < args.max_connection_bytes <= args.memory_budget
    ):
        logger.error("--max-connection-bytes must be between 1 and --memory-budget")
        return 2
    if not args.grace_period >= 0:  # also catches NaN
        # Otherwise the shutdown itself fails, with a traceback, when the first signal comes.
        logger.error("--grace-period must be a number of seconds, at least 0")
        return 2
    for option, seconds in (
        ("--receive-timeout", args.receive_timeout),
        ("--handshake-timeout", args.handshake_timeout),
        ("--idle-timeout", args.idle_timeout),
        ("--keepalive-min-interval", args.keepalive_min_interval),
    ):
        if not 0 < seconds < math.inf:  # also catches NaN
            logger.error("%s must be a number of seconds, more than 0", option)
            return 2
    if args.tls_cert is None and (args.tls_key is not None or args.tls_client_ca is not None):
        if args.tls_key is not None:
            logger.error("--tls-key needs --tls-cert")
        else:
            logger.error("--tls-client-ca needs --tls-cert and --tls-key")
        return 2
    if args.tls_cert is not None and args.tls_key is None:
        logger.error("--tls-cert needs --tls-key")
        return 2
    from trio_infer.server import ServerConfig

    config = ServerConfig(
        repository=args.repository,
        host=args.host,
        grpc_port=args.grpc_port,
        workers=args.workers,
        grace_period=args.grace_period,
        max_message_size=args.max_message_size,
        memory_budget=args.memory_budget,
        max_waiting_bytes=args.max_waiting_bytes,
        max_connection_bytes=args.max_connection_bytes,
        max_concurrent_streams=args.max_concurrent_streams,
        receive_timeout=args.receive_timeout,
        handshake_timeout=args.handshake_timeout,
        idle_timeout=args.idle_timeout,
        keepalive_min_interval=args.keepalive_min_interval,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_client_ca=args.tls_client_ca,
        debug=args.debug,
    )
    if config.tls_cert is not None and config.tls_key is not None:
        from trio_infer.transport.tls import TLSFileError, server_context

        try:
            # Built here to check the files at start (the server builds its own).
            server_context(config.tls_cert, config.tls_key, config.tls_client_ca)
        except TLSFileError as exc:
            logger.error("%s %s: %s", _TLS_OPTIONS[exc.role], exc.path, exc.problem)
            return 2
    try:
        # Checked before starting anything, so a typo in a settings file is one clear line.
        load_repository(config.repository)
    except SettingsError as exc:
        logger.error("%s", exc)
        return 2
    # Every module the server needs is imported by now: tens of thousands of objects that live
    # as long as the process. Left to the cyclic garbage collector, each full collection would
    # walk them all, a pause that every call in flight waits out; frozen, they are never walked.
    gc.freeze()
    status = 0
    try:
        forced = trio.run(_serve_until_signalled, config)
        if forced is not None:
            status = 128 + forced
    except* OSError as group:
        for error in group.exceptions:
            logger.error("cannot serve on %s:%d: %s", config.host, config.grpc_port, error)
        status = 1
    return status
