"""The model manager against a fake pool: the order of a reload's steps, which a request
arriving at any moment must see consistent (tests/test_repository.py runs the same against
real workers, where such a moment is too short to hit on purpose)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import trio

from trio_infer.core.repository import ControlMode, ModelManager
from trio_infer.core.service import InferenceCore
from trio_infer.repository.registry import ModelRegistry
from trio_infer.repository.settings import ModelSettings, TensorSpec
from trio_infer.scheduling.admission import Admission
from trio_infer.scheduling.model_errors import ModelErrorLog
from trio_infer.workers.pool import WorkerPool

X = (TensorSpec("x", "FP32", (-1, 2)),)


class FakePool:
    """Loads and drops instantly; only what the manager and the batching call."""

    def __init__(self) -> None:
        self.model_errors = ModelErrorLog()
        self.dropped: list[ModelSettings] = []

    def statistics(self) -> Any:
        return SimpleNamespace(workers=1)

    async def warm_up(self, models: Sequence[ModelSettings], *, keep_serving: bool = False) -> int:
        await trio.lowlevel.checkpoint()
        return 1

    async def unload(self, settings: ModelSettings, busy_deadline: float = -math.inf) -> int:
        await trio.lowlevel.checkpoint()
        self.dropped.append(settings)
        return 1

    async def wait_workers_changed(self) -> None:
        await trio.sleep_forever()


async def test_a_reload_switches_the_registry_and_the_batcher_in_the_same_step(
    tmp_path: Path,
) -> None:
    old = ModelSettings("m", "a.B", inputs=X, max_batch_size=4)
    new = ModelSettings("m", "a.B", inputs=X, max_batch_size=8)
    registry = ModelRegistry([old])
    core = InferenceCore(registry, cast(WorkerPool, FakePool()), Admission(1 << 20))
    manager = ModelManager(core, tmp_path, mode=ControlMode.EXPLICIT)
    # What a request arriving now would get: the settings it is served (and counted) under,
    # and the batcher that runs it, with its own settings.
    seen: set[tuple[int, int]] = set()
    switched = False

    async def watch() -> None:
        while not switched:
            batcher = core.batching.get("m")
            assert batcher is not None
            served = registry.served("m")
            assert served is not None
            seen.add((served.max_batch_size, batcher.settings.max_batch_size))
            await trio.lowlevel.checkpoint()

    async with trio.open_nursery() as nursery:
        await nursery.start(core.batching.run)
        await nursery.start(manager.run)
        await manager.wait_ready()
        nursery.start_soon(watch)
        await trio.lowlevel.checkpoint()
        await manager._submit(lambda: manager._switch(new))
        switched = True
        await trio.lowlevel.checkpoint()
        nursery.cancel_scope.cancel()
    # Never a request of the new settings in the old settings' batcher, run with the old
    # settings (which are dropped once the requests counted under them have ended).
    assert (4, 4) in seen
    assert seen <= {(4, 4), (8, 8)}
    assert core.batching.get("m").settings is registry.served("m") is new  # type: ignore[union-attr]
