"""The host tier: features in host memory (page-locked when CUDA is available), from a pool.

Entries live in blocks of a ``HostPool``; ``reserve`` hands out a block for the demoter (or a disk
hit) to fill, evicting entries until one fits, in the order of the tier's policy (``eviction``:
"lru", oldest first; "value", lowest GDSF priority; "admit", GreedyDual behind an admission
filter; the last two weigh the cost each entry's metadata records: ``featcache.eviction``).
Budget accounting counts block sizes (the requested bytes rounded up to the pool's alignment),
which is what the pool really holds; the books weigh those too.

Invariant: a block is referenced by the tier while its entry is stored, and by any reader (a
promotion copy, a pending disk write) until that reader releases it; the pool reuses it only when no
reference remains and its last copy has finished. Thread-safe.
"""

from __future__ import annotations

import threading

from ..core.hostpool import Block, HostPool
from ..entrymeta import cost_of
from ..eviction import WEIGHS_COST, books_for
from .base import Alloc, Counters, Entry


class HostTier:
    """The staging tier (``StagingTier``): entries in pool blocks, evicted by ``eviction``."""

    name = "host"

    def __init__(self, capacity_bytes: int, slab_bytes: int, pin: bool, eviction: str = "lru") -> None:
        self.capacity_bytes = capacity_bytes
        self.eviction = eviction
        self.pool = HostPool(capacity_bytes, slab_bytes, pin)
        self._entries: dict[bytes, Entry] = {}
        # the order of eviction; sizes are block sizes, whose sum never exceeds the pool's
        self._books = books_for(eviction, capacity_bytes)
        self._weighs_cost = WEIGHS_COST[eviction]
        self._counters = Counters()
        self._lock = threading.Lock()

    @property
    def used_bytes(self) -> int:
        return self.pool.block_bytes

    def fits(self, nbytes: int, meta_bytes: int = 0) -> bool:
        """Whether an entry of ``nbytes`` could be held (a block holds at most a slab; the room
        for the value's header and metadata is checked by ``reserve``)."""
        return 0 < self.capacity_bytes and nbytes <= self.pool.max_block_bytes

    def contains(self, key: bytes) -> bool:
        return key in self._entries

    def reserve(self, nbytes: int) -> Block | None:
        """A block of ``nbytes`` for the caller to fill and ``put``, evicting entries for room.

        Returns None if the entry cannot be held even with the tier empty (too large, or every
        remaining block still busy with a copy).
        """
        if not self.fits(nbytes):
            return None
        with self._lock:
            while True:
                block = self.pool.alloc(nbytes)
                if block is not None or not self._entries:
                    return block
                key = self._books.evict_one()
                if key is None:  # (the host tier pins nothing: cannot happen)
                    return None
                victim = self._entries.pop(key)
                self._counters.evictions += 1
                assert victim.block is not None
                self.pool.release(victim.block)

    def put(self, key: bytes, entry: Entry) -> bool:
        """Store an entry whose tensor is a view of ``entry.block`` (from ``reserve``).

        The tier takes over the caller's reference to the block.
        """
        assert entry.block is not None, "host entries live in pool blocks: use reserve()"
        cost = cost_of(entry.meta) if self._weighs_cost else None  # outside the lock
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                assert old.block is not None
                self.pool.release(old.block)
            self._entries[key] = entry
            self._books.add(key, entry.block.size, cost)
            return True

    def get(self, key: bytes, alloc: Alloc | None = None) -> Entry | None:
        """The entry, with an extra reference on its block: the caller must ``release`` it.
        (``alloc`` is not used: the entry already lives in host memory.)"""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self._counters.misses += 1
                return None
            self._books.touch(key)
            self._counters.hits += 1
            assert entry.block is not None
            self.pool.retain(entry.block)
            return entry

    def release(self, block: Block) -> None:
        self.pool.release(block)

    def discard(self, key: bytes) -> bool:
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is None:
                return False
            self._books.remove(key)
            assert entry.block is not None
            self.pool.release(entry.block)
            return True

    def keys(self) -> list[bytes]:
        """The keys held now (a snapshot)."""
        with self._lock:
            return list(self._entries)

    def clear(self) -> list[bytes]:
        """Drop every entry; return their keys. A block still read by a copy or a pending write
        is reused only after that reader releases it (its reference)."""
        with self._lock:
            entries, self._entries = self._entries, {}
            self._books = books_for(self.eviction, self.capacity_bytes)
            for entry in entries.values():
                assert entry.block is not None
                self.pool.release(entry.block)
            return list(entries)

    def count_drops(self, n: int = 1) -> None:
        with self._lock:
            self._counters.drops += n

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                **self._counters.as_dict(),
                "entries": len(self._entries),
                "bytes": self.pool.block_bytes,
                "capacity_bytes": self.capacity_bytes,
                "pool_bytes": self.pool.allocated_bytes,
            }

    def close(self) -> None:
        with self._lock:
            for entry in self._entries.values():
                assert entry.block is not None
                self.pool.release(entry.block)
            self._entries.clear()
            self._books = books_for(self.eviction, self.capacity_bytes)
