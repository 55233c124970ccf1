"""The disk tier: values in an LMDB environment at a directory, shared by processes, persistent.

Layout (named databases of one environment):
- ``data``: key -> value (``codec`` header + raw tensor bytes);
- ``meta``: key -> (last use in ns since the epoch, value length);
- ``lru``:  (last use, big-endian) + key -> b"", the eviction order, oldest first;
- ``info``: b"format" -> FORMAT_TAG, b"used_bytes" -> u64, the sum of the value lengths.

Invariants (each write transaction keeps them):
- a value, its meta and lru records and ``used_bytes`` change in the same transaction, so the
  accounting survives crashes and is shared by every process that opens the directory;
- ``used_bytes`` <= the budget of the process that last wrote: a put evicts oldest first to fit;
- no read trusts a value: ``codec.verify`` checks header and checksum, a bad value is reported
  through ``on_corrupt`` (the writer deletes it) and the read is a miss.

Writes happen only in the demoter's disk-writer thread (``write_batch``). Reads come from any
thread, each in a short read transaction; bytes are copied out before it ends. A reopened store
finds its entries through these tables, without a scan of payloads.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import time
from collections.abc import Callable, Sequence

import lmdb
import numpy as np
import torch

from .. import codec
from ..errors import CorruptEntryError, StoreFormatError, StoreOpenError
from .base import Counters, Entry

log = logging.getLogger("featcache")

FORMAT_TAG = b"featcache-lmdb-1"
_META = struct.Struct("<QQ")
_STAMP = struct.Struct(">Q")
_U64 = struct.Struct("<Q")
MAX_KEY_BYTES = 511  # LMDB's default key size limit


def map_size_for(capacity_bytes: int) -> int:
    """LMDB's map size for a budget: room for B-tree pages and pages freed but not yet reusable."""
    return capacity_bytes + capacity_bytes // 2 + (64 << 20)


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
        self._open()

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
        try:
            self._env = lmdb.open(
                self.path, map_size=map_size_for(self.capacity_bytes), max_dbs=4,
                readonly=self.readonly, sync=self._sync, metasync=False, writemap=False,
                readahead=False, meminit=False, max_readers=1024, mode=0o600,
                create=not self.readonly,
            )
        except lmdb.Error as e:
            raise StoreOpenError(f"cannot open the LMDB store at {self.path!r}: {e}") from e
        self._pid = os.getpid()
        create = not self.readonly
        try:
            self._data = self._env.open_db(b"data", create=create)
            self._meta = self._env.open_db(b"meta", create=create)
            self._lru = self._env.open_db(b"lru", create=create)
            self._info = self._env.open_db(b"info", create=create)
        except lmdb.Error as e:
            self._env.close()
            raise StoreFormatError(f"{self.path!r} is not a featcache store ({e})") from e
        self._check_format()

    def _check_format(self) -> None:
        with self._env.begin(db=self._info, write=not self.readonly) as txn:
            tag = txn.get(b"format")
            if tag is None and not self.readonly:
                txn.put(b"format", FORMAT_TAG)
                txn.put(b"used_bytes", _U64.pack(0))
                return
        if tag != FORMAT_TAG:
            self._env.close()
            raise StoreFormatError(
                f"{self.path!r} holds a store of format {tag!r}, this featcache reads "
                f"{FORMAT_TAG!r}: purge it (featcache purge) or point disk_path elsewhere"
            )

    def _environment(self) -> lmdb.Environment:
        # An environment must never be used across fork(): a child reopens its own.
        if os.getpid() != self._pid:
            self._open()
        return self._env

    @property
    def used_bytes(self) -> int:
        with self._environment().begin(db=self._info) as txn:
            raw = txn.get(b"used_bytes")
        return _U64.unpack(raw)[0] if raw else 0

    # -- reads ---------------------------------------------------------------------------------
    def contains(self, key: bytes) -> bool:
        with self._environment().begin(db=self._data, buffers=True) as txn:
            return txn.get(key) is not None

    def get(
        self, key: bytes, alloc: Callable[[int], torch.Tensor] | None = None
    ) -> Entry | None:
        """Read and verify ``key``; copy its bytes into ``alloc(nbytes)`` (a uint8 CPU tensor).

        A missing, corrupt or unreadable value is a miss.
        """
        try:
            with self._environment().begin(db=self._data, buffers=True) as txn:
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
        except lmdb.Error as e:
            log.warning("featcache: disk read of %s failed: %s", key.hex(), e)
            self._count("errors")
            self._count("misses")
            return None
        self._count("hits")
        typed = dst[: header.nbytes].view(header.dtype).view(header.shape)
        return Entry(typed, meta=meta)

    def put(self, key: bytes, entry: Entry) -> bool:
        """Synchronous write of one entry (the writer thread batches through ``write_batch``)."""
        data = entry.tensor.contiguous().reshape(-1).view(torch.uint8).cpu().numpy()
        value = codec.encode(entry.tensor.dtype, tuple(entry.tensor.shape), data.data, entry.meta)
        return self.write_batch([(key, value)]) == 1

    # -- writes (writer thread only) -----------------------------------------------------------
    def write_batch(
        self,
        puts: Sequence[tuple[bytes, bytes]],
        touches: Sequence[bytes] = (),
        discards: Sequence[bytes] = (),
    ) -> int:
        """Apply discards, LRU touches and puts in one transaction; return how many puts landed.

        A put larger than the budget is skipped. When the transaction fails (map or file system
        full, I/O error) nothing of it lands: its puts are counted as drops and the store stays as
        it was.
        """
        stored = 0
        evicted = 0
        now = time.time_ns()
        try:
            with self._environment().begin(write=True) as txn:
                used = _U64.unpack(txn.get(b"used_bytes", db=self._info) or _U64.pack(0))[0]
                for key in discards:
                    used -= self._delete(txn, key)
                for key in touches:
                    self._touch(txn, key, now)
                cursor = txn.cursor(db=self._lru)
                for key, value in puts:
                    size = len(value)
                    if size > self.capacity_bytes:
                        continue
                    used -= self._delete(txn, key)
                    while used + size > self.capacity_bytes and cursor.first():
                        victim = bytes(cursor.key())[_STAMP.size :]
                        used -= self._delete(txn, victim)
                        evicted += 1
                    txn.put(key, value, db=self._data)
                    txn.put(key, _META.pack(now, size), db=self._meta)
                    txn.put(_STAMP.pack(now) + key, b"", db=self._lru)
                    used += size
                    stored += 1
                txn.put(b"used_bytes", _U64.pack(used), db=self._info)
        except lmdb.Error as e:
            log.warning("featcache: disk write of %d entries failed and was dropped: %s", len(puts), e)
            with self._lock:
                self._counters.drops += len(puts)
                self._counters.errors += 1
            return 0
        with self._lock:
            self._counters.evictions += evicted
        return stored

    def _delete(self, txn: lmdb.Transaction, key: bytes) -> int:
        """Remove key's records; return the bytes it accounted for (0 if absent)."""
        meta = txn.get(key, db=self._meta)
        if meta is None:
            txn.delete(key, db=self._data)  # a value without meta would be unaccounted: drop it
            return 0
        stamp, size = _META.unpack(meta)
        txn.delete(key, db=self._data)
        txn.delete(key, db=self._meta)
        txn.delete(_STAMP.pack(stamp) + key, db=self._lru)
        return size

    def _touch(self, txn: lmdb.Transaction, key: bytes, now: int) -> None:
        meta = txn.get(key, db=self._meta)
        if meta is None:
            return
        stamp, size = _META.unpack(meta)
        txn.delete(_STAMP.pack(stamp) + key, db=self._lru)
        txn.put(_STAMP.pack(now) + key, b"", db=self._lru)
        txn.put(key, _META.pack(now, size), db=self._meta)

    def discard(self, key: bytes) -> bool:
        """Synchronous delete (tools and tests; the cache routes deletes through its writer)."""
        with self._environment().begin(write=True) as txn:
            used = _U64.unpack(txn.get(b"used_bytes", db=self._info) or _U64.pack(0))[0]
            freed = self._delete(txn, key)
            txn.put(b"used_bytes", _U64.pack(used - freed), db=self._info)
        return freed > 0

    # -- books ---------------------------------------------------------------------------------
    def _count(self, name: str) -> None:
        with self._lock:
            setattr(self._counters, name, getattr(self._counters, name) + 1)

    def count_drops(self, n: int = 1) -> None:
        with self._lock:
            self._counters.drops += n

    def entries(self) -> int:
        with self._environment().begin() as txn:
            return int(txn.stat(self._data)["entries"])

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
        if os.getpid() == self._pid:
            self._env.close()


def _fresh(nbytes: int) -> torch.Tensor:
    with torch.inference_mode(False):
        return torch.empty(nbytes, dtype=torch.uint8)
