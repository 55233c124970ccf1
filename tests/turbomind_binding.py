"""A stand-in for lmdeploy's compiled TurboMind binding (``lmdeploy.turbomind._turbomind``), so
lmdeploy's real TurboMind *Python* modules import and run on a CPU machine.

The compiled module needs CUDA 12 libraries (libcublas) and cannot load here. This stub is the only
fake: every attribute is a recording class (``_tm.multimodal.InternVitItem(**kw)`` keeps ``kw``;
``_tm.from_dlpack(t)`` keeps ``t``), so what lmdeploy's Python hands the C++ boundary can be
inspected. Nothing of lmdeploy's Python is replaced.
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Iterator
from typing import Any

_NAME = "lmdeploy.turbomind._turbomind"


def _member(owner: Any, name: str) -> Any:
    """A new recording class named ``name``, kept as an attribute of ``owner``."""
    if name.startswith("__"):
        raise AttributeError(name)
    sub = _Auto(name, (Record,), {})
    setattr(owner, name, sub)
    return sub


class _Auto(type):
    def __getattr__(cls, name: str) -> Any:
        return _member(cls, name)


class Record(metaclass=_Auto):
    """An object of the binding: records its constructor arguments; unknown attributes are
    records too (config structs that lmdeploy fills in)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args, self.kwargs = args, kwargs

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        value = Record()
        object.__setattr__(self, name, value)
        return value


class Binding(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        return _member(self, name)


@contextlib.contextmanager
def installed() -> Iterator[Binding]:
    """Import lmdeploy.turbomind afresh over the stand-in binding; restore sys.modules after."""
    saved = {k: v for k, v in sys.modules.items() if k.startswith("lmdeploy.turbomind")}
    for k in saved:
        del sys.modules[k]
    binding = Binding(_NAME)
    sys.modules[_NAME] = binding
    try:
        import lmdeploy.turbomind

        assert lmdeploy.turbomind._tm is binding, lmdeploy.turbomind._import_error
        yield binding
    finally:
        for k in [k for k in sys.modules if k.startswith("lmdeploy.turbomind")]:
            del sys.modules[k]
        sys.modules.update(saved)
