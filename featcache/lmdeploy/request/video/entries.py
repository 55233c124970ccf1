"""A video's keys, its entries and its lookup; how a read video rides through lmdeploy's parser.

lmdeploy's processor-level API splits a Qwen3-VL-lineage video into one engine item per frame
group (``get_expanded_mm_items``: each ``[1, h, w]`` of the video's ``[t, h, w]`` grid, with its own
span of video tokens), and its model runs the vision tower on those items as on images. featcache
caches each of them as an entry of its own, so the model hook serves them as it serves images:

- the video's key (``video_key``) is the digest of its encoded bytes, the model's namespace, and
  everything that changes what the model sees of them: the request's decode options
  (``num_frames``, ``fps``, ...), the processor size asked for videos, the item's own parameters,
  and what decodes and samples (``read.decoder_identity``: the loader, lmdeploy's and OpenCV's
  versions). Two samplings of one video never share an entry;
- item ``i``'s key is derived from the video's (``item_key``), its entry's metadata the item's
  fields (``entry_meta``, without its pixels) plus the video's own record (``INFO``: the item count,
  the video's grid and lmdeploy's video metadata, from which the processor's prompt text for the
  video is made again: its frame timestamps);
- a video hits only when every one of its items does (``lookup``: each entry leased, or none).

Between featcache's source resolution and lmdeploy's preprocessing the video passes through
lmdeploy's parser, which would read it again: featcache hands it over as a text part carrying the
video (``marker``) and puts the video item back once the parser is done (``restore``), as the parser
would have made it (``{"type": "video", "data": frames, "video_metadata": ..., **params}``) with its
``KeyedVideo`` beside (``VIDEO_FIELD``). A hit's ``data`` is the ``KeyedVideo`` itself, decoded
only if lmdeploy's own preprocessing has to run (``KeyedVideo.decoded``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ....core.cache import FeatureCache
from ....entrymeta import VIDEO_FIELD as VIDEO_RECORD
from ....keys import KeyHasher
from ..entry_meta import decode_item, encode_item
from ..refs import FeatRef
from ..sources import video_parts
from ..tags import FeatTag, Source
from .read import CONTAINER, decode

VIDEO_FIELD = "featcache_video"  # a restored video item's ``KeyedVideo``
MARK = "featcache_video_item"  # a text part standing for a video through lmdeploy's parser
INFO = VIDEO_RECORD  # the field of an item entry's metadata holding the video's record
STATED = "stated"  # the record's field of what the container states (``read.facts_record``)


@dataclass
class VideoHit:
    """A video whose every item is held: each item's lease (``FeatRef``), its dict from its
    metadata (0-row pixels) and the video's record (``INFO``)."""

    refs: list[FeatRef]
    items: list[dict[str, Any]]
    info: dict[str, Any]

    def release(self) -> None:
        for ref in self.refs:
            if getattr(ref, "lease", None) is not None:  # (a FeatTag holds none)
                ref.lease.release()


@dataclass
class KeyedVideo:
    """A video featcache read: its key, its bytes and decode options, and either its hit or (a
    miss) its decoded frames and lmdeploy's metadata for them."""

    key: bytes
    raw: bytes
    options: dict[str, Any]
    hit: VideoHit | None = None
    frames: Any = None
    metadata: dict[str, Any] | None = field(default=None)
    params: dict[str, Any] = field(default_factory=dict)  # the item's own (beside its source)
    form: str = CONTAINER  # ``raw``'s form: a container's bytes, or a data URL of frames (``read``)
    facts: Any = None  # a container's ``read.VideoFacts``, checked against the limits

    def decoded(self) -> tuple[Any, dict[str, Any]]:
        """(frames, metadata) as lmdeploy's parser would have made them (decoded now for a hit:
        lmdeploy's own preprocessing has to run after all)."""
        if self.frames is None:
            self.frames, self.metadata = decode(self.raw, self.options, self.form)
        assert self.metadata is not None
        return self.frames, self.metadata


def video_key(hasher: KeyHasher, namespace: str, raw: bytes, params: dict[str, Any]) -> bytes:
    """The key of a video's encoded bytes under ``params`` (the module docstring's list)."""
    return hasher.image_key(raw, namespace=namespace, params={"video": params})


def item_key(hasher: KeyHasher, namespace: str, key: bytes, index: int) -> bytes:
    """The key of a video's ``index``-th engine item."""
    return hasher.image_key(bytes(key), namespace=namespace, params={"video_item": index})


def entry_meta(item: dict[str, Any], namespace: str, info: dict[str, Any]) -> bytes:
    """An item entry's metadata: the item's fields but its offset and modality, its token count
    (``image_tokens``, what ``featcache ls`` shows), and the video's record."""
    start, end = item["offset"]
    fields = {k: v for k, v in item.items()
              if k not in ("offset", "modality") and not k.startswith("featcache")}
    return encode_item({**fields, "image_tokens": int(end) - int(start),
                        INFO: json.dumps(info, sort_keys=True)}, namespace)


def lookup(cache: FeatureCache, hasher: KeyHasher, namespace: str, key: bytes) -> VideoHit | None:
    """The video's hit if every one of its items is held (each leased), else None (none leased)."""
    def take(k: bytes, index: int) -> FeatRef | None:
        lease = cache.acquire(k)
        return None if lease is None else FeatRef(cache, k, lease.meta, lease)

    return _gathered(hasher, namespace, key, take)


def _gathered(hasher: KeyHasher, namespace: str, key: bytes,
              take: Any) -> VideoHit | None:
    """The video's items, each ``take(item_key, index)`` (a ref with its ``meta``, or None where
    the item is not there), as a ``VideoHit`` when every item of the video is there and their
    entries record the same video; else None, whatever was taken released."""
    refs: list[Any] = []
    items: list[dict[str, Any]] = []
    info: dict[str, Any] | None = None
    count = 1
    try:
        while len(refs) < count:
            ref = take(item_key(hasher, namespace, key, len(refs)), len(refs))
            if ref is None:
                raise LookupError
            refs.append(ref)
            item = decode_item(ref.meta)
            record = json.loads(item.pop(INFO))
            if info is None:
                info, count = record, int(record["items"])
            elif record != info:
                raise LookupError  # (entries of two videos under one key: never served)
            items.append(item)
    except Exception:  # a missing item, or metadata this version cannot read: a miss
        VideoHit(refs, items, {}).release()
        return None
    assert info is not None
    return VideoHit(refs, items, info)


def marker(params: dict[str, Any], video: KeyedVideo) -> dict[str, Any]:
    """What stands for a read video in lmdeploy's parser: a text part it passes on untouched."""
    return {"type": "text", "text": "", MARK: (params, video)}


def restore(messages: list[Any]) -> list[Any]:
    """``messages`` as lmdeploy's parser gave them, each ``marker`` turned back into the video item
    the parser would have made (a hit's data: its ``KeyedVideo``)."""
    def item(x: Any) -> Any:
        if not (isinstance(x, dict) and MARK in x):
            return x
        params, video = x[MARK]
        if video.hit is not None:
            data, metadata = video, video.hit.info["metadata"]
        else:
            data, metadata = video.frames, video.metadata
        return {"type": "video", "data": data, **params, "video_metadata": metadata, VIDEO_FIELD: video}

    out = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and any(isinstance(x, dict) and MARK in x for x in content):
            message = dict(message, content=[item(x) for x in content])
        out.append(message)
    return out


def video_source(item: Any) -> tuple[str, dict[str, Any]] | None:
    """(source, params) of a video part with a string source, as lmdeploy's parser reads them."""
    parts = video_parts(item) if isinstance(item, dict) else None
    return parts if parts is not None and isinstance(parts[0], str) else None


def has_videos(messages: list[Any]) -> bool:
    return any(isinstance(m, dict) and isinstance(m.get("content"), list)
               and any(video_source(x) is not None for x in m["content"]) for m in messages)


def source_decode(options: dict[str, Any], index: int, size: dict[str, int] | None,
                  form: str = CONTAINER) -> str:
    """A video item's ``tags.Source.decode`` (JSON): how a model process rebuilds item ``index``
    of the video from its bytes (``rebuild``): the request's decode options and video size, and
    the bytes' form where they are no container's."""
    how = {"io": options, "item": index, "size": size}
    return json.dumps({"video": how if form == CONTAINER else {**how, "form": form}}, sort_keys=True)


def sent_hit(keyer: Any, key: bytes, raw: bytes, options: dict[str, Any], params: dict[str, Any],
             size: dict[str, int] | None = None, form: str = CONTAINER) -> VideoHit | None:
    """Several processes: the video's items as a ``VideoHit`` of tags carrying its bytes, where
    this frontend sent every one of them to the model processes before (``keyer.sent``: their
    metadata), so it is neither decoded nor preprocessed again (a model process that no longer
    holds an item rebuilds it from the bytes: ``rebuild``); else None."""
    sent = keyer.sent
    try:
        values = json.dumps(params, sort_keys=True)
    except (TypeError, ValueError, RecursionError):  # (parameters it could not read back)
        return None

    def take(k: bytes, index: int) -> FeatTag | None:
        meta = sent.get(k) if sent is not None else None
        return None if meta is None else FeatTag(k, meta, Source(
            raw, source_decode(options, index, size, form), values))

    return _gathered(keyer.hasher, keyer.namespace, key, take)
