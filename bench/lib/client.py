"""The client side of a served benchmark: the ``openai`` client against lmdeploy's api_server
(or ``featcache serve``), one streamed greedy turn, a chat that resends its image every turn, and
featcache's counters from the server's ``/metrics``.

Every turn asks for lmdeploy's ``return_token_ids`` (so a chunk comes with the first token even
when a random model's tokens decode to no text) and ``ignore_eos`` (every answer has
``max_tokens`` tokens), greedy (temperature 0, top_k 1).
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
from typing import Any

QUESTIONS = ["What is in this picture?", "Describe the colours.", "What stands out most?",
             "Summarise it in five words.", "What would you title it?", "Anything unusual?"]


def connect(base_url: str, timeout: float = 120) -> Any:
    """An ``openai`` client for the server at ``base_url`` (no retries: a failure is reported)."""
    from openai import OpenAI

    return OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=timeout)


def served_model(client: Any) -> str:
    """The name the server serves its model under."""
    name: str = client.models.list().data[0].id
    return name


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
    """The counters that changed, by how much."""
    return {k: v - before.get(k, 0.0) for k, v in sorted(after.items()) if v != before.get(k, 0.0)}


def short(counts: dict[str, float]) -> str:
    """Counters in one compact line (names without featcache_ and _total; no lookup timings)."""
    keep = {k.removeprefix("featcache_").removesuffix("_total"): int(v) for k, v in counts.items()
            if not k.startswith("featcache_lookup_seconds")}
    return json.dumps(keep, separators=(",", ":"))


def extra_field(obj: Any, name: str) -> Any:
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
    ttft, usage = None, None
    parts: list[str] = []
    ids: list[int] = []
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
        ids.extend(extra_field(choice, "output_ids") or [])
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
    even the first turn carries the bytes). One dict per turn; ``metrics``: with the change of
    featcache's counters over the turn."""
    client = connect(base_url)
    model = model or served_model(client)
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
              + (f", featcache {short(row['featcache'])}" if metrics else ""), flush=True)
        history.append({"role": "assistant", "content": row["text"]})
    return out
