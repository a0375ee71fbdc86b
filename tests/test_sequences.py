"""Sequences (stateful models): a real server with 2 real worker processes, tritonclient's
sequence parameters over ModelStreamInfer and ModelInfer. The model keeps each sequence's running
sum in its process's memory and answers with it and its pid: a sum that is right proves the
requests ran in order on the worker that holds the sequence's state."""

from __future__ import annotations

import os
import queue
import random
import signal
import textwrap
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import trio
import tritonclient.grpc as triton
from tritonclient.utils import InferenceServerException

from tests.support import GrpcioClient, eventually, start_server, write_repository
from trio_infer.errors import InvalidInput, Unavailable
from trio_infer.model import Parameters, ParameterValue
from trio_infer.protobuf._proto import grpc_predict_v2_pb2 as pb
from trio_infer.protobuf.codec import decode_outputs, encode_inputs, encode_parameters
from trio_infer.scheduling.sequences import SequenceFlags, SequenceTable, sequence_of
from trio_infer.server import RunningServer

MODEL = textwrap.dedent(
    """
    import os

    import numpy as np

    from trio_infer.model import Model


    class Accumulate(Model):
        def load(self):
            self.sums = {}

        def predict(self, inputs, parameters):
            sequence = parameters["sequence_id"]
            if parameters["sequence_start"]:
                self.sums[sequence] = 0
            self.sums[sequence] += int(inputs["x"].sum())  # KeyError: a sequence never started
            total = self.sums[sequence]
            if parameters["sequence_end"]:
                del self.sums[sequence]
            rows = len(inputs["x"])
            return {
                "sum": np.full(rows, total, np.int64),
                "pid": np.full(rows, os.getpid(), np.int64),
            }
    """
)


def _repository(root: Path) -> Path:
    spec = {
        "implementation": "accumulate.Accumulate",
        "inputs": [{"name": "x", "datatype": "INT64", "shape": [-1]}],
        "outputs": [
            {"name": "sum", "datatype": "INT64", "shape": [-1]},
            {"name": "pid", "datatype": "INT64", "shape": [-1]},
        ],
        # It batches: a sequence's requests must not.
        "max_batch_size": 8,
        "max_batch_time": 0.005,
    }
    models = {
        "accumulate": {**spec, "max_sequence_idle_microseconds": 600_000_000},
        "forgetful": {**spec, "max_sequence_idle_microseconds": 50_000},
    }
    return write_repository(root, models, "accumulate", MODEL)


@pytest.fixture
async def server(nursery: trio.Nursery, tmp_path: Path) -> RunningServer:
    return await start_server(nursery, _repository(tmp_path / "repository"), workers=2)


def _x(value: int) -> list[Any]:
    x = triton.InferInput("x", [1], "INT64")
    x.set_data_from_numpy(np.array([value], np.int64))
    return [x]


def _answer(result: Any) -> tuple[int, int]:
    """(running sum, pid) of a response."""
    return int(result.as_numpy("sum")[0]), int(result.as_numpy("pid")[0])


async def _infer(port: int, model: str, value: int, **sequence: Any) -> tuple[int, int]:
    def call() -> tuple[int, int]:
        client = triton.InferenceServerClient(f"127.0.0.1:{port}")
        try:
            return _answer(client.infer(model, _x(value), **sequence))
        finally:
            client.close()

    return await trio.to_thread.run_sync(call)


async def _refused(port: int, model: str, value: int, **sequence: Any) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as caught:
        await _infer(port, model, value, **sequence)
    return caught.value


def test_the_sequence_parameters_are_read_as_tritonclient_sends_them() -> None:
    assert sequence_of({}) is None
    assert sequence_of({"sequence_id": 0}) is None
    assert sequence_of({"sequence_id": 7, "sequence_start": True}) == SequenceFlags(7, True, False)
    assert sequence_of({"sequence_id": "s", "sequence_end": True}) == SequenceFlags(
        "s", False, True
    )
    for bad in (
        {"sequence_id": True},
        {"sequence_id": 1.5},
        {"sequence_id": -1, "sequence_start": True},
        {"sequence_id": 1, "sequence_start": 1},
        {"sequence_start": True},
    ):
        with pytest.raises(InvalidInput):
            sequence_of(bad)


@pytest.mark.parametrize(
    "values",
    [{}, {"sequence_id": 0}, {"sequence_id": 7, "sequence_start": True}, {"sequence_id": "s"}],
)
def test_a_models_parameters_read_as_the_dict_they_were_made_from(
    values: dict[str, ParameterValue],
) -> None:
    # The server reads a request's sequence flags from the Parameters its model will see.
    parameters = Parameters(values)
    assert sequence_of(parameters) == sequence_of(values)
    for key in ("sequence_id", "sequence_start", "absent"):
        assert (key in parameters) is (key in values)
        assert parameters.get(key) == values.get(key)
        assert parameters.get(key, "default") == values.get(key, "default")


async def test_interleaved_sequences_on_a_stream_and_unary_calls_each_run_in_order_on_one_worker(
    server: RunningServer,
) -> None:
    port = server.port
    stream_values = [1, 2, 4, 8, 16, 32]
    unary_values = [100, 200, 400, 800, 1600, 3200]

    def run() -> tuple[list[Any], list[tuple[int, int]]]:
        answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
        client = triton.InferenceServerClient(f"127.0.0.1:{port}")
        unary: list[tuple[int, int]] = []
        try:
            client.start_stream(callback=lambda result, error: answers.put((result, error)))
            last = len(stream_values) - 1
            for i, (a, b) in enumerate(zip(stream_values, unary_values, strict=True)):
                # Sequence 41 goes on the stream without waiting for its answers.
                client.async_stream_infer(
                    "accumulate",
                    _x(a),
                    request_id=str(i),
                    sequence_id=41,
                    sequence_start=i == 0,
                    sequence_end=i == last,
                )
                # Sequence "b" by ModelInfer, one call at a time, between them.
                result = client.infer(
                    "accumulate",
                    _x(b),
                    sequence_id="b",
                    sequence_start=i == 0,
                    sequence_end=i == last,
                )
                unary.append(_answer(result))
            streamed = [answers.get(timeout=30) for _ in stream_values]
            client.stop_stream()
        finally:
            client.close()
        return streamed, unary

    streamed, unary = await trio.to_thread.run_sync(run)
    assert all(error is None for _, error in streamed), streamed
    by_id = {result.get_response().id: _answer(result) for result, _ in streamed}
    stream_answers = [by_id[str(i)] for i in range(len(stream_values))]
    # Each answer is the sum of the sequence's values up to it: they ran in order, with state.
    assert [s for s, _ in stream_answers] == list(np.cumsum(stream_values))
    assert [s for s, _ in unary] == list(np.cumsum(unary_values))
    stream_pids = {pid for _, pid in stream_answers}
    unary_pids = {pid for _, pid in unary}
    assert len(stream_pids) == 1
    assert len(unary_pids) == 1
    # Two live sequences on two workers: the second started on the less loaded one.
    assert stream_pids != unary_pids


async def test_a_request_of_a_sequence_not_started_or_ended_is_invalid_like_triton(
    server: RunningServer,
) -> None:
    port = server.port
    error = await _refused(port, "accumulate", 1, sequence_id=9)
    assert error.status() == "StatusCode.INVALID_ARGUMENT"
    assert error.message() == (
        "inference request for sequence 9 to model 'accumulate' must specify the START flag on "
        "the first request of the sequence"
    )
    assert (await _infer(port, "accumulate", 1, sequence_id=9, sequence_start=True))[0] == 1
    assert (await _infer(port, "accumulate", 2, sequence_id=9, sequence_end=True))[0] == 3
    error = await _refused(port, "accumulate", 4, sequence_id=9)
    assert error.status() == "StatusCode.INVALID_ARGUMENT"


async def test_a_negative_sequence_id_is_400_over_rest_and_its_uint64_over_grpc_as_triton(
    server: RunningServer,
) -> None:
    # Triton's C++ client sends a uint64 id in int64_param, so 2**64 - 7 arrives as -7, and
    # Triton reads it back as 2**64 - 7: one sequence, whichever form each request uses.
    sequence = 2**64 - 7
    client = GrpcioClient(server.port)

    def request(value: int, kind: str) -> Any:
        message = pb.ModelInferRequest(model_name="accumulate")
        encode_inputs(message, [("x", np.array([value], np.int64))], raw=True)
        setattr(message.parameters["sequence_id"], kind, -7 if kind == "int64_param" else sequence)
        message.parameters["sequence_start"].bool_param = False
        message.parameters["sequence_end"].bool_param = False
        return message

    # tritonclient.grpc sends int64_param too: -7 starts it.
    total, pid = await _infer(server.port, "accumulate", 1, sequence_id=-7, sequence_start=True)
    assert total == 1
    answer = await client.call("ModelInfer", request(2, "uint64_param"), timeout=20)
    assert decode_outputs(answer)["sum"][0] == 3
    answers = await trio.to_thread.run_sync(
        lambda: list(
            client.stub.ModelStreamInfer(
                iter([request(3, "int64_param"), request(4, "uint64_param")]), timeout=20
            )
        )
    )
    assert [a.error_message for a in answers] == ["", ""]
    assert [decode_outputs(a.infer_response)["sum"][0] for a in answers] == [6, 10]
    client.channel.close()
    message = "parameter 'sequence_id' must be an unsigned integer or a string, got -5"
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.http_port}") as http:

        async def infer(sequence_id: int, value: int, start: bool, end: bool) -> httpx.Response:
            return await http.post(
                "/v2/models/accumulate/infer",
                json={
                    "parameters": {
                        "sequence_id": sequence_id,
                        "sequence_start": start,
                        "sequence_end": end,
                    },
                    "inputs": [{"name": "x", "datatype": "INT64", "shape": [1], "data": [value]}],
                },
            )

        # Triton's REST front-end reads the number as uint64: a negative one is refused.
        refused = await infer(-5, 1, True, True)
        assert refused.status_code == 400
        assert refused.json() == {"error": message}
        ended = await infer(sequence, 5, False, True)
        assert ended.status_code == 200, ended.text
        assert [output["data"] for output in ended.json()["outputs"]] == [[15], [pid]]
    assert len(server.core.pool._sequences) == 0


async def test_a_sequence_idle_past_the_models_limit_is_ended(server: RunningServer) -> None:
    port = server.port
    assert (await _infer(port, "forgetful", 5, sequence_id="s", sequence_start=True))[0] == 5
    # Its limit is 50 ms; this sleeps well past it (a lower bound, not a timing assertion).
    await trio.sleep(0.3)
    error = await _refused(port, "forgetful", 1, sequence_id="s")
    assert error.status() == "StatusCode.INVALID_ARGUMENT"
    assert "must specify the START flag" in error.message()
    # A new start begins it again.
    assert (await _infer(port, "forgetful", 7, sequence_id="s", sequence_start=True))[0] == 7


async def test_a_killed_worker_fails_only_its_sequences_and_the_other_goes_on(
    server: RunningServer,
) -> None:
    port = server.port
    _, pid_a = await _infer(port, "accumulate", 1, sequence_id=1, sequence_start=True)
    _, pid_b = await _infer(port, "accumulate", 10, sequence_id=2, sequence_start=True)
    assert pid_a != pid_b
    assert await _infer(port, "accumulate", 2, sequence_id=1) == (3, pid_a)

    crashed = server.statistics().pool.crashed
    os.kill(pid_a, signal.SIGKILL)
    await eventually(lambda: server.statistics().pool.crashed > crashed)

    error = await _refused(port, "accumulate", 4, sequence_id=1)
    assert error.status() == "StatusCode.UNAVAILABLE"
    assert error.message() == (
        f"sequence 1 of model 'accumulate' was lost with its worker (process {pid_a}, killed by "
        "signal SIGKILL)"
    )
    # It stays lost until it starts again; the other sequence was never touched.
    assert (await _refused(port, "accumulate", 4, sequence_id=1)).status() == (
        "StatusCode.UNAVAILABLE"
    )
    assert await _infer(port, "accumulate", 20, sequence_id=2) == (30, pid_b)
    total, pid = await _infer(port, "accumulate", 4, sequence_id=1, sequence_start=True)
    assert total == 4
    assert pid != pid_a
    assert await _infer(port, "accumulate", 40, sequence_id=2, sequence_end=True) == (70, pid_b)


async def test_a_sequences_requests_sent_in_one_burst_on_a_stream_run_in_order(
    server: RunningServer,
) -> None:
    # Sent in one write, they arrive in one read: the stream's tasks run in any order, the
    # sequence's requests still reach the model in the order sent (running sums 1, 3, 6...).
    requests = []
    for index in range(1, 41):
        request = pb.ModelInferRequest(model_name="accumulate", id=str(index))
        encode_inputs(request, [("x", np.array([index], np.int64))], raw=True)
        encode_parameters(
            request.parameters,
            {"sequence_id": 77, "sequence_start": index == 1, "sequence_end": index == 40},
        )
        requests.append(request)
    client = GrpcioClient(server.port)
    answers = await trio.to_thread.run_sync(
        lambda: list(client.stub.ModelStreamInfer(iter(requests), timeout=20))
    )
    assert [a.error_message for a in answers] == [""] * 40
    sums = {int(a.infer_response.id): decode_outputs(a.infer_response)["sum"][0] for a in answers}
    assert [sums[i] for i in range(1, 41)] == [i * (i + 1) // 2 for i in range(1, 41)]


def test_the_sequence_table_counts_each_holders_live_sequences_without_walking_them() -> None:
    # held_by is asked for every lane at each sequence_start: it must not walk every live
    # sequence (starts would cost O(live sequences) on the event loop: quadratic under a flood
    # of starts), and must agree with the pins through starts, ends, idle drops and losses.
    class Walked(OrderedDict):  # type: ignore[type-arg]
        walks = 0

        def values(self):  # type: ignore[no-untyped-def, override]
            Walked.walks += 1
            return super().values()

    holders = ["a", "b", "c"]
    table: SequenceTable[str] = SequenceTable()
    rng = random.Random(7)
    now = 0.0

    def brute(holder: str) -> int:
        return sum(
            1
            for pins in table._models.values()
            for pin in pins.values()
            if pin.holder is holder and pin.lost is None
        )

    for _ in range(3000):
        now += rng.random() * 0.01
        op = rng.random()
        sequence = rng.randrange(1, 200)
        model = rng.choice(["m", "n"])
        try:
            if op < 0.5:
                flags = SequenceFlags(sequence, rng.random() < 0.5, rng.random() < 0.2)
                pin = table.route(model, flags, 1.0, now, lambda: rng.choice(holders))
                table.finished(pin, now)
            elif op < 0.52:
                table.lose(rng.choice(holders), "test")
        except (InvalidInput, Unavailable):  # not started, or lost with its holder
            pass
        for holder in holders:
            assert table.held_by(holder) == brute(holder)

    for model in list(table._models):
        table._models[model] = Walked(table._models[model])
    Walked.walks = 0
    for holder in holders:
        table.held_by(holder)
    assert Walked.walks == 0


async def test_a_sequence_request_on_a_stream_times_out_while_waiting_for_its_turn(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    # A model that takes 1.5 s for the sequence's first request: the second, sent with a
    # timeout of 200 ms, fails at its timeout while it waits for its turn; the third still
    # runs after the first (running sum 1 + 100: the second never ran).
    source = MODEL.replace(
        "        total = self.sums[sequence]",
        "        time.sleep(parameters.get('delay', 0))\n        total = self.sums[sequence]",
    ).replace("import os\n", "import os\nimport time\n", 1)
    spec = {
        "implementation": "accumulate.Accumulate",
        "inputs": [{"name": "x", "datatype": "INT64", "shape": [-1]}],
        "outputs": [
            {"name": "sum", "datatype": "INT64", "shape": [-1]},
            {"name": "pid", "datatype": "INT64", "shape": [-1]},
        ],
    }
    root = write_repository(tmp_path / "slow", {"slow_accumulate": spec}, "accumulate", source)
    server = await start_server(nursery, root, workers=2)
    requests = []
    for index, (value, parameters) in enumerate(
        [
            (1, {"sequence_start": True, "sequence_end": False, "delay": 1.5}),
            (10, {"sequence_start": False, "sequence_end": False, "timeout": 200_000}),
            (100, {"sequence_start": False, "sequence_end": True}),
        ]
    ):
        request = pb.ModelInferRequest(model_name="slow_accumulate", id=str(index))
        encode_inputs(request, [("x", np.array([value], np.int64))], raw=True)
        encode_parameters(request.parameters, {"sequence_id": 5, **parameters})
        requests.append(request)
    client = GrpcioClient(server.port)

    def stream() -> list[tuple[float, Any]]:
        t0 = time.monotonic()
        return [
            (time.monotonic() - t0, answer)
            for answer in client.stub.ModelStreamInfer(iter(requests), timeout=20)
        ]

    try:
        answers = await trio.to_thread.run_sync(stream)
    finally:
        client.channel.close()
    by_id = {answer.infer_response.id: (at, answer) for at, answer in answers}
    at, second = by_id["1"]
    assert "deadline exceeded" in second.error_message
    assert at < 1.0  # at its own timeout, not once the first had been answered
    assert [a.error_message for _, a in (by_id["0"], by_id["2"])] == ["", ""]
    assert decode_outputs(by_id["2"][1].infer_response)["sum"][0] == 101
