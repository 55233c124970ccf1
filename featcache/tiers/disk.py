"""The disk tier: values in an LMDB environment at a directory, shared by processes, persistent.

Layout (named databases of one environment):
- ``data``: key -> value (``codec`` header + metadata + raw tensor bytes);
- ``meta``: key -> (last use stamp in ns since the epoch, value length);
- ``lru``:  (last use stamp, big-endian) + key -> b"", the eviction order, oldest first;
- ``info``: b"format" -> FORMAT_TAG, b"used_bytes" -> u64, the sum of the value lengths.

Invariants (each write transaction keeps them):
- a value, its meta and lru records and ``used_bytes`` change in the same transaction, so the
  accounting survives crashes and is shared by every process that opens the directory;
- ``used_bytes`` <= the budget of the process that last wrote: opening a store for writing and
  every write batch evict oldest first until it holds (a put evicts to make room for itself);
- within a batch, operations apply in the order given; each put and touch gets its own stamp,
  later than every stamp already stored, so LRU order is use order;
- a put that does not land (larger than the budget, or its transaction failed) leaves no older
  value of its key behind: a failed batch is followed by one that deletes its keys; if that one
  fails too (a full disk), the keys are remembered as unclean: reads of them miss in this
  process, and every later batch deletes them first until one commits;
- no read trusts a value: ``codec.verify`` checks header and checksum, a bad value is reported
  through ``on_corrupt`` (the writer deletes it) and the read is a miss;
- no LMDB error escapes a public method: reads become misses (or 0), writes become drops; each is
  counted in ``errors`` and the first one is logged;
- no damaged book record stops the store: a malformed meta or lru record is skipped or deleted,
  a stamp past 2**63 is ignored, and ``used_bytes`` is recounted from the meta table whenever it
  is missing, malformed or proven wrong (negative, or over budget with nothing left to evict).

The map size does not depend on the budget (``map_size_for``): it is virtual address space only,
so processes with different budgets share a directory and a store written with a larger budget
can be reopened with a smaller one. The budget is enforced by ``used_bytes`` alone.

Writes happen only in the demoter's disk-writer thread (``write_batch``). Reads come from any
thread, each in a short read transaction; bytes are copied out before it ends. A reopened store
finds its entries through these tables, without a scan of payloads. Reader slots left by killed
processes are cleared (``reader_check``) at open and before each write batch, so they cannot pin
freed pages.
"""

from __future__ import annotations

import logging
import os
import stat
import struct
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Literal, NamedTuple

import lmdb
import numpy as np
import torch

from .. import codec
from ..errors import CorruptEntryError, StoreFormatError, StoreOpenError
from ..sizes import format_bytes
from .base import Counters, Entry, Op, value_of
from .lmdbcheck import check_data_file

log = logging.getLogger("featcache")

FORMAT_TAG = b"featcache-lmdb-2"
_META = struct.Struct("<QQ")
_STAMP = struct.Struct(">Q")
_U64 = struct.Struct("<Q")
LMDB_MAX_KEY_BYTES = 511  # LMDB's default key size limit, for the keys of every table
# The longest cache key: its lru record (an 8-byte stamp + the key) must fit as well.
MAX_KEY_BYTES = LMDB_MAX_KEY_BYTES - _STAMP.size
MAX_VALUE_BYTES = 0xFFFFFFFF  # LMDB's largest value (MAXDATASIZE); a larger put fails its txn
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


class _Shut(Exception):
    """The tier is closed: the operation is a miss (reads) or a drop (writes)."""


class _Gate:
    """Who is inside the LMDB environment. ``shut`` (close) and ``pause`` (just before a fork)
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
        with self._cond:
            while self._paused and not self._shut:
                self._cond.wait()
            if self._shut:
                raise _Shut
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


# Every open DiskTier, for the fork hooks below.
_OPEN: weakref.WeakSet[DiskTier] = weakref.WeakSet()


def _before_fork() -> None:
    for tier in list(_OPEN):
        tier._gate.pause()


def _after_fork_in_parent() -> None:
    for tier in list(_OPEN):
        tier._gate.resume()


def _after_fork_in_child() -> None:
    # The child's only thread is the one that forked: nothing of the parent's is inside, and the
    # gate (whose lock the forking thread held) starts afresh. The inherited environment is
    # closed and reopened on first use (``_use``).
    for tier in list(_OPEN):
        tier._gate = _Gate()
        tier._lock = threading.Lock()  # a parent thread may have held these at the fork
        tier._reopen_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(
        before=_before_fork, after_in_parent=_after_fork_in_parent,
        after_in_child=_after_fork_in_child,
    )


def check_store_files(path: str) -> None:
    """Refuse a store whose files another user could redirect: LMDB opens ``lock.mdb`` and
    ``data.mdb`` following symbolic links (and writes its lock header at once), so a link
    planted there would make this process overwrite the link's target with its privileges.

    - ``data.mdb`` and ``lock.mdb``, where present, must be regular files, not links;
    - the directory must not be writable by every user (someone could plant a link between this
      check and LMDB's open), and, for root, must be root's and not group-writable (root
      follows links into any file). Directories above the store are the administrator's.
    Raises ``StoreOpenError`` saying what to change.
    """
    try:
        info = os.stat(path)
    except OSError:
        return  # no directory: the open says why
    mode = info.st_mode
    if mode & stat.S_IWOTH:
        raise StoreOpenError(
            f"the store directory {path!r} is writable by every user (mode {stat.S_IMODE(mode):o}):"
            " anyone could plant links there that LMDB would follow; chmod o-w it (the cache "
            "creates its directory 0700)"
        )
    if os.geteuid() == 0 and (info.st_uid != 0 or mode & stat.S_IWGRP):
        raise StoreOpenError(
            f"the store directory {path!r} is owned by uid {info.st_uid}"
            f"{' and group-writable' if mode & stat.S_IWGRP else ''}: root does not open a store "
            "another user can write (LMDB follows links there); run as its owner, or chown it "
            "to root and chmod g-w"
        )
    for name in ("data.mdb", "lock.mdb"):
        file = os.path.join(path, name)
        try:
            kind = os.lstat(file).st_mode
        except FileNotFoundError:
            continue
        except OSError as e:
            raise StoreOpenError(f"cannot inspect {file!r}: {e}") from e
        if stat.S_ISLNK(kind) or not stat.S_ISREG(kind):
            what = "a symbolic link" if stat.S_ISLNK(kind) else "not a regular file"
            raise StoreOpenError(
                f"{file!r} is {what}: LMDB would follow it and write there; a store's files "
                "must be regular files (move the store away and let the cache create a new one)"
            )


class DiskOp(NamedTuple):
    """One step of a write batch: a ``put`` of an encoded value, a ``touch``, a ``discard``, or a
    ``discard_bad``: a discard only if the key's entry is still bad when the transaction runs
    (its value fails ``codec.verify``, or its books disagree with it), so that a maintenance
    tool never deletes a good value another process wrote since the tool found the bad one."""

    kind: Literal["put", "touch", "discard", "discard_bad"]
    key: bytes
    value: bytes | memoryview = b""


class DiskTier:
    name = "disk"

    def __init__(
        self,
        path: str | os.PathLike[str],
        capacity_bytes: int,
        *,
        readonly: bool = False,
        sync: bool = True,
        on_corrupt: Callable[[bytes], None] | None = None,
    ) -> None:
        self.path = os.fspath(path)
        self.capacity_bytes = capacity_bytes
        self.readonly = readonly
        self._sync = sync
        self._on_corrupt = on_corrupt
        self._counters = Counters()
        self._lock = threading.Lock()
        self._logged = False
        self._unclean: set[bytes] = set()  # keys whose older value a failed delete left behind
        self._gate = _Gate()
        self._reopen_lock = threading.Lock()
        self._open()
        _OPEN.add(self)

    # -- environment ---------------------------------------------------------------------------
    def _open(self) -> None:
        if self.readonly:
            if not os.path.isdir(self.path):
                raise StoreOpenError(f"no featcache store at {self.path!r}")
        else:
            try:
                os.makedirs(self.path, mode=0o700, exist_ok=True)
            except OSError as e:
                raise StoreOpenError(f"cannot create the store directory {self.path!r}: {e}") from e
            if not os.access(self.path, os.W_OK | os.X_OK):
                raise StoreOpenError(
                    f"the store directory {self.path!r} is not writable by this user; "
                    "fix its permissions or open it read-only"
                )
        check_store_files(self.path)
        try:
            file_bytes = os.path.getsize(os.path.join(self.path, "data.mdb"))
        except OSError:
            file_bytes = 0
        wanted = map_size = map_size_for(self.capacity_bytes, file_bytes)
        floor = min(wanted, map_size_floor(self.capacity_bytes, file_bytes))
        while True:
            try:
                self._env = lmdb.open(
                    self.path, map_size=map_size, max_dbs=4,
                    readonly=self.readonly, sync=self._sync, metasync=False, writemap=False,
                    readahead=False, meminit=False, max_readers=1024, mode=0o600,
                    create=not self.readonly,
                )
                break
            except lmdb.MemoryError as e:  # ENOMEM: more address space than this process may map
                if map_size <= floor:
                    raise StoreOpenError(
                        f"cannot open the store at {self.path!r} for disk_bytes="
                        f"{self.capacity_bytes} ({format_bytes(self.capacity_bytes)}): LMDB must "
                        f"map at least {floor} bytes ({format_bytes(floor)}: the budget, the data "
                        f"file of {file_bytes} bytes and headroom) and this process cannot map "
                        f"that much address space ({e}); lower disk_bytes"
                    ) from e
                map_size = max(floor, map_size // 2)
            except (lmdb.Error, OverflowError) as e:
                raise StoreOpenError(f"cannot open the LMDB store at {self.path!r}: {e}") from e
        if map_size < wanted:
            log.warning(
                "featcache: the disk store at %s maps %s of address space, not %s (larger maps "
                "failed: ENOMEM); processes sharing it should use the same disk_bytes",
                self.path, format_bytes(map_size), format_bytes(wanted),
            )
        self._check_file()
        self._pid = os.getpid()
        create = not self.readonly
        self._reader_check()
        try:
            self._data = self._env.open_db(b"data", create=create)
            self._meta = self._env.open_db(b"meta", create=create)
            self._lru = self._env.open_db(b"lru", create=create)
            self._info = self._env.open_db(b"info", create=create)
        except (lmdb.NotFoundError, lmdb.IncompatibleError) as e:  # no such table, or not ours
            self._env.close()
            raise StoreFormatError(f"{self.path!r} is not a featcache store ({e})") from e
        except lmdb.Error as e:
            self._env.close()
            raise StoreOpenError(f"cannot open the tables of the store at {self.path!r}: {e}") from e
        self._check_format()
        if not self.readonly:
            self._apply_budget()

    def _check_file(self) -> None:
        """Refuse a data file whose structure LMDB cannot be trusted with (``lmdbcheck``): a
        truncated copy, a file system that lost its tail, a damaged table page. LMDB maps the file
        and would fault (SIGBUS or SIGSEGV: the process dies) on a page past its end or a node
        that runs outside its page."""
        try:
            check_data_file(self._env, os.path.join(self.path, "data.mdb"))
        except StoreOpenError:
            self._env.close()
            raise

    def _check_format(self) -> None:
        try:
            with self._env.begin(db=self._info, write=not self.readonly) as txn:
                tag = txn.get(b"format")
                if tag is None and not self.readonly:
                    txn.put(b"format", FORMAT_TAG)
                    txn.put(b"used_bytes", _U64.pack(0))
                    return
        except lmdb.Error as e:
            self._env.close()
            raise StoreOpenError(
                f"cannot read or write the format record of the store at {self.path!r}: {e}"
            ) from e
        if tag != FORMAT_TAG:
            self._env.close()
            raise StoreFormatError(
                f"{self.path!r} holds a store of format {tag!r}, this featcache reads "
                f"{FORMAT_TAG!r}: purge it (featcache purge) or point disk_path elsewhere"
            )

    def _apply_budget(self) -> None:
        """Evict oldest first until the store fits this process's budget (it may have been
        written with a larger one). A store whose books cannot be read is refused; an eviction
        that fails (a full disk) is counted like any failed write, and the next batch retries."""
        try:
            with self._env.begin() as txn:
                used = self._used(txn)
        except lmdb.Error as e:
            self._env.close()
            raise StoreOpenError(f"cannot read the books of the store at {self.path!r}: {e}") from e
        if used > self.capacity_bytes:
            self.write_batch(())

    def _reader_check(self) -> None:
        """Free the reader slots of dead processes: a slot left by a process killed inside a
        read transaction would keep every page freed since from being reused."""
        try:
            self._env.reader_check()
        except lmdb.Error as e:
            self._failed("check of stale readers", e)

    @contextmanager
    def _use(self) -> Iterator[lmdb.Environment]:
        """The environment, for one operation; raises ``_Shut`` once the tier is closed.

        Every use of ``self._env`` after open goes through here (one level deep, never nested),
        so ``close`` and a fork never find an operation in flight.
        """
        if self._pid != os.getpid():
            self._reopen_in_child()
        with self._gate.enter():
            yield self._env

    def _reopen_in_child(self) -> None:
        """An environment must never be used across fork(): the child closes the one it
        inherited (safe: the fork hooks kept every operation out of it while forking) and opens
        its own. py-lmdb refuses a second open of the same files while the first is open."""
        with self._reopen_lock:
            if self._pid == os.getpid():
                return
            try:
                self._env.close()
                self._open()
            except (lmdb.Error, StoreOpenError) as e:
                raise lmdb.Error(f"reopen after fork failed: {e}") from e

    @property
    def used_bytes(self) -> int:
        """The bytes of all values stored, as the books say (0 if they cannot be read)."""
        try:
            with self._use() as env, env.begin() as txn:
                return self._used(txn)
        except _Shut:
            return 0
        except lmdb.Error as e:
            self._failed("read of used_bytes", e)
            return 0

    # -- reads ---------------------------------------------------------------------------------
    def fits(self, nbytes: int, meta_bytes: int = 0) -> bool:
        """Whether a value of ``nbytes`` payload and ``meta_bytes`` metadata can be stored."""
        value_bytes = codec.HEADER.size + meta_bytes + nbytes
        return value_bytes <= min(self.capacity_bytes, MAX_VALUE_BYTES)

    def contains(self, key: bytes) -> bool:
        if self._is_unclean(key):
            return False
        try:
            with self._use() as env, env.begin(db=self._data, buffers=True) as txn:
                return txn.get(key) is not None
        except _Shut:
            return False
        except lmdb.Error as e:
            self._failed(f"lookup of {key.hex()}", e)
            return False

    def get(
        self, key: bytes, alloc: Callable[[int], torch.Tensor] | None = None
    ) -> Entry | None:
        """Read and verify ``key``; copy its bytes into ``alloc(nbytes)`` (a uint8 CPU tensor).

        A missing, corrupt or unreadable value is a miss.
        """
        if self._is_unclean(key):
            self._count("misses")
            return None
        try:
            with self._use() as env, env.begin(db=self._data, buffers=True) as txn:
                value = txn.get(key)
                if value is None:
                    self._count("misses")
                    return None
                try:
                    header = codec.verify(value)
                except CorruptEntryError as e:
                    log.warning("featcache: corrupt disk entry %s dropped (%s)", key.hex(), e)
                    self._count("corrupt")
                    self._count("misses")
                    if self._on_corrupt is not None:
                        self._on_corrupt(key)
                    return None
                meta = codec.meta(value, header)
                dst = alloc(header.nbytes) if alloc is not None else _fresh(header.nbytes)
                if header.nbytes:
                    src = np.frombuffer(codec.payload(value, header), dtype=np.uint8)
                    dst[: header.nbytes].numpy()[:] = src
        except _Shut:
            self._count("misses")
            return None
        except lmdb.Error as e:
            self._failed(f"read of {key.hex()}", e)
            self._count("misses")
            return None
        self._count("hits")
        typed = dst[: header.nbytes].view(header.dtype).view(header.shape)
        return Entry(typed, meta=meta)

    def put(self, key: bytes, entry: Entry) -> bool:
        """Synchronous write of one entry (the writer thread batches through ``write_batch``)."""
        data = entry.tensor.contiguous().reshape(-1).view(torch.uint8).cpu().numpy()
        value = codec.encode(entry.tensor.dtype, tuple(entry.tensor.shape), data.data, entry.meta)
        return self.write_batch([DiskOp("put", key, value)]) == 1

    # -- writes (writer thread only) -----------------------------------------------------------
    def write(self, ops: Sequence[Op]) -> None:
        """Apply the cache writer's ``ops`` (host entries whose copies are done) in one batch
        (``write_batch``); each put's value is framed in place when its entry has a frame."""
        self.write_batch([
            DiskOp(op.kind, op.key, value_of(op.entry) if op.entry is not None else b"")
            for op in ops
        ])

    def write_batch(self, ops: Sequence[DiskOp]) -> int:
        """Apply ``ops`` in order in one transaction, then evict down to the budget; return how
        many puts landed.

        A put larger than the budget does not land and deletes the key's older value. An op whose
        key cannot be stored (empty, or longer than ``MAX_KEY_BYTES``) is skipped, and so is a put
        of a value longer than ``MAX_VALUE_BYTES`` (after deleting the key's older value): such a
        put counts as a drop and the rest of the batch lands. When the transaction fails (file
        system full, I/O error) nothing of it lands: its puts are counted as drops, and a second
        transaction deletes the keys of its puts and discards so that no older value of theirs is
        served later. Should that fail too, the keys are unclean: reads miss them, and the next
        batches delete them first.
        """
        with self._lock:
            unclean = list(self._unclean)
        ops = [*(DiskOp("discard", k) for k in unclean), *ops]
        try:
            with self._use() as env:
                return self._write_or_clean(env, ops, unclean)
        except _Shut:  # closed: nothing can land (the cache stops its writer before closing)
            self.count_drops(sum(op.kind == "put" for op in ops))
            return 0
        except lmdb.Error as e:  # only a failed reopen in a forked child gets here
            self._failed("reopen of the store", e)
            self.count_drops(sum(op.kind == "put" for op in ops))
            with self._lock:
                self._unclean.update(op.key for op in ops if op.kind != "touch")
            return 0

    def _write_or_clean(self, env: lmdb.Environment, ops: list[DiskOp], unclean: list[bytes]) -> int:
        try:
            stored = self._write(env, ops)
        except Exception as e:  # LMDB's errors, and anything else that aborts the transaction
            puts = sum(op.kind == "put" for op in ops)
            self._failed(f"write of {len(ops)} operations ({puts} puts)", e)
            self.count_drops(puts)
            stored = 0
            deletes = [DiskOp("discard", op.key) for op in ops if op.kind != "touch"]
            if deletes:
                try:
                    self._write(env, deletes)
                except Exception as e2:
                    self._failed(f"delete of {len(deletes)} keys after a failed write", e2)
                    with self._lock:
                        self._unclean.update(op.key for op in deletes)
                    return 0
        with self._lock:
            self._unclean.difference_update(unclean)
        return stored

    def _write(self, env: lmdb.Environment, ops: Sequence[DiskOp]) -> int:
        """One write transaction for ``ops`` (see ``write_batch``); raises ``lmdb.Error``."""
        stored = 0
        evicted = 0
        skipped = 0  # puts LMDB could not hold (see write_batch): drops once the batch commits
        bad_deleted = 0  # discard_bad ops that found the entry still bad
        self._reader_check()
        with env.begin(write=True) as txn:
            used = self._used(txn)
            cursor = txn.cursor(db=self._lru)
            last = _stamp_of(bytes(cursor.key())) if cursor.last() else 0
            stamp = max(time.time_ns(), last + 1) - 1  # each put and touch takes the next one
            for op in ops:
                if not 0 < len(op.key) <= MAX_KEY_BYTES:
                    # Nothing of such a key can be stored (LMDB refuses an empty key, and its
                    # lru record would pass the limit), so there is nothing to delete either.
                    if op.kind == "put":
                        skipped += 1
                    continue
                if op.kind == "discard":
                    used = self._less(txn, used, self._delete(txn, op.key))
                elif op.kind == "discard_bad":
                    if self._bad(txn, op.key):
                        used = self._less(txn, used, self._delete(txn, op.key))
                        bad_deleted += 1
                elif op.kind == "touch":
                    stamp += 1
                    self._touch(txn, op.key, stamp)
                else:
                    used = self._less(txn, used, self._delete(txn, op.key))
                    size = len(op.value)
                    if size > self.capacity_bytes:
                        continue
                    if size > MAX_VALUE_BYTES:
                        skipped += 1
                        continue
                    while used + size > self.capacity_bytes:
                        freed = self._evict_oldest(txn, cursor)
                        if freed is None:  # nothing left, yet over budget: the books were wrong
                            used = self._recount(txn)
                            break
                        used = self._less(txn, used, freed)
                        evicted += 1
                    stamp += 1
                    txn.put(op.key, op.value, db=self._data)
                    txn.put(op.key, _META.pack(stamp, size), db=self._meta)
                    txn.put(_STAMP.pack(stamp) + op.key, b"", db=self._lru)
                    used += size
                    stored += 1
            while used > self.capacity_bytes:
                freed = self._evict_oldest(txn, cursor)
                if freed is None:  # as above
                    used = self._recount(txn)
                    break
                used = self._less(txn, used, freed)
                evicted += 1
            txn.put(b"used_bytes", _U64.pack(used), db=self._info)
        with self._lock:
            self._counters.evictions += evicted
            self._counters.drops += skipped
            if bad_deleted:
                extra = self._counters.extra
                extra["bad_deleted"] = extra.get("bad_deleted", 0) + bad_deleted
        if skipped:
            log.debug("featcache: %d disk puts skipped (key or value too long for LMDB)", skipped)
        return stored

    def _bad(self, txn: lmdb.Transaction, key: bytes) -> bool:
        """Whether ``key``'s entry is bad now: its records disagree (``records_problem``) or its
        value fails ``codec.verify``."""
        value = txn.get(key, db=self._data)
        if records_problem(value, txn.get(key, db=self._meta)) is not None:
            return True
        try:
            if value is not None:
                codec.verify(value)
        except CorruptEntryError:
            return True
        return False

    def _evict_oldest(self, txn: lmdb.Transaction, cursor: lmdb.Cursor) -> int | None:
        """Delete the least recently used entry; return its bytes, or None if there is none."""
        if not cursor.first():
            return None
        record = bytes(cursor.key())
        freed = self._delete(txn, record[_STAMP.size :]) if len(record) > _STAMP.size else 0
        txn.delete(record, db=self._lru)  # gone already unless the books disagreed: progress
        return freed

    def _delete(self, txn: lmdb.Transaction, key: bytes) -> int:
        """Remove key's records; return the bytes it accounted for (0 if absent)."""
        meta = _meta_of(txn.get(key, db=self._meta))
        if meta is None:  # a value without (valid) meta would be unaccounted: drop it
            txn.delete(key, db=self._data)
            txn.delete(key, db=self._meta)  # its lru record, if any, is evicted in its turn
            return 0
        stamp, size = meta
        txn.delete(key, db=self._data)
        txn.delete(key, db=self._meta)
        txn.delete(_STAMP.pack(stamp) + key, db=self._lru)
        return size

    def _touch(self, txn: lmdb.Transaction, key: bytes, stamp: int) -> None:
        meta = _meta_of(txn.get(key, db=self._meta))
        if meta is None:
            return
        old, size = meta
        txn.delete(_STAMP.pack(old) + key, db=self._lru)
        txn.put(_STAMP.pack(stamp) + key, b"", db=self._lru)
        txn.put(key, _META.pack(stamp, size), db=self._meta)

    def discard(self, key: bytes) -> bool:
        """Synchronous delete (tools and tests; the cache routes deletes through its writer).

        Returns whether a value was deleted (False also when the store could not be written).
        """
        try:
            with self._use() as env, env.begin(write=True) as txn:
                freed = self._delete(txn, key)
                used = self._less(txn, self._used(txn), freed)
                txn.put(b"used_bytes", _U64.pack(used), db=self._info)
        except _Shut:
            return False
        except lmdb.Error as e:
            self._failed(f"delete of {key.hex()}", e)
            return False
        return freed > 0

    def _is_unclean(self, key: bytes) -> bool:
        with self._lock:
            return key in self._unclean

    # -- books ---------------------------------------------------------------------------------
    def _used(self, txn: lmdb.Transaction) -> int:
        """``used_bytes`` as recorded, or recounted if the record is missing or malformed."""
        raw = txn.get(b"used_bytes", db=self._info)
        if raw is not None and len(raw) == _U64.size:
            return int(_U64.unpack(raw)[0])
        return self._recount(txn)

    def _less(self, txn: lmdb.Transaction, used: int, freed: int) -> int:
        """``used - freed``, recounted if that is negative (a damaged size was subtracted)."""
        return used - freed if used >= freed else self._recount(txn)

    def _recount(self, txn: lmdb.Transaction) -> int:
        """The sum of the value sizes in the meta table (the books proved wrong: repair them)."""
        with self._lock:
            self._counters.extra["recounts"] = self._counters.extra.get("recounts", 0) + 1
            first = self._counters.extra["recounts"] == 1
        if first:
            log.warning(
                "featcache: the byte count of the disk store at %s was missing or wrong; "
                "recounted from its records (later recounts are counted in "
                "stats()['disk']['recounts'])", self.path,
            )
        total = 0
        for _, raw in txn.cursor(db=self._meta):
            meta = _meta_of(raw)
            total += meta[1] if meta is not None else 0
        return total

    def _count(self, name: str) -> None:
        with self._lock:
            setattr(self._counters, name, getattr(self._counters, name) + 1)

    def _failed(self, what: str, error: Exception) -> None:
        """Count an LMDB failure; log the first one (later ones at debug level)."""
        with self._lock:
            self._counters.errors += 1
            first, self._logged = not self._logged, True
        if first:
            log.warning(
                "featcache: disk %s at %s failed: %s (later LMDB errors are counted in "
                "stats()['disk']['errors'], not logged)", what, self.path, error,
            )
        else:
            log.debug("featcache: disk %s failed: %s", what, error)

    def count_drops(self, n: int = 1) -> None:
        with self._lock:
            self._counters.drops += n

    def entries(self) -> int:
        """How many values are stored (0 if the store cannot be read)."""
        try:
            with self._use() as env, env.begin() as txn:
                return int(txn.stat(self._data)["entries"])
        except _Shut:
            return 0
        except lmdb.Error as e:
            self._failed("count of entries", e)
            return 0

    def stats(self) -> dict[str, int]:
        entries, used = self.entries(), self.used_bytes
        with self._lock:
            return {
                **self._counters.as_dict(),
                "entries": entries,
                "bytes": used,
                "capacity_bytes": self.capacity_bytes,
            }

    def close(self) -> None:
        """Wait for the reads and writes in flight, then close; later calls are misses (reads)
        and drops (writes). Idempotent. In a forked child that never used the tier, this closes
        the inherited environment (safe: see ``_reopen_in_child``)."""
        self._gate.shut()
        _OPEN.discard(self)
        self._env.close()


def _meta_of(raw: bytes | memoryview | None) -> tuple[int, int] | None:
    """(stamp, size) of a meta record, or None if absent or malformed."""
    if raw is None or len(raw) != _META.size:
        return None
    stamp, size = _META.unpack(raw)
    return int(stamp), int(size)


def records_problem(value: bytes | memoryview | None, raw_meta: bytes | memoryview | None) -> str | None:
    """What is wrong with one key's ``data`` and ``meta`` records, as this tier keeps them, or
    None if they agree (or neither exists). The values themselves are ``codec.verify``'s."""
    meta = _meta_of(raw_meta)
    if raw_meta is not None and meta is None:
        return "malformed meta record"
    if meta is None:
        return None if value is None else "value without a meta record"
    if value is None:
        return "meta record without a value"
    if len(value) != meta[1]:
        return f"meta record says {meta[1]} bytes, the value holds {len(value)}"
    return None


def _stamp_of(record: bytes) -> int:
    """The stamp of an lru record; 0 for a malformed one or a stamp past 2**63 (centuries
    ahead: damage, and new stamps must stay below 2**64)."""
    if len(record) <= _STAMP.size:
        return 0
    stamp = int(_STAMP.unpack(record[: _STAMP.size])[0])
    return stamp if stamp < 1 << 63 else 0


def _fresh(nbytes: int) -> torch.Tensor:
    with torch.inference_mode(False):
        return torch.empty(nbytes, dtype=torch.uint8)
