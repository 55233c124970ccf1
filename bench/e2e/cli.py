"""bench/e2e_lmdeploy.py's command line: one parser for every mode, the defaults a dry run
shrinks, each mode's results file (with the run's metadata under "meta")."""

from __future__ import annotations

import argparse
from typing import Any

from bench.e2e import __doc__ as USAGE
from bench.e2e.breakdown import breakdown
from bench.e2e.check import CHECK_CONFIGS, check, verdict_ok
from bench.e2e.dryrun import dry_run
from bench.e2e.floor import floor, profile
from bench.e2e.runner import ENGINES, bench_meta, real_builder
from bench.e2e.speed import bench, merge
from bench.lib.results import write_report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="e2e_lmdeploy.py", description=USAGE,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["check", "bench", "breakdown", "merge", "profile", "floor",
                                         "dry-run"])
    parser.add_argument("inputs", nargs="*", help="merge: the bench JSONs of one model")
    parser.add_argument("--model")
    parser.add_argument("--json")
    parser.add_argument("--label", help="the model's name in tables and charts (default: the dir name)")
    parser.add_argument("--n", type=int, default=None,
                        help="requests per series and rep (default 10; dry-run 3)")
    parser.add_argument("--reps", type=int, default=None,
                        help="bench: repetitions of each series, interleaved (default 3; dry-run 2)")
    parser.add_argument("--chats", type=int, default=None,
                        help="bench: 4-turn chats per rep in (b) (default 3)")
    parser.add_argument("--clients", type=int, default=None,
                        help="bench: concurrent clients in (d) (default 32)")
    parser.add_argument("--d-requests", type=int, default=None,
                        help="bench: requests per rep in (d) (default 64)")
    parser.add_argument("--engines", default="plain,featcache",
                        help="bench/breakdown: engines in order, of " + ",".join(ENGINES)
                        + " (one per call for the 26B, then merge)")
    parser.add_argument("--spread-limit", type=float, default=2.0,
                        help="a series whose p90 exceeds this x its median makes no ratio")
    parser.add_argument("--kv-fraction", type=float, default=0.05,
                        help="cache_max_entry_count (0.05; ~0.3 for the 26B's 32 clients)")
    parser.add_argument("--session-len", type=int, default=8192)
    parser.add_argument("--tp", type=int, default=1,
                        help="tensor parallel, every engine (on CUDA set LMDEPLOY_EXECUTOR_BACKEND=mp: "
                        "lmdeploy's default executor for tp > 1 is ray)")
    parser.add_argument("--mp-engine", action="store_true",
                        help="lmdeploy's engine in a second process (enable_mp_engine), every engine")
    parser.add_argument("--eager", action="store_true", help="bench/breakdown: no CUDA graphs")
    parser.add_argument("--budget", type=float, default=540,
                        help="bench: s for the run; reps that would not fit are skipped, and named")
    parser.add_argument("--rep-reserve-s", type=float, default=60, help="bench: s a further rep needs")
    parser.add_argument("--size", default=None,
                        help="image size, WxH (default 1344x1008: 12 tiles + thumbnail)")
    parser.add_argument("--configs", default=",".join(CHECK_CONFIGS),
                        help="check: the configurations to run (plain, plain_prefix and "
                             "featcache_prefix always run)")
    parser.add_argument("--tier-bytes", type=int, default=12 << 10,
                        help="check: device and host tier bytes, about one image's features")
    parser.add_argument("--text-twins", action="store_true",
                        help="bench (b): after each chat, its text-only twin (same cached and new "
                             "tokens per turn, no image) through the same engine")
    parser.add_argument("--video-seconds", type=float, default=0,
                        help="bench (b): each chat is about a clip of this many seconds (an MP4 of --size "
                             "at 4 frames a second) instead of an image")
    parser.add_argument("--answer-tokens", type=int, default=1,
                        help="tokens per chat answer in (b) (bench; >1: first token streamed)")
    args = parser.parse_args(argv)
    dry = args.mode == "dry-run"
    for k, v in dict(size="112x84" if dry else "1344x1008", n=3 if dry else 10, reps=2 if dry else 3,
                     chats=1 if dry else 3, clients=4 if dry else 32, d_requests=12 if dry else 64).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.cache_device = "cuda"
    if dry:
        args.model = args.model or "<stand-in>"
        return dry_run(args)
    if args.mode == "merge":
        merge(args.inputs, args.json, args.spread_limit)
        return 0
    if not args.model:
        parser.error(f"{args.mode} needs --model")
    if args.mode in ("bench", "breakdown"):
        run = bench if args.mode == "bench" else breakdown
        run(args, real_builder(args))  # writes --json itself, after each engine
        return 0
    meta = bench_meta(args, args.mode)  # when the run began
    results: dict[str, Any]
    ok = True
    if args.mode == "check":
        results = check(args.model, args.tier_bytes, tuple(args.configs.split(",")))
        ok = verdict_ok(results["verdict"])
        unrepeatable = results["verdict"]["plain_repeatable"]["differ"]
        if unrepeatable:  # (the verdict stands, but says nothing of featcache)
            print(f"[e2e] NOT JUDGED: plain lmdeploy answered a request sent again otherwise "
                  f"({', '.join(unrepeatable)}): no comparison with it holds on this checkpoint")
    else:
        w, h = (int(x) for x in args.size.split("x"))
        run_mode = floor if args.mode == "floor" else profile
        results = run_mode(args.model, (w, h), args.n)
    if args.json:
        write_report(args.json, {"meta": meta, **results})
    return 0 if ok else 1
