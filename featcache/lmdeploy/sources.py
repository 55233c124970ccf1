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

http(s) URLs are fetched here, once, by lmdeploy's own fetcher (``load_from_url``: public
addresses only, ``allowed_media_domains``, at most 3 redirects, its timeout) with a reader that
keeps the bytes instead of decoding them; a hit is then never decoded, a miss is decoded from those
bytes (lmdeploy does not fetch it again). A URL featcache cannot fetch is left to lmdeploy, which
fetches it and raises its own error. The same picture sent as a PIL image and as encoded bytes gets
two keys (two entries), never a wrong answer.

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
import functools
import os
from pathlib import Path
from typing import Any
from urllib.parse import urlparse
from urllib.request import url2pathname

from .refs import FeatRef
from .tags import FeatTag

KEY_INFO = "featcache_key"  # image.info entry carrying the bytes' key of a decoded miss
ID_FIELD = "uuid"  # an image item's client-supplied id (vLLM's name for it)
_IMAGE_TYPES = ("image_url", "image")


class ImageIdError(ValueError):
    """A request's image id cannot be served; the message tells the client what to send."""


class CachedImage:
    """An image whose features are cached: stands in for the decoded image until preprocessing."""

    __slots__ = ("image_id", "media_io_kwargs", "raw", "ref", "source")

    def __init__(self, ref: FeatRef | FeatTag, raw: bytes | None, media_io_kwargs: dict[str, Any],
                 image_id: str | None = None, source: str | None = None) -> None:
        self.ref = ref
        self.raw = raw  # None: not read (a remembered data URL: ``source``) or not sent (an id)
        self.media_io_kwargs = media_io_kwargs
        self.image_id = image_id
        self.source = source

    def decode(self) -> Any:
        """The PIL image lmdeploy would have decoded (for a fallback to plain preprocessing);
        ``ImageIdError`` when the client sent only the image's id."""
        from lmdeploy.vl.media.image import ImageMediaIO

        if self.raw is None and self.source is not None:
            self.raw = encoded_bytes(self.source)
        if self.raw is None:
            lease = getattr(self.ref, "lease", None)  # (a FeatTag holds none)
            if lease is not None:  # the request is refused: it needs the features no more
                lease.release()  # (the error's traceback may keep this ref a while)
            raise ImageIdError(f"the features of image id {self.image_id!r} could not be served "
                               "and the image was not sent: send it again with this uuid")
        return ImageMediaIO(**self.media_io_kwargs).load_bytes(self.raw)


def encoded_bytes(source: str) -> bytes | None:
    """The encoded image behind a base64 data URL or a local file, or None for anything else
    (http URLs, malformed data URLs: lmdeploy handles and reports those itself).

    A data URL is split by hand, not by ``urlparse``: on a ~5 MB URL ``urlparse`` costs ~2 ms
    (it scans and copies the whole string, and its LRU cache keeps the last 128 URLs alive), and
    this runs on every hit (issue 16, ``bench/hit_path_costs.py``)."""
    if is_data_url(source):
        return _data_url_bytes(source[5:])
    spec = urlparse(source)
    if spec.scheme.startswith("http"):
        return None
    if spec.scheme == "data":  # (leading blanks or controls, which urlparse strips)
        return _data_url_bytes(spec.path or "")
    if spec.scheme == "file" or os.path.exists(source) or os.path.exists(spec.path):
        path = Path(url2pathname((spec.netloc or "") + (spec.path or "")))
        try:
            return path.read_bytes()
        except OSError:
            return None  # lmdeploy will raise its own error for it
    return None


def is_data_url(source: str) -> bool:
    return source[:5].lower() == "data:"


def is_http(source: str) -> bool:
    return source[:7].lower() == "http://" or source[:8].lower() == "https://"


@functools.cache
def _raw_image_io() -> type:
    """An ``ImageMediaIO`` (so lmdeploy picks its image fetch timeout) whose ``load_bytes`` keeps
    the bytes; made on first use, when lmdeploy is imported."""
    from lmdeploy.vl.media.image import ImageMediaIO

    class RawImageIO(ImageMediaIO):
        def load_bytes(self, data: bytes) -> Any:
            return bytes(data)

    return RawImageIO


def fetched_bytes(url: str, allowed_media_domains: list[str] | None = None) -> bytes:
    """The bytes behind an http(s) image URL, fetched by lmdeploy's ``load_from_url`` exactly as
    lmdeploy would fetch them (same checks, headers and image timeout) but not decoded. Raises
    what lmdeploy's fetch raises (a blocked address: ``ValueError``)."""
    from lmdeploy.vl.media.connection import load_from_url

    raw = load_from_url(url, _raw_image_io()(), allowed_media_domains)
    if not isinstance(raw, bytes):
        raise TypeError(f"lmdeploy's fetcher gave {type(raw).__name__}, not bytes")
    return raw


def _data_url_bytes(rest: str) -> bytes | None:
    """The bytes of a data URL's part after ``data:`` (``MEDIA;base64,DATA``), or None when it is
    not base64 (lmdeploy reports that). The same bytes lmdeploy's non-validating decoder gives:
    the strict decoder first (several times faster), the lenient one when it refuses (line
    breaks, missing padding...); invalid base64 raises as lmdeploy's decoding would."""
    head, comma, data = rest.partition(",")
    if not comma or not data or head.partition(";")[2] != "base64":
        return None
    try:
        import pybase64
    except ImportError:
        try:
            return base64.b64decode(data, validate=True)
        except ValueError:  # (binascii.Error)
            return base64.b64decode(data)
    try:
        return pybase64.b64decode(data, validate=True)
    except ValueError:
        return pybase64.b64decode(data)


def image_parts(item: dict[str, Any]) -> tuple[Any, dict[str, Any]] | None:
    """(source, per-image params) of an ``image_url``/``image`` item, as lmdeploy's parser reads
    them (the source None when the item carries none: an id alone), or None for other items."""
    kind = item.get("type")
    if kind not in _IMAGE_TYPES:
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


def install_sources(prompt_processor: Any, frontend: Any) -> None:
    """Wrap ``prompt_processor.async_parse_multimodal_item`` (an instance attribute shadowing
    lmdeploy's static method) so encoded sources are resolved before lmdeploy parses them."""
    original = prompt_processor.async_parse_multimodal_item

    async def async_parse_multimodal_item(messages: Any, media_io_kwargs: Any = None,
                                          allowed_media_domains: Any = None) -> Any:
        if isinstance(messages, list):
            loop = asyncio.get_running_loop()
            messages = await loop.run_in_executor(
                None, frontend.resolve_sources, messages, media_io_kwargs or {}, allowed_media_domains)
        return await original(messages, media_io_kwargs, allowed_media_domains)

    async_parse_multimodal_item.frontend = frontend  # type: ignore[attr-defined]
    prompt_processor.async_parse_multimodal_item = async_parse_multimodal_item


def trust_image_ids(prompt_processor: Any, trusted: bool) -> None:
    """Honour (or not) client image ids on the prompt path ``install_sources`` wrapped."""
    frontend = getattr(prompt_processor.async_parse_multimodal_item, "frontend", None)
    if frontend is None:
        raise ValueError("featcache is not installed on this prompt processor")
    frontend.trust_image_ids = trusted
