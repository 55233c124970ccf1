"""bench/serve_latency.py on the CPU: its plan, its statistics and tables, and its client (the
real `openai` package) against test_serve_chat's stand-in for lmdeploy's api_server."""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
from http.server import ThreadingHTTPServer

import _lmdeploy_stack
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.lib.load import load_test  # noqa: E402
from bench.lib.timing import quantile  # noqa: E402


def load():
    spec = importlib.util.spec_from_file_location("serve_latency",
                                                  os.path.join(ROOT, "bench", "serve_latency.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_plan_fits_the_budget_and_the_ids_server_sends_ids():
    sl = load()
    steps = sl.plan(list(sl.DEFAULT_SERVERS), list(sl.SOURCES), repeats=12)
    assert [(s, src) for s, src, _ in steps] == [
        ("plain", "data"), ("plain", "http"), ("plain", "file"), ("featcache", "data"),
        ("featcache", "http"), ("featcache", "file"), ("featcache_ids", "id")]
    assert all(n == 3 + 2 * 13 for _, _, n in steps)
    assert sl.estimate_s(steps, list(sl.DEFAULT_SERVERS), load_s=60) <= 530  # the default --budget
    assert sl.sources_for("featcache_mp", ["file"]) == ["file"]  # the mp server resends its bytes
    hit = sl.messages(sl.image_item("id", "data:x", "http://h/a.png", "/a.png", "i", first=False),
                      sl.question(1), "A0")
    assert hit[0]["content"][1] == {"type": "image_url", "uuid": "i"}  # no bytes on a hit turn
    assert [m["role"] for m in hit] == ["user", "assistant", "user"]
    text = sl.text_messages(5, sl.question(1), "A0")
    assert text[0]["content"].split()[-5:] == "the quick brown fox jumps".split()
    assert text[1:] == hit[1:]  # the same new text after the image / the filler
    assert sl.question(1) != sl.question(2)


def test_statistics_and_side_by_side_rows():
    sl = load()
    assert quantile([], 0.5) is None and quantile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert quantile([float(i) for i in range(1, 11)], 0.9) == 9.1
    results = {"featcache": {"data": {
        "hit": [{"ttft_ms": 24.0, "prompt_tokens": 3500, "cached_tokens": 3456,
                 "stages": {"rows": [("featcache keying", "featcache", 0.2)],
                            "totals": {"featcache": 2.0, "lmdeploy": 15.0}}}] * 3,
        "text": [{"ttft_ms": 20.0, "prompt_tokens": 3490, "cached_tokens": 3456}] * 3}}}
    (row,) = sl.side_by_side(results)
    assert row["ratio"] == 1.2 and row["hit_new"] == 44.0 and row["text_new"] == 34.0
    assert row["hit_fc_ms"] == 2.0 and row["hit_lmdeploy_ms"] == 15.0 and row["n"] == 3
    assert sl.stage_medians(results["featcache"]["data"]["hit"]) == [("featcache keying", "featcache", 0.2)]


def test_dry_run_prints_the_plan_and_a_table(capsys):
    sl = load()
    assert sl.main(["--model", "/m/x", "--dry-run", "--out", "/tmp/never"]) == 0
    out = capsys.readouterr().out
    assert "serve_stages.py --stages-out" in out
    assert "--allow-loopback-media -- lmdeploy serve api_server" in out
    assert "--trust-client-image-ids" in out and "--eager-mode" not in out  # CUDA graphs on
    assert "hit turn vs text-only turn" in out and "load: concurrent chat clients" in out
    assert not os.path.exists("/tmp/never")
    # the file source's image lies in OUT: featcache serve is told it may read files there
    servers = [line for line in out.splitlines() if "featcache serve" in line]
    assert servers and all("--allowed-local-media-path /tmp/never" in line for line in servers)


@pytest.fixture
def fake_server():
    _lmdeploy_stack.need("openai", stack=False)
    from test_serve_chat import Fake

    server = ThreadingHTTPServer(("127.0.0.1", 0), Fake)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    Fake.requests.clear()
    yield f"http://127.0.0.1:{server.server_address[1]}", Fake
    server.shutdown()


def test_latency_rounds_and_load_through_the_openai_client(fake_server, tmp_path, capsys):
    sl = load()
    base, fake = fake_server
    files = {"url": "data:image/png;base64,AAAA", "http": "http://127.0.0.1:1/a.png", "path": "/a.png"}
    res, sent = sl.latency(base, "tiny", ["file", "id"], files, repeats=2, max_tokens=2)
    assert sent == 2 * (3 + 2 * 3)
    for kind in ("file", "id"):
        assert not res[kind]["errors"] and len(res[kind]["hit"]) == len(res[kind]["text"]) == 2
        assert all(r["ttft_ms"] is not None for r in res[kind]["hit"] + res[kind]["text"])
    hits = [r for r in fake.requests if isinstance(r["messages"][0]["content"], list)]
    assert hits[0]["messages"][0]["content"][1] == {"type": "image_url", "image_url": {"url": "/a.png"}}
    ids = [r["messages"][0]["content"][1] for r in hits if "uuid" in r["messages"][0]["content"][1]]
    assert ids[0]["image_url"]["url"] == "data:image/png;base64,AAAA"  # the warm-up sends the bytes
    assert all("image_url" not in item for item in ids[1:])  # the hit turns the id alone

    lt = load_test(base, "tiny", ["data:image/png;base64,AAAA", "data:image/png;base64,BBBB"],
                      clients=4, seconds=0.5, max_tokens=2)
    assert lt["failed"] == 0 and lt["requests"] > 0 and lt["ttft_p99"] >= lt["ttft_p50"]
    mixed = load_test(base, "tiny", ["data:image/png;base64,AAAA"], clients=2, seconds=0.5,
                         max_tokens=2, text_clients=2)
    paced = load_test(base, "tiny", ["data:image/png;base64,AAAA"], clients=2, seconds=1.0,
                      max_tokens=2, text_clients=2, turn_interval=0.25)
    # each of the 4 clients starts a turn at most every 0.25 s: at most 5 turns each in 1 s
    assert 4 <= paced["requests"] <= 4 * 5 and paced["failed"] == 0, paced
    assert paced["turn_interval"] == 0.25 and paced["late_turns"] >= 0
    assert lt["requests"] > paced["requests"]  # the closed loop sent as fast as it was answered
    classes = mixed["classes"]
    assert {"image_first_turn", "text_first_turn"} <= set(classes)  # per request class
    assert sum(c["n"] for c in classes.values()) == mixed["requests"]
    assert all(c["ttft_p99"] >= c["ttft_p50"] for c in classes.values())
    texts = [r for r in fake.requests if not any(isinstance(m["content"], list) for m in r["messages"])]
    assert texts  # the text clients sent no image
    capsys.readouterr()
    sl.print_tables({}, {"featcache_mp": mixed})
    table = capsys.readouterr().out
    assert "per request class" in table and "text_first_turn" in table


def test_the_profile_summary_reads_py_spys_raw_stacks_per_process_and_thread():
    spec = importlib.util.spec_from_file_location("pyspy", os.path.join(ROOT, "bench", "pyspy.py"))
    pyspy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pyspy)

    raw = ('process 7:"python3 -c \nimport a; b()\n";thread (8): MainThread;main (a.py:1);parse (j.py:2) 5\n'
           'process 7:"python3 -c \nimport a; b()\n";thread (8): MainThread;main (a.py:1) 3\n'
           'process 9:"engine";thread (10): loop;step (e.py:4) 7\n')
    s = pyspy.summarize(raw)
    main = s['process 7:"python3 -c import a; b()" / thread (8): MainThread']
    assert main["samples"] == 8
    assert main["self"] == [("parse (j.py:2)", 5), ("main (a.py:1)", 3)]
    assert main["inclusive"][0] == ("main (a.py:1)", 8)
    assert s['process 9:"engine" / thread (10): loop']["self"] == [("step (e.py:4)", 7)]
