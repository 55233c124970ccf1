"""The requests one engine gets: warming, then series (a)-(d) ``--reps`` times, interleaved; each
request of (a)-(c) with its probe delta (``parts``), (d) with its per-request means."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import time
from collections.abc import Callable
from typing import Any

from bench.lib.engines import greedy
from bench.lib.images import image, user_message
from bench.lib.timing import summary
from bench.turbomind.probes import PROBE, instrument
from bench.turbomind.summary import summarise

TURNS = 4
POOL = 8


def user(before: str, img: Any = None) -> dict[str, Any]:
    """A user message: ``before``, the image (where one is given), then the question every
    request ends with."""
    return user_message(before, img, "what is in the picture?")


class Bench:
    """The series of one run, sent to each engine in turn; ``deadline``: when the run's budget
    ends (reps that would not fit are skipped)."""

    def __init__(self, args: argparse.Namespace, size: tuple[int, int], deadline: float) -> None:
        self.args = args
        self.size = size
        self.deadline = deadline
        self.sessions = itertools.count(1_000_000)
        self.gen = greedy(1)

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
        return dict(**summary(ttfts, tails=True), requests=done, errors=len(errors),
                    error_samples=errors[:3], wall_s=round(wall, 3),
                    requests_per_s=round(done / wall, 2) if wall else None,
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
            a_ms = summary([r["ms"] for r in raw["a"][-1]["rows"]])["median_ms"]
            c_ms = summary([r["ms"] for r in raw["c"][-1]])["median_ms"]
            print(f"[bench] {path} rep {rep}: a {a_ms} ms, c {c_ms} ms, d "
                  f"{raw['d'][-1]['requests_per_s']} req/s ({self.left():.0f} s left)", flush=True)
        res["reps"] = len(raw["a"])
        res.update(summarise(raw, TURNS))
        res["raw"] = raw
        return res
