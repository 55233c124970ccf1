"""The frontend hook: keys images before preprocessing, and skips preprocessing for hits.

Installed on the instance ``VisionModel.preprocess(messages)`` of lmdeploy's ``ImageEncoder``
(it runs on the encoder's worker thread, off the engine loop). For each image of a request:

- key it (``image_key`` over the decoded image, the model identity and the image's parameters);
- ``acquire`` it from the cache: a device hit is free; a host or disk hit is promoted here, on
  this thread. A hit becomes a per-image dict rebuilt from the entry's metadata with a 0-row
  ``pixel_values`` placeholder, plus a ``FeatRef`` holding the lease;
- run lmdeploy's own preprocessing once, for the misses only, and tag each of their dicts with a
  ``FeatRef`` so the model stores their features.

Any failure inside featcache here falls back to lmdeploy's plain preprocessing of the whole
request (counted as ``frontend_errors``): a failure is a miss, never a failed request.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from ..cache import FeatureCache
from ..keys import image_key
from .refs import REF_KEY, FeatRef, decode_item, encode_item

log = logging.getLogger("featcache")
SECTION = "lmdeploy"

Preprocess = Callable[[list[dict[str, Any]]], list[dict[str, Any]]]


def install_frontend(vision_model: Any, cache: FeatureCache, namespace: str) -> None:
    """Replace ``vision_model.preprocess`` (an instance attribute shadowing the method)."""
    original: Preprocess = vision_model.preprocess
    if getattr(original, "_featcache", False):
        raise RuntimeError("featcache is already installed on this pipeline")
    frontend = Frontend(cache, original, namespace)

    @functools.wraps(original)
    def preprocess(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return frontend(messages)

    preprocess._featcache = True  # type: ignore[attr-defined]
    preprocess.frontend = frontend  # type: ignore[attr-defined]
    vision_model.preprocess = preprocess


class Frontend:
    def __init__(self, cache: FeatureCache, original: Preprocess, namespace: str) -> None:
        self.cache = cache
        self.original = original
        self.namespace = namespace
        self._logged = False

    def __call__(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        try:
            return self._preprocess(messages)
        except Exception:
            self.cache.count(SECTION, "frontend_errors")
            if not self._logged:
                self._logged = True
                log.exception("featcache: frontend failed; preprocessing without the cache")
            return self.original(messages)

    def _preprocess(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        items = _image_items(messages)
        if items is None:  # a video or other modality: not ours, leave the request alone
            return self.original(messages)
        count = self.cache.count
        hits: dict[int, dict[str, Any]] = {}  # item index -> its per-image dict
        keys: list[bytes | None] = []
        for index, (_, _, item) in enumerate(items):
            key = self._key(item)
            keys.append(key)
            if key is None:
                continue
            lease = self.cache.acquire(key)
            if lease is None:
                continue
            try:
                hit = decode_item(lease.meta)
            except Exception:  # no record, or one this version cannot read: a miss (the
                lease.release()  # model's put will replace the entry)
                self.cache.count(SECTION, "unreadable_meta")
                continue
            hit[REF_KEY] = FeatRef(self.cache, key, lease.meta, lease)
            hits[index] = hit
        count(SECTION, "images", len(items))
        count(SECTION, "hits", len(hits))
        count(SECTION, "misses", len(items) - len(hits))
        count(SECTION, "preprocess_skipped", len(hits))

        if not hits:
            messages = self.original(list(messages))  # a copy: the fallback needs the original
            self._tag_misses(_preprocessed(messages), keys)
            return messages
        missed = [i for i in range(len(items)) if i not in hits]
        outputs: list[dict[str, Any]] = []
        if missed:
            filtered = _without(messages, [items[i] for i in hits])
            outputs = _preprocessed(self.original(filtered))
            self._tag_misses(outputs, [keys[i] for i in missed])
        miss_outputs = iter(outputs)
        merged = [hits[i] if i in hits else next(miss_outputs) for i in range(len(items))]
        messages.append(dict(role="preprocess", content=merged))
        return messages

    def _key(self, item: dict[str, Any]) -> bytes | None:
        params = {k: v for k, v in item.items() if k not in ("type", "data")}
        try:
            return image_key(item["data"], namespace=self.namespace, params=params)
        except (TypeError, ValueError) as e:
            self.cache.count(SECTION, "uncacheable")
            log.debug("featcache: image not cached (%s)", e)
            return None

    def _tag_misses(self, outputs: list[dict[str, Any]], keys: list[bytes | None]) -> None:
        if len(outputs) != len(keys):
            raise RuntimeError(f"preprocess returned {len(outputs)} items for {len(keys)} images")
        for output, key in zip(outputs, keys, strict=True):
            if key is None:
                continue
            try:
                meta = encode_item(output)
            except TypeError as e:
                self.cache.count(SECTION, "uncacheable")
                log.debug("featcache: image not cached (%s)", e)
                continue
            output[REF_KEY] = FeatRef(self.cache, key, meta, None)


def _image_items(messages: list[dict[str, Any]]) -> list[tuple[int, int, dict[str, Any]]] | None:
    """(message index, content index, item) of every multimodal item, as lmdeploy's
    ``collect_multimodal_items`` orders them; None if any is not an image."""
    items = []
    for m, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for c, item in enumerate(content):
            if not isinstance(item, dict) or item.get("type") in (None, "text"):
                continue
            if item["type"] != "image":
                return None
            items.append((m, c, item))
    return items


def _without(
    messages: list[dict[str, Any]], drop: list[tuple[int, int, dict[str, Any]]]
) -> list[dict[str, Any]]:
    """A copy of ``messages`` without the given items (the originals are left untouched)."""
    gone = {(m, c) for m, c, _ in drop}
    out = []
    for m, message in enumerate(messages):
        content = message.get("content")
        if isinstance(content, list) and any((m, c) in gone for c in range(len(content))):
            message = dict(message, content=[x for c, x in enumerate(content) if (m, c) not in gone])
        out.append(message)
    return out


def _preprocessed(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    preps = [m["content"] for m in messages if m.get("role") == "preprocess"]
    if len(preps) != 1:
        raise RuntimeError(f"expected one 'preprocess' message, found {len(preps)}")
    return list(preps[0])
