"""The cost of the structural check of ``data.mdb`` at open (``featcache.store.lmdbcheck``).

    python bench/checks/lmdbcheck.py [--entries 10000] [--big 3000] [--dir /tmp]

Builds three stores with the disk tier (10,000 entries of 1.5 KiB, stored inside their leaf
pages; ``--big`` values of 1 MiB, stored on overflow pages; an empty one) and times the check on
each: the median of 7 runs with the file in the page cache (warm), and one run after the file's
pages were dropped from it with ``posix_fadvise(DONTNEED)`` (cold; it drops only this file's
pages). CPU time is printed beside the warm figure: it holds on a busy machine. The module
docstring quotes these figures.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import lmdb
import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))  # the checkout

from featcache import codec  # noqa: E402
from featcache.store.lmdbcheck import check_data_file  # noqa: E402
from featcache.tiers.disk import DiskOp, DiskTier  # noqa: E402


def encoded(nbytes: int, fill: float) -> bytes:
    t = torch.full((nbytes // 4,), fill)
    return codec.encode(t.dtype, tuple(t.shape), t.view(torch.uint8).numpy().data)


def build(path: str, entries: int, nbytes: int, batch: int) -> None:
    tier = DiskTier(path, 1 << 40, sync=False)
    try:
        for start in range(0, entries, batch):
            tier.write_batch([
                DiskOp("put", os.urandom(16), encoded(nbytes, float(i)))
                for i in range(start, min(entries, start + batch))
            ])
    finally:
        tier.close()


def drop_cache(data_file: str) -> None:
    fd = os.open(data_file, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def measure(path: str) -> str:
    data_file = os.path.join(path, "data.mdb")
    env = lmdb.open(path, readonly=True, max_dbs=4, map_size=0)
    try:
        drop_cache(data_file)
        started = time.perf_counter()
        check_data_file(env, data_file)
        cold = time.perf_counter() - started
        warm, cpu = [], []
        for _ in range(7):
            started, started_cpu = time.perf_counter(), time.process_time()
            result = check_data_file(env, data_file)
            warm.append(time.perf_counter() - started)
            cpu.append(time.process_time() - started_cpu)
    finally:
        env.close()
    assert result is not None
    return (
        f"{os.path.getsize(data_file) / 2**20:9.1f} MiB  {result.tree_pages:6d} tree pages read  "
        f"{result.overflow_pages:7d} overflow pages counted  warm {statistics.median(warm) * 1e3:6.1f} ms"
        f" (CPU {statistics.median(cpu) * 1e3:6.1f} ms)  cold {cold * 1e3:6.1f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--entries", type=int, default=10_000)
    parser.add_argument("--big", type=int, default=3_000)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="featcache-lmdbcheck-", dir=args.dir)
    try:
        for name, entries, nbytes, batch in (
            (f"{args.entries} x 1.5 KiB", args.entries, 1400, 256),
            (f"{args.big} x 1 MiB", args.big, 1 << 20, 32),
            ("empty", 0, 0, 1),
        ):
            path = os.path.join(root, name.replace(" ", ""))
            build(path, entries, nbytes, batch)
            print(f"{name:>16}: {measure(path)}", flush=True)
            shutil.rmtree(path)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
