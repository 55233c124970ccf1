"""What travels with an image from the frontend to the model: its key, its metadata (bytes in
``entry_meta``'s format), its lease.

A ``FeatRef`` rides in the per-image dict the frontend builds, and from there in the engine's
``MultiModalData.meta``, for the whole life of the sequence (lmdeploy keeps every image of a
sequence in its history: preemption and chunked prefill may send it to the model again).

Invariant: a hit's lease is held as long as its ``FeatRef`` lives, so its features cannot be evicted
while any request that was promised them is in flight; the lease is released when the last
reference to the ``FeatRef`` goes (the request finished, failed or was aborted).
"""

from __future__ import annotations

import weakref

from ..cache import FeatureCache, Lease

REF_KEY = "featcache"  # the per-image dict / MultiModalData.meta key holding the FeatRef


class FeatRef:
    __slots__ = ("__weakref__", "cache", "key", "lease", "meta")

    def __init__(self, cache: FeatureCache, key: bytes, meta: bytes, lease: Lease | None) -> None:
        self.cache = cache
        self.key = key
        self.meta = meta
        self.lease = lease
        if lease is not None:
            weakref.finalize(self, lease.release)

    @property
    def hit(self) -> bool:
        return self.lease is not None

    def __repr__(self) -> str:
        return f"FeatRef({self.key.hex()}, {'hit' if self.hit else 'miss'})"
