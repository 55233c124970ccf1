"""A Mooncake Store master on loopback for tests/test_fleet_mooncake.py (and bench/fleet.py):
``mooncake_master`` from the installed package, with its own HTTP metadata service, TCP only.

Without the package (or where it cannot load: the CUDA build needs libcuda, every build
libibverbs) the tests skip, saying why.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

try:
    import _redis
except ImportError:  # tests/ became a package
    from tests import _redis


def master_binary() -> str:
    """The package's ``mooncake_master``, or skip (the import error says what is missing)."""
    try:
        import mooncake
        import mooncake.store  # noqa: F401  (loads the native library: the real test)
    except ImportError as e:
        if os.environ.get("FEATCACHE_REQUIRE_MOONCAKE") == "1":  # .ci/run installs it
            pytest.fail(f"FEATCACHE_REQUIRE_MOONCAKE=1 but Mooncake Store does not load: {e}")
        pytest.skip(f"Mooncake Store is not usable here: {e}")
    path = Path(mooncake.__file__).parent / "mooncake_master"
    if not path.exists():
        pytest.skip(f"no mooncake_master in {path.parent}")
    return str(path)


class MooncakeMaster:
    """One mooncake_master process (RPC and HTTP metadata on 127.0.0.1), in ``workdir``."""

    def __init__(self, binary: str, workdir: Path, lease_ms: int = 1000) -> None:
        self.binary, self.workdir = binary, workdir
        self.rpc_port, self.http_port, self.metrics_port = (_redis.free_port() for _ in range(3))
        self.lease_ms = lease_ms
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def url(self, segment: str = "64MiB", buffer: str = "64MiB") -> str:
        return (f"mooncake://127.0.0.1:{self.rpc_port}?metadata=http://127.0.0.1:{self.http_port}"
                f"/metadata&protocol=tcp&local=127.0.0.1&segment={segment}&buffer={buffer}")

    def start(self) -> None:
        assert self.proc is None
        log = open(self.workdir / "mooncake_master.log", "ab")  # noqa: SIM115 (kept for the child)
        self.proc = subprocess.Popen(
            [self.binary, "--rpc_port", str(self.rpc_port), "--rpc_address", "127.0.0.1",
             "--enable_http_metadata_server=true", "--http_metadata_server_host", "127.0.0.1",
             "--http_metadata_server_port", str(self.http_port), "--metrics_host", "127.0.0.1",
             "--metrics_port", str(self.metrics_port), "--rpc_thread_num", "2",
             "--default_kv_lease_ttl", str(self.lease_ms)],
            stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir,
        )
        log.close()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # a child process starting: nothing to wait on
            if self.proc.poll() is not None:
                raise RuntimeError(f"mooncake_master exited ({self.proc.returncode}); see {self.workdir}")
            try:
                for port in (self.rpc_port, self.http_port):
                    socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("mooncake_master did not start listening in time")

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None
