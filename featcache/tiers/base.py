"""What every tier offers, and the entry they hold."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ..hostpool import Block

STAT_FIELDS = ("hits", "misses", "evictions", "drops", "corrupt", "errors")


@dataclass(eq=False)
class Entry:
    """A stored tensor (with its metadata bytes) and the fence its bytes are ready after.

    ``fence`` is a ``torch.cuda.Event`` recorded after the work that produced ``tensor`` (the
    producer's stream for the device tier, the copy stream for the host tier), or None when the
    bytes are ready now. ``block`` is the host-pool block behind ``tensor`` (host tier only).
    ``frame``, when set, is the disk value's buffer: ``tensor``'s bytes preceded by room for the
    header and metadata, so the disk writer writes it without copying the payload.
    """

    tensor: torch.Tensor
    fence: Any = None
    block: Block | None = None
    meta: bytes = b""  # the caller's small metadata record, stored and served with the tensor
    frame: torch.Tensor | None = None  # uint8: room for header + meta, then ``tensor``'s bytes

    @property
    def nbytes(self) -> int:
        return self.tensor.nbytes


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
    """A synchronous store of entries with a byte budget. ``get``/``put`` count hits/misses."""

    name: str
    capacity_bytes: int

    @property
    def used_bytes(self) -> int: ...

    def contains(self, key: bytes) -> bool: ...

    def get(self, key: bytes) -> Entry | None: ...

    def put(self, key: bytes, entry: Entry) -> bool: ...

    def discard(self, key: bytes) -> bool: ...

    def stats(self) -> dict[str, int]: ...

    def close(self) -> None: ...


def empty_stats(capacity_bytes: int = 0) -> dict[str, int]:
    """Stats of a disabled tier: present, at zero."""
    return {**Counters().as_dict(), "entries": 0, "bytes": 0, "capacity_bytes": capacity_bytes}
