"""The user's surface, third pass, item 3 (issue 41): messages that misled. Each runs the real
program in a subprocess and checks what a user reads: the exit code, stdout, the line on stderr.

Before issue 41: `featcache --bogus` printed the whole help on stdout without naming the flag;
`featcache stats DIR --bogus` showed the top level's usage; `--older-than -5d` said "expected one
argument"; doctor with FEATCACHE_DIR naming a file said "does not exist yet, CANNOT be created";
`FEATCACHE_DIR=/nope featcache stats` said "pass DIR or set FEATCACHE_DIR" though it was set;
purge on a read-only mount advised opening the store read-only, which purge cannot.
(warm's torchvision note: tests/test_surface3_models.py.)"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from featcache import FeatureCache
from featcache.cli import main

ROOT = Path(__file__).resolve().parent.parent


def featcache(tmp_path: Path, *argv: str, env: dict[str, str] | None = None,
              prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    environ = dict(os.environ, PYTHONPATH=str(ROOT), FEATCACHE_DIR=str(tmp_path / "default-store"))
    environ.update(env or {})
    return subprocess.run([*prefix, sys.executable, "-m", "featcache", *argv], capture_output=True,
                          text=True, env=environ, cwd=tmp_path, timeout=120)


def build(path: Path, n: int = 2) -> None:
    with FeatureCache(device="cpu", device_bytes=0, host_bytes=0, disk_path=path,
                      disk_bytes="64MiB") as cache:
        for i in range(n):
            cache.put(bytes([i + 1]) * 32, torch.full((4, 4), float(i)), block=True)


def usage_then_error(out: subprocess.CompletedProcess) -> tuple[str, str]:
    """argparse's bad usage: exit 2, nothing on stdout, its usage line(s) then one error line."""
    assert out.returncode == 2 and out.stdout == "", (out.stdout, out.stderr)
    assert "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    return lines[0], lines[-1]


def test_an_unknown_top_level_flag_is_named_on_stderr(tmp_path):
    usage, error = usage_then_error(featcache(tmp_path, "--bogus"))
    assert usage.startswith("usage: featcache [-h]")
    assert error == "featcache: error: unrecognized arguments: --bogus"


def test_an_unknown_flag_of_a_command_gets_that_commands_usage(tmp_path):
    for name, argv, flag in (("stats", [str(tmp_path), "--bogus"], "--bogus"),
                             ("ls", ["--bogus", str(tmp_path)], "--bogus"),
                             ("verify", [str(tmp_path), "-z"], "-z")):
        usage, error = usage_then_error(featcache(tmp_path, name, *argv))
        assert usage.startswith(f"usage: featcache {name} "), usage
        assert error == f"featcache {name}: error: unrecognized arguments: {flag}"


def test_a_negative_age_says_what_is_wrong_with_it(tmp_path):
    for argv in (["--older-than", "-5d"], ["--older-than=-5d"]):
        usage, error = usage_then_error(featcache(tmp_path, "purge", str(tmp_path), *argv))
        assert usage.startswith("usage: featcache purge ")
        assert error == ("featcache purge: error: argument --older-than: invalid age '-5d': an age "
                         "is not negative (e.g. 7d: last used more than 7 days ago)")
    _, error = usage_then_error(featcache(tmp_path, "purge", str(tmp_path), "--older-than"))
    assert error == "featcache purge: error: argument --older-than: expected one argument"


def test_doctor_says_featcache_dir_names_a_file(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("")
    for store, says in ((afile, "is a file, not a directory"),
                        (afile / "sub", f"cannot be created: {afile} is a file, not a directory")):
        out = featcache(tmp_path, "doctor", env={"FEATCACHE_DIR": str(store)})
        assert out.returncode == 0, out.stderr  # a store directory never fails doctor
        line = next(ln for ln in out.stdout.splitlines() if ln.split()[1:2] == ["store"])
        assert line.startswith("--") and f"{store} (from FEATCACHE_DIR): {says}" in line, line
        assert "does not exist yet" not in line


def test_a_missing_featcache_dir_is_not_told_to_set_featcache_dir(tmp_path):
    missing = tmp_path / "nope"
    out = featcache(tmp_path, "stats", env={"FEATCACHE_DIR": str(missing)})
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr == (f"featcache stats: error: no such directory: {str(missing)!r} (the "
                          "default store, from FEATCACHE_DIR: pass DIR, or set FEATCACHE_DIR to a "
                          "store's directory)\n")


def read_only_mount() -> tuple[str, ...]:
    """A command prefix that runs the rest in a private mount namespace (nothing changes outside
    it), or skip: needs unshare and the right to mount (root or CAP_SYS_ADMIN)."""
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("unshare (util-linux) is not installed: no read-only mount to try")
    probe = subprocess.run([unshare, "-m", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a mount namespace here ({probe.stderr.strip()})")
    return (unshare, "-m")


def test_purge_on_a_read_only_mount_says_it_needs_a_writable_one(tmp_path):
    store, mount = tmp_path / "store", tmp_path / "mnt"
    build(store)
    mount.mkdir()
    prefix = read_only_mount()
    script = (f"mount --bind {store} {mount} && mount -o remount,bind,ro {mount} && "
              f"exec {sys.executable} -m featcache purge {mount} --all")
    out = featcache(tmp_path, env={}, prefix=(*prefix, "sh", "-c", script, "--"))
    if "mount:" in out.stderr:
        pytest.skip(f"cannot mount here: {out.stderr.strip()}")
    assert out.returncode == 1 and out.stdout == "", out.stderr
    assert out.stderr == (f"featcache purge: error: the store at {str(mount)!r} is on a read-only "
                          "file system, and deleting entries writes to it: remount it read-write "
                          "(or copy the store to a writable place and work there)\n")
    assert "open it read-only" not in out.stderr


def test_purge_of_a_store_the_user_cannot_write_says_so(tmp_path, capsys, monkeypatch):
    """The same check without the mount (any machine): a directory this user cannot write."""
    store = tmp_path / "store"
    build(store)
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if (
        os.fspath(p) == str(store) and mode & os.W_OK) else real_access(p, mode))
    rc = main(["purge", str(store), "--all"])
    out, err = capsys.readouterr()
    assert rc == 1 and out == ""
    assert err == (f"featcache purge: error: permission denied: {str(store)!r} is not writable by "
                   "this user, and deleting entries writes to it; run as the store's owner\n")
