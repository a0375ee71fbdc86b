"""The benchmark's floors (``h2-floor``, ``frames-floor``, ``tasks-floor``): each answers a real
grpcio client's ServerLive and ServerReady, alone and many at once on one connection, and says
UNIMPLEMENTED to any other method, so their rows measure calls that were really answered."""

from __future__ import annotations

import socket
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from bench.attacks import PREFACE, SETTINGS, frame
from trio_infer.protobuf._proto import grpc_predict_v2_pb2 as pb
from trio_infer.protobuf._proto import grpc_predict_v2_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parent.parent
FLOORS = {
    "h2-floor": ["bench.peers.h2_floor"],
    "frames-floor": ["bench.peers.frames_floor"],
    "tasks-floor": ["bench.peers.frames_floor", "tasks"],
}


def free_port() -> int:
    # The floors do not say which port they got: each is given one.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


@pytest.fixture
def floor_port() -> int:
    return free_port()


@pytest.fixture(params=sorted(FLOORS))
def floor(
    request: pytest.FixtureRequest, floor_port: int
) -> Iterator[pb_grpc.GRPCInferenceServiceStub]:
    module, *extra = FLOORS[request.param]
    port = floor_port
    process = subprocess.Popen([sys.executable, "-m", module, str(port), *extra], cwd=ROOT)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            grpc.channel_ready_future(channel).result(timeout=30)
            yield pb_grpc.GRPCInferenceServiceStub(channel)
    finally:
        process.terminate()
        process.wait(10)


def test_a_floor_answers_the_health_calls_and_nothing_else(
    floor: pb_grpc.GRPCInferenceServiceStub,
) -> None:
    assert floor.ServerLive(pb.ServerLiveRequest(), timeout=10).live
    assert floor.ServerReady(pb.ServerReadyRequest(), timeout=10).ready
    with pytest.raises(grpc.RpcError) as refused:
        floor.ModelReady(pb.ModelReadyRequest(name="dense"), timeout=10)
    assert refused.value.code() is grpc.StatusCode.UNIMPLEMENTED


def test_a_floor_answers_every_call_of_a_burst_on_one_connection(
    floor: pb_grpc.GRPCInferenceServiceStub,
) -> None:
    # 2,000 calls, 200 at a time: many calls end in one read, so their answers leave together.
    for _ in range(10):
        calls = [floor.ServerLive.future(pb.ServerLiveRequest(), timeout=30) for _ in range(200)]
        assert all(call.result().live for call in calls)


def test_a_floor_outlives_a_client_that_resets_its_connection(
    floor: pb_grpc.GRPCInferenceServiceStub, floor_port: int
) -> None:
    # A round whose client aborts must not take the server away from the rounds after it.
    # The reset is on the wire before each call is sent, so the floor has read it by the time
    # it has answered that call; the call after the last reset's is answered only if the
    # floor outlived them all.
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", floor_port)) as rude:
            rude.sendall(PREFACE + frame(SETTINGS, 0, 0, b""))
            assert rude.recv(1024)  # the floor's SETTINGS: it is reading this connection
            rude.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        assert floor.ServerLive(pb.ServerLiveRequest(), timeout=10).live
    assert floor.ServerLive(pb.ServerLiveRequest(), timeout=10).live
