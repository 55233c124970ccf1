"""`featcache serve` stops within a deadline of SIGINT/SIGTERM, whatever hangs (issue 27 item 2).

The watchdog's end (the last log line, the children terminated, the exit) runs in a real child
process here; that uvicorn's signal handler arms it, on uvicorn's own Server. The real servers on
the GPU are docs/reliability.md's table (the GPU run list).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from featcache.server.shutdown import Watchdog, bounded_shutdown, queued_writes

HANG = textwrap.dedent("""
    import logging, subprocess, sys, time
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    from featcache.server.shutdown import Watchdog
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    print(child.pid, flush=True)
    Watchdog(deadline_s=1.0, pending=lambda: "lost: 0 queued demotion(s), 3 queued disk write(s)").arm(
        "SIGINT received")
    time.sleep(300)  # a shutdown that hangs
""")


def test_a_hung_shutdown_ends_at_the_deadline_with_its_children_and_a_last_line():
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-c", HANG], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    child = int(proc.stdout.readline())
    try:
        out, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
    took = time.monotonic() - start
    assert proc.returncode == 1 and took < 10, (proc.returncode, took, err)
    last = err.strip().splitlines()[-1]
    assert last.startswith("ERROR featcache serve: still running 1 s after SIGINT received")
    assert "1 child process(es) terminated" in last and "3 queued disk write(s)" in last
    with pytest.raises(ProcessLookupError):  # the child is gone, not left holding anything
        for _ in range(50):
            os.kill(child, 0)
            time.sleep(0.1)


def test_a_shutdown_in_time_never_hears_from_it():
    exits = []
    dog = Watchdog(deadline_s=0.2, exit=exits.append)
    dog.arm("SIGTERM received")
    dog.arm("SIGINT received")  # a second signal does not move the deadline
    dog._timer.cancel()  # (as the process ending in time would)
    time.sleep(0.4)
    assert exits == []


def test_uvicorns_signal_handler_arms_the_watchdog_and_still_stops_the_server():
    uvicorn = pytest.importorskip("uvicorn")

    exits = []
    dog = Watchdog(deadline_s=60, exit=exits.append)
    server = uvicorn.Server(uvicorn.Config(app=lambda *a: None))
    with bounded_shutdown(dog):
        server.handle_exit(signal.SIGTERM, None)
    assert dog.armed and server.should_exit  # uvicorn's own handling is unchanged
    assert uvicorn.Server.handle_exit.__name__ == "handle_exit" and not hasattr(
        uvicorn.Server.handle_exit, "__wrapped__")  # unpatched after the block
    dog._timer.cancel()


def test_queued_writes_say_what_would_be_lost(tmp_path):
    from featcache import FeatureCache

    with FeatureCache(device="cpu", host_bytes=0, disk_path=tmp_path, disk_bytes="16MiB") as cache:
        assert queued_writes(cache) == "no disk writes were queued in this process"


def test_the_gpu_scripts_commands_parse_with_featcaches_and_lmdeploys_parsers():
    """bench/shutdown_serve.py and bench/hostile_serve.py (run on the GPU only): every server
    command they build is one featcache serve and lmdeploy's api_server take."""
    import _lmdeploy_stack

    for name in ("fastapi", "uvicorn", "openai", "shortuuid"):
        _lmdeploy_stack.need(name)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "bench"))
    import hostile_serve
    import shutdown_serve

    from featcache.cli.serving import featcache_parser
    from featcache.server.serve import lmdeploy_parser

    commands = [shutdown_serve.command(c, "/m/x", "/tmp/s", shutdown_serve.PORT + i)
                for i, c in enumerate(shutdown_serve.PYTORCH + shutdown_serve.TURBOMIND)]
    ports = [cmd[cmd.index("--server-port") + 1] for cmd in commands]
    assert len(set(ports)) == len(commands)  # --parallel: each configuration on its own port
    commands += hostile_serve.commands("/m/x", "/tmp/media", "/tmp/s",
                                       ["plain", "featcache_mp", "featcache_in"]).values()
    for cmd in commands:
        if cmd[2] == "lmdeploy":
            args = lmdeploy_parser().parse_args(cmd[5:])
        else:
            ours, rest = featcache_parser().parse_known_args(cmd[4:])
            args = lmdeploy_parser().parse_args(rest)
            assert ours.cache_dir
        assert args.model_path == "/m/x" and args.server_port > 0


def test_the_last_line_says_what_the_close_flushed(tmp_path):
    from featcache import FeatureCache
    from featcache.server.shutdown import close_reporting

    cache = FeatureCache(device="cpu", device_bytes=1 << 20, host_bytes=1 << 20,
                         disk_path=str(tmp_path / "store"), disk_bytes=1 << 24)
    import torch

    cache.put(b"k" * 16, torch.ones(64))
    line = close_reporting(cache)
    assert line.startswith("featcache serve: cache closed in ") and "queued disk write(s)" in line
    reopened = FeatureCache(device="cpu", device_bytes=1 << 20, host_bytes=1 << 20,
                            disk_path=str(tmp_path / "store"), disk_bytes=1 << 24)
    try:
        assert torch.equal(reopened.get(b"k" * 16), torch.ones(64))  # flushed, as the line says
    finally:
        reopened.close()

    class Broken:
        def stats(self):
            return {"cache": {"demote_queue": 1, "disk_queue": 2}}

        def close(self):
            raise OSError("disk gone")

    assert close_reporting(Broken(), "x") == ("x: closing the cache failed (OSError: disk gone); "
                                              "lost: up to 1 queued demotion(s), 2 queued disk write(s)")


FAKE_SERVER = """
import sys
from http.server import ThreadingHTTPServer
sys.path.insert(0, {tests!r})
from test_serve_chat import Fake
ThreadingHTTPServer(("127.0.0.1", {port}), Fake).serve_forever()
"""


def test_a_shutdown_run_signals_a_server_with_requests_in_flight(tmp_path):
    """bench/shutdown_serve.py's run on the CPU, against test_serve_chat's stand-in for lmdeploy's
    api_server in its own process: started, one chat turn, a burst of image requests, the signal
    once the first is answered; its exit, what is left of its group and the burst's tally."""
    import _lmdeploy_stack

    _lmdeploy_stack.need("openai", stack=False)
    pytest.importorskip("psutil")
    bench = os.path.join(os.path.dirname(os.path.dirname(__file__)), "bench")
    sys.path.insert(0, bench)
    import shutdown_serve
    from _redis import free_port

    port = free_port()
    cmd = [sys.executable, "-c", FAKE_SERVER.format(tests=os.path.dirname(os.path.abspath(__file__)),
                                                    port=port)]
    row = shutdown_serve.one_run("fake", cmd, port, "data:image/png;base64,AAAA", str(tmp_path), 0,
                                 signal.SIGTERM, ready_timeout=60, wait_s=20, burst=3)
    assert "error" not in row, row
    assert row["exit_s"] is not None and row["exit_s"] < 5 and row["rc"] == -signal.SIGTERM, row
    assert row["left"] == [] and row["gpu_left"] == []
    burst = row["burst"]
    assert burst["sent"] == 3 and burst["answered"] >= 1 and burst["answered"] + burst["failed"] == 3
    assert row["close_lines"] == []  # not featcache: no close line
