"""The frontend hook for lmdeploy's processor-level preprocessing API.

Qwen3-VL, Qwen3.5 and the other families lmdeploy 0.18 added lately preprocess a request with
``preprocess(messages, input_prompt, mm_processor_kwargs)`` (``VisionModel.preprocess`` in
``lmdeploy/vl/model/base.py``): one call of the checkpoint's HF processor tokenizes the rendered
prompt, runs the image processor over every image and expands each image's placeholder to its
token count; ``get_expanded_mm_items`` then splits the bundle into one dict per image
(``modality, pixel_values, image_grid_thw, offset, image_token_id``). There is no per-image call
to skip, so ``ProcessorFrontend`` makes that output itself when any image hits:

- every image is keyed (as the legacy frontend keys it, ``Frontend._lookup``), with the request's
  image size override (``mm_processor_kwargs["image"]``'s ``min_pixels``/``max_pixels``, checked
  here: ints, or the request is refused) in its key where it changes the pixels;
- a hit's expansion (its ``image_grid_thw``, so its token count) comes from its entry's metadata;
- the image processor runs on the misses only, with the keyword arguments the processor's own
  call would give it (``_merge_kwargs``), their pixels cast as lmdeploy casts them;
- the placeholders are expanded with the processor's own ``replace_image_token`` over every
  image's grid, by its own ``get_text_with_replacements``, and tokenized by its tokenizer with
  its text arguments; a prompt of token ids (lmdeploy's ``/generate``) is expanded by lmdeploy's
  own ``get_expanded_input_ids``; offsets by lmdeploy's ``get_mm_items_offset``.

Invariant: the output equals lmdeploy's own for the same request (input ids, offsets, every
per-image field; tests/test_lmdeploy_newapi.py checks it against lmdeploy's real preprocessing
for requests mixing hits and misses). Where this is not shown (a processor outside
``EXPANDING``, a request with videos, audio or time series) lmdeploy's own preprocessing runs for
the whole request and featcache only tags its images: hits then skip the vision model but not
preprocessing (counted, ``preprocess_not_skipped``). Any failure falls back to lmdeploy's own
preprocessing (``Frontend.__call__``: counted, never a failed request). With ``tags`` (several
processes) every request takes that path: each image travels with its pixels and a ``FeatTag``,
and the model processes skip the vision model for the images they hold (``ranks``).
"""

from __future__ import annotations

from typing import Any

import torch

from .entry_meta import encode_item
from .frontend import Frontend
from .media import MediaOptionError
from .messages import decoded, image_items
from .refs import REF_KEY, FeatRef
from .resolve import SECTION
from .tags import FeatTag

# HF processors whose placeholder expansion is a function of each image's ``image_grid_thw``
# alone (``replace_image_token``), shown equal to lmdeploy's output by the tests
EXPANDING = ("Qwen2VLProcessor", "Qwen3VLProcessor")
MAX_PIXELS = 1 << 40  # a size override past this is no image size


class ProcessorFrontend(Frontend):
    """``__call__`` is the vision model's new-API ``preprocess`` (module docstring)."""

    def __init__(self, vision_model: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.model = vision_model
        self.expands = _expands(getattr(vision_model, "processor", None))

    def _preprocess(self, messages: list[dict[str, Any]], input_prompt: Any = None,
                    mm_processor_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
        items = image_items(messages)
        if not items:  # no image, or another modality among them: lmdeploy's own, untouched
            return self.original(decoded(messages), input_prompt, mm_processor_kwargs)
        size = image_size(self.model.processor.image_processor, mm_processor_kwargs)
        keys, hits = self._lookup(items, None if size is None else {"processor_size": size})
        if self.tags or not hits or not self.expands:
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
            meta = _meta(item, self.namespace)
            if self.sent is not None:  # several processes: tagged, sent with its pixels
                item[REF_KEY] = FeatTag(key, meta)
                self.sent.put(key, meta)
            else:
                item[REF_KEY] = FeatRef(self.cache, key, meta, None)

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
        merged = processor._merge_kwargs(tokenizer_init_kwargs=processor.tokenizer.init_kwargs, **call)
        missed = [i for i in range(len(items)) if i not in hits]
        grids: list[torch.Tensor] = [hit["image_grid_thw"] for hit in hits.values()]
        grid_of = dict(zip(hits, grids, strict=True))
        pixels: list[torch.Tensor] = []
        if missed:
            out = processor.image_processor([items[i][2]["data"] for i in missed],
                                            **merged["images_kwargs"])
            bundle = model._postprocess_mm_output(out["pixel_values"], model.mm_feature_dtype)
            rows = [int(g.prod()) for g in out["image_grid_thw"]]
            if sum(rows) != bundle.shape[0]:
                raise RuntimeError(f"the image processor made {bundle.shape[0]} rows for grids of {rows}")
            pixels = [bundle] if len(missed) == 1 else [p.clone() for p in bundle.split(rows)]
            grid_of.update(zip(missed, out["image_grid_thw"], strict=True))
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
                item[REF_KEY] = FeatRef(self.cache, key, _meta(item, self.namespace), None)
            multimodal.append(item)
        return dict(input_ids=input_ids.tolist(), multimodal=multimodal)


def image_size(image_processor: Any, mm_processor_kwargs: Any) -> dict[str, int] | None:
    """The image size a request's ``mm_processor_kwargs`` asks of the processor, where it differs
    from the processor's own (lmdeploy's ``get_override_size``); None where it does not.
    ``MediaOptionError`` (the client's request: answered 400) for options that are not a JSON
    object, or pixel bounds that are not ints from 1 to ``MAX_PIXELS``."""
    if mm_processor_kwargs is None:
        return None
    if not isinstance(mm_processor_kwargs, dict):
        raise MediaOptionError("mm_processor_kwargs must be an object")
    options = mm_processor_kwargs.get("image")
    if not options:
        return None
    if not isinstance(options, dict):
        raise MediaOptionError("mm_processor_kwargs.image must be an object")
    for name in ("min_pixels", "max_pixels"):
        value = options.get(name)
        if value is not None and (type(value) is not int or not 0 < value <= MAX_PIXELS):
            raise MediaOptionError(f"mm_processor_kwargs.image.{name} must be an integer from 1 to "
                                   f"{MAX_PIXELS}, not {value!r:.40}")
    from lmdeploy.vl.model.preprocess_utils import get_override_size

    size = get_override_size(image_processor, options, modality="image")
    if size is None:
        return None
    own = getattr(image_processor, "size", None)
    try:
        same = (size["shortest_edge"] == own["shortest_edge"]
                and size["longest_edge"] == own["longest_edge"])
    except (KeyError, TypeError):
        same = False
    return None if same else {k: int(v) for k, v in size.items()}


def _expands(processor: Any) -> bool:
    """Whether ``ProcessorFrontend._expand`` reproduces ``processor``'s call: one of
    ``EXPANDING``, its expansion and text replacement its own, unchanged."""
    if processor is None:
        return False
    names = {k.__name__ for k in type(processor).__mro__}
    return (bool(names & set(EXPANDING)) and hasattr(processor, "get_text_with_replacements")
            and hasattr(processor, "_merge_kwargs"))


def _is_image(item: dict[str, Any]) -> bool:
    modality = item.get("modality")
    return getattr(modality, "value", modality) == "image"


def _meta(item: dict[str, Any], namespace: str) -> bytes:
    """An image's entry metadata: its per-image dict without what is the request's (its offset)
    or a constant (its modality), with its token count (``image_tokens``: what ``featcache ls``
    shows; not a field of lmdeploy's dict, never put in one)."""
    start, end = item["offset"]
    fields = {k: v for k, v in item.items() if k not in ("offset", "modality", REF_KEY)}
    return encode_item({**fields, "image_tokens": int(end) - int(start)}, namespace)
