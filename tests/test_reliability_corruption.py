"""Corruption: bit rot in the data file, truncated and garbage store files, damaged books.

What tests/test_disk_durability.py already proves is not repeated here: a flipped byte at every
header offset and 17 kinds of corrupted values (``test_corrupt_value_is_a_miss_then_dropped_...``,
``test_every_single_bit_flip_in_a_header_is_caught``), a foreign store format and the previous
value layout (``test_foreign_format_tag_...``, ``test_store_of_the_previous_value_layout_...``,
``test_values_of_format_version_1_are_rejected``). Bad values are found two ways here: by
``StoreView.verify`` (what ``featcache verify`` runs) and by a read of every key (each one is
counted in ``stats()["disk"]["corrupt"]``).

Every scenario counts what a user sees: entries served bit-exact, entries served wrong (must be
0), requests that raised (must be 0), and whether a process crashed (must never happen).
"""

from __future__ import annotations

import os
import random
import shutil
import struct
from pathlib import Path

import lmdb

import featcache.codec
from featcache import StoreOpenError
from featcache.storetools.view import StoreView

try:
    import _reliability as rel
except ImportError:  # tests/ became a package
    from tests import _reliability as rel

HEADER_BYTES = featcache.codec.HEADER.size


def keys(n: int, prefix: bytes = b"rot") -> list[bytes]:
    return [b"%s-%d" % (prefix, i) for i in range(n)]


def fill(path: Path, ks: list[bytes], disk_bytes: int | str = "64MiB") -> None:
    with rel.disk_cache(path, disk_bytes) as cache:
        for i, key in enumerate(ks):
            cache.put(key, rel.value_for(key))
            if i % 16 == 15:
                cache.flush()


def raw_values(path: Path) -> dict[bytes, bytes]:
    env = lmdb.open(str(path), max_dbs=4, map_size=1 << 30, readonly=True)
    try:
        with env.begin(db=env.open_db(b"data", create=False)) as txn:
            return {bytes(k): bytes(v) for k, v in txn.cursor()}
    finally:
        env.close()


def read_all(cache, ks: list[bytes]) -> dict[str, int]:
    """Read every key once, as a ``verify`` pass would; what a user saw, counted."""
    seen = {"served": 0, "missed": 0, "wrong": 0, "raised": 0}
    for key in ks:
        try:
            got = cache.get(key)
        except Exception:
            seen["raised"] += 1
            continue
        if got is None:
            seen["missed"] += 1
        elif rel.same_bits(got, rel.value_for(key)):
            seen["served"] += 1
        else:
            seen["wrong"] += 1
    return seen


# -- bit rot in data.mdb -----------------------------------------------------------------------
def test_bit_rot_in_the_data_file_is_found_by_reading_every_key(tmp_path):
    """Flip one byte inside each of 64 of 256 stored values, in data.mdb itself (not through
    LMDB): a read of every key serves the other 192 bit-exact and reports exactly the 64."""
    store = tmp_path / "store"
    ks = keys(256)
    fill(store, ks)
    values = raw_values(store)
    rng = random.Random(4)
    rotten = rng.sample(ks, 64)
    blob = bytearray((store / "data.mdb").read_bytes())
    for key in rotten:
        value = values[key]
        where = rng.choice((rng.randrange(HEADER_BYTES), rng.randrange(len(value))))
        bit = 1 << rng.randrange(8)
        at = blob.find(value)
        assert at > 0, "the value is in the file"
        while at >= 0:  # also in stale copies LMDB left in free pages: flip them all
            blob[at + where] ^= bit
            at = blob.find(value, at + 1)
    (store / "data.mdb").write_bytes(bytes(blob))

    with StoreView(store) as view:  # what `featcache verify` runs
        report = view.verify()
    assert report.checked == 256 and {e.key for e in report.bad} == set(rotten)
    with rel.disk_cache(store) as cache:
        seen = read_all(cache, ks)
        stats = cache.stats()["disk"]
        assert seen == {"served": 192, "missed": 64, "wrong": 0, "raised": 0}
        assert stats["corrupt"] == 64, "every rotten value is reported"
        cache.flush()  # the writer deletes what was reported
        assert cache.stats()["disk"]["entries"] == 192
        assert read_all(cache, ks)["served"] == 192 and cache.stats()["disk"]["corrupt"] == 64
        for key in rotten:  # the store keeps working: the keys take new values
            cache.put(key, rel.value_for(key))
        cache.flush()
        assert read_all(cache, ks) == {"served": 256, "missed": 0, "wrong": 0, "raised": 0}
    with StoreView(store) as view:
        assert view.verify().bad == []
    rel.report("corruption/bit-rot-in-data.mdb", runs=1, faults=64, wrong=seen["wrong"],
               failed=seen["raised"], entries=256, found_by_verify=len(report.bad),
               reported_corrupt_by_reads=stats["corrupt"], served_intact=seen["served"])


# -- truncated or garbage store files ------------------------------------------------------------
def _open_and_use(path: str, ks: list[bytes]) -> dict[str, object]:
    """The child's view of a damaged store: open it, read every key, write and read one more."""
    try:
        cache = rel.disk_cache(Path(path))
    except StoreOpenError as e:
        return {"refused": f"{type(e).__name__}: {e}"}
    try:
        seen = read_all(cache, ks)
        probe = b"probe"
        cache.put(probe, rel.value_for(probe))
        cache.flush()
        seen["probe_ok"] = int(rel.same_bits(cache.get(probe), rel.value_for(probe)))
        seen["corrupt"] = cache.stats()["disk"]["corrupt"]
        return seen
    finally:
        cache.close()


def _damages(size: int, rng: random.Random) -> dict[str, tuple[str, object]]:
    """name -> (file, what to do to it): an int truncates to that size, bytes replace it."""
    return {
        "data.mdb emptied": ("data.mdb", 0),
        "data.mdb cut to 100 B": ("data.mdb", 100),
        "data.mdb cut to 1 page": ("data.mdb", 4096),
        "data.mdb cut to its 2 meta pages": ("data.mdb", 8192),
        "data.mdb cut to 3 pages": ("data.mdb", 12288),
        "data.mdb cut in half": ("data.mdb", size // 2),
        "data.mdb cut mid-page": ("data.mdb", size // 2 + 1000),
        "data.mdb short of its last page": ("data.mdb", size - 4096),
        "data.mdb short of its last byte": ("data.mdb", size - 1),
        "data.mdb garbage": ("data.mdb", rng.randbytes(size)),
        "data.mdb garbage after its meta pages": ("data.mdb", b"keep-meta" + rng.randbytes(size)),
        "lock.mdb emptied": ("lock.mdb", 0),
        "lock.mdb garbage": ("lock.mdb", rng.randbytes(8192)),
    }


def test_truncated_or_garbage_store_files_open_or_are_refused_never_crash(tmp_path):
    """Each damage in a forked child (a crash there is seen as a signal): the store opens and
    serves nothing wrong, or the open fails with StoreOpenError."""
    base = tmp_path / "base"
    ks = keys(120, b"trunc")
    fill(base, ks)
    size = (base / "data.mdb").stat().st_size
    assert size > 16 * 4096
    rng = random.Random(7)
    outcomes: dict[str, str] = {}
    wrong = failed = crashed = 0
    for name, (file, damage) in _damages(size, rng).items():
        store = tmp_path / name.replace(" ", "_")
        shutil.copytree(base, store)
        target = store / file
        if isinstance(damage, int):
            os.truncate(target, damage)
        elif damage.startswith(b"keep-meta"):  # a valid header, garbage pages behind it
            blob = bytearray(target.read_bytes())
            blob[8192:] = damage[len(b"keep-meta") :][: size - 8192]
            target.write_bytes(bytes(blob))
        else:
            target.write_bytes(damage)
        how, result = rel.in_fork(lambda s=store: _open_and_use(str(s), ks))
        if how == "crashed":
            crashed += 1
            outcomes[name] = f"CRASHED ({result})"
            continue
        assert how == "ok", f"{name}: {result}"  # nothing but StoreOpenError escapes an open
        if "refused" in result:
            assert "StoreOpenError" in result["refused"] or "StoreFormatError" in result["refused"]
            outcomes[name] = "refused: " + result["refused"].replace(str(tmp_path), "<tmp>")
            continue
        wrong += result["wrong"]
        failed += result["raised"]
        outcomes[name] = (
            f"opened: {result['served']} served, {result['missed']} missed, "
            f"{result['wrong']} wrong, {result['raised']} raised, probe ok={result['probe_ok']}"
        )
    print("\n" + "\n".join(f"  {name}: {what}" for name, what in outcomes.items()))
    rel.report("corruption/truncated-or-garbage-files", runs=len(outcomes), faults=len(outcomes),
               wrong=wrong, failed=failed, crashed=crashed,
               refused=sum(v.startswith("refused") for v in outcomes.values()))
    assert crashed == 0, "a damaged store crashed the process"
    assert wrong == 0 and failed == 0
    assert outcomes["data.mdb short of its last page"].startswith("refused")


# -- damaged books -------------------------------------------------------------------------------
def _books(path: Path, change) -> None:
    env = lmdb.open(str(path), max_dbs=4, map_size=1 << 30)
    try:
        dbs = {name: env.open_db(name.encode()) for name in ("data", "meta", "lru", "info")}
        with env.begin(write=True) as txn:
            change(txn, dbs)
    finally:
        env.close()


def _lru_record(txn, dbs, key: bytes) -> bytes:
    for record, _ in txn.cursor(db=dbs["lru"]):
        if bytes(record).endswith(key):
            return bytes(record)
    raise AssertionError(f"no lru record for {key!r}")


def _stamp_overflow(txn, dbs) -> None:  # the newest lru stamp turned to the largest u64
    record = _lru_record(txn, dbs, b"book-3")
    txn.delete(record, db=dbs["lru"])
    txn.put(b"\xff" * 8 + b"book-3", b"", db=dbs["lru"])


BOOK_DAMAGES = {
    "meta record short": lambda txn, dbs: txn.put(b"book-3", b"xx", db=dbs["meta"]),
    "meta size huge": lambda txn, dbs: txn.put(
        b"book-3", struct.pack("<QQ", 1, 1 << 62), db=dbs["meta"]),
    "meta record missing": lambda txn, dbs: txn.delete(b"book-3", db=dbs["meta"]),
    "data record missing": lambda txn, dbs: txn.delete(b"book-3", db=dbs["data"]),
    "lru record short, sorted last": lambda txn, dbs: txn.put(b"abc", b"", db=dbs["lru"]),
    "lru record short, sorted first": lambda txn, dbs: txn.put(b"\0", b"", db=dbs["lru"]),
    "lru stamp at the u64 limit": _stamp_overflow,
    "used_bytes garbage": lambda txn, dbs: txn.put(b"used_bytes", b"abc", db=dbs["info"]),
    "used_bytes huge": lambda txn, dbs: txn.put(
        b"used_bytes", struct.pack("<Q", 1 << 62), db=dbs["info"]),
    "used_bytes missing": lambda txn, dbs: txn.delete(b"used_bytes", db=dbs["info"]),
}


def test_damaged_books_never_fail_a_request_nor_stop_the_store(tmp_path):
    """The accounting tables (meta, lru, info) damaged one record at a time: the store tools read
    it (``featcache verify``'s scan: a damaged book is a note or a bad entry, never an error), and
    the store opens (or is refused with StoreOpenError), serves nothing wrong, raises nothing, and
    keeps storing new entries within its budget."""
    budget = 1 << 20
    old = keys(20, b"book")
    new = keys(80, b"fresh")  # 80 x up to 32 KiB: the budget forces evictions
    totals = {"wrong": 0, "raised": 0, "worker_errors": 0, "tool_raised": 0}
    lines = []
    for name, change in BOOK_DAMAGES.items():
        store = tmp_path / name.replace(" ", "_").replace(",", "")
        fill(store, old, budget)
        _books(store, change)
        try:
            with StoreView(store) as view:
                report = view.verify()
            tool = f"verify: {len(report.bad)} bad, {len(report.notes)} notes"
        except Exception as e:  # what a user of `featcache verify` would have seen
            totals["tool_raised"] += 1
            tool = f"verify raised {e!r}"
        try:
            cache = rel.disk_cache(store, budget)
        except StoreOpenError as e:
            lines.append(f"  {name}: {tool}; refused ({e})")
            continue
        try:
            seen = read_all(cache, old)
            for i, key in enumerate(new):
                cache.put(key, rel.value_for(key))
                if i % 8 == 7:
                    rel.in_thread(cache.flush)
                    assert cache.stats()["disk"]["bytes"] <= budget, name
            rel.in_thread(cache.flush)
            after = read_all(cache, new)
            stats = cache.stats()
        finally:
            rel.in_thread(cache.close)
        for what in ("wrong", "raised"):
            totals[what] += seen[what] + after[what]
        totals["worker_errors"] += stats["cache"]["worker_errors"]
        lines.append(
            f"  {name}: {tool}; old {seen['served']}/{len(old)} served; new {after['served']}/{len(new)} "
            f"on disk; disk errors {stats['disk']['errors']}, worker errors "
            f"{stats['cache']['worker_errors']}"
        )
        assert seen["wrong"] == after["wrong"] == 0, name
        assert seen["raised"] == after["raised"] == 0, name
        assert stats["cache"]["worker_errors"] == 0, f"{name}: a write batch raised"
        assert after["served"] > 0, f"{name}: the store stopped taking new entries"
        assert stats["disk"]["bytes"] <= budget
        assert sum(map(len, raw_values(store).values())) <= budget, f"{name}: over budget"
    print("\n" + "\n".join(lines))
    rel.report("corruption/damaged-books", runs=len(BOOK_DAMAGES), faults=len(BOOK_DAMAGES),
               wrong=totals["wrong"], failed=totals["raised"],
               worker_errors=totals["worker_errors"], tool_raised=totals["tool_raised"])
    assert totals["tool_raised"] == 0, "verify raised on a damaged book record"
