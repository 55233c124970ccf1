"""The tiers with ``eviction="admit"`` (featcache/eviction/admission.py; issue 44), tier by tier: the device
tier judges each put (an entry not admitted is not stored there; leases hold), the host tier keeps
the same order and stores everything it is handed, the disk tier keeps its own LRU order (its
books are LMDB's, not these), and FeatureCache puts with costs, through every tier. Plus the
bench's dry run (bench/eviction.py: its CLI and report, not its figures)."""

from __future__ import annotations

import json
import os
import random
import sys

import pytest
import torch

from featcache import FeatureCache
from featcache.config import DEFAULTS, CacheConfig
from featcache.entrymeta import with_cost
from featcache.eviction.admission import AdmissionBooks
from featcache.tiers.base import Entry
from featcache.tiers.device import DeviceTier
from featcache.tiers.host import HostTier

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
import eviction as bench  # noqa: E402


def k(i: int) -> bytes:
    return b"key-%d" % i


def entry(nbytes: int, cost: float | None) -> Entry:
    return Entry(torch.zeros(nbytes, dtype=torch.uint8),
                 meta=with_cost(None, cost) if cost is not None else b"")


def device_books(tier: DeviceTier) -> AdmissionBooks:
    books = tier._books
    assert isinstance(books, AdmissionBooks)
    return books


# -- device ---------------------------------------------------------------------------------------
def test_the_device_tier_orders_by_what_a_hit_saves_and_holds_leases():
    tier = DeviceTier(capacity_bytes=300, eviction="admit")
    assert tier.put(k(0), entry(100, 0.271))  # a 26B image
    assert tier.put(k(1), entry(100, 0.002), pin=True)  # cheap, leased by a request in flight
    assert tier.put(k(2), entry(100, 0.025))
    assert tier.put(k(3), entry(100, 0.271))
    assert not tier.contains(k(2)) and tier.contains(k(1))  # the lease beat its low worth
    tier.unpin(k(1))
    assert tier.put(k(4), entry(100, 0.271))
    assert not tier.contains(k(1))
    assert all(tier.contains(q) for q in (k(0), k(3), k(4)))
    assert tier.stats()["evictions"] == 2 and tier.used_bytes <= tier.capacity_bytes


def test_the_device_tier_does_not_store_an_entry_its_filter_turns_away():
    tier = DeviceTier(capacity_bytes=200, eviction="admit")
    for i in (0, 1):
        assert tier.put(k(i), entry(100, 0.025))
        assert tier.get(k(i)) is not None  # used again: reuse 1
    device_books(tier).ledger_for(100, 0.025).filtering = True
    assert not tier.put(k(9), entry(100, 0.025))  # never used before: not admitted
    assert not tier.contains(k(9)) and tier.contains(k(0)) and tier.contains(k(1))
    assert not tier.put(k(9), entry(100, 0.025))  # its second miss: reuse 1, a tie with k(0)'s
    assert tier.put(k(9), entry(100, 0.025))  # its third: reuse 2 beats 1
    assert tier.contains(k(9)) and not tier.contains(k(0)) and tier.stats()["evictions"] == 1


def test_a_lease_on_an_entry_not_admitted_stays_balanced():
    tier = DeviceTier(capacity_bytes=100, eviction="admit")
    assert tier.put(k(0), entry(100, 0.025))
    tier.get(k(0))
    device_books(tier).ledger_for(100, 0.025).filtering = True
    assert not tier.put(k(1), entry(100, 0.025), pin=True)  # pinned, stored or not
    tier.unpin(k(1))  # balanced: no AssertionError
    assert tier.contains(k(0)) and not device_books(tier).pinned(k(1))


def test_the_device_tier_never_exceeds_its_budget_nor_evicts_a_lease():
    rng = random.Random(5)
    tier = DeviceTier(capacity_bytes=10_000, eviction="admit")
    leased: list[tuple[bytes, bool]] = []  # (key, held when leased)
    for _ in range(5000):
        key = k(min(int(rng.paretovariate(0.7)), 400))
        held = tier.get(key, pin=True) is not None or tier.put(
            key, entry(rng.choice((100, 300, 1000)), rng.choice((0.002, 0.02, 0.27, None))), pin=True)
        leased.append((key, held))
        if len(leased) > 6:
            tier.unpin(leased.pop(0)[0])
        assert all(tier.contains(q) for q, was in leased if was)  # a lease is never evicted
        assert tier.used_bytes <= tier.capacity_bytes
    for q, _ in leased:
        tier.unpin(q)


def test_leased_entries_survive_however_cheap():
    tier = DeviceTier(capacity_bytes=400, eviction="admit")
    for i in range(4):
        assert tier.put(k(i), entry(100, 0.0001), pin=True)
    for i in range(4, 20):
        assert not tier.put(k(i), entry(100, 9.0))  # no room beside the leases
    assert all(tier.contains(k(i)) for i in range(4))
    for i in range(4):
        tier.unpin(k(i))
    assert tier.put(k(20), entry(100, 9.0)) and tier.stats()["evictions"] == 1


# -- host -----------------------------------------------------------------------------------------
def _host_put(tier: HostTier, key: bytes, nbytes: int, cost: float) -> None:
    block = tier.reserve(nbytes)
    assert block is not None
    tier.put(key, Entry(block.tensor[:nbytes], None, block, with_cost(None, cost)))


def test_the_host_tier_evicts_in_the_same_order_and_stores_what_it_is_handed():
    tier = HostTier(capacity_bytes=4096, slab_bytes=4096, pin=False, eviction="admit")
    for i, cost in enumerate((0.002, 0.271, 0.002, 0.271)):
        _host_put(tier, k(i), 1024, cost)
    hit = tier.get(k(0))  # a hit refreshes the cheap k(0)
    assert hit is not None and hit.block is not None
    tier.release(hit.block)
    _host_put(tier, k(4), 1024, 0.002)
    _host_put(tier, k(5), 1024, 0.002)
    # the cheap k(2) goes first, then k(0) (H = L + its small worth, refreshed but still below
    # the costly ones'); the newcomers are stored (a copy is already made: nothing judged)
    left = set(tier.keys())
    assert left == {k(1), k(3), k(4), k(5)}, left
    assert tier.stats()["evictions"] == 2 and tier.used_bytes <= tier.capacity_bytes


# -- disk, and the cache as a whole ---------------------------------------------------------------
def test_an_entry_the_device_tier_turns_away_is_still_served_from_below(tmp_path):
    with FeatureCache(device="cpu", device_bytes=2 * 4096, host_bytes="1MiB", disk_path=tmp_path,
                      eviction="admit") as cache:
        for i in (0, 1):
            cache.put(k(i), torch.zeros(1024), cost_s=0.025, block=True)  # 4 KiB each
            assert cache.get(k(i)) is not None
        books = cache._chain.top._books  # type: ignore[attr-defined]
        assert isinstance(books, AdmissionBooks)
        books.ledger_for(4096, 0.025).filtering = True
        cache.put(k(9), torch.ones(1024), cost_s=0.025, block=True)
        cache.flush()
        assert not cache._chain.top.contains(k(9))  # not admitted to the device tier
        lease = cache.acquire(k(9))
        assert lease is not None and lease.tier in ("host", "disk")
        assert torch.equal(lease.tensor, torch.ones(1024))
        lease.release()
        assert cache.stats()["cache"]["not_stored"] == 0


def test_the_disk_tier_keeps_its_lru_order_whatever_the_eviction(tmp_path):
    """The disk's books are LMDB's stamps (store/books.py), not the memory tiers': with
    eviction="admit" its budget evicts oldest first, costs aside."""
    with FeatureCache(device="cpu", device_bytes=0, host_bytes=0, disk_path=tmp_path,
                      disk_bytes=3 * 4096 + 2048, eviction="admit") as cache:
        cache.put(k(0), torch.zeros(1024), cost_s=9.0, block=True)  # costly, oldest
        cache.put(k(1), torch.zeros(1024), cost_s=0.001, block=True)
        cache.put(k(2), torch.zeros(1024), cost_s=0.001, block=True)
        cache.flush()
        cache.put(k(3), torch.zeros(1024), cost_s=0.001, block=True)
        cache.flush()
        assert k(0) not in cache and all(q in cache for q in (k(1), k(2), k(3)))


def test_featurecache_takes_the_policy_by_name_and_refuses_others():
    with FeatureCache(device="cpu", device_bytes="1MiB", host_bytes="1MiB", eviction="admit") as cache:
        assert cache.config.eviction == "admit"
        assert isinstance(cache._chain.top._books, AdmissionBooks)  # type: ignore[attr-defined]
        assert isinstance(cache._chain.staging._books, AdmissionBooks)  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="eviction must be one of lru, value, admit"):
        CacheConfig.create("cpu", "1MiB", 0, None, "1GiB", eviction="tinylfu")
    assert DEFAULTS["eviction"] in ("lru", "value", "admit")


def test_a_costly_entry_is_kept_over_cheap_ones_through_featurecache():
    with FeatureCache(device="cpu", device_bytes=4 * 4096, host_bytes=0, eviction="admit") as cache:
        cache.put(k(0), torch.zeros(1024), cost_s=0.271)  # 4 KiB each
        for i in range(1, 6):
            cache.put(k(i), torch.zeros(1024), cost_s=0.002)
        assert cache.get(k(0)) is not None  # LRU would have evicted it two puts ago


# -- the bench's CLI (a tiny run: plumbing, not figures) -------------------------------------------
def test_the_bench_dry_run_replays_every_policy_and_writes_its_report(tmp_path, capsys):
    out = tmp_path / "eviction.json"
    assert bench.main(["--dry-run", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    report = json.loads(out.read_text())
    rows = report["sets"]["dev"]["rows"]
    assert {r["trace"] for r in rows} == {s.name for s, _ in bench.dev()}
    for r in rows:
        assert set(r["saved_s"]) == {"lru", "value", "admit"}
        assert all(0 <= v <= r["ceiling_s"] + 1e-6 for v in r["saved_s"].values())
        assert f"| {r['trace']} | " in printed
    assert set(report["us_per_call"]["admit"]) == {"touch", "add", "evict_for", "evict_one"}
    assert "within 2% of LRU" in printed and report["run"]["source_digest"]
