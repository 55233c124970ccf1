"""All of featcache's asynchrony: the demotion thread and the disk-writer thread.

Every entry put in the cache is copied down (write-through) in the background:

    put --(bounded queue)--> demotion thread: D2H copy into a host block, on the copy stream
        --(bounded queue)--> disk-writer thread: wait for the copy, encode, one LMDB txn per batch

Overflow policy: both queues are bounded. When one is full the new job is dropped (counted as a
``drop`` on the tier it was headed for) instead of blocking ``put``; the entry stays in the tiers
above. Each queue keeps an in-flight map (key -> data being moved) so a ``get`` sees entries that
are still on their way down (read-your-writes). ``flush`` waits for both queues; ``close`` drains and
joins. No polling: threads block on their queues.

A job that raises is logged (once per thread) and counted as an error; the thread keeps going. If a
thread dies anyway, ``alive`` turns False, later jobs are dropped and counted, and the request path
is unaffected.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass
from typing import Any

import torch

from . import codec
from .copier import Copier, as_bytes, owned_empty
from .hostpool import Block, HostPool
from .tiers.base import Entry
from .tiers.disk import DiskTier
from .tiers.host import HostTier

log = logging.getLogger("featcache")

_STOP = object()


@dataclass(eq=False)
class _Demotion:
    key: bytes
    tensor: torch.Tensor  # on the cache's device
    fence: Any  # producer's event
    meta: bytes


@dataclass(eq=False)
class _DiskPut:
    key: bytes
    entry: Entry  # host bytes (a retained pool block, or a staging buffer) and the copy's fence


class _Worker:
    """A daemon thread draining a bounded queue; shared plumbing of the two stages."""

    def __init__(self, name: str, maxsize: int) -> None:
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max(1, maxsize))
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._logged = False
        self.errors = 0
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def depth(self) -> int:
        return self._queue.qsize()

    def _offer(self, item: Any) -> bool:
        if not self.alive:
            return False
        try:
            self._queue.put_nowait(item)
            return True
        except queue.Full:
            return False

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is _STOP:
                    return
                self._handle(item)
            except Exception:  # a failed job must not kill the stage
                self.errors += 1
                if not self._logged:
                    self._logged = True
                    log.exception("featcache: %s failed a job (logged once)", self._thread.name)
            finally:
                self._queue.task_done()

    def _handle(self, item: Any) -> None:
        raise NotImplementedError

    def join_queue(self) -> None:
        if self.alive:
            self._queue.join()

    def stop(self) -> None:
        if self.alive:
            self._queue.put(_STOP)
            self._thread.join()


class DiskWriter(_Worker):
    """The single writer of a disk tier: batches puts, touches and discards into transactions."""

    BATCH_ENTRIES = 32
    BATCH_BYTES = 256 << 20

    def __init__(self, disk: DiskTier, copier: Copier, pool: HostPool | None, maxsize: int) -> None:
        self.disk = disk
        self._copier = copier
        self._pool = pool  # the host pool whose blocks pending puts reference, if any
        self._pending: dict[bytes, _DiskPut] = {}
        self._lock = threading.Lock()
        super().__init__("featcache-disk-writer", maxsize)

    def submit(self, key: bytes, entry: Entry) -> bool:
        job = _DiskPut(key, entry)
        with self._lock:
            self._pending[key] = job
        if self._offer(job):
            return True
        self._done(job)
        self.disk.count_drops()
        return False

    def touch(self, key: bytes) -> None:
        self._offer(("touch", key))  # recency only: losing one under load is harmless

    def discard(self, key: bytes) -> None:
        # Dropped under load, a corrupt value stays until the next read finds it again.
        self._offer(("discard", key))

    def pending(self, key: bytes) -> Entry | None:
        """A put not yet written, with an extra reference on its block that the caller releases."""
        with self._lock:
            job = self._pending.get(key)
            if job is None:
                return None
            if job.entry.block is not None:
                assert self._pool is not None
                self._pool.retain(job.entry.block)
            return job.entry

    def _handle(self, item: Any) -> None:
        batch = [item]
        nbytes = 0
        while len(batch) < self.BATCH_ENTRIES and nbytes < self.BATCH_BYTES:
            try:
                more = self._queue.get_nowait()
            except queue.Empty:
                break
            if more is _STOP:  # put it back for the loop to see after this batch
                self._queue.task_done()
                self._queue.put(_STOP)
                break
            batch.append(more)
            if isinstance(more, _DiskPut):
                nbytes += more.entry.nbytes
        try:
            self._write(batch)
        finally:
            for _ in batch[1:]:
                self._queue.task_done()

    def _write(self, batch: list[Any]) -> None:
        puts: list[tuple[bytes, bytes]] = []
        touches: list[bytes] = []
        discards: list[bytes] = []
        jobs = [job for job in batch if isinstance(job, _DiskPut)]
        try:
            for job in jobs:
                self._copier.wait(job.entry.fence)
                tensor = job.entry.tensor
                data = as_bytes(tensor).numpy().data
                value = codec.encode(tensor.dtype, tuple(tensor.shape), data, job.entry.meta)
                puts.append((job.key, value))
            for op in batch:
                if isinstance(op, tuple):
                    (touches if op[0] == "touch" else discards).append(op[1])
            self.disk.write_batch(puts, touches, discards)
        finally:
            for job in jobs:
                self._done(job)

    def _done(self, job: _DiskPut) -> None:
        with self._lock:
            if self._pending.get(job.key) is job:
                del self._pending[job.key]
        if job.entry.block is not None:
            assert self._pool is not None
            self._pool.release(job.entry.block)


class Demoter(_Worker):
    """Copies put entries down to the host tier and hands them to the disk writer."""

    def __init__(
        self,
        copier: Copier,
        host: HostTier | None,
        writer: DiskWriter | None,
        maxsize: int,
    ) -> None:
        self._copier = copier
        self.host = host
        self.writer = writer
        self._pending: dict[bytes, _Demotion] = {}
        self._lock = threading.Lock()
        super().__init__("featcache-demoter", maxsize)

    def submit(self, key: bytes, tensor: torch.Tensor, fence: Any, meta: bytes = b"") -> bool:
        job = _Demotion(key, tensor, fence, meta)
        with self._lock:
            self._pending[key] = job
        if self._offer(job):
            return True
        self._forget(job)
        if self.host is not None and self.host.fits(tensor.nbytes):
            self.host.count_drop()
        if self.writer is not None:
            self.writer.disk.count_drops()
        return False

    def pending(self, key: bytes) -> Entry | None:
        """An entry put but not yet copied down: its device tensor and producer fence."""
        with self._lock:
            job = self._pending.get(key)
            return None if job is None else Entry(job.tensor, job.fence, meta=job.meta)

    def _forget(self, job: _Demotion) -> None:
        with self._lock:
            if self._pending.get(job.key) is job:
                del self._pending[job.key]

    def _handle(self, job: _Demotion) -> None:
        try:
            self._demote(job)
        finally:
            self._forget(job)

    def _demote(self, job: _Demotion) -> None:
        tensor = job.tensor
        nbytes = tensor.nbytes
        block: Block | None = self.host.reserve(nbytes) if self.host is not None else None
        if block is not None:
            dst = block.view(nbytes)
        elif self.writer is not None:
            dst = owned_empty(nbytes, torch.device("cpu"), pin=self._copier.pin)  # staging
        else:
            if self.host is not None and self.host.fits(nbytes):
                self.host.count_drop()  # no block free: every one is busy with a copy
            return
        done = self._copier.to_host(tensor, dst, after=job.fence)
        host_entry = Entry(dst.view(tensor.dtype).view(tensor.shape), done, block, job.meta)
        if block is not None:
            block.fence = done
            assert self.host is not None
            if self.writer is not None:
                self.host.pool.retain(block)  # the disk write reads it after the tier may evict
            self.host.put(job.key, host_entry)
        if self.writer is not None:
            self.writer.submit(job.key, host_entry)

    def flush(self) -> None:
        self.join_queue()
        self._copier.synchronize()
        if self.writer is not None:
            self.writer.join_queue()

    def close(self) -> None:
        self.flush()
        self.stop()
        if self.writer is not None:
            self.writer.stop()
