"""bench/eviction.py runs on the CPU: its dry run replays every trace at every budget through
both policies' books, writes its report, and the figures hold together."""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
import eviction  # noqa: E402


def test_the_dry_run_replays_every_trace_and_writes_its_report(tmp_path, capsys):
    """Every development trace at each of the dry run's budgets, through every policy's books:
    the hit ratios and savings hold together and each replay is the trace's length."""
    out = tmp_path / "eviction.json"
    assert eviction.main(["--dry-run", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    report = json.loads(out.read_text())
    rows = report["sets"]["dev"]["rows"]
    traces = [shape.name for shape, _ in eviction.dev()]
    assert sorted((r["trace"], r["budget_bytes"]) for r in rows) == sorted(
        (t, b) for t in traces for b in (64 << 20, 256 << 20, 1 << 30))
    for r in rows:
        assert set(r["saved_s"]) == set(r["hit_ratio"]) == {"lru", "value", "admit"}
        for policy in r["saved_s"]:
            assert 0 <= r["hit_ratio"][policy] <= 1
            assert 0 <= r["saved_s"][policy] <= r["ceiling_s"] + 1e-6  # nothing saves more
        assert [p["policy"] for p in r["replays"]] == ["lru", "value", "admit"]
        assert all(p["requests"] == r["requests"] > 0 for p in r["replays"])
        assert f"| {r['trace']} | " in printed
    assert set(report["verdicts"]) >= {"dev_within_2pct", "cost_met"}
    assert "books' cost per call" in printed and report["run"]["source_digest"]


def test_the_replay_uses_the_tiers_books_and_value_wins_where_costs_differ():
    """The zipf trace (the four image classes: 26B's features save 3.7x the 2B's per byte), with
    room for a fifth of its images' bytes: value saves more vision time than LRU."""
    trace = eviction.zipf_trace(1, 4000, 100)
    lru = eviction.replay(trace, trace.distinct_bytes // 5, "lru")
    value = eviction.replay(trace, trace.distinct_bytes // 5, "value")
    assert lru.requests == value.requests == 4000
    assert value.saved_s > lru.saved_s
    total = sum(trace.costs)  # the same requests' costs, split between hits and misses
    assert lru.saved_s + lru.spent_s == pytest.approx(total) == value.saved_s + value.spent_s
