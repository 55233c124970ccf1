"""The order of the admission books (``featcache.eviction.admission``): GreedyDual by cost class,
its items, queues and victims; no admission here (the books judge an entry before they take its
victims).

Each key's priority is ``H = L + sqrt(worth)``: ``worth`` is what a hit saves per byte
(``cost_s / nbytes``, recorded at put; an unknown cost counts as the mean of the known ones) and
``L`` (``inflation``) the ``H`` of the last victim, so a key not used again ages
(GreedyDual-Size, Cao & Irani 1997; the square root, GreedyDual*'s damping, Jin & Bestavros 2001:
a 26B image, 3.7x the 2B's worth per byte, is kept about 1.9x as long, not 3.7x, which cost up to
2% against LRU where LRU already held nearly everything; docs/design.md, "Eviction"). The victim
is the unpinned key of lowest ``H``. Keys are kept in one LRU queue per *cost class* (worths
within half an octave: ``CLASS_STEPS`` per doubling): within a class the least recently used key
has the lowest ``H``, so the victim is the lowest of the queues' heads, O(cost classes) (a model's
features cost about the same per byte: a class or two per model; ties between classes go either
way). There is no frequency in the order: a conversation resending its images every turn is
recency, not popularity; with equal costs per byte the order is LRU's.

Invariants (the books keep them; the functions here read them): every held key is in exactly one
queue, its cost class's, as an ``Item`` whose ``queue`` is that queue; a queue is kept in LRU order
(a use moves the key to its end): its first unpinned key is taken as its lowest ``H``; a victim is
never a pinned key nor the key being added (``keep``).
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence

from .ledger import Ledger

CLASS_STEPS = 2  # cost classes per doubling of worth
NO_WORTH = -(1 << 30)  # the class of an entry that saves nothing

def class_of(worth: float) -> int:
    """The cost class of ``worth`` (seconds saved per byte): half an octave."""
    return math.floor(math.log2(worth) * CLASS_STEPS) if worth > 0 else NO_WORTH


class Item:
    __slots__ = ("count", "epoch", "gain", "hash", "ledger", "mark", "nbytes", "priority",
                 "queue", "stake", "worth")

    def __init__(self, nbytes: int, worth: float, gain: float, priority: float, h: int,
                 count: int, epoch: int, queue: OrderedDict[bytes, Item]) -> None:
        self.nbytes = nbytes
        self.worth = worth  # seconds a hit saves, per byte
        self.gain = gain  # what a use adds to L: sqrt(worth)
        self.priority = priority  # H
        self.hash = h  # FrequencySketch.hash_of its key
        self.count = count  # its uses lately (halved once per aging since ``epoch``)
        self.epoch = epoch
        self.queue = queue  # its cost class's LRU queue
        self.mark = 0  # ledger.SPARED, ledger.WOULD_REJECT
        self.stake = 0.0  # bytes of it a spared hit counts for (the entry turned away's share)
        self.ledger: Ledger | None = None  # the ledger a hit on a marked item is entered in


def lowest(queues: Iterable[OrderedDict[bytes, Item]], pins: dict[bytes, int],
           keep: bytes | None) -> tuple[bytes, Item]:
    """The unpinned key other than ``keep`` of lowest ``H`` (the caller checked that there is
    one): the lowest of the queues' heads (each cost class's oldest unpinned key)."""
    best: Item | None = None
    best_key = b""
    for queue in queues:
        for key in queue:  # the queue's head, past pinned keys (few)
            if key in pins or key == keep:
                continue
            item = queue[key]
            if best is None or item.priority < best.priority:
                best, best_key = item, key
            break
    assert best is not None
    return best_key, best


def plan(queues: Sequence[OrderedDict[bytes, Item]], pins: dict[bytes, int], need: int,
         keep: bytes | None) -> list[tuple[bytes, Item]]:
    """The lowest-``H`` unpinned keys other than ``keep`` whose bytes reach ``need``, lowest
    first (the caller checked that there are enough); nothing is removed."""
    key, item = lowest(queues, pins, keep)
    if item.nbytes >= need:
        return [(key, item)]
    return plan_many(queues, pins, need, keep)


def plan_many(queues: Iterable[OrderedDict[bytes, Item]], pins: dict[bytes, int], need: int,
              keep: bytes | None) -> list[tuple[bytes, Item]]:
    """``plan`` for more than one victim: the queues merged by ``H``."""
    heads: list[tuple[float, int, bytes, Item, Iterator[tuple[bytes, Item]]]] = []
    for i, queue in enumerate(queues):
        it = iter(queue.items())
        for key, item in it:
            if key not in pins and key != keep:
                heads.append((item.priority, i, key, item, it))
                break
    heapq.heapify(heads)
    victims: list[tuple[bytes, Item]] = []
    while need > 0:
        _, i, key, item, it = heapq.heappop(heads)
        victims.append((key, item))
        need -= item.nbytes
        for key, item in it:
            if key not in pins and key != keep:
                heapq.heappush(heads, (item.priority, i, key, item, it))
                break
    return victims
