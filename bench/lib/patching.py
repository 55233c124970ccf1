"""Wrappers installed over library code for a measurement: each replaces an attribute by
``make(original)``, a function that calls the original with the same arguments and returns what
it returns. Each (owner, name) is replaced once (a second install is a no-op, so wrappers never
stack), and ``undo`` puts every original back, the last installed first.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any


class Patches:
    """The replacements made so far, with their originals."""

    def __init__(self) -> None:
        self.originals: dict[tuple[Any, str], Any] = {}  # in the order installed

    def patch(self, owner: Any, name: str, make: Callable[[Any], Any], kind: str = "function") -> bool:
        """Replace ``owner.name`` by ``make(original)`` unless this replaced it already (False
        then). ``kind`` "static" or "class": a static or class method, unwrapped for ``make`` and
        wrapped again."""
        if (owner, name) in self.originals:
            return False
        original = inspect.getattr_static(owner, name)
        self.originals[(owner, name)] = original
        if kind == "static":
            setattr(owner, name, staticmethod(make(original.__func__)))
        elif kind == "class":
            setattr(owner, name, classmethod(make(original.__func__)))
        else:
            setattr(owner, name, make(original))
        return True

    def original(self, owner: Any, name: str) -> Any:
        """What ``owner.name`` was before this replaced it (what it is, where this did not)."""
        return self.originals.get((owner, name), inspect.getattr_static(owner, name))

    def undo(self) -> None:
        """Put back every original, the last replaced first."""
        for (owner, name), original in reversed(list(self.originals.items())):
            setattr(owner, name, original)
        self.originals.clear()
