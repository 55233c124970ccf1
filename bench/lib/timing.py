"""Series of times and their statistics, one definition each (every benchmark's figures come
from these).

Two quantiles, kept apart because recorded figures were made with each:

- ``percentile``: the nearest rank (``xs[round(q * (n - 1))]``): the PyTorch-engine and TurboMind
  benches' p10/p90/p99 (``summary``, ``spread``), the CLI start's p90, the charts;
- ``quantile``: linear interpolation between ranks, None for no values, rounded to 0.01 ms: the
  served benches' (serve_latency) p50/p90/p99.

A series is ``noisy`` when its p90 exceeds ``limit`` x its median: such a series makes no ratio.
"""

from __future__ import annotations

import functools
import inspect
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any


def percentile(xs: list[float], q: float) -> float:
    """The nearest-rank q-quantile (0..1) of ``xs`` (not empty)."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def quantile(values: Sequence[float | None], q: float) -> float | None:
    """The q-quantile (0..1) by linear interpolation, rounded to 0.01; None for no values (a
    None among them is left out)."""
    vals = sorted(v for v in values if v is not None)
    if not vals:
        return None
    pos = (len(vals) - 1) * q
    lo, hi = int(pos), min(int(pos) + 1, len(vals) - 1)
    return round(vals[lo] + (vals[hi] - vals[lo]) * (pos - lo), 2)


def summary(ms: list[float], tails: bool = False) -> dict[str, float]:
    """Count, median and (nearest-rank) p90 of a series in ms; ``tails``: its p99, min and max too
    (the TurboMind bench's figures). A series of none is ``{"n": 0}``."""
    if not ms:
        return dict(n=0)
    out = dict(n=len(ms), median_ms=round(statistics.median(ms), 2), p90_ms=round(percentile(ms, 0.9), 2))
    if tails:
        out.update(p99_ms=round(percentile(ms, 0.99), 2), min_ms=round(min(ms), 2), max_ms=round(max(ms), 2))
    return out


def spread(xs: list[float], limit: float = 2.0) -> dict[str, Any]:
    """Median and spread of one series (all reps pooled); ``noisy`` when p90 > ``limit`` x median:
    such a series makes no ratio."""
    if not xs:
        return dict(n=0, noisy=True)
    med = statistics.median(xs)
    p90 = percentile(xs, 0.9)
    return dict(n=len(xs), median_ms=round(med, 2), p10_ms=round(percentile(xs, 0.1), 2),
                p90_ms=round(p90, 2), min_ms=round(min(xs), 2), max_ms=round(max(xs), 2),
                noisy=bool(p90 > limit * med))


def rep_medians(reps: list[list[float]]) -> list[float]:
    """Each repetition's median (ms, 0.01), the empty ones left out."""
    return [round(statistics.median(r), 2) for r in reps if r]


def timed_call(fn: Callable[..., Any], record: Callable[[float], Any]) -> Callable[..., Any]:
    """``fn`` (a function or a coroutine function) wrapped: same arguments, same result, and each
    call's wall time in ms handed to ``record`` once it returns or raises."""
    if inspect.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def timed_async(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return await fn(*a, **k)
            finally:
                record((time.perf_counter() - t) * 1e3)
        return timed_async

    @functools.wraps(fn)
    def timed(*a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            record((time.perf_counter() - t) * 1e3)
    return timed


def median_call_ms(fn: Callable[..., Any], repeats: int, make: Callable[[], Any] | None = None,
                   setup: Callable[[], Any] | None = None, warmup: int = 0,
                   sync: Callable[[], Any] | None = None) -> float:
    """Median wall time in ms of ``fn()`` over ``repeats`` calls, after ``warmup`` untimed ones.
    ``make``: ``fn(make())``, the argument made before the clock starts; ``setup``: runs before
    each call, untimed; ``sync``: waits for the call's device work (before the clock starts, and
    after the call inside the timing)."""
    def call() -> None:
        fn(*(() if make is None else (make(),)))

    for _ in range(warmup):
        if setup is not None:
            setup()
        call()
    if sync is not None:
        sync()
    times = []
    for _ in range(repeats):
        if setup is not None:
            setup()
        arg = () if make is None else (make(),)
        if sync is not None:
            sync()
        t = time.perf_counter()
        fn(*arg)
        if sync is not None:
            sync()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)
