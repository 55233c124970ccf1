"""The LMDB environment of one open store across ``close`` and ``fork()``: ``StoreHandle``.

The disk tier owns one: it opens the store (``env.open_store``) and hands the environment out for
one operation at a time (``use``).

Invariants:
- every use of the environment after open goes through ``use`` (one level deep, never nested) and
  passes the handle's ``Gate`` (``env``), so ``close`` and a fork never find an operation in
  flight;
- an environment is never used across fork(): while the process forks, the hooks below keep
  every operation out of every open handle (``Gate.pause``); in the child the gate and the locks
  start afresh, and the first ``use`` closes the inherited environment and opens the store again;
- once ``close`` has returned, ``use`` raises ``Shut`` and the environment is closed.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import ParamSpec

import lmdb

from ..errors import StoreOpenError
from .env import Gate, open_store

P = ParamSpec("P")

# Every open StoreHandle, for the fork hooks below.
_OPEN: weakref.WeakSet[StoreHandle] = weakref.WeakSet()


def _before_fork() -> None:
    for handle in list(_OPEN):
        handle._gate.pause()


def _after_fork_in_parent() -> None:
    for handle in list(_OPEN):
        handle._gate.resume()


def _after_fork_in_child() -> None:
    # The child's only thread is the one that forked: nothing of the parent's is inside, and the
    # gate (whose lock the forking thread held) starts afresh. The inherited environment is
    # closed and reopened on first use (``use``).
    for handle in list(_OPEN):
        handle._gate = Gate()
        handle._reopen_lock = threading.Lock()  # a parent thread may have held these at the fork
        handle._forked()  # the owner's own locks, likewise


if hasattr(os, "register_at_fork"):
    os.register_at_fork(
        before=_before_fork, after_in_parent=_after_fork_in_parent,
        after_in_child=_after_fork_in_child,
    )


class StoreHandle:
    """The environment of the store at ``path``, for a process whose budget is ``capacity_bytes``
    (``env.open_store``, which says what ``readonly`` and ``sync`` do).

    The owner's callbacks, each a method of the owner, held weakly (the owner holds its handle;
    a handle that held its owner would keep a dropped owner, and its environment, open until the
    cyclic collector ran, and LMDB allows one open environment per store and process):

    - ``failed(what, error)``: an LMDB error the handle swallowed (a check of stale readers);
    - ``opened(env)``: after each open, the first and the one in a forked child, before any
      ``use`` (the disk tier applies its budget); what it raises fails the open, with the
      environment closed;
    - ``forked()``: in a forked child, right after the fork (the owner's locks start afresh).

    ``open`` opens the store the first time; the owner calls it once, holding the handle already
    (so that ``opened`` may use it).
    """

    def __init__(
        self,
        path: str,
        capacity_bytes: int,
        *,
        readonly: bool,
        sync: bool,
        failed: Callable[[str, Exception], None],
        opened: Callable[[lmdb.Environment], None] | None = None,
        forked: Callable[[], None] | None = None,
    ) -> None:
        self.path = path
        self.capacity_bytes = capacity_bytes
        self.readonly = readonly
        self._sync = sync
        self._failed = _weakly(failed)
        self._opened = _weakly(opened) if opened is not None else None
        self._forked = _weakly(forked) if forked is not None else _nothing
        self._gate = Gate()
        self._reopen_lock = threading.Lock()

    def open(self) -> None:
        """Open the store (the first time). Raises ``StoreOpenError`` (or what ``opened``
        raises) with the environment closed."""
        self._open()
        _OPEN.add(self)

    def _open(self) -> None:
        """Open the store (``env.open_store``: the checks, the tables, the format), then call
        ``opened``. Raises with the environment closed."""
        self._env, self.tables = open_store(
            self.path, self.capacity_bytes, readonly=self.readonly, sync=self._sync,
            reader_check=self.reader_check,
        )
        self._pid = os.getpid()
        if self._opened is not None:
            try:
                self._opened(self._env)
            except BaseException:
                self._env.close()
                raise

    def reader_check(self, env: lmdb.Environment) -> None:
        """Free the reader slots of dead processes: a slot left by a process killed inside a
        read transaction would keep every page freed since from being reused."""
        try:
            env.reader_check()
        except lmdb.Error as e:
            self._failed("check of stale readers", e)

    @contextmanager
    def use(self) -> Iterator[lmdb.Environment]:
        """The environment, for one operation; raises ``Shut`` once the handle is closed.

        Every use of the environment after open goes through here (one level deep, never nested),
        so ``close`` and a fork never find an operation in flight. In a forked child the first use
        reopens the store (``_reopen_in_child``), and raises ``lmdb.Error`` if that fails.
        """
        if self._pid != os.getpid():
            self._reopen_in_child()
        with self._gate.enter():
            yield self._env

    @contextmanager
    def read(self) -> Iterator[lmdb.Transaction]:
        """One short read transaction through the gate (``scan.Read``)."""
        with self.use() as env, env.begin(buffers=True) as txn:
            yield txn

    def _reopen_in_child(self) -> None:
        """An environment must never be used across fork(): the child closes the one it
        inherited (safe: the fork hooks kept every operation out of it while forking) and opens
        its own. py-lmdb refuses a second open of the same files while the first is open."""
        with self._reopen_lock:
            if self._pid == os.getpid():
                return
            try:
                self._env.close()
                self._open()
            except (lmdb.Error, StoreOpenError) as e:
                raise lmdb.Error(f"reopen after fork failed: {e}") from e

    def close(self) -> None:
        """Wait for the operations in flight, then close the environment; later uses raise
        ``Shut``. Idempotent. In a forked child that never used the handle, this closes the
        inherited environment (safe: see ``_reopen_in_child``)."""
        self._gate.shut()
        _OPEN.discard(self)
        self._env.close()


def _weakly(method: Callable[P, None]) -> Callable[P, None]:
    """``method``, a bound method, called through a weak reference (nothing once its object is
    gone)."""
    ref = weakref.WeakMethod(method)

    def call(*args: P.args, **kwargs: P.kwargs) -> None:
        bound = ref()
        if bound is not None:
            bound(*args, **kwargs)

    return call


def _nothing() -> None:
    return None
