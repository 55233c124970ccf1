"""The remote tier on Mooncake Store (``featcache.tiers.mooncake``; issue 43): a real
``mooncake_master`` on loopback (its own HTTP metadata service, TCP transport), replicas that each
contribute a segment of memory, faults included: the master killed and started again under load.

Skipped where Mooncake Store is not installed or cannot load (the reason says which library is
missing). Here: ``pip install --target DIR mooncake-transfer-engine-non-cuda`` and libibverbs1's
libraries on LD_LIBRARY_PATH (docs/scale.md, "Mooncake Store").
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing as mp
import time
from pathlib import Path

import pytest
import torch

try:
    import _mooncake
    import _procs
    import _remote_procs
    from _fleet import RECOVERY_BOUND_S, Fleet
except ImportError:  # tests/ became a package
    from tests import _mooncake, _procs, _remote_procs
    from tests._fleet import RECOVERY_BOUND_S, Fleet

from featcache import FeatureCache
from featcache.keysecret import REMOTE_SUFFIX

pytestmark = pytest.mark.slow

SPAWN = mp.get_context("spawn")


@pytest.fixture
def master(tmp_path: Path):
    m = _mooncake.MooncakeMaster(_mooncake.master_binary(), tmp_path)
    yield m
    m.kill()


def remote_only(url: str, **options) -> FeatureCache:
    return FeatureCache(device="cpu", device_bytes=0, host_bytes=0, remote_url=url, **options)


def tier(cache: FeatureCache):
    return _procs.tier_slot(cache, "remote").tier


def values() -> dict[bytes, torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    return {
        b"internvl2-2b-1-tile": torch.randn(1, 256, 2048, generator=gen).to(torch.bfloat16),
        b"f32": torch.randn(40, 512, generator=gen),
        b"f16": torch.randn(4096, generator=gen).to(torch.float16),
        b"i64": torch.randint(-(2**62), 2**62, (3000,), generator=gen),
        b"bool": torch.rand(5000, generator=gen) > 0.5,
        b"f8": torch.randn(7000, generator=gen).to(torch.float8_e4m3fn),
        b"empty": torch.empty(0, 3),
        b"scalar": torch.tensor(3.5),
    }


def test_values_round_trip_between_replica_processes(master, tmp_path):
    url = master.url()
    keys = [b"shared-%d" % i for i in range(6)]
    with remote_only(url) as writer:  # stays up: its segment holds what it published
        for key, t in values().items():
            writer.put(key, t, meta=b"meta-" + key)
        for key in keys:
            writer.put(key, _procs.value_for(key), meta=b"m:" + key)
        writer.flush()
        assert writer.stats()["remote"]["published"] == len(values()) + len(keys)
        with concurrent.futures.ProcessPoolExecutor(1, mp_context=SPAWN) as pool:
            stats = pool.submit(_remote_procs.replica_read, url, str(tmp_path / "b"), keys).result(120)
        assert stats["hits"] == len(keys) and stats["misses"] == 0
        with remote_only(url) as reader:  # this process's second cache (the same store client)
            for key, t in values().items():
                lease = reader.acquire(key)
                assert lease is not None and _procs.same_bits(lease.tensor, t)
                assert lease.meta == b"meta-" + key
                lease.release()
            assert reader.hasher.secret == writer.hasher.secret
            writer.discard(b"f32")
            writer.flush()
            assert reader.get(b"f32") is None


def test_corrupt_value_is_never_served(master):
    url = master.url()
    with remote_only(url) as cache:
        t = torch.randn(10000)
        cache.put(b"k", t)
        cache.flush()
        store = tier(cache)._connected()
        name = tier(cache).object_key(b"k")
        raw = bytearray(store.get(name))
        raw[-5] ^= 0x01  # one payload bit
        assert store.upsert(name, bytes(raw)) == 0
        assert cache.get(b"k") is None
        cache.flush()  # the drop queued by the corrupt read
        s = cache.stats()["remote"]
        assert s["corrupt"] == 1 and s["hits"] == 0
        assert store.is_exist(name) == 0
        cache.put(b"k", t)
        cache.flush()
        assert _procs.same_bits(cache.get(b"k"), t)


def test_master_unreachable_is_a_counted_miss_within_the_deadline(master):
    url = master.url()
    with remote_only(url, remote_timeout_ms=100, remote_breaker_failures=2) as cache:
        cache.put(b"k", torch.ones(100))
        cache.flush()
        master.kill()
        for _ in range(5):
            t0 = time.monotonic()
            got = cache.get(b"k")  # never an exception: a miss (or, served, the right bytes)
            assert time.monotonic() - t0 < 0.1 + 0.4
            assert got is None or _procs.same_bits(got, torch.ones(100))
        s = cache.stats()["remote"]
        assert s["hits"] + s["misses"] == 5 and s["errors"] + s["timeouts"] + s["breaker_skips"] >= 1
        cache.put(b"other", torch.ones(3))  # the publisher: failed or skipped, counted
        cache.flush()
        s = cache.stats()["remote"]
        assert s["published"] == 1 and s["publish_errors"] + s["publish_dropped"] == 1


def test_fleet_master_killed_and_back(master):
    """Two replica processes under load; the master dies (every object's metadata with it) and
    comes back: no wrong tensor, no exception, gets within the deadline, the replicas' segments
    mounted again by the clients themselves, the hit ratio back, the key secret put back."""
    fleet = Fleet(master.url(), remote_breaker_cooldown_ms=1000)
    try:
        t0 = time.monotonic()
        fleet.wait_recovered(t0, bound_s=60)
        before = fleet.check()  # the invariants, before the fault
        (secret_hex,) = {r.secret for r in fleet.replicas}
        t_kill = time.monotonic()
        master.kill()
        time.sleep(3.0)
        fleet.collect()
        during = fleet.ratio(t_kill + 0.5, time.monotonic())
        t_up = time.monotonic()
        master.start()
        took = fleet.wait_recovered(t_up, bound_s=RECOVERY_BOUND_S + 15)
        time.sleep(1.0)
        figures = fleet.check(t_kill)
        print(f"\nmooncake figure master_killed_3s: recovered_s={took:.3g}, ratio_during={during:.2f}, "
              f"max_get_ms={figures['max_get_ms']:.0f}, ratio_before={before['ratio']:.2f}")
        # the secret, lost with the master's metadata, is put back by the replicas' publishers
        from featcache.tiers import mooncake as mc

        store = mc.shared_client(mc.MooncakeSettings.from_url(master.url()))
        deadline = time.monotonic() + 20
        held = b""
        while time.monotonic() < deadline:
            held = bytes(store.get(f"featcache:{REMOTE_SUFFIX}") or b"")
            if held:
                break
            time.sleep(0.5)
        assert held.decode() == secret_hex
    finally:
        fleet.close()
    for r in fleet.replicas:
        s = r.stats
        assert not r.wrong and not r.exceptions
        assert s["misses"] == sum(not hit for _, hit, _ in r.gets)
        assert s["published"] + s["publish_errors"] + s["publish_dropped"] == r.puts
