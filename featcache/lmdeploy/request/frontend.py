"""The frontend hook: keys images before preprocessing, and skips preprocessing for hits.

Installed on the instance ``VisionModel.preprocess(messages)`` of lmdeploy's ``ImageEncoder``
(it runs on the encoder's worker thread, off the engine loop); a model with lmdeploy's
processor-level ``preprocess(messages, input_prompt, mm_processor_kwargs)`` gets
``ProcessorFrontend`` (below: ``processor.ProcessorLevel`` over this class), with that API's
output. For each image of a request:

- key it (``image_key`` over the decoded image, the model identity and the image's parameters;
  images that came as data URLs or files are keyed by their encoded bytes before decoding, and
  their hits arrive already resolved by the frontend's other half, ``resolve.SourceResolver``:
  see ``resolve`` and ``sources``);
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
import logging
import traceback
from collections.abc import Callable
from typing import Any

from ...core.cache import FeatureCache
from ...eviction.lrumap import LruMap
from ...keys import KeyHasher
from ..fastprep import FastPreprocess
from .entry_meta import decode_item, encode_item
from .media import LOCAL_FILES, MediaPolicy
from .media import MediaOptionError as MediaOptionError  # (its home: media; named here too)
from .messages import decoded, image_items, preprocessed, without
from .processor import ProcessorLevel
from .refs import REF_KEY, FeatRef
from .resolve import SECTION, DataUrlKeys, SourceResolver, bindings
from .sources import KEY_INFO, CachedImage, install_sources
from .tags import FeatTag, pack_pixels, sourced

log = logging.getLogger("featcache")
SENT_IMAGES = 65536  # the images a tag-mode frontend remembers sending (metadata: ~100 bytes each)
RAW_MODES = ("RGB", "RGBA", "L")  # PIL modes whose tobytes() rebuild the image exactly (no palette)

Preprocess = Callable[[list[dict[str, Any]]], list[dict[str, Any]]]


def install_frontend(vision_model: Any, cache: FeatureCache, namespace: str,
                     prompt_processor: Any = None, *, tags: bool = False,
                     hasher: KeyHasher | None = None, pack: bool = False) -> None:
    """Replace ``vision_model.preprocess`` (an instance attribute shadowing the method) and, given
    lmdeploy's ``MultimodalProcessor``, resolve encoded image sources before it decodes them.
    ``tags``: tag every image for a model in another process, look nothing up (``FeatTag``).
    ``hasher``: how keys are made (default: ``cache.hasher``; with ``tags``, the model
    processes' store's, ``processes.settings_hasher``). ``pack``: the engine is in another
    process, its requests pickled to it: pixels travel as ``tags.Pixels``."""
    original: Preprocess = vision_model.preprocess
    if getattr(original, "_featcache", False):
        raise RuntimeError("featcache is already installed on this pipeline")
    if "mm_processor_kwargs" in inspect.signature(original).parameters:
        # lmdeploy's processor-level API: the prompt and every image in one processor call
        frontend: Frontend = ProcessorFrontend(vision_model, cache, original, namespace, tags=tags,
                                               hasher=hasher)

        @functools.wraps(original)
        def preprocess(messages: list[dict[str, Any]], input_prompt: Any = None,
                       mm_processor_kwargs: dict[str, Any] | None = None) -> Any:
            return frontend(messages, input_prompt, mm_processor_kwargs)
    else:
        # a miss is preprocessed by featcache where it reproduces lmdeploy exactly (``fastprep``)
        frontend = Frontend(cache, FastPreprocess(vision_model, original, cache), namespace,
                            tags=tags, hasher=hasher)

        @functools.wraps(original)
        def preprocess(messages: list[dict[str, Any]]) -> Any:  # type: ignore[misc]
            return frontend(messages)
    frontend.pack = pack
    if prompt_processor is not None:
        install_sources(prompt_processor, frontend)

    preprocess._featcache = True  # type: ignore[attr-defined]
    preprocess.frontend = frontend  # type: ignore[attr-defined]
    vision_model.preprocess = preprocess


class Frontend(SourceResolver):
    """The frontend hook (module docstring): ``__call__`` is the vision model's ``preprocess``;
    ``resolve_sources`` (``SourceResolver``) runs before it, in lmdeploy's multimodal processor."""

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
        self.videos = False  # whether videos are cached (``ProcessorLevel``: where it is shown exact)
        # the model's engine in another process, its requests pickled to it (lmdeploy's mp engine):
        # pixels travel as ``tags.Pixels``
        self.pack = False
        self._logged = False
        self._warned_at: float | None = None  # the last bad image's warning (``_bad_image``)

    def __call__(self, messages: list[dict[str, Any]], *args: Any) -> Any:
        """lmdeploy's ``preprocess``: ``args`` are what follows ``messages`` in its API (none for
        the legacy one; the prompt and the processor options for the new one, ``ProcessorFrontend``)."""
        binds = bindings(messages) if self.trust_image_ids == "verify" else []
        try:
            out = self._preprocess(messages, *args)
        except MediaOptionError:
            self.cache.count(SECTION, "options_refused")
            raise  # the client's options: answered 400, never preprocessed
        except Exception:
            trace = traceback.format_exc()
            try:
                out = self.original(decoded(messages), *args)
            except Exception:
                # lmdeploy's own preprocessing refuses the request too (Qwen2-VL's aspect ratio
                # over 200, say): the client's request, not featcache's failure; plain lmdeploy
                # fails it the same way
                self.cache.count(SECTION, "preprocess_refused")
                raise
            self._failed("frontend failed; preprocessing without the cache", trace)
        for key, content in binds:  # the request is accepted: its verified ids name its images
            self.id_contents.setdefault(key, content)
        if self.pack:
            pack_pixels(_per_image(out))
        return out

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
        return sourced(key, meta, image.tobytes(), layout, params)

    def _preprocess(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        items = image_items(messages)
        if items is None:  # a video or other modality: not ours, leave the request alone
            return self.original(decoded(messages))
        keys, hits = self._lookup(items)
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

    def _lookup(self, items: list[tuple[int, int, dict[str, Any]]], extra: dict[str, Any] | None = None
                ) -> tuple[list[bytes | None], dict[int, dict[str, Any]]]:
        """Each item's key (None: not cacheable) and the hits among them (item index -> the
        per-image dict rebuilt from its entry's metadata, its ``FeatRef`` holding the lease),
        counted. ``extra``: parameters of the request's that change every image's pixels
        (``ProcessorFrontend``'s processor size): its images are keyed by their decoded pixels, never by
        the encoded bytes their sources were keyed by (which did not know them)."""
        count = self.cache.count
        hits: dict[int, dict[str, Any]] = {}  # item index -> its per-image dict
        keys: list[bytes | None] = []
        for index, (_, _, item) in enumerate(items):
            if extra and isinstance(item["data"], CachedImage):
                item["data"] = item["data"].decode()
            if isinstance(item["data"], CachedImage):  # resolved from its bytes: a hit already
                ref = item["data"].ref
                keys.append(ref.key)
                hit = decode_item(ref.meta)
                hit[REF_KEY] = ref
                hits[index] = hit
                count(SECTION, "decode_skipped")
                continue
            key = self._key(item, extra)
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
            if _keyed_by_bytes(item) and not extra:  # looked up when its source was resolved
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
        return keys, hits

    def _key(self, item: dict[str, Any], extra: dict[str, Any] | None = None) -> bytes | None:
        if _keyed_by_bytes(item) and not extra:
            key: bytes = item["data"].info[KEY_INFO]  # keyed by its encoded bytes before decoding
            return key
        params = {k: v for k, v in item.items() if k not in ("type", "data")}
        if extra:
            params.update(extra)
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
            output[REF_KEY] = self._miss_ref(key, meta)

    def _miss_ref(self, key: bytes, meta: bytes) -> FeatRef | FeatTag:
        """What rides with an image the model computes: a ``FeatRef`` for the model to store its
        features under; several processes: a ``FeatTag``, remembered as sent (``sent``)."""
        if self.sent is None:
            return FeatRef(self.cache, key, meta, None)
        self.sent.put(key, meta)
        return FeatTag(key, meta)


def _per_image(out: Any) -> list[Any]:
    """The per-image dicts of a ``preprocess`` output: the legacy API's "preprocess" message, or
    the processor-level API's ``multimodal`` list."""
    return list(out.get("multimodal") or []) if isinstance(out, dict) else preprocessed(out)


def _keyed_by_bytes(item: dict[str, Any]) -> bool:
    """Whether the item's image was decoded by ``Frontend._served`` after its bytes' key missed."""
    info = getattr(item["data"], "info", None)
    return isinstance(info, dict) and isinstance(info.get(KEY_INFO), bytes)


class ProcessorFrontend(ProcessorLevel, Frontend):
    """The frontend of lmdeploy's processor-level API (``processor.ProcessorLevel``)."""
