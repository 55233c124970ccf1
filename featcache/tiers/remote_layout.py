"""The remote tier's layout on a Redis/Valkey server: key names, the head (manifest) format and the
chunking of values. Read by the tier (``featcache.tiers.remote``) and by ``server_summary``.

For a cache key whose hex is ``H`` and the namespace ``N`` (``namespace(prefix)``)::

    N:{H}:h          the head: a small manifest, or the whole value inline if it fits one chunk
    N:{H}:<nonce>:i  chunk i of the value written with that nonce (8 random bytes, in hex)

The ``{H}`` hash tag puts all of an entry's keys in one Cluster slot. The manifest (``HEAD``) holds
the nonce, the value's length, the chunk size and count, and an xxh3-64 digest of those fields.
A value is the disk tier's value (``featcache.codec``: header, metadata, payload, checksum).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass

import xxhash

from .. import codec
from ..errors import CorruptEntryError

HEAD_MAGIC = b"FCr\x01"
# magic, kind (0 inline, 1 chunked), nonce, value length, chunk size, chunk count, xxh3-64 digest
HEAD = struct.Struct("<4sB3x8sQII8s")
INLINE, CHUNKED = 0, 1
CHUNK_TTL_MARGIN_S = 60  # chunks outlive their head by this much, so a head never outlives them
MAX_CHUNKS = 1 << 16  # a head asking for more is corrupt (bounds what a bad head can make us read)


def namespace(prefix: str) -> str:
    """The key prefix of a cache's entries: its ``remote_prefix`` and the value format's version."""
    return f"{prefix}:v{codec.FORMAT_VERSION}"


@dataclass(frozen=True)
class Manifest:
    kind: int
    nonce: bytes
    value_len: int
    chunk_bytes: int
    chunks: int
    inline: memoryview | None = None  # the value, for an inline head


def head_key(space: str, key: bytes) -> str:
    return f"{space}:{{{key.hex()}}}:h"


def chunk_keys(space: str, key: bytes, manifest: Manifest) -> list[str]:
    base = f"{space}:{{{key.hex()}}}:{manifest.nonce.hex()}"
    return [f"{base}:{i}" for i in range(manifest.chunks)]


def pack_head(kind: int, nonce: bytes, value_len: int, chunk_bytes: int, chunks: int) -> bytes:
    fields = HEAD.pack(HEAD_MAGIC, kind, nonce, value_len, chunk_bytes, chunks, b"\0" * 8)
    digest = xxhash.xxh3_64_digest(fields[: HEAD.size - 8])
    return fields[: HEAD.size - 8] + digest


def parse_head(raw: bytes) -> Manifest:
    """Validate a head; raise ``CorruptEntryError`` on anything off."""
    view = memoryview(raw)
    if view.nbytes < HEAD.size:
        raise CorruptEntryError("remote head shorter than a manifest")
    magic, kind, nonce, value_len, chunk_bytes, chunks, digest = HEAD.unpack_from(view)
    if magic != HEAD_MAGIC or digest != xxhash.xxh3_64_digest(view[: HEAD.size - 8]):
        raise CorruptEntryError("remote head: bad magic or digest")
    if kind == INLINE:
        if chunks != 0 or value_len != view.nbytes - HEAD.size:
            raise CorruptEntryError("remote head: inline length mismatch")
        return Manifest(kind, nonce, value_len, chunk_bytes, 0, view[HEAD.size :])
    if (
        kind != CHUNKED or view.nbytes != HEAD.size or chunk_bytes < 1 or not 0 < chunks <= MAX_CHUNKS
        or chunks != -(-value_len // chunk_bytes)
    ):
        raise CorruptEntryError("remote head: bad chunk layout")
    return Manifest(kind, nonce, value_len, chunk_bytes, chunks)


def max_value_bytes(chunk_bytes: int) -> int:
    """The longest value a head can name (``MAX_CHUNKS`` chunks): a longer one would read as
    corrupt, so it is never published."""
    return MAX_CHUNKS * chunk_bytes


def split(lead: bytes, payload: memoryview, chunk_bytes: int) -> Iterator[bytes | memoryview]:
    """The value ``lead + payload`` in pieces of ``chunk_bytes`` (the last may be shorter); only
    the first piece is copied (it joins the lead to the payload's start)."""
    first = chunk_bytes - len(lead)
    if first <= 0:  # a lead longer than a chunk (64 KiB of metadata in 4 KiB chunks)
        value = memoryview(lead + payload)
        for start in range(0, value.nbytes, chunk_bytes):
            yield value[start : start + chunk_bytes]
        return
    yield lead + payload[:first]
    for start in range(first, payload.nbytes, chunk_bytes):
        yield payload[start : start + chunk_bytes]
