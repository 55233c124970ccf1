"""The books of a store inside one LMDB transaction: each key's ``data``, ``meta`` and ``lru``
records (``store.layout``) and the ``used_bytes`` count, changed together.

Only these write transactions change them: the disk tier's (``featcache.tiers.disk``: its writer
thread, its synchronous ``discard``, and the eviction at open) and the store tools' deletes
(``store.deletes``: ``verify --fix``, ``purge``), by the same calls. ``Books`` keeps no state
between calls: the caller carries ``used`` through a transaction and stores it with ``set_used``
before committing.

Invariants (each write transaction that uses these keeps them):
- ``put`` writes a key's three records; ``delete`` removes them and returns the bytes the meta
  record accounted for; ``touch`` moves a key's lru record to a new stamp;
- no damaged record stops the books: a malformed meta or lru record is skipped or deleted, a stamp
  past 2**63 is ignored (new stamps must stay below 2**64), and ``used_bytes`` is recounted from
  the meta table whenever it is missing, malformed or proven wrong (negative, or over the limit
  with nothing left to evict).
"""

from __future__ import annotations

from collections.abc import Callable

import lmdb

from .. import codec
from ..errors import CorruptEntryError
from .layout import (
    USED_RECORD,
    Tables,
    lru_record,
    pack_meta,
    pack_used,
    records_problem,
    unpack_lru,
    unpack_meta,
    unpack_used,
)

STAMP_LIMIT = 1 << 63  # a stamp at or past this (centuries ahead) is damage


class Books:
    """The books of ``tables`` in the transaction ``txn`` (a read transaction suffices for
    ``used``). ``on_recount`` is called before each recount (the books proved wrong)."""

    def __init__(self, txn: lmdb.Transaction, tables: Tables, on_recount: Callable[[], None]) -> None:
        self.txn = txn
        self.tables = tables
        self._on_recount = on_recount
        self._lru_cursor: lmdb.Cursor | None = None

    # -- used_bytes ------------------------------------------------------------------------------
    def used(self) -> int:
        """``used_bytes`` as recorded, or recounted if the record is missing or malformed."""
        used = unpack_used(self.txn.get(USED_RECORD, db=self.tables.info))
        return used if used is not None else self.recount()

    def set_used(self, used: int) -> None:
        self.txn.put(USED_RECORD, pack_used(used), db=self.tables.info)

    def less(self, used: int, freed: int) -> int:
        """``used - freed``, recounted if that is negative (a damaged size was subtracted)."""
        return used - freed if used >= freed else self.recount()

    def recount(self) -> int:
        """The sum of the value sizes in the meta table (the books proved wrong: repair them)."""
        self._on_recount()
        total = 0
        for _, raw in self.txn.cursor(db=self.tables.meta):
            meta = unpack_meta(raw)
            total += meta.size if meta is not None else 0
        return total

    # -- records of one key ----------------------------------------------------------------------
    def last_stamp(self) -> int:
        """The newest stamp in the lru table; 0 if there is none, or it is malformed or past
        ``STAMP_LIMIT``."""
        cursor = self._cursor()
        entry = unpack_lru(bytes(cursor.key())) if cursor.last() else None
        return entry[0] if entry is not None and entry[0] < STAMP_LIMIT else 0

    def put(self, key: bytes, value: bytes | memoryview, stamp: int) -> None:
        """Write ``key``'s records (its older ones deleted already: ``delete``)."""
        self.txn.put(key, value, db=self.tables.data)
        self.txn.put(key, pack_meta(stamp, len(value)), db=self.tables.meta)
        self.txn.put(lru_record(stamp, key), b"", db=self.tables.lru)

    def delete(self, key: bytes) -> int:
        """Remove ``key``'s records; return the bytes it accounted for (0 if absent)."""
        meta = unpack_meta(self.txn.get(key, db=self.tables.meta))
        self.txn.delete(key, db=self.tables.data)
        self.txn.delete(key, db=self.tables.meta)
        if meta is None:  # a value without (valid) meta was unaccounted; its lru record, if any,
            return 0  # is evicted in its turn
        self.txn.delete(lru_record(meta.stamp, key), db=self.tables.lru)
        return meta.size

    def touch(self, key: bytes, stamp: int) -> None:
        """Make ``stamp`` the last use of ``key`` (nothing if it has no valid meta record)."""
        meta = unpack_meta(self.txn.get(key, db=self.tables.meta))
        if meta is None:
            return
        self.txn.delete(lru_record(meta.stamp, key), db=self.tables.lru)
        self.txn.put(lru_record(stamp, key), b"", db=self.tables.lru)
        self.txn.put(key, pack_meta(stamp, meta.size), db=self.tables.meta)

    def is_bad(self, key: bytes) -> bool:
        """Whether ``key``'s entry is bad now: its records disagree (``records_problem``) or its
        value fails ``codec.verify``."""
        value = self.txn.get(key, db=self.tables.data)
        if records_problem(value, self.txn.get(key, db=self.tables.meta)) is not None:
            return True
        try:
            if value is not None:
                codec.verify(value)
        except CorruptEntryError:
            return True
        return False

    def clear(self) -> int:
        """Delete every entry's records and set ``used_bytes`` to 0; return how many values
        there were. The tables themselves (and the ``info`` records) stay."""
        entries = int(self.txn.stat(self.tables.data)["entries"])
        for table in (self.tables.data, self.tables.meta, self.tables.lru):
            self.txn.drop(table, delete=False)
        self.set_used(0)
        return entries

    # -- eviction --------------------------------------------------------------------------------
    def evict_oldest(self) -> int | None:
        """Delete the least recently used entry; return its bytes, or None if there is none."""
        cursor = self._cursor()
        if not cursor.first():
            return None
        record = bytes(cursor.key())
        entry = unpack_lru(record)
        freed = self.delete(entry[1]) if entry is not None else 0
        self.txn.delete(record, db=self.tables.lru)  # gone already unless the books disagreed
        return freed

    def evict_to(self, used: int, limit: int) -> tuple[int, int]:
        """Evict oldest first while ``used`` > ``limit``; return (used, entries evicted). With
        nothing left to evict yet over the limit, the books were wrong: ``used`` is recounted."""
        evicted = 0
        while used > limit:
            freed = self.evict_oldest()
            if freed is None:
                return self.recount(), evicted
            used = self.less(used, freed)
            evicted += 1
        return used, evicted

    def _cursor(self) -> lmdb.Cursor:
        if self._lru_cursor is None:
            self._lru_cursor = self.txn.cursor(db=self.tables.lru)
        return self._lru_cursor
