"""Remote tier: features shared by a fleet of replicas through Redis or Valkey (one server or a
Redis Cluster), with the redis-py client. Synchronous like every tier: the cache reads it on a
local miss (the request path's only network call, bounded by ``remote_timeout_ms``) and the
publisher thread (its ``featcache.writer.TierWriter``) writes it, through ``write``.

The layout on the server (key names, the head, chunks) is ``featcache.tiers.remote_layout``'s;
a value is the disk tier's value (``featcache.codec``: header, metadata, payload, xxh3-128
checksum); no pickle.

Invariants:
- a reader never sees half an entry: chunks are written first under a fresh nonce (so they are
  never overwritten), and the head is set last, in one command (SET ... GET, which also returns
  the head it replaced, whose chunks are then unlinked); a head whose chunks are gone (evicted,
  expired, unlinked by a newer write) reads as a miss (``incomplete``); chunks without a head are
  never read and expire;
- a value is served only after its length and checksum are verified; a bad one is counted
  (``corrupt``), reported through ``on_corrupt`` (the cache queues its deletion) and is a miss;
- chunks live ``CHUNK_TTL_MARGIN_S`` longer than their head, so TTL expiry takes the head first;
- every call goes through the circuit breaker (``featcache.breaker``): a failed call (refused,
  timed out, connection lost) is a miss or an unpublished entry, counted; after
  ``remote_breaker_failures`` in a row the tier is skipped for ``remote_breaker_cooldown_ms``,
  then one trial call decides. redis-py's own retries are off (one attempt per call); its pool
  reconnects on the next call after a lost connection;
- the URL's password never appears in logs, ``repr`` or stats (``config.redact_url``).
"""

from __future__ import annotations

import logging
import os
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, TypeVar

import numpy as np
import torch

from .. import codec
from ..breaker import Breaker
from ..config import CacheConfig
from ..copier import as_bytes
from ..errors import CorruptEntryError
from .base import Alloc, Entry, Op
from .remote_layout import (
    CHUNK_TTL_MARGIN_S,
    CHUNKED,
    HEAD,
    INLINE,
    Manifest,
    chunk_keys,
    head_key,
    max_value_bytes,
    namespace,
    pack_head,
    parse_head,
    split,
)

log = logging.getLogger("featcache")

T = TypeVar("T")

STAT_NAMES = (
    "hits", "misses", "corrupt", "incomplete", "errors", "timeouts", "breaker_skips",
    "published", "publish_errors", "publish_dropped", "discards", "bytes_read", "bytes_published",
)


class _Unavailable(Exception):
    """A remote call did not happen or did not complete (breaker open, error, timeout)."""


def connect(config: CacheConfig) -> Any:
    """A redis-py client for ``config.remote_url`` (no I/O here: it connects on first use)."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    url = config.remote_url
    assert url is not None
    timeout_s = config.remote_timeout_ms / 1000
    options: dict[str, Any] = {
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
        "retry": Retry(NoBackoff(), 0),  # one attempt: the breaker decides when to try again
    }
    tls = {"ssl_ca_certs": config.remote_tls_ca_file, "ssl_certfile": config.remote_tls_cert_file,
           "ssl_keyfile": config.remote_tls_key_file}
    options.update({k: v for k, v in tls.items() if v is not None})
    scheme, _, rest = url.partition("://")
    if scheme.endswith("-cluster"):
        return redis.RedisCluster.from_url(f"{scheme.removesuffix('-cluster')}://{rest}", **options)
    return redis.Redis.from_url(url, **options)


class RemoteTier:
    """Entries on a Redis/Valkey server, shared by every cache that names the same server and
    prefix. ``client_factory`` builds the redis-py client (lazily, again after a failure)."""

    name = "remote"
    capacity_bytes = 0  # the server's maxmemory governs; nothing is counted here

    def __init__(
        self,
        client_factory: Callable[[], Any],
        *,
        prefix: str,
        ttl_s: int,
        chunk_bytes: int,
        breaker: Breaker,
        url_for_logs: str = "remote",
        on_corrupt: Callable[[bytes], None] | None = None,
    ) -> None:
        self._factory = client_factory
        self._client: Any = None
        self._client_lock = threading.Lock()
        self.prefix = namespace(prefix)
        self.ttl_s = ttl_s
        self.chunk_bytes = chunk_bytes
        self.breaker = breaker
        self._url = url_for_logs
        self._on_corrupt = on_corrupt
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._was_open = False
        self._logged_unexpected = False

    @classmethod
    def from_config(
        cls, config: CacheConfig, on_corrupt: Callable[[bytes], None] | None = None,
        client_factory: Callable[[], Any] | None = None,
    ) -> RemoteTier:
        """The tier ``config`` describes. Raises ``ImportError`` (saying what to install) when
        redis-py is missing, so that this shows at construction, not as misses."""
        if client_factory is None:
            try:
                import redis  # noqa: F401
            except ImportError as e:
                raise ImportError(
                    "remote_url needs the redis client: pip install 'featcache[remote]' (redis>=5)"
                ) from e
        return cls(
            client_factory or (lambda: connect(config)),
            prefix=config.remote_prefix,
            ttl_s=config.remote_ttl_s,
            chunk_bytes=config.remote_chunk_bytes,
            breaker=Breaker(config.remote_breaker_failures, config.remote_breaker_cooldown_ms / 1000),
            url_for_logs=config.remote_url_redacted or "remote",
            on_corrupt=on_corrupt,
        )

    # -- keys ----------------------------------------------------------------------------------
    def head_key(self, key: bytes) -> str:
        return head_key(self.prefix, key)

    def chunk_keys(self, key: bytes, manifest: Manifest) -> list[str]:
        return chunk_keys(self.prefix, key, manifest)

    # -- the Tier protocol ---------------------------------------------------------------------
    @property
    def used_bytes(self) -> int:
        return 0

    def fits(self, nbytes: int, meta_bytes: int = 0) -> bool:
        """Whether a value of ``nbytes`` payload and ``meta_bytes`` metadata can be published:
        the server's memory governs, only a head's chunk count bounds it."""
        return HEAD.size + codec.HEADER.size + meta_bytes + nbytes <= max_value_bytes(self.chunk_bytes)

    def contains(self, key: bytes) -> bool:
        """Whether the server holds a head for ``key`` (one network call; the cache never asks,
        so that ``key in cache`` stays local)."""
        try:
            return bool(self._call(lambda c: c.exists(self.head_key(key))))
        except _Unavailable:
            return False

    def get(self, key: bytes, alloc: Alloc | None = None) -> Entry | None:
        """Read and verify ``key``; its bytes land in ``alloc(n)`` (a uint8 CPU tensor of ``n``
        bytes: the value laid out so that the payload starts ``codec.PAYLOAD_ALIGN``-aligned).
        Anything missing, partial, corrupt or unreachable is a miss."""
        entry = self._read(key, alloc)
        self.count("hits" if entry is not None else "misses")
        return entry

    def put(self, key: bytes, entry: Entry) -> bool:
        """Publish ``entry`` (host bytes, ready): chunks first, the head last. False if it failed
        (counted); the server then keeps what it held."""
        tensor = entry.tensor
        payload = as_bytes(tensor).numpy().data if tensor.numel() else memoryview(b"")
        lead = codec.lead(tensor.dtype, tuple(tensor.shape), payload, entry.meta)
        value_len = len(lead) + payload.nbytes
        nonce = os.urandom(8)
        head_key = self.head_key(key)
        ttl = self.ttl_s or None
        try:
            if HEAD.size + value_len <= self.chunk_bytes:
                head = b"".join((pack_head(INLINE, nonce, value_len, self.chunk_bytes, 0), lead, payload))
                old = self._call(lambda c: c.set(head_key, head, ex=ttl, get=True))
            else:
                manifest = Manifest(CHUNKED, nonce, value_len, self.chunk_bytes,
                                    -(-value_len // self.chunk_bytes))
                chunk_ttl = ttl + CHUNK_TTL_MARGIN_S if ttl else None
                names = self.chunk_keys(key, manifest)

                def write_chunks(c: Any) -> list[Any]:
                    pipe = c.pipeline(transaction=False)
                    for name, piece in zip(names, split(lead, payload, self.chunk_bytes), strict=True):
                        pipe.set(name, piece, ex=chunk_ttl)
                    return list(pipe.execute())

                self._call(write_chunks)  # raises on any failed SET: the head is not written
                head = pack_head(CHUNKED, nonce, value_len, self.chunk_bytes, manifest.chunks)
                old = self._call(lambda c: c.set(head_key, head, ex=ttl, get=True))
        except _Unavailable:
            self.count("publish_errors")
            return False
        self.count("published")
        self.count("bytes_published", value_len)
        self._unlink_chunks(key, old, keep=nonce)
        return True

    def discard(self, key: bytes) -> bool:
        """Delete ``key`` (its head, then its chunks). False if the server could not be reached."""
        try:
            old = self._call(lambda c: c.getdel(self.head_key(key)))
        except _Unavailable:
            return False
        self.count("discards")
        self._unlink_chunks(key, old, keep=None)
        return old is not None

    def write(self, ops: Sequence[Op]) -> None:
        """Apply ``ops`` in order (the publisher thread): publish puts, delete discards. A publish
        that fails leaves the server's value as it was (counted in ``publish_errors``)."""
        for op in ops:
            if op.kind == "put":
                assert op.entry is not None
                self.put(op.key, op.entry)
            elif op.kind == "discard":
                self.discard(op.key)

    def count_drops(self, n: int = 1) -> None:
        """Publishes dropped before reaching the server (``publish_dropped``)."""
        self.count("publish_dropped", n)

    def stats(self) -> dict[str, int]:
        with self._lock:
            counts = {name: self._counts.get(name, 0) for name in STAT_NAMES}
        return {
            **counts,
            "breaker_open": int(self.breaker.is_open),
            "breaker_opened": self.breaker.opened,
            "enabled": 1,
        }

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def close(self) -> None:
        with self._client_lock:
            client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception:  # closing a client whose server is gone may raise; nothing to do
                pass

    def __repr__(self) -> str:
        return f"RemoteTier({self._url!r}, prefix={self.prefix!r})"

    # -- reading -------------------------------------------------------------------------------
    def _read(self, key: bytes, alloc: Alloc | None) -> Entry | None:
        try:
            raw = self._call(lambda c: c.get(self.head_key(key)))
            if raw is None:
                return None
            manifest = parse_head(raw)
            if manifest.inline is not None:
                pieces: list[bytes | memoryview] = [manifest.inline]
            else:
                names = self.chunk_keys(key, manifest)
                got = self._call(lambda c: c.mget(names))
                if any(piece is None for piece in got):
                    self.count("incomplete")  # chunks evicted, expired, or replaced by a newer write
                    self._dropped(key)
                    return None
                pieces = list(got)
            return self._assemble(manifest, pieces, alloc)
        except _Unavailable:
            return None
        except CorruptEntryError as e:
            log.warning("featcache: corrupt remote entry %s dropped (%s)", key.hex(), e)
            self.count("corrupt")
            self._dropped(key)
            return None

    def _assemble(
        self, manifest: Manifest, pieces: list[bytes | memoryview],
        alloc: Alloc | None,
    ) -> Entry:
        sizes = [memoryview(p).nbytes for p in pieces]
        if sum(sizes) != manifest.value_len or (
            manifest.kind == CHUNKED and any(n != manifest.chunk_bytes for n in sizes[:-1])
        ):
            raise CorruptEntryError(f"remote value of {sum(sizes)} bytes, head says {manifest.value_len}")
        lead = b"".join(bytes(memoryview(p)[: codec.HEADER.size]) for p in pieces[:2])
        meta_len = codec.meta_len(lead[: codec.HEADER.size])
        payload_len = manifest.value_len - codec.HEADER.size - meta_len
        if not 0 <= meta_len <= codec.MAX_META_BYTES or payload_len < 0:
            raise CorruptEntryError(f"remote value: bad metadata length {meta_len}")
        start, payload_start = codec.frame_offsets(meta_len)
        total = payload_start + payload_len
        buffer = alloc(total) if alloc is not None else torch.empty(total, dtype=torch.uint8)
        out = buffer[:total].numpy()
        at = start
        for piece, n in zip(pieces, sizes, strict=True):
            out[at : at + n] = np.frombuffer(piece, dtype=np.uint8)
            at += n
        value = out[start:total].data
        header = codec.verify(value)
        self.count("bytes_read", manifest.value_len)
        payload = buffer[payload_start:total]
        return Entry(payload.view(header.dtype).view(header.shape), meta=codec.meta(value, header))

    def _dropped(self, key: bytes) -> None:
        if self._on_corrupt is not None:
            self._on_corrupt(key)

    def _unlink_chunks(self, key: bytes, old_head: bytes | None, keep: bytes | None) -> None:
        """Best effort: the chunks of a head just replaced or deleted (else they expire)."""
        if old_head is None:
            return
        try:
            manifest = parse_head(old_head)
        except CorruptEntryError:
            return
        if manifest.kind != CHUNKED or manifest.nonce == keep:
            return
        names = self.chunk_keys(key, manifest)
        try:
            self._call(lambda c: c.unlink(*names))
        except _Unavailable:
            pass

    # -- calls ---------------------------------------------------------------------------------
    def _call(self, op: Callable[[Any], T]) -> T:
        """Run ``op(client)`` through the breaker; raise ``_Unavailable`` (counted) if it did not
        complete. A server error reply (e.g. OOM under ``maxmemory-policy noeviction``) is an
        error but not an outage: the breaker sees a success."""
        import redis

        if not self.breaker.allow():
            self.count("breaker_skips")
            raise _Unavailable
        try:
            result = op(self._connected())
        except redis.exceptions.ResponseError as e:
            self.breaker.success()
            self.count("errors")
            log.debug("featcache: remote error reply from %s: %s", self._url, e)
            raise _Unavailable from e
        except (redis.exceptions.RedisError, OSError) as e:
            self.count("timeouts" if isinstance(e, (redis.exceptions.TimeoutError, TimeoutError))
                       else "errors")
            self.breaker.failure()
            self._note_state(e)
            raise _Unavailable from e
        except Exception as e:  # anything else the client raises is a miss too, never a failed get
            self.count("errors")
            self.breaker.failure()
            if not self._logged_unexpected:
                self._logged_unexpected = True
                log.exception("featcache: unexpected error from the remote tier %s (logged once)",
                              self._url)
            raise _Unavailable from e
        self.breaker.success()
        self._note_state(None)
        return result

    def _connected(self) -> Any:
        with self._client_lock:
            if self._client is None:
                self._client = self._factory()
            return self._client

    def _note_state(self, error: BaseException | None) -> None:
        """Log outages once: when the breaker opens and when a call succeeds again."""
        is_open = self.breaker.is_open
        if is_open and not self._was_open:
            log.warning(
                "featcache: remote tier %s unreachable (%s: %s); skipping it for %.1f s at a time "
                "until a call succeeds", self._url, type(error).__name__, error, self.breaker.cooldown_s,
            )
        elif error is None and self._was_open:
            log.warning("featcache: remote tier %s reachable again", self._url)
        self._was_open = is_open


def server_summary(config: CacheConfig, max_entries: int = 1_000_000) -> dict[str, Any]:
    """What the server at ``config.remote_url`` holds for ``config.remote_prefix`` (for
    ``featcache stats``): entries (heads counted with SCAN, at most ``max_entries``), the server's
    memory and eviction settings. Read-only; the URL is reported without its password. Raises
    ``FeatCacheError`` when the server cannot be read."""
    from ..errors import FeatCacheError

    prefix = namespace(config.remote_prefix)
    client = connect(replace(config, remote_timeout_ms=max(config.remote_timeout_ms, 5000)))
    try:
        memory = client.info("memory")
        if "used_memory" not in memory:  # a cluster answers per node
            nodes = list(memory.values())
            memory = {"used_memory": sum(n.get("used_memory", 0) for n in nodes),
                      "maxmemory": sum(n.get("maxmemory", 0) for n in nodes),
                      "maxmemory_policy": nodes[0].get("maxmemory_policy") if nodes else None}
        entries = 0
        for _ in client.scan_iter(match=f"{prefix}:*:h", count=1000):
            entries += 1
            if entries >= max_entries:
                break
    except Exception as e:  # the client's own errors: say what failed, without the URL's secret
        raise FeatCacheError(f"cannot read {config.remote_url_redacted}: {type(e).__name__}: {e}") from None
    finally:
        client.close()
    return {"url": config.remote_url_redacted, "prefix": prefix, "entries": entries,
            "entries_capped": entries >= max_entries, "used_memory_bytes": memory.get("used_memory"),
            "maxmemory_bytes": memory.get("maxmemory"),
            "maxmemory_policy": memory.get("maxmemory_policy")}
