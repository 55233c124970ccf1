"""featcache on the real lmdeploy 0.18 PyTorch engine, against plain lmdeploy in the same run.

    python bench/e2e_lmdeploy.py check --model DIR [--json OUT]   # fidelity (tiny checkpoints)
    python bench/e2e_lmdeploy.py bench --model DIR [--json OUT]   # speed (real-shape checkpoint)

check: the same requests (repeated, distinct, multi-image, batched, a multi-turn chat resending
its images, identical text over different images) through plain lmdeploy and through featcache
with prefix caching off and on; greedy token ids must be identical, the vision model must run once
per distinct image, and the prefix cache must never serve one image's KV for another.

bench: time to first token (one new token; median, p90) and requests/s for (a) the same image in
fresh contexts, (b) a 4-turn chat resending its image, (c) all-distinct images, (d) 32 concurrent
clients over a pool of 8 images; plain lmdeploy and featcache (prefix caching on) in the same run.
Needs a GPU and lmdeploy 0.18 (see docs/benchmarks.md for how it was run).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import sys
import tempfile
import time
from typing import Any

import numpy as np
import torch


def image(seed: int, size: tuple[int, int]) -> Any:
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


class VisionCounter:
    """Counts vision-model calls of the supported classes (patched under featcache's wrappers)."""

    def __init__(self) -> None:
        import lmdeploy.pytorch.models.internvl as legacy
        import lmdeploy.pytorch.models.internvl3_hf as ivl
        import lmdeploy.pytorch.models.qwen2_5_vl as q25
        import lmdeploy.pytorch.models.qwen2_vl as q2

        self.calls = 0
        self.rows = 0
        counter = self

        def wrap(cls: Any, name: str) -> None:
            original = getattr(cls, name)

            def counted(self_: Any, pixel_values: Any, *a: Any, **k: Any) -> Any:
                counter.calls += 1
                counter.rows += int(pixel_values.shape[0])
                return original(self_, pixel_values, *a, **k)

            setattr(cls, name, counted)

        wrap(ivl.InternVLForConditionalGeneration, "get_image_features")
        wrap(legacy.InternVLChatModel, "extract_feature")  # InternVL2 (the seed models)
        for vt in (q2.Qwen2VisionTransformerPretrainedModel,
                   q25.Qwen2_5_VisionTransformerPretrainedModel):
            wrap(getattr(vt, "__wrapped__", vt), "forward")

    def take(self) -> tuple[int, int]:
        out = (self.calls, self.rows)
        self.calls = self.rows = 0
        return out


def remote_code(model: str) -> bool:
    """Whether the checkpoint brings its own config classes (``auto_map``: legacy InternVL2)."""
    import os

    with open(os.path.join(model, "config.json")) as f:
        return "auto_map" in json.load(f)


def build(kind: str, model: str, prefix: bool, cache: Any = None, eager: bool = True) -> Any:
    from lmdeploy import PytorchEngineConfig
    from lmdeploy import pipeline as plain_pipeline

    cfg = PytorchEngineConfig(session_len=8192, cache_max_entry_count=0.05, eager_mode=eager,
                              enable_prefix_caching=prefix)
    kw = dict(backend_config=cfg, log_level="ERROR", trust_remote_code=remote_code(model))
    if kind == "plain":
        return plain_pipeline(model, **kw)
    from featcache.lmdeploy import pipeline

    return pipeline(model, cache=cache, **kw)


# -- check ---------------------------------------------------------------------------------------

LONG_PREFIX = "".join(f"line {i:03d} of a long shared instruction. " for i in range(6))[:200]
LONG_SUFFIX = ("then answer in one word, please, and nothing else at all; thank you very much, "
               "my friend, for reading this far.")


def check_requests() -> list[tuple[str, Any]]:
    """(label, prompt) in order; a prompt is a (text, image(s)) tuple, a list of them (one batch),
    or OpenAI-style messages."""
    a, b, c, d, e = (image(s, size) for s, size in
                     [(1, (120, 90)), (2, (64, 64)), (3, (200, 60)), (4, (90, 130)), (5, (56, 56))])
    chat = [dict(role="user", content=[dict(type="text", text="look at this"),
                                       dict(type="image_data", image_data=dict(data=c))])]
    def long(img: Any) -> list[dict[str, Any]]:
        # 200 characters of text (byte-level tokenizers: ~200 tokens, 3 full KV blocks of 64),
        # the image, then 100 more: prefix caching can reuse the text blocks before the image for
        # any image, and blocks holding the image only for the same image.
        return [dict(role="user", content=[
            dict(type="text", text=LONG_PREFIX), dict(type="image_data", image_data=dict(data=img)),
            dict(type="text", text=LONG_SUFFIX)])]

    return [
        ("long D", long(d)),
        ("long E (same text)", long(e)),
        ("long D again", long(d)),
        ("A", ("describe the image", a)),
        ("A again", ("describe the image", a)),
        ("B", ("describe the image", b)),
        ("A third time, other text", ("what colour dominates?", a)),
        ("A+C (hit+miss)", ("compare these", [a, c])),
        ("C+B (hit+hit)", ("compare these", [c, b])),
        ("batch D,A,E", [("one", d), ("two", a), ("three", e)]),
        ("same text, image D", ("same words for both", d)),
        ("same text, image E", ("same words for both", e)),
        ("chat turn 1", chat),
        ("chat turn 2", chat + [dict(role="assistant", content="ok"),
                                dict(role="user", content="and now?")]),
        ("chat turn 3", chat + [dict(role="assistant", content="ok"),
                                dict(role="user", content="and now?"),
                                dict(role="assistant", content="fine"),
                                dict(role="user", content="last one")]),
    ]


def run_check(pipe: Any, counter: VisionCounter) -> list[dict[str, Any]]:
    from lmdeploy import GenerationConfig

    gen = GenerationConfig(max_new_tokens=12, do_sample=False, ignore_eos=True)
    rows = []
    for label, prompt in check_requests():
        counter.take()
        batch = isinstance(prompt, list) and isinstance(prompt[0], tuple)
        if batch:
            outs = pipe(prompt, gen_config=gen)
        elif isinstance(prompt, list):
            outs = [pipe([prompt], gen_config=gen)[0]]
        else:
            outs = [pipe(prompt, gen_config=gen)]
        calls, vrows = counter.take()
        rows.append(dict(label=label, token_ids=[o.token_ids for o in outs],
                         cached_tokens=[o.cached_tokens for o in outs],
                         input_tokens=[o.input_token_len for o in outs],
                         vision_calls=calls, vision_rows=vrows))
    return rows


def check(model: str, tier_bytes: int = 12 << 10) -> dict[str, Any]:
    """``tier_bytes``: device and host tier sizes, about one image's features (the default fits the
    tiny models; a real-shape model needs its own: 256 tokens x LLM hidden x 2 bytes a tile)."""
    from featcache import FeatureCache

    counter = VisionCounter()
    results: dict[str, Any] = {"model": model}
    dirs = [tempfile.mkdtemp(prefix="fc-check-") for _ in range(2)]
    # featcache_restart reopens featcache_prefix's store in a new pipeline: a restarted server
    for name, kind, prefix, store in [("plain", "plain", True, None), ("featcache", "fc", False, 0),
                                      ("featcache_prefix", "fc", True, 1),
                                      ("featcache_restart", "fc", True, 1)]:
        # tiers of about one image each, so requests are served from host and disk too
        cache = FeatureCache(device="cuda", device_bytes=tier_bytes, host_bytes=tier_bytes,
                             disk_path=dirs[store], disk_bytes=64 << 20) if kind == "fc" else None
        t = time.time()
        pipe = build(kind, model, prefix, cache)
        rows = run_check(pipe, counter)
        stats = cache.stats() if cache is not None else None
        pipe.close()
        if cache is not None:
            cache.close()
        results[name] = dict(rows=rows, stats=stats, seconds=round(time.time() - t, 1),
                             prefix_kept=getattr(pipe.async_engine.backend_config,
                                                 "enable_prefix_caching", None))
        del pipe
        gc.collect()
        torch.cuda.empty_cache()
        print(f"[e2e] {name}: done in {results[name]['seconds']} s; stats "
              f"{stats and stats.get('lmdeploy')}", flush=True)
    base = {r["label"]: r["token_ids"] for r in results["plain"]["rows"]}
    verdict = {}
    for name in ("featcache", "featcache_prefix", "featcache_restart"):
        mismatched = [r["label"] for r in results[name]["rows"] if r["token_ids"] != base[r["label"]]]
        verdict[name] = dict(token_identical=not mismatched, mismatched=mismatched,
                             vision_images=results[name]["stats"]["lmdeploy"].get("vision_images", 0),
                             tier_hits={t: results[name]["stats"][t]["hits"]
                                        for t in ("device", "host", "disk")},
                             vision_calls=sum(r["vision_calls"] for r in results[name]["rows"]),
                             plain_vision_calls=sum(r["vision_calls"] for r in results["plain"]["rows"]))
    same_text = [r for r in results["plain"]["rows"] if r["label"].startswith("same text")]
    verdict["different_images_same_text_differ"] = same_text[0]["token_ids"] != same_text[1]["token_ids"]
    # Prefix safety by the engine's own accounting: over an identical 200-token text prefix,
    # another image may reuse at most the text blocks (<= 200 tokens); the same image reuses
    # blocks that hold the image (>= 256 tokens).
    rows = {r["label"]: r for r in results["featcache_prefix"]["rows"]}
    other, same = rows["long E (same text)"]["cached_tokens"][0], rows["long D again"]["cached_tokens"][0]
    verdict["prefix"] = dict(other_image_cached_tokens=other, same_image_cached_tokens=same,
                             safe=other <= 200, reused=same >= 256,
                             input_tokens=rows["long D again"]["input_tokens"][0])
    results["verdict"] = verdict
    print("[e2e] VERDICT", json.dumps(verdict), flush=True)
    return results


# -- bench ---------------------------------------------------------------------------------------

def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def summary(walls: list[float]) -> dict[str, float]:
    return dict(n=len(walls), median_ms=round(statistics.median(walls), 2),
                p90_ms=round(percentile(walls, 0.9), 2))


def timed(prompts: list[Any], pipe: Any, gen: Any) -> list[float]:
    walls = []
    for p in prompts:
        t = time.perf_counter()
        pipe(p, gen_config=gen)
        walls.append((time.perf_counter() - t) * 1e3)
    return walls


def first_token(pipe: Any, prompt: Any, gen: Any) -> tuple[float, Any]:
    """Time to the first streamed output (ms), and the whole response (the stream is drained)."""
    t = time.perf_counter()
    ttft, out = None, None
    for chunk in pipe.stream_infer([prompt], gen_config=gen):
        if ttft is None:
            ttft = (time.perf_counter() - t) * 1e3
        out = chunk if out is None else out.extend(chunk)
    assert ttft is not None and out is not None
    return ttft, out


def chat_turn(chat: int, turn: int, im: Any) -> dict[str, Any]:
    """The user message of ``turn`` in chat ``chat``: the image comes with the first one."""
    if turn == 0:
        return dict(role="user", content=[dict(type="text", text=f"chat {chat}: describe this"),
                                          dict(type="image_data", image_data=dict(data=im))])
    return dict(role="user", content=f"and what about detail {turn}?")


def chats(pipe: Any, gen: Any, size: tuple[int, int],
          count: int) -> tuple[list[list[float]], list[list[int]], Any]:
    """``count`` 4-turn chats, each resending its image (in its first user message) every turn:
    time to first token (ms) and cached prompt tokens per turn, and the last response. With one
    new token the time is the request's wall time; with more, the first token's, by streaming."""
    walls: list[list[float]] = [[] for _ in range(4)]
    cached: list[list[int]] = [[] for _ in range(4)]
    out = None
    for c in range(count):
        im = image(100 + c, size)
        hist: list[dict[str, Any]] = []
        for turn in range(4):
            hist.append(chat_turn(c, turn, im))
            if gen.max_new_tokens == 1:
                t = time.perf_counter()
                out = pipe([hist], gen_config=gen)[0]
                walls[turn].append((time.perf_counter() - t) * 1e3)
            else:
                ttft, out = first_token(pipe, hist, gen)
                walls[turn].append(ttft)
            cached[turn].append(out.cached_tokens)
            hist.append(dict(role="assistant", content=out.text or "x"))
    return walls, cached, out


def bench(model: str, size: tuple[int, int], n: int, answer_tokens: int = 1) -> dict[str, Any]:
    """``answer_tokens``: tokens each chat turn of (b) generates (its TTFT is then streamed)."""
    from lmdeploy import GenerationConfig

    gen = GenerationConfig(max_new_tokens=1, do_sample=False)
    results: dict[str, Any] = {"model": model, "image_size": size}
    for name, kind in [("plain", "plain"), ("featcache", "fc")]:
        from featcache import FeatureCache

        with tempfile.TemporaryDirectory() as tmp:
            cache = FeatureCache(device="cuda", device_bytes="2GiB", host_bytes="4GiB",
                                 disk_path=tmp, disk_bytes="8GiB") if kind == "fc" else None
            pipe = build(kind, model, True, cache, eager=False)  # CUDA graphs, as deployed
            res: dict[str, Any] = {}
            timed([(f"warm {i}", image(900 + i, size)) for i in range(3)], pipe, gen)
            same = image(1, size)
            res["a_same_image_fresh_context"] = summary(
                timed([(f"question {i}: what is in the picture?", same) for i in range(n)], pipe, gen))
            chat_gen = gen if answer_tokens == 1 else GenerationConfig(
                max_new_tokens=answer_tokens, do_sample=False, ignore_eos=True)
            chat_walls, chat_cached, out = chats(pipe, chat_gen, size, max(3, n // 3))
            res["b_multi_turn"] = {f"turn_{i + 1}": summary(w) for i, w in enumerate(chat_walls)}
            res["b_cached_tokens_by_turn"] = chat_cached
            res["b_input_tokens_turn_4"] = out.input_token_len
            res["c_distinct_images"] = summary(
                timed([(f"question {i}: what is in the picture?", image(200 + i, size))
                       for i in range(n)], pipe, gen))
            pool = [image(300 + i, size) for i in range(8)]
            prompts = [(f"client {i}: what is this?", pool[i % 8]) for i in range(64)]
            for p in prompts[:8]:  # the pool seen once, as a server would have by then
                pipe(p, gen_config=gen)
            t = time.perf_counter()
            res["d_concurrent_32_clients_pool_8"] = _concurrent(pipe, prompts, gen, clients=32)
            res["d_concurrent_32_clients_pool_8"]["wall_s"] = round(time.perf_counter() - t, 2)
            if cache is not None:
                res["stats"] = cache.stats()
            pipe.close()
            if cache is not None:
                cache.close()
        results[name] = res
        del pipe
        gc.collect()
        torch.cuda.empty_cache()
        print(f"[e2e] {name}: {json.dumps({k: v for k, v in res.items() if k != 'stats'})}",
              flush=True)
    results["ratios"] = ratios(results["plain"], results["featcache"])
    print("[e2e] RATIOS", json.dumps(results["ratios"]), flush=True)
    return results


def _concurrent(pipe: Any, prompts: list[Any], gen: Any, clients: int) -> dict[str, float]:
    """``clients`` concurrent sessions through the engine's async API; TTFT per request."""
    engine = pipe.async_engine
    ttfts: list[float] = []

    async def one(i: int, prompt: Any) -> None:
        t = time.perf_counter()
        messages = [dict(role="user", content=[
            dict(type="text", text=prompt[0]), dict(type="image_data", image_data=dict(data=prompt[1]))])]
        request = await engine.preprocess(messages, session_id=10_000 + i, gen_config=gen)
        first = True
        async for _ in engine.generate(request, stream_response=True):
            if first:
                ttfts.append((time.perf_counter() - t) * 1e3)
                first = False

    async def main() -> float:
        sem = asyncio.Semaphore(clients)

        async def gated(i: int, p: Any) -> None:
            async with sem:
                await one(i, p)

        t = time.perf_counter()
        await asyncio.gather(*(gated(i, p) for i, p in enumerate(prompts)))
        return time.perf_counter() - t

    wall = pipe._run(coro=main()).result()  # on the pipeline's own event-loop thread
    return {**summary(ttfts), "requests_per_s": round(len(prompts) / wall, 2)}


def ratios(plain: dict[str, Any], fc: dict[str, Any]) -> dict[str, float]:
    def r(a: float, b: float) -> float:
        return round(a / b, 2)

    return {
        "a_same_image_speedup": r(plain["a_same_image_fresh_context"]["median_ms"],
                                  fc["a_same_image_fresh_context"]["median_ms"]),
        **{f"b_turn_{t}_speedup": r(plain["b_multi_turn"][f"turn_{t}"]["median_ms"],
                                    fc["b_multi_turn"][f"turn_{t}"]["median_ms"]) for t in range(1, 5)},
        "c_distinct_slowdown": r(fc["c_distinct_images"]["median_ms"],
                                 plain["c_distinct_images"]["median_ms"]),
        "d_requests_per_s_gain": r(fc["d_concurrent_32_clients_pool_8"]["requests_per_s"],
                                   plain["d_concurrent_32_clients_pool_8"]["requests_per_s"]),
    }


def profile(model: str, size: tuple[int, int], n: int) -> dict[str, Any]:
    """Where the time of a request goes, per configuration: plain, plain with prefix caching forced
    on, featcache with prefix caching off and on. Wall time, lmdeploy's request preprocessing
    (template, tokenizer, image preprocessing) and cached prompt tokens, for (a) and (b)."""
    import lmdeploy
    from lmdeploy import GenerationConfig

    from featcache import FeatureCache
    from featcache.lmdeploy.engine import keep_prefix_caching
    from featcache.lmdeploy.models import SPECS

    gen = GenerationConfig(max_new_tokens=1, do_sample=False)
    out: dict[str, Any] = {}
    for name in ("plain", "plain_prefix", "featcache_noprefix", "featcache_prefix"):
        cfg = lmdeploy.PytorchEngineConfig(session_len=8192, cache_max_entry_count=0.05,
                                           eager_mode=True, enable_prefix_caching=True)
        tmp = tempfile.mkdtemp()
        cache = None
        if name.startswith("featcache"):
            from featcache.lmdeploy import pipeline as fc_pipeline

            cfg.enable_prefix_caching = name.endswith("_prefix")
            cache = FeatureCache(device="cuda", device_bytes="2GiB", host_bytes="4GiB",
                                 disk_path=tmp, disk_bytes="8GiB")
            pipe = fc_pipeline(model, backend_config=cfg, cache=cache, log_level="ERROR",
                               trust_remote_code=remote_code(model))
        else:
            with keep_prefix_caching(name == "plain_prefix", set(SPECS)):
                pipe = lmdeploy.pipeline(model, backend_config=cfg, log_level="ERROR",
                                         trust_remote_code=remote_code(model))
        engine = pipe.async_engine
        spent: dict[str, list[float]] = {"request_preprocess_ms": [], "vision_preprocess_ms": []}
        original_pre = engine.preprocess

        async def timed_pre(*a: Any, _f: Any = original_pre, _s: Any = spent, **k: Any) -> Any:
            t = time.perf_counter()
            r = await _f(*a, **k)
            _s["request_preprocess_ms"].append((time.perf_counter() - t) * 1e3)
            return r

        engine.preprocess = timed_pre
        vm = engine.vl_encoder.model
        original_vm = vm.preprocess

        def timed_vm(messages: Any, _f: Any = original_vm, _s: Any = spent) -> Any:
            t = time.perf_counter()
            r = _f(messages)
            _s["vision_preprocess_ms"].append((time.perf_counter() - t) * 1e3)
            return r

        vm.preprocess = timed_vm
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
        turns, turn_cached, o = chats(pipe, gen, size, 3)
        res["b_wall_median_by_turn"] = [round(statistics.median(w), 2) for w in turns]
        res["b_cached_tokens_by_turn"] = turn_cached
        res["b_input_tokens_last"] = o.input_token_len
        res.update({f"b_{k}": round(statistics.median(v), 2) for k, v in spent.items() if v})
        if cache is not None:
            res["lmdeploy_stats"] = cache.stats().get("lmdeploy")
        pipe.close()
        if cache is not None:
            cache.close()
        del pipe
        gc.collect()
        torch.cuda.empty_cache()
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

    from featcache import FeatureCache

    gen = GenerationConfig(max_new_tokens=1, do_sample=False)
    tmp = tempfile.mkdtemp()
    cache = FeatureCache(device="cuda", device_bytes="2GiB", host_bytes="4GiB",
                         disk_path=tmp, disk_bytes="8GiB")
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

    for name, prompts in [("text_short", [f"q {i}: name a colour." for i in range(3)]),
                          ("image_hit", [(f"q {i}: what is it?", image(1, size)) for i in range(3)])]:
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for p in prompts:
                run(p)
        out[f"profile_{name}"] = prof.key_averages().table(sort_by="cpu_time_total", row_limit=30)
        print(f"[e2e] FLOOR profile {name}:\n" + out[f"profile_{name}"], flush=True)
    for k, v in out.items():
        if k.startswith(("text", "image")):
            print(f"[e2e] FLOOR {k}: {json.dumps(v)}", flush=True)
    pipe.close()
    cache.close()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["check", "bench", "profile", "floor"])
    parser.add_argument("--model", required=True)
    parser.add_argument("--json")
    parser.add_argument("--n", type=int, default=10, help="requests per series (bench)")
    parser.add_argument("--size", default="1344x1008", help="image size for bench, WxH")
    parser.add_argument("--tier-bytes", type=int, default=12 << 10,
                        help="check: device and host tier bytes, about one image's features")
    parser.add_argument("--answer-tokens", type=int, default=1,
                        help="tokens per chat answer in (b) (bench; >1: first token streamed)")
    args = parser.parse_args(argv)
    if args.mode == "check":
        results = check(args.model, args.tier_bytes)
        v = results["verdict"]
        ok = (all(v[k]["token_identical"] for k in ("featcache", "featcache_prefix", "featcache_restart"))
              and v["featcache_restart"]["vision_images"] in (None, 0)
              and v["prefix"]["safe"] and v["prefix"]["reused"])
    else:
        w, h = (int(x) for x in args.size.split("x"))
        if args.mode == "bench":
            results = bench(args.model, (w, h), args.n, args.answer_tokens)
        elif args.mode == "floor":
            results = floor(args.model, (w, h), args.n)
        else:
            results = profile(args.model, (w, h), args.n)
        ok = True
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
