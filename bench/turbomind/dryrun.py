"""dry-run: the whole run over the stand-in pipelines (bench/turbomind/standin.py) on the CPU,
and the checks of what each path must show: every step seen where it runs and only there, no
pixels hashed by featcache's paths, hits that skip preprocessing, combined's routes."""

from __future__ import annotations

import argparse
import json
import time

from bench.lib.standin import turbomind_binding
from bench.turbomind.probes import install_global_probes
from bench.turbomind.runner import PATHS, run_all
from bench.turbomind.series import TURNS
from bench.turbomind.standin import standin_builder


def dry_run(args: argparse.Namespace) -> int:
    """The run over the stand-in pipelines, on the CPU; checks what each path must show."""
    args.model = "<stand-in>"
    with turbomind_binding():
        install_global_probes()
        res = run_all(args, standin_builder(), args.out, time.time())
    eng = res["engines"]
    assert all(p in eng and "failed" not in eng[p] for p in PATHS), \
        {p: eng.get(p, {}).get("failed") for p in PATHS}
    reqs_per_rep = 1 + 2 * args.n + args.chats * TURNS
    for p, e in eng.items():
        assert e["reps"] == args.reps and e["request_errors"] == 0, \
            (p, e["reps"], e.get("request_error_samples"))
        d = e["d_concurrent"]
        assert d["requests"] == args.reps * args.d_requests and not d["errors"], d
        assert len(e["b_chat"]) == TURNS
        assert sum(len(rep["rows"]) + 1 for rep in e["raw"]["a"]) + sum(
            len(x) for x in e["raw"]["c"]) + sum(len(ch) for rep in e["raw"]["b"] for ch in rep) \
            == args.reps * reqs_per_rep
    plain_c, native_c, feat_c, _ = (eng[p]["c_distinct"]["parts"] for p in PATHS)
    # every step was seen where it should run, and only there
    assert plain_c["image_preprocess"] > 0 and plain_c["tm_fingerprint"] > 0 and "hook" not in plain_c
    for k in ("hook", "fc_key", "fc_acquire", "fc_tag", "fc_serve", "fc_put", "fc_fingerprint", "tm_convert"):
        assert native_c.get(k, 0) > 0, (k, native_c)
    for k in ("hook", "fc_forward", "fc_vision", "fc_put"):
        assert feat_c.get(k, 0) > 0, (k, feat_c)
    calls = {p: [r["parts"].get("calls", {}) for rep in eng[p]["raw"]["c"] for r in rep] for p in PATHS}
    assert all(c.get("sha256_computed") == 1 for c in calls["plain"]), calls["plain"][:2]
    assert not any(c.get("sha256_computed") for c in calls["native"]), "featcache misses hashed pixels"
    assert all(c.get("fc_vision") == 1 for c in calls["features"])
    a_native = [r["parts"].get("calls", {}) for rep in eng["native"]["raw"]["a"] for r in rep["rows"]]
    assert not any(c.get("image_preprocess") or c.get("fc_put") for c in a_native), "hits preprocessed"
    assert eng["native"]["featcache"]["hits"] > 0 and eng["features"]["featcache"]["tm_features_served"] > 0
    assert set(res["ratios"]) == set(PATHS[1:]) and "c_minus_plain" in res["miss_cost"]["native"]
    routes = eng["combined"]["featcache"]  # (a) features after its priming miss; (b) turns 2-4 native
    assert routes["tm_route_repeat"] >= args.reps * args.n and routes["tm_route_continued"] >= args.reps * 3
    assert all(c.get("fc_vision") is None for rep in eng["combined"]["raw"]["c"] for c in
               (r["parts"].get("calls", {}) for r in rep)), "combined ran the tower on a miss"
    assert res["micro"]["pixels"]["shape"] == [2, 3, 28, 28], res["micro"]["pixels"]
    print(f"DRY-RUN OK: {len(PATHS)} engines x {args.reps} reps; featcache native "
          f"{json.dumps(eng['native']['featcache'])}")
    return 0
