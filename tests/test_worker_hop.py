"""Tensors crossing the hop between the server and its worker processes: every datatype, at
the sizes where the wire changes how it carries them (in the pickle, out of band, around the
staging buffer's size, several MiB), and around the message size from which the gRPC front-end
splits a request's raw inputs off its message, sent by a real client to a real server whose
workers echo them back bit for bit."""

from __future__ import annotations

import itertools
import struct

import grpc
import numpy as np
import pytest
import trio

from tests.support import GrpcioClient, start_server
from trio_infer.datatypes import DATATYPES, LENGTH_PREFIX
from trio_infer.frontends import grpc_service
from trio_infer.protobuf._proto.grpc_predict_v2_pb2 import ModelInferRequest, ModelInferResponse
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


#: Message sizes each side of the one from which raw inputs are split off a request.
SPLIT = grpc_service._SPLIT_MESSAGE
_INFER = "/inference.GRPCInferenceService/ModelInfer"


def _of_size(tensors: dict[str, np.ndarray], size: int) -> ModelInferRequest:
    """:func:`_request` of ``tensors``, its id padded so that its message is ``size`` bytes."""
    request = _request(tensors)
    unpadded = request.ByteSize()
    for key_and_length in (2, 3):  # the id's key, and its length in one byte or two
        request.id = "i" * (size - unpadded - key_and_length)
        if request.ByteSize() == size:
            return request
    raise AssertionError(f"no id pads a message of {unpadded} bytes to {size}")


def _records(request: ModelInferRequest) -> tuple[bytes, bytes]:
    """``request`` serialised: its records before its raw inputs, and those."""
    raw = ModelInferRequest(raw_input_contents=request.raw_input_contents)
    head = ModelInferRequest()
    head.CopyFrom(request)
    head.ClearField("raw_input_contents")
    return head.SerializeToString(), raw.SerializeToString()


async def _call_bytes(port: int, data: bytes) -> ModelInferResponse | grpc.RpcError:
    """ModelInfer with ``data`` as the request message, as sent: its answer, or its error."""

    def call() -> ModelInferResponse | grpc.RpcError:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            infer = channel.unary_unary(_INFER, response_deserializer=ModelInferResponse.FromString)
            try:
                response: ModelInferResponse = infer(data, timeout=60)
            except grpc.RpcError as error:
                return error
            return response

    return await trio.to_thread.run_sync(call)


@pytest.mark.parametrize("size", [SPLIT - 1, SPLIT, SPLIT + 1])
async def test_every_datatype_around_the_raw_split_comes_back_bit_exact(
    one_worker_server: RunningServer, size: int
) -> None:
    client = GrpcioClient(one_worker_server.port)
    try:
        # Twice each: a numeric layout first goes through the decoding stages (which read the
        # raw inputs from the request), then, remembered, is decoded in one pass.
        for seed, datatype in enumerate(DATATYPES):
            tensors = {"x": _tensor(datatype, size - 64, seed)}
            for _ in range(2):
                _assert_bit_exact(await client.call("ModelInfer", _of_size(tensors, size)), tensors)
        tensors = {name.lower(): _tensor(name, (size - 900) // 13, 7) for name in DATATYPES}
        _assert_bit_exact(await client.call("ModelInfer", _of_size(tensors, size)), tensors)
    finally:
        client.channel.close()


async def test_raw_inputs_before_other_fields_are_read_as_the_whole_message(
    one_worker_server: RunningServer,
) -> None:
    # Not the suffix of its message: the request is parsed whole, as written.
    tensors = {"x": _tensor("FP32", 2 * SPLIT, 3), "y": _tensor("INT8", 100, 4)}
    head, raw = _records(_request(tensors))
    _assert_bit_exact(await _call_bytes(one_worker_server.port, raw + head), tensors)


async def test_a_split_request_is_refused_as_the_whole_one_is(
    one_worker_server: RunningServer,
) -> None:
    port = one_worker_server.port
    tensors = {"x": _tensor("FP32", 2 * SPLIT, 5)}
    head, raw = _records(_request(tensors))
    # Records before the raw inputs that do not parse (a model name that is not UTF-8).
    bad_name = b"\x0a\x02\xff\xfe" + head
    # Typed contents beside the raw inputs.
    typed = _request(tensors)
    typed.inputs[0].contents.fp32_contents.append(1.0)
    # One raw entry too many, and one short of its shape.
    extra = _request(tensors)
    extra.raw_input_contents.append(b"")
    short = _request(tensors)
    short.raw_input_contents[0] = short.raw_input_contents[0][:-4]
    expected = {
        bad_name + raw: "the request is not a valid inference.ModelInferRequest",
        typed.SerializeToString(): (
            "contents field must not be specified when using raw_input_contents for 'x' for "
            "model 'echo': send every input raw or every input typed, not both"
        ),
        extra.SerializeToString(): (
            "request has 1 inputs but 2 raw_input_contents entries; raw_input_contents needs "
            "exactly one entry per input, in input order"
        ),
        short.SerializeToString(): (
            "input 'x': shape [8192] has 8192 elements but raw_input_contents[0] holds 8191 "
            "FP32 elements (32764 bytes)"
        ),
    }
    for data, message in expected.items():
        error = await _call_bytes(port, data)
        assert isinstance(error, grpc.RpcError)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
        assert error.details() == message  # type: ignore[attr-defined]
    # The server goes on: the same request, well-formed, is answered.
    _assert_bit_exact(await _call_bytes(port, head + raw), tensors)
