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
