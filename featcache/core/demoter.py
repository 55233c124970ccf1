"""All of featcache's asynchrony: the demotion thread, and the writer thread of each tier below
the host (``featcache.core.writer.TierWriter``), which the demoter feeds and flushes.

Every entry put in the cache is copied down (write-through) in the background:

    put --(demote queue: at most demote_queue_entries jobs)--> demotion thread: D2H copy into a
        host block on the copy stream; the host entry to the staging (host) tier
        --> each lower tier's writer (queue: puts bounded, discards always queued) --> writer
            thread: wait for the copy, hand the tier batches of puts, touches and discards in
            queue order (one LMDB transaction per batch for the disk; chunks then the head for
            the remote)

Overload policy: by default a put over a queue's limit is dropped instead of blocking ``put``
(counted as a drop on every tier it was headed for: ``Tier.count_drops``; the entry stays in the
tiers above). A lower tier's queue is unbounded, but holds at most its ``max_puts`` pending puts
(the config's ``disk_queue_entries``, ``remote_queue_entries``); discards are tiny and always
queued; touches are skipped past ``TierWriter.TOUCH_QUEUE_LIMIT`` queued jobs.

A blocking put (``put(..., block=True)``, for batch jobs that fill a store) waits instead: the
caller for room in the demote queue (``reserve``, before it takes any lock), then the demotion
thread, with no lock held, for room in each lower tier's queue (``TierWriter.reserve``) before it
hands the entry down. Each bound is a ``Room`` (a condition variable: no polling). Nothing waits
for its own thread (a put from a background thread does not block), and a stopped or dead thread
closes its rooms, which ends every wait on them (the put is then dropped and counted, as by default).

Invariants:
- an exact tier (``Rules.exact``: the disk) never keeps a value older than the last put or discard
  of its key: a put that does not reach it (dropped, failed, too big) queues a discard of its key
  instead, in order; a tier that is not exact (the remote) keeps the last value that reached it;
- a later put or a discard of a key cancels a demotion of that key not yet handed down. Both
  take the demoter's lock, and the demotion thread checks for cancellation under that lock right
  before it hands the host copy to the host tier and the writers: so a discard either cancels a
  put or lands after it in each writer's queue;
- each queue keeps an in-flight map (key -> its latest queued job) so a ``get`` sees entries
  still on their way down (read-your-writes) and never reads a tier's value with a discard queued.

``flush`` waits for the demote queue, the copy stream and every writer's queue, in that order;
``close`` flushes, then stops and joins every thread. No polling: threads block on their queues. A
job that raises is logged (once per thread) and counted as an error; the thread keeps going. If a
thread dies anyway, that is logged (critical) and counted, ``alive`` turns False, later jobs are
dropped and counted, and the request path is unaffected; a discard a dead writer cannot apply
stays in its in-flight map, so its tier never serves that key's older value again in this process.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch

from .. import codec
from ..tiers.base import Entry, StagingTier
from .chain import Slot
from .copier import Copier, owned_empty
from .hostpool import Block
from .writer import Room, TierWriter, Worker


@dataclass(eq=False)
class _Demotion:
    key: bytes
    tensor: torch.Tensor  # on the cache's device
    fence: Any  # producer's event
    meta: bytes
    to: tuple[Slot, ...]  # the tiers below the top it fits (the exact others delete the key)
    block: bool = False  # wait for room in the lower tiers' queues instead of dropping
    cancelled: bool = False  # set under the demoter's lock by a later put or a discard of key


class Demoter(Worker):
    """Copies put entries down to the staging (host) tier and hands them to the lower tiers'
    writers. ``below``: every slot under the top, in order."""

    def __init__(
        self, copier: Copier, staging: StagingTier | None, below: tuple[Slot, ...], maxsize: int,
    ) -> None:
        self._copier = copier
        self.staging = staging
        self.written = tuple(slot for slot in below if slot.writer is not None)
        self.writers: tuple[TierWriter, ...] = tuple(
            slot.writer for slot in self.written if slot.writer is not None)
        self._pending: dict[bytes, _Demotion] = {}
        self._lock = threading.Lock()
        self._room = Room(maxsize)  # jobs queued, not yet taken by the thread
        super().__init__("featcache-demoter", 0)

    def reserve(self, wait: bool = False) -> bool:
        """Take room for one job in the queue, waiting for it with ``wait`` (call it holding no
        lock of the cache's: the thread that makes room takes them); the next ``submit(...,
        reserved=True)`` uses it. False if there is none (without ``wait``) or the demoter is
        stopped or dead. Never waits in the demoter's or a writer's thread (``wait`` is ignored
        there: they are the ones that make room)."""
        return self._room.take(wait and not self.runs_current_thread())

    def unreserve(self) -> None:
        self._room.give()

    def submit(
        self, key: bytes, tensor: torch.Tensor, fence: Any, meta: bytes, to: tuple[Slot, ...],
        *, reserved: bool = False, block: bool = False,
    ) -> bool:
        """Queue ``tensor`` for the tiers ``to`` (slots below the top that fit it), replacing what
        every tier below holds for ``key`` (the host entry goes now; a lower tier's value when
        the put lands there). False if the queue is full (and no room was ``reserved``): the job
        is dropped (counted on each tier of ``to``) and the key deleted from the host and every
        exact tier. ``block``: the demotion thread waits for room in the lower tiers' queues
        instead of dropping there."""
        job = _Demotion(key, tensor, fence, meta, to, block)
        with self._lock:
            self._cancel(key)
            if reserved or self._room.take():
                if self._offer(job):
                    self._pending[key] = job
                    return True
                self._room.give()
            self._delete_below(key)
        for slot in to:
            slot.tier.count_drops()
        return False

    def cancel(self, key: bytes) -> None:
        """Remove ``key`` below the top tier: a demotion not yet handed down is cancelled, the
        host entry dropped, and a delete queued on every writer after any put of it queued."""
        with self._lock:
            self._cancel(key)
            for writer in self.writers:
                writer.discard(key)

    def _cancel(self, key: bytes) -> None:
        # Under self._lock.
        job = self._pending.pop(key, None)
        if job is not None:
            job.cancelled = True
        if self.staging is not None:
            self.staging.discard(key)

    def _delete_below(self, key: bytes, *, but: tuple[Slot, ...] = ()) -> None:
        """Queue a delete of ``key`` on every exact tier outside ``but`` (under self._lock)."""
        for slot in self.written:
            if slot.rules.exact and slot not in but:
                assert slot.writer is not None
                slot.writer.discard(key)

    def pending(self, key: bytes) -> Entry | None:
        """An entry put but not yet copied down: its device tensor and producer fence."""
        with self._lock:
            job = self._pending.get(key)
            return None if job is None else Entry(job.tensor, job.fence, meta=job.meta)

    def _ended(self) -> None:
        self._room.close()

    def _handle(self, job: _Demotion) -> None:
        self._room.give()  # off the queue: room for the next one
        handed = False
        held: list[TierWriter] = []  # writers with room reserved for this job, until it is used
        try:
            if job.block:  # no lock held: each writer's thread makes room on its own
                held = [slot.writer for slot in job.to
                        if slot.writer is not None and slot.writer.reserve(wait=True)]
            handed = self._demote(job, held)
        finally:
            for writer in held:
                writer.unreserve()
            with self._lock:
                if self._pending.get(job.key) is job:
                    del self._pending[job.key]
                if not handed and not job.cancelled:
                    self._delete_below(job.key)  # the put reached no exact tier: no older value

    def _demote(self, job: _Demotion, held: list[TierWriter]) -> bool:
        """Copy the job down; True if it was handed to the tiers below (or cancelled). ``held``:
        the writers with room reserved for it; emptied once handing down has used that room."""
        tensor = job.tensor
        nbytes = tensor.nbytes
        staging = self.staging
        staged = staging is not None and any(slot.tier is staging for slot in job.to)
        written = tuple(slot for slot in job.to if slot.writer is not None)
        # Room for the value's header + metadata before the payload: no copy to write it.
        start, offset = codec.frame_offsets(len(job.meta))
        block: Block | None = staging.reserve(offset + nbytes) if staging is not None and staged else None
        if block is not None:
            buffer = block.tensor
        elif written:
            buffer = owned_empty(offset + nbytes, torch.device("cpu"), pin=self._copier.pin)
        else:
            if staging is not None and staged:
                staging.count_drops()  # no block free: every one is busy with a copy
            return False
        dst = buffer[offset : offset + nbytes]
        try:
            done = self._copier.to_host(tensor, dst, after=job.fence)
        except BaseException:
            if block is not None:
                assert staging is not None
                staging.release(block)
            raise
        host_entry = Entry(dst.view(tensor.dtype).view(tensor.shape), done, block, job.meta,
                           frame=buffer[start : offset + nbytes])
        if block is not None:
            block.fence = done
        with self._lock:
            if job.cancelled:
                if block is not None:
                    assert staging is not None
                    staging.release(block)
                return True
            if block is not None:
                assert staging is not None
                for _ in written:  # each write reads the block after the tier may evict it
                    staging.pool.retain(block)
                staging.put(job.key, host_entry)
            for slot in written:
                assert slot.writer is not None
                slot.writer.submit(job.key, host_entry, reserved=slot.writer in held)
            held.clear()
            self._delete_below(job.key, but=written)  # the exact tiers the put does not fit
        return True

    def runs_current_thread(self) -> bool:
        """Whether the caller is one of the demoter's or the writers' threads."""
        return self.is_current() or any(w.is_current() for w in self.writers)

    def flush(self) -> None:
        self.join_queue()
        self._copier.synchronize()
        for writer in self.writers:
            writer.join_queue()

    def close(self) -> None:
        self.flush()
        self.stop()
        for writer in self.writers:
            writer.stop()
