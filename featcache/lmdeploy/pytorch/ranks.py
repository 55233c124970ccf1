"""The model side of the multi-process mode: one cache per process that runs the model, and the
ranks' agreement on which images it serves.

In the multi-process mode (lmdeploy's mp engine, tp > 1; docs/design.md "Several processes") the
images reach the model with their pixels and a ``FeatTag`` each. Every process that runs the
model (the mp-engine child at tp=1; each rank at tp > 1) keeps its own ``FeatureCache``: its own
device tier, a host tier, and the shared disk store (one LMDB directory for all of them). Per
prefill step that holds tagged images, the model hook (``models``) asks ``resolve``:

1. each tagged image is looked up in this process's cache (``acquire``: the entry is leased for
   the step; a host or disk hit is promoted);
2. with tp > 1, one ``all_reduce(MIN)`` of the per-image availability over the tensor-parallel
   group's CPU (gloo) group: an image counts as a hit only if *every* rank holds it. The vision
   tower is sharded across the ranks with collectives inside it, so every rank must make the
   same vision call or NCCL hangs;
3. the images some rank lacks are recomputed from their pixels (every rank runs the same vision
   call) and stored in every rank's cache; the rest are served from the step's leases. An image
   the frontend sent without pixels (a ``FeatTag`` with a ``source``) that some rank lacks has
   its pixels rebuilt first, on every rank (``rebuild``, called by ``models``).

Invariants:
- whether the all_reduce is issued depends only on the step's inputs (identical on every rank):
  it is issued exactly when the step holds a tagged image; nothing raised in featcache before it
  can skip it (a failing lookup is a miss);
- the worst case is a recompute: an image is served from a cache only if every rank has it;
- a step's leases live as long as its refs (the step's plan): nothing a step serves is evicted
  under it.

Counters: each process counts in its own cache's ``lmdeploy`` section (``vision_calls``,
``vision_images``, ``vision_skipped``, ``agreed_misses``: images this rank held but another did
not). ``stats()`` returns them with the process's rank; each process answers for them on a
socket of its own (``rankstats``) and ``processes.engine_stats`` gathers them. Every rank runs the same
vision calls, so "vision once per distinct image" holds when each rank's ``vision_images`` equals
the number of distinct images.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import sys
import threading
from collections.abc import Sequence
from typing import Any

import torch

from ...core.cache import FeatureCache
from ..request.frontend import SECTION
from ..request.refs import FeatRef
from ..request.tags import FeatTag
from .budgets import default_cache

log = logging.getLogger("featcache")

_lock = threading.Lock()
_state: dict[str, Any] = {"installed": False, "settings": None, "cache": None, "failed": False,
                          "group": None, "group_set": False}


def configure(settings_json: str | None) -> None:
    """Make this process serve tagged images with a cache of these settings, built on first use
    (``processes.install_in_rank`` calls it, then patches the model classes; idempotent).

    ``settings_json``: the JSON of ``processes.FeatcacheEngineConfig.featcache_cache``:
    ``{"feature_cache": FeatureCache kwargs}``, ``{"default_cache": default_cache() kwargs}``, or
    null for ``default_cache()``; the device is this process's current GPU."""
    with _lock:
        _state["settings"] = json.loads(settings_json) if settings_json else None
        _state["installed"] = True


def rebuild_settings() -> dict[str, Any]:
    """What ``rebuild`` needs to make an image's pixels in this process (the engine's model path,
    dtype, device type, trust_remote_code): the settings' ``rebuild`` entry."""
    return dict((_state["settings"] or {}).get("rebuild") or {})


def installed() -> bool:
    return bool(_state["installed"])


def local_cache() -> FeatureCache | None:
    """This process's cache, built on first use (after lmdeploy took its KV cache memory, as
    ``featcache.lmdeploy.pipeline`` builds its own); None where the rank hook is not installed
    or the cache cannot be built (logged once: every image is then computed, never refused)."""
    cache = _state["cache"]
    if cache is not None or _state["failed"] or not _state["installed"]:
        return cache
    with _lock:
        if _state["cache"] is None and not _state["failed"]:
            try:
                _state["cache"] = _build(_state["settings"])
                atexit.register(_close_at_exit)  # before the cache's own finalizer (LIFO)
            except Exception:
                _state["failed"] = True
                log.exception("featcache: this model process has no cache; its images are "
                              "computed every time")
        return _state["cache"]


def _close_at_exit() -> None:
    """This model process's last line on its cache's disk writes (``shutdown.close_reporting``)."""
    cache = _state["cache"]
    if cache is not None:
        from ...server.shutdown import close_reporting

        try:
            who = f"featcache (model process, rank {rank()})"
        except Exception:  # noqa: BLE001
            who = "featcache (model process)"
        print(close_reporting(cache, who), file=sys.stderr, flush=True)


def _build(settings: dict[str, Any] | None) -> FeatureCache:
    """Every rank reads the shared store; only rank 0 writes it (every rank computes the same
    features, so one writer stores them all; where the rank cannot be told, every rank writes:
    correct, only more writes)."""
    try:
        writes = rank() == 0
    except Exception:
        writes = True
    if settings is not None and "feature_cache" in settings:
        kwargs = dict(settings["feature_cache"])
        kwargs["disk_writes"] = writes and kwargs.get("disk_writes", True)
        return FeatureCache(**kwargs)
    # built at the first image: the engine has reserved its KV cache (its config, "engine")
    return default_cache(**(settings or {}).get("default_cache", {}), disk_writes=writes,
                         engine=(settings or {}).get("engine"), announce=_announce)


def _announce(line: str) -> None:
    """This model process's start-up line on its budgets (what each tier got and why)."""
    try:
        who = f"featcache (model process, rank {rank()})"
    except Exception:  # noqa: BLE001
        who = "featcache (model process)"
    print(f"{who}: {line}", file=sys.stderr, flush=True)


def use_group(group: Any) -> None:
    """The process group the ranks agree over (``None``: one rank, no agreement). Default: the
    CPU group of lmdeploy's tensor-parallel group when tp > 1."""
    _state["group"] = group
    _state["group_set"] = True


def agreement_group() -> Any:
    if _state["group_set"]:
        return _state["group"]
    try:
        from lmdeploy.pytorch.distributed import get_tp_group, get_tp_world_rank

        tp, _ = get_tp_world_rank()
        group = get_tp_group("cpu") if tp > 1 else None
    except Exception:  # no lmdeploy dist context: one process (uni executor)
        group = None
    _state["group"] = group
    _state["group_set"] = True
    return group


def rank() -> int:
    group = agreement_group()
    if group is None:
        return 0
    import torch.distributed as dist

    return int(dist.get_rank(group))


def agree(available: list[bool], group: Any) -> list[bool]:
    """Per image, whether every rank of ``group`` has it (``all_reduce(MIN)``); ``group`` None:
    ``available`` itself. A failing collective makes every image a miss on this rank (the
    others see the same failure)."""
    if group is None or not available:
        return list(available)
    import torch.distributed as dist

    flags = torch.tensor([int(a) for a in available], dtype=torch.int32)
    try:
        dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=group)
    except Exception:
        log.exception("featcache: the ranks' agreement failed; this step's images are computed")
        return [False] * len(available)
    return [bool(x) for x in flags.tolist()]


def resolve(tags: Sequence[FeatTag | None], with_pixels: Sequence[bool]) -> list[FeatRef | None]:
    """The step's refs for its tagged images (None where an image has no usable tag): a hit
    (leased for the step) where every rank holds the image, else a miss whose features the model
    stores. Issues the agreement collective whenever ``tags`` holds a tag (valid or not)."""
    cache = local_cache()
    leases: list[Any] = []
    for tag, pixels in zip(tags, with_pixels, strict=True):
        lease = None
        if cache is not None and tag is not None and tag.valid and (pixels or tag.source):
            try:
                lease = cache.acquire(tag.key)
            except Exception:
                log.debug("featcache: lookup failed; a miss", exc_info=True)
        leases.append(lease)
    agreed = agree([lease is not None for lease in leases], agreement_group())
    refs: list[FeatRef | None] = []
    for tag, lease, ok in zip(tags, leases, agreed, strict=True):
        if lease is not None and not ok:
            lease.release()
            lease = None
            assert cache is not None
            cache.count(SECTION, "agreed_misses")
        if cache is None or tag is None or not tag.valid:
            refs.append(None)
        else:
            refs.append(FeatRef(cache, tag.key, tag.meta, lease))
    return refs


def stats() -> dict[str, Any]:
    """This process's counters (its cache's ``stats()``), with its rank and pid."""
    cache = _state["cache"]
    return {"rank": rank(), "pid": os.getpid(), "stats": cache.stats() if cache is not None else {}}


def reset_for_tests() -> None:
    """Forget this process's cache and settings (tests only; the cache is closed)."""
    with _lock:
        cache = _state["cache"]
        _state.update(installed=False, settings=None, cache=None, failed=False, group=None,
                      group_set=False)
    if cache is not None:
        cache.close()
