"""The engine hooks: carry each image's key into the engine, and keep prefix caching on.

- ``KeyedInputProcessor`` wraps the engine's input processor (``Engine.input_processor``): after
  lmdeploy builds its ``MultiModalData`` per image, the image's ``FeatRef`` goes into ``meta`` (for
  the model hook) and its featcache key, as hex, into ``content_hash``. With prefix caching on,
  lmdeploy then skips its sha256 over the pixels (``ensure_multimodal_content_hashes`` fills only
  missing hashes), and the block trie tells images apart by their content keys: two different
  images never share KV, a repeated image reuses it.
- ``keep_prefix_caching`` undoes ``VLAsyncEngine``'s switch-off of prefix caching for the models
  featcache keys (it sets ``enable_prefix_caching = False`` before building the engine).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch

from ...codec import MAX_META_BYTES
from ...entrymeta import with_cost
from ..request.refs import REF_KEY
from ..request.tags import FeatTag

log = logging.getLogger("featcache")


ROWS_KEY = "featcache_rows"  # MultiModalData.meta: the image's feature rows (``token_rows``)


class KeyedInputProcessor:
    """Delegates to lmdeploy's input processor, then tags its MultiModalData with featcache keys.
    ``items``: the key of the processor's ``MultiModalData`` list ("image", or the Qwen3 lineage's
    "mm_data", one per item of any modality, in the request's order: ``families.ArchSpec``;
    None: whichever of the two the processor made). ``token_rows`` (``ArchSpec.token_rows``):
    each image's feature rows, the count of its ``image_token_id`` in its span, go in its meta
    (``ROWS_KEY``) for the model hook."""

    def __init__(self, inner: Any, items: str | None = None, token_rows: bool = False) -> None:
        self.inner = inner
        self.items = items
        self.token_rows = token_rows

    def preprocess_input(self, input_ids: Any, input_multimodals: Any = None, **kwargs: Any) -> Any:
        result = self.inner.preprocess_input(input_ids, input_multimodals, **kwargs)
        if not input_multimodals or not hasattr(result, "input_multimodals"):
            return result
        made = result.input_multimodals or {}
        key = self.items or ("mm_data" if "mm_data" in made else "image")
        images = made.get(key, [])
        if len(images) != len(input_multimodals):
            return result  # not one MultiModalData per item: leave the request to lmdeploy alone
        if self.token_rows:
            ids = torch.as_tensor(result.input_ids)
            for data in images:
                rows = int((ids[data.start:data.end] == data.meta["image_token_id"]).sum())
                data.meta = dict(data.meta, **{ROWS_KEY: rows})
        for source, data in zip(input_multimodals, images, strict=True):
            ref = source.get(REF_KEY)
            if ref is None:
                continue
            data.meta = dict(data.meta or {}, **{REF_KEY: ref})
            data.content_hash = "featcache:" + ref.key.hex()
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def unservable(input_multimodals: Any) -> str | None:
    """Why a request's images cannot all be served, or None: an image (the multi-process mode)
    whose tag's metadata the model process could not store its features with (``meta_problem``),
    or sent without pixels with a damaged tag or a source that could not rebuild it
    (``rebuild.problem``). The frontend never sends one (an image travels without pixels only
    after it was decoded and preprocessed from the same bytes, options and parameters, all in its
    key); a damaged store or processes of other versions might. Every image is checked: this
    keeps a damaged one from reaching a model process's step, where it would fail every request
    of the step, or stop the engine."""
    from .rebuild import problem

    for item in input_multimodals or ():
        tag = item.get(REF_KEY) if isinstance(item, dict) else None
        if not isinstance(tag, FeatTag):
            continue
        why = meta_problem(tag.meta) if tag.valid else None
        if why is not None:
            return f"featcache: an image came with a damaged tag: {why}"
        pixels = item.get("pixel_values", item.get("pixel_values_videos"))  # (an image's; a video item's)
        if isinstance(pixels, torch.Tensor) and pixels.numel() > 0:
            continue  # computed from its pixels if need be
        if not tag.valid:
            return "featcache: an image came without pixels and with a damaged tag"
        if tag.source is None:
            return "featcache: an image came without pixels or the bytes to rebuild them"
        why = problem(tag.source)
        if why is not None:
            return f"featcache: an image sent without pixels cannot be rebuilt: {why}"
    return None


COST_ROOM = 32  # bytes a recorded cost may take past that of 0.0 (a float's repr: 24 at most)


def meta_problem(meta: bytes) -> str | None:
    """Why a model process could not store an image's features with ``meta``, or None: the
    model step puts them with their cost (``FeatureCache.put(..., cost_s=)``), recorded in the
    metadata, which must then be empty or a JSON object and stay within ``MAX_META_BYTES`` (what
    the frontend sends is ~200 bytes of ``entry_meta``'s JSON). Reads no more than the cap."""
    if len(meta) > MAX_META_BYTES - COST_ROOM:
        return f"its metadata is over {MAX_META_BYTES - COST_ROOM} bytes"
    try:
        stored = with_cost(meta, 0.0)
    except (ValueError, RecursionError):  # (UnicodeDecodeError is a ValueError)
        return "its metadata is not a JSON object"
    if len(stored) > MAX_META_BYTES - COST_ROOM:  # (re-encoded: escapes may make it longer)
        return f"its metadata, the cost recorded, is over {MAX_META_BYTES - COST_ROOM} bytes"
    return None


@contextlib.contextmanager
def keep_prefix_caching(wanted: bool, supported: set[str]) -> Iterator[None]:
    """While building a pipeline, keep ``enable_prefix_caching`` as the caller asked for it, for
    the ``supported`` architectures (those featcache keys)."""
    from lmdeploy.serve.core.async_engine import AsyncEngine

    original = AsyncEngine.__init__

    def __init__(self: Any, *args: Any, backend_config: Any = None, **kwargs: Any) -> None:
        encoder = getattr(self, "vl_encoder", None)  # VLAsyncEngine sets it before this runs
        model = getattr(encoder, "model", None)
        arch = getattr(getattr(model, "hf_config", None), "architectures", [None])[0]
        if (wanted and arch in supported and backend_config is not None
                and not backend_config.enable_prefix_caching):
            backend_config.enable_prefix_caching = True
            log.info("featcache: prefix caching kept on (images are keyed by content)")
        original(self, *args, backend_config=backend_config, **kwargs)

    AsyncEngine.__init__ = __init__  # type: ignore[method-assign]
    try:
        yield
    finally:
        AsyncEngine.__init__ = original  # type: ignore[method-assign]
