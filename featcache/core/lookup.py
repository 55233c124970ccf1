"""Reading through the chain: lookups, the promotion of what they find below the top tier, and
the per-key generations that keep a promotion from undoing a newer put or a discard.

A lookup tries the top tier, then the demoter's in-flight map (entries put and not yet copied
down), then each tier below in chain order: first what its writer still has queued for the key
(a put not yet written is served; a queued delete means the tier's value is stale, so the tier is
skipped), then the tier itself. A hit below the top is copied to the device (``Copier.to_device``,
on the caller's stream) and installed in the top tier; a value a tier copies out (disk, remote)
lands in a host block (``alloc``) and is kept in the staging (host) tier as well.

Each lookup says where it found the entry (``Found.tier``): the top tier's name, that name too
for an entry still on its way down (a device tensor), "host" for a write a lower tier's writer
still queues (its bytes in a host block), else the name of the tier it was read from.

Generations: a lookup that misses the top tier records the key's generation; every put and
discard of the key bumps it (``invalidate``, under ``order``, before touching any tier). A value
read below is installed above (``_install``, also under ``order``) only if the generation is
unchanged: then no put or discard of the key began since the read, and any that begins later
replaces what is installed. A lookup that lost the race still returns what it read, but no later
lookup sees it (counted: ``stale_promotions``). Generations exist only while a lookup of the key
is in flight.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import NamedTuple

import torch

from ..tiers.base import Entry
from .chain import Chain, Slot
from .copier import Copier, as_bytes, owned_empty
from .demoter import Demoter
from .hostpool import Block


class Found(NamedTuple):
    """A lookup's entry (device-resident) and the name of the tier it was found in."""

    entry: Entry
    tier: str


QUEUED = "host"  # where a write a lower tier's writer still queues is found: its host block


class Lookup:
    """The read path of one build of a cache. ``order`` is the cache's lock for puts, discards
    and installs (one at a time); ``count`` counts the cache's events (``inflight_hits``,
    ``promotions``, ``stale_promotions``)."""

    def __init__(
        self, chain: Chain, demoter: Demoter | None, copier: Copier, count: Callable[[str], None],
    ) -> None:
        self.order = threading.Lock()
        self._chain = chain
        self._demoter = demoter
        self._copier = copier
        self._count = count
        self._reads: dict[bytes, list[int]] = {}  # key -> [generation, lookups in flight]

    def find(self, key: bytes, pin: bool) -> Found | None:
        """The device-resident entry for ``key`` (promoted if it was lower) and where it was
        found, or None; with ``pin``, pinned in the top tier (a lease) whether or not it was
        installed there."""
        top = self._chain.top
        if top.capacity_bytes > 0:
            entry = top.get(key, pin=pin)
            if entry is not None:
                return Found(entry, top.name)
        generation = self._begin(key)
        try:
            return self._below(key, pin, generation)
        finally:
            self._end(key)

    def holds(self, key: bytes) -> bool:
        """Whether a local tier (or the way down) holds ``key``; counts and promotes nothing, and
        skips the tiers that are not local (``Rules.local``: no network call)."""
        if self._chain.top.contains(key) or (
                self._demoter is not None and self._demoter.pending(key) is not None):
            return True
        for slot in self._chain.below:
            if not slot.rules.local:
                continue
            if slot.writer is not None:
                queued, pending = slot.writer.pending(key)
                if pending is not None:
                    self.release(pending)
                    return True
                if queued:
                    continue  # a delete is queued: what the tier holds is stale
            if slot.tier.contains(key):
                return True
        return False

    def invalidate(self, key: bytes) -> None:
        """A put or a discard of ``key`` begins (the caller holds ``order``)."""
        books = self._reads.get(key)
        if books is not None:
            books[0] += 1

    def invalidate_all(self) -> None:
        """Every key changes (``clear``; the caller holds ``order``): no read in flight installs."""
        for books in self._reads.values():
            books[0] += 1

    def release(self, entry: Entry) -> None:
        """Give back the block reference an entry from below came with, if any."""
        if entry.block is not None:
            self._release([entry.block])

    # -- below the top -------------------------------------------------------------------------
    def _below(self, key: bytes, pin: bool, generation: int) -> Found | None:
        if self._demoter is not None:
            entry = self._demoter.pending(key)
            if entry is not None:
                self._count("inflight_hits")
                self._install(key, generation, device=entry, pin=pin)
                return Found(entry, self._chain.top.name)
        for slot in self._chain.below:
            if slot.writer is not None:
                queued, pending = slot.writer.pending(key)  # its block, if any, comes retained
                if pending is not None:
                    self._count("inflight_hits")
                    return Found(self._promote(key, pending, pin, generation), QUEUED)
                if queued:
                    continue  # a delete is queued: what the tier holds must not be served
            entry = self._read(slot, key, pin, generation)
            if entry is not None:
                return Found(entry, slot.tier.name)
        return None

    def _read(self, slot: Slot, key: bytes, pin: bool, generation: int) -> Entry | None:
        """Read ``key`` from ``slot``'s tier and promote it. The host tier hands out its entry
        with its block retained; a tier that copies its value out verifies it into ``alloc``'s
        host block (kept in the host tier; a staging buffer without one)."""
        staging = self._chain.staging
        blocks: list[Block] = []

        def alloc(nbytes: int) -> torch.Tensor:
            block = staging.reserve(nbytes) if staging is not None else None
            if block is None:
                return owned_empty(nbytes, torch.device("cpu"), pin=self._copier.pin)
            blocks.append(block)
            return block.tensor

        try:
            entry = slot.tier.get(key, alloc)
        except BaseException:
            self._release(blocks)
            raise
        if entry is None:
            self._release(blocks)  # alloc ran but the read failed afterwards
            return None
        if slot.rules.touch and slot.writer is not None:
            slot.writer.touch(key)
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
            self.release(entry)
        self._count("promotions")
        promoted = Entry(tensor, done, meta=entry.meta)
        self._install(key, generation, device=promoted, pin=pin)
        return promoted

    def _install(
        self, key: bytes, generation: int, *, device: Entry | None = None, pin: bool = False,
        host: Entry | None = None,
    ) -> None:
        """Install a value read from below into the top tier (``device``) or the staging tier
        (``host``, whose block reference the tier takes over), unless the key changed since
        the read began. A lease's pin is taken either way (``Lease.release`` undoes it)."""
        top, staging = self._chain.top, self._chain.staging
        with self.order:
            fresh = self._reads[key][0] == generation
            if host is not None:
                assert staging is not None and host.block is not None
                if fresh:
                    staging.pool.retain(host.block)  # one reference for the tier
                    staging.put(key, host)
            if device is not None and top.capacity_bytes > 0:
                if fresh:
                    top.put(key, device, pin=pin)
                elif pin:
                    top.pin(key)
            if not fresh:
                self._count("stale_promotions")

    # -- generations ---------------------------------------------------------------------------
    def _begin(self, key: bytes) -> int:
        with self.order:
            books = self._reads.setdefault(key, [0, 0])
            books[1] += 1
            return books[0]

    def _end(self, key: bytes) -> None:
        with self.order:
            books = self._reads[key]
            books[1] -= 1
            if not books[1]:
                del self._reads[key]

    def _release(self, blocks: list[Block]) -> None:
        staging = self._chain.staging
        for block in blocks:
            assert staging is not None
            staging.release(block)
