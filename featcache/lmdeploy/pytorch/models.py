"""The model hook: serve cached features inside lmdeploy's PyTorch model forward.

lmdeploy 0.18 runs the vision tower inside the model's forward, over the images of every sequence
in the step concatenated into one call, then ``masked_scatter``s the result into the token
embeddings in image order. For each supported class we wrap, at class level:

- ``prepare_inputs_for_generation``: images whose ``MultiModalData.meta`` holds a hit ``FeatRef``
  are taken out of the step's vision inputs (or, ``keep_items``, handed to it without pixels), so
  lmdeploy's own prepare builds the vision call for the misses only. The step's plan (each image in
  order: hit or miss, and its token count) is left for the vision wrapper. When every image hit,
  the forward still has to reach the vision call: the spec's placeholder arguments are filled in.
- the vision call (a method or submodule named by the spec, wrapped per instance on first use):
  runs the real vision model on the misses, splits its output per image (by token count), puts
  each miss's features in the cache (on the engine's stream: no host copy), and returns the
  features of every image in order: hits from their leases, misses from the output. Each miss is
  put with its share of the vision call's time (``visioncost``: what a later hit saves, for value
  eviction). A hit whose head is already in the KV cache (a prefix match ending inside it, see
  ``prefix``) contributes only its tail rows, a view of the leased features.

Several processes: the meta slot holds a ``FeatTag`` (key, metadata; pixels or the encoded image):
``prepare`` resolves the step's tags with this process's cache and the ranks' agreement
(``ranks.resolve``) into step-local ``FeatRef``s and rebuilds a miss's missing pixels (``rebuild``);
a miss that a prefix match ends inside (``skip`` > 0) is computed whole and sliced.

Concurrent misses of one image (many clients sending the same new image at once: every frontend
lookup misses until the engine has run it once) compute it once:

- one step: the misses of one key share the vision output of one of them (``_Plan.shares``; the
  others are taken out of the vision inputs like hits), in every process model;
- one process, steps after it: ``prepare`` looks up again each miss the frontend found missing;
  one stored since (by an earlier step: an engine's steps run one at a time on its loop's thread,
  each storing its misses before it returns) is served as a step-local hit, with no wait;
- one process, two engines sharing the cache (two threads): the step that is to compute a key
  claims it (``SingleFlight.lead``, one per cache); the other thread's step waits for that
  computation (``FLIGHT_WAIT_S`` at most), then is served from the cache. A step waits before it
  claims anything, so two steps never wait for each other; a leader that fails, ends before its
  vision call or does not finish in time leaves its waiters to compute the image themselves
  (counted ``vision_wait_failed``). The model processes of the multi-process mode never wait:
  their ranks must make the same vision calls (``ranks``).

Classes whose instances never see a ``FeatRef`` or ``FeatTag`` behave exactly as before. Invariant:
the vision model runs only on images that missed, on each key once a step; the returned features
have exactly one row per image token.
"""

from __future__ import annotations

import importlib
import logging
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ...core.cache import FeatureCache
from ...core.singleflight import Flight, SingleFlight
from ..families import DEEPSTACK, LIST, MAIN_ONLY, PER_IMAGE, SPECS, VISUAL, ArchSpec, modality_of
from ..request.frontend import SECTION
from ..request.refs import REF_KEY, FeatRef
from ..request.tags import FeatTag
from . import ranks
from .engine import ROWS_KEY
from .prefix import SKIP_KEY
from .visioncost import VisionClock

__all__ = ["SPECS", "ArchSpec", "patch_model_class"]  # (SPECS: the declarations, ``families``)
log = logging.getLogger("featcache")

FLIGHT_WAIT_S = 10.0  # the longest a step waits for another thread's computation of its image


@dataclass
class _Plan:
    refs: list[FeatRef | None]  # one per image of the step, in token order
    tokens: list[int]  # feature rows of each in this step
    # rows of each before this step (in the KV cache already): 0 but for a held image that a
    # prefix match ends inside; empty: all 0
    skips: list[int] = field(default_factory=list)
    # per image, the image of this step whose vision output it takes (a miss of the same key,
    # computed once for both), or None; empty: none
    shares: list[int | None] = field(default_factory=list)
    # the computations this step claimed (``_join``), ended once its misses are stored (``_land``)
    flights: list[tuple[SingleFlight[None], bytes, Flight[None]]] = field(default_factory=list)


_step = threading.local()  # the plan of the step being run on this thread (the engine loop)
_flights_lock = threading.Lock()
# per cache: the keys a step of this process is computing (one process: several engines may share
# a cache)
_flights: weakref.WeakKeyDictionary[FeatureCache, SingleFlight[None]] = weakref.WeakKeyDictionary()


def patch_model_class(spec: ArchSpec) -> type:
    """Wrap ``prepare_inputs_for_generation`` of the spec's class (idempotent). The wrapper goes
    on the class that defines it (several classes of a lineage share one: Qwen3-VL-MoE inherits
    Qwen3-VL's, Qwen3.5-MoE and MetaMoe Qwen3.5's), so every class that runs it is covered; the
    declarations of classes that share a ``prepare`` differ only in ``module`` and ``cls``."""
    cls = getattr(importlib.import_module(f"lmdeploy.pytorch.models.{spec.module}"), spec.cls)
    cls = getattr(cls, "__wrapped__", cls)
    cls = next(k for k in cls.__mro__ if "prepare_inputs_for_generation" in k.__dict__)
    original = cls.prepare_inputs_for_generation
    if getattr(original, "_featcache", False):
        return cls

    def prepare_inputs_for_generation(self: Any, past_key_values: Any, inputs_embeds: Any = None,
                                      context: Any = None) -> dict[str, Any]:
        stale = getattr(_step, "plan", None)
        if stale is not None:  # the last step of this thread ended before its vision call
            _land(stale)
        _step.plan = None
        items = _step_items(context, spec.items)
        images = _visual(items, spec.items)
        refs = _step_refs(images)
        if not any(refs):  # (a tagged image without pixels, where this process has no cache)
            _rebuild_misses(images, refs, [None] * len(refs), self)
            return original(self, past_key_values, inputs_embeds, context)
        _ensure_vision_wrapper(self, spec)
        skips = [(d.meta or {}).get(SKIP_KEY, 0) for d in images]
        tokens = [(d.meta or {}).get(ROWS_KEY, d.end - d.start) for d in images]
        rows = [skip + n for n, skip in zip(tokens, skips, strict=True)]
        plan = _Plan(refs, tokens, skips)
        plan.flights = _join(images, refs, rows)
        try:
            plan.shares = _shares(images, refs, rows)
            _rebuild_misses(images, refs, plan.shares, self)
            hit = [r is not None and r.hit for r in refs]
            taken = [h or s is not None for h, s in zip(hit, plan.shares, strict=True)]
            saved = context.input_multimodals
            emptied = [(d, d.data) for d, t in zip(images, taken, strict=True) if t and spec.keep_items]
            if any(taken) and not spec.keep_items:
                served = {id(d) for d, t in zip(images, taken, strict=True) if t}
                kept = [{**mm, spec.items: [d for d in mm.get(spec.items, []) if id(d) not in served]}
                        if mm else mm for mm in saved]
                left = any(v for mm in kept if mm for v in mm.values())
                context.input_multimodals = kept if left else None
            try:
                for d, data in emptied:  # (``keep_items``: handed to lmdeploy's prepare, no pixels)
                    d.data = data[:0]
                inputs = original(self, past_key_values, inputs_embeds, context)
            finally:
                context.input_multimodals = saved
                for d, data in emptied:
                    d.data = data
            if emptied:
                _cut_to_computed(inputs, spec.keep_items, taken)
        except BaseException:
            _land(plan)
            raise
        if all(hit) and not spec.keep_items:
            device = context.input_ids.device
            for name, make in spec.placeholders.items():
                inputs[name] = make(device, images)
            if spec.step_inputs is None:
                inputs["image_mask"] = context.input_ids == images[0].meta["image_token_id"]
        if spec.step_inputs is not None and any(taken):
            spec.step_inputs(self, _vision_module(self, spec), context, items, plan.tokens, inputs)
        _step.plan = plan
        return inputs

    prepare_inputs_for_generation._featcache = True  # type: ignore[attr-defined]
    prepare_inputs_for_generation.__wrapped__ = original  # type: ignore[attr-defined]
    cls.prepare_inputs_for_generation = prepare_inputs_for_generation
    return cls


def _cut_to_computed(inputs: dict[str, Any], names: tuple[str, ...], taken: list[bool]) -> None:
    """``keep_items``: each of ``names`` (a row per visual item of the step, as lmdeploy's prepare
    made it) keeps the rows of the items the vision call computes."""
    for name in names:
        value = inputs.get(name)
        if not isinstance(value, torch.Tensor) or value.shape[0] != len(taken):
            raise RuntimeError(f"featcache: the forward input {name!r} has not a row per image")
        inputs[name] = value[torch.tensor([not t for t in taken], device=value.device)]


def _step_items(context: Any, key: str) -> list[Any]:
    """Every ``MultiModalData`` of the step under ``key``, sequence by sequence."""
    mms = getattr(context, "input_multimodals", None) if context is not None else None
    if not mms:
        return []
    return [d for mm in mms if mm for d in (mm.get(key) or [])]


def _visual(items: list[Any], key: str) -> list[Any]:
    """Of the step's ``items`` (its ``key`` list), those its vision call takes, in that call's
    order: every item of an "image" list; the ``VISUAL`` items of an "mm_data" list (video frames
    among them: featcache keys none, so they are computed as lmdeploy computes them)."""
    return items if key == "image" else [d for d in items if modality_of(d) in VISUAL]


def _step_refs(images: list[Any]) -> list[FeatRef | None]:
    """One ref per image of the step: the frontend's ``FeatRef`` (one process), or, for a
    ``FeatTag`` (several processes), a ref resolved by this process's cache and the ranks'
    agreement (``ranks.resolve``: a collective whenever the step holds a tag). Anything else in
    the meta slot is an image featcache does not know (None)."""
    found = [(d.meta or {}).get(REF_KEY) for d in images]
    tagged = [i for i, x in enumerate(found) if isinstance(x, FeatTag)]
    refs: list[FeatRef | None] = [x if isinstance(x, FeatRef) else None for x in found]
    if tagged:
        tags: list[FeatTag] = [x for x in found if isinstance(x, FeatTag)]
        pixels = [_has_pixels(images[i]) for i in tagged]
        for i, ref in zip(tagged, ranks.resolve(tags, pixels), strict=True):
            refs[i] = ref
    return refs


def _rebuild_misses(images: list[Any], refs: list[FeatRef | None], shares: list[int | None],
                    model: Any) -> None:
    """A tagged image sent without pixels that the step computes (not served from the caches,
    nor sharing another image's vision output) gets them rebuilt from its source (``rebuild``;
    ``model``: the model, for its input processor)."""
    for data, ref, share in zip(images, refs, shares, strict=True):
        tag = (data.meta or {}).get(REF_KEY)
        if (isinstance(tag, FeatTag) and share is None and not _has_pixels(data)
                and (ref is None or not ref.hit)):
            _rebuild(data, tag, model)


def _shares(images: list[Any], refs: list[FeatRef | None], rows: list[int]) -> list[int | None]:
    """Per image of the step, the image whose vision output it takes, or None: of the misses of
    one key (as many rows each), one is computed (the first with pixels, else the first) and the
    others share its features. Depends on the step's inputs only (every rank decides alike)."""
    groups: dict[bytes, list[int]] = {}
    for i, ref in enumerate(refs):
        if ref is not None and not ref.hit:
            groups.setdefault(ref.key, []).append(i)
    shares: list[int | None] = [None] * len(refs)
    for members in groups.values():
        if len(members) > 1:
            first = next((i for i in members if _has_pixels(images[i])), members[0])
            for i in members:
                if i != first and rows[i] == rows[first]:
                    shares[i] = first
    return shares


def _join(images: list[Any], refs: list[FeatRef | None],
          rows: list[int]) -> list[tuple[SingleFlight[None], bytes, Flight[None]]]:
    """One process: the step's misses that the frontend found missing (a ``FeatRef`` in the meta
    slot) and that were stored since (by an earlier step, or another engine's on another thread)
    become step-local hits in ``refs``. A miss another thread is computing now is waited for
    first (``FLIGHT_WAIT_S`` at most, holding no flight meanwhile), then looked up again. The
    keys this step is left to compute are claimed, and their flights returned (``_land`` ends
    them). Tagged images (several processes) are left as ``ranks.resolve`` agreed them."""
    missing: dict[bytes, list[int]] = {}
    for i, (data, ref) in enumerate(zip(images, refs, strict=True)):
        if (ref is not None and not ref.hit
                and isinstance((data.meta or {}).get(REF_KEY), FeatRef)):
            missing.setdefault(ref.key, []).append(i)
    if not missing:
        return []
    cache = next(refs[i] for i in next(iter(missing.values()))).cache  # type: ignore[union-attr]
    with _flights_lock:
        flights = _flights.setdefault(cache, SingleFlight())
    _served_now(cache, missing, refs, rows)
    waits: dict[bytes, Flight[None]] = {}
    me = threading.get_ident()
    for key in missing:
        flight = flights.running(key)
        if flight is not None and flight.owner == me:
            flights.finish(key, flight)  # this thread's own, left by a step that is over
        elif flight is not None:
            waits[key] = flight
    if waits:
        _wait_for(list(waits.values()), FLIGHT_WAIT_S)
        for key, flight in waits.items():
            if not flight.done.is_set():
                flights.forget(key, flight)  # no later step waits for it again
            cache.count(SECTION, "vision_waits", len(missing[key]))
        _served_now(cache, missing, refs, rows)
        for key in waits.keys() & missing.keys():  # the leader failed, hung or kept nothing
            cache.count(SECTION, "vision_wait_failed", len(missing[key]))
    claimed = []
    for key in missing:
        flight = flights.lead(key)
        if flight is not None:  # (None: another thread claimed it meanwhile: computed here too)
            claimed.append((flights, key, flight))
    return claimed


def _served_now(cache: FeatureCache, missing: dict[bytes, list[int]],
                refs: list[FeatRef | None], rows: list[int]) -> None:
    """Each key of ``missing`` that the cache holds now (locally: no network read on the engine
    thread) becomes a step-local hit for its images (their requests' own refs record that they
    cost no vision time) and leaves ``missing``."""
    for key in list(missing):
        lease = None
        try:
            if key in cache:
                lease = cache.acquire(key)
        except Exception:
            log.debug("featcache: lookup failed; a miss", exc_info=True)
        if lease is None:
            continue
        size = lease.tensor.numel()
        if size == 0 or any(size % rows[i] for i in missing[key]):
            lease.release()  # not features of this image's shape: computed (and replaced)
            continue
        ref = FeatRef(cache, key, lease.meta, lease)
        joined = missing.pop(key)
        for i in joined:
            original = refs[i]
            assert original is not None
            if original.cost_s is None:  # (a step of its own may have computed it before)
                original.cost_s = 0.0
            refs[i] = ref
        cache.count(SECTION, "vision_joined", len(joined))


def _wait_for(flights: list[Flight[None]], timeout_s: float) -> None:
    """Wait until every one of ``flights`` has ended, ``timeout_s`` in all at most."""
    deadline = time.monotonic() + timeout_s
    for flight in flights:
        flight.done.wait(max(0.0, deadline - time.monotonic()))


def _land(plan: _Plan) -> None:
    """End the computations ``plan`` claimed (stored, failed, or never run): their waiters look
    the keys up again."""
    flights, plan.flights = plan.flights, []
    for owner, key, flight in flights:
        owner.finish(key, flight)


def _rebuild(data: Any, tag: FeatTag, model: Any) -> None:
    """Fill the pixels of an image the frontend sent without them (its features are computed)."""
    from . import rebuild

    placeholder = getattr(data, "data", None)
    device = placeholder.device if isinstance(placeholder, torch.Tensor) else torch.device("cpu")
    cache = ranks.local_cache()
    data.data = rebuild.pixels(tag, model, ranks.rebuild_settings(), device, cache)
    if cache is not None:
        cache.count(SECTION, "pixels_rebuilt")


def _has_pixels(data: Any) -> bool:
    return isinstance(getattr(data, "data", None), torch.Tensor) and data.data.numel() > 0


def _vision_module(model: Any, spec: ArchSpec) -> Any:
    """The object that owns the vision call: the submodule at ``spec.vision``'s dotted path, or
    the model itself for a method."""
    if not spec.submodule:
        return model
    owner = model
    for name in spec.vision.split("."):
        owner = getattr(owner, name)
    return owner


def _ensure_vision_wrapper(model: Any, spec: ArchSpec) -> None:
    owner = _vision_module(model, spec)
    attr = "forward" if spec.submodule else spec.vision
    current = getattr(owner, attr)
    if getattr(current, "_featcache", False):
        return
    clock = VisionClock()  # this model's vision time per image token

    def vision(*args: Any, **kwargs: Any) -> Any:
        plan = getattr(_step, "plan", None)
        _step.plan = None
        if plan is None:
            return current(*args, **kwargs)
        if spec.output == DEEPSTACK:  # one entry: the main rows and every level's, side by side
            levels = 1 + len(owner.deepstack_merger_list)

            def run() -> torch.Tensor:
                main, deep = current(*args, **kwargs)
                if len(deep) + 1 != levels:
                    raise RuntimeError(f"featcache: the vision model returned {len(deep)} deepstack "
                                       f"levels, its declaration {levels - 1}")
                return torch.cat([main, *deep], dim=-1)

            served = _serve(plan, run, clock)
            parts = [p.contiguous() for p in served.chunk(levels, dim=-1)]
            return parts[0], parts[1:]
        if spec.output == LIST:  # a tensor per computed image in, one per image of the step out
            return [*_serve(plan, lambda: torch.cat([*current(*args, **kwargs)]), clock).split(plan.tokens)]
        if spec.output == MAIN_ONLY:
            return _serve(plan, lambda: current(*args, **kwargs)[0], clock), []
        served = _serve(plan, lambda: current(*args, **kwargs), clock)  # (PER_IMAGE: as many rows each)
        return served.reshape(len(plan.refs), -1, served.shape[-1]) if spec.output == PER_IMAGE else served

    vision._featcache = True  # type: ignore[attr-defined]
    setattr(owner, attr, vision)


def _serve(plan: _Plan, run_vision: Callable[[], torch.Tensor],
           clock: VisionClock | None = None) -> torch.Tensor:
    """The features of every image of the step, in order, as [image tokens, hidden]; each miss is
    put with its cost (``clock``'s measure of the vision call; None: no cost recorded).

    An image with ``skip`` rows already in the KV cache contributes rows ``[skip:]``: from its
    cached features on a hit; on a miss (several processes: a held image some rank lacked) the
    vision model is given the whole image's pixels, its features are stored whole and sliced.
    An image that shares another's vision output (``plan.shares``) takes that image's rows; the
    keys the step claimed are released once its misses are stored, or its vision call failed."""
    skips = plan.skips or [0] * len(plan.refs)
    shares = plan.shares or [None] * len(plan.refs)
    computed = [i for i, ref in enumerate(plan.refs)
                if (ref is None or not ref.hit) and shares[i] is None]
    misses = [(plan.refs[i], skips[i] + plan.tokens[i]) for i in computed]
    pieces: list[torch.Tensor] = []
    cache = next(ref.cache for ref in plan.refs if ref is not None)
    try:
        if misses:
            sizes = [n for _, n in misses]
            costs: list[float | None] = [None] * len(misses)
            if clock is None:
                out = run_vision()
            else:
                out, costs = clock.run(run_vision, sizes)
            flat = out.reshape(-1, out.shape[-1])
            if sum(sizes) != flat.shape[0]:
                raise RuntimeError(
                    f"featcache: the vision model returned {flat.shape[0]} feature rows for images "
                    f"of {sizes} tokens; this model's output does not split per image")
            pieces = list(flat.split(sizes))
            for (ref, _), piece, cost in zip(misses, pieces, costs, strict=True):
                if ref is not None:
                    ref.cost_s = cost  # what this request's report says its miss cost
                    ref.cache.put(ref.key, piece, meta=ref.meta, cost_s=cost)
            cache.count(SECTION, "vision_images", len(misses))
            cache.count(SECTION, "vision_calls")
    finally:
        _land(plan)  # stored (or failed): whoever waits for these keys looks them up again
    cache.count(SECTION, "vision_skipped", len(plan.refs) - len(misses))
    shared = [i for i, s in enumerate(shares) if s is not None]
    if shared:
        cache.count(SECTION, "vision_shared", len(shared))
    parts = []
    piece_of = dict(zip(computed, pieces, strict=True))
    if any(skips):
        cache.count(SECTION, "partial_images", sum(1 for s in skips if s))
    for i, (ref, n, skip) in enumerate(zip(plan.refs, plan.tokens, skips, strict=True)):
        if ref is not None and ref.hit:
            assert ref.lease is not None
            features = ref.lease.ready()
            parts.append(features.reshape(skip + n, -1)[skip:])
        else:
            share = shares[i]
            if share is not None and ref is not None and ref.cost_s is None:
                ref.cost_s = 0.0  # computed once, for the image it shares with
            parts.append(piece_of[i if share is None else share][skip:])
    return parts[0] if len(parts) == 1 else torch.cat(parts)
