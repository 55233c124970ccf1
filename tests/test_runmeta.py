"""Run metadata (bench/lib/results.py): the source digest names the code that ran, whatever the
copy's .git says; ``python3 bench/runmeta.py which DIGEST`` finds the commit it names."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.lib import results  # noqa: E402


@pytest.mark.skipif(not os.path.isdir(os.path.join(ROOT, ".git")), reason="needs a git checkout")
def test_source_digest_matches_its_commit_and_changes_with_the_code(tmp_path) -> None:
    clone = tmp_path / "c"
    subprocess.run(["git", "clone", "-q", ROOT, str(clone)], check=True)
    d = results.source_digest(str(clone))
    assert d == results.commit_digest("HEAD", str(clone))
    head = subprocess.run(["git", "-C", str(clone), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()
    which = subprocess.run([sys.executable, str(clone / "bench" / "runmeta.py"), "which", d, "1"],
                           capture_output=True, text=True, timeout=120)
    assert which.returncode == 0 and which.stdout.split() == [head], which.stdout + which.stderr
    (clone / "bench" / "runmeta.py").write_text("# changed\n")
    assert results.source_digest(str(clone)) != d
