"""bench/e2e_lmdeploy.py's statistics and dry-run (bench/e2e/), bench/plot_bench.py on a synthetic
result (CPU)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)
from bench import plot_bench  # noqa: E402
from bench.e2e.check import last_logits_diff, logits_verdict  # noqa: E402
from bench.e2e.speed import add_ratios  # noqa: E402
from bench.lib.timing import spread  # noqa: E402


def _series(xs: list[float]) -> dict:
    return spread(xs)


def _result(label: str, plain_a: list[float]) -> dict:
    def engine(a: list[float], k: float) -> dict:
        return {"a_same_image_fresh_context": _series(a),
                "b_multi_turn": {f"turn_{t}": _series([k * 50.0 + t] * 6) for t in range(1, 5)},
                "c_distinct_images": _series([80.0, 82.0, 85.0]),
                "d_concurrent_32_clients_pool_8": dict(
                    requests_per_s=10.0 / k, requests_per_s_by_rep=[10.0 / k] * 3, noisy=False,
                    ttft=_series([300.0 * k] * 5))}
    r = {"meta": {"label": label}, "model": label, "engines": ["plain", "featcache"],
         "plain": engine(plain_a, 1.0), "featcache": engine([20.0, 21.0, 22.0], 0.5)}
    add_ratios(r, 2.0)
    return r


def test_spread_and_ratios_flag_a_noisy_series() -> None:
    s = spread([60.0] * 7 + [400.0] * 3)
    assert s["median_ms"] == 60.0 and s["p90_ms"] == 400.0 and s["noisy"]
    assert not spread([60.0, 61.0, 70.0])["noisy"]
    quiet = _result("m", [60.0, 62.0, 64.0])["ratios"]
    assert quiet["a_same_image_speedup"] == round(62.0 / 21.0, 2) and not quiet["flagged"]
    assert quiet["c_distinct_slowdown"] == 1.0 and quiet["d_requests_per_s_gain"] == 2.0
    noisy = _result("m", [60.0] * 7 + [400.0] * 3)["ratios"]
    assert noisy["a_same_image_speedup"] is None
    assert "plain p90 400.0" in noisy["flagged"]["a_same_image_speedup"]
    assert noisy["b_turn_1_speedup"] is not None  # only the noisy series loses its ratio


def test_plot_bench_writes_png(tmp_path) -> None:
    """Runs in CI: matplotlib is in the test extra (pip install -e '.[test]'), so without it this
    test fails, naming it, rather than skipping."""
    import matplotlib  # noqa: F401
    paths = []
    for i, a in enumerate(([60.0, 62.0, 64.0], [60.0] * 7 + [400.0] * 3)):
        p = tmp_path / f"r{i}.json"
        p.write_text(json.dumps(_result(f"model {i}", a)))
        paths.append(str(p))
    out = tmp_path / "chart.png"
    assert plot_bench.main([*paths, "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    panel = plot_bench.panel_data(json.loads(open(paths[1]).read()))
    assert panel["data"]["plain"][0][3] is True  # the noisy (a) is drawn hatched
    assert "(a)" not in plot_bench.title(panel)  # and makes no ratio in the title


def test_plot_bench_reads_a_turbomind_result() -> None:
    """A turbomind_bench.py JSON (the recorded 2B run) becomes a panel whose medians are the
    bench's own, native drawn as featcache."""
    path = os.path.join(_ROOT, "bench", "results", "seed-tmbench-2b-2026-11-30.json")
    with open(path) as f:
        result = json.load(f)
    panel = plot_bench.panel_data(result)
    assert panel["engines"] == ["plain", "featcache"] and "TurboMind" in panel["label"]
    for engine, path_name in (("plain", "plain"), ("featcache", "native")):
        e = result["engines"][path_name]
        a_med, a_lo, a_hi, _ = panel["data"][engine][0]
        assert a_med == e["a_same_image_fresh_context"]["median_ms"] and a_lo <= a_med <= a_hi
        assert panel["data"][engine][4][0] == e["b_chat"]["turn_4"]["median_ms"]
        assert panel["data"][engine][6][0] == e["d_concurrent"]["ttft_median_ms"]
    assert "2.89x faster" in plot_bench.title(panel)


def test_plot_bench_draws_the_turbomind_path_it_is_asked_for() -> None:
    """``--tm-paths``: the 26B run's combined configuration drawn as featcache, its ratios in the
    title; a path the result lacks is refused, naming what it has."""
    path = os.path.join(_ROOT, "bench", "results", "p28-tmbench-26b-h200-2026-12-02.json")
    with open(path) as f:
        result = json.load(f)
    panel = plot_bench.panel_data(result, "combined")
    e = result["engines"]["combined"]
    assert panel["data"]["featcache"][0][0] == e["a_same_image_fresh_context"]["median_ms"]
    native = result["engines"]["native"]["a_same_image_fresh_context"]["median_ms"]
    assert panel["data"]["featcache"][0][0] != native
    assert "2.58x faster" in plot_bench.title(panel)
    with pytest.raises(ValueError, match="no engine 'combined'.*native"):
        with open(os.path.join(_ROOT, "bench", "results", "seed-tmbench-2b-2026-11-30.json")) as f:
            plot_bench.panel_data(json.load(f), "combined")


@pytest.mark.skipif(importlib.util.find_spec("lmdeploy") is None, reason="lmdeploy is not installed")
def test_dry_run(tmp_path) -> None:
    """bench and breakdown over the stand-in pipeline, in a subprocess (the stage timers patch
    lmdeploy's model classes for the rest of the process)."""
    r = subprocess.run([sys.executable, os.path.join(_ROOT, "bench", "e2e_lmdeploy.py"), "dry-run",
                        "--json", str(tmp_path / "dry")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "DRY-RUN OK" in r.stdout
    b = json.loads((tmp_path / "dry-bench.json").read_text())
    assert b["plain"]["reps"] == 2 and "ratios" in b
    d = json.loads((tmp_path / "dry-breakdown.json").read_text())
    assert d["answer"]["featcache_hit_vision_calls"] == 0


def test_logits_verdict_compares_only_like_for_like() -> None:
    def row(label: str, digests: list[str], cached: int = 0, lens: list[int] | None = None) -> dict:
        return dict(label=label, cached_tokens=[cached],
                    prefill_logits=[dict(seqlens=lens or [10], image_at=3, digests=digests)])

    plain = [row("a", ["x"]), row("b", ["y"]), row("c", ["z"]), row("d", ["w"], lens=[4, 6]),
             row("e", ["v"], cached=64)]
    other = [row("a", ["x"]), row("b", ["DIFF"]), row("c", ["q"], cached=64), row("d", ["w"], lens=[10]),
             row("e", ["v"], cached=64)]
    v = logits_verdict(plain, other)
    assert v["identical"] == 2 and v["differ"] == ["b"]
    assert v["not_compared"] == ["c (cached tokens)", "d (scheduled otherwise)"]


def test_last_logits_diff() -> None:
    import torch

    a = [dict(label="x", _last=[torch.tensor([1.0, 2.0])]), dict(label="y", _last=[])]
    b = [dict(label="x", _last=[torch.tensor([1.0, 2.5])]), dict(label="y", _last=[])]
    assert last_logits_diff(a, b) == {"x": 0.5}
