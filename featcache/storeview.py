"""Read-only and maintenance access to a featcache store directory (the disk tier's LMDB files).

``StoreView`` reads a store without ever writing to it and without blocking the processes that
serve from it; ``discard_keys``, ``purge_foreign_store`` and ``StoreView.compact_to`` change or
copy it. The layout (named databases ``data``/``meta``/``lru``/``info``, their record formats and
``FORMAT_TAG``) is the disk tier's (``featcache.tiers.disk``) and the value format is
``featcache.codec``'s; this module imports both and defines no layout of its own.

How a live store is read (the choice, and why):
- ``lmdb.open(readonly=True, lock=True)``: LMDB's readers never block its writer (MVCC): each read
  transaction registers a slot in ``lock.mdb``, and the writer never reuses a page that a
  registered reader may still see. Registering needs write access to ``lock.mdb``: a user who
  cannot write it gets ``StorePermissionError`` with what to do.
- ``lock=False`` would skip that registration: a writer may then reuse pages under the reader,
  which reads garbage. It is only offered for a store no other process has open (``lock=False``
  here refuses a store in use, told by the ``fcntl`` locks LMDB holds on ``lock.mdb``, read from
  ``/proc/locks``: no file of the store is ever opened by hand while an environment is open,
  because closing it would drop this process's reader lock).
- every read transaction is short (one call, or one chunk of a scan): a long one would keep the
  writer from reusing the pages freed meanwhile, and the data file would grow.
- ``map_size=0``: the map size recorded in the store (the writers' 1 TiB or more), so a writer
  growing the data file never makes this reader fail.

Invariants:
- nothing here writes to a store through ``StoreView``, and no ``StoreView`` creates a file in a
  directory that holds no ``data.mdb``;
- every value shown as good passed ``codec.verify`` (header and checksum);
- maintenance writes go through ``DiskTier`` (``write_batch`` with ``discard`` operations), so a
  value, its meta and lru records and ``used_bytes`` change in one transaction, by the disk tier's
  own rules; the tier is opened with a budget above what the store holds, so opening it never
  evicts anything.

LMDB forbids opening one environment twice in a process: close a ``StoreView`` before opening a
``DiskTier`` (or a ``FeatureCache``) on the same directory in the same process, and vice versa.
"""

from __future__ import annotations

import errno
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Literal

import lmdb

from . import codec
from .config import DEFAULT_DIR, ENV_DIR, default_store_dir  # noqa: F401  (re-exported)
from .errors import CorruptEntryError, FeatCacheError, StoreFormatError, StoreOpenError
from .tiers.disk import (
    _META,
    _STAMP,
    _U64,
    FORMAT_TAG,
    DiskOp,
    DiskTier,
    check_store_files,
    records_problem,
)
from .tiers.lmdbcheck import check_data_file

# The named databases the disk tier opens, in its order (tests/test_cli_store.py checks a store
# written by DiskTier has exactly these).
DB_NAMES = (b"data", b"meta", b"lru", b"info")
DATA_FILE = "data.mdb"
LOCK_FILE = "lock.mdb"
SCAN_CHUNK_ENTRIES = 512  # entries per read transaction of a scan
SCAN_CHUNK_BYTES = 64 << 20  # value bytes per read transaction of a scan
DISCARD_BATCH = 1024  # discards per write transaction


class StorePermissionError(StoreOpenError):
    """This user may not read the store (or write its lock file, which a safe reader needs)."""


class OtherFormatError(StoreFormatError):
    """The directory holds a featcache store of another format version (``tag``)."""

    def __init__(self, message: str, tag: bytes) -> None:
        super().__init__(message)
        self.tag = tag


class KeyNotFoundError(FeatCacheError, LookupError):
    """No entry has the key (or key prefix) asked for, or a prefix matches several."""


@dataclass(frozen=True)
class EntryInfo:
    """One stored entry as read from the store.

    ``size``: the value's length in bytes (header + metadata + payload), what the budget counts.
    ``last_use_ns``: the lru stamp (ns since the epoch), None if the meta record is missing or
    malformed. ``header`` is None when the value's header is invalid; ``problem`` then says why,
    and also says why the checksum failed when ``checksum_ok`` is False (None: not checked).
    """

    key: bytes
    size: int
    last_use_ns: int | None
    header: codec.Header | None
    meta: bytes = b""
    problem: str | None = None
    checksum_ok: bool | None = None


@dataclass(frozen=True)
class Summary:
    """What a store directory holds, read in one read transaction.

    ``capacity_bytes`` is the budget recorded in the store's ``info`` table, None when none is
    recorded (each process sets its own ``disk_bytes``; the store keeps only ``used_bytes``).
    ``in_use_by``: the pid of a process that has the store open, 0 when none, None if unknown.
    """

    path: str
    format_tag: str
    value_format_version: int
    entries: int
    used_bytes: int | None
    capacity_bytes: int | None
    oldest_use_ns: int | None
    newest_use_ns: int | None
    map_size: int
    data_file_bytes: int
    pages_bytes: int
    page_size: int
    in_use_by: int | None
    info: dict[str, int | str] = field(default_factory=dict)


@dataclass
class VerifyReport:
    """The outcome of ``StoreView.verify``: ``bad`` entries fail ``codec.verify`` or have broken
    books (a value without its meta record, or the reverse, or a size that disagrees); ``notes``
    are book problems that deleting an entry does not repair (reported, not counted as bad)."""

    checked: int = 0
    checked_bytes: int = 0
    bad: list[EntryInfo] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


class StoreView:
    """A read-only view of the store at ``path``; see the module docstring for the guarantees.

    ``lock=False`` skips LMDB's reader registration (for a store nobody else has open, e.g. one
    whose lock file this user cannot write); it raises ``StoreOpenError`` if the store is in use.
    Raises ``StoreOpenError`` (missing directory, no store there, damaged data file),
    ``StorePermissionError`` and ``StoreFormatError`` (not a featcache store, or another format
    version) at construction.
    """

    def __init__(self, path: str | os.PathLike[str], *, lock: bool = True) -> None:
        self.path = os.fspath(path)
        self.lock = lock
        self.format_tag: bytes = b""
        check_store_dir(self.path, lock=lock)
        if not lock:
            holder = store_in_use(self.path)
            if holder:
                raise StoreOpenError(
                    f"the store at {self.path!r} is open in process {holder}: reading it without "
                    "the lock is unsafe while it may be written; drop --no-lock (and run as a "
                    "user who can write its lock.mdb)"
                )
        try:
            self._env = lmdb.open(
                self.path, readonly=True, lock=lock, map_size=0, max_dbs=len(DB_NAMES),
                readahead=False, create=False, max_readers=1024, mode=0o600, subdir=True,
            )
        except lmdb.Error as e:
            raise _open_error(self.path, e) from e
        try:
            self._check_file()
            self._dbs = {name: self._open_db(name) for name in DB_NAMES}
            self._check_format()
        except BaseException:
            self._env.close()
            raise

    # -- opening ---------------------------------------------------------------------------------
    def _check_file(self) -> None:
        """Refuse a data file whose structure LMDB cannot be trusted with (the disk tier's
        ``lmdbcheck``): reading a page past its end, or a node running outside its page, would kill
        the process (SIGBUS, SIGSEGV)."""
        check_data_file(self._env, os.path.join(self.path, DATA_FILE))

    def _open_db(self, name: bytes) -> lmdb._Database:
        try:
            return self._env.open_db(name, create=False)
        except (lmdb.NotFoundError, lmdb.IncompatibleError) as e:
            raise StoreFormatError(
                f"{self.path!r} is not a featcache store (an LMDB environment without a "
                f"{name.decode()!r} table)"
            ) from e
        except lmdb.Error as e:
            raise StoreOpenError(
                f"cannot open the {name.decode()!r} table of the store at {self.path!r}: {e}"
            ) from e

    def _check_format(self) -> None:
        try:
            with self._env.begin(db=self._dbs[b"info"]) as txn:
                tag = txn.get(b"format")
        except lmdb.Error as e:
            raise StoreOpenError(
                f"cannot read the format record of the store at {self.path!r}: {e}"
            ) from e
        self.format_tag = bytes(tag) if tag is not None else b""
        if not self.format_tag:
            raise StoreFormatError(format_message(self.path, self.format_tag))
        if self.format_tag != FORMAT_TAG:
            raise OtherFormatError(format_message(self.path, self.format_tag), self.format_tag)

    # -- reads -----------------------------------------------------------------------------------
    def summary(self) -> Summary:
        """Entry count, books, settings and LMDB sizes, from one short read transaction."""
        info_env, stat = self._env.info(), self._env.stat()
        with self._env.begin() as txn:
            entries = int(txn.stat(self._dbs[b"data"])["entries"])
            info = _info_records(txn, self._dbs[b"info"])
            cursor = txn.cursor(db=self._dbs[b"lru"])
            oldest = _stamp(bytes(cursor.key())) if cursor.first() else None
            newest = _stamp(bytes(cursor.key())) if cursor.last() else None
        used = info.get("used_bytes")
        capacity = next((info[k] for k in ("capacity_bytes", "budget_bytes", "budget") if k in info),
                        None)
        return Summary(
            path=os.path.abspath(self.path),
            format_tag=self.format_tag.decode("ascii", "replace"),
            value_format_version=codec.FORMAT_VERSION,
            entries=entries,
            used_bytes=used if isinstance(used, int) else None,
            capacity_bytes=capacity if isinstance(capacity, int) else None,
            oldest_use_ns=oldest,
            newest_use_ns=newest,
            map_size=int(info_env["map_size"]),
            data_file_bytes=os.path.getsize(os.path.join(self.path, DATA_FILE)),
            pages_bytes=(int(info_env["last_pgno"]) + 1) * int(stat["psize"]),
            page_size=int(stat["psize"]),
            in_use_by=store_in_use(self.path),
            info=info,
        )

    def entries(self, *, newest_first: bool = True, limit: int | None = None) -> Iterator[EntryInfo]:
        """Entries in last-use order (the lru table), each with its header and metadata; the
        checksum is not checked (``entry`` and ``verify`` do). A live store may change while this
        runs: an entry used meanwhile can be listed twice or not at all."""
        count = 0
        for stamp, key in self._lru_records(newest_first):
            with self._env.begin(buffers=True) as txn:
                value = txn.get(key, db=self._dbs[b"data"])
                if value is None:
                    continue  # evicted since the lru chunk was read
                info = _describe(key, value, stamp, check=False)
            yield info
            count += 1
            if limit is not None and count >= limit:
                return

    def entry(self, key: bytes) -> EntryInfo | None:
        """The entry under ``key``, checksum verified, or None if there is none."""
        with self._env.begin(buffers=True) as txn:
            value = txn.get(key, db=self._dbs[b"data"])
            if value is None:
                return None
            meta = _meta_record(txn.get(key, db=self._dbs[b"meta"]))
            return _describe(key, value, meta[0] if meta else None, check=True)

    def find(self, key_hex: str) -> bytes:
        """The key whose hex form is ``key_hex`` or starts with it (a unique prefix).

        Raises ``ValueError`` for non-hex text, ``KeyNotFoundError`` when none or several match.
        """
        text = key_hex.strip().lower()
        if not text or any(c not in "0123456789abcdef" for c in text):
            raise ValueError(f"{key_hex!r} is not a hex key (as `featcache ls` prints them)")
        start = bytes.fromhex(text[: len(text) // 2 * 2])
        found: list[bytes] = []
        with self._env.begin(db=self._dbs[b"data"]) as txn:
            cursor = txn.cursor()
            if cursor.set_range(start):
                for key in cursor.iternext(keys=True, values=False):
                    key = bytes(key)
                    if not key.hex().startswith(text):
                        break
                    found.append(key)
                    if len(found) > 1 and key.hex() != text:
                        break
        exact = [k for k in found if k.hex() == text]
        if exact:
            return exact[0]
        if not found:
            raise KeyNotFoundError(f"no entry with key {text} in {self.path!r}")
        if len(found) > 1:
            raise KeyNotFoundError(f"the key prefix {text} matches several entries: give more digits")
        return found[0]

    def verify(self, progress: Callable[[int, int], None] | None = None) -> VerifyReport:
        """Check every value's header and checksum, and the books that account for them.

        Values are read in chunks, each in its own short read transaction (a live writer is never
        held back); ``progress(entries, bytes)`` is called after each value.
        """
        report = VerifyReport()
        bad_keys: set[bytes] = set()
        for info in self._scan_values():
            report.checked += 1
            report.checked_bytes += info.size
            if info.problem is not None:
                report.bad.append(info)
                bad_keys.add(info.key)
            if progress is not None:
                progress(report.checked, report.checked_bytes)
        broken, notes = self._check_books()
        report.bad.extend(e for e in broken if e.key not in bad_keys)
        report.notes.extend(notes)
        return report

    def keys_used_before(self, cutoff_ns: int) -> list[tuple[bytes, int]]:
        """(key, size) of the entries last used before ``cutoff_ns``, oldest first."""
        out: list[tuple[bytes, int]] = []
        for stamp, key in self._lru_records(newest_first=False):
            if stamp >= cutoff_ns:
                break
            size = self._size_of(key)
            if size is not None:
                out.append((key, size))
        return out

    def all_keys(self) -> list[tuple[bytes, int]]:
        """(key, size) of every value (size from its meta record, else the value's length)."""
        out: list[tuple[bytes, int]] = []
        for chunk in self._key_chunks(b"data"):
            with self._env.begin(buffers=True) as txn:
                for key in chunk:
                    value = txn.get(key, db=self._dbs[b"data"])
                    if value is not None:
                        meta = _meta_record(txn.get(key, db=self._dbs[b"meta"]))
                        out.append((key, meta[1] if meta else len(value)))
        return out

    def keys_where(self, match: Callable[[bytes], bool]) -> list[tuple[bytes, int]]:
        """(key, size) of every readable value whose metadata ``match`` accepts (the header is
        read, the checksum is not: a damaged payload still has its metadata)."""
        out: list[tuple[bytes, int]] = []
        for chunk in self._key_chunks(b"data"):
            with self._env.begin(buffers=True) as txn:
                for key in chunk:
                    value = txn.get(key, db=self._dbs[b"data"])
                    if value is None:
                        continue
                    info = _describe(key, value, None, check=False)
                    if info.header is not None and match(info.meta):
                        meta = _meta_record(txn.get(key, db=self._dbs[b"meta"]))
                        out.append((key, meta[1] if meta else len(value)))
        return out

    def compact_to(self, dest: str | os.PathLike[str]) -> None:
        """Write a compacted copy of the store (free pages left out) into ``dest``: an empty or
        missing directory. The copy is consistent as of one read transaction; what writers add
        meanwhile is not in it."""
        target = os.fspath(dest)
        if os.path.exists(target):
            if not os.path.isdir(target):
                raise StoreOpenError(f"{target!r} exists and is not a directory")
            if os.listdir(target):
                raise StoreOpenError(f"{target!r} is not empty: compact writes into an empty directory")
        else:
            try:
                os.makedirs(target, mode=0o700)
            except OSError as e:
                raise _os_error(target, e) from e
        try:
            self._env.copy(target, compact=True)
        except lmdb.Error as e:
            raise StoreOpenError(f"compacting {self.path!r} into {target!r} failed: {e}") from e
        os.chmod(os.path.join(target, DATA_FILE), 0o600)  # as the disk tier creates its files

    def close(self) -> None:
        self._env.close()

    def __enter__(self) -> StoreView:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- helpers ---------------------------------------------------------------------------------
    def _lru_records(self, newest_first: bool) -> Iterator[tuple[int, bytes]]:
        """(stamp, key) from the lru table, in order, read in chunks of short transactions."""
        position: bytes | None = None
        while True:
            chunk: list[bytes] = []
            with self._env.begin(db=self._dbs[b"lru"]) as txn:
                cursor = txn.cursor()
                if position is None:
                    ok = cursor.last() if newest_first else cursor.first()
                elif newest_first:  # the record before ``position``
                    ok = cursor.set_range(position)
                    ok = cursor.prev() if ok else cursor.last()
                else:
                    ok = cursor.set_range(position)
                    if ok and bytes(cursor.key()) == position:
                        ok = cursor.next()
                while ok and len(chunk) < SCAN_CHUNK_ENTRIES:
                    chunk.append(bytes(cursor.key()))
                    ok = cursor.prev() if newest_first else cursor.next()
            for record in chunk:
                if len(record) > _STAMP.size:
                    yield _stamp(record) or 0, record[_STAMP.size :]
            if len(chunk) < SCAN_CHUNK_ENTRIES:
                return
            position = chunk[-1]

    def _key_chunks(self, table: bytes) -> Iterator[list[bytes]]:
        """The keys of ``table`` in order, in chunks, each read in its own transaction."""
        last: bytes | None = None
        while True:
            chunk: list[bytes] = []
            with self._env.begin(db=self._dbs[table]) as txn:
                cursor = txn.cursor()
                ok = cursor.first() if last is None else cursor.set_range(last)
                if ok and last is not None and bytes(cursor.key()) == last:
                    ok = cursor.next()
                while ok and len(chunk) < SCAN_CHUNK_ENTRIES:
                    chunk.append(bytes(cursor.key()))
                    ok = cursor.next()
            if chunk:
                yield chunk
            if len(chunk) < SCAN_CHUNK_ENTRIES:
                return
            last = chunk[-1]

    def _scan_values(self) -> Iterator[EntryInfo]:
        """Every value, checksum verified; a read transaction ends after SCAN_CHUNK_BYTES."""
        for chunk in self._key_chunks(b"data"):
            i = 0
            while i < len(chunk):
                done: list[EntryInfo] = []
                nbytes = 0
                with self._env.begin(buffers=True) as txn:
                    while i < len(chunk) and nbytes < SCAN_CHUNK_BYTES:
                        key = chunk[i]
                        i += 1
                        value = txn.get(key, db=self._dbs[b"data"])
                        if value is None:
                            continue  # deleted since the keys were read
                        meta = _meta_record(txn.get(key, db=self._dbs[b"meta"]))
                        done.append(_describe(key, value, meta[0] if meta else None, check=True))
                        nbytes += len(value)
                yield from done

    def _check_books(self) -> tuple[list[EntryInfo], list[str]]:
        """The accounting, in one read transaction (small tables; values are not read)."""
        broken: list[EntryInfo] = []
        notes: list[str] = []
        total = 0
        with self._env.begin(buffers=True) as txn:
            data, meta_db, lru = self._dbs[b"data"], self._dbs[b"meta"], self._dbs[b"lru"]
            for raw_key, raw in txn.cursor(db=meta_db):
                key = bytes(raw_key)
                meta = _meta_record(raw)
                value = txn.get(key, db=data)
                problem = records_problem(value, raw)  # the disk tier's rule
                if meta is not None:
                    total += meta[1]
                if problem is not None:
                    size = len(value) if value is not None else meta[1] if meta is not None else 0
                    broken.append(_broken(key, size, meta[0] if meta is not None else None, problem))
                    continue
                assert meta is not None
                stamp = meta[0]
                if txn.get(_STAMP.pack(stamp) + key, db=lru) is None:
                    notes.append(f"{key.hex()}: no lru record (it cannot be evicted until used)")
            for raw_key in txn.cursor(db=data).iternext(keys=True, values=False):
                key = bytes(raw_key)
                if txn.get(key, db=meta_db) is None:
                    value = txn.get(key, db=data)
                    size = len(value) if value is not None else 0
                    broken.append(_broken(key, size, None, "value without a meta record"))
            stale = 0
            for raw_key in txn.cursor(db=lru).iternext(keys=True, values=False):
                record = bytes(raw_key)
                key = record[_STAMP.size :]
                meta = _meta_record(txn.get(key, db=meta_db))
                if meta is None or _STAMP.pack(meta[0]) + key != record:
                    stale += 1
            used = _info_records(txn, self._dbs[b"info"]).get("used_bytes")
        if stale:
            notes.append(f"{stale} stale lru record(s) (the disk tier drops them as it evicts)")
        if used != total:
            notes.append(
                f"used_bytes is {used}, the meta records add up to {total} (the disk tier "
                "recounts when it finds its books wrong)"
            )
        return broken, notes

    def _size_of(self, key: bytes) -> int | None:
        with self._env.begin(buffers=True) as txn:
            meta = _meta_record(txn.get(key, db=self._dbs[b"meta"]))
            if meta is not None:
                return meta[1]
            value = txn.get(key, db=self._dbs[b"data"])
            return len(value) if value is not None else None


# -- maintenance (writes) ----------------------------------------------------------------------
def maintenance_budget(path: str | os.PathLike[str]) -> int:
    """A budget above what the store holds, so that opening a ``DiskTier`` on it for maintenance
    evicts nothing (the store records no budget of its own)."""
    try:
        file_bytes = os.path.getsize(os.path.join(os.fspath(path), DATA_FILE))
    except OSError:
        file_bytes = 0
    return 2 * file_bytes + (1 << 30)  # used_bytes <= the data file's size


def discard_keys(path: str | os.PathLike[str], keys: Iterable[bytes], *,
                 only_bad: bool = False) -> int:
    """Delete ``keys`` through a writable ``DiskTier``: each batch of DISCARD_BATCH is one write
    transaction that deletes data, meta and lru records and lowers ``used_bytes``.

    ``only_bad``: delete a key only if its entry is still bad inside that transaction (``verify
    --fix`` on a live store: a writer may have replaced a bad value with a good one since).
    Returns the number of keys deleted. Raises ``StoreOpenError`` if the store cannot be opened
    for writing, ``FeatCacheError`` if a transaction failed (the disk tier counts it).
    """
    todo = list(keys)
    kind: Literal["discard", "discard_bad"] = "discard_bad" if only_bad else "discard"
    tier = DiskTier(path, maintenance_budget(path))
    try:
        for start in range(0, len(todo), DISCARD_BATCH):
            tier.write_batch([DiskOp(kind, k) for k in todo[start : start + DISCARD_BATCH]])
        stats = tier.stats()
        errors = stats["errors"]
        deleted = stats.get("bad_deleted", 0) if only_bad else len(todo)
    finally:
        tier.close()
    if errors:
        raise FeatCacheError(
            f"{errors} write transaction(s) on {os.fspath(path)!r} failed (see the log above); "
            "some entries may remain"
        )
    return deleted


def purge_foreign_store(path: str | os.PathLike[str]) -> str:
    """Delete the files of a featcache store of another format version (this featcache cannot
    read its entries, only remove them). Returns the format tag it held.

    Refuses anything but an LMDB environment whose ``info`` table names a ``featcache-`` format,
    and a store another process has open.
    """
    where = os.fspath(path)
    check_store_dir(where, lock=True)
    holder = store_in_use(where)
    if holder:
        raise StoreOpenError(f"the store at {where!r} is open in process {holder}: stop it first")
    try:
        env = lmdb.open(where, readonly=True, lock=False, map_size=0, max_dbs=len(DB_NAMES),
                        create=False)
    except lmdb.Error as e:
        raise _open_error(where, e) from e
    try:
        check_data_file(env, os.path.join(where, DATA_FILE))  # a damaged file could crash LMDB
        with env.begin() as txn:
            info = env.open_db(b"info", txn=txn, create=False)
            tag = bytes(txn.get(b"format", db=info) or b"")
    except lmdb.Error as e:
        raise StoreFormatError(f"{where!r} is not a featcache store: nothing deleted") from e
    finally:
        env.close()
    if not tag.startswith(b"featcache-"):
        raise StoreFormatError(f"{where!r} is not a featcache store: nothing deleted")
    if tag == FORMAT_TAG:
        raise StoreFormatError(f"{where!r} is a store of this version: purge its entries instead")
    for name in (DATA_FILE, LOCK_FILE):
        try:
            os.remove(os.path.join(where, name))
        except FileNotFoundError:
            pass
        except OSError as e:
            raise _os_error(where, e) from e
    return tag.decode("ascii", "replace")


# -- checks ------------------------------------------------------------------------------------
def check_store_dir(path: str, *, lock: bool) -> None:
    """Raise the error a user can act on if ``path`` cannot hold a readable store."""
    if not os.path.exists(path):
        raise StoreOpenError(f"no such directory: {path!r}")
    if not os.path.isdir(path):
        raise StoreOpenError(f"{path!r} is not a directory (a store is a directory)")
    data = os.path.join(path, DATA_FILE)
    if not os.access(path, os.R_OK | os.X_OK):
        raise StorePermissionError(f"permission denied: cannot read the directory {path!r}")
    if not os.path.exists(data):
        raise StoreFormatError(f"{path!r} is not a featcache store (no {DATA_FILE} in it)")
    check_store_files(path)
    if not os.access(data, os.R_OK):
        raise StorePermissionError(f"permission denied: cannot read {data!r}; run as its owner")
    lock_file = os.path.join(path, LOCK_FILE)
    lock_ok = os.access(lock_file, os.R_OK | os.W_OK) if os.path.exists(lock_file) else os.access(
        path, os.W_OK)
    if lock and not lock_ok and not _read_only_fs(path):
        raise StorePermissionError(
            f"permission denied: {lock_file!r} is not writable by this user, and a safe reader "
            "of a live store registers there; run as the store's owner, or add --no-lock if no "
            "process has the store open"
        )


def store_in_use(path: str) -> int | None:
    """The pid of another process that has the store open (it holds LMDB's shared ``fcntl`` lock
    on ``lock.mdb``), 0 if none, None if that cannot be told (not Linux, no lock file).

    Read from ``/proc/locks``, never by opening ``lock.mdb``: closing any descriptor of a file
    drops every POSIX lock this process holds on it, LMDB's reader lock included, and a writer
    would then take this process's readers for dead and reuse the pages they are reading
    (corrupt copies, verify reporting good entries as bad; issue 11).
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        inode = os.stat(os.path.join(path, LOCK_FILE)).st_ino
        with open("/proc/locks", encoding="ascii", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    me = os.getpid()
    for line in lines:
        # "1: POSIX  ADVISORY  READ 1234 fd:01:5678 0 0" ("->" marks a waiter: not a holder)
        fields = line.split()
        if len(fields) < 8 or fields[1] == "->" or fields[1] != "POSIX":
            continue
        try:
            pid = int(fields[4])
            ino = int(fields[5].rsplit(":", 1)[1])
        except (ValueError, IndexError):
            continue
        # The inode alone: a lock on an overlay file system shows the device of the layer below.
        if ino == inode and pid != me and pid > 0:
            return pid
    return 0


def format_message(path: str, tag: bytes) -> str:
    if not tag:
        return f"{path!r} is not a featcache store (no format record)"
    return (
        f"{path!r} holds a featcache store of format {tag.decode('ascii', 'replace')!r}; this "
        f"featcache reads {FORMAT_TAG.decode()!r}: delete it with `featcache purge --all {path}` "
        "or point the cache elsewhere"
    )


# -- records -----------------------------------------------------------------------------------
def _stamp(record: bytes) -> int | None:
    if len(record) <= _STAMP.size:
        return None
    return int(_STAMP.unpack(record[: _STAMP.size])[0])


def _meta_record(raw: bytes | memoryview | None) -> tuple[int, int] | None:
    if raw is None or len(raw) != _META.size:
        return None
    stamp, size = _META.unpack(raw)
    return int(stamp), int(size)


def _info_records(txn: lmdb.Transaction, db: lmdb._Database) -> dict[str, int | str]:
    """The info table: u64 records as ints, others as text."""
    out: dict[str, int | str] = {}
    for raw_key, raw in txn.cursor(db=db):
        name = bytes(raw_key).decode("ascii", "replace")
        value = bytes(raw)
        out[name] = int(_U64.unpack(value)[0]) if len(value) == _U64.size and name != "format" \
            else value.decode("ascii", "replace")
    return out


def _describe(key: bytes, value: memoryview | bytes, stamp: int | None, *, check: bool) -> EntryInfo:
    """An EntryInfo from a value read in the caller's transaction (copies what it keeps)."""
    size = len(value)
    try:
        header = codec.verify(value) if check else codec.decode_header(value)
    except CorruptEntryError as e:
        readable: codec.Header | None = None
        try:
            readable = codec.decode_header(value)  # a checksum failure still has a readable header
        except CorruptEntryError:
            pass
        meta = codec.meta(value, readable) if readable is not None else b""
        return EntryInfo(key, size, stamp, readable, meta, problem=str(e),
                         checksum_ok=False if check else None)
    return EntryInfo(key, size, stamp, header, codec.meta(value, header),
                     checksum_ok=True if check else None)


def _broken(key: bytes, size: int, stamp: int | None, problem: str) -> EntryInfo:
    return EntryInfo(key, size, stamp, None, problem=problem)


def _read_only_fs(path: str) -> bool:
    """On a read-only file system LMDB reads without its lock file (no writer can exist)."""
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def _open_error(path: str, error: lmdb.Error) -> StoreOpenError:
    text = str(error)
    if "Permission denied" in text or "EACCES" in text:
        return StorePermissionError(f"permission denied opening the store at {path!r}: {text}")
    return StoreOpenError(f"cannot open the LMDB store at {path!r}: {text}")


def _os_error(path: str, error: OSError) -> StoreOpenError:
    if error.errno in (errno.EACCES, errno.EPERM):
        return StorePermissionError(f"permission denied: {error.filename or path!r}")
    return StoreOpenError(f"{path!r}: {error.strerror or error}")
