"""Eviction bookkeeping for an in-memory tier by value: GreedyDual-Size-Frequency (GDSF).

Each key's priority is ``H = L + hits * cost_s / nbytes``: what a hit on it saves (``cost_s``, the
seconds of vision computation of its miss, recorded at put; ``featcache.entrymeta.cost_of``)
times how often it was used since it came in (``hits``, 1 at ``add``), per byte it holds. The
victim is the unpinned key of lowest ``H``; ``L`` (``inflation``) is then raised to the victim's
``H``, so a key that is not used again ages: every later ``add`` or ``touch`` starts from the
higher ``L`` (recency), and an old key keeps its place only by the hits it earned (frequency)
and what it saves per byte (Cao & Irani 1997, GreedyDual-Size; Cherkasova 1998, GDSF). With
equal costs per byte and no repeats it is LRU. docs/design.md ("Eviction") says why this one.

Correlated uses count once (LRU-K's correlated reference period, O'Neil et al. 1993): a touch
within ``CORRELATION`` x (keys held) uses (adds and touches) of the key's last one refreshes its
``H`` at the current ``L`` but does not add to ``hits``. A conversation resends its image at every
turn, close together: those turns are one burst of use, not popularity, and counting them let a
finished chat's images outlive the live ones (on bench/eviction.py's chat trace at 1 GiB, plain
GDSF saved 10.7% less vision time than LRU; with the window, 1.3% less).

The books hold keys, sizes and costs only; the tier holds the values. Invariants:
- ``used_bytes`` is the sum of the sizes of the keys held and never exceeds ``capacity_bytes``;
- a key with a positive pin count (lent to an in-flight user) is never chosen as a victim;
- a victim has the lowest ``H`` of the unpinned keys (ties: the least recently added or touched);
- ``L`` never decreases; every key's ``H`` is at least the ``L`` of its last ``add`` or ``touch``;
- ``hits`` grows only on a touch more than ``CORRELATION`` x (keys held) uses after the key's last;
- ``evict_for`` removes its victims only when they make enough room (else nothing changes).

Costs: a binary heap of ``(H, seq, key)`` with lazy deletion: ``touch``, ``add``, ``unpin`` push a
new record and leave the old one, recognised as stale by its ``seq``; a pinned key has no live
record (it is pushed again at its last ``unpin``). The heap is rebuilt when stale records
outnumber live ones twice over, so every operation is O(log n) amortised.
"""

from __future__ import annotations

import heapq

from .lru import Pins

# What a byte saves when a key's cost is unknown (put without one) and no key with a known cost
# was added yet: InternVL2-2B's vision model on a 13-tile image, 24.6 ms for 13.6 MB of features
# (bench/results/HISTORY.md, "InternVL2-26B and InternVL2-2B": the cheaper of the two models measured).
# Once costs are known, an unknown one counts as their mean per byte.
DEFAULT_S_PER_BYTE = 24.6e-3 / (3328 * 2048 * 2)

_REBUILD_SLACK = 64  # stale heap records tolerated on top of twice the live ones

# A touch within this many times the keys held of uses (adds and touches, the books' clock) after
# the key's last use is correlated: recency refreshed, frequency not counted. 2 was the best of
# 0.5, 1, 2 and 4 on bench/eviction.py's traces (docs/design.md, "Eviction").
CORRELATION = 2.0


class _Item:
    __slots__ = ("hits", "last", "nbytes", "priority", "seq", "worth")

    def __init__(self, nbytes: int, worth: float, priority: float, seq: int, last: int) -> None:
        self.nbytes = nbytes
        self.worth = worth  # seconds saved per byte per hit
        self.hits = 1
        self.priority = priority
        self.seq = seq  # of its live heap record (none while pinned)
        self.last = last  # the books' clock at its last add or touch


class ValueBooks:
    """Lowest ``L + hits * cost_s / nbytes`` first (GDSF); same calls as ``LruBooks``."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self.inflation = 0.0  # L: the H of the last victim
        self._items: dict[bytes, _Item] = {}
        self._heap: list[tuple[float, int, bytes]] = []
        self._seq = 0
        self._pins = Pins()
        self._known_worth = 0.0  # the sum of the worths of the keys added with a known cost
        self._known = 0  # how many
        self._clock = 0  # adds and touches so far

    def __contains__(self, key: bytes) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    def priority(self, key: bytes) -> float | None:
        """``key``'s ``H`` now, or None if it is not held."""
        item = self._items.get(key)
        return None if item is None else item.priority

    def touch(self, key: bytes) -> None:
        item = self._items[key]
        self._clock += 1
        if self._clock - item.last > CORRELATION * len(self._items):
            item.hits += 1  # a use of its own, not a repeat within a burst
        item.last = self._clock
        item.priority = self.inflation + item.hits * item.worth
        if key not in self._pins:
            self._push(key, item)

    def add(self, key: bytes, nbytes: int, cost_s: float | None = None) -> None:
        """Hold ``key`` (``nbytes``, what a hit on it saves: ``cost_s`` seconds; None: unknown,
        counted as the mean per byte of the known ones). Replaces the key: its hits restart."""
        self.remove(key)
        if self.used_bytes + nbytes > self.capacity_bytes:
            raise AssertionError("add() without room: call evict_for() first")
        if cost_s is not None and cost_s >= 0:
            worth = cost_s / max(nbytes, 1)
            self._known_worth += worth
            self._known += 1
        else:
            worth = self._known_worth / self._known if self._known else DEFAULT_S_PER_BYTE
        self._clock += 1
        item = _Item(nbytes, worth, self.inflation + worth, -1, self._clock)
        self._items[key] = item
        self.used_bytes += nbytes
        if key not in self._pins:
            self._push(key, item)

    def remove(self, key: bytes) -> int | None:
        """Forget ``key`` (a discard, not an eviction: ``L`` stays); its heap record goes stale."""
        item = self._items.pop(key, None)
        if item is None:
            return None
        self.used_bytes -= item.nbytes
        return item.nbytes

    def evict_for(self, nbytes: int, replacing: bytes | None = None,
                  cost_s: float | None = None) -> list[bytes] | None:
        """Remove the lowest-``H`` unpinned keys whose removal makes room for ``nbytes`` and
        return them (``L`` rises to the highest of their ``H``); None, with nothing removed, if
        that is impossible. ``replacing`` is a key about to be overwritten: its size is counted
        as free and it is never a victim. (``cost_s``, the incoming entry's, is accepted and
        ignored: ``add`` takes it.)"""
        if nbytes > self.capacity_bytes:
            return None
        free = self.capacity_bytes - self.used_bytes
        kept = self._items.get(replacing) if replacing is not None else None
        if kept is not None:
            free += kept.nbytes
        if free >= nbytes:
            return []
        taken: list[tuple[float, int, bytes]] = []  # live records popped, in H order
        victims: list[bytes] = []
        heap = self._heap
        while free < nbytes and heap:
            record = heapq.heappop(heap)
            key = record[2]
            item = self._items.get(key)
            if item is None or item.seq != record[1]:
                continue  # stale: dropped for good
            taken.append(record)
            if key != replacing:
                victims.append(key)
                free += item.nbytes
        if free < nbytes:
            for record in taken:
                heapq.heappush(heap, record)
            return None
        for record in taken:
            if record[2] == replacing:
                heapq.heappush(heap, record)
                continue
            self.inflation = max(self.inflation, record[0])
            self.remove(record[2])
        return victims

    def evict_one(self) -> bytes | None:
        """Remove the lowest-``H`` unpinned key and return it (``L`` rises to its ``H``); None if
        every key is pinned (or none is held)."""
        heap = self._heap
        while heap:
            priority, seq, key = heapq.heappop(heap)
            item = self._items.get(key)
            if item is None or item.seq != seq:
                continue
            self.inflation = max(self.inflation, priority)
            self.remove(key)
            return key
        return None

    def pin(self, key: bytes) -> None:
        item = self._items.get(key)
        if self._pins.add(key) and item is not None:
            item.seq = -1  # its heap record goes stale: a pinned key is no candidate

    def unpin(self, key: bytes) -> None:
        item = self._items.get(key)
        if self._pins.drop(key) and item is not None:
            self._push(key, item)  # a candidate again, at the H its uses earned

    def pinned(self, key: bytes) -> bool:
        return key in self._pins

    def _push(self, key: bytes, item: _Item) -> None:
        self._seq += 1
        item.seq = self._seq
        heap = self._heap
        heapq.heappush(heap, (item.priority, self._seq, key))
        if len(heap) > 2 * len(self._items) + _REBUILD_SLACK:
            self._rebuild()

    def _rebuild(self) -> None:
        """Drop the stale records: O(n), after at least n pushes since the last rebuild."""
        self._heap = [(item.priority, item.seq, key) for key, item in self._items.items()
                      if item.seq >= 0]
        heapq.heapify(self._heap)
