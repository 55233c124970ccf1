"""``len(cache)``, ``cache.keys()``, ``cache.clear()`` and ``cache.verify()`` (issue 18 item 8):
what a user of python-diskcache expects, on the CPU. The concurrent-writer test is made
deterministic: the writer thread runs between the chunks of the iteration (``SCAN_CHUNK_ENTRIES``
made small), each step handed over through events."""

from __future__ import annotations

import threading

import lmdb
import pytest
import torch

import featcache.store.scan as scan_module
from featcache import FeatCacheError, FeatureCache
from featcache.cli import main


def key(i: int) -> bytes:
    return i.to_bytes(4, "big") + b"k"


def value(i: int) -> torch.Tensor:
    return torch.full((16,), float(i))


def open_cache(path, **options):
    settings = {"device_bytes": "1MiB", "host_bytes": "4MiB", "disk_bytes": "64MiB", **options}
    return FeatureCache(device="cpu", disk_path=path, **settings)


def filled(path, n: int, step: int = 1) -> FeatureCache:
    cache = open_cache(path)
    for i in range(0, n * step, step):
        cache.put(key(i), value(i))
    cache.flush()
    return cache


def test_len_and_keys_read_the_disk_store(tmp_path):
    with filled(tmp_path / "s", 10) as cache:
        assert len(cache) == 10
        assert list(cache.keys()) == sorted(key(i) for i in range(10))
        assert bool(cache)
    with open_cache(tmp_path / "s", device_bytes=0, host_bytes=0) as reopened:
        assert len(reopened) == 10  # the persistent tier: nothing in memory after a restart
        assert set(reopened.keys()) == {key(i) for i in range(10)}
        assert reopened.stats()["cache"]["gets"] == 0  # listing counts nothing


def test_len_and_keys_without_a_disk_are_the_memory_tiers():
    with FeatureCache(device="cpu", device_bytes=3 * 64, host_bytes="1MiB") as cache:
        assert len(cache) == 0 and list(cache.keys()) == [] and bool(cache)
        for i in range(5):
            cache.put(key(i), value(i))
        cache.flush()
        # the device tier holds 3, the host all 5: each key once
        assert cache.stats()["device"]["entries"] == 3
        assert len(cache) == 5 and list(cache.keys()) == [key(i) for i in range(5)]


def test_keys_while_a_writer_thread_puts_and_discards(tmp_path, monkeypatch):
    """Every key stored for the whole iteration is yielded once, none twice, in order, while
    another thread puts keys before and after the cursor and discards its own, between chunks."""
    monkeypatch.setattr(scan_module, "SCAN_CHUNK_ENTRIES", 4)
    path = tmp_path / "s"
    with filled(path, 30, step=10) as cache:  # keys 0, 10, ..., 290
        stable = set(list(cache.keys()))
        go, done = threading.Event(), threading.Event()
        rounds: list[int] = []
        stop: list[bool] = []

        def writer():
            n = 0
            while go.wait(5) and not stop:
                go.clear()
                if n >= 40:  # the iteration must end: no more keys after 40 rounds
                    done.set()
                    continue
                for j in (n * 7 + 1, 295 - n, n * 7 + 3):  # below and above the cursor
                    cache.put(key(j), value(j))
                cache.discard(key(n * 7 + 1))
                cache.get(key(n * 10 % 300))  # a hit: a recency touch on the disk writer
                cache.flush()
                rounds.append(n)
                n += 1
                done.set()

        thread = threading.Thread(target=writer, daemon=True)
        thread.start()
        seen = []
        for k in cache.keys():
            seen.append(k)
            go.set()
            assert done.wait(5)
            done.clear()
        stop.append(True)
        go.set()
        thread.join(5)
        assert len(rounds) == 40 and len(seen) > 40
        assert seen == sorted(seen) and len(set(seen)) == len(seen)  # none twice
        assert stable <= set(seen)  # none lost
        assert len(cache) > 30  # the writer's puts landed meanwhile


def test_clear_empties_every_tier_and_keeps_a_lease_valid(tmp_path):
    path = tmp_path / "s"
    with filled(path, 6) as cache:
        cache.put(b"only-in-memory", torch.zeros(64 << 10))  # 256 KiB: fits device and host
        lease = cache.acquire(key(0))
        assert lease is not None
        used = cache.stats()["device"]["bytes"]
        assert cache.clear() == 7  # 6 on disk (and in memory), 1 pending: each counted once
        assert len(cache) == 0 and list(cache.keys()) == []
        assert cache.get(key(0)) is None and key(1) not in cache
        assert cache.get(b"only-in-memory") is None
        # the leased entry left view but stays, counted, until released
        assert torch.equal(lease.tensor, value(0))
        assert 0 < cache.stats()["device"]["bytes"] <= used
        lease.release()
        assert cache.stats()["device"]["bytes"] == 0
        assert cache.stats()["host"]["entries"] == 0
        cache.put(key(99), value(99))  # a put after clear() is kept
        cache.flush()
        assert cache.clear() == 1
        cache.put(key(98), value(98))
    with open_cache(path) as reopened:
        assert list(reopened.keys()) == [key(98)]
        assert torch.equal(reopened.get(key(98)), value(98))
        assert reopened.stats()["disk"]["bytes"] > 0


def test_a_put_of_a_cleared_leased_key_is_served(tmp_path):
    with filled(tmp_path / "s", 2) as cache:
        lease = cache.acquire(key(0))
        cache.clear()
        cache.put(key(0), value(7))
        lease.release()  # the new value stays
        assert torch.equal(cache.get(key(0)), value(7))


def flip_last_byte(path, k: bytes) -> None:
    env = lmdb.open(str(path), max_dbs=4, map_size=1 << 30)
    try:
        data = env.open_db(b"data")
        with env.begin(write=True) as txn:
            raw = bytearray(txn.get(k, db=data))
            raw[-1] ^= 0x40
            txn.put(k, bytes(raw), db=data)
    finally:
        env.close()


def test_verify_is_the_report_featcache_verify_prints(tmp_path, capsys):
    path = tmp_path / "s"
    filled(path, 5).close()
    flip_last_byte(path, key(2))
    rc = main(["verify", str(path)])
    printed = capsys.readouterr().out
    assert rc == 2
    with open_cache(path, device_bytes=0, host_bytes=0) as cache:
        report = cache.verify()
        assert report.checked == 5 and [e.key for e in report.bad] == [key(2)]
        assert report.deleted is None
        assert f"verified {report.checked} entries" in printed
        assert f"bad   {key(2).hex()}" in printed and report.bad[0].problem in printed
        assert len(cache) == 5  # no writes without fix
        assert cache.verify().bad == report.bad
        steps = []
        fixed = cache.verify(fix=True, progress=lambda n, b: steps.append(n))
        assert fixed.deleted == 1 and steps == [1, 2, 3, 4, 5]
        assert len(cache) == 4 and cache.verify().bad == []
        assert cache.get(key(2)) is None and torch.equal(cache.get(key(3)), value(3))


def test_verify_without_a_disk_and_on_a_closed_cache():
    cache = FeatureCache(device="cpu", host_bytes="1MiB")
    report = cache.verify(fix=True)
    assert report.checked == 0 and report.bad == [] and report.deleted == 0
    cache.close()
    with pytest.raises(FeatCacheError, match="closed"):
        cache.verify()
    with pytest.raises(FeatCacheError, match="closed"):
        cache.clear()
    assert len(cache) == 0
