"""How long the CLI takes to start, measured (``--version``, ``--help``, ``stats``, ``ls`` under
0.3 s; ``verify``, ``purge`` and ``compact`` too), against the interpreter
alone and an ``import torch`` in the same run.

    python bench/cli_start.py [--n 15] [--json OUT]

Builds a small store in a temporary directory, then runs each command ``--n`` times in a fresh
interpreter (wall time of the whole process) and prints median and p90 per command, the
interpreter's own start (``python -c pass``) and what ``import torch`` alone costs here. The
commands that write run on a fresh copy of the store each time (``purge --all`` deletes its 16
entries; ``compact`` writes into a new directory), copied outside the timing.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # featcache and bench.lib from this checkout

from bench.lib.results import write_report  # noqa: E402
from bench.lib.timing import percentile  # noqa: E402


def wall(cmd: list[str], n: int, prepare: Callable[[], None] | None = None) -> dict[str, float]:
    """Median and p90 wall time of ``cmd`` over ``n`` runs; ``prepare`` runs before each, untimed."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    times = []
    for _ in range(n):
        if prepare is not None:
            prepare()
        t = time.perf_counter()
        subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, check=True)
        times.append((time.perf_counter() - t) * 1e3)
    return dict(median_ms=round(statistics.median(times), 1), p90_ms=round(percentile(times, 0.9), 1))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=15)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    import torch

    from featcache import FeatureCache

    with tempfile.TemporaryDirectory() as store:
        with FeatureCache(device="cpu", device_bytes="1MiB", host_bytes=0, disk_path=store,
                          disk_bytes="64MiB") as cache:
            for i in range(16):
                cache.put(bytes([i + 1]) * 16, torch.full((256, 64), float(i)), meta=b'{"ns":"m"}')
        py = [sys.executable]
        rows = {"python -c pass": wall(py + ["-c", "pass"], args.n),
                "python -c 'import torch'": wall(py + ["-c", "import torch"], max(3, args.n // 3))}
        for cmd in (["--version"], ["--help"], ["stats", store], ["ls", store], ["verify", store]):
            rows["featcache " + " ".join(c if c != store else "STORE" for c in cmd)] = wall(
                py + ["-m", "featcache", *cmd], args.n)
        work = store + ".work"  # a fresh copy of the store (or nothing) before each run

        def fresh(copy: bool) -> Callable[[], None]:
            def prepare() -> None:
                shutil.rmtree(work, ignore_errors=True)
                if copy:
                    shutil.copytree(store, work)
            return prepare

        rows["featcache purge COPY --all"] = wall(
            py + ["-m", "featcache", "purge", work, "--all"], args.n, fresh(copy=True))
        rows["featcache compact STORE DEST"] = wall(
            py + ["-m", "featcache", "compact", store, work], args.n, fresh(copy=False))
        shutil.rmtree(work, ignore_errors=True)
    base = rows["python -c pass"]["median_ms"]
    print(f"{'command':34s} {'median ms':>10s} {'p90 ms':>8s} {'- python':>9s}")
    for name, r in rows.items():
        print(f"{name:34s} {r['median_ms']:10.1f} {r['p90_ms']:8.1f} {r['median_ms'] - base:9.1f}")
    slow = [k for k, r in rows.items() if k.startswith("featcache") and r["median_ms"] > 300]
    verdict = "met" if not slow else "NOT met: " + ", ".join(slow)
    print(f"target: every featcache command under 300 ms (median): {verdict}")
    if args.json:  # with the run's commit, machine and date
        write_report(args.json, dict(rows=rows, n=args.n, python=sys.version.split()[0],
                                     cores=os.cpu_count()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
