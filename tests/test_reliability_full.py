"""Full disk and full map: writes are dropped and counted, requests never fail, nothing stale is
served, and the store takes writes again once space returns.

Two ways to run out: a file system that is full (a 4 MiB tmpfs, mounted for the test; skipped
with the reason when this process may not mount) and an LMDB map that is full (the map size
helper patched to 1 MiB). In both the disk budget (64 MiB) is far above what fits, so eviction
never saves the write: the transaction fails. What happens when the budget itself is the limit
(eviction, LRU order, a value larger than the budget) is proven in tests/test_disk_durability.py
(``test_disk_budget_holds_after_every_flush``, ``test_disk_eviction_is_lru_and_reads_count_as_use``).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import lmdb
import pytest
import torch

import featcache.store.env as store_env
from featcache import FeatureCache
from featcache.tiers.disk import DiskTier

try:
    import _reliability as rel
except ImportError:  # tests/ became a package
    from tests import _reliability as rel

MiB = 1 << 20


def key(i: int) -> bytes:
    return b"full-%d" % i


def old_value(i: int) -> torch.Tensor:
    return torch.full((4096,), float(i))  # 16 KiB


def new_value(i: int) -> torch.Tensor:
    return torch.full((4096,), -float(i) - 0.5)


@pytest.fixture
def small_fs(tmp_path) -> Iterator[Path]:
    """A 4 MiB tmpfs, or a skip saying why there is none."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root (the full-map variant still runs)")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()}); the full-map variant runs")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill_up(path: Path) -> int:
    """Write a filler file until the file system is full; return its size."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    size = 0
    try:
        while True:
            size += os.write(fd, b"\0" * 65536)
    except OSError:
        pass
    try:
        while True:
            size += os.write(fd, b"\0" * 512)
    except OSError:
        pass
    finally:
        os.close(fd)
    return size


class Tally:
    """What the user saw while the disk was full."""

    def __init__(self) -> None:
        self.requests = self.failed = self.wrong = self.stale = self.served = 0

    def put(self, cache: FeatureCache, k: bytes, t: torch.Tensor) -> None:
        self.requests += 1
        try:
            cache.put(k, t)
        except Exception:
            self.failed += 1

    def get(self, cache: FeatureCache, k: bytes, want: torch.Tensor,
            old: torch.Tensor | None = None) -> None:
        self.requests += 1
        try:
            got = cache.get(k)
        except Exception:
            self.failed += 1
            return
        if got is None:
            return
        self.served += 1
        if old is not None and rel.same_bits(got, old):
            self.stale += 1
        elif not rel.same_bits(got, want):
            self.wrong += 1


def run_out_of_space(cache: FeatureCache, exhaust, give_back, n: int = 160) -> dict[str, int]:
    """The shared scenario: fill, run out, replace every value, read, get space back, write."""
    tally = Tally()
    for i in range(n):  # more than fits: some of these already fail
        tally.put(cache, key(i), old_value(i))
        if i % 8 == 7:
            rel.in_thread(cache.flush)
    rel.in_thread(cache.flush)
    stored_before = cache.stats()["disk"]["entries"]
    exhaust()
    for i in range(n):  # replace every value while no space is left
        tally.put(cache, key(i), new_value(i))
        if i % 8 == 7:
            rel.in_thread(cache.flush)
    rel.in_thread(cache.flush)
    for i in range(n):  # the old values must never come back
        tally.get(cache, key(i), new_value(i), old=old_value(i))
    full = cache.stats()["disk"]
    give_back()
    for i in range(n, n + 40):  # space is back: new writes land
        tally.put(cache, key(i), old_value(i))
        if i % 8 == 7:
            rel.in_thread(cache.flush)
    rel.in_thread(cache.flush)
    landed = sum(key(i) in cache for i in range(n, n + 40))
    for i in range(n + 40):
        tally.get(cache, key(i), new_value(i) if i < n else old_value(i),
                  old=old_value(i) if i < n else None)
    return {
        "requests": tally.requests, "failed": tally.failed, "wrong": tally.wrong,
        "stale": tally.stale, "served": tally.served, "stored_before": stored_before,
        "failed_txns": full["errors"], "drops": full["drops"], "landed_after": landed,
    }


def check_reopen(path: Path, n: int) -> dict[str, int]:
    """After close and reopen: every entry served is bit-exact and current."""
    tally = Tally()
    with rel.disk_cache(path) as cache:
        for i in range(n + 40):
            tally.get(cache, key(i), new_value(i) if i < n else old_value(i),
                      old=old_value(i) if i < n else None)
    return {"served": tally.served, "wrong": tally.wrong + tally.stale, "failed": tally.failed}


def test_full_file_system_drops_writes_serves_nothing_stale_and_recovers(small_fs):
    store = small_fs / "store"
    filler = small_fs / "filler"
    cache = rel.disk_cache(store, "64MiB", device_bytes=MiB)
    try:
        out = run_out_of_space(cache, lambda: fill_up(filler), filler.unlink)
        assert out["failed"] == out["wrong"] == out["stale"] == 0
        assert out["failed_txns"] > 0 and out["drops"] > 0, "the file system never filled up"
        assert out["landed_after"] == 40, "the store did not recover once space returned"
    finally:
        rel.in_thread(cache.close)
    again = check_reopen(store, 160)
    assert again["wrong"] == again["failed"] == 0 and again["served"] >= 40
    rel.report("full/tmpfs-4MiB", runs=1, faults=out["failed_txns"], wrong=out["wrong"] + out["stale"],
               failed=out["failed"], requests=out["requests"], drops=out["drops"],
               stored_before_full=out["stored_before"], landed_after_space_returned=out["landed_after"],
               served_after_reopen=again["served"])


def test_full_map_drops_writes_serves_nothing_stale_and_recovers(tmp_path, monkeypatch):
    store = tmp_path / "store"
    monkeypatch.setattr(store_env, "map_size_for", lambda capacity, file_bytes=0: 2 * MiB)
    cache = rel.disk_cache(store, "64MiB", device_bytes=MiB)

    def discard_half() -> None:  # space returns: entries are deleted, their pages reused
        for i in range(0, 160, 2):
            cache.discard(key(i))
        rel.in_thread(cache.flush)

    try:
        out = run_out_of_space(cache, lambda: None, discard_half)
        assert out["failed"] == out["wrong"] == out["stale"] == 0
        assert out["failed_txns"] > 0 and out["drops"] > 0, "the map never filled up"
        assert out["landed_after"] == 40, "the store did not recover once space returned"
    finally:
        rel.in_thread(cache.close)
    monkeypatch.undo()  # reopened with the real (1 TiB) map: room again for everything
    again = check_reopen(store, 160)
    assert again["wrong"] == again["failed"] == 0 and again["served"] >= 40
    rel.report("full/map-2MiB", runs=1, faults=out["failed_txns"], wrong=out["wrong"] + out["stale"],
               failed=out["failed"], requests=out["requests"], drops=out["drops"],
               stored_before_full=out["stored_before"], landed_after_space_returned=out["landed_after"],
               served_after_reopen=again["served"])


def test_a_failed_write_whose_cleanup_also_fails_never_serves_the_old_value(tmp_path):
    """The worst case of a full disk: the transaction of a replacing put fails, and so does the
    one that deletes the key's older value. That older value must still never be served."""
    store = tmp_path / "store"
    cache = rel.disk_cache(store)
    try:
        for i in range(20):
            cache.put(key(i), old_value(i))
        rel.in_thread(cache.flush)
        disk: DiskTier = rel.tier_slot(cache, "disk").tier
        real_write = disk._write
        failures = {"left": 2 * 20}  # every write and cleanup transaction of 20 replacing puts

        def failing_write(env, ops):
            if failures["left"] > 0:
                failures["left"] -= 1
                raise lmdb.DiskError("injected: no space left on device")
            return real_write(env, ops)

        disk._write = failing_write
        for i in range(20):
            cache.put(key(i), new_value(i))
            rel.in_thread(cache.flush)  # one batch per put: two failed transactions each
        tally = Tally()
        for i in range(20):
            tally.get(cache, key(i), new_value(i), old=old_value(i))
        stats = cache.stats()["disk"]
        assert failures["left"] == 0 and stats["errors"] == 40 and stats["drops"] == 20
        assert tally.failed == tally.wrong == 0
        assert tally.stale == 0, f"{tally.stale} old values served after their replacement failed"
        # The disk works again: the next write or discard of those keys cleans them up.
        for i in range(20):
            cache.put(key(i), new_value(i))
        rel.in_thread(cache.flush)
        for i in range(20):
            tally.get(cache, key(i), new_value(i), old=old_value(i))
        assert tally.served == 20 and tally.stale == tally.wrong == 0
    finally:
        rel.in_thread(cache.close)
    rel.report("full/write-and-cleanup-both-fail", runs=1, faults=40, wrong=tally.wrong + tally.stale,
               failed=tally.failed, requests=tally.requests + 40, stale=tally.stale)
