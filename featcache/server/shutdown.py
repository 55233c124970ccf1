"""A bounded shutdown for `featcache serve`: SIGINT or SIGTERM stop it within a deadline, whatever hangs.

On the first SIGINT/SIGTERM lmdeploy's server (uvicorn) stops taking requests and shuts down: its
engine, the engine's process (lmdeploy's mp engine) and featcache's caches close, the caches
flushing what they still hold for the disk. On the H200 that once took longer than 60 s (issue
27). So the signal also arms a ``Watchdog``: if the process is still running ``deadline_s`` later,
it writes one last log line (what was still queued for the disk: lost), terminates this process's
children (the engine and model processes: nothing is left holding the GPU) and exits with
status 1. A shutdown that finishes in time never hears from it.

The watchdog is armed from uvicorn's own signal handler (``Server.handle_exit``, wrapped while
``bounded_shutdown`` is active), so lmdeploy's and uvicorn's handling of the signal is unchanged.

SIGTERM needs one more thing. Once its server has shut down, uvicorn restores the handlers it found
and raises the signal again, "the expected behaviour": for SIGINT Python's KeyboardInterrupt, which
unwinds through the caller's ``finally`` (the cache's close); for SIGTERM the default action, which
ends the process on the spot, the close and its last line never reached (seen on the H200: every
``featcache serve`` exited -15 with no close line). So while ``bounded_shutdown`` is active SIGTERM
raises ``SystemExit(143)`` (128 + 15, what a shell reports for a process SIGTERM ended) in the
main thread instead: the same unwinding as SIGINT, the close flushed, exit status 143. It also arms
the watchdog, so a SIGTERM while the engine is still being built is bounded too.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

log = logging.getLogger("featcache")

DEADLINE_S = 10.0  # from the first SIGINT/SIGTERM to the process's exit, at most
CHILD_GRACE_S = 2.0  # a child asked to terminate gets this long before it is killed


class Watchdog:
    """Ends this process ``deadline_s`` after ``arm`` unless it has exited by then. ``pending``
    says, for the last log line, what is still queued (called once, on expiry)."""

    def __init__(self, deadline_s: float = DEADLINE_S,
                 pending: Callable[[], str] | None = None,
                 exit: Callable[[int], Any] = os._exit) -> None:
        self.deadline_s = deadline_s
        self.pending = pending
        self._exit = exit
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        self._armed_at = 0.0

    @property
    def armed(self) -> bool:
        return self._timer is not None

    def arm(self, why: str) -> None:
        """Start the countdown (once: a second signal does not move the deadline)."""
        with self._lock:
            if self._timer is not None:
                return
            self._armed_at = time.monotonic()
            self._timer = threading.Timer(self.deadline_s, self._expire, args=(why,))
            self._timer.name = "featcache-shutdown"
            self._timer.daemon = True  # a shutdown that finishes in time is not held by it
            self._timer.start()
        log.info("featcache serve: %s; stopping (at most %.0f s)", why, self.deadline_s)

    def _expire(self, why: str) -> None:
        lost = ""
        if self.pending is not None:
            try:
                lost = self.pending()
            except Exception as e:  # noqa: BLE001 (the last line must still be written)
                lost = f"(what was queued is unknown: {type(e).__name__})"
        killed = terminate_children(CHILD_GRACE_S)
        log.error("featcache serve: still running %.0f s after %s: exiting now%s%s",
                  time.monotonic() - self._armed_at, why,
                  f"; {killed} child process(es) terminated" if killed else "",
                  f"; {lost}" if lost else "")
        for handler in logging.getLogger().handlers + log.handlers:
            with contextlib.suppress(Exception):
                handler.flush()
        self._exit(1)


def terminate_children(grace_s: float = CHILD_GRACE_S) -> int:
    """Terminate every descendant of this process (SIGTERM, then SIGKILL after ``grace_s``);
    returns how many there were."""
    import psutil

    try:
        children = psutil.Process().children(recursive=True)
    except psutil.Error:
        return 0
    for child in children:
        with contextlib.suppress(psutil.Error):
            child.terminate()
    _, alive = psutil.wait_procs(children, timeout=grace_s)
    for child in alive:
        with contextlib.suppress(psutil.Error):
            child.kill()
    psutil.wait_procs(alive, timeout=grace_s)
    return len(children)


def queued(cache: Any) -> tuple[int, int]:
    """The demotions and disk writes ``cache`` still holds for its lower tiers."""
    counts = cache.stats().get("cache", {})
    return int(counts.get("demote_queue", 0)), int(counts.get("disk_queue", 0))


def queued_writes(cache: Any) -> str:
    """What ``cache`` still held for its lower tiers (lost if the process ends now)."""
    demote, disk = queued(cache)
    if not demote and not disk:
        return "no disk writes were queued in this process"
    return f"lost: {demote} queued demotion(s), {disk} queued disk write(s) of this process"


def close_reporting(cache: Any, who: str = "featcache serve") -> str:
    """Close ``cache`` (flushing what it queued for its lower tiers) and return the line that
    says so: the last word of a process on its disk writes. A close that fails is reported, not
    raised: the process is ending either way."""
    try:
        demote, disk = queued(cache)
    except Exception:  # noqa: BLE001 (a closed or broken cache: the close below says more)
        demote = disk = 0
    start = time.monotonic()
    try:
        cache.close()
    except Exception as e:  # noqa: BLE001
        return (f"{who}: closing the cache failed ({type(e).__name__}: {e}); lost: up to "
                f"{demote} queued demotion(s), {disk} queued disk write(s)")
    return (f"{who}: cache closed in {time.monotonic() - start:.2f} s; flushed {demote} queued "
            f"demotion(s) and {disk} queued disk write(s)")


TERMINATED = 128 + signal.SIGTERM  # the exit status after SIGTERM, the cache closed


@contextlib.contextmanager
def bounded_shutdown(watchdog: Watchdog) -> Iterator[Watchdog]:
    """While active, uvicorn's handling of SIGINT/SIGTERM also arms ``watchdog`` (which, once
    armed, outlives the block: it covers the closing that follows the server), and SIGTERM
    unwinds the main thread (``SystemExit(TERMINATED)``) instead of ending the process before its
    cache is closed. A SIGTERM handler already set (not the default action) is left alone."""
    import uvicorn

    original = uvicorn.Server.handle_exit

    def handle_exit(self: Any, sig: int, frame: Any) -> None:
        watchdog.arm(f"{signal.Signals(sig).name} received")
        original(self, sig, frame)

    def terminate(sig: int, frame: Any) -> None:
        watchdog.arm(f"{signal.Signals(sig).name} received")
        raise SystemExit(TERMINATED)

    main = threading.current_thread() is threading.main_thread()  # where signals are handled
    replace_term = main and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    if replace_term:
        signal.signal(signal.SIGTERM, terminate)
    uvicorn.Server.handle_exit = handle_exit  # type: ignore[method-assign]
    try:
        yield watchdog
    finally:
        uvicorn.Server.handle_exit = original  # type: ignore[method-assign]
        if replace_term:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
