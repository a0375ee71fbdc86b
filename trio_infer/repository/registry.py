"""The models this server serves, found by name and version, each one's state (ready, loading,
unloading, unavailable and why), and a signal for whoever watches them change."""

from __future__ import annotations

import enum
from collections.abc import Iterator, Sequence

import trio

from trio_infer.errors import InvalidInput, ModelNotFound, Unavailable, shown
from trio_infer.repository.settings import ModelSettings

_INT64_MAX = 2**63 - 1
#: The most characters of a client's model name an error repeats: more than a folder's name
#: can have, so a served model's name is never cut.
_NAME_SHOWN = 256


class ModelState(enum.StrEnum):
    """A model's state as the repository index reports it (Triton's names)."""

    READY = "READY"
    UNAVAILABLE = "UNAVAILABLE"
    LOADING = "LOADING"
    UNLOADING = "UNLOADING"


class ModelRegistry:
    """The served models by name, with each model's readiness and state.

    A model starts not ready; the server marks it ready once worker processes have loaded it,
    and not ready again while nothing can serve it. A model being unloaded is still found but
    refused; one unloaded (:meth:`withdraw`) is no longer served, and only its state is kept.
    Changes wake :meth:`wait_changed` (health Watch streams).
    """

    def __init__(self, models: Sequence[ModelSettings]) -> None:
        self._models = {settings.name: settings for settings in models}
        self._ready: set[str] = set()
        self._loading: set[str] = set()
        self._unloading: set[str] = set()
        #: Why a model is not ready: its load's error, or that it was unloaded.
        self._reasons: dict[str, str] = {}
        #: The version of each model no longer served, for the index.
        self._withdrawn: dict[str, str] = {}
        self._changed = trio.Event()
        self.changes = 0
        """How many times readiness changed (see :meth:`wait_changed`)."""

    def __iter__(self) -> Iterator[ModelSettings]:
        return iter(self._models.values())

    def lookup(self, name: str, version: str = "") -> ModelSettings:
        """The settings of model ``name``; an empty ``version`` means the served one.

        The errors are Triton's, whose clients match their text: an unknown model's message
        starts with ``Request for unknown model``, and a version that is neither one the model
        declares nor an integer (Triton's versions are int64) is a malformed request. A
        declared version is taken whatever it is (MLServer's versions are free-form strings,
        such as ``v1.2``).

        Raises:
            InvalidInput: ``version`` is not declared by the model and is not an integer
                string of at most 2**63 - 1.
            ModelNotFound: no such model, or it is served at another version.
            Unavailable: the model was unloaded, or its load failed and it was never served
                (Triton's code for it); the message says which.
        """
        settings = self._models.get(name)
        if version and (settings is None or version not in (settings.version, *settings.versions)):
            if not _is_int64(version):
                raise InvalidInput(
                    "failed to get model version from specified version string "
                    f"'{shown(version)}': "
                    "a version is an integer from 0 to 2**63 - 1"
                )
            if settings is not None:
                served = settings.version or "(unversioned)"
                raise ModelNotFound(
                    f"Request for unknown model: '{name}' version {version} is not found "
                    f"(served version: {served})"
                )
        if settings is None:
            # A model unloaded, or never served because its load failed: its callers learn why.
            reason = self._reasons.get(name, "")
            if name in self._withdrawn or reason:
                why = "it was unloaded" if reason in ("", "unloaded") else f"not ready: {reason}"
                raise Unavailable(
                    f"Request for unknown model: '{name}' has no available versions ({why})"
                )
            raise ModelNotFound(
                f"Request for unknown model: '{shown(name, _NAME_SHOWN)}' is not found"
            )
        return settings

    def is_ready(self, name: str) -> bool:
        """Whether model ``name`` can serve requests now."""
        return name in self._ready

    def all_ready(self) -> bool:
        """Whether every served model is ready."""
        return len(self._ready) == len(self._models)

    def set_ready(self, name: str, ready: bool, reason: str = "") -> None:
        """Record whether model ``name`` can serve requests and, when not, why (waking
        :meth:`wait_changed` when that changes)."""
        if ready:
            self._reasons.pop(name, None)
        elif reason:
            self._reasons[name] = reason
        if ready == (name in self._ready):
            return
        if ready:
            self._ready.add(name)
        else:
            self._ready.discard(name)
        self.notify()

    def served(self, name: str) -> ModelSettings | None:
        """The settings model ``name`` is served with (also while it is being unloaded); None
        when it is not served."""
        return self._models.get(name)

    def is_unloading(self, name: str) -> bool:
        """Whether model ``name`` is being unloaded: found, but taking no new request."""
        return name in self._unloading

    def reason(self, name: str) -> str:
        """Why model ``name`` is not ready (``""``: no reason recorded)."""
        return self._reasons.get(name, "")

    def set_loading(self, name: str, loading: bool) -> None:
        """Record that model ``name`` is being loaded (or no longer is)."""
        if loading:
            self._loading.add(name)
        else:
            self._loading.discard(name)

    def serve(self, settings: ModelSettings) -> None:
        """Serve model ``settings.name`` with these settings from now on (added, or replacing
        the settings before: a reload). Its readiness is the caller's to set."""
        self._models[settings.name] = settings
        self._withdrawn.pop(settings.name, None)
        self._unloading.discard(settings.name)

    def start_unloading(self, name: str) -> None:
        """Refuse model ``name``'s new requests from now on: it is being unloaded."""
        self._unloading.add(name)
        self.set_ready(name, False, "unloading")

    def withdraw(self, name: str, reason: str) -> None:
        """Serve model ``name`` no more (it was unloaded); the index keeps its state."""
        settings = self._models.pop(name, None)
        if settings is not None:
            self._withdrawn[name] = settings.version
        self._unloading.discard(name)
        self.set_ready(name, False, reason)
        self.notify()

    def state(self, name: str) -> tuple[ModelState, str]:
        """Model ``name``'s state for the index and the reason when it is not READY."""
        # A load that comes while an unload waits for calls is the newer change: it wins.
        if name in self._loading:
            return ModelState.LOADING, ""
        if name in self._unloading:
            return ModelState.UNLOADING, "unloading"
        if name in self._ready:
            return ModelState.READY, ""
        return ModelState.UNAVAILABLE, self._reasons.get(name, "not loaded")

    def withdrawn_version(self, name: str) -> str | None:
        """The version of a model no longer served (None: it is served, or never was)."""
        return self._withdrawn.get(name)

    def notify(self) -> None:
        """Wake whoever waits in :meth:`wait_changed`: a model's readiness, or the server's
        (its drain), changed."""
        self.changes += 1
        self._changed.set()
        self._changed = trio.Event()

    async def wait_changed(self, since: int) -> None:
        """Wait until readiness has changed (:meth:`set_ready`, :meth:`notify`) since
        :attr:`changes` was ``since``; at once if it has already."""
        while self.changes == since:
            await self._changed.wait()


def _is_int64(version: str) -> bool:
    """Whether ``version`` is a version number as Triton takes one: decimal digits (ASCII
    only; no sign, space or ``_``, which ``int`` would take) of an int64 at least 0. Its
    length is checked first: ``int`` refuses strings of thousands of digits, and an int64 has at
    most 19 (leading zeros aside)."""
    if not (version.isascii() and version.isdigit()):
        return False
    digits = version.lstrip("0")
    return len(digits) <= 19 and int(digits or "0") <= _INT64_MAX
