"""Eviction bookkeeping for an in-memory tier by recency: LRU order, byte accounting and leases.

The books hold keys and sizes only; the tier holds the values (``featcache.eviction`` picks these
books or ``featcache.eviction.value``'s by the config's ``eviction``). Invariants:
- ``used_bytes`` is the sum of the sizes of the keys held and never exceeds ``capacity_bytes``;
- a key with a positive pin count (lent to an in-flight user) is never chosen as a victim;
- a victim is the least recently added or touched unpinned key;
- ``evict_for`` removes its victims only when they make enough room (else nothing changes).

Costs: O(1) per ``touch``, ``add``, ``remove``, ``pin``; an eviction skips the pinned keys older
than its victims (few: leases are held for one request).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator


class Pins:
    """How many users hold each key lent to them (both books' leases: a key held is never a
    victim). A key is in it while its count is positive."""

    def __init__(self) -> None:
        self._counts: dict[bytes, int] = {}

    def __contains__(self, key: bytes) -> bool:
        return key in self._counts

    def add(self, key: bytes) -> bool:
        """One more holder of ``key``; True if it is the first."""
        count = self._counts.get(key, 0)
        self._counts[key] = count + 1
        return not count

    def drop(self, key: bytes) -> bool:
        """One holder of ``key`` fewer; True if that was the last. AssertionError without one."""
        count = self._counts.get(key, 0) - 1
        if count < 0:
            raise AssertionError(f"unpin without pin for {key.hex()}")
        if count:
            self._counts[key] = count
            return False
        del self._counts[key]
        return True


class LruBooks:
    """Least recently used first. ``add``'s ``cost_s`` is accepted and ignored (the books of
    ``eviction="value"`` weigh it)."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._sizes: OrderedDict[bytes, int] = OrderedDict()  # oldest first
        self._pins = Pins()

    def __contains__(self, key: bytes) -> bool:
        return key in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    def touch(self, key: bytes) -> None:
        self._sizes.move_to_end(key)

    def victims_for(self, nbytes: int, replacing: bytes | None = None) -> list[bytes] | None:
        """Oldest unpinned keys whose removal makes room for ``nbytes``, or None if impossible
        (nothing is removed: ``evict_for`` removes them).

        ``replacing`` is a key about to be overwritten: its size is counted as free.
        """
        if nbytes > self.capacity_bytes:
            return None
        free = self.capacity_bytes - self.used_bytes
        if replacing is not None and replacing in self._sizes:
            free += self._sizes[replacing]
        victims: list[bytes] = []
        for key in self.unpinned_oldest_first():
            if free >= nbytes:
                break
            if key == replacing:
                continue
            victims.append(key)
            free += self._sizes[key]
        return victims if free >= nbytes else None

    def evict_for(self, nbytes: int, replacing: bytes | None = None,
                  cost_s: float | None = None) -> list[bytes] | None:
        """Remove the victims that make room for ``nbytes`` (``victims_for``) and return them;
        None, with nothing removed, if no choice of unpinned keys makes enough room. (``cost_s``,
        the incoming entry's, is accepted and ignored: the admission books weigh it.)"""
        victims = self.victims_for(nbytes, replacing)
        for key in victims or ():
            self.remove(key)
        return victims

    def evict_one(self) -> bytes | None:
        """Remove the oldest unpinned key and return it; None if every key is pinned (or none)."""
        key = next(self.unpinned_oldest_first(), None)
        if key is not None:
            self.remove(key)
        return key

    def unpinned_oldest_first(self) -> Iterator[bytes]:
        return (k for k in self._sizes if k not in self._pins)

    def add(self, key: bytes, nbytes: int, cost_s: float | None = None) -> None:
        self.remove(key)
        if self.used_bytes + nbytes > self.capacity_bytes:
            raise AssertionError("add() without room: call evict_for() first")
        self._sizes[key] = nbytes
        self.used_bytes += nbytes

    def remove(self, key: bytes) -> int | None:
        nbytes = self._sizes.pop(key, None)
        if nbytes is not None:
            self.used_bytes -= nbytes
        return nbytes

    def pin(self, key: bytes) -> None:
        self._pins.add(key)

    def unpin(self, key: bytes) -> None:
        self._pins.drop(key)

    def pinned(self, key: bytes) -> bool:
        return key in self._pins
