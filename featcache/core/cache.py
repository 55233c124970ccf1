"""FeatureCache: content-addressed image features in a chain of tiers with byte budgets.

    device (GPU; the CPU without CUDA) -> host (pinned RAM, pooled) -> disk (LMDB, persistent)
        -> remote (Redis/Valkey, shared; ``remote_url``)

The tiers are an ordered tuple of slots (``featcache.core.chain``: tier, writer, rules); the cache
loops over them and names none.

Data flow:
- ``put`` stores the tensor in the top (device) tier (no copy) and queues it for write-through to
  every tier below that fits it (``Demoter``); it never waits for a copy or a write. Past a
  queue's bound the write-through is dropped (counted), unless the put blocks (``block=True``, or
  inside ``blocking_puts()``): then it waits for room in every bounded queue on the way down.
- ``get`` looks in the top tier, then in what is still on its way down, then in each tier below,
  in order (``featcache.core.lookup``: what a tier's writer still queues is looked at first). A
  hit below is promoted to the device on the caller's stream (the returned tensor is ordered
  before the caller's current stream's next work), a value read from disk or remote verified and
  kept in the host tier on the way, and a tier that keeps recency by writes (disk) is sent a
  touch. The remote tier is read only when every local tier missed (one bounded network read).
- Eviction: the memory tiers by the config's ``eviction`` (``featcache.eviction``: "admit", the
  default, weighs the cost ``put(..., cost_s=)`` records and may leave a new entry out of a memory
  tier, still written through below), the disk by LRU. Every entry is written through, so
  evicting never copies.

Invariants:
- every tier's ``bytes`` stays within its ``capacity_bytes`` at all times;
- an entry lent through ``acquire``/``lease`` is never evicted from the top tier until released;
- a value is served only after its checksum (disk, remote) or the copy that produced it (host)
  is done; a bad value is dropped, counted and reported as a miss: failures are misses, never
  wrong data;
- tensors returned may share storage with the cache: callers must not modify them, and a caller of
  ``put`` hands the tensor over (it must not modify it afterwards);
- puts and discards of the cache are applied to its tiers one at a time (``Lookup.order``), so
  every tier sees them in the same order: after ``flush()`` all local tiers agree on each key;
- a value read from a lower tier is installed in the tiers above only if no put or discard of its
  key started after the read began (a per-key generation, ``featcache.core.lookup``): a promotion
  never undoes a newer put or a discard (a stale one is counted, ``stale_promotions``);
- an unclosed cache is closed when collected or at interpreter exit (``weakref.finalize``: its
  threads must not be killed mid-copy), and a forked child rebuilds its tiers and threads on
  first use (``featcache.core.forks``: empty memory tiers, the disk store reopened): nothing
  inherited from the parent's threads or LMDB environment is used.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from .. import autosize
from ..codec import check_storable
from ..config import CacheConfig
from ..keys import ImageKey, KeyHasher
from ..keysecret import hasher_for, remote_secret_name
from ..store.env import check_not_foreign
from ..store.report import VerifyReport
from ..tiers.base import Entry
from . import forks
from .chain import KINDS, build_chain
from .copier import make_copier
from .counts import Counts
from .demoter import Demoter
from .intake import check_key, owned, stored_meta, valid_key
from .lease import Lease, NoLease
from .lookup import Found, Lookup
from .singleflight import SingleFlight


class FeatureCache(forks.Adoptable):
    """A tiered, content-addressed cache of feature tensors. Thread-safe.

    ``FeatureCache(device="cuda", device_bytes="2GiB", host_bytes="8GiB",
    disk_path="/var/cache/featcache", disk_bytes="100GiB")``: sizes are ints or strings like
    "64MiB"; a budget of 0 disables a tier; ``disk_path=None`` means no disk tier; ``device``
    defaults to "cuda" when available, else "cpu". Further options: see ``config.DEFAULTS``.
    ``budgets="auto"``: each size not given is chosen from what the machine has free
    (``featcache.autosize``; the choice and its reasons are logged).
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
        budgets = options.pop("budgets", None)
        if budgets is not None:
            path = os.fspath(disk_path) if isinstance(disk_path, (str, os.PathLike)) else None
            sizes = autosize.sized(budgets, None if device is None else str(device), path, {
                "device_bytes": device_bytes, "host_bytes": host_bytes, "disk_bytes": disk_bytes})
            device_bytes, host_bytes, disk_bytes = (sizes[f"{t}_bytes"] for t in autosize.TIERS)
        self.config = CacheConfig.create(
            device, device_bytes, host_bytes, disk_path, disk_bytes, **options
        )
        self.device = torch.device(self.config.device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._closed = False
        self._blocking = 0  # open blocking_puts() contexts: puts that do not say block= wait
        self._blocking_lock = threading.Lock()
        if self.config.disk_path is not None:  # (another program's LMDB: refused before its
            check_not_foreign(os.fspath(self.config.disk_path))  # directory gets a key secret)
        # how keys are made, under the store's secret: kept across fork (the store's file, read once)
        self.hasher: KeyHasher = hasher_for(self.config)
        self._build()

    def _build(self) -> None:
        """The chain of tiers, the background threads and the books (at construction, and again
        in a forked child)."""
        self._forks = forks.generation()
        self._copier = make_copier(self.device)
        self._chain = build_chain(self.config, self._copier)
        below = self._chain.below
        self._demoter = (
            Demoter(self._copier, self._chain.staging, below, self.config.demote_queue_entries)
            if below else None
        )
        self._flights: SingleFlight[torch.Tensor] = SingleFlight()  # get_or_compute's misses
        self._counts = Counts(("cache", *(kind.name for kind in KINDS)))
        self._count = self._counts.count  # (the read path's: no reference to the cache)
        # puts, discards and promotions' installs take its lock (``order``), one at a time
        self._lookup = Lookup(self._chain, self._demoter, self._copier, self._count)
        self._keep_remote_secret()
        self._finalizer = weakref.finalize(self, forks.release, self._forks, self._chain, self._demoter)

    def _keep_remote_secret(self) -> None:
        """Hand the remote tier the fleet's key secret this cache keys with (it sets it again
        on a server that lost it: ``featcache.tiers.remote``); not an operator's secret file."""
        secret = self.hasher.secret
        if (secret is not None and self.config.remote_url is not None
                and self.config.key_secret_file is None):
            self._chain.keep_secret(remote_secret_name(self.config), secret)

    # -- public API ----------------------------------------------------------------------------
    def image_key(self, image: Any, *, namespace: str = "",
                  params: Mapping[str, Any] | None = None) -> ImageKey:
        """The key of ``image`` for model ``namespace`` and preprocessing ``params``
        (``featcache.image_key``'s arguments), under this cache's key secret: the key every
        process sharing its store (servers, ``featcache warm``, pipelines) makes for the image."""
        return self.hasher.image_key(image, namespace=namespace, params=params)

    def client_key(self, image_id: str, *, namespace: str = "",
                   params: Mapping[str, Any] | None = None) -> ImageKey:
        """The key of the image a trusted client names ``image_id``, under this cache's secret."""
        return self.hasher.client_key(image_id, namespace=namespace, params=params)

    def put(self, key: bytes, features: torch.Tensor, meta: bytes | None = None, *,
            namespace: str | None = None, block: bool | None = None,
            cost_s: float | None = None) -> None:
        """Store ``features`` under ``key``; returns at once, unless ``block`` (lower tiers fill in
        the background).

        ``block``: what happens when the background work falls behind. False (the default,
        outside ``blocking_puts()``): the put never waits; past ``demote_queue_entries`` queued
        copies or ``disk_queue_entries`` (``remote_queue_entries``) pending writes, the entry is
        not written down and that is counted (``stats()[tier]["drops"]``): right for a server,
        whose request path must not wait for a disk. True: the put waits for room in the copy
        queue, and the background copy waits for room in each lower tier's queue, so no entry is
        dropped on its way down (a script that fills a store; ``flush()`` then waits for the
        writes). It waits as long as the writes take (no timeout); it does not wait when called
        from the cache's own background threads, nor once the cache is closing (then the entry
        is dropped and counted as with False). An entry larger than a tier's budget still skips
        that tier, and the host tier, a cache of its own, may still skip one while every block
        is busy. None: True inside ``with cache.blocking_puts():``, else False.

        ``meta``: optional small bytes (at most 64 KiB) stored and served with the tensor
        (``Lease.meta``). An entry larger than a tier's budget skips that tier; larger than all,
        it is not stored. A put of an existing key replaces it: no local tier serves the old value
        afterwards, including the tiers the new value skips, is dropped from, or has not yet
        reached (a put that does not reach the disk deletes the key there). The remote tier, if
        any, serves the last value *published* (in the background, after the put returns): a
        publish that is dropped or fails leaves the server's value as it was.

        ``namespace`` (default: the one a key from ``image_key`` carries) is recorded in the
        metadata (``{"ns": ...}``, or added to ``meta`` when that is a JSON object) so that
        ``featcache ls`` shows it and ``purge --namespace`` finds the entry: keys are digests and
        cannot tell it. Given explicitly with ``meta`` that is not a JSON object, it raises
        ``ValueError``; carried by the key, such ``meta`` is stored as it is.

        ``cost_s``: what a hit on the entry saves, in seconds (the time ``features`` took to
        compute: the lmdeploy integration records its vision model's). Recorded in the metadata
        (``{"cost_s": ...}``, like the namespace; ``ValueError`` with ``meta`` that is not a JSON
        object), so it travels through every tier; ``eviction="admit"`` or ``"value"`` keeps the
        entries that save the most per byte. None: unknown (counted as the mean of the known costs).
        """
        self._check_open()
        check_key(key)
        check_storable(features)
        meta_bytes = stored_meta(meta, namespace, key, cost_s)
        tensor = owned(features, self.device)
        top = self._chain.top
        to_top = top.fits(tensor.nbytes, len(meta_bytes))
        to = tuple(s for s in self._chain.below if s.tier.fits(tensor.nbytes, len(meta_bytes)))
        if not (to_top or to):
            self._count("not_stored")
            self._remove(key)  # replaced by nothing: the old value must not be served
            return
        self._count("puts")
        if block is None:
            block = self._blocking > 0
        demoter = self._demoter
        # room in the copy queue is waited for before any lock is taken: the demotion thread,
        # which makes room, takes them
        reserved = block and bool(to) and demoter is not None and demoter.reserve(wait=True)
        try:
            fence = self._copier.producer_fence()
            with self._lookup.order:  # every tier sees the puts and discards of a key in one order
                self._lookup.invalidate(key)
                if not (to_top and top.put(key, Entry(tensor, fence, meta=meta_bytes))):
                    top.discard(key)
                if demoter is not None:
                    if to:  # the host entry now, the lower tiers' values in order
                        used, reserved = reserved, False  # submit uses the room up either way
                        demoter.submit(key, tensor, fence, meta_bytes, to, reserved=used,
                                       block=block)
                    else:
                        demoter.cancel(key)
        finally:
            if reserved and demoter is not None:  # raised before the room was used
                demoter.unreserve()

    def get(self, key: bytes) -> torch.Tensor | None:
        """The features stored under ``key`` on the cache's device, bit-identical, or None.

        The tensor is ready for use on the caller's current CUDA stream. Do not modify it.
        """
        found = self._find(key, pin=False)
        return None if found is None else found.entry.tensor

    def get_or_compute(self, key: bytes, compute: Callable[[], torch.Tensor],
                       meta: bytes | None = None, *, namespace: str | None = None,
                       block: bool | None = None, cost_s: float | None = None) -> torch.Tensor:
        """The features under ``key`` (``get``), else ``compute()``'s, which are ``put`` (with
        ``meta``, ``namespace``, ``block`` and ``cost_s``: ``put``'s) and returned: the "get,
        else compute and put" pattern, with one computation per miss in this process. Callers
        that ask for a key while another computes it wait for that computation and return its
        result; if it raises, each of them raises that exception and nothing is stored (a later
        call computes again). A hit returns the tensor on the cache's device; a computed one is
        what ``compute`` returned.
        """
        found = self.get(key)
        if found is not None:
            return found

        def fill() -> torch.Tensor:
            # another caller's computation may have been put between our miss and our flight
            value = self.get(key) if key in self else None
            if value is None:
                value = compute()
                self.put(key, value, meta, namespace=namespace, block=block, cost_s=cost_s)
            return value

        return self._flights.run(key, fill)

    @contextlib.contextmanager
    def blocking_puts(self) -> Iterator[FeatureCache]:
        """``with cache.blocking_puts():`` -- meanwhile every ``put`` and ``get_or_compute`` that
        does not say ``block=``, from any thread, blocks as with ``block=True``: for a batch job
        whose puts are made by code it does not call itself (``featcache warm``: lmdeploy's engine
        puts through featcache's model hook). Contexts nest; outside them the default is back."""
        with self._blocking_lock:
            self._blocking += 1
        try:
            yield self
        finally:
            with self._blocking_lock:
                self._blocking -= 1

    def acquire(self, key: bytes) -> Lease | None:
        """Like ``get``, but the entry is pinned in the top tier until ``Lease.release()``;
        ``Lease.tier`` names the tier it was found in."""
        found = self._find(key, pin=True)
        if found is None:
            return None
        return Lease(self, key, found.entry, pinned=self._chain.top.capacity_bytes > 0,
                     tier=found.tier)

    def lease(self, key: bytes) -> Lease | NoLease:
        """``with cache.lease(key) as feats:`` -- feats is the tensor or None; pinned meanwhile."""
        return self.acquire(key) or NoLease()

    def __contains__(self, key: object) -> bool:
        """Whether any local tier (or the way down) holds ``key``; counts nothing, promotes
        nothing, and does not ask the remote tier (no network call: ``Rules.local``). A key
        ``put`` would refuse (not bytes, empty, too long) is not contained."""
        if not valid_key(key) or self._closed:
            return False
        assert isinstance(key, bytes)
        if not self._adopted():
            return False
        return self._lookup.holds(key)

    # -- the whole cache (python-diskcache's names: len, iterkeys as keys(), clear, check as verify)
    def __len__(self) -> int:
        """How many entries the persistent tier holds: the disk store (LMDB's count, so entries
        other processes put there count too), or without one the memory tiers (device and host,
        each key once). A put still on its way down counts once it lands (``flush()``)."""
        return self._chain.entries() if self._adopted() else 0

    def __bool__(self) -> bool:
        """Always True: a cache is an object, not a container (``if cache:`` with an empty cache
        would otherwise be False, since ``__len__`` is defined)."""
        return True

    def keys(self) -> Iterator[bytes]:
        """The keys of the persistent tier (the disk store: yours and other processes'), in byte
        order; without one, of the memory tiers (a snapshot taken at the first ``next``).

        From the disk the keys are read in chunks, each in a short read-only LMDB transaction,
        so a long iteration never holds writers back. While others write: no key is yielded
        twice, and every key stored for the whole iteration is yielded; a key put or deleted
        meanwhile may or may not be. A put still on its way down shows once it lands
        (``flush()``). Counts nothing, promotes nothing. Raises ``FeatCacheError`` if the store
        cannot be read.
        """
        self._check_open()
        return self._chain.keys()

    def clear(self) -> int:
        """Remove every entry from every local tier; return how many keys were removed (each
        once, whatever tiers held it).

        Pending writes are finished first (``flush``), and puts, discards and promotions wait
        until the clear is done: a put made after ``clear()`` returns is kept. The disk store is
        emptied in one transaction, other processes' entries included (as ``featcache purge
        --all``). A lease in flight stays valid: its entry leaves view at once (lookups miss)
        but stays in the device tier, counted in its budget, until released. The remote tier,
        shared by a fleet, is left as it is (``discard`` a key there, or use the server's tools).
        Raises ``FeatCacheError`` if the disk store cannot be written.
        """
        self._check_open()
        with self._lookup.order:  # no put, discard or promotion while clearing
            self.flush()
            self._lookup.invalidate_all()  # a read below in flight installs nothing
            return self._chain.clear()

    def verify(self, fix: bool = False,
               progress: Callable[[int, int], None] | None = None) -> VerifyReport:
        """Check every disk entry's header and checksum and the books that account for them:
        the report ``featcache verify`` prints (``bad`` entries, ``notes``), read in short read
        transactions; ``progress(entries, bytes)`` after each value. Only reads, unless ``fix``:
        then each bad entry still bad when deleted is deleted (``report.deleted``: how many).
        Bad entries are served as misses either way. Without a disk tier there is nothing to
        check (an empty report). Raises ``FeatCacheError`` if the store cannot be read.
        """
        self._check_open()
        return self._chain.verify(fix, progress)

    def discard(self, key: bytes) -> None:
        """Remove ``key`` from every tier (from the lower tiers asynchronously, in queue order).

        A put of ``key`` still on its way down is cancelled, or deleted after it lands: no tier
        serves the key afterwards, also after a reopen.
        """
        self._check_open()
        check_key(key)
        self._remove(key)

    def flush(self) -> None:
        """Wait until every pending copy and lower-tier write is done."""
        if not self._adopted():
            return
        if self._demoter is not None and not self._closed:
            self._demoter.flush()

    def count(self, section: str, event: str, n: int = 1) -> None:
        """Count an integration's event; it appears as ``stats()[section][event]``."""
        self._counts.event(section, event, n)

    def stats(self) -> dict[str, dict[str, int]]:
        """Per-tier counters and sizes (``device``, ``host``, ``disk``; ``remote`` when a remote
        tier is configured: docs/tuning.md), cache-wide ones (``cache``), and one section per
        integration that counted events (e.g. ``lmdeploy``)."""
        self._adopted()
        own, events = self._counts.snapshot()
        workers = [w for w in (self._demoter, *self._chain.writers) if w is not None]
        cache = {
            **own,
            "demote_queue": self._demoter.depth if self._demoter is not None else 0,
            **self._chain.queue_depths("cache"),
            "worker_errors": sum(w.errors for w in workers),
            "workers_alive": int(all(w.alive for w in workers)),
        }
        return {**self._chain.stats(), "cache": cache, **events}

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

    # -- helpers -------------------------------------------------------------------------------
    def _find(self, key: bytes, pin: bool) -> Found | None:
        """``get``'s and ``acquire``'s lookup: counted a hit or a miss, and a hit's tensor ready on
        the caller's current stream."""
        self._check_open()
        check_key(key)
        found = self._lookup.find(key, pin=pin)
        self._count("hits" if found is not None else "misses")
        if found is not None:
            self._copier.ready(found.entry.tensor, found.entry.fence)
        return found

    def _remove(self, key: bytes) -> None:
        """Drop ``key`` from the top tier and (through the demoter) from every tier below."""
        with self._lookup.order:
            self._lookup.invalidate(key)
            self._chain.top.discard(key)
            if self._demoter is not None:
                self._demoter.cancel(key)
