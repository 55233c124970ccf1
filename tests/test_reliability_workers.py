"""Stuck and dead background workers: the request path keeps answering, correctly.

featcache has two background threads per cache: the demoter (device -> host copies) and the disk
writer (LMDB transactions). Here each is held inside a job (stuck: a slow copy engine, a hung
file system) or killed (a job raises an exception that ends the thread). Requests must keep
answering from the tiers above, never with a value other than the last one put, and the failure
must be visible: logged once, ``workers_alive``/``worker_errors``/``drops``/queue depths in stats.

Already proven elsewhere and not repeated: a worker whose jobs raise ``Exception`` keeps running,
counts and logs once (tests/test_cache.py::test_a_failing_worker_is_counted_and_requests_still_work);
LMDB failing every call (tests/test_disk_durability.py::test_lmdb_errors_never_escape_the_public_api).
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from featcache import FeatureCache

try:
    import _reliability as rel
except ImportError:  # tests/ became a package
    from tests import _reliability as rel

MiB = 1 << 20


def key(i: int) -> bytes:
    return b"worker-%d" % i


def feats(i: int) -> torch.Tensor:
    return torch.full((16, 256), float(i))  # 16 KiB


class Gate:
    """Holds a worker inside ``obj.name(...)`` until opened (a stuck copy engine or disk)."""

    def __init__(self, obj: object, name: str) -> None:
        self.entered = threading.Event()
        self.open = threading.Event()
        self._inner = getattr(obj, name)
        setattr(obj, name, self)

    def __call__(self, *args, **kwargs):
        self.entered.set()
        self.open.wait(60)
        return self._inner(*args, **kwargs)


class Killed(BaseException):
    """Not an ``Exception``: the worker's per-job guard lets it through and the thread ends."""


def kill(worker) -> None:
    """End ``worker``'s thread at its next job; wait until it is dead."""

    def die(item):
        raise Killed("injected: the worker thread dies")

    worker._handle = die  # an instance attribute: the thread's loop calls this
    worker._offer("poison")  # any item: the thread takes it and dies
    worker._thread.join(10)
    assert not worker.alive


def serve_all(cache: FeatureCache, want: dict[bytes, torch.Tensor]) -> dict[str, int]:
    seen = {"served": 0, "missed": 0, "wrong": 0, "raised": 0}
    for k, t in want.items():
        try:
            got = cache.get(k)
        except Exception:
            seen["raised"] += 1
            continue
        if got is None:
            seen["missed"] += 1
        else:
            seen["served" if rel.same_bits(got, t) else "wrong"] += 1
    return seen


@pytest.mark.parametrize("stuck", ["demoter", "disk-writer"])
def test_stuck_worker_requests_keep_answering_from_the_tiers_above(tmp_path, stuck):
    n = 300
    cache = FeatureCache(device="cpu", device_bytes=8 * MiB, host_bytes=2 * MiB,
                         disk_path=tmp_path / "store", disk_bytes=64 * MiB)
    try:
        if stuck == "demoter":
            gate = Gate(cache._copier, "to_host")
        else:
            gate = Gate(rel.tier_slot(cache, "disk").tier, "write_batch")
        want: dict[bytes, torch.Tensor] = {}
        slowest = 0.0
        failed = wrong = 0
        for i in range(n):
            want[key(i)] = feats(i)
            started = time.perf_counter()
            try:
                cache.put(key(i), feats(i))
                got = cache.get(key(i))
            except Exception:
                failed += 1
                continue
            slowest = max(slowest, time.perf_counter() - started)
            wrong += not rel.same_bits(got, want[key(i)])
            if i == 0:
                assert gate.entered.wait(10), "the worker never took the first job"
        if stuck == "disk-writer":
            rel.in_thread(cache._demoter.join_queue)  # every put has reached the writer
        seen = serve_all(cache, want)
        stats = cache.stats()
        assert failed == wrong == 0
        assert seen == {"served": n, "missed": 0, "wrong": 0, "raised": 0}
        assert stats["cache"]["workers_alive"] == 1 and stats["cache"]["worker_errors"] == 0
        if stuck == "demoter":  # 1 job held + a full queue; every later copy is dropped
            assert stats["cache"]["demote_queue"] == 64
            assert stats["host"]["drops"] == stats["disk"]["drops"] == n - 65
        else:  # host copies go on; disk writes beyond the writer's limit are dropped
            assert stats["host"]["entries"] > 0
            assert stats["disk"]["drops"] == n - 64
        assert slowest < 0.5, f"a put+get took {slowest:.3f} s behind a stuck worker"
        gate.open.set()
        rel.in_thread(cache.flush)
        assert serve_all(cache, want)["wrong"] == 0
        drops = cache.stats()["disk"]["drops"]  # the writer may drop one more when released
        assert cache.stats()["disk"]["entries"] == n - drops
    finally:
        gate.open.set()
        rel.in_thread(cache.close)
    rel.report(f"workers/stuck-{stuck}", runs=1, faults=1, wrong=wrong + seen["wrong"],
               failed=failed + seen["raised"], requests=2 * n + n, disk_drops=drops,
               slowest_put_get_ms=round(slowest * 1000, 2))


def test_stuck_disk_writer_keeps_its_queue_bounded_under_disk_reads(tmp_path):
    """Each disk hit queues an LRU touch for the writer: with the writer stuck, reads must not
    grow its queue without bound (touches are hints; puts and discards are bounded elsewhere)."""
    store = tmp_path / "store"
    cache = rel.disk_cache(store)
    try:
        want = {key(i): feats(i) for i in range(50)}
        for k, t in want.items():
            cache.put(k, t.clone())
        rel.in_thread(cache.flush)
        gate = Gate(rel.tier_slot(cache, "disk").tier, "write_batch")
        cache.put(b"hold", feats(-1))
        assert gate.entered.wait(10)
        reads = 0
        for _ in range(200):
            seen = serve_all(cache, want)
            assert seen["served"] == len(want)
            reads += len(want)
        depth = cache.stats()["cache"]["disk_queue"]
        gate.open.set()
        rel.in_thread(cache.flush)
    finally:
        gate.open.set()
        rel.in_thread(cache.close)
    assert depth <= 2048, f"{reads} reads queued {depth} touches behind a stuck writer"
    rel.report("workers/stuck-disk-writer-under-disk-reads", runs=1, faults=1, wrong=0, failed=0,
               requests=reads, writer_queue_depth=depth)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_dead_demoter_requests_keep_answering_failure_visible(tmp_path, caplog):
    cache = FeatureCache(device="cpu", device_bytes=8 * MiB, host_bytes=2 * MiB,
                         disk_path=tmp_path / "store", disk_bytes=64 * MiB)
    try:
        before = {key(i): feats(i) for i in range(20)}
        for k, t in before.items():
            cache.put(k, t.clone())
        rel.in_thread(cache.flush)
        kill(cache._demoter)
        after = {key(i): feats(1000 + i) for i in range(10, 60)}  # 10 keys replaced
        for k, t in after.items():
            cache.put(k, t.clone())
        cache.discard(key(0))
        want = {**before, **after}
        del want[key(0)]
        seen = serve_all(cache, want)
        assert cache.get(key(0)) is None
        rel.in_thread(cache.flush)  # returns: a dead worker is not waited for
        stats = cache.stats()
        assert seen == {"served": len(want), "missed": 0, "wrong": 0, "raised": 0}
        assert stats["cache"]["workers_alive"] == 0 and stats["cache"]["worker_errors"] >= 1
        assert stats["host"]["drops"] == stats["disk"]["drops"] == len(after)
        died = [r for r in caplog.records if "stopped" in r.getMessage()]
        assert len(died) == 1, "the worker's death is logged once"
        # With the upper tiers gone (a restart), only values still current are served.
        cache._chain.top.discard(key(0))
        for k in want:
            cache._chain.top.discard(k)
            cache._chain.staging.discard(k)
        late = serve_all(cache, want)
        assert late["wrong"] == late["raised"] == 0 and cache.get(key(0)) is None
    finally:
        rel.in_thread(cache.close)
    rel.report("workers/dead-demoter", runs=1, faults=1, wrong=seen["wrong"] + late["wrong"],
               failed=seen["raised"] + late["raised"], requests=len(after) + 1 + 2 * len(want),
               host_drops=stats["host"]["drops"], disk_drops=stats["disk"]["drops"],
               served_after_upper_tiers_cleared=late["served"])


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_dead_disk_writer_never_lets_the_disk_serve_a_replaced_or_discarded_value(tmp_path, caplog):
    cache = FeatureCache(device="cpu", device_bytes=0, host_bytes=0,
                         disk_path=tmp_path / "store", disk_bytes=64 * MiB)
    try:
        old = {key(i): feats(i) for i in range(40)}
        for k, t in old.items():
            cache.put(k, t.clone())
        rel.in_thread(cache.flush)
        kill(rel.tier_slot(cache, "disk").writer)
        replaced = {key(i): feats(1000 + i) for i in range(10)}
        for k, t in replaced.items():
            cache.put(k, t.clone())  # reaches no tier: device and host are off, the disk is stuck
        for i in range(10, 20):
            cache.discard(key(i))
        rel.in_thread(cache.flush)
        wrong = 0
        for i in range(20):  # replaced or discarded: a miss, never the disk's older value
            got = cache.get(key(i))
            wrong += got is not None and not rel.same_bits(got, replaced.get(key(i), feats(-1)))
        kept = {key(i): old[key(i)] for i in range(20, 40)}
        seen = serve_all(cache, kept)  # untouched since the death: still served from disk
        stats = cache.stats()
        assert wrong == 0, f"{wrong} replaced or discarded values served from disk"
        assert seen == {"served": 20, "missed": 0, "wrong": 0, "raised": 0}
        assert stats["cache"]["workers_alive"] == 0
        assert stats["disk"]["drops"] == len(replaced)
        assert len([r for r in caplog.records if "stopped" in r.getMessage()]) == 1
    finally:
        rel.in_thread(cache.close)
    rel.report("workers/dead-disk-writer", runs=1, faults=1, wrong=wrong + seen["wrong"],
               failed=seen["raised"], requests=10 + 10 + 20 + 20, disk_drops=stats["disk"]["drops"])
