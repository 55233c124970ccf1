"""The frontend hook: keys images before preprocessing, and skips preprocessing for hits.

Installed on the instance ``VisionModel.preprocess(messages)`` of lmdeploy's ``ImageEncoder``
(it runs on the encoder's worker thread, off the engine loop). For each image of a request:

- key it (``image_key`` over the decoded image, the model identity and the image's parameters;
  images that came as data URLs or files are keyed by their encoded bytes before decoding, and
  their hits arrive already resolved: see ``sources``);
- ``acquire`` it from the cache: a device hit is free; a host or disk hit is promoted here, on
  this thread. A hit becomes a per-image dict rebuilt from the entry's metadata with a 0-row
  ``pixel_values`` placeholder, plus a ``FeatRef`` holding the lease;
- run lmdeploy's own preprocessing once, for the misses only, and tag each of their dicts with a
  ``FeatRef`` so the model stores their features.

With ``tags=True`` (several processes: lmdeploy's mp engine, tp > 1) the cache here only counts:
every image is tagged with a picklable ``FeatTag`` (key and metadata) and the processes that run
the model serve it from their own caches (``ranks``). The first time an image is seen it is
preprocessed by lmdeploy and sent with its pixels; its metadata is remembered (``sent``). An
encoded image (data URL, file, http) seen again is neither decoded nor preprocessed: it is sent
without pixels, its tag carrying its encoded bytes (``tags.Source``), from which a model process
that no longer holds its features rebuilds the pixels (``rebuild``): never a wrong answer, at
worst the cost of a miss paid in the model process. An in-memory image (a pipeline's PIL image)
seen again is not preprocessed either: its tag carries the image's pixel bytes.

Any failure inside featcache here falls back to lmdeploy's plain preprocessing of the whole
request (counted as ``frontend_errors``): a failure is a miss, never a failed request.
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
import time
import traceback
from collections.abc import Callable
from typing import Any

from ...core.cache import FeatureCache
from ...eviction.lrumap import LruMap
from ...keys import ImageKey, KeyHasher, KeyPrefix
from ..fastprep import FastPreprocess
from .entry_meta import decode_item, encode_item
from .httpfetch import FetchError
from .media import LOCAL_FILES, ImageOptions, MediaError, MediaPolicy, image_io_options
from .media import MediaOptionError as MediaOptionError  # (its home: media; named here too)
from .messages import decoded, image_items, preprocessed, without
from .refs import REF_KEY, FeatRef
from .sources import (
    ID_FIELD,
    ID_INFO,
    KEY_INFO,
    BadImageError,
    CachedImage,
    ImageIdError,
    decode_image,
    encoded_bytes,
    fetched_bytes,
    guarded,
    has_image_items,
    image_parts,
    install_sources,
    is_data_url,
    is_http,
)
from .tags import FeatTag, Source
from .urlkeys import DataUrlKeys

log = logging.getLogger("featcache")
SECTION = "lmdeploy"
SENT_IMAGES = 65536  # the images a tag-mode frontend remembers sending (metadata: ~100 bytes each)
RAW_MODES = ("RGB", "RGBA", "L")  # PIL modes whose tobytes() rebuild the image exactly (no palette)

Preprocess = Callable[[list[dict[str, Any]]], list[dict[str, Any]]]


def install_frontend(vision_model: Any, cache: FeatureCache, namespace: str,
                     prompt_processor: Any = None, *, tags: bool = False,
                     hasher: KeyHasher | None = None) -> None:
    """Replace ``vision_model.preprocess`` (an instance attribute shadowing the method) and, given
    lmdeploy's ``MultimodalProcessor``, resolve encoded image sources before it decodes them.
    ``tags``: tag every image for a model in another process, look nothing up (``FeatTag``).
    ``hasher``: how keys are made (default: ``cache.hasher``; with ``tags``, the model
    processes' store's, ``processes.settings_hasher``)."""
    original: Preprocess = vision_model.preprocess
    if getattr(original, "_featcache", False):
        raise RuntimeError("featcache is already installed on this pipeline")
    if "mm_processor_kwargs" in inspect.signature(original).parameters:
        # lmdeploy's new-API preprocess takes a request's processor options, which change the
        # pixels: this hook would neither see nor key them
        raise ValueError(f"featcache keys lmdeploy's legacy preprocess(messages) only; "
                         f"{type(vision_model).__name__} takes per-request processor options")
    # a miss is preprocessed by featcache where it reproduces lmdeploy exactly (``fastprep``)
    frontend = Frontend(cache, FastPreprocess(vision_model, original, cache), namespace, tags=tags,
                        hasher=hasher)
    if prompt_processor is not None:
        install_sources(prompt_processor, frontend)

    @functools.wraps(original)
    def preprocess(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return frontend(messages)

    preprocess._featcache = True  # type: ignore[attr-defined]
    preprocess.frontend = frontend  # type: ignore[attr-defined]
    vision_model.preprocess = preprocess


class Frontend:
    def __init__(self, cache: FeatureCache, original: Preprocess, namespace: str,
                 tags: bool = False, hasher: KeyHasher | None = None) -> None:
        self.cache = cache
        self.original = original
        self.namespace = namespace
        self.hasher = hasher if hasher is not None else cache.hasher
        self.tags = tags  # several processes: tag every image (``FeatTag``)
        # several processes: key -> metadata of the images tagged for the model processes (their
        # features computed there); a resent encoded image is then not preprocessed again
        self.sent: LruMap[bytes, bytes] | None = LruMap(SENT_IMAGES) if tags else None
        # client image ids ("uuid"): featcache serve --trust-client-image-ids [verify]; False, True
        # or "verify" (``ID_MODES``)
        self.trust_image_ids: bool | str = False
        # "verify": the content key each id was first sent with (ids: the keys ``client_key`` makes)
        self.id_contents: LruMap[bytes, bytes] = LruMap(SENT_IMAGES)
        self.data_urls = DataUrlKeys()  # data URLs keyed before: a repeat is not base64-decoded
        # what image sources are read (``media``): featcache serve's --allowed-local-media-path
        # and --max-image-bytes; any local file for the Python API (``sources.set_media_policy``)
        self.media: MediaPolicy = LOCAL_FILES
        self._logged = False
        self._warned_at: float | None = None  # the last bad image's warning (``_bad_image``)

    def __call__(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        binds = _binds(messages) if self.trust_image_ids == "verify" else []
        try:
            out = self._preprocess(messages)
        except Exception:
            trace = traceback.format_exc()
            try:
                out = self.original(decoded(messages))
            except Exception:
                # lmdeploy's own preprocessing refuses the request too (Qwen2-VL's aspect ratio
                # over 200, say): the client's request, not featcache's failure; plain lmdeploy
                # fails it the same way
                self.cache.count(SECTION, "preprocess_refused")
                raise
            self._failed("frontend failed; preprocessing without the cache", trace)
        for key, content in binds:  # the request is accepted: its verified ids name its images
            self.id_contents.setdefault(key, content)
        return out

    def _failed(self, what: str, trace: str | None = None) -> None:
        self.cache.count(SECTION, "frontend_errors")
        if not self._logged:
            self._logged = True
            # the traceback as text: a record holding the exception would keep its frames, and
            # with them the request's leases, alive for as long as a handler keeps the record
            log.error("featcache: %s (logged once)\n%s", what, trace or traceback.format_exc())

    def resolve_sources(self, messages: list[dict[str, Any]], media_io_kwargs: dict[str, Any],
                        allowed_media_domains: list[str] | None = None) -> list[dict[str, Any]]:
        """Key data-URL, file and http(s) images by their encoded bytes; hits become
        ``CachedImage`` items (no decode), misses are decoded here and carry their key. Returns new
        messages (the caller's are left as they are); on any failure, the original messages,
        their images read here without the cache. Either way no source is left for lmdeploy to
        read that the media policy (``self.media``) refuses (``sources.guarded``): a refusal is a
        ``MediaError`` (counted, ``media_refused``). ``allowed_media_domains``: lmdeploy's, for
        the http fetches. Decode options that are not what lmdeploy's ``ImageMediaIO`` takes raise
        ``MediaOptionError`` (a ``ValueError``: the client's request is answered 400; counted,
        ``options_refused``)."""
        try:
            io_kwargs = image_io_options(media_io_kwargs) if has_image_items(messages) else {}
        except MediaOptionError:
            self.cache.count(SECTION, "options_refused")
            raise
        # a client's error (an id, a refused source, an image that is none) is counted and raised:
        # lmdeploy answers it with a 400 and its message; any other failure is featcache's
        try:
            try:
                resolved = [self._resolve_message(m, io_kwargs, allowed_media_domains)
                            for m in messages]
            except (ImageIdError, MediaError, BadImageError, FetchError):
                raise  # (a URL that cannot be fetched: refused at once, never fetched again)
            except Exception:
                self._failed("resolving encoded image sources failed; featcache reads them uncached")
                resolved = messages
            # what is still a source (unresolved, or all of them after a failure): read here
            return guarded(resolved, io_kwargs, allowed_media_domains, self.media)
        except ImageIdError:
            self.cache.count(SECTION, "image_id_refused")
            raise
        except MediaError:
            self.cache.count(SECTION, "media_refused")
            raise
        except BadImageError as e:
            self._bad_image(e)
            raise  # plain lmdeploy fails such a request too (with a 500: PIL's OSError)

    def _bad_image(self, error: BadImageError) -> None:
        """A client sent an image that is none: counted, one warning line a minute at most (a
        client's mistake is no failure of featcache's: no traceback, no error)."""
        self.cache.count(SECTION, "bad_images")
        now = time.monotonic()
        if self._warned_at is None or now - self._warned_at >= 60:
            self._warned_at = now
            log.warning("featcache: a client sent an image that cannot be read, answered 400: %s "
                        "(counted as bad_images; this line at most once a minute)", error)

    def _resolve_message(self, message: Any, io_kwargs: dict[str, Any], domains: Any) -> Any:
        content = message.get("content") if isinstance(message, dict) else None
        if message.get("role") not in ("user", "tool") or not isinstance(content, list):
            return message
        return dict(message, content=[self._resolve_item(x, io_kwargs, domains) for x in content])

    def _source_bytes(self, source: str, domains: Any) -> bytes | None:
        """The encoded image behind ``source`` (data URL, file, http(s) URL), read under
        ``self.media``, or None for a data URL or file featcache cannot read (``sources.guarded``
        then reports what is wrong with it); ``MediaError`` where the policy refuses it. An
        http(s) URL is fetched here, once, with lmdeploy's address, domain and redirect checks
        (``httpfetch.fetch_http``), never by lmdeploy: one that cannot be fetched raises
        ``FetchError`` (counted, ``fetch_failed``), and is not fetched again (issue 39: a failing
        URL cost two fetches, the second by ``guarded``)."""
        if not is_http(source):
            return encoded_bytes(source, self.media)
        try:
            return fetched_bytes(source, domains, self.media)
        except FetchError:  # blocked, unreachable, an error status, ...: the client's 400
            self.cache.count(SECTION, "fetch_failed")
            raise

    def _resolve_item(self, item: Any, io_kwargs: dict[str, Any], domains: Any = None) -> Any:
        parts = image_parts(item) if isinstance(item, dict) else None
        if parts is None:
            return item
        source, params = parts
        image_id = item.get(ID_FIELD)
        if image_id is not None and (self.trust_image_ids is True or not isinstance(source, str)):
            return self._resolve_id(image_id, source, params, io_kwargs, domains)
        if not isinstance(source, str):
            return item
        ident = self.data_urls.ident(source, params, io_kwargs) if is_data_url(source) else None
        if ident is not None and (known := self.data_urls.get(ident)) is not None:
            binds = None if image_id is None else self._check_id(image_id, params, io_kwargs, known)
            # keyed without decoding the base64 again; decoded below only on a miss
            self.cache.count(SECTION, "source_keyed")
            self.cache.count(SECTION, "data_url_remembered")
            served = self._served(known, None, params, io_kwargs, source=source)
            return item if served is None else _bound(served, binds)
        raw = self._source_bytes(source, domains)
        if raw is None:
            return item
        try:
            key = self._bytes_key(raw, params, io_kwargs)  # (an ImageKey)
        except (TypeError, ValueError):  # not keyable here: decoded uncached (never read again)
            return {"type": "image_data", "image_data": {"data": decode_image(raw, io_kwargs), **params}}
        if ident is not None:
            self.data_urls.put(ident, key)
        binds = None if image_id is None else self._check_id(image_id, params, io_kwargs, key)
        self.cache.count(SECTION, "source_keyed")
        return _bound(self._served(key, raw, params, io_kwargs), binds)

    def _bytes_key(self, raw: bytes, params: dict[str, Any], io: dict[str, Any]) -> ImageKey:
        """The key of an encoded image: its bytes, the model, its per-image parameters and the
        request's decode options (which change the decoded pixels: issue 26)."""
        return self._keys(io).image_key(raw, params)

    def _id_key(self, image_id: Any, params: dict[str, Any], io: dict[str, Any]) -> bytes:
        try:
            return self._keys(io).client_key(image_id, params)
        except (TypeError, ValueError) as e:
            raise ImageIdError(f"bad image uuid: {e}") from None

    def _keys(self, io: dict[str, Any]) -> KeyPrefix:
        """The keys of a request's images (``params={"io": io, "item": ...}``), its decode
        options framed once per request (``ImageOptions.key_prefix``), not once per image (issue
        39: 200 images with a 50,000-key object took 24-36 s); a plain dict, for this key alone."""
        if isinstance(io, ImageOptions):
            return io.key_prefix(self.hasher, self.namespace)
        return self.hasher.prefix(self.namespace, {"io": io}, "item")

    def _check_id(self, image_id: Any, params: dict[str, Any], io: dict[str, Any],
                  content: bytes) -> tuple[bytes, bytes] | None:
        """``--trust-client-image-ids verify``: an id sent with its image is served by the
        image's own key (``content``), and remembered with the first one it came with in a
        request that was accepted, so a later request naming the id alone gets that image; an
        id sent again with other bytes keeps its first image (counted, ``image_id_mismatch``)
        and this request is answered from its own bytes. Returns the binding (id key, image
        key; None: ids are not verified), which the image's item carries (``_bound``) until the
        whole request is preprocessed (``__call__``): a refused request binds no id (issue 39)."""
        if self.trust_image_ids != "verify":
            return None
        key = self._id_key(image_id, params, io)
        first = self.id_contents.get(key)
        self.cache.count(SECTION, "image_id_verified")
        if first is not None and first != content:
            self.cache.count(SECTION, "image_id_mismatch")
        return key, content

    def _resolve_id(self, image_id: Any, source: Any, params: dict[str, Any],
                    io_kwargs: dict[str, Any], domains: Any = None) -> Any:
        """An item naming its image by a client id: keyed by the id (the server trusts its
        clients), served from the cache, else decoded from the bytes sent with it (``source``);
        refused with a message saying what to send otherwise."""
        if not self.trust_image_ids:
            raise ImageIdError("this server does not take image ids (uuid) without the image: send "
                               "the image itself (its operator can allow ids with featcache serve "
                               "--trust-client-image-ids)")
        key = self._id_key(image_id, params, io_kwargs)
        if self.trust_image_ids == "verify":  # (an id alone: the image it was first sent with)
            content = self.id_contents.get(key)
            if content is None:
                raise ImageIdError(f"image uuid {image_id!r} is not known to this server (never "
                                   "sent with its image, or forgotten since): send the image again "
                                   "with this uuid")
            key = content
        try:
            raw = self._source_bytes(source, domains) if isinstance(source, str) else None
        except FetchError as e:
            raise ImageIdError(f"image uuid {image_id!r}: its image could not be read ({e})") from None
        if isinstance(source, str) and raw is None:
            raise ImageIdError(f"image uuid {image_id!r}: its image could not be read: send it "
                               "with its uuid as a data URL, a file path or an http(s) URL this "
                               "server may fetch")
        self.cache.count(SECTION, "image_id_keyed")
        served = self._served(key, raw, params, io_kwargs, image_id)
        if served is None and self.tags:
            raise ImageIdError(f"image uuid {image_id!r} came without its image: this server runs "
                               "the model in another process, which needs the image's bytes "
                               "(send it with its uuid; ids alone need featcache serve "
                               "--engine-process in with --tp 1)")
        if served is None:
            raise ImageIdError(f"image uuid {image_id!r} is not in the cache (never sent with its "
                               "image, or evicted since): send the image again with this uuid")
        return served

    def _served(self, key: bytes, raw: bytes | None, params: dict[str, Any],
                io_kwargs: dict[str, Any], image_id: str | None = None,
                source: str | None = None) -> Any:
        """The ``image_data`` item for ``key``: a ``CachedImage`` on a hit, else ``raw`` decoded
        and carrying its key; None for a miss with nothing to decode. ``source``: the data URL
        or file ``raw`` was not read from yet (a hit keeps it for a fallback, a miss reads it
        here). With ``tags`` the cache here holds nothing: an image sent to the model processes
        before is a ``CachedImage`` holding its ``FeatTag`` (``_sent_tag``), any other is decoded."""
        if self.tags:
            tag = self._sent_tag(key, raw, params, io_kwargs, source)
            if tag is not None:
                data: Any = CachedImage(tag, raw, io_kwargs, image_id, source, self.media)
                return {"type": "image_data", "image_data": {"data": data, **params}}
        lease = None if self.tags else self.cache.acquire(key)
        if lease is not None:
            try:
                decode_item(lease.meta)
            except Exception:
                lease.release()
                self.cache.count(SECTION, "unreadable_meta")
            else:
                ref = FeatRef(self.cache, key, lease.meta, lease)
                data = CachedImage(ref, raw, io_kwargs, image_id, source, self.media)
                return {"type": "image_data", "image_data": {"data": data, **params}}
        if raw is None and source is not None:
            raw = encoded_bytes(source, self.media)
        if raw is None:
            return None
        data = decode_image(raw, io_kwargs)  # as lmdeploy's parser would
        data.info[KEY_INFO] = key
        return {"type": "image_data", "image_data": {"data": data, **params}}

    def _sent_tag(self, key: bytes, raw: bytes | None, params: dict[str, Any],
                  io_kwargs: dict[str, Any], source: str | None) -> FeatTag | None:
        """Several processes: the tag of an encoded image this frontend sent the model processes
        before (its metadata remembered), with its encoded bytes to rebuild it from; None where
        it was not sent, or its bytes or options cannot travel (then it is preprocessed)."""
        assert self.sent is not None
        meta = self.sent.get(key)
        if meta is None:
            return None
        if raw is None and source is not None:
            raw = encoded_bytes(source, self.media)
        if raw is None:
            return None
        decode = io_kwargs.decode_text if isinstance(io_kwargs, ImageOptions) else {"io": io_kwargs}
        return _sourced(key, meta, raw, decode, params)

    def _sent_image_tag(self, key: bytes, item: dict[str, Any]) -> FeatTag | None:
        """Several processes: the tag of an in-memory image (a pipeline's PIL image) sent before,
        with its pixel bytes to rebuild it from; None where it was not sent or is not an image
        whose bytes say all of it (a palette, or not a PIL image)."""
        assert self.sent is not None
        from PIL import Image

        image = item["data"]
        meta = self.sent.get(key)
        if meta is None or not isinstance(image, Image.Image) or image.mode not in RAW_MODES:
            return None
        params = {k: v for k, v in item.items() if k not in ("type", "data")}
        layout = {"pil": {"mode": image.mode, "size": list(image.size)}}
        return _sourced(key, meta, image.tobytes(), layout, params)

    def _preprocess(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        items = image_items(messages)
        if items is None:  # a video or other modality: not ours, leave the request alone
            return self.original(decoded(messages))
        count = self.cache.count
        hits: dict[int, dict[str, Any]] = {}  # item index -> its per-image dict
        keys: list[bytes | None] = []
        for index, (_, _, item) in enumerate(items):
            if isinstance(item["data"], CachedImage):  # resolved from its bytes: a hit already
                ref = item["data"].ref
                keys.append(ref.key)
                hit = decode_item(ref.meta)
                hit[REF_KEY] = ref
                hits[index] = hit
                count(SECTION, "decode_skipped")
                continue
            key = self._key(item)
            keys.append(key)
            if key is None:
                continue
            if self.tags:  # several processes: an in-memory image sent before goes as its bytes
                tag = self._sent_image_tag(key, item)
                if tag is not None:
                    hit = decode_item(tag.meta)
                    hit[REF_KEY] = tag
                    hits[index] = hit
                continue
            if _keyed_by_bytes(item):  # looked up when its source was resolved: a miss there
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
        if self.tags:
            count(SECTION, "tagged", sum(1 for k in keys if k is not None))

        if not hits:
            messages = self.original(decoded(list(messages)))  # a copy: the fallback needs the original
            self._tag_misses(preprocessed(messages), keys)
            return messages
        missed = [i for i in range(len(items)) if i not in hits]
        outputs: list[dict[str, Any]] = []
        if missed:
            filtered = without(messages, [items[i] for i in hits])
            outputs = preprocessed(self.original(filtered))
            self._tag_misses(outputs, [keys[i] for i in missed])
        miss_outputs = iter(outputs)
        merged = [hits[i] if i in hits else next(miss_outputs) for i in range(len(items))]
        messages.append(dict(role="preprocess", content=merged))
        return messages

    def _key(self, item: dict[str, Any]) -> bytes | None:
        if _keyed_by_bytes(item):
            key: bytes = item["data"].info[KEY_INFO]  # keyed by its encoded bytes before decoding
            return key
        params = {k: v for k, v in item.items() if k not in ("type", "data")}
        try:
            return self.hasher.image_key(item["data"], namespace=self.namespace, params=params)
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
                meta = encode_item(output, self.namespace)
            except TypeError as e:
                self.cache.count(SECTION, "uncacheable")
                log.debug("featcache: image not cached (%s)", e)
                continue
            if self.sent is not None:  # several processes: what the model processes were sent
                output[REF_KEY] = FeatTag(key, meta)
                self.sent.put(key, meta)
            else:
                output[REF_KEY] = FeatRef(self.cache, key, meta, None)


def _sourced(key: bytes, meta: bytes, raw: bytes, decode: dict[str, Any] | str | None,
             params: dict[str, Any]) -> FeatTag | None:
    """The tag of an image sent before (``meta``, remembered) carrying ``raw`` and how to read
    it (``decode``: a dict, or its JSON text made and checked once per request,
    ``ImageOptions.decode_text``); None where the options or parameters are not plain JSON (the
    model process could not rebuild the same pixels) or ``meta`` cannot be read."""
    if decode is None:
        return None
    try:
        how = decode if isinstance(decode, str) else json.dumps(decode, sort_keys=True)
        values = json.dumps(params, sort_keys=True)
        if (not isinstance(decode, str) and json.loads(how) != decode
                or json.loads(values) != params):
            return None
        decode_item(meta)
    except Exception:
        return None
    return FeatTag(key, meta, Source(raw, how, values))


def _keyed_by_bytes(item: dict[str, Any]) -> bool:
    """Whether the item's image was decoded by ``Frontend._served`` after its bytes' key missed."""
    info = getattr(item["data"], "info", None)
    return isinstance(info, dict) and isinstance(info.get(KEY_INFO), bytes)


def _bound(served: Any, binds: tuple[bytes, bytes] | None) -> Any:
    """``served`` (an ``image_data`` item, or None) carrying the id binding its request makes
    once it is accepted (``Frontend._check_id``)."""
    if binds is not None and served is not None:
        data = served["image_data"]["data"]
        if isinstance(data, CachedImage):
            data.binds = binds
        else:
            data.info[ID_INFO] = binds
    return served


def _binds(messages: list[dict[str, Any]]) -> list[tuple[bytes, bytes]]:
    """The id bindings the images of ``messages`` carry (``_bound``). Only a pair of byte strings
    is one: a decoded image's ``info`` also holds what its file says (a PNG's text chunks)."""
    found = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        for item in content if isinstance(content, list) else ():
            data = item.get("data") if isinstance(item, dict) else None
            if isinstance(data, CachedImage):
                binds: Any = data.binds
            else:
                info = getattr(data, "info", None)
                binds = info.get(ID_INFO) if isinstance(info, dict) else None
            if (isinstance(binds, tuple) and len(binds) == 2
                    and all(isinstance(x, bytes) for x in binds)):
                found.append(binds)
    return found
