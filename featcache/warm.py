"""``featcache warm``: compute image features offline into the disk tier, so a server starts hot.

    featcache warm MODEL IMAGE... [--from-dir DIR] [--cache-dir DIR] [--param KEY=VALUE ...]

Each image goes through a featcache pipeline of MODEL (lmdeploy's PyTorch engine, one GPU), as a
one-token request whose image is a local file: the key is the one a server computes for the same
file sent as a file path or a base64 data URL (keys of encoded images are digests of their bytes,
the model's namespace and the per-image parameters), so ``featcache serve`` over the same
``--cache-dir`` with the same ``--dtype`` and parameters serves them from disk. Images already
cached are not computed again. The store is flushed to disk before the command returns.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Iterable
from typing import Any

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL", help="model path or id (as for lmdeploy)")
    p.add_argument("images", nargs="*", metavar="IMAGE", help="image files")
    p.add_argument("--from-dir", metavar="DIR",
                   help=f"also every image file under DIR, recursively ({', '.join(IMAGE_SUFFIXES)})")
    p.add_argument("--cache-dir", metavar="DIR",
                   help="store directory (default: $FEATCACHE_DIR, else ~/.cache/featcache)")
    p.add_argument("--disk-bytes", metavar="N", help="disk tier budget, e.g. 64GiB "
                   "(default: half the free space, at most 32GiB)")
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                   help="a per-image parameter the server's clients send too (e.g. "
                   "max_dynamic_patch=6); part of the key. Repeatable")
    p.add_argument("--dtype", default="auto", help="as the server's --dtype (default auto)")
    p.add_argument("--batch", type=int, default=8, metavar="N", help="images per batch (default 8)")


def collect(images: Iterable[str], from_dir: str | None) -> list[str]:
    """The image files to warm, in order, each once; raises ``ValueError`` for missing ones."""
    paths = [os.path.abspath(p) for p in images]
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing:
        raise ValueError(f"no such file: {missing[0]}" + (f" (and {len(missing) - 1} more)"
                                                          if len(missing) > 1 else ""))
    if from_dir is not None:
        if not os.path.isdir(from_dir):
            raise ValueError(f"no such directory: {from_dir}")
        for root, dirs, files in os.walk(from_dir):
            dirs.sort()
            paths += [os.path.abspath(os.path.join(root, f)) for f in sorted(files)
                      if f.lower().endswith(IMAGE_SUFFIXES)]
    seen: set[str] = set()
    return [p for p in paths if not (p in seen or seen.add(p))]  # type: ignore[func-returns-value]


def parse_params(items: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` pairs; values that read as int, float or bool become one."""
    params: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--param {item!r}: use KEY=VALUE")
        value: Any = text
        for kind in (int, float):
            try:
                value = kind(text)
                break
            except ValueError:
                continue
        if text in ("true", "false"):
            value = text == "true"
        params[key] = value
    return params


def request(path: str, params: dict[str, Any]) -> list[dict[str, Any]]:
    """The one-token request that computes ``path``'s features, as a client would send it."""
    return [{"role": "user", "content": [
        {"type": "text", "text": "."},
        {"type": "image_url", "image_url": {"url": path, **params}}]}]


def main(args: argparse.Namespace) -> int:
    """Run ``featcache warm`` (see the module docstring); the exit code."""
    from lmdeploy import GenerationConfig, PytorchEngineConfig

    from .cli import ProgressBar
    from .errors import FeatCacheError
    from .lmdeploy import SECTION, default_cache, pipeline
    from .sizes import parse_bytes

    try:
        paths = collect(args.images, args.from_dir)
        params = parse_params(args.param)
        disk_bytes = parse_bytes(args.disk_bytes) if args.disk_bytes else None
        if args.batch < 1:
            raise ValueError("--batch must be at least 1")
    except ValueError as e:
        print(f"featcache warm: error: {e}", file=sys.stderr)
        return 2
    if not paths:
        print("featcache warm: error: no images (give IMAGE files or --from-dir DIR)", file=sys.stderr)
        return 2
    try:
        cache = default_cache(path=args.cache_dir, disk_bytes=disk_bytes)
    except (FeatCacheError, TypeError, ValueError) as e:  # e.g. a --disk-bytes it cannot map
        print(f"featcache warm: error: {e}", file=sys.stderr)
        return 1
    try:
        pipe = pipeline(args.model, cache=cache, log_level="ERROR",
                        backend_config=PytorchEngineConfig(dtype=args.dtype, session_len=16384))
    except BaseException:
        cache.close()
        raise
    gen = GenerationConfig(max_new_tokens=1, do_sample=False)
    failed: list[str] = []
    start = time.perf_counter()
    bar = ProgressBar(len(paths), "warm")
    done = nbytes = 0
    try:
        for i in range(0, len(paths), args.batch):
            batch = paths[i:i + args.batch]
            try:
                pipe([request(p, params) for p in batch], gen_config=gen)
            except Exception:  # one bad file fails its batch: find it, keep the others
                for p in batch:
                    try:
                        pipe([request(p, params)], gen_config=gen)
                    except Exception as e:
                        failed.append(f"{p}: {type(e).__name__}: {e}")
            done += len(batch)
            nbytes += sum(os.path.getsize(p) for p in batch)
            bar.update(done, nbytes)
        bar.close(done, nbytes)
        cache.flush()
        stats = cache.stats()
        counts, disk = stats.get(SECTION, {}), stats.get("disk", {})
    finally:
        pipe.close()
        cache.close()
    computed = counts.get("misses", 0)
    print(f"warmed {len(paths) - len(failed)} of {len(paths)} images in "
          f"{time.perf_counter() - start:.1f} s: {computed} computed, "
          f"{counts.get('hits', 0)} already cached; store: {disk.get('entries', 0)} entries, "
          f"{disk.get('bytes', 0) / 2**20:.1f} MiB")
    for line in failed:
        print(f"featcache warm: failed: {line}", file=sys.stderr)
    return 1 if failed else 0
