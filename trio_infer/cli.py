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
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import trio

from trio_infer.logs import LOG_FORMATS
from trio_infer.logs import configure as configure_logs
from trio_infer.repository.server_settings import read_server_settings
from trio_infer.repository.settings import SettingsError

# Worker processes re-import the main script, which for the installed command imports this
# module: the server is imported inside functions so that each worker does not load it too.
if TYPE_CHECKING:
    from trio_infer.server import RunningServer, ServerConfig

logger = logging.getLogger("trio_infer")

_MAX_MESSAGE_SIZE = 1024 * 1024 * 1024
_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
_TLS_OPTIONS = {"certificate": "--tls-cert", "key": "--tls-key", "client CA": "--tls-client-ca"}


class _OneLineErrors(argparse.ArgumentParser):
    """argparse, with a bad option or value said in one line (no usage block), exit 2: the
    same as every other invalid value, for logs and scripts that read the last line."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _true_or_false(value: str) -> bool:
    """``true`` or ``false`` (any case), as Triton's boolean options take them."""
    lowered = value.lower()
    if lowered not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")
    return lowered == "true"


def _restriction(value: str) -> tuple[str, str]:
    """Triton's ``<groups>:<header>=<value>``; the one group served is ``model-repository``."""
    groups, colon, rule = value.partition(":")
    header, equals, expected = rule.partition("=")
    if not colon or not equals or not header or not expected:
        raise argparse.ArgumentTypeError(
            f"expected model-repository:HEADER=VALUE, got {value[:100]!r}"
        )
    for group in groups.split(","):
        if group != "model-repository":
            raise argparse.ArgumentTypeError(
                f"only the model-repository group can be restricted, got {group[:100]!r}"
            )
    return header.lower(), expected


def restriction(values: Sequence[tuple[str, str]]) -> tuple[str, str] | None:
    """The repository restriction the restriction options set, from the ``(header, value)``
    each was given; None when none was (unrestricted).

    Raises:
        ValueError: Two of them differ: they are one setting for both entrances, so one of
            them would silently stand for both.
    """
    if len(set(values)) > 1:
        # Not repeated: the values are keys, which a log must not hold.
        raise ValueError(
            "--grpc-restricted-protocol and --http-restricted-api are one setting for gRPC and "
            "REST alike, given here with different headers or values"
        )
    return values[0] if values else None


def port_clash(ports: Sequence[tuple[str, int | None]]) -> str | None:
    """Why two listeners of ``ports`` (each an option and its port; None: not served) cannot
    both start, when two fixed ports are the same: the second bind would fail as if another
    program held the port. None when they can (0 picks a free port for each).
    """
    taken: dict[int, str] = {}
    for option, port in ports:
        if port:
            if port in taken:
                return f"{taken[port]} and {option} are both {port}: each needs a port of its own"
            taken[port] = option
    return None


def _parser(option_defaults: dict[str, object] | None = None) -> argparse.ArgumentParser:
    """The command's parser; ``option_defaults`` replace ``serve``'s own defaults (by option
    name: an MLServer settings.json's, :mod:`trio_infer.repository.server_settings`)."""
    from trio_infer.core.repository import ControlMode
    from trio_infer.core.service import SERVER_NAME, SERVER_VERSION
    from trio_infer.server import ServerConfig

    parser = _OneLineErrors(
        prog="trio-infer",
        description="An Open Inference Protocol (KServe V2) gRPC and REST model server.",
    )
    parser.add_argument("--version", action="version", version=f"{SERVER_NAME} {SERVER_VERSION}")
    commands = parser.add_subparsers(dest="command", required=True)
    # No abbreviations: "--repository X" must not be taken for --repository-poll-secs.
    serve = commands.add_parser(
        "serve", help="serve a model repository over gRPC and REST", allow_abbrev=False
    )
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
        "--http-port",
        type=int,
        default=defaults.http_port,
        help="REST (HTTP/1.1) port, same host; 0 picks a free port and logs it (default: "
        "%(default)s)",
    )
    serve.add_argument("--no-http", action="store_true", help="serve no REST port (gRPC only)")
    serve.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="also serve GET /metrics on this port of its own (it is always on the REST port); "
        "0 picks a free port and logs it (default: none)",
    )
    serve.add_argument(
        "--model-control-mode",
        choices=[mode.value for mode in ControlMode],
        default=defaults.model_control_mode.value,
        help="Triton's modes: none, every model loaded at start and the repository extension's "
        "load/unload refused; explicit, the --load-model ones loaded at start and load/unload "
        "served; poll, every model at start and the folder followed (default: %(default)s)",
    )
    serve.add_argument(
        "--load-model",
        action="append",
        default=[],
        metavar="NAME",
        help="with --model-control-mode explicit: load this model at start (repeatable; '*' "
        "loads every one)",
    )
    serve.add_argument(
        "--repository-poll-secs",
        type=float,
        default=defaults.repository_poll_interval,
        help="with --model-control-mode poll: seconds between two reads of the repository "
        "(default: %(default)s)",
    )
    serve.add_argument(
        "--grpc-restricted-protocol",
        "--http-restricted-api",
        dest="restricted",
        type=_restriction,
        action="append",
        default=[],
        metavar="model-repository:HEADER=VALUE",
        help="Triton's option: the repository extension's calls (index, load, unload; gRPC and "
        "REST) are refused unless they carry this header with this value; loading a model runs "
        "its code",
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
        help="seconds an admitted request message may take to arrive whole, and a unary "
        "call's (or a health Watch's) one message to begin, whatever the call's deadline "
        "(default: %(default)s)",
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
        "--max-connection-age",
        type=float,
        default=defaults.max_connection_age,
        metavar="S",
        help="seconds (spread by 10%% either way) after which a client connection is retired, "
        "so that its client reconnects and may reach another replica: gRPC GOAWAY, REST "
        "Connection: close (default: none)",
    )
    serve.add_argument(
        "--max-connection-age-grace",
        type=float,
        default=defaults.max_connection_age_grace,
        metavar="S",
        help="with --max-connection-age: seconds the gRPC calls in flight on a retired "
        "connection get to finish before they end with UNAVAILABLE (default: as long as they "
        "take)",
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
        "--log-format",
        choices=LOG_FORMATS,
        default="text",
        help="text lines, or one JSON object per line (time, level, logger, message and the "
        "record's fields) (default: %(default)s)",
    )
    serve.add_argument(
        "--access-log",
        action="store_true",
        help="log one line per call (logger trio_infer.access): protocol, method, model, "
        "status, duration, bytes in and out, request id",
    )
    serve.add_argument(
        "--strict-readiness",
        type=_true_or_false,
        default=defaults.strict_readiness,
        metavar="true|false",
        help="ready only when every model is ready (default: true); false: ready whenever the "
        "server runs, so one broken model does not take it out of a load balancer",
    )
    serve.add_argument(
        "--debug",
        action="store_true",
        help="tracebacks in model error messages, and the server's debug logs",
    )
    if option_defaults:
        serve.set_defaults(**option_defaults)
    return parser


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
    from trio_infer.core.repository import ControlMode

    args = _parser().parse_args(argv)
    try:
        # MLServer's settings.json, where `mlserver start REPOSITORY` reads it: defaults for
        # the options it has an equivalent of, so the options given here win.
        mlserver = read_server_settings(args.repository)
    except SettingsError as exc:
        configure_logs(logging.INFO, args.log_format, args.access_log)
        logger.error("%s", exc)
        return 2
    if mlserver is not None:
        args = _parser(mlserver.options).parse_args(argv)
    level = args.log_level or ("DEBUG" if args.debug else "INFO")
    configure_logs(logging.getLevelNamesMapping()[level], args.log_format, args.access_log)
    if mlserver is not None:
        logger.info(
            "%s: read %s%s",
            mlserver.file,
            ", ".join(sorted(mlserver.options)) or "no option",
            f" (no equivalent here: {', '.join(mlserver.ignored)})" if mlserver.ignored else "",
        )
    if args.workers < 1:
        logger.error("--workers must be at least 1")
        return 2
    if not 0 <= args.grpc_port <= 65535:
        # The OS would take the port modulo 65536 and serve somewhere nobody asked for.
        logger.error("--grpc-port must be between 0 and 65535")
        return 2
    if args.metrics_port is not None and not 0 <= args.metrics_port <= 65535:
        logger.error("--metrics-port must be between 0 and 65535")
        return 2
    if args.load_model and args.model_control_mode != ControlMode.EXPLICIT:
        logger.error("--load-model needs --model-control-mode explicit")
        return 2
    if not 0 < args.repository_poll_secs < math.inf:  # also catches NaN
        logger.error("--repository-poll-secs must be a number of seconds, more than 0")
        return 2
    if not 0 <= args.http_port <= 65535:
        logger.error("--http-port must be between 0 and 65535 (--no-http serves no REST)")
        return 2
    try:
        restricted = restriction(args.restricted)
    except ValueError as exc:
        logger.error("%s", exc)
        return 2
    clash = port_clash(
        (
            ("--grpc-port", args.grpc_port),
            ("--http-port", None if args.no_http else args.http_port),
            ("--metrics-port", args.metrics_port),
        )
    )
    if clash is not None:
        logger.error("%s", clash)
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
    if args.max_connection_age is not None and not 0 < args.max_connection_age < math.inf:
        logger.error("--max-connection-age must be a number of seconds, more than 0")
        return 2
    if args.max_connection_age_grace is not None:
        if args.max_connection_age is None:
            logger.error("--max-connection-age-grace needs --max-connection-age")
            return 2
        if not 0 <= args.max_connection_age_grace < math.inf:
            logger.error("--max-connection-age-grace must be a number of seconds, at least 0")
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
    from trio_infer.server import ServerConfig, models_at_start

    config = ServerConfig(
        repository=args.repository,
        host=args.host,
        grpc_port=args.grpc_port,
        http_port=None if args.no_http else args.http_port,
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
        max_connection_age=args.max_connection_age,
        max_connection_age_grace=args.max_connection_age_grace,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_client_ca=args.tls_client_ca,
        access_log=args.access_log,
        strict_readiness=args.strict_readiness,
        metrics_port=args.metrics_port,
        model_control_mode=ControlMode(args.model_control_mode),
        load_models=tuple(args.load_model),
        repository_poll_interval=args.repository_poll_secs,
        repository_control_header=restricted,
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
        models_at_start(config)
    except SettingsError as exc:
        logger.error("%s", exc)
        return 2
    # Every module the server needs is imported by now: tens of thousands of objects that live
    # as long as the process. Left to the cyclic garbage collector, each full collection would
    # walk them all, a pause that every call in flight waits out; frozen, they are never walked.
    gc.freeze()
    # With 25 calls in flight, a burst allocates more objects that outlive it briefly than
    # CPython 3.11's threshold of 700, so a young-generation collection ran every ~26 calls
    # and found almost nothing to free. 2,000 is CPython 3.13's own default: a collection
    # then walks at most that many young objects, well under a millisecond.
    young, middle, old = gc.get_threshold()
    gc.set_threshold(max(young, 2000), middle, old)
    status = 0
    try:
        forced = trio.run(_serve_until_signalled, config)
        if forced is not None:
            status = 128 + forced
    except* OSError as group:
        for error in group.exceptions:
            # run_server names the address it could not bind (gRPC's or REST's).
            where = getattr(error, "filename", None) or f"{config.host}:{config.grpc_port}"
            logger.error("cannot serve on %s: %s", where, getattr(error, "strerror", None) or error)
        status = 1
    return status
