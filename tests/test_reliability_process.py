"""The cache across process events (issue 11, classes 7, 8 and 9).

7. A process that exits with puts in flight and without ``close()``: it used to abort (SIGABRT,
   "terminate called without an active exception": a background thread caught in torch's C++
   copy was unwound by force at interpreter exit). Now the cache is closed at exit: exit code 0
   and every put on disk.
8. A cache inherited by a forked child: every ``get`` raised (py-lmdb refuses to reopen an
   environment that is still open in the process). Now the child rebuilds the cache on first use
   (empty memory tiers, the disk store reopened, its own threads) and the parent is unaffected.
9. Symbolic links in a store directory: LMDB follows them and writes its lock header to the
   target. Now refused, with directories that other users could write.
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from featcache import FeatureCache, StoreOpenError
from featcache.storetools.view import StoreView

try:
    import _procs
    import _reliability as rel
except ImportError:  # tests/ became a package
    from tests import _procs
    from tests import _reliability as rel

_EXIT_WITHOUT_CLOSE = """
import sys, torch
from featcache import FeatureCache
torch.set_num_threads(2)
cache = FeatureCache(device="cpu", device_bytes=sys.argv[2], host_bytes="256MiB",
                     disk_path=sys.argv[1], disk_bytes="1GiB", disk_sync=False)
value = torch.arange(4_000_000, dtype=torch.float32)
for i in range(int(sys.argv[3])):
    cache.put(b"exit-%d" % i, value + i)
# no close(), no flush(): the interpreter exits with copies and disk writes in flight
"""


@pytest.mark.parametrize("device_bytes,puts", [("0", 3), ("64MiB", 12)])
def test_exit_without_close_is_clean_and_loses_nothing(tmp_path, device_bytes, puts):
    runs, failed, lost = 3, 0, 0
    for run in range(runs):
        store = tmp_path / f"s{run}"
        done = subprocess.run(
            [sys.executable, "-c", _EXIT_WITHOUT_CLOSE, str(store), device_bytes, str(puts)],
            capture_output=True, text=True, timeout=120,
        )
        assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
        with rel.disk_cache(store, "1GiB") as cache:
            for i in range(puts):
                got = cache.get(b"exit-%d" % i)
                if got is None or not torch.equal(got, torch.arange(4_000_000,
                                                                    dtype=torch.float32) + i):
                    lost += 1
    assert lost == 0
    rel.report(f"exit without close ({puts} puts of 16 MB, device_bytes={device_bytes})",
               runs=runs, faults=runs, wrong=0, failed=failed, lost=lost)


_DROPPED_WITHOUT_CLOSE = """
import sys, torch
from featcache import FeatureCache
def work():
    cache = FeatureCache(device="cpu", device_bytes=0, host_bytes="256MiB",
                         disk_path=sys.argv[1] if sys.argv[1] != "-" else None,
                         disk_bytes="1GiB", disk_sync=False)
    value = torch.arange(4_000_000, dtype=torch.float32)
    for i in range(10):
        cache.put(b"exit-%d" % i, value + i)
work()  # the cache is dropped unclosed, copies in flight, and the interpreter exits
"""


@pytest.mark.parametrize("disk", [False, True])
def test_a_cache_dropped_unclosed_is_released_cleanly(tmp_path, disk):
    """Not closed and not referenced any more: its finalizer flushes and stops its threads (no
    SIGABRT at exit: before, a cache without a disk tier was collected and its threads killed
    mid-copy at exit in 5 of 5 runs), and its puts reach the disk."""
    store = tmp_path / "s"
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", _DROPPED_WITHOUT_CLOSE,
                               str(store) if disk else "-"],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    if disk:
        with rel.disk_cache(store, "1GiB") as cache:
            for i in range(10):
                assert torch.equal(cache.get(b"exit-%d" % i),
                                   torch.arange(4_000_000, dtype=torch.float32) + i)


def test_a_collected_cache_stops_its_threads_and_frees_its_store(tmp_path):
    import gc
    import weakref

    before = {t.name for t in threading.enumerate()}
    cache = rel.disk_cache(tmp_path, host_bytes="8MiB")
    cache.put(b"k", torch.ones(1024))
    ref = weakref.ref(cache)
    del cache
    gc.collect()
    assert ref() is None
    assert not {t.name for t in threading.enumerate() if t.name.startswith("featcache")} - before
    with rel.disk_cache(tmp_path) as again:  # the environment was closed: it opens again here
        assert torch.equal(again.get(b"k"), torch.ones(1024))


def _warm_intra_op_pool() -> None:
    """Use torch's intra-op thread pool, as any real serving process has before it forks: the
    pool (OpenMP) does not survive fork(), and a child that enters it hangs (issue 27)."""
    torch.set_num_threads(max(2, torch.get_num_threads()))
    a = torch.randn(1 << 20)
    torch.empty_like(a).copy_(a)  # 4 MB: large enough to be split over the pool's threads


def _fork(body, timeout_s: int = 60) -> tuple[int, str]:
    """Run ``body()`` in a forked child of this process (which has caches open, and has used
    torch's intra-op pool first): its exit code (0: body returned True) and what it printed on
    failure. A child that has not finished after ``timeout_s`` is killed by its alarm (SIGALRM:
    a hang fails the test instead of the suite)."""
    _warm_intra_op_pool()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        os.close(r)
        signal.alarm(timeout_s)
        code = 1
        try:
            ok, why = body()
            os.write(w, why.encode()[:4000])
            code = 0 if ok else 1
        except BaseException as e:
            os.write(w, f"{type(e).__name__}: {e}".encode()[:4000])
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        text = f.read().decode()
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return -os.WTERMSIG(status), text
    return os.waitstatus_to_exitcode(status), text


def test_a_forked_child_uses_the_inherited_cache(tmp_path):
    keys = [b"f%d" % i for i in range(24)]
    with FeatureCache(device="cpu", device_bytes="4MiB", host_bytes="4MiB", disk_path=tmp_path,
                      disk_bytes="64MiB") as cache:
        for k in keys:
            cache.put(k, _procs.value_for(k))
        cache.flush()

        def child() -> tuple[bool, str]:
            for k in keys:  # device, host or disk: whatever it holds is right
                got = cache.get(k)
                if not _procs.same_bits(got, _procs.value_for(k)):
                    return False, f"get({k!r}) in the child: {got!r}"
            cache.put(b"from-child", _procs.value_for(b"from-child"))
            cache.flush()
            ok = b"from-child" in cache and cache.stats()["cache"]["workers_alive"] == 1
            cache.close()
            return ok, "child's put"

        for _ in range(3):
            code, why = _fork(child)
            assert code == 0, why
        # the parent goes on as before, and sees what the child wrote to the shared disk
        cache.put(b"parent", _procs.value_for(b"parent"))
        cache.flush()
        assert _procs.same_bits(cache.get(b"from-child"), _procs.value_for(b"from-child"))
        assert all(_procs.same_bits(cache.get(k), _procs.value_for(k)) for k in keys)
        assert cache.stats()["disk"]["errors"] == 0


@pytest.mark.parametrize("tiers", ["disk only", "host and disk"])
def test_a_forked_child_promotes_demotes_and_flushes_after_the_parent_used_torchs_pool(
        tmp_path, tiers):
    """Issue 27: the parent has used torch's intra-op pool (``_fork`` does that); the child's
    promotions (a disk hit copied up), demotions (a put written through to host and disk) and
    flush must not enter the inherited pool, or they hang."""
    host = "8MiB" if tiers == "host and disk" else 0
    keys = [b"p%d" % i for i in range(8)]
    with FeatureCache(device="cpu", device_bytes=0 if not host else "1MiB", host_bytes=host,
                      disk_path=tmp_path, disk_bytes="64MiB") as cache:
        for k in keys:
            cache.put(k, torch.randn(512, 512))  # 1 MiB each: copies the pool would split
        cache.flush()

        def child() -> tuple[bool, str]:
            got = cache.get(keys[0])
            if got is None:
                return False, "no promotion in the child"
            cache.put(b"child", torch.randn(512, 512).t())  # not contiguous: a dense copy too
            cache.flush()
            again = cache.get(b"child")
            ok = again is not None and again.is_contiguous() and b"child" in cache
            cache.close()
            return ok, "child's put, flush and get"

        code, why = _fork(child, timeout_s=30)
        assert code == 0, f"child exit {code} ({'hung: killed by its alarm' if code == -14 else why})"


def test_fork_while_the_disk_writer_and_readers_are_busy(tmp_path):
    """Forks taken while this process writes and reads its store: no child hangs or fails (an
    LMDB operation in flight at the fork would make the child's close of the inherited
    environment wait forever), and the parent's store stays whole."""
    with rel.disk_cache(tmp_path, "64MiB", host_bytes="8MiB", disk_sync=False) as cache:
        stop = threading.Event()
        errors: list[str] = []

        def busy(who: int) -> None:
            i = 0
            while not stop.is_set():
                k = b"busy-%d-%d" % (who, i % 40)
                try:
                    cache.put(k, _procs.value_for(k))
                    got = cache.get(b"busy-%d-%d" % (who, (i * 7) % 40))
                    if got is not None and not _procs.same_bits(
                            got, _procs.value_for(b"busy-%d-%d" % (who, (i * 7) % 40))):
                        errors.append("wrong value in the parent")
                except Exception as e:  # pragma: no cover - reported
                    errors.append(repr(e))
                i += 1

        threads = [threading.Thread(target=busy, args=(w,), daemon=True) for w in range(3)]
        for t in threads:
            t.start()

        def child() -> tuple[bool, str]:
            n = 0
            for w in range(3):
                for j in range(40):
                    k = b"busy-%d-%d" % (w, j)
                    got = cache.get(k)
                    if got is not None:
                        n += 1
                        if not _procs.same_bits(got, _procs.value_for(k)):
                            return False, f"wrong value for {k!r} in the child"
            return True, f"{n} hits"

        forks = 12
        try:
            for _ in range(forks):
                time.sleep(0.02)
                code, why = _fork(child)
                assert code == 0, why
        finally:
            stop.set()
            for t in threads:
                t.join(30)
        assert not errors, errors[:3]
    rel.report("fork with writes and reads in flight", runs=forks, faults=forks, wrong=0, failed=0)


# -- 9: links and other users' directories ---------------------------------------------------------
def _store(path: Path) -> None:
    with rel.disk_cache(path) as cache:
        cache.put(b"k", torch.ones(4))


@pytest.mark.parametrize("name", ["lock.mdb", "data.mdb"])
@pytest.mark.parametrize("opener", ["cache", "view"])
def test_a_symlinked_store_file_is_refused_and_its_target_untouched(tmp_path, name, opener):
    store = tmp_path / "store"
    _store(store)
    target = tmp_path / "precious"
    target.write_bytes(b"must stay as it is\n" * 100)
    before = target.read_bytes()
    (store / name).unlink()
    (store / name).symlink_to(target)
    with pytest.raises(StoreOpenError, match="symbolic link"):
        if opener == "cache":
            rel.disk_cache(store)
        else:
            StoreView(store)
    assert target.read_bytes() == before


def test_a_store_directory_every_user_can_write_is_refused(tmp_path):
    store = tmp_path / "store"
    _store(store)
    os.chmod(store, 0o777)
    with pytest.raises(StoreOpenError, match="writable by every user"):
        rel.disk_cache(store)
    with pytest.raises(StoreOpenError, match="writable by every user"):
        StoreView(store)
    os.chmod(store, 0o700)
    with rel.disk_cache(store) as cache:
        assert torch.equal(cache.get(b"k"), torch.ones(4))


@pytest.mark.skipif(os.geteuid() != 0, reason="what root refuses")
def test_root_refuses_a_store_directory_another_user_owns(tmp_path):
    store = tmp_path / "store"
    _store(store)
    os.chown(store, 65534, 65534)
    with pytest.raises(StoreOpenError, match="root does not open a store another user can write"):
        rel.disk_cache(store)
    os.chown(store, 0, 0)
    os.chmod(store, 0o770)
    with pytest.raises(StoreOpenError, match="group-writable"):
        rel.disk_cache(store)
    os.chmod(store, 0o700)
    assert stat.S_IMODE(store.stat().st_mode) == 0o700
    rel.disk_cache(store).close()
