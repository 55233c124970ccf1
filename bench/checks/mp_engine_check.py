"""featcache's multi-process mode on a GPU: lmdeploy's mp engine (tp=1) or tp=2, against plain
lmdeploy with the same process model (docs/multi-gpu.md, docs/benchmarks.md).

    python3 bench/checks/mp_engine_check.py --model /tmp/models/internvl_hf_tiny --json $OUT/mp1.json
    LMDEPLOY_EXECUTOR_BACKEND=mp python3 bench/checks/mp_engine_check.py --model ... --tp 2 --json ...

(tp=2: lmdeploy's default executor on CUDA is ray, which the GPU machine does not have; the mp
executor is asked for by that variable.) Three pipelines in turn, each with the same engine config
(``enable_mp_engine`` as ``--mp-engine``, ``tp``, eager, prefix caching asked for):

- ``plain``: ``lmdeploy.pipeline`` (0.18 switches prefix caching off for these models);
- ``plain_prefix``: lmdeploy alone with its prefix caching kept on (its own pixel hashes);
- ``featcache``: ``featcache.lmdeploy.pipeline`` (a ``FeatcacheEngineConfig``; every model
  process has its own cache over one disk directory).

Each runs ``bench.e2e.check.check_requests()`` (greedy, 12 tokens), then ``featcache`` runs
``--again`` fresh prompts over the same five images (new text: no KV reuse), which its model
processes must serve from their caches. The verdict: greedy tokens per request identical to
``plain_prefix`` (same prefix caching) and to ``plain``; each rank's ``vision_images`` equal to
the five distinct images (vision once per distinct image, every rank the same calls) and
``vision_skipped`` covering the fresh prompts; cached tokens per request beside plain_prefix's.
Exit code 0 when the verdict holds, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))  # the checkout

from bench.e2e.check import check_requests  # noqa: E402
from bench.lib.engines import ask, build, close_pipeline, exit_after_close  # noqa: E402
from bench.lib.images import image  # noqa: E402
from bench.lib.results import write_report  # noqa: E402

DISTINCT = 5  # images a..e of check_requests()


def pipeline(kind: str, args: argparse.Namespace, store: str) -> Any:
    """Eager, prefix caching asked for; featcache's model processes get their cache settings
    through the engine config (``cache=None`` would size them from the machine)."""
    settings = {"feature_cache": {"device_bytes": args.tier_bytes, "host_bytes": args.tier_bytes,
                                  "disk_path": store, "disk_bytes": 1 << 30}}
    return build("fc" if kind == "featcache" else kind, args.model, True, eager=True,
                 kv_fraction=args.kv_fraction, tp=args.tp, mp_engine=args.mp_engine,
                 cache_settings=settings if kind == "featcache" else None)


def run(pipe: Any, requests: list[tuple[str, Any]]) -> list[dict[str, Any]]:
    from lmdeploy import GenerationConfig

    gen = GenerationConfig(max_new_tokens=12, do_sample=False, ignore_eos=True)
    rows = []
    for label, prompt in requests:
        outs = ask(pipe, prompt, gen)
        rows.append(dict(label=label, token_ids=[list(o.token_ids) for o in outs],
                         cached_tokens=[o.cached_tokens for o in outs]))
    return rows


def fresh_requests(n: int) -> list[tuple[str, Any]]:
    images = [image(s, size) for s, size in
              [(1, (120, 90)), (2, (64, 64)), (3, (200, 60)), (4, (90, 130)), (5, (56, 56))]]
    return [(f"fresh {i} image {j}", (f"pass {i}: what is in picture {j}?", im))
            for i in range(n) for j, im in enumerate(images)]


def vision_verdict(stats: list[dict[str, Any]], fresh: int) -> dict[str, Any]:
    per_rank = [dict(rank=s["rank"], pid=s["pid"], **{k: s["stats"].get("lmdeploy", {}).get(k, 0)
                for k in ("vision_calls", "vision_images", "vision_skipped", "agreed_misses",
                          "partial_images")}) for s in stats]
    images = {r["vision_images"] for r in per_rank}
    return dict(per_rank=per_rank,
                once_per_distinct_image=images == {DISTINCT},
                same_calls_on_every_rank=len({(r["vision_calls"], r["vision_images"])
                                              for r in per_rank}) == 1,
                fresh_served_from_cache=all(r["vision_skipped"] >= fresh for r in per_rank))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--mp-engine", type=int, default=1, help="1: enable_mp_engine (default)")
    p.add_argument("--kv-fraction", type=float, default=0.05)
    p.add_argument("--tier-bytes", type=int, default=64 << 20)
    p.add_argument("--again", type=int, default=2, help="passes of fresh prompts (featcache)")
    p.add_argument("--engines", default="plain,plain_prefix,featcache")
    p.add_argument("--json")
    args = p.parse_args(argv)
    args.mp_engine = bool(args.mp_engine)
    if args.tp > 1 and os.environ.get("LMDEPLOY_EXECUTOR_BACKEND") != "mp":
        print("note: tp > 1 without LMDEPLOY_EXECUTOR_BACKEND=mp uses lmdeploy's default (ray)")
    from featcache.lmdeploy import model_stats

    results: dict[str, Any] = dict(model=args.model, tp=args.tp, mp_engine=args.mp_engine,
                                   executor=os.environ.get("LMDEPLOY_EXECUTOR_BACKEND"))
    with tempfile.TemporaryDirectory() as store:
        for kind in args.engines.split(","):
            t = time.perf_counter()
            pipe = pipeline(kind, args, store)
            built = time.perf_counter() - t
            try:
                rows = run(pipe, check_requests())
                entry: dict[str, Any] = dict(build_s=round(built, 1), rows=rows)
                if kind == "featcache":
                    entry["fresh_rows"] = run(pipe, fresh_requests(args.again))
                    entry["frontend"] = pipe.featcache.stats().get("lmdeploy", {})
                    entry["model_stats"] = model_stats(pipe)
            finally:
                close_pipeline(pipe)
            entry["run_s"] = round(time.perf_counter() - t - built, 1)
            results[kind] = entry
            print(f"{kind}: built in {built:.0f} s, ran in {entry['run_s']} s", flush=True)
    verdict: dict[str, Any] = {}
    if "featcache" in results:
        fc = {r["label"]: r for r in results["featcache"]["rows"]}
        for ref in ("plain_prefix", "plain"):
            if ref in results:
                differ = [r["label"] for r in results[ref]["rows"]
                          if r["token_ids"] != fc[r["label"]]["token_ids"]]
                verdict[f"tokens_vs_{ref}"] = dict(identical=len(fc) - len(differ), differ=differ)
        if "plain_prefix" in results:
            verdict["cached_tokens"] = {r["label"]: dict(featcache=fc[r["label"]]["cached_tokens"],
                                                         plain_prefix=r["cached_tokens"])
                                        for r in results["plain_prefix"]["rows"]
                                        if r["cached_tokens"] != fc[r["label"]]["cached_tokens"]}
        verdict["vision"] = vision_verdict(results["featcache"]["model_stats"],
                                           DISTINCT * args.again)
    results["verdict"] = verdict
    print(json.dumps(verdict, indent=1))
    if args.json:
        write_report(args.json, results)
    v = verdict.get("vision", {})
    ok = (not verdict.get("tokens_vs_plain_prefix", {}).get("differ")
          and v.get("once_per_distinct_image") and v.get("same_calls_on_every_rank")
          and v.get("fresh_served_from_cache"))
    print("VERDICT:", "ok" if ok else "NOT ok")
    return 0 if ok else 1


if __name__ == "__main__":
    exit_after_close(main())
