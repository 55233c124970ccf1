"""Eviction policies of the memory tiers (issue 30 item 1): the books' contract, shared by both
policies (cachetools' way: one set of tests, every policy); the value books' (GDSF) orders on
hand-made cases and against a brute-force reference; leases; the device and host tiers with
``eviction="value"``; the cost's way from ``put`` (and the lmdeploy hook's clock) to the books.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from featcache import FeatureCache
from featcache.entrymeta import cost_of, with_cost
from featcache.eviction import POLICIES, books_for
from featcache.eviction.value import DEFAULT_S_PER_BYTE, ValueBooks
from featcache.lmdeploy.pytorch.visioncost import VisionClock
from featcache.tiers.base import Entry
from featcache.tiers.device import DeviceTier
from featcache.tiers.host import HostTier


def k(i: int) -> bytes:
    return b"key-%d" % i


# -- the contract of every policy's books --------------------------------------------------------
@pytest.fixture(params=sorted(POLICIES))
def policy(request) -> str:
    return request.param


def test_books_account_bytes_and_never_overfill(policy):
    books = books_for(policy, 100)
    for i in range(4):
        assert books.evict_for(30) is not None
        books.add(k(i), 30, 1.0)
        assert books.used_bytes <= 100
    assert books.used_bytes == 90 and len(books) == 3  # one was evicted for the fourth
    with pytest.raises(AssertionError):
        books.add(k(9), 20, 1.0)  # no room: evict_for first
    assert books.remove(k(3)) == 30 and books.used_bytes == 60 and k(3) not in books
    assert books.remove(k(3)) is None


def test_pinned_keys_are_never_victims_and_a_failed_eviction_changes_nothing(policy):
    books = books_for(policy, 100)
    for i in range(3):
        books.add(k(i), 30, 1.0)
    books.pin(k(0))
    books.pin(k(1))
    assert books.evict_for(70) is None  # only k(2)'s 30 bytes + 10 free are evictable
    assert len(books) == 3 and books.used_bytes == 90
    assert books.evict_for(40) == [k(2)]
    books.add(k(3), 40, 1.0)
    books.pin(k(3))
    assert books.evict_one() is None  # every key is pinned
    books.unpin(k(0))
    assert books.evict_for(30) == [k(0)]  # a candidate again once its lease ended
    with pytest.raises(AssertionError):
        books.unpin(k(0))  # unpin without pin


def test_the_key_being_replaced_is_counted_free_and_never_a_victim(policy):
    books = books_for(policy, 100)
    books.add(k(0), 60, 0.001)  # the cheapest and oldest
    books.add(k(1), 40, 1.0)
    assert books.evict_for(100, replacing=k(0)) == [k(1)]
    books.add(k(0), 100, 1.0)
    assert books.used_bytes == 100 and k(0) in books


def test_a_pin_taken_before_the_key_is_added_holds(policy):
    books = books_for(policy, 20)
    books.pin(k(0))  # a lease on a key whose put comes after (DeviceTier.put(pin=True))
    books.add(k(0), 10, 0.0)
    books.add(k(1), 10, 9.0)
    assert books.evict_for(10) == [k(1)]
    books.unpin(k(0))
    books.add(k(2), 10, 9.0)
    assert books.evict_for(10) == [k(0)]


# -- value (GDSF): orders on hand-made cases -----------------------------------------------------
def test_value_with_equal_costs_per_byte_and_no_repeats_is_lru():
    books = ValueBooks(30)
    for i in range(3):
        books.add(k(i), 10, 1.0)
    books.touch(k(0))  # a hit: k(0) now has two uses
    assert [books.evict_one() for _ in range(3)] == [k(1), k(2), k(0)]


def test_value_evicts_what_saves_least_per_byte_first():
    books = ValueBooks(40)
    books.add(k(0), 10, 0.020)  # 2 ms per byte-unit: a 26B 1-tile image, say
    books.add(k(1), 10, 0.002)  # ten times cheaper, same size
    books.add(k(2), 20, 0.020)  # as costly as k(0) but twice the bytes
    assert books.evict_for(10) == [k(1)]
    assert books.evict_one() == k(2)  # 0.001 per byte against k(0)'s 0.002
    assert books.evict_one() == k(0)


def test_value_frequency_keeps_a_used_key_and_inflation_ages_it_out():
    books = ValueBooks(20)
    books.add(k(0), 10, 1.0)  # use 1
    books.add(k(9), 10, 1.0)  # use 2; two keys held: a repeat within 4 uses is correlated
    for _ in range(2):
        for _ in range(4):
            books.touch(k(9))  # a burst of repeats: refreshed, not counted
        books.touch(k(0))  # 6 and then 5 uses after k(0)'s last: each counts
    assert books.priority(k(9)) == pytest.approx(0.1) and books.priority(k(0)) == pytest.approx(0.3)
    books.remove(k(9))
    books.add(k(1), 10, 1.0)  # H = 0.1
    assert books.evict_for(10) == [k(1)]  # the used key stays
    assert books.inflation == pytest.approx(0.1)
    books.add(k(2), 10, 1.0)  # H = L + 0.1 = 0.2
    assert books.evict_for(10) == [k(2)]
    books.add(k(3), 10, 1.0)  # H = 0.2 + 0.1 = 0.3: ties k(0), which is older
    assert books.evict_for(10) == [k(0)]  # aged out: unused while L rose past its credit
    assert books.inflation == pytest.approx(0.3)


def test_value_counts_a_burst_of_repeats_as_one_use_and_refreshes_its_recency():
    """A conversation resends its image every turn: repeats within CORRELATION x (keys held) uses
    of the last are one use (LRU-K's correlated references), so they earn no frequency credit;
    each refreshes the key's H at the current L (recency), as LRU would."""
    books = ValueBooks(30)
    for i in range(3):
        books.add(k(i), 10, 1.0)  # uses 1-3; a repeat within 6 uses of the last is correlated
    for _ in range(5):
        books.touch(k(0))  # uses 4-8: one burst
    assert books.priority(k(0)) == pytest.approx(0.1)  # one use
    assert [books.evict_one() for _ in range(3)] == [k(1), k(2), k(0)]  # k(0) used last


def test_value_counts_an_unknown_cost_as_the_mean_of_the_known_ones():
    books = ValueBooks(100)
    books.add(k(0), 10, None)  # nothing known yet: the default rate
    assert books.priority(k(0)) == pytest.approx(DEFAULT_S_PER_BYTE)
    books.add(k(1), 10, 1.0)
    books.add(k(2), 10, 3.0)
    books.add(k(3), 10, None)
    assert books.priority(k(3)) == pytest.approx(0.2)  # the mean of 0.1 and 0.3 per byte


def test_value_evictions_follow_the_lowest_priority_against_a_brute_force_reference():
    """Random puts, hits, discards and leases: every victim is, at that moment, the unpinned key
    of lowest H (ties: the least recently used), the budget always holds, and the heap of lazy
    records stays bounded (rebuilt at a push past twice the most keys held, plus slack)."""
    rng = random.Random(30)
    books = ValueBooks(2000)
    most = evicted = 0
    last_use: dict[bytes, int] = {}
    pins: dict[bytes, int] = {}
    for step in range(4000):
        key = k(rng.randrange(60))
        roll = rng.random()
        if roll < 0.1 and pins:
            held = rng.choice(sorted(pins))
            books.unpin(held)
            pins[held] -= 1
            if not pins[held]:
                del pins[held]
            if held in books:
                last_use[held] = step
        elif roll < 0.2:
            books.pin(key)
            pins[key] = pins.get(key, 0) + 1
        elif roll < 0.25:
            books.remove(key)
        elif key in books:
            books.touch(key)
            last_use[key] = step
        else:
            nbytes = rng.choice((10, 40, 130, 400))
            candidates = sorted((books.priority(c), last_use[c], c) for c in list(last_use)
                                if c in books and not books.pinned(c))
            victims = books.evict_for(nbytes)
            if victims:
                expected = [c for _, _, c in candidates[:len(victims)]]
                assert victims == expected, f"step {step}"
                evicted += len(victims)
            if victims is not None:
                books.add(key, nbytes, rng.choice((0.002, 0.02, 0.27)))
                last_use[key] = step
        assert books.used_bytes <= books.capacity_bytes
        most = max(most, len(books))
        assert len(books._heap) <= 2 * most + 65
    assert evicted > 500 and pins  # the case was exercised: evictions, with leases held


# -- the tiers with eviction="value" ----------------------------------------------------------------
def test_device_tier_keeps_what_saves_most_and_respects_leases():
    tier = DeviceTier(capacity_bytes=300, eviction="value")

    def put(key: bytes, cost: float, pin: bool = False) -> bool:
        return tier.put(key, Entry(torch.zeros(100, dtype=torch.uint8), meta=with_cost(None, cost)),
                        pin=pin)

    put(k(0), 0.271)  # a 26B image
    put(k(1), 0.002, pin=True)  # a cheap one, leased by a request in flight
    put(k(2), 0.025)
    put(k(3), 0.271)
    assert not tier.contains(k(2)) and tier.contains(k(1))  # the lease beat its low value
    tier.unpin(k(1))
    put(k(4), 0.271)
    assert not tier.contains(k(1))  # cheapest, unpinned now: the victim
    assert {key for key in (k(0), k(3), k(4)) if tier.contains(key)} == {k(0), k(3), k(4)}
    assert tier.stats()["evictions"] == 2 and tier.used_bytes <= tier.capacity_bytes


def test_device_tier_with_lru_ignores_the_cost():
    tier = DeviceTier(capacity_bytes=200, eviction="lru")
    for i, cost in enumerate((0.271, 0.002, 0.271)):
        tier.put(k(i), Entry(torch.zeros(100, dtype=torch.uint8), meta=with_cost(None, cost)))
    assert not tier.contains(k(0)) and tier.contains(k(1))  # the oldest, however costly


def _host_put(tier: HostTier, key: bytes, nbytes: int, cost: float) -> None:
    block = tier.reserve(nbytes)
    assert block is not None
    tier.put(key, Entry(block.tensor[:nbytes], None, block, with_cost(None, cost)))


@pytest.mark.parametrize("eviction, gone", [("value", [k(0), k(2)]), ("lru", [k(1), k(2)])])
def test_host_tier_reserve_evicts_in_its_policys_order(eviction, gone):
    tier = HostTier(capacity_bytes=4096, slab_bytes=4096, pin=False, eviction=eviction)
    for i, cost in enumerate((0.002, 0.271, 0.002, 0.271)):
        _host_put(tier, k(i), 1024, cost)
    hit = tier.get(k(0))  # a hit on the cheap k(0)
    assert hit is not None and hit.block is not None
    tier.release(hit.block)
    _host_put(tier, k(4), 1024, 0.271)
    _host_put(tier, k(5), 1024, 0.271)
    # value: k(0)'s two uses of a cheap image are still worth less than one of a costly one;
    # lru: k(0)'s hit made k(1) and k(2) the oldest
    left = set(tier.keys())
    assert left.isdisjoint(gone) and len(left) == 4, left
    assert tier.stats()["evictions"] == 2


def test_a_tier_replays_a_trace_as_its_books_do():
    """The benchmark replays the books alone (bench/eviction.py); the device tier evicts exactly
    as they do, the costs read from each entry's metadata."""
    rng = random.Random(7)
    tier = DeviceTier(capacity_bytes=5000, eviction="value")
    books = ValueBooks(5000)
    for _ in range(2000):
        i = min(int(rng.paretovariate(0.8)), 200)
        key, nbytes, cost = k(i), 100 * (1 + i % 7), (0.002, 0.02, 0.27)[i % 3]
        if tier.get(key) is not None:
            books.touch(key)
            continue
        assert tier.put(key, Entry(torch.zeros(nbytes, dtype=torch.uint8), meta=with_cost(None, cost)))
        assert books.evict_for(nbytes, replacing=key) is not None
        books.add(key, nbytes, cost)
        assert set(tier.keys()) == {key for key in map(k, range(201)) if key in books}


# -- the cost's way: put(cost_s=) to the metadata, the clock of the model hook --------------------
def test_put_records_the_cost_and_value_eviction_keeps_the_costly_entry(tmp_path):
    with FeatureCache(device="cpu", device_bytes=4 * 4096, host_bytes=0, eviction="value") as cache:
        cache.put(k(0), torch.zeros(1024), cost_s=0.271)  # 4 KiB each
        for i in range(1, 8):
            cache.put(k(i), torch.zeros(1024), cost_s=0.002)
        assert cache.get(k(0)) is not None  # LRU would have evicted it three puts ago
        lease = cache.acquire(k(0))
        assert lease is not None and cost_of(lease.meta) == 0.271
        lease.release()
        assert cache.config.eviction == "value"
    with FeatureCache(device="cpu", device_bytes=4 * 4096, host_bytes=0, eviction="lru") as cache:
        cache.put(k(0), torch.zeros(1024), cost_s=0.271)
        for i in range(1, 8):
            cache.put(k(i), torch.zeros(1024), cost_s=0.002)
        assert cache.get(k(0)) is None


def test_the_cost_travels_with_the_metadata_through_the_disk(tmp_path):
    meta = json.dumps({"fields": {"image_tokens": 256}}).encode()
    with FeatureCache(device="cpu", device_bytes="1MiB", host_bytes="1MiB", disk_path=tmp_path,
                      eviction="value") as cache:
        cache.put(k(0), torch.ones(16), meta, namespace="m", cost_s=0.0246)
        cache.flush()
    with FeatureCache(device="cpu", device_bytes="1MiB", host_bytes="1MiB", disk_path=tmp_path,
                      eviction="value") as cache:
        lease = cache.acquire(k(0))  # from the disk, promoted: the books read the same cost
        assert lease is not None
        assert json.loads(lease.meta) == {"cost_s": 0.0246, "fields": {"image_tokens": 256}, "ns": "m"}
        lease.release()


def test_cost_arguments_are_checked():
    with FeatureCache(device="cpu", device_bytes="1MiB", host_bytes=0) as cache:
        with pytest.raises(ValueError, match="JSON object"):
            cache.put(k(0), torch.ones(4), b"\x00opaque", cost_s=0.1)
        with pytest.raises(ValueError, match="finite"):
            cache.put(k(0), torch.ones(4), cost_s=-1.0)
        with pytest.raises(TypeError, match="number of seconds"):
            cache.put(k(0), torch.ones(4), cost_s=True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="eviction must be one of lru, value"):
        FeatureCache(device="cpu", eviction="lfu")
    assert cost_of(b'{"cost_s": "1"}') is None and cost_of(b"not json") is None
    assert cost_of(b'{"fields": {"cost_s": 1}}') is None  # only the top level's counts


def test_the_vision_clock_splits_a_cpu_call_by_tokens_and_learns_the_rate():
    clock = VisionClock()

    def vision() -> torch.Tensor:
        return torch.ones(64, 8) @ torch.ones(8, 8)

    out, costs = clock.run(vision, [16, 48])
    assert out.shape == (64, 8)
    assert costs[0] is not None and costs[1] is not None and costs[0] > 0
    assert costs[1] == pytest.approx(3 * costs[0])
    assert clock.per_token_s == pytest.approx(sum(costs) / 64)
