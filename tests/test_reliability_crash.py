"""Crash: processes SIGKILLed at random moments of heavy demotion; the store is reopened after
each kill and every entry it serves must be bit-exact.

Each run forks a child that puts entries as fast as it can through all three tiers (small
budgets, so every tier evicts; fsync on; queues always full: copies and writes are dropped as
designed), reads
older ones back (promotions from host and disk, LRU touches queued) and replaces some, and never
waits for the disk. The parent kills it with SIGKILL after a random delay, then opens the store,
reads every key the child may have written, checks the books, and closes it before the next run.

tests/test_disk_durability.py::test_sigkill_mid_write_loses_nothing_flushed_and_serves_nothing_wrong
already proves, for a disk-only writer that flushes, that nothing reported flushed is lost and
that a process keeping the store open through the kills still writes; it is not repeated here.
"""

from __future__ import annotations

import mmap
import os
import random
import select
import signal
import struct
import time

import pytest
import torch

from featcache import FeatureCache

try:
    import _procs
    import _reliability as rel
    from test_disk_durability import check_books
except ImportError:  # tests/ became a package
    from tests import _procs
    from tests import _reliability as rel
    from tests.test_disk_durability import check_books

MiB = 1 << 20
RUNS = 8
DISK_BYTES = 16 * MiB  # small enough that the children evict while they are killed
WRONG_EXIT = 3  # the child saw a wrong value itself


def crash_key(run: int, i: int) -> bytes:
    return b"heavy-%d-%d" % (run, i)


def heavy_demotion(path: str, run: int, seed: int, progress: mmap.mmap, ready: int) -> None:
    """The child: put, read back and replace entries as fast as it can until killed."""
    torch.set_num_threads(1)
    rng = random.Random(seed)
    cache = FeatureCache(device="cpu", device_bytes=2 * MiB, host_bytes=2 * MiB,
                         host_slab_bytes=MiB, disk_path=path, disk_bytes=DISK_BYTES,
                         disk_sync=True, demote_queue_entries=16, disk_queue_entries=16)
    os.write(ready, b"r")
    i = 0
    while True:
        key = crash_key(run, i)
        cache.put(key, _procs.value_for(key))
        i += 1
        progress[:8] = struct.pack("<Q", i)
        roll = rng.random()
        if roll < 0.4:  # a read of an older entry: a promotion from host or disk, an LRU touch
            old = crash_key(run, rng.randrange(i))
            got = cache.get(old)
            if got is not None and not rel.same_bits(got, _procs.value_for(old)):
                os._exit(WRONG_EXIT)
        elif roll < 0.5:  # a replacement of an older entry (the same value: it derives from the key)
            old = crash_key(run, rng.randrange(i))
            cache.put(old, _procs.value_for(old))
        elif roll < 0.52:
            cache.discard(crash_key(run, rng.randrange(i)))


def run_and_kill(path: str, run: int, delay: float) -> int:
    """Fork the child, SIGKILL it ``delay`` s after its cache opened; its number of puts."""
    progress = mmap.mmap(-1, 8)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        try:
            os.close(read_end)
            heavy_demotion(path, run, 1000 + run, progress, write_end)
        finally:
            os._exit(1)
    os.close(write_end)
    try:
        ready, _, _ = select.select([read_end], [], [], 60)
        assert ready and os.read(read_end, 1) == b"r", "the child did not open its cache"
        time.sleep(delay)
        os.kill(pid, signal.SIGKILL)
    finally:
        os.close(read_end)
        _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (
        "the child saw a wrong value" if os.waitstatus_to_exitcode(status) == WRONG_EXIT
        else f"the child ended with status {status} before the kill"
    )
    return struct.unpack("<Q", progress[:8])[0]


@pytest.mark.slow
def test_sigkill_during_heavy_demotion_then_reopen_serves_only_exact_entries(tmp_path):
    store = tmp_path / "store"
    rng = random.Random(2024)
    lines = []
    totals = {"puts": 0, "survivors": 0, "served": 0, "wrong": 0, "raised": 0}
    for run in range(RUNS):
        delay = rng.uniform(0.05, 0.6)
        puts = run_and_kill(str(store), run, delay)
        books = check_books(store)  # whole transactions or nothing: the books add up
        on_disk = set(books["data"])
        with rel.disk_cache(store, DISK_BYTES) as cache:
            served = wrong = raised = 0
            for key in sorted(on_disk):  # every run's survivors, again after each new kill
                try:
                    got = cache.get(key)
                except Exception:
                    raised += 1
                    continue
                if got is not None:
                    served += 1
                    wrong += not rel.same_bits(got, _procs.value_for(key))
            for i in range(puts + 1):  # keys not on disk are plain misses
                key = crash_key(run, i)
                if key not in on_disk:
                    try:
                        raised += cache.get(key) is not None
                    except Exception:
                        raised += 1
            stats = cache.stats()["disk"]
        survivors = sum(k.startswith(b"heavy-%d-" % run) for k in on_disk)
        lines.append(f"  run {run}: killed after {delay * 1000:.0f} ms and {puts} puts; "
                     f"{survivors} of its entries on disk; {served} served in all, {wrong} wrong")
        assert wrong == 0 and raised == 0, lines[-1]
        assert served == len(on_disk) and stats["corrupt"] == stats["errors"] == 0
        totals["puts"] += puts
        totals["survivors"] += survivors
        totals["served"] += served
        totals["wrong"] += wrong
        totals["raised"] += raised
    print("\n" + "\n".join(lines))
    rel.report("crash/sigkill-during-heavy-demotion", runs=RUNS, faults=RUNS,
               wrong=totals["wrong"], failed=totals["raised"], puts_before_kills=totals["puts"],
               entries_surviving=totals["survivors"], reads_after_reopens=totals["served"])
    assert totals["survivors"] > 0, "no entry ever reached the disk: the kills came too early"
