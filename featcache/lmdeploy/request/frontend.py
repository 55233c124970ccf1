"""The frontend hook: keys images before preprocessing, and skips preprocessing for hits.

Installed on the instance ``VisionModel.preprocess(messages)`` of lmdeploy's ``ImageEncoder``
(it runs on the encoder's worker thread, off the engine loop); a model with lmdeploy's
processor-level ``preprocess(messages, input_prompt, mm_processor_kwargs)`` gets
``ProcessorFrontend`` (below), this class with that API's output. For each image of a request:

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
import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch

from ...core.cache import FeatureCache
from ...eviction.lrumap import LruMap
from ...keys import KeyHasher
from ..families import reproduces_expansion
from ..fastprep import FastPreprocess, PatchMaker, processor_patch_maker, processor_patches
from .entry_meta import decode_item, encode_item, processor_item_meta
from .media import LOCAL_FILES, MediaPolicy, image_size
from .media import MediaOptionError as MediaOptionError  # (its home: media; named here too)
from .messages import decoded, image_items, preprocessed, without
from .refs import REF_KEY, FeatRef
from .resolve import SECTION, SourceResolver, bindings
from .sources import KEY_INFO, CachedImage, install_sources
from .tags import FeatTag, sourced
from .urlkeys import DataUrlKeys

log = logging.getLogger("featcache")
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


def _keyed_by_bytes(item: dict[str, Any]) -> bool:
    """Whether the item's image was decoded by ``Frontend._served`` after its bytes' key missed."""
    info = getattr(item["data"], "info", None)
    return isinstance(info, dict) and isinstance(info.get(KEY_INFO), bytes)


# -- lmdeploy's processor-level preprocessing API ---------------------------------------------

class ProcessorFrontend(Frontend):
    """The frontend hook for lmdeploy's processor-level preprocessing API (``__call__`` is the
    vision model's new-API ``preprocess``).

    Qwen3-VL, Qwen3.5 and the other families lmdeploy 0.18 added lately preprocess a request with
    ``preprocess(messages, input_prompt, mm_processor_kwargs)`` (``VisionModel.preprocess`` in
    ``lmdeploy/vl/model/base.py``): one call of the checkpoint's HF processor tokenizes the rendered
    prompt, runs the image processor over every image and expands each image's placeholder to its
    token count; ``get_expanded_mm_items`` then splits the bundle into one dict per image
    (``modality, pixel_values, image_grid_thw, offset, image_token_id``). There is no per-image call
    to skip, so ``ProcessorFrontend`` makes that output itself when any image hits:

    - every image is keyed (as the legacy frontend keys it, ``Frontend._lookup``), with the request's
      image size override (``mm_processor_kwargs["image"]``'s ``min_pixels``/``max_pixels``, checked
      by ``media.image_size``: ints, or the request is refused) in its key where it changes the
      pixels;
    - a hit's expansion (its ``image_grid_thw``, so its token count) comes from its entry's metadata;
    - the misses' pixels are made by featcache's ``PatchMaker`` where it reproduces the image
      processor (``fastprep.processor_patch_maker``, probed; plain RGB images; ``preprocess_fast``;
      then a request with no hit takes this path too), else by the image processor with the
      arguments its own call would give it (``preprocess_fallback``), cast as lmdeploy casts them;
    - the placeholders are expanded with the processor's own ``replace_image_token`` over every
      image's grid, by its own ``get_text_with_replacements``, and tokenized by its tokenizer with
      its text arguments; a prompt of token ids (lmdeploy's ``/generate``) is expanded by lmdeploy's
      own ``get_expanded_input_ids``; offsets by lmdeploy's ``get_mm_items_offset``.

    Invariant: the output equals lmdeploy's own for the same request (input ids, offsets, every
    per-image field; tests/test_lmdeploy_newapi.py checks it against lmdeploy's real preprocessing
    for requests mixing hits and misses). Where this is not shown (a processor outside
    ``families.EXPANDING``, a request with videos, audio or time series) lmdeploy's own preprocessing runs for
    the whole request and featcache only tags its images: hits then skip the vision model but not
    preprocessing (counted, ``preprocess_not_skipped``). Any failure falls back to lmdeploy's own
    preprocessing (``Frontend.__call__``: counted, never a failed request). With ``tags`` (several
    processes) every request takes that path: each image travels with its pixels and a ``FeatTag``,
    and the model processes skip the vision model for the images they hold (``ranks``).
    """

    def __init__(self, vision_model: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.model = vision_model
        processor = getattr(vision_model, "processor", None)
        self.expands = reproduces_expansion(processor, vision_model)
        # featcache's exact preprocessing of misses (``fastprep.processor_patch_maker``), or None
        self.maker: PatchMaker | None = None
        if self.expands and not self.tags:
            self.maker, why = processor_patch_maker(processor.image_processor)
            log.info("featcache: preprocessing of new images: %s",
                     f"featcache's, {why}" if self.maker is not None else f"lmdeploy's ({why})")

    def _preprocess(self, messages: list[dict[str, Any]], input_prompt: Any = None,
                    mm_processor_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
        items = image_items(messages)
        if not items:  # no image, or another modality among them: lmdeploy's own, untouched
            return self.original(decoded(messages), input_prompt, mm_processor_kwargs)
        size = image_size(self.model.processor.image_processor, mm_processor_kwargs)
        keys, hits = self._lookup(items, None if size is None else {"processor_size": size})
        if self.tags or not self.expands or (not hits and self.maker is None):
            if not self.tags:  # lmdeploy's image processor makes the misses' pixels
                self.cache.count(SECTION, "preprocess_fallback", len(items) - len(hits))
            if hits and not self.tags:
                self.cache.count(SECTION, "preprocess_not_skipped", len(hits))
            out = self.original(decoded(messages), input_prompt, mm_processor_kwargs)
            self._tag(out, keys, hits)
            return out
        return self._expand(items, keys, hits, input_prompt, size)

    def _tag(self, out: dict[str, Any], keys: list[bytes | None],
             hits: dict[int, dict[str, Any]]) -> None:
        """lmdeploy's output for the whole request: each image's dict gets its ``FeatRef`` (a
        hit's, holding its lease; a miss's, for the model to store its features) or ``FeatTag``."""
        images = [m for m in out["multimodal"] if _is_image(m)]
        if len(images) != len(keys):
            raise RuntimeError(f"preprocess returned {len(images)} images for {len(keys)}")
        for index, (item, key) in enumerate(zip(images, keys, strict=True)):
            if key is None:
                continue
            hit = hits.get(index)
            if hit is not None and not self.tags:
                item[REF_KEY] = hit[REF_KEY]
                continue
            # (several processes: it goes with its pixels)
            item[REF_KEY] = self._miss_ref(key, processor_item_meta(item, self.namespace))

    def _expand(self, items: list[tuple[int, int, dict[str, Any]]], keys: list[bytes | None],
                hits: dict[int, dict[str, Any]], input_prompt: Any,
                size: dict[str, int] | None) -> dict[str, Any]:
        """The request's output, the processor run on its misses only (module docstring)."""
        from lmdeploy.vl.constants import Modality
        from lmdeploy.vl.model.preprocess_utils import get_expanded_input_ids, get_mm_items_offset

        model = self.model
        processor = model.processor
        call: dict[str, Any] = {"padding": True, "return_tensors": "pt"}
        if size is not None:
            call["images_kwargs"] = {"size": size}
        merged = processor._merge_kwargs(_kwargs_class(processor),
                                         tokenizer_init_kwargs=processor.tokenizer.init_kwargs, **call)
        missed = [i for i in range(len(items)) if i not in hits]
        grids: list[torch.Tensor] = [hit["image_grid_thw"] for hit in hits.values()]
        grid_of = dict(zip(hits, grids, strict=True))
        pixels: list[torch.Tensor] = []
        if missed:
            images = [items[i][2]["data"] for i in missed]
            made = None if self.maker is None else processor_patches(self.maker, images, size)
            if made is None:
                self.cache.count(SECTION, "preprocess_fallback", len(missed))
                out = processor.image_processor(images, **merged["images_kwargs"])
                values, thw = out["pixel_values"], out["image_grid_thw"]
            else:
                self.cache.count(SECTION, "preprocess_fast", len(missed))
                values, thw = made
            bundle = model._postprocess_mm_output(values, model.mm_feature_dtype)
            rows = [int(g.prod()) for g in thw]
            if sum(rows) != bundle.shape[0]:
                raise RuntimeError(f"the image processor made {bundle.shape[0]} rows for grids of {rows}")
            pixels = [bundle] if len(missed) == 1 else [p.clone() for p in bundle.split(rows)]
            grid_of.update(zip(missed, thw, strict=True))
        every = torch.stack([torch.as_tensor(grid_of[i]) for i in range(len(items))])
        token_id = model.mm_tokens.image_token_id
        if isinstance(input_prompt, str):
            replacements = [processor.replace_image_token({"image_grid_thw": every}, image_idx=i)
                            for i in range(len(items))]
            text, _ = processor.get_text_with_replacements([input_prompt], replacements)
            text_kwargs = dict(merged["text_kwargs"])
            for name in ("return_mm_token_type_ids", "return_text_replacement_offsets"):
                text_kwargs.pop(name, None)
            input_ids = processor.tokenizer(text, **text_kwargs)["input_ids"].flatten()
        else:  # token ids (lmdeploy's /generate): each placeholder id expanded
            collected = {Modality.IMAGE: {"image_grid_thw": every}}
            input_ids = get_expanded_input_ids(input_prompt, collected, processor, model.mm_tokens)
        offsets = get_mm_items_offset(input_ids=input_ids, mm_token_id=token_id)
        if len(offsets) != len(items):
            raise RuntimeError(f"the prompt holds {len(offsets)} image spans for {len(items)} images")
        multimodal = []
        miss_pixels = dict(zip(missed, pixels, strict=True))
        for i, offset in enumerate(offsets):
            hit = hits.get(i)
            item = dict(modality=Modality.IMAGE,
                        pixel_values=hit["pixel_values"] if hit is not None else miss_pixels[i],
                        image_grid_thw=every[i], offset=offset, image_token_id=token_id)
            key = keys[i]
            if hit is not None:
                item[REF_KEY] = hit[REF_KEY]
            elif key is not None:
                item[REF_KEY] = self._miss_ref(key, processor_item_meta(item, self.namespace))
            multimodal.append(item)
        return dict(input_ids=input_ids.tolist(), multimodal=multimodal)


def _kwargs_class(processor: Any) -> Any:
    """The kwargs class (its defaults) the processor's call hands ``_merge_kwargs``: 5.24's
    ``valid_processor_kwargs``, else its module's ``<Name>Kwargs`` (5.17 requires it)."""
    found = getattr(processor, "valid_processor_kwargs", None)
    if found is not None:
        return found
    for k in type(processor).__mro__:
        named = getattr(sys.modules.get(k.__module__), f"{k.__name__}Kwargs", None)
        if named is not None:
            return named
    return None


def _is_image(item: dict[str, Any]) -> bool:
    modality = item.get("modality")
    return getattr(modality, "value", modality) == "image"
