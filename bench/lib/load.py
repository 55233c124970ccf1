"""Chat traffic against a server, by request class: an image chat's first turn (its image a miss
the first time), its later turns (the image resent with the history), a text chat's first and
later turns. Per class the count, p50, p99 and p99/p50 of time to first token: a request that
waits on another's work (a disk write, a demotion, a rebuild) shows as a p99 far above its
class's p50 (the stall measure: p99 at most 1.2x p50).

``load_test``: concurrent clients for a while, each sending its next turn as soon as the last one
is answered (closed loop: a faster server is offered more, and its mix of classes shifts toward
the ones it serves faster), or at most one turn per ``turn_interval`` seconds (paced: while the
server keeps up, every server is offered the same requests per second of each class, so their
classes' times compare at equal load); ``mixed``: the same classes one request at a time (nothing
overlaps, so a slow turn waited on work an earlier request left behind).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from bench.lib.client import QUESTIONS, connect, stream_turn
from bench.lib.stages import read as read_stages
from bench.lib.stages import summarize
from bench.lib.timing import quantile


def request_class(text_only: bool, turn: int) -> str:
    """``image_first_turn``, ``image_later_turns``, ``text_first_turn`` or ``text_later_turns``."""
    return ("text" if text_only else "image") + ("_first_turn" if turn == 0 else "_later_turns")


def user_turn(turn: int, url: str | None, suffix: str = "") -> dict[str, Any]:
    """A chat's user message at ``turn``: a question (``suffix`` after it), with the image at
    ``url`` on the first turn (None: a text chat)."""
    text = QUESTIONS[turn % len(QUESTIONS)] + suffix
    if turn > 0 or url is None:
        return {"role": "user", "content": text}
    return {"role": "user", "content": [{"type": "text", "text": text},
                                        {"type": "image_url", "image_url": {"url": url}}]}


def class_table(by_class: dict[str, list[float]]) -> dict[str, Any]:
    """Per request class: count, p50, p99 and p99/p50 of time to first token."""
    classes = {}
    for kind, values in sorted(by_class.items()):
        p50, p99 = quantile(values, 0.5), quantile(values, 0.99)
        classes[kind] = {"n": len(values), "ttft_p50": p50, "ttft_p99": p99,
                         "p99_over_p50": round(p99 / p50, 2) if p50 and p99 else None}
    return classes


def load_test(base: str, model: str, urls: list[str], clients: int, seconds: float,
              max_tokens: int, turns: int = 4, text_clients: int = 0,
              turn_interval: float = 0.0) -> dict[str, Any]:
    """``clients`` threads chatting for ``seconds`` (``turns``-turn chats, the image resent every
    turn), client c's k-th chat over image (c+k) % n, beside ``text_clients`` threads whose chats
    have no image: requests/s, p50/p99 time to first token, per request class too (``classes``),
    failed requests (a request without a token counts as one). ``turn_interval`` > 0: each client
    starts a turn at most every that many seconds (its clients' phases spread over one interval);
    ``late`` counts the turns that started late because the previous answer took longer (a server
    that did not keep up with the offered load)."""
    start = time.monotonic()
    deadline = start + seconds
    late = [0]
    lock = threading.Lock()
    ttfts: list[float] = []
    by_class: dict[str, list[float]] = {}
    failures: list[str] = []

    def client_loop(c: int) -> None:
        client = connect(base)
        chat = 0
        text_only = c >= clients
        due = start + (turn_interval * c / max(1, clients + text_clients) if turn_interval else 0.0)
        while time.monotonic() < deadline:
            url = None if text_only else urls[(c + chat) % len(urls)]
            history: list[dict] = []
            for turn in range(turns):
                if turn_interval:  # paced: this turn's slot, or at once if the last answer overran it
                    now = time.monotonic()
                    if now > due + 0.05:
                        with lock:
                            late[0] += 1
                    time.sleep(max(0.0, due - now))
                    due = max(due, now) + turn_interval
                if time.monotonic() >= deadline:
                    return
                history.append(user_turn(turn, url))
                try:
                    row = stream_turn(client, model, history, max_tokens)
                    if row["ttft_ms"] is None:
                        raise RuntimeError("no token")
                except Exception as e:  # noqa: BLE001 (counted: must stay 0)
                    with lock:
                        failures.append(f"{type(e).__name__}: {e}"[:300])
                    break
                with lock:
                    ttfts.append(row["ttft_ms"])
                    by_class.setdefault(request_class(text_only, turn), []).append(row["ttft_ms"])
                history.append({"role": "assistant", "content": row["text"] or "ok"})
            chat += 1

    t = time.monotonic()
    threads = [threading.Thread(target=client_loop, args=(c,)) for c in range(clients + text_clients)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    took = time.monotonic() - t
    return {"clients": clients, "text_clients": text_clients, "turn_interval": turn_interval,
            "late_turns": late[0], "seconds": round(took, 1),
            "requests": len(ttfts), "rps": round(len(ttfts) / took, 2),
            "ttft_p50": quantile(ttfts, 0.5), "ttft_p99": quantile(ttfts, 0.99),
            "classes": class_table(by_class), "failed": len(failures), "failures": failures[:10]}


def mixed(base: str, model: str, urls: list[str], rounds: int, max_tokens: int, seq0: int,
          turns: int = 4) -> dict[str, Any]:
    """Issue 27's stall case, one request at a time: per round a ``turns``-turn chat over a new
    image (its first turn a miss; the image resent with the history every later turn), then a
    ``turns``-turn text-only chat. Nothing overlaps, so a turn far above its class's p50 waited on
    work left behind by an earlier request (a disk write, a demotion, a rebuild, a collection).
    Per class p50/p99 (``classes``) and every turn (``turns``: class, round, ttft, request seq)."""
    client = connect(base)
    rows: list[dict[str, Any]] = []
    errors: list[str] = []
    seq = seq0
    for r in range(rounds):
        for text_only in (False, True):
            history: list[dict] = []
            for turn in range(turns):
                kind = request_class(text_only, turn)
                history.append(user_turn(turn, None if text_only else urls[r % len(urls)], f" (chat {r})"))
                try:
                    row = stream_turn(client, model, history, max_tokens)
                except Exception as e:  # noqa: BLE001 (reported; the order of seq is lost)
                    errors.append(f"{type(e).__name__}: {e}"[:300])
                    return {"rounds": rounds, "turns": rows, "errors": errors, "classes": {}}
                rows.append({"class": kind, "round": r, "turn": turn, "ttft_ms": row["ttft_ms"],
                             "prompt_tokens": row["prompt_tokens"], "cached_tokens": row["cached_tokens"],
                             "seq": seq})
                seq += 1
                history.append({"role": "assistant", "content": row["text"] or "ok"})
    by_class: dict[str, list[float]] = {}
    for row in rows:
        by_class.setdefault(row["class"], []).append(row["ttft_ms"])
    return {"rounds": rounds, "turns": rows, "errors": errors, "classes": class_table(by_class)}


def attach_mixed_stages(res: dict[str, Any], stages_file: str, slowest: int = 4) -> None:
    """The server's stage summaries onto the ``slowest`` turns of each class (where the time went)."""
    try:
        rows = read_stages(stages_file)
    except OSError:
        return
    by_class: dict[str, list[dict[str, Any]]] = {}
    for t in res.get("turns", []):
        by_class.setdefault(t["class"], []).append(t)
    for turns in by_class.values():
        for t in sorted(turns, key=lambda x: -(x["ttft_ms"] or 0))[:slowest]:
            if t["seq"] < len(rows):
                t["stages"] = summarize(rows[t["seq"]])


def print_mixed(mixed_runs: dict[str, Any]) -> None:
    """The table of ``mixed`` runs per server: each class's p50, p99 and slowest turns."""
    if not mixed_runs:
        return
    print("\nmixed chats, one request at a time (a stall: p99 over 1.2x p50)")
    print(f"  {'server':<14} {'class':<20} {'n':>4} {'p50':>9} {'p99':>9} {'p99/p50':>8}  "
          "slowest turns (round.turn ms)")
    for server, res in mixed_runs.items():
        for kind, c in res.get("classes", {}).items():
            slow = sorted((t for t in res["turns"] if t["class"] == kind), key=lambda x: -x["ttft_ms"])[:3]
            slowest = ", ".join(f"{t['round']}.{t['turn']} {t['ttft_ms']:.0f}" for t in slow)
            print(f"  {server:<14} {kind:<20} {c['n']:>4} {c['ttft_p50']:>9} {c['ttft_p99']:>9} "
                  f"{c['p99_over_p50']:>8}  {slowest}")
        if res.get("errors"):
            print(f"  {server}: ERRORS {res['errors']}")
