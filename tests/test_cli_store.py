"""The store commands of the CLI (stats, ls, inspect, verify, purge, compact) on stores built here.

Each store is written through FeatureCache (device="cpu", host_bytes=0) and closed before a
command reads it in this process (LMDB forbids two environments on one store in a process); the
commands that must see a store another process holds open run as `python -m featcache`.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import lmdb
import pytest
import torch

import featcache.store.scan as scan_module
import featcache.storetools.maintenance as maintenance
import featcache.storetools.view as view_module
from featcache import FeatureCache, config, image_key
from featcache.cli import main
from featcache.cli.progress import ProgressBar
from featcache.cli.render import meta_summary
from featcache.codec import HEADER
from featcache.store import layout
from featcache.tiers.disk import DiskTier

NS = "InternVLForConditionalGeneration:0123456789abcdef0123456789abcdef"
LMDEPLOY_META = json.dumps(
    {"fields": {"image_token_id": 92546, "image_tokens": 256}, "ns": NS,
     "pixels": [[3, 448, 448], "bfloat16"]},
    sort_keys=True, separators=(",", ":"),
).encode()


# -- helpers ------------------------------------------------------------------------------------
def tensor_for(i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    return torch.randn(1 + i % 3, 16, 8, generator=g).to(torch.bfloat16)


def build_store(path: Path, n: int = 4, first: int = 0) -> dict[bytes, torch.Tensor]:
    """Put entries ``first..first+n-1`` in put order (the last is the most recently used); odd
    ones carry lmdeploy-like JSON metadata. Returns key -> tensor."""
    want: dict[bytes, torch.Tensor] = {}
    with FeatureCache(device="cpu", host_bytes=0, disk_path=path, disk_bytes="64MiB") as cache:
        for i in range(first, first + n):
            # the digest alone: entries without a recorded namespace (an ImageKey would record it)
            key = bytes(image_key(b"image-%d" % i, namespace="test-model"))
            cache.put(key, tensor_for(i).clone(), meta=LMDEPLOY_META if i % 2 else None)
            want[key] = tensor_for(i)
            cache.flush()
    return want


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


def books(path: Path) -> dict[str, dict[bytes, bytes]]:
    """Every record of every table of a closed store, after checking the books agree."""
    env = lmdb.open(str(path), max_dbs=4, map_size=1 << 30, readonly=True)
    try:
        out = {}
        for name in ("data", "meta", "lru", "info"):
            db = env.open_db(name.encode(), create=False)
            with env.begin(db=db) as txn:
                out[name] = {bytes(k): bytes(v) for k, v in txn.cursor()}
    finally:
        env.close()
    assert set(out["data"]) == set(out["meta"])
    assert len(out["lru"]) == len(out["meta"])
    for key, raw in out["meta"].items():
        stamp, size = struct.unpack("<QQ", raw)
        assert size == len(out["data"][key])
        assert struct.pack(">Q", stamp) + key in out["lru"]
    used = struct.unpack("<Q", out["info"][b"used_bytes"])[0]
    assert used == sum(len(v) for v in out["data"].values())
    return out


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def same_bits(a: torch.Tensor | None, b: torch.Tensor) -> bool:
    return a is not None and a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.view(torch.uint8), b.view(torch.uint8))


@pytest.fixture
def store(tmp_path) -> tuple[Path, dict[bytes, torch.Tensor]]:
    path = tmp_path / "store"
    return path, build_store(path)


# -- stats --------------------------------------------------------------------------------------
def test_stats_table_and_json(store, capsys):
    path, want = store
    rc, out, err = run(capsys, "stats", str(path))
    assert rc == 0 and err == ""
    assert "featcache-lmdb-2" in out
    assert "counted in the memory of each process" in out
    disk_row = next(line for line in out.splitlines() if line.startswith("disk "))
    assert disk_row.split()[1] == str(len(want))

    rc, out, _ = run(capsys, "stats", str(path), "--json")
    doc = json.loads(out)
    stored = sum(t.nbytes + HEADER.size for t in want.values()) + 2 * len(LMDEPLOY_META)
    assert doc["tiers"]["disk"] == {"entries": len(want), "bytes": stored, "capacity_bytes": None}
    assert doc["tiers"]["device"] is None and doc["process_counters"] is None
    assert doc["format"] == "featcache-lmdb-2" and doc["info"]["used_bytes"] == stored
    assert doc["lmdb"]["map_size"] >= 1 << 40  # the store's own (the writers'), not a reader's
    assert doc["last_use_ns"]["oldest"] < doc["last_use_ns"]["newest"]
    assert doc["in_use_by_pid"] == 0
    with FeatureCache(device="cpu", host_bytes=0, disk_path=path, disk_bytes="64MiB") as cache:
        assert cache.stats()["disk"]["bytes"] == stored  # what the cache itself reports


def test_store_dir_defaults_to_featcache_dir(store, capsys, monkeypatch):
    path, want = store
    monkeypatch.setenv("FEATCACHE_DIR", str(path))
    rc, out, _ = run(capsys, "stats", "--json")
    assert rc == 0 and json.loads(out)["tiers"]["disk"]["entries"] == len(want)
    key = list(want)[0].hex()
    for argv in (["inspect", key, "--json"], ["inspect", str(path), key, "--json"]):  # DIR optional
        rc, out, _ = run(capsys, *argv)
        assert rc == 0 and json.loads(out)["key"] == key, argv
    rc, out, _ = run(capsys, "verify")
    assert rc == 0 and f"verified {len(want)} entries" in out


# -- ls and inspect -----------------------------------------------------------------------------
def test_ls_lists_most_recently_used_first(store, capsys):
    path, want = store
    keys = list(want)  # put order: oldest first
    rc, out, _ = run(capsys, "ls", str(path))
    assert rc == 0
    lines = out.splitlines()
    assert lines[0].split() == ["KEY", "SIZE", "DTYPE", "SHAPE", "LAST", "USE", "NAMESPACE", "META"]
    rows = lines[1:-1]
    assert [r.split()[0] for r in rows] == [k.hex() for k in reversed(keys)]
    newest = rows[0].split()
    assert newest[3:5] == ["bfloat16", str(list(want[keys[-1]].shape)).replace(" ", "")]
    # odd ones carry lmdeploy's metadata, with the namespace; even ones none
    assert rows[0].split()[-2:] == [NS, "image_tokens=256"] and rows[1].split()[-2:] == ["-", "-"]
    assert lines[-1] == f"{len(keys)} of {len(keys)} entries, most recently used first."

    rc, out, _ = run(capsys, "ls", str(path), "--limit", "2", "--json")
    docs = [json.loads(line) for line in out.splitlines()]
    assert [d["key"] for d in docs] == [keys[-1].hex(), keys[-2].hex()]
    assert docs[0]["shape"] == list(want[keys[-1]].shape) and docs[0]["dtype"] == "bfloat16"
    assert docs[0]["meta"] == "image_tokens=256"
    assert docs[0]["size"] == want[keys[-1]].nbytes + HEADER.size + len(LMDEPLOY_META)


def test_ls_order_follows_use(store, capsys):
    path, want = store
    oldest = next(iter(want))
    with FeatureCache(device="cpu", device_bytes=0, host_bytes=0, disk_path=path,
                      disk_bytes="64MiB") as cache:
        assert same_bits(cache.get(oldest), want[oldest])  # a disk hit: its lru stamp moves
        cache.flush()
    rc, out, _ = run(capsys, "ls", str(path), "--limit", "1")
    assert out.splitlines()[1].split()[0] == oldest.hex()
    assert "1 of 4 entries" in out


def test_inspect_by_key_and_prefix(store, capsys):
    path, want = store
    key = list(want)[1]  # carries JSON metadata
    rc, out, _ = run(capsys, "inspect", str(path), key.hex())
    assert rc == 0
    fields = dict(line.split(None, 1) for line in out.splitlines() if line and not line.startswith(" "))
    assert fields["dtype"] == "bfloat16"
    assert fields["shape"] == str(list(want[key].shape)).replace(" ", "")
    assert fields["checksum"].startswith("OK")
    assert f"metadata {len(LMDEPLOY_META)} B" in fields["layout"]
    assert '"image_tokens": 256' in out  # pretty JSON

    rc, out, _ = run(capsys, "inspect", str(path), key.hex()[:10], "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["key"] == key.hex() and doc["checksum_ok"] is True
    assert doc["meta"]["fields"]["image_tokens"] == 256

    rc, _, err = run(capsys, "inspect", str(path), "ffff" * 8)
    assert rc == 1 and "no entry with key" in err and err.count("\n") == 1
    with pytest.raises(SystemExit) as exc:
        main(["inspect", str(path), "not-hex"])
    assert exc.value.code == 2


def test_inspect_finds_a_key_by_any_unique_prefix_odd_lengths_included(tmp_path, capsys):
    """Every prefix of every key, 1 character up: found when unique, 'several' when not (issue 18:
    `inspect 9` said "no entry" although one key started with 9)."""
    path = tmp_path / "store"
    keys = [k.hex() for k in build_store(path, n=12)]
    for key in keys:
        for n in range(1, 9):
            prefix = key[:n]
            matching = [k for k in keys if k.startswith(prefix)]
            rc, out, err = run(capsys, "inspect", str(path), prefix, "--json")
            if len(matching) == 1:
                assert rc == 0 and json.loads(out)["key"] == key, (prefix, err)
            else:
                assert rc == 1 and "matches several entries" in err, (prefix, err)
    assert any(sum(k.startswith(k0[0]) for k in keys) == 1 for k0 in keys)  # a 1-char unique one


def test_meta_summary():
    assert meta_summary(b"") == "-"
    assert meta_summary(LMDEPLOY_META) == "image_tokens=256"
    assert meta_summary(b'{"image_tokens": 64}') == "image_tokens=64"
    assert meta_summary(b'{"a": 1, "b": 2}') == "JSON {a, b}"
    assert meta_summary(b"\x00\xff") == "2 B, not JSON"


# -- verify -------------------------------------------------------------------------------------
def test_entry_metadata_of_any_shape_is_read_without_raising():
    from featcache.lmdeploy.request.entry_meta import namespace_of, read

    assert namespace_of(LMDEPLOY_META) == NS and read(LMDEPLOY_META).namespace == NS
    assert read(LMDEPLOY_META).image_tokens == 256
    for meta in (b"", b"\x00\xff", b"[1, 2]", b'{"ns": 3}', b"null", b'{"fields": []}', b"{"):
        assert namespace_of(meta) is None and read(meta).namespace is None
    assert read(b'{"fields": {"image_tokens": true}}').image_tokens is None  # a bool is no count
    assert not read(b"\x00\xff").is_json and read(b"null").is_json


def test_verify_finds_and_fixes_a_corrupt_entry(store, capsys):
    path, want = store
    keys = list(want)
    bad = keys[2]
    rc, out, _ = run(capsys, "verify", str(path))
    assert rc == 0 and f"verified {len(want)} entries" in out and "all good" in out

    flip_payload_byte(path, bad)
    before = books(path)
    rc, out, err = run(capsys, "verify", str(path))
    assert rc == 2 and "1 bad" in out
    assert f"bad   {bad.hex()}" in out and "checksum mismatch" in out
    assert err == ""  # no progress bar when stderr is not a terminal
    assert books(path) == before, "verify without --fix wrote to the store"

    rc, out, _ = run(capsys, "inspect", str(path), bad.hex())
    assert rc == 2 and "BAD: checksum mismatch" in out

    rc, out, _ = run(capsys, "verify", str(path), "--fix")
    assert rc == 2 and "deleted 1 bad entry" in out
    after = books(path)  # data, meta, lru and used_bytes still agree
    assert bad not in after["data"] and set(after["data"]) == set(keys) - {bad}
    rc, out, _ = run(capsys, "verify", str(path))
    assert rc == 0 and "all good" in out
    with FeatureCache(device="cpu", device_bytes=0, host_bytes=0, disk_path=path,
                      disk_bytes="64MiB") as cache:
        assert cache.get(bad) is None
        for key in set(keys) - {bad}:
            assert same_bits(cache.get(key), want[key])
        assert cache.stats()["disk"]["corrupt"] == 0


def test_verify_reports_broken_books(store, capsys):
    path, want = store
    orphan = list(want)[0]
    env = lmdb.open(str(path), max_dbs=4, map_size=1 << 30)
    with env.begin(write=True) as txn:  # a value whose meta record is gone: unaccounted
        txn.delete(orphan, db=env.open_db(b"meta", txn=txn))
    env.close()
    rc, out, _ = run(capsys, "verify", str(path))
    assert rc == 2 and f"{orphan.hex()}" in out and "value without a meta record" in out
    assert "used_bytes is" in out  # the books no longer add up: reported as a note
    rc, out, _ = run(capsys, "verify", str(path), "--fix")
    assert rc == 2 and "deleted 1 bad entry" in out
    rc, out, _ = run(capsys, "verify", str(path))
    assert orphan.hex() not in out


def test_progress_bar_draws_only_on_a_terminal():
    stream = io.StringIO()
    bar = ProgressBar(4, "verify", stream=stream, enabled=True)
    bar.update(1, 100, force=True)
    bar.close(4, 400)
    text = stream.getvalue()
    assert text.startswith("\rverify [") and "4/4" in text and text.endswith("\n")
    quiet = io.StringIO()
    bar = ProgressBar(4, "verify", stream=quiet)  # StringIO is not a terminal
    bar.update(4, 400, force=True)
    bar.close(4, 400)
    assert quiet.getvalue() == ""


def test_scans_span_many_read_transactions(tmp_path, capsys, monkeypatch):
    """Listing, verifying and purging read (and delete) in chunks: the same answers."""
    path = tmp_path / "store"
    want = build_store(path, n=7)
    keys = list(want)
    flip_payload_byte(path, keys[3])
    monkeypatch.setattr(scan_module, "SCAN_CHUNK_ENTRIES", 2)
    monkeypatch.setattr(scan_module, "SCAN_CHUNK_BYTES", 1)
    monkeypatch.setattr(maintenance, "DISCARD_BATCH", 2)
    rc, out, _ = run(capsys, "ls", str(path), "--limit", "0", "--json")
    assert [json.loads(line)["key"] for line in out.splitlines()] == [k.hex() for k in reversed(keys)]
    rc, out, _ = run(capsys, "ls", str(path), "--limit", "5", "--json")
    assert len(out.splitlines()) == 5
    rc, out, _ = run(capsys, "verify", str(path))
    assert rc == 2 and "verified 7 entries" in out and out.count("\nbad ") == 1
    with view_module.StoreView(path) as view:
        assert [k for k, _ in view.keys_used_before(time.time_ns())] == keys
        assert sorted(k for k, _ in view.all_keys()) == sorted(keys)
    rc, out, _ = run(capsys, "purge", str(path), "--all")
    assert rc == 0 and "deleted 7 entries" in out
    assert books(path)["data"] == {}


# -- purge and compact --------------------------------------------------------------------------
def test_purge_older_than_uses_last_use(tmp_path, capsys, monkeypatch):
    path = tmp_path / "store"
    real = time.time_ns
    with monkeypatch.context() as m:  # the disk tier stamps these ten days ago
        m.setattr(time, "time_ns", lambda: real() - 10 * 86400 * 10**9)
        old = build_store(path, n=3)
    new = build_store(path, n=2, first=10)
    rc, out, _ = run(capsys, "purge", str(path), "--older-than", "7d", "--dry-run")
    assert rc == 0 and out.startswith("would delete 3 of 5 entries")
    assert len(books(path)["data"]) == 5
    rc, out, _ = run(capsys, "purge", str(path), "--older-than", "7d")
    assert rc == 0 and out.startswith("deleted 3 entries last used before") and "2 entries" in out
    assert set(books(path)["data"]) == set(new)
    rc, out, _ = run(capsys, "purge", str(path), "--older-than", "1w")
    assert "deleted 0 entries" in out
    assert not set(old) & set(books(path)["data"])


def test_purge_namespace_then_all(store, capsys):
    path, want = store
    keys = list(want)
    rc, out, _ = run(capsys, "purge", str(path), "--namespace", "some-other-model")
    assert rc == 0 and "deleted 0 entries of namespace some-other-model" in out
    rc, out, _ = run(capsys, "purge", str(path), "--namespace", NS, "--dry-run")
    assert rc == 0 and f"would delete 2 of {len(want)} entries of namespace {NS}" in out
    assert len(books(path)["data"]) == len(want)
    rc, out, _ = run(capsys, "purge", str(path), "--namespace", NS)
    assert rc == 0 and f"deleted 2 entries of namespace {NS}" in out
    assert set(books(path)["data"]) == {k for i, k in enumerate(keys) if i % 2 == 0}  # no meta: kept
    with pytest.raises(SystemExit) as exc:  # one of --all / --older-than / --namespace is required
        main(["purge", str(path)])
    assert exc.value.code == 2
    rc, out, _ = run(capsys, "purge", str(path), "--all")
    assert rc == 0 and "deleted 2 entries" in out and "0 entries (0 B) remain" in out
    assert books(path)["data"] == {}
    with FeatureCache(device="cpu", host_bytes=0, disk_path=path, disk_bytes="64MiB") as cache:
        assert cache.stats()["disk"]["entries"] == 0  # the emptied store is still a store


def test_purge_all_removes_a_store_of_another_format(tmp_path, capsys):
    path = tmp_path / "old"
    build_store(path, n=1)
    env = lmdb.open(str(path), max_dbs=4, map_size=1 << 30)
    with env.begin(write=True) as txn:
        txn.put(b"format", b"featcache-lmdb-1", db=env.open_db(b"info", txn=txn))
    env.close()
    rc, _, err = run(capsys, "stats", str(path))
    assert rc == 1 and "featcache-lmdb-1" in err and "purge --all" in err
    rc, _, err = run(capsys, "purge", str(path), "--older-than", "1d")
    assert rc == 1 and "featcache-lmdb-1" in err
    rc, out, _ = run(capsys, "purge", str(path), "--all")
    assert rc == 0 and "format featcache-lmdb-1" in out
    assert path.is_dir() and not (path / "data.mdb").exists()
    with FeatureCache(device="cpu", host_bytes=0, disk_path=path, disk_bytes="64MiB") as cache:
        assert cache.stats()["disk"]["entries"] == 0  # the directory takes a new store


def test_compact_copies_every_entry(store, tmp_path, capsys):
    path, want = store
    keys = list(want)
    run(capsys, "purge", str(path), "--older-than", "0s")  # frees pages: something to compact
    build_store(path, n=4)
    dest = tmp_path / "compacted"
    rc, out, _ = run(capsys, "compact", str(path), str(dest))
    assert rc == 0 and "compacted" in out and f"{len(keys)} entries" in out
    assert (dest / "data.mdb").stat().st_size <= (path / "data.mdb").stat().st_size
    assert books(dest)["data"] == books(path)["data"]
    with FeatureCache(device="cpu", device_bytes=0, host_bytes=0, disk_path=dest,
                      disk_bytes="64MiB") as cache:
        for key, t in want.items():
            assert same_bits(cache.get(key), t)
    rc, _, err = run(capsys, "compact", str(path), str(dest))
    assert rc == 1 and "not empty" in err


# -- errors a user can act on ---------------------------------------------------------------------
def test_errors_are_one_line_and_exit_1(tmp_path, capsys):
    rc, _, err = run(capsys, "stats", str(tmp_path / "missing"))
    assert (rc, err) == (1, f"featcache stats: error: no such directory: {str(tmp_path / 'missing')!r}\n")
    empty = tmp_path / "empty"
    empty.mkdir()
    rc, _, err = run(capsys, "ls", str(empty))
    assert rc == 1 and "not a featcache store" in err and err.count("\n") == 1
    assert list(empty.iterdir()) == [], "a reader created files in a directory with no store"
    other = tmp_path / "other-lmdb"
    env = lmdb.open(str(other))
    with env.begin(write=True) as txn:
        txn.put(b"a", b"b")
    env.close()
    for command in (["verify", str(other)], ["purge", str(other), "--all"]):
        rc, _, err = run(capsys, *command)
        assert rc == 1 and "not a featcache store" in err
    assert (other / "data.mdb").exists(), "purge deleted a store that is not featcache's"


def test_permission_denied_is_reported(store, capsys, monkeypatch):
    path, _ = store
    lock_file = os.path.join(str(path), "lock.mdb")
    real_access = os.access
    monkeypatch.setattr(os, "access",  # as for a user who cannot write lock.mdb
                        lambda p, mode: False if os.fspath(p) == lock_file else real_access(p, mode))
    rc, _, err = run(capsys, "stats", str(path))
    assert rc == 1 and "permission denied" in err and "--no-lock" in err
    rc, out, _ = run(capsys, "stats", str(path), "--json", "--no-lock")  # nobody has it open
    assert rc == 0 and json.loads(out)["tiers"]["disk"]["entries"] == 4


def _main_as_nobody(argvs: list[list[str]]) -> list[tuple[int, str, str]]:
    """Run main(argv) for each argv in a forked child that dropped root: (rc, stdout, stderr)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            results = []
            for argv in argvs:
                out, err = io.StringIO(), io.StringIO()
                with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                    rc = main(argv)
                results.append((rc, out.getvalue(), err.getvalue()))
            os.write(write_end, json.dumps(results).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as f:
        raw = f.read().decode()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0 and raw, "the unprivileged child failed"
    return [tuple(r) for r in json.loads(raw)]


def test_permission_denied_for_a_non_root_user():
    if os.geteuid() != 0:
        pytest.skip("needs root to drop to another user (see the monkeypatched variant)")
    base = Path(tempfile.mkdtemp(prefix="featcache-cli-perm-"))
    try:
        base.chmod(0o755)
        private = base / "private"  # the store as the cache leaves it: 0700 / 0600
        build_store(private, n=1)
        shared = base / "shared"  # readable by others, lock file not writable by them
        build_store(shared, n=2)
        shared.chmod(0o755)
        for f in shared.iterdir():
            f.chmod(0o644)
        results = _main_as_nobody([
            ["stats", str(private)],
            ["ls", str(shared)],
            ["ls", str(shared), "--no-lock", "--json"],
            ["verify", str(shared), "--no-lock"],
        ])
        rc, _, err = results[0]
        assert rc == 1 and "permission denied" in err and err.count("\n") == 1
        rc, _, err = results[1]
        assert rc == 1 and "lock.mdb" in err and "--no-lock" in err
        rc, out, _ = results[2]
        assert rc == 0 and len(out.splitlines()) == 2
        assert results[3][0] == 0 and "all good" in results[3][1]
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_db_names_are_the_disk_tiers(tmp_path):
    tier = DiskTier(tmp_path / "s", 1 << 20)
    tier.close()
    env = lmdb.open(str(tmp_path / "s"), max_dbs=4, readonly=True)
    with env.begin() as txn:
        assert sorted(bytes(k) for k, _ in txn.cursor()) == sorted(layout.TABLES)
    env.close()


# -- a live store, through `python -m featcache` ----------------------------------------------------
def test_python_m_reads_a_store_this_process_holds_open(tmp_path):
    path = tmp_path / "live"
    want = build_store(path, n=3)
    cmd = [sys.executable, "-m", "featcache"]
    with FeatureCache(device="cpu", host_bytes=0, disk_path=path, disk_bytes="64MiB") as cache:
        extra = image_key(b"while-open")
        cache.put(extra, torch.ones(4, 4))
        cache.flush()
        out = subprocess.run([*cmd, "stats", str(path), "--json"], capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr
        doc = json.loads(out.stdout)
        assert doc["tiers"]["disk"]["entries"] == len(want) + 1
        assert doc["in_use_by_pid"] == os.getpid()
        out = subprocess.run([*cmd, "verify", str(path), "--no-lock"], capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 1 and "is open in process" in out.stderr
        assert out.stderr.count("\n") == 1
        cache.put(image_key(b"after the reads"), torch.zeros(3))  # the writer was never blocked
        cache.flush()
        assert cache.stats()["disk"]["entries"] == len(want) + 2


def test_default_dir_is_where_the_lmdeploy_integration_keeps_its_store(monkeypatch):
    import argparse

    import _lmdeploy_stack

    from featcache.cli.command import store_dir

    lmdeploy_integration = _lmdeploy_stack.need("featcache.lmdeploy", stack=False)
    assert config.DEFAULT_DIR == lmdeploy_integration.DEFAULT_DIR
    monkeypatch.delenv("FEATCACHE_DIR", raising=False)
    assert store_dir(argparse.Namespace(dir=None)) == config.DEFAULT_DIR
    assert config.DEFAULT_DIR == os.path.join(os.path.expanduser("~"), ".cache", "featcache")


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("answer,deleted", [("n\n", False), ("\n", False), ("y\n", True)])
def test_purge_all_asks_on_a_terminal(store, capsys, monkeypatch, answer, deleted):
    path, keys = store
    monkeypatch.setattr(sys, "stdin", _Terminal(answer))
    rc, out, err = run(capsys, "purge", str(path), "--all")
    assert "[y/N]" in err and "[y/N]" not in out
    if deleted:
        assert rc == 0 and f"deleted {len(keys)} entries" in out
        assert books(path)["data"] == {}
    else:
        assert rc == 1 and err.count("\n") == 1 and "nothing deleted" in err
        assert len(books(path)["data"]) == len(keys)


@pytest.mark.parametrize("stdin,extra", [(_Terminal, ["--yes"]), (io.StringIO, [])])
def test_purge_all_yes_and_scripts_are_not_asked(store, capsys, monkeypatch, stdin, extra):
    path, keys = store
    monkeypatch.setattr(sys, "stdin", stdin(""))  # would decline if asked
    rc, out, err = run(capsys, "purge", str(path), "--all", *extra)
    assert rc == 0 and "[y/N]" not in out + err and f"deleted {len(keys)} entries" in out


def test_ls_namespace_lists_only_that_namespace(store, capsys):
    path, want = store
    keys = list(want)
    rc, out, _ = run(capsys, "ls", str(path), "--namespace", NS, "--json", "--limit", "0")
    listed = [json.loads(line) for line in out.splitlines()]
    assert rc == 0 and len(listed) == 2 and {d["namespace"] for d in listed} == {NS}
    assert {bytes.fromhex(d["key"]) for d in listed} == {k for i, k in enumerate(keys) if i % 2 == 1}
    rc, out, _ = run(capsys, "ls", str(path), "--namespace", NS, "--json", "--limit", "1")
    assert len(out.splitlines()) == 1
    rc, out, _ = run(capsys, "ls", str(path), "--namespace", "another-model")
    assert rc == 0 and "no entries of namespace another-model" in out


def test_verify_purge_compact_json(store, capsys, tmp_path):
    path, want = store
    rc, out, _ = run(capsys, "verify", str(path), "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["checked"] == len(want) and doc["bad"] == [] and doc["deleted"] is None
    rc, out, _ = run(capsys, "compact", str(path), str(tmp_path / "copy"), "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["entries"] == len(want) and doc["dest"].endswith("copy")
    rc, out, _ = run(capsys, "purge", str(path), "--namespace", NS, "--dry-run", "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["dry_run"] and doc["matched"] == 2 and doc["entries"] == len(want)
    rc, out, _ = run(capsys, "purge", str(path), "--all", "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["deleted"] == len(want) and doc["remaining_entries"] == 0
