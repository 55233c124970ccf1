"""The video cases (tests/video/test_lmdeploy_video.py, issue 52) in an interpreter of their own.

transformers' real video processors need torchvision, which these tests give transformers from
the wheel installed aside (``video_tiny``) before transformers is first imported: that must not
happen in the suite's own interpreter, whose other tests run transformers without torchvision
(its PIL image processors). So this test runs pytest on tests/video in a new interpreter with
``FEATCACHE_VIDEO_CASES`` set (tests/conftest.py) and passes when every case there passes."""

from __future__ import annotations

import os
import subprocess
import sys

import _lmdeploy_stack
import pytest

_lmdeploy_stack.require()

import video_tiny  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_every_video_case_passes():
    if not os.path.isdir(os.path.join(video_tiny.REF_DIR, "torchvision")):
        pytest.fail(f"torchvision's wheel is not installed aside at {video_tiny.REF_DIR} "
                    "(README's test command)")
    env = dict(os.environ, FEATCACHE_VIDEO_CASES="1")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/video"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=1100)
    assert run.returncode == 0, run.stdout[-8000:] + run.stderr[-3000:]
    assert " passed" in run.stdout and " failed" not in run.stdout
