"""How the store tools read an entry's metadata: the ``"ns"`` (namespace) and the image's token
count of featcache's JSON entry metadata, from any bytes, without raising and without torch; and
the ``"cost_s"`` (what a hit saves) that ``FeatureCache.put`` records and value eviction weighs.

The format itself (one JSON object, keys sorted: ``{"fields": {...}, "ns": NAMESPACE, "pixels":
[...]}``) is written by ``featcache.lmdeploy.request.entry_meta``, which documents it whole; a
``FeatureCache`` user's own metadata may be anything, and reads as "not this format". Keys are
digests, so ``ns`` is the only way to tell which model an entry belongs to (``featcache ls``,
``purge --namespace``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

VIDEO_FIELD = "featcache_video"  # (``featcache.lmdeploy.request.video.entries.INFO``)


@dataclass(frozen=True)
class EntryMeta:
    """An entry's metadata as the store tools show it (any bytes: this format or not)."""

    size: int  # bytes
    is_json: bool
    record: Any  # the decoded JSON value (None when empty or not JSON)
    namespace: str | None  # "ns" of a JSON object, when a string
    image_tokens: int | None  # the image's token count, when recorded
    # a video's engine item: the video's record (``featcache.lmdeploy.request.video.entries``:
    # "items", "grid", "metadata", "options"), or None
    video: dict[str, Any] | None = None


def read(meta: bytes) -> EntryMeta:
    """What ``meta`` says, for tools; never raises."""
    try:
        record = json.loads(meta) if meta else None
        is_json = bool(meta)
    except (UnicodeDecodeError, ValueError):
        record, is_json = None, False
    tokens = video = None
    if isinstance(record, dict):
        fields = record.get("fields")
        nested = fields if isinstance(fields, dict) else {}
        found = record.get("image_tokens", nested.get("image_tokens"))
        tokens = found if isinstance(found, int) and not isinstance(found, bool) else None
        try:
            video = json.loads(nested[VIDEO_FIELD]) if isinstance(nested.get(VIDEO_FIELD), str) else None
        except ValueError:
            video = None
    return EntryMeta(len(meta), is_json, record, _namespace(record), tokens,
                     video if isinstance(video, dict) else None)


def namespace_of(meta: bytes) -> str | None:
    """The namespace ``meta`` records (``"ns"`` of a JSON object), or None; never raises."""
    if not meta.startswith(b"{"):  # cheap for the opaque metadata a scan may meet
        return None
    try:
        return _namespace(json.loads(meta))
    except (UnicodeDecodeError, ValueError):
        return None


def _namespace(record: Any) -> str | None:
    ns = record.get("ns") if isinstance(record, dict) else None
    return ns if isinstance(ns, str) else None


def _json_object(meta: bytes | None, field: str) -> dict[str, Any]:
    """``meta`` as the JSON object a ``field=`` of ``put`` is recorded in (empty for no metadata);
    ``ValueError`` for metadata that is not one (opaque bytes have nowhere to record it)."""
    if not meta:
        return {}
    try:
        record = json.loads(meta)
    except (UnicodeDecodeError, ValueError):
        record = None
    if not isinstance(record, dict):
        raise ValueError(f"{field}= is recorded in the entry's metadata, which must then be "
                         "None or a JSON object; these meta bytes are not one")
    return record


def with_namespace(meta: bytes | None, namespace: str) -> bytes:
    """``meta`` with ``namespace`` recorded as its ``"ns"`` (what ``FeatureCache.put(...,
    namespace=...)`` stores, so that ``featcache ls`` shows it and ``purge --namespace`` finds it):
    ``{"ns": namespace}`` for no metadata, the JSON object with ``"ns"`` set for a JSON object.

    Raises ``TypeError`` for a namespace that is not a non-empty string, ``ValueError`` for
    metadata that is not a JSON object (opaque bytes have nowhere to record it) or that records
    another namespace."""
    if not isinstance(namespace, str) or not namespace:
        raise TypeError(f"namespace must be a non-empty str, not {namespace!r}")
    record = _json_object(meta, "namespace")
    if record.get("ns", namespace) != namespace:
        raise ValueError(f"meta records namespace {record['ns']!r}, not {namespace!r}")
    record["ns"] = namespace
    return json.dumps(record, sort_keys=True, separators=(",", ":")).encode()


COST_FIELD = "cost_s"  # what a hit on the entry saves: the seconds its miss's computation took


def cost_of(meta: bytes) -> float | None:
    """The cost ``meta`` records (``"cost_s"`` of a JSON object: the seconds of computation a hit
    on the entry saves), or None; never raises. What the memory tiers' value eviction weighs
    (``featcache.eviction.value``); cheap for metadata without one (a byte search)."""
    if b'"cost_s"' not in meta or not meta.startswith(b"{"):
        return None
    try:
        record = json.loads(meta)
    except (UnicodeDecodeError, ValueError):
        return None
    cost = record.get(COST_FIELD) if isinstance(record, dict) else None
    if isinstance(cost, bool) or not isinstance(cost, (int, float)):
        return None
    return float(cost) if 0 <= cost < float("inf") else None


def with_cost(meta: bytes | None, cost_s: float) -> bytes:
    """``meta`` with ``cost_s`` recorded as its ``"cost_s"`` (what ``FeatureCache.put(...,
    cost_s=...)`` stores, so the cost travels with the entry through every tier and restart):
    ``{"cost_s": cost_s}`` for no metadata, the JSON object with it set for a JSON object.

    Raises ``TypeError`` for a cost that is not a number, ``ValueError`` for a negative or
    infinite one or for metadata that is not a JSON object (opaque bytes have nowhere to record
    it)."""
    if isinstance(cost_s, bool) or not isinstance(cost_s, (int, float)):
        raise TypeError(f"cost_s must be a number of seconds, not {type(cost_s).__name__} {cost_s!r}")
    if not 0 <= cost_s < float("inf"):
        raise ValueError(f"cost_s must be a finite number of seconds >= 0, not {cost_s!r}")
    record = _json_object(meta, "cost_s")
    record[COST_FIELD] = round(float(cost_s), 6)
    return json.dumps(record, sort_keys=True, separators=(",", ":")).encode()


def recorded(meta: bytes | None, namespace: str | None, carried: object = None) -> bytes | None:
    """The metadata ``FeatureCache.put`` stores: ``meta`` with the namespace recorded. An explicit
    ``namespace`` must be recordable (``with_namespace``'s errors); one ``carried`` by the key (an
    ``ImageKey``'s; "" when made without) is recorded where it can be, else the caller's ``meta``
    is stored as it is."""
    if namespace is not None:
        return with_namespace(meta, namespace)
    if not carried or not isinstance(carried, str):
        return meta
    try:
        return with_namespace(meta, carried)
    except ValueError:  # opaque, or another namespace: the caller's metadata wins
        return meta
