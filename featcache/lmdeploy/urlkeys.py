"""Data URLs seen before: their bytes' key without base64-decoding them again.

A chat client resends the same data URL every turn. Keying it means base64-decoding ~5 MB and
hashing the bytes (1.5 ms on the CPU machine, 5 ms on the H200 host under a running engine; issue
16). ``DataUrlKeys`` remembers, per data URL text (its digest, with the item's per-image
parameters and the request's decode options), the ``ImageKey`` its bytes gave: a repeat is keyed
by hashing the text alone.

Invariant: an entry maps a data URL's exact text, parameters and decode options to the key those
give; decoding is deterministic, so the entry never goes stale (an evicted image's key simply
misses in the cache, and the caller decodes). The digest is keyed BLAKE3 under a random key of
this map's own (it never leaves the process): a client can neither predict it nor craft two data
URLs that share an entry (issue 26). Bounded (LRU), thread-safe (lmdeploy resolves requests on
its executor's threads).
"""

from __future__ import annotations

import json
import os
from typing import Any

import blake3

from ..keys import ImageKey
from ..lrumap import LruMap


class DataUrlKeys(LruMap[tuple[bytes, str], ImageKey]):
    def __init__(self, capacity: int = 4096) -> None:
        super().__init__(capacity)
        self._secret = os.urandom(32)

    def ident(self, url: str, params: dict[str, Any], io: dict[str, Any]) -> tuple[bytes, str] | None:
        """What identifies a data URL item: its text's digest, its per-image parameters and the
        request's decode options (None where those are not plain JSON: not remembered)."""
        try:
            extra = json.dumps([params, io], sort_keys=True, allow_nan=False)
        except (TypeError, ValueError):
            return None
        text = url.encode("utf-8", "surrogatepass")  # (a JSON string may hold lone surrogates)
        return blake3.blake3(text, key=self._secret, max_threads=blake3.blake3.AUTO).digest(), extra
