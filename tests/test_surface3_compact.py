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


def test_compact_leaves_out_every_corrupt_entry_wherever_it_stands(tmp_path, capsys):
    """Three of six entries damaged (the first, one inside, the last): all three left out and
    listed, the others copied whole. (Planted: only the first bad entry discarded from the copy;
    the one-bad-entry tests passed.)"""
    store, copy = tmp_path / "store", tmp_path / "copy"
    keys = build(store, n=6)
    bad = [keys[0], keys[3], keys[5]]
    for key in bad:
        flip_payload_byte(store, key)
    rc, out, _ = run(capsys, "compact", str(store), str(copy))
    assert rc == 2 and "skipped 3 bad entries (" in out, out
    assert sorted(line.split()[1] for line in out.splitlines() if line.startswith("bad ")) == sorted(
        k.hex() for k in bad)
    rc, out, _ = run(capsys, "verify", str(copy))
    assert rc == 0 and out.startswith("verified 3 entries"), out
    with FeatureCache(device="cpu", device_bytes=0, host_bytes=0, disk_path=copy,
                      disk_bytes="64MiB") as cache:
        for i, key in enumerate(keys):
            got = cache.get(key)
            assert (got is None) if key in bad else torch.equal(got, torch.full((64, 64), float(i)))


def test_a_compacted_copy_is_readable_by_its_owner_only(tmp_path, capsys):
    """The copy's data file is 0600, as the disk tier makes its own (it holds what every image
    looked like to the model), with or without bad entries to drop. (Planted: the chmod of the
    copy removed; the copy was then the umask's 0644.)"""
    import os
    import stat

    for damaged in (False, True):
        store, copy = tmp_path / f"store{damaged}", tmp_path / f"copy{damaged}"
        keys = build(store)
        if damaged:
            flip_payload_byte(store, keys[1])
        old = os.umask(0o022)
        try:
            run(capsys, "compact", str(store), str(copy))
        finally:
            os.umask(old)
        assert stat.S_IMODE(os.stat(copy / "data.mdb").st_mode) == 0o600, damaged
