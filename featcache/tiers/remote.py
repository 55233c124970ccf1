"""Remote tier: features shared by a fleet of replicas through Redis or Valkey (one server or a
Redis Cluster), with the redis-py client. Synchronous like every tier: the cache reads it on a
local miss (the request path's only network call, bounded by ``remote_timeout_ms``) and the
publisher thread (its ``featcache.core.writer.TierWriter``) writes it, through ``write``.

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
- every call goes through a circuit breaker (``featcache.tiers.remote_calls``; a Redis Cluster: a
  breaker per node, a deadline per call): a failed call (refused, timed out, connection lost) is
  a miss or an unpublished entry, counted; after ``remote_breaker_failures`` in a row the server
  (a cluster's node) is skipped for ``remote_breaker_cooldown_ms``;
- the URL's password never appears in logs, ``repr`` or stats (``config.redact_url``).

A Redis Cluster (``redis-cluster://`` or ``rediss-cluster://``, any node's address) is driven by
redis-py's ``RedisCluster`` (``featcache.tiers.remote_calls`` says how its calls are bounded).
All of an entry's keys share one hash tag, so every call is one slot's, on one node; a read is
assembled by the caller, and a publish's head is written only after its chunks' call returned in
time, so what an abandoned call still does on a worker thread is discarded.

The fleet's key secret (``featcache.keysecret``) lives on the same server: ``keep_secret`` gives
the tier the one this process keys with, and the publisher sets it again (``SET NX``) after an
outage or every ``SECRET_CHECK_S``, so a server that lost it (a restart without persistence, a
flush) gets it back before a new replica would make up another; a server holding another secret is
counted (``secret_mismatch``) and said once, never adopted (this process's keys stay as they are).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from .. import codec
from ..config import CacheConfig
from ..core.copier import as_bytes
from ..errors import CorruptEntryError
from .base import Alloc, Entry, Op
from .breaker import Breaker
from .remote_calls import RemoteCalls, Unavailable, connect
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

STAT_NAMES = (
    "hits", "misses", "corrupt", "incomplete", "errors", "timeouts", "breaker_skips",
    "published", "publish_errors", "publish_dropped", "discards", "bytes_read", "bytes_published",
    "secret_restored", "secret_mismatch",
)
SECRET_CHECK_S = 60.0  # the publisher checks the fleet's key secret on the server this often


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
        cluster: bool = False,
        deadline_s: float | None = None,
    ) -> None:
        """``cluster``: the client is a ``RedisCluster`` (a breaker per node, and calls run on
        worker threads, each abandoned after ``deadline_s``)."""
        self._factory = client_factory
        self.prefix = namespace(prefix)
        self.ttl_s = ttl_s
        self.chunk_bytes = chunk_bytes
        self.breaker = breaker
        self._url = url_for_logs
        self._on_corrupt = on_corrupt
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._calls = RemoteCalls(self._new_client, breaker, count=self.count,
                                  on_outage=self._secret_lost, url_for_logs=url_for_logs,
                                  cluster=cluster, deadline_s=deadline_s)
        self._secret: tuple[str, bytes] | None = None
        self._secret_due = 0.0  # monotonic time of the next check (0: at the next publish)
        self._secret_mismatch_said = False

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
            cluster=(config.remote_url or "").partition("://")[0].endswith("-cluster"),
            deadline_s=config.remote_timeout_ms / 1000,
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
            name = self.head_key(key)
            return bool(self._calls.call(lambda c: c.exists(name), name))
        except Unavailable:
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
                old = self._calls.call(lambda c: c.set(head_key, head, ex=ttl, get=True), head_key)
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

                self._calls.call(write_chunks, head_key)  # raises on any failed SET: no head written
                head = pack_head(CHUNKED, nonce, value_len, self.chunk_bytes, manifest.chunks)
                old = self._calls.call(lambda c: c.set(head_key, head, ex=ttl, get=True), head_key)
        except Unavailable:
            self.count("publish_errors")
            return False
        self.count("published")
        self.count("bytes_published", value_len)
        self._unlink_chunks(key, old, keep=nonce)
        return True

    def discard(self, key: bytes) -> bool:
        """Delete ``key`` (its head, then its chunks). False if the server could not be reached."""
        try:
            name = self.head_key(key)
            old = self._calls.call(lambda c: c.getdel(name), name)
        except Unavailable:
            return False
        self.count("discards")
        self._unlink_chunks(key, old, keep=None)
        return old is not None

    def write(self, ops: Sequence[Op]) -> None:
        """Apply ``ops`` in order (the publisher thread): publish puts, delete discards. A publish
        that fails leaves the server's value as it was (counted in ``publish_errors``)."""
        self._check_secret()
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
        nodes = self._calls.node_breakers()
        return {
            **counts,
            "breaker_open": int(self.breaker.is_open),
            "breaker_open_nodes": sum(b.is_open for b in nodes),
            "breaker_opened": self.breaker.opened + sum(b.opened for b in nodes),
            "enabled": 1,
        }

    def keep_secret(self, name: str, secret: bytes) -> None:
        """The fleet's key secret this process keys with, kept on the server under ``name``
        (see the module docstring)."""
        self._secret = (name, secret)
        self._secret_due = time.monotonic() + SECRET_CHECK_S  # just read or set at start

    def _check_secret(self) -> None:
        """On the publisher thread, when due: set the secret again where the server lost it."""
        if self._secret is None or time.monotonic() < self._secret_due:
            return
        name, secret = self._secret
        self._secret_due = time.monotonic() + SECRET_CHECK_S
        value = secret.hex().encode()
        try:
            if self._calls.call(lambda c: c.set(name, value, nx=True), name):
                self.count("secret_restored")
                log.warning("featcache: the remote tier %s had lost the fleet's key secret; set it "
                            "again", self._url)
                return
            held = self._calls.call(lambda c: c.get(name), name)
        except Unavailable:
            self._secret_due = 0.0  # try again at the next publish
            return
        if held is not None and bytes(held).strip().lower() != value:
            self.count("secret_mismatch")
            if not self._secret_mismatch_said:
                self._secret_mismatch_said = True
                log.warning("featcache: the remote tier %s holds another key secret than this "
                            "process keys with: its entries and this process's do not meet until "
                            "it restarts", self._url)

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def close(self) -> None:
        self._calls.close()

    def __repr__(self) -> str:
        return f"RemoteTier({self._url!r}, prefix={self.prefix!r})"

    def _new_client(self) -> Any:
        """A new client, from the factory the tier holds now (read at each connect)."""
        return self._factory()

    def _secret_lost(self) -> None:
        """After an outage: check the key secret within a second (the server may have lost it)."""
        self._secret_due = min(self._secret_due, time.monotonic() + 1.0)

    # -- reading -------------------------------------------------------------------------------
    def _read(self, key: bytes, alloc: Alloc | None) -> Entry | None:
        try:
            name = self.head_key(key)
            raw = self._calls.call(lambda c: c.get(name), name)
            if raw is None:
                return None
            manifest = parse_head(raw)
            if manifest.inline is not None:
                pieces: list[bytes | memoryview] = [manifest.inline]
            else:
                names = self.chunk_keys(key, manifest)
                got = self._calls.call(lambda c: c.mget(names), name)
                if any(piece is None for piece in got):
                    self.count("incomplete")  # chunks evicted, expired, or replaced by a newer write
                    self._dropped(key)
                    return None
                pieces = list(got)
            return self._assemble(manifest, pieces, alloc)
        except Unavailable:
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
            self._calls.call(lambda c: c.unlink(*names), names[0])
        except Unavailable:
            pass

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
