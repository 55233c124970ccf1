"""lmdeploy's message lists as its vision models read them: their image items in lmdeploy's own
order (``collect_multimodal_items``'), a copy without some of them, one with every image featcache
holds unread decoded (for lmdeploy's own preprocessing), and the per-image dicts of a
preprocessed list. Never changes the lists it is given."""

from __future__ import annotations

from typing import Any

from .sources import CachedImage
from .video.entries import VIDEO_FIELD, KeyedVideo


def image_items(messages: list[dict[str, Any]]) -> list[tuple[int, int, dict[str, Any]]] | None:
    """(message index, content index, item) of every multimodal item, as lmdeploy's
    ``collect_multimodal_items`` orders them; None if any is not an image."""
    split = media_items(messages)
    return None if split is None or split[1] else split[0]


def media_items(messages: list[dict[str, Any]]
                ) -> tuple[list[tuple[int, int, dict[str, Any]]], list[dict[str, Any]]] | None:
    """(image items as ``image_items`` gives them, video items) in lmdeploy's order; None if any
    item is of another modality (audio, time series)."""
    images, videos = [], []
    for m, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for c, item in enumerate(content):
            if not isinstance(item, dict) or item.get("type") in (None, "text"):
                continue
            if item["type"] == "image":
                images.append((m, c, item))
            elif item["type"] == "video":
                videos.append(item)
            else:
                return None
    return images, videos


def without(
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


def decoded(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with every ``CachedImage`` decoded, and every video featcache read handed over
    as lmdeploy's parser makes it (a held one decoded now), for lmdeploy's own preprocessing."""
    def item(x: Any) -> Any:
        if isinstance(x, dict) and isinstance(x.get("data"), CachedImage):
            return dict(x, data=x["data"].decode())
        if isinstance(x, dict) and isinstance(x.get(VIDEO_FIELD), KeyedVideo):
            frames, metadata = x[VIDEO_FIELD].decoded()
            out = dict(x, data=frames, video_metadata=metadata)
            del out[VIDEO_FIELD]
            return out
        return x

    return [dict(m, content=[item(x) for x in m["content"]])
            if isinstance(m, dict) and isinstance(m.get("content"), list) else m for m in messages]


def preprocessed(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    preps = [m["content"] for m in messages if m.get("role") == "preprocess"]
    if len(preps) != 1:
        raise RuntimeError(f"expected one 'preprocess' message, found {len(preps)}")
    return list(preps[0])
