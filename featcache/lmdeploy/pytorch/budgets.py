"""The cache a serving process builds when none is given, its tier budgets sized from the machine:
``budgets="share"`` (the serving default for now: ``config.SERVING_BUDGETS``' fixed shares, each
capped) or ``"auto"`` (``featcache.autosize``: each tier from what is free, the device tier from
what lmdeploy's KV cache left). ``default_cache`` is re-exported by ``featcache.lmdeploy`` and is
what each model process of the multi-process mode builds (``ranks``).

With ``"auto"``, the device tier is decided after lmdeploy's engine reserved its KV cache, on
every path:

- ``featcache.lmdeploy.pipeline(cache=None)`` builds its cache once ``lmdeploy.pipeline`` has
  returned (engine built, KV cache allocated, warmed up) and passes the engine's config;
- each model process (lmdeploy's mp engine, tp > 1) builds its cache at its first image
  (``ranks.local_cache``), after its own engine's reservation;
- ``featcache serve`` with the engine in the server's process must hold its cache before the
  engine exists (its metrics and shutdown hold it from the start): it gets an
  ``EngineSizedCache``, which holds nothing until ``wrap`` installs it on the built engine and
  sizes it then.

Every cache built here records its ``Budgets`` (``chosen_budgets``), logs their line (INFO) and
hands it to ``announce``: ``featcache serve`` and the model processes print it when they start.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Callable
from typing import Any

from ... import autosize
from ...autosize import Budgets, Choice, EngineMemory
from ...config import BUDGETS, SERVING_BUDGETS, SERVING_BUDGETS_DEFAULT, CacheConfig, default_store_dir
from ...core.cache import FeatureCache
from ...sizes import format_bytes

log = logging.getLogger("featcache")

Announce = Callable[[str], None]

_CHOSEN: weakref.WeakKeyDictionary[FeatureCache, Budgets] = weakref.WeakKeyDictionary()


def chosen_budgets(cache: FeatureCache) -> Budgets | None:
    """The budgets ``default_cache`` chose for ``cache``, with their reasons (None: a cache not
    built here, or an ``EngineSizedCache`` not sized yet)."""
    return _CHOSEN.get(cache)


def check_budgets(budgets: str | None) -> str:
    """``budgets`` (None: the serving default), checked: one of ``config.BUDGETS``."""
    mode = SERVING_BUDGETS_DEFAULT if budgets is None else budgets
    if mode not in BUDGETS:
        raise ValueError(f"budgets must be one of {', '.join(BUDGETS)} (None: "
                         f"{SERVING_BUDGETS_DEFAULT}), not {budgets!r}")
    return mode


def default_cache(*, path: str | None = None, device_bytes: int | None = None,
                  host_bytes: int | None = None, disk_bytes: int | None = None,
                  host_only: bool = False, remote_url: str | None = None,
                  disk_writes: bool = True, key_algorithm: str | None = None,
                  key_secret_file: str | None = None, budgets: str | None = None,
                  eviction: str | None = None, engine: Any = None, before_engine: bool = False,
                  announce: Announce | None = None) -> FeatureCache:
    """The cache ``pipeline(cache=None)`` builds; each argument overrides one default.

    Each tier budget not given is sized from the machine by ``budgets``: "share" (None, for
    now) a share of the GPU's free memory, of RAM and of the free space at the store
    (``config.SERVING_BUDGETS``), "auto" what ``featcache.autosize`` decides (docs/tuning.md).
    ``engine``: the config of the lmdeploy engine built before this call, whose KV cache took its
    memory (None: none known). ``before_engine`` (with "auto"): the engine that will run in this
    process is not built yet, so the cache returned is an ``EngineSizedCache`` that ``wrap``
    sizes once it is. ``announce`` is called with the budgets' line (what each tier got and why)
    once they are decided. The store is at ``path``, else ``$FEATCACHE_DIR``, else
    ``~/.cache/featcache`` (created, mode 0700). ``host_only=True`` (TurboMind, which takes host
    tensors): the device tier is on the CPU, sized as the host tier would be, and there is no
    separate host tier. ``remote_url``: a shared remote tier (Redis or Valkey, docs/tuning.md),
    off by default. ``disk_writes=False``: the store is read, never written (tp ranks > 0: rank 0
    writes the features every rank computed). ``key_algorithm`` and ``key_secret_file``: how
    keys are made (``featcache.keysecret``; None: the defaults). ``eviction``: what the device
    and host tiers evict, one of ``config.EVICTIONS`` (None: the config's default).
    """
    mode = check_budgets(budgets)
    path = path or default_store_dir()
    os.makedirs(path, mode=0o700, exist_ok=True)
    given = {"device_bytes": device_bytes, "host_bytes": host_bytes, "disk_bytes": disk_bytes}
    rest: dict[str, Any] = {"remote_url": remote_url, "disk_writes": disk_writes}
    rest.update((k, v) for k, v in (("key_algorithm", key_algorithm),
                                    ("key_secret_file", key_secret_file),
                                    ("eviction", eviction)) if v is not None)
    if mode == "auto" and before_engine and not host_only and autosize.cuda_available():
        return EngineSizedCache(path, given, rest, announce)
    memory = EngineMemory.of(engine) if engine is not None else None
    chosen = choose(mode, path, given, host_only=host_only, engine=memory)
    cache = FeatureCache(device="cpu" if chosen.device == "cpu" else None, disk_path=path,
                         **chosen.sizes(), **rest)
    _record(cache, chosen, announce)
    return cache


def choose(mode: str, path: str, given: dict[str, int | None], *, host_only: bool = False,
           engine: EngineMemory | None = None) -> Budgets:
    """The budgets of a serving cache with its store at ``path`` (``default_cache``'s)."""
    device = autosize.current_gpu() if autosize.cuda_available() and not host_only else "cpu"
    if mode == "auto":
        return autosize.decide(device=device, disk_path=path, given=given, engine=engine,
                      cpu_why="TurboMind takes host tensors" if host_only else None)
    return _share(device, path, given, host_only)


def _share(device: str, path: str, given: dict[str, int | None], host_only: bool) -> Budgets:
    """``config.SERVING_BUDGETS``' shares: of the free GPU memory, of RAM, of the free space."""

    def sized(tier: str, amount: int, what: str) -> Choice:
        value = given[f"{tier}_bytes"]
        if value is not None:
            return Choice(tier, value, "given")
        rule = SERVING_BUDGETS[f"{tier}_bytes"]
        return Choice(tier, rule.bytes_from(amount), f"{rule} ({format_bytes(amount)} {what})")

    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    host = sized("host", ram, "of RAM")
    if host_only:
        tiers = (Choice("device", host.nbytes, f"on the CPU (TurboMind takes host tensors): "
                        f"the host tier's share, {host.reason}"),
                 Choice("host", 0, "the device tier is in RAM"))
    elif device == "cpu":
        tiers = (Choice("device", given["device_bytes"] or 0,
                        "given" if given["device_bytes"] is not None else
                        "no CUDA (the host tier holds the features)"), host)
    else:
        tiers = (sized("device", autosize.gpu_memory(device)[0], f"free on {device}"), host)
    st = os.statvfs(path)
    disk = sized("disk", st.f_bavail * st.f_frsize, f"free at {path}")
    return Budgets("share", device, (*tiers, disk))


def _record(cache: FeatureCache, chosen: Budgets, announce: Announce | None) -> None:
    _CHOSEN[cache] = chosen
    log.info("featcache: %s", chosen.line())
    if announce is not None:
        announce(chosen.line())


class EngineSizedCache(FeatureCache):
    """A serving cache built before the lmdeploy engine that will run in its process, with
    ``budgets="auto"``: the server's metrics and shutdown hold it from the start, but its device
    tier can only be sized from what the engine's KV cache leaves. Until ``size_after`` it holds
    nothing (no tier has a budget, as ``featcache.lmdeploy.counters_cache``); ``wrap`` calls
    ``size_after`` with the engine it installs it on, before any request, and the same object is
    then rebuilt with the budgets decided (its settings were checked at construction)."""

    def __init__(self, path: str, given: dict[str, int | None], rest: dict[str, Any],
                 announce: Announce | None) -> None:
        CacheConfig.create("cpu", 0, 0, path, given["disk_bytes"], **rest)  # bad settings: now
        super().__init__(device="cpu", device_bytes=0, host_bytes=0)
        self._pending: tuple[str, dict[str, int | None], dict[str, Any], Announce | None] | None = (
            path, given, rest, announce)

    @property
    def sized(self) -> bool:
        return self._pending is None

    def size_after(self, engine_config: Any) -> Budgets:
        """Decide the budgets now that the engine (``engine_config``'s) reserved its KV cache, and
        rebuild this cache with them. Once: a later call returns the budgets decided."""
        if self._pending is None:
            chosen = chosen_budgets(self)
            assert chosen is not None
            return chosen
        path, given, rest, announce = self._pending
        chosen = choose("auto", path, given, engine=EngineMemory.of(engine_config))
        self.close()  # the placeholder: no tier, no thread that holds anything
        FeatureCache.__init__(self, None, disk_path=path, **chosen.sizes(), **rest)
        self._pending = None
        _record(self, chosen, announce)
        return chosen

    def __repr__(self) -> str:
        return "EngineSizedCache(not sized yet)" if self._pending else super().__repr__()
