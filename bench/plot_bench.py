"""Chart of ``bench/e2e_lmdeploy.py bench`` results: time to first token, plain vs featcache.

    pip install matplotlib          # on the CPU machine, after the JSONs came back
    python bench/plot_bench.py bench-2b.json bench-26b.json --out docs/seed-bench.png

One panel per model (one JSON per model; a ``merge``d JSON counts as one), in the order given. In
each panel, grouped bars: (a) same image in a fresh context, (b) chat turns 1-4 resending the
image, (c) all-distinct images, (d) TTFT under 32 concurrent clients; plain and featcache side by
side, the bar at the median over all reps, the error bar from p10 to p90. A series the bench
flagged as noisy (p90 > 2x median) is hatched, and its ratio is left out of the title. Ratios in
the title are the bench's own (medians over all reps).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

GROUPS = [("(a) same image", "a_same_image_fresh_context"),
          *[(f"(b) turn {t}", f"b_multi_turn.turn_{t}") for t in range(1, 5)],
          ("(c) distinct", "c_distinct_images"),
          ("(d) 32 clients", "d_concurrent_32_clients_pool_8.ttft")]
ENGINES = [("plain", "plain lmdeploy", "#9e9e9e"), ("featcache", "featcache", "#1f77b4"),
           ("featcache_noprefix", "featcache (prefix caching off)", "#6baed6")]


def _get(d: dict[str, Any], path: str) -> dict[str, Any]:
    for k in path.split("."):
        d = d.get(k, {}) if isinstance(d, dict) else {}
    return d


def panel_data(result: dict[str, Any]) -> dict[str, Any]:
    """The numbers one panel draws: per engine, per group, (median, p10, p90, noisy) or None."""
    engines = [e for e, _, _ in ENGINES if e in result]
    data: dict[str, list[Any]] = {}
    for e in engines:
        row = []
        for _, path in GROUPS:
            s = _get(result[e], path)
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
            bits.append(name.format(r[key]))
    return p["label"] + ("\n" + ", ".join(bits) if bits else "")


def plot(results: list[dict[str, Any]], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [panel_data(r) for r in results]
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.6), squeeze=False)
    for ax, p in zip(axes[0], panels, strict=True):
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
    args = ap.parse_args(argv)
    results = []
    for path in args.inputs:
        with open(path) as f:
            results.append(json.load(f))
    plot(results, args.out)
    print(f"wrote {args.out}: {len(results)} panel(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
