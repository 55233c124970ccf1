"""Child-process bodies for tests/test_disk_durability.py (started with the "spawn" context).

They live in a module of their own so that a spawned child imports only this file, torch and
featcache, not the test module. Every value a child writes is derived from its key by
``value_for``, so any process can check any entry it reads without being told what was written.
"""

from __future__ import annotations

import os
import queue
import time
import zlib

import torch

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int32)


def value_for(key: bytes) -> torch.Tensor:
    """A tensor determined by ``key`` alone: dtype, shape (1..16 x 512) and contents."""
    seed = zlib.crc32(key)
    gen = torch.Generator().manual_seed(seed)
    rows = 1 + seed % 16
    dtype = _DTYPES[(seed >> 4) % len(_DTYPES)]
    if dtype.is_floating_point:
        return torch.randn(rows, 512, generator=gen).to(dtype)
    return torch.randint(-(2**31), 2**31 - 1, (rows, 512), generator=gen, dtype=dtype)


def same_bits(a: torch.Tensor | None, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (NaN-safe, unlike ``torch.equal``)."""
    if a is None or a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
    )


def crash_key(run: int, i: int) -> bytes:
    return b"crash-%d-%d" % (run, i)


def shared_value(key: bytes, who: bytes) -> torch.Tensor:
    return value_for(key + b"|" + who)


def _open(path: str, disk_bytes: int, **options):
    from featcache import FeatureCache

    torch.set_num_threads(1)
    return FeatureCache(
        device="cpu", device_bytes=0, host_bytes=0, disk_path=path, disk_bytes=disk_bytes,
        **options,
    )


def two_process_child(
    path: str, disk_bytes: int, n_first: int, n_second: int, n_shared: int, q, go
) -> None:
    """Phase 1: write ``child-a-*``, flush, report. Phase 2 (after ``go``): write ``child-b-*`` and
    ``shared-*`` concurrently with the parent, reading shared keys back as it goes."""
    try:
        cache = _open(path, disk_bytes)
        first = [b"child-a-%d" % i for i in range(n_first)]
        for i, key in enumerate(first):
            cache.put(key, value_for(key))
            if i % 8 == 7:
                cache.flush()
        cache.flush()
        q.put(("phase1", [k for k in first if k in cache]))
        if not go.wait(120):
            q.put(("error", "parent never said go"))
            return
        bad: list[bytes] = []
        shared = [b"shared-%d" % i for i in range(n_shared)]
        for i in range(n_second):
            own = b"child-b-%d" % i
            cache.put(own, value_for(own))
            key = shared[i % n_shared]
            cache.put(key, shared_value(key, b"child"))
            if i % 4 == 3:
                cache.flush()
                for k in shared:
                    got = cache.get(k)
                    if got is not None and not (
                        same_bits(got, shared_value(k, b"child"))
                        or same_bits(got, shared_value(k, b"parent"))
                    ):
                        bad.append(k)
                got = cache.get(own)
                if got is not None and not same_bits(got, value_for(own)):
                    bad.append(own)
        cache.flush()
        stats = cache.stats()
        cache.close()
        q.put(("phase2", bad, stats))
    except BaseException as e:  # report instead of dying silently
        q.put(("error", f"{type(e).__name__}: {e}"))
        raise


def crash_writer(path: str, disk_bytes: int, run: int, q, limit: int = 100_000) -> None:
    """Write ``crash-<run>-<i>`` entries forever (until SIGKILLed), with fsync on.

    Every 8 puts: flush, then report the indices confirmed on disk. Now and then an older key is
    put again (same value, derived from the key) so that replacements are in flight too.
    """
    cache = _open(path, disk_bytes, disk_sync=True)
    q.put(("ready", os.getpid()))
    i = 0
    while i < limit:
        batch = []
        for _ in range(8):
            key = crash_key(run, i)
            cache.put(key, value_for(key))
            batch.append(i)
            if i >= 20 and i % 5 == 0:
                old = crash_key(run, i - 20)
                cache.put(old, value_for(old))
            i += 1
        cache.flush()
        confirmed = [j for j in batch if crash_key(run, j) in cache]
        try:
            q.put(("flushed", confirmed), timeout=10)
        except queue.Full:
            pass
    q.put(("done", i))
    cache.close()


def big_writer(path: str, disk_bytes: int, n: int, q) -> None:
    """Fill the store with ``n`` entries of 1 MiB (no fsync), then report and exit."""
    try:
        with _open(path, disk_bytes, disk_sync=False) as cache:
            for i in range(n):
                cache.put(b"big-%d" % i, torch.full((256 * 1024,), float(i)))
                if i % 8 == 7:
                    cache.flush()
            cache.flush()
            q.put(("written", cache.stats()["disk"]))
    except BaseException as e:
        q.put(("error", f"{type(e).__name__}: {e}"))
        raise


def reader_killed_mid_read(path: str, q) -> None:
    """Stand-in for a reader process SIGKILLed while inside a read transaction (as a ``get``
    copying a large payload out can be): it opens one, reports, and waits to be killed."""
    import lmdb

    env = lmdb.open(path, max_dbs=4, map_size=1 << 30, readonly=True)
    txn = env.begin()
    q.put(("reading", txn.id()))
    time.sleep(600)


# -- load (tests/test_reliability_load.py) --------------------------------------------------------
LOAD_KEYS = [b"load-%d" % i for i in range(48)]


def load_writers(processes: int, threads: int) -> list[bytes]:
    return [b"p%d-t%d" % (p, t) for p in range(processes) for t in range(threads)]


def digest(t: torch.Tensor) -> tuple[object, ...]:
    """Identity of a tensor's dtype, shape and bytes (cheap to compare, NaN-safe)."""
    import xxhash

    raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return (t.dtype, tuple(t.shape), xxhash.xxh3_128_digest(raw))


def allowed_digests(writers: list[bytes]) -> dict[tuple[bytes, bytes], tuple[object, ...]]:
    """(key, writer) -> digest of the value that writer puts under key."""
    return {(k, w): digest(shared_value(k, w)) for k in LOAD_KEYS for w in writers}


def load_budgets(cache) -> list[str]:
    """Budget violations right now (every tier's books; the host tier's blocks and slabs)."""
    bad = []
    for slot in cache._chain.slots:
        tier = slot.tier
        pool = getattr(tier, "pool", None)
        held = max(tier.used_bytes, pool.allocated_bytes if pool is not None else 0)
        if held > tier.capacity_bytes and tier.capacity_bytes > 0:
            bad.append(f"{tier.name} {held} > {tier.capacity_bytes}")
    return bad


def tier_slot(cache, name: str):
    """The slot of ``cache``'s tier named ``name`` (tests look tiers up by name; the cache never
    does)."""
    return next(slot for slot in cache._chain.slots if slot.tier.name == name)


def load_thread(cache, who: bytes, allowed, seconds: float, seed: int, stop) -> dict[str, int]:
    """Mix put/get/acquire on shared keys for ``seconds``; count what was seen.

    Every value served must be one some writer put under that key (its digest is in
    ``allowed``), a lease's metadata must name the writer of its tensor, a leased tensor must
    not change while leased, and a key leased by this thread alone (``own``) must stay in the
    device tier until released whatever the other threads put meanwhile.
    """
    import random

    rng = random.Random(seed)
    per_key = {}
    for (k, w), d in allowed.items():
        per_key.setdefault(k, {})[d] = w
    own = b"own-" + who
    own_value = value_for(own)
    counts = dict(ops=0, puts=0, gets=0, acquires=0, hits=0, leases=0, own_leases=0, wrong=0,
                  raised=0,
                  lease_evicted=0, lease_changed=0)

    def check(key: bytes, t, meta: bytes | None = None) -> None:
        writer = per_key[key].get(digest(t))
        if writer is None or (meta is not None and meta != writer):
            counts["wrong"] += 1

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not stop.is_set():
        counts["ops"] += 1
        key = rng.choice(LOAD_KEYS)
        roll = rng.random()
        try:
            if roll < 0.35:
                cache.put(key, shared_value(key, who), meta=who)
                counts["puts"] += 1
            elif roll < 0.75:
                counts["gets"] += 1
                got = cache.get(key)
                if got is not None:
                    counts["hits"] += 1
                    check(key, got)
            elif roll < 0.92:
                counts["acquires"] += 1
                lease = cache.acquire(key)
                if lease is not None:
                    counts["leases"] += 1
                    check(key, lease.tensor, lease.meta)
                    before = digest(lease.tensor)
                    other = rng.choice(LOAD_KEYS)
                    cache.put(other, shared_value(other, who), meta=who)
                    counts["puts"] += 1
                    if digest(lease.tensor) != before:
                        counts["lease_changed"] += 1
                    lease.release()
            else:
                cache.put(own, own_value.clone())
                counts["puts"] += 1
                counts["acquires"] += 1
                lease = cache.acquire(own)
                if lease is not None and cache._chain.top.contains(own):
                    counts["own_leases"] += 1
                    for _ in range(6):  # pressure: other entries must go, not this one
                        other = rng.choice(LOAD_KEYS)
                        cache.put(other, shared_value(other, who), meta=who)
                        counts["puts"] += 1
                        if not cache._chain.top.contains(own):
                            counts["lease_evicted"] += 1
                    if not same_bits(lease.tensor, own_value):
                        counts["lease_changed"] += 1
                if lease is not None:
                    lease.release()
        except Exception:
            counts["raised"] += 1
    return counts


def run_load(cache, prefix: int, threads: int, writers, seconds: float) -> dict[str, int]:
    """``threads`` load threads plus a budget sampler in this process; summed counts."""
    import threading

    allowed = allowed_digests(writers)
    stop = threading.Event()
    results: list[dict[str, int]] = []
    lock = threading.Lock()
    samples = {"samples": 0, "over_budget": 0}
    violations: list[str] = []

    def body(t: int) -> None:
        out = load_thread(cache, b"p%d-t%d" % (prefix, t), allowed, seconds, 1000 * prefix + t,
                          stop)
        with lock:
            results.append(out)

    def sampler() -> None:
        while not stop.is_set():
            bad = load_budgets(cache)
            samples["samples"] += 1
            if bad:
                samples["over_budget"] += 1
                violations.extend(bad)
            time.sleep(0.002)

    workers = [threading.Thread(target=body, args=(t,), daemon=True) for t in range(threads)]
    watcher = threading.Thread(target=sampler, daemon=True)
    watcher.start()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    stop.set()
    watcher.join()
    total: dict[str, int] = dict(samples)
    for out in results:
        for k, v in out.items():
            total[k] = total.get(k, 0) + v
    total["violations"] = violations[:5]  # type: ignore[assignment]
    return total


# Every tier's budget is below the 610 KiB that one value per shared key takes, so each tier
# must evict whatever the timing (with 1 MiB of host the 48 keys fitted, and a slow machine's
# host tier never evicted).
LOAD_BUDGETS = dict(device_bytes=512 << 10, host_bytes=384 << 10, disk_bytes=384 << 10,
                    host_slab_bytes=128 << 10, disk_sync=False)


def load_child(path: str, prefix: int, threads: int, processes: int, seconds: float, q, go) -> None:
    """One more process of the load test: same workload, own writers, the same store."""
    try:
        from featcache import FeatureCache

        torch.set_num_threads(1)
        cache = FeatureCache(device="cpu", disk_path=path, **LOAD_BUDGETS)
        writers = load_writers(processes, threads)
        q.put(("ready", prefix))
        if not go.wait(120):
            q.put(("error", "parent never said go"))
            return
        out = run_load(cache, prefix, threads, writers, seconds)
        cache.flush()
        out["stats"] = cache.stats()  # type: ignore[assignment]
        cache.close()
        q.put(("done", out))
    except BaseException as e:  # report instead of dying silently
        q.put(("error", f"{type(e).__name__}: {e}"))
        raise


# -- live-store tools (tests/test_reliability_live.py) ---------------------------------------------
def churn_writer(path: str, disk_bytes: int, who: int, keys: int, q, stop) -> None:
    """Put and discard ``churn-<i>`` entries (values from ``value_for``) until ``stop`` is set, on a
    budget small enough that eviction runs all the time: pages are freed and reused constantly."""
    import random

    try:
        rng = random.Random(who)
        with _open(path, disk_bytes, disk_sync=False) as cache:
            q.put(("ready", os.getpid()))
            n = 0
            while not stop.is_set():
                key = b"churn-%d" % rng.randrange(keys)
                if rng.random() < 0.2:
                    cache.discard(key)
                else:
                    cache.put(key, value_for(key))
                n += 1
                if n % 16 == 0:
                    cache.flush()
            q.put(("done", n))
    except BaseException as e:
        q.put(("error", f"{type(e).__name__}: {e}"))
        raise
