"""What a run's paths come to against plain TurboMind measured in the same run: ratios of the
medians (and p90s), the miss-cost breakdown per step, the issues' targets (``compare``); and the
log's readable summary of it all (``report``)."""

from __future__ import annotations

import json
from typing import Any

from bench.turbomind.series import TURNS

MISS_PARTS = ("wall", "python_total", "request_preprocess", "image_preprocess", "hook", "featcache_own",
              "fc_key", "fc_acquire", "fc_tag", "fc_serve", "fc_put", "fc_fingerprint", "serve_copy",
              "fc_forward", "fc_vision", "tm_convert", "tm_fingerprint", "engine_rest")


def compare(results: dict[str, Any]) -> None:
    """Ratios against plain (same run), the miss-cost breakdown, the issue's targets."""
    eng = {p: r for p, r in results["engines"].items() if "failed" not in r and r.get("reps")}
    plain = eng.get("plain")
    if plain is None:
        return
    ratios: dict[str, Any] = {}
    miss: dict[str, Any] = {}

    def r(x: float | None, y: float | None) -> float | None:
        return round(x / y, 3) if x and y else None

    for path, e in eng.items():
        if path == "plain":
            continue
        a, pa = e["a_same_image_fresh_context"], plain["a_same_image_fresh_context"]
        c, pc = e["c_distinct"], plain["c_distinct"]
        v: dict[str, Any] = dict(
            a_speedup_median=r(pa["median_ms"], a["median_ms"]), a_speedup_p90=r(pa["p90_ms"], a["p90_ms"]),
            c_slowdown_median=r(c["median_ms"], pc["median_ms"]), c_slowdown_p90=r(c["p90_ms"], pc["p90_ms"]),
            c_extra_ms_median=round(c["median_ms"] - pc["median_ms"], 2))
        for t, turn in e["b_chat"].items():
            v[f"b_{t}_speedup_median"] = r(plain["b_chat"][t]["median_ms"], turn["median_ms"])
        if "d_concurrent" in e and "d_concurrent" in plain:
            d, pd = e["d_concurrent"], plain["d_concurrent"]
            v["d_requests_per_s_gain"] = r(d["requests_per_s_median"], pd["requests_per_s_median"])
            v["d_ttft_p99_ratio"] = r(d["ttft_p99_ms"], pd["ttft_p99_ms"])
        ratios[path] = v
    for path, e in eng.items():  # the misses: (c) and (b) turn 1, per-request medians
        c_parts = e["c_distinct"]["parts"]
        t1 = e["b_chat"].get("turn_1", {}).get("parts", {})
        miss[path] = dict(c={k: c_parts.get(k, 0.0) for k in MISS_PARTS if k in c_parts or k == "wall"},
                          b_turn_1={k: t1.get(k, 0.0) for k in MISS_PARTS if k in t1})
        if path != "plain":
            pp = plain["c_distinct"]["parts"]
            miss[path]["c_minus_plain"] = {k: round(c_parts.get(k, 0.0) - pp.get(k, 0.0), 3)
                                           for k in ("wall", "python_total", "request_preprocess",
                                                     "image_preprocess", "tm_convert", "engine_rest")}
    results["ratios"] = ratios
    results["miss_cost"] = miss
    results["targets"] = targets(ratios, eng)


def targets(ratios: dict[str, Any], eng: dict[str, Any]) -> dict[str, bool]:
    """Each path's issue figures, met or not (issue 12's native and features, issue 28 item 1's
    combined), from the ratios and the engines' summaries; a path that did not run has none."""
    targets: dict[str, bool] = {}
    if "features" in ratios:
        targets["features_a_at_least_2x"] = (ratios["features"]["a_speedup_median"] or 0) >= 2
    if "native" in ratios:
        turns = [ratios["native"].get(f"b_turn_{t}_speedup_median") for t in range(1, TURNS + 1)]
        targets["native_b_never_slower_by_median"] = all(x is not None and x >= 1 for x in turns)
        targets["native_c_at_most_2pct_slower"] = (ratios["native"]["c_slowdown_median"] or 9) <= 1.02
    if "combined" in ratios:  # issue 28 item 1: >= 4x on (a), turns 2-4 within 1.1x of native
        cb = ratios["combined"]
        targets["combined_a_at_least_4x"] = (cb["a_speedup_median"] or 0) >= 4
        targets["combined_c_at_most_2pct_slower"] = (cb["c_slowdown_median"] or 9) <= 1.02
        if "native" in eng:
            nb, cbt = eng["native"]["b_chat"], eng["combined"]["b_chat"]
            targets["combined_b_turns_2_4_within_1_1x_native"] = all(
                cbt[f"turn_{t}"]["median_ms"] <= 1.1 * nb[f"turn_{t}"]["median_ms"]
                for t in range(2, TURNS + 1))
    if "features" in ratios:
        targets["features_c_at_most_2pct_slower"] = (ratios["features"]["c_slowdown_median"] or 9) <= 1.02
    gains = [v.get("d_requests_per_s_gain") for v in ratios.values() if v.get("d_requests_per_s_gain")]
    if gains:
        targets["d_better_path_at_least_2x"] = max(gains) >= 2
    return targets


def report(results: dict[str, Any]) -> None:
    """A readable summary in the log."""
    eng = {p: e for p, e in results["engines"].items() if "failed" not in e and e.get("reps")}
    for p, e in results["engines"].items():
        if "failed" in e:
            print(f"[bench] {p}: FAILED {e['failed']}")
    if not eng:
        return
    print("[bench] series (median / p90 ms; reps):")
    for p, e in eng.items():
        a, c = e["a_same_image_fresh_context"], e["c_distinct"]
        line = (f"  {p:9s} reps {e['reps']}  a {a['median_ms']} / {a['p90_ms']}  c {c['median_ms']} / "
                f"{c['p90_ms']}  b " + " ".join(f"{t['median_ms']}" for t in e["b_chat"].values()))
        if "d_concurrent" in e:
            d = e["d_concurrent"]
            line += (f"  d {d['requests_per_s_median']} req/s, TTFT {d['ttft_median_ms']} / "
                     f"p99 {d['ttft_p99_ms']}")
        print(line)
        print(f"  {'':9s} b cached tokens by turn: "
              + " | ".join(str(t["cached_tokens"]) for t in e["b_chat"].values()))
    for p, v in results.get("ratios", {}).items():
        print(f"[bench] ratios {p} vs plain: {json.dumps(v)}")
    miss = results.get("miss_cost", {})
    if miss:
        print("[bench] miss cost, (c) per-request medians in ms:")
        names = [k for k in MISS_PARTS if any(k in m["c"] for m in miss.values())]
        print("  " + f"{'step':20s}" + "".join(f"{p:>12s}" for p in miss))
        for k in names:
            print("  " + f"{k:20s}" + "".join(f"{m['c'].get(k, 0.0):12.3f}" for m in miss.values()))
    print(f"[bench] targets: {json.dumps(results.get('targets', {}))}")
    if results.get("skipped"):
        print(f"[bench] skipped: {results['skipped']}")
