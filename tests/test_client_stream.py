"""trio_infer.client's streams (InferenceClient.stream) against real servers with real worker
processes: answers matched by id, per-message errors, cancellation reaching the workers, and the
stream's real final status from send and from iteration."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
import trio

from tests.probe import process_exists, start_probe
from tests.support import eventually, start_server
from trio_infer.client import InferenceClient, InferStream, StreamAnswer
from trio_infer.errors import InferError, Overloaded, StatusCode, Unavailable
from trio_infer.server import RunningServer

MiB = 1024 * 1024
A = np.arange(16, dtype=np.float32).reshape(1, 16)
B = np.full((1, 16), 0.5, dtype=np.float32)
X = np.zeros(1, np.float32)


@pytest.fixture
async def client(server: RunningServer) -> AsyncIterator[InferenceClient]:
    async with InferenceClient.connect("127.0.0.1", server.port) as connected:
        yield connected


async def answers_by_id(stream: InferStream) -> dict[str, StreamAnswer]:
    by_id: dict[str, StreamAnswer] = {}
    async for answer in stream:
        assert answer.id not in by_id
        by_id[answer.id] = answer
    return by_id


async def send_until_it_fails(stream: InferStream) -> None:
    while True:
        await stream.send("echo", {"x": X})
        await trio.sleep(0.01)


async def collect(stream: InferStream, answers: list[StreamAnswer]) -> None:
    async for answer in stream:
        answers.append(answer)


async def test_many_requests_to_several_models_on_one_stream(client: InferenceClient) -> None:
    x = np.random.default_rng(1).standard_normal((3, 256)).astype(np.float32)

    async def send_all(stream: InferStream) -> None:
        for index in range(40):
            await stream.send(
                "add_sub", {"INPUT0": A + index, "INPUT1": B}, request_id=f"add_sub-{index}"
            )
            text = np.array([f"text {index}".encode()], dtype=np.object_)
            raw = index % 2 == 0
            await stream.send("echo", {"text": text}, request_id=f"echo-{index}", raw=raw)
        await stream.send("dense", {"x": x}, request_id="dense", outputs=["y"])
        await stream.done_sending()

    async with client.stream(timeout=30, metadata={"x-user": "me"}) as stream:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(send_all, stream)
            answers = await answers_by_id(stream)
        # Iteration ended with OK: it stays ended.
        assert [answer async for answer in stream] == []
    assert len(answers) == 81
    assert all(answer.error is None for answer in answers.values())
    for index in range(40):
        added = answers[f"add_sub-{index}"]
        assert (added.model_name, added.model_version) == ("add_sub", "")
        np.testing.assert_array_equal(added["OUTPUT0"], A + index + B)
        np.testing.assert_array_equal(added.outputs["OUTPUT1"], A + index - B)
        assert answers[f"echo-{index}"]["text"].tolist() == [f"text {index}".encode()]
    weights = np.random.default_rng(0).standard_normal((256, 256)).astype(np.float32)
    np.testing.assert_allclose(answers["dense"]["y"], np.tanh(x @ weights), atol=1e-4)
    # The connection carries unary calls as before.
    assert await client.server_live()


async def test_a_message_timeout_fails_that_message_only(
    client: InferenceClient, server: RunningServer
) -> None:
    async with client.stream() as stream:
        # Its own timeout passes long before the model would finish.
        await stream.send(
            "sleep", {"x": X}, parameters={"delay_ms": 60_000}, timeout=0.2, request_id="slow"
        )
        await stream.send("no_such_model", {}, request_id="unknown")
        for index in range(10):
            await stream.send("echo", {"x": X + index}, request_id=f"ok-{index}", timeout=30)
        await stream.done_sending()
        answers = await answers_by_id(stream)
    slow, unknown = answers.pop("slow"), answers.pop("unknown")
    assert slow.error is not None
    assert (slow.error.code, slow.error.message) == (
        StatusCode.UNKNOWN,
        "deadline exceeded (the request's timeout parameter)",
    )
    assert (slow.model_name, slow.outputs) == ("sleep", {})
    with pytest.raises(InferError) as caught:
        slow["x"]
    assert caught.value is slow.error
    assert unknown.error is not None
    assert unknown.error.message == "Request for unknown model: 'no_such_model' is not found"
    assert sorted(answers) == sorted(f"ok-{index}" for index in range(10))
    for index in range(10):
        assert answers[f"ok-{index}"].error is None
        assert answers[f"ok-{index}"]["x"].tolist() == [float(index)]
    # The worker sleeping for nobody was stopped.
    await eventually(lambda: server.statistics().pool.busy == 0)


@pytest.mark.parametrize("how", ["leave the block", "cancel an enclosing scope"])
async def test_ending_a_stream_early_kills_the_worker_running_its_message(
    nursery: trio.Nursery, tmp_path: Path, how: str
) -> None:
    probe = await start_probe(nursery, tmp_path)
    async with InferenceClient.connect("127.0.0.1", probe.server.port) as client:
        with trio.CancelScope() as scope:
            async with client.stream() as stream:
                await stream.send("probe", {"x": X}, request_id="quick")
                sleep = {"tag": "streamed", "action": "sleep", "delay_ms": 60_000}
                await stream.send("probe", {"x": X}, parameters=sleep, request_id="slow")
                pid = await probe.wait_started("streamed")
                async for answer in stream:
                    assert answer.id == "quick"
                    if how == "leave the block":
                        break
                    scope.cancel()
        assert scope.cancelled_caught == (how == "cancel an enclosing scope")
        await eventually(lambda: not process_exists(pid))
        await probe.wait_idle()
        # The connection goes on: a new worker serves the next stream.
        async with client.stream() as stream:
            await stream.send("probe", {"x": X}, request_id="after")
            await stream.done_sending()
            answers = await answers_by_id(stream)
        assert int(answers["after"]["pid"][0]) != pid


async def test_a_stream_past_its_deadline_raises_deadline_exceeded_from_iteration_and_send(
    client: InferenceClient, server: RunningServer
) -> None:
    async with client.stream(timeout=0.5) as stream:
        await stream.send("echo", {"x": X}, request_id="fast")
        await stream.send("sleep", {"x": X}, parameters={"delay_ms": 60_000}, request_id="slow")
        first = await stream.__anext__()
        assert (first.id, first.error) == ("fast", None)
        with pytest.raises(InferError) as caught:
            await stream.__anext__()
        assert caught.value.code == StatusCode.DEADLINE_EXCEEDED
        # The stream's real status, again, from send and from iteration.
        with pytest.raises(InferError) as from_send:
            await stream.send("echo", {"x": X}, request_id="late")
        assert from_send.value.code == StatusCode.DEADLINE_EXCEEDED
        with pytest.raises(InferError) as again:
            await stream.__anext__()
        assert again.value.code == StatusCode.DEADLINE_EXCEEDED
        await stream.done_sending()  # nothing to do on an ended stream
    await eventually(lambda: server.statistics().pool.busy == 0)


async def test_an_enclosing_deadline_bounds_the_stream_on_the_server(
    client: InferenceClient, server: RunningServer
) -> None:
    with trio.move_on_after(0.5):
        async with client.stream() as stream:
            await stream.send("sleep", {"x": X}, parameters={"delay_ms": 60_000})
            # Shielded from the scope's own cancellation: what ends the stream is the server,
            # which had the scope's deadline as the stream's grpc-timeout.
            with trio.CancelScope(shield=True), pytest.raises(InferError) as caught:
                await stream.__anext__()
            assert caught.value.code == StatusCode.DEADLINE_EXCEEDED
    await eventually(lambda: server.statistics().pool.busy == 0)


async def refused_outright(nursery: trio.Nursery) -> tuple[InferError, InferError, InferError]:
    """What a stream's sends and iteration raise once the server has refused one of its
    messages outright: three times its size is more than the whole memory budget, and a stream
    cannot skip a message's body, so the server ends the stream."""
    server = await start_server(nursery, memory_budget=4 * MiB)
    async with (
        InferenceClient.connect("127.0.0.1", server.port) as client,
        client.stream() as stream,
    ):
        await stream.send("echo", {"x": X + 1}, request_id="small")
        first = await stream.__anext__()
        assert first["x"].tolist() == [1.0]
        # The server takes this one's first bytes only: the send waits for flow control until
        # the stream's end wakes it with the status.
        with pytest.raises(InferError) as caught:
            await stream.send("echo", {"x": np.zeros(2 * MiB, np.uint8)}, request_id="huge")
        with pytest.raises(InferError) as from_send:
            await stream.send("echo", {"x": X}, request_id="after")
        with pytest.raises(InferError) as from_iteration:
            await stream.__anext__()
        assert await client.server_live()
    return caught.value, from_send.value, from_iteration.value


async def test_a_send_the_server_ends_the_stream_under_raises_the_streams_status(
    nursery: trio.Nursery,
) -> None:
    during, after, iterating = await refused_outright(nursery)
    # The status the server ended the stream with, from its trailers: the same from every
    # side, and not "the write failed".
    assert (during.code, during.message) == (after.code, after.message)
    assert (during.code, during.message) == (iterating.code, iterating.message)
    assert during.code != StatusCode.OK
    assert "writ" not in during.message


async def test_a_message_refused_outright_ends_the_stream_with_resource_exhausted(
    nursery: trio.Nursery,
) -> None:
    during, _, _ = await refused_outright(nursery)
    assert isinstance(during, Overloaded)
    assert during.code == StatusCode.RESOURCE_EXHAUSTED
    assert "budget" in during.message


async def test_a_send_after_a_shutdown_ended_the_stream_raises_its_status(
    nursery: trio.Nursery,
) -> None:
    server = await start_server(nursery, grace_period=0.2)
    async with (
        InferenceClient.connect("127.0.0.1", server.port) as client,
        client.stream() as stream,
    ):
        await stream.send("sleep", {"x": X}, parameters={"delay_ms": 60_000}, request_id="slow")
        await eventually(lambda: server.statistics().pool.busy == 1)
        server.shutdown()
        # Requests go on being sent until the stream has ended: then send raises the status
        # the server ended it with (read from its trailers), not the connection's loss.
        with pytest.raises(Unavailable) as from_send:
            await send_until_it_fails(stream)
        assert from_send.value.message == "server shut down before the call finished"
        answers: list[StreamAnswer] = []
        with pytest.raises(Unavailable) as from_iteration:
            await collect(stream, answers)  # the echoes answered before the end, then the status
        assert from_iteration.value.message == "server shut down before the call finished"
        assert all(answer.model_name == "echo" for answer in answers)


async def test_mistakes_are_caught_before_anything_is_sent(client: InferenceClient) -> None:
    async with client.stream() as stream:
        with pytest.raises(ValueError, match="timeout must be a positive number"):
            await stream.send("echo", {"x": X}, timeout=0)
        with pytest.raises(ValueError, match="not both"):
            await stream.send("echo", {"x": X}, parameters={"timeout": 5}, timeout=1.0)
        with pytest.raises(TypeError, match="sequence of output names"):
            await stream.send("echo", {"x": X}, outputs="x")
        # The stream is still whole.
        await stream.send("echo", {"x": X + 7}, request_id="ok")
        await stream.done_sending()
        with pytest.raises(trio.ClosedResourceError):
            await stream.send("echo", {"x": X})
        answers = await answers_by_id(stream)
    assert answers["ok"]["x"].tolist() == [7.0]
    with pytest.raises(ValueError, match="timeout must be a positive number"):
        async with client.stream(timeout=-1):
            pass  # pragma: no cover
    with pytest.raises(trio.ClosedResourceError):
        await stream.send("echo", {"x": X})
