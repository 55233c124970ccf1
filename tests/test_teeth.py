"""The test suite's own guards (issue 32): a missing dependency skips naming it and fails CI; a
thread that crashes fails its test."""

from __future__ import annotations

import os
import subprocess
import sys

import _lmdeploy_stack
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# -- item 1: the lmdeploy stack --------------------------------------------------------------------
def test_a_module_missing_deep_in_the_stack_is_named(tmp_path, monkeypatch):
    (tmp_path / "featcache_teeth_outer.py").write_text("import featcache_teeth_absent\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    why = _lmdeploy_stack.missing("featcache_teeth_outer", stack=False)
    assert why == "module 'featcache_teeth_absent' is not installed (imported by featcache_teeth_outer)"
    assert _lmdeploy_stack.missing("featcache_teeth_absent", stack=False) == (
        "module 'featcache_teeth_absent' is not installed")

    monkeypatch.delenv(_lmdeploy_stack.REQUIRE_ENV, raising=False)
    with pytest.raises(pytest.skip.Exception, match="featcache_teeth_absent"):
        _lmdeploy_stack.need("featcache_teeth_outer", stack=False)
    monkeypatch.setenv(_lmdeploy_stack.REQUIRE_ENV, "1")
    with pytest.raises(pytest.fail.Exception, match="featcache_teeth_absent.*FEATCACHE_REQUIRE_LMDEPLOY=1"):
        _lmdeploy_stack.need("featcache_teeth_outer", stack=False)


def test_ci_requires_the_lmdeploy_stack_and_redis():
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        script = f.read()
    assert "export FEATCACHE_REQUIRE_LMDEPLOY=1\n" in script
    assert "export FEATCACHE_REQUIRE_REDIS=1\n" in script


def test_no_test_file_skips_on_a_bare_importorskip_of_the_lmdeploy_stack():
    """``pytest.importorskip("lmdeploy")`` skips on any module missing below lmdeploy, with its own
    message and never failing CI: the lmdeploy stack goes through ``_lmdeploy_stack``."""
    stack = ("lmdeploy", "transformers", "openai", "fastapi", "shortuuid", "pybase64")
    offenders = []
    for name in sorted(os.listdir(os.path.join(ROOT, "tests"))):
        if name.endswith(".py") and name != "test_teeth.py":
            with open(os.path.join(ROOT, "tests", name)) as f:
                for n, line in enumerate(f, 1):
                    if any(f'importorskip("{m}' in line for m in stack):
                        offenders.append(f"{name}:{n}")
    assert offenders == []


def test_pybase64_missing_fails_the_lmdeploy_tests_under_the_ci_switch(tmp_path):
    """The audit's case: only ``pybase64`` missing. Without the switch the lmdeploy tests skip,
    naming it; with ``FEATCACHE_REQUIRE_LMDEPLOY=1`` (CI) they fail, naming it."""
    _lmdeploy_stack.need("lmdeploy")  # the stack itself is here (else this case says nothing)
    run = ("import sys; sys.modules['pybase64'] = None; import pytest; "
           "sys.exit(pytest.main(['-q', '-rs', '-p', 'no:cacheprovider', "
           "'tests/test_lmdeploy_defaults.py']))")
    env = {k: v for k, v in os.environ.items() if k != _lmdeploy_stack.REQUIRE_ENV}
    skipped = subprocess.run([sys.executable, "-c", run], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=300)
    assert skipped.returncode == 5, skipped.stdout + skipped.stderr  # 5: a module-level skip
    assert "1 skipped" in skipped.stdout and "module 'pybase64' is not installed" in skipped.stdout
    failed = subprocess.run([sys.executable, "-c", run], cwd=ROOT, capture_output=True, text=True,
                            env={**env, _lmdeploy_stack.REQUIRE_ENV: "1"}, timeout=300)
    assert failed.returncode != 0
    assert "module 'pybase64' is not installed" in failed.stdout
    assert "FEATCACHE_REQUIRE_LMDEPLOY=1" in failed.stdout


# -- item 2: a thread's crash fails its test ------------------------------------------------------
CRASHING_THREAD = '''
import threading


def test_a_thread_raises():
    t = threading.Thread(target=lambda: 1 / 0)
    t.start()
    t.join()
'''


def test_an_exception_in_a_tests_thread_fails_the_test(tmp_path):
    """The project's pytest configuration turns pytest's ``PytestUnhandledThreadExceptionWarning``
    (a thread's unhandled exception, which used to pass as a warning) into a failure."""
    (tmp_path / "test_crash.py").write_text(CRASHING_THREAD)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c",
         os.path.join(ROOT, "pyproject.toml"), "--rootdir", str(tmp_path), str(tmp_path)],
        cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "1 failed" in run.stdout and "ZeroDivisionError" in run.stdout
