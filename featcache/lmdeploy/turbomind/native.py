"""The TurboMind native path (the default): cached, engine-ready pixels served straight to TurboMind.

TurboMind runs the vision model of every VLM it accepts in C++. Python hands it, per image, CPU
``pixel_values``, the token span and a 32-byte ``fingerprint``; without a fingerprint lmdeploy
computes sha256 over the pixel bytes on every request (``turbomind/models/*.py``,
``_resolve_fingerprint``). TurboMind folds fingerprints into its prefix-cache keys and skips its
vision model when a prefix hit covers an image's whole span.

The native path (``install_native_path`` on a pipeline, ``install_native`` on its vision model):
the cache holds each image's engine-ready pixel tensor (after lmdeploy's tiling, resize and
normalisation, in the dtype and layout lmdeploy hands TurboMind) in host memory, under a key of
its own (the model identity says "pixels").
On top of the frontend (``frontend.py``, which keys images before preprocessing and skips
lmdeploy's preprocessing for hits), each keyed image's per-image dict gets:

- on a hit, the cached pixel tensor (no preprocessing, no copy);
- on a miss, lmdeploy's pixels themselves, stored in the cache (no copy; demotion to disk is
  asynchronous). They stay in pageable memory: page-locking 15 MB of pixels took 8.7 ms on a
  fresh allocation on an H200 host (14.6 ms per miss with the copy, 2026-11-30,
  bench/results/HISTORY.md, "TurboMind speed at InternVL3-2B shape"), while TurboMind's upload
  of pageable pixels costs about 0.7 ms more than of pinned ones, once per request that uses them;
- in both cases ``fingerprint = fingerprint(key)``: a function of the featcache key alone, so the
  same image carries the same fingerprint in every process and after restarts, and lmdeploy's
  sha256 over the pixels never runs for keyed images.

The features path (opt-in, InternVL-HF) lives in ``features``; ``turbomind`` picks the path.

Invariants: TurboMind tensors come from a cache whose device tier is the host (``cpu``); a hit's
lease is held by its per-image dict (a ``FeatRef``) until lmdeploy drops the request's
multimodal data; any failure inside featcache falls back to lmdeploy's plain preprocessing of the
request (counted as ``frontend_errors``), never to wrong pixels.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from typing import Any

import torch

from ...core.cache import FeatureCache
from ..families import SPECS
from ..request.entry_meta import encode_item, processor_item_meta
from ..request.frontend import SECTION, Frontend, install_frontend
from ..request.identity import model_identity
from ..request.messages import decoded, preprocessed
from ..request.refs import REF_KEY, FeatRef
from .common import check_host_cache, engine_vision_dtype

log = logging.getLogger("featcache")

_PERSON = b"featcache-tm-fp1"  # blake2b personalisation (16 bytes): fingerprints are ours alone
# lmdeploy VisionModels whose TurboMind inputs the native path serves (either preprocess API):
# the declarations that say so (``families``)
NATIVE_ARCHS = tuple(arch for arch, spec in SPECS.items() if spec.turbomind)

Preprocess = Callable[[list[dict[str, Any]]], list[dict[str, Any]]]


def fingerprint(key: bytes) -> bytes:
    """The 32-byte TurboMind fingerprint of a featcache key: equal keys give equal fingerprints in
    any process; different keys give different ones (blake2b-256 of the key, personalised)."""
    return hashlib.blake2b(key, digest_size=32, person=_PERSON).digest()


def install_native_path(pipe: Any, cache: FeatureCache, arch: str, namespace: str | None) -> None:
    """The native path on a TurboMind pipeline (through ``wrap``); architectures it does not
    serve pass through untouched, with one log line."""
    engine = pipe.async_engine
    encoder = engine.vl_encoder
    if arch not in NATIVE_ARCHS:
        log.warning("featcache: architecture %s is not cached on TurboMind; it passes through", arch)
        return
    check_host_cache(cache)
    dtype = engine_vision_dtype(getattr(engine, "engine", None))
    namespace = namespace or pixels_namespace(encoder, arch, dtype)
    install_native(encoder.model, cache, namespace, engine.prompt_processor, dtype)
    pipe.featcache = cache
    log.info("featcache: caching %s pixels for TurboMind (namespace %s)", arch, namespace)


def pixels_namespace(encoder: Any, arch: str, vision_dtype: torch.dtype | None) -> str:
    """The model identity the native path keys pixels under (``encoder``: lmdeploy's
    ``ImageEncoder``; ``vision_dtype``: TurboMind's, ``engine_vision_dtype``). ``featcache warm``
    computes it too, without an engine: the two must agree for a warmed store to be hit."""
    return model_identity(encoder.model.model_path, arch, vision_dtype or encoder.mm_feature_dtype,
                          extra={"turbomind": "pixels"})


def install_native(vision_model: Any, cache: FeatureCache, namespace: str,
                   prompt_processor: Any = None, vision_dtype: torch.dtype | None = None) -> None:
    """The frontend, plus ``NativePixels`` over its output, on ``vision_model.preprocess``.

    ``vision_dtype``: the dtype TurboMind's vision model takes; floating pixels are stored in it
    (lmdeploy would cast them on every request; Qwen2-VL's come as float32). Part of the namespace.
    """
    check_host_cache(cache)
    install_frontend(vision_model, cache, namespace, prompt_processor)
    keyed: Preprocess = vision_model.preprocess
    frontend: Frontend = keyed.frontend  # type: ignore[attr-defined]
    vision_model.preprocess = NativePixels(cache, keyed, frontend, vision_dtype)


class NativePixels:
    """Fills each keyed image's per-image dict with its pixels (cached or stored) and fingerprint.
    Installed as ``VisionModel.preprocess`` (marked ``_featcache``, as the frontend's hook is)."""

    _featcache = True

    def __init__(self, cache: FeatureCache, keyed: Preprocess, frontend: Frontend,
                 vision_dtype: torch.dtype | None = None) -> None:
        self.cache = cache
        self.keyed = keyed
        self.frontend = frontend
        self.vision_dtype = vision_dtype

    def __call__(self, messages: list[dict[str, Any]], *args: Any) -> Any:
        """lmdeploy's ``preprocess``: ``args``, the processor-level API's prompt and options (its
        output a dict whose ``multimodal`` holds the per-image dicts; the legacy API's, messages)."""
        out = self.keyed(list(messages), *args)  # a copy: the fallback needs the caller's messages
        try:
            processor_level = isinstance(out, dict)
            for item in out["multimodal"] if processor_level else preprocessed(out):
                ref = item.get(REF_KEY)
                if isinstance(ref, FeatRef):
                    self._serve(item, ref, processor_level)
        except Exception:
            self.frontend._failed("serving cached pixels failed; preprocessing without the cache")
            return self.frontend.original(decoded(messages), *args)
        return out

    def _serve(self, item: dict[str, Any], ref: FeatRef, processor_level: bool = False) -> None:
        count = self.cache.count
        if ref.hit:
            assert ref.lease is not None
            pixels, record = ref.lease.tensor, item["pixel_values"]
            if (pixels.device.type != "cpu" or pixels.dtype != record.dtype
                    or pixels.shape[1:] != record.shape[1:]):
                raise RuntimeError(f"cached pixels {tuple(pixels.shape)} {pixels.dtype} on "
                                   f"{pixels.device} do not match their record")
            item["pixel_values"] = pixels
            count(SECTION, "tm_pixels_served")
        else:
            pixels = item["pixel_values"]
            meta = ref.meta
            dtype = self.vision_dtype or pixels.dtype
            if pixels.is_floating_point() and pixels.dtype != dtype:  # as to_tm_tensor would
                pixels = pixels.to(dtype)
                record = processor_item_meta if processor_level else encode_item
                meta = record({**item, "pixel_values": pixels}, self.frontend.namespace)
            # 2026-11-30: a copy into page-locked memory here cost 14.6 ms per miss (8.7 ms of it
            # allocating), to save ~0.7 ms of upload per use: the pixels are kept as they are.
            self.cache.put(ref.key, pixels, meta=meta)
            item["pixel_values"] = pixels
            count(SECTION, "tm_pixels_stored")
        item["fingerprint"] = fingerprint(ref.key)
