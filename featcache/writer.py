"""Background threads: the shared plumbing (``Worker``) and the single writer of a lower tier
(``TierWriter``, one class for every tier below the host: disk, remote, ...).

A ``TierWriter`` owns one thread and one queue. Its queue is unbounded, but at most ``max_puts``
puts are pending (queued or being written) at a time: a put over the limit is dropped and
counted on the tier (``Tier.count_drops``). Discards are tiny and always queued; touches (hits,
for a tier that records recency in writes) are skipped while ``TOUCH_QUEUE_LIMIT`` jobs are queued.
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

from .copier import Copier
from .hostpool import HostPool
from .tiers.base import Entry, Op, WrittenTier

log = logging.getLogger("featcache")

_STOP = object()


class Worker:
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
        self._max_puts = max(1, max_puts)
        self._batch_entries = max(1, batch_entries)
        self._exact = exact
        self._puts = 0  # puts queued or being written
        self._latest: dict[bytes, Op] = {}  # key -> its last queued put or discard
        self._lock = threading.Lock()
        super().__init__(name, 0)

    def submit(self, key: bytes, entry: Entry) -> bool:
        """Queue a put of ``entry`` (the writer takes over its block reference); False if dropped
        (counted; for an exact tier a discard of ``key`` is queued instead)."""
        job = Op("put", key, entry)
        with self._lock:
            if self._puts < self._max_puts and self._enqueue(job):
                self._puts += 1
                return True
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
                self._puts -= 1
        if job.kind == "put":
            self._release(job)

    def _release(self, job: Op) -> None:
        if job.entry is not None and job.entry.block is not None:
            assert self._pool is not None
            self._pool.release(job.entry.block)
