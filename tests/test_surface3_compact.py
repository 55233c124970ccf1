"""The user's surface, third pass, item 2 (issue 41): `featcache compact` of a store with a corrupt
entry. Before, it copied the entry silently and exited 0 while `verify` exited 2 on the same store;
a compacted copy now holds only the entries whose checksum holds, says how many it skipped, and
exits 2 (bad entries found, as verify does)."""

from __future__ import annotations

import json
from pathlib import Path

import lmdb
import torch

from featcache import FeatureCache
from featcache.cli import main


def build(path: Path, n: int = 4) -> list[bytes]:
    keys = [bytes([i + 1]) * 32 for i in range(n)]
    with FeatureCache(device="cpu", device_bytes=0, host_bytes=0, disk_path=path,
                      disk_bytes="64MiB") as cache:
        for i, key in enumerate(keys):
            cache.put(key, torch.full((64, 64), float(i)), block=True)
    return keys


def flip_payload_byte(path: Path, key: bytes) -> None:
    """Damage one payload byte of ``key``'s stored value, as bit rot would."""
    env = lmdb.open(str(path), max_dbs=4, map_size=1 << 30)
    try:
        data = env.open_db(b"data")
        with env.begin(write=True) as txn:
            value = bytearray(txn.get(key, db=data))
            value[-1] ^= 0x40
            txn.put(key, bytes(value), db=data)
    finally:
        env.close()


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_compact_leaves_a_corrupt_entry_out_says_so_and_exits_2(tmp_path, capsys):
    store, copy = tmp_path / "store", tmp_path / "copy"
    keys = build(store)
    flip_payload_byte(store, keys[1])
    rc, _, _ = run(capsys, "verify", str(store))
    assert rc == 2  # what verify says of the store

    rc, out, err = run(capsys, "compact", str(store), str(copy))
    assert rc == 2, out
    lines = out.splitlines()
    assert lines[0].endswith("3 entries)"), out
    assert lines[1].startswith("skipped 1 bad entry (") and "checksum holds" in lines[1], out
    assert f"`featcache verify --fix {store}`" in lines[1]
    assert lines[2].startswith(f"bad   {keys[1].hex()}") and lines[2].endswith("checksum mismatch")
    assert err == ""

    rc, out, _ = run(capsys, "verify", str(copy))  # the copy: every entry good
    assert rc == 0 and out.startswith("verified 3 entries") and "all good" in out
    with FeatureCache(device="cpu", device_bytes=0, host_bytes=0, disk_path=copy,
                      disk_bytes="64MiB") as cache:
        assert cache.get(keys[1]) is None
        for i in (0, 2, 3):
            assert torch.equal(cache.get(keys[i]), torch.full((64, 64), float(i)))
    assert sorted(p.name for p in copy.iterdir()) == ["data.mdb", "key-secret", "lock.mdb"]
    rc, _, _ = run(capsys, "verify", str(store))
    assert rc == 2, "compact changed the store it copies"


def test_compact_json_lists_what_it_skipped(tmp_path, capsys):
    store = tmp_path / "store"
    keys = build(store)
    flip_payload_byte(store, keys[0])
    rc, out, _ = run(capsys, "compact", str(store), str(tmp_path / "copy"), "--json")
    doc = json.loads(out)
    assert rc == 2 and doc["entries"] == 3
    assert [(s["key"], s["problem"]) for s in doc["skipped"]] == [(keys[0].hex(), "checksum mismatch")]


def test_compact_of_a_good_store_skips_nothing_and_exits_0(tmp_path, capsys):
    store = tmp_path / "store"
    build(store)
    rc, out, _ = run(capsys, "compact", str(store), str(tmp_path / "copy"), "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["entries"] == 4 and doc["skipped"] == []
