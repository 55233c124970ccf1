"""The small exception hierarchy of featcache.

Misses are never exceptions: a lookup that finds nothing (or finds a bad entry) returns ``None``.
Caller misuse raises ``ValueError``/``TypeError``; these classes are for conditions of the store
itself that a user can act on.
"""


class FeatCacheError(Exception):
    """Base class of featcache's own errors."""


class StoreOpenError(FeatCacheError):
    """The disk store cannot be opened (missing permissions, read-only directory, bad path)."""


class StoreFormatError(StoreOpenError):
    """The directory holds a store of another format version; move it away or purge it."""


class CorruptEntryError(FeatCacheError):
    """A stored value failed validation (bad magic, header, length or checksum)."""
