"""The remote tiers' circuit breaker (``remote``, ``mooncake``): after ``failures`` consecutive
failures, calls are refused for ``cooldown_s``.

    closed --N consecutive failures--> open --cooldown elapsed--> half-open (one trial call)
    half-open --trial succeeds--> closed ; half-open --trial fails--> open (a new cooldown)

Policy only: it does no I/O and never sleeps; the caller asks ``allow()`` before a call and reports
``success()`` or ``failure()`` after it. The clock is injected (``time.monotonic`` by default) so
tests drive it without waiting. Thread-safe: while a half-open trial is in flight, other callers
are refused, so a server that is still down costs one timeout per cooldown, not one per caller.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class Breaker:
    def __init__(
        self, failures: int, cooldown_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if failures < 1:
            raise ValueError("a breaker opens after at least 1 failure")
        if cooldown_s < 0:
            raise ValueError("cooldown_s must be >= 0")
        self.failures = failures
        self.cooldown_s = cooldown_s
        self.clock = clock
        self._lock = threading.Lock()
        self._consecutive = 0
        self._open_until: float | None = None  # None: closed
        self._trial = False  # a half-open trial call is in flight
        self.opened = 0  # times the breaker opened (closed or half-open -> open)
        self.refused = 0  # calls refused while open or while a trial was in flight

    @property
    def is_open(self) -> bool:
        """True while calls are refused (open, cooldown not over, or a trial in flight)."""
        with self._lock:
            return self._open_until is not None and (
                self._trial or self.clock() < self._open_until
            )

    def allow(self) -> bool:
        """May a call go out now? After the cooldown, exactly one caller gets a trial."""
        with self._lock:
            if self._open_until is None:
                return True
            if self._trial or self.clock() < self._open_until:
                self.refused += 1
                return False
            self._trial = True
            return True

    def success(self) -> None:
        with self._lock:
            self._consecutive = 0
            self._open_until = None
            self._trial = False

    def failure(self) -> None:
        with self._lock:
            self._consecutive += 1
            if self._trial or (self._open_until is None and self._consecutive >= self.failures):
                self._open_until = self.clock() + self.cooldown_s
                self._trial = False
                self.opened += 1
