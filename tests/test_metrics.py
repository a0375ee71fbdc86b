"""Prometheus metrics: the recorder's arithmetic, and the metrics of a real server after known
traffic over gRPC, parsed with prometheus_client's own parser."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import trio
import trio.testing
from prometheus_client.parser import text_string_to_metric_families

from tests.probe import write_probe_repository
from tests.support import GrpcioClient, eventually, start_server
from trio_infer.errors import InferError, InvalidInput, StatusCode
from trio_infer.frontends.http_service import http_status
from trio_infer.protobuf._proto import grpc_predict_v2_pb2 as pb
from trio_infer.protobuf.codec import decode_outputs, encode_inputs, encode_parameters
from trio_infer.repository.settings import EXAMPLES
from trio_infer.scheduling.statistics import (
    Histogram,
    ModelRecorder,
    RequestTiming,
    Timing,
    final_status,
)
from trio_infer.server import RunningServer

# -- the recorder, by itself ------------------------------------------------------------------


def test_a_value_on_a_bound_falls_in_that_bounds_bucket() -> None:
    histogram = Histogram((0.1, 1.0, 10.0))
    for value in (0.0, 0.1, 0.10000001, 1.0, 10.0, 10.5, math.inf):
        histogram.observe(value)
    snapshot = histogram.snapshot()
    assert snapshot.counts == (2, 2, 1, 2)
    assert snapshot.cumulative() == [(0.1, 2), (1.0, 4), (10.0, 5), (math.inf, 7)]
    assert snapshot.count == 7
    assert snapshot.sum == math.inf


def test_a_snapshot_does_not_move_with_later_observations() -> None:
    histogram = Histogram((1.0,))
    histogram.observe(0.5)
    snapshot = histogram.snapshot()
    histogram.observe(2.0)
    assert (snapshot.counts, snapshot.sum) == ((1, 0), 0.5)
    assert histogram.snapshot().counts == (1, 1)


def test_bucket_bounds_must_increase() -> None:
    with pytest.raises(ValueError, match="must increase"):
        Histogram((1.0, 1.0))
    with pytest.raises(ValueError, match="must increase"):
        Histogram((2.0, 1.0))


def test_the_final_status_of_each_way_a_request_ends() -> None:
    assert final_status(None, past_deadline=False) is StatusCode.OK
    assert final_status(InvalidInput("bad"), past_deadline=True) is StatusCode.INVALID_ARGUMENT
    chosen = InferError("quota", StatusCode.RESOURCE_EXHAUSTED)
    assert final_status(chosen, past_deadline=False) is StatusCode.RESOURCE_EXHAUSTED
    assert final_status(RuntimeError("a bug"), past_deadline=False) is StatusCode.INTERNAL


async def test_a_request_cut_by_its_deadline_is_deadline_exceeded_and_a_cancelled_one_cancelled(
    autojump_clock: trio.testing.MockClock,
) -> None:
    recorder = ModelRecorder("m", "1")
    deadline = trio.current_time() + 1.0
    with trio.move_on_at(deadline), RequestTiming(recorder, deadline):
        assert recorder.in_flight == 1
        await trio.sleep(5)
    with trio.CancelScope() as scope, RequestTiming(recorder, math.inf):
        scope.cancel()
        await trio.sleep(5)
    statistics = recorder.statistics()
    assert statistics.requests[StatusCode.DEADLINE_EXCEEDED] == 1
    assert statistics.requests[StatusCode.CANCELLED] == 1
    assert sum(statistics.requests.values()) == 2
    assert statistics.in_flight == 0
    assert statistics.request_duration.sum == pytest.approx(1.0)
    assert statistics.failure_seconds == pytest.approx(1.0)
    # Neither reached a worker: no queue wait, no compute.
    assert statistics.queue_duration.count == statistics.compute_duration.count == 0


async def test_a_successful_request_records_its_wait_compute_and_execution(
    autojump_clock: trio.testing.MockClock,
) -> None:
    recorder = ModelRecorder("m")
    with RequestTiming(recorder, math.inf) as timing:
        await trio.sleep(0.5)
        timing.queued = trio.current_time()
        await trio.sleep(0.25)
        timing.ran(trio.current_time(), 0.125)
        await trio.sleep(0.125)
        timing.executed(3)
    with pytest.raises(InvalidInput), RequestTiming(recorder, math.inf):
        raise InvalidInput("bad")
    statistics = recorder.statistics()
    assert (
        statistics.requests[StatusCode.OK] == statistics.requests[StatusCode.INVALID_ARGUMENT] == 1
    )
    assert statistics.success_seconds == pytest.approx(0.875)
    assert statistics.failure_seconds == 0.0
    assert statistics.queue_duration.sum == pytest.approx(0.25)
    assert statistics.compute_duration.sum == 0.125
    assert (statistics.executions, statistics.inferences) == (1, 3)
    assert statistics.batch_sizes == {3: (1, 0.125)}
    assert statistics.last_inference > 0


def test_a_wait_is_never_negative() -> None:
    recorder = ModelRecorder("m")
    timing = Timing()
    timing.queued = 10.0
    timing.ran(9.999, 0.001)  # the worker's start was seen a hair before the hand-over
    recorder.finished(StatusCode.OK, 0.01, timing)
    assert recorder.statistics().queue_duration.sum == 0.0


def test_durations_counted_together_give_what_counting_each_gives() -> None:
    # A recorder counts its durations into the histograms in groups, and whenever it is read:
    # each read sees every request that ended before it, with the counts and float sums of
    # observing each duration in turn.
    rng = np.random.default_rng(7)
    recorder = ModelRecorder("m")
    request, queue, compute = Histogram(), Histogram(), Histogram()
    for index in range(1000):
        seconds = float(10.0 ** rng.uniform(-5, 2))
        status = StatusCode.OK if index % 7 else StatusCode.INVALID_ARGUMENT
        timing = Timing()
        timing.queued = 1.0
        if index % 5:
            timing.ran(1.0 + float(rng.uniform(-1e-6, 0.01)), float(rng.uniform(0, 0.02)))
        recorder.finished(status, seconds, timing)
        request.observe(seconds)
        if status is StatusCode.OK and timing.started is not None:
            queue.observe(max(timing.started - timing.queued, 0.0))
            compute.observe(timing.compute)
        if index in (0, 254, 255, 256, 511, 700, 999):
            statistics = recorder.statistics()
            assert statistics.request_duration == request.snapshot()
            assert statistics.queue_duration == queue.snapshot()
            assert statistics.compute_duration == compute.snapshot()
    bounds = (0.1, 1.0, 10.0)
    values = [0.0, 0.1, 0.10000001, 1.0, 10.0, 10.5, 0.3]
    together, each = Histogram(bounds), Histogram(bounds)
    together.observe_all(values)
    for value in values:
        each.observe(value)
    assert together.snapshot() == each.snapshot()


def test_executions_by_batch_size_add_up() -> None:
    recorder = ModelRecorder("m")
    for rows, compute in ((4, 0.5), (1, 0.25), (4, 0.25)):
        recorder.executed(rows, compute)
    statistics = recorder.statistics()
    assert statistics.batch_sizes == {1: (1, 0.25), 4: (2, 0.75)}
    assert (statistics.executions, statistics.inferences) == (3, 9)


# -- a real server ----------------------------------------------------------------------------


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(server: RunningServer) -> Samples:
    """Every sample of the server's metrics, by name and labels, through the parser."""
    body, content_type = server.metrics.render()
    assert content_type.startswith("text/plain; version=")
    samples: Samples = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            key = (sample.name, tuple(sorted(sample.labels.items())))
            assert key not in samples, key
            samples[key] = sample.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def model(name: str, **labels: str) -> dict[str, str]:
    return {"model": name, "version": "", **labels}


def add_sub_request(**inputs: np.ndarray) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="add_sub")
    encode_inputs(request, list(inputs.items()), raw=True)
    return request


def metrics_repository(root: Path) -> Path:
    """The probe (which reports its worker's pid), add_sub and sleep as shipped, and dense
    batching exactly 4 rows: its batch waits up to 10 s for them."""
    repository = write_probe_repository(root)
    for name in ("add_sub", "sleep", "dense"):
        shutil.copytree(EXAMPLES / name, repository / name)
    settings = repository / "dense" / "model-settings.json"
    dense = json.loads(settings.read_text())
    settings.write_text(json.dumps(dense | {"max_batch_size": 4, "max_batch_time": 10}))
    return repository


N_OK, M_INVALID, K_EXPIRED, DENSE_REQUESTS = 6, 3, 2, 4


async def test_metrics_count_exactly_the_traffic_sent_and_survive_a_worker_crash(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    server = await start_server(nursery, metrics_repository(tmp_path))
    client = GrpcioClient(server.port)
    before = scrape(server)
    for name in ("add_sub", "dense", "sleep", "probe"):
        assert value(before, "trio_infer_model_ready", **model(name)) == 1
        assert value(before, "trio_infer_requests_total", **model(name, status="OK")) == 0

    x = np.ones((1, 16), np.float32)
    began = trio.current_time()
    for _ in range(N_OK):
        await client.call("ModelInfer", add_sub_request(INPUT0=x, INPUT1=x), timeout=10)
    add_sub_wall = trio.current_time() - began
    for _ in range(M_INVALID):  # INPUT1 missing: refused by the core's validation
        error = await client.error("ModelInfer", add_sub_request(INPUT0=x), timeout=10)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    for _ in range(K_EXPIRED):
        # The request's own timeout (microseconds), not the call's: at grpc-timeout the client
        # resets the stream, and on a busy machine the reset can reach the server before its
        # own deadline passes, which is then a cancellation (CANCELLED), not an expiry.
        request = pb.ModelInferRequest(model_name="sleep")
        encode_inputs(request, [("x", x)], raw=True)
        encode_parameters(request.parameters, {"delay_ms": 5000, "timeout": 300_000})
        error = await client.error("ModelInfer", request, timeout=10)
        assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED

    began = trio.current_time()
    async with trio.open_nursery() as batch:
        for _ in range(DENSE_REQUESTS):
            request = pb.ModelInferRequest(model_name="dense")
            encode_inputs(request, [("x", np.ones((1, 256), np.float32))], raw=True)
            batch.start_soon(lambda r=request: client.call("ModelInfer", r, timeout=20))
    dense_wall = trio.current_time() - began

    # Each expired call's worker was killed (its requester was gone).
    await eventually(lambda: server.core.pool.statistics().killed == K_EXPIRED)
    after = scrape(server)
    requests = "trio_infer_requests_total"
    assert value(after, requests, **model("add_sub", status="OK")) == N_OK
    assert value(after, requests, **model("add_sub", status="INVALID_ARGUMENT")) == M_INVALID
    assert value(after, requests, **model("sleep", status="DEADLINE_EXCEEDED")) == K_EXPIRED
    assert value(after, requests, **model("dense", status="OK")) == DENSE_REQUESTS
    total = sum(v for (name, _), v in after.items() if name == requests)
    assert total == N_OK + M_INVALID + K_EXPIRED + DENSE_REQUESTS

    add_sub = histograms(after, "add_sub")
    assert add_sub["request"][0] == N_OK + M_INVALID
    assert add_sub["queue"][0] == add_sub["compute"][0] == N_OK  # successes only
    # One call at a time: the calls' durations add up to less than the time they took.
    assert 0 < add_sub["request"][1] <= add_sub_wall
    assert add_sub["compute"][1] > 0
    assert add_sub["queue"][1] + add_sub["compute"][1] <= add_sub["request"][1]
    assert value(after, "trio_infer_inferences_total", **model("add_sub")) == N_OK
    assert value(after, "trio_infer_executions_total", **model("add_sub")) == N_OK

    dense = histograms(after, "dense")
    assert dense["request"][0] == dense["queue"][0] == dense["compute"][0] == DENSE_REQUESTS
    assert 0 < dense["request"][1] <= DENSE_REQUESTS * dense_wall
    assert dense["queue"][1] + dense["compute"][1] <= dense["request"][1]
    # One batch of 4 rows: each request counts the batch's compute, the execution counts once.
    assert value(after, "trio_infer_inferences_total", **model("dense")) == DENSE_REQUESTS
    assert value(after, "trio_infer_executions_total", **model("dense")) == 1
    assert value(after, "trio_infer_batch_size_count", **model("dense")) == 1
    assert value(after, "trio_infer_batch_size_sum", **model("dense")) == DENSE_REQUESTS
    assert value(after, "trio_infer_batch_size_bucket", **model("dense", le="2.0")) == 0
    assert value(after, "trio_infer_batch_size_bucket", **model("dense", le="4.0")) == 1

    sleep = histograms(after, "sleep")
    assert sleep["request"][0] == K_EXPIRED
    # Each ran until its deadline (0.3 s after it arrived, a little before the core saw it).
    assert 0.25 * K_EXPIRED < sleep["request"][1] < 5 * K_EXPIRED
    assert sleep["queue"][0] == sleep["compute"][0] == 0
    for name in ("add_sub", "dense", "sleep"):
        assert value(after, "trio_infer_requests_in_flight", **model(name)) == 0
        assert value(after, "trio_infer_requests_waiting", **model(name)) == 0
        assert value(after, "trio_infer_last_inference_timestamp_seconds", **model(name)) > 0

    assert value(after, "trio_infer_worker_deaths_total", cause="killed") == K_EXPIRED
    assert value(after, "trio_infer_worker_deaths_total", cause="crash") == 0
    assert value(after, "trio_infer_calls_total", protocol="grpc") >= total
    assert value(after, "trio_infer_connections", protocol="grpc") >= 1
    assert value(after, "trio_infer_memory_budget_bytes") == server.core.admission.budget_bytes
    assert value(after, "trio_infer_memory_reserved_bytes") >= 0
    assert value(after, "trio_infer_task_crashes_total", task="lane") == 0
    assert not [key for key in after if key[0] == "trio_infer_refusals_total"]

    # A worker killed from outside: a crash, counted; the counts before it stay.
    response = await client.call("ModelInfer", probe_request(), timeout=10)
    pid = int(decode_outputs(response)["pid"][0])
    os.kill(pid, signal.SIGKILL)
    await eventually(lambda: server.core.pool.statistics().crashed == 1)
    await client.call("ModelInfer", add_sub_request(INPUT0=x, INPUT1=x), timeout=10)
    crashed = scrape(server)
    assert value(crashed, "trio_infer_worker_deaths_total", cause="crash") == 1
    assert value(crashed, "trio_infer_worker_deaths_total", cause="killed") == K_EXPIRED
    assert value(crashed, "trio_infer_worker_starts_total") > value(
        before, "trio_infer_worker_starts_total"
    )
    assert value(crashed, requests, **model("add_sub", status="OK")) == N_OK + 1
    assert value(crashed, requests, **model("probe", status="OK")) == 1
    since = {("add_sub", "OK"), ("probe", "OK")}
    for (name, labels), count in after.items():
        if name == requests and (dict(labels)["model"], dict(labels)["status"]) not in since:
            assert crashed[(name, labels)] == count, labels


def probe_request() -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="probe")
    encode_inputs(request, [("x", np.zeros((1, 1), np.float32))], raw=True)
    return request


def histograms(samples: Samples, name: str) -> dict[str, Any]:
    """``(count, sum)`` of each duration histogram of model ``name``; the ``+Inf`` bucket is
    checked against the count on the way."""
    found: dict[str, Any] = {}
    for kind in ("request", "queue", "compute"):
        metric = f"trio_infer_{kind}_duration_seconds"
        count = value(samples, f"{metric}_count", **model(name))
        assert value(samples, f"{metric}_bucket", **model(name, le="+Inf")) == count
        found[kind] = (count, value(samples, f"{metric}_sum", **model(name)))
    return found


def parse(body: str) -> Samples:
    samples: Samples = {}
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


async def test_metrics_are_scraped_over_http_on_the_rest_port_and_the_metrics_port(
    nursery: trio.Nursery,
) -> None:
    server = await start_server(nursery, metrics_port=0)
    assert server.metrics_port is not None
    body = {
        "inputs": [
            {"name": name, "datatype": "FP32", "shape": [1, 16], "data": [1.0] * 16}
            for name in ("INPUT0", "INPUT1")
        ]
    }
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.http_port}") as rest:
        for _ in range(3):
            answer = await rest.post("/v2/models/add_sub/infer", json=body)
            assert answer.status_code == 200
        scraped = await rest.get("/metrics")
        assert scraped.status_code == 200
        assert scraped.headers["content-type"].startswith("text/plain; version=")
        # The scrape is a request of the REST port too: it sees the connection it came on.
        samples = parse(scraped.text)
        assert value(samples, "trio_infer_requests_total", **model("add_sub", status="OK")) == 3
        assert value(samples, "trio_infer_connections", protocol="http") >= 1
        assert (await rest.post("/metrics")).status_code == 405
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.metrics_port}") as port:
        own = await port.get("/metrics")
        assert own.status_code == 200
        ok = model("add_sub", status="OK")
        assert value(parse(own.text), "trio_infer_requests_total", **ok) == 3
        # The metrics port serves nothing else: not the protocol, not the models.
        assert (await port.get("/v2/health/ready")).status_code == 404
        assert (await port.post("/v2/models/add_sub/infer", json=body)).status_code == 404


async def test_a_rest_request_refused_after_its_model_ran_is_counted_with_the_status_it_got(
    nursery: trio.Nursery,
) -> None:
    server = await start_server(nursery)
    # Echo's output is its BYTES input, whose second element is not UTF-8: asked for as JSON it
    # cannot be written, and the request is refused (400) after the model ran.
    blob = b"".join(len(e).to_bytes(4, "little") + e for e in (b"ok", b"\xff\xfe"))
    size = {"binary_data_size": len(blob)}
    header = {"inputs": [{"name": "s", "datatype": "BYTES", "shape": [2], "parameters": size}]}

    async def echo(rest: httpx.AsyncClient, **fields: Any) -> int:
        text = json.dumps(header | fields).encode()
        answer = await rest.post(
            "/v2/models/echo/infer",
            content=text + blob,
            headers={"Inference-Header-Content-Length": str(len(text))},
        )
        return answer.status_code

    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.http_port}") as rest:
        assert await echo(rest) == http_status(InvalidInput("")) == 400
        assert await echo(rest, parameters={"binary_data_output": True}) == 200
        scraped = await rest.get("/metrics")
    samples = parse(scraped.text)
    for status in StatusCode:
        expected = 1 if status in (StatusCode.OK, StatusCode.INVALID_ARGUMENT) else 0
        got = value(samples, "trio_infer_requests_total", **model("echo", status=status.name))
        assert got == expected, status
    assert value(samples, "trio_infer_request_duration_seconds_count", **model("echo")) == 2
    assert value(samples, "trio_infer_compute_duration_seconds_count", **model("echo")) == 1

    stub = GrpcioClient(server.port)
    try:
        response = await stub.call("ModelStatistics", pb.ModelStatisticsRequest(name="echo"))
    finally:
        stub.channel.close()
    (statistics,) = response.model_stats
    inference = statistics.inference_stats
    # Requests by how they ended; the model ran both times.
    assert (inference.success.count, inference.fail.count) == (1, 1)
    assert (inference.queue.count, inference.compute_infer.count) == (1, 1)
    assert (statistics.execution_count, statistics.inference_count) == (2, 2)


GROWS = """
import numpy as np

from trio_infer import Model


class Grows(Model):
    def predict(self, inputs, parameters):
        return {"y": np.zeros(parameters.get("n", 1), np.float32)}
"""


async def test_a_grpc_answer_the_budget_refuses_is_counted_with_the_status_it_got(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    folder = tmp_path / "grows"
    folder.mkdir()
    (folder / "grows_model.py").write_text(GROWS)
    (folder / "model-settings.json").write_text(
        json.dumps({"name": "grows", "implementation": "grows_model.Grows"})
    )
    # A 1 MiB budget: a request of a few bytes is admitted, its 800 kB answer (within the
    # budget, which bounds a worker's report) is refused as it is encoded, after the model ran:
    # more than a connection's share of the budget.
    server = await start_server(nursery, tmp_path, memory_budget=1 << 20)
    client = GrpcioClient(server.port)

    def grows(n: int) -> pb.ModelInferRequest:
        request = pb.ModelInferRequest(model_name="grows")
        encode_inputs(request, [("x", np.zeros(1, np.float32))], raw=True)
        encode_parameters(request.parameters, {"n": n})
        return request

    try:
        error = await client.error("ModelInfer", grows(200_000))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "the encoded outputs" in (error.details() or "")
        answer = await client.call("ModelInfer", grows(10))
        assert decode_outputs(answer)["y"].shape == (10,)
        response = await client.call("ModelStatistics", pb.ModelStatisticsRequest(name="grows"))
    finally:
        client.channel.close()
    samples = scrape(server)
    for status in StatusCode:
        expected = 1 if status in (StatusCode.OK, StatusCode.RESOURCE_EXHAUSTED) else 0
        got = value(samples, "trio_infer_requests_total", **model("grows", status=status.name))
        assert got == expected, status
    (statistics,) = response.model_stats
    inference = statistics.inference_stats
    assert (inference.success.count, inference.fail.count) == (1, 1)
    assert (statistics.execution_count, statistics.inference_count) == (2, 2)


async def test_a_model_name_of_quotes_backslashes_and_line_breaks_is_one_label_value(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    # A folder's settings may name its model anything: /metrics must escape it as a label value.
    name = 'we"ird\\na\nme {x="1"}'
    folder = tmp_path / "repository" / "odd"
    folder.mkdir(parents=True)
    settings = {"name": name, "implementation": "trio_infer.examples.models.Echo"}
    (folder / "model-settings.json").write_text(json.dumps(settings))
    server = await start_server(nursery, tmp_path / "repository", workers=1)
    client = GrpcioClient(server.port)
    try:
        request = pb.ModelInferRequest(model_name=name)
        tensor = request.inputs.add(name="x", datatype="FP32", shape=[1])
        tensor.contents.fp32_contents.append(1.0)
        await client.call("ModelInfer", request, timeout=30)
    finally:
        client.channel.close()
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.http_port}") as rest:
        body = (await rest.get("/metrics")).text
    ok = [
        sample
        for family in text_string_to_metric_families(body)
        if family.name == "trio_infer_requests"
        for sample in family.samples
        if sample.labels.get("status") == "OK"
    ]
    assert [(sample.labels["model"], sample.value) for sample in ok] == [(name, 1.0)]
