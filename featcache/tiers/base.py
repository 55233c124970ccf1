"""What every tier offers (``Tier``), the entry they hold, and the writes handed to lower tiers.

The protocols, by role in the chain (``featcache.core.chain``):
- ``Tier``: every tier. Synchronous; ``get`` counts hits and misses; ``fits`` says whether
  an entry could be stored at all (its budget, its format's limits);
- ``LeasingTier``: the top tier, which lends entries to requests (``pin``/``unpin``: a pinned
  entry is never evicted);
- ``StagingTier``: host memory in blocks, where copies between the device and the tiers below
  are made (``reserve`` a block, ``put`` it, ``release`` a reference);
- ``WrittenTier``: a tier below the host, written in the background by its ``TierWriter``
  (``write``: a batch of puts, discards and touches, applied in order);
- ``PersistentTier``: the written tier that outlives the process (the disk): what ``len(cache)``,
  ``cache.keys()``, ``clear()`` and ``verify()`` read and change.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch

from .. import codec
from ..core.copier import as_bytes
from ..core.hostpool import Block, HostPool
from ..store.report import VerifyReport

STAT_FIELDS = ("hits", "misses", "evictions", "drops", "corrupt", "errors")

# Where a tier that copies a value out puts its bytes: ``alloc(n)`` returns a uint8 CPU tensor of
# at least ``n`` bytes (a staging block, or a fresh buffer).
Alloc = Callable[[int], torch.Tensor]


@dataclass(eq=False)
class Entry:
    """A stored tensor (with its metadata bytes) and the fence its bytes are ready after.

    ``fence`` is a ``torch.cuda.Event`` recorded after the work that produced ``tensor`` (the
    producer's stream for the device tier, the copy stream for the host tier), or None when the
    bytes are ready now. ``block`` is the host-pool block behind ``tensor`` (host entries only).
    ``frame``, when set, is the stored value's buffer: ``tensor``'s bytes preceded by room for the
    header and metadata, so the value is written without copying the payload (``value_of``).
    """

    tensor: torch.Tensor
    fence: Any = None
    block: Block | None = None
    meta: bytes = b""  # the caller's small metadata record, stored and served with the tensor
    frame: torch.Tensor | None = None  # uint8: room for header + meta, then ``tensor``'s bytes

    @property
    def nbytes(self) -> int:
        return self.tensor.nbytes


def value_of(entry: Entry) -> memoryview | bytes:
    """The stored value (``codec``) of a host entry whose bytes are ready: written in place into
    its frame when it has one (no payload copy), else encoded into new bytes."""
    tensor = entry.tensor
    if entry.frame is None:
        data = as_bytes(tensor).numpy().data
        return codec.encode(tensor.dtype, tuple(tensor.shape), data, entry.meta)
    frame = entry.frame.numpy().data
    codec.encode_in_place(frame, tensor.dtype, tuple(tensor.shape), entry.meta)
    return frame


@dataclass(frozen=True, eq=False)
class Op:
    """One write to a lower tier, applied in queue order: a ``put`` of a host entry (its bytes
    ready), a ``discard``, or a ``touch`` (a use: recency only)."""

    kind: Literal["put", "discard", "touch"]
    key: bytes
    entry: Entry | None = None  # for a put


@dataclass
class Counters:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    drops: int = 0
    corrupt: int = 0
    errors: int = 0
    extra: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, int]:
        return {**{name: getattr(self, name) for name in STAT_FIELDS}, **self.extra}


class Tier(Protocol):
    """A synchronous store of entries with a byte budget; ``get`` counts hits and misses.

    ``get(key, alloc)``: the entry or None (a miss: absent, or unreadable, or corrupt). A tier
    that copies the value out (disk, remote) puts its bytes into ``alloc(n)``; one that holds
    entries in memory ignores ``alloc``. ``count_drops``: writes headed for the tier that were
    dropped before reaching it (a full queue, a failed copy), counted in its stats.
    """

    name: str
    capacity_bytes: int

    @property
    def used_bytes(self) -> int: ...

    def fits(self, nbytes: int, meta_bytes: int = 0) -> bool: ...

    def contains(self, key: bytes) -> bool: ...

    def get(self, key: bytes, alloc: Alloc | None = None) -> Entry | None: ...

    def put(self, key: bytes, entry: Entry) -> bool: ...

    def discard(self, key: bytes) -> bool: ...

    def count_drops(self, n: int = 1) -> None: ...

    def stats(self) -> dict[str, int]: ...

    def close(self) -> None: ...


class LeasingTier(Tier, Protocol):
    """The top tier: a hit or a put may pin its key (a lease) in the same step; a pinned key is
    never evicted until every pin is undone (``unpin``)."""

    def get(self, key: bytes, alloc: Alloc | None = None, *, pin: bool = False) -> Entry | None: ...

    def put(self, key: bytes, entry: Entry, *, pin: bool = False) -> bool: ...

    def pin(self, key: bytes) -> None: ...

    def unpin(self, key: bytes) -> None: ...

    def keys(self) -> list[bytes]: ...

    def clear(self) -> list[bytes]: ...


class StagingTier(Tier, Protocol):
    """Host memory in pool blocks: ``reserve`` a block to fill (evicting for room), ``put`` an
    entry living in it (the tier takes over the reference), ``release`` a reference taken by
    ``get`` or ``reserve``."""

    pool: HostPool

    def reserve(self, nbytes: int) -> Block | None: ...

    def release(self, block: Block) -> None: ...

    def keys(self) -> list[bytes]: ...

    def clear(self) -> list[bytes]: ...


class WrittenTier(Tier, Protocol):
    """A tier written in the background by its ``TierWriter``: ``write`` applies ``ops`` in
    order, each put's bytes ready (in one transaction where the tier has them). Failures of the
    tier's own storage are the tier's to count and contain (a drop, an error); an exception out of
    ``write`` means that nothing of the batch is known to have landed."""

    def write(self, ops: Sequence[Op]) -> None: ...


class PersistentTier(WrittenTier, Protocol):
    """The written tier that outlives the process (``Rules.persistent``): its entries can be
    counted, listed (in short read transactions), checked and cleared by the caller's thread.
    ``clear`` and ``delete_bad`` write in the caller's thread (the store serialises them with its
    writer's transactions); ``delete_bad`` deletes a key only if its entry is still bad then."""

    def entries(self) -> int: ...

    def keys(self) -> Iterator[bytes]: ...

    def verify(self, progress: Callable[[int, int], None] | None = None) -> VerifyReport: ...

    def delete_bad(self, keys: Sequence[bytes]) -> int: ...

    def clear(self) -> int: ...


def empty_stats(capacity_bytes: int = 0) -> dict[str, int]:
    """Stats of a disabled tier: present, at zero."""
    return {**Counters().as_dict(), "entries": 0, "bytes": 0, "capacity_bytes": capacity_bytes}
