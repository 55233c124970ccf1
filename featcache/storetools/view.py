"""A read-only view of a featcache store directory (the disk tier's LMDB files), live or not.

``StoreView`` reads a store without ever writing to it and without blocking the processes that
serve from it. The records are read through ``featcache.store.layout`` and the values through
``featcache.codec``; this module decodes nothing itself. The writes (``verify --fix``, ``purge``,
``compact``) are ``storetools.maintenance``'s.

How a live store is read (the choice, and why):
- ``lmdb.open(readonly=True, lock=True)``: LMDB's readers never block its writer (MVCC): each read
  transaction registers a slot in ``lock.mdb``, and the writer never reuses a page that a
  registered reader may still see. Registering needs write access to ``lock.mdb``: a user who
  cannot write it gets ``StorePermissionError`` with what to do.
- ``lock=False`` would skip that registration: a writer may then reuse pages under the reader,
  which reads garbage. It is only offered for a store no other process has open (``lock=False``
  here refuses a store in use, told by ``store.files.store_in_use`` from ``/proc/locks``: no file
  of the store is ever opened by hand while an environment is open, because closing it would drop
  this process's reader lock).
- every read transaction is short (one call, or one chunk of a scan): a long one would keep the
  writer from reusing the pages freed meanwhile, and the data file would grow.
- ``map_size=0``: the map size recorded in the store (the writers' 1 TiB or more), so a writer
  growing the data file never makes this reader fail.

Invariants: nothing here writes to the store it views (its environment is opened read-only), and
no ``StoreView`` creates a file in a directory that holds no ``data.mdb``, but for the empty
directory that ``copy_to`` (``maintenance.compact``) is given; every value shown as good passed
``codec.verify`` (header and checksum); ``data.mdb``'s B-trees are walked (``store.lmdbcheck``)
before LMDB reads a page.

LMDB forbids opening one environment twice in a process: close a ``StoreView`` before opening a
``DiskTier`` (or a ``FeatureCache``) on the same directory in the same process, and vice versa.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import lmdb

from .. import codec
from ..errors import FeatCacheError, StoreOpenError
from ..store import scan
from ..store.files import DATA_FILE, check_store_dir, open_error, store_in_use
from ..store.layout import (
    FORMAT_RECORD,
    TABLES,
    USED_RECORD,
    check_format,
    info_records,
    open_tables,
    unpack_lru,
    unpack_meta,
)
from ..store.lmdbcheck import NUM_METAS, check_data_file
from ..store.report import EntryInfo, Summary, VerifyReport, describe
from ..store.scan import read_entry


class KeyNotFoundError(FeatCacheError, LookupError):
    """No entry has the key (or key prefix) asked for, or a prefix matches several."""


class StoreView:
    """A read-only view of the store at ``path``; see the module docstring for the guarantees.

    ``lock=False`` skips LMDB's reader registration (for a store nobody else has open, e.g. one
    whose lock file this user cannot write); it raises ``StoreOpenError`` if the store is in use.
    Raises ``StoreOpenError`` (missing directory, no store there, damaged data file),
    ``StorePermissionError`` and ``StoreFormatError`` (not a featcache store; ``OtherFormatError``
    for another format version) at construction.
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
                self.path, readonly=True, lock=lock, map_size=0, max_dbs=len(TABLES),
                readahead=False, create=False, max_readers=1024, mode=0o600, subdir=True,
            )
        except lmdb.Error as e:
            raise open_error(self.path, e) from e
        try:
            # A data file whose structure LMDB cannot be trusted with is refused: reading a page
            # past its end, or a node running outside its page, would kill the process.
            check_data_file(self._env, os.path.join(self.path, DATA_FILE))
            self._tables = open_tables(self._env, self.path, create=False)
            self._check_format()
        except BaseException:
            self._env.close()
            raise

    def _check_format(self) -> None:
        try:
            with self._env.begin(db=self._tables.info) as txn:
                tag = txn.get(FORMAT_RECORD)
        except lmdb.Error as e:
            raise StoreOpenError(
                f"cannot read the format record of the store at {self.path!r}: {e}"
            ) from e
        self.format_tag = bytes(tag) if tag is not None else b""
        check_format(self.path, self.format_tag)

    # -- reads -----------------------------------------------------------------------------------
    def summary(self) -> Summary:
        """Entry count, books, settings and LMDB sizes, from one short read transaction."""
        info_env, stat = self._env.info(), self._env.stat()
        with self._env.begin() as txn:
            entries = int(txn.stat(self._tables.data)["entries"])
            # the pages the B-trees hold now: the two meta pages, the main table (the names of
            # the others) and every table; the rest of the file is free pages
            live_pages = NUM_METAS + _pages(stat) + sum(_pages(txn.stat(db)) for db in self._tables)
            info = info_records(txn, self._tables.info)
            cursor = txn.cursor(db=self._tables.lru)
            oldest = _stamp(bytes(cursor.key())) if cursor.first() else None
            newest = _stamp(bytes(cursor.key())) if cursor.last() else None
        used = info.get(USED_RECORD.decode())
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
            live_bytes=live_pages * int(stat["psize"]),
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
                value = txn.get(key, db=self._tables.data)
                if value is None:
                    continue  # evicted since the lru chunk was read
                info = describe(key, value, stamp, check=False)
            yield info
            count += 1
            if limit is not None and count >= limit:
                return

    def entry(self, key: bytes) -> EntryInfo | None:
        """The entry under ``key``, checksum verified, or None if there is none."""
        with self._env.begin(buffers=True) as txn:
            return read_entry(txn, self._tables, key, check=True)

    def find(self, key_hex: str) -> bytes:
        """The key whose hex form is ``key_hex`` or starts with it (a unique prefix).

        Raises ``ValueError`` for non-hex text, ``KeyNotFoundError`` when none or several match.
        """
        text = key_hex.strip().lower()
        if not text or any(c not in "0123456789abcdef" for c in text):
            raise ValueError(f"{key_hex!r} is not a hex key (as `featcache ls` prints them)")
        # the smallest key with this hex prefix (an odd length ends in a nibble: pad it with 0)
        start = bytes.fromhex(text + "0" * (len(text) % 2))
        found: list[bytes] = []
        with self._env.begin(db=self._tables.data) as txn:
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
        return scan.verify(self._read, self._tables, progress)

    def keys_used_before(self, cutoff_ns: int) -> list[tuple[bytes, int]]:
        """(key, size) of the entries last used before ``cutoff_ns``, oldest first."""
        out: list[tuple[bytes, int]] = []
        for stamp, key in self._lru_records(newest_first=False):
            if stamp >= cutoff_ns:
                break
            with self._env.begin(buffers=True) as txn:
                size = self._size(txn, key)
            if size is not None:
                out.append((key, size))
        return out

    def all_keys(self) -> list[tuple[bytes, int]]:
        """(key, size) of every value (size from its meta record, else the value's length)."""
        return self.keys_where(None)

    def keys_where(self, match: Callable[[bytes], bool] | None) -> list[tuple[bytes, int]]:
        """(key, size) of every readable value whose metadata ``match`` accepts (the header is
        read, the checksum is not: a damaged payload still has its metadata); every value when
        ``match`` is None, readable or not."""
        out: list[tuple[bytes, int]] = []
        for chunk in scan.key_chunks(self._read, self._tables.data):
            with self._env.begin(buffers=True) as txn:
                for key in chunk:
                    value = txn.get(key, db=self._tables.data)
                    if value is None:
                        continue  # deleted since the keys were read
                    if match is not None:
                        info = describe(key, value, None, check=False)
                        if info.header is None or not match(info.meta):
                            continue
                    meta = unpack_meta(txn.get(key, db=self._tables.meta))
                    out.append((key, meta.size if meta else len(value)))
        return out

    def copy_to(self, target: str) -> None:
        """LMDB's compacted copy of the store (free pages left out), consistent as of one read
        transaction, into the existing empty directory ``target``; the store itself is only read.
        ``storetools.maintenance.compact`` prepares ``target``."""
        try:
            self._env.copy(target, compact=True)
        except lmdb.Error as e:
            raise StoreOpenError(f"compacting {self.path!r} into {target!r} failed: {e}") from e

    def _read(self) -> lmdb.Transaction:
        """One short read transaction (``store.scan.Read``)."""
        return self._env.begin(buffers=True)

    def close(self) -> None:
        self._env.close()

    def __enter__(self) -> StoreView:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- helpers ---------------------------------------------------------------------------------
    def _size(self, txn: lmdb.Transaction, key: bytes) -> int | None:
        """The bytes ``key``'s entry accounts for: its meta record's size, else its value's
        length; None if it has neither."""
        meta = unpack_meta(txn.get(key, db=self._tables.meta))
        if meta is not None:
            return meta.size
        value = txn.get(key, db=self._tables.data)
        return len(value) if value is not None else None

    def _lru_records(self, newest_first: bool) -> Iterator[tuple[int, bytes]]:
        """(stamp, key) from the lru table, in order, read in chunks of short transactions."""
        position: bytes | None = None
        while True:
            chunk: list[bytes] = []
            with self._env.begin(db=self._tables.lru) as txn:
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
                while ok and len(chunk) < scan.SCAN_CHUNK_ENTRIES:
                    chunk.append(bytes(cursor.key()))
                    ok = cursor.prev() if newest_first else cursor.next()
            for record in chunk:
                entry = unpack_lru(record)
                if entry is not None:
                    yield entry
            if len(chunk) < scan.SCAN_CHUNK_ENTRIES:
                return
            position = chunk[-1]


def _pages(stat: Any) -> int:
    """The pages of one B-tree, from LMDB's ``stat`` of it."""
    return int(stat["branch_pages"]) + int(stat["leaf_pages"]) + int(stat["overflow_pages"])


def _stamp(record: bytes) -> int | None:
    """The stamp of an lru record as stored, or None if the record is malformed."""
    entry = unpack_lru(record)
    return entry[0] if entry is not None else None
