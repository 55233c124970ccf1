"""The lmdeploy stack the lmdeploy tests import (requirements/lmdeploy-cpu.txt), or a skip that
names the module missing.

``require(*extra)`` at a test module's top (or ``need(name)`` inside a test) imports lmdeploy (at
least ``MIN_VERSION``), ``lmdeploy.vl.engine``, transformers and ``extra``. A module missing anywhere
in their import chains (lmdeploy itself, or one of its dependencies such as ``pybase64``) skips,
with a reason that names it; with ``FEATCACHE_REQUIRE_LMDEPLOY=1`` (``.ci/run`` sets it) it fails
instead, so that a CI run without the stack cannot pass by skipping it (``pytest.importorskip``
skipped all of these files, silently and with "lmdeploy is not installed", when only ``pybase64``
was missing).
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest

REQUIRE_ENV = "FEATCACHE_REQUIRE_LMDEPLOY"
INSTALL = "pip install --no-deps lmdeploy==0.18.0 -r requirements/lmdeploy-cpu.txt"
MIN_VERSION = (0, 18)
STACK = ("lmdeploy", "lmdeploy.vl.engine", "transformers")


def missing(*modules: str, stack: bool = True) -> str | None:
    """Why the stack (unless not ``stack``) and ``modules`` cannot be imported, naming the module
    missing; or None."""
    for name in (*(STACK if stack else ()), *modules):
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as e:
            gone = e.name or str(e)
            via = "" if gone == name else f" (imported by {name})"
            return f"module {gone!r} is not installed{via}"
    if not stack:
        return None
    import lmdeploy

    version = tuple(int(p) for p in lmdeploy.__version__.split(".")[:2] if p.isdigit())
    if version < MIN_VERSION:
        return f"lmdeploy {lmdeploy.__version__} is older than {'.'.join(map(str, MIN_VERSION))}"
    return None


def _refuse(why: str, module_level: bool) -> None:
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{why}, and {REQUIRE_ENV}=1 asks for the lmdeploy tests to run ({INSTALL})",
                    pytrace=False)
    pytest.skip(f"{why}: the lmdeploy tests need {INSTALL}", allow_module_level=module_level)


def require(*modules: str) -> None:
    """At a test module's top: skip the module (fail under ``FEATCACHE_REQUIRE_LMDEPLOY=1``)
    unless the stack and ``modules`` import."""
    why = missing(*modules)
    if why is not None:
        _refuse(why, module_level=True)


def need(name: str, *, stack: bool = True) -> ModuleType:
    """Inside a test: ``name`` (and the stack, unless not ``stack``: a module of
    requirements/lmdeploy-cpu.txt used without lmdeploy), or skip the test (fail under the
    switch)."""
    why = missing(name, stack=stack)
    if why is not None:
        _refuse(why, module_level=False)
    return importlib.import_module(name)


def need_transforms() -> None:
    """Inside a test: torchvision's transforms, from which lmdeploy builds InternVL's V1-5
    preprocessing (``bench.lib.torchvision_ref``: the test command unpacks them aside), or skip
    the test (fail under the switch)."""
    from bench.lib import torchvision_ref

    why = torchvision_ref.missing()
    if why is not None:
        _refuse(why, module_level=False)
