"""Tensors crossing the hop between the server and its worker processes: every datatype, at
the sizes where the wire changes how it carries them (in the pickle, out of band, around the
staging buffer's size, several MiB), sent by a real client to a real server whose workers echo
them back bit for bit."""

from __future__ import annotations

import itertools
import struct

import numpy as np
import pytest
import trio

from tests.support import GrpcioClient, start_server
from trio_infer.datatypes import DATATYPES, LENGTH_PREFIX
from trio_infer.protobuf._proto.grpc_predict_v2_pb2 import ModelInferRequest
from trio_infer.server import RunningServer
from trio_infer.workers import wire

MiB = 1024 * 1024
#: Byte sizes of a tensor's data: none, one byte, each side of the out-of-band threshold and
#: of the staging buffer's size, and several MiB (more than a socket holds at once).
THRESHOLD = wire._OUT_OF_BAND_BYTES
STAGING = wire._STAGING_BYTES
SIZES = [0, 1, THRESHOLD - 1, THRESHOLD, THRESHOLD + 1, STAGING - 1, STAGING, STAGING + 1]
SIZES += [3 * MiB + 5]


def _tensor(datatype: str, size: int, seed: int) -> np.ndarray:
    """A tensor of ``datatype`` whose data is about ``size`` bytes (its elements' whole number
    nearest below; a BYTES tensor's elements together hold ``size`` bytes), every bit pattern
    random (floats' NaN payloads included)."""
    rng = np.random.default_rng(seed)
    if datatype == "BYTES":
        raw = rng.integers(0, 256, size, np.uint8).tobytes()
        cuts = sorted({0, size, *rng.integers(0, size + 1, 3).tolist()})
        return np.array([raw[a:b] for a, b in itertools.pairwise(cuts)] or [b""], object)
    dtype = DATATYPES[datatype]
    count = size // dtype.itemsize or (1 if size else 0)
    if datatype == "BOOL":
        return rng.integers(0, 2, count, np.uint8).astype(bool)
    return rng.integers(0, 256, count * dtype.itemsize, np.uint8).view(dtype)


def _raw(array: np.ndarray) -> bytes:
    if array.dtype == object:
        return b"".join(struct.pack("<I", len(item)) + item for item in array)
    return array.tobytes()


def _parse(raw: bytes, datatype: str, shape: list[int]) -> np.ndarray:
    if datatype != "BYTES":
        return np.frombuffer(raw, DATATYPES[datatype]).reshape(shape)
    items, at = [], 0
    while at < len(raw):
        (length,) = struct.unpack_from("<I", raw, at)
        items.append(raw[at + LENGTH_PREFIX : at + LENGTH_PREFIX + length])
        at += LENGTH_PREFIX + length
    return np.array(items, object).reshape(shape)


def _request(tensors: dict[str, np.ndarray]) -> ModelInferRequest:
    request = ModelInferRequest(model_name="echo")
    for name, array in tensors.items():
        datatype = next(k for k, v in DATATYPES.items() if v == array.dtype)
        request.inputs.add(name=name, datatype=datatype, shape=list(array.shape))
        request.raw_input_contents.append(_raw(array))
    return request


def _assert_bit_exact(response: object, sent: dict[str, np.ndarray]) -> None:
    outputs = {
        output.name: _parse(raw, output.datatype, list(output.shape))
        for output, raw in zip(
            response.outputs,  # type: ignore[attr-defined]
            response.raw_output_contents,  # type: ignore[attr-defined]
            strict=True,
        )
    }
    assert outputs.keys() == sent.keys()
    for name, array in sent.items():
        got = outputs[name]
        assert got.dtype == array.dtype, name
        assert got.shape == array.shape, name
        if array.dtype == object:
            assert list(got) == list(array), name
        else:
            assert got.tobytes() == array.tobytes(), name


@pytest.fixture
async def one_worker_server(nursery: trio.Nursery) -> RunningServer:
    """The example models behind a real server with one worker, so every call crosses the
    same connection one after another: each frame starts where the last one's bytes left the
    staging buffer."""
    return await start_server(nursery, workers=1)


@pytest.mark.parametrize("size", SIZES)
async def test_every_datatype_at_every_size_comes_back_bit_exact(
    one_worker_server: RunningServer, size: int
) -> None:
    client = GrpcioClient(one_worker_server.port)
    try:
        # Each datatype alone (its frame's only buffer), then all of them in one call.
        for seed, datatype in enumerate(DATATYPES):
            tensors = {"x": _tensor(datatype, size, seed)}
            _assert_bit_exact(await client.call("ModelInfer", _request(tensors)), tensors)
        tensors = {name.lower(): _tensor(name, size, 99) for name in DATATYPES}
        _assert_bit_exact(await client.call("ModelInfer", _request(tensors)), tensors)
    finally:
        client.channel.close()
