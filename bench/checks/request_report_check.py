"""The per-request report on a GPU: what `featcache serve` tells each response
(``X-Featcache``, ``usage.featcache``) against what its request sent, in both process models.

    python3 bench/checks/request_report_check.py --model /tmp/models/internvl3_2b_shape \\
        --json $OUT/report.json
    python3 bench/checks/request_report_check.py --model DIR --dry-run    # the plan and the command lines

For each server (``--servers in,mp``: ``featcache serve --engine-process in``, then ``mp``, each
over a new store, ``--featcache-report usage``, prefix caching on), one request at a time unless
said, each a 1344x1008 noise PNG as a data URL (13 InternVL tiles) per image, 8 tokens answered:

1. ``text``: no image: ``images=0``;
2. ``w``, then ``w_again``: the first image the model's vision clock times (on CUDA its time is
   read once the GPU has passed it, so W's entry records none): ``in``: a hit from the device
   tier, ``unknown_cost=1``;
3. ``a``, then ``a_again``: a miss costed at the rate learnt from W's call (``vision_computed_ms``),
   then its hit, whose ``vision_saved_ms`` is that recorded time;
4. ``stream``: A and B streamed with ``stream_options.include_usage``: the header (sent before the
   first token) says 2 images, 1 hit; the final usage chunk carries the same and B's vision time;
5. ``together``: A (a hit) and C+D (two misses) at once: each response its own report.

``mp``'s hits are the images the server sent without pixels; the model process's own counters
(``featcache_model_*`` on /metrics) are recorded beside them per request. Each request's time to
its response's headers is recorded. Exit code 0 when every expectation holds (``checks``), 1
otherwise, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import sys
import tempfile
import threading
import time
from typing import Any

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))  # the checkout

from bench.lib.client import counters, delta  # noqa: E402
from bench.lib.images import chat_url  # noqa: E402
from bench.lib.results import write_report  # noqa: E402
from bench.lib.servers import featcache_command, running, server_flags  # noqa: E402

SEEDS = {"w": 301, "a": 302, "b": 303, "c": 304, "d": 305}
PORT = 23410
SERVERS = ("in", "mp")
# name -> (images by seed name, streamed); "together" runs its two requests at once
PLAN: dict[str, tuple[tuple[str, ...], bool]] = {
    "text": ((), False), "w": (("w",), False), "w_again": (("w",), False), "a": (("a",), False),
    "a_again": (("a",), False), "stream": (("a", "b"), True),
    "together_hit": (("a",), False), "together_misses": (("c", "d"), False)}


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="request_report_check.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a model directory lmdeploy's PyTorch engine runs")
    p.add_argument("--servers", default=",".join(SERVERS), help="in, mp or both (default in,mp)")
    p.add_argument("--port", type=int, default=PORT, help=f"the servers' port (default {PORT})")
    p.add_argument("--ready-timeout", type=float, default=300, help="seconds for a server to start")
    p.add_argument("--json", metavar="FILE", help="write the report there too")
    p.add_argument("--dry-run", action="store_true", help="no server: the plan and command lines")
    args = p.parse_args(argv)
    args.server_list = [s for s in args.servers.split(",") if s]
    if not args.server_list or set(args.server_list) - set(SERVERS):
        p.error(f"--servers is a comma-separated list of {', '.join(SERVERS)}, not {args.servers!r}")
    return args


def command(model: str, mode: str, store: str, port: int) -> list[str]:
    return featcache_command(model, store, port, server_flags("pytorch", eager=False), mode,
                             ours=("--featcache-report", "usage"))


def ask(port: int, model: str, seeds: tuple[str, ...], stream: bool) -> dict[str, Any]:
    """One chat completion: its status, X-Featcache, usage.featcache (a stream's final chunk)
    and the seconds to its headers."""
    content: list[dict[str, Any]] = [{"type": "text", "text": "describe"}]
    content += [{"type": "image_url", "image_url": {"url": chat_url(SEEDS[s])}} for s in seeds]
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": content}],
                            "max_completion_tokens": 8, "temperature": 0, "ignore_eos": True,
                            "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    try:
        began = time.perf_counter()
        conn.request("POST", "/v1/chat/completions", json.dumps(body),
                     {"content-type": "application/json"})
        response = conn.getresponse()
        headers_s = time.perf_counter() - began
        text = response.read().decode()
        header = response.getheader("x-featcache")
    finally:
        conn.close()
    usage = None
    docs = ([json.loads(e[6:]) for e in text.split("\n\n") if e.startswith("data: {")] if stream
            else [json.loads(text)] if response.status == 200 else [])
    for doc in docs:
        if isinstance(doc.get("usage"), dict):
            usage = doc["usage"].get("featcache")
    fields = dict(p.split("=", 1) for p in header.split("; ")) if header else None
    return {"status": response.status, "header": header, "fields": fields, "usage": usage,
            "headers_s": round(headers_s, 4)}


def run_server(args: argparse.Namespace, mode: str, report: dict[str, Any]) -> dict[str, Any]:
    """``mode``'s server over a new store, for the plan's requests; its record in ``report``."""
    served = report.setdefault(mode, {})
    store = tempfile.mkdtemp(prefix=f"fc-report-{mode}-")
    log = os.path.join(store, "server.log")
    with running(mode, command(args.model, mode, os.path.join(store, "store"), args.port),
                 args.port, log, args.ready_timeout, served) as base:
        served.update(run_requests(args.port, base, mode))
    return served


def run_requests(port: int, base: str, mode: str) -> dict[str, Any]:
    """The plan's requests to the server on ``port`` (its URL ``base``), in order, the two
    ``together`` ones at once; each with the model processes' counters that changed meanwhile."""
    name = json.loads(_get(port, "/v1/models"))["data"][0]["id"]
    served: dict[str, Any] = {}
    for step, (seeds, stream) in PLAN.items():
        if step.startswith("together"):
            continue
        before = counters(base)
        served[step] = ask(port, name, seeds, stream)
        served[step]["model_process"] = {k: v for k, v in delta(before, counters(base)).items()
                                         if k.startswith("featcache_model_lmdeploy")}
        print(f"[{mode}] {step}: {served[step]['header']}  usage {served[step]['usage']}",
              flush=True)
    together: dict[str, Any] = {}
    threads = [threading.Thread(target=lambda s=s: together.__setitem__(s, ask(
        port, name, PLAN[s][0], False))) for s in ("together_hit", "together_misses")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    for step in sorted(together):
        served[step] = together[step]
        print(f"[{mode}] {step}: {together[step]['header']}", flush=True)
    return served


def _get(port: int, path: str) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", path)
        return conn.getresponse().read().decode()
    finally:
        conn.close()


def checks(mode: str, served: dict[str, Any], cuda: bool) -> list[dict[str, Any]]:
    """Each expectation of ``mode``'s run: name, whether it holds, what was seen (``cuda``: the
    server timed its vision calls with CUDA events, so the first one's time came too late for W's
    entry)."""
    out = []

    def expect(name: str, ok: bool, seen: Any) -> None:
        out.append({"check": f"{mode}: {name}", "ok": bool(ok), "seen": seen})

    def f(step: str) -> dict[str, str]:
        return (served.get(step) or {}).get("fields") or {}

    def u(step: str) -> dict[str, Any]:
        return (served.get(step) or {}).get("usage") or {}

    for step, (seeds, _) in PLAN.items():
        expect(f"{step}: 200, mode and images", (served.get(step) or {}).get("status") == 200
               and f(step).get("mode") == mode and f(step).get("images") == str(len(seeds)),
               (served.get(step) or {}).get("header"))
    hits = {"text": 0, "w": 0, "w_again": 1, "a": 0, "a_again": 1, "stream": 1, "together_hit": 1,
            "together_misses": 0}
    for step, n in hits.items():
        expect(f"{step}: hits={n}", f(step).get("hits") == str(n), f(step).get("hits"))
    expect("stream: the final usage chunk has the report", u("stream").get("hits") == 1, u("stream"))
    if mode == "in":
        for step in ("w_again", "a_again", "together_hit"):
            expect(f"{step}: from the device tier", f(step).get("tiers") == "device:1", f(step))
        if cuda:
            expect("w_again: W's entry records no time", f("w_again").get("unknown_cost") == "1"
                   and f("w_again").get("vision_saved_ms") == "unknown", f("w_again"))
        computed = u("a").get("vision_computed_ms")
        saved = f("a_again").get("vision_saved_ms")
        expect("a_again saves what a's miss took", computed is not None and saved is not None
               and saved != "unknown" and abs(float(saved) - computed) <= 1.0, (computed, saved))
        expect("stream: B's vision time measured", (u("stream").get("vision_computed_ms") or 0) > 0,
               u("stream"))
    else:
        for step in ("w_again", "a_again"):
            expect(f"{step}: tiers and saving unknown", f(step).get("tiers") == "unknown"
                   and f(step).get("vision_saved_ms") == "unknown", f(step))
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    plan = {"servers": {m: command(args.model, m, f"<new store>/{m}", args.port)
                        for m in args.server_list},
            "requests": {k: {"images": list(v[0]), "stream": v[1]} for k, v in PLAN.items()}}
    if args.dry_run:
        print(json.dumps(plan, indent=1))
        return 0
    import torch

    report: dict[str, Any] = {"plan": plan}
    for mode in args.server_list:
        served = run_server(args, mode, report)
        report.setdefault("checks", []).extend(checks(mode, served, torch.cuda.is_available()))
        if args.json:
            write_report(args.json, report)
    failed = [c for c in report["checks"] if not c["ok"]]
    report["verdict"] = "OK" if not failed else f"{len(failed)} of {len(report['checks'])} failed"
    for c in failed:
        print(f"FAILED {c['check']}: {c['seen']}", flush=True)
    print(f"verdict: {report['verdict']}", flush=True)
    if args.json:
        write_report(args.json, report)
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
