"""The eviction policies of the in-memory tiers, as a table: the config's ``eviction`` names one,
and the device and host tiers keep their books with it.

    "admit"  featcache.eviction.admission.AdmissionBooks  GreedyDual by cost class (lowest L + sqrt(cost /
                                                 bytes)) behind a TinyLFU admission filter that is
                                                 on only while it pays; the default
    "value"  featcache.eviction.value.ValueBooks          GreedyDual-Size-Frequency: lowest
                                                 L + hits * cost / bytes (a burst of repeats one hit)
    "lru"    featcache.eviction.lru.LruBooks              least recently used first

"admit" is the default because it is the one within 2% of LRU on every trace of bench/eviction.py
(the worst cell -0.8%, development and held-out traces alike; "value" lost up to 36% where large
images come back too late to be hit) while keeping most of value's gains where cost per byte
varies (docs/benchmarks.md, "Eviction policies against LRU").

All keep the same books (``Books``): keys, sizes, leases (pins); the tiers hold the values and
call the books under their own lock. ``evict_for`` is told the incoming entry's cost (admission
weighs it; the others ignore it) and may refuse it (None: the entry is not stored). The disk
tier's order is LMDB's stamp table (LRU); why it stays so: docs/design.md, "Eviction".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from ..config import EVICTIONS
from .admission import AdmissionBooks
from .lru import LruBooks
from .value import ValueBooks


class Books(Protocol):
    """What a tier asks of its eviction books (see ``LruBooks`` for the invariants)."""

    capacity_bytes: int
    used_bytes: int

    def __contains__(self, key: bytes) -> bool: ...

    def __len__(self) -> int: ...

    def touch(self, key: bytes) -> None: ...

    def add(self, key: bytes, nbytes: int, cost_s: float | None = None) -> None: ...

    def remove(self, key: bytes) -> int | None: ...

    def evict_for(self, nbytes: int, replacing: bytes | None = None,
                  cost_s: float | None = None) -> list[bytes] | None: ...

    def evict_one(self) -> bytes | None: ...

    def pin(self, key: bytes) -> None: ...

    def unpin(self, key: bytes) -> None: ...

    def pinned(self, key: bytes) -> bool: ...


POLICIES: dict[str, Callable[[int], Books]] = {"lru": LruBooks, "value": ValueBooks,
                                               "admit": AdmissionBooks}
assert tuple(POLICIES) == EVICTIONS, "config.EVICTIONS lists the policies of this table"

# Whether a policy weighs what a hit saves (the tiers then read an entry's cost at put).
WEIGHS_COST = {"lru": False, "value": True, "admit": True}


def books_for(eviction: str, capacity_bytes: int) -> Books:
    """New, empty books of policy ``eviction`` (one of ``config.EVICTIONS``)."""
    try:
        make = POLICIES[eviction]
    except KeyError:
        raise ValueError(f"eviction must be one of {', '.join(POLICIES)}, not {eviction!r}") from None
    return make(capacity_bytes)
