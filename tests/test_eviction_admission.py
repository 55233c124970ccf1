"""The admission books (``eviction="admit"``, featcache/eviction/admission.py; issue 44) on hand-made cases:
the order (GreedyDual-Size by cost class), the admission duel (reuse x worth, ties keep the
victim), the per-class filter and its ledger (on only while it pays), aging, the sketch, leases,
and the books' invariants under random calls. The tiers with these books:
tests/test_eviction_admission_tiers.py. The shared contract of every policy: tests/test_eviction.py.
"""

from __future__ import annotations

import random
import zlib

import pytest

from featcache.config import EVICTIONS
from featcache.eviction import POLICIES, WEIGHS_COST, admission, books_for
from featcache.eviction.admission import AdmissionBooks, FrequencySketch
from featcache.eviction.ledger import MIN_EVENTS, ON_MARGIN, SAMPLED


def k(i: int) -> bytes:
    return b"key-%d" % i


def keys_where(sampled: bool, n: int, prefix: bytes = b"s") -> list[bytes]:
    """``n`` keys whose hash falls in (or out of) the sample judged while a filter is off."""
    found = []
    i = 0
    while len(found) < n:
        key = prefix + b"-%d" % i
        if (zlib.crc32(key) & SAMPLED == 0) == sampled:
            found.append(key)
        i += 1
    return found


def filtering(books: AdmissionBooks, on: bool = True, nbytes: int = 10, cost_s: float = 1.0) -> None:
    """Set the filter of the cost class of (``nbytes``, ``cost_s``) entries."""
    books.ledger_for(nbytes, cost_s).filtering = on


def test_the_policy_is_registered_weighs_costs_and_is_named_in_the_config():
    assert "admit" in EVICTIONS and POLICIES["admit"] is AdmissionBooks and WEIGHS_COST["admit"]
    assert isinstance(books_for("admit", 100), AdmissionBooks)


# -- the order: GDS by cost class ------------------------------------------------------------------
def test_equal_costs_per_byte_evict_least_recently_used_first():
    books = AdmissionBooks(30)
    for i in range(3):
        books.add(k(i), 10, 1.0)
    books.touch(k(0))
    assert [books.evict_one() for _ in range(3)] == [k(1), k(2), k(0)]


def test_what_saves_least_per_byte_goes_first_and_inflation_ages_the_rest():
    books = AdmissionBooks(40)
    books.add(k(0), 10, 8.0)  # 0.8 s per byte: H = sqrt(0.8) = 0.89
    books.add(k(1), 10, 1.0)  # 0.1: H = 0.32
    books.add(k(2), 10, 2.0)  # 0.2: H = 0.45
    assert books.priority(k(0)) == pytest.approx(0.8 ** 0.5)
    assert books.evict_one() == k(1)
    assert books.inflation == pytest.approx(0.1 ** 0.5)
    assert books.evict_one() == k(2)  # L = 0.45 now
    books.add(k(3), 10, 1.0)  # H = 0.45 + 0.32 = 0.76 < k(0)'s 0.89, though newer
    assert books.evict_one() == k(3)
    books.add(k(4), 10, 1.0)  # H = 0.76 + 0.32 = 1.08: k(0), never used again, has aged out
    assert books.evict_one() == k(0)


def test_evictions_follow_the_lowest_priority_against_a_brute_force_reference():
    """Random adds, touches and leases, the filters kept off, two cost classes of exact worths:
    every eviction takes the unpinned keys of lowest H until the entry fits, as a brute force over
    the books' own H says (ties within a class: the least recently used; between classes,
    either)."""
    rng = random.Random(44)
    books = AdmissionBooks(200)
    books._decide = lambda ledger: None  # type: ignore[method-assign]  # the filters stay off
    last: dict[bytes, int] = {}  # key -> when it was last added or touched
    sizes: dict[bytes, int] = {}
    pinned: set[bytes] = set()
    evictions = 0
    for clock in range(4000):
        key = k(rng.randrange(60))
        if key in books:
            if rng.random() < 0.5:
                books.touch(key)
                last[key] = clock
            continue
        nbytes = rng.choice((10, 20))
        cost = nbytes * rng.choice((0.1, 0.8))
        ranked = sorted((q for q in sizes if q not in pinned),
                        key=lambda q: (books.priority(q), last[q]))
        expected, free = [], 200 - books.used_bytes
        for q in ranked:
            if free >= nbytes:
                break
            expected.append(q)
            free += sizes[q]
        before = {q: books.priority(q) for q in sizes}
        victims = books.evict_for(nbytes, replacing=key, cost_s=cost)
        if free < nbytes:
            assert victims is None  # only leased keys left to take
            continue
        assert victims is not None and not set(victims) & pinned and key not in victims
        room = 200 - books.used_bytes
        assert room >= nbytes
        if victims:
            kept = [before[q] for q in sizes if q not in pinned and q not in victims]
            assert not kept or max(before[v] for v in victims) <= min(kept)  # the lowest H
            assert room - sizes[victims[-1]] < nbytes  # and no more than needed
            assert max(before[v] for v in victims) == max(before[q] for q in expected)
        else:
            assert not expected
        evictions += len(victims)
        for v in victims:
            del sizes[v]
        books.add(key, nbytes, cost)
        sizes[key] = nbytes
        last[key] = clock
        if rng.random() < 0.05 and key not in pinned:
            books.pin(key)
            pinned.add(key)
        elif pinned and rng.random() < 0.2:
            books.unpin(pinned.pop())
        assert books.used_bytes == sum(sizes.values()) <= 200
    assert evictions > 1000


def test_a_victim_has_the_lowest_priority_of_the_unpinned_keys():
    rng = random.Random(7)
    books = AdmissionBooks(100)
    for i in range(10):
        books.add(k(i), 10, rng.choice((1.0, 8.0)))
    for _ in range(30):
        books.touch(k(rng.randrange(10)))
    books.pin(k(3))
    before = {k(i): books.priority(k(i)) for i in range(10)}
    victim = books.evict_one()
    assert victim != k(3) and before[victim] == min(h for q, h in before.items() if q != k(3))


# -- the duel -------------------------------------------------------------------------------------
def test_while_filtering_a_key_never_used_before_does_not_displace_one_used_again():
    books = AdmissionBooks(20)
    books.add(k(0), 10, 1.0)
    books.add(k(1), 10, 1.0)
    books.touch(k(0))
    books.touch(k(1))  # both used again: reuse 1
    filtering(books)
    new = k(9)
    assert books.evict_for(10, replacing=new, cost_s=1.0) is None  # reuse 0 against 1: refused
    assert k(0) in books and k(1) in books and new not in books and books.used_bytes == 20
    assert books.uses(new) == 1  # the refused miss was counted


def test_a_key_used_again_is_admitted_against_a_victim_that_was_not():
    books = AdmissionBooks(20)
    books.add(k(0), 10, 1.0)
    books.add(k(1), 10, 1.0)
    books.touch(k(1))  # k(0) never used again: the victim (lowest H), reuse 0
    filtering(books)
    new = k(9)
    assert books.evict_for(10, replacing=new, cost_s=1.0) is None  # 0 against 0: a tie keeps it
    assert books.evict_for(10, replacing=new, cost_s=1.0) == [k(0)]  # its second miss: reuse 1
    books.add(new, 10, 1.0)
    assert books.uses(new) == 2 and k(1) in books


def test_the_duel_weighs_reuse_by_what_a_hit_saves_per_byte():
    """Reuse 1 of a key saving 8x per byte beats reuse 3 of a cheap one; reuse 1 of a cheap one
    does not beat reuse 1 of a costly one (each class's filter on)."""
    books = AdmissionBooks(20)
    books.add(k(0), 10, 1.0)  # cheap
    for _ in range(3):
        books.touch(k(0))  # reuse 3
    books.add(k(1), 10, 8.0)
    books.touch(k(1))  # costly, reuse 1
    filtering(books, cost_s=1.0)
    filtering(books, cost_s=8.0)
    costly, cheap = k(8), k(9)
    books.sketch.increment(FrequencySketch.hash_of(costly))  # seen once before: reuse 1 now
    assert books.evict_for(10, replacing=costly, cost_s=8.0) == [k(0)]  # 1 x 0.8 > 3 x 0.1
    books.add(costly, 10, 8.0)
    books.sketch.increment(FrequencySketch.hash_of(cheap))
    assert books.evict_for(10, replacing=cheap, cost_s=1.0) is None  # 1 x 0.1 < 1 x 0.8
    assert k(1) in books and costly in books and cheap not in books


def test_with_the_filter_off_every_entry_is_admitted_as_by_gds():
    books = AdmissionBooks(20)
    books.add(k(0), 10, 1.0)
    books.add(k(1), 10, 1.0)
    books.touch(k(0))
    books.touch(k(1))
    assert not books.ledger_for(10, 1.0).filtering  # off at the start
    assert books.evict_for(10, replacing=k(9), cost_s=1.0) == [k(0)]


# -- the ledger: the filter is on only while it pays ------------------------------------------------
def test_a_filter_that_turns_away_keys_that_come_back_turns_itself_off():
    books = AdmissionBooks(40)
    for i in range(40):
        books.add(k(i), 1, 1.0)
        books.touch(k(i))  # all used again: a new key loses every duel
    ledger = books.ledger_for(1, 1.0)
    ledger.filtering = True
    books._turnover = books.capacity_bytes  # one budget come in (the ledger may decide)
    turned = [b"new-%d" % i for i in range(MIN_EVENTS + 4)]
    for key in turned:
        assert books.evict_for(1, replacing=key, cost_s=1.0) is None
    assert all(q in books for q in (k(i) for i in range(40)))
    for key in turned:  # each comes back: a hit it lost
        if books.evict_for(1, replacing=key, cost_s=1.0) is not None:
            books.add(key, 1, 1.0)
    assert ledger.debit > ledger.credit and not ledger.filtering


def test_a_filter_off_turns_on_when_what_it_would_have_turned_away_displaced_keys_used_again():
    books = AdmissionBooks(10)
    olds = keys_where(False, 10, b"old")
    for key in olds:
        books.add(key, 1, 1.0)
        books.touch(key)
    ledger = books.ledger_for(1, 1.0)
    assert not ledger.filtering
    books._turnover = books.capacity_bytes
    rounds = 0
    for new in keys_where(True, 4 * MIN_EVENTS, b"new"):  # judged even while off
        rounds += 1
        victims = books.evict_for(1, replacing=new, cost_s=1.0)
        assert victims  # admitted (off), though it would have been turned away
        books.add(new, 1, 1.0)
        back = victims[0]  # the displaced key comes back: a hit the filter would have saved
        if books.evict_for(1, replacing=back, cost_s=1.0) is not None:  # (None once it is on)
            books.add(back, 1, 1.0)
        if ledger.filtering:
            break
    assert ledger.filtering and ledger.credit > ledger.debit and rounds < 2 * MIN_EVENTS


def test_hits_on_keys_the_filter_spared_are_its_credit():
    books = AdmissionBooks(2)
    books.add(k(0), 1, 1.0)
    books.add(k(1), 1, 1.0)
    books.touch(k(0))
    books.touch(k(1))
    ledger = books.ledger_for(1, 1.0)
    ledger.filtering = True
    assert books.evict_for(1, replacing=k(9), cost_s=1.0) is None  # spares the victim, k(0)
    books.touch(k(0))
    assert ledger.credit == pytest.approx(1.0) and ledger.debit == 0
    books.touch(k(0))  # counted once
    assert ledger.credit == pytest.approx(1.0)


def test_a_hit_on_a_spared_victim_larger_than_the_entry_counts_for_the_entrys_bytes_only():
    """Turning away a 1-byte entry kept a 4-byte victim: its hit saved the victim's cost, but 3
    of its bytes would have held other entries; the ledger counts its worth x 1 byte (issue 44:
    unscaled, hits on large spared victims kept the filter on where it lost, lru-stack-deep)."""
    books = AdmissionBooks(4)
    books.add(k(0), 4, 8.0)  # 2 s per byte
    books.touch(k(0))
    ledger = books.ledger_for(1, 1.0)  # the entry's class: 1 s per byte
    ledger.filtering = True
    assert books.evict_for(1, replacing=k(9), cost_s=1.0) is None  # k(0) spared
    books.touch(k(0))
    assert ledger.credit == pytest.approx(2.0)  # 2 s per byte x 1 byte, not 8 s


def test_the_filter_turns_on_only_when_its_credit_clearly_beats_its_debit():
    books = AdmissionBooks(1000)
    books._turnover = books.capacity_bytes
    ledger = books.ledger_for(1, 1.0)
    ledger.events = MIN_EVENTS
    ledger.debit = 10.0
    ledger.credit = 10.0 * ON_MARGIN - 0.5  # above the debit, not by the margin
    books._decide(ledger)
    assert ON_MARGIN > 1 and not ledger.filtering
    ledger.credit = 10.0 * ON_MARGIN + 0.5
    books._decide(ledger)
    assert ledger.filtering
    ledger.credit = 10.0 * ON_MARGIN - 0.5  # and off again below the margin
    books._decide(ledger)
    assert not ledger.filtering


def test_filters_are_per_cost_class():
    books = AdmissionBooks(100)
    books.ledger_for(10, 8.0).filtering = True
    assert not books.ledger_for(10, 1.0).filtering
    assert books.ledger_for(10, 8.0) is books.ledger_for(20, 16.0)  # the same worth, one class
    assert books.ledger_for(10, 8.0) is not books.ledger_for(10, 1.0)


def test_no_decision_before_one_budget_came_in():
    books = AdmissionBooks(1000)
    ledger = books.ledger_for(1, 1.0)
    ledger.credit = 5.0
    for _ in range(MIN_EVENTS + 1):
        books._decide(ledger)
    assert not ledger.filtering  # the ghosts do not reach back yet
    books._turnover = books.capacity_bytes
    books._decide(ledger)
    assert ledger.filtering


# -- counting and aging ------------------------------------------------------------------------------
def test_the_sketch_counts_caps_at_15_and_halves():
    sketch = FrequencySketch()
    h = FrequencySketch.hash_of(b"a")
    assert sketch.estimate(h) == 0
    for i in range(1, 21):
        assert sketch.increment(h) == min(i, admission.MAX_COUNT)
    sketch.halve()
    assert sketch.estimate(h) == 7
    sketch.record(h, 12)
    assert sketch.estimate(h) == 12
    other = FrequencySketch.hash_of(b"b")
    assert sketch.estimate(other) <= 1  # distinct keys rarely share all four counters


def test_sketch_estimates_never_undercount():
    sketch = FrequencySketch(1024)
    rng = random.Random(3)
    truth: dict[int, int] = {}
    for _ in range(20_000):
        h = FrequencySketch.hash_of(b"%d" % rng.randrange(4000))
        sketch.increment(h)
        truth[h] = truth.get(h, 0) + 1
    assert all(sketch.estimate(h) >= min(c, 15) for h, c in truth.items())
    exact = sum(sketch.estimate(h) == min(c, 15) for h, c in truth.items())
    assert exact / len(truth) > 0.8


def test_counts_of_keys_held_age_with_the_sketch():
    books = AdmissionBooks(100)
    books.add(k(0), 10, 1.0)
    for _ in range(8):
        books.touch(k(0))
    assert books.uses(k(0)) == 9
    books.add(k(1), 10, 1.0)
    agings = books.agings
    while books.agings == agings:  # SAMPLE x entries uses later, every count is halved
        books.touch(k(1))
    assert books.uses(k(0)) == 4
    books.touch(k(0))
    assert books.uses(k(0)) == 5


def test_the_duel_weighs_a_held_keys_uses_as_aged():
    """A victim used 9 times, three agings ago (9 >> 3: 1 use now), loses the duel to a new key
    seen twice lately, while filtering. (Planted: the duel reading the count without its
    aging; ``uses()`` ages it on its own, so the test above passed.)"""
    books = AdmissionBooks(20)
    books.add(k(0), 10, 1.0)
    for _ in range(8):
        books.touch(k(0))
    books.add(k(1), 10, 1.0)
    start = books.agings
    while books.agings < start + 3:
        books.touch(k(1))  # k(0): the least recently used, the victim
    assert books.uses(k(0)) == 1
    filtering(books)
    new = k(9)
    for _ in range(2):
        books.sketch.increment(FrequencySketch.hash_of(new))  # seen twice: reuse 2 at its miss
    assert books.evict_for(10, replacing=new, cost_s=1.0) == [k(0)]


def test_an_evicted_keys_count_outlives_it():
    books = AdmissionBooks(20)
    books.add(k(0), 10, 1.0)
    for _ in range(5):
        books.touch(k(0))
    books.add(k(1), 10, 1.0)
    books.touch(k(1))
    assert books.evict_for(20, replacing=None) is not None  # both go
    assert books.uses(k(0)) == 6  # remembered by the sketch
    books.add(k(2), 10, 1.0)
    books.add(k(3), 10, 1.0)
    books.touch(k(2))
    books.touch(k(3))  # reuse 1 each
    filtering(books)
    assert books.evict_for(10, replacing=k(0), cost_s=1.0) == [k(2)]  # its history: reuse 6


def test_a_miss_counted_by_evict_for_is_not_counted_again_by_add():
    books = AdmissionBooks(100)
    assert books.evict_for(10, replacing=k(0), cost_s=1.0) == []
    books.add(k(0), 10, 1.0)
    assert books.uses(k(0)) == 1
    books.add(k(1), 10, 1.0)  # no evict_for before it: counted here
    assert books.uses(k(1)) == 1


# -- leases and invariants ------------------------------------------------------------------------------
def test_leased_keys_are_never_victims_whatever_their_priority_or_the_duel():
    books = AdmissionBooks(30)
    books.add(k(0), 10, 0.1)  # the cheapest: the victim, but leased
    books.pin(k(0))
    books.add(k(1), 10, 5.0)
    books.add(k(2), 10, 9.0)
    assert books.evict_for(10, replacing=k(9), cost_s=9.0) == [k(1)]
    books.add(k(9), 10, 9.0)
    books.pin(k(2))
    books.pin(k(9))
    assert books.evict_one() is None  # every key held is leased
    assert books.evict_for(10, replacing=k(8), cost_s=99.0) is None
    books.unpin(k(0))
    assert books.evict_one() == k(0)
    with pytest.raises(AssertionError):
        books.unpin(k(0))


def test_a_lease_taken_before_the_put_holds_and_counts_its_bytes():
    books = AdmissionBooks(20)
    books.pin(k(0))
    books.add(k(0), 10, 0.0)
    books.add(k(1), 10, 9.0)
    assert books.evict_for(20, replacing=None) is None  # 10 evictable bytes only
    assert books.evict_for(10, replacing=None) == [k(1)]
    books.unpin(k(0))
    assert books.evict_for(20, replacing=None) == [k(0)]


def test_replacing_a_held_key_counts_its_bytes_free_and_judges_nothing():
    books = AdmissionBooks(20)
    books.add(k(0), 10, 1.0)
    books.add(k(1), 10, 1.0)
    books.touch(k(1))
    filtering(books)
    assert books.evict_for(20, replacing=k(0), cost_s=1.0) == [k(1)]  # a put over k(0)
    books.add(k(0), 20, 1.0)
    assert books.used_bytes == 20 and len(books) == 1


def test_random_calls_keep_the_invariants():
    rng = random.Random(11)
    books = AdmissionBooks(500)
    pins: dict[bytes, int] = {}
    for _ in range(20_000):
        key = k(rng.randrange(300))
        op = rng.random()
        if op < 0.35 and key in books:
            books.touch(key)
        elif op < 0.75:
            nbytes = rng.choice((1, 5, 40, 120))
            cost = nbytes * rng.choice((0.01, 0.1, 0.37)) if rng.random() > 0.1 else None
            victims = books.evict_for(nbytes, replacing=key, cost_s=cost)
            if victims is not None:
                assert not any(v in pins for v in victims) and key not in victims
                books.add(key, nbytes, cost)
        elif op < 0.85:
            books.pin(key)
            pins[key] = pins.get(key, 0) + 1
        elif op < 0.95 and pins:
            released = rng.choice(list(pins))
            books.unpin(released)
            pins[released] -= 1
            if not pins[released]:
                del pins[released]
        elif key in books and key not in pins:
            assert books.remove(key) is not None
        assert 0 <= books.used_bytes <= books.capacity_bytes
        if rng.random() < 0.01:
            assert books.used_bytes == sum(i.nbytes for i in books._items.values())
            assert books._pinned_bytes == sum(i.nbytes for q, i in books._items.items() if q in pins)
            assert sum(len(q) for q in books._classes.values()) == len(books)
