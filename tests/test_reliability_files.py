"""Files: the store is private whatever the umask, and a store that cannot be written is refused
at open with StoreOpenError, never at the first write.

Already proven in tests/test_disk_durability.py and not repeated: the directory is 0700 and its
files 0600 under the default umask (``test_store_directory_and_files_are_private``), and an
unwritable existing, empty or uncreatable directory is refused at open, as an unprivileged user
(``test_unwritable_directory_is_refused`` and, as root, ``..._for_a_non_root_user``, which drops
privileges in a forked child). Here: permissive umasks, a read-only file system (which binds
root too), and files of another user.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

from featcache import StoreOpenError

try:
    import _reliability as rel
except ImportError:  # tests/ became a package
    from tests import _reliability as rel

NOBODY = 65534


def modes(store: Path) -> dict[str, int]:
    return {p.name: stat.S_IMODE(p.stat().st_mode) for p in (store, *store.iterdir())}


@pytest.mark.parametrize("umask", [0o000, 0o002, 0o022, 0o077])
def test_store_is_private_whatever_the_umask(tmp_path, umask):
    store = tmp_path / "new" / "store"
    old = os.umask(umask)
    try:
        with rel.disk_cache(store) as cache:
            cache.put(b"k", torch.ones(4))
            cache.flush()
    finally:
        os.umask(old)
    assert modes(store) == {"store": 0o700, "data.mdb": 0o600, "lock.mdb": 0o600,
                            "key-secret": 0o600}  # featcache.keysecret


def _ro_mount(tmp_path: Path) -> Path:
    mnt = tmp_path / "ro"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a read-only file system needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    return mnt


def test_read_only_file_system_is_refused_at_open_even_for_root(tmp_path):
    mnt = _ro_mount(tmp_path)
    try:
        with rel.disk_cache(mnt / "store") as cache:
            cache.put(b"k", torch.ones(4))
        (mnt / "empty").mkdir()
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        refused = []
        for path in (mnt / "store", mnt / "empty", mnt / "new"):
            with pytest.raises(StoreOpenError) as exc:
                rel.disk_cache(path)
            refused.append(str(exc.value))
        assert "not writable" in refused[0] and "not writable" in refused[1]
        assert "cannot create" in refused[2]
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
    rel.report("files/read-only-fs", runs=3, faults=3, wrong=0, failed=0, refused_at_open=3)


def test_files_of_another_user_are_refused_at_open(tmp_path):
    """A writable directory holding data.mdb/lock.mdb that this user may not write (or read):
    StoreOpenError at open, as the unprivileged user."""
    if os.geteuid() != 0:
        pytest.skip("needs root to hand the files to another user")
    base = Path(tempfile.mkdtemp(prefix="featcache-files-"))
    try:
        base.chmod(0o755)
        cases = {}
        for name, file_mode in (("readonly-files", 0o444), ("private-files", 0o600)):
            store = base / name
            with rel.disk_cache(store) as cache:
                cache.put(b"k", torch.ones(4))
            os.chown(store, NOBODY, NOBODY)  # the directory is nobody's: writable by nobody
            store.chmod(0o700)
            for p in store.iterdir():
                p.chmod(file_mode)  # the files stay root's
            cases[name] = str(store)

        def open_as_nobody() -> dict[str, str]:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            out = {}
            for name, path in cases.items():
                try:
                    rel.disk_cache(Path(path)).close()
                    out[name] = "opened"
                except StoreOpenError as e:
                    out[name] = f"StoreOpenError: {e}"
            return out

        how, result = rel.in_fork(open_as_nobody)
        assert how == "ok", result
        for name, what in result.items():
            assert what.startswith("StoreOpenError"), f"{name}: {what}"
            assert "Permission denied" in what, what  # refused for the files, not the directory
            print(f"\n  {name}: {what}")
    finally:
        shutil.rmtree(base, ignore_errors=True)
    rel.report("files/other-users-files", runs=len(result), faults=len(result), wrong=0, failed=0,
               refused_at_open=sum(v.startswith("StoreOpenError") for v in result.values()))
