"""Remote tier on Mooncake Store (kvcache-ai/Mooncake's ``mooncake.store``), for fleets that
already run it for KV transfer: the same tier as ``featcache.tiers.remote`` (``get(key, alloc)``,
``put``, ``discard``, ``write`` for the publisher thread, stats, the breaker), on a
``MooncakeDistributedStore`` client instead of redis-py. Optional: ``pip install
'featcache[mooncake]'`` (the CUDA build) or ``mooncake-transfer-engine-non-cuda`` on a host
without CUDA (it links libibverbs: ``apt-get install libibverbs1``, no RDMA device needed for TCP).
The ``mooncake://`` URL, the client (one per process) and the store's error codes are
``featcache.tiers.mooncake_client``'s.

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
from typing import Any, TypeVar

import numpy as np
import torch

from .. import codec
from ..config import CacheConfig
from ..core.copier import as_bytes
from ..errors import CorruptEntryError
from .base import Alloc, Entry, Op
from .breaker import Breaker
from .mooncake_client import (
    OBJECT_NOT_FOUND,
    Failed,
    MooncakeSettings,
    check_installed,
    outage,
    put_if_absent,
    release_client,
    shared_client,
)
from .remote import STAT_NAMES
from .remote_calls import CLUSTER_WORKERS
from .remote_layout import namespace

log = logging.getLogger("featcache")

T = TypeVar("T")
# The publisher checks the fleet's key secret this often: in Mooncake it lives in the memory of
# the replicas holding it, and goes with the last of them.
SECRET_CHECK_S = 10.0


class _Unavailable(Exception):
    """A call did not happen or did not complete (breaker open, error, timeout)."""


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
            raise Failed(rc, what)
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
        except Failed as e:
            self.count("errors")
            if outage(e.rc) or e.what == "setup":
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


