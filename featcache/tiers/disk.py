"""The disk tier: values in an LMDB environment at a directory, shared by processes, persistent.

The store's tables and records are ``featcache.store.layout``'s; every write transaction changes
them through ``featcache.store.books``, so that a value, its meta and lru records and
``used_bytes`` change in the same transaction: the accounting survives crashes and is shared by
every process that opens the directory.

Invariants (each write transaction keeps them):
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
  counted in ``errors`` and the first one is logged; only the whole-store calls (``keys``,
  ``verify``, ``clear``: asked for by a user, not on the request path) raise ``FeatCacheError``
  instead, so that a listing or a check never looks complete when it is not;
- no damaged book record stops the store (``store.books``: skipped, deleted or recounted).

Opening is ``store.env.open_store``'s: the directory and files checked (no links, no directory
every user can write), a map size independent of the budget, ``data.mdb``'s B-trees walked first.

Writes happen only in the demoter's disk-writer thread (``write_batch``). Reads come from any
thread, each in a short read transaction; bytes are copied out before it ends. A reopened store
finds its entries through the tables, without a scan of payloads. Reader slots left by killed
processes are cleared (``reader_check``) at open and before each write batch, so they cannot pin
freed pages. The environment's lifetime across ``close`` and ``fork`` is the tier's
``StoreHandle``'s (``store.handle``): every use of it passes a ``Gate`` (``store.env``), so
``close`` and a ``fork`` never find an operation in flight; a forked child reopens the store on
first use (and applies its budget again).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Literal, NamedTuple

import lmdb
import numpy as np
import torch

from .. import codec
from ..config import DEFAULTS
from ..errors import CorruptEntryError, FeatCacheError, StoreOpenError
from ..store import scan
from ..store.books import Books
from ..store.env import Shut
from ..store.handle import StoreHandle
from ..store.layout import MAX_VALUE_BYTES, Tables, key_storable
from ..store.report import VerifyReport
from .base import Counters, Entry, Op, value_of

log = logging.getLogger("featcache")

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
        sync: bool = bool(DEFAULTS["disk_sync"]),
        on_corrupt: Callable[[bytes], None] | None = None,
    ) -> None:
        self.path = os.fspath(path)
        self.capacity_bytes = capacity_bytes
        self.readonly = readonly
        self._on_corrupt = on_corrupt
        self._counters = Counters()
        self._lock = threading.Lock()
        self._logged = False
        self._unclean: set[bytes] = set()  # keys whose older value a failed delete left behind
        # Opens the store (``store.env.open_store``: the checks, the tables, the format), then
        # evicts down to this budget; raises ``StoreOpenError`` with the environment closed.
        self._handle = StoreHandle(
            self.path, capacity_bytes, readonly=readonly, sync=sync, failed=self._failed,
            opened=None if readonly else self._apply_budget, forked=self._new_lock,
        )
        self._handle.open()

    # -- environment ---------------------------------------------------------------------------
    def _apply_budget(self, env: lmdb.Environment) -> None:
        """Evict oldest first until the store fits this process's budget (it may have been
        written with a larger one): after each open of the store, the one in a forked child too.
        A store whose books cannot be read is refused; an eviction that fails (a full disk) is
        counted like any failed write, and the next batch retries."""
        try:
            with env.begin() as txn:
                used = self._books(txn).used()
        except lmdb.Error as e:
            raise StoreOpenError(f"cannot read the books of the store at {self.path!r}: {e}") from e
        if used > self.capacity_bytes:
            self.write_batch(())

    def _new_lock(self) -> None:
        self._lock = threading.Lock()  # in a forked child: a parent thread may have held it

    @property
    def _tables(self) -> Tables:
        """The tables of the environment open now (a forked child opens its own)."""
        return self._handle.tables

    def _books(self, txn: lmdb.Transaction) -> Books:
        return Books(txn, self._tables, self._recounted)

    @property
    def used_bytes(self) -> int:
        """The bytes of all values stored, as the books say (0 if they cannot be read)."""
        try:
            with self._handle.use() as env, env.begin() as txn:
                return self._books(txn).used()
        except Shut:
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
            with self._handle.use() as env, env.begin(db=self._tables.data, buffers=True) as txn:
                return txn.get(key) is not None
        except Shut:
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
            with self._handle.use() as env, env.begin(db=self._tables.data, buffers=True) as txn:
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
        except Shut:
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
        key cannot be stored (empty, or longer than ``layout.MAX_KEY_BYTES``) is skipped, and so
        is a put of a value longer than ``layout.MAX_VALUE_BYTES`` (after deleting the key's older
        value): such a put counts as a drop and the rest of the batch lands. When the transaction
        fails (file system full, I/O error) nothing of it lands: its puts are counted as drops,
        and a second transaction deletes the keys of its puts and discards so that no older value
        of theirs is served later. Should that fail too, the keys are unclean: reads miss them,
        and the next batches delete them first.
        """
        with self._lock:
            unclean = list(self._unclean)
        ops = [*(DiskOp("discard", k) for k in unclean), *ops]
        try:
            with self._handle.use() as env:
                return self._write_or_clean(env, ops, unclean)
        except Shut:  # closed: nothing can land (the cache stops its writer before closing)
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
        self._handle.reader_check(env)
        with env.begin(write=True) as txn:
            books = self._books(txn)
            used = books.used()
            stamp = max(time.time_ns(), books.last_stamp() + 1) - 1  # each put and touch: the next
            for op in ops:
                if not key_storable(op.key):
                    # Nothing of such a key can be stored (LMDB refuses an empty key, and its
                    # lru record would pass the limit), so there is nothing to delete either.
                    if op.kind == "put":
                        skipped += 1
                    continue
                if op.kind == "discard":
                    used = books.less(used, books.delete(op.key))
                elif op.kind == "discard_bad":
                    if books.is_bad(op.key):
                        used = books.less(used, books.delete(op.key))
                        bad_deleted += 1
                elif op.kind == "touch":
                    stamp += 1
                    books.touch(op.key, stamp)
                else:
                    used = books.less(used, books.delete(op.key))
                    size = len(op.value)
                    if size > self.capacity_bytes:
                        continue
                    if size > MAX_VALUE_BYTES:
                        skipped += 1
                        continue
                    used, n = books.evict_to(used, self.capacity_bytes - size)
                    evicted += n
                    stamp += 1
                    books.put(op.key, op.value, stamp)
                    used += size
                    stored += 1
            used, n = books.evict_to(used, self.capacity_bytes)
            evicted += n
            books.set_used(used)
        with self._lock:
            self._counters.evictions += evicted
            self._counters.drops += skipped
            if bad_deleted:
                extra = self._counters.extra
                extra["bad_deleted"] = extra.get("bad_deleted", 0) + bad_deleted
        if skipped:
            log.debug("featcache: %d disk puts skipped (key or value too long for LMDB)", skipped)
        return stored

    def discard(self, key: bytes) -> bool:
        """Synchronous delete (tools and tests; the cache routes deletes through its writer).

        Returns whether a value was deleted (False also when the store could not be written).
        """
        try:
            with self._handle.use() as env, env.begin(write=True) as txn:
                books = self._books(txn)
                freed = books.delete(key)
                books.set_used(books.less(books.used(), freed))
        except Shut:
            return False
        except lmdb.Error as e:
            self._failed(f"delete of {key.hex()}", e)
            return False
        return freed > 0

    def _is_unclean(self, key: bytes) -> bool:
        with self._lock:
            return key in self._unclean

    # -- counters ------------------------------------------------------------------------------
    def _recounted(self) -> None:
        """The books proved wrong and are being recounted: count it, log the first time."""
        with self._lock:
            self._counters.extra["recounts"] = self._counters.extra.get("recounts", 0) + 1
            first = self._counters.extra["recounts"] == 1
        if first:
            log.warning(
                "featcache: the byte count of the disk store at %s was missing or wrong; "
                "recounted from its records (later recounts are counted in "
                "stats()['disk']['recounts'])", self.path,
            )

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
            with self._handle.use() as env, env.begin() as txn:
                return int(txn.stat(self._tables.data)["entries"])
        except Shut:
            return 0
        except lmdb.Error as e:
            self._failed("count of entries", e)
            return 0

    # -- the whole store (PersistentTier) -----------------------------------------------------------
    @contextmanager
    def _whole_store(self, what: str) -> Iterator[None]:
        """LMDB errors, and a closed tier, as ``FeatCacheError`` (counted, logged once)."""
        try:
            yield
        except Shut:
            raise FeatCacheError(f"{what}: the disk tier at {self.path!r} is closed") from None
        except lmdb.Error as e:
            self._failed(what, e)
            raise FeatCacheError(f"{what} of the store at {self.path!r} failed: {e}") from e

    def keys(self) -> Iterator[bytes]:
        """Every key stored, in byte order, read in chunks of short read transactions
        (``store.scan``): none is yielded twice, and every key stored from the start of the
        iteration to its end is yielded, whatever writers do meanwhile; a key put or deleted
        during the iteration may or may not be. Raises ``FeatCacheError`` if the store cannot
        be read."""
        with self._whole_store("listing of keys"):
            for chunk in scan.key_chunks(self._handle.read, self._tables.data):
                yield from chunk

    def verify(self, progress: Callable[[int, int], None] | None = None) -> VerifyReport:
        """Check every value's header and checksum and the books (``store.scan.verify``, what
        ``featcache verify`` runs); only reads. Raises ``FeatCacheError`` on an LMDB error."""
        with self._whole_store("check"):
            return scan.verify(self._handle.read, self._tables, progress)

    def delete_bad(self, keys: Sequence[bytes]) -> int:
        """Delete each of ``keys`` whose entry is still bad inside the write transaction (a put
        may have replaced it with a good value since it was found); return how many were."""
        with self._lock:
            before = self._counters.extra.get("bad_deleted", 0)
        self.write_batch([DiskOp("discard_bad", k) for k in keys])
        with self._lock:
            return self._counters.extra.get("bad_deleted", 0) - before

    def clear(self) -> int:
        """Delete every entry in one write transaction (``Books.clear``); return how many there
        were. Raises ``FeatCacheError`` if the transaction failed (nothing was deleted)."""
        with self._whole_store("clear"), self._handle.use() as env:
            self._handle.reader_check(env)
            with env.begin(write=True) as txn:
                return self._books(txn).clear()

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
        the inherited environment (safe: see ``StoreHandle._reopen_in_child``)."""
        self._handle.close()


def _fresh(nbytes: int) -> torch.Tensor:
    with torch.inference_mode(False):
        return torch.empty(nbytes, dtype=torch.uint8)
