"""The model processes' counters, read from outside them while the engine runs.

lmdeploy's own channel to its ranks (the mp executor's ``collective_rpc``) is not free for this:
after the engine starts, a task of the driver always waits on rank 0's return buffer for forward
outputs, so a second caller reading that buffer could take a forward's outputs (and the engine
would hang) or hand the engine a stats dict. featcache therefore keeps a channel of its own.

Each model process with featcache (``processes.install_in_rank``) answers on a Unix socket in a
folder the driver made for that engine (private: ``tempfile.mkdtemp`` is mode 0700, so only
this user may connect): ``<folder>/<pid>.sock``. A daemon thread accepts, writes
``ranks.stats()`` as one JSON document and closes. The driver (``gather``) connects to every
socket in the folder with a timeout and returns the answers in rank order.

Invariants: nothing here touches the model, lmdeploy's buffers or the agreement collective; an
unanswered socket (a process gone or stuck) costs only its entry and at most ``timeout``.
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import socket
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger("featcache")

SUFFIX = ".sock"


def serve(folder: str, answer: Callable[[], dict[str, Any]]) -> str:
    """Answer ``answer()`` (JSON-able) to every connection on ``<folder>/<pid>.sock``, from a
    daemon thread, for this process's life. Returns the socket's path."""
    path = os.path.join(folder, f"{os.getpid()}{SUFFIX}")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # a pid reused within one engine's folder
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(8)

    def loop() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return  # closed
            with conn:
                try:
                    conn.settimeout(5)
                    conn.sendall(json.dumps(answer()).encode())
                except Exception:
                    log.warning("featcache: could not answer for this model process's counters",
                                exc_info=True)

    threading.Thread(target=loop, name="featcache-rankstats", daemon=True).start()
    return path


def ask(path: str, timeout: float) -> dict[str, Any]:
    """One process's answer on ``path`` (raises ``OSError`` or ``ValueError`` without one)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(timeout)
        conn.connect(path)
        parts = []
        while chunk := conn.recv(1 << 16):
            parts.append(chunk)
    answer: dict[str, Any] = json.loads(b"".join(parts))
    return answer


def gather(folder: str, timeout: float = 2.0) -> list[dict[str, Any]]:
    """Every answering process's ``ranks.stats()`` in ``folder``, rank order (one that does not
    answer within ``timeout`` is left out, and logged)."""
    out = []
    for path in sorted(glob.glob(os.path.join(glob.escape(folder), "*" + SUFFIX))):
        try:
            out.append(ask(path, timeout))
        except (OSError, ValueError) as e:
            log.warning("featcache: no counters from the model process at %s (%s: %s)", path,
                        type(e).__name__, e)
    return sorted(out, key=lambda s: (s.get("rank", 0), s.get("pid", 0)))
