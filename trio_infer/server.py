"""The server's ownership tree: worker pool, model readiness, listeners, and shutdown.

::

    run_server                         owns everything below; returns when all of it is done
    ├── WorkerPool                     worker processes; closed last, so no call outlives it
    └── server nursery
        ├── Batching.run               the batching models' batchers
        ├── GrpcServer.serve           listeners and connections (trio_infer.transport)
        ├── HttpServer.serve           the REST port's listeners and connections
        ├── HttpServer.serve           the metrics port (``GET /metrics`` only), if asked for
        └── ModelManager.run           which models are served: loads them into every worker
                                       and marks them ready, again after a worker crash; the
                                       repository extension's loads and unloads; polling

Internal tasks that raise (bugs) do not end the server: a pool lane or a batcher fails the calls
it held, and its owner starts a fresh one in the same nursery; a model operation that raises
fails alone, and the served models are loaded again. Each crash is logged with its traceback and
counted in :attr:`ServerStatistics.task_crashes`.

Shutdown (:meth:`RunningServer.shutdown`): readiness turns false, listeners close and every
connection gets GOAWAY; calls in flight have the grace period to finish; the rest end with
UNAVAILABLE; connections that still have not closed a moment later are cut off by the server
nursery's deadline; then the pool shuts its workers down.
"""

from __future__ import annotations

import logging
import os
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import trio

from trio_infer.core.repository import ControlMode, ModelManager
from trio_infer.core.service import CORE_EXTENSIONS, InferenceCore
from trio_infer.frontends.grpc_service import GrpcService
from trio_infer.frontends.http_service import HttpService, metrics_handler
from trio_infer.observability.metrics import ServerMetrics, TransportCounts
from trio_infer.repository.registry import ModelRegistry
from trio_infer.repository.settings import (
    EXAMPLES,
    ModelSettings,
    SettingsError,
    load_repository,
    scan_repository,
)
from trio_infer.scheduling.admission import Admission, AdmissionStatistics
from trio_infer.scheduling.batching import BatchStatistics
from trio_infer.transport.grpc_protocol import ProtocolLimits
from trio_infer.transport.grpc_server import GrpcServer, TransportStatistics
from trio_infer.transport.http_server import HttpLimits, HttpServer, HttpStatistics
from trio_infer.transport.tls import server_context
from trio_infer.workers.pool import PoolStatistics, WorkerPool

__all__ = ["RunningServer", "ServerConfig", "ServerStatistics", "models_at_start", "run_server"]

logger = logging.getLogger(__name__)

#: After the grace period, how long connections get to deliver their final statuses. With a
#: protocol breaker's GOAWAY (0.2 s) and the pool's close (0.25 s), the server exits within the
#: grace period plus a second.
_CLOSE_SLACK = 0.5


@dataclass(frozen=True)
class ServerConfig:
    """Everything ``trio-infer serve`` can be told, and ``send_timeout``, which it cannot.

    Args:
        repository: A folder with one subfolder per model (each with ``model-settings.json``).
        host: The address to listen on.
        grpc_port: The gRPC port; 0 picks a free one (see :attr:`RunningServer.port`).
        http_port: The REST (HTTP/1.1) port on the same host; 0 picks a free one (see
            :attr:`RunningServer.http_port`); None serves no REST.
        metrics_port: A port of its own for ``GET /metrics`` (also served on the REST port),
            plaintext even with ``tls_cert``; 0 picks a free one; None: none.
        workers: Worker processes that run model code.
        grace_period: Seconds in-flight calls get to finish once shutdown starts.
        max_message_size: The largest request message accepted, in bytes.
        memory_budget: The most bytes requests in flight may reserve together (see
            :mod:`trio_infer.scheduling.admission`); default a quarter of the machine's memory.
        max_waiting_bytes: The most bytes requests waiting for room in the budget may ask for
            together (default: a quarter of the budget); 0 refuses at once a request that
            does not fit.
        max_connection_bytes: The most bytes of the budget the requests of one client
            connection may hold, reserved and waiting together (default: half the budget);
            past it a request is refused at once.
        max_concurrent_streams: Calls one client connection may have open at once.
        receive_timeout: Seconds an admitted request message may take to arrive whole, and a
            unary call's one message to begin, whatever the call's deadline (what was
            reserved for it, and the call's stream, are held no longer).
        handshake_timeout: Seconds a new connection may take to send its HTTP/2 preface.
        idle_timeout: Seconds a connection may carry no call before it is closed.
        send_timeout: Seconds a response may wait for a client that reads none of it before
            its call is abandoned (CANCELLED), and a write the socket takes none of before the
            connection is closed.
        keepalive_min_interval: Seconds a client must leave between two PINGs with no answer
            sent between them; more than two sooner ones end its connection (GOAWAY
            ENHANCE_YOUR_CALM "too_many_pings", as gRPC servers do).
        max_connection_age: Seconds after which a client connection is retired, spread by up
            to 10 % either way, so that its client reconnects and may reach another replica
            (gRPC servers' ``max_connection_age``): a gRPC connection gets GOAWAY, a REST one
            ``Connection: close`` on its first response past the age. None: connections live
            on.
        max_connection_age_grace: Seconds the calls in flight on a gRPC connection retired by
            its age get to finish before they end with UNAVAILABLE; None: as long as they take.
        tls_cert: Serve TLS on the gRPC and REST ports with this PEM certificate chain (with
            ``tls_key``); plaintext when None.
        tls_key: The PEM private key of ``tls_cert``.
        tls_client_ca: Require client certificates that chain to these PEM CA certificates
            (mutual TLS); needs ``tls_cert``.
        access_log: Log one line per call (the ``trio_infer.access`` logger, at INFO).
        strict_readiness: The server is ready only when every model is (Triton's name and
            default); with False, whenever it runs and is not shutting down, so that one broken
            model does not take the replica out of its load balancer.
        model_control_mode: Which models are served, and whether the repository extension
            may change that (Triton's modes: :class:`~trio_infer.core.repository.ControlMode`).
        load_models: In ``explicit`` mode, the models loaded at start (``*``: every one).
        repository_poll_interval: Seconds between two reads of the repository in ``poll``
            mode.
        repository_control_header: ``(name, value)``: the repository extension's calls (index,
            load, unload) are refused (PERMISSION_DENIED) unless they carry this header, as
            Triton's ``--grpc-restricted-protocol model-repository:name=value`` does; loading
            a model imports and runs its code. None: not restricted.
        debug: Include tracebacks in the messages of model errors.
    """

    repository: Path = EXAMPLES
    host: str = "0.0.0.0"
    grpc_port: int = 8081
    http_port: int | None = 8080
    metrics_port: int | None = None
    workers: int = field(default_factory=lambda: os.cpu_count() or 1)
    grace_period: float = 30.0
    max_message_size: int = 64 * 1024 * 1024
    memory_budget: int = field(default_factory=lambda: _physical_memory() // 4)
    max_waiting_bytes: int | None = None
    max_connection_bytes: int | None = None
    max_concurrent_streams: int = 100
    receive_timeout: float = 30.0
    handshake_timeout: float = 10.0
    idle_timeout: float = 300.0
    keepalive_min_interval: float = 300.0
    send_timeout: float = 30.0
    max_connection_age: float | None = None
    max_connection_age_grace: float | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = None
    access_log: bool = False
    strict_readiness: bool = True
    model_control_mode: ControlMode = ControlMode.NONE
    load_models: tuple[str, ...] = ()
    repository_poll_interval: float = 15.0
    repository_control_header: tuple[str, str] | None = None
    debug: bool = False


@dataclass(frozen=True)
class ServerStatistics:
    """A snapshot of a running server (the numbers a metrics endpoint will expose).

    Attributes:
        admission: The memory budget and the models' queues.
        pool: The worker processes and their calls.
        batching: Each batching model's batches, by model name.
        transport: The gRPC connections: how many, their calls, their unsent bytes.
        http: The REST connections and their requests in flight (None: no REST port).
        task_crashes: Internal tasks that raised (bugs), by kind: ``lane`` (a worker lane of
            the pool), ``batcher`` (a model's batcher, summed over models) and ``models`` (an
            operation of the model manager). Each crash failed the calls its task held, was
            logged with
            its traceback, and its task was replaced.
    """

    admission: AdmissionStatistics
    pool: PoolStatistics
    batching: dict[str, BatchStatistics]
    task_crashes: dict[str, int] = field(default_factory=dict)
    transport: TransportStatistics | None = None
    http: HttpStatistics | None = None


class RunningServer:
    """A handle on a server started with ``await nursery.start(run_server, config)``."""

    def __init__(
        self,
        host: str,
        port: int,
        core: InferenceCore,
        models: ModelManager,
        transport: GrpcServer | None = None,
        *,
        http: HttpServer | None = None,
        http_port: int | None = None,
        metrics_port: int | None = None,
    ) -> None:
        self.host = host
        """The address the server listens on."""
        self.port = port
        """The gRPC port it is bound to (the real one, when 0 was asked for)."""
        self.core = core
        """The V2 core every front-end calls: the registry, the pool, admission, batching."""
        self.models = models
        """Which models are served, their loading, and the repository extension."""
        self.http_port = http_port
        """The REST port it is bound to (the real one, when 0 was asked for); None when it
        serves no REST."""
        self.metrics_port = metrics_port
        """The port of its metrics listener (``GET /metrics`` only); None when it has none."""
        self._transport = transport
        self._http = http
        self._shutdown_requested = trio.Event()
        self.metrics = ServerMetrics(
            core,
            transports=self._transport_counts,
            task_crashes=lambda: self.statistics().task_crashes,
        )
        """The server's Prometheus metrics: ``metrics.render()`` is the answer to
        ``GET /metrics``."""

    @property
    def shutting_down(self) -> bool:
        """Whether :meth:`shutdown` has been called."""
        return self._shutdown_requested.is_set()

    def statistics(self) -> ServerStatistics:
        """Return a snapshot of admission control, the worker pool and batching."""
        pool = self.core.pool.statistics()
        batching = self.core.batching.statistics()
        return ServerStatistics(
            admission=self.core.admission.statistics(),
            pool=pool,
            batching=batching,
            task_crashes={
                "lane": pool.lane_crashes,
                "batcher": sum(batches.batcher_crashes for batches in batching.values()),
                "models": self.models.crashes,
            },
            transport=None if self._transport is None else self._transport.statistics(),
            http=None if self._http is None else self._http.statistics(),
        )

    def _transport_counts(self) -> dict[str, TransportCounts]:
        """Each entrance's connections and calls, for the metrics."""
        counts: dict[str, TransportCounts] = {}
        if self._transport is not None:
            grpc = self._transport.statistics()
            counts["grpc"] = TransportCounts(grpc.connections, grpc.calls, grpc.calls_started)
        if self._http is not None:
            http = self._http.statistics()
            counts["http"] = TransportCounts(http.connections, http.requests, http.requests_started)
        return counts

    def shutdown(self) -> None:
        """Start a graceful shutdown; ``run_server`` returns when it is complete."""
        self._shutdown_requested.set()

    async def wait_ready(self) -> None:
        """Wait until every model served at start has been loaded in the workers once."""
        await self.models.wait_ready()


async def run_server(
    config: ServerConfig,
    *,
    task_status: trio.TaskStatus[RunningServer] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``config.repository`` until :meth:`RunningServer.shutdown` completes or the
    caller cancels.

    Reports a :class:`RunningServer` through ``task_status`` once the port is bound; models
    become ready in the background (ServerLive answers at once, ServerReady once they are).

    Raises:
        SettingsError: the repository or a model's settings are invalid.
        TLSFileError: a TLS file is missing or invalid.
        ValueError: ``tls_key`` or ``tls_client_ca`` is given without ``tls_cert``, or
            ``tls_cert`` without ``tls_key``.
        OSError: the port cannot be bound.
    """
    registry = ModelRegistry(models_at_start(config))
    ssl_context = _tls_context(config)
    # A report past the whole budget could not be answered: its bytes are not read.
    async with WorkerPool.open(
        config.workers, debug=config.debug, max_report_bytes=config.memory_budget
    ) as pool:
        core = InferenceCore(
            registry,
            pool,
            Admission(
                config.memory_budget,
                max_waiting_bytes=config.max_waiting_bytes,
                max_owner_bytes=config.max_connection_bytes,
            ),
            strict_readiness=config.strict_readiness,
            # Triton's binary tensor data extension is REST's.
            extensions=CORE_EXTENSIONS
            + (("binary_tensor_data",) if config.http_port is not None else ()),
        )
        models = ModelManager(
            core,
            config.repository,
            mode=config.model_control_mode,
            grace_period=config.grace_period,
            poll_interval=config.repository_poll_interval,
        )
        limits = ProtocolLimits(
            max_message_size=config.max_message_size,
            max_concurrent_streams=config.max_concurrent_streams,
            receive_timeout=config.receive_timeout,
            handshake_timeout=config.handshake_timeout,
            idle_timeout=config.idle_timeout,
            min_ping_interval=config.keepalive_min_interval,
            send_timeout=config.send_timeout,
            max_connection_age=config.max_connection_age,
            max_connection_age_grace=config.max_connection_age_grace,
        )
        service = GrpcService(core, models, control_header=config.repository_control_header)
        grpc = GrpcServer(
            service.handle,
            limits,
            ssl_context=ssl_context,
            access_log=config.access_log,
            immediate=service.immediate,
        )
        listeners = await _listen(config.host, config.grpc_port)
        port: int = listeners[0].socket.getsockname()[1]
        http_limits = HttpLimits(
            max_body_size=config.max_message_size,
            handshake_timeout=config.handshake_timeout,
            receive_timeout=config.receive_timeout,
            idle_timeout=config.idle_timeout,
            send_timeout=config.send_timeout,
            max_connection_age=config.max_connection_age,
        )
        http: HttpServer | None = None
        http_listeners: list[trio.SocketListener] = []
        http_port: int | None = None
        # The metrics read the running server's statistics: bound once it exists.
        server: RunningServer | None = None

        def render_metrics() -> tuple[bytes, str]:
            assert server is not None, "no request is served before the server exists"
            return server.metrics.render()

        if config.http_port is not None:
            http = HttpServer(
                HttpService(
                    core,
                    models,
                    metrics=render_metrics,
                    control_header=config.repository_control_header,
                ).handle,
                http_limits,
                ssl_context=_tls_context(config, alpn="http/1.1"),
                access_log=config.access_log,
            )
            http_listeners = await _listen(config.host, config.http_port)
            http_port = http_listeners[0].socket.getsockname()[1]
        metrics_http: HttpServer | None = None
        metrics_listeners: list[trio.SocketListener] = []
        metrics_port: int | None = None
        if config.metrics_port is not None:
            metrics_http = HttpServer(metrics_handler(render_metrics), http_limits)
            metrics_listeners = await _listen(config.host, config.metrics_port)
            metrics_port = metrics_listeners[0].socket.getsockname()[1]
        async with trio.open_nursery() as nursery:
            await nursery.start(core.batching.run)
            await nursery.start(grpc.serve, listeners)
            if http is not None:
                await nursery.start(http.serve, http_listeners)
                scheme = "http" if config.tls_cert is None else "https"
                logger.info("REST on %s://%s:%d", scheme, config.host, http_port)
            if metrics_http is not None:
                await nursery.start(metrics_http.serve, metrics_listeners)
                logger.info("metrics on http://%s:%d/metrics", config.host, metrics_port)
            server = RunningServer(
                config.host,
                port,
                core,
                models,
                grpc,
                http=http,
                http_port=http_port,
                metrics_port=metrics_port,
            )
            logger.info(
                "serving %d model(s) from %s on %s:%d%s with %d worker(s)",
                len(list(registry)),
                config.repository,
                config.host,
                port,
                _security(config),
                config.workers,
            )
            lifecycle = trio.CancelScope()
            nursery.start_soon(_run_in, lifecycle, models.run)
            task_status.started(server)

            await server._shutdown_requested.wait()
            logger.info(
                "shutting down: %d call(s) in flight, grace period %.1f s",
                grpc.calls_in_flight.count + (0 if http is None else http.requests_in_flight.count),
                config.grace_period,
            )
            core.start_draining()
            lifecycle.cancel()
            # Both entrances drain at once, with the same grace period; the metrics port
            # answers until then.
            async with trio.open_nursery() as draining:
                draining.start_soon(grpc.shutdown, config.grace_period)
                if http is not None:
                    draining.start_soon(http.shutdown, config.grace_period)
            if metrics_http is not None:
                await metrics_http.shutdown(0)
            core.batching.stop()
            nursery.cancel_scope.deadline = trio.current_time() + _CLOSE_SLACK
    for name, batches in core.batching.statistics().items():
        logger.info(
            "model '%s': %d batches, %d requests, %d rows (mean %.1f requests per batch); "
            "%d requests filled a batch alone",
            name,
            batches.batches,
            batches.requests,
            batches.rows,
            batches.mean_batch_requests,
            batches.alone,
        )
    logger.info("server stopped")


async def _run_in(scope: trio.CancelScope, run: Callable[[], Awaitable[None]]) -> None:
    with scope:
        await run()


async def _listen(host: str, port: int) -> list[trio.SocketListener]:
    """Bind ``host:port``; an OSError names that address (as its ``filename``)."""
    try:
        return await trio.open_tcp_listeners(port, host=host)
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, f"{host}:{port}") from exc


def models_at_start(config: ServerConfig) -> list[ModelSettings]:
    """The models served from the start: every one of the repository (in ``poll`` mode there
    may be none yet), but in ``explicit`` mode only those of ``load_models``.

    Raises:
        SettingsError: The repository cannot be read, a settings file is invalid (every one in
            ``none`` and ``poll`` modes; those named in ``explicit`` mode), ``none`` mode finds
            no model, or a model named in ``load_models`` is not in the repository.
    """
    if config.model_control_mode is ControlMode.NONE:
        return load_repository(config.repository)
    found = scan_repository(config.repository)
    if config.model_control_mode is ControlMode.POLL:
        # Every model, each valid; none at all is fine: the polls add them as they come.
        for problem in (entry.error for entry in found.values()):
            if problem is not None:
                raise SettingsError(problem)
        return [entry.settings for entry in found.values() if entry.settings is not None]
    names = list(found) if "*" in config.load_models else list(config.load_models)
    models: list[ModelSettings] = []
    for name in dict.fromkeys(names):
        entry = found.get(name)
        if entry is None:
            raise SettingsError(
                f"{config.repository}: --load-model {name!r}: no folder of the repository "
                "declares that model"
            )
        if entry.settings is None:
            raise SettingsError(f"{entry.error}")
        models.append(entry.settings)
    return models


def _tls_context(config: ServerConfig, alpn: str = "h2") -> ssl.SSLContext | None:
    """The listeners' TLS context (None: plaintext), offering ``alpn`` to clients."""
    if config.tls_cert is None:
        if config.tls_key is not None or config.tls_client_ca is not None:
            raise ValueError("tls_key and tls_client_ca need tls_cert")
        return None
    if config.tls_key is None:
        raise ValueError("tls_cert needs tls_key")
    context = server_context(config.tls_cert, config.tls_key, config.tls_client_ca)
    if alpn != "h2":
        context.set_alpn_protocols([alpn])
    return context


def _security(config: ServerConfig) -> str:
    """How the listener is secured, as the start-up log line says it."""
    if config.tls_cert is None:
        return ""
    if config.tls_client_ca is None:
        return " over TLS"
    return " over mutual TLS (client certificates required)"


def _physical_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
