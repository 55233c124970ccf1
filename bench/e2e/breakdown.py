"""breakdown: where a request's time goes, plain vs featcache, per engine: the stages of ``--n``
misses and ``--n`` repeats of one image in fresh contexts (featcache: hits), of 4-turn chats and
their text-only twins, and the device-to-host copies a request makes."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from bench.e2e.probes import SPANS, D2HCounter, install_stage_timers, instrument_preprocess
from bench.e2e.runner import run_engines
from bench.e2e.series import chats
from bench.lib import models
from bench.lib.images import image, user_message
from bench.lib.results import write_report
from bench.lib.timing import percentile

STAGES = ("wall", "request_preprocess", "image_preprocess", "fc_frontend_own", "vision", "fc_serve_own",
          "prefill", "decode", "engine_overhead", "forward_prefill_host", "vision_calls", "forward_calls")


def derive(spans: dict[str, Any], wall: float) -> dict[str, float]:
    """One request's stages (ms). ``prefill`` = the prefill forwards minus the vision model and
    featcache's own serving inside them; ``engine_overhead`` = wall - request preprocessing - every
    model forward (scheduling, the engine loop, input/output copies, detokenizing, the response)."""
    g = spans.get
    calls = spans.get("calls", {})
    vision = g("vision", 0.0)
    serve_own = max(0.0, g("fc_serve", 0.0) - vision) if calls.get("fc_serve") else 0.0
    fwd = g("forward_prefill", 0.0)
    d = dict(wall=wall, request_preprocess=g("request_preprocess", 0.0),
             image_preprocess=g("image_preprocess", 0.0),
             fc_frontend_own=max(0.0, g("fc_frontend", 0.0) - g("image_preprocess", 0.0))
             if calls.get("fc_frontend") else 0.0,
             vision=vision, fc_serve_own=serve_own, prefill=fwd - vision - serve_own,
             decode=g("forward_decode", 0.0),
             engine_overhead=wall - g("request_preprocess", 0.0) - fwd - g("forward_decode", 0.0),
             forward_prefill_host=g("forward_prefill_host", 0.0),
             vision_calls=float(calls.get("vision", 0)),
             forward_calls=float(calls.get("forward_prefill", 0) + calls.get("forward_decode", 0)))
    return {k: round(v, 3) for k, v in d.items()}


def breakdown_message(i: int, im: Any, tag: str) -> list[dict[str, Any]]:
    """Text *before* the image differs per request: the prefix cache cannot cover the image span,
    so a repeated image is served by featcache (or, plain, by the vision model), not by KV reuse."""
    return [user_message(f"{tag} request {i}: look at this picture", im, "what is in it?")]


def breakdown_engine(pipe: Any, args: argparse.Namespace, size: tuple[int, int],
                     on_device: Any = None) -> dict[str, Any]:
    """Per-request stages of ``--n`` misses (distinct images) and ``--n`` repeats of one image in
    fresh contexts (featcache: hits), one new token each; then a few requests with the D2H counter."""
    from lmdeploy import GenerationConfig

    gen = GenerationConfig(max_new_tokens=1, do_sample=False)
    instrument_preprocess(pipe)

    def request(msgs: list[dict[str, Any]]) -> dict[str, Any]:
        SPANS.take()
        t = time.perf_counter()
        out = pipe([msgs], gen_config=gen)[0]
        wall = (time.perf_counter() - t) * 1e3
        row = derive(SPANS.take(), wall)
        row["input_tokens"] = out.input_token_len
        row["cached_tokens"] = out.cached_tokens
        return row

    for i in range(3):  # warm: two misses, a repeat
        request(breakdown_message(i, image(800 + min(i, 1), size), "warm"))
    res: dict[str, Any] = {}
    res["miss"] = [request(breakdown_message(i, image(50_000 + i, size), "miss")) for i in range(args.n)]
    same = image(60_000, size)
    res["repeat_first"] = request(breakdown_message(0, same, "prime"))
    res["repeat"] = [request(breakdown_message(i, same, "repeat")) for i in range(args.n)]
    counter = D2HCounter(on_device)
    d2h: dict[str, Any] = {}
    with counter:
        for name, im in (("miss", image(70_000, size)), ("repeat", same)):
            SPANS.enabled = False  # not timed: the counter's own wrappers cost host time
            try:
                pipe([breakdown_message(99, im, f"d2h {name}")], gen_config=gen)
            finally:
                SPANS.enabled = True
            SPANS.take()
            d2h[name] = counter.take()
    res["d2h"] = d2h
    res["chat"] = chat_stages(pipe, gen, size, args.chats, args.video_seconds)
    res["medians"] = {series: {k: round(statistics.median(r[k] for r in res[series]), 3) for k in STAGES}
                      for series in ("miss", "repeat")}
    res["spread"] = {series: {k: [round(percentile([r[k] for r in res[series]], q), 3) for q in (0.1, 0.9)]
                              for k in ("wall", "vision", "prefill", "engine_overhead")}
                     for series in ("miss", "repeat")}
    return res


CHAT_COLUMNS = (*STAGES, "input_tokens", "cached_tokens")  # per chat turn: its stages and tokens


def chat_stages(pipe: Any, gen: Any, size: tuple[int, int], count: int,
                video_s: float = 0) -> dict[str, Any]:
    """The stages of each turn of ``count`` 4-turn chats resending their image (``video_s``: a clip
    of that many seconds instead), and of each chat's text-only twin (same cached and new tokens):
    where a chat turn spends what its twin does not.
    Per kind ("chat", "twin") and turn: the rows, and each stage's median."""
    rows: dict[str, list[list[dict[str, Any]]]] = {k: [[] for _ in range(4)] for k in ("chat", "twin")}

    def observe(kind: str, turn: int, ms: float, out: Any) -> None:
        row = derive(SPANS.take(), ms)
        row["input_tokens"] = out.input_token_len
        row["cached_tokens"] = out.cached_tokens
        rows[kind][turn].append(row)

    SPANS.take()
    chats(pipe, gen, size, count, seed=300, twins=True, observe=observe, video_s=video_s)
    medians = {kind: [{k: round(statistics.median(r[k] for r in turn), 3) for k in CHAT_COLUMNS}
                      for turn in by_turn]
               for kind, by_turn in rows.items()}
    return dict(rows=rows, medians=medians)


def chat_stages_table(label: str, engine: str, chat: dict[str, Any]) -> None:
    m = chat["medians"]
    print(f"[e2e] CHAT STAGES {label} {engine}: per-turn medians, ms, chat / text-only twin")
    print("  " + f"{'stage':22s}" + "".join(f"{'turn ' + str(t + 1):>20s}" for t in range(4)))
    for k in CHAT_COLUMNS:
        print("  " + f"{k:22s}" + "".join(f"{m['chat'][t][k]:>9.2f} /{m['twin'][t][k]:>9.2f}"
                                          for t in range(4)))


# What shared/notes/gpu.md measured on the H200 for the features of one 13-tile image (bf16):
# what the 0.5/0.6 `.cpu()` of the features would cost today.
CPU_COPY_BASELINE = {"internvl2_2b": dict(features="13 x 256 x 2048 bf16 (13.6 MB)", pageable_ms=0.97,
                                          pinned_side_stream_ms=0.26),
                     "internvl2_26b": dict(features="13 x 256 x 6144 bf16 (40.9 MB)", pageable_ms=25.8,
                                           pinned_side_stream_ms=0.75)}


def breakdown(args: argparse.Namespace, builder: Any, on_device: Any = None,
              timers: list[tuple[Any, str | None, Any]] | None = None) -> dict[str, Any]:
    """Where a request's time goes, plain vs featcache: per engine, the medians of each stage over
    ``--n`` misses and ``--n`` repeats of one image (featcache: hits), and the D2H copies."""
    w, h = (int(x) for x in args.size.split("x"))
    patched = install_stage_timers(timers)
    print(f"[e2e] breakdown timers on: {patched}", flush=True)

    def per_engine(pipe: Any, engine: str, cache: Any, deadline: float, save: Any) -> dict[str, Any]:
        res = breakdown_engine(pipe, args, (w, h), on_device)
        print(f"[e2e] BREAKDOWN {engine}: {json.dumps(res['medians'])} d2h {json.dumps(res['d2h'])}",
              flush=True)
        chat_stages_table(args.label or models.label(args.model), engine, res["chat"])
        return res

    results = run_engines(args, builder, "breakdown", per_engine)
    results["timers"] = patched
    results["answer"] = breakdown_answer(results)
    results["cpu_copy_baseline_h200"] = CPU_COPY_BASELINE
    if args.json:
        write_report(args.json, results)
    breakdown_table(results)
    return results


def breakdown_answer(results: dict[str, Any]) -> dict[str, Any]:
    """The seed's two questions, from the medians."""
    out: dict[str, Any] = {}
    plain = results.get("plain")
    if plain:
        d = plain["d2h"]
        out["plain_d2h_feature_sized_copies_per_request"] = {k: v["large_calls"] for k, v in d.items()}
        out["plain_d2h_feature_sized_ms_per_request"] = {k: v["large_ms"] for k, v in d.items()}
        out["plain_d2h_all_copies_per_request"] = {k: v["calls"] for k, v in d.items()}
        m = plain["medians"]["miss"]
        out["plain_miss_ms"] = {k: m[k] for k in ("wall", "image_preprocess", "vision", "prefill",
                                                  "engine_overhead")}
    fc = next((results[e] for e in ("featcache", "featcache_noprefix") if e in results), None)
    if fc:
        hit = fc["medians"]["repeat"]
        out["featcache_hit_ms"] = {k: hit[k] for k in ("wall", "request_preprocess", "image_preprocess",
                                                       "fc_frontend_own", "vision", "fc_serve_own",
                                                       "prefill", "engine_overhead")}
        out["featcache_hit_own_cost_ms"] = round(hit["fc_frontend_own"] + hit["fc_serve_own"], 3)
        out["featcache_hit_vision_calls"] = hit["vision_calls"]
        out["featcache_d2h_feature_sized_copies_per_request"] = {k: v["large_calls"]
                                                                 for k, v in fc["d2h"].items()}
        if plain:
            out["hit_saves_ms_vs_plain_repeat"] = round(plain["medians"]["repeat"]["wall"] - hit["wall"], 3)
    return out


def breakdown_table(results: dict[str, Any]) -> None:
    cols = [(e, s) for e in results.get("engines", []) if e in results for s in ("miss", "repeat")]
    print(f"[e2e] BREAKDOWN TABLE {results['meta']['label']}: per-request medians, ms "
          "(GPU time by CUDA events for vision/fc_serve_own/prefill/decode; host time otherwise)")
    print("  " + f"{'stage':22s}" + "".join(f"{e + ' ' + s:>24s}" for e, s in cols))
    for k in STAGES:
        print("  " + f"{k:22s}" + "".join(f"{results[e]['medians'][s][k]:24.3f}" for e, s in cols))
    for k in ("calls", "large_calls", "large_mbytes", "large_ms"):
        print("  " + f"{'d2h ' + k:22s}" + "".join(f"{results[e]['d2h'][s][k]:>24}" for e, s in cols))
    print("[e2e] ANSWER " + json.dumps(results.get("answer", {})), flush=True)

