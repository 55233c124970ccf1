"""Eviction bookkeeping for an in-memory tier: GreedyDual by cost class, behind a TinyLFU
admission filter that is on only while it pays (``eviction="admit"``; ``featcache.eviction``).

**Order (GreedyDual by cost class, ``featcache.eviction.costclasses``).** Each key's priority is
``H = L + sqrt(worth)``: ``worth`` is what a hit saves per byte and ``L`` (``inflation``) the ``H``
of the last victim; the victim is the unpinned key of lowest ``H``, the lowest of the heads of one
LRU queue per cost class. There is no frequency in the order: with equal costs per byte it is LRU's.

**Admission (TinyLFU).** Every use is counted: a key held counts its own uses (``count``), a key
not held is counted in a count-min sketch (``FrequencySketch``: 4 one-byte counters capped at 15
per key, in one 64-byte block, 16 counters per entry as Caffeine's; an evicted key's count is
written back to it), and every ``SAMPLE`` x (entries) uses all counts are halved, so old
popularity fades (Einziger, Friedman & Manes 2017). A key's ``reuse`` is its count less its first
use. A new entry that needs room is judged against the victims that room would take: it is
admitted only if its ``(reuse + EPS) x worth`` is above theirs (their mean per byte; ``EPS`` is 0,
so a tie, as between keys never used again, keeps the victims). A key never used lately (a scan,
a one-off document, a large image whose next use comes too late) does not displace keys that were
used again; among keys used again, reuse is weighed by what a hit saves per byte.

**The filter is on only where it pays** (one filter per cost class, its ``Ledger`` in
``ledgers``: ``featcache.eviction.ledger``). Both of its ways of being wrong are counted, in
seconds of vision time, in its ledger, halved with the counts:
- on: a key it turned away, asked for again while a ghost remembers it (keys only, at most
  ``capacity_bytes`` of them), is a hit it lost (``debit``); a hit on a key it spared (a victim
  it did not evict) is a hit it saved (``credit``);
- off (the class's entries all admitted: the GreedyDual order alone): a hit on an entry it would
  have turned away is a hit it would have lost (``debit``); a victim of such an entry asked for
  again while a second ghost remembers it is a hit it would have saved (``credit``). While off,
  only a sample of the misses is judged (a key hash's low 3 bits 0), each of their ledger
  entries counting 8 times.
A victim's hit counts for the bytes at stake, the entry's (its worth per byte x the smaller of its
bytes and the entry's; several victims, their share): sparing a 40.9 MB image for a 13.6 MB one
kept 27 MB that would have held other hits. Each filter starts off and turns on while
``credit > ON_MARGIN x debit`` (1.5), deciding first after ``MIN_EVENTS`` ledger entries and one
budget of bytes come in since the first eviction (before that the ghosts do not reach as far back
as they will, and hits saved show sooner than hits lost). So where new entries are soon used
again (chat turns, retries) the books are the GreedyDual order alone; where a class's are not
(scans, long-tail catalogs, large images used once per reuse distance) its filter keeps what was
used. (2026-12-03, bench/eviction.py's adversaries: with whole victims' costs as credit and the
filter on at ``credit > debit``, the LRU stack model of deep reuse, lru-stack-deep, lost 11.1% to
LRU at 1 GiB: ledgers near a tie flipped the filter on where it did not pay; the stake alone left
-3.2%, with the margin +4.0%, the development traces' gains kept within a few points.)
docs/design.md, "Eviction", says why this design and what else was tried.

Invariants (the ``Books`` contract, as ``featcache.eviction.lru.LruBooks``):
- ``used_bytes`` is the sum of the sizes of the keys held and never exceeds ``capacity_bytes``;
- a key with a positive pin count (lent to an in-flight user) is never chosen as a victim;
- ``evict_for`` removes its victims only when it returns them (else nothing is removed: a refusal
  only counts the use and the ledger's entries);
- ``L`` never decreases; a key's ``H`` is ``L`` at its last add or touch plus ``sqrt(worth)``.

Costs: O(1) per ``touch``, ``add``, ``remove``, ``pin``; an eviction O(cost classes + victims),
skipping the pinned keys at the head of a queue (few: leases are held for one request). Aging is
O(1): the sketch is halved in C (``bytes.translate``), a held key's count when it is next read.
The sketch is rebuilt (empty) when the entries held outgrow it, doubling.
"""

from __future__ import annotations

import math
import zlib
from collections import OrderedDict

from .costclasses import CLASS_STEPS, NO_WORTH, Item, class_of, lowest, plan, plan_many
from .ledger import SAMPLE_WEIGHT, SAMPLED, SPARED, WOULD_REJECT, Ghost, Ledger
from .sketch import MAX_COUNT, FrequencySketch

EPS = 0.0  # added to reuse in the duel (0: between keys never used again, the victim stays)
SAMPLE = 10  # counts are halved every SAMPLE x (entries the sketch is sized for) uses (Caffeine's)

# What a byte saves when a key's cost is unknown and no key with a known cost was added yet (the
# value books' default: InternVL2-2B, 24.6 ms for 13.6 MB).
DEFAULT_S_PER_BYTE = 24.6e-3 / (3328 * 2048 * 2)


class AdmissionBooks:
    """GreedyDual by cost class behind a TinyLFU admission filter that is on while it pays; the calls of
    ``LruBooks`` (``evict_for`` weighs the incoming entry's ``cost_s``)."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self.inflation = 0.0  # L: the H of the last victim
        self.sketch = FrequencySketch()
        self.ledgers: dict[int, Ledger] = {}  # cost class -> its filter's ledger
        self.agings = 0  # how many times every count was halved
        self._uses = 0  # since the last aging
        self._period = SAMPLE * self.sketch.entries  # uses between agings
        self._turnover = -1  # bytes come in or turned away since the first eviction (-1: none)
        self._items: dict[bytes, Item] = {}
        self._classes: dict[int, OrderedDict[bytes, Item]] = {}  # cost class -> LRU queue
        self._queues: list[OrderedDict[bytes, Item]] = []  # the same queues, in a list
        self._pins: dict[bytes, int] = {}  # key -> holders (while positive)
        self._pinned_bytes = 0  # of the keys held that are pinned
        self._rejected = Ghost(capacity_bytes)  # keys the filters turned away
        self._displaced = Ghost(capacity_bytes)  # victims of entries they would have turned away
        self._known_worth = 0.0
        self._known = 0
        # the miss evict_for counted, for the add that follows: (key, hash, count, would reject,
        # (nbytes, cost_s, worth, cost class) where it weighed the entry, else None)
        self._counted: tuple[bytes, int, int, bool,
                             tuple[int, float | None, float, int] | None] | None = None

    # -- what the tiers call ------------------------------------------------------------------
    def __contains__(self, key: bytes) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    def touch(self, key: bytes) -> None:
        item = self._items[key]
        if item.epoch != self.agings:
            item.count >>= self.agings - item.epoch
            item.epoch = self.agings
        if item.count < MAX_COUNT:
            item.count += 1
        uses = self._uses + 1
        self._uses = uses
        if uses >= self._period:
            self._age()
        item.priority = self.inflation + item.gain
        item.queue.move_to_end(key)
        if item.mark:
            self._ledger_hit(item)

    def add(self, key: bytes, nbytes: int, cost_s: float | None = None) -> None:
        """Hold ``key`` (``nbytes``; ``cost_s``: what a hit saves, None: unknown). Its use is
        counted, unless ``evict_for(..., replacing=key)`` counted it just before."""
        if key in self._items:
            self.remove(key)
        if self.used_bytes + nbytes > self.capacity_bytes:
            raise AssertionError("add() without room: call evict_for() first")
        counted, self._counted = self._counted, None
        judged = None
        if counted is not None and counted[0] == key:
            _, h, count, would_reject, judged = counted
        else:
            h, count = self._use(key)
            would_reject = False
        if judged is not None and judged[0] == nbytes and judged[1] == cost_s:
            worth, cls = judged[2], judged[3]  # as evict_for found them
            if cost_s is not None and cost_s >= 0:
                self._known_worth += worth
                self._known += 1
        else:
            if cost_s is not None and cost_s >= 0:
                worth = cost_s / (nbytes or 1)
                self._known_worth += worth
                self._known += 1
            else:
                worth = self._mean_worth()
            cls = class_of(worth)
        queue = self._classes.get(cls)
        if queue is None:
            queue = self._classes[cls] = OrderedDict()
            self._queues.append(queue)
        gain = math.sqrt(worth)
        item = Item(nbytes, worth, gain, self.inflation + gain, h, count, self.agings, queue)
        if would_reject:
            item.mark = WOULD_REJECT
            item.ledger = self._ledger(cls)
        self._items[key] = item
        queue[key] = item
        self.used_bytes += nbytes
        if key in self._pins:
            self._pinned_bytes += nbytes
        if len(self._items) > self.sketch.entries:
            self._grow_sketch()

    def remove(self, key: bytes) -> int | None:
        """Forget ``key`` (a discard, not an eviction: ``L`` stays, no ghost, no count kept)."""
        item = self._items.pop(key, None)
        if item is None:
            return None
        del item.queue[key]
        self.used_bytes -= item.nbytes
        if key in self._pins:
            self._pinned_bytes -= item.nbytes
        return item.nbytes

    def evict_for(self, nbytes: int, replacing: bytes | None = None,
                  cost_s: float | None = None) -> list[bytes] | None:
        """Evict the lowest-``H`` unpinned keys that make room for ``nbytes`` and return them;
        None, with nothing removed, if no choice of unpinned keys makes room, or if the entry
        (``replacing``, not held, costing ``cost_s``: None, unknown) is not admitted.
        ``replacing``: the key about to be added, counted as free if held and never a victim; a
        miss of a key not held is counted here, once with the ``add`` that follows."""
        self._counted = None
        items = self._items
        capacity = self.capacity_bytes
        if replacing is None or replacing in items or nbytes > capacity:
            return self._evict_plain(nbytes, replacing)
        # a miss (``_use``, inlined: it is the hot one): count the use, then the ghosts
        h = zlib.crc32(replacing)  # FrequencySketch.hash_of
        count = self.sketch.increment(h)  # (inlined it measured no faster)
        self._uses += 1
        if self._uses >= self._period:
            self._age()
        if replacing in self._rejected.remembered or replacing in self._displaced.remembered:
            self._returned(replacing)
        free = capacity - self.used_bytes
        if free >= nbytes:
            self._counted = (replacing, h, count, False, None)
            return []
        if free + self.used_bytes - self._pinned_bytes < nbytes:
            self._counted = (replacing, h, count, False, None)
            return None
        if self._turnover < capacity:
            self._turnover += nbytes
        worth = cost_s / (nbytes or 1) if cost_s is not None and cost_s >= 0 else self._mean_worth()
        cls = math.floor(math.log2(worth) * CLASS_STEPS) if worth > 0 else NO_WORTH  # class_of
        ledger = self.ledgers.get(cls)
        if ledger is None:
            ledger = self.ledgers[cls] = Ledger()
        judged = (nbytes, cost_s, worth, cls)  # for the add that follows
        # the victim: the lowest of the queues' heads (``replacing`` is in none)
        key, item = lowest(self._queues, self._pins, None)
        if item.nbytes < nbytes - free:
            return self._evict_many(nbytes, free, replacing, h, count, worth, ledger, judged)
        would_reject = False
        if ledger.filtering or not h & SAMPLED:  # judged: all while filtering, else a sample
            # the duel: (reuse + EPS) x worth, per byte, against the victim's (a tie keeps it)
            uses = item.count >> (self.agings - item.epoch)
            if (((count - 1 if count > 1 else 0) + EPS) * worth * item.nbytes
                    <= ((uses - 1 if uses > 1 else 0) + EPS) * item.worth * item.nbytes):
                if ledger.filtering:
                    item.mark = SPARED
                    item.ledger = ledger
                    item.stake = nbytes if nbytes < item.nbytes else item.nbytes
                    self._rejected.add(replacing, nbytes, worth * nbytes, ledger)
                    self._counted = (replacing, h, count, False, None)
                    return None
                would_reject = True  # off: the sample's ledger entries count for the rest
                stake = nbytes if nbytes < item.nbytes else item.nbytes
                self._displaced.add(key, item.nbytes, SAMPLE_WEIGHT * item.worth * stake, ledger)
        self._counted = (replacing, h, count, would_reject, judged)
        # _evict, inlined
        if item.priority > self.inflation:
            self.inflation = item.priority
        del items[key]
        del item.queue[key]
        self.used_bytes -= item.nbytes  # (a victim is never pinned)
        uses = item.count >> (self.agings - item.epoch)
        if uses > 1:
            self.sketch.record(item.hash, uses)  # its popularity outlives it
        return [key]

    def _evict_many(self, nbytes: int, free: int, replacing: bytes, h: int, count: int,
                    worth: float, ledger: Ledger,
                    judged: tuple[int, float | None, float, int]) -> list[bytes] | None:
        """``evict_for``'s miss path where more than one victim is needed."""
        victims = plan_many(self._queues, self._pins, nbytes - free, replacing)
        would_reject = False
        if ledger.filtering or not h & SAMPLED:
            agings = self.agings
            theirs = 0.0
            total = 0
            for _, v in victims:
                uses = v.count >> (agings - v.epoch)
                theirs += ((uses - 1 if uses > 1 else 0) + EPS) * v.worth * v.nbytes
                total += v.nbytes
            if ((count - 1 if count > 1 else 0) + EPS) * worth * total <= theirs:
                if ledger.filtering:
                    share = nbytes / total if nbytes < total else 1.0
                    for _, v in victims:
                        v.mark = SPARED
                        v.ledger = ledger
                        v.stake = v.nbytes * share
                    self._rejected.add(replacing, nbytes, worth * nbytes, ledger)
                    self._counted = (replacing, h, count, False, None)
                    return None
                would_reject = True
                share = nbytes / total if nbytes < total else 1.0
                for k, v in victims:
                    self._displaced.add(k, v.nbytes, SAMPLE_WEIGHT * v.worth * v.nbytes * share,
                                        ledger)
        self._counted = (replacing, h, count, would_reject, judged)
        for k, v in victims:
            self._evict(k, v)
        return [k for k, _ in victims]

    def _evict_plain(self, nbytes: int, replacing: bytes | None) -> list[bytes] | None:
        """``evict_for`` without an entry to judge (``replacing`` held, or none)."""
        if nbytes > self.capacity_bytes:
            return None
        free = self.capacity_bytes - self.used_bytes
        held = self._items.get(replacing) if replacing is not None else None
        if held is not None:
            free += held.nbytes
        if free >= nbytes:
            return []
        evictable = self.used_bytes - self._pinned_bytes
        if held is not None and replacing not in self._pins:
            evictable -= held.nbytes
        if free + evictable < nbytes:
            return None
        victims = plan(self._queues, self._pins, nbytes - free, replacing)
        for key, item in victims:
            self._evict(key, item)
        return [key for key, _ in victims]

    def evict_one(self) -> bytes | None:
        """Remove the lowest-``H`` unpinned key and return it (``L`` rises to its ``H``); None if
        every key is pinned (or none is held)."""
        if self.used_bytes - self._pinned_bytes <= 0:
            return None
        key, item = lowest(self._queues, self._pins, None)
        self._evict(key, item)
        return key

    def pin(self, key: bytes) -> None:
        count = self._pins.get(key, 0)
        self._pins[key] = count + 1
        if not count:
            item = self._items.get(key)
            if item is not None:
                self._pinned_bytes += item.nbytes

    def unpin(self, key: bytes) -> None:
        count = self._pins.get(key, 0) - 1
        if count < 0:
            raise AssertionError(f"unpin without pin for {key.hex()}")
        if count:
            self._pins[key] = count
            return
        del self._pins[key]
        item = self._items.get(key)
        if item is not None:
            self._pinned_bytes -= item.nbytes

    def pinned(self, key: bytes) -> bool:
        return key in self._pins

    # -- for tests and reports ---------------------------------------------------------------
    def ledger_for(self, nbytes: int, cost_s: float | None) -> Ledger:
        """The ledger (and filter) of the cost class of an entry of ``nbytes`` costing
        ``cost_s`` (None: unknown)."""
        return self._ledger(class_of(self._worth(nbytes, cost_s)))

    def priority(self, key: bytes) -> float | None:
        """``key``'s ``H`` now, or None if it is not held."""
        item = self._items.get(key)
        return None if item is None else item.priority

    def uses(self, key: bytes) -> int:
        """``key``'s uses lately, as counted (its own count if held, else the sketch's)."""
        item = self._items.get(key)
        if item is None:
            return self.sketch.estimate(FrequencySketch.hash_of(key))
        return item.count >> (self.agings - item.epoch)

    # -- inside --------------------------------------------------------------------------------
    def _worth(self, nbytes: int, cost_s: float | None) -> float:
        if cost_s is not None and cost_s >= 0:
            return cost_s / (nbytes or 1)
        return self._mean_worth()

    def _mean_worth(self) -> float:
        return self._known_worth / self._known if self._known else DEFAULT_S_PER_BYTE

    def _use(self, key: bytes) -> tuple[int, int]:
        """A miss of ``key`` (``evict_for``'s, inlined there): count its use (its hash and count
        after it); a ghost remembering it is a ledger entry."""
        h = zlib.crc32(key)  # FrequencySketch.hash_of
        count = self.sketch.increment(h)
        self._uses += 1
        if self._uses >= self._period:
            self._age()
        if self._rejected.nbytes or self._displaced.nbytes:
            self._returned(key)
        return h, count

    def _returned(self, key: bytes) -> None:
        """A miss of ``key``: a ghost remembering it is a ledger entry."""
        lost = self._rejected.take(key)
        if lost is not None:  # turned away, back: a hit lost
            lost[2].debit += lost[1]
            self._decide(lost[2])
            return
        saved = self._displaced.take(key)
        if saved is not None:  # displaced by one it would have turned away, back
            saved[2].credit += saved[1]
            self._decide(saved[2])

    def _evict(self, key: bytes, item: Item) -> None:
        if item.priority > self.inflation:
            self.inflation = item.priority
        del self._items[key]
        del item.queue[key]
        self.used_bytes -= item.nbytes  # (a victim is never pinned)
        count = item.count >> (self.agings - item.epoch)
        if count > 1:
            self.sketch.record(item.hash, count)  # its popularity outlives it

    def _ledger_hit(self, item: Item) -> None:
        """A hit on a marked key: a hit its filter saved (spared) or would have lost."""
        ledger = item.ledger
        assert ledger is not None
        if item.mark == SPARED:
            ledger.credit += item.worth * item.stake
        else:  # a sampled entry it would have turned away
            ledger.debit += SAMPLE_WEIGHT * item.worth * item.nbytes
        item.mark = 0
        item.ledger = None
        self._decide(ledger)

    def _ledger(self, cls: int) -> Ledger:
        ledger = self.ledgers.get(cls)
        if ledger is None:
            ledger = self.ledgers[cls] = Ledger()
        return ledger

    def _decide(self, ledger: Ledger) -> None:
        ledger.decide(self._turnover >= self.capacity_bytes)

    def _age(self) -> None:
        """Halve every count (the held keys' when next read) and the ledger."""
        self.sketch.halve()
        self.agings += 1
        self._uses //= 2
        for ledger in self.ledgers.values():
            ledger.credit /= 2
            ledger.debit /= 2

    def _grow_sketch(self) -> None:
        self.sketch.resize(2 * self.sketch.entries)
        self._period = SAMPLE * self.sketch.entries
