"""The disk tier's LMDB environment: how a store is opened (its directory and files checked, the
map size, the B-tree walk of ``data.mdb``, the tables, the format record) and the gate that keeps
``close`` and ``fork`` out of every operation in flight.

The map size does not depend on the budget (``map_size_for``): it is virtual address space only,
so processes with different budgets share a directory and a store written with a larger budget
can be reopened with a smaller one. The budget is enforced by the books (``used_bytes``) alone.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import lmdb

from ..errors import StoreFormatError, StoreOpenError
from ..sizes import format_bytes
from .files import DATA_FILE, data_file_bytes, prepare_store_dir
from .layout import FORMAT_RECORD, TABLES, Tables, check_format, new_store_records, open_tables
from .lmdbcheck import check_data_file

log = logging.getLogger("featcache")

MIN_MAP_BYTES = 1 << 40


def map_size_for(capacity_bytes: int, file_bytes: int = 0) -> int:
    """LMDB's map size: generous and, in practice, the same for every budget.

    It only reserves virtual address space (the file grows as pages are used), and a map larger
    than any process's data file means no ``MDB_MAP_FULL`` after reopening with a smaller budget
    and no ``MDB_MAP_RESIZED`` when another process grows the file. A budget so large that this
    map exceeds the address space the process may map (``ENOMEM``) is opened with a smaller one,
    down to ``map_size_floor``.
    """
    return min(max(MIN_MAP_BYTES, 2 * capacity_bytes + file_bytes), sys.maxsize)


def map_size_floor(capacity_bytes: int, file_bytes: int = 0) -> int:
    """The smallest map a budget needs: the data file as it is, the budget of new values, and
    headroom for B-tree pages and pages freed but not yet reusable (1/8 of the budget + 1 GiB)."""
    return file_bytes + capacity_bytes + capacity_bytes // 8 + (1 << 30)


def open_store(
    path: str, capacity_bytes: int, *, readonly: bool, sync: bool,
    reader_check: Callable[[lmdb.Environment], None],
) -> tuple[lmdb.Environment, Tables]:
    """Open the store at ``path`` for a process whose budget is ``capacity_bytes``: check the
    directory and its files (``files.prepare_store_dir``), open the environment (``open_env``),
    refuse a data file whose structure LMDB cannot be trusted with (``lmdbcheck``: a truncated
    copy, a file system that lost its tail, a damaged table page; LMDB maps the file and would
    fault, SIGBUS or SIGSEGV, on a page past its end or a node that runs outside its page), call
    ``reader_check``, open the tables, and refuse a store of another format (a new store, unless
    ``readonly``, gets its first info records). Raises ``StoreOpenError`` (``StoreFormatError``:
    not a store of this format) with the environment closed."""
    prepare_store_dir(path, readonly=readonly)
    env = open_env(path, capacity_bytes, readonly=readonly, sync=sync)
    try:
        check_data_file(env, os.path.join(path, DATA_FILE))
        reader_check(env)
        if not readonly:
            refuse_foreign(env, path)
        tables = open_tables(env, path, create=not readonly)
        try:
            with env.begin(db=tables.info, write=not readonly) as txn:
                tag = txn.get(FORMAT_RECORD)
                if tag is None and not readonly:
                    for record, value in new_store_records():
                        txn.put(record, value)
                    return env, tables
        except lmdb.Error as e:
            raise StoreOpenError(
                f"cannot read or write the format record of the store at {path!r}: {e}"
            ) from e
        check_format(path, tag)
    except BaseException:
        env.close()
        raise
    return env, tables


def open_env(path: str, capacity_bytes: int, *, readonly: bool, sync: bool) -> lmdb.Environment:
    """Open the environment of the store at ``path`` (its directory checked already) for a
    process whose budget is ``capacity_bytes``: ``map_size_for``, halved on ``ENOMEM`` down to
    ``map_size_floor`` (logged when smaller than wanted). ``writemap=False``: a full disk fails a
    write, not the process; ``metasync=False``; files 0600. Raises ``StoreOpenError`` naming
    ``disk_bytes`` when even the floor cannot be mapped, and for any other LMDB error."""
    file_bytes = data_file_bytes(path)
    wanted = map_size = map_size_for(capacity_bytes, file_bytes)
    floor = min(wanted, map_size_floor(capacity_bytes, file_bytes))
    while True:
        try:
            env = lmdb.open(
                path, map_size=map_size, max_dbs=len(TABLES),
                readonly=readonly, sync=sync, metasync=False, writemap=False,
                readahead=False, meminit=False, max_readers=1024, mode=0o600,
                create=not readonly,
            )
            break
        except lmdb.MemoryError as e:  # ENOMEM: more address space than this process may map
            if map_size <= floor:
                raise StoreOpenError(
                    f"cannot open the store at {path!r} for disk_bytes="
                    f"{capacity_bytes} ({format_bytes(capacity_bytes)}): LMDB must "
                    f"map at least {floor} bytes ({format_bytes(floor)}: the budget, the data "
                    f"file of {file_bytes} bytes and headroom) and this process cannot map "
                    f"that much address space ({e}); lower disk_bytes"
                ) from e
            map_size = max(floor, map_size // 2)
        except (lmdb.Error, OverflowError) as e:
            raise StoreOpenError(f"cannot open the LMDB store at {path!r}: {e}") from e
    if map_size < wanted:
        log.warning(
            "featcache: the disk store at %s maps %s of address space, not %s (larger maps "
            "failed: ENOMEM); processes sharing it should use the same disk_bytes",
            path, format_bytes(map_size), format_bytes(wanted),
        )
    return env


def check_not_foreign(path: str) -> None:
    """``refuse_foreign`` before anything is written at ``path`` (a cache writes its key secret
    there first): an existing, non-empty data file is opened read-only, without the lock, and its
    table names read; nothing else. Absent or empty: nothing to check (the open checks it)."""
    if data_file_bytes(path) == 0:
        return
    try:
        env = lmdb.open(path, readonly=True, lock=False, max_dbs=len(TABLES), create=False,
                        subdir=True, readahead=False)
    except lmdb.Error:
        return  # not readable as LMDB: the store's open says what it is
    try:
        try:  # (a damaged file is read no further: a page past its end would kill the process)
            check_data_file(env, os.path.join(path, DATA_FILE))
        except StoreOpenError:
            return  # the store's open refuses it, saying why
        refuse_foreign(env, path)
    finally:
        env.close()


def refuse_foreign(env: lmdb.Environment, path: str) -> None:
    """Raise ``StoreFormatError`` where ``env`` is an LMDB environment of someone else's (its main
    table holds anything but featcache's table names): featcache creates its tables only in a new
    environment or its own, never in another program's data (``featcache stats`` refuses to read
    one alike)."""
    try:
        with env.begin() as txn:
            names = [bytes(k) for k, _ in txn.cursor()]
    except lmdb.Error as e:
        raise StoreOpenError(f"cannot read the LMDB environment at {path!r}: {e}") from e
    foreign = [n for n in names if n not in TABLES]
    if foreign:
        shown = ", ".join(repr(n[:24]) for n in foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        raise StoreFormatError(f"{path!r} is not a featcache store (an LMDB environment holding "
                               f"{shown}): featcache does not write into another program's data; "
                               "choose another directory")


class Shut(Exception):
    """The gate is shut (the tier is closed): the operation is a miss (reads) or a drop (writes)."""


class Gate:
    """Who is inside an LMDB environment. ``shut`` (close) and ``pause`` (just before a fork)
    wait until nobody is, and nobody enters after ``shut``, or while paused.

    Why: a read copies out of LMDB's memory map (``buffers=True``) and hashes it with xxhash; if
    another thread closed the environment meanwhile, the map is gone and the process dies
    (SIGSEGV). And an environment inherited by a forked child can only be closed safely (py-lmdb
    waits forever for an operation that was in flight at the fork) if none was.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._inside = 0
        self._shut = False
        self._paused = False

    @contextmanager
    def enter(self) -> Iterator[None]:
        """Be inside for the ``with`` block; raises ``Shut`` once ``shut`` was called."""
        with self._cond:
            while self._paused and not self._shut:
                self._cond.wait()
            if self._shut:
                raise Shut
            self._inside += 1
        try:
            yield
        finally:
            with self._cond:
                self._inside -= 1
                if self._inside == 0:
                    self._cond.notify_all()

    def shut(self) -> None:
        with self._cond:
            self._shut = True
            self._cond.notify_all()
            while self._inside:
                self._cond.wait()

    def pause(self) -> None:
        with self._cond:
            self._paused = True
            while self._inside:
                self._cond.wait()

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()
