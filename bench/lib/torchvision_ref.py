"""torchvision's real transforms, for lmdeploy's InternVL-Chat-V1-5 preprocessing on this CPU.

lmdeploy builds that preprocessing from torchvision's ``Compose``/``Lambda``/``Resize``/
``ToTensor``/``Normalize``. No torchvision build loads beside the CPU torch 2.13.0 (its compiled
ops register against another torch), but those five classes are pure Python. The test command
installs the torchvision wheel aside (``pip install --no-deps --target .cache/torchvision-ref
torchvision==0.29.1``, off ``sys.path``); ``installed()`` then puts its package in
``sys.modules`` without running its ``__init__`` (which loads the compiled ops), so lmdeploy's
``import torchvision.transforms`` gets torchvision's own code, and takes it out again after (so
that transformers, which probes for torchvision, never sees it). Where torchvision imports
(the GPU machine), that torchvision is used. Used by tests/test_preprocess_exact.py and
``bench/distinct.py stages`` on a CPU.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import types
from collections.abc import Iterator

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout
REF_DIR = os.environ.get("FEATCACHE_TORCHVISION_REF", os.path.join(ROOT, ".cache", "torchvision-ref"))
INSTALL = ("python3 -m pip install --no-deps --target .cache/torchvision-ref torchvision==0.29.1")


def _importable() -> bool:
    try:
        import torchvision.transforms  # noqa: F401
    except Exception:
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
        return False
    return True


def missing() -> str | None:
    """Why torchvision's transforms cannot be had here, or None."""
    if importlib.util.find_spec("torchvision") is not None and _importable():
        return None
    if os.path.isfile(os.path.join(REF_DIR, "torchvision", "transforms", "transforms.py")):
        return None
    return f"torchvision's transforms are not at {REF_DIR} ({INSTALL})"


@contextlib.contextmanager
def installed() -> Iterator[None]:
    """torchvision's transforms importable inside the block (see the module docstring)."""
    if importlib.util.find_spec("torchvision") is not None and _importable():
        yield
        return
    before = set(sys.modules)
    package = types.ModuleType("torchvision")
    package.__path__ = [os.path.join(REF_DIR, "torchvision")]  # type: ignore[attr-defined]
    sys.modules["torchvision"] = package
    try:
        yield
    finally:
        for name in set(sys.modules) - before:
            if name == "torchvision" or name.startswith("torchvision."):
                del sys.modules[name]
