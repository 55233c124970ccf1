"""The CLI starts without torch or numpy (issue 18: ``--version``, ``--help``, ``stats``, ``ls`` under
0.3 s; issue 29 item 5: ``verify``, ``purge`` and ``compact`` too, deletes included). Whether a
module is imported is exact and asserted here; the time is only bounded generously (a loaded CI
machine), its real figure is bench/cli_start.py's."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest
import torch

from featcache import FeatureCache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEAVY = ("torch", "numpy", "lmdeploy", "transformers", "redis")


def _imports(args: list[str]) -> tuple[set[str], float, subprocess.CompletedProcess[str]]:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "featcache", *args],
                       capture_output=True, text=True, env=env, timeout=60)
    took = time.perf_counter() - t
    names = {line.rsplit("|", 1)[-1].strip() for line in r.stderr.splitlines()
             if line.startswith("import time:")}
    return names, took, r


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("store"))
    with FeatureCache(device="cpu", device_bytes="1MiB", host_bytes=0, disk_path=path,
                      disk_bytes="64MiB") as cache:
        for i in range(3):
            cache.put(bytes([i + 1]) * 16, torch.full((8, 4), float(i)), meta=b'{"ns":"m"}')
    return path


@pytest.mark.parametrize("args", [
    ["--version"], ["--help"], ["stats", "{store}"], ["ls", "{store}"], ["inspect", "{store}", "01"],
    ["stats", "--help"], ["verify", "{store}"], ["verify", "{copy}", "--fix"],
    ["purge", "{copy}", "--all"], ["purge", "{copy}", "--namespace", "m"],
    ["purge", "{copy}", "--older-than", "0s", "--dry-run"], ["compact", "{store}", "{dest}"],
])
def test_store_commands_start_without_torch(args, store, tmp_path) -> None:
    copy = tmp_path / "copy"  # the commands that write work on a copy of the store
    shutil.copytree(store, copy)
    names, took, r = _imports([a.format(store=store, copy=copy, dest=tmp_path / "dest") for a in args])
    assert r.returncode == 0, r.stderr[-2000:]
    assert not names & set(HEAVY), sorted(names & set(HEAVY))
    assert took < 10, took  # the real figure: bench/cli_start.py
    if args[0] == "purge" and "--dry-run" not in args:
        assert r.stdout.startswith("deleted 3 ")  # the deletes ran, without torch


def test_the_public_names_still_import(store) -> None:
    import featcache

    assert featcache.FeatureCache is FeatureCache
    assert callable(featcache.image_key) and featcache.CacheConfig.__name__ == "CacheConfig"
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        featcache.nope  # noqa: B018
    assert {"FeatureCache", "image_key", "parse_bytes"} <= set(dir(featcache))
