"""Data URLs seen before: their bytes' key without base64-decoding them again.

A chat client resends the same data URL every turn. Keying it means base64-decoding ~5 MB and
hashing the bytes (1.5 ms on the CPU machine, 5 ms on the H200 host under a running engine; issue
16). ``DataUrlKeys`` remembers, per data URL text (its xxh3_128 digest, with the item's per-image
parameters), the ``ImageKey`` its bytes gave: a repeat is keyed by hashing the text alone.

Invariant: an entry maps a data URL's exact text to the key of the bytes that text decodes to;
decoding is deterministic, so the entry never goes stale (an evicted image's key simply misses in
the cache, and the caller decodes). The digest is xxh3_128, as the keys themselves are by default:
not collision-resistant against an adversary (docs/design.md, "Keys"). Bounded (LRU), thread-safe
(lmdeploy resolves requests on its executor's threads).
"""

from __future__ import annotations

import json
from typing import Any

import xxhash

from ..keys import ImageKey
from ..lrumap import LruMap


class DataUrlKeys(LruMap[tuple[bytes, str], ImageKey]):
    def __init__(self, capacity: int = 4096) -> None:
        super().__init__(capacity)

    @staticmethod
    def ident(url: str, params: dict[str, Any]) -> tuple[bytes, str]:
        """What identifies a data URL item: its text's digest and its per-image parameters."""
        text = url.encode("utf-8", "surrogatepass")  # (a JSON string may hold lone surrogates)
        return xxhash.xxh3_128_digest(text), json.dumps(params, sort_keys=True, default=str)
