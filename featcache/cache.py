"""FeatureCache: content-addressed image features in three tiers with byte budgets, and an
optional remote tier shared by a fleet.

    device (GPU; the CPU without CUDA) -> host (pinned RAM, pooled) -> disk (LMDB, persistent)
        -> remote (Redis/Valkey, shared; ``remote_url``)

Data flow:
- ``put`` stores the tensor in the device tier (no copy) and queues it for write-through to the
  host and disk tiers (``Demoter``); it never waits for a copy or a disk write.
- ``get`` looks in the device tier, then in what is still on its way down, then host, then disk.
  A lower-tier hit is promoted: host bytes are copied to the device on the caller's stream (the returned
  tensor is ordered before the caller's current stream's next work); a disk hit is verified,
  copied into a host block (kept in the host tier) and promoted the same way. A miss in every
  local tier reads the remote tier (one bounded, short-timeout network read; a remote hit is
  verified and promoted like a disk hit); every put is also published to the remote tier in the
  background (``RemotePublisher``), never on the request path.
- Eviction is LRU per tier. Because every entry is written through, evicting never copies.

Invariants:
- every tier's ``bytes`` stays within its ``capacity_bytes`` at all times;
- an entry lent through ``acquire``/``lease`` is never evicted from the device tier until released;
- a value is served only after its checksum (disk) or the copy that produced it (host) is done;
  a bad value is dropped, counted and reported as a miss: failures are misses, never wrong data;
- tensors returned may share storage with the cache: callers must not modify them, and a caller of
  ``put`` hands the tensor over (it must not modify it afterwards);
- puts and discards of the cache are applied to its tiers one at a time (``_order``), so every tier
  sees them in the same order: after ``flush()`` all tiers agree on each key;
- a value read from a lower tier is installed in the tiers above only if no put or discard of its
  key started after the read began (a per-key generation, checked under ``_order``): a
  promotion never undoes a newer put or a discard;
- an unclosed cache is closed when collected or at interpreter exit (``weakref.finalize``: its
  threads must not be killed mid-copy),
  and a forked child rebuilds its tiers and threads on first use (empty memory tiers, the disk
  store reopened): nothing inherited from the parent's threads or LMDB environment is used.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from .codec import HEADER, check_meta, check_storable
from .config import CacheConfig
from .copier import as_bytes, make_copier, owned_empty
from .demoter import Demoter, DiskWriter, RemotePublisher
from .errors import FeatCacheError
from .hostpool import Block
from .store.layout import MAX_KEY_BYTES, MAX_VALUE_BYTES
from .tiers.base import Entry, empty_stats
from .tiers.device import DeviceTier
from .tiers.disk import DiskTier
from .tiers.host import HostTier
from .tiers.remote import RemoteTier

log = logging.getLogger("featcache")

_FORKS = [0]  # bumped in every forked child: a cache built before it rebuilds on first use
_ADOPT_LOCK = threading.Lock()


def _after_fork_in_child() -> None:
    global _ADOPT_LOCK
    _FORKS[0] += 1
    _ADOPT_LOCK = threading.Lock()  # another thread of the parent may have held it


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _release(forks: int, demoter: Demoter | None, device: DeviceTier, host: HostTier | None,
             disk: DiskTier | None, remote: RemoteTier | None) -> None:
    """Flush and close what one build of a cache made. Run once (``weakref.finalize``): by
    ``close()``, when the cache is collected unclosed, or at interpreter exit. Left to die with
    the interpreter, a background thread caught inside torch's C++ code is unwound by force and
    the process aborts (SIGABRT, "terminate called without an active exception"), losing the
    writes in flight."""
    if forks != _FORKS[0]:  # inherited by a forked child: its threads are the parent's
        if disk is not None:
            disk.close()  # the inherited environment, so that the child may open the store
        return
    if demoter is not None and demoter.runs_current_thread():
        # collected inside one of its own threads: that thread cannot wait for itself
        threading.Thread(target=_release, args=(forks, demoter, device, host, disk, remote),
                         name="featcache-release", daemon=True).start()
        return
    if demoter is not None:
        demoter.close()
    device.close()
    if host is not None:
        host.close()
    if disk is not None:
        disk.close()
    if remote is not None:
        remote.close()


def _weakly(method: Callable[[bytes], None]) -> Callable[[bytes], None]:
    """``method`` through a weak reference: a tier's callback must not keep its cache alive
    (an unclosed cache that nobody references is released by its finalizer)."""
    ref = weakref.WeakMethod(method)  # type: ignore[arg-type]

    def call(key: bytes) -> None:
        bound = ref()
        if bound is not None:
            bound(key)

    return call


class Lease:
    """A tensor lent by the cache; its device entry stays resident until ``release``.

    ``tensor`` is ready on the acquiring thread's current stream; a user on another stream calls
    ``ready()`` there first. ``meta`` is the metadata stored with the entry (b"" if none).
    """

    def __init__(self, cache: FeatureCache, key: bytes, entry: Entry, pinned: bool) -> None:
        self.key = key
        self.tensor = entry.tensor
        self.meta = entry.meta
        self._fence = entry.fence
        self._cache = cache
        self._tier = cache._device  # the tier it pinned (a forked child's cache has a new one)
        self._pinned = pinned

    def ready(self) -> torch.Tensor:
        """The tensor, made safe to use on the caller's current stream."""
        self._cache._copier.ready(self.tensor, self._fence)
        return self.tensor

    def release(self) -> None:
        if self._pinned:
            self._pinned = False
            self._tier.unpin(self.key)

    def __enter__(self) -> torch.Tensor:
        return self.tensor

    def __exit__(self, *exc: object) -> None:
        self.release()


class FeatureCache:
    """A tiered, content-addressed cache of feature tensors. Thread-safe.

    ``FeatureCache(device="cuda", device_bytes="2GiB", host_bytes="8GiB",
    disk_path="/var/cache/featcache", disk_bytes="100GiB")``: sizes are ints or strings like
    "64MiB"; a budget of 0 disables a tier; ``disk_path=None`` means no disk tier; ``device``
    defaults to "cuda" when available, else "cpu". Further options: see ``config.DEFAULTS``.
    """

    def __init__(
        self,
        device: str | torch.device | None = None,
        device_bytes: int | str | None = None,
        host_bytes: int | str | None = None,
        disk_path: str | os.PathLike[str] | None = None,
        disk_bytes: int | str | None = None,
        **options: Any,
    ) -> None:
        self.config = CacheConfig.create(
            device, device_bytes, host_bytes, disk_path, disk_bytes, **options
        )
        self.device = torch.device(self.config.device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._closed = False
        self._build()

    def _build(self) -> None:
        """The tiers, the background threads and the books (at construction, and again in a
        forked child)."""
        cfg = self.config
        self._forks = _FORKS[0]
        self._order = threading.Lock()  # puts, discards and promotions' installs, one at a time
        self._reads: dict[bytes, list[int]] = {}  # key -> [generation, lookups in flight]
        self._copier = make_copier(self.device)
        self._device = DeviceTier(cfg.device_bytes)
        self._host = (
            HostTier(cfg.host_bytes, cfg.host_slab_bytes, pin=self._copier.pin)
            if cfg.host_bytes > 0 else None
        )
        self._writer: DiskWriter | None = None
        self._disk: DiskTier | None = None
        if cfg.disk_path is not None and cfg.disk_bytes > 0:
            self._disk = DiskTier(
                cfg.disk_path, cfg.disk_bytes, sync=cfg.disk_sync, on_corrupt=_weakly(self._drop_corrupt)
            )
            pool = self._host.pool if self._host is not None else None
            self._writer = DiskWriter(self._disk, self._copier, pool, cfg.disk_queue_entries)
        self._remote: RemoteTier | None = None
        self._publisher: RemotePublisher | None = None
        if cfg.remote_url is not None:
            self._remote = RemoteTier.from_config(cfg, on_corrupt=_weakly(self._drop_remote))
            pool = self._host.pool if self._host is not None else None
            self._publisher = RemotePublisher(self._remote, self._copier, pool, cfg.remote_queue_entries)
        self._demoter = (
            Demoter(self._copier, self._host, self._writer, cfg.demote_queue_entries, self._publisher)
            if self._host is not None or self._writer is not None or self._publisher is not None
            else None
        )
        self._counts: Counter[str] = Counter()
        self._events: dict[str, Counter[str]] = {}  # counters of integrations, by section
        self._counts_lock = threading.Lock()
        self._finalizer = weakref.finalize(
            self, _release, self._forks, self._demoter, self._device, self._host, self._disk,
            self._remote)

    # -- public API ----------------------------------------------------------------------------
    def put(self, key: bytes, features: torch.Tensor, meta: bytes | None = None) -> None:
        """Store ``features`` under ``key``; returns at once (lower tiers fill in the background).

        ``meta``: optional small bytes (at most 64 KiB) stored and served with the tensor
        (``Lease.meta``). An entry larger than a tier's budget skips that tier; larger than all,
        it is not stored. A put of an existing key replaces it: no local tier serves the old value
        afterwards, including the tiers the new value skips, is dropped from, or has not yet
        reached (a put that does not reach the disk deletes the key there). The remote tier, if
        any, serves the last value *published* (in the background, after the put returns): a
        publish that is dropped or fails leaves the server's value as it was.
        """
        self._check_open()
        _check_key(key)
        check_storable(features)
        meta_bytes = check_meta(meta)
        tensor = self._owned(features)
        nbytes = tensor.nbytes
        to_device = 0 < self._device.capacity_bytes and nbytes <= self._device.capacity_bytes
        to_host = self._host is not None and self._host.fits(nbytes)
        to_disk = (
            self._disk is not None
            and nbytes + HEADER.size + len(meta_bytes)
            <= min(self._disk.capacity_bytes, MAX_VALUE_BYTES)
        )
        to_remote = self._publisher is not None
        if not (to_device or to_host or to_disk or to_remote):
            self._count("not_stored")
            self._remove(key)  # replaced by nothing: the old value must not be served
            return
        self._count("puts")
        fence = self._copier.producer_fence()
        with self._order:  # every tier sees the puts and discards of a key in one order
            self._invalidate(key)
            if not (to_device and self._device.put(key, Entry(tensor, fence, meta=meta_bytes))):
                self._device.discard(key)
            if self._demoter is not None:
                if to_host or to_disk or to_remote:  # the host entry now, disk/remote in order
                    self._demoter.submit(key, tensor, fence, meta_bytes, to_disk=to_disk,
                                         to_remote=to_remote)
                else:
                    self._demoter.cancel(key)

    def get(self, key: bytes) -> torch.Tensor | None:
        """The features stored under ``key`` on the cache's device, bit-identical, or None.

        The tensor is ready for use on the caller's current CUDA stream. Do not modify it.
        """
        self._check_open()
        _check_key(key)
        entry = self._lookup(key, pin=False)
        self._count("hits" if entry is not None else "misses")
        if entry is None:
            return None
        self._copier.ready(entry.tensor, entry.fence)
        return entry.tensor

    def acquire(self, key: bytes) -> Lease | None:
        """Like ``get``, but the entry is pinned in the device tier until ``Lease.release()``."""
        self._check_open()
        _check_key(key)
        entry = self._lookup(key, pin=True)
        self._count("hits" if entry is not None else "misses")
        if entry is None:
            return None
        self._copier.ready(entry.tensor, entry.fence)
        return Lease(self, key, entry, pinned=self._device.capacity_bytes > 0)

    def lease(self, key: bytes) -> Lease | _NoLease:
        """``with cache.lease(key) as feats:`` -- feats is the tensor or None; pinned meanwhile."""
        return self.acquire(key) or _NoLease()

    def __contains__(self, key: object) -> bool:
        """Whether any local tier (or the way down) holds ``key``; counts nothing, promotes
        nothing, and does not ask the remote tier (no network call). A key ``put`` would refuse
        (not bytes, empty, too long) is not contained."""
        if not _valid_key(key) or self._closed:
            return False
        assert isinstance(key, bytes)
        if not self._adopted():
            return False
        if (
            self._device.contains(key)
            or (self._demoter is not None and self._demoter.pending(key) is not None)
            or (self._host is not None and self._host.contains(key))
        ):
            return True
        if self._disk is None or self._writer is None:
            return False
        queued, pending = self._writer.pending(key)
        if pending is not None:
            self._release(pending)
        return pending is not None if queued else self._disk.contains(key)

    def discard(self, key: bytes) -> None:
        """Remove ``key`` from every tier (from disk and remote asynchronously, in queue order).

        A put of ``key`` still on its way down is cancelled, or deleted after it lands: no tier
        serves the key afterwards, also after a reopen.
        """
        self._check_open()
        _check_key(key)
        self._remove(key)

    def flush(self) -> None:
        """Wait until every pending copy and disk write is done."""
        if not self._adopted():
            return
        if self._demoter is not None and not self._closed:
            self._demoter.flush()

    def count(self, section: str, event: str, n: int = 1) -> None:
        """Count an integration's event; it appears as ``stats()[section][event]``."""
        if section in ("device", "host", "disk", "cache", "remote"):
            raise ValueError(f"section {section!r} is reserved for the cache's own counters")
        with self._counts_lock:
            self._events.setdefault(section, Counter())[event] += n

    def stats(self) -> dict[str, dict[str, int]]:
        """Per-tier counters and sizes (``device``, ``host``, ``disk``), cache-wide ones
        (``cache``), ``remote`` when a remote tier is configured (docs/tuning.md), and one
        section per integration that counted events (e.g. ``lmdeploy``)."""
        self._adopted()
        with self._counts_lock:
            counts = dict(self._counts)
            events = {section: dict(c) for section, c in self._events.items()}
        demoter = self._demoter
        return {
            "device": self._device.stats(),
            "host": self._host.stats() if self._host is not None else empty_stats(),
            "disk": self._disk.stats() if self._disk is not None else empty_stats(),
            "cache": {
                "gets": counts.get("hits", 0) + counts.get("misses", 0),
                **{k: counts.get(k, 0) for k in ("hits", "misses", "puts", "not_stored")},
                **{k: counts.get(k, 0)
                   for k in ("inflight_hits", "promotions", "stale_promotions")},
                "demote_queue": demoter.depth if demoter is not None else 0,
                "disk_queue": self._writer.depth if self._writer is not None else 0,
                "worker_errors": sum(w.errors for w in self._workers()),
                "workers_alive": int(all(w.alive for w in self._workers())),
            },
            **self._remote_stats(),
            **events,
        }

    def close(self) -> None:
        """Flush, stop the background threads and release every tier. Idempotent. (An unclosed
        cache is closed when it is collected, or at interpreter exit.)"""
        if self._closed:
            return
        self._closed = True
        self._finalizer()

    def __enter__(self) -> FeatureCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        c = self.config
        return (
            f"FeatureCache(device={str(self.device)!r}, device_bytes={c.device_bytes}, "
            f"host_bytes={c.host_bytes}, disk_path={c.disk_path!r}, disk_bytes={c.disk_bytes}"
            + (f", remote_url={c.remote_url_redacted!r})" if c.remote_url is not None else ")")
        )

    # -- lookups and promotion -----------------------------------------------------------------
    def _lookup(self, key: bytes, pin: bool) -> Entry | None:
        """The device-resident entry for ``key`` (promoted if it was lower), or None."""
        if self._device.capacity_bytes > 0:
            entry = self._device.get(key, pin=pin)
            if entry is not None:
                return entry
        generation = self._begin_read(key)
        try:
            return self._lookup_below(key, pin, generation)
        finally:
            self._end_read(key)

    def _lookup_below(self, key: bytes, pin: bool, generation: int) -> Entry | None:
        """The lower tiers, in order; what is found is installed above unless stale."""
        if self._demoter is not None:
            entry = self._demoter.pending(key)
            if entry is not None:
                self._count("inflight_hits")
                self._install(key, generation, device=entry, pin=pin)
                return entry
        if self._host is not None:
            entry = self._host.get(key)  # its block comes retained
            if entry is not None:
                return self._promote(key, entry, pin, generation)
        if self._disk is not None:
            entry = self._from_disk(key, pin, generation)
            if entry is not None:
                return entry
        if self._remote is not None:
            return self._from_remote(key, pin, generation)
        return None

    def _from_disk(self, key: bytes, pin: bool, generation: int) -> Entry | None:
        assert self._disk is not None and self._writer is not None
        queued, pending = self._writer.pending(key)  # its block, if any, comes retained
        if pending is not None:
            self._count("inflight_hits")
            return self._promote(key, pending, pin, generation)
        if queued:
            return None  # a discard is queued: what the disk holds is stale
        disk = self._disk
        entry = self._load(key, pin, generation, lambda alloc: disk.get(key, alloc))
        if entry is not None:
            self._writer.touch(key)
        return entry

    def _from_remote(self, key: bytes, pin: bool, generation: int) -> Entry | None:
        """A local miss: read the remote tier (bounded by ``remote_timeout_ms``), unless a publish
        or delete of ``key`` is still queued here (then that decides)."""
        assert self._remote is not None and self._publisher is not None
        queued, pending = self._publisher.pending(key)  # its block, if any, comes retained
        if pending is not None:
            self._count("inflight_hits")
            return self._promote(key, pending, pin, generation)
        if queued:
            return None  # a delete is queued: what the server holds must not be served
        remote = self._remote
        return self._load(key, pin, generation, lambda alloc: remote.get(key, alloc))

    def _load(
        self, key: bytes, pin: bool, generation: int,
        read: Callable[[Callable[[int], torch.Tensor]], Entry | None],
    ) -> Entry | None:
        """``read(alloc)`` a verified entry from disk or remote into a host block (kept in the
        host tier; a staging buffer without one), then promote it to the device."""
        blocks: list[Block] = []

        def alloc(nbytes: int) -> torch.Tensor:
            block = self._host.reserve(nbytes) if self._host is not None else None
            if block is None:
                return owned_empty(nbytes, torch.device("cpu"), pin=self._copier.pin)
            blocks.append(block)
            return block.tensor

        try:
            entry = read(alloc)
        except BaseException:
            for block in blocks:
                self._host.release(block)  # type: ignore[union-attr]
            raise
        if entry is None:
            for block in blocks:  # alloc ran but the read failed afterwards
                self._host.release(block)  # type: ignore[union-attr]
            return None
        if blocks:
            entry.block = blocks[0]
            self._install(key, generation, host=entry)
        return self._promote(key, entry, pin, generation)

    def _promote(self, key: bytes, entry: Entry, pin: bool, generation: int) -> Entry:
        """Copy a host entry to the device; release the caller's block reference once queued."""
        try:
            source = as_bytes(entry.tensor)
            shape = tuple(entry.tensor.shape)
            tensor, done = self._copier.to_device(source, entry.tensor.dtype, shape, entry.fence)
            if entry.block is not None:
                entry.block.fence = done
        finally:
            if entry.block is not None:
                assert self._host is not None
                self._host.release(entry.block)
        self._count("promotions")
        promoted = Entry(tensor, done, meta=entry.meta)
        self._install(key, generation, device=promoted, pin=pin)
        return promoted

    # -- generations: a promotion never undoes a newer put or a discard --------------------------
    # A lookup that misses the device tier records the key's generation; every put and discard of
    # the key bumps it (under ``_order``, before touching any tier). A value read below is
    # installed above (``_install``, also under ``_order``) only if the generation is unchanged:
    # then no put or discard of the key began since the read, and any that begins later replaces
    # what is installed. Generations exist only while a lookup of the key is in flight.
    def _begin_read(self, key: bytes) -> int:
        with self._order:
            books = self._reads.setdefault(key, [0, 0])
            books[1] += 1
            return books[0]

    def _end_read(self, key: bytes) -> None:
        with self._order:
            books = self._reads[key]
            books[1] -= 1
            if not books[1]:
                del self._reads[key]

    def _invalidate(self, key: bytes) -> None:
        # Under self._order.
        books = self._reads.get(key)
        if books is not None:
            books[0] += 1

    def _install(
        self, key: bytes, generation: int, *, device: Entry | None = None, pin: bool = False,
        host: Entry | None = None,
    ) -> None:
        """Install a value read from below into the device tier (``device``) or the host tier
        (``host``, whose block reference the tier takes over), unless the key changed since
        the read began. A lease's pin is taken either way (``Lease.release`` undoes it)."""
        with self._order:
            fresh = self._reads[key][0] == generation
            if host is not None:
                assert self._host is not None and host.block is not None
                if fresh:
                    self._host.pool.retain(host.block)  # one reference for the tier
                    self._host.put(key, host)
            if device is not None and self._device.capacity_bytes > 0:
                if fresh:
                    self._device.put(key, device, pin=pin)
                elif pin:
                    self._device.pin(key)
            if not fresh:
                self._count("stale_promotions")

    # -- helpers -------------------------------------------------------------------------------
    def _remove(self, key: bytes) -> None:
        """Drop ``key`` from the device tier and (through the demoter) from every tier below."""
        with self._order:
            self._invalidate(key)
            self._device.discard(key)
            if self._demoter is not None:
                self._demoter.cancel(key)

    def _release(self, entry: Entry) -> None:
        if entry.block is not None:
            assert self._host is not None
            self._host.release(entry.block)

    def _owned(self, features: torch.Tensor) -> torch.Tensor:
        """The tensor the device tier keeps: on the cache's device, dense, owning its storage."""
        tensor = features.detach()
        if tensor.is_neg() or tensor.is_conj():  # lazy views: the raw bytes are not the values
            tensor = tensor.resolve_neg().resolve_conj()
        if tensor.device != self.device:
            return tensor.to(self.device).contiguous()
        whole = (
            tensor.is_contiguous()
            and tensor.storage_offset() == 0
            and tensor.untyped_storage().nbytes() == tensor.nbytes
        )
        # A view would keep its whole base alive while the books count only the view.
        return tensor if whole else tensor.clone(memory_format=torch.contiguous_format)

    def _drop_corrupt(self, key: bytes) -> None:
        if self._writer is not None:
            self._writer.discard(key)

    def _drop_remote(self, key: bytes) -> None:
        """A corrupt or incomplete remote entry: delete it on the server, in the background."""
        if self._publisher is not None:
            self._publisher.discard(key)

    def _remote_stats(self) -> dict[str, dict[str, int]]:
        if self._remote is None or self._publisher is None:
            return {}
        return {"remote": {**self._remote.stats(), "publish_queue": self._publisher.depth}}

    def _workers(self) -> list[Any]:
        return [w for w in (self._demoter, self._writer, self._publisher) if w is not None]

    def _count(self, name: str) -> None:
        with self._counts_lock:
            self._counts[name] += 1

    def _check_open(self) -> None:
        if self._closed:
            raise FeatCacheError("this FeatureCache is closed")
        if self._forks != _FORKS[0]:
            self._adopt()

    def _adopted(self) -> bool:
        """For the calls that never raise: whether the tiers are this process's, adopting them
        first in a forked child; False if that cannot be (closed there, or on CUDA)."""
        if self._forks == _FORKS[0]:
            return True
        if self._closed:
            return False
        try:
            self._adopt()
        except FeatCacheError:
            return False
        return True

    def _adopt(self) -> None:
        """First use in a forked child: rebuild the tiers and threads (the parent's threads do
        not exist here and its locks may be held forever); the memory tiers start empty, the
        disk store is reopened. Runs in the child's first thread to use the cache."""
        with _ADOPT_LOCK:
            if self._forks == _FORKS[0]:
                return
            if self.device.type == "cuda":
                self._closed = True
                raise FeatCacheError(
                    "this FeatureCache lives on CUDA and the process was forked since: CUDA cannot "
                    "be used in a forked child; create the cache in the child, or start children "
                    "with the 'spawn' method"
                )
            self._finalizer()  # the parent's build: closes the inherited environment only
            self._build()


class _NoLease:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _valid_key(key: object) -> bool:
    """Whether ``key`` is one the cache stores: bytes, 1 to ``MAX_KEY_BYTES`` long (every record
    the disk tier writes for it then fits LMDB's key limit)."""
    return isinstance(key, bytes) and 0 < len(key) <= MAX_KEY_BYTES


def _check_key(key: object) -> None:
    if not isinstance(key, bytes):
        raise TypeError(f"keys are bytes (from featcache.image_key), not {type(key).__name__}")
    if not _valid_key(key):
        raise ValueError(f"a key must be 1 to {MAX_KEY_BYTES} bytes long, got {len(key)}")
