"""The model hook: serve cached features inside lmdeploy's PyTorch model forward.

lmdeploy 0.18 runs the vision tower inside the model's forward, over the images of every sequence
in the step concatenated into one call, then ``masked_scatter``s the result into the token
embeddings in image order. For each supported class we wrap, at class level:

- ``prepare_inputs_for_generation``: images whose ``MultiModalData.meta`` holds a hit ``FeatRef``
  are taken out of the step's vision inputs (they carry no pixels), so lmdeploy's own prepare
  builds the vision call for the misses only. The step's plan (each image in order: hit or miss,
  and its token count) is left for the vision wrapper. When every image hit, the forward still
  has to reach the vision call, so the spec's placeholder arguments are filled in.
- the vision call (a method or submodule named by the spec, wrapped per instance on first use):
  runs the real vision model on the misses, splits its output per image (by token count), puts
  each miss's features in the cache (on the engine's stream: no host copy), and returns the
  features of every image in order: hits from their leases, misses from the output. Each miss is
  put with its share of the vision call's time (``visioncost``: what a later hit saves, for value
  eviction). A hit whose head is already in the KV cache (a prefix match ending inside it, see
  ``prefix``) contributes only its tail rows, a view of the leased features.

In the multi-process mode the meta slot holds a ``FeatTag`` instead (key and metadata; pixels, or
the encoded image to rebuild them from): ``prepare`` resolves the step's tags against this
process's own cache, with the ranks' agreement (``ranks.resolve``), into step-local ``FeatRef``s,
rebuilds the pixels of a miss that came without them (``rebuild``), and the rest is the same; a
miss that a prefix match ends inside (``skip`` > 0) is computed whole and sliced.

Classes whose instances never see a ``FeatRef`` or ``FeatTag`` behave exactly as before. Invariant: the vision
model runs only on images that missed; the returned features have exactly one row per image token.
"""

from __future__ import annotations

import importlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from . import ranks
from .frontend import SECTION
from .prefix import SKIP_KEY
from .refs import REF_KEY, FeatRef
from .tags import FeatTag
from .visioncost import VisionClock

log = logging.getLogger("featcache")


def _empty(device: torch.device) -> torch.Tensor:
    return torch.empty(0, device=device)


@dataclass(frozen=True)
class ArchSpec:
    """Where one architecture's vision call lives and what its forward needs to reach it."""

    module: str  # lmdeploy.pytorch.models.<module>
    cls: str  # the top-level model class
    vision: str  # the vision call: a method name or a submodule attribute
    submodule: bool  # True: ``vision`` names an nn.Module attribute; False: a method
    placeholders: dict[str, Callable[[torch.device], Any]]  # forward kwargs when every image hit


SPECS: dict[str, ArchSpec] = {
    "InternVLChatModel": ArchSpec(
        "internvl", "InternVLChatModel", "extract_feature", False, {"pixel_values": _empty}),
    "InternVLForConditionalGeneration": ArchSpec(
        "internvl3_hf", "InternVLForConditionalGeneration", "get_image_features", False,
        {"pixel_values": _empty}),
    "Qwen2VLForConditionalGeneration": ArchSpec(
        "qwen2_vl", "Qwen2VLForConditionalGeneration", "visual", True,
        {"pixel_values": _empty, "vis_cu_seqlens": _empty,
         "vis_pos_emb": lambda d: (_empty(d), _empty(d))}),
    "Qwen2_5_VLForConditionalGeneration": ArchSpec(
        "qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration", "visual", True,
        {"pixel_values": _empty, "vis_cu_seqlens": _empty, "vis_pos_emb": _empty,
         "window_index": _empty, "cu_window_seqlens": _empty}),
}


@dataclass
class _Plan:
    refs: list[FeatRef | None]  # one per image of the step, in token order
    tokens: list[int]  # image tokens of each in this step
    # rows of each before this step (in the KV cache already): 0 but for a held image that a
    # prefix match ends inside; empty: all 0
    skips: list[int] = field(default_factory=list)


_step = threading.local()  # the plan of the step being run on this thread (the engine loop)


def patch_model_class(spec: ArchSpec) -> type:
    """Wrap ``prepare_inputs_for_generation`` of the spec's class (idempotent)."""
    cls = getattr(importlib.import_module(f"lmdeploy.pytorch.models.{spec.module}"), spec.cls)
    cls = getattr(cls, "__wrapped__", cls)
    original = cls.prepare_inputs_for_generation
    if getattr(original, "_featcache", False):
        return cls

    def prepare_inputs_for_generation(self: Any, past_key_values: Any, inputs_embeds: Any = None,
                                      context: Any = None) -> dict[str, Any]:
        _step.plan = None
        images = _step_images(context)
        refs = _step_refs(images, self)
        if not any(refs):
            return original(self, past_key_values, inputs_embeds, context)
        _ensure_vision_wrapper(self, spec)
        hit = [r is not None and r.hit for r in refs]
        saved = context.input_multimodals
        if any(hit):
            served = {id(d) for d, h in zip(images, hit, strict=True) if h}
            kept = [{**mm, "image": [d for d in mm.get("image", []) if id(d) not in served]}
                    if mm else mm for mm in saved]
            context.input_multimodals = None if all(hit) else kept
        try:
            inputs = original(self, past_key_values, inputs_embeds, context)
        finally:
            context.input_multimodals = saved
        if all(hit):
            device = context.input_ids.device
            for name, make in spec.placeholders.items():
                inputs[name] = make(device)
            inputs["image_mask"] = context.input_ids == images[0].meta["image_token_id"]
        _step.plan = _Plan(refs, [d.end - d.start for d in images],
                           [(d.meta or {}).get(SKIP_KEY, 0) for d in images])
        return inputs

    prepare_inputs_for_generation._featcache = True  # type: ignore[attr-defined]
    prepare_inputs_for_generation.__wrapped__ = original  # type: ignore[attr-defined]
    cls.prepare_inputs_for_generation = prepare_inputs_for_generation
    return cls


def _step_images(context: Any) -> list[Any]:
    mms = getattr(context, "input_multimodals", None) if context is not None else None
    if not mms:
        return []
    return [d for mm in mms if mm for d in (mm.get("image") or [])]


def _step_refs(images: list[Any], model: Any = None) -> list[FeatRef | None]:
    """One ref per image of the step: the frontend's ``FeatRef`` (one process), or, for a
    ``FeatTag`` (several processes), a ref resolved by this process's cache and the ranks'
    agreement (``ranks.resolve``: a collective whenever the step holds a tag). A tagged image
    sent without pixels that is not served from the caches gets them rebuilt from its source
    (``rebuild``; ``model``: the model, for its input processor). Anything else in the meta slot
    is an image featcache does not know (None)."""
    found = [(d.meta or {}).get(REF_KEY) for d in images]
    tagged = [i for i, x in enumerate(found) if isinstance(x, FeatTag)]
    refs: list[FeatRef | None] = [x if isinstance(x, FeatRef) else None for x in found]
    if tagged:
        tags: list[FeatTag] = [x for x in found if isinstance(x, FeatTag)]
        pixels = [_has_pixels(images[i]) for i in tagged]
        resolved = ranks.resolve(tags, pixels)
        for i, tag, ref, has in zip(tagged, tags, resolved, pixels, strict=True):
            refs[i] = ref
            if not has and (ref is None or not ref.hit):
                _rebuild(images[i], tag, model)
    return refs


def _rebuild(data: Any, tag: FeatTag, model: Any) -> None:
    """Fill the pixels of an image the frontend sent without them (its features are computed)."""
    from . import rebuild

    placeholder = getattr(data, "data", None)
    device = placeholder.device if isinstance(placeholder, torch.Tensor) else torch.device("cpu")
    data.data = rebuild.pixels(tag, model, ranks.rebuild_settings(), device)
    cache = ranks.local_cache()
    if cache is not None:
        cache.count(SECTION, "pixels_rebuilt")


def _has_pixels(data: Any) -> bool:
    pixels = getattr(data, "data", None)
    return isinstance(pixels, torch.Tensor) and pixels.numel() > 0


def _ensure_vision_wrapper(model: Any, spec: ArchSpec) -> None:
    owner = getattr(model, spec.vision) if spec.submodule else model
    attr = "forward" if spec.submodule else spec.vision
    current = getattr(owner, attr)
    if getattr(current, "_featcache", False):
        return
    clock = VisionClock()  # this model's vision time per image token

    def vision(*args: Any, **kwargs: Any) -> torch.Tensor:
        plan = getattr(_step, "plan", None)
        _step.plan = None
        if plan is None:
            return current(*args, **kwargs)
        return _serve(plan, lambda: current(*args, **kwargs), clock)

    vision._featcache = True  # type: ignore[attr-defined]
    setattr(owner, attr, vision)


def _serve(plan: _Plan, run_vision: Callable[[], torch.Tensor],
           clock: VisionClock | None = None) -> torch.Tensor:
    """The features of every image of the step, in order, as [image tokens, hidden]; each miss is
    put with its cost (``clock``'s measure of the vision call; None: no cost recorded).

    An image with ``skip`` rows already in the KV cache contributes rows ``[skip:]``: from its
    cached features on a hit; on a miss (several processes: a held image some rank lacked) the
    vision model is given the whole image's pixels, its features are stored whole and sliced."""
    skips = plan.skips or [0] * len(plan.refs)
    misses = [(ref, skip + n) for ref, n, skip in zip(plan.refs, plan.tokens, skips, strict=True)
              if ref is None or not ref.hit]
    pieces: list[torch.Tensor] = []
    cache = next(ref.cache for ref in plan.refs if ref is not None)
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
    cache.count(SECTION, "vision_skipped", len(plan.refs) - len(misses))
    parts = []
    miss_pieces = iter(pieces)
    if any(skips):
        cache.count(SECTION, "partial_images", sum(1 for s in skips if s))
    for ref, n, skip in zip(plan.refs, plan.tokens, skips, strict=True):
        if ref is not None and ref.hit:
            assert ref.lease is not None
            features = ref.lease.ready()
            parts.append(features.reshape(skip + n, -1)[skip:])
        else:
            parts.append(next(miss_pieces)[skip:])
    return parts[0] if len(parts) == 1 else torch.cat(parts)
