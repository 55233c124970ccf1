"""The per-stage records bench/serve_stages.py writes (one JSON line per chat request, timed in
the server's own process): reading them, and turning one into stages, each owned by featcache or
lmdeploy, that add up to the request's first byte.

A record: ``marks_ms`` (ms since the request reached the app: ``body_read``, ``endpoint``,
``prepared``, ``generate_start``, ``first_output``, ``first_byte``, ``end``), ``spans_ms`` (a
span's nesting path, ``a>b``, -> [ms, calls]), ``body_bytes``, ``session_id`` and ``engine`` (the
in-process engine's share, or None).
"""

from __future__ import annotations

import collections
import json
import statistics
from typing import Any

# (span name -> label) in the order a request meets them; a span's time is its own (its children's
# taken out). Owner: featcache for fc_*, lmdeploy otherwise.
LABELS = [
    ("json_parse", "JSON parse (body)"),
    ("parse_items", "image items parsed (lmdeploy's thread hops)"),
    ("load_from_url", "image source read (data URL split/file open)"),
    ("http_fetch", "http fetch"),
    ("load_base64", "base64 decode (lmdeploy)"),
    ("load_file", "file read + decode (lmdeploy)"),
    ("image_decode", "PNG decode + convert"),
    ("fc_resolve", "featcache resolve (rest)"),
    ("fc_source_bytes", "featcache source bytes (base64/file/http)"),
    ("fc_key", "featcache keying"),
    ("fc_acquire", "featcache lookup"),
    ("vl_preprocess", "preprocess queue + hops"),
    ("fc_frontend", "featcache frontend (rest)"),
    ("fc_preprocess", "featcache image preprocessing (fastprep; lmdeploy's where it falls back)"),
    ("model_preprocess", "lmdeploy image preprocessing"),
    ("template", "chat template (+ multimodal wrap)"),
    ("text_prompt", "chat template (text)"),
    ("tokenize", "tokenization"),
    ("engine_preprocess", "lmdeploy preprocess (rest)"),
    ("prepare", "request setup (rest)"),
]


def exclusive(spans: dict[str, list[float]]) -> dict[str, float]:
    """Per span name, the time of its own (summed over paths, children taken out), in ms."""
    own: dict[str, float] = collections.defaultdict(float)
    for path, (ms, _) in spans.items():
        children = sum(v[0] for p, v in spans.items()
                       if p.startswith(path + ">") and ">" not in p[len(path) + 1:])
        own[path.rsplit(">", 1)[-1]] += ms - children
    return dict(own)


def summarize(row: dict[str, Any]) -> dict[str, Any]:
    """One request's stages: ``rows`` [(label, owner, ms)] in order, and totals per owner. The
    timeline's pieces (body read, validation, prepare, engine, send) add up to the first byte."""
    marks, spans = row["marks_ms"], row["spans_ms"]
    own = exclusive(spans)
    rows: list[tuple[str, str, float]] = []

    def add(label: str, owner: str, ms: float | None) -> None:
        if ms is not None:
            rows.append((label, owner, round(ms, 3)))

    body = marks.get("body_read")
    add("read body", "lmdeploy", body)
    if body is not None and "endpoint" in marks:
        add("validate (pydantic, deps) + hops", "lmdeploy",
            marks["endpoint"] - body - own.get("json_parse", 0.0))
    for name, label in LABELS:
        if name in own:
            add(label, "featcache" if name.startswith("fc_") else "lmdeploy", own[name])
    if "prepared" in marks and "generate_start" in marks:
        add("prepared -> generate", "lmdeploy", marks["generate_start"] - marks["prepared"])
    first = marks.get("first_output")
    start = marks.get("generate_start")
    engine = row.get("engine")
    if first is not None and start is not None:
        if engine:  # in process: queueing, the add, prefill steps, the rest
            add("engine: queue to add", "lmdeploy", engine["add_at_ms"] - start)
            spans_e = engine.get("add_spans_ms", {})
            fc_in = spans_e.get("fc_input_processor", 0.0)
            add("engine: featcache input processor", "featcache", fc_in)
            add("engine: add message (rest)", "lmdeploy", engine["add_ms"] - fc_in)
            prefill = sum(s[1] for s in engine["steps"] if not s[2])
            add("engine: prefill step(s)", "lmdeploy", prefill)
            add("engine: waits, decode steps, output", "lmdeploy",
                first - engine["add_at_ms"] - engine["add_ms"] - prefill)
        else:
            add("submit -> first output (engine process)", "lmdeploy", first - start)
    if first is not None and "first_byte" in marks:
        add("first output -> first byte (detokenize, SSE)", "lmdeploy", marks["first_byte"] - first)
    totals: dict[str, float] = collections.defaultdict(float)
    for _, owner, ms in rows:
        totals[owner] += ms
    return {"rows": rows, "totals": {k: round(v, 3) for k, v in totals.items()},
            "first_byte_ms": marks.get("first_byte")}


def read(path: str) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def medians(summaries: list[dict[str, Any]]) -> list[tuple[str, str, float]]:
    """Per stage (label, owner), in the order first met, the median ms over ``summaries``
    (``summarize``'s outputs); a request without a stage does not count for it."""
    by: dict[tuple[str, str], list[float]] = {}
    for one in summaries:
        for label, owner, ms in one.get("rows", []):
            by.setdefault((label, owner), []).append(ms)
    return [(label, owner, round(statistics.median(v), 2)) for (label, owner), v in by.items()]
