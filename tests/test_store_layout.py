"""The LMDB layout's one home (``featcache.store.layout``): its records, its format check, and that
the disk tier and the store tools go through it rather than decoding records themselves."""

from __future__ import annotations

import ast
import struct
from pathlib import Path

import lmdb
import pytest

import featcache
from featcache import StoreFormatError
from featcache.store import layout
from featcache.store.layout import OtherFormatError
from featcache.storetools.view import StoreView
from featcache.tiers.disk import DiskTier

PACKAGE = Path(featcache.__file__).parent


# -- records ---------------------------------------------------------------------------------------
def test_records_have_the_stored_bytes_and_malformed_ones_decode_to_none():
    """The byte formats are fixed by stores already on disk: a change must bump FORMAT_TAG."""
    assert layout.FORMAT_TAG == b"featcache-lmdb-2"
    assert layout.TABLES == (b"data", b"meta", b"lru", b"info")
    assert layout.pack_meta(7, 300) == struct.pack("<QQ", 7, 300)
    assert layout.unpack_meta(struct.pack("<QQ", 7, 300)) == (7, 300)
    assert layout.lru_record(7, b"key") == struct.pack(">Q", 7) + b"key"
    assert layout.unpack_lru(struct.pack(">Q", 7) + b"key") == (7, b"key")
    assert layout.pack_used(5) == struct.pack("<Q", 5) and layout.unpack_used(struct.pack("<Q", 5)) == 5
    for bad in (b"", b"x" * 15, b"x" * 17):
        assert layout.unpack_meta(bad) is None
    assert layout.unpack_meta(None) is None and layout.unpack_used(None) is None
    assert layout.unpack_used(b"x" * 7) is None
    assert layout.unpack_lru(b"x" * 8) is None and layout.unpack_lru(b"") is None
    # lru records sort in stamp order (LMDB orders keys bytewise): eviction takes the oldest
    stamps = [2**40, 1, 256, 2**63 - 1, 0]
    records = sorted(layout.lru_record(s, b"k") for s in stamps)
    assert [layout.unpack_lru(r)[0] for r in records] == sorted(stamps)


def test_key_limits_fit_every_record():
    assert layout.MAX_KEY_BYTES == layout.LMDB_MAX_KEY_BYTES - 8 == 503
    assert len(layout.lru_record(2**63, b"k" * layout.MAX_KEY_BYTES)) == layout.LMDB_MAX_KEY_BYTES
    assert layout.key_storable(b"k") and layout.key_storable(b"k" * 503)
    assert not layout.key_storable(b"") and not layout.key_storable(b"k" * 504)


def test_records_problem_is_the_one_rule_for_a_keys_records():
    meta = layout.pack_meta(1, 3)
    assert layout.records_problem(None, None) is None
    assert layout.records_problem(b"abc", meta) is None
    assert layout.records_problem(b"abc", None) == "value without a meta record"
    assert layout.records_problem(None, meta) == "meta record without a value"
    assert layout.records_problem(b"abc", b"short") == "malformed meta record"
    assert layout.records_problem(b"abcd", meta) == "meta record says 3 bytes, the value holds 4"


def test_check_format():
    layout.check_format("d", layout.FORMAT_TAG)
    with pytest.raises(StoreFormatError, match="no format record") as exc:
        layout.check_format("d", None)
    assert not isinstance(exc.value, OtherFormatError)
    with pytest.raises(OtherFormatError, match="featcache-lmdb-99") as other:
        layout.check_format("d", b"featcache-lmdb-99")
    assert other.value.tag == b"featcache-lmdb-99"


def _set_info(path: Path, name: bytes, value: bytes | None) -> None:
    env = lmdb.open(str(path), max_dbs=4, map_size=1 << 30)
    try:
        with env.begin(write=True, db=env.open_db(b"info")) as txn:
            if value is None:
                txn.delete(name)
            else:
                txn.put(name, value)
    finally:
        env.close()


@pytest.mark.parametrize("tag", [b"featcache-lmdb-99", None])
def test_the_tier_and_the_tools_refuse_a_store_with_one_rule(tmp_path, tag):
    """The disk tier (read-only, so it does not initialise a store) and ``StoreView`` refuse a
    store of another format, or one without a format record, with the same error."""
    store = tmp_path / "store"
    DiskTier(store, 1 << 20).close()
    _set_info(store, b"format", tag)
    errors = []
    for open_store in (lambda: DiskTier(store, 1 << 20, readonly=True), lambda: StoreView(store)):
        with pytest.raises(StoreFormatError) as exc:
            open_store()
        errors.append(exc.value)
    assert type(errors[0]) is type(errors[1]) is (OtherFormatError if tag else StoreFormatError)
    assert str(errors[0]) == str(errors[1])
    _set_info(store, b"format", layout.FORMAT_TAG)
    DiskTier(store, 1 << 20).close()  # a refused open changed nothing


# -- one home --------------------------------------------------------------------------------------
def _modules(*patterns: str) -> list[Path]:
    return sorted(p for pattern in patterns for p in PACKAGE.glob(pattern))


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module, names) of every ``from ... import`` in ``path``, as absolute featcache names."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = parts[: len(parts) - node.level]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            out.append((module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            out.extend((a.name, []) for a in node.names)
    return out


LAYOUT_USERS = ("tiers/disk.py", "store/books.py", "store/env.py", "store/files.py", "storetools/*.py")


def test_only_the_layout_module_knows_the_bytes_of_a_record():
    """No user of the store packs or unpacks a record itself (``struct``), or names a table or an
    info record by its bytes: the issue found the tools decoding the disk tier's records again."""
    names = {*layout.TABLES, layout.FORMAT_RECORD, layout.USED_RECORD}
    for path in _modules(*LAYOUT_USERS):
        assert "struct" not in [m for m, _ in _imports(path)], path
        literals = {n.value for n in ast.walk(ast.parse(path.read_text()))
                    if isinstance(n, ast.Constant) and isinstance(n.value, bytes)}
        assert not literals & names, (path, literals & names)


def test_no_private_name_crosses_the_store_and_the_store_sits_below_the_tiers():
    for path in _modules("**/*.py"):
        for module, names in _imports(path):
            if module.startswith(("featcache.store", "featcache.tiers.disk")):
                assert not [n for n in names if n.startswith("_")], (path, module, names)
    for path in _modules("store/*.py"):
        for module, _ in _imports(path):
            if module.startswith("featcache."):
                assert module.split(".")[1] in {"store", "errors", "codec", "sizes"}, (path, module)
    for path in _modules("storetools/*.py"):
        assert not [m for m, _ in _imports(path) if m.startswith("featcache.cli")], path
