"""Encoded sources: images sent as base64 data URLs or local files are keyed by their bytes.

lmdeploy decodes every ``image_url`` (a data URL, a file path, an http URL) into a PIL image before
preprocessing; decoding a 1344x1008 PNG costs tens of milliseconds, and keying the decoded pixels
costs more. For data URLs and files featcache reads the encoded bytes instead (base64-decoding a
data URL is the only work), keys them with ``image_key(bytes, namespace, params)``, and looks them
up *before* lmdeploy's parser runs (on the event loop's default executor, as lmdeploy's own parsing):

- a hit becomes an ``image_data`` item holding a ``CachedImage`` (its ``FeatRef`` and lease, and
  the bytes for a fallback): lmdeploy's parser passes ``image_data`` through untouched and the
  frontend serves it with no decoding, no pixel hashing and no preprocessing;
- a miss is decoded here, exactly as lmdeploy would (``ImageMediaIO.load_bytes``), and handed on
  as an ``image_data`` PIL image that carries its key in ``image.info``, so its features are
  stored under the bytes' key.

http(s) URLs are fetched here, once, with lmdeploy's own checks (``httpfetch.fetch_http``:
public addresses only, ``allowed_media_domains``, at most 3 redirects, its timeout and messages,
one deadline for the whole fetch) by a reader that keeps the bytes instead of decoding them; a
hit is then never decoded, a miss is decoded from those bytes (lmdeploy does not fetch it
again). A URL that cannot be fetched is refused at once (``FetchError``, a 400 with the reason),
never fetched again (issue 39: a failing URL cost two fetches, a redirect loop 8 requests). The
same picture sent as a PIL image and as encoded bytes gets two keys (two entries), never a wrong
answer.

Every source is read under the frontend's ``MediaPolicy`` (``media``: local files only under
``allowed_local_media_path``, regular files only, at most ``max_image_bytes`` of a file, a data
URL or an http body), and lmdeploy is never left to read one itself: an image item whose source
featcache did not turn into ``image_data`` (a source it could not key, a failure while resolving)
is read here under the policy and decoded (``guarded``), and the local file of another medium
(video, audio) is checked against it before lmdeploy reads it. A refusal is a ``MediaError``
(a ``ValueError``: a 400 with its message, which names the server option).

Client image ids (a server started with ``--trust-client-image-ids``; vLLM's request shape): an
image item may carry ``"uuid": ID`` beside its ``image_url``. The image is then keyed by
``client_image_key(ID, namespace, params)`` instead of its bytes, and a later request may send the
item without the image (``{"type": "image_url", "uuid": ID}``). An id the cache does not hold, an
id without an image on a server that does not trust ids, or an id first sent with an http URL is
refused with ``ImageIdError`` (a ``ValueError``: lmdeploy answers it as a 400 with the message).
Anyone who can guess an id could read that image's features into their answer: ids are honoured
only when the operator trusts the clients.
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any
from urllib.parse import urlparse, urlsplit
from urllib.request import url2pathname

from .httpfetch import fetch_http
from .media import (
    LOCAL_FILES,
    MediaError,
    MediaPolicy,
    check_base64_length,
    check_decoded,
    check_local,
    image_io_options,
    read_local,
    shown,
)
from .refs import FeatRef
from .tags import FeatTag

KEY_INFO = "featcache_key"  # image.info entry carrying the bytes' key of a decoded miss
# image.info entry (``CachedImage.binds`` for a hit): the (id key, image key) a verified client id
# is bound to once the whole request is accepted (``Frontend._check_id``)
ID_INFO = "featcache_id"
ID_FIELD = "uuid"  # an image item's client-supplied id (vLLM's name for it)
_IMAGE_TYPES = ("image_url", "image")
_VIDEO_TYPES = ("video_url", "video")
# the items lmdeploy 0.18's parser reads a source for (``_parse_multimodal_item``): images above,
# and media featcache leaves to lmdeploy, whose local files it checks first
_OTHER_MEDIA = (*_VIDEO_TYPES, "audio_url", "audio", "time_series_url", "time_series")


class ImageIdError(ValueError):
    """A request's image id cannot be served; the message tells the client what to send."""


class CachedImage:
    """An image whose features are cached: stands in for the decoded image until preprocessing."""

    __slots__ = ("binds", "image_id", "media", "media_io_kwargs", "raw", "ref", "source")

    def __init__(self, ref: FeatRef | FeatTag, raw: bytes | None, media_io_kwargs: dict[str, Any],
                 image_id: str | None = None, source: str | None = None,
                 media: MediaPolicy | None = None) -> None:
        self.ref = ref
        self.raw = raw  # None: not read (a remembered data URL: ``source``) or not sent (an id)
        self.media_io_kwargs = media_io_kwargs
        self.image_id = image_id
        self.source = source
        self.media = media  # the policy ``source`` is read under (None: ``LOCAL_FILES``)
        self.binds: tuple[bytes, bytes] | None = None  # (``ID_INFO``)

    def decode(self) -> Any:
        """The PIL image lmdeploy would have decoded (for a fallback to plain preprocessing);
        ``ImageIdError`` when the client sent only the image's id."""

        if self.raw is None and self.source is not None:
            self.raw = encoded_bytes(self.source, self.media)
        if self.raw is None:
            lease = getattr(self.ref, "lease", None)  # (a FeatTag holds none)
            if lease is not None:  # the request is refused: it needs the features no more
                lease.release()  # (the error's traceback may keep this ref a while)
            raise ImageIdError(f"the features of image id {self.image_id!r} could not be served "
                               "and the image was not sent: send it again with this uuid")
        return decode_image(self.raw, self.media_io_kwargs)


def encoded_bytes(source: str, media: MediaPolicy | None = None) -> bytes | None:
    """The encoded image behind a base64 data URL or a local file, read under ``media`` (None:
    ``LOCAL_FILES``, any file); None for an http(s) URL, a malformed data URL or a file that
    cannot be opened (``read_source`` reports those). ``MediaError`` for a source the policy
    refuses. Any source other than http(s) and data URLs is a local file, named as lmdeploy
    names it (a path, or a ``file:`` URL).

    A data URL is read as lmdeploy reads it (``_data_url_bytes``), split by hand where that
    gives what ``urlparse`` gives: on a ~5 MB URL ``urlparse`` costs ~2 ms (it scans and copies
    the whole string, and its LRU cache keeps the last 128 URLs alive), and this runs on every
    hit (issue 16, ``bench/checks/hit_path_costs.py``)."""
    media = LOCAL_FILES if media is None else media
    if is_data_url(source):
        return _data_url_bytes(source, media)
    spec = _urlsplit(source)
    if spec.scheme.startswith("http"):
        return None
    if spec.scheme == "data":  # (leading blanks or controls, tabs or line breaks: urlparse drops them)
        return _path_bytes(spec.path, media)
    spec = urlparse(source)  # a file, named as lmdeploy names it (urlparse cuts ';...' off a path)
    try:
        return read_local(url2pathname((spec.netloc or "") + (spec.path or "")), media, source)
    except MediaError:
        raise
    except OSError:
        return None  # missing, unreadable: read_source says so


def is_data_url(source: str) -> bool:
    return source[:5].lower() == "data:"


def is_http(source: str) -> bool:
    return source[:7].lower() == "http://" or source[:8].lower() == "https://"


def fetched_bytes(url: str, allowed_media_domains: list[str] | None = None,
                  media: MediaPolicy | None = None) -> bytes:
    """The bytes behind an http(s) image URL, fetched with lmdeploy's checks, headers and image
    timeout (``httpfetch.fetch_http``), at most ``media``'s ``max_image_bytes`` of them, not
    decoded. Raises ``FetchError`` for a URL that cannot be fetched (with lmdeploy's message for
    its checks), ``MediaError`` for a body over the cap or not received within the timeout."""
    return fetch_http(url, allowed_media_domains, LOCAL_FILES if media is None else media)


def read_source(source: str, media: MediaPolicy, allowed_media_domains: list[str] | None = None
                ) -> bytes:
    """The encoded image behind any string source, read under ``media``; raises for every
    source it cannot give (a ``ValueError`` with a message for the client, as lmdeploy's parser
    raises for it, or ``MediaError``), never returns None."""
    if is_http(source) or _urlsplit(source).scheme.startswith("http"):
        return fetched_bytes(source, allowed_media_domains, media)
    raw = encoded_bytes(source, media)
    if raw is not None:
        return raw
    if is_data_url(source) or _urlsplit(source).scheme == "data":
        raise ValueError(f"invalid data URL {shown(source)!r}: only base64 data URLs "
                         "(data:image/png;base64,...) are read")
    raise ValueError(f"cannot read image file {shown(source)!r}: no such file, or not readable "
                     "by the server")


# urllib's urlsplit without its cache (``functools.lru_cache``, Python 3.11+): the cache keeps the
# last 128 URLs it split alive, each up to --max-image-bytes of data URL text
_urlsplit = getattr(urlsplit, "__wrapped__", urlsplit)
# what ends the path of a URL (``?``, ``#``) or is removed from all of it (tab, CR, LF) by urlsplit
_URL_BREAKS = "?#\t\r\n"


def _data_url_bytes(url: str, media: MediaPolicy) -> bytes | None:
    """The bytes of the data URL ``url`` (``data:MEDIA;base64,DATA``) as lmdeploy 0.18 reads them
    (``vl/media/connection.py``: ``_load_data_url`` on ``urlparse(url).path``, the text after
    ``data:`` and any ``//host``, up to the first ``?`` or ``#``, tabs and line breaks removed),
    or None when that is no base64 data URL (``read_source`` reports it). Issue 39: reading past
    a ``#`` or ``?`` answered from other bytes than lmdeploy's, even another image.

    The fast path: a URL whose text after ``data:`` does not begin with ``//``, whose
    ``MEDIA;base64`` holds none of ``? # tab CR LF`` and whose DATA the strict decoder takes
    (base64 characters only: none of those either) has all of it as its path, so urlparse is
    not called. Any other is split by urllib's own ``urlsplit`` (what ``urlparse`` gives for a
    ``data:`` URL). Text that would decode to more than ``media.max_image_bytes`` is refused
    before it is decoded (its length is all it takes)."""
    comma = url.find(",", 5)
    head = url[5:comma] if comma > 0 else ""
    if (comma > 0 and comma < len(url) - 1 and not url.startswith("//", 5)
            and head.partition(";")[2] == "base64" and not any(c in head for c in _URL_BREAKS)):
        check_base64_length(len(url) - comma - 1, media)
        raw = _strict_b64decode(url[comma + 1:])
        if raw is not None:
            return check_decoded(raw, media)
    try:
        path = _urlsplit(url).path
    except ValueError as e:  # ("Invalid IPv6 URL": a '[' in the //host): lmdeploy refuses it too
        raise BadImageError(f"invalid data URL {shown(url)!r}: {e}") from None
    return _path_bytes(path, media)


def _path_bytes(path: str, media: MediaPolicy) -> bytes | None:
    """lmdeploy's ``_load_data_url`` on a data URL's ``path`` (``MEDIA;base64,DATA``): its bytes,
    or None where lmdeploy refuses it (no comma, no DATA, not ``;base64``). The same bytes
    lmdeploy's non-validating decoder gives: the strict decoder first (several times faster),
    the lenient one when it refuses (missing padding...); invalid base64 raises as lmdeploy's
    decoding would."""
    spec, comma, data = path.partition(",")
    if not comma or not data or spec.partition(";")[2] != "base64":
        return None
    check_base64_length(len(data), media)
    raw = _strict_b64decode(data)
    return check_decoded(_b64decode(data) if raw is None else raw, media)


def _strict_b64decode(data: str) -> bytes | None:
    """``data`` decoded if it is strictly base64 (the alphabet and its padding only), else None."""
    try:
        return bytes(_b64decoder()(data, validate=True))
    except ValueError:  # (binascii.Error)
        return None


def _b64decoder() -> Any:
    try:
        import pybase64
    except ImportError:
        return base64.b64decode
    return pybase64.b64decode


def _b64decode(data: str) -> bytes:
    """``data`` decoded as lmdeploy decodes it (pybase64's non-validating decoder)."""
    try:
        return bytes(_b64decoder()(data))
    except ValueError as e:  # not base64 even leniently: the client's to fix
        raise BadImageError(f"the image's data URL is not valid base64 ({e})") from None


class BadImageError(ValueError):
    """An image a client sent cannot be read as an image (not base64, not an image format PIL
    knows, damaged, a decompression bomb): the client's to fix, answered 400 (lmdeploy answers a
    ``ValueError`` so) with this message."""


def decode_image(raw: bytes, io_kwargs: dict[str, Any]) -> Any:
    """The PIL image lmdeploy's parser would make of ``raw`` (``ImageMediaIO.load_bytes`` with
    the request's decode options); ``BadImageError`` for bytes that are no image.

    Whatever PIL raises reading a client's bytes is a bad image: on damaged files it raises far
    more than ``OSError`` and ``SyntaxError`` (issue 39; one byte changed in small files gave
    ``UnicodeDecodeError`` for a PNG chunk type that is not ASCII, ``ValueError``, ``TypeError``,
    ``NotImplementedError``, even ``AttributeError``; its plugins also raise ``struct.error``,
    ``EOFError``, ``IndexError``, ``ZeroDivisionError``...); ``MemoryError`` excepted (the
    server's memory). The catch covers the decode call alone, the reader built before it, so a
    failure of featcache's own is never passed off as the client's."""
    from lmdeploy.vl.media.image import ImageMediaIO
    from PIL import Image

    if not isinstance(raw, (bytes, bytearray, memoryview)):
        raise TypeError(f"decode_image takes the encoded bytes, not {type(raw).__name__}")
    reader = ImageMediaIO(**io_kwargs)
    try:
        return reader.load_bytes(raw)
    except MemoryError:
        raise
    except Exception as e:  # PIL's, for the client's bytes (above)
        why = ("not an image format it knows" if isinstance(e, Image.UnidentifiedImageError)
               else f"{type(e).__name__}: {str(e)[:200]}")
        raise BadImageError(f"the image cannot be decoded ({why}); send a PNG, JPEG, WebP, GIF "
                            "or BMP image") from None


def image_parts(item: dict[str, Any]) -> tuple[Any, dict[str, Any]] | None:
    """(source, per-image params) of an ``image_url``/``image`` item, as lmdeploy's parser reads
    them (the source None when the item carries none: an id alone), or None for other items."""
    return _parts(item, _IMAGE_TYPES)


def video_parts(item: dict[str, Any]) -> tuple[Any, dict[str, Any]] | None:
    """(source, per-item params) of a ``video_url``/``video`` item, as ``image_parts`` reads an
    image's; None for other items."""
    return _parts(item, _VIDEO_TYPES)


def _parts(item: dict[str, Any], kinds: tuple[str, ...]) -> tuple[Any, dict[str, Any]] | None:
    kind = item.get("type")
    if kind not in kinds:
        return None
    value = item.get(kind, {})
    if isinstance(value, dict):
        params = dict(value)
        source = params.pop("url", None) or params.pop("data", None)
    else:
        params = {k: v for k, v in item.items() if k not in ("type", kind, ID_FIELD)}
        source = value
    return source, params


def source_of(item: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """(source string, per-image params) of an image item, or None if it carries no string
    source."""
    parts = image_parts(item)
    return parts if parts is not None and isinstance(parts[0], str) else None


def guarded(messages: list[Any], io_kwargs: dict[str, Any], allowed_media_domains: Any,
            media: MediaPolicy) -> list[Any]:
    """``messages`` with nothing left for lmdeploy's parser to read that ``media`` refuses: an
    image item whose source is still a string (one featcache did not resolve) is read here under
    the policy and decoded as lmdeploy would decode it (an ``image_data`` item); another
    medium's local file is checked (``media.check_local``) and left to lmdeploy, as are its
    http(s) and data URLs. Raises ``MediaError`` for a refused source, and what lmdeploy's
    parser would raise for one it cannot read or decode. New messages; the caller's untouched."""
    return [_guarded_message(m, io_kwargs, allowed_media_domains, media) for m in messages]


def _guarded_message(message: Any, io_kwargs: dict[str, Any], domains: Any,
                     media: MediaPolicy) -> Any:
    content = message.get("content") if isinstance(message, dict) else None
    if not isinstance(content, list) or message.get("role") not in ("user", "tool"):
        return message  # (lmdeploy's parser reads nothing of these)
    items = [_guarded_item(x, io_kwargs, domains, media) for x in content]
    unchanged = all(a is b for a, b in zip(items, content, strict=True))
    return message if unchanged else dict(message, content=items)


def _guarded_item(item: Any, io_kwargs: dict[str, Any], domains: Any, media: MediaPolicy) -> Any:
    if not isinstance(item, dict):
        return item
    parts = _parts(item, _IMAGE_TYPES)
    if parts is not None and isinstance(parts[0], str):

        source, params = parts
        image = decode_image(read_source(source, media, domains), io_kwargs)
        return {"type": "image_data", "image_data": {"data": image, **params}}
    parts = _parts(item, _OTHER_MEDIA)
    if parts is not None and isinstance(parts[0], str):
        source = parts[0]
        spec = urlparse(source)
        if not (spec.scheme.startswith("http") or spec.scheme == "data" or is_data_url(source)):
            try:
                check_local(url2pathname((spec.netloc or "") + (spec.path or "")), media, source)
            except MediaError:
                raise
            except OSError:
                pass  # missing, unreadable: lmdeploy's parser reports it
    return item


def has_image_items(messages: list[Any]) -> bool:
    """Whether any message holds an image part (then its request's decode options matter)."""
    return any(isinstance(m, dict) and isinstance(m.get("content"), list)
               and any(isinstance(x, dict) and image_parts(x) is not None for x in m["content"])
               for m in messages)


class SourceGuard:
    """What ``install_sources`` calls where featcache does not cache the model (an architecture
    it does not serve): the media policy alone (``guarded``), so lmdeploy still reads no source
    the policy refuses."""

    def __init__(self, media: MediaPolicy | None = None) -> None:
        self.media = LOCAL_FILES if media is None else media
        self.trust_image_ids = False  # (ids are never honoured here: lmdeploy refuses an id alone)

    def resolve_sources(self, messages: list[Any], media_io_kwargs: dict[str, Any],
                        allowed_media_domains: list[str] | None = None) -> list[Any]:
        # the request's decode options, checked as the caching frontend checks them: a client's
        # malformed options are its 400, never a failure inside lmdeploy's decoding
        io_kwargs = image_io_options(media_io_kwargs) if has_image_items(messages) else {}
        return guarded(messages, io_kwargs, allowed_media_domains, self.media)


def install_sources(prompt_processor: Any, frontend: Any) -> None:
    """Wrap ``prompt_processor.async_parse_multimodal_item`` (an instance attribute shadowing
    lmdeploy's static method) so encoded sources are resolved before lmdeploy parses them.
    ``frontend``: a ``Frontend``, or a ``SourceGuard`` (the media policy only)."""
    original = prompt_processor.async_parse_multimodal_item

    async def async_parse_multimodal_item(messages: Any, media_io_kwargs: Any = None,
                                          allowed_media_domains: Any = None) -> Any:
        if isinstance(messages, dict):  # (lmdeploy's parser takes one message too)
            messages = [messages]
        if isinstance(messages, list):
            loop = asyncio.get_running_loop()
            messages = await loop.run_in_executor(
                None, frontend.resolve_sources, messages, media_io_kwargs or {}, allowed_media_domains)
        parsed = await original(messages, media_io_kwargs, allowed_media_domains)
        restore = getattr(frontend, "restore", None)  # (the videos featcache read: ``video.entries``)
        return parsed if restore is None else restore(parsed)

    async_parse_multimodal_item.frontend = frontend  # type: ignore[attr-defined]
    prompt_processor.async_parse_multimodal_item = async_parse_multimodal_item


def trust_image_ids(prompt_processor: Any, trusted: bool | str) -> None:
    """Honour (or not) client image ids on the prompt path ``install_sources`` wrapped: False,
    True (an id names the image it was first sent with), or "verify" (an id sent with its image
    is answered from that image: ``Frontend._check_id``)."""
    if trusted not in (False, True, "verify"):
        raise ValueError(f"trust_image_ids is False, True or 'verify', not {trusted!r}")
    frontend = getattr(prompt_processor.async_parse_multimodal_item, "frontend", None)
    if frontend is None:
        raise ValueError("featcache is not installed on this prompt processor")
    frontend.trust_image_ids = trusted


def set_media_policy(prompt_processor: Any, media: MediaPolicy) -> None:
    """Read image sources under ``media`` on the prompt path ``install_sources`` wrapped."""
    frontend = getattr(prompt_processor.async_parse_multimodal_item, "frontend", None)
    if frontend is None:
        raise ValueError("featcache is not installed on this prompt processor")
    if not isinstance(media, MediaPolicy):
        raise TypeError(f"media_policy must be a featcache.lmdeploy.request.media.MediaPolicy, not "
                        f"{type(media).__name__}")
    frontend.media = media


def read_sources_under(prompt_processor: Any, media: MediaPolicy) -> None:
    """featcache reads the prompt path's image sources under ``media``: through its frontend, or,
    where none is installed (an architecture it does not cache), a ``SourceGuard`` alone. (No
    prompt processor: an engine that parses no request here.)"""
    if prompt_processor is None:
        return
    if getattr(prompt_processor.async_parse_multimodal_item, "frontend", None) is None:
        install_sources(prompt_processor, SourceGuard(media))
    else:
        set_media_policy(prompt_processor, media)
