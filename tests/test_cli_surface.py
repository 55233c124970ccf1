"""The user's surface, second pass (issue 29 items 2-6): values past what Python's types take,
a missing huggingface_hub, ``warm`` without a GPU, ``serve`` without MODEL, and what ``stats`` and
``purge`` say about the space a purge frees. Each runs the real program (a subprocess, or
``main`` in this process where a store is read)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from featcache import FeatureCache
from featcache.cli import main

ROOT = Path(__file__).resolve().parent.parent
CUDA = torch.cuda.is_available()


def featcache(tmp_path: Path, *argv: str, prelude: str = "") -> subprocess.CompletedProcess:
    """``featcache ARGV`` in a fresh interpreter, after ``prelude`` (Python run before ``main``)."""
    code = f"import sys\n{prelude}\nfrom featcache.cli import main\nsys.exit(main(sys.argv[1:]))"
    env = dict(os.environ, PYTHONPATH=str(ROOT), FEATCACHE_DIR=str(tmp_path / "default-store"))
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=120)


def build(path: Path, n: int, shape: tuple[int, ...] = (8, 4)) -> None:
    with FeatureCache(device="cpu", device_bytes=0, host_bytes=0, disk_path=path,
                      disk_bytes="64MiB") as cache:
        for i in range(n):
            cache.put(bytes([i + 1]) * 16, torch.full(shape, float(i)))


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


# -- item 2: no traceback for values past what Python's types take --------------------------------
def test_ls_limit_past_sys_maxsize_lists_everything(tmp_path, capsys):
    build(tmp_path / "s", 3)
    rc, out, err = run(capsys, "ls", str(tmp_path / "s"), "--limit", str(sys.maxsize + 1))
    assert rc == 0 and err == ""
    assert out.strip().endswith("3 of 3 entries, most recently used first.")


def test_purge_older_than_an_age_before_the_epoch_matches_nothing(tmp_path, capsys):
    build(tmp_path / "s", 3)
    rc, out, err = run(capsys, "purge", str(tmp_path / "s"), "--older-than", "1000000w", "--dry-run")
    assert rc == 0 and err == ""
    assert out.startswith("would delete 0 of 3 entries last used before 1970-01-01")
    rc, out, _ = run(capsys, "purge", str(tmp_path / "s"), "--older-than", "1000000w")
    assert rc == 0 and out.startswith("deleted 0 entries") and "3 entries" in out


def test_an_age_too_large_for_a_float_is_bad_usage(tmp_path):
    out = featcache(tmp_path, "purge", str(tmp_path), "--older-than", "9" * 400 + "w")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1].endswith("too large")


PAST_THE_GPU = "import featcache.cli.serving as s\ns.cuda_problem = lambda: None"


@pytest.mark.parametrize("model, prelude, says", [
    # the base install has no huggingface_hub (lmdeploy brings it): what to install
    ("nobody-xyz/no-such-model", "sys.modules['huggingface_hub'] = None",
     "this command needs huggingface_hub, which is not installed: pip install 'featcache[lmdeploy]'"),
    ("{tmp}/no/such/model", "", "no such model directory: '{tmp}/no/such/model'"),
    ("nobody-xyz/no-such-model", "import os\nos.environ['HF_HUB_OFFLINE'] = '1'",
     "cannot get the model 'nobody-xyz/no-such-model' from the Hugging Face hub"),
])
def test_warm_model_problems_past_the_gpu_check_are_one_line(tmp_path, model, prelude, says):
    """What warm says of a model it cannot load, on a machine whose GPU check passes (here
    faked: the GPU is checked first)."""
    (tmp_path / "a.png").write_bytes(b"not really a png")
    model, says = model.format(tmp=tmp_path), says.format(tmp=tmp_path)
    out = featcache(tmp_path, "warm", model, str(tmp_path / "a.png"),
                    prelude=f"{prelude}\n{PAST_THE_GPU}")
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    line = out.stderr.strip()
    assert "\n" not in line and line.startswith(f"featcache warm: error: {says}"), out.stderr


def test_warm_with_a_hub_out_of_reach_fails_in_one_line_within_seconds(tmp_path):
    """A hub id, not cached, on a machine that cannot reach the hub (its endpoint a closed port
    here): one line naming the failure, without huggingface_hub's five retries (23 s of them)."""
    (tmp_path / "a.png").write_bytes(b"not really a png")
    prelude = (f"import os\nos.environ['HF_ENDPOINT'] = 'http://127.0.0.1:9'\n"
               f"os.environ['HF_HUB_CACHE'] = {str(tmp_path / 'hub')!r}\n{PAST_THE_GPU}")
    started = time.monotonic()
    out = featcache(tmp_path, "warm", "nobody-xyz/no-such-model", str(tmp_path / "a.png"), prelude=prelude)
    took = time.monotonic() - started
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.strip().splitlines() == [out.stderr.strip()], out.stderr
    assert out.stderr.startswith("featcache warm: error: cannot get the model 'nobody-xyz/no-such-model' "
                                 "from the Hugging Face hub (ConnectError"), out.stderr
    assert took < 8, took


# -- item 3: warm checks the GPU first ---------------------------------------------------------------
@pytest.mark.skipif(CUDA, reason="the case is a machine without CUDA")
def test_warm_without_a_gpu_fails_at_once_without_asking_the_hub(tmp_path):
    """A hub id on a GPU-less machine: the GPU line within 5 s, and no hub access at all (any
    import of huggingface_hub would fail this run)."""
    (tmp_path / "a.png").write_bytes(b"not really a png")
    started = time.monotonic()
    out = featcache(tmp_path, "warm", "nobody-xyz/no-such-model", str(tmp_path / "a.png"),
                    prelude="sys.modules['huggingface_hub'] = None")
    took = time.monotonic() - started
    assert out.returncode == 1, out.stderr
    assert out.stderr.strip().splitlines() == [out.stderr.strip()]
    assert out.stderr.startswith("featcache warm: error: this command needs a CUDA GPU")
    assert took < 5, took


# -- item 4: serve without MODEL ---------------------------------------------------------------------
@pytest.mark.parametrize("argv", [["serve"], ["serve", "--cache-dir", "x"]])
def test_serve_without_model_says_so_in_one_line(tmp_path, argv):
    out = featcache(tmp_path, *argv)
    assert out.returncode == 2 and out.stdout == ""
    usage, error = out.stderr.strip().splitlines()
    assert usage.startswith("usage: featcache serve MODEL")
    assert error.startswith("featcache serve: error: MODEL is missing")


# -- item 6: live pages and what compact would give back ---------------------------------------------
def test_stats_after_purge_all_shows_the_free_pages_and_purge_says_compact_gives_them_back(
        tmp_path, capsys):
    store = tmp_path / "s"
    build(store, 12, shape=(256, 1024))  # 12 MiB of values
    rc, out, _ = run(capsys, "purge", str(store), "--all")
    assert rc == 0
    deleted, advice = out.strip().splitlines()
    assert deleted.startswith("deleted 12 entries")
    assert advice.startswith("the data file stays 12.") and (
        f"`featcache compact {store} DEST` would give back 12.") in advice
    rc, out, _ = run(capsys, "stats", str(store), "--json")
    lmdb_doc = json.loads(out)["lmdb"]
    assert lmdb_doc["live_bytes"] <= 8 * lmdb_doc["page_size"]  # meta pages, main table, info
    assert lmdb_doc["reclaimable_bytes"] == lmdb_doc["data_file_bytes"] - lmdb_doc["live_bytes"]
    assert lmdb_doc["reclaimable_bytes"] > 12 << 20
    rc, out, _ = run(capsys, "stats", str(store))
    assert "pages      16.0 KiB live, 12." in out and "MiB free" in out
    rc, out, _ = run(capsys, "compact", str(store), str(tmp_path / "c"), "--json")
    assert json.loads(out)["dest_data_file_bytes"] == lmdb_doc["live_bytes"]  # what stats said


def test_purge_says_nothing_of_compact_when_little_would_come_back(tmp_path, capsys):
    store = tmp_path / "s"
    build(store, 3)
    rc, out, _ = run(capsys, "purge", str(store), "--all")
    assert rc == 0 and out.count("\n") == 1 and "compact" not in out
    rc, out, _ = run(capsys, "purge", str(store), "--all", "--json")
    doc = json.loads(out)
    assert doc["reclaimable_bytes"] < 1 << 20 and doc["data_file_bytes"] > 0


# -- issue 52: the video limits ------------------------------------------------------------------------
def test_serve_video_limits_reach_the_media_policy():
    import argparse

    from featcache.cli.videoflags import VIDEO_FLAGS, video_limits
    from featcache.config import VIDEO_OPTIONS
    from featcache.lmdeploy.request.media import VideoLimits

    parser = argparse.ArgumentParser()
    for name, kind, _ in VIDEO_FLAGS:
        parser.add_argument(VIDEO_OPTIONS[name], dest=name, type=kind)
    args = parser.parse_args(["--max-video-bytes", "8MiB", "--max-sampled-frames", "16",
                              "--max-video-seconds", "90.5"])
    assert video_limits(args) == VideoLimits(max_video_bytes=8 << 20, max_sampled_frames=16,
                                             max_video_seconds=90.5)
    assert video_limits(parser.parse_args([])) == VideoLimits()


@pytest.mark.parametrize("flag, value", [("--max-video-bytes", "0"), ("--max-video-frames", "-3"),
                                         ("--max-video-seconds", "nan"), ("--max-sampled-frames", "2.5")])
def test_serve_refuses_a_video_limit_that_is_none_as_bad_usage(tmp_path, flag, value):
    out = featcache(tmp_path, "serve", "some/model", flag, value)
    assert out.returncode == 2 and out.stdout == ""
    assert f"argument {flag}" in out.stderr and "Traceback" not in out.stderr


# -- the small ones: an LMDB of another program's, empty names, a file for a directory ----------------
def _foreign(path: Path) -> None:
    import lmdb

    env = lmdb.open(str(path), map_size=1 << 20)
    with env.begin(write=True) as txn:
        txn.put(b"their-key", b"their value")
    env.close()


def test_a_cache_and_the_demo_refuse_another_programs_lmdb_and_write_nothing_there(tmp_path, capsys):
    from featcache.errors import StoreFormatError

    foreign = tmp_path / "theirs"
    _foreign(foreign)
    before = sorted(p.name for p in foreign.iterdir())
    with pytest.raises(StoreFormatError, match="not a featcache store .*their-key"):
        FeatureCache(device="cpu", device_bytes="1MiB", host_bytes=0, disk_path=foreign,
                     disk_bytes="16MiB")
    out = featcache(tmp_path, "demo", "--cache-dir", str(foreign), "--turns", "2")
    assert out.returncode == 1 and "not a featcache store" in out.stderr and "Traceback" not in out.stderr
    assert sorted(p.name for p in foreign.iterdir()) == before  # no key secret, no table added
    rc, _, err = run(capsys, "stats", str(foreign))
    assert rc == 1 and "not a featcache store" in err


def test_an_empty_data_file_says_what_it_is(tmp_path, capsys):
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "data.mdb").write_bytes(b"")
    rc, _, err = run(capsys, "stats", str(tmp_path / "s"))
    assert rc == 1 and "its data.mdb is empty (0 bytes)" in err and "Bad file descriptor" not in err


def test_demo_refuses_an_empty_cache_dir(tmp_path, capsys):
    rc, _, err = run(capsys, "demo", "--cache-dir", "", "--turns", "2")
    assert rc == 2 and "--cache-dir '' names no directory" in err


def test_warm_from_dir_that_is_a_file_says_so(tmp_path, capsys):
    (tmp_path / "a.png").write_bytes(b"x")
    rc, _, err = run(capsys, "warm", "some/model", "--from-dir", str(tmp_path / "a.png"))
    assert rc == 2 and "is a file, not a directory" in err


@pytest.mark.parametrize("inside", ["copy", "."])
def test_compact_refuses_a_destination_inside_its_source(tmp_path, capsys, inside):
    store = tmp_path / "s"
    build(store, 3)
    before = sorted(p.name for p in store.iterdir())
    rc, _, err = run(capsys, "compact", str(store), str(store / inside))
    assert rc == 1 and "is inside the store" in err
    assert sorted(p.name for p in store.iterdir()) == before


def test_the_docs_name_every_eviction_policy_and_the_default():
    """Every ``--eviction A|B|C`` the docs show lists the policies the server takes, and the CLI
    page names the default as the code has it (a stale ``value|lru`` was shown after ``admit``
    became the default)."""
    import re

    from featcache.config import DEFAULTS, EVICTIONS

    root = Path(__file__).resolve().parent.parent
    for page in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        for shown in re.findall(r"--eviction ([a-z|]+)", page.read_text()):
            if "|" in shown:
                assert set(shown.split("|")) == set(EVICTIONS), f"{page.name}: --eviction {shown}"
    assert f"`{DEFAULTS['eviction']}`, the default" in (root / "docs" / "cli.md").read_text()


def test_serve_help_works_without_lmdeploy_and_says_what_to_install(tmp_path):
    out = featcache(tmp_path, "serve", "--help", prelude="sys.modules['lmdeploy'] = None")
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    assert "--max-video-bytes" in out.stdout and "--cache-dir" in out.stdout  # featcache's own
    assert "lmdeploy is not installed" in out.stdout
    assert "pip install 'torch<=2.12.1' 'featcache[lmdeploy]'" in out.stdout
    root = Path(__file__).resolve().parent.parent
    for page in ("README.md", "docs/serving.md"):
        assert "pip install 'torch<=2.12.1'" in (root / page).read_text().replace("\n", " "), page


@pytest.mark.parametrize("where", ["under-a-file", "proc"])
def test_warm_says_first_that_its_store_cannot_be_made(tmp_path, capsys, where):
    """Before the GPU check and before anything is said of the store's key secret."""
    if where == "proc" and not os.path.isdir("/proc/self"):
        pytest.skip("no /proc here")
    (tmp_path / "a.png").write_bytes(b"x")
    store = str(tmp_path / "a.png" / "store") if where == "under-a-file" else "/proc/featcache-store"
    rc, _, err = run(capsys, "warm", "some/model", str(tmp_path / "a.png"), "--cache-dir", store)
    assert rc == 1 and err.count("\n") == 1 and f"the store directory {store} cannot be created" in err
