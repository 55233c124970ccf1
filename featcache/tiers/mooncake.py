"""Remote tier on Mooncake Store (kvcache-ai/Mooncake's ``mooncake.store``), for fleets that
already run it for KV transfer: the same tier as ``featcache.tiers.remote`` (``get(key, alloc)``,
``put``, ``discard``, ``write`` for the publisher thread, stats, the breaker), on a
``MooncakeDistributedStore`` client instead of redis-py. Optional: ``pip install
'featcache[mooncake]'`` (the CUDA build) or ``mooncake-transfer-engine-non-cuda`` on a host
without CUDA (it links libibverbs: ``apt-get install libibverbs1``, no RDMA device needed for TCP).

``remote_url="mooncake://MASTER_HOST:PORT?metadata=URL&protocol=tcp&local=HOST&segment=SIZE&buffer=SIZE"``:
the master's RPC address; ``metadata`` the metadata service (``http://host:port/metadata``, the
master's own with ``--enable_http_metadata_server``, or ``etcd://...``); ``protocol`` the
transport (``tcp`` or ``rdma``, then ``device=`` the NICs); ``local`` this host's address as peers
reach it; ``segment`` the memory this replica contributes to the store (default 256MiB; objects
live in the contributors' segments: a replica that leaves takes its share with it); ``buffer`` the
client's transfer buffer (default 64MiB; an entry larger than it is not published).

Layout: one object per entry, ``<namespace>:<key hex>``, holding the disk tier's value
(``featcache.codec``: header, metadata, payload, xxh3-128 checksum) behind 0..63 zero bytes, so
that the object laid into a buffer puts the payload ``codec.PAYLOAD_ALIGN``-aligned
(``codec.frame_offsets``). Mooncake makes an object readable only once its put completed, so no
head/chunk protocol is needed; a value is still served only after its length and checksum verify
(a torn read of an object being replaced, a bad replica: counted ``corrupt``, a miss, dropped).
Mooncake has no per-object TTL: ``remote_ttl_s`` does not apply (the store's eviction and leases
govern).

Deadline: the store's calls take no timeout (a get while the master is gone answers at once, a
put or an existence check waited 3-4 s here), so a get runs on the tier's worker threads and the
caller waits at most ``remote_timeout_ms``; the worker reads into the store's own buffer
(``get_buffer``), and the caller copies from it into ``alloc``'s block, so an abandoned read never
writes a block the cache has reused (one copy: the price of the deadline). Publishes run on the
publisher thread itself, off the request path, without abandonment (an abandoned put would go on
reading a host block the cache may reuse). Every failed call is a miss or a failed publish,
counted; the breaker skips the store after ``remote_breaker_failures`` in a row.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import parse_qs, urlsplit

import numpy as np
import torch

from .. import codec
from ..breaker import Breaker
from ..config import CacheConfig
from ..core.copier import as_bytes
from ..errors import CorruptEntryError
from ..sizes import parse_bytes
from .base import Alloc, Entry, Op
from .remote import CLUSTER_WORKERS, STAT_NAMES
from .remote_layout import namespace

log = logging.getLogger("featcache")

T = TypeVar("T")
# The publisher checks the fleet's key secret this often: in Mooncake it lives in the memory of
# the replicas holding it, and goes with the last of them.
SECRET_CHECK_S = 10.0

# Mooncake's error codes (mooncake-store's types.h) the tier tells apart
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
TRANSFER_FAIL = -800
RPC_FAIL = -900


def _outage(rc: int) -> bool:
    """A code that means the store could not be reached (not a refusal of this one call)."""
    return rc in (TRANSFER_FAIL,) or rc <= RPC_FAIL


class _Unavailable(Exception):
    """A call did not happen or did not complete (breaker open, error, timeout)."""


class _Failed(Exception):
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
    process's segment). Raises ``ImportError`` without the package, ``_Failed`` when setup fails."""
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
        raise _Failed(rc, "setup")
    return store


# (pid, settings) -> [this process's client, tiers holding it]
_SHARED: dict[tuple[int, MooncakeSettings], list[Any]] = {}
_SHARED_LOCK = threading.Lock()


def shared_client(settings: MooncakeSettings, hold: bool = False) -> Any:
    """This process's store client for ``settings`` (one per process: the key secret is read and
    set through the client whose segment then keeps it, the tier's); ``hold``: a tier takes a
    reference (``release_client`` gives it back; the last one closes it). A forked child makes
    its own."""
    import os

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


class MooncakeTier:
    """Entries in a Mooncake Store, shared by every cache that names the same master and prefix.
    ``client_factory`` builds the store client (lazily, again after a failure)."""

    name = "remote"
    capacity_bytes = 0  # the store's segments govern

    def __init__(
        self,
        client_factory: Callable[[], Any],
        *,
        prefix: str,
        max_value_bytes: int,
        breaker: Breaker,
        deadline_s: float,
        url_for_logs: str = "mooncake",
        on_corrupt: Callable[[bytes], None] | None = None,
    ) -> None:
        self._factory = client_factory
        self._client: Any = None
        self._client_lock = threading.Lock()
        self.prefix = namespace(prefix)
        self.max_value_bytes = max_value_bytes
        self.breaker = breaker
        self._deadline_s = deadline_s
        self._url = url_for_logs
        self._on_corrupt = on_corrupt
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._was_open = False
        self._pool = concurrent.futures.ThreadPoolExecutor(CLUSTER_WORKERS, "featcache-mooncake")
        self._secret: tuple[str, bytes] | None = None
        self._secret_due = 0.0
        self._secret_mismatch_said = False

    @classmethod
    def from_config(
        cls, config: CacheConfig, on_corrupt: Callable[[bytes], None] | None = None,
        client_factory: Callable[[], Any] | None = None,
    ) -> MooncakeTier:
        assert config.remote_url is not None
        settings = MooncakeSettings.from_url(config.remote_url)
        if client_factory is None:
            check_installed()
        return cls(
            client_factory or (lambda: shared_client(settings, hold=True)),
            prefix=config.remote_prefix,
            max_value_bytes=settings.buffer_bytes,
            breaker=Breaker(config.remote_breaker_failures, config.remote_breaker_cooldown_ms / 1000),
            deadline_s=config.remote_timeout_ms / 1000,
            url_for_logs=config.remote_url_redacted or "mooncake",
            on_corrupt=on_corrupt,
        )

    def object_key(self, key: bytes) -> str:
        return f"{self.prefix}:{key.hex()}"

    # -- the Tier protocol ---------------------------------------------------------------------
    @property
    def used_bytes(self) -> int:
        return 0

    def fits(self, nbytes: int, meta_bytes: int = 0) -> bool:
        """A value must fit the client's transfer buffer (a get lands there first)."""
        return codec.PAYLOAD_ALIGN + codec.HEADER.size + meta_bytes + nbytes <= self.max_value_bytes

    def contains(self, key: bytes) -> bool:
        name = self.object_key(key)
        try:
            return bool(self._call(lambda c: self._rc(c.is_exist(name), "is_exist", miss_ok=True) == 1))
        except _Unavailable:
            return False

    def get(self, key: bytes, alloc: Alloc | None = None) -> Entry | None:
        """Read and verify ``key`` into ``alloc(n)``'s block (the payload aligned). Anything
        missing, corrupt or unreachable (within the deadline) is a miss."""
        entry = self._read(key, alloc)
        self.count("hits" if entry is not None else "misses")
        return entry

    def put(self, key: bytes, entry: Entry) -> bool:
        tensor = entry.tensor
        payload = as_bytes(tensor).numpy().data if tensor.numel() else memoryview(b"")
        lead = codec.lead(tensor.dtype, tuple(tensor.shape), payload, entry.meta)
        start, _ = codec.frame_offsets(len(entry.meta))
        value_len = len(lead) + payload.nbytes
        name = self.object_key(key)
        parts: list[Any] = [bytes(start) + lead] + ([payload] if payload.nbytes else [])
        try:
            self._call(lambda c: self._rc(c.upsert_parts(name, *parts), "upsert"), direct=True)
        except _Unavailable:
            self.count("publish_errors")
            return False
        self.count("published")
        self.count("bytes_published", value_len)
        return True

    def discard(self, key: bytes) -> bool:
        name = self.object_key(key)
        try:
            rc = self._call(lambda c: self._rc(c.remove(name, True), "remove", miss_ok=True),
                            direct=True)
        except _Unavailable:
            return False
        self.count("discards")
        return rc == 0

    def write(self, ops: Sequence[Op]) -> None:
        self._check_secret()
        for op in ops:
            if op.kind == "put":
                assert op.entry is not None
                self.put(op.key, op.entry)
            elif op.kind == "discard":
                self.discard(op.key)

    def count_drops(self, n: int = 1) -> None:
        self.count("publish_dropped", n)

    def stats(self) -> dict[str, int]:
        with self._lock:
            counts = {name: self._counts.get(name, 0) for name in STAT_NAMES}
        return {**counts, "breaker_open": int(self.breaker.is_open), "breaker_open_nodes": 0,
                "breaker_opened": self.breaker.opened, "enabled": 1}

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def keep_secret(self, name: str, secret: bytes) -> None:
        self._secret = (name, secret)
        self._secret_due = time.monotonic() + SECRET_CHECK_S

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._client_lock:
            client, self._client = self._client, None
        if client is not None:
            release_client(client)  # its segment, and the objects in it, leave the store

    def __repr__(self) -> str:
        return f"MooncakeTier({self._url!r}, prefix={self.prefix!r})"

    # -- reading -------------------------------------------------------------------------------
    def _read(self, key: bytes, alloc: Alloc | None) -> Entry | None:
        name = self.object_key(key)

        def fetch(c: Any) -> Any:
            handle = c.get_buffer(name)
            return handle if handle is not None and handle.size() > 0 else None

        try:
            handle = self._call(fetch)
        except _Unavailable:
            return None
        if handle is None:
            return None
        try:
            return self._assemble(handle, alloc)
        except CorruptEntryError as e:
            log.warning("featcache: corrupt remote entry %s dropped (%s)", key.hex(), e)
            self.count("corrupt")
            if self._on_corrupt is not None:
                self._on_corrupt(key)
            return None

    def _assemble(self, handle: Any, alloc: Alloc | None) -> Entry:
        total = int(handle.size())
        source = np.ctypeslib.as_array((ctypes.c_uint8 * total).from_address(int(handle.ptr())))
        start = _value_start(source)
        meta_len = codec.meta_len(source[start : start + codec.HEADER.size].tobytes())
        if not 0 <= meta_len <= codec.MAX_META_BYTES or codec.frame_offsets(meta_len)[0] != start:
            raise CorruptEntryError("remote value: bad framing")
        _, payload_start = codec.frame_offsets(meta_len)
        if total < payload_start:
            raise CorruptEntryError("remote value shorter than its header")
        buffer = alloc(total) if alloc is not None else torch.empty(total, dtype=torch.uint8)
        out = buffer[:total].numpy()
        np.copyto(out, source)
        del source  # the handle's memory is the store's: nothing refers to it past here
        value = out[start:total].data
        header = codec.verify(value)
        self.count("bytes_read", total - start)
        payload = buffer[payload_start:total]
        return Entry(payload.view(header.dtype).view(header.shape), meta=codec.meta(value, header))

    # -- the fleet's key secret ----------------------------------------------------------------
    def _check_secret(self) -> None:
        if self._secret is None or time.monotonic() < self._secret_due:
            return
        name, secret = self._secret
        self._secret_due = time.monotonic() + SECRET_CHECK_S
        try:
            held = self._call(lambda c: put_if_absent(c, name, secret.hex().encode()), direct=True)
        except _Unavailable:
            self._secret_due = 0.0
            return
        if held is None:
            self.count("secret_restored")
            log.warning("featcache: the remote tier %s had lost the fleet's key secret; set it "
                        "again", self._url)
        elif held.strip().lower() != secret.hex().encode():
            self.count("secret_mismatch")
            if not self._secret_mismatch_said:
                self._secret_mismatch_said = True
                log.warning("featcache: the remote tier %s holds another key secret than this "
                            "process keys with: its entries and this process's do not meet until "
                            "it restarts", self._url)

    # -- calls ---------------------------------------------------------------------------------
    @staticmethod
    def _rc(rc: int, what: str, miss_ok: bool = False) -> int:
        if rc < 0 and not (miss_ok and rc == OBJECT_NOT_FOUND):
            raise _Failed(rc, what)
        return rc

    def _call(self, op: Callable[[Any], T], direct: bool = False) -> T:
        """``op(client)`` through the breaker: on a worker thread within the deadline, or here
        (``direct``: the publisher's calls). Raises ``_Unavailable`` (counted) if it failed."""
        if not self.breaker.allow():
            self.count("breaker_skips")
            raise _Unavailable
        try:
            if direct:
                result = op(self._connected())
            else:
                future = self._pool.submit(lambda: op(self._connected()))
                try:
                    result = future.result(timeout=self._deadline_s)
                except concurrent.futures.TimeoutError:
                    if not future.done():
                        future.cancel()
                        raise TimeoutError(f"no answer within {self._deadline_s} s") from None
                    result = future.result()
        except _Failed as e:
            self.count("errors")
            if _outage(e.rc) or e.what == "setup":
                self._failed(e)
            else:
                self.breaker.success()  # the store answered: a refusal of this call
            raise _Unavailable from e
        except Exception as e:  # TimeoutError, the client's own exceptions: a miss, counted
            self.count("timeouts" if isinstance(e, TimeoutError) else "errors")
            self._failed(e)
            raise _Unavailable from e
        self.breaker.success()
        if self._was_open:
            self._was_open = False
            log.warning("featcache: remote tier %s reachable again", self._url)
        return result

    def _failed(self, error: BaseException) -> None:
        self.breaker.failure()
        self._secret_due = min(self._secret_due, time.monotonic() + 1.0)
        # a client that was set up stays: it reconnects to a master that comes back by itself
        if self.breaker.is_open and not self._was_open:
            self._was_open = True
            log.warning("featcache: remote tier %s unreachable (%s: %s); skipping it for %.1f s at "
                        "a time until a call succeeds", self._url, type(error).__name__, error,
                        self.breaker.cooldown_s)

    def _connected(self) -> Any:
        with self._client_lock:
            if self._client is None:
                self._client = self._factory()
            return self._client


def _value_start(source: np.ndarray) -> int:
    """Where the value begins in an object: after the zero bytes that align its payload."""
    limit = min(codec.PAYLOAD_ALIGN, source.size)
    nonzero = np.flatnonzero(source[:limit])
    if nonzero.size == 0:
        raise CorruptEntryError("remote value: no header")
    return int(nonzero[0])


def put_if_absent(store: Any, name: str, value: bytes) -> bytes | None:
    """Store ``value`` under ``name`` unless something is there; None if it was stored, else what
    is there (Redis's ``SET NX`` + ``GET``; a Mooncake put of a key that exists keeps the value
    there, so two racing proposals end on one)."""
    exists = store.is_exist(name)
    if exists < 0:
        raise _Failed(exists, "is_exist")
    if exists == 0:
        rc = store.put(name, value)
        if rc < 0 and rc != OBJECT_ALREADY_EXISTS:
            raise _Failed(rc, "put")
    held = store.get(name)
    if not held:
        raise _Failed(OBJECT_NOT_FOUND, "get")
    held = bytes(held)
    return None if exists == 0 and held == value else held


def read_or_set_secret(config: CacheConfig, name: str, proposal: bytes) -> bytes:
    """The fleet's key secret (hex bytes) in the store, set to ``proposal`` where none is (for
    ``featcache.keysecret``), through this process's client: the object lives in the segments
    of the replicas that hold it, and each running replica's publisher puts it again where it
    is gone (``SECRET_CHECK_S``)."""
    assert config.remote_url is not None
    store = shared_client(MooncakeSettings.from_url(config.remote_url))
    held = put_if_absent(store, name, proposal)
    return proposal if held is None else held
