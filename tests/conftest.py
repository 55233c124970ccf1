import os

import pytest
import torch

from featcache.config import DEFAULTS

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
