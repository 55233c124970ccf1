"""A cache's builds across fork(): which process a build belongs to, how a forked child adopts the
cache (``Adoptable``, ``FeatureCache``'s base), and how a build is released.

A build is what ``FeatureCache`` makes at construction, and again in a forked child: the chain of
tiers, the demoter and the writers with their threads. A build belongs to the process that made
it: a forked child has none of its threads, and a lock one of them held at the fork stays held
there forever.

Invariants:
- ``generation()`` is bumped in every forked child (``os.register_at_fork``): a build noted with
  another generation was inherited (``inherited``), and nothing of it is used; the child adopts
  the cache instead, one thread at a time (``adoption_lock``, made afresh in every child), by
  releasing the inherited build and making its own;
- ``release`` of an inherited build only closes what the child's own build must reopen
  (``Chain.close_inherited``: the LMDB environment); it joins no thread and takes no lock of it.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import TYPE_CHECKING

from ..errors import FeatCacheError

if TYPE_CHECKING:
    import torch

    from .chain import Chain
    from .demoter import Demoter

_FORKS = [0]  # bumped in every forked child: a cache built before it rebuilds on first use
_ADOPT_LOCK = threading.Lock()

# Why a cache on CUDA is refused in a forked child.
CUDA_AFTER_FORK = (
    "this FeatureCache lives on CUDA and the process was forked since: CUDA cannot be used in a "
    "forked child; create the cache in the child, or start children with the 'spawn' method"
)


def _after_fork_in_child() -> None:
    global _ADOPT_LOCK
    _FORKS[0] += 1
    _ADOPT_LOCK = threading.Lock()  # another thread of the parent may have held it


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def generation() -> int:
    """This process's generation: what a build notes when it is made."""
    return _FORKS[0]


def inherited(noted: int) -> bool:
    """Whether a build noted with generation ``noted`` was made before a fork (in a parent)."""
    return noted != _FORKS[0]


def adoption_lock() -> threading.Lock:
    """The lock under which a forked child adopts a cache (look it up at each use: every forked
    child makes a new one)."""
    return _ADOPT_LOCK


def release(noted: int, chain: Chain, demoter: Demoter | None) -> None:
    """Flush and close what one build of a cache made. Run once (``weakref.finalize``): by
    ``close()``, when the cache is collected unclosed, or at interpreter exit. Left to die with
    the interpreter, a background thread caught inside torch's C++ code is unwound by force and
    the process aborts (SIGABRT, "terminate called without an active exception"), losing the
    writes in flight. Holds no reference to the cache (the tiers' callbacks go to their writers)."""
    if inherited(noted):  # inherited by a forked child: its threads are the parent's
        chain.close_inherited()  # e.g. the LMDB environment, so that the child may open the store
        return
    if demoter is not None and demoter.runs_current_thread():
        # collected inside one of its own threads: that thread cannot wait for itself
        threading.Thread(target=release, args=(noted, chain, demoter),
                         name="featcache-release", daemon=True).start()
        return
    if demoter is not None:
        demoter.close()
    chain.close()


class Adoptable:
    """What keeps a cache's build this process's (``FeatureCache``'s base): the calls that raise
    check with ``_check_open``, those that never raise with ``_adopted``; in a forked child the
    first of them adopts the cache (``_adopt``). The cache provides ``device``, ``_closed``,
    ``_forks`` (its build's generation), ``_finalizer`` (releases its build) and ``_build``."""

    device: torch.device
    _closed: bool
    _forks: int
    _finalizer: weakref.finalize

    def _build(self) -> None:
        raise NotImplementedError

    def _check_open(self) -> None:
        if self._closed:
            raise FeatCacheError("this FeatureCache is closed")
        if inherited(self._forks):
            self._adopt()

    def _adopted(self) -> bool:
        """For the calls that never raise: whether the tiers are this process's, adopting them
        first in a forked child; False if that cannot be (closed there, or on CUDA)."""
        if not inherited(self._forks):
            return True
        try:
            self._check_open()  # raises if closed, else adopts
        except FeatCacheError:
            return False
        return True

    def _adopt(self) -> None:
        """First use in a forked child: rebuild the tiers and threads (the parent's threads do
        not exist here and its locks may be held forever); the memory tiers start empty, the
        disk store is reopened. Runs in the child's first thread to use the cache."""
        with adoption_lock():
            if not inherited(self._forks):
                return
            if self.device.type == "cuda":
                self._closed = True
                raise FeatCacheError(CUDA_AFTER_FORK)
            self._finalizer()  # the parent's build: closes what the child must reopen, only
            self._build()
