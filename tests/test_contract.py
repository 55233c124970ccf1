"""One contract, run against every tier: each configuration serves its reads from one tier."""

import threading

import pytest
import torch

from featcache import FeatureCache

MiB = 1 << 20

# tier -> (device_bytes, host_bytes, disk?) such that reads come from that tier
TIERS = {
    "device": dict(device_bytes=4 * MiB, host_bytes=0, disk=False),
    "host": dict(device_bytes=0, host_bytes=4 * MiB, disk=False),
    "disk": dict(device_bytes=0, host_bytes=0, disk=True),
}


@pytest.fixture(params=list(TIERS))
def tier(request):
    return request.param


@pytest.fixture
def make(tier, tmp_path):
    caches = []

    def build(capacity=4 * MiB):
        spec = TIERS[tier]
        cache = FeatureCache(
            device="cpu",
            device_bytes=capacity if spec["device_bytes"] else 0,
            host_bytes=capacity if spec["host_bytes"] else 0,
            disk_path=tmp_path / "store" if spec["disk"] else None,
            disk_bytes=capacity,
            host_slab_bytes=capacity,
        )
        caches.append(cache)
        return cache

    yield build
    for cache in caches:
        cache.close()


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def features(i: int, dtype=torch.bfloat16, shape=(16, 256)) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    return (torch.randn(shape, generator=g) * 100).to(dtype)


def read(cache, tier, k):
    """get() after the write-through has landed, so a read can only come from the tier under test."""
    cache.flush()
    return cache.get(k)


class TestTierContract:
    @pytest.mark.parametrize(
        "dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int8, torch.bool]
    )
    def test_bit_identical_roundtrip(self, make, tier, dtype):
        cache = make()
        t = features(1, torch.float32)
        t = (t > 0) if dtype == torch.bool else t.to(dtype)
        cache.put(key(1), t)
        out = read(cache, tier, key(1))
        assert out is not None and out.dtype == dtype and out.shape == t.shape
        assert out.device.type == "cpu"
        assert torch.equal(out.view(torch.uint8), t.view(torch.uint8))  # bits, NaNs included
        assert cache.stats()[tier]["hits"] == 1

    def test_special_values_and_shapes(self, make, tier):
        cache = make()
        cases = {
            2: torch.tensor([float("nan"), float("inf"), -0.0, 1e-40], dtype=torch.float32),
            3: torch.tensor(3.5, dtype=torch.bfloat16),  # 0-dim
            4: torch.zeros(0, 7, dtype=torch.float16),  # no elements
            5: torch.ones(1, 2, 1, 3, 1, 2, 1, 2),  # 8 dims
        }
        for i, t in cases.items():
            cache.put(key(i), t)
        for i, t in cases.items():
            out = read(cache, tier, key(i))
            assert out is not None and out.shape == t.shape and out.dtype == t.dtype
            assert torch.equal(out.view(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))

    def test_miss_is_none_and_counted(self, make, tier):
        cache = make()
        assert cache.get(key(9)) is None
        assert cache.stats()[tier]["misses"] == 1
        assert key(9) not in cache

    def test_put_replaces(self, make, tier):
        cache = make()
        cache.put(key(1), features(1))
        cache.flush()
        cache.put(key(1), features(2))
        assert torch.equal(read(cache, tier, key(1)), features(2))
        assert cache.stats()[tier]["entries"] == 1

    def test_entry_larger_than_the_budget_is_not_stored(self, make, tier):
        cache = make(capacity=64 * 1024)
        cache.put(key(1), torch.zeros(64 * 1024, dtype=torch.uint8))  # == budget: header won't fit
        cache.put(key(2), torch.zeros(100_000, dtype=torch.uint8))
        assert read(cache, tier, key(2)) is None
        assert cache.stats()["cache"]["not_stored"] >= 1
        assert cache.stats()[tier]["bytes"] <= cache.stats()[tier]["capacity_bytes"]

    def test_budget_never_exceeded_and_lru_keeps_the_recent(self, make, tier):
        cache = make(capacity=256 * 1024)  # 8 entries of 32 KiB (minus headers on disk)
        for i in range(40):
            cache.put(key(i), features(i, shape=(64, 256)))
            if i >= 1:
                assert read(cache, tier, key(0)) is not None, f"recently used key 0 evicted at {i}"
            s = cache.stats()[tier]
            assert s["bytes"] <= s["capacity_bytes"]
        s = cache.stats()[tier]
        assert s["evictions"] > 0 and 0 < s["entries"] < 40
        assert read(cache, tier, key(1)) is None  # the oldest untouched entry went first
        assert torch.equal(read(cache, tier, key(39)), features(39, shape=(64, 256)))

    def test_stats_shape(self, make, tier):
        cache = make()
        stats = cache.stats()
        for name in ("device", "host", "disk"):
            for field in ("hits", "misses", "entries", "bytes", "capacity_bytes", "evictions"):
                assert isinstance(stats[name][field], int)
        for field in ("drops", "corrupt"):
            assert stats["disk"][field] == 0
        disabled = {"device", "host", "disk"} - {tier}
        cache.put(key(1), features(1))
        cache.get(key(1))
        cache.get(key(2))
        for name in disabled:  # a disabled tier stays present, at zero
            assert cache.stats()[name]["capacity_bytes"] in (0, 4 * MiB)
            if name != "disk" or tier != "disk":
                assert cache.stats()[name]["entries"] == 0

    def test_concurrent_threads_see_only_what_was_put(self, make, tier):
        cache = make(capacity=1 * MiB)
        errors = []
        barrier = threading.Barrier(4)

        def worker(seed):
            try:
                barrier.wait()
                for n in range(150):
                    i = (seed * 7 + n) % 24
                    if n % 3 == 0:
                        cache.put(key(i), features(i, shape=(32, 256)))
                    else:
                        out = cache.get(key(i))
                        if out is not None and not torch.equal(out, features(i, shape=(32, 256))):
                            errors.append(f"wrong value for {i}")
                    s = cache.stats()[tier]
                    if s["bytes"] > s["capacity_bytes"]:
                        errors.append(f"over budget: {s}")
            except Exception as e:  # pragma: no cover - reported below
                errors.append(repr(e))

        threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        assert cache.stats()["cache"]["worker_errors"] == 0
