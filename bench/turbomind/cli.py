"""bench/turbomind_bench.py's command line: ``run`` on the GPU machine, ``dry-run`` on the CPU,
the defaults a dry run shrinks."""

from __future__ import annotations

import argparse
import time

from bench.turbomind import __doc__ as USAGE
from bench.turbomind.dryrun import dry_run
from bench.turbomind.probes import install_global_probes
from bench.turbomind.runner import PATHS, real_builder, run_all


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="turbomind_bench.py", description=USAGE,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["run", "dry-run"])
    ap.add_argument("--model", help="checkpoint dir (run): bench/device/make_real_shape.py builds it")
    ap.add_argument("--out", help="JSON results (rewritten after each engine)")
    ap.add_argument("--paths", default=",".join(PATHS), help="engines, in order (default: all four)")
    ap.add_argument("--size", default=None, help="image WxH (default 1344x1008: 12 tiles + thumbnail)")
    ap.add_argument("--n", type=int, default=None, help="requests per rep in (a) and (c) (default 10)")
    ap.add_argument("--reps", type=int, default=None, help="repetitions of each series (default 3)")
    ap.add_argument("--chats", type=int, default=None, help="4-turn chats per rep in (b) (default 2)")
    ap.add_argument("--clients", type=int, default=None, help="concurrent clients in (d) (default 32)")
    ap.add_argument("--d-requests", type=int, default=None, help="requests per rep in (d) (default 128)")
    ap.add_argument("--duration", type=float, default=None, help="(d) for this many s per rep instead")
    ap.add_argument("--budget", type=float, default=420, help="s for the whole run (default 420): "
                    "engines and reps that would not fit are skipped, and named")
    ap.add_argument("--engine-reserve-s", type=float, default=75, help="s an engine needs to start")
    ap.add_argument("--rep-reserve-s", type=float, default=25, help="s a further rep needs to start")
    ap.add_argument("--session-len", type=int, default=8192)
    ap.add_argument("--kv-fraction", type=float, default=0.2, help="TurboMind cache_max_entry_count")
    ap.add_argument("--cache-gib", type=float, default=4, help="featcache's host (device='cpu') tier")
    ap.add_argument("--disk-gib", type=float, default=8, help="featcache's disk tier (0: none)")
    ap.add_argument("--no-micro", action="store_true")
    args = ap.parse_args(argv)
    dry = args.mode == "dry-run"
    defaults = dict(size="112x84" if dry else "1344x1008", n=3 if dry else 10, reps=2 if dry else 3,
                    chats=1 if dry else 2, clients=4 if dry else 32, d_requests=12 if dry else 128)
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if dry:
        args.duration = None  # the checks count requests
        return dry_run(args)
    if not args.model:
        ap.error("run needs --model")
    t0 = time.time()
    install_global_probes()
    res = run_all(args, real_builder(args), args.out, t0)
    failed = [p for p, e in res["engines"].items() if "failed" in e]
    print(f"[bench] done in {time.time() - t0:.0f} s; failed: {failed or 'none'}", flush=True)
    return 1 if failed or not res["engines"] else 0
