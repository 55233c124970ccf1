"""Deleting entries from a store from outside a cache: the one writer of the store tools
(``verify --fix`` and ``purge``), without torch (the store commands start in a fraction of a
second: issue 29 item 5).

Invariants (each write transaction keeps them, by the disk tier's own rules, ``store.books``):
- an entry's ``data``, ``meta`` and ``lru`` records and ``used_bytes`` change in one transaction
  (``Books.delete``, ``Books.less``, ``Books.set_used``), as the disk tier's discards do;
- ``only_bad``: a key is deleted only if its entry is still bad inside that transaction
  (``Books.is_bad``): a writer may have replaced a bad value with a good one since it was found;
- nothing is evicted and nothing is put: the tool has no budget (the store records none), so no
  entry but those named is touched;
- one write transaction per batch of ``batch`` keys, never held across anything but its own
  deletes; reader slots of dead processes are cleared before each (``reader_check``), so they do
  not pin the pages the deletes free. LMDB serialises these transactions with the servers'.

Opening is ``store.env.open_store``'s (the directory and files checked, ``data.mdb``'s B-trees
walked, the format refused unless it is this one). LMDB allows one environment per store and
process: nothing else in this process may have the store open meanwhile.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import lmdb

from ..errors import FeatCacheError
from .books import Books
from .env import open_store
from .layout import key_storable

DELETE_BATCH = 1024  # keys per write transaction


def delete_entries(path: str | os.PathLike[str], keys: Sequence[bytes], *, only_bad: bool = False,
                   batch: int = DELETE_BATCH) -> int:
    """Delete ``keys`` from the store at ``path``, ``batch`` keys per write transaction; return
    how many entries were deleted (keys with no records count for nothing).

    Raises ``StoreOpenError`` if the store cannot be opened for writing, ``FeatCacheError`` if a
    transaction failed (the batches before it are committed: those entries are gone).
    """
    where = os.fspath(path)
    # capacity 0: the map size is the floor every writer uses (``env.map_size_for``); no budget
    env, tables = open_store(where, 0, readonly=False, sync=True, reader_check=_reader_check)
    deleted = 0
    try:
        for start in range(0, len(keys), batch):
            _reader_check(env)
            with env.begin(write=True) as txn:
                books = Books(txn, tables, _repaired)
                used = books.used()
                for key in keys[start : start + batch]:
                    if not key_storable(key):  # no record of such a key can exist (layout)
                        continue
                    if only_bad and not books.is_bad(key):
                        continue
                    present = txn.get(key, db=tables.data) is not None or txn.get(
                        key, db=tables.meta) is not None
                    used = books.less(used, books.delete(key))
                    deleted += present
                books.set_used(used)
    except lmdb.Error as e:
        raise FeatCacheError(
            f"deleting entries of the store at {where!r} failed ({e}) after {deleted} were "
            "deleted; the others remain"
        ) from e
    finally:
        env.close()
    return deleted


def _reader_check(env: lmdb.Environment) -> None:
    """Free the reader slots of dead processes (a process killed inside a read transaction)."""
    env.reader_check()


def _repaired() -> None:
    """``used_bytes`` proved wrong and is recounted in the same transaction (``Books.recount``):
    nothing more to do here; ``featcache verify`` reports such books as notes."""
