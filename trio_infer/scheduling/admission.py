"""Admission control: what a request must be granted before the server holds its data.

Two bounds, checked in order as a request's data becomes known:

1. The **memory budget** (server-wide, ``--memory-budget``). A request announces its size in the
   5-byte gRPC prefix before its body is read; it reserves room for that message, its decoded
   copy and a response of the same size before the transport lets the client send the body. A
   request larger than the whole budget is refused at once. Others wait, first come first
   served, until room frees up, for at most their deadline (or ``max_wait`` when they set none),
   as long as the waiting room has space: with it, the requests waiting must need no more than
   ``max_waiting_bytes`` (a quarter of the budget by default; 0: none waits). Past that, a
   request is refused at once: under overload the admitted requests keep their latency and the
   excess is turned away fast, instead of every request waiting longer (by Little's law, more
   requests inside at the same throughput each take longer).

   Waiting is for bursts, not for sustained overload. As in CoDel (RFC 8289), a queue whose
   requests have all waited longer than ``target_wait`` for ``interval`` is a standing queue:
   from then on a request that does not fit is refused at once instead of joining it. Once per
   ``interval`` one such request is let wait as a probe, for at most ``target_wait``: room by
   then counts towards the end of shedding, none gets it refused like the others (a probe that
   waited for room would be the slowest of the admitted requests, one in every interval).
   Shedding ends when three probes in a row get room within ``target_wait``, or when a request
   finds room at once an interval after the last one refused for want of room (light load
   brings no probes). A waiting room that sustained overload keeps full adds its whole wait to
   every admitted request; shedding keeps their latency near that of a full budget.

   One **owner** (a front-end passes the client connection) may hold at most ``max_owner_bytes``
   of the budget at once (``--max-connection-bytes``, half the budget by default). A request
   that would take its owner past the share is refused at once, whatever room the budget has,
   and so is a waiter whose owner's share has filled by the time room comes: one client cannot
   take the whole budget, however many calls it opens, and a client waiting on its own calls
   gains nothing from waiting. A share as large as the budget turns the bound off. Half leaves as
   much again to every other client while a single client with many calls still gets most of an
   idle server.
2. The **per-model queue** (``max_queue_size`` in model settings): once the request is parsed and
   its model known, it takes one of the model's slots, or is refused at once when all are taken.
   A slot is held while the request waits for and runs on a worker. Refusing at once rather
   than queueing longer keeps latency bounded and lets a load balancer send the request to a
   replica with room.

Every refusal is ``Overloaded`` (RESOURCE_EXHAUSTED) naming the bound, and is counted; a
request that alone needs more than the whole budget or a whole share gets its subclass
``TooLarge``, which no retry can pass (REST answers it 413, not 429). Both
grants are context managers (a slot is also a pair of calls, ``take_slot`` and ``release_slot``,
for a caller's own ``try``/``finally``): whatever way a request ends, its bytes and slot are
given back.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType

import numpy as np
import trio

from trio_infer.datatypes import DATATYPES
from trio_infer.errors import Overloaded, TooLarge, Unavailable
from trio_infer.repository.settings import ModelSettings, TensorSpec

__all__ = ["Admission", "AdmissionStatistics", "OutputSize", "Reservation"]

#: Probes in a row that must find room within ``target_wait`` to end shedding: under sustained
#: overload one short probe can be luck, and ending shedding on it turned it off and on again.
_SHORT_PROBES_TO_END = 3


@dataclass(frozen=True)
class AdmissionStatistics:
    """A snapshot of admission control.

    Attributes:
        budget_bytes: The memory budget.
        reserved_bytes: Bytes reserved by requests in flight now.
        waiting: Requests waiting for room in the budget.
        in_flight: Requests holding a slot, by model.
        rejected: Refusals since start, by the name of the bound that refused them.
        shedding: A standing queue was seen: requests that do not fit are refused, not queued.
    """

    budget_bytes: int
    reserved_bytes: int
    waiting: int
    in_flight: dict[str, int]
    rejected: dict[str, int]
    shedding: bool


class Reservation:
    """Bytes of the memory budget held by one request; see :meth:`Admission.reserve`, whose
    ``async with`` it is (one object per request, on every call's path: it holds the bytes
    from entering the block)."""

    __slots__ = (
        "_admission",
        "_deadline",
        "_kept",
        "_owner",
        "_released",
        "_wait",
        "granted",
        "nbytes",
    )

    def __init__(
        self,
        admission: Admission,
        nbytes: int,
        owner: Hashable | None = None,
        deadline: float = math.inf,
        wait: bool = True,
    ) -> None:
        self._admission = admission
        self.granted = nbytes
        """The bytes reserved before the request's body was read, before any growth."""
        self.nbytes = nbytes
        """The bytes held now, growth included."""
        # A share as large as the budget bounds nothing the budget does not: none is kept.
        self._owner = owner if admission._shared else None
        self._deadline = deadline
        self._wait = wait
        self._kept = False
        self._released = False

    async def __aenter__(self) -> Reservation:
        admission = self._admission
        nbytes = self.nbytes
        # The common case, on every call's path: room now, no scope, no waiting.
        if admission._take_now(nbytes, self._owner):
            return self
        if not self._wait:
            # Room only if there is some now: none, so it holds nothing and gives nothing back.
            self.granted = self.nbytes = 0
            return self
        granted = False
        with trio.move_on_after(admission.max_wait if math.isinf(self._deadline) else math.inf):
            await admission._wait_for_room(nbytes, self._owner)
            granted = True
        if not granted:
            raise admission._refuse(
                "memory_budget",
                f"memory budget full: waited {admission.max_wait:g} s for {nbytes} bytes "
                "(--memory-budget)",
            )
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if not self._kept:
            self._release()

    def release(self) -> None:
        """Give the bytes back now (once: later calls, and the end of the ``async with`` block
        that reserved them, do nothing)."""
        self._release()

    def release_later(self) -> Callable[[], None]:
        """Keep the bytes past the end of the ``async with`` block that reserved them; return
        the function that gives them back (once: later calls do nothing). For memory that
        outlives the request's handler, such as an answer still being written."""
        self._kept = True
        return self._release

    def _release(self) -> None:
        if self._released:
            return
        self._released = True
        admission = self._admission
        nbytes = self.nbytes
        owner = self._owner
        if owner is not None:
            admission._give_share(owner, nbytes)
        admission._reserved -= nbytes
        if admission._waiters:
            admission._grant_waiters()

    def grow_nowait(self, nbytes: int, what: str) -> None:
        """Reserve ``nbytes`` more, if there is room now.

        Holding bytes while waiting for more could deadlock the budget, so this never waits.
        The bytes count towards the owner's share as well.

        Raises:
            Overloaded: the budget has no room for ``nbytes`` more now, or the owner's share
                has not; :class:`TooLarge` when the request would then hold more than either
                holds at all.
        """
        admission = self._admission
        reserved = admission._reserved + nbytes
        total = self.nbytes + nbytes
        owner = self._owner
        # What no retry can pass is told first, whatever else is full now.
        if total > admission.budget_bytes:
            raise admission._refuse(
                "memory_budget",
                f"{_needs(what, nbytes, total)}: more than the whole memory budget of "
                f"{admission.budget_bytes} bytes (--memory-budget)",
                TooLarge,
            )
        if owner is not None and total > admission.max_owner_bytes:
            raise admission._share_full(owner, nbytes, what, total)
        if admission._waiters or reserved > admission.budget_bytes:
            raise admission._refuse(
                "memory_budget",
                f"memory budget full: {what} needs {nbytes} more bytes, "
                f"{admission.budget_bytes - admission._reserved} of "
                f"{admission.budget_bytes} are free (--memory-budget)",
            )
        if owner is not None:
            shares = admission._held
            held = shares.get(owner, 0) + nbytes
            if held > admission.max_owner_bytes:
                raise admission._share_full(owner, nbytes, what, total)
            shares[owner] = held
        admission._reserved = reserved
        self.nbytes += nbytes


def _needs(what: str, nbytes: int, total: int) -> str:
    """What a request asks for: ``nbytes`` more for ``what``, ``total`` in all."""
    if nbytes == total:
        return f"{what} needs {total} bytes"
    return f"{what} needs {nbytes} more bytes, {total} in all"


@dataclass
class _Waiter:
    nbytes: int
    granted: trio.Event
    since: float
    owner: Hashable | None = None
    #: Set with ``granted`` when room came but the owner's share had none.
    refused: bool = False


class Admission:
    """The server's memory budget and the per-model queue bounds.

    Args:
        budget_bytes: The most bytes requests in flight may reserve together.
        max_wait: How long a request with no deadline may wait for room in the budget.
        max_waiting_bytes: The most bytes requests waiting for room may ask for together
            (default: a quarter of ``budget_bytes``).
        target_wait: A wait for room longer than this, in seconds, is a sign of overload.
        interval: Seconds of waits above ``target_wait`` that make a standing queue, and
            between two probes of whether it still stands.
        max_owner_bytes: The most bytes one owner (a client connection) may hold reserved
            (default: half of ``budget_bytes``).
    """

    def __init__(
        self,
        budget_bytes: int,
        max_wait: float = 10.0,
        max_waiting_bytes: int | None = None,
        *,
        target_wait: float = 0.005,
        interval: float = 0.1,
        max_owner_bytes: int | None = None,
    ) -> None:
        self.budget_bytes = budget_bytes
        self.max_owner_bytes = budget_bytes // 2 if max_owner_bytes is None else max_owner_bytes
        if self.max_owner_bytes < 1:
            raise ValueError(f"max_owner_bytes must be at least 1, got {max_owner_bytes}")
        #: A share as large as the budget bounds nothing the budget does not: none is kept.
        self._shared = self.max_owner_bytes < budget_bytes
        self.max_wait = max_wait
        self.max_waiting_bytes = (
            budget_bytes // 4 if max_waiting_bytes is None else max_waiting_bytes
        )
        if self.max_waiting_bytes < 0:
            raise ValueError(f"max_waiting_bytes must be at least 0, got {max_waiting_bytes}")
        self.target_wait = target_wait
        self.interval = interval
        #: When waits first went above target, with none below since (None: they are not).
        self._slow_since: float | None = None
        self._shedding = False
        self._last_probe = -math.inf
        #: When a request was last refused for want of room (not for its size).
        self._last_turned_away = -math.inf
        self._short_probes = 0
        self._reserved = 0
        self._waiting_bytes = 0
        # Invariant: a waiter is in this queue exactly until it is granted or gives up, and the
        # head waiter is granted as soon as its bytes fit.
        self._waiters: deque[_Waiter] = deque()
        self._in_flight: Counter[str] = Counter()
        # Slots held by each settings object (by identity), for wait_idle: a model reloaded or
        # unloaded is let go of only once the calls that looked up its old settings are done.
        self._by_settings: dict[int, int] = {}
        self._idle: dict[int, trio.Event] = {}
        # The cancel scopes of the calls holding each settings object's slots (by identity), and
        # why they were cancelled once :meth:`cancel_calls` has: a model unloaded, or settings
        # replaced by a reload, end the calls that outlive the grace period.
        self._scopes: dict[int, set[trio.CancelScope]] = {}
        self._withdrawn: dict[int, str] = {}
        self._rejected: Counter[str] = Counter()
        # Invariant: an owner is a key exactly while it holds reserved bytes, and its value is
        # their sum, at most max_owner_bytes.
        self._held: dict[Hashable, int] = {}

    def statistics(self) -> AdmissionStatistics:
        """Return a snapshot of reservations, waiters, slots and refusals."""
        return AdmissionStatistics(
            budget_bytes=self.budget_bytes,
            reserved_bytes=self._reserved,
            waiting=len(self._waiters),
            in_flight={name: n for name, n in self._in_flight.items() if n},
            rejected=dict(self._rejected),
            shedding=self._shedding,
        )

    def reserve(
        self, nbytes: int, deadline: float, owner: Hashable | None = None, *, wait: bool = True
    ) -> Reservation:
        """Hold ``nbytes`` of the budget for the duration of the ``async with`` block.

        Waits first come, first served for room until ``deadline`` (the caller's cancel scope
        enforces it) or, with no deadline, for at most ``max_wait`` seconds.

        Args:
            nbytes: The bytes to hold.
            deadline: The caller's deadline, on the Trio clock (``math.inf``: none).
            owner: Who asks (a front-end passes its client connection's key): an owner holds
                at most ``max_owner_bytes``. ``None`` is bound by the budget only.
            wait: False: never wait; where a wait would start, the block is entered holding
                nothing (``nbytes`` 0), as :meth:`reserve_nowait` returns None. Refusals are
                the same.

        Raises:
            Overloaded: no room came within ``max_wait``, or the owner's share has no room
                for ``nbytes`` more; :class:`TooLarge` when ``nbytes`` exceeds the whole budget
                or a whole share.
        """
        return Reservation(self, nbytes, owner, deadline, wait)

    def reserve_nowait(self, nbytes: int, owner: Hashable | None = None) -> Reservation | None:
        """Hold ``nbytes`` of the budget now, if :meth:`reserve` would grant them without
        waiting; None when it would wait (for room, or behind requests already waiting), and
        nothing is held then. The caller gives the bytes back with
        :meth:`Reservation.release`, or keeps them with :meth:`Reservation.release_later`.
        None too for ``nbytes`` 0: no bytes are nothing to hold or give back, and the room
        found or not is taken note of as for any request.

        Raises:
            Overloaded: :meth:`reserve` would refuse the request at once (larger than the
                budget, or past the owner's share).
        """
        if not nbytes:
            # No owner's share can be past its bound (nothing grows it there), so none refuses
            # no bytes more: the owner changes nothing.
            self._take_now(0, None)
            return None
        reservation = Reservation(self, nbytes, owner)
        return reservation if self._take_now(nbytes, reservation._owner) else None

    def _take_now(self, nbytes: int, owner: Hashable | None) -> bool:
        """Hold ``nbytes`` for ``owner`` (None when shares are not kept) if they need no wait;
        False when they would wait, and nothing is held then.

        Raises:
            Overloaded: :meth:`reserve` would refuse the request at once.
        """
        if nbytes > self.budget_bytes:
            raise self._refuse(
                "memory_budget",
                f"request needs {nbytes} bytes, more than the whole memory budget of "
                f"{self.budget_bytes} bytes (--memory-budget)",
                TooLarge,
            )
        held = 0
        if owner is not None:
            held = self._held.get(owner, 0) + nbytes
            if held > self.max_owner_bytes:
                raise self._share_full(owner, nbytes, "the request", nbytes)
        if self._waiters or self._reserved + nbytes > self.budget_bytes:
            return False
        if owner is not None:
            self._held[owner] = held
        self._reserved += nbytes
        # Room without waiting: whatever queue there was has drained.
        self._slow_since = None
        if self._shedding and trio.current_time() - self._last_turned_away >= self.interval:
            # Light load: probes only come from requests that must wait, and none has had to
            # for an interval.
            self._shedding = False
        return True

    def model_slot(self, settings: ModelSettings, *, cancellable: bool = False) -> ModelSlot:
        """One of the model's ``max_queue_size`` slots, held for the ``with`` block;
        ``cancellable``: :meth:`cancel_calls` may end the block (UNAVAILABLE) once its model
        is unloaded or replaced (a call that may never end on its own: a stream's generator).

        Raises:
            Overloaded: on entering the block, every slot of the model is taken.
        """
        return ModelSlot(self, settings, cancellable)

    def take_slot(self, settings: ModelSettings) -> None:
        """Take one of the model's ``max_queue_size`` slots, to be given back with
        :meth:`release_slot` whatever way the call ends (:meth:`model_slot` without its object,
        for a call's own ``try``/``finally``).

        Raises:
            Overloaded: every slot of the model is taken.
        """
        name = settings.name
        in_flight = self._in_flight
        taken = in_flight.get(name, 0)
        if taken >= settings.max_queue_size:
            raise self._refuse(
                "max_queue_size",
                f"model '{name}' has {settings.max_queue_size} requests in flight, its "
                "max_queue_size",
            )
        in_flight[name] = taken + 1
        key = id(settings)
        by_settings = self._by_settings
        by_settings[key] = by_settings.get(key, 0) + 1

    def release_slot(self, settings: ModelSettings) -> None:
        """Give back a slot :meth:`take_slot` took."""
        self._in_flight[settings.name] -= 1
        key = id(settings)
        by_settings = self._by_settings
        held = by_settings[key] - 1
        if held:
            by_settings[key] = held
        else:
            del by_settings[key]
            self._scopes.pop(key, None)
            self._withdrawn.pop(key, None)
            idle = self._idle.pop(key, None)
            if idle is not None:
                idle.set()

    def cancel_calls(self, settings: ModelSettings, why: str) -> int:
        """Cancel every call holding a ``cancellable`` slot of these very settings; each ends
        with UNAVAILABLE ``why`` (a model unloaded, or replaced by a reload, whose calls
        outlived the grace period). Returns how many were cancelled."""
        key = id(settings)
        scopes = self._scopes.get(key)
        if not scopes:
            return 0
        self._withdrawn[key] = why
        for scope in scopes:
            scope.cancel()
        return len(scopes)

    async def wait_idle(self, settings: ModelSettings) -> None:
        """Wait until no request holds a slot of these very settings (by identity: the calls
        of a model's settings replaced by a reload, not the new ones')."""
        key = id(settings)
        while key in self._by_settings:
            await self._idle.setdefault(key, trio.Event()).wait()

    async def _wait_for_room(self, nbytes: int, owner: Hashable | None) -> None:
        """Wait for room for ``nbytes`` and hold them (for ``owner``: None when shares are not
        kept), or raise why not."""
        now = trio.current_time()
        if self._waiting_bytes + nbytes > self.max_waiting_bytes:
            self._last_turned_away = now
            raise self._refuse(
                "memory_budget",
                f"memory budget full: {self._reserved} of {self.budget_bytes} bytes reserved "
                f"and {self._waiting_bytes} of {self.max_waiting_bytes} bytes that may wait for "
                "room already waiting (--memory-budget, --max-waiting-bytes)",
            )
        patience = math.inf
        if self._shedding:
            if self._waiters or now - self._last_probe < self.interval:
                raise self._shed()
            # A probe: whether it gets room within target_wait tells if the queue still stands.
            self._last_probe = now
            patience = self.target_wait
        waiter = _Waiter(nbytes, trio.Event(), now, owner)
        self._waiters.append(waiter)
        self._waiting_bytes += nbytes
        try:
            with trio.move_on_after(patience):
                await waiter.granted.wait()
        except BaseException:
            if waiter.granted.is_set():
                if not waiter.refused:
                    # Granted in the same tick as cancelled: give the bytes back.
                    if owner is not None:
                        self._give_share(owner, nbytes)
                    self._release(nbytes)
            else:
                self._waiters.remove(waiter)
                self._waiting_bytes -= nbytes
                waited = trio.current_time() - waiter.since
                if waited > self.target_wait:
                    # A request that gave up quickly says nothing of how long room takes.
                    self._observe_wait(waited)
                # A large waiter leaving the head may let smaller ones behind it in.
                self._grant_waiters()
            raise
        if not waiter.granted.is_set():
            # A probe that found no room in time: the queue stands.
            self._waiters.remove(waiter)
            self._waiting_bytes -= nbytes
            self._observe_wait(math.inf)
            self._grant_waiters()
            raise self._shed()
        if waiter.refused:
            assert owner is not None, "only an owner's share refuses a waiter"
            raise self._share_full(owner, nbytes, "the request", nbytes)

    def _share_full(self, owner: Hashable, nbytes: int, what: str, total: int) -> Overloaded:
        """The refusal of ``nbytes`` more for ``owner``'s request, which would then hold
        ``total``: :class:`TooLarge` when that alone is more than a share."""
        if total > self.max_owner_bytes:
            return self._refuse(
                "max_connection_bytes",
                f"{_needs(what, nbytes, total)}: more than a connection's whole share of the "
                f"memory budget, {self.max_owner_bytes} bytes (--max-connection-bytes)",
                TooLarge,
            )
        return self._refuse(
            "max_connection_bytes",
            f"connection's share of the memory budget full: {what} needs {nbytes} more bytes, "
            f"the connection holds {self._held.get(owner, 0)} of its {self.max_owner_bytes} "
            "(--max-connection-bytes)",
        )

    def _give_share(self, owner: Hashable, nbytes: int) -> None:
        # Requests of no bytes (ServerLive, say) hold nothing: the owner's entry may be gone
        # when the last of several ends.
        held = self._held.get(owner, 0) - nbytes
        if held > 0:
            self._held[owner] = held
        else:
            self._held.pop(owner, None)

    def _release(self, nbytes: int) -> None:
        self._reserved -= nbytes
        self._grant_waiters()

    def _grant_waiters(self) -> None:
        while self._waiters and self._reserved + self._waiters[0].nbytes <= self.budget_bytes:
            waiter = self._waiters.popleft()
            self._waiting_bytes -= waiter.nbytes
            owner = waiter.owner
            if owner is not None:
                held = self._held.get(owner, 0) + waiter.nbytes
                if held > self.max_owner_bytes:
                    # Its connection's other requests took the share while it waited.
                    waiter.refused = True
                    waiter.granted.set()
                    continue
                self._held[owner] = held
            self._reserved += waiter.nbytes
            waiter.granted.set()
            self._observe_wait(trio.current_time() - waiter.since)

    def _observe_wait(self, waited: float) -> None:
        now = trio.current_time()
        if waited <= self.target_wait:
            self._slow_since = None
            if self._shedding:
                # One short wait can be luck (a call ended just as the probe came): under
                # overload a slot frees every few ms. Several in a row mean the queue is gone.
                self._short_probes += 1
                self._shedding = self._short_probes < _SHORT_PROBES_TO_END
            return
        self._short_probes = 0
        if self._slow_since is None:
            self._slow_since = now
        elif now - self._slow_since >= self.interval and not self._shedding:
            self._shedding = True
            self._last_probe = now  # the first probe, an interval from now

    def _shed(self) -> Overloaded:
        self._last_turned_away = trio.current_time()
        return self._refuse(
            "memory_budget",
            f"memory budget full: {self._reserved} of {self.budget_bytes} bytes reserved, and "
            f"requests have waited over {self.target_wait * 1000:g} ms for room for "
            f"{self.interval:g} s: refused rather than queued (--memory-budget)",
        )

    def _refuse(self, bound: str, message: str, error: type[Overloaded] = Overloaded) -> Overloaded:
        self._rejected[bound] += 1
        return error(message)


class OutputSize:
    """The estimated bytes of a model's outputs, from its declared outputs, worked out once
    for every request to the model: a request's estimate is its batch size times the bytes of
    one row of the outputs whose first dimension is ``-1``, plus the bytes of the others.

    A ``-1`` in an output's first dimension is taken as the request's batch size (the first
    dimension of its first input; 1 when that has none, or there are no inputs). The estimate
    is 0 when any declared output's size cannot be known (no declared outputs, BYTES, or
    another free dimension): the caller then assumes an answer as large as the request.

    Args:
        outputs: The model's declared outputs.
    """

    __slots__ = ("_fixed", "_per_row")

    def __init__(self, outputs: Sequence[TensorSpec]) -> None:
        # None: the size cannot be known.
        self._per_row: int | None = 0
        self._fixed = 0
        for spec in outputs:
            shape = spec.shape
            if spec.datatype == "BYTES" or not shape or any(dim < 0 for dim in shape[1:]):
                self._per_row = None
                return
            size = DATATYPES[spec.datatype].itemsize * math.prod(shape[1:])
            if shape[0] == -1:
                self._per_row += size
            elif shape[0] < 0:
                self._per_row = None
                return
            else:
                self._fixed += shape[0] * size

    def estimate(self, inputs: Mapping[str, np.ndarray], batch: int | None = None) -> int:
        """The estimated bytes of the outputs of a request of these ``inputs``; ``batch``: its
        batch size when the caller has read it already (every input's first dimension), so
        that it is not read again."""
        per_row = self._per_row
        if per_row is None:
            return 0
        if batch is not None:
            return batch * per_row + self._fixed
        rows = 1
        for first in inputs.values():
            if first.ndim:
                rows = first.shape[0]
            break
        return rows * per_row + self._fixed


class ModelSlot:
    """One request's slot under its model's ``max_queue_size``: taken on entering the ``with``
    block, given back on leaving it (a class, not a generator: one is made per request). It
    holds the settings, whose identity keys :meth:`Admission.wait_idle`."""

    __slots__ = ("_admission", "_cancellable", "_scope", "_settings")

    def __init__(
        self, admission: Admission, settings: ModelSettings, cancellable: bool = False
    ) -> None:
        self._admission = admission
        self._settings = settings
        self._cancellable = cancellable
        self._scope: trio.CancelScope | None = None

    def __enter__(self) -> None:
        admission = self._admission
        admission.take_slot(self._settings)
        if not self._cancellable:
            return
        # A scope of its own, for Admission.cancel_calls: a call that may never end on its own
        # (a decoupled model's stream) is ended once its model's unload grace period is over.
        self._scope = scope = trio.CancelScope()
        key = id(self._settings)
        scopes = admission._scopes.get(key)
        if scopes is None:
            scopes = admission._scopes[key] = set()
        scopes.add(scope)
        scope.__enter__()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        admission = self._admission
        scope = self._scope
        if scope is None:
            admission.release_slot(self._settings)
            return
        key = id(self._settings)
        why = admission._withdrawn.get(key)
        try:
            scope.__exit__(exc_type, exc, traceback)
        finally:
            scopes = admission._scopes.get(key)
            if scopes is not None:
                scopes.discard(scope)
            admission.release_slot(self._settings)
        if scope.cancelled_caught:
            # Only this scope's own cancel is caught here: Admission.cancel_calls.
            raise Unavailable(why or f"model '{self._settings.name}' was unloaded")
