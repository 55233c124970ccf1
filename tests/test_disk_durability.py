"""Durability of the disk (LMDB) tier, seen through the public API.

Persistence across reopen, two processes on one directory, SIGKILL mid-write, corrupted and
truncated values, a foreign format tag, the byte budget with LRU eviction, and permissions.
Caches here use ``device_bytes=0, host_bytes=0`` wherever reads must come from disk.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import queue
import shutil
import signal
import stat
import struct
import tempfile
import threading
import time
import weakref
from pathlib import Path

import lmdb
import pytest
import torch

import featcache
import featcache.codec
from featcache import FeatureCache, StoreFormatError, StoreOpenError, image_key
from featcache.tiers.base import Entry
from featcache.tiers.disk import DiskOp, DiskTier

try:
    import _procs
except ImportError:  # tests/ became a package
    from tests import _procs

HEADER_BYTES = featcache.codec.HEADER.size  # what every stored value adds to the tensor's bytes
SPAWN = mp.get_context("spawn")


# -- helpers ----------------------------------------------------------------------------------
def open_disk_cache(path: Path, disk_bytes: int | str = "64MiB", **options) -> FeatureCache:
    """A cache whose every read comes from disk (device and host tiers disabled)."""
    return FeatureCache(
        device="cpu", device_bytes=0, host_bytes=0, disk_path=path, disk_bytes=disk_bytes,
        **options,
    )


def assert_same(got: torch.Tensor | None, want: torch.Tensor) -> None:
    assert got is not None, "entry missing"
    assert got.dtype == want.dtype
    assert tuple(got.shape) == tuple(want.shape)
    assert _procs.same_bits(got, want)


def stored_size(t: torch.Tensor) -> int:
    return t.nbytes + HEADER_BYTES


def raw_env(path: Path, readonly: bool = False) -> lmdb.Environment:
    # Never while a FeatureCache of this process has the directory open (LMDB forbids opening
    # one environment twice in a process).
    return lmdb.open(str(path), max_dbs=4, map_size=1 << 30, readonly=readonly)


def rewrite_value(path: Path, key: bytes, change) -> bytes:
    """Replace the raw stored value of ``key`` by ``change(old)``; return the old value."""
    env = raw_env(path)
    try:
        data = env.open_db(b"data")
        with env.begin(write=True) as txn:
            old = txn.get(key, db=data)
            assert old is not None, f"{key!r} is not stored"
            txn.put(key, change(bytes(old)), db=data)
    finally:
        env.close()
    return bytes(old)


def read_books(path: Path) -> dict[str, dict[bytes, bytes]]:
    """Every record of every table of a closed store."""
    env = raw_env(path, readonly=True)
    try:
        out: dict[str, dict[bytes, bytes]] = {}
        for name in ("data", "meta", "lru", "info"):
            db = env.open_db(name.encode(), create=False)
            with env.begin(db=db) as txn:
                out[name] = {bytes(k): bytes(v) for k, v in txn.cursor()}
        return out
    finally:
        env.close()


def check_books(path: Path) -> dict[str, dict[bytes, bytes]]:
    """The on-disk accounting is consistent: data, meta and lru agree and used_bytes adds up."""
    books = read_books(path)
    data, meta, lru = books["data"], books["meta"], books["lru"]
    assert set(data) == set(meta), "data and meta disagree on keys"
    assert len(lru) == len(meta)
    for key, raw in meta.items():
        stamp, size = struct.unpack("<QQ", raw)
        assert size == len(data[key]), f"meta size of {key!r} is not its value's length"
        assert struct.pack(">Q", stamp) + key in lru, f"{key!r} missing from the lru table"
    used = struct.unpack("<Q", books["info"][b"used_bytes"])[0]
    assert used == sum(len(v) for v in data.values())
    return books


def flush_or_fail(cache: FeatureCache, timeout: float = 60.0) -> None:
    """flush(), failing (instead of hanging the suite) if the writer is stuck."""
    t = threading.Thread(target=cache.flush, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "flush() did not return: the disk writer is stuck"


def close_quietly(cache: FeatureCache, timeout: float = 60.0) -> None:
    """close() for finally blocks: a stuck writer (already reported) must not hang the suite."""
    t = threading.Thread(target=cache.close, daemon=True)
    t.start()
    t.join(timeout)


def get_message(q, proc, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while True:
        try:
            msg = q.get(timeout=0.5)
        except queue.Empty:
            if not proc.is_alive():
                raise AssertionError(
                    f"child exited with {proc.exitcode} without reporting"
                ) from None
            if time.monotonic() > deadline:
                raise AssertionError("child did not report in time") from None
            continue
        assert msg[0] != "error", f"child failed: {msg[1]}"
        return msg


def stop(proc) -> None:
    if proc.is_alive():
        os.kill(proc.pid, signal.SIGKILL)
    proc.join(30)


def sample_tensors() -> dict[bytes, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    base = torch.randn(64, 48, generator=g)
    special = torch.tensor([float("nan"), -0.0, float("inf"), -float("inf"), 65504.0, 6e-8])
    tensors = {
        "bf16": torch.randn(3, 577, 64, generator=g).to(torch.bfloat16),
        "fp16": torch.randn(257, 1024, generator=g).to(torch.float16),
        "fp32": torch.randn(16, 4096, generator=g),
        "fp64": torch.randn(7, 9, generator=g, dtype=torch.float64),
        "int64": torch.randint(-(2**62), 2**62, (33, 3), generator=g, dtype=torch.int64),
        "int32": torch.randint(-(2**31), 2**31 - 1, (5, 6, 7), generator=g, dtype=torch.int32),
        "int16": torch.randint(-(2**15), 2**15 - 1, (100,), generator=g, dtype=torch.int16),
        "int8": torch.randint(-128, 127, (2, 2, 2, 2), generator=g, dtype=torch.int8),
        "uint8": torch.randint(0, 255, (3, 224, 224), generator=g, dtype=torch.uint8),
        "bool": torch.rand(13, 17, generator=g) > 0.5,
        "fp8": torch.randn(8, 64, generator=g).to(torch.float8_e4m3fn),
        "scalar-fp32": torch.tensor(3.25),
        "scalar-int64": torch.tensor(-(2**40), dtype=torch.int64),
        "scalar-bf16": torch.tensor(-1.5, dtype=torch.bfloat16),
        "empty": torch.empty(0, 16),
        "specials-fp16": special.to(torch.float16),
        "8-dims": torch.arange(256, dtype=torch.int16).reshape(2, 2, 2, 2, 2, 2, 2, 2),
        "transposed": base.t(),  # non-contiguous input
        "slice": base[10:20, 5:9],  # a view into a larger tensor
        "large-bf16": torch.randn(7, 1024, 1024, generator=g).to(torch.bfloat16),  # ~14.7 MB
    }
    # the digests alone (bytes): an ImageKey would record its namespace in each entry's metadata,
    # and the sizes these tests count are header + payload
    return {bytes(image_key(name.encode(), namespace="durability")): t for name, t in tensors.items()}


# -- 1. persistence -----------------------------------------------------------------------------
def test_entries_persist_across_reopen_without_reading_payloads(tmp_path, monkeypatch):
    store = tmp_path / "store"
    tensors = sample_tensors()
    want = {k: t.clone() for k, t in tensors.items()}  # the cache owns what was put
    with open_disk_cache(store) as cache:
        for key, t in tensors.items():
            cache.put(key, t)
            cache.flush()  # one at a time: the ~14 MB entry must not overflow any queue
        before = cache.stats()["disk"]
        for key, t in want.items():
            assert_same(cache.get(key), t)
    assert before["entries"] == len(want)
    assert before["bytes"] == sum(stored_size(t) for t in want.values())
    assert before["drops"] == before["errors"] == before["corrupt"] == 0

    calls = {"verify": 0, "decode_header": 0}

    def counting(name):
        original = getattr(featcache.codec, name)

        def wrapper(*args, **kwargs):
            calls[name] += 1
            return original(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(featcache.codec, "verify", counting("verify"))
    monkeypatch.setattr(featcache.codec, "decode_header", counting("decode_header"))
    started = time.perf_counter()
    reopened = open_disk_cache(store)
    opened_in = time.perf_counter() - started
    try:
        assert calls == {"verify": 0, "decode_header": 0}, "the reopen read payloads"
        after = reopened.stats()["disk"]
        assert (after["entries"], after["bytes"]) == (before["entries"], before["bytes"])
        assert after["capacity_bytes"] == 64 << 20
        for key, t in want.items():
            got = reopened.get(key)
            assert_same(got, t)
            if t.dtype.itemsize > 1 and not t.to(torch.float64).isnan().any():
                assert torch.equal(got, t)  # what a user would compare with
        assert calls["verify"] == len(want), "every disk read is verified"
        stats = reopened.stats()
        assert stats["disk"]["hits"] == len(want) and stats["disk"]["misses"] == 0
        assert stats["cache"]["hits"] == len(want)
        assert reopened.get(bytes(image_key(b"never-put", namespace="durability"))) is None
    finally:
        reopened.close()
    print(f"\nreopen of {before['entries']} entries / {before['bytes']} bytes: {opened_in:.3f}s")


# -- 2. two processes on one directory ---------------------------------------------------------
@pytest.mark.slow
def test_two_processes_share_one_directory(tmp_path):
    store = tmp_path / "store"
    budget = 1 << 20  # small: both writers evict from the same books
    n_first, n_second, n_shared = 24, 96, 12
    parent = open_disk_cache(store, budget)
    q, go = SPAWN.Queue(), SPAWN.Event()
    child = SPAWN.Process(
        target=_procs.two_process_child,
        args=(str(store), budget, n_first, n_second, n_shared, q, go),
        daemon=True,
    )
    child.start()
    try:
        # Phase 1: the child writes and flushes; this process, open all along, reads them.
        _, written = get_message(q, child)
        assert len(written) == n_first, "the child's flushed puts are on disk"
        for key in written:
            assert_same(parent.get(key), _procs.value_for(key))
        assert parent.stats()["disk"]["entries"] == n_first

        # Phase 2: both write at once, to own keys and to the same shared keys.
        go.set()
        shared = [b"shared-%d" % i for i in range(n_shared)]
        bad = []
        for i in range(n_second):
            own = b"parent-b-%d" % i
            parent.put(own, _procs.value_for(own))
            key = shared[i % n_shared]
            parent.put(key, _procs.shared_value(key, b"parent"))
            if i % 4 == 3:
                flush_or_fail(parent)
                assert parent.stats()["disk"]["bytes"] <= budget
                for k in shared:
                    got = parent.get(k)
                    if got is not None and not (
                        _procs.same_bits(got, _procs.shared_value(k, b"parent"))
                        or _procs.same_bits(got, _procs.shared_value(k, b"child"))
                    ):
                        bad.append(k)
        flush_or_fail(parent)
        _, child_bad, child_stats = get_message(q, child)
        child.join(60)
        assert child.exitcode == 0
        assert bad == [] and child_bad == [], "a process was served a value never put"
        assert child_stats["disk"]["errors"] == 0 and child_stats["disk"]["corrupt"] == 0
        assert child_stats["cache"]["worker_errors"] == 0

        stats = parent.stats()
        assert 0 < stats["disk"]["bytes"] <= budget
        assert stats["disk"]["errors"] == stats["disk"]["corrupt"] == 0
        assert stats["cache"]["worker_errors"] == 0
        served = 0
        allowed: dict[bytes, list[torch.Tensor]] = {}
        for i in range(n_first):
            allowed[b"child-a-%d" % i] = [_procs.value_for(b"child-a-%d" % i)]
        for i in range(n_second):
            for who in (b"child-b-%d" % i, b"parent-b-%d" % i):
                allowed[who] = [_procs.value_for(who)]
        for k in shared:
            allowed[k] = [_procs.shared_value(k, b"parent"), _procs.shared_value(k, b"child")]
        for key, values in allowed.items():
            got = parent.get(key)
            if got is not None:
                served += 1
                assert any(_procs.same_bits(got, v) for v in values), f"bad value for {key!r}"
        assert served == stats["disk"]["entries"] > 0
        evictions = stats["disk"]["evictions"] + child_stats["disk"]["evictions"]
        print(f"\ntwo processes: {served} entries served after {evictions} evictions")
    finally:
        go.set()
        stop(child)
        close_quietly(parent)
    books = check_books(store)
    assert sum(len(v) for v in books["data"].values()) <= budget


# -- 3. SIGKILL mid-write ------------------------------------------------------------------------
@pytest.mark.slow
def test_sigkill_mid_write_loses_nothing_flushed_and_serves_nothing_wrong(tmp_path):
    store = tmp_path / "store"
    budget = 256 << 20  # no evictions: every confirmed entry must survive
    confirmed: set[bytes] = set()
    counts = []
    # This process keeps the store open through every kill, like a sibling worker would: it must
    # still write afterwards (LMDB's writer lock of a killed process must not stay held).
    survivor = open_disk_cache(store, budget)
    try:
        # (reports to wait for, then a short pause that moves the kill to another point of the
        # child's put/encode/commit/fsync cycle; the pause orders nothing)
        schedule = ((1, 0), (3, 0.002), (6, 0.01), (2, 0.03), (4, 0.07))
        for run, (reports, pause) in enumerate(schedule):
            q = SPAWN.Queue()
            child = SPAWN.Process(
                target=_procs.crash_writer, args=(str(store), budget, run, q), daemon=True
            )
            child.start()
            try:
                assert get_message(q, child)[0] == "ready"
                got = 0
                while got < reports:
                    kind, indices = get_message(q, child)
                    assert kind == "flushed"
                    confirmed.update(_procs.crash_key(run, j) for j in indices)
                    got += 1
                time.sleep(pause)
                os.kill(child.pid, signal.SIGKILL)  # the child is busy putting the next batch
                child.join(30)
                assert child.exitcode == -signal.SIGKILL
            finally:
                stop(child)
            # The surviving process still reads and writes.
            probe = b"survivor-%d" % run
            survivor.put(probe, _procs.value_for(probe))
            flush_or_fail(survivor)
            assert_same(survivor.get(probe), _procs.value_for(probe))
            for key in sorted(confirmed)[-8:]:
                assert_same(survivor.get(key), _procs.value_for(key))
            counts.append(reports)
        survivor_stats = survivor.stats()["disk"]
        assert survivor_stats["errors"] == survivor_stats["corrupt"] == 0
    finally:
        close_quietly(survivor)

    books = check_books(store)  # a crash never leaves the books half-updated
    on_disk = set(books["data"])
    crashed = {k for k in on_disk if k.startswith(b"crash-")}
    missing = confirmed - on_disk
    assert not missing, f"{len(missing)} entries reported flushed were lost, e.g. {min(missing)!r}"
    with open_disk_cache(store, budget) as cache:
        for key in sorted(on_disk):  # crash-* and survivor-* values both derive from the key
            assert_same(cache.get(key), _procs.value_for(key))
        stats = cache.stats()["disk"]
        assert stats["corrupt"] == stats["errors"] == 0
        assert stats["hits"] == len(on_disk)
        # And the store takes new writes after the crashes.
        cache.put(b"after-crash", _procs.value_for(b"after-crash"))
        cache.flush()
        assert_same(cache.get(b"after-crash"), _procs.value_for(b"after-crash"))
    print(
        f"\nSIGKILL runs: {len(counts)}; entries reported flushed: {len(confirmed)}; "
        f"on disk after the kills: {len(crashed)} (all verified, "
        f"{len(crashed - confirmed)} committed but unreported)"
    )


# -- 4. corruption ---------------------------------------------------------------------------
TARGET = torch.arange(256, dtype=torch.float32).reshape(4, 64) / 7  # 1024 payload bytes


# Header fields are located in the stored value itself, so the cases follow the header layout.
def _dims_at(value: bytes) -> int:
    at = value.find(struct.pack("<QQ", 4, 64))
    assert 0 < at < HEADER_BYTES
    return at


def _nbytes_at(value: bytes) -> int:
    at = value.find(struct.pack("<Q", TARGET.nbytes))
    assert 0 < at < _dims_at(value)
    return at


def _flip_at(where):
    def change(value: bytes) -> bytes:
        b = bytearray(value)
        b[where(value)] ^= 0xFF
        return bytes(b)

    return change


def _flip(offset: int):
    return _flip_at(lambda value: offset)


def _set_byte(offset: int, byte: int):
    def change(value: bytes) -> bytes:
        b = bytearray(value)
        b[offset] = byte
        return bytes(b)

    return change


def _swap_dims(value: bytes) -> bytes:  # (4, 64) -> (64, 4): same length, other shape
    at = _dims_at(value)
    b = bytearray(value)
    b[at : at + 8], b[at + 8 : at + 16] = value[at + 8 : at + 16], value[at : at + 8]
    return bytes(b)


CORRUPTIONS = {
    "payload-first-byte": _flip(HEADER_BYTES),
    "payload-middle-byte": _flip(HEADER_BYTES + 511),
    "payload-last-byte": _flip(-1),
    "header-magic": _flip(0),
    "header-version": _flip(4),
    "header-dtype-unknown": _flip(6),
    "header-dtype-fp32-as-int32": _set_byte(6, 8),  # same item size: only the checksum knows
    "header-ndim": _flip(7),
    "header-nbytes": _flip_at(_nbytes_at),
    "header-shape": _flip_at(_dims_at),
    "header-shape-swapped": _swap_dims,
    "header-checksum": _flip(HEADER_BYTES - 16),
    "truncated-inside-header": lambda v: v[: HEADER_BYTES // 2],
    "truncated-to-header": lambda v: v[:HEADER_BYTES],
    "truncated-payload": lambda v: v[:-4],
    "empty-value": lambda v: b"",
    "extra-bytes": lambda v: v + b"\0\0\0\0",
}


@pytest.mark.parametrize("how", list(CORRUPTIONS))
def test_corrupt_value_is_a_miss_then_dropped_and_replaceable(tmp_path, how):
    store = tmp_path / "store"
    key = bytes(image_key(b"target", namespace="durability"))
    neighbours = {
        bytes(image_key(b"n%d" % i, namespace="durability")): torch.randn(8, 8) for i in range(3)
    }
    with open_disk_cache(store) as cache:
        cache.put(key, TARGET.clone())
        for k, t in neighbours.items():
            cache.put(k, t.clone())
        cache.flush()
        before = cache.stats()["disk"]
    old = rewrite_value(store, key, CORRUPTIONS[how])
    assert len(old) == stored_size(TARGET)

    with open_disk_cache(store) as cache:
        assert cache.get(key) is None  # never the bad tensor, never an exception
        stats = cache.stats()
        assert stats["disk"]["corrupt"] == 1
        assert stats["disk"]["misses"] == 1 and stats["cache"]["misses"] == 1
        cache.flush()  # the writer deletes the bad value
        after = cache.stats()["disk"]
        assert after["entries"] == before["entries"] - 1
        assert after["bytes"] == before["bytes"] - stored_size(TARGET)
        assert key not in cache
        assert cache.get(key) is None
        assert cache.stats()["disk"]["corrupt"] == 1, "the bad value was read only once"
        for k, t in neighbours.items():
            assert_same(cache.get(k), t)
        replacement = TARGET * 2
        cache.put(key, replacement.clone())
        cache.flush()
        assert_same(cache.get(key), replacement)
        assert cache.stats()["disk"]["entries"] == before["entries"]
    check_books(store)
    with open_disk_cache(store) as cache:
        assert_same(cache.get(key), replacement)
        assert cache.stats()["disk"]["corrupt"] == 0


def test_every_single_bit_flip_in_a_header_is_caught(tmp_path):
    """One flipped bit at each header byte (and a few payload bytes): never served, all dropped."""
    store = tmp_path / "store"
    offsets = [*range(HEADER_BYTES), *(HEADER_BYTES + j for j in (0, 1, 255, 512, 1023))]
    keys = [b"flip-%d" % off for off in offsets]
    with open_disk_cache(store) as cache:
        for i, key in enumerate([*keys, b"good"]):
            cache.put(key, TARGET.clone())
            if i % 16 == 15:
                cache.flush()
    env = raw_env(store)
    try:
        data = env.open_db(b"data")
        with env.begin(write=True, db=data) as txn:
            for key, off in zip(keys, offsets, strict=True):
                value = bytearray(txn.get(key))
                value[off] ^= 0x01
                txn.put(key, bytes(value))
    finally:
        env.close()
    with open_disk_cache(store) as cache:
        served = []
        for i, key in enumerate(keys):
            if cache.get(key) is not None:
                served.append(key)
            if i % 16 == 15:
                cache.flush()  # the writer's queue takes the deletes a batch at a time
        cache.flush()
        assert served == [], "a value with a flipped bit was served"
        stats = cache.stats()["disk"]
        assert stats["corrupt"] == len(keys)
        assert stats["entries"] == 1 and stats["bytes"] == stored_size(TARGET)
        assert_same(cache.get(b"good"), TARGET)
    check_books(store)


# -- 5. format version -----------------------------------------------------------------------
def test_foreign_format_tag_is_refused_and_left_alone(tmp_path):
    store = tmp_path / "store"
    key = bytes(image_key(b"kept", namespace="durability"))
    with open_disk_cache(store) as cache:
        cache.put(key, torch.ones(3))
    env = raw_env(store)
    try:
        info = env.open_db(b"info")
        with env.begin(write=True, db=info) as txn:
            assert txn.get(b"format") == b"featcache-lmdb-2"
            txn.put(b"format", b"featcache-lmdb-99")
    finally:
        env.close()
    for _ in range(2):  # a refused open changes nothing: the second one refuses the same way
        with pytest.raises(StoreFormatError, match="featcache-lmdb-99") as exc:
            open_disk_cache(store)
        assert isinstance(exc.value, StoreOpenError)
        assert isinstance(exc.value, featcache.FeatCacheError)
    books = read_books(store)
    assert books["info"][b"format"] == b"featcache-lmdb-99"
    assert key in books["data"]


# -- 6. disk budget ----------------------------------------------------------------------------
def test_disk_budget_holds_after_every_flush(tmp_path):
    store = tmp_path / "store"
    budget = 1 << 20
    g = torch.Generator().manual_seed(7)
    sizes: dict[bytes, int] = {}
    with open_disk_cache(store, "1MiB") as cache:
        assert cache.stats()["disk"]["capacity_bytes"] == budget
        for i in range(240):
            key = b"budget-%d" % i
            t = torch.randn(int(torch.randint(1, 40_000, (), generator=g)), generator=g)
            cache.put(key, t)
            sizes[key] = stored_size(t)
            if i % 3 == 2:
                cache.flush()
                stats = cache.stats()["disk"]
                assert stats["bytes"] <= stats["capacity_bytes"] == budget
                present = [k for k in sizes if k in cache]
                assert stats["entries"] == len(present)
                assert stats["bytes"] == sum(sizes[k] for k in present)
        cache.flush()
        stats = cache.stats()["disk"]
        assert stats["evictions"] > 0 and stats["drops"] == stats["errors"] == 0
        # Larger than the whole budget: not stored at all (no other tier is enabled).
        cache.put(b"too-big", torch.zeros(budget // 4 + 1))
        cache.flush()
        assert b"too-big" not in cache
        assert cache.stats()["cache"]["not_stored"] == 1
    check_books(store)


def test_disk_eviction_is_lru_and_reads_count_as_use(tmp_path):
    store = tmp_path / "store"
    budget = 1 << 20
    value = torch.zeros(65536 - HEADER_BYTES, dtype=torch.uint8)  # 64 KiB stored: 16 fit exactly
    keys = [b"lru-%02d" % i for i in range(22)]
    with open_disk_cache(store, budget) as cache:
        for i, key in enumerate(keys[:16]):
            cache.put(key, value + i)
            cache.flush()  # one batch each: every entry gets its own time stamp
        assert cache.stats()["disk"]["bytes"] == budget == 16 * stored_size(value)
        assert cache.stats()["disk"]["evictions"] == 0
        assert_same(cache.get(keys[0]), value + 0)  # the oldest entry is used again...
        cache.flush()  # ...and the writer records the use
        for i, key in enumerate(keys[16:], start=16):
            cache.put(key, value + i)
            cache.flush()
            assert cache.stats()["disk"]["bytes"] <= budget
        stats = cache.stats()["disk"]
        assert stats["evictions"] == 6
        assert keys[0] in cache, "a recently read entry was evicted before older ones"
        assert [k for k in keys[1:7] if k in cache] == [], "the oldest unread entries go first"
    with open_disk_cache(store, budget) as cache:  # the order survives a reopen
        cache.put(b"lru-new", value)
        cache.flush()
        assert keys[0] in cache and keys[7] not in cache and keys[8] in cache
        for i in [0, *range(8, 22)]:
            assert_same(cache.get(keys[i]), value + i)


def test_reopen_with_a_smaller_budget_applies_it_at_open(tmp_path):
    store = tmp_path / "store"
    value = torch.zeros(65536 - HEADER_BYTES, dtype=torch.uint8)  # 64 KiB stored
    with open_disk_cache(store, "4MiB") as cache:
        for i in range(40):
            cache.put(b"big-%d" % i, value + i)
            if i % 8 == 7:
                cache.flush()
        cache.flush()
        assert cache.stats()["disk"]["bytes"] == 40 * stored_size(value)
    with open_disk_cache(store, "1MiB") as cache:
        stats = cache.stats()["disk"]  # before any write: the open evicted the oldest
        assert stats["bytes"] == 16 * stored_size(value) == stats["capacity_bytes"]
        assert stats["entries"] == 16 and stats["evictions"] == 24
        assert b"big-23" not in cache and b"big-24" in cache
        cache.put(b"small", value)
        cache.flush()
        stats = cache.stats()["disk"]
        assert stats["bytes"] <= stats["capacity_bytes"] == 1 << 20
        assert stats["errors"] == 0
        assert b"small" in cache and b"big-39" in cache and b"big-0" not in cache
    check_books(store)


# -- 7. permissions ----------------------------------------------------------------------------
def _expect_open_refused(path: Path) -> None:
    with pytest.raises(StoreOpenError, match=str(path.name)):
        open_disk_cache(path)


def test_unwritable_directory_is_refused(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root ignores permission bits (see the privilege-dropping variant)")
    existing = tmp_path / "existing"
    with open_disk_cache(existing) as cache:
        cache.put(b"k", torch.ones(2))
    empty = tmp_path / "empty"
    empty.mkdir()
    parent = tmp_path / "parent"
    parent.mkdir()
    for d in (existing, empty, parent):
        d.chmod(0o500)
    try:
        _expect_open_refused(existing)
        _expect_open_refused(empty)
        _expect_open_refused(parent / "store")  # cannot be created
    finally:
        for d in (existing, empty, parent):
            d.chmod(0o700)


def _open_as_nobody(paths: list[str]) -> list[str]:
    """Open each path in a forked child that dropped root; what each open did, in order."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            lines = []
            for path in paths:
                try:
                    open_disk_cache(Path(path)).close()
                    lines.append("opened")
                except StoreOpenError as e:
                    lines.append(f"StoreOpenError: {e}")
                except BaseException as e:
                    lines.append(f"{type(e).__name__}: {e}")
            os.write(write_end, "\n".join(lines).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as f:
        out = f.read().decode()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    return out.split("\n")


def test_unwritable_directory_is_refused_for_a_non_root_user():
    if os.geteuid() != 0:
        pytest.skip("covered by test_unwritable_directory_is_refused")
    base = Path(tempfile.mkdtemp(prefix="featcache-perm-"))
    try:
        base.chmod(0o755)  # traversable by the unprivileged child
        existing = base / "existing"
        with open_disk_cache(existing) as cache:
            cache.put(b"k", torch.ones(2))
        empty = base / "empty"
        parent = base / "parent"
        writable = base / "writable"  # control: the same user may open a store it can write
        for d in (empty, parent, writable):
            d.mkdir()
        for d in (existing, empty, parent, writable):
            for p in (d, *d.iterdir()):
                os.chown(p, 65534, 65534)
            d.chmod(0o500 if d is not writable else 0o700)
        results = _open_as_nobody(
            [str(existing), str(empty), str(parent / "store"), str(writable)]
        )
        assert results[0].startswith("StoreOpenError") and "not writable" in results[0]
        assert results[1].startswith("StoreOpenError") and "not writable" in results[1]
        assert results[2].startswith("StoreOpenError") and "cannot create" in results[2]
        assert results[3] == "opened"
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_store_directory_and_files_are_private(tmp_path):
    store = tmp_path / "a" / "store"
    with open_disk_cache(store) as cache:
        cache.put(b"k", torch.ones(2))
    assert stat.S_IMODE(store.stat().st_mode) == 0o700
    files = sorted(p.name for p in store.iterdir())
    assert files == ["data.mdb", "key-secret", "lock.mdb"]  # the key secret: featcache.keysecret
    for p in store.iterdir():
        assert stat.S_IMODE(p.stat().st_mode) == 0o600, p.name


# -- regressions of fixed bugs (each test failed before its fix) ---------------------------------
class WriterGate:
    """Holds the disk writer inside its next ``write_batch`` until opened: a full disk queue
    without sleeping."""

    def __init__(self, cache: FeatureCache) -> None:
        self.entered = threading.Event()
        self.open = threading.Event()
        disk = _procs.tier_slot(cache, "disk").tier
        self._write_batch = disk.write_batch
        disk.write_batch = self  # an instance attribute: the writer thread calls this

    def __call__(self, *args, **kwargs):
        self.entered.set()
        self.open.wait(30)
        return self._write_batch(*args, **kwargs)


class CopyGate:
    """Holds the demotion thread inside its next device-to-host copy until opened."""

    def __init__(self, cache: FeatureCache) -> None:
        self.entered = threading.Event()
        self.open = threading.Event()
        self._to_host = cache._copier.to_host
        cache._copier.to_host = self

    def __call__(self, *args, **kwargs):
        self.entered.set()
        self.open.wait(30)
        return self._to_host(*args, **kwargs)


def test_replacing_put_that_skips_the_disk_does_not_resurrect_the_old_value(tmp_path):
    store = tmp_path / "store"
    with FeatureCache(
        device="cpu", device_bytes="8MiB", host_bytes=0, disk_path=store, disk_bytes="1MiB"
    ) as cache:
        cache.put(b"k", torch.zeros(10))
        cache.flush()
        cache.put(b"k", torch.ones(300_000))  # 1.2 MB: device only, too large for the disk
        cache.flush()
        assert_same(cache.get(b"k"), torch.ones(300_000))
    with open_disk_cache(store, "1MiB") as cache:
        got = cache.get(b"k")
        assert got is None or _procs.same_bits(got, torch.ones(300_000)), "stale value served"


def test_discard_right_after_put_stays_discarded_on_disk(tmp_path):
    store = tmp_path / "store"
    keys = [b"d%d" % i for i in range(20)]
    with open_disk_cache(store) as cache:
        for i, key in enumerate(keys):
            cache.put(key, torch.full((1000,), float(i)))
            cache.discard(key)
        cache.flush()
    with open_disk_cache(store) as cache:
        assert [k for k in keys if k in cache] == []


def test_reopen_with_a_much_smaller_budget_still_accepts_writes(tmp_path):
    store = tmp_path / "store"
    with open_disk_cache(store, "128MiB", disk_sync=False) as cache:
        for i in range(80):  # 80 MiB: more than map_size_for(1 MiB) = 65.5 MiB
            cache.put(b"big-%d" % i, torch.full((256 * 1024,), float(i)))
            if i % 8 == 7:
                cache.flush()
    with open_disk_cache(store, "1MiB") as cache:
        cache.put(b"small", torch.zeros(100))
        cache.flush()
        stats = cache.stats()["disk"]
        assert stats["errors"] == 0 and b"small" in cache
        assert stats["bytes"] <= stats["capacity_bytes"]


@pytest.mark.slow
def test_smaller_budget_process_survives_a_bigger_one_growing_the_file(tmp_path):
    store = tmp_path / "store"
    small = open_disk_cache(store, "1MiB")
    try:
        small.put(b"mine", torch.arange(10.0))
        small.flush()
        q = SPAWN.Queue()
        child = SPAWN.Process(
            target=_procs.big_writer, args=(str(store), 128 << 20, 80, q), daemon=True
        )
        child.start()
        try:
            get_message(q, child)
            child.join(60)
        finally:
            stop(child)
        stats = small.stats()["disk"]  # raises lmdb.MapResizedError today
        assert stats["errors"] == 0
        got = small.get(b"mine")
        assert got is None or _procs.same_bits(got, torch.arange(10.0))
        assert_same(small.get(b"big-79"), torch.full((256 * 1024,), 79.0))
        small.flush()  # the read's LRU touch is a write: it applies this process's budget
        stats = small.stats()["disk"]
        assert stats["bytes"] <= stats["capacity_bytes"] == 1 << 20 and stats["errors"] == 0
    finally:
        close_quietly(small)


@pytest.mark.slow
def test_writes_continue_after_a_reader_is_killed_mid_read(tmp_path):
    store = tmp_path / "store"
    survivor = open_disk_cache(store, "1MiB", disk_sync=False)
    try:
        survivor.put(b"seed", torch.zeros(10))
        survivor.flush()
        q = SPAWN.Queue()
        child = SPAWN.Process(
            target=_procs.reader_killed_mid_read, args=(str(store), q), daemon=True
        )
        child.start()
        try:
            get_message(q, child)
            os.kill(child.pid, signal.SIGKILL)
            child.join(30)
        finally:
            stop(child)
        value = torch.zeros(64 * 1024)  # 256 KiB
        for i in range(320):  # 80 MiB of churn through a 1 MiB budget
            survivor.put(b"churn-%d" % i, value + i)
            if i % 4 == 3:
                survivor.flush()
        survivor.flush()
        stats = survivor.stats()["disk"]
        assert stats["errors"] == 0 and stats["drops"] == 0
        assert_same(survivor.get(b"churn-319"), value + 319)
        # The killed reader's slot was cleared, so freed pages were reused (85 MiB otherwise).
        assert (store / "data.mdb").stat().st_size < 16 << 20
    finally:
        close_quietly(survivor)


def test_replacing_put_kept_only_in_host_memory_deletes_the_old_disk_value(tmp_path):
    store = tmp_path / "store"
    with FeatureCache(
        device="cpu", device_bytes=0, host_bytes="4MiB", disk_path=store, disk_bytes="1MiB"
    ) as cache:
        cache.put(b"k", torch.zeros(10))
        cache.flush()
        cache.put(b"k", torch.ones(300_000))  # 1.2 MB: host only, too large for the disk
        cache.flush()
        assert_same(cache.get(b"k"), torch.ones(300_000))
        assert cache.stats()["disk"]["entries"] == 0
    with open_disk_cache(store, "1MiB") as cache:
        assert cache.get(b"k") is None, "stale value served"


def test_put_dropped_by_a_full_disk_queue_deletes_the_old_value(tmp_path):
    store = tmp_path / "store"
    old, new = torch.zeros(1000), torch.ones(1000)
    with open_disk_cache(store, disk_queue_entries=1) as cache:
        cache.put(b"k", old)
        cache.flush()
        gate = WriterGate(cache)
        cache.put(b"x", torch.ones(10))  # the writer takes it and waits inside write_batch
        assert gate.entered.wait(10)
        cache.put(b"filler", torch.ones(10))
        cache.put(b"k", new)  # the disk queue is full: this put is dropped
        cache._demoter.join_queue()  # every put has reached the writer (or been dropped there)
        assert cache.stats()["disk"]["drops"] >= 1
        got = cache.get(b"k")
        assert got is None or _procs.same_bits(got, new), "stale value served before the flush"
        gate.open.set()
        flush_or_fail(cache)
        got = cache.get(b"k")
        assert got is None or _procs.same_bits(got, new), "stale value served after the flush"
    check_books(store)
    with open_disk_cache(store) as cache:
        got = cache.get(b"k")
        assert got is None or _procs.same_bits(got, new), "stale value served after reopen"


def test_put_dropped_by_a_full_demotion_queue_deletes_the_old_value(tmp_path):
    store = tmp_path / "store"
    old, new = torch.zeros(1000), torch.ones(1000)
    with open_disk_cache(store, demote_queue_entries=1) as cache:
        cache.put(b"k", old)
        cache.flush()
        gate = CopyGate(cache)
        cache.put(b"x", torch.ones(10))  # the demoter takes it and waits inside its copy
        assert gate.entered.wait(10)
        cache.put(b"filler", torch.ones(10))  # fills the demotion queue
        cache.put(b"k", new)  # dropped
        assert cache.stats()["disk"]["drops"] == 1
        got = cache.get(b"k")
        assert got is None or _procs.same_bits(got, new), "stale value served before the flush"
        gate.open.set()
        flush_or_fail(cache)
        assert b"k" not in cache and b"x" in cache and b"filler" in cache
    check_books(store)
    with open_disk_cache(store) as cache:
        assert cache.get(b"k") is None, "stale value served after reopen"


def test_disk_queue_bounds_pending_puts_but_always_takes_discards(tmp_path):
    store = tmp_path / "store"
    with open_disk_cache(store, disk_queue_entries=2) as cache:
        gate = WriterGate(cache)
        cache.put(b"x", torch.ones(10))  # pending (being written): 1 of 2
        assert gate.entered.wait(10)
        cache.put(b"a", torch.ones(10))  # pending: 2 of 2
        cache.put(b"b", torch.ones(10))  # over the limit: dropped
        cache._demoter.join_queue()
        for i in range(100):  # discards are never dropped
            cache.discard(b"gone-%d" % i)
        stats = cache.stats()
        assert stats["disk"]["drops"] == 1
        assert stats["cache"]["disk_queue"] >= 100
        gate.open.set()
        flush_or_fail(cache)
        assert b"x" in cache and b"a" in cache and b"b" not in cache
        assert cache.stats()["disk"]["entries"] == 2


def test_write_batch_applies_its_operations_in_order(tmp_path):
    tier = DiskTier(tmp_path / "store", 1 << 20)
    try:
        value = featcache.codec.encode(torch.float32, (4,), torch.ones(4).numpy().data)
        stored = tier.write_batch([
            DiskOp("put", b"a", value), DiskOp("discard", b"a"),  # put, then discard: gone
            DiskOp("discard", b"b"), DiskOp("put", b"b", value),  # discard, then put: stored
            DiskOp("put", b"c", value), DiskOp("put", b"c", value),  # twice: one entry
        ])
        assert stored == 4  # puts that landed, whatever came after them
        assert not tier.contains(b"a") and tier.contains(b"b") and tier.contains(b"c")
        assert (tier.entries(), tier.used_bytes) == (2, 2 * len(value))
    finally:
        tier.close()
    check_books(tmp_path / "store")


def test_puts_of_one_batch_are_evicted_in_put_order(tmp_path):
    value = featcache.codec.encode(torch.float32, (4,), torch.ones(4).numpy().data)
    tier = DiskTier(tmp_path / "store", 3 * len(value))
    try:
        # One batch, keys not in sorted order: eviction must follow put order, not key order.
        assert tier.write_batch([DiskOp("put", k, value) for k in (b"c", b"a", b"b")]) == 3
        tier.write_batch([DiskOp("put", b"d", value)])
        assert [k for k in (b"a", b"b", b"c", b"d") if tier.contains(k)] == [b"a", b"b", b"d"]
        # Touches take stamps in order too; a batch with no put still applies the budget.
        tier.write_batch([DiskOp("touch", b"b"), DiskOp("touch", b"a")])
        tier.capacity_bytes = len(value)
        tier.write_batch([])
        assert [k for k in (b"a", b"b", b"d") if tier.contains(k)] == [b"a"]
        assert tier.stats()["evictions"] == 3
    finally:
        tier.close()
    check_books(tmp_path / "store")


def test_a_dropped_disk_tier_is_freed_at_once_and_its_store_reopens(tmp_path):
    """The tier's ``StoreHandle`` holds the tier's callbacks weakly: a tier dropped unclosed is
    freed by its reference count, and its environment with it (LMDB allows one open environment
    per store and process), not left to the cyclic collector."""
    gc.disable()
    try:
        tier = DiskTier(tmp_path / "store", 1 << 20)
        tier.put(b"k", Entry(torch.ones(3)))
        dropped = weakref.ref(tier)
        del tier
        assert dropped() is None
        again = DiskTier(tmp_path / "store", 1 << 20)
    finally:
        gc.enable()
    try:
        assert_same(again.get(b"k").tensor, torch.ones(3))
    finally:
        again.close()


class _BrokenEnv:
    """An LMDB environment that fails every call, as one remapped by another process could."""

    def __getattr__(self, name):
        def fail(*args, **kwargs):
            raise lmdb.MapResizedError("simulated")

        return fail


def test_lmdb_errors_never_escape_the_public_api(tmp_path, caplog):
    store = tmp_path / "store"
    cache = open_disk_cache(store)
    try:
        cache.put(b"k", torch.ones(10))
        cache.flush()
        disk = _procs.tier_slot(cache, "disk").tier
        env, disk._handle._env = disk._handle._env, _BrokenEnv()
        try:
            stats = cache.stats()["disk"]
            assert (stats["entries"], stats["bytes"]) == (0, 0)
            assert b"k" not in cache
            assert cache.get(b"k") is None
            cache.put(b"j", torch.ones(10))
            cache.discard(b"k")
            flush_or_fail(cache)
            stats = cache.stats()
            assert stats["disk"]["errors"] >= 5 and stats["disk"]["drops"] == 1
            assert stats["cache"]["worker_errors"] == 0 and stats["cache"]["workers_alive"] == 1
            assert sum("later LMDB errors" in r.message for r in caplog.records) == 1
        finally:
            disk._handle._env = env
        cache.put(b"after", torch.ones(3))  # the store works again once LMDB does
        flush_or_fail(cache)
        assert_same(cache.get(b"after"), torch.ones(3))
    finally:
        close_quietly(cache)


def test_store_of_the_previous_value_layout_is_refused(tmp_path):
    store = tmp_path / "store"
    with open_disk_cache(store) as cache:
        cache.put(b"kept", torch.ones(3))
    env = raw_env(store)
    try:
        with env.begin(write=True, db=env.open_db(b"info")) as txn:
            txn.put(b"format", b"featcache-lmdb-1")  # 96-byte headers, no metadata
    finally:
        env.close()
    with pytest.raises(StoreFormatError, match="featcache-lmdb-1"):
        open_disk_cache(store)
    assert b"kept" in read_books(store)["data"], "a refused store is left alone"


def test_values_of_format_version_1_are_rejected():
    value = bytearray(featcache.codec.encode(torch.float32, (4,), torch.ones(4).numpy().data))
    struct.pack_into("<H", value, 4, 1)
    with pytest.raises(featcache.CorruptEntryError, match="format version 1"):
        featcache.codec.verify(bytes(value))
