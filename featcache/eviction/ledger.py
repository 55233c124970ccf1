"""What an admission filter knows of its own worth (``featcache.eviction.admission``, "The filter
is on only where it pays"): each cost class's ``Ledger`` (seconds of hits its filter saved or
would have saved, ``credit``, and lost or would have lost, ``debit``, lately) and the ``Ghost``s
(keys gone lately, without values) whose return is a ledger entry.

Invariants:
- a filter decides only after ``MIN_EVENTS`` ledger entries and once the books saw a budget of
  bytes come in since their first eviction; then it filters while ``credit > ON_MARGIN x debit``;
- while a class's filter is off only the misses whose key hash ``& SAMPLED`` is 0 are judged, and
  each of their ledger entries counts ``SAMPLE_WEIGHT`` times;
- a ghost holds at most ``capacity`` bytes of keys (the oldest forgotten first); a key is in it
  at most once.
"""

from __future__ import annotations

from collections import OrderedDict

MIN_EVENTS = 16  # ledger entries before the filter's first decision
ON_MARGIN = 1.5  # a filter turns on while its ledger's credit is above ON_MARGIN x its debit
SAMPLED = 7  # while a class's filter is off, the misses whose key hash & SAMPLED is 0 are judged
SAMPLE_WEIGHT = SAMPLED + 1  # what each of their ledger entries counts for
SPARED, WOULD_REJECT = 1, 2  # an item's mark: what a hit on it tells its ledger


class Ledger:
    """A cost class's ledger: seconds of hits its filter saved (or would have) and lost (or
    would have), lately; whether it filters."""

    __slots__ = ("credit", "debit", "events", "filtering")

    def __init__(self) -> None:
        self.credit = 0.0
        self.debit = 0.0
        self.events = 0  # entries so far
        self.filtering = False  # until the ledger says it pays

    def decide(self, warm: bool) -> None:
        """Count an entry; decide whether to filter, once ``warm`` (a budget come in since the
        first eviction) and past ``MIN_EVENTS`` entries."""
        self.events += 1
        if self.events >= MIN_EVENTS and warm:
            self.filtering = self.credit > ON_MARGIN * self.debit


class Ghost:
    """Keys gone lately, without values: at most ``capacity`` bytes of them, oldest forgotten;
    each with its bytes, a cost (seconds) and a ledger. ``remembered``: the keys (the books'
    miss path reads it directly, not through ``in``: it is the hot one)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.nbytes = 0
        self.remembered: OrderedDict[bytes, tuple[int, float, Ledger]] = OrderedDict()

    def add(self, key: bytes, nbytes: int, cost_s: float, ledger: Ledger) -> None:
        keys = self.remembered
        old = keys.pop(key, None)
        if old is not None:
            self.nbytes -= old[0]
        keys[key] = (nbytes, cost_s, ledger)
        self.nbytes += nbytes
        while self.nbytes > self.capacity:
            self.nbytes -= keys.popitem(last=False)[1][0]

    def take(self, key: bytes) -> tuple[int, float, Ledger] | None:
        """Forget ``key``; what it was remembered with (bytes, cost, ledger), or None."""
        held = self.remembered.pop(key, None)
        if held is not None:
            self.nbytes -= held[0]
        return held

    def __contains__(self, key: bytes) -> bool:
        return key in self.remembered

    def __len__(self) -> int:
        return len(self.remembered)
