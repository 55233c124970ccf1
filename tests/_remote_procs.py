"""Child-process bodies for tests/test_remote.py (started with the "spawn" context): two
independent "replicas", each with its own FeatureCache and local tiers, sharing one server."""

from __future__ import annotations

import torch

try:
    from _procs import same_bits, value_for
except ImportError:  # tests/ became a package
    from tests._procs import same_bits, value_for


def _cache(url: str, disk_path: str):
    from featcache import FeatureCache

    torch.set_num_threads(1)
    return FeatureCache(device="cpu", device_bytes="32MiB", host_bytes="32MiB", disk_path=disk_path,
                        disk_bytes="64MiB", remote_url=url, remote_chunk_bytes="16KiB")


def replica_compute(url: str, disk_path: str, keys: list[bytes]) -> dict[str, int]:
    """A replica that misses everywhere, 'computes' each key and puts it; close() publishes."""
    with _cache(url, disk_path) as cache:
        for key in keys:
            assert cache.get(key) is None
            cache.put(key, value_for(key), meta=b"m:" + key)
    return cache.stats()["remote"]


def replica_read(url: str, disk_path: str, keys: list[bytes]) -> dict[str, int]:
    """A second replica: every key must come back from the remote tier, bit-exact."""
    with _cache(url, disk_path) as cache:
        for key in keys:
            lease = cache.acquire(key)
            assert lease is not None, key
            assert same_bits(lease.tensor, value_for(key)), key
            assert lease.meta == b"m:" + key
            lease.release()
        assert cache.stats()["disk"]["hits"] == 0  # its own disk never had them
        return cache.stats()["remote"]
