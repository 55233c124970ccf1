"""featcache serve's video limits (``featcache.lmdeploy.request.media.VideoLimits``): its options,
how each is read, and the limits they make."""

from __future__ import annotations

import argparse
from typing import Any

from ..config import VIDEO_DEFAULTS
from ..sizes import format_bytes, parse_bytes


def _bytes(text: str) -> int:
    try:
        return parse_bytes(text)
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive(kind: type) -> Any:
    def parse(text: str) -> Any:  # (argparse words a ValueError)
        value = _bytes(text) if kind is bytes else kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be more than 0, not {text}")
        return value
    return parse


# featcache serve's video limits (featcache.lmdeploy.request.media.VideoLimits), by field
VIDEO_FLAGS = [
    ("max_video_bytes", _positive(bytes), "the most bytes read of one video (file, data URL, http body)"),
    ("max_video_seconds", _positive(float), "the longest video, by its stated duration"),
    ("max_video_frames", _positive(int), "the most frames a video may hold (the decoder walks them)"),
    ("max_sampled_frames", _positive(int), "the most frames a request's sampling may keep of one video"),
    ("max_frame_pixels", _positive(int), "the most pixels of one video frame (width x height)"),
]


def shown_default(name: str) -> str:
    value = VIDEO_DEFAULTS[name]
    return format_bytes(int(value)) if name == "max_video_bytes" else f"{value:.0f}"


def video_limits(args: argparse.Namespace) -> Any:
    """The ``VideoLimits`` of featcache serve's video options (the defaults where not given)."""
    from ..lmdeploy.request.media import VideoLimits

    return VideoLimits(**{name: getattr(args, name) for name, _, _ in VIDEO_FLAGS
                          if getattr(args, name) is not None})
