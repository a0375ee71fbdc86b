"""Fixtures: a real server on 127.0.0.1 port 0 with real worker processes, and real clients."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from tests.probe import Probe, start_probe
from tests.support import GrpcioClient, start_server
from trio_infer.server import RunningServer


@pytest.fixture
async def server(nursery: trio.Nursery) -> RunningServer:
    """The built-in example models behind a real server with two worker processes."""
    return await start_server(nursery)


@pytest.fixture
def grpcio_client(server: RunningServer) -> Iterator[GrpcioClient]:
    """A grpcio client connected to :func:`server`."""
    client = GrpcioClient(server.port)
    yield client
    client.channel.close()


@pytest.fixture
async def probe(nursery: trio.Nursery, tmp_path: Path) -> Probe:
    return await start_probe(nursery, tmp_path)
