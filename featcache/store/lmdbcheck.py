"""A structural check of an LMDB data file (``data.mdb``) before LMDB reads it.

Why: LMDB maps the file and trusts its pages. A page number past the end of a truncated file, or
a node whose key or value size runs outside its page, makes LMDB read past the mapped file
(SIGBUS) or past the page (garbage, or SIGSEGV): the process dies and no Python code can catch it.
LMDB keeps no page checksums. py-lmdb 3.0 builds it with patches that refuse some of this when a
page is read (``lmdb.CorruptedError``: a node, ``mp_lower`` or ``mp_upper`` outside its page, an
overflow run past the pages in use), but nothing checks the end of the file (SIGBUS), and a leaf
page zeroed in place trips an assertion (SIGABRT); tests/test_reliability_lmdbfile.py shows each.

What ``check_data_file`` does, inside one read transaction of the already opened environment
(beginning it reads only the two meta pages; while it lasts, no writer in any process reuses a
page of its snapshot, or of any later one, so a live store can be checked):
- it reads the meta page of that snapshot and every page of every B-tree reachable from it (the
  free list, the main table, every named table, and the duplicate sub-tables of DUPSORT tables)
  with ``os.pread``, never through the map: a read past the end is a short read, not a fault;
- each branch and leaf page must carry its own page number and the type its depth calls for, have
  sane ``mp_lower``/``mp_upper``, and every node must lie inside its page with its key and (inline)
  value; a branch must point at pages in use; a table's depth must be what its record says;
- overflow runs (values over ~2 KiB) are counted with LMDB's ``OVPAGES`` and must lie inside the
  file and the pages in use, but are not read: the bytes of a featcache value are checked by its
  own checksum (``codec.verify``) on every read;
- no page may be reached twice (cycles, cross-links), nor overlap an overflow run.
Reachable pages only: LMDB may leave pages beyond the end of the file that its meta page counts as
in use (``mm_last_pg``) but that the same transaction freed (they were never written; mdb.c: "the
file may be shorter if the freeDB lists the final pages"). That is a healthy store.

Not checked (damage that stays possible): damage after the check (a file cut while mapped,
rot while open); a page that stays structurally valid (a key or stamp changed in place, keys out of
order: lookups may miss, nothing reads outside a page); the header of an overflow run and the
contents of the free list (trusted when LMDB frees or reuses pages); the per-table page and entry
counts (only reported by ``stat``).

Cost: proportional to the branch and leaf pages (about 5 us each, plus 1 to 3 us per node), not
to the values. Measured with ``bench/checks/lmdbcheck.py`` on a shared 2-core AMD EPYC VM (Python 3.11;
ranges over runs on a busy machine): 10,000 entries of 1.5 KiB, stored inside their leaf pages
(6,950 tree pages): 55 to 90 ms warm (35 to 60 ms of CPU), 0.3 s with the file out of the page
cache; 3,000 values of 1 MiB (3 GiB; 771,000 overflow pages counted, not read; 110 tree pages):
10 to 12 ms warm, 11 to 15 ms cold; an empty store: 0.1 ms.

Layout: LMDB 0.9 (mdb.c: ``MDB_page``, ``MDB_node``, ``MDB_db``, ``MDB_meta``) on a 64-bit
little-endian host; on any other host the check is skipped (``None``). LMDB takes its ``fcntl``
locks on ``lock.mdb`` only, so opening and closing a descriptor of ``data.mdb`` here drops none.
"""

from __future__ import annotations

import os
import struct
import sys
from dataclasses import dataclass

import lmdb

from ..errors import StoreOpenError

# mdb.c, LMDB 0.9.36 (MDB_DEVEL off: PAGEBASE is 0, node offsets count from the page start).
PAGEHDRSZ = 16  # mp_pgno u64, mp_pad u16, mp_flags u16, mp_lower u16 + mp_upper u16 | mp_pages
NODESIZE = 8  # mn_lo, mn_hi, mn_flags, mn_ksize: u16 each, then the key, then the data
P_BRANCH, P_LEAF, P_OVERFLOW, P_META, P_LEAF2, P_SUBP = 0x01, 0x02, 0x04, 0x08, 0x20, 0x40
P_TYPES = P_BRANCH | P_LEAF | P_OVERFLOW | P_META | P_LEAF2 | P_SUBP  # P_DIRTY, P_KEEP: ignored
F_BIGDATA, F_SUBDATA, F_DUPDATA = 0x01, 0x02, 0x04
MDB_DUPSORT, MDB_DUPFIXED = 0x04, 0x10
FREE_DBI, MAIN_DBI = 0, 1
NUM_METAS = 2
CURSOR_STACK = 32  # LMDB's deepest tree
P_INVALID = (1 << 64) - 1
MDB_MAGIC = 0xBEEFC0DE
MDB_DATA_VERSION = 1
ATTEMPTS = 3  # a failed walk is retried only when a writer committed meanwhile

_HEAD = struct.Struct("<QHHHH")  # mp_pgno, mp_pad, mp_flags, mp_lower, mp_upper
_NODE = struct.Struct("<HHHH")  # mn_lo, mn_hi, mn_flags, mn_ksize
_DB = struct.Struct("<IHHQQQQQ")  # md_pad, md_flags, md_depth, 3 page counts, entries, md_root
_META = struct.Struct("<IIQQ48s48sQQ")  # magic, version, address, mapsize, dbs[2], last_pg, txnid
_PGNO = struct.Struct("<Q")
_SUPPORTED = sys.byteorder == "little" and struct.calcsize("P") == 8


@dataclass(frozen=True)
class FileCheck:
    """What one check read: the transaction it checked, the branch and leaf pages it read, the
    overflow pages it counted without reading them, and the tables it walked."""

    txnid: int
    tree_pages: int
    overflow_pages: int
    tables: int


class _Damage(Exception):
    """A structural fault; the message says what and where."""


class _Label:
    """A page's name in a message, built only if one is raised."""

    __slots__ = ("pgno", "leaf", "table")

    def __init__(self, pgno: int, leaf: bool, table: str) -> None:
        self.pgno, self.leaf, self.table = pgno, leaf, table

    def __str__(self) -> str:
        return f"page {self.pgno} ({'a leaf' if self.leaf else 'a branch'} of {self.table})"


def check_data_file(env: lmdb.Environment, data_file: str) -> FileCheck | None:
    """Check the structure of ``data_file`` (the ``data.mdb`` of the open ``env``) as its latest
    snapshot sees it; return what was read, or None on a host whose layout this module does not
    know. Raises ``StoreOpenError`` for a damaged or unreadable file (``env`` is left open: the
    caller closes it)."""
    if not _SUPPORTED:
        return None
    store = os.path.dirname(data_file) or "."
    try:
        fd = os.open(data_file, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise StoreOpenError(f"cannot read {data_file!r}: {e.strerror or e}") from e
    try:
        psize = int(env.stat()["psize"])
        for attempt in range(ATTEMPTS):
            with env.begin() as txn:
                txnid = txn.id()
                try:
                    return _Walk(fd, psize).run(txnid)
                except _Damage as e:
                    damage = e
            # A concurrent writer can only matter if it committed since: otherwise the damage is
            # in the snapshot itself, and a second look would see the same.
            with env.begin() as txn:
                if txn.id() == txnid or attempt == ATTEMPTS - 1:
                    raise StoreOpenError(
                        f"the store at {store!r} is damaged: {damage}; move it away or delete it"
                    ) from None
    except lmdb.Error as e:
        raise StoreOpenError(f"cannot check the LMDB store at {store!r}: {e}") from e
    except OSError as e:
        raise StoreOpenError(f"cannot read {data_file!r}: {e.strerror or e}") from e
    finally:
        os.close(fd)
    raise AssertionError("unreachable")  # pragma: no cover


class _Walk:
    """One walk of the trees of one snapshot (see the module docstring for what is checked)."""

    def __init__(self, fd: int, psize: int) -> None:
        self.fd = fd
        self.psize = psize
        self.pages_in_use = 0  # mm_last_pg + 1
        self.file_bytes = 0
        self.seen: set[int] = set()  # branch and leaf pages read
        self.runs: list[tuple[int, int]] = []  # overflow runs: (first page, pages)
        self.tables = 0

    def run(self, txnid: int) -> FileCheck:
        dbs, last_pg = self._meta(txnid)
        self.pages_in_use = last_pg + 1
        # After the meta page: its writer wrote every page it names before it wrote the meta.
        self.file_bytes = os.fstat(self.fd).st_size
        self._tree("the free list", dbs[FREE_DBI], "free")
        self._tree("the main table", dbs[MAIN_DBI], "main")
        self._overlaps()
        return FileCheck(txnid, len(self.seen), sum(n for _, n in self.runs), self.tables)

    def _meta(self, txnid: int) -> tuple[tuple[bytes, bytes], int]:
        """The two core table records and ``mm_last_pg`` of the meta page of ``txnid``.

        A read transaction uses meta page ``txnid & 1``. Should a writer have committed twice
        since it began, that page holds a newer snapshot, whose pages the open reader also keeps
        from reuse: the newest meta then serves as well."""
        metas = []
        for index in range(NUM_METAS):
            raw = os.pread(self.fd, PAGEHDRSZ + _META.size, index * self.psize)
            if len(raw) < PAGEHDRSZ + _META.size:
                raise _Damage(f"meta page {index} lies past the end of data.mdb (truncated)")
            magic, version, _, _, free, main, last_pg, mm_txnid = _META.unpack_from(raw, PAGEHDRSZ)
            if magic != MDB_MAGIC or version != MDB_DATA_VERSION:
                continue  # LMDB checked both at open; one can be mid-rewrite by a writer
            psize = _DB.unpack(free)[0]
            if psize != self.psize:
                raise _Damage(f"meta page {index} gives a page size of {psize}, not {self.psize}")
            metas.append((mm_txnid, index, (free, main), last_pg))
        exact = [m for m in metas if m[0] == txnid]
        newer = sorted(m for m in metas if m[0] > txnid)
        chosen = exact[0] if exact else newer[-1] if newer else None
        if chosen is None:
            raise _Damage(f"no meta page holds transaction {txnid}, the latest LMDB reports")
        _, index, dbs, last_pg = chosen
        if not NUM_METAS - 1 <= last_pg < 1 << 48:
            raise _Damage(f"meta page {index} says {last_pg} is the last page in use")
        return dbs, last_pg

    def _tree(self, name: str, record: bytes, kind: str) -> None:
        """Walk one table; ``kind``: "free", "main", "named" or "dups" (a duplicate sub-table)."""
        pad, flags, depth, _, _, _, _, root = _DB.unpack(record)
        self.tables += 1
        if root == P_INVALID:
            return
        if not 1 <= depth <= CURSOR_STACK:
            raise _Damage(f"{name} has a depth of {depth}")
        leaf_type = P_LEAF | P_LEAF2 if kind == "dups" and flags & MDB_DUPFIXED else P_LEAF
        stack: list[tuple[int, int, int]] = [(root, 1, -1)]  # page, level, parent (-1: root)
        while stack:
            pgno, level, parent = stack.pop()
            leaf = level == depth
            label = _Label(pgno, leaf, name)
            page, got = self._page(pgno, name, parent)
            if got != (leaf_type if leaf else P_BRANCH):
                raise _Damage(f"{label} has type flags {got:#x}")
            if got & P_LEAF2:
                self._leaf2(page, 0, self.psize, pad, label)
            elif not leaf:
                stack.extend((child, level + 1, pgno) for child in self._nodes(
                    page, 0, self.psize, label, branch=True))
            else:
                self._leaf(page, name, flags, kind, label)

    def _page(self, pgno: int, name: str, parent: int) -> tuple[bytes, int]:
        """The page ``pgno`` and its type flags, read once and checked to be itself."""
        if not NUM_METAS <= pgno < self.pages_in_use or pgno in self.seen:
            where = f"the root of {name}" if parent < 0 else f"a child of page {parent} ({name})"
            if pgno in self.seen:
                raise _Damage(f"page {pgno} is reached twice (a cycle or a cross-link): {where}")
            raise _Damage(
                f"{where} is page {pgno}, outside the pages in use (2 to {self.pages_in_use - 1})"
            )
        self.seen.add(pgno)
        page = os.pread(self.fd, self.psize, pgno * self.psize)
        if len(page) < self.psize:
            raise _Damage(
                f"page {pgno} of {name} lies past the end of data.mdb ({self.file_bytes} bytes): "
                "truncated"
            )
        number, _, flags, _, _ = _HEAD.unpack_from(page)
        if number != pgno:
            raise _Damage(f"page {pgno} of {name} holds page number {number}")
        return page, flags & P_TYPES

    def _bounds(self, page: bytes, base: int, size: int, label: object) -> tuple[int, int]:
        """(nodes, mp_upper) of the page at ``page[base:base+size]``, checked."""
        _, _, _, lower, upper = _HEAD.unpack_from(page, base)
        if not PAGEHDRSZ <= lower <= upper <= size or (lower - PAGEHDRSZ) & 1:
            raise _Damage(f"{label} has mp_lower {lower} and mp_upper {upper}")
        return (lower - PAGEHDRSZ) >> 1, upper

    def _nodes(self, page: bytes, base: int, size: int, label: object, *, branch: bool) -> list[int]:
        """Check every node of a branch page (return its children) or a sub-page (no data)."""
        count, upper = self._bounds(page, base, size, label)
        out = []
        for i, ptr in enumerate(struct.unpack_from(f"<{count}H", page, base + PAGEHDRSZ)):
            if ptr < upper or ptr + NODESIZE > size:
                raise _Damage(f"{label}: node {i} is at offset {ptr}, outside its page")
            lo, hi, flags, ksize = _NODE.unpack_from(page, base + ptr)
            end = ptr + NODESIZE + ksize + (0 if branch else lo | hi << 16)
            if end > size:
                raise _Damage(f"{label}: node {i} ends at {end}, past its page")
            if branch:
                child = lo | hi << 16 | flags << 32
                if not NUM_METAS <= child < self.pages_in_use:
                    raise _Damage(f"{label}: node {i} points at page {child}, not in use")
                out.append(child)
        return out

    def _leaf2(self, page: bytes, base: int, size: int, ksize: int, label: object) -> None:
        count, _ = self._bounds(page, base, size, label)
        if ksize == 0 or PAGEHDRSZ + count * ksize > size:
            raise _Damage(f"{label}: {count} keys of {ksize} bytes do not fit")

    def _leaf(self, page: bytes, name: str, db_flags: int, kind: str, label: _Label) -> None:
        count, upper = self._bounds(page, 0, self.psize, label)
        psize = self.psize
        for i, ptr in enumerate(struct.unpack_from(f"<{count}H", page, PAGEHDRSZ)):
            if ptr < upper or ptr + NODESIZE > psize:
                raise _Damage(f"{label}: node {i} is at offset {ptr}, outside its page")
            lo, hi, flags, ksize = _NODE.unpack_from(page, ptr)
            dsize = lo | hi << 16
            data = ptr + NODESIZE + ksize
            if flags & F_BIGDATA:
                if data + 8 > psize:
                    raise _Damage(f"{label}: node {i} ends at {data + 8}, past its page")
                first = _PGNO.unpack_from(page, data)[0]
                pages = (PAGEHDRSZ - 1 + dsize) // psize + 1  # OVPAGES
                if not NUM_METAS <= first or first + pages > self.pages_in_use:
                    raise _Damage(
                        f"{label}: node {i} has a value of {dsize} bytes on pages {first} to "
                        f"{first + pages - 1}, not all in use"
                    )
                if (first + pages) * psize > self.file_bytes:
                    raise _Damage(
                        f"{label}: node {i} has a value on pages {first} to {first + pages - 1}, "
                        f"past the end of data.mdb ({self.file_bytes} bytes): truncated"
                    )
                self.runs.append((first, pages))
                continue
            if data + dsize > psize:
                raise _Damage(f"{label}: node {i} ends at {data + dsize}, past its page")
            if flags & (F_SUBDATA | F_DUPDATA):
                self._nested(page, ptr, data, dsize, flags, name, db_flags, kind, f"{label}: node {i}")

    def _nested(
        self, page: bytes, ptr: int, data: int, dsize: int, flags: int, name: str, db_flags: int,
        kind: str, where: str,
    ) -> None:
        """A node holding a table record (a named table, or a sub-table of duplicates) or a
        sub-page of duplicates."""
        key = bytes(page[ptr + NODESIZE : data])
        if flags & F_DUPDATA and not db_flags & MDB_DUPSORT:
            raise _Damage(f"{where} holds duplicates in a table without them")
        if flags & F_SUBDATA:
            if dsize != _DB.size or (kind == "main") == bool(flags & F_DUPDATA):
                raise _Damage(f"{where} is a malformed table record")
            record = bytes(page[data : data + dsize])
            if kind == "main":
                self._tree(f"the table {key!r}", record, "named")
            else:
                self._tree(f"the duplicates of {key!r} in {name}", record, "dups")
            return
        if dsize < PAGEHDRSZ:  # a sub-page of duplicates, inside the node
            raise _Damage(f"{where} holds a sub-page of {dsize} bytes")
        _, pad, sub_flags, _, _ = _HEAD.unpack_from(page, data)
        label = f"{where}, its sub-page"
        if sub_flags & P_TYPES not in (P_LEAF | P_SUBP, P_LEAF | P_LEAF2 | P_SUBP):
            raise _Damage(f"{label} has type flags {sub_flags & P_TYPES:#x}")
        if sub_flags & P_LEAF2:
            self._leaf2(page, data, dsize, pad, label)
        else:
            self._nodes(page, data, dsize, label, branch=False)

    def _overlaps(self) -> None:
        """No two reachable pages (tree pages, overflow runs) share a page number."""
        end = NUM_METAS
        for first, pages in sorted([(p, 1) for p in self.seen] + self.runs):
            if first < end:
                raise _Damage(f"page {first} is used twice (an overflow run overlaps it)")
            end = first + pages
