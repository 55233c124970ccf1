"""bench/serve_chat.py on the CPU: its commands parse with featcache's and lmdeploy's own parsers,
and its client (the real `openai` package) reads what lmdeploy's api_server streams (token ids
in chunks with no text, usage with cached tokens, featcache's counters on /metrics) from a
stand-in HTTP server that speaks lmdeploy's wire format."""

from __future__ import annotations

import importlib.util
import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import _lmdeploy_stack
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load():
    spec = importlib.util.spec_from_file_location("serve_chat", os.path.join(ROOT, "bench", "serve_chat.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_dry_run_builds_both_servers_for_turbomind(capsys, tmp_path):
    sc = load()
    cmds = sc.commands("/m/x", "turbomind", str(tmp_path / "store"))
    assert cmds["plain"][1:6] == ["-m", "lmdeploy", "serve", "api_server", "/m/x"]
    assert cmds["featcache"][1:5] == ["-m", "featcache", "serve", "/m/x"]
    for cmd in cmds.values():
        assert cmd[cmd.index("--backend") + 1] == "turbomind" and "--enable-prefix-caching" in cmd
        assert "--eager-mode" not in cmd  # a PyTorch flag
    assert sc.main(["--dry-run", "--backend", "turbomind", "--model", "/m/x", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "featcache warm" not in out  # its keys are the PyTorch engine's
    _lmdeploy_stack.need("lmdeploy")
    assert '"backend": "turbomind"' in out and "not parsed" not in out
    parsed = sc.check_commands(cmds)
    assert parsed["featcache"]["cache_dir"] == str(tmp_path / "store")
    assert parsed["plain"]["server_port"] != parsed["featcache"]["server_port"]


class Fake(BaseHTTPRequestHandler):
    """lmdeploy's api_server as the client sees it: two tokens, the first with no text."""

    requests: list[dict] = []
    hits = 0

    def log_message(self, *a):
        pass

    def _send(self, body: bytes, kind: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path.startswith("/v1/models"):
            self._send(json.dumps({"object": "list", "data": [
                {"id": "tiny", "object": "model", "created": 0, "owned_by": "lmdeploy"}]}).encode(),
                "application/json")
        elif self.path.startswith("/metrics"):
            text = ("# TYPE featcache_lmdeploy_hits_total counter\n"
                    f"featcache_lmdeploy_hits_total {Fake.hits}.0\n"
                    f'featcache_lookups_total{{result="hit"}} {Fake.hits}.0\nfeatcache_puts_total 1.0\n')
            self._send(text.encode(), "text/plain")

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Fake.requests.append(req)
        turn = sum(m["role"] == "user" for m in req["messages"])
        Fake.hits += turn > 1  # the image resent
        base = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "tiny"}
        chunks = [dict(base, choices=[{"index": 0, "delta": {"role": "assistant", "content": ""},
                                       "output_ids": [7]}]),
                  dict(base, choices=[{"index": 0, "delta": {"content": "ok"}, "output_ids": [8],
                                       "finish_reason": "length"}]),
                  dict(base, choices=[], usage={"prompt_tokens": 100 * turn, "completion_tokens": 2,
                                                "total_tokens": 100 * turn + 2,
                                                "prompt_tokens_details": {"cached_tokens": 64 * (turn - 1)}})]
        body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        self._send(body.encode(), "text/event-stream")


def test_client_reads_token_ids_cached_tokens_and_counters():
    _lmdeploy_stack.need("openai", stack=False)
    sc = load()
    server = ThreadingHTTPServer(("127.0.0.1", 0), Fake)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        rows = sc.run_chat(base, "data:image/png;base64,AAAA", turns=3, max_tokens=2, metrics=True)
    finally:
        server.shutdown()
    assert [r["output_ids"] for r in rows] == [[7, 8]] * 3
    assert [r["cached_tokens"] for r in rows] == [0, 64, 128]
    assert [r["prompt_tokens"] for r in rows] == [100, 200, 300]
    assert all(r["ttft_ms"] is not None and r["ttft_ms"] <= r["total_ms"] for r in rows)
    assert rows[0]["featcache"] == {} and rows[1]["featcache"] == {
        "featcache_lmdeploy_hits_total": 1.0, 'featcache_lookups_total{result="hit"}': 1.0}
    req = Fake.requests[-1]  # greedy, every token kept, token ids asked for, the image resent
    assert req["temperature"] == 0 and req["ignore_eos"] and req["return_token_ids"]
    assert req["messages"][0]["content"][1]["image_url"]["url"].startswith("data:image/png")
    assert [m["role"] for m in req["messages"]] == ["user", "assistant", "user", "assistant", "user"]

    other = [dict(r, output_ids=[7, 9]) if r["turn"] == 2 else r for r in rows]
    cmp = sc.compare({"chats": {"a": rows}}, {"chats": {"a": other}})
    assert cmp["turns_compared"] == 3 and not cmp["tokens_identical"] and cmp["mismatches"] == ["a#2"]
    assert sc.compare({"chats": {"a": rows}}, {"chats": {"a": rows}})["tokens_identical"]


def test_image_ids_send_the_bytes_once_then_the_id(tmp_path):
    """--image-ids: a third server trusting ids; each image's bytes go out with its id on the
    first turn it appears in, afterwards (later turns, later chats) the id alone."""
    _lmdeploy_stack.need("openai", stack=False)
    sc = load()
    cmds = sc.commands("/m/x", "pytorch", str(tmp_path / "store"), image_ids=True)
    ids = cmds["featcache_ids"]
    assert "--trust-client-image-ids" in ids and ids[ids.index("--cache-dir") + 1].endswith("store-ids")
    assert "featcache_ids" not in sc.commands("/m/x", "pytorch", str(tmp_path / "store"))
    server = ThreadingHTTPServer(("127.0.0.1", 0), Fake)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        Fake.requests.clear()
        first = sc.run_chat(base, "data:image/png;base64," + "A" * 4000, turns=2, max_tokens=2,
                            image_id="image-a")
        again = sc.run_chat(base, "data:image/png;base64," + "A" * 4000, turns=1, max_tokens=2,
                            image_id="image-a", id_known=True)
    finally:
        server.shutdown()
    sent = [r["messages"][0]["content"][1] for r in Fake.requests]
    assert sent[0] == {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 4000},
                       "uuid": "image-a"}
    assert sent[1] == sent[2] == {"type": "image_url", "uuid": "image-a"}
    assert first[0]["messages_bytes"] > 4000 > first[1]["messages_bytes"]
    assert again[0]["messages_bytes"] < 4000
    rows = sc.ids_vs_bytes({"chats": {"a": first}}, {"chats": {"a": first}})
    assert [r["turn"] for r in rows] == [1, 2] and rows[0]["ttft_ms_id"] == first[0]["ttft_ms"]


def test_a_server_runs_for_the_block_and_an_error_in_it_is_recorded(tmp_path):
    """bench/lib/servers.py's ``running``: the server is up inside the block (its /v1/models
    answers), an error there is recorded with the server's exit code, and the server is stopped."""
    import socket
    import sys
    import urllib.request

    sys.path.insert(0, ROOT)
    from bench.lib.servers import running

    (tmp_path / "v1").mkdir()
    (tmp_path / "v1" / "models").write_text('{"data": []}')
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory",
           str(tmp_path)]
    res: dict = {}
    with running("stand-in", cmd, port, str(tmp_path / "server.log"), 30, res) as base:
        assert urllib.request.urlopen(f"{base}/v1/models", timeout=5).read() == b'{"data": []}'
        raise RuntimeError("the chat failed")
    assert res["error"] == "RuntimeError: the chat failed" and res["ready_s"] >= 0
    assert res["server_rc"] == 0 and res["command"].endswith(str(tmp_path))  # SIGINT: a clean exit
    with pytest.raises(OSError):  # stopped
        urllib.request.urlopen(f"{base}/v1/models", timeout=2)
