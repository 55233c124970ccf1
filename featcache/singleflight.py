"""One computation per key at a time: the misses of ``FeatureCache.get_or_compute``.

Invariant: while a key's computation runs, every other caller of ``run`` for that key waits for it
and gets its result, or its exception (nothing of a failed computation is kept: the next call
computes again). Waiters hold no lock while they wait; the map of flights is held only to join or
leave one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

T = TypeVar("T")


class _Flight(Generic[T]):
    def __init__(self) -> None:
        self.done = threading.Event()
        self.value: T | None = None
        self.error: BaseException | None = None

    def result(self) -> T:
        """Wait for the computation; its value, or its exception raised here."""
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self.value  # type: ignore[return-value]  # set before done


class SingleFlight(Generic[T]):
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._flights: dict[Hashable, _Flight[T]] = {}

    def run(self, key: Hashable, fn: Callable[[], T]) -> T:
        """``fn()``, unless a call for ``key`` is already running: then that call's outcome."""
        with self._lock:
            flight = self._flights.get(key)
            first = flight is None
            if flight is None:
                flight = self._flights[key] = _Flight()
        if not first:
            return flight.result()
        try:
            flight.value = fn()
            return flight.value
        except BaseException as e:
            flight.error = e
            raise
        finally:
            with self._lock:
                del self._flights[key]
            flight.done.set()
