"""A real redis-server on loopback for the remote-tier tests (and nothing else).

``redis_binary()`` finds the server: ``$FEATCACHE_REDIS_SERVER``, else ``redis-server`` on PATH.
Without one the tests skip, unless ``FEATCACHE_REQUIRE_REDIS=1`` (CI sets it): then they fail.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

REQUIRE_ENV = "FEATCACHE_REQUIRE_REDIS"
BINARY_ENV = "FEATCACHE_REDIS_SERVER"


def redis_binary() -> str:
    """The redis-server to run, or skip (fail when ``FEATCACHE_REQUIRE_REDIS=1``)."""
    path = os.environ.get(BINARY_ENV) or shutil.which("redis-server")
    if path and os.access(path, os.X_OK):
        try:
            import redis  # noqa: F401
        except ImportError:
            path = None
            why = "the redis client (pip install 'redis>=5') is not installed"
    else:
        why = "redis-server is not installed (apt-get install redis-server)"
    if path:
        return path
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{why}, and {REQUIRE_ENV}=1 asks for the remote-tier tests to run")
    pytest.skip(why)


PORT_TRIES = 3  # ports tried for a server whose port the harness picked (a cluster: formations)


def port_taken(log: Path) -> bool:
    """Whether the redis-server that wrote ``log`` exited because its port (or cluster bus port),
    free when ``free_port`` picked it, was bound by another process first (it can only pick a
    port, not hold it)."""
    return "Address already in use" in log.read_text(errors="replace")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """One redis-server process on 127.0.0.1 (no persistence), in ``workdir``."""

    def __init__(self, binary: str, workdir: Path, port: int | None = None, *extra: str) -> None:
        self.binary = binary
        self.workdir = workdir
        self.port = port or free_port()
        self.extra = extra
        self.proc: subprocess.Popen[bytes] | None = None
        for attempt in range(PORT_TRIES):
            try:
                self.start()
                return
            except RuntimeError:
                # a port taken before the server bound it: a new one, unless the caller chose it
                if port is not None or not port_taken(self._log()) or attempt == PORT_TRIES - 1:
                    raise
                self.proc = None
                self.port = free_port()

    def _log(self) -> Path:
        return self.workdir / f"redis-{self.port}.log"

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        assert self.proc is None
        log = open(self._log(), "ab")  # noqa: SIM115 (kept for the child)
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.workdir), *self.extra],
            stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir,
        )
        log.close()
        self._wait_ready()

    def _wait_ready(self, timeout_s: float = 10.0) -> None:
        # Waiting for a child process to listen: the one place a test polls (no event to wait on).
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited ({self.proc.returncode}); see {self.workdir}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    reply = s.recv(64)
                    if reply.startswith((b"+PONG", b"-NOAUTH")):
                        return
            except OSError:
                pass
            time.sleep(0.01)
        raise RuntimeError("redis-server did not start listening in time")

    def kill(self) -> None:
        """SIGKILL: the server vanishes mid-run, its data with it."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def client(self, **kw: object):  # type: ignore[no-untyped-def]
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, **kw)
