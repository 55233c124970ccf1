"""What a reading of a store hands back: typed records of a store and its entries, read-only
(the store tools' ``StoreView`` and ``FeatureCache.verify`` alike).

``describe`` is the one place a tool turns a stored value into an ``EntryInfo``: the value's
header is ``codec``'s to decode and verify, the records around it are ``store.layout``'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .. import codec
from ..errors import CorruptEntryError


@dataclass(frozen=True)
class EntryInfo:
    """One stored entry as read from the store.

    ``size``: the value's length in bytes (header + metadata + payload), what the budget counts.
    ``last_use_ns``: the lru stamp (ns since the epoch), None if the meta record is missing or
    malformed. ``header`` is None when the value's header is invalid; ``problem`` then says why,
    and also says why the checksum failed when ``checksum_ok`` is False (None: not checked).
    """

    key: bytes
    size: int
    last_use_ns: int | None
    header: codec.Header | None
    meta: bytes = b""
    problem: str | None = None
    checksum_ok: bool | None = None


@dataclass(frozen=True)
class Summary:
    """What a store directory holds, read in one read transaction.

    ``capacity_bytes`` is the budget recorded in the store's ``info`` table, None when none is
    recorded (each process sets its own ``disk_bytes``; the store keeps only ``used_bytes``).
    ``in_use_by``: the pid of a process that has the store open, 0 when none, None if unknown.
    Sizes of ``data.mdb``: ``data_file_bytes`` the file; ``pages_bytes`` its high-water mark
    (LMDB's last page in use + 1: it never goes down); ``live_bytes`` the pages its B-trees hold
    now (meta pages, tables); the rest, ``reclaimable_bytes``, is free pages, which later writes
    reuse but only a compacted copy gives back to the file system (``featcache compact``).
    """

    path: str
    format_tag: str
    value_format_version: int
    entries: int
    used_bytes: int | None
    capacity_bytes: int | None
    oldest_use_ns: int | None
    newest_use_ns: int | None
    map_size: int
    data_file_bytes: int
    pages_bytes: int
    live_bytes: int
    page_size: int
    in_use_by: int | None
    info: dict[str, int | str] = field(default_factory=dict)

    @property
    def reclaimable_bytes(self) -> int:
        """What a compacted copy would give back: the data file less its live pages."""
        return max(0, self.data_file_bytes - self.live_bytes)


@dataclass
class VerifyReport:
    """The outcome of ``StoreView.verify``: ``bad`` entries fail ``codec.verify`` or have broken
    books (a value without its meta record, or the reverse, or a size that disagrees); ``notes``
    are book problems that deleting an entry does not repair (reported, not counted as bad)."""

    checked: int = 0
    checked_bytes: int = 0
    bad: list[EntryInfo] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    deleted: int | None = None  # with a fix: the bad entries deleted (None: nothing was fixed)


def describe(key: bytes, value: memoryview | bytes, stamp: int | None, *, check: bool) -> EntryInfo:
    """An EntryInfo from a value read in the caller's transaction (copies what it keeps);
    ``check``: verify the checksum too, not only the header."""
    size = len(value)
    try:
        header = codec.verify(value) if check else codec.decode_header(value)
    except CorruptEntryError as e:
        readable: codec.Header | None = None
        try:
            readable = codec.decode_header(value)  # a checksum failure still has a readable header
        except CorruptEntryError:
            pass
        meta = codec.meta(value, readable) if readable is not None else b""
        return EntryInfo(key, size, stamp, readable, meta, problem=str(e),
                         checksum_ok=False if check else None)
    return EntryInfo(key, size, stamp, header, codec.meta(value, header),
                     checksum_ok=True if check else None)


def broken(key: bytes, size: int, stamp: int | None, problem: str) -> EntryInfo:
    """An entry whose records disagree (``layout.records_problem``)."""
    return EntryInfo(key, size, stamp, None, problem=problem)
