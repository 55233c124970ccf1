"""Servers a benchmark starts: ``lmdeploy serve api_server`` and ``featcache serve`` command lines
built alike (the same engine flags for both, so a run compares like with like; ``commands``: the
served benches' set of them), started in their own process group, waited for, run for a block
(``running``), stopped with SIGINT (what Ctrl-C does), their logs' tails.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from typing import Any


def server_flags(backend: str, eager: bool, extra: list[str] | tuple[str, ...] = (), prefix: bool = True,
                 log_level: str = "WARNING") -> list[str]:
    """lmdeploy's flags, the same for every server of a run (TurboMind's KV share as
    bench/turbomind_bench.py builds its engines; PyTorch's as bench/e2e_lmdeploy.py's)."""
    flags = ["--backend", backend] + (["--enable-prefix-caching"] if prefix else [])
    flags += ["--session-len", "8192", "--log-level", log_level]
    if backend == "turbomind":
        flags += ["--cache-max-entry-count", "0.2"]
    else:
        flags += ["--cache-max-entry-count", "0.05"] + (["--eager-mode"] if eager else [])
    return flags + list(extra)


def lmdeploy_command(model: str, port: int, flags: list[str]) -> list[str]:
    """Plain ``lmdeploy serve api_server``."""
    return [sys.executable, "-m", "lmdeploy", "serve", "api_server", model, "--server-port", str(port),
            *flags]


def under_stages(cmd: list[str], stages: str) -> list[str]:
    """``cmd`` (python -m lmdeploy|featcache ...) run under bench/serve_stages.py, which appends
    each chat request's per-stage times, measured in the server's process, to ``stages``
    (bench/lib/stages.py reads them)."""
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "serve_stages.py")
    return [cmd[0], script, "--stages-out", stages, "--allow-loopback-media", "--", *cmd[2:]]


def featcache_command(model: str, store: str, port: int, flags: list[str],
                      engine_process: str | None = "in", ours: tuple[str, ...] | list[str] = ()) -> list[str]:
    """``featcache serve`` over the store ``store``: featcache's own options (``ours``, the store,
    ``--engine-process`` unless None: TurboMind has none) before lmdeploy's ``flags``."""
    process = ["--engine-process", engine_process] if engine_process else []
    return [sys.executable, "-m", "featcache", "serve", model, *ours, "--cache-dir", store, *process,
            "--server-port", str(port), *flags]


def parse_command(cmd: list[str]) -> tuple[argparse.Namespace | None, argparse.Namespace]:
    """A command line of ``lmdeploy_command`` or ``featcache_command`` parsed by featcache's and
    lmdeploy's own parsers (needs lmdeploy): (featcache's options or None, lmdeploy's)."""
    from featcache.cli.serving import featcache_parser
    from featcache.server.serve import lmdeploy_parser

    if cmd[2] == "lmdeploy":
        return None, lmdeploy_parser().parse_args(cmd[5:])
    ours, rest = featcache_parser().parse_known_args(cmd[4:])
    return ours, lmdeploy_parser().parse_args(rest)


# The served benchmarks' servers (bench/serve_chat.py, bench/serve_latency.py), in the order they
# run: each on its own port, featcache's each over its own store (STORE + suffix)
PORTS = {"plain": 23400, "featcache": 23401, "featcache_ids": 23402, "featcache_mp": 23403}
SERVERS = tuple(PORTS)  # the order they run in
STORES = {"featcache": "", "featcache_ids": "-ids", "featcache_mp": "-mp"}  # suffix of STORE


def commands(model: str, backend: str, store: str, eager: bool = False,
             extra: list[str] | None = None, image_ids: bool = False,
             mp_engine: bool = False, featcache_args: tuple[str, ...] = ()) -> dict[str, list[str]]:
    """Each server's command line, the same engine flags for all: plain, featcache (engine in its
    process), featcache_ids (``image_ids``: it trusts the clients' image ids), featcache_mp
    (``mp_engine``, PyTorch: lmdeploy's engine process); ``featcache_args`` to featcache's only."""
    flags = server_flags(backend, eager, extra or [])
    ours = tuple(featcache_args)
    cmds = {"plain": lmdeploy_command(model, PORTS["plain"], flags),
            "featcache": featcache_command(model, store, PORTS["featcache"], flags, "in", ours)}
    if image_ids:  # the clients name their images: bytes on a chat's first turn only
        cmds["featcache_ids"] = featcache_command(model, store + STORES["featcache_ids"],
                                                  PORTS["featcache_ids"], flags, "in",
                                                  (*ours, "--trust-client-image-ids"))
    if mp_engine and backend == "pytorch":  # lmdeploy's process model: the engine in a second process
        cmds["featcache_mp"] = featcache_command(model, store + STORES["featcache_mp"],
                                                 PORTS["featcache_mp"], flags, "mp", ours)
    return cmds


def check_commands(cmds: dict[str, list[str]]) -> dict[str, Any]:
    """Parse every command line with featcache's and lmdeploy's own parsers (needs lmdeploy)."""
    out: dict[str, Any] = {}
    for name in SERVERS:
        if name in cmds:
            ours, engine = parse_command(cmds[name])
            out[name] = engine_args(engine)
            if ours is not None:
                out[name].update(cache_dir=ours.cache_dir, engine_process=ours.engine_process,
                                 trust_client_image_ids=ours.trust_client_image_ids)
    return out


def wait_ready(port: int, proc: subprocess.Popen, timeout: float) -> None:
    """Until the server on ``port`` answers ``/v1/models``; raises when ``proc`` exits first or
    ``timeout`` seconds pass."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2).read()
            return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"server not ready in {timeout:.0f} s")


def start(cmd: list[str], port: int, log: str, timeout: float) -> tuple[subprocess.Popen, float]:
    """Start ``cmd`` in its own process group, its output to ``log``; wait until it serves.
    Returns (process, seconds to ready); a server that fails to start is stopped, its log's tail
    printed, and the error raised."""
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    t = time.monotonic()
    try:
        wait_ready(port, proc, timeout)
    except BaseException:
        stop(proc)
        print(f"[serve] FAILED to start: {shlex.join(cmd)}\n{tail(log)}", flush=True)
        raise
    took = time.monotonic() - t
    print(f"[serve] ready in {took:.1f} s: {shlex.join(cmd[1:6])} ...", flush=True)
    return proc, took


@contextlib.contextmanager
def running(name: str, cmd: list[str], port: int, log: str, ready_timeout: float,
            res: dict[str, Any]) -> Iterator[str]:
    """The server of ``cmd`` for the block (its base URL), recorded in ``res``: its command and
    seconds to ready, then its exit code and seconds to stop (``server_rc``, ``stop_s``). An error
    in the block is recorded (``error``, the log's tail printed), not raised: what ran is kept."""
    proc, took = start(cmd, port, log, ready_timeout)
    res.update(command=shlex.join(cmd), ready_s=round(took, 1), pid=proc.pid)
    try:
        yield f"http://127.0.0.1:{port}"
    except Exception as e:  # noqa: BLE001 - keep what ran; the log tail says why
        res["error"] = f"{type(e).__name__}: {e}"
        print(f"[{name}] ERROR {res['error']}\n{tail(log)}", flush=True)
    finally:
        t = time.monotonic()
        res["server_rc"] = stop(proc)
        res["stop_s"] = round(time.monotonic() - t, 1)


def stop(proc: subprocess.Popen, wait: float = 45) -> int:
    """SIGINT to the server's process group; SIGKILL after ``wait`` seconds. Its exit code."""
    try:
        os.killpg(proc.pid, signal.SIGINT)
    except ProcessLookupError:
        return proc.wait()
    try:
        return proc.wait(wait)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait()


def kill(proc: subprocess.Popen) -> None:
    """SIGKILL to the server's process group (what is left of it), and reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def tail(path: str, n: int = 4000) -> str:
    """The last ``n`` characters of a log ("" when there is none)."""
    try:
        with open(path, errors="replace") as f:
            return f.read()[-n:]
    except OSError:
        return ""


def engine_args(a: argparse.Namespace) -> dict[str, Any]:
    """What a parsed lmdeploy command line says about the engine (for a dry run's report)."""
    return {"model_path": a.model_path, "backend": a.backend, "server_port": a.server_port,
            "enable_prefix_caching": a.enable_prefix_caching, "session_len": a.session_len,
            "cache_max_entry_count": a.cache_max_entry_count}
