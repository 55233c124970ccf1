"""The admission books' count of how often keys were used lately (``featcache.eviction.admission``):
a count-min sketch of 4-bit counters that ages by halving, TinyLFU's (Einziger, Friedman and
Manes 2017) as Caffeine lays it out: the four counters of a key in one 64-byte block."""

from __future__ import annotations

import zlib

MIN_ENTRIES = 1024  # the sketch is sized for at least this many entries
MAX_COUNT = 15  # 4-bit counters
BYTES_PER_ENTRY = 16  # sketch counters (a byte each) per entry it is sized for

_HALF = bytes(i >> 1 for i in range(256))


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class FrequencySketch:
    """How often keys not held were used lately: a count-min sketch (Cormode & Muthukrishnan
    2005), 4 counters per key (capped at ``MAX_COUNT``) in one 64-byte block (one cache line, a
    counter in each quarter), ``BYTES_PER_ENTRY`` counters per entry it is sized for.

    A key is known by its hash, ``hash_of(key)`` (crc32: deterministic across processes; the
    block from its low bits, the four counters from its high 16, independent up to 512k
    entries). An estimate never undercounts a key's uses since the last ``halve``; it overcounts
    only by collisions. The owner halves it (``AdmissionBooks`` does every ``SAMPLE`` x
    ``entries`` uses)."""

    def __init__(self, entries: int = MIN_ENTRIES) -> None:
        self.entries = 0
        self.table = bytearray()
        self.resize(entries)

    @staticmethod
    def hash_of(key: bytes) -> int:
        return zlib.crc32(key)

    def resize(self, entries: int) -> None:
        """Size for ``entries`` (at least ``MIN_ENTRIES``); forgets every count."""
        self.entries = _pow2(max(entries, MIN_ENTRIES))
        self.table = bytearray(BYTES_PER_ENTRY * self.entries)
        self._blocks = len(self.table) // 64 - 1  # a mask

    def slots(self, h: int) -> tuple[int, int, int, int]:
        base = (h & self._blocks) << 6
        return (base + ((h >> 16) & 15), base + 16 + ((h >> 20) & 15),
                base + 32 + ((h >> 24) & 15), base + 48 + ((h >> 28) & 15))

    def estimate(self, h: int) -> int:
        t = self.table
        base = (h & self._blocks) << 6
        return min(t[base + ((h >> 16) & 15)], t[base + 16 + ((h >> 20) & 15)],
                   t[base + 32 + ((h >> 24) & 15)], t[base + 48 + ((h >> 28) & 15)])

    def increment(self, h: int) -> int:
        """Count one use of the key of hash ``h``; its estimate after it."""
        t = self.table
        base = (h & self._blocks) << 6
        a = base + ((h >> 16) & 15)
        b = base + 16 + ((h >> 20) & 15)
        c = base + 32 + ((h >> 24) & 15)
        d = base + 48 + ((h >> 28) & 15)
        x = t[a]  # the least of the four before, in x (each counter capped at MAX_COUNT)
        if x < MAX_COUNT:
            t[a] = x + 1
        y = t[b]
        if y < MAX_COUNT:
            t[b] = y + 1
        if y < x:
            x = y
        y = t[c]
        if y < MAX_COUNT:
            t[c] = y + 1
        if y < x:
            x = y
        y = t[d]
        if y < MAX_COUNT:
            t[d] = y + 1
        if y < x:
            x = y
        return x + 1 if x < MAX_COUNT else MAX_COUNT

    def record(self, h: int, count: int) -> None:
        """Raise the counters of the key of hash ``h`` to at least ``count`` (an evicted key's
        own count, kept for its return)."""
        t = self.table
        base = (h & self._blocks) << 6  # slots(h), inlined
        i = base + ((h >> 16) & 15)
        if t[i] < count:
            t[i] = count
        i = base + 16 + ((h >> 20) & 15)
        if t[i] < count:
            t[i] = count
        i = base + 32 + ((h >> 24) & 15)
        if t[i] < count:
            t[i] = count
        i = base + 48 + ((h >> 28) & 15)
        if t[i] < count:
            t[i] = count

    def halve(self) -> None:
        """Age every count: halved (in C)."""
        self.table = bytearray(self.table.translate(_HALF))
