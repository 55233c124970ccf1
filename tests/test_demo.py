"""`featcache demo` (issue 29 item 9): its cost is linear in the turns, a chat longer than it runs
is refused at once in one line, and every row of its table accounts for every image sent."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import pytest
import torch

from featcache import FeatureCache, config
from featcache.cli import main


def sent(k: int) -> int:
    """Images turn k (1-based) sends: its new one and the earlier ones still in the window."""
    return min(k, config.DEMO_WINDOW)


def test_each_row_accounts_for_every_image_and_a_turn_sends_a_bounded_window(tmp_path, capsys):
    turns = config.DEMO_WINDOW + 4
    assert main(["demo", "--turns", str(turns), "--cache-dir", str(tmp_path / "s"), "--device", "cpu",
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["bit_identical"] == turns
    for run in ("first", "after_restart"):
        rows = report["runs"][run]
        assert [r["images"] for r in rows] == [sent(k) for k in range(1, turns + 1)]
        for r in rows:  # encoded, each tier, or still on its way down: nothing unaccounted for
            assert r["encoded"] + r["device"] + r["host"] + r["disk"] + r["in_flight"] == r["images"]
    assert report["image_requests"] == 2 * sum(sent(k) for k in range(1, turns + 1))  # linear


def test_the_table_has_a_column_for_in_flight_hits_and_its_rows_add_up(tmp_path):
    """Entries still on their way down (the demotion held inside its copy) are served in flight:
    the table shows them, and each row still adds up to the images the turn sent."""
    from featcache import demo

    model = demo.TinyVisionEncoder().eval()
    per_image = 256 * 1024 * 4
    cache = FeatureCache(device="cpu", device_bytes=per_image, host_bytes=0,
                         disk_path=tmp_path / "s", disk_bytes=64 << 20)
    entered, opened = threading.Event(), threading.Event()
    to_host = cache._copier.to_host

    def held(*args, **kwargs):  # the demotion thread waits here: every put stays in flight
        entered.set()
        opened.wait(60)
        return to_host(*args, **kwargs)

    cache._copier.to_host = held
    lines: list[str] = []
    try:
        turns = demo.run_chat(cache, model, 4, torch.float32, model.identity,
                              demo._table("chat", lines.append))
    finally:
        opened.set()
        cache.close()
    assert entered.is_set()
    assert sum(t.sources["in_flight"] for t in turns) > 0
    for k, t in enumerate(turns, 1):
        assert t.images == sent(k) and sum(t.sources[s] for s in demo.SOURCES) == t.images
    header, rows = lines[1].split(), [line.split() for line in lines[2:]]
    assert header == ["turn", "images", "encoded", "device", "host", "disk", "in-flight", "ms"]
    for row in rows:  # the printed table adds up too
        assert int(row[1]) == sum(int(cell) for cell in row[2:7])


def test_a_long_chat_is_linear(tmp_path):
    """Lookups grow with the turns times the window, not with the turns squared."""
    from featcache import demo

    model = demo.TinyVisionEncoder().eval()
    turns = 3 * config.DEMO_WINDOW
    with FeatureCache(device="cpu", device_bytes=64 << 20, host_bytes=0) as cache:
        rows = demo.run_chat(cache, model, turns, torch.float32, model.identity)
        gets = cache.stats()["cache"]["gets"]
    assert gets == sum(t.images for t in rows) == sum(sent(k) for k in range(1, turns + 1))
    assert gets < config.DEMO_WINDOW * turns


def test_more_turns_than_it_runs_are_refused_at_once_in_one_line():
    out = subprocess.run([sys.executable, "-m", "featcache", "demo", "--turns", "100000"],
                         capture_output=True, text=True, timeout=20)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1
    most = config.DEMO_MAX_TURNS
    assert out.stderr.startswith(f"featcache demo: error: --turns 100000: the demo runs at most "
                                 f"{most} turns")
    from featcache import demo

    with pytest.raises(ValueError, match=f"1 to {most}"):
        demo.run(turns=most + 1)
