"""Shared helpers of the tests/test_reliability_*.py files (docs/reliability.md's figures).

``report`` prints one line per scenario (run pytest with ``-s`` to see them); the doc's table is
copied from these lines. ``in_fork`` runs a body in a forked child and tells a crash (a signal such
as SIGBUS or SIGSEGV) apart from an orderly result, so a test can prove "never crashes".
"""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from featcache import FeatureCache

try:
    import _procs
except ImportError:  # tests/ became a package
    from tests import _procs

value_for = _procs.value_for
same_bits = _procs.same_bits
tier_slot = _procs.tier_slot


def report(scenario: str, *, runs: int, faults: int, wrong: int, failed: int, **extra: Any) -> None:
    """Print the figures of one scenario as a single greppable line."""
    more = "".join(f" {k}={v}" for k, v in extra.items())
    print(
        f"\nRELIABILITY {scenario}: runs={runs} faults={faults} wrong={wrong} failed={failed}{more}",
        flush=True,
    )


def disk_cache(path: Path, disk_bytes: int | str = "64MiB", **options: Any) -> FeatureCache:
    """A cache whose every read comes from disk (device and host tiers disabled) unless the
    options enable them."""
    options.setdefault("device_bytes", 0)
    options.setdefault("host_bytes", 0)
    return FeatureCache(device="cpu", disk_path=path, disk_bytes=disk_bytes, **options)


def in_thread(fn: Callable[[], Any], timeout: float = 60.0) -> Any:
    """``fn()`` in a daemon thread; fails (instead of hanging the suite) if it does not return."""
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"{getattr(fn, '__name__', fn)} did not return in {timeout} s"
    return out[0] if out else None


def in_fork(body: Callable[[], Any], timeout: float = 60.0) -> tuple[str, Any]:
    """Run ``body()`` in a forked child: ``("ok", its JSON-able result)``, ``("raised", text)``
    or ``("crashed", signal name)``. Call only while this process has no FeatureCache open."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        code = 0
        try:
            os.close(read_end)
            # the body's own torch ops (not featcache's: its CPU copies never use the pool) would
            # enter the intra-op pool this child inherited, which does not survive fork()
            torch.set_num_threads(1)
            try:
                msg = {"ok": body()}
            except BaseException as e:  # reported, not re-raised: the parent judges
                msg = {"raised": f"{type(e).__name__}: {e}"}
            os.write(write_end, json.dumps(msg).encode())
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    os.close(write_end)
    chunks = []
    done = threading.Event()

    def drain() -> None:
        with os.fdopen(read_end, "rb") as f:
            chunks.append(f.read())
        done.set()

    threading.Thread(target=drain, daemon=True).start()
    if not done.wait(timeout):
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    done.wait(5)
    if os.WIFSIGNALED(status):
        return "crashed", signal.Signals(os.WTERMSIG(status)).name
    raw = chunks[0] if chunks else b""
    if not raw:
        return "crashed", f"exit {os.waitstatus_to_exitcode(status)} without a result"
    msg = json.loads(raw)
    return ("ok", msg["ok"]) if "ok" in msg else ("raised", msg["raised"])
