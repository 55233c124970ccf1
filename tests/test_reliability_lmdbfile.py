"""The structural check of ``data.mdb`` at open (``featcache.store.lmdbcheck``), issue 11 items 4
and 10.

- Healthy stores whose data file is shorter than the pages LMDB counts as in use (LMDB never
  writes pages freed by the transaction that allocated them) open everywhere: after ``featcache
  purge``, and after an open with a small budget evicted at open. Each test first proves the file
  is that short.
- Damaged stores (truncated mid-tree or in the overflow pages of a value; LMDB's table pages zeroed
  or scribbled on) are refused with ``StoreOpenError`` by ``FeatureCache``, ``StoreView`` and
  ``featcache verify``, never with a raw ``lmdb.Error``, never by dying (each in a forked child).
  What plain LMDB does with the same file is printed beside it.
- A store written by another process while it is checked never fails the check.

The test reads LMDB's layout itself (``Layout``, from mdb.c) to find the pages to damage; it
does not use the module under test for that.
"""

from __future__ import annotations

import contextlib
import faulthandler
import io
import os
import select
import shutil
import struct
import time
from collections.abc import Callable
from pathlib import Path

import lmdb
import pytest
import torch

from featcache import StoreOpenError, codec
from featcache.cli import main
from featcache.store.books import Books
from featcache.store.lmdbcheck import check_data_file
from featcache.storetools.view import StoreView
from featcache.tiers.disk import DiskOp, DiskTier

try:
    import _reliability as rel
except ImportError:  # tests/ became a package
    from tests import _reliability as rel

SMALL = 384  # float32 elements: a 1.6 KB value, stored inside its leaf page (not on overflow pages)
HEAD = struct.Struct("<QHHHH")  # mp_pgno, mp_pad, mp_flags, mp_lower, mp_upper
NODE = struct.Struct("<HHHH")  # mn_lo, mn_hi, mn_flags, mn_ksize
DB = struct.Struct("<IHHQQQQQ")  # md_pad, md_flags, md_depth, pages x3, entries, md_root
P_BRANCH, P_LEAF, F_BIGDATA = 0x01, 0x02, 0x01


class Layout:
    """This test's own reading of an LMDB data file (mdb.c, 64-bit little-endian), to find pages."""

    def __init__(self, store: Path) -> None:
        self.blob: bytes | bytearray = (store / "data.mdb").read_bytes()
        # MDB_meta after a page header: magic, version, address, mapsize, mm_dbs[2] (the free
        # list's md_pad is the page size), mm_last_pg, mm_txnid
        self.psize = struct.unpack_from("<I", self.blob, 16 + 24)[0]
        metas = []
        for at in (16, self.psize + 16):
            last_pg, txnid = struct.unpack_from("<QQ", self.blob, at + 24 + 2 * DB.size)
            metas.append((txnid, last_pg, self.blob[at + 24 + DB.size : at + 24 + 2 * DB.size]))
        self.txnid, self.last_pg, self.main = max(metas)

    @property
    def pages_needed(self) -> int:
        return (self.last_pg + 1) * self.psize

    def head(self, pgno: int) -> tuple[int, int, int, int, int]:
        return HEAD.unpack_from(self.blob, pgno * self.psize)

    def nodes(self, pgno: int) -> list[tuple[int, int, int, int, int]]:
        """(offset in the page, mn_lo, mn_hi, mn_flags, mn_ksize) of each node."""
        lower = self.head(pgno)[3]
        base = pgno * self.psize
        ptrs = struct.unpack_from(f"<{(lower - 16) // 2}H", self.blob, base + 16)
        return [(p, *NODE.unpack_from(self.blob, base + p)) for p in ptrs]

    def tables(self) -> dict[str, tuple[int, int]]:
        """name -> (root page, depth), from the main table's (single) leaf page."""
        root = DB.unpack(self.main)[7]
        assert self.head(root)[2] & P_LEAF, "the main table fits one leaf page"
        out = {"main": (root, DB.unpack(self.main)[2])}
        for off, _, _, _, ksize in self.nodes(root):
            at = root * self.psize + off + 8
            record = DB.unpack_from(self.blob, at + ksize)
            out[self.blob[at : at + ksize].decode()] = (record[7], record[2])
        return out

    def leaves(self, table: str) -> list[int]:
        root, depth = self.tables()[table]
        level = [root]
        for _ in range(depth - 1):
            level = [lo | hi << 16 | fl << 32 for p in level for _, lo, hi, fl, _ in self.nodes(p)]
        return level

    def overflow_runs(self) -> list[tuple[int, int]]:
        """(first page, pages) of every value of the data table stored on overflow pages."""
        runs = []
        for leaf in self.leaves("data"):
            for off, lo, hi, flags, ksize in self.nodes(leaf):
                if flags & F_BIGDATA:
                    first = struct.unpack_from("<Q", self.blob, leaf * self.psize + off + 8 + ksize)
                    runs.append((first[0], (15 + (lo | hi << 16)) // self.psize + 1))
        return runs


def small_value(i: int) -> torch.Tensor:
    return torch.full((SMALL,), float(i))


def fill_small(store: Path, n: int = 200, disk_bytes: str = "64MiB") -> list[bytes]:
    """``n`` entries of 1.6 KB, flushed every 16 (as a serving process writes them)."""
    ks = [b"small-%d" % i for i in range(n)]
    with rel.disk_cache(store, disk_bytes) as cache:
        for i, key in enumerate(ks):
            cache.put(key, small_value(i))
            if i % 16 == 15:
                cache.flush()
    return ks


def serve_all(store: Path, ks: list[bytes]) -> dict[str, int]:
    """Open every way a user can and read every key: what each saw."""
    with StoreView(store) as view:
        report = view.verify()
    with contextlib.redirect_stdout(io.StringIO()):
        rc = main(["verify", str(store)])
    served = wrong = 0
    with rel.disk_cache(store) as cache:
        for i, key in enumerate(ks):
            got = cache.get(key)
            served += got is not None
            wrong += got is not None and not rel.same_bits(got, small_value(i))
    return {"verified": report.checked, "bad": len(report.bad), "verify_rc": rc,
            "served": served, "wrong": wrong}


# -- item 4: healthy stores shorter than their last page -----------------------------------------
def test_store_purged_by_the_cli_opens_though_its_file_is_shorter_than_its_last_page(tmp_path):
    """200 entries, then ``featcache purge --older-than 0s``: the purge's own transaction leaves
    freed pages past the end of data.mdb. The store opens (it was refused as truncated, and purge
    itself failed with exit code 1 on its closing summary)."""
    store = tmp_path / "store"
    fill_small(store)
    with contextlib.redirect_stdout(io.StringIO()) as out:
        rc = main(["purge", str(store), "--older-than", "0s"])
    layout = Layout(store)
    assert len(layout.blob) < layout.pages_needed, "the construction leaves the file short"
    assert rc == 0 and "0 entries" in out.getvalue()
    assert plain_lmdb_reads_everything(store) == ("ok", 2), "LMDB reads it: format, used_bytes"
    seen = serve_all(store, [])
    assert seen == {"verified": 0, "bad": 0, "verify_rc": 0, "served": 0, "wrong": 0}
    ks = fill_small(store, 20)  # and it takes new entries
    assert serve_all(store, ks)["served"] == 20
    rel.report("lmdbfile/purged-store-shorter-than-its-pages", runs=1, faults=0, wrong=0,
               failed=0, file_bytes=len(layout.blob), pages_bytes=layout.pages_needed)


def test_store_evicted_at_open_reopens_with_a_larger_budget(tmp_path):
    """200 entries; an open with a 64 KiB budget evicts all but a few at open, which leaves freed
    pages past the end of data.mdb; reopening with 64 MiB serves every entry left."""
    store = tmp_path / "store"
    ks = fill_small(store)
    rel.disk_cache(store, "64KiB").close()
    layout = Layout(store)
    assert len(layout.blob) < layout.pages_needed, "the construction leaves the file short"
    seen = serve_all(store, ks)
    assert 0 < seen["served"] < len(ks) and seen["verified"] == seen["served"]
    assert seen["bad"] == seen["wrong"] == seen["verify_rc"] == 0
    rel.report("lmdbfile/evicted-at-open-then-larger-budget", runs=1, faults=0, wrong=0, failed=0,
               file_bytes=len(layout.blob), pages_bytes=layout.pages_needed,
               served=seen["served"])


# -- item 10 and truncations: damaged stores -----------------------------------------------------
def plain_lmdb_reads_everything(store: Path) -> tuple[str, object]:
    """What LMDB alone does with the store (every table, every value read), in a forked child:
    ("ok", values read), ("raised", error) or ("crashed", signal)."""

    def body() -> int:
        faulthandler.disable()  # a crash is the expected outcome here: no traceback dump
        env = lmdb.open(str(store), readonly=True, lock=False, max_dbs=4, map_size=0)
        count = 0
        with env.begin() as txn:
            for name in (b"data", b"meta", b"lru", b"info"):
                for _, value in txn.cursor(db=env.open_db(name, txn=txn, create=False)):
                    count += len(bytes(value)) >= 0
        return count

    return rel.in_fork(body)


def featcache_opens(store: Path) -> dict[str, str]:
    """In the child: how FeatureCache, StoreView and ``featcache verify`` take the store."""
    out: dict[str, str] = {}
    for name, opener in (("FeatureCache", lambda: rel.disk_cache(store)),
                         ("StoreView", lambda: StoreView(store))):
        try:
            opener().close()
            out[name] = "opened"
        except Exception as e:
            out[name] = f"{type(e).__name__}: {e}"
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        rc = main(["verify", str(store)])
    out["verify"] = f"exit {rc}: {err.getvalue()}"
    return out


def _put(layout: Layout, pgno: int, offset: int, fmt: str, *values: int) -> None:
    struct.pack_into(fmt, layout.blob, pgno * layout.psize + offset, *values)


def _zero(layout: Layout, pgno: int) -> None:
    layout.blob[pgno * layout.psize : (pgno + 1) * layout.psize] = bytes(layout.psize)


def _inline_leaf(layout: Layout) -> int:
    return next(p for p in layout.leaves("data") if not any(n[3] & F_BIGDATA for n in layout.nodes(p)))


def _big_node(layout: Layout) -> tuple[int, int, int]:
    """(leaf, node offset, key size) of a value stored on overflow pages."""
    for leaf in layout.leaves("data"):
        for off, _, _, flags, ksize in layout.nodes(leaf):
            if flags & F_BIGDATA:
                return leaf, off, ksize
    raise AssertionError("no value on overflow pages")


def _child(layout: Layout, pgno: int) -> None:  # branch node 1 points past the pages in use
    off, *_ = layout.nodes(layout.tables()["data"][0])[1]
    child = layout.last_pg + 1000
    _put(layout, pgno, off, "<HHH", child & 0xFFFF, child >> 16 & 0xFFFF, child >> 32)


def _cross_link(layout: Layout, pgno: int) -> None:  # branch node 1 points at node 0's child
    nodes = layout.nodes(pgno)
    _put(layout, pgno, nodes[1][0], "<HHH", *nodes[0][1:4])


def _cut(layout: Layout, size: int) -> None:
    del layout.blob[size:]


def _first_leaf_node(layout: Layout, fmt: str, field: int, *values: int) -> None:
    leaf = _inline_leaf(layout)
    _put(layout, leaf, layout.nodes(leaf)[0][0] + field, fmt, *values)


# name -> what to do to the file (a bytearray in ``layout.blob``)
DAMAGES: dict[str, Callable[[Layout], None]] = {
    "info table page zeroed": lambda lay: _zero(lay, lay.tables()["info"][0]),
    "main table page zeroed": lambda lay: _zero(lay, lay.tables()["main"][0]),
    "data branch page zeroed": lambda lay: _zero(lay, lay.tables()["data"][0]),
    "data leaf page zeroed": lambda lay: _zero(lay, _inline_leaf(lay)),
    "leaf node value size 1 GiB": lambda lay: _first_leaf_node(lay, "<HH", 0, 0, 1 << 14),
    "leaf node key size 65535": lambda lay: _first_leaf_node(lay, "<H", 6, 0xFFFF),
    "leaf mp_lower 65534": lambda lay: _put(lay, _inline_leaf(lay), 12, "<H", 0xFFFE),
    "leaf mp_upper past the page": lambda lay: _put(lay, _inline_leaf(lay), 14, "<H", 0xFFFE),
    "leaf node offset past the page": lambda lay: _put(lay, _inline_leaf(lay), 16, "<H", 0xFFF0),
    "leaf page number wrong": lambda lay: _put(lay, _inline_leaf(lay), 0, "<Q", 3),
    "branch child past the pages in use": lambda lay: _child(lay, lay.tables()["data"][0]),
    "branch children cross-linked": lambda lay: _cross_link(lay, lay.tables()["data"][0]),
    "overflow page number past the file": lambda lay: _put(
        lay, _big_node(lay)[0], sum(_big_node(lay)[1:]) + 8, "<Q", lay.last_pg + 10),
    "overflow value size 4 GiB": lambda lay: _put(lay, _big_node(lay)[0], _big_node(lay)[1],
                                                  "<HH", 0xFFFF, 0xFFFF),
    "table depth 0 in the main table": lambda lay: _put(
        lay, lay.tables()["main"][0], lay.nodes(lay.tables()["main"][0])[0][0] + 8
        + lay.nodes(lay.tables()["main"][0])[0][4] + 6, "<H", 0),
    "cut mid-tree (at the data branch page)": lambda lay: _cut(
        lay, lay.tables()["data"][0] * lay.psize),
    "cut in the overflow pages of the last value": lambda lay: _cut(lay, len(lay.blob) - lay.psize),
}


def _damage_base(store: Path) -> list[bytes]:
    """200 inline values (a data table of depth 2) and, last, 8 values on overflow pages, so that
    the file ends with an overflow run."""
    ks = fill_small(store)
    big = [b"big-%d" % i for i in range(8)]
    tier = DiskTier(store, 64 << 20)
    try:
        for i, key in enumerate(big):
            tier.write_batch([DiskOp("put", key, _encoded(16 << 10, float(i)))])
    finally:
        tier.close()
    return ks + big


def test_damaged_lmdb_pages_are_refused_at_open_never_a_crash(tmp_path):
    """Each damage on a copy of one store, opened in a forked child by FeatureCache, StoreView
    and ``featcache verify``: all three refuse it with StoreOpenError (verify: exit code 1 and one
    line), none dies, none lets an ``lmdb.Error`` out."""
    base = tmp_path / "base"
    _damage_base(base)
    layout = Layout(base)
    data_root, data_depth = layout.tables()["data"]
    assert data_depth == 2 and layout.head(data_root)[2] & P_BRANCH
    first, pages = max(layout.overflow_runs())
    assert (first + pages) * layout.psize == len(layout.blob), "the file ends with a value"
    assert first * layout.psize < len(layout.blob) - layout.psize, "cut only overflow pages"
    assert data_root * layout.psize < len(layout.blob)
    assert featcache_opens(base) == {"FeatureCache": "opened", "StoreView": "opened",
                                     "verify": "exit 0: "}
    lines, crashed, plain_crashed, escaped = [], 0, 0, 0
    for name, damage in DAMAGES.items():
        store = tmp_path / name.replace(" ", "_")
        shutil.copytree(base, store)
        layout = Layout(base)
        layout.blob = bytearray(layout.blob)
        damage(layout)
        (store / "data.mdb").write_bytes(bytes(layout.blob))
        plain = plain_lmdb_reads_everything(store)
        plain_crashed += plain[0] == "crashed"
        how, result = rel.in_fork(lambda s=store: featcache_opens(s))
        if how != "ok":
            crashed += 1
            lines.append(f"  {name}: CRASHED or raised ({how}: {result})")
            continue
        refused = all(r.startswith("StoreOpenError: the store at") and "is damaged" in r
                      for r in (result["FeatureCache"], result["StoreView"]))
        verify = result["verify"]
        one_line = verify.startswith("exit 1: featcache verify: error: the store at") and \
            verify.count("\n") == 1
        escaped += not (refused and one_line)
        why = result["StoreView"].split("is damaged: ")[-1].split("; move it")[0]
        lines.append(f"  {name}: refused ({why}); plain LMDB: {plain[0]} {plain[1]}")
        assert refused and one_line, f"{name}: {result}"
    print("\n" + "\n".join(lines))
    rel.report("lmdbfile/damaged-table-pages-and-truncations", runs=len(DAMAGES),
               faults=len(DAMAGES), wrong=0, failed=0, crashed=crashed, refused=len(DAMAGES) - escaped,
               plain_lmdb_crashed=plain_crashed)
    assert crashed == 0 and escaped == 0


# -- a live store ----------------------------------------------------------------------------
def _encoded(elems: int, fill: float = 1.0) -> bytes:
    t = torch.full((elems,), fill)
    return codec.encode(t.dtype, tuple(t.shape), t.view(torch.uint8).numpy().data)


def _writer(store: Path, values: list[bytes], go: int, stop: int) -> None:  # pragma: no cover
    """In the child: write batches of puts (values inline and on overflow pages) under a budget
    that evicts in the same transactions, and discards, until ``stop`` is readable."""
    tier = DiskTier(store, 1 << 20, sync=False)
    os.write(go, b"1")
    n = 0
    while not select.select([stop], [], [], 0)[0]:
        ops = [DiskOp("put", b"live-%d" % ((n + i) % 300), values[(n + i) % 4]) for i in range(7)]
        ops.append(DiskOp("discard", b"live-%d" % ((n * 7) % 300)))
        tier.write_batch(ops)
        n += 1
    tier.close()


@pytest.mark.slow
def test_checks_of_a_store_written_by_another_process_never_fail(tmp_path):
    """A second process writes batches (puts, evictions, discards) as fast as it can while this
    one checks the store through one StoreView (at least 300 times, and until 50 different
    snapshots were checked), then opens a StoreView 30 times: no check fails."""
    store = tmp_path / "live"
    values = [_encoded(SMALL), _encoded(3000), _encoded(SMALL, 2.0), _encoded(40000)]
    go_r, go_w = os.pipe()
    stop_r, stop_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        code = 1
        try:
            _writer(store, values, go_w, stop_r)
            code = 0
        finally:
            os._exit(code)
    failures: list[str] = []
    txnids: set[int] = set()
    try:
        assert os.read(go_r, 1) == b"1"
        time.sleep(0.05)  # a few batches in: the store has a free list and overflow pages
        checks = 0
        deadline = time.monotonic() + 30
        with StoreView(store) as view:
            while (checks < 300 or len(txnids) < 50) and time.monotonic() < deadline:
                checks += 1
                try:
                    check = check_data_file(view._env, str(store / "data.mdb"))
                    assert check is not None
                    txnids.add(check.txnid)
                except StoreOpenError as e:
                    failures.append(str(e))
        for _ in range(30):
            try:
                StoreView(store).close()
            except StoreOpenError as e:
                failures.append(str(e))
    finally:
        os.write(stop_w, b"1")
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the writer failed"
    rel.report("lmdbfile/checks-of-a-live-store", runs=checks + 30, faults=0, wrong=0,
               failed=len(failures), snapshots=len(txnids))
    assert failures == []
    assert len(txnids) >= 50, "the writer committed while the checks ran"


# -- every LMDB error at open is a StoreOpenError --------------------------------------------------
class _FailingEnv:
    """An LMDB environment whose ``open_db``, or the read of the format record, fails."""

    def __init__(self, env: lmdb.Environment, where: str) -> None:
        self._env, self._where = env, where

    def __getattr__(self, name: str):
        return getattr(self._env, name)

    def open_db(self, *args, **kwargs):
        if self._where == "open_db":
            raise lmdb.CorruptedError("injected")
        return self._env.open_db(*args, **kwargs)

    def begin(self, *args, **kwargs):
        if self._where == "format" and "db" in kwargs:
            raise lmdb.CorruptedError("injected")
        return self._env.begin(*args, **kwargs)


@pytest.mark.parametrize("where", ["open_db", "format", "books"])
def test_lmdb_errors_at_open_are_store_open_errors(tmp_path, monkeypatch, where):
    """An ``lmdb.Error`` while the tables are opened, the format record is read or the books are
    read at open reaches the caller as StoreOpenError (FeatureCache, StoreView), with the
    environment closed: the next open of the same directory in this process works."""
    store = tmp_path / "store"
    fill_small(store, 4)
    real_open = lmdb.open
    with monkeypatch.context() as patch:
        patch.setattr(lmdb, "open", lambda *a, **k: _FailingEnv(real_open(*a, **k), where))
        if where == "books":
            def broken(self):
                raise lmdb.CorruptedError("injected")
            patch.setattr(Books, "used", broken)
        with pytest.raises(StoreOpenError, match="injected"):
            rel.disk_cache(store)
        if where != "books":  # a StoreView reads no books at open
            with pytest.raises(StoreOpenError, match="injected"):
                StoreView(store)
    assert serve_all(store, [b"small-0"])["served"] == 1
