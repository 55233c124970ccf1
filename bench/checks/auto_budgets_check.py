"""``budgets="auto"`` on a GPU: the budgets featcache chose, beside what
``torch.cuda.mem_get_info`` says once lmdeploy's engine has loaded, and whether the device tier
then fits beside lmdeploy's own memory when it fills.

    python3 bench/checks/auto_budgets_check.py --model /tmp/models/internvl3_2b_shape --json $OUT/auto.json
    python3 bench/checks/auto_budgets_check.py --model DIR --dry-run  # CPU: the plan, this machine's rules

The run (tp=1, the engine in this process, as ``featcache serve --engine-process in``):

1. ``featcache.lmdeploy.pipeline(MODEL, budgets="auto", backend_config=PytorchEngineConfig(
   cache_max_entry_count=KV, ...))``: the cache is built once the engine reserved its KV cache;
   ``mem_get_info`` is read right after, beside ``chosen_budgets(pipe.featcache)`` (each tier's
   budget and reason) and the engine's KV blocks;
2. distinct generated images (``--size``, so many tiles each) are sent in batches of one-image
   requests (8 new tokens each) until the device tier has taken its budget (an eviction) or
   ``--max-images`` or ``--budget-s`` run out; ``mem_get_info``, torch's peak allocated and
   reserved bytes, the device tier's bytes and evictions are read after; a CUDA out-of-memory
   error (raised, or a request answered with an error) is reported;
3. the verdict: the device budget is the rule's (25% of what was free after the engine, less
   1 GiB), no out-of-memory error, the device tier filled (evictions > 0, or every image held),
   and the GPU still had the margin free at the end.

Exit code 0 when the verdict holds, 1 otherwise (2: bad arguments). ``--dry-run`` builds no engine:
it prints the plan and what ``budgets="auto"`` decides on this machine without one (on a CPU the
device tier is RAM), as JSON, and exits 0.
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

from bench.lib.images import image  # noqa: E402
from bench.lib.results import write_report  # noqa: E402


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="auto_budgets_check.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a model directory lmdeploy's PyTorch engine runs")
    p.add_argument("--kv", type=float, default=0.8, help="cache_max_entry_count (default 0.8)")
    p.add_argument("--size", default="1344x1008", help="generated images' WxH (default 1344x1008)")
    p.add_argument("--batch", type=int, default=16, help="requests per pipeline call (default 16)")
    p.add_argument("--max-images", type=int, default=2000, help="at most this many images")
    p.add_argument("--budget-s", type=float, default=400.0, help="stop filling after this long")
    p.add_argument("--cache-dir", help="the store (default: a temporary directory)")
    p.add_argument("--json", metavar="FILE", help="write the report there too")
    p.add_argument("--dry-run", action="store_true", help="no engine: the plan and the rules here")
    args = p.parse_args(argv)
    try:
        width, height = (int(v) for v in args.size.lower().split("x"))
    except ValueError:
        p.error(f"--size is WxH, e.g. 1344x1008, not {args.size!r}")
    args.wh = (width, height)
    return args


def gpu() -> dict[str, int]:
    import torch

    free, total = torch.cuda.mem_get_info()
    return {"free": int(free), "total": int(total),
            "allocated": int(torch.cuda.memory_allocated()),
            "reserved": int(torch.cuda.memory_reserved()),
            "max_allocated": int(torch.cuda.max_memory_allocated()),
            "max_reserved": int(torch.cuda.max_memory_reserved())}


def kv_blocks(pipe: Any) -> dict[str, Any]:
    """The engine's KV cache as lmdeploy sized it (its cache config), where it can be read."""
    engine = getattr(pipe.async_engine, "engine", None)
    config = getattr(getattr(engine, "executor", None), "cache_config", None)
    if config is None:
        config = getattr(engine, "cache_config", None)
    return {k: getattr(config, k, None) for k in ("num_gpu_blocks", "block_size",
                                                  "cache_max_entry_count", "max_prefill_token_num")}


def dry_run(args: argparse.Namespace) -> dict[str, Any]:
    from featcache import autosize
    from featcache.config import AUTO_BUDGETS, default_store_dir

    on_gpu = autosize.cuda_available()
    device = autosize.current_gpu() if on_gpu else "cpu"
    here = autosize.decide(device=device, disk_path=args.cache_dir or default_store_dir(),
                           given={"device_bytes": 0} if on_gpu else None)
    if on_gpu:  # no engine yet: the most its device tier can be (as featcache doctor says)
        most = autosize.before_engine(device, autosize.EngineMemory(args.kv))
        here = autosize.Budgets(here.mode, device, (most, *here.choices[1:]))
    return {"dry_run": True, "model": args.model,
            "plan": [f"featcache.lmdeploy.pipeline({args.model!r}, budgets='auto', "
                     f"backend_config=PytorchEngineConfig(cache_max_entry_count={args.kv}, "
                     "enable_prefix_caching=True))",
                     "mem_get_info after the engine, beside chosen_budgets(pipe.featcache)",
                     f"{args.size} noise images, {args.batch} one-image requests per call, until "
                     f"the device tier evicts (at most {args.max_images}, {args.budget_s:g} s)",
                     "mem_get_info, peak memory, device tier bytes and evictions after; OOM caught"],
            "rules": {tier: str(rule) for tier, rule in AUTO_BUDGETS.items()},
            "budgets_here_now": here.as_dict()}


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from lmdeploy import GenerationConfig, PytorchEngineConfig

    from featcache.config import AUTO_BUDGETS
    from featcache.lmdeploy import chosen_budgets, pipeline

    store = args.cache_dir or tempfile.mkdtemp(prefix="featcache-auto-")
    os.environ["FEATCACHE_DIR"] = store
    config = PytorchEngineConfig(session_len=16384, cache_max_entry_count=args.kv,
                                 enable_prefix_caching=True)
    before = gpu()
    start = time.perf_counter()
    pipe = pipeline(args.model, budgets="auto", backend_config=config, log_level="ERROR")
    after_engine = gpu()
    chosen = chosen_budgets(pipe.featcache)
    report: dict[str, Any] = {
        "model": args.model, "cache_max_entry_count": args.kv, "size": args.size,
        "gpu_before_engine": before, "gpu_after_engine": after_engine,
        "engine_s": round(time.perf_counter() - start, 1), "kv": kv_blocks(pipe),
        "budgets": chosen.as_dict() if chosen is not None else None,
        "device_bytes": pipe.featcache.config.device_bytes}
    gen = GenerationConfig(max_new_tokens=8, do_sample=False)
    sent, failed, oom, fill_start = 0, 0, None, time.perf_counter()
    try:
        while sent < args.max_images and time.perf_counter() - fill_start < args.budget_s:
            batch = [("describe the image", image(sent + i, args.wh))
                     for i in range(min(args.batch, args.max_images - sent))]
            answers = pipe(batch, gen_config=gen)
            sent += len(batch)
            # an engine that ran out of memory answers with an error, it does not raise here
            failed += sum(getattr(a, "finish_reason", None) not in ("stop", "length")
                          for a in answers)
            if failed or pipe.featcache.stats()["device"].get("evictions", 0) > 0:
                break
    except Exception as e:  # noqa: BLE001 (torch.OutOfMemoryError, or the engine gone)
        oom = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    torch.cuda.synchronize()
    stats = pipe.featcache.stats()
    report.update(images=sent, failed_requests=failed,
                  fill_s=round(time.perf_counter() - fill_start, 1), oom=oom,
                  gpu_after_fill=gpu(), device_tier=stats["device"],
                  lmdeploy=stats.get("lmdeploy", {}))
    rule = AUTO_BUDGETS["device_bytes"]
    expected = rule.bytes_from(after_engine["free"], after_engine["total"])
    device = stats["device"]
    report["verdict"] = {
        # the cache read mem_get_info a moment after this script did: within 64 MiB
        "budget_is_the_rule": abs(report["device_bytes"] - expected) <= 64 << 20,
        "no_oom": oom is None and failed == 0,
        "tier_filled": device.get("evictions", 0) > 0 or device.get("entries", 0) == sent,
        "margin_left": report["gpu_after_fill"]["free"] >= rule.margin(after_engine["total"]),
    }
    report["ok"] = all(report["verdict"].values())
    pipe.close()
    return report


def main(argv: list[str]) -> int:
    args = parse(argv)
    report = dry_run(args) if args.dry_run else run(args)
    if args.json:
        write_report(args.json, report)
    print(json.dumps(report, indent=1))
    return 0 if args.dry_run or report.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
