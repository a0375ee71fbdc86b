"""The server's ownership tree: worker pool, model readiness, listeners, and shutdown.

::

    run_server                         owns everything below; returns when all of it is done
    ├── WorkerPool                     worker processes; closed last, so no call outlives it
    └── server nursery
        ├── GrpcServer.serve           listeners and connections (see trio_infer.transport)
        └── warm-up                    loads every model in every worker, then marks it ready

Shutdown (:meth:`RunningServer.shutdown`): readiness turns false, listeners close and every
connection gets GOAWAY; calls in flight have the grace period to finish; the rest end with
UNAVAILABLE; connections that still have not closed a moment later are cut off by the server
nursery's deadline; then the pool shuts its workers down.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import trio

from trio_infer.grpc_protocol import ProtocolLimits
from trio_infer.pool import WorkerPool
from trio_infer.registry import ModelRegistry
from trio_infer.service import InferenceService
from trio_infer.settings import EXAMPLES, load_repository
from trio_infer.transport import GrpcServer

__all__ = ["RunningServer", "ServerConfig", "run_server"]

logger = logging.getLogger(__name__)

#: After the grace period, how long connections get to deliver their final statuses.
_CLOSE_SLACK = 1.0


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
        debug: Include tracebacks in the messages of model errors.
    """

    repository: Path = EXAMPLES
    host: str = "0.0.0.0"
    grpc_port: int = 8081
    workers: int = field(default_factory=lambda: os.cpu_count() or 1)
    grace_period: float = 30.0
    max_message_size: int = 64 * 1024 * 1024
    debug: bool = False


class RunningServer:
    """A handle on a server started with ``await nursery.start(run_server, config)``."""

    def __init__(self, host: str, port: int, service: InferenceService) -> None:
        self.host = host
        """The address the server listens on."""
        self.port = port
        """The gRPC port it is bound to (the real one, when 0 was asked for)."""
        self.service = service
        self._shutdown_requested = trio.Event()
        self._ready = trio.Event()

    @property
    def shutting_down(self) -> bool:
        """Whether :meth:`shutdown` has been called."""
        return self._shutdown_requested.is_set()

    def shutdown(self) -> None:
        """Start a graceful shutdown; ``run_server`` returns when it is complete."""
        self._shutdown_requested.set()

    async def wait_ready(self) -> None:
        """Wait until every model is loaded in the workers and the server reports ready."""
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
        OSError: the port cannot be bound.
    """
    registry = ModelRegistry(load_repository(config.repository))
    async with WorkerPool.open(config.workers, debug=config.debug) as pool:
        service = InferenceService(registry, pool)
        grpc = GrpcServer(service.handle, ProtocolLimits(max_message_size=config.max_message_size))
        listeners = await trio.open_tcp_listeners(config.grpc_port, host=config.host)
        port: int = listeners[0].socket.getsockname()[1]
        async with trio.open_nursery() as nursery:
            await nursery.start(grpc.serve, listeners)
            server = RunningServer(config.host, port, service)
            logger.info(
                "serving %d model(s) from %s on %s:%d with %d worker(s)",
                len(list(registry)), config.repository, config.host, port, config.workers,
            )
            warm_up = trio.CancelScope()
            nursery.start_soon(_warm_up, server, warm_up)
            task_status.started(server)

            await server._shutdown_requested.wait()
            logger.info("shutting down: %d call(s) in flight, grace period %.1f s",
                        grpc.calls_in_flight.count, config.grace_period)
            service.draining = True
            warm_up.cancel()
            await grpc.shutdown(config.grace_period)
            nursery.cancel_scope.deadline = trio.current_time() + _CLOSE_SLACK
    logger.info("server stopped")


async def _warm_up(server: RunningServer, scope: trio.CancelScope) -> None:
    registry = server.service.registry
    with scope:
        models = list(registry)
        await server.service.pool.warm_up(models)
        for settings in models:
            registry.set_ready(settings.name, True)
        server._ready.set()
        logger.info("ready: %s", ", ".join(settings.name for settings in models))
