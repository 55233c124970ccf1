"""The LMDB layout of a featcache store: its tables, the bytes of each record, the format tag and
the key limits. The one home of all of it: the disk tier (``featcache.tiers.disk`` and
``store.books``) writes records through these functions, the store tools (``featcache.storetools``)
read them through the same ones; no other module packs, unpacks or names a record.

Tables (named databases of one LMDB environment, ``TABLES``):
- ``data``: key -> value (``featcache.codec``'s format: header + metadata + raw tensor bytes);
- ``meta``: key -> (last use stamp, value length): two little-endian u64 (``pack_meta``);
- ``lru``:  (last use stamp, big-endian u64) + key -> b"": the eviction order, oldest first
  (big-endian, so LMDB's byte order of the records is the order of their stamps);
- ``info``: b"format" -> ``FORMAT_TAG``, b"used_bytes" -> little-endian u64, the sum of the value
  lengths (``pack_used``). The store records no budget: each process brings its own.
A stamp is a time in ns since the epoch.

Readers never trust a record: every ``unpack_*`` returns None for a record of the wrong length,
and ``records_problem`` is the one rule for whether a key's ``data`` and ``meta`` records agree.

Key limits: LMDB keys are at most ``LMDB_MAX_KEY_BYTES`` (511) bytes in every table, and a key's
lru record is an 8-byte stamp + the key, so a cache key is at most ``MAX_KEY_BYTES`` (503) bytes.
A value is at most ``MAX_VALUE_BYTES`` (LMDB's MAXDATASIZE).
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import lmdb

from ..errors import StoreFormatError, StoreOpenError

# Any change to a table or a record bumps this tag (and so does a change of the value format:
# ``codec.FORMAT_VERSION``): a store of another tag is refused at open, never misread.
FORMAT_TAG = b"featcache-lmdb-2"
TABLES = (b"data", b"meta", b"lru", b"info")  # in the order they are opened (``Tables``)
INFO_TABLE = TABLES[3]
FORMAT_RECORD = b"format"  # info table
USED_RECORD = b"used_bytes"  # info table

_META = struct.Struct("<QQ")  # stamp, size
_STAMP = struct.Struct(">Q")  # the prefix of an lru record
_U64 = struct.Struct("<Q")  # used_bytes

LMDB_MAX_KEY_BYTES = 511  # LMDB's default key size limit, for the keys of every table
# The longest cache key: its lru record (an 8-byte stamp + the key) must fit as well.
MAX_KEY_BYTES = LMDB_MAX_KEY_BYTES - _STAMP.size
MAX_VALUE_BYTES = 0xFFFFFFFF  # LMDB's largest value (MAXDATASIZE); a larger put fails its txn


class Tables(NamedTuple):
    """The handles of the four tables of one open environment."""

    data: lmdb._Database
    meta: lmdb._Database
    lru: lmdb._Database
    info: lmdb._Database


class Meta(NamedTuple):
    """A decoded meta record: the key's last use stamp (ns) and its value's length (bytes)."""

    stamp: int
    size: int


class OtherFormatError(StoreFormatError):
    """The directory holds a featcache store of another format version (``tag``)."""

    def __init__(self, message: str, tag: bytes) -> None:
        super().__init__(message)
        self.tag = tag


# -- tables and format ---------------------------------------------------------------------------
def open_tables(env: lmdb.Environment, path: str, *, create: bool) -> Tables:
    """Open (or, with ``create``, create) the four tables of ``env``, the store at ``path``.

    Raises ``StoreFormatError`` if one is missing or is not a plain table (not a featcache store)
    and ``StoreOpenError`` for any other LMDB error; ``env`` is left open (the caller closes it).
    """
    handles = []
    for name in TABLES:
        try:
            handles.append(env.open_db(name, create=create))
        except (lmdb.NotFoundError, lmdb.IncompatibleError) as e:
            raise StoreFormatError(
                f"{path!r} is not a featcache store (an LMDB environment without a "
                f"{name.decode()!r} table)"
            ) from e
        except lmdb.Error as e:
            raise StoreOpenError(
                f"cannot open the {name.decode()!r} table of the store at {path!r}: {e}"
            ) from e
    return Tables(*handles)


def new_store_records() -> tuple[tuple[bytes, bytes], ...]:
    """The info records a new, empty store starts with (key, value)."""
    return ((FORMAT_RECORD, FORMAT_TAG), (USED_RECORD, pack_used(0)))


def check_format(path: str, tag: bytes | memoryview | None) -> None:
    """Refuse the store at ``path`` unless its format record ``tag`` is ``FORMAT_TAG``: raise
    ``StoreFormatError`` when there is none, ``OtherFormatError`` when it names another."""
    found = bytes(tag) if tag is not None else b""
    if not found:
        raise StoreFormatError(format_message(path, found))
    if found != FORMAT_TAG:
        raise OtherFormatError(format_message(path, found), found)


def format_message(path: str, tag: bytes) -> str:
    """Why the store at ``path`` with format record ``tag`` is refused, and what to do."""
    if not tag:
        return f"{path!r} is not a featcache store (no format record)"
    return (
        f"{path!r} holds a featcache store of format {tag.decode('ascii', 'replace')!r}; this "
        f"featcache reads {FORMAT_TAG.decode()!r}: delete it with `featcache purge --all {path}` "
        "or point the cache elsewhere"
    )


def is_featcache_tag(tag: bytes) -> bool:
    """Whether ``tag`` names a featcache format of any version (this one or another)."""
    return tag.startswith(b"featcache-")


# -- records ---------------------------------------------------------------------------------------
def key_storable(key: bytes) -> bool:
    """Whether every record of ``key`` fits LMDB: 1 to ``MAX_KEY_BYTES`` bytes."""
    return 0 < len(key) <= MAX_KEY_BYTES


def pack_meta(stamp: int, size: int) -> bytes:
    return _META.pack(stamp, size)


def unpack_meta(raw: bytes | memoryview | None) -> Meta | None:
    """The (stamp, size) of a meta record, or None if absent or malformed."""
    if raw is None or len(raw) != _META.size:
        return None
    stamp, size = _META.unpack(raw)
    return Meta(int(stamp), int(size))


def lru_record(stamp: int, key: bytes) -> bytes:
    """The lru table's key for ``key`` last used at ``stamp``."""
    return _STAMP.pack(stamp) + key


def unpack_lru(record: bytes) -> tuple[int, bytes] | None:
    """(stamp, key) of an lru record, or None if it is too short to hold a key. The stamp is as
    stored: whether it is plausible is the reader's call."""
    if len(record) <= _STAMP.size:
        return None
    return int(_STAMP.unpack(record[: _STAMP.size])[0]), record[_STAMP.size :]


def pack_used(used: int) -> bytes:
    return _U64.pack(used)


def unpack_used(raw: bytes | memoryview | None) -> int | None:
    """The ``used_bytes`` record's count, or None if absent or malformed."""
    if raw is None or len(raw) != _U64.size:
        return None
    return int(_U64.unpack(raw)[0])


def info_records(txn: lmdb.Transaction, db: lmdb._Database) -> dict[str, int | str]:
    """The info table, for people: u64 records as ints, others (the format tag) as text."""
    out: dict[str, int | str] = {}
    for raw_key, raw in txn.cursor(db=db):
        name = bytes(raw_key).decode("ascii", "replace")
        value = bytes(raw)
        count = unpack_used(value) if name != FORMAT_RECORD.decode() else None
        out[name] = count if count is not None else value.decode("ascii", "replace")
    return out


def records_problem(value: bytes | memoryview | None, raw_meta: bytes | memoryview | None) -> str | None:
    """What is wrong with one key's ``data`` record ``value`` and ``meta`` record ``raw_meta``,
    or None if they agree (or neither exists). The value's own bytes are ``codec.verify``'s."""
    meta = unpack_meta(raw_meta)
    if raw_meta is not None and meta is None:
        return "malformed meta record"
    if meta is None:
        return None if value is None else "value without a meta record"
    if value is None:
        return "meta record without a value"
    if len(value) != meta.size:
        return f"meta record says {meta.size} bytes, the value holds {len(value)}"
    return None

