"""What travels with an image from the frontend to the model: its key, its metadata (bytes in
``entry_meta``'s format), its lease.

A ``FeatRef`` rides in the per-image dict the frontend builds, and from there in the engine's
``MultiModalData.meta``, for the whole life of the sequence (lmdeploy keeps every image of a
sequence in its history: preemption and chunked prefill may send it to the model again).

Invariant: a hit's lease is held as long as its ``FeatRef`` lives, so its features cannot be evicted
while any request that was promised them is in flight; the lease is released when the last
reference to the ``FeatRef`` goes (the request finished, failed or was aborted).

A ``FeatRef`` never leaves its process (its cache, lease and device tensors are this process's):
pickling one raises a ``TypeError`` that names the cause, the one-process mode used where the
model runs elsewhere (``featcache.lmdeploy.multi_process`` decides; a process boundary it does not
know of would otherwise fail inside lmdeploy with "cannot pickle 'Stream' object").
"""

from __future__ import annotations

import weakref

from ...core.cache import FeatureCache, Lease

REF_KEY = "featcache"  # the per-image dict / MultiModalData.meta key holding the FeatRef


class FeatRef:
    """``lease`` is a hit's (None: a miss, whose features the model hook computes and puts);
    ``cost_s`` is what the model hook measured of a miss's vision call (``visioncost``; None
    before it ran, or where the time is not known yet), read by a request's report (``report``)."""

    __slots__ = ("__weakref__", "cache", "cost_s", "key", "lease", "meta")

    def __init__(self, cache: FeatureCache, key: bytes, meta: bytes, lease: Lease | None) -> None:
        self.cache = cache
        self.key = key
        self.meta = meta
        self.lease = lease
        self.cost_s: float | None = None
        if lease is not None:
            weakref.finalize(self, lease.release)

    @property
    def hit(self) -> bool:
        return self.lease is not None

    def __repr__(self) -> str:
        return f"FeatRef({self.key.hex()}, {'hit' if self.hit else 'miss'})"

    def __copy__(self) -> FeatRef:
        return self  # one lease, however many copies of the request hold it

    def __deepcopy__(self, memo: dict[int, object]) -> FeatRef:
        return self

    def __reduce__(self) -> tuple[object, ...]:
        raise TypeError(
            "featcache: a FeatRef (one-process mode) was about to cross a process boundary: this "
            "engine runs the model in another process, which featcache.lmdeploy.multi_process "
            "did not foresee; build the pipeline with featcache.lmdeploy.pipeline() and an engine "
            "config that says so (enable_mp_engine, tp, distributed_executor_backend)")
