"""The host tier: features in host memory (page-locked when CUDA is available), from a pool.

Entries live in blocks of a ``HostPool``; ``reserve`` hands out a block for the demoter (or a disk
hit) to fill, evicting the oldest entries until one fits. Budget accounting counts block sizes (the
requested bytes rounded up to the pool's alignment), which is what the pool really holds.

Invariant: a block is referenced by the tier while its entry is stored, and by any reader (a
promotion copy, a pending disk write) until that reader releases it; the pool reuses it only when no
reference remains and its last copy has finished. Thread-safe.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from ..hostpool import Block, HostPool
from .base import Alloc, Counters, Entry


class HostTier:
    """The staging tier (``StagingTier``): entries in pool blocks, LRU."""

    name = "host"

    def __init__(self, capacity_bytes: int, slab_bytes: int, pin: bool) -> None:
        self.capacity_bytes = capacity_bytes
        self.pool = HostPool(capacity_bytes, slab_bytes, pin)
        self._entries: OrderedDict[bytes, Entry] = OrderedDict()  # oldest first
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
        """A block of ``nbytes`` for the caller to fill and ``put``, evicting LRU entries for room.

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
                _, victim = self._entries.popitem(last=False)
                self._counters.evictions += 1
                assert victim.block is not None
                self.pool.release(victim.block)

    def put(self, key: bytes, entry: Entry) -> bool:
        """Store an entry whose tensor is a view of ``entry.block`` (from ``reserve``).

        The tier takes over the caller's reference to the block.
        """
        assert entry.block is not None, "host entries live in pool blocks: use reserve()"
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                assert old.block is not None
                self.pool.release(old.block)
            self._entries[key] = entry
            return True

    def get(self, key: bytes, alloc: Alloc | None = None) -> Entry | None:
        """The entry, with an extra reference on its block: the caller must ``release`` it.
        (``alloc`` is not used: the entry already lives in host memory.)"""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self._counters.misses += 1
                return None
            self._entries.move_to_end(key)
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
            assert entry.block is not None
            self.pool.release(entry.block)
            return True

    def keys(self) -> list[bytes]:
        """The keys held now, oldest use first (a snapshot)."""
        with self._lock:
            return list(self._entries)

    def clear(self) -> list[bytes]:
        """Drop every entry; return their keys. A block still read by a copy or a pending write
        is reused only after that reader releases it (its reference)."""
        with self._lock:
            entries, self._entries = self._entries, OrderedDict()
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
