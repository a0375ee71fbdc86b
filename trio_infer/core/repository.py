"""The models' lifecycle: loading them into the workers and keeping them loaded, and the
repository extension (index, load, unload, polling the folder), one change at a time.

One task owns every change to which models are served (:meth:`ModelManager.run`): it takes
operations from a bounded queue and applies each in turn, so a load, an unload, a worker's
replacement and a poll never interleave their steps. Callers of :meth:`ModelManager.load` and
:meth:`~ModelManager.unload` wait for their operation's result; a caller that gives up (its
deadline, its client gone) does not stop the operation, which leaves the registry whole either
way. Waiting for a model's calls to end is not done in that task but beside it, so that a long
grace period holds no other change back.

Loading never stops other models' calls: a model is loaded into every idle worker while the
settings before it (if any) still serve; only once they have it does the registry switch to
it, and the old settings are dropped from the workers once their calls have ended (or the
grace period has passed). A busy worker loads and drops after the calls it runs, in the pool's
nursery: no operation waits for a running call, which may be a stream that never ends. A load
that fails leaves the old settings serving.

Control modes (Triton's ``--model-control-mode``):

- ``none``: every model of the repository is loaded at start; load and unload are refused.
- ``explicit``: the models named at start are loaded (``*``: all); load and unload serve.
- ``poll``: as ``none`` at start, then the folder is read again every ``poll_interval``
  seconds: added models are loaded, changed ones reloaded, removed ones unloaded; load and
  unload are refused (the folder is the truth).
"""

from __future__ import annotations

import enum
import json
import logging
import math
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import trio

from trio_infer.core.service import InferenceCore
from trio_infer.errors import (
    InferError,
    InvalidInput,
    ModelNotFound,
    Overloaded,
    StatusCode,
    Unavailable,
)
from trio_infer.repository.registry import ModelState
from trio_infer.repository.settings import (
    ModelSettings,
    RepositoryEntry,
    SettingsError,
    load_model_settings,
    scan_repository,
)

__all__ = [
    "ControlMode",
    "IndexEntry",
    "ModelManager",
    "check_model_name",
    "config_override",
    "json_object",
]

logger = logging.getLogger(__name__)

#: Operations waiting for the lifecycle task; more are refused (RESOURCE_EXHAUSTED).
_MAX_PENDING = 64
#: Backoff between attempts to load a served model that failed to load (seconds).
_RETRY_FIRST = 1.0
_RETRY_MAX = 30.0


class ControlMode(enum.StrEnum):
    """Triton's ``--model-control-mode``: who decides which models are served."""

    NONE = "none"
    EXPLICIT = "explicit"
    POLL = "poll"


@dataclass(frozen=True)
class IndexEntry:
    """One model of the repository index."""

    name: str
    version: str
    state: ModelState
    reason: str


def config_override(text: str) -> dict[str, Any]:
    """A load's ``config`` (Triton's parameter name): a JSON object of ``model-settings.json``
    fields that override the folder's.

    Raises:
        InvalidInput: It is not valid JSON, or not an object.
    """
    return json_object(text, "load parameter 'config'", "a JSON object of settings fields")


def json_object(
    text: str | bytes | bytearray, what: str, kind: str = "a JSON object"
) -> dict[str, Any]:
    """``text`` parsed as a JSON object: a load's ``config``, a REST request's body.

    Raises:
        InvalidInput: It is not valid JSON (or nested deeper than the parser goes), or not an
            object; the message calls it ``what`` and says it must be ``kind``.
    """
    try:
        document = json.loads(text)
    except ValueError as exc:
        raise InvalidInput(f"{what} is not valid JSON: {exc}") from None
    except RecursionError:
        # The json module recurses per level: a client's "[[[[..." must not be a 500.
        raise InvalidInput(f"{what} is not valid JSON: it is nested too deeply") from None
    if not isinstance(document, dict):
        raise InvalidInput(f"{what} must be {kind}")
    return document


def check_model_name(name: str) -> None:
    """Refuse a model name that is not a plain folder name: loading a model imports and runs
    the code of its folder, so a name must never reach outside the repository.

    Raises:
        InvalidInput: The name is empty, ``.`` or ``..``, holds a path separator or a NUL, or
            is longer than a file name may be.
    """
    if (
        not name
        or name in (".", "..")
        or "/" in name
        or "\\" in name
        or "\0" in name
        or len(name.encode("utf-8", "surrogateescape")) > 255
    ):
        raise InvalidInput(
            f"model name {name[:100]!r} is not a plain folder name of the repository"
        )


@dataclass
class _Operation:
    """A change for the lifecycle task, and its result for whoever waits."""

    apply: Callable[[], Awaitable[None]]
    done: trio.Event = field(default_factory=trio.Event)
    error: InferError | None = None


class ModelManager:
    """Owns which models are served and their loading (see the module's docstring).

    Args:
        core: The core whose registry, pool, batching and admission it changes.
        repository: The repository folder.
        mode: The control mode.
        grace_period: Seconds the calls of a model being unloaded (or of settings replaced by
            a reload) get to end before it is dropped from the workers.
        poll_interval: Seconds between two reads of the folder in ``poll`` mode.
    """

    def __init__(
        self,
        core: InferenceCore,
        repository: Path,
        *,
        mode: ControlMode = ControlMode.NONE,
        grace_period: float = 30.0,
        poll_interval: float = 15.0,
    ) -> None:
        self.core = core
        self.repository = repository
        self.mode = mode
        self.grace_period = grace_period
        self.poll_interval = poll_interval
        self.polls = 0
        """Reads of the repository done by ``poll`` mode so far."""
        self.crashes = 0
        """Operations that raised an unexpected error (a bug): each was logged with its
        traceback and failed alone."""
        self._send, self._receive = trio.open_memory_channel[_Operation](_MAX_PENDING)
        self._nursery: trio.Nursery | None = None
        self._ready = trio.Event()
        # Served models that failed to load, with the time of their next attempt and backoff.
        self._retry: dict[str, tuple[float, float]] = {}
        # The unloads under way, by model: what a second unload of the same model waits for.
        self._unloading: dict[str, trio.Event] = {}
        # When to load every served model again after an operation crashed (a bug).
        self._retry_all = math.inf
        # What the last poll saw of each folder, to tell a change from none.
        self._seen: dict[str, str | None] = {}
        # Per model name: held by a load while it loads and switches, and by a drop from the
        # workers while it decides and drops (see _switch).
        self._locks: dict[str, trio.Lock] = {}

    # -- the lifecycle task ---------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Load the served models, then apply every operation, keep the models loaded across
        worker replacements and (``poll``) follow the folder, until cancelled."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            nursery.start_soon(self._watch_workers)
            if self.mode is ControlMode.POLL:
                self._seen = {
                    name: _revision(entry) for name, entry in (await self._scan_quietly()).items()
                }
                nursery.start_soon(self._tick, self.poll_interval, self._poll)
            await self._apply(_Operation(self._load_served))
            while True:
                with trio.move_on_at(self._next_retry()):
                    operation = await self._receive.receive()
                    await self._apply(operation)
                    continue
                await self._apply(_Operation(self._load_served))

    async def wait_ready(self) -> None:
        """Wait until every model served at start has been loaded into the workers once."""
        await self._ready.wait()

    async def _apply(self, operation: _Operation) -> None:
        try:
            await operation.apply()
        except InferError as error:
            operation.error = error
        except Exception as crash:
            # Cancellations are not caught: they end the task, as they should. What the
            # operation left half done is mended by loading every served model again.
            self.crashes += 1
            self._retry_all = trio.current_time() + _RETRY_FIRST
            logger.error(
                "internal error: a model operation crashed (%s: %s); the served models are "
                "loaded again in %.1f s",
                type(crash).__name__,
                crash,
                _RETRY_FIRST,
                exc_info=crash,
            )
            operation.error = InferError(
                "internal error in the model repository (logged by the server)",
                StatusCode.INTERNAL,
            )
        finally:
            operation.done.set()

    async def _submit(self, apply: Callable[[], Awaitable[None]]) -> None:
        operation = _Operation(apply)
        try:
            self._send.send_nowait(operation)
        except trio.WouldBlock:
            raise Overloaded(
                f"{_MAX_PENDING} model repository operations are already waiting"
            ) from None
        await operation.done.wait()
        if operation.error is not None:
            raise operation.error

    async def _watch_workers(self) -> None:
        # A replacement worker holds no model: every served model is loaded into it.
        while True:
            await self.core.pool.wait_workers_changed()
            await self._send.send(_Operation(self._load_served))

    async def _tick(self, interval: float, apply: Callable[[], Awaitable[None]]) -> None:
        while True:
            await trio.sleep(interval)
            await self._send.send(_Operation(apply))

    def _next_retry(self) -> float:
        return min([self._retry_all, *(when for when, _ in self._retry.values())])

    # -- keeping the served models loaded ---------------------------------------------------

    async def _load_served(self) -> None:
        """Load every served model into every worker; a model that fails turns (or stays) not
        ready, with its error as the reason, and is tried again with backoff."""
        registry = self.core.registry
        self._retry_all = math.inf
        now = trio.current_time()
        for settings in list(registry):
            # Checked as each comes: an unload ends beside this task (its drop, its withdraw),
            # so a model unloaded while the ones before it loaded is served no more.
            if registry.served(settings.name) is not settings or registry.is_unloading(
                settings.name
            ):
                continue
            # A model not ready yet (at start, or failed) is LOADING in the index meanwhile.
            loading = not registry.is_ready(settings.name)
            registry.set_loading(settings.name, loading)
            try:
                await self.core.pool.warm_up([settings], busy_wait=self.grace_period)
            except InferError as error:
                logger.error("model '%s' is not ready: %s", settings.name, error.message)
                registry.set_ready(settings.name, False, error.message)
                _, backoff = self._retry.get(settings.name, (now, _RETRY_FIRST / 2))
                backoff = min(backoff * 2, _RETRY_MAX)
                self._retry[settings.name] = (trio.current_time() + backoff, backoff)
                continue
            finally:
                registry.set_loading(settings.name, False)
            self._retry.pop(settings.name, None)
            registry.set_ready(settings.name, True)
        if not self._retry and not self._ready.is_set():
            logger.info(
                "ready: %s", ", ".join(settings.name for settings in registry) or "no model served"
            )
            self._ready.set()

    # -- the repository extension -------------------------------------------------------------

    async def index(self, ready_only: bool = False) -> list[IndexEntry]:
        """Every model of the repository folder, and every served model, with its state (and
        why it is not ready), sorted by name."""
        registry = self.core.registry
        entries: dict[str, IndexEntry] = {}
        for name, entry in (await self._scan_quietly()).items():
            state, reason = registry.state(name)
            version = entry.settings.version if entry.settings is not None else ""
            served = registry.served(name)
            if served is not None:
                version = served.version
            elif state is ModelState.UNAVAILABLE and entry.error is not None:
                reason = entry.error
            elif state is ModelState.UNAVAILABLE and registry.withdrawn_version(name) is None:
                reason = registry.reason(name) or "not loaded"
            entries[name] = IndexEntry(name, version, state, reason)
        for settings in registry:
            if settings.name not in entries:
                state, reason = registry.state(settings.name)
                entries[settings.name] = IndexEntry(settings.name, settings.version, state, reason)
        listed = [entries[name] for name in sorted(entries)]
        if ready_only:
            return [entry for entry in listed if entry.state is ModelState.READY]
        return listed

    async def load(self, name: str, config: Mapping[str, Any] | None = None) -> None:
        """Load (or reload) model ``name`` from the repository folder, its settings
        overridden by ``config`` (top-level fields of ``model-settings.json``); returns once
        every idle worker has it (a busy one loads it after its calls, before any other) and
        the registry serves it.

        Raises:
            InvalidInput: The name is not a plain folder name, the folder leads out of the
                repository, or the settings (with ``config``) are invalid.
            ModelNotFound: No folder of the repository declares that model.
            InferError: The mode refuses explicit loads (FAILED_PRECONDITION), or the model
                failed to load (its old settings, if any, still serve).
        """
        check_model_name(name)
        self._check_mode("load")
        await self._submit(lambda: self._load(name, config))

    async def unload(self, name: str) -> None:
        """Unload model ``name``: its new calls are refused at once, its calls in flight get
        the grace period, then it is dropped from every worker and served no more.

        Raises:
            InvalidInput: The name is not a plain folder name.
            ModelNotFound: The model is not served.
            InferError: The mode refuses explicit unloads (FAILED_PRECONDITION).
        """
        check_model_name(name)
        self._check_mode("unload")
        unloaded: list[trio.Event] = []

        async def start() -> None:
            unloaded.append(await self._unload(name))

        await self._submit(start)
        await unloaded[0].wait()

    def _check_mode(self, what: str) -> None:
        if self.mode is not ControlMode.EXPLICIT:
            raise InferError(
                f"explicit model {what} is not allowed: the server runs with "
                f"--model-control-mode {self.mode} (explicit allows it)",
                StatusCode.FAILED_PRECONDITION,
            )

    async def _load(self, name: str, config: Mapping[str, Any] | None) -> None:
        entry = (await self._scan()).get(name)
        if entry is None:
            raise ModelNotFound(
                f"no folder of the model repository {self.repository} declares model '{name}'"
            )
        if entry.settings is None or entry.error is not None:
            logger.error("loading model '%s' failed: %s", name, entry.error)
            raise InvalidInput(f"model '{name}' cannot be loaded: {entry.error}")
        settings = entry.settings
        if config:
            try:
                settings = load_model_settings(entry.folder, config, revision=settings.revision)
            except SettingsError as exc:
                logger.error("loading model '%s' failed: %s", name, exc)
                raise InvalidInput(f"model '{name}' cannot be loaded: {exc}") from None
            if settings.name != name:
                # It would serve this folder's code under another model's name (replacing
                # that model, if served): a load names the model it loads.
                raise InvalidInput(
                    f"model '{name}' cannot be loaded: its config renames it to "
                    f"'{settings.name[:100]}'"
                )
        await self._switch(settings)

    async def _switch(self, settings: ModelSettings) -> None:
        """Serve ``settings``: load them into every worker, then switch the registry and the
        batching to them; the settings they replace are dropped once their calls end."""
        registry, pool = self.core.registry, self.core.pool
        name = settings.name
        old = registry.served(name)
        if old == settings and registry.is_ready(name) and not registry.is_unloading(name):
            return  # served as asked already
        registry.set_loading(name, True)
        # The workers' cache keys a model by its settings' value, so a drop of equal settings
        # (an unload's, or a reload's of the settings it replaced, loaded again now) would drop
        # what this load puts there. The lock orders them: a drop under way is sent to every
        # worker first and this load follows it there (it loads anew); a drop that comes later
        # finds these settings served and keeps them.
        async with self._lock(name):
            try:
                try:
                    # Not every worker at once: the models served meanwhile keep a worker.
                    await pool.warm_up([settings], keep_serving=True, busy_wait=self.grace_period)
                except InferError as error:
                    # Workers that loaded it drop it again; the old settings still serve.
                    # Equal settings are the old ones' cache entry: those must stay.
                    if settings != old:
                        await pool.unload(settings)
                    if old is None:
                        registry.set_ready(name, False, error.message)
                    # The message names the model already ("loading model 'x' failed: ...").
                    logger.error("%s", error.message)
                    raise
            finally:
                registry.set_loading(name, False)
            # The new batcher is started first, and the registry switches with no checkpoint
            # after the batching does: a request counted under the new settings (its slot, its
            # answer's version) is never run by the old batcher with the old settings, which
            # are dropped from the workers once no slot of theirs is held.
            await self.core.batching.replace(settings)
            registry.serve(settings)
            self._retry.pop(name, None)
            registry.set_ready(name, True)
        logger.info("model '%s' loaded%s", name, " (reloaded)" if old is not None else "")
        if old is not None and old != settings:
            # Equal settings are the same model in the workers' cache: never dropped here.
            assert self._nursery is not None
            self._nursery.start_soon(self._drop_when_idle, old)

    async def _unload(self, name: str) -> trio.Event:
        """Start unloading model ``name``; the event is set once it is unloaded. The waiting is
        done beside the lifecycle task: the grace period holds no other change back."""
        registry = self.core.registry
        settings = registry.served(name)
        unloading = self._unloading.get(name)
        if unloading is not None and registry.is_unloading(name):
            return unloading  # a second unload waits for the first one's end
        if settings is None:
            raise ModelNotFound(f"model '{name}' is not loaded")
        registry.start_unloading(name)
        self._retry.pop(name, None)
        finished = self._unloading[name] = trio.Event()
        assert self._nursery is not None
        self._nursery.start_soon(self._finish_unload, settings, finished)
        return finished

    async def _finish_unload(self, settings: ModelSettings, finished: trio.Event) -> None:
        await self._drop_when_idle(settings, "unloaded")
        registry = self.core.registry
        name = settings.name
        # Unless a load came meanwhile and serves it again (these settings or others, which a
        # later unload of them withdraws in its turn).
        if registry.is_unloading(name) and registry.served(name) is settings:
            self.core.batching.remove(name)
            registry.withdraw(name, "unloaded")
            logger.info("model '%s' unloaded", name)
        if self._unloading.get(name) is finished:
            del self._unloading[name]
        finished.set()

    async def _drop_when_idle(self, settings: ModelSettings, why: str = "reloaded") -> None:
        """Drop ``settings`` from the workers once no call holds them, or the grace period has
        passed: a decoupled model's calls still running then are cancelled (UNAVAILABLE), or
        a stream that never ends would hold the drop, and the model's lock with it, forever; a
        unary call still running keeps its worker until it ends."""
        admission = self.core.admission
        name = settings.name
        grace_end = trio.current_time() + self.grace_period
        with trio.move_on_at(grace_end):
            await admission.wait_idle(settings)
        if not self._kept(settings):
            admission.cancel_calls(
                settings,
                f"model '{name}' was {why}: the call did not end within the grace period of "
                f"{self.grace_period:g} s",
            )
        # Done beside the lifecycle task, not in it: the workers drop the model after the calls
        # they hold, and one of those may run long (another model's: waited for until the end
        # of the grace period, then left to drop it once it ends). A load of this model waits
        # (_switch) only until the drops are sent: its own loads follow them in every worker.
        async with trio.open_nursery() as dropping, self._lock(name):
            if self._kept(settings):
                return
            await dropping.start(partial(self.core.pool.unload, settings, busy_deadline=grace_end))

    def _kept(self, settings: ModelSettings) -> bool:
        """Whether settings being dropped were loaded again meanwhile with equal settings: the
        workers' entry (keyed by value) is the newer one's, served, or for its own unload to
        drop after its own grace."""
        registry = self.core.registry
        served = registry.served(settings.name)
        return served == settings and (
            served is not settings or not registry.is_unloading(settings.name)
        )

    def _lock(self, name: str) -> trio.Lock:
        lock = self._locks.get(name)
        if lock is None:
            lock = self._locks[name] = trio.Lock()
        return lock

    # -- polling -------------------------------------------------------------------------------

    async def _poll(self) -> None:
        """Apply what changed in the folder since the last poll: added models are loaded,
        changed ones reloaded, removed ones unloaded. A model whose new settings cannot be read
        or loaded keeps serving as it was."""
        found = await self._scan_quietly()
        registry = self.core.registry
        for name, entry in found.items():
            revision = _revision(entry)
            unchanged = self._seen.get(name, "") == revision
            # A folder unchanged since the last poll is left alone when its model serves, or
            # when its settings cannot be read (said once, not at every poll); a model whose
            # load failed is tried again.
            if unchanged and (registry.served(name) is not None or entry.settings is None):
                continue
            self._seen[name] = revision
            if entry.settings is None:
                logger.error("model '%s' was not (re)loaded: %s", name, entry.error)
                continue
            try:
                await self._switch(entry.settings)
            except InferError:
                continue  # logged by _switch; the old settings, if any, serve on
        for settings in list(registry):
            if settings.name not in found and not registry.is_unloading(settings.name):
                self._seen.pop(settings.name, None)
                await self._unload(settings.name)
        self.polls += 1

    async def _scan(self) -> dict[str, RepositoryEntry]:
        # In a thread: reading every settings file and the size and time of every file of every
        # model folder would hold the event loop, and every call with it, for a large repository.
        try:
            return await trio.to_thread.run_sync(scan_repository, self.repository)
        except SettingsError as exc:
            raise Unavailable(f"the model repository cannot be read: {exc}") from None

    async def _scan_quietly(self) -> dict[str, RepositoryEntry]:
        try:
            return await self._scan()
        except Unavailable as exc:
            logger.error("%s", exc.message)
            return {}


def _revision(entry: RepositoryEntry) -> str | None:
    return entry.settings.revision if entry.settings is not None else entry.error
