"""One contract, run against every tier of the chain (``featcache.core.chain.KINDS``), the remote tier
included (a real redis-server on loopback: tests/_redis.py).

``TestCacheContract``: a cache configured so that every read comes from the tier under test.
``TestTierProtocol``: the tier itself, as ``build_chain`` builds it, through the ``Tier`` protocol
(and the role protocol of its slot: leasing, staging, written).
"""

import threading

import pytest
import torch

from featcache import FeatureCache
from featcache.codec import frame_offsets
from featcache.config import CacheConfig
from featcache.core.chain import BELOW, KINDS, STAGING, TOP, build_chain
from featcache.core.copier import make_copier
from featcache.tiers.base import Entry, Op

try:
    import _redis
except ImportError:  # tests/ became a package
    from tests import _redis

MiB = 1 << 20

# kind -> the cache options under which every read comes from that tier ("disk": a store under
# tmp_path, "remote": a redis-server of its own). A new kind fails test_every_kind_is_covered
# until it is added here, and then runs the whole contract.
CONFIGS = {
    "device": dict(device_bytes=4 * MiB, host_bytes=0),
    "host": dict(device_bytes=0, host_bytes=4 * MiB),
    "disk": dict(device_bytes=0, host_bytes=0, disk=True),
    "remote": dict(device_bytes=0, host_bytes=0, remote=True),
}


WRITTEN = [kind.name for kind in BELOW]  # the kinds written through a TierWriter


def test_every_kind_is_covered():
    assert list(CONFIGS) == [kind.name for kind in KINDS]


@pytest.fixture(scope="session")
def redis_bin() -> str:
    return _redis.redis_binary()


@pytest.fixture(params=list(CONFIGS))
def tier(request):
    return request.param


@pytest.fixture
def options(tier, tmp_path, request):
    """Cache options for ``tier`` with budgets of ``capacity`` (a function of it)."""
    spec = CONFIGS[tier]
    url = None
    if spec.get("remote"):
        server = _redis.RedisServer(request.getfixturevalue("redis_bin"), tmp_path)
        request.addfinalizer(server.kill)
        url = server.url

    def build(capacity=4 * MiB):
        return dict(
            device="cpu",
            device_bytes=capacity if spec["device_bytes"] else 0,
            host_bytes=capacity if spec["host_bytes"] else 0,
            disk_path=tmp_path / "store" if spec.get("disk") else None,
            disk_bytes=capacity,
            host_slab_bytes=capacity,
            remote_url=url,
            remote_chunk_bytes=64 * 1024,
        )

    return build


@pytest.fixture
def make(options):
    caches = []

    def build(capacity=4 * MiB):
        cache = FeatureCache(**options(capacity))
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


def read(cache, k):
    """get() after the write-through has landed, so a read can only come from the tier under test."""
    cache.flush()
    return cache.get(k)


def budgeted(cache, tier) -> bool:
    """Whether ``tier`` keeps a byte budget of its own (the remote tier does not: the server's
    maxmemory governs, and its stats have no sizes)."""
    return "capacity_bytes" in cache.stats()[tier]


class TestCacheContract:
    @pytest.mark.parametrize(
        "dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int8, torch.bool]
    )
    def test_bit_identical_roundtrip(self, make, tier, dtype):
        cache = make()
        t = features(1, torch.float32)
        t = (t > 0) if dtype == torch.bool else t.to(dtype)
        cache.put(key(1), t)
        out = read(cache, key(1))
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
            out = read(cache, key(i))
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
        assert torch.equal(read(cache, key(1)), features(2))
        if budgeted(cache, tier):
            assert cache.stats()[tier]["entries"] == 1

    def test_discard_removes(self, make, tier):
        cache = make()
        cache.put(key(1), features(1))
        cache.flush()
        cache.discard(key(1))
        assert cache.get(key(1)) is None  # a delete still queued decides
        assert read(cache, key(1)) is None

    def test_entry_larger_than_the_budget_is_not_stored(self, make, tier):
        cache = make(capacity=64 * 1024)
        if not budgeted(cache, tier):
            pytest.skip(f"the {tier} tier has no budget of its own")
        cache.put(key(1), torch.zeros(64 * 1024, dtype=torch.uint8))  # == budget: header won't fit
        cache.put(key(2), torch.zeros(100_000, dtype=torch.uint8))
        assert read(cache, key(2)) is None
        assert cache.stats()["cache"]["not_stored"] >= 1
        assert cache.stats()[tier]["bytes"] <= cache.stats()[tier]["capacity_bytes"]

    def test_budget_never_exceeded_and_lru_keeps_the_recent(self, make, tier):
        cache = make(capacity=256 * 1024)  # 8 entries of 32 KiB (minus headers on disk)
        if not budgeted(cache, tier):
            pytest.skip(f"the {tier} tier has no budget of its own")
        for i in range(40):
            cache.put(key(i), features(i, shape=(64, 256)))
            if i >= 1:
                assert read(cache, key(0)) is not None, f"recently used key 0 evicted at {i}"
            s = cache.stats()[tier]
            assert s["bytes"] <= s["capacity_bytes"]
        s = cache.stats()[tier]
        assert s["evictions"] > 0 and 0 < s["entries"] < 40
        assert read(cache, key(1)) is None  # the oldest untouched entry went first
        assert torch.equal(read(cache, key(39)), features(39, shape=(64, 256)))

    def test_stats_shape(self, make, tier):
        cache = make()
        stats = cache.stats()
        shown = [k.name for k in KINDS if k.rules.report.when_off]  # device, host, disk
        for name in shown:
            for field in ("hits", "misses", "entries", "bytes", "capacity_bytes", "evictions"):
                assert isinstance(stats[name][field], int)
        for field in ("drops", "corrupt"):
            assert stats["disk"][field] == 0
        assert ("remote" in stats) == (tier == "remote")  # present only when configured
        disabled = set(shown) - {tier}
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
                    if s.get("bytes", 0) > s.get("capacity_bytes", 0) > 0:
                        errors.append(f"over budget: {s}")
            except Exception as e:  # pragma: no cover - reported below
                errors.append(repr(e))

        threads = [threading.Thread(target=worker, args=(s,), daemon=True) for s in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        assert cache.stats()["cache"]["worker_errors"] == 0


# -- the tiers themselves ------------------------------------------------------------------------
@pytest.fixture
def chain_slot(tier, options):
    """The slot of ``tier`` in a chain built from its configuration (writers running)."""
    config = CacheConfig.create(**options())
    chain = build_chain(config, make_copier(torch.device("cpu")))
    slot = next(s for s in chain.slots if s.tier.name == tier)
    yield chain, slot
    for writer in chain.writers:
        writer.stop()
    chain.close()


def stored(chain, slot, t: torch.Tensor, meta: bytes = b"") -> Entry:
    """An entry of ``t`` as the cache hands it to the slot's tier: the tensor itself for the top,
    a framed copy in a host block for the others (in a staging block when there is one)."""
    if slot.tier is chain.top:
        return Entry(t, meta=meta)
    start, offset = frame_offsets(len(meta))
    block = chain.staging.reserve(offset + t.nbytes) if chain.staging is not None else None
    buffer = block.tensor if block is not None else torch.empty(offset + t.nbytes, dtype=torch.uint8)
    buffer[offset : offset + t.nbytes].copy_(t.reshape(-1).view(torch.uint8))
    view = buffer[offset : offset + t.nbytes].view(t.dtype).view(t.shape)
    return Entry(view, None, block, meta, frame=buffer[start : offset + t.nbytes])


def put(chain, slot, k: bytes, t: torch.Tensor, meta: bytes = b"") -> None:
    """Store through the slot's own path: ``put`` for the top and staging tiers, ``write`` (what
    its writer calls) for a written tier."""
    entry = stored(chain, slot, t, meta)
    if slot.writer is None:
        assert slot.tier.put(k, entry)
    else:
        slot.tier.write([Op("put", k, entry)])
        if entry.block is not None:
            chain.staging.release(entry.block)


def got(chain, tier, k: bytes):
    """``tier.get(k, alloc)`` with host buffers, and the buffers alloc handed out."""
    buffers = []

    def alloc(n):
        buffers.append(torch.empty(n, dtype=torch.uint8))
        return buffers[-1]

    entry = tier.get(k, alloc)
    if entry is not None and entry.block is not None:
        chain.staging.release(entry.block)
    return entry, buffers


class TestTierProtocol:
    def test_kinds_are_top_staging_then_written(self):
        assert KINDS == (TOP, STAGING, *BELOW)
        assert all(kind.rules.writer is not None for kind in BELOW)

    def test_put_get_roundtrip_with_meta(self, chain_slot):
        chain, slot = chain_slot
        t = features(3, torch.float16, shape=(40, 300))
        put(chain, slot, key(3), t, meta=b"meta-3")
        assert slot.tier.contains(key(3))
        entry, buffers = got(chain, slot.tier, key(3))
        assert entry is not None and entry.meta == b"meta-3"
        assert entry.tensor.dtype == t.dtype and entry.tensor.shape == t.shape
        assert torch.equal(entry.tensor.view(torch.uint8), t.view(torch.uint8))
        if buffers:  # a tier that copies out writes into what alloc gave it
            start = buffers[0].data_ptr()
            assert start <= entry.tensor.data_ptr() < start + buffers[0].nbytes
        assert slot.tier.stats()["hits"] == 1

    def test_miss_is_none_and_counted(self, chain_slot):
        chain, slot = chain_slot
        entry, _ = got(chain, slot.tier, key(7))
        assert entry is None and not slot.tier.contains(key(7))
        assert slot.tier.stats()["misses"] == 1

    def test_discard(self, chain_slot):
        chain, slot = chain_slot
        put(chain, slot, key(1), features(1))
        assert slot.tier.discard(key(1))
        assert not slot.tier.contains(key(1)) and got(chain, slot.tier, key(1))[0] is None
        assert not slot.tier.discard(key(1))  # nothing left to delete

    def test_fits(self, chain_slot):
        _, slot = chain_slot
        assert slot.tier.fits(1024, 16)
        if slot.tier.capacity_bytes:
            assert not slot.tier.fits(slot.tier.capacity_bytes + 1)

    def test_count_drops_shows_in_stats(self, chain_slot):
        _, slot = chain_slot
        before = slot.tier.stats()
        slot.tier.count_drops(3)
        after = slot.tier.stats()
        changed = {k: after[k] - before[k] for k in after if after[k] != before.get(k)}
        assert list(changed.values()) == [3], changed

    def test_stats_and_sizes(self, chain_slot):
        chain, slot = chain_slot
        put(chain, slot, key(1), features(1))
        stats = slot.tier.stats()
        assert all(isinstance(v, int) for v in stats.values())
        assert {"hits", "misses"} <= set(stats)
        assert 0 <= slot.tier.used_bytes and (
            not slot.tier.capacity_bytes or slot.tier.used_bytes <= slot.tier.capacity_bytes)

    @pytest.mark.parametrize("tier", WRITTEN)
    def test_written_tier_applies_ops_in_order(self, chain_slot):
        chain, slot = chain_slot
        ops = [Op("put", key(1), stored(chain, slot, features(1))), Op("discard", key(1)),
               Op("put", key(2), stored(chain, slot, features(2))), Op("touch", key(2)),
               Op("put", key(2), stored(chain, slot, features(3)))]
        slot.tier.write(ops)
        assert got(chain, slot.tier, key(1))[0] is None
        assert torch.equal(got(chain, slot.tier, key(2))[0].tensor, features(3))

    @pytest.mark.parametrize("tier", WRITTEN)
    def test_writer_serves_what_it_has_queued(self, chain_slot):
        chain, slot = chain_slot
        assert slot.writer.pending(key(5)) == (False, None)
        slot.writer.submit(key(5), stored(chain, slot, features(5)))
        slot.writer.discard(key(6))
        queued, entry = slot.writer.pending(key(6))
        assert queued and entry is None  # a delete is queued: the tier's value must not be served
        slot.writer.join_queue()
        assert slot.writer.pending(key(5)) == (False, None)
        assert torch.equal(got(chain, slot.tier, key(5))[0].tensor, features(5))


@pytest.mark.parametrize("host_bytes, disk, names", [
    (0, False, ["device"]),
    (MiB, False, ["device", "host"]),
    (0, True, ["device", "disk"]),
    (MiB, True, ["device", "host", "disk"]),
])
def test_the_chain_holds_the_tiers_the_config_turns_on_in_order(tmp_path, host_bytes, disk, names):
    config = CacheConfig.create("cpu", MiB, host_bytes, tmp_path / "s" if disk else None, 8 * MiB)
    chain = build_chain(config, make_copier(torch.device("cpu")))
    try:
        assert [s.tier.name for s in chain.slots] == names
        assert [k.name for k in chain.off] == [k.name for k in KINDS if k.name not in names]
        assert chain.top is chain.slots[0].tier
        assert (chain.staging is not None) == ("host" in names)
        assert [s.tier.name for s in chain.slots if s.writer is not None] == (["disk"] if disk else [])
        assert list(chain.stats()) == ["device", "host", "disk"]  # off: present at zero, not remote
    finally:
        for writer in chain.writers:
            writer.stop()
        chain.close()
