import torch

from featcache.tiers import Entry
from featcache.tiers.device import DeviceTier


def entry(nbytes: int) -> Entry:
    return Entry(torch.zeros(nbytes, dtype=torch.uint8))


def test_a_pin_is_recorded_even_when_the_entry_cannot_be_stored():
    tier = DeviceTier(capacity_bytes=100)
    assert tier.put(b"a", entry(80), pin=True)
    assert not tier.put(b"b", entry(80), pin=True)  # the only room is pinned by a
    tier.unpin(b"a")
    tier.unpin(b"b")  # balanced: no error
    assert tier.put(b"c", entry(80))  # a is no longer pinned: evicted for c
    assert not tier.contains(b"a") and tier.contains(b"c")


def test_pinned_entries_survive_and_others_are_evicted_oldest_first():
    tier = DeviceTier(capacity_bytes=300)
    for k in (b"a", b"b", b"c"):
        tier.put(k, entry(100))
    tier.get(b"a", pin=True)
    tier.put(b"d", entry(100))
    assert tier.contains(b"a") and not tier.contains(b"b")
    tier.put(b"e", entry(200))
    assert tier.contains(b"a") and not tier.contains(b"c") and not tier.contains(b"d")
    stats = tier.stats()
    assert stats["bytes"] <= stats["capacity_bytes"] and stats["evictions"] == 3


def test_a_lease_released_after_the_cache_closed_is_harmless():
    from featcache import FeatureCache

    cache = FeatureCache(device="cpu", device_bytes=1 << 20, host_bytes=0)
    cache.put(b"k" * 16, torch.ones(4))
    lease = cache.acquire(b"k" * 16)
    cache.close()
    lease.release()  # e.g. a request that outlived the pipeline: no error
