"""floor (lmdeploy's own per-request floor, and why a chat's turn 2 missed the prefix cache) and
profile (where a request's time goes per configuration, eager mode): two diagnoses of 2026-11-29
(bench/results/HISTORY.md, "Where the floor is")."""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from typing import Any

from bench.e2e.series import chat_turn, chats, timed
from bench.lib.engines import bench_cache, build, close_pipeline, free_gpu
from bench.lib.images import image
from bench.lib.timing import summary, timed_call

# profile's configurations: (pipeline kind, prefix caching asked for)
PROFILED = {"plain": ("plain", True), "plain_prefix": ("plain_prefix", True),
            "featcache_noprefix": ("fc", False), "featcache_prefix": ("fc", True)}


def profile(model: str, size: tuple[int, int], n: int) -> dict[str, Any]:
    """Where the time of a request goes, per configuration: plain, plain with prefix caching forced
    on, featcache with prefix caching off and on. Wall time, lmdeploy's request preprocessing
    (template, tokenizer, image preprocessing) and cached prompt tokens, for (a) and (b)."""
    from lmdeploy import GenerationConfig

    gen = GenerationConfig(max_new_tokens=1, do_sample=False)
    out: dict[str, Any] = {}
    for name, (kind, prefix) in PROFILED.items():
        cache = bench_cache("cuda", tempfile.mkdtemp()) if kind == "fc" else None
        pipe = build(kind, model, prefix, cache)  # eager, as this diagnosis ran
        engine = pipe.async_engine
        spent: dict[str, list[float]] = {"request_preprocess_ms": [], "vision_preprocess_ms": []}
        engine.preprocess = timed_call(engine.preprocess, spent["request_preprocess_ms"].append)
        vm = engine.vl_encoder.model
        vm.preprocess = timed_call(vm.preprocess, spent["vision_preprocess_ms"].append)
        timed([(f"warm {i}", image(900 + i, size)) for i in range(2)], pipe, gen)
        for v in spent.values():
            v.clear()
        same = image(1, size)
        walls, cached = [], []
        for i in range(n):
            t = time.perf_counter()
            o = pipe((f"question {i}: what is in the picture?", same), gen_config=gen)
            walls.append((time.perf_counter() - t) * 1e3)
            cached.append(o.cached_tokens)
        res: dict[str, Any] = {"a_wall": summary(walls), "a_cached_tokens": cached,
                               **{f"a_{k}": round(statistics.median(v), 2) for k, v in spent.items()}}
        for v in spent.values():
            v.clear()
        b = chats(pipe, gen, size, 3)
        res["b_wall_median_by_turn"] = [round(statistics.median(w), 2) for w in b.walls]
        res["b_cached_tokens_by_turn"] = b.cached
        res["b_input_tokens_last"] = b.out.input_token_len
        res.update({f"b_{k}": round(statistics.median(v), 2) for k, v in spent.items() if v})
        if cache is not None:
            res["lmdeploy_stats"] = cache.stats().get("lmdeploy")
        close_pipeline(pipe)
        if cache is not None:
            cache.close()
        del pipe
        free_gpu()
        out[name] = res
        print(f"[e2e] PROFILE {name}: {json.dumps(res)}", flush=True)
    return out


def floor(model: str, size: tuple[int, int], n: int) -> dict[str, Any]:
    """lmdeploy's own per-request floor, and why a chat's turn 2 misses the prefix cache.

    One featcache pipeline (prefix caching on, CUDA graphs), one new token per request. Text-only
    series: a fresh ~3.4k-token prompt, the same long prompt with a new last line (a prefix-cache
    hit), a short prompt. Image series: 4-turn chats resending their image, with the token ids of
    each turn compared with the previous turn's, and turn 1 asked twice. For each request: wall
    time, lmdeploy's request preprocessing and cached prompt tokens."""
    from lmdeploy import GenerationConfig

    gen = GenerationConfig(max_new_tokens=1, do_sample=False)
    cache = bench_cache("cuda", tempfile.mkdtemp())
    pipe = build("fc", model, True, cache, eager=False)
    engine = pipe.async_engine
    seen: list[Any] = []
    original_pre = engine.preprocess

    async def recorded(*a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        r = await original_pre(*a, **k)
        seen.append(((time.perf_counter() - t) * 1e3, list(r.inputs.get("input_ids") or [])))
        return r

    engine.preprocess = recorded

    def run(prompt: Any) -> dict[str, Any]:
        seen.clear()
        t = time.perf_counter()
        o = pipe(prompt, gen_config=gen)
        wall = (time.perf_counter() - t) * 1e3
        o = o[0] if isinstance(o, list) else o
        if not seen:
            raise RuntimeError(f"request was not preprocessed: {o!r}"[:2000])
        pre, ids = seen[-1]
        return dict(wall_ms=wall, preprocess_ms=pre, cached=o.cached_tokens, ids=ids, out=o)

    def series(prompts: list[Any]) -> dict[str, Any]:
        rows = [run(p) for p in prompts]
        return dict(wall=summary([r["wall_ms"] for r in rows]),
                    preprocess_ms=round(statistics.median(r["preprocess_ms"] for r in rows), 2),
                    input_tokens=[len(r["ids"]) for r in rows], cached=[r["cached"] for r in rows])

    body = " ".join(f"fact {j}: the value is {j * 7 % 101}." for j in range(280))
    run(f"warm: {body}")
    timed([(f"warm {i}", image(900 + i, size)) for i in range(3)], pipe, gen)
    out: dict[str, Any] = {"model": model}
    out["text_long_fresh"] = series([f"document {i}. {body}" for i in range(n)])
    out["text_long_cached"] = series([f"document 0. {body}\nquestion {i}: which fact is last?"
                                      for i in range(n)])
    out["text_short"] = series([f"question {i}: name a colour." for i in range(n)])
    out["image_short_text_hit"] = series([(f"question {i}: what is in the picture?", image(1, size))
                                          for i in range(n)])

    def common(a: list[int], b: list[int]) -> int:
        k = 0
        while k < min(len(a), len(b)) and a[k] == b[k]:
            k += 1
        return k

    chats_out = []
    for c in range(3):
        im = image(100 + c, size)
        hist: list[dict[str, Any]] = []
        turns, prev = [], None
        for turn in range(4):
            hist.append(chat_turn(c, turn, im))
            r = run([hist])
            row = dict(wall_ms=round(r["wall_ms"], 2), preprocess_ms=round(r["preprocess_ms"], 2),
                       input_tokens=len(r["ids"]), cached=r["cached"],
                       common_prefix_with_previous=None if prev is None else common(prev, r["ids"]))
            if turn == 0:
                again = run([hist])
                row["turn1_again"] = dict(wall_ms=round(again["wall_ms"], 2), cached=again["cached"],
                                          same_ids=again["ids"] == r["ids"])
                row["generated"] = list(r["out"].token_ids)
            if prev is not None:  # where the previous turn's prompt ended, to see what differs
                row["ids_near_previous_end"] = r["ids"][len(prev) - 6:len(prev) + 6]
                row["previous_ids_end"] = prev[-6:]
            prev = r["ids"]
            turns.append(row)
            hist.append(dict(role="assistant", content=r["out"].text or "x"))
        chats_out.append(turns)
        print(f"[e2e] FLOOR chat {c}: {json.dumps(turns)}", flush=True)
    out["chats"] = chats_out
    out["lmdeploy_stats"] = cache.stats().get("lmdeploy")
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    profiled: list[tuple[str, list[Any]]] = [
        ("text_short", [f"q {i}: name a colour." for i in range(3)]),
        ("image_hit", [(f"q {i}: what is it?", image(1, size)) for i in range(3)])]
    for name, prompts in profiled:
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for p in prompts:
                run(p)
        out[f"profile_{name}"] = prof.key_averages().table(sort_by="cpu_time_total", row_limit=30)
        print(f"[e2e] FLOOR profile {name}:\n" + out[f"profile_{name}"], flush=True)
    for k, v in out.items():
        if k.startswith(("text", "image")):
            print(f"[e2e] FLOOR {k}: {json.dumps(v)}", flush=True)
    close_pipeline(pipe)
    cache.close()
    return out


