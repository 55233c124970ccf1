"""The device tier: features kept as tensors on the cache's device (a GPU, or the CPU without one).

A put stores the caller's tensor itself (no copy); when room is needed, entries are evicted by the
tier's policy (``eviction``: "lru", oldest first; "value", lowest GDSF priority; "admit",
GreedyDual behind an admission filter, which may turn a new entry away: ``put`` is then False;
the last two weigh the cost each entry's metadata records: ``featcache.eviction``), except
entries pinned by a lease, which stay until released. ``clear`` drops every entry but the pinned
ones, which it marks dropped: they are no longer found (lookups miss, ``contains`` is False)
but stay, counted in the budget, until their last lease is released, then go (a put of the key
in between keeps the new value).
Thread-safe.
"""

from __future__ import annotations

import threading

from ..entrymeta import cost_of
from ..eviction import WEIGHS_COST, books_for
from .base import Alloc, Counters, Entry


class DeviceTier:
    """The top tier (``LeasingTier``): the producers' tensors, evicted by ``eviction``, leases."""

    name = "device"

    def __init__(self, capacity_bytes: int, eviction: str = "lru") -> None:
        self.capacity_bytes = capacity_bytes
        self.eviction = eviction
        self._books = books_for(eviction, capacity_bytes)
        self._weighs_cost = WEIGHS_COST[eviction]
        self._entries: dict[bytes, Entry] = {}
        self._dropped: set[bytes] = set()  # cleared while leased: gone at the last unpin
        self._counters = Counters()
        self._lock = threading.Lock()
        self._closed = False

    @property
    def used_bytes(self) -> int:
        return self._books.used_bytes

    def fits(self, nbytes: int, meta_bytes: int = 0) -> bool:
        """Whether an entry of ``nbytes`` could be held (the metadata is held with the tensor,
        uncounted: it is at most 64 KiB)."""
        return 0 < self.capacity_bytes and nbytes <= self.capacity_bytes

    def contains(self, key: bytes) -> bool:
        return key in self._entries and key not in self._dropped

    def get(self, key: bytes, alloc: Alloc | None = None, *, pin: bool = False) -> Entry | None:
        """The entry, or None; with ``pin`` the hit is pinned in the same step (a lease).
        (``alloc`` is not used: the entry is the tensor itself, never copied out.)"""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or key in self._dropped:
                self._counters.misses += 1
                return None
            self._books.touch(key)
            self._counters.hits += 1
            if pin:
                self._books.pin(key)
            return entry

    def put(self, key: bytes, entry: Entry, *, pin: bool = False) -> bool:
        """Store ``entry``, evicting unpinned entries for room (by the policy); False if it
        cannot fit.

        With ``pin`` the key is pinned in the same step (a lease), stored or not, so every lease
        unpins exactly what it pinned; a pin on a key that could not be stored only keeps a later
        put of that key resident until the lease ends."""
        cost = cost_of(entry.meta) if self._weighs_cost else None  # outside the lock
        with self._lock:
            if pin:
                self._books.pin(key)
            self._dropped.discard(key)
            victims = self._books.evict_for(entry.nbytes, replacing=key, cost_s=cost)
            if victims is None:
                return False
            for victim in victims:
                self._remove(victim)
                self._counters.evictions += 1
            self._books.add(key, entry.nbytes, cost)
            self._entries[key] = entry
            return True

    def discard(self, key: bytes) -> bool:
        with self._lock:
            return self._remove(key)

    def _remove(self, key: bytes) -> bool:
        self._dropped.discard(key)
        self._books.remove(key)
        return self._entries.pop(key, None) is not None

    def pin(self, key: bytes) -> None:
        """Pin ``key`` without looking it up: the lease of a lookup whose value was not
        installed (a newer put or a discard of the key raced with it) still pins, so that its
        ``unpin`` stays balanced."""
        with self._lock:
            self._books.pin(key)

    def unpin(self, key: bytes) -> None:
        with self._lock:
            if not self._closed:  # leases may outlive the cache; closing dropped every pin
                self._books.unpin(key)
                if key in self._dropped and not self._books.pinned(key):
                    self._remove(key)

    def keys(self) -> list[bytes]:
        """The keys held now (a snapshot), leased entries that ``clear`` dropped left out."""
        with self._lock:
            return [k for k in self._entries if k not in self._dropped]

    def clear(self) -> list[bytes]:
        """Drop every entry; return the keys dropped. A leased entry is dropped from view at
        once and from memory (and the budget) when its last lease is released."""
        with self._lock:
            gone = [k for k in self._entries if k not in self._dropped]
            for key in gone:
                if self._books.pinned(key):
                    self._dropped.add(key)
                else:
                    self._remove(key)
            return gone

    def count_drops(self, n: int = 1) -> None:
        with self._lock:
            self._counters.drops += n

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                **self._counters.as_dict(),
                "entries": len(self._entries),
                "bytes": self._books.used_bytes,
                "capacity_bytes": self.capacity_bytes,
            }

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._entries.clear()
            self._dropped.clear()
            self._books = books_for(self.eviction, self.capacity_bytes)
