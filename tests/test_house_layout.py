"""The house's folders (issue 42 item 1): every import path the docs name works, and no folder of
the package holds more than a dozen modules flat."""

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

# The most modules (``__init__.py`` not counted) any folder of the package holds flat; the
# package's root holds more (its foundation: keys, settings, sizes, codec, errors; metrics; the
# applications warm and demo: the store's core went to ``core/``), and may not grow past it.
MOST_FLAT = 12
MOST_FLAT_ROOT = 15


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
            [p for p in folder.glob("*.py") if p.name != "__init__.py"])
    root = counts.pop("featcache")
    assert root <= MOST_FLAT_ROOT, f"featcache/ holds {root} modules flat (at most {MOST_FLAT_ROOT})"
    crowded = {folder: n for folder, n in counts.items() if n > MOST_FLAT}
    assert not crowded, f"more than {MOST_FLAT} modules flat: {crowded}"


def test_the_lmdeploy_integration_is_split_by_purpose():
    """The request side, the PyTorch engine, TurboMind (no ``tm_`` prefixes) and the preprocessing."""
    lmdeploy = PACKAGE / "lmdeploy"
    assert {p.name for p in lmdeploy.iterdir() if p.is_dir() and p.name != "__pycache__"} == {
        "request", "pytorch", "turbomind"}
    assert not list(lmdeploy.rglob("tm_*.py"))
    assert {p.name for p in lmdeploy.glob("*.py")} == {"__init__.py", "fastprep.py", "media.py"}
