"""The server's ownership tree: worker pool, model readiness, listeners, and shutdown.

::

    run_server                         owns everything below; returns when all of it is done
    ├── WorkerPool                     worker processes; closed last, so no call outlives it
    └── server nursery
        ├── Batching.run               the batching models' batchers
        ├── GrpcServer.serve           listeners and connections (trio_infer.transport)
        └── readiness keeper           loads every model in every worker, marks it ready; again
                                       after a worker crash

Internal tasks that raise (bugs) do not end the server: a pool lane or a batcher fails the calls
it held, and its owner starts a fresh one in the same nursery; the readiness keeper, which holds
no call, is run again by the task that supervises it. Each crash is logged with its traceback and
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
from dataclasses import dataclass, field
from pathlib import Path

import trio

from trio_infer.core.service import InferenceCore
from trio_infer.errors import InferError
from trio_infer.frontends.grpc_service import GrpcService
from trio_infer.repository.registry import ModelRegistry
from trio_infer.repository.settings import EXAMPLES, ModelSettings, load_repository
from trio_infer.scheduling.admission import Admission, AdmissionStatistics
from trio_infer.scheduling.batching import BatchStatistics
from trio_infer.transport.grpc_protocol import ProtocolLimits
from trio_infer.transport.grpc_server import GrpcServer, TransportStatistics
from trio_infer.transport.tls import server_context
from trio_infer.workers.pool import PoolStatistics, WorkerPool

__all__ = ["RunningServer", "ServerConfig", "ServerStatistics", "run_server"]

logger = logging.getLogger(__name__)

#: After the grace period, how long connections get to deliver their final statuses. With a
#: protocol breaker's GOAWAY (0.2 s) and the pool's close (0.25 s), the server exits within the
#: grace period plus a second.
_CLOSE_SLACK = 0.5
#: Backoff between attempts to load a model that failed to load (seconds).
_RETRY_FIRST = 1.0
_RETRY_MAX = 30.0


@dataclass(frozen=True)
class ServerConfig:
    """Everything ``trio-infer serve`` can be told.

    Args:
        repository: A folder with one subfolder per model (each with ``model-settings.json``).
        host: The address to listen on.
        grpc_port: The gRPC port; 0 picks a free one (see :attr:`RunningServer.port`).
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
        receive_timeout: Seconds an admitted request message may take to arrive whole, whatever
            the call's deadline (what was reserved for it is held no longer).
        handshake_timeout: Seconds a new connection may take to send its HTTP/2 preface.
        idle_timeout: Seconds a connection may carry no call before it is closed.
        send_timeout: Seconds a response may wait for a client that reads none of it before
            its call is abandoned (CANCELLED), and a write the socket takes none of before the
            connection is closed.
        keepalive_min_interval: Seconds a client must leave between two PINGs with no answer
            sent between them; more than two sooner ones end its connection (GOAWAY
            ENHANCE_YOUR_CALM "too_many_pings", as gRPC servers do).
        tls_cert: Serve TLS with this PEM certificate chain (with ``tls_key``); plaintext when
            None.
        tls_key: The PEM private key of ``tls_cert``.
        tls_client_ca: Require client certificates that chain to these PEM CA certificates
            (mutual TLS); needs ``tls_cert``.
        debug: Include tracebacks in the messages of model errors.
    """

    repository: Path = EXAMPLES
    host: str = "0.0.0.0"
    grpc_port: int = 8081
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
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = None
    debug: bool = False


@dataclass(frozen=True)
class ServerStatistics:
    """A snapshot of a running server (the numbers a metrics endpoint will expose).

    Attributes:
        admission: The memory budget and the models' queues.
        pool: The worker processes and their calls.
        batching: Each batching model's batches, by model name.
        transport: The gRPC connections: how many, their calls, their unsent bytes.
        task_crashes: Internal tasks that raised (bugs), by kind: ``lane`` (a worker lane of
            the pool), ``batcher`` (a model's batcher, summed over models) and ``readiness``
            (the readiness keeper). Each crash failed the calls its task held, was logged with
            its traceback, and its task was replaced.
    """

    admission: AdmissionStatistics
    pool: PoolStatistics
    batching: dict[str, BatchStatistics]
    task_crashes: dict[str, int] = field(default_factory=dict)
    transport: TransportStatistics | None = None


class RunningServer:
    """A handle on a server started with ``await nursery.start(run_server, config)``."""

    def __init__(
        self, host: str, port: int, core: InferenceCore, transport: GrpcServer | None = None
    ) -> None:
        self.host = host
        """The address the server listens on."""
        self.port = port
        """The gRPC port it is bound to (the real one, when 0 was asked for)."""
        self.core = core
        """The V2 core every front-end calls: the registry, the pool, admission, batching."""
        self._transport = transport
        self._shutdown_requested = trio.Event()
        self._ready = trio.Event()
        self._readiness_crashes = 0

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
                "readiness": self._readiness_crashes,
            },
            transport=None if self._transport is None else self._transport.statistics(),
        )

    def shutdown(self) -> None:
        """Start a graceful shutdown; ``run_server`` returns when it is complete."""
        self._shutdown_requested.set()

    async def wait_ready(self) -> None:
        """Wait until every model has been loaded in the workers once."""
        await self._ready.wait()


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
    registry = ModelRegistry(load_repository(config.repository))
    ssl_context = _tls_context(config)
    async with WorkerPool.open(config.workers, debug=config.debug) as pool:
        core = InferenceCore(
            registry,
            pool,
            Admission(
                config.memory_budget,
                max_waiting_bytes=config.max_waiting_bytes,
                max_owner_bytes=config.max_connection_bytes,
            ),
        )
        limits = ProtocolLimits(
            max_message_size=config.max_message_size,
            max_concurrent_streams=config.max_concurrent_streams,
            receive_timeout=config.receive_timeout,
            handshake_timeout=config.handshake_timeout,
            idle_timeout=config.idle_timeout,
            min_ping_interval=config.keepalive_min_interval,
            send_timeout=config.send_timeout,
        )
        grpc = GrpcServer(GrpcService(core).handle, limits, ssl_context=ssl_context)
        listeners = await trio.open_tcp_listeners(config.grpc_port, host=config.host)
        port: int = listeners[0].socket.getsockname()[1]
        async with trio.open_nursery() as nursery:
            await nursery.start(core.batching.run)
            await nursery.start(grpc.serve, listeners)
            server = RunningServer(config.host, port, core, grpc)
            logger.info(
                "serving %d model(s) from %s on %s:%d%s with %d worker(s)",
                len(list(registry)),
                config.repository,
                config.host,
                port,
                _security(config),
                config.workers,
            )
            readiness = trio.CancelScope()
            nursery.start_soon(_supervise_readiness, server, readiness)
            task_status.started(server)

            await server._shutdown_requested.wait()
            logger.info(
                "shutting down: %d call(s) in flight, grace period %.1f s",
                grpc.calls_in_flight.count,
                config.grace_period,
            )
            core.draining = True
            readiness.cancel()
            await grpc.shutdown(config.grace_period)
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


async def _supervise_readiness(server: RunningServer, scope: trio.CancelScope) -> None:
    """Run the readiness keeper until ``scope`` is cancelled; run it again if it raises."""
    with scope:
        while True:
            try:
                await _keep_models_ready(server)
            except Exception as crash:
                # Cancellations are not caught: the shutdown ends this task.
                server._readiness_crashes += 1
                logger.error(
                    "internal error: the readiness keeper crashed (%s: %s); a fresh one starts "
                    "in %.1f s",
                    type(crash).__name__,
                    crash,
                    _RETRY_FIRST,
                    exc_info=crash,
                )
                # Not at once: a bug that raises on every try would log as fast as it can.
                await trio.sleep(_RETRY_FIRST)


async def _keep_models_ready(server: RunningServer) -> None:
    """Load every model in every worker and keep the registry's readiness true to it.

    A model that fails to load is not ready and is retried with backoff. After a worker process
    crashes, the models are loaded again: that starts the replacement worker now rather than on
    some caller's request path, and a model whose loading is what crashes workers turns not
    ready instead of failing every call. A worker that cannot be started (out of file
    descriptors, say) is not a failure of the models: a model stays ready while any worker has
    it loaded, and is loaded in that worker's lane once it has a worker again.
    """
    registry, pool = server.core.registry, server.core.pool
    while True:
        failing = list(registry)
        backoff = _RETRY_FIRST
        while failing:
            failing = [s for s in failing if not await _load_everywhere(pool, registry, s)]
            if failing:
                await trio.sleep(backoff)
                backoff = min(backoff * 2, _RETRY_MAX)
        if not server._ready.is_set():
            logger.info("ready: %s", ", ".join(settings.name for settings in registry))
            server._ready.set()
        await pool.wait_workers_changed()


async def _load_everywhere(
    pool: WorkerPool, registry: ModelRegistry, settings: ModelSettings
) -> bool:
    try:
        await pool.warm_up([settings])
    except InferError as exc:
        logger.error("model '%s' is not ready: %s", settings.name, exc.message)
        registry.set_ready(settings.name, False)
        return False
    registry.set_ready(settings.name, True)
    return True


def _tls_context(config: ServerConfig) -> ssl.SSLContext | None:
    if config.tls_cert is None:
        if config.tls_key is not None or config.tls_client_ca is not None:
            raise ValueError("tls_key and tls_client_ca need tls_cert")
        return None
    if config.tls_key is None:
        raise ValueError("tls_cert needs tls_key")
    return server_context(config.tls_cert, config.tls_key, config.tls_client_ca)


def _security(config: ServerConfig) -> str:
    """How the listener is secured, as the start-up log line says it."""
    if config.tls_cert is None:
        return ""
    if config.tls_client_ca is None:
        return " over TLS"
    return " over mutual TLS (client certificates required)"


def _physical_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
