"""Sequences (stateful models): Triton's ``sequence_id``, ``sequence_start`` and ``sequence_end``
request parameters, and the table that pins each live sequence to one worker.

A request that sets ``sequence_id`` (an unsigned integer, or a non-empty string; tritonclient
sends it with ``infer(..., sequence_id=...)``) belongs to that sequence of its model. The first
request of a sequence sets ``sequence_start`` (true); the last sets ``sequence_end``. The
parameters stay in the request's parameters: the model sees the id and both flags. The worker pool
(``trio_infer.workers.pool``) runs every request of a live sequence on the worker its first
request went to, one at a time in arrival order, so a model may keep the sequence's state in its
process memory. A sequence ends at its ``sequence_end`` request, when it has been idle (no
request in flight) for longer than the model's ``max_sequence_idle_microseconds``, or when its
worker process ends (it is lost: its state went with the process).

The table is generic in what holds a sequence (the pool's lanes), so that it knows nothing of
workers.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

from trio_infer.errors import InvalidInput, Unavailable
from trio_infer.model import ParameterValue

__all__ = ["Pin", "SequenceFlags", "SequenceId", "SequenceTable", "sequence_of"]

#: A sequence's id: tritonclient sends an integer (int64 / uint64) or a string.
SequenceId = int | str

Holder = TypeVar("Holder")


@dataclass(frozen=True)
class SequenceFlags:
    """A request's place in a sequence, read from its parameters."""

    id: SequenceId
    start: bool
    end: bool


def sequence_of(parameters: Mapping[str, ParameterValue]) -> SequenceFlags | None:
    """The sequence a request belongs to, or None (no ``sequence_id``, or 0 or ``""``: none, as
    tritonclient's default).

    Raises:
        InvalidInput: ``sequence_id`` is neither an unsigned integer nor a string, a flag is
            not a boolean, or a flag is set without a ``sequence_id``.
    """
    if not parameters:
        return None  # most requests: no sequence, and no flag to check
    value = parameters.get("sequence_id", 0)
    start = parameters.get("sequence_start", False)
    end = parameters.get("sequence_end", False)
    # bool is an int in Python, but not in the protocol.
    if type(value) not in (int, str):
        raise _not_an_id(value)
    for name, flag in (("sequence_start", start), ("sequence_end", end)):
        if type(flag) is not bool:
            raise InvalidInput(f"parameter {name!r} must be a boolean, got {flag!r}")
    if value in (0, ""):
        if start or end:
            raise InvalidInput(
                "parameters 'sequence_start' and 'sequence_end' need a non-zero 'sequence_id'"
            )
        return None
    if type(value) is int and value < 0:
        # Triton's integer ids are uint64: a negative one (a JSON number) names no sequence.
        # (The gRPC front-end reads an int64_param as the uint64 of its bits, as Triton does.)
        raise _not_an_id(value)
    assert isinstance(value, int | str)
    return SequenceFlags(value, bool(start), bool(end))


def _not_an_id(value: ParameterValue) -> InvalidInput:
    return InvalidInput(
        f"parameter 'sequence_id' must be an unsigned integer or a string, got {value!r}"
    )


@dataclass(eq=False)
class Pin(Generic[Holder]):
    """A live sequence: where its requests run, and since when it is idle."""

    model: str
    id: SequenceId
    holder: Holder
    last: float
    """When it last had a request arrive or end (the Trio clock)."""
    busy: int = 0
    """Its requests in flight."""
    lost: str | None = None
    """Why it was lost with its worker; its later requests fail with this message."""
    counted: bool = False
    """Whether its table counts it as held by its holder (live, neither ended nor lost)."""

    def lose(self, cause: str) -> None:
        """Mark it lost with its worker (once: the first cause is kept)."""
        if self.lost is None:
            self.lost = (
                f"sequence {self.id!r} of model '{self.model}' was lost with its worker ({cause})"
            )


class SequenceTable(Generic[Holder]):
    """The live sequences of every model: ``(model, id)`` to its :class:`Pin`.

    Bounded by the idle limit: each model's pins are kept in the order they were last used, and
    those idle past the limit are dropped whenever a request of that model's sequences arrives.
    """

    def __init__(self) -> None:
        self._models: dict[str, OrderedDict[SequenceId, Pin[Holder]]] = {}
        # How many live pins each holder has (what held_by answers): kept as pins come and go,
        # since a walk of every pin on each sequence_start makes starts cost O(live sequences).
        self._held: Counter[Holder] = Counter()

    def route(
        self,
        model: str,
        sequence: SequenceFlags,
        idle_limit: float,
        now: float,
        choose: Callable[[], Holder],
    ) -> Pin[Holder]:
        """The pin of a request of ``sequence``, counted in flight until :meth:`finished`.

        A ``sequence_start`` of a sequence that is not live (or was lost) starts it on
        ``choose()``; one of a live sequence starts it again where it is. A ``sequence_end``
        ends it: a later request must start it again.

        Raises:
            InvalidInput: The sequence is not live and the request does not start it (Triton's
                message).
            Unavailable: The sequence was lost with its worker.
        """
        pins = self._models.setdefault(model, OrderedDict())
        self._drop_idle(pins, idle_limit, now)
        pin = pins.get(sequence.id)
        if sequence.start and (pin is None or pin.lost is not None):
            pin = pins[sequence.id] = Pin(model, sequence.id, choose(), now, counted=True)
            self._held[pin.holder] += 1
        elif pin is None:
            raise InvalidInput(
                f"inference request for sequence {sequence.id!r} to model '{model}' must "
                "specify the START flag on the first request of the sequence"
            )
        elif pin.lost is not None:
            raise Unavailable(pin.lost)
        pins.move_to_end(sequence.id)
        pin.last = now
        pin.busy += 1
        if sequence.end:
            del pins[sequence.id]
            self._uncount(pin)
        return pin

    def finished(self, pin: Pin[Holder], now: float) -> None:
        """A request of ``pin`` ended: its idle time starts over."""
        pin.busy -= 1
        pin.last = now
        pins = self._models.get(pin.model)
        if pins is not None and pins.get(pin.id) is pin:
            pins.move_to_end(pin.id)

    def lose(self, holder: Holder, cause: str) -> list[Pin[Holder]]:
        """Mark every live sequence ``holder`` runs lost (its worker ended); return them."""
        lost: list[Pin[Holder]] = []
        for pins in self._models.values():
            for pin in pins.values():
                if pin.holder is holder and pin.lost is None:
                    pin.lose(cause)
                    self._uncount(pin)
                    lost.append(pin)
        return lost

    def held_by(self, holder: Holder) -> int:
        """How many live sequences ``holder`` runs."""
        return self._held[holder]

    def _uncount(self, pin: Pin[Holder]) -> None:
        """``pin`` is no longer live (ended, dropped or lost): its holder holds one fewer."""
        if pin.counted:
            pin.counted = False
            self._held[pin.holder] -= 1
            if not self._held[pin.holder]:
                del self._held[pin.holder]

    def __len__(self) -> int:
        return sum(len(pins) for pins in self._models.values())

    def _drop_idle(
        self, pins: OrderedDict[SequenceId, Pin[Holder]], limit: float, now: float
    ) -> None:
        # Oldest use first: stop at the first pin used within the limit. A pin with a request
        # in flight is not idle: it goes to the back, as if used now.
        for _ in range(len(pins)):
            key, pin = next(iter(pins.items()))
            if now - pin.last <= limit:
                return
            if pin.busy:
                pin.last = now
                pins.move_to_end(key)
            else:
                del pins[key]
                self._uncount(pin)
