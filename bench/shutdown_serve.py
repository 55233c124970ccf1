"""How fast `featcache serve` (and plain `lmdeploy serve api_server`) stop on SIGINT/SIGTERM, on a GPU.

    python bench/shutdown_serve.py --model DIR --out DIR [--configs NAME,...] [--repeats N]
                                   [--signal INT|TERM] [--parallel] [--burst N] [--dry-run]

Issue 27: on the H200 `featcache serve MODEL --enable-prefix-caching` once did not exit within
60 s of SIGINT. Per configuration and repetition: start the server (its own process group, as a
terminal runs it), send one chat turn with an image (so the caches hold features and have disk
writes to flush), send the signal to the whole group (what Ctrl-C does), and measure:

- ``exit_s``: from the signal to the server's main process exiting (target: < 10 s);
- ``left``: processes of its group still alive 2 s after that (target: none);
- ``gpu_pids``: processes nvidia-smi still shows on the GPU afterwards (target: none of the group);
- the last lines of the server's log (featcache's watchdog writes one when it had to end it), and
  ``close_lines``: featcache's lines on closing its caches (what was flushed, or lost).

Configurations (``--configs``, default all PyTorch ones): ``plain`` and ``plain_prefix`` (lmdeploy),
``fc_mp`` / ``fc_mp_prefix`` (featcache, lmdeploy's engine process), ``fc_in`` / ``fc_in_prefix``
(featcache, engine in the server's process); with ``--backend turbomind``: ``plain_tm``, ``fc_tm``.
Results: ``shutdown-INT.json`` (or ``-TERM``) in --out, rewritten after each run.

``--burst N``: after that turn, N more image requests (new images) at once, and the signal as soon
as the first of them is answered: the others are in flight and its features are queued for the
disk, so the close has writes to flush (its close line says how many) and requests to end
(``burst``: answered, failed; a request cut off by the stop fails, as in plain lmdeploy).

``--parallel`` runs a repetition's configurations at once, each on its own port (the GPU holds
them all: PyTorch servers take 5% of its memory for KV, TurboMind 20%); starting a server is most
of a run's time, so this divides the device time by the number of configurations. Each run's
``gpu_left`` is the GPU's processes afterwards that were in that server's process group before the
signal, so the other servers' processes do not count against it; their load on the host can only
make a stop slower, never faster.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench.lib

from bench.lib.client import run_chat  # noqa: E402
from bench.lib.images import chat_url  # noqa: E402
from bench.lib.results import write_report  # noqa: E402
from bench.lib.servers import featcache_command, kill, lmdeploy_command, server_flags, start, tail  # noqa: E402

PORT = 23420
PYTORCH = ("plain", "plain_prefix", "fc_mp", "fc_mp_prefix", "fc_in", "fc_in_prefix")
TURBOMIND = ("plain_tm", "fc_tm")


def command(name: str, model: str, store: str, port: int = PORT) -> list[str]:
    """The configuration's server: prefix caching for ``*_prefix`` and TurboMind (``*_tm``), the
    engine in featcache's process (``fc_in*``) or lmdeploy's engine process (``fc_mp*``)."""
    tm = name.endswith("_tm")
    flags = server_flags("turbomind" if tm else "pytorch", eager=True,
                         prefix=name.endswith("_prefix") or tm, log_level="INFO")
    if name.startswith("plain"):
        return lmdeploy_command(model, port, flags)
    process = None if tm else ("in" if name.startswith("fc_in") else "mp")
    return featcache_command(model, store, port, flags, process)


def port_of(index: int, parallel: bool) -> int:
    """The port of the ``index``-th configuration: its own with ``--parallel``, else the one."""
    return PORT + index if parallel else PORT


def group_alive(pgid: int) -> list[int]:
    import psutil

    alive = []
    for p in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(p.pid) == pgid:
                alive.append(p.pid)
        except (ProcessLookupError, PermissionError, OSError):
            continue
    return alive


def gpu_pids() -> list[int]:
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [int(x) for x in out.split() if x.strip().isdigit()]


def start_burst(base: str, n: int, seed: int) -> tuple[list[threading.Thread], dict[str, int],
                                                     threading.Event]:
    """``n`` one-turn image chats at once (threads); returns them, their tally and an event set
    when the first is answered."""
    tally = {"answered": 0, "failed": 0}
    first = threading.Event()
    lock = threading.Lock()

    def one(i: int) -> None:
        try:
            run_chat(base, chat_url(seed + i), 1, max_tokens=4)
            key = "answered"
        except Exception:  # noqa: BLE001 (cut off by the stop: counted)
            key = "failed"
        with lock:
            tally[key] += 1
        first.set()

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    return threads, tally, first


def one_run(name: str, cmd: list[str], port: int, image: str, logs: str, rep: int, sig: int,
            ready_timeout: float, wait_s: float, burst: int = 0) -> dict[str, Any]:
    log_path = os.path.join(logs, f"{name}-{rep}-{signal.Signals(sig).name}.log")
    row: dict[str, Any] = {"config": name, "rep": rep, "command": shlex.join(cmd)}
    proc = None
    try:
        proc, ready = start(cmd, port, log_path, ready_timeout)  # in its own process group
        row["ready_s"] = round(ready, 1)
        row["turn"] = run_chat(f"http://127.0.0.1:{port}", image, 1, max_tokens=4)[0]["ttft_ms"]
        threads: list[threading.Thread] = []
        if burst:
            threads, tally, first = start_burst(f"http://127.0.0.1:{port}", burst, 1000 + 100 * rep)
            first.wait(60)
        before = gpu_pids()
        group = set(group_alive(proc.pid))
        signalled = time.monotonic()
        os.killpg(proc.pid, sig)  # what Ctrl-C does: the signal to the whole group
        try:
            proc.wait(wait_s)
            row["exit_s"] = round(time.monotonic() - signalled, 2)
        except subprocess.TimeoutExpired:
            row["exit_s"] = None  # did not exit: killed below
        row["rc"] = proc.returncode
        for t in threads:
            t.join(30)
        if burst:
            row["burst"] = dict(tally, sent=burst)
        time.sleep(2)
        row["left"] = group_alive(proc.pid)
        row["gpu_pids_before"] = before
        row["gpu_pids_after"] = gpu_pids()
        row["gpu_left"] = [pid for pid in row["gpu_pids_after"] if pid in group]
    except Exception as e:  # keep what ran; the log says why
        row["error"] = f"{type(e).__name__}: {e}"
    finally:
        if proc is not None:
            kill(proc)
        time.sleep(1)
    row["log_tail"] = tail(log_path, 1500).splitlines()[-8:]
    # featcache's last word on its disk writes (the server's, and each model process's), if any
    with open(log_path, errors="replace") as f:
        row["close_lines"] = [line.strip() for line in f
                              if line.startswith("featcache") and ("cache closed" in line or "lost" in line)]
    print(f"[{name} #{rep}] exit {row.get('exit_s')} s, rc {row.get('rc')}, left {row.get('left')}, "
          f"gpu left {row.get('gpu_left')}{' ERROR ' + row['error'] if 'error' in row else ''}",
          flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--configs", default=",".join(PYTORCH))
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--signal", choices=("INT", "TERM"), default="INT")
    p.add_argument("--wait", type=float, default=60, help="seconds to wait for the exit")
    p.add_argument("--ready-timeout", type=float, default=240)
    p.add_argument("--store", default="/tmp/shutdown-store")
    p.add_argument("--logs", default="/tmp/shutdown-logs",
                   help="the servers' logs (their tails are in the JSON; the device returns 8 files)")
    p.add_argument("--burst", type=int, default=0, metavar="N",
                   help="N image requests at once after the first turn; the signal when one is answered")
    p.add_argument("--parallel", action="store_true",
                   help="a repetition's configurations at once, each on its own port")
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args(argv)
    configs = [c for c in args.configs.split(",") if c]
    unknown = set(configs) - set(PYTORCH) - set(TURBOMIND)
    if unknown:
        p.error(f"unknown configs: {sorted(unknown)}")
    if args.dry_run:
        for i, c in enumerate(configs):
            cmd = command(c, args.model, f"{args.store}-{c}", port_of(i, args.parallel))
            print(f"{c}: {shlex.join(cmd)}")
        return 0
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.logs, exist_ok=True)
    image = chat_url(1)
    sig = getattr(signal, f"SIG{args.signal}")
    rows: list[dict[str, Any]] = []
    path = os.path.join(args.out, f"shutdown-{args.signal}.json")
    lock = threading.Lock()

    def run(rep: int, i: int, c: str) -> None:
        port = port_of(i, args.parallel)
        row = one_run(c, command(c, args.model, f"{args.store}-{c}", port), port, image, args.logs,
                      rep, sig, args.ready_timeout, args.wait, args.burst)
        with lock:  # rewritten after each run: a call that runs out of time keeps what it measured
            rows.append(row)
            write_report(path, {"signal": args.signal, "parallel": args.parallel, "burst": args.burst,
                                "rows": rows})

    for rep in range(args.repeats):
        if args.parallel:
            with concurrent.futures.ThreadPoolExecutor(len(configs)) as pool:
                for f in [pool.submit(run, rep, i, c) for i, c in enumerate(configs)]:
                    f.result()
        else:
            for i, c in enumerate(configs):
                run(rep, i, c)
    return 0


if __name__ == "__main__":
    sys.exit(main())
