import os

# The video cases (tests/video) run in an interpreter of their own, started by
# tests/test_lmdeploy_video.py with this variable set: transformers must find torchvision's
# transforms before it is first imported (``video_tiny``), which the rest of the suite must not.
VIDEO_CASES = "FEATCACHE_VIDEO_CASES"
if os.environ.get(VIDEO_CASES):
    import video_tiny

    video_tiny.torchvision_for_transformers()
collect_ignore = [] if os.environ.get(VIDEO_CASES) else ["video"]

import pytest  # noqa: E402
import torch  # noqa: E402

from featcache.config import DEFAULTS  # noqa: E402

# FEATCACHE_TEST_EVICTION=lru runs the tests with that eviction policy as every cache's default
# ("value" is featcache's; issue 30: the reliability suite passes with "lru" and "value"); it
# reaches this process and its forked children, not children started with spawn or as new
# interpreters (they keep featcache's default).
if os.environ.get("FEATCACHE_TEST_EVICTION"):
    DEFAULTS["eviction"] = os.environ["FEATCACHE_TEST_EVICTION"]


def pytest_report_header(config):
    return f"featcache eviction default: {DEFAULTS['eviction']}"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(
        reason="needs CUDA: on the GPU run list (docs/benchmarks.md, 'The GPU run list')")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
