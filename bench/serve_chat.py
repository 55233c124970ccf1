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
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
import urllib.request
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench.lib

from bench.lib.client import run_chat, short  # noqa: E402
from bench.lib.images import chat_url, url_bytes  # noqa: E402
from bench.lib.models import label  # noqa: E402
from bench.lib.results import write_report  # noqa: E402
from bench.lib.servers import (  # noqa: E402
    PORTS,
    SERVERS,
    STORES,
    check_commands,
    commands,
    running,
)

# (name, image, turns, index of the first question): A twice (the second time in a fresh context
# with another first question: an image hit in featcache, not a prefix hit), B once
CHATS = [("image_a", "a", 4, 0), ("image_b", "b", 4, 0), ("image_a_again", "a", 3, 4)]
IMAGE_SEEDS = {"a": 1, "b": 2, "warmup": 3}
WARMED = ("featcache", "featcache_mp")  # the servers `featcache warm` fills first (PyTorch)


def serve_and_chat(name: str, cmd: list[str], port: int, images: dict[str, str], out: str,
                   max_tokens: int, ready_timeout: float) -> dict[str, Any]:
    ids = name == "featcache_ids"  # the client names each image; bytes only the first time
    known: set[str] = set()
    res: dict[str, Any] = {}
    metrics = name.startswith("featcache")
    with running(name, cmd, port, os.path.join(out, f"{name}.log"), ready_timeout, res) as base:
        res["chats"] = {}
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
              f"{'same' if r['tokens_identical'] else 'DIFF'}  {short(r['featcache_hits'])}", flush=True)


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
        name = label(model)
        out = os.path.join(out_root, name) if len(args.model) > 1 else out_root
        store = os.path.join(os.path.abspath(args.store_root), name)
        cmds = commands(model, args.backend, store, args.eager, args.server_arg, args.image_ids,
                        args.mp_engine, tuple(args.featcache_arg))
        plans.append((model, out, store, {k: v for k, v in cmds.items() if k not in args.skip}))
    warm = args.backend == "pytorch" and not args.skip_warm
    if args.dry_run:
        print_plan(plans, warm, args.max_tokens)
        return 0

    def left() -> float:  # seconds of the budget
        return args.budget - (time.monotonic() - t0)

    result: dict[str, Any] = {"backend": args.backend, "max_tokens": args.max_tokens, "models": {},
                              "skipped": []}
    path = os.path.join(out_root, "serve_chat.json")
    rc = 0
    for model, out, store, cmds in plans:
        os.makedirs(out, exist_ok=True)
        for suffix in STORES.values():  # featcache starts cold
            shutil.rmtree(store + suffix, ignore_errors=True)
        images = {name: chat_url(seed) for name, seed in IMAGE_SEEDS.items()}
        if warm:  # `featcache warm` reads a file: the same bytes the chats send
            with open(os.path.join(out, "a.png"), "wb") as f:
                f.write(url_bytes(images["a"]))
        res: dict[str, Any] = {}
        result["models"][model] = res
        for name in [n for n in SERVERS if n in cmds]:
            if skipped(result, f"{model} {name}", left(), ""):
                continue
            if name in WARMED and warm:
                res["warm" + STORES[name].replace("-", "_")] = warm_store(
                    model, os.path.join(out, "a.png"), store + STORES[name], max(30, left() - 60))
                if skipped(result, f"{model} {name}", left(), " after warm"):  # none left to start it
                    continue
            try:
                res[name] = serve_and_chat(name, cmds[name], PORTS[name], images, out, args.max_tokens,
                                           ready_timeout=min(300, max(30, left() - 30)))
            except Exception as e:
                res[name] = {"command": shlex.join(cmds[name]), "error": f"{type(e).__name__}: {e}"}
            if name in WARMED:
                res["stats" + STORES[name].replace("-", "_")] = store_stats(store + STORES[name])
        rc |= comparisons(model, res)
        write_report(path, result)  # rewritten after each model, with the run's metadata
    result["seconds"] = round(time.monotonic() - t0, 1)
    write_report(path, result)
    for model, res in result["models"].items():
        for line in res.get("featcache", {}).get("metrics_featcache_lines", []):
            print(f"[metrics] {label(model)} {line}")
    print(f"[serve] done in {result['seconds']} s, rc={rc}; {path}", flush=True)
    return rc


def print_plan(plans: list[tuple[str, str, str, dict[str, list[str]]]], warm: bool, max_tokens: int) -> None:
    """--dry-run: each server's command (parsed by featcache's and lmdeploy's parsers when
    lmdeploy is installed), the warm-ups and the chats."""
    for model, out, store, cmds in plans:
        print(f"[dry-run] model {model} -> {out} (store {store})")
        for name, cmd in cmds.items():
            print(f"[dry-run] {name}: {shlex.join(cmd)}")
        if warm:
            for name in (n for n in WARMED if n in cmds):
                print(f"[dry-run] before {name}: {sys.executable} -m featcache warm {model} "
                      f"{out}/a.png --cache-dir {store}{STORES[name]}")
        try:
            print("[dry-run] parsed:", json.dumps(check_commands(cmds)))
        except ImportError as e:
            print(f"[dry-run] not parsed ({e}; needs lmdeploy)")
    print("[dry-run] chats (each server, in order): warmup 1 turn, "
          + ", ".join(f"{c} {t} turns (image {i})" for c, i, t, _ in CHATS)
          + f"; {max_tokens} new tokens per turn, greedy, ignore_eos, return_token_ids")


def skipped(result: dict[str, Any], what: str, left: float, when: str) -> bool:
    """A server starts only with 60 s of the budget left; one that does not is recorded."""
    if left >= 60:
        return False
    result["skipped"].append(f"{what}: {left:.0f} s left{when}")
    print(f"[serve] SKIPPED {what}: {left:.0f} s left{when}", flush=True)
    return True


def warm_store(model: str, image_file: str, store: str, timeout: float) -> dict[str, Any]:
    """``featcache warm MODEL IMAGE --cache-dir STORE``: its exit code, output and seconds."""
    t = time.monotonic()
    w = subprocess.run([sys.executable, "-m", "featcache", "warm", model, image_file, "--cache-dir", store],
                       capture_output=True, text=True, timeout=timeout)
    print(w.stdout, w.stderr[-3000:], flush=True)
    return {"rc": w.returncode, "stdout": w.stdout.strip(), "seconds": round(time.monotonic() - t, 1)}


def store_stats(store: str) -> Any:
    """``featcache stats STORE --json`` (its stderr's tail where it failed)."""
    stats = subprocess.run([sys.executable, "-m", "featcache", "stats", store, "--json"],
                           capture_output=True, text=True, timeout=60)
    return json.loads(stats.stdout) if stats.returncode == 0 else stats.stderr[-2000:]


def comparisons(model: str, res: dict[str, Any]) -> int:
    """Each featcache server against plain (and the ids server against the bytes one), tables
    printed; the exit code's bits: 1 tokens differ, 2 a server failed."""
    rc = 0
    for name, key, title in (("featcache", "compare", model),
                             ("featcache_ids", "compare_ids", model + " (image ids)"),
                             ("featcache_mp", "compare_mp", model + " (engine process mp)")):
        if "plain" in res and name in res:
            res[key] = compare(res["plain"], res[name])
            print_table(title, res[key])
            rc |= 0 if res[key]["tokens_identical"] else 1
    if "featcache" in res and "compare_ids" in res:  # the same chats, images named by id
        res["ids_vs_bytes"] = ids_vs_bytes(res["featcache"], res["featcache_ids"])
        print(f"[serve] image ids vs bytes: {json.dumps(res['ids_vs_bytes'])}", flush=True)
    if any("error" in res.get(k, {}) for k in SERVERS):
        rc |= 2
    return rc


if __name__ == "__main__":
    sys.exit(main())
