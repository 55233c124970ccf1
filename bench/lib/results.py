"""Results files and what each records about the run it measured: versions, GPU, commit, start
time, and a digest of the code that ran. Every results JSON a benchmark writes goes through
``write_report`` (or ``write_json`` with a ``run_meta`` of its own under ``"meta"``).

The device machine's copy of the checkout carries the working tree but its ``.git`` may lag behind
(a run on 2026-11-30 reported the session's first commit for code three commits later), so the
commit is recorded with ``dirty`` (the tracked sources differ from it) and ``source_digest``: the
sha256 of featcache/ and bench/'s Python files, which names the code exactly (``commit_digest``: a
commit's). Which commit was it?

    python3 bench/runmeta.py which DIGEST [N]   # the commits among the last N (50) with that digest
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import time
from typing import Any

ROOTS = ("featcache", "bench")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout


def _digest(files: dict[str, bytes]) -> str:
    h = hashlib.sha256()
    for name in sorted(files):
        h.update(name.encode() + b"\0" + hashlib.sha256(files[name]).digest())
    return h.hexdigest()[:16]


def source_digest(root: str = ROOT) -> str:
    """sha256 over (path, content) of every ``*.py`` under featcache/ and bench/ in ``root``."""
    files = {}
    for top in ROOTS:
        for d, _, names in os.walk(os.path.join(root, top)):
            for n in names:
                if n.endswith(".py"):
                    p = os.path.join(d, n)
                    with open(p, "rb") as f:
                        files[os.path.relpath(p, root)] = f.read()
    return _digest(files)


def commit_digest(commit: str, root: str = ROOT) -> str:
    """``source_digest`` of the tree at ``commit`` (from git, not the working tree)."""
    def git(*a: str) -> bytes:
        return subprocess.run(["git", "-C", root, *a], capture_output=True, check=True).stdout

    names = [n for n in git("ls-tree", "-r", "--name-only", commit, *ROOTS).decode().splitlines()
             if n.endswith(".py")]
    return _digest({n: git("show", f"{commit}:{n}") for n in names})


def run_meta(**fields: Any) -> dict[str, Any]:
    """``fields`` plus torch's and lmdeploy's versions (None if absent), the GPU's name when CUDA
    is available, the checkout's short commit and whether the sources differ from it (None where
    there is no .git), the sources' digest and the start time."""
    import torch

    try:
        import lmdeploy

        lmdeploy_version: str | None = lmdeploy.__version__
    except ImportError:
        lmdeploy_version = None
    m: dict[str, Any] = dict(fields, torch=torch.__version__, lmdeploy=lmdeploy_version,
                             started=time.strftime("%Y-%m-%d %H:%M:%S"))
    if torch.cuda.is_available():
        m["gpu"] = torch.cuda.get_device_name()
    try:
        m["commit"] = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                                     capture_output=True, text=True, timeout=5).stdout.strip() or None
        m["dirty"] = subprocess.run(["git", "-C", ROOT, "diff", "--quiet", "HEAD", "--", *ROOTS],
                                    capture_output=True, timeout=5).returncode != 0 if m["commit"] else None
    except Exception:  # noqa: BLE001 - the device copy may have no .git
        m["commit"] = m["dirty"] = None
    m["source_digest"] = source_digest()
    return m


def has_run_meta(report: dict[str, Any]) -> bool:
    """Whether ``report`` carries this run's metadata: under ``"run"``, or under ``"meta"`` as the
    PyTorch-engine and TurboMind benches record it when their run begins (plot_bench reads it)."""
    meta = report.get("meta")
    return "run" in report or (isinstance(meta, dict) and "source_digest" in meta)


def write_json(path: str, obj: Any) -> None:
    """The one way a results file is written: indented JSON, anything else as its ``str``."""
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, default=str)


def write_report(path: str, report: dict[str, Any]) -> None:
    """Write ``report`` as JSON to ``path`` with this run's metadata under ``"run"`` (``run_meta``,
    once per report: a report rewritten as its run goes keeps the first; where that fails, its
    error: the figures stand without it), unless it carries its own (``has_run_meta``)."""
    if not has_run_meta(report):
        try:
            report["run"] = run_meta()
        except Exception as e:  # noqa: BLE001
            report["run"] = {"error": str(e)}
    write_json(path, report)


def emit(report: dict[str, Any], path: str | None = None) -> int:
    """A finished run's report: printed as JSON, and written to ``path`` where one is given
    (``write_report``: with the run's metadata). Returns 0, the run's exit code."""
    print(json.dumps(report, indent=1), flush=True)
    if path:
        write_report(path, report)
    return 0


def at(d: dict[str, Any], path: str) -> Any:
    """The value at a dotted ``path`` of a results dict (``"b_multi_turn.turn_1"``); {} where
    any step is missing."""
    for k in path.split("."):
        d = d.get(k, {}) if isinstance(d, dict) else {}
    return d
