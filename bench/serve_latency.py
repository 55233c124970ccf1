"""A hit turn's time to first token against a text-only turn, per server and image source; a load
test. Issue 16. GPU; ``--dry-run`` runs on the CPU.

    python bench/serve_latency.py --model DIR [--backend pytorch|turbomind] [--out DIR]
        [--servers plain,featcache,featcache_ids,featcache_mp] [--sources data,http,file] [--repeats N]
        [--load SECONDS] [--clients 32] [--text-clients N] [--turn-interval S] [--images 8]
        [--budget S] [--eager] [--dry-run]

Servers (bench/lib/servers.py's, as serve_chat.py runs them; CUDA graphs on unless --eager), one
at a time, each run under bench/serve_stages.py (per-stage times recorded in the server's process,
loopback image URLs allowed): plain ``lmdeploy serve api_server``, ``featcache serve``, ``featcache serve
--trust-client-image-ids`` (its images named by ids: bytes on the warm-up turn only), ``featcache
serve --engine-process mp`` (lmdeploy's own process model: the engine in a second process; the
server-side stages are then the API process's only). Per server
and image source (a 1344x1008 PNG as a base64 data URL, as an ``http://127.0.0.1`` URL served by
this script, as a file path; the ids server: by id):

1. warm-up: the image's first turn (its features computed), then text probes that size a filler
   text to the image's prompt tokens;
2. --repeats + 1 rounds (the first dropped): a hit turn ``[user: Q0 + image, assistant: A0,
   user: Q_r]`` and a text turn ``[user: Q0 + filler, assistant: A0, user: Q_r]``, in alternating
   order; Q_r differs each round (no prefix-cache hit on the question itself), A0 is the image
   turn's answer in both, so both turns add the same new text to a context of the same length.

Reported per row: median and p90 time to first token of both, their ratio (the target:
<= 1.2), ``usage.prompt_tokens_details.cached_tokens`` and new tokens (prompt - cached), and the
server-side stages of both (median per stage, owner featcache or lmdeploy). --load S: then
--clients concurrent chat clients over --images images (data URLs, 4 turns per chat, images
resent every turn; --text-clients more with text-only chats; --turn-interval S: each client at most
one turn every S seconds, the same offered load for every server) for S seconds against plain, featcache
and featcache_mp: requests/s, p50/p99 time to first token, per request class too (an image chat's
first turn, its later turns, a text chat's turns: p99/p50, the stall measure), failed
requests. Writes OUT/latency.json and prints the tables.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import os
import shlex
import shutil
import sys
import threading
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # bench.lib

from bench import pyspy  # noqa: E402
from bench.lib.client import connect, served_model, stream_turn  # noqa: E402
from bench.lib.images import chat_url, url_bytes  # noqa: E402
from bench.lib.load import attach_mixed_stages, load_test, mixed, print_mixed  # noqa: E402
from bench.lib.results import write_report  # noqa: E402
from bench.lib.servers import PORTS, STORES, commands, start, stop, under_stages  # noqa: E402
from bench.lib.stages import medians as stage_medians_of  # noqa: E402
from bench.lib.stages import read as read_stages  # noqa: E402
from bench.lib.stages import summarize  # noqa: E402
from bench.lib.timing import quantile  # noqa: E402

SERVERS = ("plain", "featcache", "featcache_ids", "featcache_mp")
DEFAULT_SERVERS = SERVERS[:3]  # --servers' default (with featcache_mp: past the default budget)
SOURCES = ("data", "http", "file")
HTTP_PORT = 23419
Q0 = "What is in this picture?"
FILLER = "the quick brown fox jumps over the lazy dog "  # sized to the image's prompt tokens
LOAD_SERVERS = ("plain", "featcache", "featcache_mp")


# -- the plan (pure) ----------------------------------------------------------------------------------
def sources_for(server: str, sources: list[str]) -> list[str]:
    """The ids server names its images by id whatever the source (its hits carry no bytes)."""
    return ["id"] if server == "featcache_ids" else list(sources)


def question(r: int) -> str:
    return f"Question {100 + r}: what stands out most?"


def plan(servers: list[str], sources: list[str], repeats: int) -> list[tuple[str, str, int]]:
    """(server, source, requests) in run order: 1 image warm-up + 2 text probes + 2 per round."""
    return [(s, src, 3 + 2 * (repeats + 1)) for s in servers for src in sources_for(s, sources)]


def estimate_s(steps: list[tuple[str, str, int]], servers: list[str], load_s: float,
               start_s: float = 60, request_s: float = 0.5) -> float:
    """A pessimistic estimate of a run's wall time (server starts, requests, load tests)."""
    loads = sum(1 for s in servers if s in LOAD_SERVERS) * (load_s + 15 if load_s else 0)
    return len(servers) * (start_s + 10) + sum(n for _, _, n in steps) * request_s + loads


def messages(source: dict[str, Any], question_text: str, answer: str | None) -> list[dict]:
    """The hit turn (``answer`` given) or the warm-up turn: the image first, as the chats send it."""
    first: list[dict] = [{"type": "text", "text": Q0}, source]
    out: list[dict] = [{"role": "user", "content": first}]
    if answer is not None:
        out += [{"role": "assistant", "content": answer}, {"role": "user", "content": question_text}]
    return out


def text_messages(filler_words: int, question_text: str, answer: str | None) -> list[dict]:
    words = FILLER.split()
    filler = " ".join(words[i % len(words)] for i in range(filler_words))
    out: list[dict] = [{"role": "user", "content": f"{Q0} {filler}"}]
    if answer is not None:
        out += [{"role": "assistant", "content": answer}, {"role": "user", "content": question_text}]
    return out


def side_by_side(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (server, source): hit vs text time to first token (median, p90, ratio), cached
    and new tokens, server-side featcache / lmdeploy ms of the hit (medians)."""
    rows = []
    for server, per_source in results.items():
        for source, r in per_source.items():
            hit, text = r.get("hit", []), r.get("text", [])
            h50, t50 = quantile([x["ttft_ms"] for x in hit], 0.5), quantile([x["ttft_ms"] for x in text], 0.5)
            rows.append({
                "server": server, "source": source, "n": len(hit),
                "hit_p50": h50, "hit_p90": quantile([x["ttft_ms"] for x in hit], 0.9),
                "text_p50": t50, "text_p90": quantile([x["ttft_ms"] for x in text], 0.9),
                "ratio": round(h50 / t50, 2) if h50 and t50 else None,
                "hit_cached": quantile([x["cached_tokens"] for x in hit], 0.5),
                "text_cached": quantile([x["cached_tokens"] for x in text], 0.5),
                "hit_new": quantile([new_tokens(x) for x in hit], 0.5),
                "text_new": quantile([new_tokens(x) for x in text], 0.5),
                "hit_fc_ms": quantile([x.get("stages", {}).get("totals", {}).get("featcache", 0.0)
                                  for x in hit if x.get("stages")], 0.5),
                "hit_lmdeploy_ms": quantile([x.get("stages", {}).get("totals", {}).get("lmdeploy")
                                        for x in hit if x.get("stages")], 0.5),
                "errors": r.get("errors", []),
            })
    return rows


def new_tokens(row: dict[str, Any]) -> float | None:
    if row.get("prompt_tokens") is None:
        return None
    return float(row["prompt_tokens"] - (row.get("cached_tokens") or 0))


def stage_medians(turns: list[dict[str, Any]]) -> list[tuple[str, str, float]]:
    """Per stage label (in the order first met), the median ms over ``turns``' stages."""
    return stage_medians_of([t["stages"] for t in turns if t.get("stages")])


def print_tables(results: dict[str, dict[str, Any]], load: dict[str, Any]) -> None:
    print("\nhit turn vs text-only turn, time to first token (ms), same server, same run")
    print(f"  {'server':<14} {'source':<6} {'n':>3}  {'hit p50/p90':>15}  {'text p50/p90':>15}  "
          f"{'x':>5}  {'cached hit/text':>15}  {'new hit/text':>13}  {'server fc/lmdeploy ms':>21}")
    for r in side_by_side(results):
        print(f"  {r['server']:<14} {r['source']:<6} {r['n']:>3}  "
              f"{r['hit_p50']!s:>7}/{r['hit_p90']!s:<7}  {r['text_p50']!s:>7}/{r['text_p90']!s:<7}  "
              f"{r['ratio']!s:>5}  {r['hit_cached']!s:>7}/{r['text_cached']!s:<7}  "
              f"{r['hit_new']!s:>6}/{r['text_new']!s:<6}  {r['hit_fc_ms']!s:>10}/{r['hit_lmdeploy_ms']!s:<10}"
              + (f"  ERRORS {len(r['errors'])}" if r["errors"] else ""))
    for server, per_source in results.items():
        for source, r in per_source.items():
            hit, text = stage_medians(r.get("hit", [])), dict(
                (label, ms) for label, _, ms in stage_medians(r.get("text", [])))
            if not hit:
                continue
            print(f"\n  stages, {server} / {source}: hit (text) ms, medians")
            for label, owner, ms in hit:
                print(f"    {label:<46} {owner:<9} {ms:>9.2f}  ({text.get(label, '-')})")
    if load:
        print("\nload: concurrent chat clients, images resent every turn")
        print(f"  {'server':<10} {'clients':>7} {'s':>5} {'requests':>8} {'req/s':>7} "
              f"{'ttft p50':>9} {'ttft p99':>9} {'failed':>6}")
        for server, r in load.items():
            print(f"  {server:<10} {r['clients']:>7} {r['seconds']:>5} {r['requests']:>8} "
                  f"{r['rps']!s:>7} {r['ttft_p50']!s:>9} {r['ttft_p99']!s:>9} {r['failed']:>6}")
        rows = [(server, kind, c) for server, r in load.items()
                for kind, c in (r.get("classes") or {}).items()]
        if rows:
            print("\n  per request class (a stall: p99 over 1.2x p50)")
            print(f"  {'server':<10} {'class':<18} {'n':>5} {'p50':>9} {'p99':>9} {'p99/p50':>8}")
            for server, kind, c in rows:
                print(f"  {server:<10} {kind:<18} {c['n']:>5} {c['ttft_p50']!s:>9} "
                      f"{c['ttft_p99']!s:>9} {c['p99_over_p50']!s:>8}")


# -- running (GPU) ------------------------------------------------------------------------------------
def serve_files(directory: str) -> http.server.ThreadingHTTPServer:
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=directory)
    handler.log_message = lambda *a: None  # type: ignore[attr-defined]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", HTTP_PORT), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def image_item(kind: str, url: str, http_url: str, path: str, image_id: str, first: bool) -> dict:
    if kind == "id":
        item: dict[str, Any] = {"type": "image_url", "uuid": image_id}
        if first:
            item["image_url"] = {"url": url}
        return item
    src = {"data": url, "http": http_url, "file": path}[kind]
    return {"type": "image_url", "image_url": {"url": src}}


def latency(base: str, model: str, kinds: list[str], files: dict[str, Any], repeats: int,
            max_tokens: int) -> tuple[dict[str, Any], int]:
    """The warm-ups and rounds of every source kind; (results, chat requests sent)."""
    client = connect(base)
    out: dict[str, Any] = {}
    sent = 0
    for kind in kinds:
        res: dict[str, Any] = {"hit": [], "text": [], "errors": []}
        out[kind] = res
        image_id = f"latency-{kind}"
        try:
            item = functools.partial(image_item, kind, files["url"], files["http"], files["path"], image_id)
            warm = stream_turn(client, model, messages(item(True), Q0, None), max_tokens)
            answer = warm["text"] or "ok"
            probes = [stream_turn(client, model, text_messages(n, Q0, None), 1)
                      for n in (0, 256)]
            sent += 3
            per_word = max(1e-3, (probes[1]["prompt_tokens"] - probes[0]["prompt_tokens"]) / 256)
            words = max(0, round((warm["prompt_tokens"] - probes[0]["prompt_tokens"]) / per_word))
            res["warm"] = {k: warm[k] for k in ("ttft_ms", "prompt_tokens", "cached_tokens")}
            res["filler_words"] = words
            for r in range(repeats + 1):
                order = ("hit", "text") if r % 2 == 0 else ("text", "hit")
                for which in order:
                    msgs = (messages(item(False), question(r), answer) if which == "hit"
                            else text_messages(words, question(r), answer))
                    row = stream_turn(client, model, msgs, max_tokens)
                    row["seq"] = sent
                    sent += 1
                    row.pop("output_ids", None)
                    if r > 0:  # round 0 primes the prefix cache
                        res[which].append(row)
            print(f"  [{kind}] hit p50 {quantile([x['ttft_ms'] for x in res['hit']], 0.5)} ms, text p50 "
                  f"{quantile([x['ttft_ms'] for x in res['text']], 0.5)} ms", flush=True)
        except Exception as e:  # noqa: BLE001 (reported, the run goes on)
            res["errors"].append(f"{type(e).__name__}: {e}")
            print(f"  [{kind}] ERROR {res['errors'][-1]}", flush=True)
    return out, sent


def attach_stages(results: dict[str, Any], stages_file: str, sent: int) -> None:
    """The server's records, in request order, onto the timed turns (request ``seq``); not after
    an error (a failed request may or may not have reached the server: the order is unknown)."""
    if any(res.get("errors") for res in results.values()):
        return
    try:
        rows = read_stages(stages_file)
    except OSError:
        return
    if len(rows) < sent:
        print(f"  stages: {len(rows)} records for {sent} requests; not attached", flush=True)
        return
    for res in results.values():
        for which in ("hit", "text"):
            for t in res.get(which, []):
                t["stages"] = summarize(rows[t["seq"]])
                t["server_body_bytes"] = rows[t["seq"]]["body_bytes"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--backend", choices=["pytorch", "turbomind"], default="pytorch")
    p.add_argument("--out", default="latency_out")
    p.add_argument("--store-root", default="/tmp/serve_latency_store")
    p.add_argument("--servers", default=",".join(DEFAULT_SERVERS))
    p.add_argument("--sources", default=",".join(SOURCES))
    p.add_argument("--repeats", type=int, default=12, help="timed rounds per source (default 12)")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--load", type=float, default=60, metavar="S", help="load test seconds (0: none)")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--text-clients", type=int, default=0,
                   help="load test: clients whose chats have no image, beside --clients")
    p.add_argument("--turn-interval", type=float, default=0.0, metavar="S",
                   help="load test: each client sends at most one turn every S seconds (paced: equal "
                        "offered load for every server that keeps up; 0: closed loop, the default)")
    p.add_argument("--images", type=int, default=8)
    p.add_argument("--profile", action="store_true",
                   help="py-spy the server's processes during the load test (top frames per process "
                        "and thread in the load report's profile)")
    p.add_argument("--mixed", type=int, default=0, metavar="ROUNDS",
                   help="the stall case, one request at a time: ROUNDS x (a 4-turn chat over "
                        "a new image, a 4-turn text chat); per class p50/p99 (0: none)")
    p.add_argument("--budget", type=float, default=530,
                   help="seconds for the whole run: a server is skipped with < 90 s left, a load "
                   "test shortened to what is left")
    p.add_argument("--eager", action="store_true", help="--eager-mode (CUDA graphs off)")
    p.add_argument("--server-arg", action="append", default=[], metavar="ARG")
    p.add_argument("--dry-run", action="store_true", help="print the plan and a sample table; exit")
    args = p.parse_args(argv)
    t0 = time.monotonic()
    servers = [s for s in args.servers.split(",") if s]
    sources = [s for s in args.sources.split(",") if s]
    bad = [s for s in servers if s not in SERVERS] + [s for s in sources if s not in SOURCES]
    if bad:
        p.error(f"unknown server or source: {bad}")
    out = os.path.abspath(args.out)
    store = os.path.join(os.path.abspath(args.store_root), os.path.basename(args.model.rstrip("/")))
    # featcache serve reads no local file unless told where from (issue 26): the file source's
    # image is written into OUT
    local = ("--allowed-local-media-path", out) if "file" in sources else ()
    cmds = commands(args.model, args.backend, store, args.eager, args.server_arg,
                    image_ids="featcache_ids" in servers, mp_engine="featcache_mp" in servers,
                    featcache_args=local)
    steps = plan(servers, sources, args.repeats)
    if args.dry_run:
        for s in servers:
            line = shlex.join(under_stages(cmds[s], os.path.join(out, f"stages-{s}.jsonl")))
            print(f"[dry-run] {s}: {line}")
        for server, src, n in steps:
            print(f"[dry-run] {server} / {src}: {n} requests (warm-up, 2 probes, {args.repeats}+1 rounds)")
        estimate = estimate_s(steps, servers, args.load)
        print(f"[dry-run] load: {args.clients} clients x {args.images} images, {args.load:.0f} s on "
              f"{[s for s in servers if s in LOAD_SERVERS]}; estimate {estimate:.0f} s "
              f"of a {args.budget:.0f} s budget")
        sample = {s: {src: {"hit": [{"ttft_ms": 20.0 + i, "prompt_tokens": 3500, "cached_tokens": 3456,
                                     "stages": {"rows": [("read body", "lmdeploy", 1.0)],
                                                "totals": {"lmdeploy": 1.0}}} for i in range(3)],
                            "text": [{"ttft_ms": 18.0 + i, "prompt_tokens": 3500, "cached_tokens": 3456}
                                     for i in range(3)]}
                      for src in sources_for(s, sources)} for s in servers}
        print("[dry-run] sample table (made-up numbers):")
        print_tables(sample, {"plain": {"clients": args.clients, "seconds": args.load, "requests": 0,
                                        "rps": 0.0, "ttft_p50": None, "ttft_p99": None, "failed": 0}})
        return 0

    os.makedirs(out, exist_ok=True)
    url = chat_url(1)
    path = os.path.join(out, "a.png")
    with open(path, "wb") as f:
        f.write(url_bytes(url))
    files = {"url": url, "http": f"http://127.0.0.1:{HTTP_PORT}/a.png", "path": path}
    load_urls = [chat_url(10 + i) for i in range(args.images)] if args.load else []
    mixed_urls = [chat_url(100 + i) for i in range(args.mixed)]
    http_server = serve_files(out)
    report: dict[str, Any] = {"model": args.model, "backend": args.backend, "eager": args.eager,
                              "repeats": args.repeats, "max_tokens": args.max_tokens,
                              "latency": {}, "load": {}, "mixed": {}, "servers": {}, "skipped": []}
    try:
        for server in servers:
            left = args.budget - (time.monotonic() - t0)
            if left < 90:
                report["skipped"].append(f"{server}: {left:.0f} s left")
                continue
            stages_file = os.path.join(out, f"stages-{server}.jsonl")
            if os.path.exists(stages_file):
                os.remove(stages_file)
            if server.startswith("featcache"):
                shutil.rmtree(store + STORES[server], ignore_errors=True)
            cmd = under_stages(cmds[server], stages_file)
            port = PORTS[server]
            try:
                proc, ready = start(cmd, port, os.path.join(out, f"{server}.log"),
                                    min(240, max(30, left - 60)))
            except Exception as e:  # noqa: BLE001
                report["servers"][server] = {"command": shlex.join(cmd), "error": f"{type(e).__name__}: {e}"}
                continue
            base = f"http://127.0.0.1:{port}"
            report["servers"][server] = {"command": shlex.join(cmd), "ready_s": round(ready, 1)}
            try:
                model = served_model(connect(base))
                print(f"[{server}] latency", flush=True)
                res, sent = latency(base, model, sources_for(server, sources), files, args.repeats,
                                    args.max_tokens)
                attach_stages(res, stages_file, sent)
                report["latency"][server] = res
                if args.mixed:
                    print(f"[{server}] mixed: {args.mixed} rounds, one request at a time", flush=True)
                    report["mixed"][server] = mixed(base, model, mixed_urls, args.mixed,
                                                    args.max_tokens, sent)
                    attach_mixed_stages(report["mixed"][server], stages_file)
                    sent += len(report["mixed"][server]["turns"])
                left = args.budget - (time.monotonic() - t0) - 20
                if args.load and server in LOAD_SERVERS and left > 20:
                    seconds = min(args.load, left)
                    print(f"[{server}] load {args.clients} clients, {seconds:.0f} s", flush=True)
                    profiler = (pyspy.Profile(proc.pid, seconds, os.path.join(out, f"pyspy-{server}.txt"))
                                if args.profile else None)
                    report["load"][server] = load_test(base, model, load_urls, args.clients, seconds,
                                                       args.max_tokens,
                                                       text_clients=args.text_clients,
                                                       turn_interval=args.turn_interval)
                    if profiler is not None:
                        report["load"][server]["profile"] = profiler.summary()
            finally:
                report["servers"][server]["rc"] = stop(proc, wait=20)
    finally:
        http_server.shutdown()
        report["side_by_side"] = side_by_side(report["latency"])
        write_report(os.path.join(out, "latency.json"), report)  # with commit, GPU, date
    print_tables(report["latency"], report["load"])
    print_mixed(report["mixed"])
    failed = sum(r.get("failed", 0) for r in report["load"].values())
    errors = sum(len(r.get("errors", [])) for per in report["latency"].values() for r in per.values())
    return 1 if failed or errors else 0


if __name__ == "__main__":
    sys.exit(main())
