"""`featcache serve` end to end on a GPU: the OpenAI client, multi-turn, against plain lmdeploy.

    python bench/serve_chat.py --model DIR [--model DIR ...] [--backend pytorch|turbomind]
                               [--out DIR] [--eager] [--skip-warm] [--image-ids] [--mp-engine]
                               [--skip SERVER] [--dry-run]

Per model, one server at a time, the same requests in the same order:

1. plain `lmdeploy serve api_server MODEL --backend B --enable-prefix-caching ...`: a one-turn
   warm-up chat, then the chats (default: image A 4 turns, image B 4 turns, image A again in a
   fresh context, 3 turns), each resending its 1344x1008 PNG as a base64 data URL every turn;
2. (PyTorch only, unless --skip-warm) `featcache warm MODEL A.png` into a fresh store (its keys are
   the PyTorch engine's: a TurboMind server has its own namespace, so warm is skipped there);
3. `featcache serve MODEL --cache-dir STORE --engine-process in` with the same flags and the
   same chats (the engine in the server's process); featcache's counters are read from the
   server's /metrics after every turn, `featcache stats` at the end.
   STORE is --store-root/<model name>, emptied first, outside --out;
4. (--image-ids) `featcache serve MODEL --trust-client-image-ids --engine-process in
   --cache-dir STORE-ids`: the same chats, each image named by an id (`"uuid"` beside
   `image_url`); its bytes go out the first time it appears, later turns and chats send the id
   alone. Reported against plain (tokens) and
   against step 3 per turn (`ids_vs_bytes`: time to first token and the messages' size).
5. (--mp-engine, PyTorch) `featcache serve MODEL --engine-process mp --cache-dir STORE-mp`, warmed
   like step 3: lmdeploy's own process model (the engine and the model in a second process, as
   plain `api_server` runs them), the same chats; per turn also the engine process's counters
   (`featcache_model_*{rank}` on /metrics). Reported against plain (`compare_mp`).

Every turn is one streamed request through the `openai` client, greedy (temperature 0), with
lmdeploy's `return_token_ids` (so a chunk comes with the first token even when the random model's
tokens decode to no text) and `ignore_eos` (so every answer has --max-tokens tokens). Per turn:
time to first token, whole request, prompt tokens, `usage.prompt_tokens_details.cached_tokens`,
the answer's token ids, and (featcache) the change of each featcache_*_total counter. The report
sets the featcache answers against the plain ones, token by token (`tokens_identical`).

--dry-run prints the server commands (checked against featcache's and lmdeploy's own parsers when
lmdeploy is installed) and the chat plan, then exits: no GPU, no server.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "examples"))

QUESTIONS = ["What is in this picture?", "Describe the colours.", "What stands out most?",
             "Summarise it in five words.", "What would you title it?", "Anything unusual?"]
# (name, image, turns, index of the first question): A twice (the second time in a fresh context
# with another first question: an image hit in featcache, not a prefix hit), B once
CHATS = [("image_a", "a", 4, 0), ("image_b", "b", 4, 0), ("image_a_again", "a", 3, 4)]
IMAGE_SEEDS = {"a": 1, "b": 2, "warmup": 3}
PORTS = {"plain": 23400, "featcache": 23401, "featcache_ids": 23402, "featcache_mp": 23403}
SERVERS = tuple(PORTS)  # the order they run in
STORES = {"featcache": "", "featcache_ids": "-ids", "featcache_mp": "-mp"}  # suffix of STORE


# -- servers ---------------------------------------------------------------------------------------

def server_flags(backend: str, eager: bool, extra: list[str]) -> list[str]:
    """The flags both servers get (TurboMind's as bench/turbomind_bench.py builds its engines)."""
    flags = ["--backend", backend, "--enable-prefix-caching", "--session-len", "8192",
             "--log-level", "WARNING"]
    if backend == "turbomind":
        flags += ["--cache-max-entry-count", "0.2"]
    else:
        flags += ["--cache-max-entry-count", "0.05"] + (["--eager-mode"] if eager else [])
    return flags + list(extra)


def commands(model: str, backend: str, store: str, eager: bool = False,
             extra: list[str] | None = None, image_ids: bool = False,
             mp_engine: bool = False, featcache_args: tuple[str, ...] = ()) -> dict[str, list[str]]:
    common = server_flags(backend, eager, extra or [])
    py = sys.executable
    cmds = {
        "plain": [py, "-m", "lmdeploy", "serve", "api_server", model, "--server-port",
                  str(PORTS["plain"]), *common],
        "featcache": [py, "-m", "featcache", "serve", model, "--cache-dir", store,
                      "--engine-process", "in", "--server-port", str(PORTS["featcache"]), *common],
    }
    if image_ids:  # the clients name their images: bytes on a chat's first turn only
        cmds["featcache_ids"] = [py, "-m", "featcache", "serve", model, "--cache-dir", store + "-ids",
                                 "--trust-client-image-ids", "--engine-process", "in", "--server-port",
                                 str(PORTS["featcache_ids"]), *common]
    if mp_engine and backend == "pytorch":  # lmdeploy's process model: the engine in a second process
        cmds["featcache_mp"] = [py, "-m", "featcache", "serve", model, "--cache-dir", store + "-mp",
                                "--engine-process", "mp", "--server-port",
                                str(PORTS["featcache_mp"]), *common]
    for name, cmd in cmds.items():  # featcache's own options, before lmdeploy's
        if name != "plain":
            cmd[5:5] = list(featcache_args)
    return cmds


def check_commands(cmds: dict[str, list[str]]) -> dict[str, Any]:
    """Parse every command line with featcache's and lmdeploy's own parsers (needs lmdeploy)."""
    from featcache.cli.serving import featcache_parser
    from featcache.serve import lmdeploy_parser

    def engine(a: argparse.Namespace) -> dict[str, Any]:
        return {"model_path": a.model_path, "backend": a.backend, "server_port": a.server_port,
                "enable_prefix_caching": a.enable_prefix_caching, "session_len": a.session_len,
                "cache_max_entry_count": a.cache_max_entry_count}

    out: dict[str, Any] = {"plain": engine(lmdeploy_parser().parse_args(cmds["plain"][5:]))}
    for name in SERVERS[1:]:
        if name in cmds:
            ours, rest = featcache_parser().parse_known_args(cmds[name][4:])
            out[name] = {**engine(lmdeploy_parser().parse_args(rest)), "cache_dir": ours.cache_dir,
                         "engine_process": ours.engine_process,
                         "trust_client_image_ids": ours.trust_client_image_ids}
    return out


def wait_ready(port: int, proc: subprocess.Popen, timeout: float) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2).read()
            return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"server not ready in {timeout:.0f} s")


def start(cmd: list[str], port: int, log: str, timeout: float) -> tuple[subprocess.Popen, float]:
    f = open(log, "w")
    proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    t = time.monotonic()
    try:
        wait_ready(port, proc, timeout)
    except BaseException:
        stop(proc)
        print(f"[serve] FAILED to start: {shlex.join(cmd)}\n{tail(log)}", flush=True)
        raise
    took = time.monotonic() - t
    print(f"[serve] ready in {took:.1f} s: {shlex.join(cmd[1:6])} ...", flush=True)
    return proc, took


def stop(proc: subprocess.Popen, wait: float = 45) -> int:
    try:
        os.killpg(proc.pid, signal.SIGINT)
    except ProcessLookupError:
        return proc.wait()
    try:
        return proc.wait(wait)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait()


def tail(path: str, n: int = 4000) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-n:]
    except OSError:
        return ""


# -- the client ------------------------------------------------------------------------------------

def counters(base: str) -> dict[str, float]:
    """featcache's counters (featcache_*_total, labels kept) from the server's /metrics."""
    text = urllib.request.urlopen(f"{base}/metrics", timeout=5).read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r"^(featcache_[A-Za-z0-9_]*_total)(\{[^}]*\})? ([0-9.eE+-]+)$", line)
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in sorted(after.items()) if v != before.get(k, 0.0)}


def _extra(obj: Any, name: str) -> Any:
    """A field the openai types do not declare (lmdeploy's ``output_ids``)."""
    value = getattr(obj, name, None)
    if value is None:
        value = (getattr(obj, "model_extra", None) or {}).get(name)
    return value


def stream_turn(client: Any, model: str, messages: list[dict], max_tokens: int) -> dict[str, Any]:
    """One streamed, greedy chat request through the openai ``client``: time to first token
    (the first chunk with a choice: return_token_ids puts the first token's id in it even when it
    decodes to no text), whole request, usage (prompt, cached, completion tokens), the messages'
    size, the answer's token ids and text."""
    body_bytes = len(json.dumps(messages))
    start = time.perf_counter()
    ttft, parts, ids, usage = None, [], [], None
    stream = client.chat.completions.create(
        model=model, messages=messages, stream=True, max_tokens=max_tokens, temperature=0,
        stream_options={"include_usage": True},
        extra_body={"return_token_ids": True, "ignore_eos": True, "top_k": 1})
    for chunk in stream:
        usage = chunk.usage or usage
        if not chunk.choices:
            continue
        if ttft is None:
            ttft = time.perf_counter() - start
        choice = chunk.choices[0]
        parts.append(choice.delta.content or "")
        ids.extend(_extra(choice, "output_ids") or [])
    total = time.perf_counter() - start
    details = getattr(usage, "prompt_tokens_details", None)
    return {"ttft_ms": round(ttft * 1e3, 2) if ttft is not None else None,
            "total_ms": round(total * 1e3, 2),
            "prompt_tokens": getattr(usage, "prompt_tokens", None),
            "cached_tokens": getattr(details, "cached_tokens", None),
            "completion_tokens": getattr(usage, "completion_tokens", None),
            "messages_bytes": body_bytes, "output_ids": ids, "text": "".join(parts)}


def run_chat(base_url: str, image_url: str, turns: int, first_question: int = 0,
             max_tokens: int = 8, metrics: bool = False, model: str | None = None,
             image_id: str | None = None, id_known: bool = False) -> list[dict]:
    """One chat through the openai client: the image in the first user message, resent with the
    history every turn (``image_id``: named by that id, its bytes sent on the first turn only, as
    a ``--trust-client-image-ids`` server allows; ``id_known``: sent in an earlier chat, so not
    even the first turn carries the bytes). One dict per turn."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=120)
    model = model or client.models.list().data[0].id
    history: list[dict] = []
    out = []
    for turn in range(turns):
        question = QUESTIONS[(first_question + turn) % len(QUESTIONS)]
        content: list[dict] | str = question
        if turn == 0:
            image: dict[str, Any] = {"type": "image_url", "image_url": {"url": image_url}}
            if image_id is not None:
                image = {"type": "image_url", "uuid": image_id} if id_known else {**image, "uuid": image_id}
            content = [{"type": "text", "text": question}, image]
        elif image_id is not None:  # the history names the image: no bytes after the first turn
            history[0]["content"][1] = {"type": "image_url", "uuid": image_id}
        history.append({"role": "user", "content": content})
        before = counters(base_url) if metrics else {}
        row = {"turn": turn + 1, **stream_turn(client, model, history, max_tokens)}
        ids = row["output_ids"]
        if metrics:
            row["featcache"] = delta(before, counters(base_url))
        out.append(row)
        print(f"  turn {turn + 1}: ttft {row['ttft_ms']} ms, total {row['total_ms']} ms, "
              f"{row['prompt_tokens']} prompt tokens ({row['cached_tokens']} cached), ids "
              f"{ids[:8]}{'...' if len(ids) > 8 else ''}"
              + (f", featcache {_short(row['featcache'])}" if metrics else ""), flush=True)
        history.append({"role": "assistant", "content": row["text"]})
    return out


def _short(counts: dict[str, float]) -> str:
    keep = {k.removeprefix("featcache_").removesuffix("_total"): int(v) for k, v in counts.items()
            if not k.startswith("featcache_lookup_seconds")}
    return json.dumps(keep, separators=(",", ":"))


def serve_and_chat(name: str, cmd: list[str], port: int, images: dict[str, str], out: str,
                   max_tokens: int, ready_timeout: float) -> dict[str, Any]:
    ids = name == "featcache_ids"  # the client names each image; bytes only the first time
    known: set[str] = set()
    base = f"http://127.0.0.1:{port}"
    proc, took = start(cmd, port, os.path.join(out, f"{name}.log"), ready_timeout)
    res: dict[str, Any] = {"command": shlex.join(cmd), "ready_s": round(took, 1), "chats": {}}
    metrics = name.startswith("featcache")
    try:
        print(f"[{name}] warm-up", flush=True)
        res["warmup"] = run_chat(base, images["warmup"], 1, max_tokens=max_tokens, metrics=metrics,
                                 image_id="warmup" if ids else None)
        for chat, image, turns, first in CHATS:
            print(f"[{name}] {chat}", flush=True)
            image_id = f"image-{image}" if ids else None
            res["chats"][chat] = run_chat(base, images[image], turns, first, max_tokens, metrics,
                                          image_id=image_id, id_known=image_id in known)
            known.add(image_id or "")
        if metrics:
            text = urllib.request.urlopen(f"{base}/metrics", timeout=5).read().decode()
            res["metrics_featcache_lines"] = [line for line in text.splitlines()
                                              if line.startswith("featcache_") and not line.endswith(" 0.0")]
    except Exception as e:  # keep what ran; the log tail says why
        res["error"] = f"{type(e).__name__}: {e}"
        print(f"[{name}] ERROR {res['error']}\n{tail(os.path.join(out, f'{name}.log'))}", flush=True)
    finally:
        res["server_rc"] = stop(proc)
    return res


def compare(plain: dict, fc: dict) -> dict[str, Any]:
    """Token ids turn by turn, featcache against plain; TTFT ratios; featcache hits per turn."""
    rows, mismatches = [], []
    for chat in fc.get("chats", {}):
        for p, f in zip(plain.get("chats", {}).get(chat, []), fc["chats"][chat], strict=False):
            same = p["output_ids"] == f["output_ids"] and bool(p["output_ids"])
            if not same:
                mismatches.append(f"{chat}#{f['turn']}")
            counts = f.get("featcache", {})
            hits = {k: v for k, v in counts.items() if "hit" in k}
            # the engine process's vision work (featcache serve --engine-process mp)
            model = {k.removeprefix("featcache_model_lmdeploy_"): v for k, v in counts.items()
                     if k.startswith("featcache_model_lmdeploy_vision")}
            rows.append({"chat": chat, "turn": f["turn"], "tokens_identical": same,
                         "ttft_ms_plain": p["ttft_ms"], "ttft_ms_featcache": f["ttft_ms"],
                         "speedup": (round(p["ttft_ms"] / f["ttft_ms"], 2)
                                     if p["ttft_ms"] and f["ttft_ms"] else None),
                         "cached_plain": p["cached_tokens"], "cached_featcache": f["cached_tokens"],
                         "featcache_hits": hits, **({"model_process": model} if model else {})})
    turns = len(rows)
    out = {"turns_compared": turns, "tokens_identical": turns > 0 and not mismatches,
           "mismatches": mismatches, "per_turn": rows}
    vision = [v for r in rows for k, v in r.get("model_process", {}).items()
              if k.startswith("vision_images") and 'rank="0"' in k]
    if vision:  # images rank 0 computed over the chats (every rank makes the same vision calls)
        out["model_vision_images"] = sum(vision)
    return out


def ids_vs_bytes(fc: dict, ids: dict) -> list[dict[str, Any]]:
    """Per turn: time to first token and the messages' size, the image sent as bytes every turn
    (featcache) against named by its id (featcache_ids)."""
    rows = []
    for chat, turns in ids.get("chats", {}).items():
        for b, i in zip(fc.get("chats", {}).get(chat, []), turns, strict=False):
            rows.append({"chat": chat, "turn": i["turn"], "ttft_ms_bytes": b["ttft_ms"],
                         "ttft_ms_id": i["ttft_ms"], "messages_bytes": b.get("messages_bytes"),
                         "messages_bytes_id": i.get("messages_bytes")})
    return rows


def print_table(model: str, cmp: dict) -> None:
    print(f"[serve] {model}: {cmp['turns_compared']} turns, tokens identical: "
          f"{cmp['tokens_identical']} {cmp['mismatches'] or ''}", flush=True)
    print("  chat            turn  ttft plain / featcache ms   x     cached plain / featcache  ids  "
          "featcache hits", flush=True)
    for r in cmp["per_turn"]:
        print(f"  {r['chat']:<15} {r['turn']:>4}  "
              f"{r['ttft_ms_plain']!s:>10} / {r['ttft_ms_featcache']!s:<10} "
              f"{r['speedup']!s:>5}  {r['cached_plain']!s:>6} / {r['cached_featcache']!s:<6}   "
              f"{'same' if r['tokens_identical'] else 'DIFF'}  {_short(r['featcache_hits'])}", flush=True)


# -- main ------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="append", required=True, help="checkpoint dir (repeatable)")
    p.add_argument("--backend", choices=["pytorch", "turbomind"], default="pytorch")
    p.add_argument("--out", default="serve_out")
    p.add_argument("--store-root", default="/tmp/serve_chat_store",
                   help="featcache's stores, one per model, emptied first (kept out of --out: an LMDB "
                   "map file is as large as its budget)")
    p.add_argument("--eager", action="store_true", help="PyTorch: --eager-mode (faster start)")
    p.add_argument("--skip-warm", action="store_true",
                   help="no `featcache warm` step (PyTorch; TurboMind never warms: other namespace)")
    p.add_argument("--max-tokens", type=int, default=8, help="new tokens per turn (default 8)")
    p.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                   help="one more argument for both servers (repeatable), "
                   "e.g. --server-arg=--trust-remote-code")
    p.add_argument("--budget", type=float, default=480,
                   help="seconds for the whole run: no server starts with less than 60 s left")
    p.add_argument("--image-ids", action="store_true",
                   help="a third server (featcache serve --trust-client-image-ids, its own store): "
                   "the same chats with each image named by an id, its bytes sent once")
    p.add_argument("--mp-engine", action="store_true",
                   help="one more server (PyTorch): featcache serve --engine-process mp (lmdeploy's "
                   "own process model, the engine in a second process; its own store, warmed too)")
    p.add_argument("--featcache-arg", action="append", default=[], metavar="ARG",
                   help="one more argument for the featcache servers only (repeatable), e.g. "
                   "--featcache-arg=--host-bytes=0")
    p.add_argument("--skip", action="append", default=[], choices=SERVERS[1:], metavar="SERVER",
                   help="leave this featcache server out (repeatable; plain always runs)")
    p.add_argument("--dry-run", action="store_true", help="print the commands and the plan; exit")
    args = p.parse_args(argv)
    t0 = time.monotonic()
    out_root = os.path.abspath(args.out)
    plans = []
    for model in args.model:
        name = os.path.basename(model.rstrip("/"))
        out = os.path.join(out_root, name) if len(args.model) > 1 else out_root
        store = os.path.join(os.path.abspath(args.store_root), name)
        cmds = commands(model, args.backend, store, args.eager, args.server_arg, args.image_ids,
                        args.mp_engine, tuple(args.featcache_arg))
        plans.append((model, out, store, {k: v for k, v in cmds.items() if k not in args.skip}))
    warm = args.backend == "pytorch" and not args.skip_warm
    if args.dry_run:
        for model, out, store, cmds in plans:
            print(f"[dry-run] model {model} -> {out} (store {store})")
            for name, cmd in cmds.items():
                print(f"[dry-run] {name}: {shlex.join(cmd)}")
            if warm:
                for name in (n for n in ("featcache", "featcache_mp") if n in cmds):
                    print(f"[dry-run] before {name}: {sys.executable} -m featcache warm {model} "
                          f"{out}/a.png --cache-dir {store}{STORES[name]}")
            try:
                print("[dry-run] parsed:", json.dumps(check_commands(cmds)))
            except ImportError as e:
                print(f"[dry-run] not parsed ({e}; needs lmdeploy)")
        print("[dry-run] chats (each server, in order): warmup 1 turn, "
              + ", ".join(f"{c} {t} turns (image {i})" for c, i, t, _ in CHATS)
              + f"; {args.max_tokens} new tokens per turn, greedy, ignore_eos, return_token_ids")
        return 0

    from chat import data_url  # examples/chat.py: 1344x1008 noise PNG

    result: dict[str, Any] = {"backend": args.backend, "max_tokens": args.max_tokens, "models": {},
                              "skipped": []}
    rc = 0
    for model, out, store, cmds in plans:
        os.makedirs(out, exist_ok=True)
        for suffix in STORES.values():  # featcache starts cold
            shutil.rmtree(store + suffix, ignore_errors=True)
        images = {name: data_url(None, seed) for name, seed in IMAGE_SEEDS.items()}
        if warm:  # `featcache warm` reads a file: the same bytes the chats send
            with open(os.path.join(out, "a.png"), "wb") as f:
                f.write(base64.b64decode(images["a"].split(",", 1)[1]))
        res: dict[str, Any] = {}
        result["models"][model] = res
        for name in [n for n in SERVERS if n in cmds]:
            left = args.budget - (time.monotonic() - t0)
            if left < 60:
                result["skipped"].append(f"{model} {name}: {left:.0f} s left")
                print(f"[serve] SKIPPED {model} {name}: {left:.0f} s left", flush=True)
                continue
            if name in ("featcache", "featcache_mp") and warm:
                t = time.monotonic()
                w = subprocess.run([sys.executable, "-m", "featcache", "warm", model,
                                    os.path.join(out, "a.png"), "--cache-dir", store + STORES[name]],
                                   capture_output=True, text=True, timeout=max(30, left - 60))
                print(w.stdout, w.stderr[-3000:], flush=True)
                res["warm" + STORES[name].replace("-", "_")] = {
                    "rc": w.returncode, "stdout": w.stdout.strip(),
                    "seconds": round(time.monotonic() - t, 1)}
                left = args.budget - (time.monotonic() - t0)
                if left < 60:  # no time left to start the server after all
                    result["skipped"].append(f"{model} {name}: {left:.0f} s left after warm")
                    print(f"[serve] SKIPPED {model} {name}: {left:.0f} s left after warm", flush=True)
                    continue
            try:
                res[name] = serve_and_chat(name, cmds[name], PORTS[name], images, out, args.max_tokens,
                                           ready_timeout=min(300, max(30, left - 30)))
            except Exception as e:
                res[name] = {"command": shlex.join(cmds[name]), "error": f"{type(e).__name__}: {e}"}
            if name in ("featcache", "featcache_mp"):
                stats = subprocess.run([sys.executable, "-m", "featcache", "stats",
                                        store + STORES[name], "--json"],
                                       capture_output=True, text=True, timeout=60)
                res["stats" + STORES[name].replace("-", "_")] = (
                    json.loads(stats.stdout) if stats.returncode == 0 else stats.stderr[-2000:])
        if "plain" in res and "featcache" in res:
            res["compare"] = compare(res["plain"], res["featcache"])
            print_table(model, res["compare"])
            rc |= 0 if res["compare"]["tokens_identical"] else 1
        if "plain" in res and "featcache_ids" in res:  # the same chats, images named by id
            res["compare_ids"] = compare(res["plain"], res["featcache_ids"])
            print_table(model + " (image ids)", res["compare_ids"])
            rc |= 0 if res["compare_ids"]["tokens_identical"] else 1
            if "featcache" in res:
                res["ids_vs_bytes"] = ids_vs_bytes(res["featcache"], res["featcache_ids"])
                print(f"[serve] image ids vs bytes: {json.dumps(res['ids_vs_bytes'])}", flush=True)
        if "plain" in res and "featcache_mp" in res:  # lmdeploy's process model, both sides
            res["compare_mp"] = compare(res["plain"], res["featcache_mp"])
            print_table(model + " (engine process mp)", res["compare_mp"])
            rc |= 0 if res["compare_mp"]["tokens_identical"] else 1
        if any("error" in res.get(k, {}) for k in SERVERS):
            rc |= 2
        with open(os.path.join(out_root, "serve_chat.json"), "w") as f:
            json.dump(result, f, indent=1)
    result["seconds"] = round(time.monotonic() - t0, 1)
    with open(os.path.join(out_root, "serve_chat.json"), "w") as f:
        json.dump(result, f, indent=1)
    for model, res in result["models"].items():
        for line in res.get("featcache", {}).get("metrics_featcache_lines", []):
            print(f"[metrics] {os.path.basename(model)} {line}")
    print(f"[serve] done in {result['seconds']} s, rc={rc}; {out_root}/serve_chat.json", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
