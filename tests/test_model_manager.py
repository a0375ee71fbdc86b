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
import trio.testing

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

    async def warm_up(
        self,
        models: Sequence[ModelSettings],
        *,
        keep_serving: bool = False,
        busy_wait: float = math.inf,
    ) -> int:
        await trio.lowlevel.checkpoint()
        return 1

    async def unload(
        self,
        settings: ModelSettings,
        busy_deadline: float = -math.inf,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> int:
        await trio.lowlevel.checkpoint()
        self.dropped.append(settings)
        task_status.started()
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


class GatedPool(FakePool):
    """A FakePool whose warm-ups and drops of the models named in ``gates`` wait for them."""

    def __init__(self) -> None:
        super().__init__()
        self.gates: dict[str, trio.Event] = {}
        self.warmed: list[str] = []
        self.changed = trio.Event()

    async def warm_up(
        self,
        models: Sequence[ModelSettings],
        *,
        keep_serving: bool = False,
        busy_wait: float = math.inf,
    ) -> int:
        for settings in models:
            self.warmed.append(settings.name)
            if settings.name in self.gates:
                await self.gates[settings.name].wait()
        return await super().warm_up(models, keep_serving=keep_serving)

    async def unload(
        self,
        settings: ModelSettings,
        busy_deadline: float = -math.inf,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> int:
        if settings.name in self.gates:
            await self.gates[settings.name].wait()
        return await super().unload(settings, busy_deadline, task_status=task_status)

    async def wait_workers_changed(self) -> None:
        await self.changed.wait()
        self.changed = trio.Event()


async def test_a_model_unloaded_while_the_served_models_are_loaded_again_is_not_loaded_back(
    tmp_path: Path,
) -> None:
    a, b = ModelSettings("a", "a.B", inputs=X), ModelSettings("b", "a.B", inputs=X)
    registry = ModelRegistry([a, b])
    pool = GatedPool()
    core = InferenceCore(registry, cast(WorkerPool, pool), Admission(1 << 20))
    manager = ModelManager(core, tmp_path, mode=ControlMode.EXPLICIT, grace_period=0)
    async with trio.open_nursery() as nursery:
        await nursery.start(core.batching.run)
        await nursery.start(manager.run)
        await manager.wait_ready()
        # b's unload has begun: its drop from the workers waits.
        pool.gates["b"] = trio.Event()
        nursery.start_soon(manager.unload, "b")
        await trio.testing.wait_all_tasks_blocked()
        assert registry.is_unloading("b")
        # A worker is replaced: every served model is loaded again, a's load waiting.
        pool.gates["a"] = trio.Event()
        pool.warmed.clear()
        pool.changed.set()
        await trio.testing.wait_all_tasks_blocked()
        assert pool.warmed == ["a"]
        # b's unload ends meanwhile, then a's load.
        pool.gates.pop("b").set()
        await trio.testing.wait_all_tasks_blocked()
        assert registry.served("b") is None
        pool.gates.pop("a").set()
        await trio.testing.wait_all_tasks_blocked()
        # b is not loaded back into the workers, nor ready.
        assert pool.warmed == ["a"]
        assert not registry.is_ready("b")
        assert [e.state.name for e in await manager.index() if e.name == "b"] in (
            [],
            ["UNAVAILABLE"],
        )
        nursery.cancel_scope.cancel()
