"""A request's videos, read before lmdeploy's parser: once, under the server's limits; keyed; a hit
not decoded (``read`` for the reading and the limits, ``entries`` for the keys and the hand-over).

``resolve_videos`` runs in the frontend's ``resolve_sources`` (``SourceResolver``), and, for a model
featcache does not cache, in the ``SourceGuard`` (``cache`` None: every video read and decoded here
under the limits, nothing keyed). A video part lmdeploy would read from a string source becomes a
``marker`` holding its ``KeyedVideo``; ``entries.restore`` puts it back after the parser. A data URL
of frames (``video/jpeg``) is read, keyed and decoded as lmdeploy reads it (``read.read_frames``).
"""

from __future__ import annotations

from typing import Any

from ..media import MediaPolicy
from .entries import STATED, KeyedVideo, lookup, marker, sent_hit, video_key, video_source
from .read import (
    CONTAINER,
    JPEG,
    VideoLimits,
    checked,
    decode,
    decoder_identity,
    is_frames,
    probe,
    read_frames,
    read_video,
    recorded_facts,
    video_io_options,
)

SECTION = "lmdeploy"


def resolve_videos(messages: list[Any], media_io_kwargs: Any, domains: Any, media: MediaPolicy,
                   limits: VideoLimits, keyer: Any = None) -> list[Any]:
    """``messages`` with each readable video part read, checked and (``keyer``: the frontend, with
    its ``cache``, ``hasher``, ``namespace`` and ``tags``) keyed and looked up; a ``marker`` in its
    place. New messages where any video was read; raises ``MediaOptionError``, ``MediaError``,
    ``BadVideoError``, ``FetchError`` for the client's request (answered 400)."""
    options = video_io_options(media_io_kwargs)
    identity = decoder_identity()
    out = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list) or message.get("role") not in ("user", "tool"):
            out.append(message)
            continue
        items = [_resolve(x, options, identity, domains, media, limits, keyer) for x in content]
        out.append(dict(message, content=items))
    return out


def _resolve(item: Any, options: dict[str, Any], identity: dict[str, Any], domains: Any,
             media: MediaPolicy, limits: VideoLimits, keyer: Any) -> Any:
    parts = video_source(item)
    if parts is None:
        return item
    source, params = parts
    if is_frames(source):
        form, raw = JPEG, read_frames(source, limits)
    else:
        form, read = CONTAINER, read_video(source, media, limits, domains)
        if read is None:
            return item
        raw = read
    video = KeyedVideo(b"", raw, options, params=params, form=form)
    if keyer is not None:
        keyed = {"io": options, "item": params, "decoder": identity}
        try:
            video.key = video_key(keyer.hasher, keyer.namespace, raw,
                                  keyed if form == CONTAINER else {**keyed, "form": form})
        except (TypeError, ValueError):  # parameters that cannot be keyed: read, not cached
            keyer.cache.count(SECTION, "uncacheable")
        if video.key:  # (several processes: what this frontend sent the model processes before)
            video.hit = (sent_hit(keyer, video.key, raw, options, params, form=form) if keyer.tags
                         else lookup(keyer.cache, keyer.hasher, keyer.namespace, video.key))
    if form == CONTAINER:
        _check(video, options, limits)
    if keyer is not None:
        keyer.cache.count(SECTION, "videos")
        if video.key:
            keyer.cache.count(SECTION, "video_hits" if video.hit is not None else "video_misses")
    if video.hit is None:
        video.frames, video.metadata = decode(raw, options, form)
    else:
        keyer.cache.count(SECTION, "video_decode_skipped")
    return marker(params, video)


def _check(video: KeyedVideo, options: dict[str, Any], limits: VideoLimits) -> None:
    """A container's stated facts checked against the limits: a hit's as its entries recorded
    them (the same bytes: what OpenCV would read of them again), else read now (``probe``), kept
    for the entries the model makes of it. Past a limit, a hit's leases are released and the
    ``MediaError`` raised."""
    held = recorded_facts(video.hit.info.get(STATED)) if video.hit is not None else None
    try:
        if held is not None:
            video.facts = checked(held, options, limits)
        else:
            video.facts = probe(video.raw, options, limits)
    except BaseException:
        if video.hit is not None:
            video.hit.release()
            video.hit = None
        raise
