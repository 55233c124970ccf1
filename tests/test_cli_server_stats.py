"""``featcache stats --url``: a running server's hit ratios, read from its /metrics page (here a
real HTTP server in a thread serving ``featcache.metrics.render`` of a real cache)."""

from __future__ import annotations

import http.server
import json
import socket
import subprocess
import sys
import threading

import pytest
import torch

from featcache import FeatureCache, metrics
from featcache.cli import main, scrape
from featcache.errors import FeatCacheError


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


def _numbers(doc, path=""):
    """(path, value) of every number in a JSON document."""
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _numbers(v, f"{path}.{k}")
    elif isinstance(doc, (int, float)) and not isinstance(doc, bool):
        yield path, doc


def test_stats_url_json_counts_are_integers(server, capsys):
    """The exposition format writes counters as floats (6.0); --json gives counts as integers,
    only the ratios are fractions (issue 29 item 7)."""
    for page in ("/metrics", "/mp"):
        assert main(["stats", "--url", server + page, "--json"]) == 0
        out = capsys.readouterr().out
        numbers = list(_numbers(json.loads(out)))
        assert len(numbers) > 10
        for path, value in numbers:
            assert isinstance(value, int) or path.endswith("hit_ratio"), (path, value)


@pytest.fixture
def not_http():
    """A TCP server that answers every connection with a line that is not HTTP."""
    sock = socket.create_server(("127.0.0.1", 0))

    def serve():
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            with conn:
                conn.recv(4096)
                conn.sendall(b"-ERR unknown command\r\n")

    threading.Thread(target=serve, daemon=True).start()
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    sock.close()


@pytest.mark.parametrize("args,code,words", [
    (["--url", "ftp://x"], 2, "not an http(s) address"),
    (["--url", "http://localhost:port"], 2, "'http://localhost:port' is not an http(s) address"),
    (["--url", "http://[::1"], 2, "is not an http(s) address"),
    (["--url", "http://127.0.0.1:1"], 1, "cannot reach http://127.0.0.1:1/metrics (Connection "
     "refused): check that featcache serve runs there and listens on that host and port"),
    (["--url", "{server}/nope"], 1, "{server}/nope answered HTTP 404"),
    (["--url", "{not_http}"], 1, "{not_http}/metrics did not answer as an HTTP server"),
    (["--url", "{server}/other"], 1, "no featcache metrics at {server}/other: check that"),
    (["DIR", "--url", "{server}"], 2, "without DIR"),
])
def test_stats_url_failures_are_one_line(server, not_http, args, code, words):
    def fill(text):
        return text.replace("{server}", server).replace("{not_http}", not_http)

    argv = [fill(a) for a in args]
    words = fill(words)
    r = subprocess.run([sys.executable, "-m", "featcache", "stats", *argv], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == code and words in r.stderr, r.stderr
    assert r.stderr.strip().count("\n") == 0 and "Traceback" not in r.stderr


def test_a_server_that_does_not_answer_is_named_with_the_time_waited():
    sock = socket.create_server(("127.0.0.1", 0), backlog=8)  # listens, never accepts
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        with pytest.raises(FeatCacheError) as e:
            scrape.server_stats(url, timeout_s=0.3)
    finally:
        sock.close()
    message = str(e.value)
    assert message.startswith(f"no answer from {url}/metrics in 0.3 s: check that featcache serve "
                              "runs there"), message
