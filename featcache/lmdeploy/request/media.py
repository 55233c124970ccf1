"""What a server reads of the images a request names: where local files may lie, how many bytes.

A request's ``image_url`` may be a local path (or ``file://`` URL), a base64 data URL or an http(s)
URL. lmdeploy 0.18 reads all of them itself, with no limits: a client that sends ``/dev/zero``
takes the server's memory, a FIFO blocks the request forever, and any image file the server can
read ends up in that client's answer. featcache reads every image source itself (``sources``), so
it reads them under one ``MediaPolicy``:

- local files only under ``allowed_local_media_path`` (vLLM's ``--allowed-local-media-path``, with
  its meaning; None: no local files at all, what ``featcache serve`` does unless given one; the
  Python ``pipeline()``/``wrap()`` API, one trusted user, allows every file: ``LOCAL_FILES``);
- regular files only: opened without blocking (a FIFO never waits for a writer) and without
  following a link at any step below the allowed directory (``_open_under``), checked on the
  opened descriptor, so that what is read is what was checked;
- at most ``max_image_bytes`` of any source: a file's size, a data URL's base64 text (refused
  before it is decoded) and an http body, as sent and decoded (``httpfetch.fetch_http``: read as
  it arrives, never past the cap, all of the fetch within lmdeploy's image fetch timeout, with
  lmdeploy's address, domain and redirect checks).

A refusal is a ``MediaError``, a ``ValueError``: lmdeploy's server answers it with HTTP 400 and the
message, which says what to send instead and names the server option.
"""

from __future__ import annotations

import dataclasses
import fcntl
import functools
import json
import os
import stat
from dataclasses import dataclass
from typing import Any

from ...config import MEDIA_DEFAULTS, VIDEO_DEFAULTS
from ...keys import KeyHasher, KeyPrefix
from ...sizes import format_bytes, parse_bytes

LOCAL_OPTION = "--allowed-local-media-path"
CAP_OPTION = "--max-image-bytes"
DEFAULT_MAX_IMAGE_BYTES = parse_bytes(MEDIA_DEFAULTS["max_image_bytes"])  # type: ignore[arg-type]
_CHUNK = 1 << 20  # bytes read at a time past a file's stated size
_DIR_FLAGS = getattr(os, "O_PATH", os.O_RDONLY) | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NOCTTY


class MediaError(ValueError):
    """An image source this server will not read; the message says what to send instead and
    names the option (lmdeploy answers a ``ValueError`` with HTTP 400 and its message)."""


class MediaTooLarge(MediaError):
    """A source over the reader's byte cap (``--max-image-bytes``, or a video reader's own)."""


@dataclass(frozen=True)
class VideoLimits:
    """What one video of a request may cost the server (``video.read``'s docstring names each;
    defaults ``featcache.config.VIDEO_DEFAULTS``, each a ``featcache serve`` option,
    ``featcache.config.VIDEO_OPTIONS``)."""

    max_video_bytes: int = int(VIDEO_DEFAULTS["max_video_bytes"])
    max_video_seconds: float = VIDEO_DEFAULTS["max_video_seconds"]
    max_video_frames: int = int(VIDEO_DEFAULTS["max_video_frames"])
    max_sampled_frames: int = int(VIDEO_DEFAULTS["max_sampled_frames"])
    max_frame_pixels: int = int(VIDEO_DEFAULTS["max_frame_pixels"])

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{f.name} must be a positive number, not {value!r}")


@dataclass(frozen=True)
class MediaPolicy:
    """Where local image files may lie and how large any image source may be.

    ``allowed_local_media_path``: a directory (kept as its real path) under which local files
    are read, or None for no local files; ``LOCAL_FILES`` allows all (``/``).
    ``max_image_bytes``: the most bytes read of one image source (file, data URL, http body)."""

    allowed_local_media_path: str | None = MEDIA_DEFAULTS["allowed_local_media_path"]
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    video: VideoLimits = VideoLimits()  # what one video may cost (``video.read``)

    def __post_init__(self) -> None:
        cap = self.max_image_bytes
        if isinstance(cap, bool) or not isinstance(cap, int):
            raise TypeError(f"max_image_bytes must be an int number of bytes, not "
                            f"{type(cap).__name__} {cap!r}")
        if cap < 1:
            raise ValueError(f"max_image_bytes must be at least 1 byte, not {cap}")
        path = self.allowed_local_media_path
        if path is None:
            return
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"allowed_local_media_path must be a directory path or None, not "
                            f"{type(path).__name__} {path!r}")
        real = os.path.realpath(os.fspath(path))
        if not os.path.isdir(real):
            raise ValueError(f"allowed_local_media_path {os.fspath(path)!r} is not a directory")
        object.__setattr__(self, "allowed_local_media_path", real)

    @classmethod
    def create(cls, allowed_local_media_path: str | os.PathLike[str] | None = None,
               max_image_bytes: int | str | None = None, video: VideoLimits | None = None) -> MediaPolicy:
        """A policy from user values: the cap as an int or a string like "64MiB", None for the
        default (``featcache.config.MEDIA_DEFAULTS``)."""
        cap = DEFAULT_MAX_IMAGE_BYTES if max_image_bytes is None else max_image_bytes
        if isinstance(cap, str):
            try:
                cap = parse_bytes(cap)
            except ValueError as e:
                raise ValueError(f"max_image_bytes: {e}") from None
        return cls(allowed_local_media_path, cap, VideoLimits() if video is None else video)  # type: ignore[arg-type]


LOCAL_FILES = MediaPolicy(os.sep)  # the Python API's default: any file of the caller's, capped


def shown(source: str) -> str:
    """``source`` as a message may repeat it: short (a data URL holds the whole image)."""
    return source if len(source) <= 96 else source[:80] + f"... ({len(source)} characters)"


def _too_large(what: str, cap: int) -> MediaTooLarge:
    return MediaTooLarge(f"{what} is larger than this server's {CAP_OPTION} ({cap} bytes, "
                      f"{format_bytes(cap)}): send a smaller image (the server's operator may "
                      f"raise {CAP_OPTION})")


# -- local files -------------------------------------------------------------------------------
def read_local(path: str, policy: MediaPolicy, source: str | None = None) -> bytes:
    """The bytes of the local file ``path`` (as lmdeploy names it: relative to the working
    directory), read under ``policy``. ``MediaError`` for a file the policy refuses (no local
    files, outside the allowed directory, not a regular file, over the cap); ``OSError`` for one
    that cannot be opened (missing, unreadable). ``source``: the client's text, for messages."""
    fd, size = _open_under(path, policy, source or path, policy.max_image_bytes)
    try:
        return _read_capped(fd, size, policy.max_image_bytes, f"image file {shown(source or path)!r}")
    finally:
        os.close(fd)


def check_local(path: str, policy: MediaPolicy, source: str | None = None) -> None:
    """Raise as ``read_local`` would for a file the policy refuses (its size aside), reading
    nothing: for the media featcache leaves to lmdeploy (videos, audio)."""
    fd, _ = _open_under(path, policy, source or path, None)
    os.close(fd)


def _open_under(path: str, policy: MediaPolicy, source: str,
                limit: int | None) -> tuple[int, int]:
    """(descriptor, size) of the regular file ``path`` under the policy's directory, opened
    without following a link at any step below it and without blocking; at most ``limit``
    bytes long by its stated size (None: any size).

    The path's real path must lie under the directory; then the file is reached from the
    directory one component at a time (``openat`` with ``O_NOFOLLOW``), each step a directory
    that is no link, so a component swapped for a link since the check fails to open instead of
    leading elsewhere. The file's type and size are checked before opening (no device or FIFO
    is ever opened when nothing races) and again on the descriptor, which must be the file
    checked (same device and inode)."""
    root = policy.allowed_local_media_path
    if root is None:
        raise MediaError(f"image {shown(source)!r} is neither an http(s) nor a data URL, and this "
                         "server reads no local files: send the image as a data URL (its "
                         f"operator may allow files under a directory with {LOCAL_OPTION} DIR)")
    real = os.path.realpath(path)
    parts = _below(real, root)
    if parts is None:
        raise MediaError(f"image file {shown(source)!r} is not under the directory this server "
                         f"reads local images from ({LOCAL_OPTION}): send the image as a data "
                         "URL, or name a file under that directory")
    what = f"image file {shown(source)!r}"
    if not parts:
        raise MediaError(f"{what} is not a regular file (a directory): send an image file")
    directory = os.open(root, _DIR_FLAGS)
    try:
        for part in parts[:-1]:
            inner = os.open(part, _DIR_FLAGS, dir_fd=directory)
            os.close(directory)
            directory = inner
        before = os.stat(parts[-1], dir_fd=directory, follow_symlinks=False)
        _check_file(before, what, limit)
        fd = os.open(parts[-1], _FILE_FLAGS, dir_fd=directory)
    finally:
        os.close(directory)
    try:
        st = os.fstat(fd)
        _check_file(st, what, limit)
        if (st.st_dev, st.st_ino) != (before.st_dev, before.st_ino):
            raise MediaError(f"{what} changed while it was opened: send it again")
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~os.O_NONBLOCK)  # a regular file: plain reads
    except BaseException:
        os.close(fd)
        raise
    return fd, st.st_size


def _below(real: str, root: str) -> list[str] | None:
    """The components of ``real`` below ``root`` (both real paths), or None if it is not
    below it (``[]``: ``root`` itself)."""
    if real == root:
        return []
    prefix = root if root.endswith(os.sep) else root + os.sep
    if not real.startswith(prefix):
        return None
    return [p for p in real[len(prefix):].split(os.sep) if p]


def _check_file(st: os.stat_result, what: str, cap: int | None) -> None:
    if not stat.S_ISREG(st.st_mode):
        kind = ("a FIFO" if stat.S_ISFIFO(st.st_mode) else "a device" if stat.S_ISCHR(st.st_mode)
                or stat.S_ISBLK(st.st_mode) else "a directory" if stat.S_ISDIR(st.st_mode)
                else "a link" if stat.S_ISLNK(st.st_mode) else "a socket")
        raise MediaError(f"{what} is not a regular file ({kind}): send an image file")
    if cap is not None and st.st_size > cap:
        raise _too_large(what, cap)


def _read_capped(fd: int, size: int, cap: int, what: str) -> bytes:
    """At most ``cap`` bytes from ``fd`` (its stated ``size`` read in one call), never reading
    more than ``cap + 1``: ``MediaError`` if there are more (a file that grew, or a /proc file
    whose stated size is 0)."""
    chunks: list[bytes] = []
    total = 0
    want = min(size, cap) + 1
    while total <= cap:
        chunk = os.read(fd, min(want, cap + 1 - total))
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
        want = _CHUNK
    if total > cap:
        raise _too_large(what, cap)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


# -- data URLs ---------------------------------------------------------------------------------
def check_base64_length(length: int, policy: MediaPolicy) -> None:
    """Refuse, before decoding, base64 text of ``length`` characters, more than the encoding of
    ``max_image_bytes`` (it can only decode to more; the decoded length is checked again:
    ``check_decoded``)."""
    cap = policy.max_image_bytes
    if length > 4 * -(-cap // 3):
        raise _too_large(f"the image of this data URL ({length} base64 characters)", cap)


def check_decoded(raw: bytes, policy: MediaPolicy) -> bytes:
    if len(raw) > policy.max_image_bytes:
        raise _too_large("the image of this data URL", policy.max_image_bytes)
    return raw


class MediaOptionError(ValueError):
    """A request's decode options (``media_io_kwargs``) are not what lmdeploy's image reader
    takes; the message tells the client which (lmdeploy answers a ``ValueError`` with a 400)."""


# The most a request's image decode options may hold, as canonical JSON. lmdeploy's image reader
# takes one option (``image_mode``) and keeps any other unused; every image of a request is keyed
# with its options, so their size is a cost per request (issue 39: 50,000 keys took 24-36 s).
MAX_IMAGE_OPTIONS_BYTES = 16 << 10


class ImageOptions(dict[str, Any]):
    """A request's checked image decode options (``image_io_options``), a dict as lmdeploy's
    ``ImageMediaIO(**options)`` takes it, with what every image of the request is keyed by made
    once: ``text``, the canonical JSON (sorted keys, ASCII), the key prefixes framed from it
    (``key_prefix``) and what a tag carries to rebuild an image with them (``decode_text``).
    Invariant: never changed after it is made (what is made from it would go stale)."""

    def __init__(self, options: dict[str, Any], text: str) -> None:
        super().__init__(options)
        self.text = text
        self._prefixes: dict[tuple[KeyHasher, str], KeyPrefix] = {}

    def key_prefix(self, hasher: KeyHasher, namespace: str) -> KeyPrefix:
        """``hasher.prefix(namespace, {"io": self}, "item")`` (``keys.KeyPrefix``), framed once
        per hasher and namespace."""
        held = self._prefixes.get((hasher, namespace))
        if held is None:
            held = self._prefixes[(hasher, namespace)] = hasher.prefix(namespace, {"io": self},
                                                                       "item")
        return held

    @functools.cached_property
    def decode_text(self) -> str | None:
        """``{"io": options}`` as JSON (``tags.Source.decode``), or None where JSON would not
        give these options back (a tuple, a key that is no string): such an image cannot travel
        without its pixels."""
        text = json.dumps({"io": self}, sort_keys=True)
        return text if json.loads(text) == {"io": self} else None

    def __reduce__(self) -> tuple[Any, ...]:  # travels as the plain dict it is
        return (dict, (dict(self),))


def image_io_options(media_io_kwargs: Any) -> ImageOptions:
    """The image decode options of a request (``media_io_kwargs["image"]``, lmdeploy's
    ``ImageMediaIO`` arguments), checked: a JSON object of at most ``MAX_IMAGE_OPTIONS_BYTES``
    (as canonical JSON) whose ``image_mode``, when given, is a mode PIL converts an RGB image
    to. Raises ``MediaOptionError`` otherwise; so does lmdeploy, later and for every request,
    when it decodes with them (it takes options of any size)."""
    if media_io_kwargs is None:
        return ImageOptions({}, "{}")  # (one per request: what is made from it is the request's)
    if not isinstance(media_io_kwargs, dict):
        raise MediaOptionError(f"media_io_kwargs must be an object, not {type(media_io_kwargs).__name__}")
    options = media_io_kwargs.get("image", {})
    if options is None:
        return ImageOptions({}, "{}")
    if not isinstance(options, dict) or not all(isinstance(k, str) for k in options):
        raise MediaOptionError("media_io_kwargs.image must be an object of named options")
    try:
        text = json.dumps(options, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        raise MediaOptionError("media_io_kwargs.image must hold JSON values only") from None
    if len(text) > MAX_IMAGE_OPTIONS_BYTES:  # (ASCII: its length is its size in bytes)
        raise MediaOptionError(
            f"media_io_kwargs.image is {len(text)} bytes as JSON, more than this server takes "
            f"({MAX_IMAGE_OPTIONS_BYTES} bytes, {format_bytes(MAX_IMAGE_OPTIONS_BYTES)}): send only "
            "the options lmdeploy's image reader takes (e.g. {\"image_mode\": \"L\"})")
    mode = options.get("image_mode", "RGB")
    if not (isinstance(mode, str) and _convertible(mode)):
        raise MediaOptionError(f"media_io_kwargs.image.image_mode {mode!r:.40} is not an image mode "
                               "images can be converted to (e.g. 'RGB', 'L', 'RGBA')")
    return ImageOptions(options, text)


@functools.lru_cache(maxsize=64)
def _convertible(mode: str) -> bool:
    if not 0 < len(mode) <= 16:
        return False
    from PIL import Image

    try:
        Image.new("RGB", (1, 1)).convert(mode)
    except (ValueError, TypeError, KeyError, OSError):
        return False
    return True


MAX_PIXELS = 1 << 40  # a size override past this is no image size


def image_size(image_processor: Any, mm_processor_kwargs: Any) -> dict[str, int] | None:
    """The image size a request's ``mm_processor_kwargs`` asks of the processor, where it differs
    from the processor's own (lmdeploy's ``get_override_size``); None where it does not.
    ``MediaOptionError`` (the client's request: answered 400) for options that are not a JSON
    object, or pixel bounds that are not ints from 1 to ``MAX_PIXELS``."""
    if mm_processor_kwargs is None:
        return None
    if not isinstance(mm_processor_kwargs, dict):
        raise MediaOptionError("mm_processor_kwargs must be an object")
    options = mm_processor_kwargs.get("image")
    if not options:
        return None
    if not isinstance(options, dict):
        raise MediaOptionError("mm_processor_kwargs.image must be an object")
    for name in ("min_pixels", "max_pixels"):
        value = options.get(name)
        if value is not None and (type(value) is not int or not 0 < value <= MAX_PIXELS):
            raise MediaOptionError(f"mm_processor_kwargs.image.{name} must be an integer from 1 to "
                                   f"{MAX_PIXELS}, not {value!r:.40}")
    from lmdeploy.vl.model.preprocess_utils import get_override_size

    size = get_override_size(image_processor, options, modality="image")
    if size is None:
        return None
    own = getattr(image_processor, "size", None)
    try:
        same = (size["shortest_edge"] == own["shortest_edge"]
                and size["longest_edge"] == own["longest_edge"])
    except (KeyError, TypeError):
        same = False
    return None if same else {k: int(v) for k, v in size.items()}
