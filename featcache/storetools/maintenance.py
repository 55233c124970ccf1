"""The writes of the store tools: ``verify --fix`` and ``purge`` delete entries (``discard_keys``),
``purge --all`` of a store of another format deletes its files (``purge_foreign_store``), and
``compact`` writes a compacted copy into a new directory (``compact``).

Invariants:
- entries are deleted only through ``store.deletes`` (no torch: the store commands start fast),
  so a value, its meta and lru records and ``used_bytes`` change in one transaction, by the disk
  tier's own rules (``store.books``); nothing but the named entries is deleted (no eviction);
- ``discard_keys(only_bad=True)`` deletes an entry only if it is still bad inside that write
  transaction (``Books.is_bad``): a writer may have replaced a bad value with a good one since;
- files are deleted only from a store this featcache can tell is featcache's, of another format
  version, that no process has open (``store.files.store_in_use``);
- ``compact`` writes only into an empty or new directory; the store itself is only read. The
  copy holds only entries that pass ``verify`` (their checksums hold, their books agree): the
  others are deleted from the copy (never from the store) and returned, and the copy is
  compacted again so that their pages are given back too.

LMDB forbids opening one environment twice in a process: no ``StoreView`` or ``FeatureCache`` on
the same directory may be open in this process while these run.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable

import lmdb

from ..errors import StoreFormatError, StoreOpenError
from ..store.deletes import delete_entries
from ..store.files import (
    DATA_FILE,
    LOCK_FILE,
    SECRET_FILE,
    StorePermissionError,
    check_store_dir,
    open_error,
    os_error,
    store_in_use,
)
from ..store.layout import FORMAT_RECORD, FORMAT_TAG, INFO_TABLE, TABLES, is_featcache_tag
from ..store.lmdbcheck import check_data_file
from ..store.report import EntryInfo
from .view import StoreView

DISCARD_BATCH = 1024  # discards per write transaction


def discard_keys(path: str | os.PathLike[str], keys: Iterable[bytes], *,
                 only_bad: bool = False) -> int:
    """Delete ``keys`` (``store.deletes``): each batch of DISCARD_BATCH is one write transaction
    that deletes data, meta and lru records and lowers ``used_bytes``.

    ``only_bad``: delete a key only if its entry is still bad inside that transaction (``verify
    --fix`` on a live store: a writer may have replaced a bad value with a good one since).
    Returns the number of entries deleted. Raises ``StoreOpenError`` if the store cannot be
    opened for writing, ``FeatCacheError`` if a transaction failed (some entries remain).
    """
    check_deletable(os.fspath(path))
    return delete_entries(path, list(keys), only_bad=only_bad, batch=DISCARD_BATCH)


def check_deletable(path: str) -> None:
    """Raise the error a user can act on if the store at ``path`` cannot be written, which
    deleting entries needs (``purge``, ``verify --fix``): a read-only file system, or a directory
    or ``data.mdb`` this user cannot write. (The cache's own open says "open it read-only", which
    a delete cannot.)"""
    try:
        read_only = bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    if read_only:
        raise StorePermissionError(
            f"the store at {path!r} is on a read-only file system, and deleting entries writes "
            "to it: remount it read-write (or copy the store to a writable place and work there)")
    data = os.path.join(path, DATA_FILE)
    for target in (path, data):
        if os.path.exists(target) and not os.access(target, os.W_OK):
            raise StorePermissionError(
                f"permission denied: {target!r} is not writable by this user, and deleting "
                "entries writes to it; run as the store's owner")


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
        env = lmdb.open(where, readonly=True, lock=False, map_size=0, max_dbs=len(TABLES),
                        create=False)
    except lmdb.Error as e:
        raise open_error(where, e) from e
    try:
        check_data_file(env, os.path.join(where, DATA_FILE))  # a damaged file could crash LMDB
        with env.begin() as txn:
            info = env.open_db(INFO_TABLE, txn=txn, create=False)
            tag = bytes(txn.get(FORMAT_RECORD, db=info) or b"")
    except lmdb.Error as e:
        raise StoreFormatError(f"{where!r} is not a featcache store: nothing deleted") from e
    finally:
        env.close()
    if not is_featcache_tag(tag):
        raise StoreFormatError(f"{where!r} is not a featcache store: nothing deleted")
    if tag == FORMAT_TAG:
        raise StoreFormatError(f"{where!r} is a store of this version: purge its entries instead")
    for name in (DATA_FILE, LOCK_FILE):
        try:
            os.remove(os.path.join(where, name))
        except FileNotFoundError:
            pass
        except OSError as e:
            raise os_error(where, e) from e
    return tag.decode("ascii", "replace")


def compact(view: StoreView, dest: str | os.PathLike[str]) -> list[EntryInfo]:
    """Write a compacted copy of the store ``view`` reads (free pages left out) into ``dest``: an
    empty or missing directory, created 0700. The copy is consistent as of one read transaction;
    what writers add meanwhile is not in it. Entries of the copy that fail ``verify`` (a checksum
    that does not hold, broken books) are left out of it: returned, as ``verify`` reports them."""
    target = os.fspath(dest)
    source, real = os.path.realpath(view.path), os.path.realpath(target)
    if real == source or real.startswith(source.rstrip(os.sep) + os.sep):
        raise StoreOpenError(f"{target!r} is inside the store {view.path!r}: compact writes the copy "
                             "to a directory outside it (a store directory holds the store's files "
                             "only)")
    if os.path.exists(target):
        if not os.path.isdir(target):
            raise StoreOpenError(f"{target!r} exists and is not a directory")
        if os.listdir(target):
            raise StoreOpenError(f"{target!r} is not empty: compact writes into an empty directory")
    else:
        try:
            os.makedirs(target, mode=0o700)
        except OSError as e:
            raise os_error(target, e) from e
    view.copy_to(target)
    os.chmod(os.path.join(target, DATA_FILE), 0o600)  # as the disk tier creates its files
    _copy_key_secret(view.path, target)
    return _drop_bad_entries(target)


def _drop_bad_entries(target: str) -> list[EntryInfo]:
    """Delete the entries of the fresh copy at ``target`` that fail ``verify`` (no process has it
    open), then compact it once more so their pages leave the file as well; the entries dropped."""
    with StoreView(target) as copy:
        bad = copy.verify().bad
    if not bad:
        return []
    discard_keys(target, [e.key for e in bad])
    again = os.path.join(target, ".compact")
    try:
        os.mkdir(again, 0o700)
        with StoreView(target) as copy:
            copy.copy_to(again)
        os.replace(os.path.join(again, DATA_FILE), os.path.join(target, DATA_FILE))
        os.chmod(os.path.join(target, DATA_FILE), 0o600)
        os.rmdir(again)
    except OSError as e:
        raise os_error(target, e) from e
    return bad


def _copy_key_secret(source: str, target: str) -> None:
    """The store's key secret goes with its entries: without it the copy's keys would all miss
    (``featcache.keysecret``; copied as bytes, 0600, never printed)."""
    path = os.path.join(source, SECRET_FILE)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return  # a store of a cache keyed otherwise (xxh3, or a secret file named elsewhere)
    except OSError as e:
        raise os_error(source, e) from e
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise StoreOpenError(f"{path!r} is not a regular file: its key secret is not copied")
        text = os.read(fd, 4096)
    finally:
        os.close(fd)
    out = os.open(os.path.join(target, SECRET_FILE), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(out, text)
    finally:
        os.close(out)
