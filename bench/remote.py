"""A second replica's first request for an image the first replica computed: a remote-tier hit,
against recomputing the features (a stand-in vision model) and against a local disk hit.

    python bench/remote.py [--redis-server PATH | --url redis://...] [--device cuda] [--out r.json]

Replica 1 runs in a child process: it "computes" N images' features (InternVL2-2B: 13 x 256 x 2048
bf16 = 13.6 MB; with --large also InternVL2-26B: 13 x 256 x 6144 = 40.9 MB), puts them and closes,
which publishes them to the server. Replica 2 (this process, empty local tiers of its own) then
asks for each: every one is a remote hit, timed from ``get`` until the tensor is usable on the
device (a CUDA sync on GPU), its bytes checked against replica 1's digest. In the same run:
- a local disk hit: the same features put into a disk tier, reopened, read once each (warm page
  cache, as on a replica that computed them itself before a restart);
- recompute: a stand-in for the vision model, an InternViT-shaped transformer (patch conv, pre-LN
  attention + MLP blocks, pixel shuffle, the MLP projector) over 13 tiles of 448 px: 24 layers of
  width 1024 (InternViT-300M) for the 2B shape, 45 layers of width 3200 (InternViT-6B) for the
  26B shape. On CUDA it runs in full (bf16). On a CPU, a full forward takes minutes, so it runs
  ``--vit-layers`` layers over ``--vit-tiles`` tiles (1 and 1 by default, fp32) and the result is
  scaled by layers x tiles (blocks cost the same each; tiles are independent): marked
  "extrapolated" in the output;
- the floor of the fetch: redis-py GET of the head + MGET of the chunks, nothing else.

The GPU machine has no network and no redis-server: carry one (bench/carry_redis.sh makes
``.bench-carry/`` with the binary, the two libraries it needs beyond a generic Ubuntu >= 22.04,
and the redis wheel) and pass ``--redis-server .bench-carry/redis-server``. Ratios measured in
one run are the claims; absolute times depend on the machine (loopback here, not a real network).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import math
import multiprocessing as mp
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, not installed

from bench.lib.results import write_report  # noqa: E402
from featcache import FeatureCache  # noqa: E402

SHAPES = {"InternVL2-2B": (13, 256, 2048), "InternVL2-26B": (13, 256, 6144)}
VITS = {  # layers, width, MLP width, heads: InternViT-300M and InternViT-6B
    "InternVL2-2B": (24, 1024, 4096, 16),
    "InternVL2-26B": (45, 3200, 12800, 25),
}
TILES, TILE_PX, PATCH = 13, 448, 14


# -- the server ----------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(binary: str, workdir: str) -> tuple[subprocess.Popen[bytes], str]:
    """redis-server on loopback, no persistence; the binary's folder is also searched for the
    shared libraries a carried copy brings along (liblzf, libjemalloc)."""
    port = free_port()
    env = dict(os.environ)
    here = str(Path(binary).resolve().parent)
    env["LD_LIBRARY_PATH"] = here + (":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", workdir, "--maxmemory", "16gb", "--maxmemory-policy", "allkeys-lru"],
        stdout=open(os.path.join(workdir, "redis.log"), "wb"), stderr=subprocess.STDOUT, env=env,
    )
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:  # wait for it to listen (a child process: nothing to await)
        if proc.poll() is not None:
            raise SystemExit(f"redis-server exited ({proc.returncode}); see {workdir}/redis.log")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return proc, f"redis://127.0.0.1:{port}/0"
        except OSError:
            pass
        time.sleep(0.02)
    proc.kill()
    raise SystemExit("redis-server did not start listening")


# -- the stand-in vision model ----------------------------------------------------------------------
class Block(torch.nn.Module):
    def __init__(self, dim: int, mlp: int, heads: int, **kw: object) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = torch.nn.LayerNorm(dim, **kw)  # type: ignore[arg-type]
        self.qkv = torch.nn.Linear(dim, 3 * dim, **kw)  # type: ignore[arg-type]
        self.proj = torch.nn.Linear(dim, dim, **kw)  # type: ignore[arg-type]
        self.norm2 = torch.nn.LayerNorm(dim, **kw)  # type: ignore[arg-type]
        self.fc1 = torch.nn.Linear(dim, mlp, **kw)  # type: ignore[arg-type]
        self.fc2 = torch.nn.Linear(mlp, dim, **kw)  # type: ignore[arg-type]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, self.heads, d // self.heads).unbind(2)
        a = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        x = x + self.proj(a.transpose(1, 2).reshape(b, n, d))
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm2(x))))


class VisionStandIn(torch.nn.Module):
    """InternViT-shaped: patch conv -> blocks -> pixel shuffle (0.5) -> MLP projector."""

    def __init__(self, layers: int, dim: int, mlp: int, heads: int, out: int, **kw: object) -> None:
        super().__init__()
        self.patch = torch.nn.Conv2d(3, dim, PATCH, PATCH, **kw)  # type: ignore[arg-type]
        self.blocks = torch.nn.ModuleList(Block(dim, mlp, heads, **kw) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(4 * dim, **kw)  # type: ignore[arg-type]
        self.fc1 = torch.nn.Linear(4 * dim, out, **kw)  # type: ignore[arg-type]
        self.fc2 = torch.nn.Linear(out, out, **kw)  # type: ignore[arg-type]

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.patch(pixels).flatten(2).transpose(1, 2)  # tiles x 1024 x dim
        x = torch.cat([x.mean(1, keepdim=True), x], 1)  # + a class token: 1025 tokens
        for block in self.blocks:
            x = block(x)
        x = x[:, 1:]
        t, n, d = x.shape
        side = int(math.isqrt(n))
        x = x.reshape(t, side // 2, 2, side // 2, 2, d).permute(0, 1, 3, 2, 4, 5).reshape(t, n // 4, 4 * d)
        return self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


def recompute_ms(name: str, device: torch.device, layers: int | None, tiles: int | None,
                 repeats: int) -> tuple[float, bool, str]:
    full_layers, dim, mlp, heads = VITS[name]
    on_gpu = device.type == "cuda"
    layers = layers or (full_layers if on_gpu else 1)
    tiles = tiles or (TILES if on_gpu else 1)
    dtype = torch.bfloat16 if on_gpu else torch.float32
    with torch.inference_mode():
        model = VisionStandIn(layers, dim, mlp, heads, SHAPES[name][2], device=device, dtype=dtype)
        pixels = torch.randn(tiles, 3, TILE_PX, TILE_PX, device=device, dtype=dtype)
        model(pixels)  # warm-up
        sync(device)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            model(pixels).to(torch.bfloat16)
            sync(device)
            times.append((time.perf_counter() - t0) * 1e3)
    del model
    scale = (full_layers / layers) * (TILES / tiles)
    how = f"{layers}/{full_layers} layers x {tiles}/{TILES} tiles, {str(dtype).removeprefix('torch.')}"
    return statistics.median(times) * scale, scale != 1, how


# -- replicas ---------------------------------------------------------------------------------------
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def features(i: int, shape: tuple[int, ...]) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + i)
    return torch.randn(shape, generator=gen).to(torch.bfloat16)


def digest(t: torch.Tensor) -> str:
    return xxhash.xxh3_64_hexdigest(t.detach().cpu().contiguous().view(torch.uint8).numpy().data)


def replica_one(url: str, keys: list[bytes], shape: tuple[int, ...], device: str) -> dict[str, object]:
    """Child process: compute (here: generate) and put every image's features; close publishes."""
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    cache = FeatureCache(device=device, device_bytes="2GiB", host_bytes="4GiB", remote_url=url)
    digests = {}
    for i, key in enumerate(keys):
        t = features(i, shape).to(device)
        digests[key.hex()] = digest(t)
        cache.put(key, t)
    t0 = time.perf_counter()
    cache.close()  # drains the publisher: every entry is on the server now
    publish_ms = (time.perf_counter() - t0) * 1e3
    remote = cache.stats()["remote"]
    return {"digests": digests, "drain_ms": publish_ms, "published": remote["published"],
            "bytes_published": remote["bytes_published"], "publish_errors": remote["publish_errors"]}


def timed_gets(cache: FeatureCache, keys: list[bytes], device: torch.device,
               check: Callable[[int, torch.Tensor], None]) -> list[float]:
    times = []
    for i, key in enumerate(keys):
        t0 = time.perf_counter()
        got = cache.get(key)
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
        if got is None:
            raise SystemExit(f"key {i} missed: {cache.stats()}")
        check(i, got)
    return times


def run_shape(name: str, url: str, args: argparse.Namespace, workdir: str) -> dict[str, object]:
    import redis

    shape = SHAPES[name]
    device = torch.device(args.device)
    keys = [f"{name}/{os.getpid()}/{i}".encode() for i in range(args.images)]
    nbytes = math.prod(shape) * 2

    with concurrent.futures.ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        first = pool.submit(replica_one, url, keys, shape, args.device).result()
    assert first["published"] == len(keys), first
    want = first["digests"]
    assert isinstance(want, dict)

    def check(i: int, t: torch.Tensor) -> None:
        assert tuple(t.shape) == shape and t.device.type == device.type
        if digest(t) != want[keys[i].hex()]:
            raise SystemExit(f"{name}: wrong bytes served for image {i}")

    # Replica 2: a fresh cache with its own (empty) disk tier; every first get is a remote hit.
    second = FeatureCache(device=args.device, device_bytes="2GiB", host_bytes="4GiB",
                          disk_path=os.path.join(workdir, f"r2-{name}"), disk_bytes="8GiB",
                          remote_url=url)
    remote_times = timed_gets(second, keys, device, check)
    remote_stats = second.stats()["remote"]
    assert remote_stats["hits"] == len(keys) and second.stats()["disk"]["hits"] == 0, remote_stats
    second.close()

    # The fetch alone: what redis-py takes to bring the head and the chunks to this process.
    client = redis.Redis.from_url(url)
    from featcache.config import CacheConfig
    from featcache.tiers import remote as rm
    from featcache.tiers import remote_layout

    tier = rm.RemoteTier.from_config(CacheConfig.create(remote_url=url), client_factory=lambda: client)
    fetch_times = []
    for key in keys:
        t0 = time.perf_counter()
        head = remote_layout.parse_head(client.get(tier.head_key(key)))
        pieces = client.mget(tier.chunk_keys(key, head)) if head.chunks else [head.inline]
        fetch_times.append((time.perf_counter() - t0) * 1e3)
        assert sum(len(p) for p in pieces) == head.value_len
    client.close()

    # A local disk hit on a replica that computed the features itself before a restart.
    disk_dir = os.path.join(workdir, f"disk-{name}")
    with FeatureCache(device=args.device, device_bytes="2GiB", host_bytes="4GiB", disk_path=disk_dir,
                      disk_bytes="8GiB", disk_sync=False) as writer:
        for i, key in enumerate(keys):
            writer.put(key, features(i, shape).to(device))
    reopened = FeatureCache(device=args.device, device_bytes="2GiB", host_bytes="4GiB",
                            disk_path=disk_dir, disk_bytes="8GiB")
    disk_times = timed_gets(reopened, keys, device, check)
    assert reopened.stats()["disk"]["hits"] == len(keys)
    reopened.close()

    model_ms, extrapolated, how = recompute_ms(name, device, args.vit_layers, args.vit_tiles,
                                               args.model_repeats)
    remote_ms = statistics.median(remote_times)
    disk_ms = statistics.median(disk_times)
    return {
        "shape": list(shape), "mbytes": round(nbytes / 1e6, 1), "images": len(keys),
        "remote_hit_ms": {"median": remote_ms, "p90": _p90(remote_times), "all": remote_times},
        "remote_fetch_floor_ms": statistics.median(fetch_times),
        "disk_hit_ms": {"median": disk_ms, "p90": _p90(disk_times), "all": disk_times},
        "recompute_ms": model_ms, "recompute_extrapolated": extrapolated, "recompute_how": how,
        "recompute_over_remote": model_ms / remote_ms, "remote_over_disk": remote_ms / disk_ms,
        "remote_gb_per_s": nbytes / remote_ms / 1e6,
        "publish_drain_ms_per_image": first["drain_ms"] / len(keys),  # type: ignore[operator]
    }


def _p90(xs: list[float]) -> float:
    return sorted(xs)[min(len(xs) - 1, int(0.9 * len(xs)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--redis-server", help="the redis-server binary to start on loopback "
                        "(default: redis-server on PATH)")
    parser.add_argument("--url", help="use this running server instead of starting one")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--images", type=int, default=8, help="images per shape")
    parser.add_argument("--large", action="store_true", help="also the 40.9 MB InternVL2-26B shape")
    parser.add_argument("--vit-layers", type=int, help="stand-in layers to run (default: all on "
                        "CUDA, 1 on CPU; the time is scaled to the full depth)")
    parser.add_argument("--vit-tiles", type=int, help="tiles to run (default 13 on CUDA, 1 on CPU)")
    parser.add_argument("--model-repeats", type=int, default=3)
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()

    proc = None
    with tempfile.TemporaryDirectory(prefix="featcache-bench-remote-") as workdir:
        if args.url:
            url = args.url
        else:
            binary = args.redis_server or shutil.which("redis-server")
            if not binary:
                raise SystemExit("no redis-server: pass --redis-server PATH or --url")
            proc, url = start_server(binary, workdir)
        try:
            names = list(SHAPES) if args.large else ["InternVL2-2B"]
            results = {name: run_shape(name, url, args, workdir) for name in names}
        finally:
            if proc is not None:
                proc.kill()
                proc.wait()
    doc = {
        "device": args.device,
        "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
        "cpu_threads": torch.get_num_threads(), "torch": torch.__version__,
        "server": "loopback redis-server" if proc is not None else "given --url",
        "results": results,
    }
    print(f"device {args.device}; server: {doc['server']}; medians over {args.images} images")
    print(f"{'shape':<15} {'MB':>5} {'remote hit':>11} {'fetch floor':>12} {'disk hit':>9} "
          f"{'recompute':>10} {'recomp/remote':>14} {'remote/disk':>12}")
    for name, r in results.items():
        mark = "*" if r["recompute_extrapolated"] else ""
        print(f"{name:<15} {r['mbytes']:>5} {r['remote_hit_ms']['median']:>9.2f}ms "  # type: ignore[index]
              f"{r['remote_fetch_floor_ms']:>10.2f}ms {r['disk_hit_ms']['median']:>7.2f}ms "  # type: ignore[index]
              f"{r['recompute_ms']:>8.1f}ms{mark} {r['recompute_over_remote']:>13.1f}x "
              f"{r['remote_over_disk']:>11.2f}x")
    if any(r["recompute_extrapolated"] for r in results.values()):
        print("* recompute extrapolated: " + "; ".join(
            f"{n}: {r['recompute_how']}" for n, r in results.items()))
    if args.out:
        write_report(args.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
