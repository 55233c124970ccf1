"""Data URLs seen before: their bytes' key without base64-decoding them again.

A chat client resends the same data URL every turn. Keying it means base64-decoding ~5 MB and
hashing the bytes (1.5 ms on the CPU machine, 5 ms on the H200 host under a running engine; issue
16). ``DataUrlKeys`` remembers, per data URL text (its digest, with the item's per-image
parameters and the request's decode options), the ``ImageKey`` its bytes gave: a repeat is keyed
by hashing the text alone.

Invariant: an entry maps a data URL's exact text, parameters and decode options to the key those
give; decoding is deterministic, so the entry never goes stale (an evicted image's key simply
misses in the cache, and the caller decodes). An entry is one digest of all three, keyed BLAKE3
under a random key of this map's own (it never leaves the process): a client can neither predict
it nor craft two data URLs that share an entry (issue 26), and no entry holds a client's text,
so every entry weighs the same however large the options or the URL (issue 39: the options' text
held in each entry made 240 URLs with 1 MiB of options 241 MiB). Bounded (LRU) by entries and by
bytes (``capacity_bytes``, each entry weighed with what a dict entry costs), thread-safe
(lmdeploy resolves requests on its executor's threads).
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any

import blake3

from ...eviction.lrumap import LruMap
from ...keys import ImageKey
from .media import ImageOptions

CAPACITY = 4096  # entries
CAPACITY_BYTES = 2 << 20  # ~4,600 entries
# what an entry costs beyond its two digests (measured with tracemalloc, CPython 3.11: the
# OrderedDict entry, the two bytes objects, the ImageKey's attribute dict)
ENTRY_OVERHEAD_BYTES = 384


def _weigh(ident: bytes, key: ImageKey) -> int:
    return len(ident) + len(key) + ENTRY_OVERHEAD_BYTES


class DataUrlKeys(LruMap[bytes, ImageKey]):
    def __init__(self, capacity: int = CAPACITY, capacity_bytes: int = CAPACITY_BYTES) -> None:
        super().__init__(capacity, capacity_bytes, _weigh)
        self._secret = os.urandom(32)

    def ident(self, url: str, params: dict[str, Any], io: dict[str, Any]) -> bytes | None:
        """What identifies a data URL item: one 32-byte digest of its text, its per-image
        parameters and the request's decode options (None where those are not plain JSON: not
        remembered). ``io``: an ``ImageOptions`` brings its JSON text, made once per request."""
        try:
            item = json.dumps(params, sort_keys=True, allow_nan=False)
            options = io.text if isinstance(io, ImageOptions) else json.dumps(
                io, sort_keys=True, allow_nan=False)
        except (TypeError, ValueError, RecursionError):
            return None
        digest = blake3.blake3(key=self._secret, max_threads=blake3.blake3.AUTO)
        # framed (each part after its length): no two different items give one stream
        for part in (item.encode("utf-8", "surrogatepass"), options.encode("utf-8", "surrogatepass"),
                     url.encode("utf-8", "surrogatepass")):  # (JSON text may hold lone surrogates)
            digest.update(struct.pack("<Q", len(part)))
            digest.update(part)
        return digest.digest()
