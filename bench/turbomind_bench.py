"""Speed on lmdeploy 0.18's real TurboMind: plain TurboMind vs featcache's native and features paths.

    python3 bench/turbomind_bench.py run --model DIR --out bench.json [--n 10 --reps 3 ...]
    python3 bench/turbomind_bench.py dry-run [--out dry.json]      # CPU, a stand-in pipeline

``run`` builds one engine at a time (plain TurboMind, featcache ``turbomind="native"``, ``"features"``
and ``"combined"``; TurboMind prefix caching on for all; GPU memory freed between), warms
each, then sends the same requests to each, one new token per request (greedy), so a request's wall
time is its time to first token:

- (a) the same image in fresh contexts: one priming request, then ``--n`` requests whose text
  *before* the image differs (TurboMind's prefix cache cannot cover the image's span);
- (b) ``--chats`` 4-turn chats resending their image (in the first user message, history resent):
  per-turn time and TurboMind's ``cached_tokens`` per turn;
- (c) ``--n`` all-distinct images (every request a miss, for featcache too);
- (d) ``--clients`` concurrent clients over a pool of 8 images (seen once before), closed loop,
  ``--d-requests`` requests or ``--duration`` seconds: requests/s and TTFT median/p90/p99.

Each series is repeated ``--reps`` times (interleaved: a b c d, a b c d, ...), medians and p90 over
all repetitions, ratios against plain TurboMind measured in the same run. Every request of (a)-(c)
is also broken down with ``time.perf_counter`` around the frontend's steps (wrappers installed on
the live objects, counted per request): lmdeploy's request preprocessing, its image preprocessing,
featcache's hook (keying, cache lookup, tagging, serving: the pinned pixel copy, the put, the
fingerprint), TurboMind's ``mm_input_converter`` (lmdeploy's sha256 over pixels for plain), and the
rest (engine: ViT, prefill, scheduling). ``miss_cost`` sets native and features against plain on the
misses of (c) and (b) turn 1; ``micro`` times the same primitives alone on one 13-tile image.

``dry-run`` runs all of it on the CPU over a stand-in pipeline (lmdeploy's real TurboMind Python over
the recording stand-in binding, featcache's real frontend, native and features hooks), small images.
Device use: ``bash bench/device/run_turbomind.sh bench`` (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import itertools
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections import defaultdict
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PATHS = ("plain", "native", "features", "combined")
TURNS = 4
POOL = 8


# -- requests ------------------------------------------------------------------------------------

def image(seed: int, size: tuple[int, int]) -> Any:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def user(before: str, img: Any = None, after: str = "what is in the picture?") -> dict[str, Any]:
    content: list[dict[str, Any]] = [dict(type="text", text=before)]
    if img is not None:
        content.append(dict(type="image_data", image_data=dict(data=img)))
    content.append(dict(type="text", text=after))
    return dict(role="user", content=content)


# -- instrumentation -----------------------------------------------------------------------------

class Probe:
    """Milliseconds and calls per named step, summed over threads; snapshots give per-request
    deltas (sequential series) or per-series totals (concurrent)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ms: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def add(self, name: str, ms: float, calls: int = 1) -> None:
        with self.lock:
            self.ms[name] += ms
            self.calls[name] += calls

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.add(name, (time.perf_counter() - t) * 1e3)
        return timed

    def wrap_async(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        async def timed(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return await fn(*a, **k)
            finally:
                self.add(name, (time.perf_counter() - t) * 1e3)
        return timed

    def snap(self) -> tuple[dict[str, float], dict[str, int]]:
        with self.lock:
            return dict(self.ms), dict(self.calls)

    def since(self, snap: tuple[dict[str, float], dict[str, int]]) -> dict[str, Any]:
        ms, calls = self.snap()
        out: dict[str, Any] = {k: round(v - snap[0].get(k, 0.0), 3) for k, v in ms.items()
                               if calls[k] != snap[1].get(k, 0)}
        n = {k: v - snap[1].get(k, 0) for k, v in calls.items() if v != snap[1].get(k, 0)}
        if n:
            out["calls"] = n
        return out


PROBE = Probe()
_GLOBAL: dict[str, Any] = {}  # the originals of the module-level functions wrapped once


def install_global_probes() -> None:
    """Module-level steps: TurboMind's converter (InternVL items), lmdeploy's per-image fingerprint
    (``sha256_computed`` counts those without a featcache fingerprint), featcache's fingerprint."""
    import lmdeploy.turbomind.models.internvl as ivl
    import lmdeploy.turbomind.turbomind as tmt

    import featcache.lmdeploy.tm_native as fct

    if _GLOBAL.get("installed_on") is tmt.TurboMind:  # once per import of lmdeploy.turbomind
        return
    _GLOBAL["installed_on"] = tmt.TurboMind
    _GLOBAL["resolve_fingerprint"] = original = ivl._resolve_fingerprint
    tmt.TurboMind.mm_input_converter = PROBE.wrap("tm_convert", tmt.TurboMind.mm_input_converter)

    def resolve(input_mm: dict[str, Any], *a: Any) -> bytes:
        if input_mm.get("fingerprint") is None:
            PROBE.add("sha256_computed", 0.0)
        out: bytes = original(input_mm, *a)
        return out

    ivl._resolve_fingerprint = PROBE.wrap("tm_fingerprint", resolve)
    if "fingerprint" not in _GLOBAL:
        _GLOBAL["fingerprint"] = fct.fingerprint
        fct.fingerprint = PROBE.wrap("fc_fingerprint", fct.fingerprint)


def instrument(pipe: Any, path: str) -> dict[str, Any]:
    """Wrap the live pipeline's steps (instance attributes); returns what was found."""
    from featcache.lmdeploy.tm_native import NativePixels

    engine = pipe.async_engine
    engine.preprocess = PROBE.wrap_async("request_preprocess", engine.preprocess)
    vm = engine.vl_encoder.model
    hook = vm.preprocess
    found: dict[str, Any] = dict(hook=type(hook).__name__)
    if path == "plain":
        vm.preprocess = PROBE.wrap("image_preprocess", hook)
        return found
    frontend = hook.frontend
    cache = frontend.cache
    vm.preprocess = PROBE.wrap("hook", hook)
    frontend.original = PROBE.wrap("image_preprocess", frontend.original)
    frontend._key = PROBE.wrap("fc_key", frontend._key)
    frontend._tag_misses = PROBE.wrap("fc_tag", frontend._tag_misses)
    cache.acquire = PROBE.wrap("fc_acquire", cache.acquire)
    cache.put = PROBE.wrap("fc_put", cache.put)
    if isinstance(hook, NativePixels):
        hook._serve = PROBE.wrap("fc_serve", hook._serve)
        found["pin"] = getattr(hook, "pin", False)
        found["vision_dtype"] = str(hook.vision_dtype)
    if path in ("features", "combined"):
        server = vm.forward.__self__
        server = getattr(server, "features", server)  # combined: its FeatureServer
        vm.forward = PROBE.wrap("fc_forward", vm.forward)
        server.run = PROBE.wrap("fc_vision", server.run)
    return found


def derive(parts: dict[str, Any], wall: float) -> dict[str, float]:
    """Per-request figures from one request's probe delta (ms)."""
    d = {k: float(v) for k, v in parts.items() if k != "calls"}
    d.pop("sha256_computed", None)
    if "hook" in d:
        d["featcache_own"] = d["hook"] - d.get("image_preprocess", 0.0)
    if "fc_serve" in d:
        d["serve_copy"] = d["fc_serve"] - d.get("fc_put", 0.0) - d.get("fc_fingerprint", 0.0)
    d["python_total"] = d.get("request_preprocess", 0.0) + d.get("tm_convert", 0.0)
    d["engine_rest"] = wall - d["python_total"]
    d["wall"] = wall
    return d


# -- statistics ----------------------------------------------------------------------------------

def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def stats(xs: list[float]) -> dict[str, Any]:
    if not xs:
        return dict(n=0)
    return dict(n=len(xs), median_ms=round(statistics.median(xs), 2), p90_ms=round(pct(xs, 0.9), 2),
                p99_ms=round(pct(xs, 0.99), 2), min_ms=round(min(xs), 2), max_ms=round(max(xs), 2))


def parts_medians(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Median over requests of each per-request figure (0 where a step did not run)."""
    derived = [derive(r["parts"], r["ms"]) for r in rows]
    names = sorted({k for d in derived for k in d})
    return {k: round(statistics.median(d.get(k, 0.0) for d in derived), 3) for k in names}


# -- one engine ----------------------------------------------------------------------------------

class Bench:
    def __init__(self, args: argparse.Namespace, size: tuple[int, int], deadline: float) -> None:
        self.args = args
        self.size = size
        self.deadline = deadline
        self.sessions = itertools.count(1_000_000)
        from lmdeploy import GenerationConfig

        self.gen = GenerationConfig(max_new_tokens=1, do_sample=False)

    def left(self) -> float:
        return self.deadline - time.time()

    def request(self, pipe: Any, messages: list[dict[str, Any]]) -> dict[str, Any]:
        snap = PROBE.snap()
        t = time.perf_counter()
        out = pipe([messages], gen_config=self.gen)[0]
        ms = (time.perf_counter() - t) * 1e3
        parts = PROBE.since(snap)
        row = dict(ms=round(ms, 3), cached=getattr(out, "cached_tokens", None),
                   input_tokens=out.input_token_len, parts=parts)
        if getattr(out, "finish_reason", None) == "error":
            row["error"] = f"{getattr(out, 'error_code', None)}: {getattr(out, 'error_message', '')}"
        return row

    def warm(self, pipe: Any) -> None:
        ims = [image(900 + i, self.size) for i in range(2)]
        for i, im in enumerate(ims + ims[:1]):  # two misses, then a hit in a fresh context
            self.request(pipe, [user(f"warm-up {i}: look at this", im)])
        hist = [user("warm-up chat", ims[1])]
        self.request(pipe, hist)
        self.request(pipe, hist + [dict(role="assistant", content="ok."), user("and then?")])
        self.concurrent(pipe, lambda k, j: [user(f"warm-up client {k} {j}", ims[j % 2])],
                        clients=4, count=8, duration=None)

    def series_a(self, pipe: Any, rep: int) -> dict[str, Any]:
        im = image(10_000 + rep, self.size)
        first = self.request(pipe, [user(f"rep {rep}: prime the cache with this picture", im)])
        rows = [self.request(pipe, [user(f"rep {rep}, conversation {i}: a fresh context. Look", im)])
                for i in range(self.args.n)]
        return dict(first=first, rows=rows)

    def series_b(self, pipe: Any, rep: int) -> list[list[dict[str, Any]]]:
        chats = []
        for c in range(self.args.chats):
            im = image(20_000 + 100 * rep + c, self.size)
            hist: list[dict[str, Any]] = []
            turns = []
            for turn in range(TURNS):
                hist.append(user(f"rep {rep} chat {c}: describe this", im) if turn == 0
                            else dict(role="user", content=f"and what about detail {turn}?"))
                turns.append(self.request(pipe, list(hist)))
                hist.append(dict(role="assistant", content="ok."))  # the same history on every path
            chats.append(turns)
        return chats

    def series_c(self, pipe: Any, rep: int) -> list[dict[str, Any]]:
        ims = [image(30_000 + 100 * rep + i, self.size) for i in range(self.args.n)]
        return [self.request(pipe, [user(f"rep {rep}, picture {i}: a new one. Look", im)])
                for i, im in enumerate(ims)]

    def concurrent(self, pipe: Any, make: Callable[[int, int], list[dict[str, Any]]], clients: int,
                   count: int | None, duration: float | None) -> dict[str, Any]:
        """``clients`` closed-loop clients through the engine's async API (on the pipeline's own
        event loop), until ``count`` requests were issued or ``duration`` seconds passed."""
        engine = pipe.async_engine
        ttfts: list[float] = []
        cached: list[int] = []
        errors: list[str] = []
        issued = [0]

        async def client(k: int, stop: float | None) -> None:
            while True:
                if count is not None and issued[0] >= count:
                    return
                if stop is not None and time.perf_counter() >= stop:
                    return
                j = issued[0]
                issued[0] += 1
                t = time.perf_counter()
                first = None
                try:
                    req = await engine.preprocess(make(k, j), session_id=next(self.sessions),
                                                  gen_config=self.gen)
                    async for out in engine.generate(req, stream_response=True):
                        if first is None:
                            first = (time.perf_counter() - t) * 1e3
                            cached.append(getattr(out, "cached_tokens", 0) or 0)
                except Exception as e:  # noqa: BLE001 - counted, reported
                    errors.append(f"{type(e).__name__}: {e}"[:300])
                    continue
                if first is not None:
                    ttfts.append(first)

        async def main() -> float:
            t = time.perf_counter()
            stop = t + duration if duration else None
            await asyncio.gather(*(client(k, stop) for k in range(clients)))
            return time.perf_counter() - t

        snap = PROBE.snap()
        wall = pipe._run(coro=main()).result()
        parts = PROBE.since(snap)
        done = len(ttfts)
        per_request = {k: round(v / done, 3) for k, v in parts.items() if k != "calls" and done}
        return dict(**stats(ttfts), requests=done, errors=len(errors), error_samples=errors[:3],
                    wall_s=round(wall, 3), requests_per_s=round(done / wall, 2) if wall else None,
                    cached_tokens_median=statistics.median(cached) if cached else None,
                    parts_mean_ms=per_request)

    def series_d(self, pipe: Any, pool: list[Any], rep: int) -> dict[str, Any]:
        a = self.args
        return self.concurrent(
            pipe, lambda k, j: [user(f"rep {rep} client {k} request {j}: what is this?", pool[j % POOL])],
            clients=a.clients, count=None if a.duration else a.d_requests, duration=a.duration)

    def engine(self, pipe: Any, path: str) -> dict[str, Any]:
        """Warm, then the four series ``--reps`` times; returns the raw rows and summaries."""
        res: dict[str, Any] = dict(path=path, instrumented=instrument(pipe, path))
        t = time.time()
        self.warm(pipe)
        res["warm_s"] = round(time.time() - t, 1)
        pool = [image(40_000 + j, self.size) for j in range(POOL)]
        for j, im in enumerate(pool):  # the pool seen once, as a server would have by then
            self.request(pipe, [user(f"pool picture {j}: what is this?", im)])
        raw: dict[str, list[Any]] = dict(a=[], b=[], c=[], d=[])
        for rep in range(self.args.reps):
            if rep and self.left() < self.args.rep_reserve_s:
                res["reps_skipped"] = f"stopped after {rep} reps: {self.left():.0f} s left"
                break
            raw["a"].append(self.series_a(pipe, rep))
            raw["b"].append(self.series_b(pipe, rep))
            raw["c"].append(self.series_c(pipe, rep))
            raw["d"].append(self.series_d(pipe, pool, rep))
            print(f"[bench] {path} rep {rep}: a {stats([r['ms'] for r in raw['a'][-1]['rows']])['median_ms']}"
                  f" ms, c {stats([r['ms'] for r in raw['c'][-1]])['median_ms']} ms, d "
                  f"{raw['d'][-1]['requests_per_s']} req/s ({self.left():.0f} s left)", flush=True)
        res["reps"] = len(raw["a"])
        res.update(summarise(raw))
        res["raw"] = raw
        return res


def summarise(raw: dict[str, list[Any]]) -> dict[str, Any]:
    a_rows = [r for rep in raw["a"] for r in rep["rows"]]
    chats = [chat for rep in raw["b"] for chat in rep]
    c_rows = [r for rep in raw["c"] for r in rep]
    d = raw["d"]
    out: dict[str, Any] = {
        "a_same_image_fresh_context": dict(
            **stats([r["ms"] for r in a_rows]), first_ms=[r["first"]["ms"] for r in raw["a"]],
            per_rep_median_ms=[stats([r["ms"] for r in rep["rows"]]).get("median_ms") for rep in raw["a"]],
            cached_tokens=sorted({r["cached"] for r in a_rows}, key=str), parts=parts_medians(a_rows)),
        "b_chat": {f"turn_{t + 1}": dict(**stats([c[t]["ms"] for c in chats]),
                                         cached_tokens=[c[t]["cached"] for c in chats],
                                         input_tokens=sorted({c[t]["input_tokens"] for c in chats}),
                                         parts=parts_medians([c[t] for c in chats]))
                   for t in range(TURNS)} if chats else {},
        "c_distinct": dict(
            **stats([r["ms"] for r in c_rows]),
            per_rep_median_ms=[stats([r["ms"] for r in rep]).get("median_ms") for rep in raw["c"]],
            cached_tokens=sorted({r["cached"] for r in c_rows}, key=str), parts=parts_medians(c_rows)),
    }
    if d:
        ttft_medians = [x.get("median_ms") for x in d]
        out["d_concurrent"] = dict(
            requests_per_s_median=round(statistics.median(x["requests_per_s"] for x in d), 2),
            requests_per_s=[x["requests_per_s"] for x in d],
            ttft_median_ms=round(statistics.median(m for m in ttft_medians if m is not None), 2),
            ttft_p90_ms=round(statistics.median(x["p90_ms"] for x in d if x.get("n")), 2),
            ttft_p99_ms=round(statistics.median(x["p99_ms"] for x in d if x.get("n")), 2),
            requests=sum(x["requests"] for x in d), errors=sum(x["errors"] for x in d),
            parts_mean_ms=d[-1]["parts_mean_ms"])
    seq = a_rows + c_rows + [t for c in chats for t in c]
    out["sha256_over_pixels"] = sum(r["parts"].get("calls", {}).get("sha256_computed", 0) for r in seq)
    out["sequential_requests"] = len(seq)
    errors = [r.get("error") for r in seq if r.get("error")]
    out["request_errors"] = len(errors)
    if errors:
        out["request_error_samples"] = errors[:3]
    return out


# -- micro: the primitives alone -----------------------------------------------------------------

def micro(pipe: Any, size: tuple[int, int], k: int = 5) -> dict[str, Any]:
    """One ``size`` image through lmdeploy's own image preprocessing (unwrapped), then each step a
    miss costs on either side, alone: lmdeploy's sha256 fingerprint, featcache's key, blake2b
    fingerprint and meta, pageable and pinned copies (fresh allocations kept alive as the cache keeps
    them, then re-used from torch's caching host allocator), the put (no disk tier / with one)."""
    import torch

    from featcache import FeatureCache
    from featcache.keys import image_key
    from featcache.lmdeploy.entry_meta import encode_item

    fingerprint = _GLOBAL.get("fingerprint") or __import__(
        "featcache.lmdeploy.tm_native", fromlist=["fingerprint"]).fingerprint
    resolve = _GLOBAL["resolve_fingerprint"]
    hook = pipe.async_engine.vl_encoder.model.preprocess  # lmdeploy's own, under any featcache hook
    prep = hook.frontend.original if hasattr(hook, "frontend") else hook
    im = image(7, size)

    def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
        t = time.perf_counter()
        r = fn()
        return (time.perf_counter() - t) * 1e3, r

    out: dict[str, Any] = {}

    def series(name: str, fn: Callable[[int], Any]) -> list[Any]:
        times, results = [], []
        for i in range(k):
            ms, r = timed(lambda i=i: fn(i))
            times.append(ms)
            results.append(r)
        out[name] = dict(median_ms=round(statistics.median(times), 3), all_ms=[round(x, 3) for x in times])
        return results

    items = series("lmdeploy_image_preprocess", lambda i: prep(
        [dict(role="user", content=[dict(type="image", data=im)])])[-1]["content"][0])
    item = items[0]
    px = item["pixel_values"]
    out["pixels"] = dict(shape=list(px.shape), dtype=str(px.dtype), mbytes=round(px.nbytes / 2**20, 2),
                         image_tokens=int(item["image_tokens"]))
    series("lmdeploy_sha256_fingerprint", lambda i: resolve(dict(pixel_values=px)))
    keys = series("featcache_image_key", lambda i: image_key(im, namespace=f"micro-{i}", params={}))
    series("featcache_blake2b_fingerprint", lambda i: fingerprint(keys[i]))
    series("featcache_encode_meta", lambda i: encode_item(item, "micro"))
    series("pageable_clone", lambda i: px.clone())
    pinned: list[Any] = []
    if torch.cuda.is_available():
        pinned = series("pinned_alloc_copy_fresh", lambda i: torch.empty_like(
            px, memory_format=torch.contiguous_format, pin_memory=True).copy_(px))
        del pinned[:]
        gc.collect()
        series("pinned_alloc_copy_reused", lambda i: torch.empty_like(
            px, memory_format=torch.contiguous_format, pin_memory=True).copy_(px))
    with tempfile.TemporaryDirectory() as d:
        for name, disk in (("put_no_disk", None), ("put_with_disk", d)):
            cache = FeatureCache(device="cpu", device_bytes=1 << 30, host_bytes=0, disk_path=disk,
                                 disk_bytes=(1 << 30) if disk else 0)
            tensors = [px.clone() for _ in range(k)]
            series(name, lambda i, c=cache, ts=tensors: c.put(keys[i], ts[i], meta=b"m"))
            cache.close()
    return out


# -- the run -------------------------------------------------------------------------------------

def engine_config(args: argparse.Namespace) -> Any:
    from lmdeploy import TurbomindEngineConfig

    return TurbomindEngineConfig(session_len=args.session_len, cache_max_entry_count=args.kv_fraction,
                                 dtype="bfloat16", enable_prefix_caching=True)


def real_builder(args: argparse.Namespace) -> Callable[[str, Any], Any]:
    def build(path: str, cache: Any) -> Any:
        with open(os.path.join(args.model, "config.json")) as f:
            remote = "auto_map" in json.load(f)  # legacy InternVL2 (the seed models): own config classes
        kw = dict(backend_config=engine_config(args), log_level="WARNING", trust_remote_code=remote)
        if path == "plain":
            from lmdeploy import pipeline as plain_pipeline

            return plain_pipeline(args.model, **kw)
        from featcache.lmdeploy import pipeline

        pipe = pipeline(args.model, cache=cache, turbomind=path, **kw)
        if getattr(pipe, "featcache", None) is not cache:
            raise RuntimeError(f"featcache was not installed on the {path} pipeline")
        return pipe
    return build


def gpu_memory() -> dict[str, float] | None:
    import torch

    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    return dict(free_gib=round(free / 2**30, 1), total_gib=round(total / 2**30, 1))


def run_all(args: argparse.Namespace, builder: Callable[[str, Any], Any], out: str | None,
            t0: float) -> dict[str, Any]:
    import torch

    from featcache import FeatureCache

    w, h = (int(x) for x in args.size.split("x"))
    bench = Bench(args, (w, h), t0 + args.budget)
    results: dict[str, Any] = dict(meta=meta(args), engines={}, skipped=[])

    def save() -> None:
        if out:
            with open(out, "w") as f:
                json.dump(results, f, indent=1, default=str)

    for path in args.paths.split(","):
        if bench.left() < args.engine_reserve_s:
            results["skipped"].append(f"{path}: {bench.left():.0f} s left (< {args.engine_reserve_s})")
            print(f"[bench] SKIPPED {path}: out of time", flush=True)
            continue
        store = tempfile.mkdtemp(prefix=f"fc-tmb-{path}-")
        cache = None
        if path != "plain":
            cache = FeatureCache(device="cpu", device_bytes=int(args.cache_gib * 2**30), host_bytes=0,
                                 disk_path=store if args.disk_gib > 0 else None,
                                 disk_bytes=int(args.disk_gib * 2**30))
        t = time.time()
        mem0 = gpu_memory()
        pipe = None
        try:
            pipe = builder(path, cache)
            build_s = round(time.time() - t, 1)
            print(f"[bench] {path}: engine built in {build_s} s; GPU {gpu_memory()}", flush=True)
            if path == args.paths.split(",")[0] and not args.no_micro:
                results["micro"] = micro(pipe, (w, h))
                print(f"[bench] micro: {json.dumps(results['micro'])}", flush=True)
            res = bench.engine(pipe, path)
            res.update(build_s=build_s, gpu_before_build=mem0, seconds=round(time.time() - t, 1))
            if cache is not None:
                s = cache.stats()
                res["featcache"] = s.get("lmdeploy", {})
                res["tiers"] = {k: s[k] for k in ("device", "disk") if k in s}
            results["engines"][path] = res
        except BaseException as e:  # noqa: BLE001 - a failed engine is reported, the rest still run
            results["engines"][path] = dict(path=path, failed=f"{type(e).__name__}: {e}",
                                            traceback=traceback.format_exc()[-3000:])
            print(f"[bench] {path} FAILED: {type(e).__name__}: {e}", flush=True)
            if isinstance(e, KeyboardInterrupt):
                raise
        finally:
            if pipe is not None:
                try:
                    pipe.close()
                except Exception as e:  # noqa: BLE001
                    print(f"[bench] {path}: close failed: {e}", flush=True)
            if cache is not None:
                cache.close()
            shutil.rmtree(store, ignore_errors=True)
            del pipe
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        compare(results)
        save()
        print(f"[bench] {path}: done in {time.time() - t:.0f} s; GPU after free {gpu_memory()}", flush=True)
    compare(results)
    save()
    report(results)
    return results


def meta(args: argparse.Namespace) -> dict[str, Any]:
    from runmeta import run_meta

    return run_meta(args=vars(args), new_tokens=1, prefix_caching=True)


# -- comparisons ---------------------------------------------------------------------------------

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
    targets: dict[str, Any] = {}
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
    results["targets"] = targets


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


# -- dry run: a stand-in pipeline on the CPU -----------------------------------------------------

def fake_builder(args: argparse.Namespace) -> Callable[[str, Any], Any]:
    """Pipelines that go through what the real ones run in Python: lmdeploy's real
    ``TurboMind.mm_input_converter`` and InternVL ``to_turbomind_multimodal`` fingerprinting (over
    the stand-in binding), featcache's real frontend with ``NativePixels`` or ``FeatureServer``; the
    vision preprocessing and the engine are stand-ins (small tensors, a 2 ms sleep)."""
    import lmdeploy.turbomind.models.internvl as ivl
    import torch
    from lmdeploy.messages import Response, TurbomindEngineConfig
    from lmdeploy.turbomind.turbomind import TurboMind

    from featcache.lmdeploy.frontend import install_frontend
    from featcache.lmdeploy.tm_combined import CombinedServer
    from featcache.lmdeploy.tm_features import FeatureServer
    from featcache.lmdeploy.tm_native import install_native

    tiles, per_tile = 2, 4

    class Vision:
        def preprocess(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
            import numpy as np

            out = []
            for m in messages:
                for x in m["content"] if isinstance(m.get("content"), list) else []:
                    if isinstance(x, dict) and x.get("type") == "image":
                        a = np.asarray(x["data"].convert("RGB").resize((28, 28)), dtype=np.float32)
                        px = torch.from_numpy(a).permute(2, 0, 1)[None].repeat(tiles, 1, 1, 1)
                        out.append(dict(pixel_values=px.to(torch.bfloat16), image_tokens=tiles * per_tile,
                                        image_token_id=5))
            messages.append(dict(role="preprocess", content=out))
            return messages

    class Source:
        def to_turbomind_multimodal(self, mm: list[dict[str, Any]]) -> list[bytes]:
            return [ivl._resolve_fingerprint(x) for x in mm]  # looked up per call, as lmdeploy does

    class Tower:
        device = torch.device("cpu")

        def __call__(self, pixels: Any) -> Any:
            return torch.zeros(pixels.shape[0], per_tile, 16, dtype=torch.bfloat16)

    class Engine:
        def __init__(self) -> None:
            self.vl_encoder = type("Encoder", (), {})()
            self.vl_encoder.model = Vision()
            self.tm = object.__new__(TurboMind)
            self.tm.engine_config = TurbomindEngineConfig(dtype="bfloat16")
            self.tm.source_model = Source()

        def _prepare(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
            msgs = [dict(m, content=[dict(type="image", data=x["image_data"]["data"])
                                     if isinstance(x, dict) and x.get("type") == "image_data" else x
                                     for x in m["content"]]) if isinstance(m.get("content"), list) else m
                    for m in messages]
            vm = self.vl_encoder.model
            msgs = vm.preprocess(msgs)
            if getattr(vm, "_turbomind_native_vision", True) is False:  # features (combined: by route)
                msgs = vm.forward(msgs, 1)
                if msgs[-1].get("featcache_route", "features") == "features":
                    return dict(multimodal=None, tokens=10)
            items = [m for m in msgs if m.get("role") == "preprocess"][0]["content"]
            return dict(multimodal=[dict(x, offset=3 + 10 * i) for i, x in enumerate(items)],
                        tokens=10 + sum(int(x["image_tokens"]) for x in items))

        async def preprocess(self, messages: Any, session_id: int, gen_config: Any) -> dict[str, Any]:
            return await asyncio.to_thread(self._prepare, messages)

        async def generate(self, request: dict[str, Any], stream_response: bool = True) -> Any:
            TurboMind.mm_input_converter(self.tm, request["multimodal"])  # on the loop, as lmdeploy
            await asyncio.sleep(0.002)
            yield Response(text="", generate_token_len=1, input_token_len=request["tokens"],
                           token_ids=[1], cached_tokens=0)

    class Pipe:
        def __init__(self) -> None:
            self.async_engine = Engine()
            self.loop = asyncio.new_event_loop()
            self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
            self.thread.start()
            self.ids = itertools.count(1)

        def _run(self, coro: Any) -> Any:
            return asyncio.run_coroutine_threadsafe(coro, self.loop)

        def __call__(self, prompts: list[Any], gen_config: Any) -> list[Any]:
            async def one(messages: Any) -> Any:
                req = await self.async_engine.preprocess(messages, next(self.ids), gen_config)
                async for out in self.async_engine.generate(req):
                    return out
            return [self._run(one(p)).result() for p in prompts]

        def close(self) -> None:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(5)

    def build(path: str, cache: Any) -> Any:
        pipe = Pipe()
        vm = pipe.async_engine.vl_encoder.model
        if path == "native":
            install_native(vm, cache, "dry-run:native")
        elif path == "features":
            install_frontend(vm, cache, "dry-run:features")
            FeatureServer(cache, Tower(), torch.bfloat16).install(vm)  # type: ignore[arg-type]
        elif path == "combined":
            install_native(vm, cache, "dry-run:native")
            CombinedServer(cache, FeatureServer(cache, Tower(), torch.bfloat16),  # type: ignore[arg-type]
                           "dry-run:features").install(vm)
        if cache is not None:
            pipe.featcache = cache
        return pipe
    return build


def dry_run(args: argparse.Namespace) -> int:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    import turbomind_binding

    args.model = "<stand-in>"
    with turbomind_binding.installed():
        install_global_probes()
        res = run_all(args, fake_builder(args), args.out, time.time())
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["run", "dry-run"])
    ap.add_argument("--model", help="checkpoint dir (run): bench/device/make_real_shape.py builds it")
    ap.add_argument("--out", help="JSON results (rewritten after each engine)")
    ap.add_argument("--paths", default=",".join(PATHS), help="engines, in order (default: all three)")
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


if __name__ == "__main__":
    sys.exit(main())
