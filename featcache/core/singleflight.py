"""One computation per key at a time: the misses of ``FeatureCache.get_or_compute``, and of
lmdeploy's model hook (``featcache.lmdeploy.pytorch.models``).

Invariant: while a key's computation runs, every other caller of ``run`` for that key waits for it
and gets its result, or its exception (nothing of a failed computation is kept: the next call
computes again). Waiters hold no lock while they wait; the map of flights is held only to join or
leave one.

A caller whose computation is not one function call (the model hook: claimed in a step's
``prepare``, done in its vision call) claims the key with ``lead`` and ends the flight with
``finish``; others find it with ``running`` and wait on ``Flight.done`` for as long as they choose.
A waiter that gives up calls ``forget``: later callers then start a new flight instead of waiting
for one that may never end, and whoever still waits on the old one wakes when it ends.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

T = TypeVar("T")


class Flight(Generic[T]):
    """One computation of a key; ``owner``: the thread that runs it (``threading.get_ident``)."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.value: T | None = None
        self.error: BaseException | None = None
        self.owner = threading.get_ident()

    def result(self) -> T:
        """Wait for the computation; its value, or its exception raised here."""
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self.value  # type: ignore[return-value]  # set before done


class SingleFlight(Generic[T]):
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._flights: dict[Hashable, Flight[T]] = {}

    def run(self, key: Hashable, fn: Callable[[], T]) -> T:
        """``fn()``, unless a call for ``key`` is already running: then that call's outcome."""
        with self._lock:
            flight = self._flights.get(key)
            first = flight is None
            if flight is None:
                flight = self._flights[key] = Flight()
        if not first:
            return flight.result()
        try:
            flight.value = fn()
            return flight.value
        except BaseException as e:
            flight.error = e
            raise
        finally:
            self.forget(key, flight)
            flight.done.set()

    def lead(self, key: Hashable) -> Flight[T] | None:
        """Claim ``key``'s computation for a caller that runs it itself and ends it with
        ``finish``: the new flight, or None while another one runs (``running``)."""
        with self._lock:
            if key in self._flights:
                return None
            flight = self._flights[key] = Flight()
            return flight

    def running(self, key: Hashable) -> Flight[T] | None:
        """The flight of ``key`` in progress, or None."""
        with self._lock:
            return self._flights.get(key)

    def finish(self, key: Hashable, flight: Flight[T], value: T | None = None,
               error: BaseException | None = None) -> None:
        """End ``flight`` (``lead``'s): its waiters wake to ``value`` or ``error``; the next call
        for ``key`` starts a new one. Idempotent."""
        self.forget(key, flight)
        if not flight.done.is_set():
            flight.value, flight.error = value, error
            flight.done.set()

    def forget(self, key: Hashable, flight: Flight[T]) -> None:
        """Send no later caller to ``flight`` (it stays in progress for those already waiting)."""
        with self._lock:
            if self._flights.get(key) is flight:
                del self._flights[key]
