"""bench/runmeta.py: the source digest names the code that ran, whatever the copy's .git says."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
import runmeta  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(not os.path.isdir(os.path.join(ROOT, ".git")), reason="needs a git checkout")
def test_source_digest_matches_its_commit_and_changes_with_the_code(tmp_path) -> None:
    clone = tmp_path / "c"
    subprocess.run(["git", "clone", "-q", ROOT, str(clone)], check=True)
    d = runmeta.source_digest(str(clone))
    assert d == runmeta.commit_digest("HEAD", str(clone))
    (clone / "bench" / "runmeta.py").write_text("# changed\n")
    assert runmeta.source_digest(str(clone)) != d
