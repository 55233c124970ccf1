"""Chart of ``bench/e2e_lmdeploy.py bench`` results: time to first token, plain vs featcache.

    pip install matplotlib          # on the CPU machine, after the JSONs came back
    python bench/plot_bench.py bench-2b.json bench-26b.json --out docs/seed-bench.png

One panel per model (one JSON per model; a ``merge``d JSON counts as one), in the order given; a
``bench/turbomind_bench.py`` JSON makes a TurboMind panel (its engine ``plain`` and, drawn as
featcache, the path ``--tm-paths`` names for it, ``native`` by default; p10 and p90 from its raw
per-request times; (d) keeps per-rep medians only: its bar spans median-p90). In
each panel, grouped bars: (a) same image in a fresh context, (b) chat turns 1-4 resending the
image, (c) all-distinct images, (d) TTFT under 32 concurrent clients; plain and featcache side by
side, the bar at the median over all reps, the error bar from p10 to p90. A series the bench
flagged as noisy (p90 > 2x median) is hatched, and its ratio is left out of the title. Ratios in
the title are the bench's own (medians over all reps).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench.lib

from bench.lib import models  # noqa: E402
from bench.lib.results import at  # noqa: E402
from bench.lib.timing import spread  # noqa: E402

GROUPS = [("(a) same image", "a_same_image_fresh_context"),
          *[(f"(b) turn {t}", f"b_multi_turn.turn_{t}") for t in range(1, 5)],
          ("(c) distinct", "c_distinct_images"),
          ("(d) 32 clients", "d_concurrent_32_clients_pool_8.ttft")]
ENGINES = [("plain", "plain lmdeploy", "#9e9e9e"), ("featcache", "featcache", "#1f77b4"),
           ("featcache_noprefix", "featcache (prefix caching off)", "#6baed6")]


def from_turbomind(result: dict[str, Any], tm_path: str = "native") -> dict[str, Any]:
    """A ``turbomind_bench.py`` result in the shape ``panel_data`` reads (engine ``tm_path`` drawn
    as featcache), with p10/p90 over its raw per-request times (``timing.spread``: the bench's own
    nearest-rank median and p90, the p10 it does not keep, noisy past 2x the median)."""
    engines = result.get("engines", {})
    if tm_path not in engines:
        raise ValueError(f"the TurboMind result has no engine {tm_path!r} (it has {sorted(engines)})")
    out: dict[str, Any] = dict(meta=dict(label=result.get("meta", {}).get("label")
                                         or _model_label(result) + " (TurboMind)"))
    for path, e in engines.items():
        if path not in ("plain", tm_path) or "failed" in e or "raw" not in e:
            continue
        raw = e["raw"]
        turns: dict[str, list[float]] = {}
        for rep in raw["b"]:
            for chat in rep:
                for t, row in enumerate(chat, 1):
                    turns.setdefault(f"turn_{t}", []).append(row["ms"])
        d = e.get("d_concurrent", {})
        out["featcache" if path == tm_path else path] = dict(
            a_same_image_fresh_context=spread([r["ms"] for rep in raw["a"] for r in rep["rows"]]),
            b_multi_turn={t: spread(v) for t, v in turns.items()},
            c_distinct_images=spread([r["ms"] for rep in raw["c"] for r in rep]),
            d_concurrent_32_clients_pool_8=dict(ttft=dict(
                n=d.get("requests", 0), median_ms=d.get("ttft_median_ms"), p10_ms=d.get("ttft_median_ms"),
                p90_ms=d.get("ttft_p90_ms")) if d else {}))
    r = result.get("ratios", {}).get(tm_path, {})
    out["ratios"] = dict(a_same_image_speedup=r.get("a_speedup_median"),
                         b_turn_4_speedup=r.get("b_turn_4_speedup_median"),
                         c_distinct_slowdown=r.get("c_slowdown_median"),
                         d_requests_per_s_gain=r.get("d_requests_per_s_gain"))
    return out


def _model_label(result: dict[str, Any]) -> str:
    return models.label(str(result.get("meta", {}).get("args", {}).get("model", "?")))


def panel_data(result: dict[str, Any], tm_path: str = "native") -> dict[str, Any]:
    """The numbers one panel draws: per engine, per group, (median, p10, p90, noisy) or None;
    ``tm_path``: the path a TurboMind result's panel draws as featcache."""
    if isinstance(result.get("engines"), dict):  # bench/turbomind_bench.py
        result = from_turbomind(result, tm_path)
    engines = [e for e, _, _ in ENGINES if e in result]
    data: dict[str, list[Any]] = {}
    for e in engines:
        row = []
        for _, path in GROUPS:
            s = at(result[e], path)
            row.append((s["median_ms"], s["p10_ms"], s["p90_ms"], bool(s.get("noisy")))
                       if s.get("n") else None)
        data[e] = row
    label = result.get("meta", {}).get("label") or str(result.get("model", "?"))
    return dict(label=label, engines=engines, data=data, ratios=result.get("ratios", {}))


def title(p: dict[str, Any]) -> str:
    r = p["ratios"]
    bits = []
    for key, name in (("a_same_image_speedup", "(a) {}x faster"), ("b_turn_4_speedup", "(b) turn 4 {}x"),
                      ("c_distinct_slowdown", "(c) misses {}x the time"),
                      ("d_requests_per_s_gain", "(d) {}x req/s")):
        if r.get(key) is not None:
            bits.append(name.format(round(r[key], 2)))
    return p["label"] + ("\n" + ", ".join(bits) if bits else "")


def plot(results: list[dict[str, Any]], out: str, labels: list[str] | None = None,
         tm_paths: list[str] | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = tm_paths or ["native"] * len(results)
    panels = [panel_data(r, t) for r, t in zip(results, paths, strict=True)]
    for p, label in zip(panels, labels or [], strict=False):  # no labels: keep their own
        p["label"] = label
    cols = min(len(panels), 2)
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(6.5 * cols, 4.6 * rows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    for ax, p in zip(axes.flat, panels, strict=False):  # spare axes were switched off above
        n = len(p["engines"])
        width = 0.8 / max(n, 1)
        for j, e in enumerate(p["engines"]):
            name, colour = next((lbl, c) for k, lbl, c in ENGINES if k == e)
            for i, cell in enumerate(p["data"][e]):
                if cell is None:
                    continue
                med, lo, hi, noisy = cell
                x = i + (j - (n - 1) / 2) * width
                ax.bar(x, med, width, color=colour, hatch="//" if noisy else None,
                       edgecolor="black" if noisy else colour, label=name if i == 0 else None)
                ax.errorbar(x, med, yerr=[[max(0.0, med - lo)], [max(0.0, hi - med)]], fmt="none",
                            ecolor="black", capsize=2, linewidth=0.8)
                ax.annotate(f"{med:.0f}", (x, max(med, hi)), xytext=(0, 2), textcoords="offset points",
                            ha="center", va="bottom", fontsize=6)
        ax.set_xticks(range(len(GROUPS)))
        ax.set_xticklabels([g for g, _ in GROUPS], rotation=30, ha="right", fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel("time to first token, ms (median; p10-p90; log scale)")
        ax.set_title(title(p), fontsize=10)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("inputs", nargs="+", help="bench JSONs, one per model (panel order)")
    ap.add_argument("--out", required=True, help="PNG to write")
    ap.add_argument("--labels", help="panel titles separated by ;, in the order of the inputs "
                    "(default: each result's label)")
    ap.add_argument("--tm-paths", help="for each input, separated by ;, the TurboMind path drawn as "
                    "featcache (native, features or combined; ignored for PyTorch-engine inputs); "
                    "one name: every input (default native)")
    args = ap.parse_args(argv)
    labels = args.labels.split(";") if args.labels else []
    if labels and len(labels) != len(args.inputs):
        ap.error(f"--labels names {len(labels)} panels for {len(args.inputs)} inputs")
    tm_paths = (args.tm_paths or "native").split(";")
    if len(tm_paths) == 1:
        tm_paths *= len(args.inputs)
    if len(tm_paths) != len(args.inputs):
        ap.error(f"--tm-paths names {len(tm_paths)} paths for {len(args.inputs)} inputs")
    results = []
    for path in args.inputs:
        with open(path) as f:
            results.append(json.load(f))
    try:
        plot(results, args.out, labels, tm_paths)
    except ValueError as e:
        ap.error(str(e))
    print(f"wrote {args.out}: {len(results)} panel(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
