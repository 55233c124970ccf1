"""Hostile clients against `featcache serve` and plain `lmdeploy serve api_server`, on a GPU.

    python bench/hostile_serve.py --model DIR --out DIR [--servers plain,featcache_mp,featcache_in]
                                  [--budget S] [--dry-run]

One server at a time (the same requests, the same order), through the `openai` client:

1. **Sources** (featcache servers with `--allowed-local-media-path MEDIA --max-image-bytes 8MiB`):
   `/dev/zero`, a FIFO and a 1 GiB file inside MEDIA, a file outside it (as a path, a `file://`
   URL and a symbolic link inside MEDIA), `/etc/passwd`, a 9 MB data URL. Each: the HTTP status,
   the time to the answer, the message; after each, an ordinary request must still be answered.
   Plain lmdeploy gets the cases it survives (not `/dev/zero`, which takes all its memory), with a
   10 s client timeout (its FIFO read never returns).
2. **Decode options**: the same data URL with `media_io_kwargs` absent, `{"image": {"image_mode":
   "L"}}`, absent, "L" again, and a bad mode: every answer's token ids and prompt logprobs... (the
   first tokens' logprobs) set against plain's for the same request.
3. **A chat**: 3 turns resending one data URL: token ids against plain's.

Every answer is greedy with lmdeploy's `return_token_ids`; the report (`hostile.json`) holds each
case's rows and the verdicts (`sources_ok`: every hostile source got a 400 in < 1 s and the next
request was answered; `options_identical` and `chat_identical`: token ids and logprobs equal to
plain's). --dry-run prints the commands and the cases, then exits.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench.lib

from bench.lib.client import connect, extra_field, run_chat, served_model  # noqa: E402
from bench.lib.images import data_url, png  # noqa: E402
from bench.lib.results import write_report  # noqa: E402
from bench.lib.servers import featcache_command, lmdeploy_command, running, server_flags  # noqa: E402

PORTS = {"plain": 23410, "featcache_mp": 23411, "featcache_in": 23412}
CAP = "8MiB"
GREY = {"image": {"image_mode": "L"}}


SIZE = (448, 336)  # the PNGs' size


def prepare(media: str, outside: str) -> dict[str, str]:
    """The hostile sources (name -> image URL), made on disk."""
    os.makedirs(media, exist_ok=True)
    os.makedirs(outside, exist_ok=True)
    with open(os.path.join(outside, "secret.png"), "wb") as f:
        f.write(png(7, SIZE))
    fifo = os.path.join(media, "fifo.png")
    if not os.path.exists(fifo):
        os.mkfifo(fifo)
    with open(os.path.join(media, "big.png"), "wb") as f:
        f.truncate(1 << 30)  # 1 GiB, sparse
    link = os.path.join(media, "link.png")
    if not os.path.lexists(link):
        os.symlink(os.path.join(outside, "secret.png"), link)
    with open(os.path.join(media, "ok.png"), "wb") as f:
        f.write(png(8, SIZE))
    return {
        "dev_zero": "/dev/zero",
        "fifo_in_media": fifo,
        "1GiB_file_in_media": os.path.join(media, "big.png"),
        "path_outside_media": os.path.join(outside, "secret.png"),
        "file_url_outside_media": "file://" + os.path.join(outside, "secret.png"),
        "symlink_out_of_media": link,
        "etc_passwd": "/etc/passwd",
        "9MB_data_url": data_url(os.urandom(9_000_000)),
    }


PLAIN_SKIPS = {"dev_zero": "takes all of plain lmdeploy's memory: not sent to it"}


def commands(model: str, media: str, store: str, servers: list[str]) -> dict[str, list[str]]:
    flags = server_flags("pytorch", True, ["--logprobs-mode", "raw_logprobs"])
    ours = ["--allowed-local-media-path", media, "--max-image-bytes", CAP]
    cmds = {"plain": lmdeploy_command(model, PORTS["plain"], flags)}
    for name, process in (("featcache_mp", "mp"), ("featcache_in", "in")):
        cmds[name] = featcache_command(model, f"{store}-{process}", PORTS[name], flags, process, ours)
    return {k: v for k, v in cmds.items() if k in servers}


def ask(client: Any, model: str, url: str, extra: dict[str, Any] | None = None,
        timeout: float = 120, logprobs: bool = False) -> dict[str, Any]:
    """One greedy request with the image at ``url``: status, seconds, token ids and (``logprobs``:
    the servers run with --logprobs-mode raw_logprobs) each token's logprob."""
    import openai

    messages = [{"role": "user", "content": [{"type": "text", "text": "What is in this picture?"},
                                             {"type": "image_url", "image_url": {"url": url}}]}]
    body = {"return_token_ids": True, "ignore_eos": True, "top_k": 1, **(extra or {})}
    t = time.perf_counter()
    try:
        r = client.with_options(timeout=timeout).chat.completions.create(
            model=model, messages=messages, max_tokens=4, temperature=0, extra_body=body,
            **({"logprobs": True, "top_logprobs": 1} if logprobs else {}))
    except openai.APIStatusError as e:
        return {"status": e.status_code, "s": round(time.perf_counter() - t, 3),
                "message": str(e)[:300]}
    except openai.APITimeoutError:
        return {"status": "timeout", "s": round(time.perf_counter() - t, 3)}
    except openai.APIConnectionError as e:
        return {"status": "connection error", "s": round(time.perf_counter() - t, 3),
                "message": str(e)[:200]}
    choice = r.choices[0]
    ids = extra_field(choice, "output_ids")
    content = getattr(choice.logprobs, "content", None) or []
    return {"status": 200, "s": round(time.perf_counter() - t, 3), "output_ids": ids,
            "text": choice.message.content,
            "logprobs": [[c.token, c.logprob] for c in content]}


def run_server(name: str, cmd: list[str], cases: dict[str, str], good: str, out: str,
               ready_timeout: float) -> dict[str, Any]:
    res: dict[str, Any] = {}
    with running(name, cmd, PORTS[name], os.path.join(out, f"{name}.log"), ready_timeout, res) as base:
        res.update(sources={}, options=[], chat=None)
        client = connect(base, timeout=600)  # (openai's default; each request sets its own)
        model = served_model(client)
        for case, url in cases.items():
            if name == "plain" and case in PLAIN_SKIPS:
                res["sources"][case] = {"skipped": PLAIN_SKIPS[case]}
                continue
            row = ask(client, model, url, timeout=10 if name == "plain" else 30)
            if row["status"] == "timeout" and case == "fifo_in_media":
                _unblock(url)  # plain lmdeploy still reads it: let that read end (EOF)
            row["next_request"] = ask(client, model, good)["status"]
            res["sources"][case] = row
            print(f"[{name}] {case}: {row['status']} in {row['s']} s; next request "
                  f"{row['next_request']}", flush=True)
        for label, extra in (("default", None), ("grey", {"media_io_kwargs": GREY}),
                             ("default_again", None), ("grey_again", {"media_io_kwargs": GREY}),
                             ("bad_mode", {"media_io_kwargs": {"image": {"image_mode": "NOPE"}}})):
            row = {"request": label, **ask(client, model, good, extra, logprobs=True)}
            res["options"].append(row)
            print(f"[{name}] options {label}: {row['status']} {row.get('output_ids')}", flush=True)
        res["chat"] = run_chat(base, good, 3, model=model, max_tokens=8)
    return res


def _unblock(fifo: str) -> None:
    """Open a FIFO for writing and close it: a reader blocked on it gets end of file."""
    try:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:  # no reader (ENXIO): nothing blocked
        pass


def verdicts(results: dict[str, Any]) -> dict[str, Any]:
    plain = results.get("plain")
    out: dict[str, Any] = {}
    for name, res in results.items():
        if name == "plain" or "error" in res:
            continue
        rows = res["sources"].values()
        out[f"{name}_sources_ok"] = all(r.get("status") == 400 and r["s"] < 1.0
                                        and r.get("next_request") == 200 for r in rows)
        if plain and "error" not in plain:
            same = [_same(a, b) for a, b in zip(res["options"], plain["options"], strict=True)]
            out[f"{name}_options_identical"] = all(same)
            out[f"{name}_options_rows"] = same
            out[f"{name}_chat_identical"] = [a["output_ids"] for a in res["chat"] or []] == \
                [b["output_ids"] for b in plain["chat"] or []]
    if plain and "error" not in plain:
        opts = {r["request"]: r for r in plain["options"]}
        out["plain_grey_differs_from_default"] = (
            opts["default"].get("logprobs") != opts["grey"].get("logprobs"))
    return out


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a["status"] != b["status"]:
        return False
    return a["status"] != 200 or (a["output_ids"] == b["output_ids"] and a["logprobs"] == b["logprobs"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--servers", default="plain,featcache_mp,featcache_in")
    p.add_argument("--work", default="/tmp/hostile", help="where the hostile files and stores go")
    p.add_argument("--ready-timeout", type=float, default=240)
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args(argv)
    servers = args.servers.split(",")
    media, outside = os.path.join(args.work, "media"), os.path.join(args.work, "outside")
    cmds = commands(args.model, media, os.path.join(args.work, "store"), servers)
    if args.dry_run:
        for name, cmd in cmds.items():
            print(f"{name}: {shlex.join(cmd)}")
        print("cases:", ", ".join(["dev_zero", "fifo_in_media", "1GiB_file_in_media",
                                   "path_outside_media", "file_url_outside_media",
                                   "symlink_out_of_media", "etc_passwd", "9MB_data_url"]))
        return 0
    os.makedirs(args.out, exist_ok=True)
    cases = prepare(media, outside)
    good = data_url(png(9, SIZE))
    results = {}
    for name, cmd in cmds.items():
        results[name] = run_server(name, cmd, cases, good, args.out, args.ready_timeout)
    report = {"servers": results, "verdicts": verdicts(results),
              "cases": {k: (v if len(v) < 200 else f"data URL of {len(v)} chars") for k, v in cases.items()}}
    write_report(os.path.join(args.out, "hostile.json"), report)
    print(json.dumps(report["verdicts"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
