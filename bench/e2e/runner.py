"""One engine at a time: each of ``--engines`` built in turn (GPU memory freed between), a mode's
work run on it, the results file rewritten after each engine and rep (a run cut short keeps what
it measured), the run's metadata recorded when it began."""

from __future__ import annotations

import argparse
import tempfile
import time
from typing import Any

from bench.lib import models
from bench.lib.engines import bench_cache, build, close_pipeline, free_gpu
from bench.lib.results import run_meta, write_report

ENGINES = {"plain": ("plain", True), "featcache": ("fc", True), "featcache_noprefix": ("fc", False)}


def real_builder(args: argparse.Namespace) -> Any:
    """``build(engine, cache) -> pipeline``; CUDA graphs unless ``--eager`` (as deployed)."""
    def b(engine: str, cache: Any) -> Any:
        kind, prefix = ENGINES[engine]
        return build(kind, args.model, prefix, cache, eager=args.eager, kv_fraction=args.kv_fraction,
                     session_len=args.session_len, tp=args.tp, mp_engine=args.mp_engine)
    return b


def bench_meta(args: argparse.Namespace, mode: str) -> dict[str, Any]:
    """The run's metadata (``run_meta``): the mode, the model and its label, the arguments."""
    return run_meta(mode=mode, model=args.model, label=args.label or models.label(args.model),
                    args={k: v for k, v in vars(args).items() if k != "builder"})


def run_engines(args: argparse.Namespace, builder: Any, mode: str,
                per_engine: Any) -> dict[str, Any]:
    """Build each engine of ``--engines`` in turn (one at a time, GPU memory freed between), run
    ``per_engine(pipe, engine, cache, save)`` on it; the JSON is rewritten after each engine and
    rep, so a run cut short still leaves what it measured."""
    results: dict[str, Any] = {"meta": bench_meta(args, mode), "model": args.model, "engines": []}
    deadline = time.time() + args.budget

    def save() -> None:
        if args.json:
            write_report(args.json, results)  # its run metadata: "meta"

    for engine in args.engines.split(","):
        if engine not in ENGINES:
            raise SystemExit(f"unknown engine {engine!r}: one of {sorted(ENGINES)}")
        with tempfile.TemporaryDirectory() as tmp:
            cache = bench_cache(args.cache_device, tmp) if ENGINES[engine][0] == "fc" else None
            t = time.time()
            pipe = builder(engine, cache)
            build_s = round(time.time() - t, 1)
            print(f"[e2e] {engine}: built in {build_s} s", flush=True)
            try:
                res = per_engine(pipe, engine, cache, deadline, save)
                res["build_s"] = build_s
                if cache is not None:
                    res["stats"] = cache.stats()
                if cache is not None and (args.tp > 1 or args.mp_engine):
                    from featcache.lmdeploy import model_stats

                    res["model_stats"] = model_stats(pipe)  # each model process's cache
                results[engine] = res
                results["engines"].append(engine)
            finally:
                close_pipeline(pipe)
                if cache is not None:
                    cache.close()
        del pipe
        free_gpu()
        save()
    return results
