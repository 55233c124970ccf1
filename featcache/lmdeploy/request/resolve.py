"""The frontend's half that runs before lmdeploy decodes a request's images: installed on lmdeploy's
``MultimodalProcessor`` (``sources.install_sources``), it keys data-URL, file and http(s) images by
their encoded bytes (``sources``), turns hits into ``CachedImage`` items (no decode) and decodes
misses carrying their key, and keys client image ids (``--trust-client-image-ids``). ``Frontend``
(``featcache.lmdeploy.request.frontend``) is a ``SourceResolver``; its other half preprocesses.

Invariants:
- no source is left for lmdeploy to read that the media policy (``media``) refuses (``guarded``),
  whether resolving succeeded or failed;
- a client's error (a bad id, a refused source, an image that is none, a URL that cannot be
  fetched) is counted and raised, answered 400 by lmdeploy; any other failure here is featcache's:
  counted (``frontend_errors``), logged once, and the images are read without the cache;
- ``--trust-client-image-ids verify``: an id binds to the image it first came with only once the
  request it came in is accepted (``bound`` on the item, ``bindings`` read back by the frontend
  after preprocessing): a refused request binds no id.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import time
import traceback
from typing import Any

import blake3

from ...core.cache import FeatureCache
from ...eviction.lrumap import LruMap
from ...keys import ImageKey, KeyHasher, KeyPrefix
from .entry_meta import decode_item
from .httpfetch import FetchError
from .media import ImageOptions, MediaError, MediaOptionError, MediaPolicy, image_io_options
from .refs import FeatRef
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
    is_data_url,
    is_http,
)
from .tags import FeatTag, sourced
from .video.entries import has_videos, restore
from .video.read import BadVideoError
from .video.resolve import resolve_videos

log = logging.getLogger("featcache")
SECTION = "lmdeploy"  # the section of the cache's stats the integration counts in


class SourceResolver:
    """Resolves a request's encoded image sources (``resolve_sources``) into keyed items. Its
    state is the frontend's (set by ``Frontend.__init__``)."""

    cache: FeatureCache
    hasher: KeyHasher
    namespace: str
    tags: bool  # several processes: images are tagged, the cache here holds nothing
    sent: LruMap[bytes, bytes] | None  # several processes: key -> metadata of the images sent
    trust_image_ids: bool | str  # client image ids: False, True or "verify"
    id_contents: LruMap[bytes, bytes]  # "verify": the content key each id was first sent with
    data_urls: DataUrlKeys  # data URLs keyed before: a repeat is not base64-decoded
    media: MediaPolicy  # what image sources are read
    videos: bool  # whether this frontend caches videos (else they are read here, not keyed)
    _logged: bool
    _warned_at: float | None  # the last bad image's warning (``_bad_image``)

    def restore(self, messages: list[Any]) -> list[Any]:
        """lmdeploy's parsed messages with the videos read here put back (``video.entries``)."""
        return restore(messages)

    def _failed(self, what: str, trace: str | None = None) -> None:
        """A failure of featcache's in the frontend (either half, or a TurboMind path through
        it): counted (``frontend_errors``), the first one logged with its traceback."""
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
        resolved = self._resolve_images(messages, io_kwargs, allowed_media_domains)
        if not has_videos(resolved):
            return resolved
        try:  # (``video.resolve``: each video read once, under the limits; keyed where cached)
            return resolve_videos(resolved, media_io_kwargs, allowed_media_domains, self.media,
                                  self.media.video, self if self.videos else None)
        except MediaOptionError:
            self.cache.count(SECTION, "options_refused")
            raise
        except BadVideoError:
            self.cache.count(SECTION, "bad_videos")
            raise
        except FetchError:
            self.cache.count(SECTION, "fetch_failed")
            raise
        except MediaError:
            self.cache.count(SECTION, "media_refused")
            raise

    def _resolve_images(self, messages: list[dict[str, Any]], io_kwargs: dict[str, Any],
                        allowed_media_domains: list[str] | None) -> list[dict[str, Any]]:
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
            return item if served is None else bound(served, binds)
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
        return bound(self._served(key, raw, params, io_kwargs), binds)

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
        key; None: ids are not verified), which the image's item carries (``bound``) until the
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
        return sourced(key, meta, raw, decode, params)


def bound(served: Any, binds: tuple[bytes, bytes] | None) -> Any:
    """``served`` (an ``image_data`` item, or None) carrying the id binding its request makes
    once it is accepted (``SourceResolver._check_id``)."""
    if binds is not None and served is not None:
        data = served["image_data"]["data"]
        if isinstance(data, CachedImage):
            data.binds = binds
        else:
            data.info[ID_INFO] = binds
    return served


def bindings(messages: list[dict[str, Any]]) -> list[tuple[bytes, bytes]]:
    """The id bindings the images of ``messages`` carry (``bound``). Only a pair of byte strings
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


# -- data URLs seen before: their bytes' key without base64-decoding them again --------------

CAPACITY = 4096  # entries
CAPACITY_BYTES = 2 << 20  # ~4,600 entries
# what an entry costs beyond its two digests (measured with tracemalloc, CPython 3.11: the
# OrderedDict entry, the two bytes objects, the ImageKey's attribute dict)
ENTRY_OVERHEAD_BYTES = 384


def _weigh(ident: bytes, key: ImageKey) -> int:
    return len(ident) + len(key) + ENTRY_OVERHEAD_BYTES


class DataUrlKeys(LruMap[bytes, ImageKey]):
    """Data URLs seen before: their bytes' key without base64-decoding them again.

    A chat client resends the same data URL every turn. Keying it means base64-decoding ~5 MB and
    hashing the bytes (1.5 ms on the CPU machine, 5 ms on the H200 host under a running engine; issue
    16). ``DataUrlKeys`` remembers, per data URL text (its digest, with the item's per-image
    parameters and the request's decode options), the ``ImageKey`` its bytes gave: a repeat is keyed
    by hashing the text alone.

    Invariant: an entry maps a data URL's exact text, parameters and decode options to the key those
    give; decoding is deterministic, so the entry never goes stale (an evicted image's key simply
    misses in the cache, and the caller decodes). An entry is one digest of all three, keyed BLAKE3
    under a random key of this map's own (it never leaves the process): a client can neither predict
    it nor craft two data URLs that share an entry (issue 26), and no entry holds a client's text,
    so every entry weighs the same however large the options or the URL (issue 39: the options' text
    held in each entry made 240 URLs with 1 MiB of options 241 MiB). Bounded (LRU) by entries and by
    bytes (``capacity_bytes``, each entry weighed with what a dict entry costs), thread-safe
    (lmdeploy resolves requests on its executor's threads)."""

    def __init__(self, capacity: int = CAPACITY, capacity_bytes: int = CAPACITY_BYTES) -> None:
        super().__init__(capacity, capacity_bytes, _weigh)
        self._secret = os.urandom(32)

    def ident(self, url: str, params: dict[str, Any], io: dict[str, Any]) -> bytes | None:
        """What identifies a data URL item: one 32-byte digest of its text, its per-image
        parameters and the request's decode options (None where those are not plain JSON: not
        remembered). ``io``: an ``ImageOptions`` brings its JSON text, made once per request."""
        try:
            item = json.dumps(params, sort_keys=True, allow_nan=False)
            options = io.text if isinstance(io, ImageOptions) else json.dumps(
                io, sort_keys=True, allow_nan=False)
        except (TypeError, ValueError, RecursionError):
            return None
        digest = blake3.blake3(key=self._secret, max_threads=blake3.blake3.AUTO)
        # framed (each part after its length): no two different items give one stream
        for part in (item.encode("utf-8", "surrogatepass"), options.encode("utf-8", "surrogatepass"),
                     url.encode("utf-8", "surrogatepass")):  # (JSON text may hold lone surrogates)
            digest.update(struct.pack("<Q", len(part)))
            digest.update(part)
        return digest.digest()
