"""``featcache stats --url``: a running ``featcache serve``'s counters, read from its ``/metrics``.

Hits and misses live in each process's memory (``FeatureCache.stats()``), not in the store, so the
hit ratios of a server are read where it exports them: the Prometheus text of its ``/metrics``
(``featcache.metrics``). Only the ``featcache_*`` samples are read; a page without any is an error
(the server runs without featcache, or with ``--disable-metrics``). Where the model runs in other
processes (lmdeploy's mp engine, tp > 1) the server exports each model process's cache too
(``featcache_model_*{rank}``): summed up per rank under ``model_processes``.
"""

from __future__ import annotations

import http.client
import math
import re
import urllib.parse
from typing import Any

from ..errors import FeatCacheError
from .command import UsageError

_SAMPLE = re.compile(r"^(featcache_[A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def metrics_url(url: str) -> str:
    """``url`` with ``/metrics`` when it names no path; http(s) only (``UsageError`` else)."""
    usage = f"--url: {url!r} is not an http(s) address like http://HOST:PORT"
    try:
        parts = urllib.parse.urlsplit(url if "://" in url else f"http://{url}")
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number in range
    except ValueError:  # e.g. an unclosed [IPv6 address
        raise UsageError(usage) from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UsageError(usage)
    return urllib.parse.urlunsplit(parts._replace(path=parts.path if parts.path not in ("", "/")
                                                  else "/metrics"))


def parse(text: str) -> list[tuple[str, dict[str, str], float]]:
    """The ``featcache_*`` samples of a Prometheus text page: (name, labels, value). A whole
    value is an ``int`` (the exposition format writes counters as floats: ``3.0``), so that
    counts stay integers in ``--json``; a value that is not a finite number is skipped."""
    out: list[tuple[str, dict[str, str], float]] = []
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m is None:
            continue
        labels = dict(_LABEL.findall(m.group(2) or ""))
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        if math.isfinite(value):
            out.append((m.group(1), labels, int(value) if value.is_integer() else value))
    return out


def _ratio(hits: float, misses: float) -> float | None:
    return round(hits / (hits + misses), 4) if hits + misses else None


MODEL = "featcache_model_"  # the model processes' families (featcache.metrics.process_families)


def summary(samples: list[tuple[str, dict[str, str], float]]) -> dict[str, Any]:
    """``_summary`` of the server's own samples and, where the model runs in other processes
    (``featcache_model_*{rank}``), ``model_processes``: rank -> the same summary of that
    process's samples."""
    doc = _summary([x for x in samples if not x[0].startswith(MODEL)])
    ranks: dict[str, list[tuple[str, dict[str, str], float]]] = {}
    for name, labels, value in samples:
        if name.startswith(MODEL) and "rank" in labels:
            rest = {k: v for k, v in labels.items() if k != "rank"}
            ranks.setdefault(labels["rank"], []).append(
                ("featcache_" + name.removeprefix(MODEL), rest, value))
    if ranks:
        doc["model_processes"] = {rank: _summary(ranks[rank])
                                  for rank in sorted(ranks, key=lambda r: (len(r), r))}
    return doc


def _summary(samples: list[tuple[str, dict[str, str], float]]) -> dict[str, Any]:
    """Lookups and their hit ratio, per tier hits/misses/ratio/entries/bytes, and every
    integration's image counters (``featcache_<section>_<event>_total``) with its hit ratio."""
    lookups: dict[str, float] = {}
    tiers: dict[str, dict[str, float | None]] = {}
    sections: dict[str, dict[str, float | None]] = {}
    for name, labels, value in samples:
        if name == "featcache_lookups_total" and "result" in labels:
            lookups[labels["result"]] = value
        elif name.startswith("featcache_tier_") and "tier" in labels:
            field = name.removeprefix("featcache_tier_").removesuffix("_total")
            tiers.setdefault(labels["tier"], {})[field] = value
        elif name.startswith("featcache_lmdeploy_") and name.endswith("_total"):
            event = name.removeprefix("featcache_lmdeploy_").removesuffix("_total")
            sections.setdefault("lmdeploy", {})[event] = value
    for t in tiers.values():
        t["hit_ratio"] = _ratio(t.get("hits") or 0, t.get("misses") or 0)
    for s in sections.values():
        s["hit_ratio"] = _ratio(s.get("hits") or 0, s.get("misses") or 0)
    return dict(lookups=lookups, hit_ratio=_ratio(lookups.get("hit", 0), lookups.get("miss", 0)),
                tiers=tiers, **sections)


def server_stats(url: str, timeout_s: float = 5.0) -> dict[str, Any]:
    """``summary`` of the page at ``url`` (``metrics_url``). Raises ``FeatCacheError`` naming
    the address and what to check when the server cannot be read, or its page holds no featcache
    metrics."""
    target = metrics_url(url)
    text = _fetch(target, timeout_s)
    samples = parse(text)
    if not samples:
        raise FeatCacheError(f"no featcache metrics at {target}: check that it is a featcache "
                             "serve's address and that it runs without --disable-metrics")
    return dict(url=target, **summary(samples))


def _fetch(target: str, timeout_s: float) -> str:
    """The page at ``target``; ``FeatCacheError`` with the address and what to check if it
    cannot be read."""
    import urllib.error  # (here: ~20 ms of imports, only for --url)
    import urllib.request

    check = "check that featcache serve runs there and listens on that host and port"
    try:
        with urllib.request.urlopen(target, timeout=timeout_s) as response:  # noqa: S310 - http(s)
            return str(response.read().decode("utf-8", "replace"))
    except urllib.error.HTTPError as e:
        raise FeatCacheError(
            f"{target} answered HTTP {e.code} {e.reason}: check the address (a featcache serve "
            "answers at /metrics, the path --url takes by default)") from None
    except urllib.error.URLError as e:  # refused, no such host, TLS, ...
        why = e.reason.strerror if isinstance(e.reason, OSError) and e.reason.strerror else e.reason
        raise FeatCacheError(f"cannot reach {target} ({why}): {check}") from None
    except TimeoutError:
        raise FeatCacheError(f"no answer from {target} in {timeout_s:g} s: {check}") from None
    except (http.client.HTTPException, OSError) as e:  # not an HTTP server, connection reset
        said = " ".join(str(e).split())[:80]  # what it sent may span lines: one line, short
        raise FeatCacheError(f"{target} did not answer as an HTTP server "
                             f"({type(e).__name__}{': ' + said if said else ''}): {check}") from None


def lines(doc: dict[str, Any]) -> list[str]:
    """The human form of ``server_stats``."""
    out = [f"server metrics at {doc['url']}", *_lines(doc)]
    for rank, process in doc.get("model_processes", {}).items():
        out.append(f"model process, rank {rank} (its own cache):")
        out += ["  " + line for line in _lines(process)]
    return out


def _lines(doc: dict[str, Any]) -> list[str]:
    def pct(r: float | None) -> str:
        return "-" if r is None else f"{100 * r:.1f}%"

    out = []
    lk = doc["lookups"]
    out.append(f"lookups: {int(lk.get('hit', 0))} hits, {int(lk.get('miss', 0))} misses, "
               f"hit ratio {pct(doc['hit_ratio'])}")
    s = doc.get("lmdeploy", {})
    if "images" in s:
        out.append(f"images (lmdeploy): {int(s.get('images') or 0)}, {int(s.get('hits') or 0)} hits, "
                   f"{int(s.get('misses') or 0)} misses, hit ratio {pct(s['hit_ratio'])}")
    if "vision_images" in s or "vision_skipped" in s:  # where the model runs
        out.append(f"vision model (lmdeploy): {int(s.get('vision_images') or 0)} images computed "
                   f"in {int(s.get('vision_calls') or 0)} calls, {int(s.get('vision_skipped') or 0)} "
                   f"served from the cache, {int(s.get('pixels_rebuilt') or 0)} rebuilt from bytes")
    out.append(f"{'tier':<8} {'hits':>10} {'misses':>10} {'ratio':>7} {'entries':>9} {'bytes':>14}")
    for tier, t in doc["tiers"].items():
        out.append(f"{tier:<8} {int(t.get('hits') or 0):>10} {int(t.get('misses') or 0):>10} "
                   f"{pct(t['hit_ratio']):>7} {int(t.get('entries') or 0):>9} "
                   f"{int(t.get('bytes') or 0):>14}")
    return out
