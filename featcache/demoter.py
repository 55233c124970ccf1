"""All of featcache's asynchrony: the demotion, disk-writer and remote-publisher threads.

Every entry put in the cache is copied down (write-through) in the background:

    put --(bounded queue)--> demotion thread: D2H copy into a host block, on the copy stream
        --(queue, puts bounded)--> disk-writer thread: wait for the copy, encode, one LMDB txn
                                   per batch, applying puts, touches and discards in queue order
        --(queue, puts bounded)--> remote publisher thread: wait for the copy, publish to Redis
                                   (chunks, then the head), applying puts and discards in order

Overload policy: the demotion queue holds at most ``demote_queue_entries`` jobs and the writer's
queue at most ``disk_queue_entries`` pending puts (discards are tiny and always queued). A job
over the limit is dropped (counted as a ``drop`` on the tier it was headed for) instead of
blocking ``put``; the entry stays in the tiers above. LRU touches (recency hints of disk reads)
are skipped while the writer's queue holds ``TOUCH_QUEUE_LIMIT`` jobs. The publisher holds at
most ``remote_queue_entries`` pending publishes; one over the limit is dropped and counted
(``stats()["remote"]["publish_dropped"]``), and the server keeps what it held for the key.

Invariants:
- the disk never keeps a value older than the last put or discard of its key: a put that does
  not reach the disk (dropped, failed, too big) queues a discard of its key instead, in order;
- a later put or a discard of a key cancels a demotion of that key not yet handed down. Both
  take the demoter's lock, and the demotion thread checks for cancellation under that lock right
  before it hands the host copy to the host tier and the writer: so a discard either cancels a
  put or lands after it in the writer's queue;
- the remote tier keeps the last value *published* for a key: a put whose publish is dropped or
  fails leaves the server's value as it was (for content keys, the same features computed by
  another replica); a ``discard`` or a put that fits no local tier queues a remote delete;
- each queue keeps an in-flight map (key -> its latest queued job) so a ``get`` sees entries
  still on their way down (read-your-writes) and never reads a disk value with a discard queued.

``flush`` waits for both queues; ``close`` drains and joins. No polling: threads block on their
queues. A job that raises is logged (once per thread) and counted as an error; the thread keeps
going. If a thread dies anyway, that is logged (critical) and counted, ``alive`` turns False,
later jobs are dropped and counted, and the request path is unaffected; a discard the dead
writer cannot apply stays in its in-flight map, so the disk never serves that key's older value
again in this process.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass
from typing import Any, Literal

import torch

from . import codec
from .copier import Copier, as_bytes, owned_empty
from .hostpool import Block, HostPool
from .tiers.base import Entry
from .tiers.disk import DiskOp, DiskTier
from .tiers.host import HostTier
from .tiers.remote import RemoteTier

log = logging.getLogger("featcache")

_STOP = object()


@dataclass(eq=False)
class _Demotion:
    key: bytes
    tensor: torch.Tensor  # on the cache's device
    fence: Any  # producer's event
    meta: bytes
    to_disk: bool  # False: the entry is too large for the disk; its key is deleted there
    to_remote: bool = False  # publish it to the remote tier
    cancelled: bool = False  # set under the demoter's lock by a later put or a discard of key


@dataclass(eq=False)
class _DiskPut:
    key: bytes
    entry: Entry  # host bytes (a retained pool block, or a staging buffer) and the copy's fence


@dataclass(eq=False)
class _DiskMark:
    """A discard or an LRU touch of ``key``, applied in queue order with the puts."""

    kind: Literal["discard", "touch"]
    key: bytes


class _Worker:
    """A daemon thread draining a queue (bounded if ``maxsize`` > 0); shared plumbing."""

    def __init__(self, name: str, maxsize: int) -> None:
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=maxsize)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._logged = False
        self.errors = 0
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def is_current(self) -> bool:
        """Whether the caller runs in this worker's thread."""
        return threading.current_thread() is self._thread

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
                self._failed()
            except BaseException:  # this ends the thread: say so once, where users look
                self.errors += 1
                log.critical(
                    "featcache: %s stopped (a job raised a BaseException): later work for it "
                    "is dropped and counted; stats()['cache']['workers_alive'] is 0",
                    self._thread.name, exc_info=True,
                )
                raise
            finally:
                self._queue.task_done()

    def _failed(self) -> None:
        """Count the exception being handled; log the first one."""
        self.errors += 1
        if not self._logged:
            self._logged = True
            log.exception("featcache: %s failed a job (logged once)", self._thread.name)

    def _handle(self, item: Any) -> None:
        raise NotImplementedError

    def join_queue(self) -> None:
        if self.alive:
            self._queue.join()

    def stop(self) -> None:
        if self.alive:
            self._queue.put(_STOP)
            self._thread.join()


class _Writer(_Worker):
    """A single writer thread of one lower tier (disk, remote): the in-flight map of the last job
    queued per key (read-your-writes for ``pending``), and the count of queued puts, whose block
    references it holds until each put is done."""

    def __init__(self, name: str, copier: Copier, pool: HostPool | None, max_puts: int) -> None:
        self._copier = copier
        self._pool = pool  # the host pool whose blocks pending puts reference, if any
        self._max_puts = max(1, max_puts)
        self._puts = 0  # puts queued or being written
        self._latest: dict[bytes, _DiskPut | _DiskMark] = {}  # key -> its last queued put/discard
        self._lock = threading.Lock()
        super().__init__(name, 0)

    def _enqueue(self, item: _DiskPut | _DiskMark) -> bool:
        # Under self._lock: the in-flight map and the queue order agree.
        if not self._offer(item):
            if isinstance(item, _DiskMark) and item.kind == "discard":
                # Only a dead thread refuses a discard (the queue is unbounded): the delete
                # can never run, so it stays in the in-flight map and the tier's value of the
                # key is never served again by this process.
                self._latest[item.key] = item
            return False
        if not (isinstance(item, _DiskMark) and item.kind == "touch"):
            self._latest[item.key] = item
        return True

    def pending(self, key: bytes) -> tuple[bool, Entry | None]:
        """What the queue will leave in the tier for ``key``.

        ``(False, None)``: nothing queued for it. ``(True, entry)``: a put not yet written, with
        an extra reference on its block that the caller releases. ``(True, None)``: a discard is
        queued, so the tier's value, if any, must not be served.
        """
        with self._lock:
            item = self._latest.get(key)
            if item is None:
                return False, None
            if isinstance(item, _DiskMark):
                return True, None
            if item.entry.block is not None:
                assert self._pool is not None
                self._pool.retain(item.entry.block)
            return True, item.entry

    def _done(self, item: _DiskPut | _DiskMark) -> None:
        with self._lock:
            if self._latest.get(item.key) is item:
                del self._latest[item.key]
            if isinstance(item, _DiskPut):
                self._puts -= 1
        if isinstance(item, _DiskPut):
            self._release(item)

    def _release(self, job: _DiskPut) -> None:
        if job.entry.block is not None:
            assert self._pool is not None
            self._pool.release(job.entry.block)



class DiskWriter(_Writer):
    """The single writer of a disk tier: batches puts, touches and discards into transactions.

    Its queue is unbounded, but at most ``max_puts`` puts are pending (queued or being written)
    at a time: a put over the limit is dropped, and a discard of its key is queued instead.
    """

    BATCH_ENTRIES = 32
    BATCH_BYTES = 256 << 20
    TOUCH_QUEUE_LIMIT = 1024  # touches are skipped while the queue holds this many jobs

    def __init__(self, disk: DiskTier, copier: Copier, pool: HostPool | None, max_puts: int) -> None:
        self.disk = disk
        self.touches_skipped = 0
        super().__init__("featcache-disk-writer", copier, pool, max_puts)

    def submit(self, key: bytes, entry: Entry) -> bool:
        """Queue a put of ``entry`` (the writer takes over its block reference); False if dropped,
        in which case a discard of ``key`` is queued instead."""
        job = _DiskPut(key, entry)
        with self._lock:
            if self._puts < self._max_puts and self._enqueue(job):
                self._puts += 1
                return True
            self._enqueue(_DiskMark("discard", key))
        self._release(job)
        self.disk.count_drops()
        return False

    def touch(self, key: bytes) -> None:
        """Record a use of ``key`` (recency only). Skipped while ``TOUCH_QUEUE_LIMIT`` jobs are
        queued (a stuck or slow disk): reads must not grow the queue without bound."""
        if self._queue.qsize() >= self.TOUCH_QUEUE_LIMIT:
            self.touches_skipped += 1
            return
        with self._lock:
            self._enqueue(_DiskMark("touch", key))

    def discard(self, key: bytes) -> None:
        """Delete ``key`` from disk after every put of it queued so far."""
        with self._lock:
            self._enqueue(_DiskMark("discard", key))

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

    def _write(self, batch: list[_DiskPut | _DiskMark]) -> None:
        ops: list[DiskOp] = []
        try:
            for item in batch:
                if isinstance(item, _DiskMark):
                    ops.append(DiskOp(item.kind, item.key))
                    continue
                try:
                    self._copier.wait(item.entry.fence)
                    value = self._value(item.entry)
                except Exception:  # this put is lost: its key's older value must go too
                    self._failed()
                    self.disk.count_drops()
                    ops.append(DiskOp("discard", item.key))
                else:
                    ops.append(DiskOp("put", item.key, value))
            self.disk.write_batch(ops)
        finally:
            for item in batch:
                self._done(item)

    @staticmethod
    def _value(entry: Entry) -> memoryview | bytes:
        """The disk value of a host entry: written in place into its frame when it has one."""
        tensor = entry.tensor
        if entry.frame is None:
            data = as_bytes(tensor).numpy().data
            return codec.encode(tensor.dtype, tuple(tensor.shape), data, entry.meta)
        frame = entry.frame.numpy().data
        codec.encode_in_place(frame, tensor.dtype, tuple(tensor.shape), entry.meta)
        return frame

class RemotePublisher(_Writer):
    """The single writer of the remote tier, off the request path: publishes host entries and
    applies remote deletes, in queue order.

    Its queue is unbounded, but at most ``max_puts`` publishes are pending at a time: one over the
    limit is dropped (counted as ``publish_dropped``). Deletes are small and always queued. While
    the remote tier's breaker is open, each job fails at once (counted), so the queue drains.
    """

    def __init__(self, remote: RemoteTier, copier: Copier, pool: HostPool | None, max_puts: int) -> None:
        self.remote = remote
        super().__init__("featcache-remote-publisher", copier, pool, max_puts)

    def submit(self, key: bytes, entry: Entry) -> bool:
        """Queue a publish of ``entry`` (the publisher takes over its block reference); False if
        dropped (counted)."""
        job = _DiskPut(key, entry)
        with self._lock:
            if self._puts < self._max_puts and self._enqueue(job):
                self._puts += 1
                return True
        self._release(job)
        self.remote.count("publish_dropped")
        return False

    def discard(self, key: bytes) -> None:
        """Delete ``key`` on the server after every publish of it queued so far."""
        with self._lock:
            self._enqueue(_DiskMark("discard", key))

    def _handle(self, item: _DiskPut | _DiskMark) -> None:
        try:
            if isinstance(item, _DiskMark):
                self.remote.discard(item.key)
            else:
                self._copier.wait(item.entry.fence)
                self.remote.put(item.key, item.entry)
        finally:
            self._done(item)


class Demoter(_Worker):
    """Copies put entries down to the host tier and hands them to the disk writer."""

    def __init__(
        self,
        copier: Copier,
        host: HostTier | None,
        writer: DiskWriter | None,
        maxsize: int,
        publisher: RemotePublisher | None = None,
    ) -> None:
        self._copier = copier
        self.host = host
        self.writer = writer
        self.publisher = publisher
        self._pending: dict[bytes, _Demotion] = {}
        self._lock = threading.Lock()
        super().__init__("featcache-demoter", max(1, maxsize))

    def submit(
        self, key: bytes, tensor: torch.Tensor, fence: Any, meta: bytes = b"", to_disk: bool = True,
        to_remote: bool = False,
    ) -> bool:
        """Queue ``tensor`` for the tiers below, replacing what they hold for ``key`` (the host
        entry goes now; the disk value when the put lands). False if the queue is full: the job
        is dropped and the key deleted from host and disk (the remote keeps its value)."""
        job = _Demotion(key, tensor, fence, meta, to_disk, to_remote)
        with self._lock:
            self._cancel(key)
            if self._offer(job):
                self._pending[key] = job
                return True
            if self.writer is not None:
                self.writer.discard(key)
        if self.host is not None and self.host.fits(tensor.nbytes):
            self.host.count_drop()
        if self.writer is not None and to_disk:
            self.writer.disk.count_drops()
        if self.publisher is not None and to_remote:
            self.publisher.remote.count("publish_dropped")
        return False

    def cancel(self, key: bytes) -> None:
        """Remove ``key`` below the device tier: a demotion not yet handed down is cancelled,
        the host entry dropped, and a disk (and remote) delete queued after any put of it already
        queued."""
        with self._lock:
            self._cancel(key)
            if self.writer is not None:
                self.writer.discard(key)
            if self.publisher is not None:
                self.publisher.discard(key)

    def _cancel(self, key: bytes) -> None:
        # Under self._lock.
        job = self._pending.pop(key, None)
        if job is not None:
            job.cancelled = True
        if self.host is not None:
            self.host.discard(key)

    def pending(self, key: bytes) -> Entry | None:
        """An entry put but not yet copied down: its device tensor and producer fence."""
        with self._lock:
            job = self._pending.get(key)
            return None if job is None else Entry(job.tensor, job.fence, meta=job.meta)

    def _handle(self, job: _Demotion) -> None:
        handed = False
        try:
            handed = self._demote(job)
        finally:
            with self._lock:
                if self._pending.get(job.key) is job:
                    del self._pending[job.key]
                if not handed and not job.cancelled and self.writer is not None:
                    self.writer.discard(job.key)  # the put did not reach the disk: no older value

    def _demote(self, job: _Demotion) -> bool:
        """Copy the job down; True if it was handed to the tiers below (or cancelled)."""
        tensor = job.tensor
        nbytes = tensor.nbytes
        # Room for the disk value's header + metadata before the payload: no copy to write it.
        start, offset = codec.frame_offsets(len(job.meta))
        block: Block | None = (
            self.host.reserve(offset + nbytes) if self.host is not None else None)
        if block is not None:
            buffer = block.tensor
        elif (self.writer is not None and job.to_disk) or (self.publisher is not None and job.to_remote):
            buffer = owned_empty(offset + nbytes, torch.device("cpu"), pin=self._copier.pin)
        else:
            if self.host is not None and self.host.fits(nbytes):
                self.host.count_drop()  # no block free: every one is busy with a copy
            return False
        dst = buffer[offset : offset + nbytes]
        try:
            done = self._copier.to_host(tensor, dst, after=job.fence)
        except BaseException:
            if block is not None:
                assert self.host is not None
                self.host.release(block)
            raise
        host_entry = Entry(dst.view(tensor.dtype).view(tensor.shape), done, block, job.meta,
                           frame=buffer[start : offset + nbytes])
        if block is not None:
            block.fence = done
        with self._lock:
            if job.cancelled:
                if block is not None:
                    assert self.host is not None
                    self.host.release(block)
                return True
            if block is not None:
                assert self.host is not None
                if self.writer is not None and job.to_disk:
                    self.host.pool.retain(block)  # the disk write reads it after the tier may evict
                if self.publisher is not None and job.to_remote:
                    self.host.pool.retain(block)  # and so does the publish
                self.host.put(job.key, host_entry)
            if self.writer is not None:
                if job.to_disk:
                    self.writer.submit(job.key, host_entry)
                else:
                    self.writer.discard(job.key)
            if self.publisher is not None and job.to_remote:
                self.publisher.submit(job.key, host_entry)
        return True

    def runs_current_thread(self) -> bool:
        """Whether the caller is one of the demoter's, the writer's or the publisher's threads."""
        return any(w.is_current() for w in (self, self.writer, self.publisher) if w is not None)

    def flush(self) -> None:
        self.join_queue()
        self._copier.synchronize()
        if self.writer is not None:
            self.writer.join_queue()
        if self.publisher is not None:
            self.publisher.join_queue()

    def close(self) -> None:
        self.flush()
        self.stop()
        if self.writer is not None:
            self.writer.stop()
        if self.publisher is not None:
            self.publisher.stop()
