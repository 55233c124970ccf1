"""dry-run: bench and breakdown over the stand-in pipeline (bench/e2e/standin.py), on the CPU,
and the checks of what each must produce."""

from __future__ import annotations

import argparse
import json
import tempfile

from bench.e2e.breakdown import breakdown
from bench.e2e.probes import D2HCounter, install_stage_timers
from bench.e2e.speed import SERIES, bench, merge, ratios
from bench.e2e.standin import standin
from bench.lib.timing import spread


def dry_run(args: argparse.Namespace) -> int:
    """bench and breakdown over the stand-in, on the CPU; checks what each must produce."""
    build, timers, on_device = standin()
    base = args.json or tempfile.mktemp(prefix="e2e-dry-")
    args.cache_device = "cpu"
    args.json = base + "-bench.json"
    args.text_twins = True
    b = bench(args, build)
    for e in ("plain", "featcache"):
        r = b[e]
        assert r["reps"] == args.reps, (e, r["reps"])
        assert r["a_same_image_fresh_context"]["n"] == args.reps * args.n
        assert r["c_distinct_images"]["n"] == args.reps * args.n
        assert all(r["b_multi_turn"][f"turn_{t}"]["n"] == args.reps * args.chats for t in range(1, 5))
        twins = r["b_text_twin"]
        assert all(twins[f"turn_{t}"]["n"] == args.reps * args.chats for t in range(1, 5)), twins
        assert set(r["b_turn_over_text_twin"]) == {f"turn_{t}" for t in range(1, 5)}
        first = r["b_input_tokens_by_turn"][0]  # a twin's first turn is its chat's length or under
        assert all(0 < x <= y for x, y in zip(twins["turn_1"]["input_tokens"], first, strict=True))
        d = r["d_concurrent_32_clients_pool_8"]
        assert d["requests"] == args.reps * args.d_requests and len(d["requests_per_s_by_rep"]) == args.reps
        for s in ("a_same_image_fresh_context", "c_distinct_images"):
            x = r[s]
            assert x["p10_ms"] <= x["median_ms"] <= x["p90_ms"] and len(x["per_rep_median_ms"]) == args.reps
    st = b["featcache"]["stats"]["lmdeploy"]
    assert st.get("vision_skipped", 0) > 0 and st.get("hits", 0) > 0, st
    rat = b["ratios"]
    assert set(rat) >= {"a_same_image_speedup", "b_turn_4_speedup", "c_distinct_slowdown",
                        "d_requests_per_s_gain", "flagged"}, rat
    assert all(rat[k] is not None or k in rat["flagged"] for k, _, _ in SERIES), rat
    # a noisy series makes no ratio: plain (a) as seen once on the GPU (median 353, p90 614 -> fine;
    # a p90 above 2x median -> flagged)
    noisy = dict(b["plain"], a_same_image_fresh_context=dict(spread([60.0] * 7 + [400.0] * 3), n=10))
    flagged = ratios(noisy, b["featcache"], args.spread_limit)
    assert flagged["a_same_image_speedup"] is None and "a_same_image_speedup" in flagged["flagged"], flagged
    m = merge([args.json, args.json], base + "-merged.json", args.spread_limit)
    assert m["ratios"]["a_same_image_speedup"] == rat["a_same_image_speedup"]

    args.json = base + "-breakdown.json"
    D2HCounter.LARGE = 1024  # the stand-in's features are 2 KiB
    r = breakdown(args, build, on_device, timers)
    pm, pr = r["plain"]["medians"]["miss"], r["plain"]["medians"]["repeat"]
    fm, fh = r["featcache"]["medians"]["miss"], r["featcache"]["medians"]["repeat"]
    for row in (pm, pr, fm):
        assert row["vision_calls"] == 1 and row["vision"] >= 3 and row["image_preprocess"] >= 2, row
    assert fh["vision_calls"] == 0 and fh["vision"] == 0 and fh["image_preprocess"] == 0, fh
    assert fh["fc_frontend_own"] > 0 and fh["fc_serve_own"] > 0 and fm["fc_serve_own"] > 0, fh
    assert pm["fc_frontend_own"] == 0 and pm["fc_serve_own"] == 0, pm
    for row in (pm, fm, fh):
        assert row["prefill"] >= 4 and row["engine_overhead"] > 0 and row["forward_calls"] == 1, row
    for row in [x for e in ("plain", "featcache") for s in ("miss", "repeat") for x in r[e][s]]:
        assert abs(row["wall"] - row["request_preprocess"] - row["vision"] - row["fc_serve_own"]
                   - row["prefill"] - row["decode"] - row["engine_overhead"]) < 0.01, row
    assert r["plain"]["d2h"]["miss"]["large_calls"] == 1, r["plain"]["d2h"]
    fd = r["featcache"]["d2h"]["repeat"]
    assert fd["large_calls"] == 0 and fd["calls"] >= 1, fd
    assert r["answer"]["featcache_hit_vision_calls"] == 0
    for e in ("plain", "featcache"):
        cm = r[e]["chat"]["medians"]
        assert all(len(r[e]["chat"]["rows"][k][t]) == args.chats for k in ("chat", "twin") for t in range(4))
        assert cm["chat"][0]["vision_calls"] == 1 and all(t["vision_calls"] == 0 for t in cm["twin"]), cm
        assert all(t["input_tokens"] > 0 and t["wall"] > 0 for k in cm for t in cm[k]), cm
    # the real targets resolve (lmdeploy imports here; nothing of them runs)
    real = install_stage_timers(None)
    assert "InternVLChatModel.extract_feature" in real and "InternVLChatModel.forward" in real, real
    print(f"DRY-RUN OK: bench {args.reps} reps x 2 engines ({args.json.replace('-breakdown', '-bench')}), "
          f"breakdown ({args.json}); ratios {json.dumps(rat)}")
    return 0

