"""The house's layers (.importlinter, docs/design.md "The house") are kept by import-linter: the
suite runs ``lint-imports`` on the package, and a layer broken in a copy of it fails with that
contract's name."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / ".importlinter"


def lint(path: Path) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` with the house's contracts, on the package found first on ``path``."""
    env = dict(os.environ, PYTHONPATH=str(path))
    run = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    return subprocess.run([sys.executable, "-c", run, "--config", str(CONFIG), "--no-cache"],
                          cwd=path, env=env, capture_output=True, text=True, timeout=300)


def test_every_contract_of_the_house_is_kept():
    done = lint(ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout


@pytest.mark.parametrize("module, line, contract", [
    ("eviction/lru.py", "import featcache.lmdeploy.request.frontend",
     "The store's core never imports lmdeploy"),
    ("eviction/lrumap.py", "import featcache.server.shutdown", "The store's core never imports lmdeploy"),
    ("tiers/disk.py", "import lmdeploy", "The store's core never imports lmdeploy"),
    ("lmdeploy/pytorch/prefix.py", "from ..turbomind import native",
     "The PyTorch engine's hooks never import TurboMind"),
    ("lmdeploy/turbomind/route.py", "from ..pytorch import ranks",
     "TurboMind's paths never import the PyTorch engine"),
    ("server/serve.py", "import featcache.cli.render", "The CLI sits on top"),
])
def test_a_broken_layer_fails_with_its_contracts_name(tmp_path, module, line, contract):
    copy = tmp_path / "featcache"
    shutil.copytree(ROOT / "featcache", copy, ignore=shutil.ignore_patterns("__pycache__"))
    target = copy / module
    target.write_text(target.read_text() + f"\n{line}  # planted\n")
    done = lint(tmp_path)
    assert done.returncode != 0, done.stdout
    assert f"{contract}" in done.stdout and "BROKEN" in done.stdout, done.stdout
