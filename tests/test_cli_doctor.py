"""``featcache doctor`` (issue 18 item 7): one line per check, or one JSON document; exit 0 when
featcache's core works, 1 when it does not; what is missing says what to install."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import featcache.core.cache as cache_module
from featcache.cli import main

ROOT = Path(__file__).resolve().parent.parent
CORE = {"python", "featcache", "torch", "lmdb", "xxhash", "numpy", "core"}
ALL = CORE | {"cuda", "lmdeploy", "lmdeploy.pytorch", "lmdeploy.turbomind", "redis",
              "prometheus_client", "PIL", "store", "budget.device", "budget.host", "budget.disk"}


def doctor(*argv: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "featcache", "doctor", *argv], capture_output=True,
                          text=True, timeout=600, cwd=ROOT, env=env)


def environment(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "FEATCACHE_DIR": str(tmp_path / "store")}


def test_doctor_prints_one_line_per_check_and_exits_0(tmp_path):
    done = doctor(env=environment(tmp_path))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[-1] == "featcache's core works"
    checks = {}
    for line in lines[:-1]:
        status, name, detail = line.split(None, 2)
        assert status in ("ok", "--", "FAIL"), line
        checks[name] = (status, detail)
    assert set(checks) == ALL
    assert all(checks[name][0] == "ok" for name in CORE)
    assert str(tmp_path / "store") in checks["store"][1] and "can be created" in checks["store"][1]
    for status, detail in checks.values():  # whatever is missing says what to do
        assert status == "ok" or "; fix: " in detail
    import torch

    assert checks["torch"][1] == torch.__version__
    if not torch.cuda.is_available():
        assert checks["cuda"][0] == "--" and "CUDA build of torch" in checks["cuda"][1]
    assert "Traceback" not in done.stderr


def test_doctor_json_shape(tmp_path):
    done = doctor("--json", env=environment(tmp_path))
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert set(report) == {"ok", "checks", "budgets"} and report["ok"] is True
    assert [t["tier"] for t in report["budgets"]["tiers"]] == ["device", "host", "disk"]
    assert {c["name"] for c in report["checks"]} == ALL
    for c in report["checks"]:
        assert set(c) == {"name", "status", "detail", "fix", "required"}
        assert c["required"] == (c["name"] in CORE)
        assert c["status"] in ("ok", "--", "FAIL") and isinstance(c["detail"], str)


def test_a_broken_core_exits_1_and_says_why(tmp_path, monkeypatch, capsys):
    def broken(*args, **kwargs):
        raise OSError("disk on fire")

    monkeypatch.setattr(cache_module, "FeatureCache", broken)
    monkeypatch.setenv("FEATCACHE_DIR", str(tmp_path))
    assert main(["doctor"]) == 1
    out = capsys.readouterr().out
    core = next(line for line in out.splitlines() if line.split()[1] == "core")
    assert core.startswith("FAIL") and "OSError: disk on fire" in core and "; fix: " in core
    assert out.splitlines()[-1].startswith("featcache's core does not work here")
    assert main(["doctor", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["ok"] is False


def _store_line(done: subprocess.CompletedProcess[str]) -> str:
    return next(line for line in done.stdout.splitlines() if line.split()[1:2] == ["store"])


@pytest.mark.parametrize("damage", ["random", "empty", "truncated"])
def test_doctor_reports_a_broken_store_as_stats_does(tmp_path, damage):
    """A default store whose data file is random bytes, empty or cut short: FAIL, with what
    ``featcache stats`` says of it (its core still works: exit 0)."""
    store = tmp_path / "store"
    if damage == "truncated":
        import torch

        from featcache import FeatureCache

        with FeatureCache(device="cpu", device_bytes="1MiB", host_bytes=0, disk_path=store,
                          disk_bytes="64MiB") as cache:
            for i in range(40):
                cache.put(bytes([i]) * 16, torch.randn(256, 256), block=True)
        data = store / "data.mdb"
        data.write_bytes(data.read_bytes()[: data.stat().st_size // 3])
    else:
        store.mkdir()
        (store / "data.mdb").write_bytes(os.urandom(100_000) if damage == "random" else b"")
    done = doctor(env=environment(tmp_path))
    line = _store_line(done)
    assert line.startswith("FAIL") and "BROKEN" in line and "; fix: move it aside" in line, line
    stats = subprocess.run([sys.executable, "-m", "featcache", "stats", str(store)], capture_output=True,
                           text=True, timeout=120, cwd=ROOT, env=environment(tmp_path))
    assert stats.returncode == 1 and stats.stderr.split("error: ", 1)[1].strip() in line
    if damage == "empty":
        assert "its data.mdb is empty (0 bytes)" in line
    assert done.returncode == 0 and "Traceback" not in done.stderr


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="no /proc here")
def test_doctor_says_a_store_cannot_be_created_where_no_directory_can_be(tmp_path):
    """Under /proc (root may write there by its permissions, yet no directory can be made) and
    under a file."""
    env = environment(tmp_path)
    line = _store_line(doctor(env={**env, "FEATCACHE_DIR": "/proc/featcache-store"}))
    assert line.startswith("--") and "CANNOT be created (/proc:" in line, line
    (tmp_path / "file").write_text("x")
    line = _store_line(doctor(env={**env, "FEATCACHE_DIR": str(tmp_path / "file" / "store")}))
    assert line.startswith("--") and "is a file, not a directory" in line, line
