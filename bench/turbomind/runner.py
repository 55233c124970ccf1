"""One engine at a time: each of ``--paths`` built in turn (featcache's cache in host memory, a
disk tier beside it; GPU memory freed between), ``micro`` on the first, the series on each, the
comparisons and the results file rewritten after every engine (a run cut short keeps what it
measured), the run's metadata recorded when it began; a failed engine is reported and the rest run."""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

from bench.lib.engines import build_turbomind, free_gpu, host_cache, turbomind_config
from bench.lib.results import run_meta, write_report
from bench.turbomind.compare import compare, report
from bench.turbomind.micro import micro
from bench.turbomind.series import Bench

PATHS = ("plain", "native", "features", "combined")


def real_builder(args: argparse.Namespace) -> Callable[[str, Any], Any]:
    """``build(path, cache) -> pipeline``: TurboMind with prefix caching on, featcache's path
    ``path`` over ``cache`` (checked to be installed)."""
    def build(path: str, cache: Any) -> Any:
        config = turbomind_config(True, args.session_len, args.kv_fraction)  # lmdeploy may change it
        pipe = build_turbomind(path, args.model, config, cache)
        if path != "plain" and getattr(pipe, "featcache", None) is not cache:
            raise RuntimeError(f"featcache was not installed on the {path} pipeline")
        return pipe
    return build


def gpu_memory() -> dict[str, float] | None:
    import torch

    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    return dict(free_gib=round(free / 2**30, 1), total_gib=round(total / 2**30, 1))


def bench_meta(args: argparse.Namespace) -> dict[str, Any]:
    """The run's metadata (``run_meta``): the arguments, one new token, prefix caching on."""
    return run_meta(args=vars(args), new_tokens=1, prefix_caching=True)


def run_all(args: argparse.Namespace, builder: Callable[[str, Any], Any], out: str | None,
            t0: float) -> dict[str, Any]:
    """Every path of ``--paths`` through ``builder``, in turn, within ``--budget`` s from ``t0``;
    the results (``out`` rewritten after each engine)."""
    w, h = (int(x) for x in args.size.split("x"))
    bench = Bench(args, (w, h), t0 + args.budget)
    results: dict[str, Any] = dict(meta=bench_meta(args), engines={}, skipped=[])

    def save() -> None:
        if out:
            write_report(out, results)  # its run metadata: "meta"

    for path in args.paths.split(","):
        if bench.left() < args.engine_reserve_s:
            results["skipped"].append(f"{path}: {bench.left():.0f} s left (< {args.engine_reserve_s})")
            print(f"[bench] SKIPPED {path}: out of time", flush=True)
            continue
        store = tempfile.mkdtemp(prefix=f"fc-tmb-{path}-")
        cache = None
        if path != "plain":
            cache = host_cache(int(args.cache_gib * 2**30), store if args.disk_gib > 0 else None,
                               int(args.disk_gib * 2**30))
        t = time.time()
        mem0 = gpu_memory()
        pipe = None
        try:
            pipe = builder(path, cache)
            build_s = round(time.time() - t, 1)
            print(f"[bench] {path}: engine built in {build_s} s; GPU {gpu_memory()}", flush=True)
            if path == args.paths.split(",")[0] and not args.no_micro:
                results["micro"] = micro(pipe, (w, h))
                print(f"[bench] micro: {json.dumps(results['micro'])}", flush=True)
            res = bench.engine(pipe, path)
            res.update(build_s=build_s, gpu_before_build=mem0, seconds=round(time.time() - t, 1))
            if cache is not None:
                s = cache.stats()
                res["featcache"] = s.get("lmdeploy", {})
                res["tiers"] = {k: s[k] for k in ("device", "disk") if k in s}
            results["engines"][path] = res
        except BaseException as e:  # noqa: BLE001 - a failed engine is reported, the rest still run
            results["engines"][path] = dict(path=path, failed=f"{type(e).__name__}: {e}",
                                            traceback=traceback.format_exc()[-3000:])
            print(f"[bench] {path} FAILED: {type(e).__name__}: {e}", flush=True)
            if isinstance(e, KeyboardInterrupt):
                raise
        finally:
            if pipe is not None:
                try:
                    pipe.close()
                except Exception as e:  # noqa: BLE001
                    print(f"[bench] {path}: close failed: {e}", flush=True)
            if cache is not None:
                cache.close()
            shutil.rmtree(store, ignore_errors=True)
            del pipe
            free_gpu()
        compare(results)
        save()
        print(f"[bench] {path}: done in {time.time() - t:.0f} s; GPU after free {gpu_memory()}", flush=True)
    compare(results)
    save()
    report(results)
    return results
