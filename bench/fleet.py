"""A fleet's shared tier: remote-hit latency and bandwidth of one Redis node, a Redis Cluster
(3 primaries + 1 replica each) and Mooncake Store (where its package loads), in one run, with
every figure also as a ratio to one node's.

    python bench/fleet.py [--images-1 24] [--images-13 8] [--rounds 3] [--no-mooncake] [--out f.json]

Entries are InternVL2-2B features: 256 tokens x 2048 hidden bf16 per tile, 1 tile (1.0 MiB) and 13
tiles (13.6 MB). A writer replica (a child process, kept up until the reads are done: Mooncake
keeps objects in its contributors' memory) puts every entry and flushes; this process then opens
a fresh replica (no device tier, an empty host tier) per round and gets every entry once: each
get is a remote hit, timed from ``get`` until the tensor is returned (fetched, verified, copied
into a host block), its bytes checked against the writer's digest. Everything runs on loopback
(the cluster's nodes reached directly, no proxy), so the figures are client and server CPU
costs, not a network's; their ratios measured in one run are the claim.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import xxhash

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout, not installed
sys.path.insert(0, str(ROOT / "tests"))  # the loopback servers the tests start

from bench.lib.results import write_report  # noqa: E402
from featcache import FeatureCache  # noqa: E402

TILE = (256, 2048)
SHAPES = {"1 tile": (1, *TILE), "13 tiles": (13, *TILE)}


def features(i: int, shape: tuple[int, ...]) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7000 + i)
    return torch.randn(shape, generator=gen).to(torch.bfloat16)


def digest(t: torch.Tensor) -> str:
    return xxhash.xxh3_64_hexdigest(t.contiguous().view(torch.uint8).numpy().data)


def writer(url: str, jobs: list[tuple[bytes, int, tuple[int, ...]]], conn: Any) -> None:
    """Child process: put every entry, flush, send the digests, stay up until told to go."""
    torch.set_num_threads(1)
    cache = FeatureCache(device="cpu", device_bytes=0, host_bytes=0, remote_url=url,
                         remote_queue_entries=1024)
    digests = {}
    for key, i, shape in jobs:
        t = features(i, shape)
        digests[key.hex()] = digest(t)
        cache.put(key, t)
    cache.flush()
    conn.send({"digests": digests, "remote": cache.stats()["remote"]})
    conn.recv()
    cache.close()


class Backend:
    """One tier under test: its writer (a child process) up and done, its entries' digests."""

    def __init__(self, name: str, url: str, args: argparse.Namespace) -> None:
        self.name, self.url = name, url
        counts = {"1 tile": args.images_1, "13 tiles": args.images_13}
        self.jobs = [(f"{name}/{label}/{i}".encode(), label, i, shape)
                     for label, shape in SHAPES.items() for i in range(counts[label])]
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=writer, daemon=True,
                                args=(url, [(k, i, sh) for k, _, i, sh in self.jobs], child))
        self.proc.start()
        if not self.conn.poll(600):
            raise SystemExit(f"{name}: the writer did not finish")
        done = self.conn.recv()
        assert done["remote"]["published"] == len(self.jobs), done["remote"]
        self.digests = done["digests"]
        self.times: dict[str, list[float]] = {label: [] for label in SHAPES}
        self.reader: FeatureCache | None = None

    def fresh_reader(self) -> None:
        if self.reader is not None:
            s = self.reader.stats()["remote"]
            assert s["hits"] == len(self.jobs) and s["misses"] == 0, s
            self.reader.close()
        # no device tier: a hit is the fetch, the checksum and the copy into a host block
        self.reader = FeatureCache(device="cpu", device_bytes=0, host_bytes="512MiB",
                                   remote_url=self.url, remote_timeout_ms=5000)

    def read(self, j: int, keep: bool) -> None:
        key, label, _, _ = self.jobs[j]
        assert self.reader is not None
        t0 = time.perf_counter()
        got = self.reader.get(key)
        ms = (time.perf_counter() - t0) * 1e3
        if got is None or digest(got) != self.digests[key.hex()]:
            raise SystemExit(f"{self.name}: {key!r} missed or wrong: {self.reader.stats()['remote']}")
        if keep:
            self.times[label].append(ms)

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()
        self.conn.send("go")
        self.proc.join(60)
        if self.proc.is_alive():
            self.proc.kill()

    def figures(self) -> dict[str, Any]:
        out = {}
        for label, shape in SHAPES.items():
            xs = sorted(self.times[label])
            med = statistics.median(xs)
            nbytes = math.prod(shape) * 2
            out[label] = {"median_ms": med, "p90_ms": xs[min(len(xs) - 1, int(0.9 * len(xs)))],
                          "gb_per_s": nbytes / med / 1e6, "mbytes": nbytes / 1e6, "samples": len(xs)}
        return out


def run(backends: list[Backend], rounds: int) -> None:
    """Every round: a fresh reader per tier, then entry by entry, each tier in turn (so that the
    machine's drift, other work on its cores, weighs on every tier alike); round 0 warms up."""
    for round_ in range(rounds + 1):
        for b in backends:
            b.fresh_reader()
        for j in range(len(backends[0].jobs)):
            for b in backends[j % len(backends):] + backends[: j % len(backends)]:
                b.read(j, keep=round_ > 0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images-1", type=int, default=24, help="1-tile entries")
    parser.add_argument("--images-13", type=int, default=8, help="13-tile entries")
    parser.add_argument("--rounds", type=int, default=5, help="fresh readers, each reading all")
    parser.add_argument("--no-mooncake", action="store_true")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()

    import _cluster
    import _redis

    binary = shutil.which("redis-server")
    cli = shutil.which("redis-cli")
    if not binary or not cli:
        raise SystemExit("needs redis-server and redis-cli on PATH")
    skipped: dict[str, str] = {}
    stop: list[Any] = []
    backends: list[Backend] = []
    with tempfile.TemporaryDirectory(prefix="featcache-bench-fleet-") as workdir:
        try:
            one = _redis.RedisServer(binary, Path(workdir), None, "--maxmemory", "4gb")
            stop.append(one.kill)
            backends.append(Backend("one node", one.url, args))
            cdir = Path(workdir) / "cluster"
            cdir.mkdir()
            cluster = _cluster.RedisCluster(binary, cli, cdir, proxied=False)
            stop.append(cluster.close)
            backends.append(Backend("cluster 3+3", cluster.url, args))
            if not args.no_mooncake:
                try:
                    import _mooncake
                    import mooncake
                    import mooncake.store  # noqa: F401
                except ImportError as e:
                    skipped["mooncake"] = str(e)
                else:
                    mdir = Path(workdir) / "mooncake"
                    mdir.mkdir()
                    master = _mooncake.MooncakeMaster(
                        str(Path(mooncake.__file__).parent / "mooncake_master"), mdir)
                    stop.append(master.kill)
                    backends.append(Backend("mooncake", master.url(segment="512MiB"), args))
            run(backends, args.rounds)
        finally:
            for b in backends:
                b.close()
            for kill in reversed(stop):
                kill()
    results = {b.name: b.figures() for b in backends}
    base = results["one node"]
    print(f"remote hit, fresh replica, loopback; {os.cpu_count()} CPUs; medians over "
          f"{args.rounds} rounds after a warm-up, the tiers read in turn")
    print(f"{'tier':<13} {'entry':<9} {'MB':>5} {'median':>9} {'p90':>9} {'GB/s':>6} "
          f"{'x one node':>11}")
    for name, r in results.items():
        for label in SHAPES:
            x = r[label]
            print(f"{name:<13} {label:<9} {x['mbytes']:>5.1f} {x['median_ms']:>7.2f}ms "
                  f"{x['p90_ms']:>7.2f}ms {x['gb_per_s']:>6.2f} "
                  f"{x['median_ms'] / base[label]['median_ms']:>10.2f}x")
    for name, why in skipped.items():
        print(f"{name}: not run ({why})")
    if args.out:
        write_report(args.out, {"results": results, "skipped": skipped, "cpus": os.cpu_count(),
                                "torch": torch.__version__})
    return 0


if __name__ == "__main__":
    sys.exit(main())
