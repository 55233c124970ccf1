"""Mooncake Store's client as the Mooncake tier (``featcache.tiers.mooncake``) and the key secret
(``featcache.keysecret``) use it: the settings a ``mooncake://`` URL names, one set-up client per
process (shared by the tiers and the secret; the last tier holding it closes it), the error
codes the tier tells apart, and a put-if-absent (Redis's ``SET NX`` + ``GET``) for the fleet's
key secret. No tier logic here: the tier's breaker, deadline and counts are the tier's.

``remote_url="mooncake://MASTER_HOST:PORT?metadata=URL&protocol=tcp&local=HOST&segment=SIZE&buffer=SIZE"``:
the master's RPC address; ``metadata`` the metadata service (``http://host:port/metadata``, the
master's own with ``--enable_http_metadata_server``, or ``etcd://...``); ``protocol`` the
transport (``tcp`` or ``rdma``, then ``device=`` the NICs); ``local`` this host's address as peers
reach it; ``segment`` the memory this replica contributes to the store (default 256MiB; objects
live in the contributors' segments: a replica that leaves takes its share with it); ``buffer`` the
client's transfer buffer (default 64MiB; an entry larger than it is not published).

Invariant: one client per process and settings (``shared_client``): the key secret lives in the
segment of the client that put it, so the secret and the tiers go through the same one; a forked
child makes its own (a client inherited across ``fork()`` is never used).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, urlsplit

from ..config import CacheConfig
from ..sizes import parse_bytes

# Mooncake's error codes (mooncake-store's types.h) the tier tells apart
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
TRANSFER_FAIL = -800
RPC_FAIL = -900
SECRET_SETTLE_S = 5.0  # how long a start waits for another replica's put of the key secret
SECRET_RETRY_S = 0.05


def outage(rc: int) -> bool:
    """A code that means the store could not be reached (not a refusal of this one call)."""
    return rc in (TRANSFER_FAIL,) or rc <= RPC_FAIL


class Failed(Exception):
    """A call returned an error code."""

    def __init__(self, rc: int, what: str) -> None:
        super().__init__(f"{what}: mooncake error {rc}")
        self.rc = rc
        self.what = what


@dataclass(frozen=True)
class MooncakeSettings:
    master: str
    metadata: str
    protocol: str = "tcp"
    local: str = "127.0.0.1"
    device: str = ""
    segment_bytes: int = 256 << 20
    buffer_bytes: int = 64 << 20

    @classmethod
    def from_url(cls, url: str) -> MooncakeSettings:
        parts = urlsplit(url)
        if parts.scheme != "mooncake" or not parts.hostname or not parts.port:
            raise ValueError("a Mooncake remote_url is mooncake://MASTER_HOST:PORT?metadata=...")
        q = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        metadata = q.get("metadata")
        if not metadata:
            raise ValueError("a Mooncake remote_url needs metadata=<the metadata service's URL>")
        return cls(
            master=f"{parts.hostname}:{parts.port}", metadata=metadata,
            protocol=q.get("protocol", "tcp"), local=q.get("local", "127.0.0.1"),
            device=q.get("device", ""),
            segment_bytes=parse_bytes(q.get("segment", "256MiB")),
            buffer_bytes=parse_bytes(q.get("buffer", "64MiB")),
        )


def connect(settings: MooncakeSettings, segment_bytes: int | None = None) -> Any:
    """A set-up ``MooncakeDistributedStore`` (it registers with the master and mounts this
    process's segment). Raises ``ImportError`` without the package, ``Failed`` when setup fails."""
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    rc = store.setup(settings.local, settings.metadata,
                     settings.segment_bytes if segment_bytes is None else segment_bytes,
                     settings.buffer_bytes, settings.protocol, settings.device, settings.master)
    if rc != 0:
        try:
            store.close()
        except Exception:
            pass
        raise Failed(rc, "setup")
    return store


# (pid, settings) -> [this process's client, tiers holding it]
_SHARED: dict[tuple[int, MooncakeSettings], list[Any]] = {}
_SHARED_LOCK = threading.Lock()


def shared_client(settings: MooncakeSettings, hold: bool = False) -> Any:
    """This process's store client for ``settings`` (one per process: the key secret is read and
    set through the client whose segment then keeps it, the tier's); ``hold``: a tier takes a
    reference (``release_client`` gives it back; the last one closes it). A forked child makes
    its own."""
    with _SHARED_LOCK:
        key = (os.getpid(), settings)
        held = _SHARED.get(key)
        if held is None:
            held = _SHARED[key] = [connect(settings), 0]
        held[1] += int(hold)
        return held[0]


def release_client(client: Any) -> None:
    with _SHARED_LOCK:
        for key, held in list(_SHARED.items()):
            if held[0] is client:
                held[1] -= 1
                if held[1] > 0:
                    return
                del _SHARED[key]
    try:
        client.close()
    except Exception:  # closing a client whose master is gone may fail: nothing to do
        pass


def check_installed() -> None:
    try:
        import mooncake.store  # noqa: F401
    except ImportError as e:
        raise ImportError(
            "a mooncake:// remote_url needs Mooncake Store: pip install 'featcache[mooncake]' "
            f"(or mooncake-transfer-engine-non-cuda without CUDA) ({e})") from e


def put_if_absent(store: Any, name: str, value: bytes) -> bytes | None:
    """Store ``value`` under ``name`` unless something is there; None if it was stored, else what
    is there (Redis's ``SET NX`` + ``GET``; a Mooncake put of a key that exists keeps the value
    there, so two racing proposals end on one)."""
    exists = store.is_exist(name)
    if exists < 0:
        raise Failed(exists, "is_exist")
    if exists == 0:
        rc = store.put(name, value)
        if rc < 0 and rc != OBJECT_ALREADY_EXISTS:
            raise Failed(rc, "put")
    held = store.get(name)
    if not held:
        raise Failed(OBJECT_NOT_FOUND, "get")
    held = bytes(held)
    return None if exists == 0 and held == value else held


def read_or_set_secret(config: CacheConfig, name: str, proposal: bytes,
                       settle_s: float = SECRET_SETTLE_S) -> bytes:
    """The fleet's key secret (hex bytes) in the store, set to ``proposal`` where none is (for
    ``featcache.keysecret``), through this process's client: the object lives in the segments
    of the replicas that hold it, and each running replica's publisher puts it again where it
    is gone (``featcache.tiers.mooncake.SECRET_CHECK_S``).

    Replicas started together race to set it: a put of the same name by another client may be
    in flight, so that this one's put is refused, or its get finds nothing yet or fails to read
    the other's segment (``TRANSFER_FAIL``). Such a call is tried again for up to ``settle_s``
    (the other's put then lands, and its value is read), so that replicas started at once key
    alike; a master that cannot be reached (``RPC_FAIL`` and below) is not waited on."""
    assert config.remote_url is not None
    store = shared_client(MooncakeSettings.from_url(config.remote_url))
    deadline = time.monotonic() + settle_s
    while True:
        try:
            held = put_if_absent(store, name, proposal)
            return proposal if held is None else held
        except Failed as e:
            if e.rc <= RPC_FAIL or time.monotonic() >= deadline:
                raise
        time.sleep(SECRET_RETRY_S)  # (start-up only: another replica's put landing)
