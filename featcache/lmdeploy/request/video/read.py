"""What featcache reads of a video a request names, and the limits it reads it under.

lmdeploy 0.18 reads a ``video_url`` (a data URL, a local file, an http(s) URL) with no limit of its
own: it decodes every frame of the container up to the last one it samples (OpenCV's ``grab``), and
holds every sampled frame at full resolution (``frames x height x width x 3`` bytes, allocated from
the container's stated size before one frame is read). A client that sends a long, large or
lying video, or asks to sample thousands of frames (``media_io_kwargs.video.num_frames``), costs the
server what it likes. featcache reads every video source itself, once, and refuses one over the
server's ``VideoLimits`` before decoding it (``probe``: the container's stated frame count, rate and
resolution, read by the decoder lmdeploy uses), with a ``MediaError`` (a 400) naming the limit:

- ``max_video_bytes``: the encoded video, as read from a file, a data URL or an http body;
- ``max_video_seconds``: its stated duration (frames / rate);
- ``max_video_frames``: the frames the decoder may walk through (the container's stated count: a
  container that states fewer than it holds is read only up to what it states, lmdeploy's loop);
- ``max_sampled_frames``: the frames the request's sampling keeps (lmdeploy's ``smart_nframes``
  over the request's ``num_frames`` and ``fps``), each held decoded;
- ``max_frame_pixels``: one frame's width x height.

Memory is then bounded by ``max_video_bytes`` plus ``max_sampled_frames x max_frame_pixels x 3``.
The decode itself is lmdeploy's (``VideoMediaIO(...).load_bytes``, whichever backend it chooses), on
the bytes read here: a hit is never decoded, a miss is decoded once. A container OpenCV cannot
open, one that states no frame, or bytes its decoder fails on are a ``BadVideoError`` (400).

A video may also come as a sequence of frames (``JPEG``: a ``data:video/jpeg;base64,`` URL of
comma-separated base64 images, lmdeploy's form for frames a client sampled itself). lmdeploy
decodes every frame of it, unsampled, at an ``fps`` of the request's options or 2; featcache reads
the URL as lmdeploy's parser does (``urlparse``, then its split), checks the URL's length, the
frame count and every frame's stated size (its header, nothing decoded) against the same limits,
and decodes it with lmdeploy's own reader (``load_from_url``). Its "bytes" are the URL itself.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
from dataclasses import dataclass
from typing import Any

from ....config import VIDEO_OPTIONS as OPTION
from ....sizes import format_bytes
from ..httpfetch import fetch_http
from ..media import MediaError, MediaOptionError, MediaPolicy, MediaTooLarge, VideoLimits, shown
from ..sources import encoded_bytes, is_data_url, is_http

MAX_VIDEO_OPTIONS_BYTES = 4 << 10  # a request's video decode options, as canonical JSON
# the options lmdeploy's video reader takes (``VideoMediaIO(num_frames, **kwargs)``, its loaders'
# ``load_bytes(data, num_frames, fps, max_duration)``), each a number
VIDEO_OPTIONS = ("num_frames", "fps", "max_duration")
DEFAULT_NUM_FRAMES = 32  # lmdeploy's ``VideoMediaIO`` default
CONTAINER, JPEG = "container", "jpeg"  # a video's forms: encoded bytes, or a data URL of frames


class BadVideoError(ValueError):
    """A video a client sent cannot be read as one (no container the decoder opens, no frame,
    damaged): the client's to fix, answered 400 with this message."""


def _over(limits: VideoLimits, name: str, what: str, advice: str) -> MediaError:
    value = getattr(limits, name)
    shown_value = format_bytes(value) if name == "max_video_bytes" else f"{value:g}"
    return MediaError(f"{what}, more than this server's {OPTION[name]} ({shown_value}): {advice} "
                      f"(the server's operator may raise {OPTION[name]})")


def video_io_options(media_io_kwargs: Any) -> dict[str, Any]:
    """A request's video decode options (``media_io_kwargs["video"]``), checked: a JSON object of
    at most ``MAX_VIDEO_OPTIONS_BYTES`` holding only ``VIDEO_OPTIONS``, each a number
    (``num_frames`` an integer, -1 for every frame, or at least 1). ``MediaOptionError`` otherwise
    (lmdeploy would pass anything on to its decoder)."""
    if media_io_kwargs is None:
        return {}
    if not isinstance(media_io_kwargs, dict):
        raise MediaOptionError(f"media_io_kwargs must be an object, not {type(media_io_kwargs).__name__}")
    options = media_io_kwargs.get("video") or {}
    if not isinstance(options, dict):
        raise MediaOptionError("media_io_kwargs.video must be an object of named options")
    unknown = sorted(str(k)[:40] for k in options if k not in VIDEO_OPTIONS)
    if unknown:
        raise MediaOptionError(f"media_io_kwargs.video takes {', '.join(VIDEO_OPTIONS)} only, not "
                               f"{', '.join(unknown)[:200]}")
    for name, value in options.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise MediaOptionError(f"media_io_kwargs.video.{name} must be a number, not {value!r:.40}")
    frames = options.get("num_frames", DEFAULT_NUM_FRAMES)
    if not isinstance(frames, int) or not (frames == -1 or frames >= 1):
        raise MediaOptionError(f"media_io_kwargs.video.num_frames must be an integer, -1 (every "
                               f"frame) or at least 1, not {frames!r:.40}")
    if len(json.dumps(options, sort_keys=True)) > MAX_VIDEO_OPTIONS_BYTES:
        raise MediaOptionError("media_io_kwargs.video is too large")
    return dict(options)


def read_video(source: str, media: MediaPolicy, limits: VideoLimits,
               allowed_media_domains: list[str] | None = None) -> bytes | None:
    """The encoded video behind ``source`` (a base64 data URL, a local file under ``media``'s
    directory, an http(s) URL fetched with lmdeploy's checks and its video timeout), at most
    ``limits.max_video_bytes`` of it; None for a data URL that is no base64 data URL (lmdeploy's to
    refuse). A sequence of frames is ``read_frames``'s (``is_frames``). ``MediaError`` for a source
    the policy or the limits refuse, ``FetchError`` for a URL that cannot be fetched,
    ``ValueError`` for a file that cannot be read."""
    cap = limits.max_video_bytes
    policy = dataclasses.replace(media, max_image_bytes=cap)
    try:
        if is_http(source):
            return fetch_http(source, allowed_media_domains, policy, medium="video", cap=cap)
        raw = encoded_bytes(source, policy)
    except MediaTooLarge:  # (the readers' cap, here the video's own): said in the video's terms
        raise _over(limits, "max_video_bytes", f"the video {shown(source)!r} is larger",
                    "send a shorter or smaller video") from None
    if raw is None and not is_data_url(source):
        raise ValueError(f"cannot read video file {shown(source)!r}: no such file, or not readable "
                         "by the server")
    return raw


HEAD_CHARS = 4096  # of a data URL, parsed alone where they decide its media type (``is_frames``)


def is_frames(source: str) -> bool:
    """Whether ``source`` is a sequence of frames (``JPEG``) as lmdeploy tells one: a data URL
    whose media type, after its parse, is ``video/jpeg`` in any case.

    Parsed from its first ``HEAD_CHARS`` where they decide it (a megabyte-long URL is not
    sanitized whole for its first few bytes): ``urlparse``'s path of a prefix, without a network
    location, is a prefix of the whole URL's path, so a comma in it with data after it gives the
    same media type and the same verdict on the data; any other prefix (no comma yet, nothing
    after it, a ``//`` location) is decided by the whole URL."""
    if not is_data_url(source):
        return False
    if len(source) > HEAD_CHARS:
        from urllib.parse import urlparse

        head = urlparse(source[:HEAD_CHARS])
        if not head.netloc and head.path.partition(",")[2]:
            return _path_parts(head.path)[0].lower() == "video/jpeg"
    return _frames_parts(source)[0].lower() == "video/jpeg"


def _frames_parts(url: str) -> tuple[str, str, str]:
    """(media type, data type, data) of a data URL, split as lmdeploy's ``_load_data_url`` splits
    ``urlparse(url).path`` (which drops what follows a ``?`` or ``#``, and tabs and newlines);
    ("", "", "") where it would refuse the URL."""
    from urllib.parse import urlparse

    return _path_parts(urlparse(url).path or "")


def _path_parts(path: str) -> tuple[str, str, str]:
    """``_frames_parts`` of a data URL's parsed path."""
    parts = path.split(",", 1)
    if len(parts) != 2 or not parts[1]:
        return "", "", ""
    media = parts[0].split(";", 1)
    return (media[0].lstrip("/"), media[1], parts[1]) if len(media) == 2 else ("", "", "")


def read_frames(source: str, limits: VideoLimits) -> bytes:
    """A ``JPEG`` video's data URL as its bytes, checked (module docstring) without decoding a
    frame: ``MediaError`` past a limit, ``BadVideoError`` for a frame that is no image."""
    if len(source) > 4 * -(-limits.max_video_bytes // 3) + 64:
        raise _over(limits, "max_video_bytes", f"the video of this data URL ({len(source)} characters) "
                    "is larger", "send a shorter or smaller video")
    if not source.isascii():
        raise BadVideoError("a video/jpeg data URL is base64 text: send its frames base64-encoded")
    raw = source.encode("ascii")
    frames = read_frames_url(raw)
    most = min(limits.max_sampled_frames, limits.max_video_frames)
    if len(frames) > most:
        name = "max_sampled_frames" if most == limits.max_sampled_frames else "max_video_frames"
        raise _over(limits, name, f"this data URL holds {len(frames)} frames", "send fewer frames")
    frames_problem(frames, limits)
    return raw


def read_frames_url(raw: bytes) -> list[str]:
    """The base64 frames of a ``JPEG`` video's URL (its bytes), as lmdeploy splits them;
    ``BadVideoError`` for a URL lmdeploy would not read as base64 frames."""
    try:
        media, kind, data = _frames_parts(raw.decode("ascii"))
    except UnicodeDecodeError:
        media, kind, data = "", "", ""
    if media.lower() != "video/jpeg" or kind != "base64":
        raise BadVideoError("a video/jpeg data URL is ';base64,' then its frames, comma-separated")
    return data.split(",")


def frames_problem(frames: list[str], limits: VideoLimits | None = None) -> None:
    """Each frame's header read as lmdeploy's image reader would open it (``pybase64``, then
    Pillow): ``BadVideoError`` for a frame that is no image; with ``limits``, ``MediaError`` for
    one over ``max_frame_pixels`` (without: the frontend checked them when it read the video)."""
    import pybase64
    from PIL import Image, UnidentifiedImageError

    for i, frame in enumerate(frames):
        try:
            with Image.open(io.BytesIO(pybase64.b64decode(frame))) as image:
                width, height = image.size
        except (OSError, ValueError, UnidentifiedImageError, Image.DecompressionBombError) as e:
            raise BadVideoError(f"frame {i} of the video is no image ({type(e).__name__}): send "
                                "base64-encoded JPEG frames") from None
        if limits is not None and width * height > limits.max_frame_pixels:
            raise _over(limits, "max_frame_pixels", f"frame {i} of the video is {width}x{height} "
                        f"({width * height} pixels)", "send smaller frames")


@dataclass(frozen=True)
class VideoFacts:
    """What a container states (``probe``)."""

    frames: int
    fps: float
    width: int
    height: int

    @property
    def seconds(self) -> float:
        return self.frames / self.fps if self.fps > 0 else 0.0


def stated(raw: bytes) -> VideoFacts:
    """The container's stated frames, rate and size, read by OpenCV as lmdeploy's loader reads them
    (from the bytes, its stream-buffered backend), no frame decoded. ``BadVideoError`` for bytes it
    cannot open or that state no frame."""
    import cv2
    from lmdeploy.vl.media.video_loader import OpenCVVideoLoader

    stream = io.BytesIO(raw)  # (shares the bytes; held here: OpenCV keeps no reference to it)
    cap = cv2.VideoCapture(stream, OpenCVVideoLoader().get_cv2_video_api(), [])
    try:
        if not cap.isOpened():
            raise BadVideoError("the video cannot be decoded (not a container this server reads); "
                                "send an MP4, WebM, MKV or AVI video")
        facts = VideoFacts(int(cap.get(cv2.CAP_PROP_FRAME_COUNT)), float(cap.get(cv2.CAP_PROP_FPS)),
                           int(cap.get(cv2.CAP_PROP_FRAME_WIDTH)), int(cap.get(cv2.CAP_PROP_FRAME_HEIGHT)))
    finally:
        cap.release()
    if facts.frames <= 0 or facts.width <= 0 or facts.height <= 0:
        raise BadVideoError(f"the video states {facts.frames} frames of {facts.width}x{facts.height}: "
                            "send a video with frames")
    return facts


def probe(raw: bytes, options: dict[str, Any], limits: VideoLimits) -> VideoFacts:
    """What the container states (``stated``), checked against ``limits`` and the request's
    sampling (module docstring): ``MediaError`` past a limit."""
    return checked(stated(raw), options, limits)


def facts_record(facts: VideoFacts) -> dict[str, Any]:
    """``facts`` as a video entry's record holds them (``expand``'s ``STATED``)."""
    return {"frames": facts.frames, "fps": facts.fps, "width": facts.width, "height": facts.height}


def recorded_facts(record: Any) -> VideoFacts | None:
    """The facts a video entry's record holds (``facts_record``), or None (an entry of a version
    that did not record them, or a record this one cannot read: the container is probed)."""
    try:
        facts = VideoFacts(int(record["frames"]), float(record["fps"]), int(record["width"]),
                           int(record["height"]))
    except Exception:
        return None
    return facts if facts.frames > 0 and facts.width > 0 and facts.height > 0 else None


def checked(facts: VideoFacts, options: dict[str, Any], limits: VideoLimits) -> VideoFacts:
    """``facts`` (what a container states, read now or recorded with its entries) checked against
    ``limits`` and the request's sampling: ``MediaError`` past a limit."""
    from lmdeploy.vl.media.video_loader import VideoLoader

    if facts.width * facts.height > limits.max_frame_pixels:
        raise _over(limits, "max_frame_pixels", f"the video's frames are {facts.width}x{facts.height} "
                    f"({facts.width * facts.height} pixels)", "send a smaller video")
    if facts.frames > limits.max_video_frames:
        raise _over(limits, "max_video_frames", f"the video holds {facts.frames} frames",
                    "send a shorter video")
    if facts.seconds > limits.max_video_seconds:
        raise _over(limits, "max_video_seconds", f"the video lasts {facts.seconds:.1f} s",
                    "send a shorter video")
    sampled, _ = VideoLoader.smart_nframes(facts.frames, options.get("num_frames", DEFAULT_NUM_FRAMES),
                                           options.get("fps", -1), facts.seconds)
    if sampled > limits.max_sampled_frames:
        raise _over(limits, "max_sampled_frames", f"sampling this video as asked keeps {sampled} frames",
                    "ask for fewer (media_io_kwargs.video.num_frames or fps)")
    return facts


def decode(raw: bytes, options: dict[str, Any], form: str = CONTAINER) -> tuple[Any, dict[str, Any]]:
    """(frames, metadata) as lmdeploy's parser makes them of ``raw`` with the request's options
    (``VideoMediaIO(ImageMediaIO(), **options).load_bytes``; a ``JPEG`` video's URL through
    lmdeploy's ``load_from_url``); ``BadVideoError`` for bytes its decoder fails on, or that give
    no frame."""
    from lmdeploy.vl.media.connection import load_from_url
    from lmdeploy.vl.media.image import ImageMediaIO
    from lmdeploy.vl.media.video import VideoMediaIO
    from lmdeploy.vl.media.video_loader import OpenCVVideoLoader

    reader = VideoMediaIO(image_io=ImageMediaIO(), **options)
    try:
        if form == JPEG:
            frames, metadata = load_from_url(raw.decode("ascii"), reader)
        elif type(reader.video_loader) is OpenCVVideoLoader:
            frames, metadata = _opencv_load(raw, reader.num_frames, **reader.kwargs)
        else:
            frames, metadata = reader.load_bytes(raw)
    except MemoryError:
        raise
    except Exception as e:  # the decoder's, for the client's bytes
        raise BadVideoError(f"the video cannot be decoded ({type(e).__name__}: {str(e)[:200]})") from None
    if len(frames) == 0:
        raise BadVideoError("no frame of the video could be decoded: send an undamaged video")
    return frames, metadata


def _opencv_load(raw: bytes, num_frames: int = -1, fps: float = -1, **_: Any) -> tuple[Any, dict[str, Any]]:
    """lmdeploy 0.18's ``OpenCVVideoLoader.load_bytes``, line for line, its parts called, but for
    the stream it reads: held for the whole decode. lmdeploy passes a temporary ``BytesIO`` that
    OpenCV keeps no reference to, so the stream can be freed while frames are read (a crash of the
    whole server, seen here as a segmentation fault reading a container's properties)."""
    import cv2
    from lmdeploy.vl.media.video_loader import OpenCVVideoLoader

    stream = io.BytesIO(raw)
    cap = cv2.VideoCapture(stream, OpenCVVideoLoader().get_cv2_video_api(), [])
    try:
        if not cap.isOpened():
            raise ValueError("Could not open video stream")
        total = int(cap.get(cv2.CAP_PROP_FRAME_COUNT))
        original_fps = cap.get(cv2.CAP_PROP_FPS)
        duration = total / original_fps if original_fps > 0 else 0
        count, index = OpenCVVideoLoader.smart_nframes(total, num_frames, fps, duration)
        frames, _, valid = OpenCVVideoLoader._read_frames(cap, set(index), count, max(index))
    finally:
        cap.release()
    return frames, {"total_num_frames": total, "fps": original_fps, "duration": duration,
                    "video_backend": "opencv", "frames_indices": valid}


def decoder_identity() -> dict[str, Any]:
    """What decodes and samples a video here (in every video's key: another decoder, another
    sampling): lmdeploy's chosen loader and version, and OpenCV's version."""
    import lmdeploy
    from lmdeploy.vl.media.image import ImageMediaIO
    from lmdeploy.vl.media.video import VideoMediaIO

    try:
        import cv2
        cv = cv2.__version__
    except ImportError:
        cv = None
    loader = type(VideoMediaIO(image_io=ImageMediaIO()).video_loader).__name__
    return {"loader": loader, "lmdeploy": lmdeploy.__version__, "opencv": cv}
