"""The cache a serving process builds when none is given: tier budgets sized from the machine
(``config.SERVING_BUDGETS``). ``featcache.lmdeploy.default_cache`` (re-exported there), also used
by each model process of the multi-process mode (``ranks``)."""

from __future__ import annotations

import os

import torch

from ..cache import FeatureCache
from ..config import SERVING_BUDGETS, default_store_dir


def default_cache(*, path: str | None = None, device_bytes: int | None = None,
                  host_bytes: int | None = None, disk_bytes: int | None = None,
                  host_only: bool = False, remote_url: str | None = None,
                  disk_writes: bool = True, key_algorithm: str | None = None,
                  key_secret_file: str | None = None) -> FeatureCache:
    """The cache ``pipeline(cache=None)`` builds; each argument overrides one default.

    Each tier budget not given is a share of what the machine has (``config.SERVING_BUDGETS``:
    of the GPU's free memory, of RAM, of the free space at the store); the store is at
    ``path``, else ``$FEATCACHE_DIR``, else ``~/.cache/featcache`` (created, mode 0700).
    ``host_only=True`` (TurboMind, which takes host tensors): the host budget is the device tier,
    on the CPU, and there is no separate host tier. ``remote_url``: a shared remote tier (Redis or
    Valkey, docs/tuning.md), off by default. ``disk_writes=False``: the store is read, never
    written (tp ranks > 0: rank 0 writes the features every rank computed). ``key_algorithm``
    and ``key_secret_file``: how keys are made (``featcache.keysecret``; None: the defaults).
    """
    keys = {k: v for k, v in (("key_algorithm", key_algorithm),
                              ("key_secret_file", key_secret_file)) if v is not None}
    if host_bytes is None:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        host_bytes = SERVING_BUDGETS["host_bytes"].bytes_from(ram)
    if device_bytes is None:
        device_bytes = 0
        if torch.cuda.is_available() and not host_only:
            device_bytes = SERVING_BUDGETS["device_bytes"].bytes_from(torch.cuda.mem_get_info()[0])
    path = path or default_store_dir()
    os.makedirs(path, mode=0o700, exist_ok=True)
    if disk_bytes is None:
        st = os.statvfs(path)
        disk_bytes = SERVING_BUDGETS["disk_bytes"].bytes_from(st.f_bavail * st.f_frsize)
    if host_only:
        return FeatureCache(device="cpu", device_bytes=host_bytes, host_bytes=0, disk_path=path,
                            disk_bytes=disk_bytes, remote_url=remote_url, disk_writes=disk_writes,
                            **keys)
    return FeatureCache(device_bytes=device_bytes, host_bytes=host_bytes, disk_path=path,
                        disk_bytes=disk_bytes, remote_url=remote_url, disk_writes=disk_writes,
                        **keys)
