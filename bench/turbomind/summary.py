"""A path's figures from its raw rows: per series the nearest-rank median, p90, p99, min and max
over all reps (``timing.summary``), each rep's median, the cached tokens seen, and the median of
each per-request step (``parts``); (d)'s medians over its reps; the requests that failed."""

from __future__ import annotations

import statistics
from typing import Any

from bench.lib.timing import summary
from bench.turbomind.probes import derive


def parts_medians(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Median over requests of each per-request figure (0 where a step did not run)."""
    derived = [derive(r["parts"], r["ms"]) for r in rows]
    names = sorted({k for d in derived for k in d})
    return {k: round(statistics.median(d.get(k, 0.0) for d in derived), 3) for k in names}


def summarise(raw: dict[str, list[Any]], turns: int) -> dict[str, Any]:
    """The summaries of raw (a)-(d) (``turns`` turns a chat in (b)), keyed as the results file
    keeps them (bench/plot_bench.py reads them)."""
    def stats(xs: list[float]) -> dict[str, float]:
        return summary(xs, tails=True)

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
                   for t in range(turns)} if chats else {},
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
