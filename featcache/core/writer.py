"""Background threads: the shared plumbing (``Worker``) and the single writer of a lower tier
(``TierWriter``, one class for every tier below the host: disk, remote, ...).

A ``TierWriter`` owns one thread and one queue. Its queue is unbounded, but at most ``max_puts``
puts are pending (queued or being written) at a time (its ``Room``): a put over the limit is
dropped and counted on the tier (``Tier.count_drops``), unless room for it was reserved first
(``reserve(wait=True)``: the demoter does so for a ``put(..., block=True)``, waiting for room
instead of dropping). Discards are tiny and always queued; touches (hits, for a tier that records
recency in writes) are skipped while ``TOUCH_QUEUE_LIMIT`` jobs are queued.
The thread hands the tier batches of up to ``batch_entries`` jobs (``WrittenTier.write``), in
queue order, each put after its host copy is done.

Invariants:
- the in-flight map holds, per key, the last put or discard queued and not yet written
  (read-your-writes: ``pending``); a discard that cannot be queued (a dead thread) stays there
  for good, so the tier's value of that key is never served again by this process;
- for an ``exact`` tier (one that never keeps a value older than its key's last put or discard),
  a put that does not land (dropped, its copy failed, the batch raised) queues or applies a
  discard of its key instead;
- a pending put holds a reference on its host block until it is written, then releases it.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any

from ..tiers.base import Entry, Op, WrittenTier
from .copier import Copier
from .hostpool import HostPool

log = logging.getLogger("featcache")

_STOP = object()


class Room:
    """At most ``limit`` items admitted at a time: the bound of a queue whose producers either
    drop when it is full (``take()`` is False) or wait for room (``take(wait=True)``). No polling:
    a waiter sleeps on a condition variable that ``give`` and ``close`` notify. After ``close``
    (its consumer stopped or died) every ``take`` fails at once and every waiter wakes and fails,
    so no producer waits for a thread that will never make room."""

    def __init__(self, limit: int) -> None:
        self.limit = max(1, limit)
        self._used = 0
        self._closed = False
        self._cond = threading.Condition(threading.Lock())

    def take(self, wait: bool = False) -> bool:
        """Admit one item; False if the room is full (without ``wait``) or closed."""
        with self._cond:
            if wait:
                self._cond.wait_for(lambda: self._used < self.limit or self._closed)
            if self._closed or self._used >= self.limit:
                return False
            self._used += 1
            return True

    def give(self) -> None:
        """An admitted item left (taken off the queue, written, or not queued after all)."""
        with self._cond:
            self._used -= 1
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


class Worker:
    """A daemon thread draining a queue (bounded if ``maxsize`` > 0); shared plumbing. A
    subclass whose producers may wait for room closes its ``Room`` in ``_ended`` (called when the
    worker is stopped and when its thread ends, however it ends)."""

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
        try:
            self._loop()
        finally:
            self._ended()  # nobody may wait for room this thread would make

    def _loop(self) -> None:
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

    def _ended(self) -> None:
        """The worker takes no more work (stopping, or its thread ended): end every wait for room."""

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
        self._ended()
        if self.alive:
            self._queue.put(_STOP)
            self._thread.join()


class TierWriter(Worker):
    """The single writer thread of one lower tier (see the module docstring)."""

    BATCH_BYTES = 256 << 20  # a batch stops growing past this many bytes of puts
    TOUCH_QUEUE_LIMIT = 1024  # touches are skipped while the queue holds this many jobs

    def __init__(
        self, tier: WrittenTier, *, name: str, copier: Copier, pool: HostPool | None,
        max_puts: int, batch_entries: int, exact: bool,
    ) -> None:
        self.tier = tier
        self._copier = copier
        self._pool = pool  # the host pool whose blocks pending puts reference, if any
        self._room = Room(max_puts)  # puts queued or being written
        self._batch_entries = max(1, batch_entries)
        self._exact = exact
        self._latest: dict[bytes, Op] = {}  # key -> its last queued put or discard
        self._lock = threading.Lock()
        super().__init__(name, 0)

    def reserve(self, wait: bool = False) -> bool:
        """Take room for one put, waiting for it with ``wait`` (never from this writer's own
        thread: it is the one that makes room); the next ``submit(..., reserved=True)`` uses it,
        or ``unreserve()`` gives it back. False if there is none (without ``wait``) or the
        writer is stopped or dead."""
        return self._room.take(wait)

    def unreserve(self) -> None:
        self._room.give()

    def submit(self, key: bytes, entry: Entry, *, reserved: bool = False) -> bool:
        """Queue a put of ``entry`` (the writer takes over its block reference); False if dropped
        (counted; for an exact tier a discard of ``key`` is queued instead). ``reserved``: room
        was taken by ``reserve``; this call uses it up either way."""
        job = Op("put", key, entry)
        with self._lock:
            if reserved or self._room.take():
                if self._enqueue(job):
                    return True
                self._room.give()
            if self._exact:
                self._enqueue(Op("discard", key))
        self._release(job)
        self.tier.count_drops()
        return False

    def discard(self, key: bytes) -> None:
        """Delete ``key`` from the tier after every put of it queued so far."""
        with self._lock:
            self._enqueue(Op("discard", key))

    def touch(self, key: bytes) -> None:
        """Record a use of ``key`` (recency only). Skipped while ``TOUCH_QUEUE_LIMIT`` jobs are
        queued (a stuck or slow tier): reads must not grow the queue without bound."""
        if self._queue.qsize() >= self.TOUCH_QUEUE_LIMIT:
            return
        with self._lock:
            self._enqueue(Op("touch", key))

    def _enqueue(self, job: Op) -> bool:
        # Under self._lock: the in-flight map and the queue order agree.
        if not self._offer(job):
            if job.kind == "discard":
                # Only a dead thread refuses a discard (the queue is unbounded): the delete
                # can never run, so it stays in the in-flight map and the tier's value of the
                # key is never served again by this process.
                self._latest[job.key] = job
            return False
        if job.kind != "touch":
            self._latest[job.key] = job
        return True

    def pending(self, key: bytes) -> tuple[bool, Entry | None]:
        """What the queue will leave in the tier for ``key``.

        ``(False, None)``: nothing queued for it. ``(True, entry)``: a put not yet written, with
        an extra reference on its block that the caller releases. ``(True, None)``: a discard is
        queued, so the tier's value, if any, must not be served.
        """
        with self._lock:
            job = self._latest.get(key)
            if job is None:
                return False, None
            if job.entry is None:
                return True, None
            if job.entry.block is not None:
                assert self._pool is not None
                self._pool.retain(job.entry.block)
            return True, job.entry

    def _ended(self) -> None:
        self._room.close()

    def _handle(self, item: Op) -> None:
        batch = [item]
        nbytes = 0
        while len(batch) < self._batch_entries and nbytes < self.BATCH_BYTES:
            try:
                more = self._queue.get_nowait()
            except queue.Empty:
                break
            if more is _STOP:  # put it back for the loop to see after this batch
                self._queue.task_done()
                self._queue.put(_STOP)
                break
            batch.append(more)
            if more.entry is not None:
                nbytes += more.entry.nbytes
        try:
            self._write(batch)
        finally:
            for _ in batch[1:]:
                self._queue.task_done()

    def _write(self, batch: list[Op]) -> None:
        ops: list[Op] = []
        try:
            for job in batch:
                if job.entry is not None:
                    try:
                        self._copier.wait(job.entry.fence)
                    except Exception:  # this put is lost: for an exact tier, its key's value too
                        self._failed()
                        self.tier.count_drops()
                        if self._exact:
                            ops.append(Op("discard", job.key))
                        continue
                ops.append(job)
            try:
                self.tier.write(ops)
            except Exception:  # nothing of the batch is known to have landed
                self._failed()
                self.tier.count_drops(sum(op.kind == "put" for op in ops))
                if self._exact:  # no older value of its keys may be served later
                    self.tier.write([Op("discard", op.key) for op in ops if op.kind != "touch"])
        finally:
            for job in batch:
                self._done(job)

    def _done(self, job: Op) -> None:
        with self._lock:
            if self._latest.get(job.key) is job:
                del self._latest[job.key]
        if job.kind == "put":
            self._room.give()
            self._release(job)

    def _release(self, job: Op) -> None:
        if job.entry is not None and job.entry.block is not None:
            assert self._pool is not None
            self._pool.release(job.entry.block)
