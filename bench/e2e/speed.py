"""bench (the speed of series (a)-(d) per engine), its statistics and ratios, its table, and
merge (engines of one model run in separate calls, merged into one result with the ratios)."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from bench.e2e.runner import run_engines
from bench.e2e.series import chats, concurrent, timed, warm
from bench.lib.images import image
from bench.lib.results import at, write_report
from bench.lib.timing import rep_medians, spread


def bench_engine(pipe: Any, args: argparse.Namespace, size: tuple[int, int], deadline: float,
                 save: Any = None) -> dict[str, Any]:
    """Warm, then (a) (b) (c) (d) ``--reps`` times, interleaved (a b c d, a b c d, ...)."""
    from lmdeploy import GenerationConfig

    gen = GenerationConfig(max_new_tokens=1, do_sample=False)
    chat_gen = gen if args.answer_tokens == 1 else GenerationConfig(
        max_new_tokens=args.answer_tokens, do_sample=False, ignore_eos=True)
    t = time.time()
    warm(pipe, gen, size)
    res: dict[str, Any] = dict(warm_s=round(time.time() - t, 1))
    pool = [image(300 + i, size) for i in range(8)]
    for i, p in enumerate(pool):  # the pool seen once, as a server would have by then
        pipe((f"pool picture {i}: what is this?", p), gen_config=gen)
    raw: dict[str, list[Any]] = dict(a=[], b=[], c=[], d=[])
    res["raw"] = raw
    for rep in range(args.reps):
        if rep and time.time() > deadline - args.rep_reserve_s:
            res["reps_skipped"] = f"stopped after {rep} reps: {deadline - time.time():.0f} s left"
            print(f"[e2e] {res['reps_skipped']}", flush=True)
            break
        same = image(10_000 + rep, size)
        first = timed([(f"rep {rep}: prime the cache with this picture", same)], pipe, gen)[0]
        rows = timed([(f"rep {rep} question {i}: what is in the picture?", same)
                      for i in range(args.n)], pipe, gen)
        raw["a"].append(dict(first_ms=first, ms=rows))
        b = chats(pipe, chat_gen, size, args.chats, seed=20_000 + 100 * rep, twins=args.text_twins,
                  video_s=args.video_seconds)
        raw["b"].append(dict(ms=b.walls, cached=b.cached, input_tokens=b.input_tokens,
                             input_tokens_turn_4=b.out.input_token_len))
        if args.text_twins:
            raw["b"][-1].update(twin_ms=b.twin_walls, twin_cached=b.twin_cached,
                                twin_input_tokens=b.twin_input_tokens)
        raw["c"].append(timed([(f"rep {rep} question {i}: what is in the picture?",
                                image(30_000 + 100 * rep + i, size)) for i in range(args.n)], pipe, gen))
        prompts = [(f"rep {rep} client {i}: what is this?", pool[i % 8]) for i in range(args.d_requests)]
        raw["d"].append(concurrent(pipe, prompts, gen, clients=args.clients,
                                    session_base=100_000 * (rep + 1)))
        print(f"[e2e] rep {rep}: a {statistics.median(rows):.1f} ms, c "
              f"{statistics.median(raw['c'][-1]):.1f} ms, b "
              + " / ".join(f"{statistics.median(w):.1f}" for w in b.walls)
              + (" (text twins " + " / ".join(f"{statistics.median(w):.1f}" for w in b.twin_walls) + ")"
                 if args.text_twins else "")
              + f" ms, d {raw['d'][-1]['requests_per_s']} req/s", flush=True)
        if save is not None:
            save()
    res["reps"] = len(raw["a"])
    res.update(summarise(raw, args.spread_limit))
    return res



def summarise(raw: dict[str, list[Any]], limit: float) -> dict[str, Any]:
    """Per series: all reps pooled (median, p10/p90, min/max, ``noisy``) and each rep's median."""
    out: dict[str, Any] = {}
    out["a_same_image_fresh_context"] = dict(
        **spread([x for r in raw["a"] for x in r["ms"]], limit),
        per_rep_median_ms=rep_medians([r["ms"] for r in raw["a"]]),
        first_ms=[round(r["first_ms"], 2) for r in raw["a"]])
    out["b_multi_turn"] = {
        f"turn_{t + 1}": dict(**spread([x for r in raw["b"] for x in r["ms"][t]], limit),
                              per_rep_median_ms=rep_medians([r["ms"][t] for r in raw["b"]]))
        for t in range(4)} if raw["b"] else {}
    out["b_cached_tokens_by_turn"] = [[x for r in raw["b"] for x in r["cached"][t]] for t in range(4)]
    out["b_input_tokens_turn_4"] = raw["b"][-1]["input_tokens_turn_4"] if raw["b"] else None
    if raw["b"] and "input_tokens" in raw["b"][0]:
        out["b_input_tokens_by_turn"] = [[x for r in raw["b"] for x in r["input_tokens"][t]]
                                         for t in range(4)]
    if raw["b"] and "twin_ms" in raw["b"][0]:  # the text-only twins (--text-twins)
        out["b_text_twin"] = {
            f"turn_{t + 1}": dict(**spread([x for r in raw["b"] for x in r["twin_ms"][t]], limit),
                                  cached_tokens=[x for r in raw["b"] for x in r["twin_cached"][t]],
                                  input_tokens=[x for r in raw["b"] for x in r["twin_input_tokens"][t]])
            for t in range(4)}
        # the chat turn's time over its twin's, medians (issue 15's target: <= 1.1 from turn 2)
        out["b_turn_over_text_twin"] = {
            f"turn_{t + 1}": round(out["b_multi_turn"][f"turn_{t + 1}"]["median_ms"]
                                   / out["b_text_twin"][f"turn_{t + 1}"]["median_ms"], 3)
            for t in range(4)}
    out["c_distinct_images"] = dict(**spread([x for r in raw["c"] for x in r], limit),
                                    per_rep_median_ms=rep_medians(raw["c"]))
    if raw["d"]:
        rps = [d["requests_per_s"] for d in raw["d"]]
        ttft = spread([x for d in raw["d"] for x in d["ttft_ms"]], limit)
        out["d_concurrent_32_clients_pool_8"] = dict(
            requests_per_s=round(statistics.median(rps), 2), requests_per_s_min=min(rps),
            requests_per_s_max=max(rps), requests_per_s_by_rep=rps,
            # throughput is the ratio here: noisy when the reps disagree by more than the limit
            noisy=bool(max(rps) > limit * min(rps)),
            ttft=ttft, clients=raw["d"][0]["clients"], requests=sum(d["n"] for d in raw["d"]))
    return out


SERIES = [("a_same_image_speedup", "a_same_image_fresh_context", "plain/fc"),
          *[(f"b_turn_{t}_speedup", f"b_multi_turn.turn_{t}", "plain/fc") for t in range(1, 5)],
          ("c_distinct_slowdown", "c_distinct_images", "fc/plain")]



def ratios(plain: dict[str, Any], fc: dict[str, Any], limit: float = 2.0) -> dict[str, Any]:
    """Plain vs featcache from the medians over all reps; a ratio whose either series is noisy
    (p90 > limit x median; for (d), requests/s of the reps apart by more than the limit) is None,
    and named in ``flagged`` with the numbers."""
    out: dict[str, Any] = {}
    flagged: dict[str, str] = {}
    for name, path, how in SERIES:
        p, f = at(plain, path), at(fc, path)
        if not p.get("n") or not f.get("n"):
            out[name] = None
            continue
        bad = [f"{who} p90 {s['p90_ms']} > {limit} x median {s['median_ms']}"
               for who, s in (("plain", p), ("featcache", f)) if s.get("noisy")]
        if bad:
            out[name] = None
            flagged[name] = "; ".join(bad)
            continue
        a, b = (p["median_ms"], f["median_ms"]) if how == "plain/fc" else (f["median_ms"], p["median_ms"])
        out[name] = round(a / b, 2)
    pd, fd = plain.get("d_concurrent_32_clients_pool_8"), fc.get("d_concurrent_32_clients_pool_8")
    if pd and fd:
        bad = [f"{who} requests/s by rep {d['requests_per_s_by_rep']} apart by > {limit}x"
               for who, d in (("plain", pd), ("featcache", fd)) if d.get("noisy")]
        if bad:
            out["d_requests_per_s_gain"] = None
            flagged["d_requests_per_s_gain"] = "; ".join(bad)
        else:
            out["d_requests_per_s_gain"] = round(fd["requests_per_s"] / pd["requests_per_s"], 2)
        if pd["ttft"].get("n") and fd["ttft"].get("n"):
            out["d_ttft_median_ratio"] = round(fd["ttft"]["median_ms"] / pd["ttft"]["median_ms"], 2)
    out["flagged"] = flagged
    return out



def bench(args: argparse.Namespace, builder: Any) -> dict[str, Any]:
    """The (a)-(d) series per engine, then the ratios (when both plain and featcache ran)."""
    w, h = (int(x) for x in args.size.split("x"))

    def per_engine(pipe: Any, engine: str, cache: Any, deadline: float, save: Any) -> dict[str, Any]:
        res = bench_engine(pipe, args, (w, h), deadline, save)
        print(f"[e2e] {engine}: " + json.dumps({k: v for k, v in res.items() if k not in ("raw", "stats")}),
              flush=True)
        return res

    results = run_engines(args, builder, "bench", per_engine)
    add_ratios(results, args.spread_limit)
    if args.json:
        write_report(args.json, results)
    report(results)
    return results


def add_ratios(results: dict[str, Any], limit: float) -> None:
    fc = next((e for e in ("featcache", "featcache_noprefix") if e in results), None)
    if "plain" in results and fc:
        results["ratios"] = ratios(results["plain"], results[fc], limit)
        results["ratios"]["featcache_engine"] = fc


def report(results: dict[str, Any]) -> None:
    """The table in the log: median [p10, p90] ms per series and engine, then the ratios."""
    def cell(s: dict[str, Any]) -> str:
        if not s.get("n"):
            return "-"
        return f"{s['median_ms']} [{s['p10_ms']}, {s['p90_ms']}]" + (" NOISY" if s.get("noisy") else "")

    rows = [("a same image", "a_same_image_fresh_context")] + [
        (f"b turn {t}", f"b_multi_turn.turn_{t}") for t in range(1, 5)] + [
        ("c distinct", "c_distinct_images"), ("d TTFT", "d_concurrent_32_clients_pool_8.ttft")]
    engines = [e for e in results.get("engines", []) if e in results]
    print(f"[e2e] TABLE {results['meta']['label']}: TTFT median [p10, p90] ms, reps "
          + ", ".join(f"{e} {results[e].get('reps')}" for e in engines))
    print("  " + f"{'series':14s}" + "".join(f"{e:>34s}" for e in engines))
    for label, path in rows:
        print("  " + f"{label:14s}" + "".join(f"{cell(at(results[e], path)):>34s}" for e in engines))
    line = "  " + f"{'d req/s':14s}"
    for e in engines:
        d = results[e].get("d_concurrent_32_clients_pool_8")
        line += f"{(str(d['requests_per_s']) + ' ' + str(d['requests_per_s_by_rep'])) if d else '-':>34s}"
    print(line)
    if "ratios" in results:
        print("[e2e] RATIOS " + json.dumps(results["ratios"]), flush=True)


def merge(paths: list[str], out: str | None, limit: float) -> dict[str, Any]:
    """Engines of one model run in separate calls (the 26B: one engine load per 600 s call), merged
    into one result with the ratios."""
    merged: dict[str, Any] = {}
    for p in paths:
        with open(p) as f:
            r = json.load(f)
        if not merged:
            merged = {"meta": r["meta"], "model": r["model"], "engines": [], "merged_from": []}
        elif r["model"] != merged["model"]:
            raise SystemExit(f"{p}: model {r['model']} is not {merged['model']}")
        merged["merged_from"].append(p)
        for e in r["engines"]:
            merged[e] = r[e]
            if e not in merged["engines"]:
                merged["engines"].append(e)
    add_ratios(merged, limit)
    if out:
        write_report(out, merged)
    report(merged)
    return merged

