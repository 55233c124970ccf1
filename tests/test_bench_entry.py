"""``python -m bench`` (bench/__main__.py): it lists every runnable file under bench/ with its line,
runs each one's ``--help`` through the entry point, and runs a benchmark as its file does (the same
output and exit code, arguments passed through)."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.__main__ import runnable, summary  # noqa: E402

ENV = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the entry point sets its own


def entry(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "bench", *args], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=timeout)


def by_file(name: str, *args: str) -> subprocess.CompletedProcess[str]:
    """The file form, as bench/device's scripts run it: from the root, the root on PYTHONPATH."""
    return subprocess.run([sys.executable, runnable()[name], *args], cwd=ROOT,
                          env=dict(ENV, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=120)


def test_the_list_names_every_runnable_file_with_its_line():
    files = runnable()
    assert {"e2e_lmdeploy", "serve_chat", "serve_latency", "serve_stages", "turbomind_bench",
            "plot_bench", "make_tiny_vlm"} <= set(files)
    assert not {"pyspy", "timing", "results", "__init__", "__main__"} & set(files)  # modules
    out = entry()
    assert out.returncode == 0, out.stderr
    for name, path in files.items():
        line = next((x for x in out.stdout.splitlines()
                     if x.startswith("  ") and x.split()[:1] == [name]), None)
        assert line is not None, name
        assert summary(path) in line and "(no docstring)" not in line and "unreadable" not in line
    assert "featcache on the real lmdeploy 0.18 PyTorch engine" in out.stdout


def test_every_runnable_file_is_listed_under_the_question_it_answers():
    """A new bench file goes under a user's question, the checks, the tools or the builders
    (bench/__main__.py's QUESTIONS, CHECKS, TOOLS): none is left in "not yet placed"."""
    from bench.__main__ import groups

    placed = groups()
    assert not [t for t in placed if t.startswith("not yet placed")], placed
    assert sorted(n for names in placed.values() for n in names) == sorted(runnable())
    assert placed["a pipeline (PyTorch engine): repeated and new images, chat turns, clients at once; "
                  "token identity:"] == ["e2e_lmdeploy"]


def test_every_checkpoint_a_run_names_has_its_builder():
    """bench/lib/models.py's CHECKPOINTS: each names a builder file that exists."""
    from bench.lib.models import CHECKPOINTS

    for name, cmd in CHECKPOINTS.items():
        assert os.path.isfile(os.path.join(ROOT, cmd.split()[0])), (name, cmd)
    assert {"qwen3vl_tiny", "cogvlm_tiny", "qwen3vl_2b_shape", "internvl3_2b_shape"} <= set(CHECKPOINTS)


@pytest.mark.timeout(600)  # every bench file's start-up, 4 at a time: 145 s on a shared 2-core machine
def test_every_runnable_file_answers_help_through_the_entry_point():
    names = sorted(runnable())
    with ThreadPoolExecutor(4) as pool:
        results = dict(zip(names, pool.map(lambda n: entry(n, "--help", timeout=240), names), strict=True))
    failed = {n: (r.returncode, (r.stdout + r.stderr)[-600:]) for n, r in results.items()
              if r.returncode != 0 or not r.stdout.strip()}
    assert not failed, failed


@pytest.mark.parametrize("args", [("e2e_lmdeploy", "--help"), ("runmeta", "which"),
                                  ("serve_stages", "--stages-out", "x"),
                                  ("shutdown_serve", "--dry-run", "--model", "/m/x", "--out", "/tmp/never")])
def test_a_benchmark_runs_as_its_file_does(args):
    """The same output and exit code (runmeta with no digest and serve_stages with no command
    exit 2) through ``python -m bench NAME`` as through ``python3 bench/NAME.py``."""
    via_entry, via_file = entry(*args), by_file(*args)
    assert via_entry.returncode == via_file.returncode
    assert via_entry.stdout == via_file.stdout and via_entry.stdout
    assert not os.path.exists("/tmp/never")


def test_a_dry_run_through_the_entry_point(tmp_path):
    out = entry("serve_chat", "--dry-run", "--backend", "turbomind", "--model", "/m/x",
                "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr[-2000:]
    assert "[dry-run] featcache:" in out.stdout and "--backend turbomind" in out.stdout
    assert "image_a 4 turns" in out.stdout


def test_an_unknown_name_is_refused_with_the_list():
    out = entry("no_such_bench")
    assert out.returncode == 2 and "no_such_bench" in out.stderr and "serve_chat" in out.stderr


def test_every_command_in_the_docs_names_a_runnable_file():
    """docs/*.md write their bench commands as ``python3 -m bench NAME``: each NAME is one the
    entry point runs, and no command is left in the file form (the runs are rerun as written)."""
    import glob
    import re

    from bench.__main__ import runnable

    names = set(runnable())
    used, file_form = set(), []
    for path in glob.glob(os.path.join(ROOT, "docs", "*.md")):
        with open(path) as f:
            text = f.read()
        doc = os.path.basename(path)
        used |= {(doc, m) for m in re.findall(r"python3? -m bench (\w+)", text) if m != "NAME"}
        file_form += [(doc, m) for m in re.findall(r"python3? bench/(?:device/)?(\w+)\.py", text)
                      if m != "NAME"]
    assert used and {name for _, name in used} <= names, sorted(u for u in used if u[1] not in names)
    assert file_form == [], file_form
