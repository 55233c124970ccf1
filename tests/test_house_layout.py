"""The house's folders (issue 42 item 1): every import path the docs name works, no folder of the
package holds more than a dozen modules flat, and no module is longer than ``MOST_LINES``."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "featcache"

# What README.md and docs/ tell a user to import (the public names: they stay where they are
# whatever moves inside; a module that moved leaves a re-export where the docs name it).
DOCUMENTED = [
    ("featcache", "FeatureCache"),
    ("featcache", "Lease"),
    ("featcache", "CacheConfig"),
    ("featcache", "image_key"),
    ("featcache.lmdeploy", "pipeline"),
    ("featcache.lmdeploy", "wrap"),
    ("featcache.lmdeploy", "default_cache"),
    ("featcache.lmdeploy", "model_stats"),
    ("featcache.lmdeploy", "multi_process"),
    ("featcache.lmdeploy", "chosen_budgets"),
    ("featcache.lmdeploy", "RequestReport"),
    ("featcache.lmdeploy", "MediaPolicy"),
    ("featcache.lmdeploy.media", "MediaPolicy"),
    ("featcache.lmdeploy.media", "MAX_IMAGE_OPTIONS_BYTES"),
    ("featcache.lmdeploy.media", "LOCAL_FILES"),
    ("featcache.lmdeploy.fastprep", "FastPreprocess"),
    ("featcache.keys", "image_key"),
    ("featcache.config", "DEFAULTS"),
    ("featcache.config", "AUTO_BUDGETS"),
    ("featcache.warm", "warm_images"),
    ("featcache.metrics", "render"),
    ("featcache.eviction", "books_for"),
    ("featcache.entrymeta", "recorded"),
    ("featcache.store.layout", "MAX_KEY_BYTES"),
    ("featcache.cli", "main"),  # the console script (pyproject.toml)
]

# The most modules any folder of the package holds flat, its root included (the foundation:
# keys, settings, sizes, codec, errors; metrics; the applications warm and demo: the store's core
# went to ``core/``, the remote tiers' breaker to ``tiers/``). Not counted: a package's
# ``__init__.py``, and the root's ``__main__.py`` (``python -m featcache``) and ``_version.py``
# (the version pyproject.toml reads), which hold no part of the house.
MOST_FLAT = 12
NOT_COUNTED = {"__init__.py", "__main__.py", "_version.py"}
# The most lines a module of the package holds: past it, a module does more than one job (split
# it along a seam, each part saying in its docstring what it owns).
MOST_LINES = 450


@pytest.mark.parametrize("module, name", DOCUMENTED)
def test_every_documented_name_imports(module, name):
    assert getattr(importlib.import_module(module), name) is not None


def test_every_dotted_path_the_docs_name_resolves():
    """Every ``featcache.x.y`` the docs and the README write in backticks is a module, or a name
    of one: a module that moves takes its docs along (or leaves a re-export where they name it)."""
    texts = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    named = set()
    for path in texts:
        named |= {(m, path.name) for m in re.findall(r"`(featcache(?:\.[A-Za-z_]\w*)+)(?:\(\))?`",
                                                     path.read_text())}
    assert len(named) > 20
    broken = []
    for dotted, where in sorted(named):
        if dotted == "featcache.__main__":  # `python -m featcache`: importing it runs the CLI
            continue
        parts = dotted.split(".")
        for cut in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
            except ModuleNotFoundError:
                continue
            try:
                for attr in parts[cut:]:
                    obj = getattr(obj, attr)
            except AttributeError:
                broken.append(f"{dotted} ({where})")
            break
    assert not broken, "named by the docs but not importable: " + ", ".join(broken)


def test_no_folder_has_more_than_a_dozen_modules_flat():
    counts = {}
    for folder in [PACKAGE, *sorted(p for p in PACKAGE.rglob("*") if p.is_dir())]:
        if folder.name == "__pycache__":
            continue
        counts[folder.relative_to(ROOT).as_posix()] = len(
            [p for p in folder.glob("*.py") if p.name not in NOT_COUNTED])
    assert counts["featcache"] > 0
    crowded = {folder: n for folder, n in counts.items() if n > MOST_FLAT}
    assert not crowded, f"more than {MOST_FLAT} modules flat: {crowded}"


def test_no_module_is_longer_than_the_bar():
    lengths = {path.relative_to(ROOT).as_posix(): len(path.read_text().splitlines())
               for path in PACKAGE.rglob("*.py") if "__pycache__" not in path.parts}
    assert len(lengths) > 100  # the whole package was read
    long = {path: n for path, n in sorted(lengths.items()) if n > MOST_LINES}
    assert not long, f"modules of more than {MOST_LINES} lines (split them along a seam): {long}"


def test_the_lmdeploy_integration_is_split_by_purpose():
    """The request side, the PyTorch engine, TurboMind (no ``tm_`` prefixes) and the preprocessing."""
    lmdeploy = PACKAGE / "lmdeploy"
    assert {p.name for p in lmdeploy.iterdir() if p.is_dir() and p.name != "__pycache__"} == {
        "request", "pytorch", "turbomind"}
    assert not list(lmdeploy.rglob("tm_*.py"))
    # families.py: the model-family declarations both engines' paths read
    assert {p.name for p in lmdeploy.glob("*.py")} == {"__init__.py", "fastprep.py", "media.py",
                                                       "families.py"}


def test_the_license_ships_with_the_package():
    """The repository holds the license's text, and the installed package declares it as an SPDX
    expression with that file (PEP 639; the table form ``{text = ...}`` is deprecated)."""
    import importlib.metadata

    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text
    meta = importlib.metadata.metadata("featcache")
    assert meta["License-Expression"] == "Apache-2.0"
    assert "LICENSE" in (meta.get_all("License-File") or [])
