"""A cache's counters: its own events (``stats()["cache"]``: hits, misses, puts, ...), counted by
the cache and its read path, and the sections its integrations count in (``FeatureCache.count``:
``stats()["lmdeploy"]``, ...). Thread-safe, under one lock.

Invariants: ``count`` holds no reference to the cache (the read path keeps it, and an unreferenced
cache is freed, and closed, at once); an integration's section never takes a name of the cache's
own sections (``reserved``: "cache" and the tiers').
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Collection

# The cache's own counters, in the order ``stats()["cache"]`` shows them (after ``gets``)
CACHE_COUNTERS = ("hits", "misses", "puts", "not_stored", "inflight_hits", "promotions",
                  "stale_promotions")


class Counts:
    """The counters of one build of a cache; ``reserved``: the section names integrations may not
    count in."""

    def __init__(self, reserved: Collection[str]) -> None:
        self._counts: Counter[str] = Counter()
        self._events: dict[str, Counter[str]] = {}  # counters of integrations, by section
        self._lock = threading.Lock()
        self._reserved = frozenset(reserved)

    def count(self, name: str) -> None:
        """Count one of the cache's own events (``CACHE_COUNTERS``)."""
        with self._lock:
            self._counts[name] += 1

    def event(self, section: str, event: str, n: int = 1) -> None:
        """Count an integration's event, ``stats()[section][event]``."""
        if section in self._reserved:
            raise ValueError(f"section {section!r} is reserved for the cache's own counters")
        with self._lock:
            self._events.setdefault(section, Counter())[event] += n

    def snapshot(self) -> tuple[dict[str, int], dict[str, dict[str, int]]]:
        """The cache's own counters (``gets``, then ``CACHE_COUNTERS``, each at 0 where none) and
        the integrations' sections, read at one time."""
        with self._lock:
            counts = dict(self._counts)
            events = {section: dict(c) for section, c in self._events.items()}
        own = {"gets": counts.get("hits", 0) + counts.get("misses", 0),
               **{k: counts.get(k, 0) for k in CACHE_COUNTERS}}
        return own, events
