"""The models this server serves, found by name and version, and whether each is ready."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from trio_infer.errors import ModelNotFound
from trio_infer.repository.settings import ModelSettings


class ModelRegistry:
    """The served models by name, with each model's readiness.

    A model starts not ready; the server marks it ready once worker processes have loaded it,
    and not ready again while nothing can serve it.
    """

    def __init__(self, models: Sequence[ModelSettings]) -> None:
        self._models = {settings.name: settings for settings in models}
        self._ready: set[str] = set()

    def __iter__(self) -> Iterator[ModelSettings]:
        return iter(self._models.values())

    def lookup(self, name: str, version: str = "") -> ModelSettings:
        """The settings of model ``name``; an empty ``version`` means the served one.

        Raises:
            ModelNotFound: no such model, or it is served at another version.
        """
        settings = self._models.get(name)
        if settings is None:
            raise ModelNotFound(f"model '{name}' is not served here")
        if version and version not in (settings.version, *settings.versions):
            served = settings.version or "(unversioned)"
            raise ModelNotFound(
                f"model '{name}' has no version '{version}' (served version: {served})"
            )
        return settings

    def is_ready(self, name: str) -> bool:
        """Whether model ``name`` can serve requests now."""
        return name in self._ready

    def all_ready(self) -> bool:
        """Whether every served model is ready."""
        return len(self._ready) == len(self._models)

    def set_ready(self, name: str, ready: bool) -> None:
        """Record whether model ``name`` can serve requests."""
        if ready:
            self._ready.add(name)
        else:
            self._ready.discard(name)
