"""The store tools on a live store: other processes write while `featcache verify`, `compact`,
`ls` and `stats` read (issue 11, class 1).

The defect: checking whether the store was in use opened and closed ``lock.mdb``; closing any
descriptor of a file drops every POSIX lock the process holds on it, LMDB's per-process reader
lock included, so a writer's stale-reader check freed the tool's reader slots and reused the
pages it was reading (corrupt copies, good entries listed as bad). The deterministic test below
shows the mechanism directly: after the tool's in-use check, a writer's ``reader_check`` must not
take this process's open read transaction for a dead one.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
from pathlib import Path

import pytest

from featcache import FeatureCache
from featcache.cli import main as cli
from featcache.store.files import store_in_use
from featcache.storetools.view import StoreView

try:
    import _procs
    import _reliability as rel
except ImportError:  # tests/ became a package
    from tests import _procs
    from tests import _reliability as rel

_CHECK_READERS = """
import sys, lmdb
env = lmdb.open(sys.argv[1], max_dbs=4, map_size=1 << 40)
print(env.reader_check())
"""


def _filled(path: Path, n: int = 40) -> None:
    with FeatureCache(device="cpu", device_bytes=0, host_bytes=0, disk_path=path,
                      disk_bytes="64MiB") as cache:
        for i in range(n):
            cache.put(b"k%d" % i, _procs.value_for(b"k%d" % i))


def _stale_readers_freed_by_a_writer(path: Path) -> int:
    """What a writer process's stale-reader check clears (LMDB's mdb_reader_check)."""
    done = subprocess.run([sys.executable, "-c", _CHECK_READERS, str(path)],
                          capture_output=True, text=True, timeout=60, check=True)
    return int(done.stdout.strip())


@pytest.mark.parametrize("check", ["summary", "store_in_use", "verify", "entries"])
def test_a_tool_keeps_its_reader_lock_while_reading(tmp_path, check):
    _filled(tmp_path)
    with StoreView(tmp_path) as view:
        txn = view._env.begin()  # a read in progress, as during a scan or a compacting copy
        try:
            if check == "summary":
                view.summary()
            elif check == "store_in_use":
                store_in_use(str(tmp_path))
            elif check == "verify":
                assert not view.verify().bad
            else:
                list(view.entries())
            # The writer must still see this process's reader as alive: nothing freed.
            assert _stale_readers_freed_by_a_writer(tmp_path) == 0
            assert str(os.getpid()) in view._env.readers()
        finally:
            txn.abort()


def test_store_in_use_names_the_writer_without_opening_the_lock_file(tmp_path):
    ctx = mp.get_context("spawn")
    q, stop = ctx.Queue(), ctx.Event()
    writer = ctx.Process(target=_procs.churn_writer,
                         args=(str(tmp_path), 8 << 20, 1, 64, q, stop), daemon=True)
    writer.start()
    try:
        kind, pid = q.get(timeout=120)
        assert kind == "ready"
        assert store_in_use(str(tmp_path)) == pid
        fds = os.listdir("/proc/self/fd")
        lock = str(tmp_path / "lock.mdb")
        assert not any(os.path.realpath(f"/proc/self/fd/{fd}") == lock for fd in fds
                       if os.path.exists(f"/proc/self/fd/{fd}"))
    finally:
        stop.set()
        writer.join(60)
    assert store_in_use(str(tmp_path)) == 0


def test_verify_and_compact_while_two_processes_write(tmp_path, capsys):
    """`featcache verify` exits 0 and `featcache compact` copies a store that verifies, round
    after round, while two processes put, discard and evict on a small budget (pages freed and
    reused all the time): the load under which 17-28 of ~300 compactions failed before."""
    store = tmp_path / "store"
    _filled(store, 8)
    ctx = mp.get_context("spawn")
    q, stop = ctx.Queue(), ctx.Event()
    writers = [ctx.Process(target=_procs.churn_writer,
                           args=(str(store), 4 << 20, who, 96, q, stop), daemon=True)
               for who in (1, 2)]
    for w in writers:
        w.start()
    rounds, faults = 30, 0
    try:
        for _ in range(2):
            kind, _pid = q.get(timeout=120)
            assert kind == "ready"
        for r in range(rounds):
            assert cli(["verify", str(store)]) == 0, capsys.readouterr().out
            dest = tmp_path / f"copy-{r}"
            assert cli(["compact", str(store), str(dest)]) == 0
            with StoreView(dest) as copy:
                report = copy.verify()
                assert not report.bad, [e.problem for e in report.bad]
                for key, _ in copy.all_keys():  # every value is its own key's
                    info = copy.entry(key)
                    assert info is not None and info.checksum_ok
            faults += 1  # a round of maintenance under load
    finally:
        stop.set()
        for w in writers:
            w.join(60)
    wrong = _check_copies(tmp_path, rounds)
    assert wrong == 0
    rel.report("tools on a live store (verify + compact, 2 writer processes)",
               runs=rounds, faults=faults, wrong=wrong, failed=0)


def _check_copies(root: Path, rounds: int) -> int:
    """Every entry of every copy holds its own key's value (a page reused under the copy once
    served another key's value with a valid checksum)."""
    wrong = 0
    for r in range(rounds):
        with FeatureCache(device="cpu", device_bytes=0, host_bytes=0,
                          disk_path=root / f"copy-{r}", disk_bytes="64MiB") as cache:
            for i in range(96):
                key = b"churn-%d" % i
                got = cache.get(key)
                if got is not None and not _procs.same_bits(got, _procs.value_for(key)):
                    wrong += 1
    return wrong


def test_verify_fix_keeps_a_value_rewritten_after_the_listing(tmp_path, capsys):
    """`verify --fix` deletes only entries still bad when it deletes them: a writer that replaced
    a bad value with a good one between the listing and the fix keeps its value (the deletes are
    conditional inside the write transaction)."""
    from featcache.storetools.maintenance import discard_keys
    from featcache.tiers.disk import DiskOp, DiskTier

    _filled(tmp_path, 4)
    tier = DiskTier(tmp_path, 64 << 20)
    tier.write_batch([DiskOp("put", b"k1", b"not a featcache value"),
                      DiskOp("put", b"k2", b"not a featcache value")])
    tier.close()
    with StoreView(tmp_path) as view:
        bad = sorted(e.key for e in view.verify().bad)
    assert bad == [b"k1", b"k2"]
    with FeatureCache(device="cpu", device_bytes=0, host_bytes=0, disk_path=tmp_path,
                      disk_bytes="64MiB") as cache:
        cache.put(b"k1", _procs.value_for(b"k1"))  # rewritten after the listing
    assert discard_keys(tmp_path, bad, only_bad=True) == 1
    with FeatureCache(device="cpu", device_bytes=0, host_bytes=0, disk_path=tmp_path,
                      disk_bytes="64MiB") as cache:
        assert _procs.same_bits(cache.get(b"k1"), _procs.value_for(b"k1"))
        assert cache.get(b"k2") is None
        assert _procs.same_bits(cache.get(b"k0"), _procs.value_for(b"k0"))
    # and through the command: the good entry stays, the bad one goes
    tier = DiskTier(tmp_path, 64 << 20)
    tier.write_batch([DiskOp("put", b"k3", b"bad again")])
    tier.close()
    assert cli(["verify", "--fix", str(tmp_path)]) == 2
    assert "deleted 1 bad entry" in capsys.readouterr().out
    assert cli(["verify", str(tmp_path)]) == 0
