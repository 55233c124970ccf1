"""The combined TurboMind configuration (``turbomind="combined"``, InternVL): TurboMind's prefix reuse
on chat turns *and* featcache's vision-model skip on fresh contexts, chosen per request.

No single TurboMind request can have both (lmdeploy 0.18 keeps requests with ``input_embeddings``
out of its prefix cache, in C++: docs/turbomind.md), so each request is routed to the native path
or to the features path by ``route.decide``, from what featcache sent TurboMind before. What
``install_combined`` puts on lmdeploy's vision model:

- ``preprocess``: the native path's stages (``native.install_native``, its namespace, so a
  store the native path filled serves here too): the frontend keys each image and skips
  lmdeploy's preprocessing on a hit; ``NativePixels`` serves the cached engine-ready pixels or
  stores lmdeploy's, and gives every keyed image its fingerprint. Every request leaves it with
  every image's full pixels, whichever route it takes next;
- ``forward`` (``CombinedServer.forward``, on the encoder's worker thread, where lmdeploy runs a
  features-path vision model): routes the request, books it (``route.RouteBook``); on the
  features route, serves each image's features from the cache (under ``features_key``, derived
  from its pixel key) or runs the vision tower over its pixels and stores them (``FeatureServer``);
- ``to_turbomind``: packs the request as the native path does (lmdeploy's ``to_pytorch``:
  ``input_ids`` + per-image pixels and fingerprints, which TurboMind prefix-caches) or as the
  features path does (``to_turbomind_aux``: ``input_ids`` + ``input_embeddings``), by its route;
- ``_turbomind_native_vision = False``, so that lmdeploy calls ``forward`` and ``to_turbomind``
  for every image request (it reads the flag per request: ``serve/processors/multimodal.py``,
  ``vl/engine.py::wrap_for_turbomind``).

Invariants: a request routed native carries exactly what the native path sends (every image's
full pixels and fingerprint), so TurboMind computes any image its prefix cache no longer covers;
a request routed features carries every image's features. A failure while routing or computing
features sends the request native (counted ``tm_route_errors``), never a wrong or missing input.
Outputs: native-routed requests are plain TurboMind's; features-routed requests are the features
path's (close to plain TurboMind's, not token-identical: docs/turbomind.md).
"""

from __future__ import annotations

import hashlib
import logging
import traceback
from typing import Any

from ...core.cache import FeatureCache
from ...keys import ImageKey
from ..request.entry_meta import encode_item
from ..request.frontend import SECTION
from ..request.messages import preprocessed
from ..request.refs import REF_KEY, FeatRef
from .common import check_host_cache, engine_vision_dtype
from .features import FeatureServer, check_features_arch, features_tower, install_server
from .native import install_native, pixels_namespace
from .route import FEATURES, NATIVE, Route, RouteBook, context_digests, decide

log = logging.getLogger("featcache")

ROUTE_FIELD = "featcache_route"  # on the "forward" entry of a request's messages: its path
HELD_FIELD = "featcache_held"  # ... and the leases of the cached features it is served
_PERSON = b"featcache-tm-ft1"  # blake2b personalisation of features keys (16 bytes)


def features_key(pixel_key: bytes, namespace: str) -> ImageKey:
    """The key of an image's features, from the key of its pixels (the native path's): a function
    of both alone, so every process derives the same one; it is as unpredictable as the pixel key
    (a keyed digest under the store's secret). ``namespace``: the features' model identity."""
    h = hashlib.blake2b(digest_size=32, person=_PERSON)
    name = namespace.encode()
    h.update(len(name).to_bytes(4, "little") + name + bytes(pixel_key))
    return ImageKey(h.digest(), namespace)


def install_combined(pipe: Any, cache: FeatureCache, arch: str, namespace: str | None) -> None:
    """The combined configuration on a TurboMind pipeline (through ``wrap``); raises
    ``ValueError`` for an architecture the features path cannot serve (it needs both paths).
    ``namespace``: the pixels' (the features' is ``namespace + ":features"``); None: the native
    and features paths' own."""
    check_features_arch(arch)
    check_host_cache(cache)
    engine = pipe.async_engine
    encoder = engine.vl_encoder
    vision_dtype = engine_vision_dtype(getattr(engine, "engine", None))
    tower, dtype, features_ns = features_tower(encoder, arch, engine.backend_config, vision_dtype)
    pixels_ns = namespace or pixels_namespace(encoder, arch, vision_dtype)
    if namespace:
        features_ns = f"{namespace}:features"
    install_native(encoder.model, cache, pixels_ns, engine.prompt_processor, vision_dtype)
    CombinedServer(cache, FeatureServer(cache, tower, dtype), features_ns).install(encoder.model)
    pipe.featcache = cache
    log.info("featcache: combined TurboMind paths for %s (pixels %s, features %s)", arch,
             pixels_ns, features_ns)


class CombinedServer:
    """lmdeploy's ``VisionModel.forward`` / ``to_turbomind`` for the combined configuration.

    ``features``: the tower, its dtype and its checks (a ``FeatureServer``); ``namespace``: the
    features' (salts the contexts too); ``book``: where the routed contexts are remembered."""

    def __init__(self, cache: FeatureCache, features: FeatureServer, namespace: str,
                 book: RouteBook | None = None) -> None:
        self.cache = cache
        self.features = features
        self.namespace = namespace
        self.book = book if book is not None else RouteBook()
        self.force: str | None = None  # every request along this path (``featcache warm``)
        self._logged = False

    def install(self, vision_model: Any) -> None:
        """Instance attributes shadowing lmdeploy's (the vision model's ``preprocess`` must be the
        native path's already: ``install_native``)."""
        install_server(vision_model, self)

    def forward(self, messages: list[dict[str, Any]], max_batch_size: int = 1) -> list[dict[str, Any]]:
        """Route the request and append ``{'role': 'forward', 'content': FEATURES OR None,
        ROUTE_FIELD: PATH, HELD_FIELD: [leases]}``: on the features route, each image's features
        (a host tensor [image tokens, hidden] in the engine dtype), in order."""
        held: dict[int, FeatRef] = {}
        digests: list[bytes | None] = []
        content = None
        try:
            items = preprocessed(messages)
            refs = [item.get(REF_KEY) for item in items]
            keys = [ref.key if isinstance(ref, FeatRef) else None for ref in refs]
            if not keys or None in keys:  # an image featcache does not key (or passed through)
                route = Route(NATIVE, "unkeyed")
            else:
                digests = context_digests(messages, keys, self.namespace)
                route = decide(digests, self.book, lambda: self._seen(refs, held))
            if self.force is not None and route.reason != "unkeyed":
                route = Route(self.force, "forced")
            if route.path == FEATURES:
                content = self._features(items, held, max_batch_size)
        except Exception:
            self._failed()
            route, content = Route(NATIVE, "errors"), None
        self.book.record(digests, route.path)
        self.cache.count(SECTION, f"tm_route_{route.path}")
        self.cache.count(SECTION, f"tm_route_{route.reason}")
        if route.path == NATIVE:
            held.clear()  # (leases of features this request does not use)
        messages.append({"role": "forward", "content": content, ROUTE_FIELD: route.path,
                         HELD_FIELD: list(held.values())})
        return messages

    def _seen(self, refs: list[Any], held: dict[int, FeatRef]) -> list[bool]:
        """Per image (each keyed): whether its pixels or features are cached; the features found
        are leased into ``held`` (image index -> ``FeatRef``), pinned until the request is sent."""
        seen = []
        for i, ref in enumerate(refs):
            key = features_key(ref.key, self.namespace)
            lease = self.cache.acquire(key) if key in self.cache else None
            if lease is not None:
                held[i] = FeatRef(self.cache, key, lease.meta, lease)
            seen.append(ref.hit or lease is not None)
        return seen

    def _features(self, items: list[dict[str, Any]], held: dict[int, FeatRef],
                  max_batch_size: int) -> list[Any]:
        """Every image's features: the held ones served as cached, the others computed from
        their pixels by the tower (in batches of ``max_batch_size``) and stored."""
        out: list[Any] = [None] * len(items)
        missing = []
        for i, item in enumerate(items):
            ref = held.get(i)
            if ref is not None and ref.lease is not None:
                out[i] = self.features.checked(ref.lease.tensor, item)
            else:
                missing.append(i)
        self.cache.count(SECTION, "tm_features_served", len(items) - len(missing))
        step = max(1, max_batch_size)
        for start in range(0, len(missing), step):
            chunk = missing[start:start + step]
            for i, host in zip(chunk, self.features.run([items[i] for i in chunk]), strict=True):
                item = items[i]
                meta = encode_item({k: v for k, v in item.items() if k != "fingerprint"},
                                   self.namespace)
                self.cache.put(features_key(item[REF_KEY].key, self.namespace), host, meta=meta)
                out[i] = host
        self.cache.count(SECTION, "tm_features_stored", len(missing))
        return out

    def _failed(self) -> None:
        self.cache.count(SECTION, "frontend_errors")
        if not self._logged:
            self._logged = True
            log.error("featcache: routing a TurboMind request failed; it goes the native way "
                      "(logged once)\n%s", traceback.format_exc())

    def to_turbomind(self, vision_model: Any, messages: list[dict[str, Any]], chat_template: Any,
                     tokenizer: Any, tools: Any = None, chat_template_kwargs: Any = None
                     ) -> dict[str, Any]:
        """The request as its route sends it: the native path's packing (what lmdeploy's
        ``wrap_for_turbomind`` does for a native-vision model: ``to_pytorch``, or
        ``to_pytorch_with_input_ids`` for a request given as token ids) or the features path's."""
        route = [m.get(ROUTE_FIELD) for m in messages if m.get("role") == "forward"]
        if route != [FEATURES]:
            if vision_model.has_input_ids(messages):
                native: dict[str, Any] = vision_model.to_pytorch_with_input_ids(messages)
                return native
            native = vision_model.to_pytorch(messages, chat_template, tokenizer, tools=tools,
                                             chat_template_kwargs=chat_template_kwargs)
            return native
        return self.features.to_turbomind(vision_model, messages, chat_template, tokenizer, tools,
                                          chat_template_kwargs)
