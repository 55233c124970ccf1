"""Hit latency and throughput per tier, against raw copy floors measured in the same run.

    python bench/tiers.py [--device cuda] [--iters 50] [--out results.json]

For InternVL2-2B / -26B feature shapes (13 x 256 x 2048 and 13 x 256 x 6144, bf16) it reports:
- device-tier hit: host time of ``get`` (target <= 0.05 ms);
- host-tier hit: ``get`` until the tensor is on the device, against a plain pinned H2D copy of the
  same bytes and a pageable one (target <= 1.15x pinned);
- warm disk hit: ``get`` from LMDB (page cache warm) to the device, in GB/s (target >= 2 GB/s);
- put beside a GPU workload of ~22 ms (a vision forward's cost): the workload's time per step alone
  and with a ``put`` of its output each step, write-through to host and disk on (target <= 1%).
Ratios, not absolute times, are the claims: the machines are noisy.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # featcache, bench.lib

from bench.lib.results import write_report  # noqa: E402
from bench.lib.timing import median_call_ms  # noqa: E402
from featcache import FeatureCache  # noqa: E402

SHAPES = {"InternVL2-2B 13 tiles": (13, 256, 2048), "InternVL2-26B 13 tiles": (13, 256, 6144)}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn: Callable[[], object], iters: int, device: torch.device, warmup: int = 3,
              setup: Callable[[], object] | None = None) -> float:
    """Median wall time of fn() until its device work is done, in ms; setup() runs untimed."""
    return median_call_ms(fn, iters, setup=setup, warmup=warmup, sync=lambda: sync(device))


def host_ms(fn: Callable[[], object], iters: int) -> float:
    """Median host (CPU) time of fn(), in ms: what the request path pays before it can go on."""
    return median_call_ms(fn, iters, warmup=3)


def bench_shape(name: str, shape: tuple[int, ...], device: torch.device, iters: int) -> dict:
    nbytes = 2 * int(torch.Size(shape).numel())
    feats = torch.randn(shape, device=device).to(torch.bfloat16)
    cuda = device.type == "cuda"
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    pageable = torch.empty(nbytes, dtype=torch.uint8)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    row: dict = {"shape": list(shape), "MB": round(nbytes / 1e6, 1)}
    row["floor_h2d_pinned_ms"] = median_ms(lambda: dst.copy_(pinned, non_blocking=True), iters, device)
    row["floor_h2d_pageable_ms"] = median_ms(lambda: dst.copy_(pageable), iters, device)
    row["floor_d2d_clone_ms"] = median_ms(lambda: feats.clone(), iters, device)

    with tempfile.TemporaryDirectory() as tmp:
        cache = FeatureCache(device=device, device_bytes=4 * nbytes, host_bytes=4 * nbytes,
                             disk_path=tmp, disk_bytes=8 * nbytes, disk_sync=False)
        key = b"k" * 16
        cache.put(key, feats)
        cache.flush()
        out = cache.get(key)
        assert out is not None and torch.equal(out, feats)
        row["device_hit_host_ms"] = host_ms(lambda: cache.get(key), iters * 20)

        def evict_from_device() -> None:
            cache._chain.top.discard(key)

        def evict_from_device_and_host() -> None:
            cache._chain.top.discard(key)
            assert cache._chain.staging is not None
            cache._chain.staging.discard(key)

        def get() -> object:
            return cache.get(key)

        row["host_hit_ms"] = median_ms(get, iters, device, setup=evict_from_device)
        row["host_hit_vs_pinned_floor"] = row["host_hit_ms"] / row["floor_h2d_pinned_ms"]
        row["host_hit_host_ms"] = median_ms(  # the request path's own time: launch, no wait
            get, iters, torch.device("cpu"), setup=lambda: (evict_from_device(), sync(device)))
        evict_from_device()
        assert torch.equal(get(), feats)
        host_bytes = pinned[:nbytes]
        row["h2d_copier_host_ms"] = median_ms(  # the copier alone, on the host: where time goes
            lambda: cache._copier.to_device(host_bytes, torch.bfloat16, shape, None),
            iters, torch.device("cpu"), setup=lambda: sync(device))

        row["disk_hit_ms"] = median_ms(get, iters, device, setup=evict_from_device_and_host)
        row["disk_hit_GBps"] = nbytes / row["disk_hit_ms"] / 1e6
        evict_from_device_and_host()
        assert torch.equal(get(), feats)
        stats = cache.stats()
        assert stats["disk"]["hits"] > 0 and stats["host"]["hits"] > 0
        cache.close()
    return row


def bench_put_overhead(device: torch.device, steps: int, target_ms: float = 22.0) -> dict:
    """A GPU workload of ~target_ms per step (one 13-tile vision forward's cost), alone vs with a
    put of a fresh 13.6 MB output each step (write-through to host and disk on)."""
    shape = SHAPES["InternVL2-2B 13 tiles"]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(4096, 4096, device=device, dtype=dtype)
    per = median_ms(lambda: a @ a, 5, device)
    reps = max(1, round(target_ms / per))

    def workload() -> torch.Tensor:
        x = a
        for _ in range(reps):
            x = a @ a
        return x[:1].reshape(-1)[:1].float().expand(shape).to(torch.bfloat16).contiguous()

    with tempfile.TemporaryDirectory() as tmp:
        cache = FeatureCache(device=device, device_bytes="512MiB", host_bytes="1GiB",
                             disk_path=tmp, disk_bytes="4GiB", disk_sync=False)
        counter = iter(range(10**9))

        def with_put() -> None:
            cache.put(next(counter).to_bytes(16, "little"), workload())

        # interleave the two, several rounds, so drift on the machine hits both alike
        alone, put = [], []
        for _ in range(5):
            alone.append(median_ms(workload, steps, device, warmup=1))
            put.append(median_ms(with_put, steps, device, warmup=1))
        cache.flush()
        stats = cache.stats()
        cache.close()
    alone_ms, put_ms = statistics.median(alone), statistics.median(put)
    return {
        "workload_ms": alone_ms, "workload_plus_put_ms": put_ms,
        "put_overhead_pct": 100 * (put_ms / alone_ms - 1),
        "host_drops": stats["host"]["drops"], "disk_drops": stats["disk"]["drops"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--steps", type=int, default=10, help="workload steps per round (put overhead)")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    results: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                     "torch": torch.__version__, "shapes": {}}
    for name, shape in SHAPES.items():
        results["shapes"][name] = row = bench_shape(name, shape, device, args.iters)
        print(f"{name}: {row['MB']} MB")
        print(f"  floors: H2D pinned {row['floor_h2d_pinned_ms']:.3f} ms, pageable "
              f"{row['floor_h2d_pageable_ms']:.3f} ms, D2D clone {row['floor_d2d_clone_ms']:.3f} ms")
        print(f"  device hit {row['device_hit_host_ms']:.4f} ms host time (target <= 0.05)")
        print(f"  host hit   {row['host_hit_ms']:.3f} ms = {row['host_hit_vs_pinned_floor']:.2f}x the "
              f"pinned copy (target <= 1.15x); {row['host_hit_host_ms']:.3f} ms of it on the host, "
              f"{row['h2d_copier_host_ms']:.3f} ms in the copier")
        print(f"  disk hit   {row['disk_hit_ms']:.3f} ms = {row['disk_hit_GBps']:.2f} GB/s (target >= 2)")
    results["put_overhead"] = po = bench_put_overhead(device, args.steps)
    print(f"put beside a {po['workload_ms']:.1f} ms workload: {po['workload_plus_put_ms']:.2f} ms "
          f"(+{po['put_overhead_pct']:.2f}%, target <= 1%; drops host {po['host_drops']} "
          f"disk {po['disk_drops']})")
    if args.out:
        write_report(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
