"""``featcache stats --url``: a running server's hit ratios, read from its /metrics page (here a
real HTTP server in a thread serving ``featcache.metrics.render`` of a real cache)."""

from __future__ import annotations

import http.server
import json
import subprocess
import sys
import threading

import pytest
import torch

from featcache import FeatureCache, metrics
from featcache.cli import main


@pytest.fixture
def server():
    cache = FeatureCache(device="cpu", device_bytes="1MiB", host_bytes="1MiB")
    keys = [bytes([i]) * 16 for i in range(3)]
    for k in keys:
        cache.put(k, torch.ones(8))
    for k in keys + keys:
        cache.get(k)  # 6 hits
    cache.get(b"\xff" * 16)  # 1 miss
    cache.count("lmdeploy", "images", 4)
    cache.count("lmdeploy", "hits", 3)
    cache.count("lmdeploy", "misses", 1)
    engine = [{"rank": r, "pid": 1, "stats": {
        "cache": {"hits": 5 + r, "misses": 5 - r},
        "device": {"hits": 5 + r, "misses": 5 - r, "entries": 2, "bytes": 64},
        "lmdeploy": {"vision_images": 2, "vision_skipped": 8}}} for r in (0, 1)]
    pages = {"/metrics": metrics.render(cache).encode(), "/other": b"# nothing of ours\nx 1\n",
             "/mp": metrics.render_families(metrics.families(cache)
                                            + metrics.process_families(engine)).encode()}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            body = pages.get(self.path)
            self.send_response(200 if body is not None else 404)
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *a):
            pass

    httpd = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    cache.close()


def test_stats_url_reads_hit_ratios(server, capsys):
    assert main(["stats", "--url", server, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["url"] == server + "/metrics"
    assert doc["lookups"] == {"hit": 6, "miss": 1} and doc["hit_ratio"] == round(6 / 7, 4)
    assert doc["tiers"]["device"]["hits"] == 6 and doc["tiers"]["device"]["entries"] == 3
    assert doc["lmdeploy"]["hit_ratio"] == 0.75
    assert main(["stats", "--url", server]) == 0
    out = capsys.readouterr().out
    assert "hit ratio 85.7%" in out and "images (lmdeploy): 4, 3 hits, 1 misses, hit ratio 75.0%" in out


def test_stats_url_sums_up_each_model_process(server, capsys):
    """A server whose model runs in other processes: each rank's cache beside the server's."""
    assert main(["stats", "--url", server + "/mp", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["lookups"] == {"hit": 6, "miss": 1}  # the server's own
    ranks = doc["model_processes"]
    assert list(ranks) == ["0", "1"]
    assert ranks["1"]["lookups"] == {"hit": 6, "miss": 4} and ranks["1"]["hit_ratio"] == 0.6
    assert ranks["0"]["tiers"]["device"]["entries"] == 2
    assert ranks["0"]["lmdeploy"]["vision_skipped"] == 8
    assert main(["stats", "--url", server + "/mp"]) == 0
    out = capsys.readouterr().out
    assert "model process, rank 1 (its own cache):\n  lookups: 6 hits, 4 misses, hit ratio 60.0%" in out
    assert "  vision model (lmdeploy): 2 images computed in 0 calls, 8 served from the cache" in out


def test_the_exported_gauges_say_the_same(server):
    import urllib.request

    text = urllib.request.urlopen(server + "/metrics").read().decode()
    assert f"featcache_hit_ratio {6 / 7}" in text and "featcache_lmdeploy_hit_ratio 0.75" in text


@pytest.mark.parametrize("args,code,words", [
    (["--url", "ftp://x"], 2, "not an http(s) address"),
    (["--url", "http://127.0.0.1:1"], 1, "Connection refused"),
    (["--url", "{server}/other"], 1, "no featcache metrics"),
    (["DIR", "--url", "{server}"], 2, "without DIR"),
])
def test_stats_url_failures_are_one_line(server, args, code, words):
    argv = [a.replace("{server}", server) for a in args]
    r = subprocess.run([sys.executable, "-m", "featcache", "stats", *argv], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == code and words in r.stderr, r.stderr
    assert r.stderr.strip().count("\n") == 0 and "Traceback" not in r.stderr
