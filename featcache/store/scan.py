"""Scans of a store in short read transactions: its keys in order, and the check of every value
and of the books that account for them (``verify``). The store tools' ``StoreView`` and the disk
tier (``FeatureCache.keys``/``verify``) both scan through here, each with its own environment.

``Read`` opens one short read transaction (``buffers=True``); a scan opens one per chunk of at
most ``SCAN_CHUNK_ENTRIES`` keys (and ``SCAN_CHUNK_BYTES`` of values), so a live writer is never
held back and the data file does not grow under a long reader.

Guarantees while writers run (other threads or processes): keys come in strictly increasing byte
order, each chunk resuming after the last key of the one before, so no key is yielded twice, and
every key present from the start of a scan to its end is yielded; a key added or deleted during
the scan may or may not be.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

import lmdb

from .layout import USED_RECORD, Tables, info_records, lru_record, records_problem, unpack_lru, unpack_meta
from .report import EntryInfo, VerifyReport, broken, describe

SCAN_CHUNK_ENTRIES = 512  # entries per read transaction of a scan
SCAN_CHUNK_BYTES = 64 << 20  # value bytes per read transaction of a scan

Read = Callable[[], AbstractContextManager[lmdb.Transaction]]


def key_chunks(read: Read, table: lmdb._Database) -> Iterator[list[bytes]]:
    """The keys of ``table`` in order, in chunks, each read in its own transaction."""
    last: bytes | None = None
    while True:
        chunk: list[bytes] = []
        with read() as txn:
            cursor = txn.cursor(db=table)
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


def read_entry(txn: lmdb.Transaction, tables: Tables, key: bytes, *, check: bool) -> EntryInfo | None:
    """The entry under ``key`` as ``txn`` sees it (last use from its meta record), or None."""
    value = txn.get(key, db=tables.data)
    if value is None:
        return None
    meta = unpack_meta(txn.get(key, db=tables.meta))
    return describe(key, value, meta.stamp if meta else None, check=check)


def verify(read: Read, tables: Tables,
           progress: Callable[[int, int], None] | None = None) -> VerifyReport:
    """Check every value's header and checksum (values read in chunks of short transactions,
    ``progress(entries, bytes)`` called after each), then the books, in one read transaction of
    the small tables. Only reads."""
    report = VerifyReport()
    bad_keys: set[bytes] = set()
    for info in _scan_values(read, tables):
        report.checked += 1
        report.checked_bytes += info.size
        if info.problem is not None:
            report.bad.append(info)
            bad_keys.add(info.key)
        if progress is not None:
            progress(report.checked, report.checked_bytes)
    bad, notes = _check_books(read, tables)
    report.bad.extend(e for e in bad if e.key not in bad_keys)
    report.notes.extend(notes)
    return report


def _scan_values(read: Read, tables: Tables) -> Iterator[EntryInfo]:
    """Every value, checksum verified; a read transaction ends after SCAN_CHUNK_BYTES."""
    for chunk in key_chunks(read, tables.data):
        i = 0
        while i < len(chunk):
            done: list[EntryInfo] = []
            nbytes = 0
            with read() as txn:
                while i < len(chunk) and nbytes < SCAN_CHUNK_BYTES:
                    info = read_entry(txn, tables, chunk[i], check=True)
                    i += 1
                    if info is None:
                        continue  # deleted since the keys were read
                    done.append(info)
                    nbytes += info.size
            yield from done


def _check_books(read: Read, tables: Tables) -> tuple[list[EntryInfo], list[str]]:
    """The accounting, in one read transaction (small tables; values are not read)."""
    bad: list[EntryInfo] = []
    notes: list[str] = []
    total = 0
    with read() as txn:
        for raw_key, raw in txn.cursor(db=tables.meta):
            key = bytes(raw_key)
            meta = unpack_meta(raw)
            value = txn.get(key, db=tables.data)
            problem = records_problem(value, raw)
            if meta is not None:
                total += meta.size
            if problem is not None:
                size = len(value) if value is not None else meta.size if meta is not None else 0
                bad.append(broken(key, size, meta.stamp if meta is not None else None, problem))
                continue
            assert meta is not None
            if txn.get(lru_record(meta.stamp, key), db=tables.lru) is None:
                notes.append(f"{key.hex()}: no lru record (it cannot be evicted until used)")
        for raw_key in txn.cursor(db=tables.data).iternext(keys=True, values=False):
            key = bytes(raw_key)
            if txn.get(key, db=tables.meta) is None:
                value = txn.get(key, db=tables.data)
                size = len(value) if value is not None else 0
                bad.append(broken(key, size, None, "value without a meta record"))
        stale = 0
        for raw_key in txn.cursor(db=tables.lru).iternext(keys=True, values=False):
            record = bytes(raw_key)
            entry = unpack_lru(record)  # None: too short to name a key
            meta = unpack_meta(txn.get(entry[1], db=tables.meta)) if entry is not None else None
            if entry is None or meta is None or lru_record(meta.stamp, entry[1]) != record:
                stale += 1
        used = info_records(txn, tables.info).get(USED_RECORD.decode())
    if stale:
        notes.append(f"{stale} stale lru record(s) (the disk tier drops them as it evicts)")
    if used != total:
        notes.append(
            f"used_bytes is {used}, the meta records add up to {total} (the disk tier "
            "recounts when it finds its books wrong)"
        )
    return bad, notes
