"""A tensor lent by the cache: its top-tier entry is pinned (never evicted) until released."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..tiers.base import Entry

if TYPE_CHECKING:
    from .cache import FeatureCache


class Lease:
    """A tensor lent by the cache; its top-tier entry stays resident until ``release``.

    ``tensor`` is ready on the acquiring thread's current stream; a user on another stream calls
    ``ready()`` there first. ``meta`` is the metadata stored with the entry (b"" if none).
    ``tier`` is the name of the tier the lookup found it in (``lookup.Found``): "device" (no
    copy), or "host", "disk" or "remote" (read there and copied to the device by this lookup).
    """

    def __init__(self, cache: FeatureCache, key: bytes, entry: Entry, pinned: bool,
                 tier: str = "device") -> None:
        self.key = key
        self.tier = tier
        self.tensor = entry.tensor
        self.meta = entry.meta
        self._fence = entry.fence
        self._cache = cache
        self._tier = cache._chain.top  # the tier it pinned (a forked child's cache has a new one)
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


class NoLease:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
