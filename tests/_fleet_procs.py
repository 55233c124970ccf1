"""Child-process body for tests/test_fleet_cluster*.py (started with the "spawn" context): one
featcache replica of a fleet, under a steady load of gets and puts against the shared tier.

Each image is named ``img-<i>``; its key is the replica's ``client_key`` (keyed with the fleet's
secret, so two replicas' keys meet only while their secrets agree) and its features are
``value_for`` of the name, so any replica checks any value it is served. A get that misses is a
"compute" and a put. Every get is recorded (when it began, whether it hit, how long it took);
whatever comes out of ``get``/``put`` other than a value or None is recorded as an exception.
"""

from __future__ import annotations

import random
import time
import traceback
from typing import Any

import torch

try:
    from _procs import same_bits, value_for
except ImportError:  # tests/ became a package
    from tests._procs import same_bits, value_for


def _secret_name(prefix: str) -> str:
    from featcache.keysecret import REMOTE_SUFFIX

    return f"{prefix}:{REMOTE_SUFFIX}"


def replica(url: str, conn: Any, images: int, seed: int, options: dict[str, Any]) -> None:
    """Run until the parent sends "stop"; answer "report" with what happened since the last one:
    ``{"gets": [(t, hit, ms), ...], "puts": n, "wrong": [...], "exceptions": [...], "stats":
    remote stats, "secret": hex}``. ``options`` are FeatureCache options (remote-only by default)."""
    from featcache import FeatureCache

    torch.set_num_threads(1)
    rng = random.Random(seed)
    options = {"device_bytes": 0, "host_bytes": 0, "remote_chunk_bytes": "8KiB", **options}
    cache = FeatureCache(device="cpu", remote_url=url, **options)
    assert cache.hasher.secret is not None
    secret = cache.hasher.secret.hex()
    names = [f"img-{i}" for i in range(images)]
    keys = [cache.client_key(n) for n in names]
    want = {n: value_for(n.encode()) for n in names}
    gets: list[tuple[float, bool, float]] = []
    wrong: list[str] = []
    exceptions: list[str] = []
    puts = 0
    conn.send("ready")
    try:
        while True:
            if conn.poll():
                command = conn.recv()
                if command == "stop":
                    break
                conn.send({"gets": gets, "puts": puts, "wrong": wrong, "exceptions": exceptions,
                           "stats": cache.stats()["remote"], "secret": secret})
                gets, wrong, exceptions, puts = [], [], [], 0
                continue
            i = rng.randrange(images)
            t0 = time.monotonic()
            try:
                got = cache.get(keys[i])
            except Exception:
                exceptions.append(traceback.format_exc())
                got = None
            ms = (time.monotonic() - t0) * 1e3
            gets.append((t0, got is not None, ms))
            if got is not None:
                if not same_bits(got, want[names[i]]):
                    wrong.append(names[i])
                continue
            try:
                cache.put(keys[i], want[names[i]])
                puts += 1
            except Exception:
                exceptions.append(traceback.format_exc())
            time.sleep(0.001)
    finally:
        t0 = time.monotonic()
        cache.close()
        close_ms = (time.monotonic() - t0) * 1e3
    conn.send({"gets": gets, "puts": puts, "wrong": wrong, "exceptions": exceptions,
               "stats": cache.stats()["remote"], "secret": secret, "close_ms": close_ms})


def server_secret(url: str, prefix: str = "featcache") -> str | None:
    """The fleet's secret as the cluster holds it (hex), or None where it has none."""
    import redis

    client = redis.RedisCluster.from_url(url.replace("-cluster://", "://"), socket_timeout=2)
    try:
        value = client.get(_secret_name(prefix))
    finally:
        client.close()
    return value.decode() if value is not None else None
